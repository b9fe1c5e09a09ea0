#include "net/handshake.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <thread>

#include "common/coding.h"
#include "net/frame.h"
#include "net/socket.h"

namespace nonstop::net {
namespace {

struct SocketPair {
  UniqueFd a, b;
  SocketPair() {
    int fds[2];
    NONSTOP_CHECK_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
    a.Reset(fds[0]);
    b.Reset(fds[1]);
  }
};

Hello MakeHello(std::string token) {
  Hello h;
  h.kind = ConnectionKind::kData;
  h.generation = 4;
  h.worker_id = 3;
  h.job_token = std::move(token);
  return h;
}

TEST(HandshakeTest, AcceptsMatchingToken) {
  SocketPair p;
  Status client;
  std::thread t([&] {
    client = ClientHandshake(p.a.get(), MakeHello("secret"), DeadlineAfter(Millis(2000)), nullptr);
  });
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData,
                                         DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  EXPECT_TRUE(client.ok()) << client.ToString();
  EXPECT_EQ(server->worker_id, 3);
  EXPECT_EQ(server->generation, 4u);
}

TEST(HandshakeTest, WrongTokenIsRefusedOnBothSides) {
  SocketPair p;
  Status client;
  std::thread t([&] {
    client =
        ClientHandshake(p.a.get(), MakeHello("other-job"), DeadlineAfter(Millis(2000)), nullptr);
  });
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData,
                                         DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("job token mismatch"), std::string::npos);
  EXPECT_EQ(client.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(client.message().find("job token mismatch"), std::string::npos) << client.ToString();
}

TEST(HandshakeTest, NewerMajorVersionIsRefused) {
  SocketPair p;
  Hello h = MakeHello("secret");
  h.proto_major = kProtocolMajor + 1;
  std::thread t([&] { (void)ClientHandshake(p.a.get(), h, DeadlineAfter(Millis(2000)), nullptr); });
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData,
                                         DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("not supported"), std::string::npos);
}

TEST(HandshakeTest, GarbageOnThePortIsRefused) {
  SocketPair p;
  const char raw[] = "\x01\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00Z";
  std::string junk(raw, sizeof(raw) - 1);  // a frame whose checksum is wrong
  ASSERT_TRUE(
      SendAll(p.a.get(), std::as_bytes(std::span(junk)), DeadlineAfter(Millis(1000)), nullptr, "x")
          .ok());
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData,
                                         DeadlineAfter(Millis(2000)), nullptr);
  ASSERT_FALSE(server.ok());
}

TEST(HandshakeTest, NegativeWorkerIdIsRefused) {
  SocketPair p;
  Hello h = MakeHello("secret");
  h.worker_id = -1;
  Status client;
  std::thread t(
      [&] { client = ClientHandshake(p.a.get(), h, DeadlineAfter(Millis(2000)), nullptr); });
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData,
                                         DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("negative"), std::string::npos)
      << server.status().ToString();
  EXPECT_EQ(client.code(), StatusCode::kFailedPrecondition) << client.ToString();
}

TEST(HandshakeTest, CheckHelloComparesTheWholeToken) {
  Hello h = MakeHello("secret");
  EXPECT_TRUE(CheckHello(h, "secret", ConnectionKind::kData).ok());
  EXPECT_FALSE(CheckHello(h, "secret2", ConnectionKind::kData).ok());
  EXPECT_FALSE(CheckHello(h, "secre", ConnectionKind::kData).ok());
  EXPECT_FALSE(CheckHello(h, "", ConnectionKind::kData).ok());
  EXPECT_FALSE(CheckHello(h, "secret", ConnectionKind::kControl).ok());
}

std::string HeaderWithLength(uint32_t length) {
  std::string header;
  PutFixed32(&header, length);
  PutFixed16(&header, kFrameHello);
  PutFixed16(&header, 0);
  PutFixed32(&header, 0);
  return header;
}

void Send(int fd, std::string_view bytes) {
  ASSERT_TRUE(SendAll(fd, std::as_bytes(std::span(bytes.data(), bytes.size())),
                      DeadlineAfter(Millis(1000)), nullptr, "x")
                  .ok());
}

TEST(HelloAcceptorTest, HugeLengthIsRefusedAsSoonAsTheHeaderIsIn) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), "secret", ConnectionKind::kData);
  EXPECT_EQ(acceptor.Advance(), HelloAcceptor::State::kReading);  // nothing yet: no blocking
  Send(p.a.get(), HeaderWithLength(0xFFFFFFF0u));
  EXPECT_EQ(acceptor.Advance(), HelloAcceptor::State::kRefused);
  EXPECT_NE(acceptor.error().message().find("exceeds the limit"), std::string::npos)
      << acceptor.error().ToString();
  // The dialer is told why.
  Result<Frame> ack = ReadFrame(p.a.get(), DeadlineAfter(Millis(1000)), nullptr);
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  EXPECT_EQ(ack->payload[0], '\0');
}

TEST(HelloAcceptorTest, HelloArrivingByteByByteIsAccepted) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), "secret", ConnectionKind::kData);
  std::string bytes = EncodeFrame(kFrameHello, EncodeHello(MakeHello("secret")));
  for (size_t i = 0; i + 1 < bytes.size(); ++i) {
    Send(p.a.get(), bytes.substr(i, 1));
    ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kReading) << "byte " << i;
    EXPECT_EQ(acceptor.wanted_events(), POLLIN);
  }
  Send(p.a.get(), bytes.substr(bytes.size() - 1));
  ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kAccepted) << acceptor.error().ToString();
  EXPECT_EQ(acceptor.hello().worker_id, 3);
  EXPECT_EQ(acceptor.hello().generation, 4u);
  Result<Frame> ack = ReadFrame(p.a.get(), DeadlineAfter(Millis(1000)), nullptr);
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  EXPECT_EQ(ack->payload, std::string(1, '\1'));
}

TEST(HelloAcceptorTest, NeverReadsPastTheHello) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), "secret", ConnectionKind::kData);
  Send(p.a.get(), EncodeFrame(kFrameHello, EncodeHello(MakeHello("secret"))) + "NEXT");
  ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kAccepted) << acceptor.error().ToString();
  char rest[8] = {};
  ASSERT_EQ(::recv(p.b.get(), rest, sizeof(rest), 0), 4);
  EXPECT_EQ(std::string(rest, 4), "NEXT");
}

TEST(HelloAcceptorTest, CallersRuleCanRefuse) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), "secret", ConnectionKind::kData, [](const Hello& h) {
    return FailedPreconditionError("not today, worker " + std::to_string(h.worker_id));
  });
  Send(p.a.get(), EncodeFrame(kFrameHello, EncodeHello(MakeHello("secret"))));
  ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kRefused);
  EXPECT_EQ(acceptor.error().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(acceptor.error().message().find("not today, worker 3"), std::string::npos);
}

TEST(HelloAcceptorTest, PeerClosingMidHelloIsUnavailable) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), "secret", ConnectionKind::kData);
  Send(p.a.get(), HeaderWithLength(40));
  p.a.Reset();
  EXPECT_EQ(acceptor.Advance(), HelloAcceptor::State::kRefused);
  EXPECT_EQ(acceptor.error().code(), StatusCode::kUnavailable) << acceptor.error().ToString();
}

}  // namespace
}  // namespace nonstop::net
