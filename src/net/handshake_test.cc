#include "net/handshake.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <thread>

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
  std::thread t([&] { client = ClientHandshake(p.a.get(), MakeHello("secret"), DeadlineAfter(Millis(2000)), nullptr); });
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData, DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  EXPECT_TRUE(client.ok()) << client.ToString();
  EXPECT_EQ(server->worker_id, 3);
  EXPECT_EQ(server->generation, 4u);
}

TEST(HandshakeTest, WrongTokenIsRefusedOnBothSides) {
  SocketPair p;
  Status client;
  std::thread t([&] { client = ClientHandshake(p.a.get(), MakeHello("other-job"), DeadlineAfter(Millis(2000)), nullptr); });
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData, DeadlineAfter(Millis(2000)), nullptr);
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
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData, DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("not supported"), std::string::npos);
}

TEST(HandshakeTest, GarbageOnThePortIsRefused) {
  SocketPair p;
  const char raw[] = "\x01\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00Z";
  std::string junk(raw, sizeof(raw) - 1);  // a frame whose checksum is wrong
  ASSERT_TRUE(SendAll(p.a.get(), std::as_bytes(std::span(junk)), DeadlineAfter(Millis(1000)), nullptr, "x").ok());
  Result<Hello> server = ServerHandshake(p.b.get(), "secret", ConnectionKind::kData, DeadlineAfter(Millis(2000)), nullptr);
  ASSERT_FALSE(server.ok());
}

}  // namespace
}  // namespace nonstop::net
