#include "net/handshake.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <thread>

#include <fmt/format.h>

#include "common/coding.h"
#include "common/role_keys.h"
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

const crypto::Key kKey = crypto::JobKey("secret");

bool AnyKind(ConnectionKind) { return true; }

Hello MakeHello() {
  Hello h;
  h.kind = ConnectionKind::kData;
  h.generation = 4;
  h.worker_id = 3;
  return h;
}

struct Outcome {
  Result<Channel> client = UnavailableError("not run");
  Result<Accepted> server = UnavailableError("not run");
};

Outcome RunHandshakeWith(const crypto::Key& dialer_key, const KeyOf& acceptor_keys, Hello hello,
                         ConnectionKind kind) {
  SocketPair p;
  Outcome o;
  std::thread t([&] {
    o.client = ClientHandshake(p.a.get(), dialer_key, hello, DeadlineAfter(Millis(2000)), nullptr);
    if (!o.client.ok()) p.a.Reset();  // the dialer leaves, as its owners do
  });
  o.server = ServerHandshake(p.b.get(), acceptor_keys, kind, DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  return o;
}

Outcome RunHandshake(const crypto::Key& dialer_key, const crypto::Key& acceptor_key,
                     Hello hello = MakeHello(), ConnectionKind kind = ConnectionKind::kData) {
  return RunHandshakeWith(dialer_key, OneKey(acceptor_key), std::move(hello), kind);
}

// Keys by role (common/role_keys.h): what a worker holds proves only that worker's connections.
TEST(HandshakeTest, AWorkerCanNeitherAnswerAsTheControllerNorDialAsAnotherWorkerOrAnAgent) {
  const WorkerKeys three = WorkerKeysOf(kKey, 3), four = WorkerKeysOf(kKey, 4);
  Hello control = MakeHello();  // worker 3's control connection
  control.kind = ConnectionKind::kControl;
  // The controller (the job key) and worker 3: accepted, both ways proven.
  Outcome genuine =
      RunHandshakeWith(three.control, JobRoles(kKey), control, ConnectionKind::kControl);
  ASSERT_TRUE(genuine.client.ok()) << genuine.client.status().ToString();
  ASSERT_TRUE(genuine.server.ok()) << genuine.server.status().ToString();
  // Worker 4 answering worker 3 as the controller, with every key it holds: worker 3 is not fooled.
  for (const crypto::Key& held : {four.control, four.data}) {
    Outcome impostor =
        RunHandshakeWith(three.control, OneKey(held), control, ConnectionKind::kControl);
    EXPECT_EQ(impostor.client.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(impostor.client.status().message().find("did not prove"), std::string::npos)
        << impostor.client.status().message();
    EXPECT_FALSE(impostor.server.ok());
  }
  // Worker 4 dialing the controller as worker 3, or as an agent, with every key it holds.
  Hello agent = control;
  agent.kind = ConnectionKind::kAgent;
  for (const crypto::Key& held : {four.control, four.data}) {
    for (const Hello& claim : {control, agent}) {
      Outcome o = RunHandshakeWith(held, JobRoles(kKey), claim, claim.kind);
      EXPECT_FALSE(o.server.ok()) << static_cast<int>(claim.kind);
      EXPECT_FALSE(o.client.ok());
    }
  }
  // Data connections: every worker's data key, and nothing else.
  EXPECT_TRUE(
      RunHandshakeWith(four.data, JobRoles(kKey), MakeHello(), ConnectionKind::kData).server.ok());
  EXPECT_FALSE(
      RunHandshakeWith(four.control, OneKey(three.data), MakeHello(), ConnectionKind::kData)
          .server.ok());
}

TEST(HandshakeTest, BothSidesProveTheKeyAndShareSessionKeys) {
  Outcome o = RunHandshake(kKey, kKey);
  ASSERT_TRUE(o.server.ok()) << o.server.status().ToString();
  ASSERT_TRUE(o.client.ok()) << o.client.status().ToString();
  EXPECT_EQ(o.server->hello.worker_id, 3);
  EXPECT_EQ(o.server->hello.generation, 4u);
  // Each direction's frames open on the other side, in order.
  for (int i = 0; i < 3; ++i) {
    FrameDecoder d;
    ASSERT_TRUE(d.Feed(o.client->send->Seal(10, "to the acceptor " + std::to_string(i))).ok());
    Frame f = *d.Next();
    ASSERT_TRUE(o.server->channel.recv->Open(&f).ok()) << i;
    EXPECT_EQ(f.payload, "to the acceptor " + std::to_string(i));
    FrameDecoder e;
    ASSERT_TRUE(e.Feed(o.server->channel.send->Seal(11, "to the dialer")).ok());
    Frame g = *e.Next();
    ASSERT_TRUE(o.client->recv->Open(&g).ok()) << i;
    EXPECT_EQ(g.payload, "to the dialer");
  }
}

TEST(HandshakeTest, ADialerWithAnotherKeyNeverSendsItsProof) {
  Outcome o = RunHandshake(crypto::JobKey("other-job"), kKey);
  ASSERT_FALSE(o.client.ok());
  EXPECT_EQ(o.client.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(o.client.status().message().find("did not prove the job key"), std::string::npos)
      << o.client.status().ToString();
  // The acceptor saw the dialer leave before any proof.
  ASSERT_FALSE(o.server.ok());
  EXPECT_EQ(o.server.status().code(), StatusCode::kUnavailable) << o.server.status().ToString();
}

// What an impostor on the controller's address gets from a dialer: a hello with a nonce, and
// nothing after its challenge fails (neither the token nor a proof it could use).
TEST(HandshakeTest, AnImpostorAcceptorGetsNoSecretAndNoProof) {
  SocketPair p;
  Result<Channel> client = UnavailableError("not run");
  std::thread t([&] {
    client = ClientHandshake(p.a.get(), kKey, MakeHello(), DeadlineAfter(Millis(2000)), nullptr);
    p.a.Reset();
  });
  Result<Frame> hello = ReadFrame(p.b.get(), DeadlineAfter(Millis(2000)), nullptr);
  ASSERT_TRUE(hello.ok());
  EXPECT_EQ(hello->type, kFrameHello);
  EXPECT_EQ(hello->payload.find("secret"), std::string::npos);
  // The impostor answers with a challenge it made without the key.
  std::string bogus =
      crypto::RandomBytes(crypto::kNonceBytes) + std::string(crypto::kMacBytes, 'x');
  ASSERT_TRUE(
      WriteFrame(p.b.get(), kFrameChallenge, bogus, DeadlineAfter(Millis(1000)), nullptr).ok());
  t.join();
  EXPECT_EQ(client.status().code(), StatusCode::kDataLoss) << client.status().ToString();
  char buf[64];
  EXPECT_EQ(::recv(p.b.get(), buf, sizeof(buf), 0), 0)
      << "the dialer sent more after the challenge";
}

// A recorded dialer's frames, replayed to the same acceptor key, fail: the acceptor's nonce is
// new.
TEST(HandshakeTest, AReplayedHandshakeIsRefused) {
  // Record a genuine exchange, frame by frame.
  DialerHandshake dialer(kKey, MakeHello());
  AcceptorHandshake acceptor(OneKey(kKey), AnyKind, nullptr);
  std::string hello = dialer.Start();
  FrameDecoder d;
  ASSERT_TRUE(d.Feed(hello).ok());
  HandshakeStep challenge = acceptor.OnFrame(*d.Next());
  ASSERT_TRUE(challenge.error.ok());
  ASSERT_TRUE(d.Feed(challenge.send).ok());
  HandshakeStep proof = dialer.OnFrame(*d.Next());
  ASSERT_TRUE(proof.error.ok());
  ASSERT_TRUE(d.Feed(proof.send).ok());
  ASSERT_TRUE(acceptor.OnFrame(*d.Next()).done);
  // Replay both to a fresh acceptor.
  AcceptorHandshake again(OneKey(kKey), AnyKind, nullptr);
  ASSERT_TRUE(d.Feed(hello).ok());
  ASSERT_TRUE(again.OnFrame(*d.Next()).error.ok());
  ASSERT_TRUE(d.Feed(proof.send).ok());
  HandshakeStep replayed = again.OnFrame(*d.Next());
  EXPECT_FALSE(replayed.done);
  EXPECT_EQ(replayed.error.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(replayed.send.empty()) << "a peer without the key is told nothing";
}

// The acceptor's own proof sent back as the dialer's, on the same connection, fails: the proofs
// name their roles.
TEST(HandshakeTest, AReflectedProofIsRefused) {
  AcceptorHandshake acceptor(OneKey(kKey), AnyKind, nullptr);
  Hello h = MakeHello();
  h.nonce = crypto::RandomBytes(crypto::kNonceBytes);
  FrameDecoder d;
  ASSERT_TRUE(d.Feed(EncodeFrame(kFrameHello, EncodeHello(h))).ok());
  HandshakeStep challenge = acceptor.OnFrame(*d.Next());
  ASSERT_TRUE(d.Feed(challenge.send).ok());
  Frame c = *d.Next();
  std::string acceptor_proof = c.payload.substr(crypto::kNonceBytes);
  ASSERT_TRUE(d.Feed(EncodeFrame(kFrameProof, acceptor_proof)).ok());
  HandshakeStep reflected = acceptor.OnFrame(*d.Next());
  EXPECT_FALSE(reflected.done);
  EXPECT_EQ(reflected.error.code(), StatusCode::kFailedPrecondition);
}

TEST(HandshakeTest, NewerMajorVersionIsRefusedAndTheRefusalIsNotBelieved) {
  Hello h = MakeHello();
  h.proto_major = kProtocolMajor + 1;
  Outcome o = RunHandshake(kKey, kKey, h);
  ASSERT_FALSE(o.server.ok());
  EXPECT_NE(o.server.status().message().find("not supported"), std::string::npos);
  // Unproven, so not final to the dialer (a garbage class), though it says why.
  EXPECT_EQ(o.client.status().code(), StatusCode::kDataLoss) << o.client.status().ToString();
  EXPECT_NE(o.client.status().message().find("not supported"), std::string::npos);
}

TEST(HandshakeTest, GarbageOnThePortIsRefused) {
  SocketPair p;
  const char raw[] = "\x01\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00Z";
  std::string junk(raw, sizeof(raw) - 1);  // a frame whose checksum is wrong
  ASSERT_TRUE(
      SendAll(p.a.get(), std::as_bytes(std::span(junk)), DeadlineAfter(Millis(1000)), nullptr, "x")
          .ok());
  Result<Accepted> server = ServerHandshake(p.b.get(), OneKey(kKey), ConnectionKind::kData,
                                            DeadlineAfter(Millis(2000)), nullptr);
  ASSERT_FALSE(server.ok());
}

TEST(HandshakeTest, NegativeWorkerIdIsRefusedWithTheReasonSealed) {
  Hello h = MakeHello();
  h.worker_id = -1;
  Outcome o = RunHandshake(kKey, kKey, h);
  ASSERT_FALSE(o.server.ok());
  EXPECT_NE(o.server.status().message().find("negative"), std::string::npos)
      << o.server.status().ToString();
  // An authenticated refusal: final, with the reason.
  EXPECT_EQ(o.client.status().code(), StatusCode::kFailedPrecondition)
      << o.client.status().ToString();
  EXPECT_NE(o.client.status().message().find("negative"), std::string::npos);
}

// A data connection names its lane (3.0); a 2.x hello, which has none, is refused by its version.
TEST(HandshakeTest, ADataHelloCarriesItsLaneAndAProtocol2HelloIsRefusedByItsVersion) {
  Hello h = MakeHello();
  h.lane = 3;
  h.nonce = std::string(crypto::kNonceBytes, 'n');
  Result<Hello> back = DecodeHello(EncodeHello(h));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->lane, 3);
  EXPECT_EQ(back->worker_id, 3);
  std::string no_lane = EncodeHello(h);
  no_lane.resize(no_lane.size() - 2);
  EXPECT_FALSE(DecodeHello(no_lane).ok()) << "a 3.0 hello without its lane is truncated";
  EXPECT_FALSE(DecodeHello(no_lane + "x").ok()) << "one byte of a lane is a truncated hello";

  Outcome o = RunHandshake(kKey, kKey, h);
  ASSERT_TRUE(o.server.ok()) << o.server.status().ToString();
  EXPECT_EQ(o.server->hello.lane, 3);

  Hello v2 = h;  // a 2.0 worker's hello: the version says it, the bytes after it are not read
  v2.proto_major = 2;
  v2.proto_minor = 0;
  Outcome refused = RunHandshake(kKey, kKey, v2);
  ASSERT_FALSE(refused.server.ok());
  EXPECT_NE(refused.server.status().message().find("2.0"), std::string::npos)
      << refused.server.status().ToString();
}

TEST(HandshakeTest, ALaneBeyondTheDataLanesOrOnAControlPortIsRefused) {
  Hello h = MakeHello();
  h.lane = kDataLanes;
  Outcome o = RunHandshake(kKey, kKey, h);
  ASSERT_FALSE(o.server.ok());
  EXPECT_NE(o.client.status().message().find(fmt::format("lane {} is out of range", kDataLanes)),
            std::string::npos)
      << o.client.status().ToString();
  Hello control = MakeHello();
  control.kind = ConnectionKind::kControl;
  control.lane = 1;
  Outcome c = RunHandshake(kKey, kKey, control, ConnectionKind::kControl);
  ASSERT_FALSE(c.server.ok());
  EXPECT_NE(c.server.status().message().find("lanes 0 to 0"), std::string::npos)
      << c.server.status().ToString();
}

// A port answers only hellos of its own kind with a challenge: no port proves the key over a hello
// meant for another, so a relay of a control hello to a data port (by a peer without the key)
// gets the dialer no authenticated refusal, only a plain one it does not believe.
TEST(HandshakeTest, AHelloOfAnotherKindGetsNoChallenge) {
  AcceptorHandshake data_port(
      OneKey(kKey), [](ConnectionKind k) { return k == ConnectionKind::kData; }, nullptr);
  Hello h = MakeHello();
  h.kind = ConnectionKind::kControl;
  h.nonce = crypto::RandomBytes(crypto::kNonceBytes);
  FrameDecoder d;
  ASSERT_TRUE(d.Feed(EncodeFrame(kFrameHello, EncodeHello(h))).ok());
  HandshakeStep step = data_port.OnFrame(*d.Next());
  EXPECT_EQ(step.error.code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(d.Feed(step.send).ok());
  EXPECT_EQ(d.Next()->type, kFrameHelloAck) << "a challenge for a hello of another kind";
  Outcome o = RunHandshake(kKey, kKey, MakeHello(), ConnectionKind::kControl);
  ASSERT_FALSE(o.server.ok());
  EXPECT_EQ(o.client.status().code(), StatusCode::kDataLoss) << "a plain refusal is not final";
  EXPECT_NE(o.client.status().message().find("kind 2"), std::string::npos);
}

// A sealed stream refuses a frame altered, replayed, dropped or injected.
TEST(FrameMacTest, RefusesAlteredReplayedReorderedAndUnsealedFrames) {
  const crypto::Key k = crypto::DeriveKey(kKey, "test");
  auto decode = [](const std::string& bytes) {
    FrameDecoder d;
    EXPECT_TRUE(d.Feed(bytes).ok());
    return *d.Next();
  };
  FrameMac sender(k);
  std::string f0 = sender.Seal(20, "plan 0"), f1 = sender.Seal(20, "plan 1");
  {
    FrameMac r(k);
    Frame a = decode(f0), b = decode(f1);
    ASSERT_TRUE(r.Open(&a).ok());
    ASSERT_TRUE(r.Open(&b).ok());
    EXPECT_EQ(b.payload, "plan 1");
  }
  {
    FrameMac r(k);
    Frame a = decode(f0);
    a.payload[0] ^= 1;  // altered
    EXPECT_EQ(r.Open(&a).code(), StatusCode::kDataLoss);
  }
  {
    FrameMac r(k);
    Frame a = decode(f0), again = decode(f0);
    ASSERT_TRUE(r.Open(&a).ok());
    EXPECT_FALSE(r.Open(&again).ok()) << "replayed";
  }
  {
    FrameMac r(k);
    Frame b = decode(f1);
    EXPECT_FALSE(r.Open(&b).ok()) << "frame 0 dropped";
  }
  {
    FrameMac r(k);
    Frame a = decode(f0);
    a.type = 21;  // the type is covered
    EXPECT_FALSE(r.Open(&a).ok());
    Frame plain = decode(EncodeFrame(20, "plan 0 with no tag at all"));
    FrameMac r2(k);
    EXPECT_FALSE(r2.Open(&plain).ok()) << "unsealed";
  }
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
  HelloAcceptor acceptor(p.b.get(), OneKey(kKey), ConnectionKind::kData);
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

// Drives a dialer over `fd` by hand: its hello, then (once the challenge is there) its proof.
class ManualDialer {
 public:
  ManualDialer(int fd) : fd_(fd), hs_(kKey, MakeHello()) {}
  std::string Hello() { return hs_.Start(); }
  // Reads the challenge and returns the proof frame.
  std::string Proof() {
    Result<Frame> challenge = ReadFrame(fd_, DeadlineAfter(Millis(1000)), nullptr);
    EXPECT_TRUE(challenge.ok()) << challenge.status().ToString();
    HandshakeStep step = hs_.OnFrame(*challenge);
    EXPECT_TRUE(step.error.ok()) << step.error.ToString();
    return step.send;
  }
  HandshakeStep Ack() {
    Result<Frame> ack = ReadFrame(fd_, DeadlineAfter(Millis(1000)), nullptr);
    EXPECT_TRUE(ack.ok()) << ack.status().ToString();
    return hs_.OnFrame(*ack);
  }

 private:
  int fd_;
  DialerHandshake hs_;
};

TEST(HelloAcceptorTest, FramesArrivingByteByByteAreAccepted) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), OneKey(kKey), ConnectionKind::kData);
  ManualDialer dialer(p.a.get());
  for (std::string bytes : {dialer.Hello(), std::string()}) {
    if (bytes.empty()) bytes = dialer.Proof();
    for (size_t i = 0; i + 1 < bytes.size(); ++i) {
      Send(p.a.get(), bytes.substr(i, 1));
      ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kReading) << "byte " << i;
      EXPECT_EQ(acceptor.wanted_events(), POLLIN);
    }
    Send(p.a.get(), bytes.substr(bytes.size() - 1));
    acceptor.Advance();
  }
  ASSERT_EQ(acceptor.state(), HelloAcceptor::State::kAccepted) << acceptor.error().ToString();
  EXPECT_EQ(acceptor.hello().worker_id, 3);
  EXPECT_EQ(acceptor.hello().generation, 4u);
  EXPECT_TRUE(dialer.Ack().done);
}

TEST(HelloAcceptorTest, NeverReadsPastTheProof) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), OneKey(kKey), ConnectionKind::kData);
  ManualDialer dialer(p.a.get());
  Send(p.a.get(), dialer.Hello());
  ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kReading);
  Send(p.a.get(), dialer.Proof() + "NEXT");
  ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kAccepted) << acceptor.error().ToString();
  char rest[8] = {};
  ASSERT_EQ(::recv(p.b.get(), rest, sizeof(rest), 0), 4);
  EXPECT_EQ(std::string(rest, 4), "NEXT");
}

TEST(HelloAcceptorTest, CallersRuleCanRefuseAndTheDialerLearnsWhy) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), OneKey(kKey), ConnectionKind::kData, [](const Hello& h) {
    return FailedPreconditionError("not today, worker " + std::to_string(h.worker_id));
  });
  ManualDialer dialer(p.a.get());
  Send(p.a.get(), dialer.Hello());
  ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kReading);
  Send(p.a.get(), dialer.Proof());
  ASSERT_EQ(acceptor.Advance(), HelloAcceptor::State::kRefused);
  EXPECT_EQ(acceptor.error().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(acceptor.error().message().find("not today, worker 3"), std::string::npos);
  HandshakeStep ack = dialer.Ack();
  EXPECT_EQ(ack.error.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(ack.error.message().find("not today, worker 3"), std::string::npos);
}

TEST(HelloAcceptorTest, PeerClosingMidHelloIsUnavailable) {
  SocketPair p;
  HelloAcceptor acceptor(p.b.get(), OneKey(kKey), ConnectionKind::kData);
  Send(p.a.get(), HeaderWithLength(40));
  p.a.Reset();
  EXPECT_EQ(acceptor.Advance(), HelloAcceptor::State::kRefused);
  EXPECT_EQ(acceptor.error().code(), StatusCode::kUnavailable) << acceptor.error().ToString();
}

}  // namespace
}  // namespace nonstop::net
