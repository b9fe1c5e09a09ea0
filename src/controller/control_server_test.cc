#include "controller/control_server.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstring>
#include <map>

#include <thread>

#include "common/mutex.h"
#include "common/role_keys.h"
#include "control/messages.h"
#include "net/handshake.h"

namespace nonstop::controller {
namespace {

// A real server on loopback, driven by its event loop on a thread.
struct ServerFixture {
  net::EventLoop loop;
  std::vector<Event> events;
  std::unique_ptr<ControlServer> server;
  std::atomic<bool> stop{false};
  std::thread thread;
  explicit ServerFixture(ControlServerOptions options = {}) {
    auto s = ControlServer::Create(
        &loop, {"127.0.0.1", 0}, "tok", [this](Event e) { events.push_back(std::move(e)); },
        options);
    NONSTOP_CHECK(s.ok());
    server = std::move(*s);
  }
  void RunFor(Millis d) {
    auto until = Clock::now() + d;
    while (Clock::now() < until) {
      loop.RunOnce(Millis(10));
      server->CheckTimers(Clock::now());
    }
  }
  template <typename T>
  int Count() const {
    int n = 0;
    for (const auto& e : events) n += std::holds_alternative<T>(e) ? 1 : 0;
    return n;
  }
};

UniqueFd Dial(const net::HostPort& where) {
  auto fd = net::Dial(where, DeadlineAfter(Millis(2000)));
  NONSTOP_CHECK(fd.ok());
  return std::move(*fd);
}

// The session keys of each test worker's connection (by descriptor), set by its handshake.
Mutex channels_mu;
std::map<int, net::Channel>& Channels() {
  static std::map<int, net::Channel> channels;
  return channels;
}

// Sends one frame on a test worker's connection, sealed with its session key.
Status SendSealed(int fd, uint16_t type, std::string_view payload) {
  std::string bytes;
  {
    MutexLock lock(&channels_mu);
    bytes = Channels().at(fd).send->Seal(type, payload);
  }
  return net::SendAll(fd, std::as_bytes(std::span(bytes)), DeadlineAfter(Millis(1000)), nullptr,
                      "sealed frame");
}

// Reads one frame of a test worker's connection and checks its MAC.
Result<net::Frame> ReadSealed(int fd, Deadline deadline) {
  NONSTOP_ASSIGN_OR_RETURN(net::Frame f, net::ReadFrame(fd, deadline, nullptr));
  MutexLock lock(&channels_mu);
  NONSTOP_RETURN_IF_ERROR(Channels().at(fd).recv->Open(&f));
  return f;
}

// Says hello as `hello_id` and joins as `worker_id` (blocking; run it on a
// client thread). False if the server refused the hello.
bool HelloAndJoin(int fd, int worker_id, int hello_id) {
  net::Hello h;
  h.kind = net::ConnectionKind::kControl;
  h.worker_id = hello_id;
  auto channel = net::ClientHandshake(fd, WorkerControlKey(crypto::JobKey("tok"), hello_id), h,
                                      DeadlineAfter(Millis(3000)), nullptr);
  if (!channel.ok()) return false;
  {
    MutexLock lock(&channels_mu);
    Channels()[fd] = std::move(*channel);
  }
  control::JoinMsg j{worker_id, 1, "127.0.0.1:1", false, -1};
  return SendSealed(fd, control::kMsgJoin, control::Encode(j)).ok();
}

void Join(int fd, int worker_id) { ASSERT_TRUE(HelloAndJoin(fd, worker_id, worker_id)); }

TEST(ControlServerTest, GarbageAndWrongTokensAreClosedAndTheServerCarriesOn) {
  ServerFixture f;
  UniqueFd garbage = Dial(f.server->address());
  std::string http = "GET /status HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(garbage.get(), http.data(), http.size(), 0), static_cast<ssize_t>(http.size()));
  // A dialer without the key: it gets the challenge, and a proof it makes up is refused.
  UniqueFd wrong = Dial(f.server->address());
  net::Hello h;
  h.kind = net::ConnectionKind::kControl;
  h.worker_id = 1;
  net::DialerHandshake impostor(crypto::JobKey("not-the-token"), h);
  std::string hello = impostor.Start();
  ASSERT_GT(::send(wrong.get(), hello.data(), hello.size(), 0), 0);
  f.RunFor(Millis(100));
  std::string proof = net::EncodeFrame(net::kFrameProof, std::string(crypto::kMacBytes, 'p'));
  ASSERT_GT(::send(wrong.get(), proof.data(), proof.size(), MSG_NOSIGNAL), 0);
  f.RunFor(Millis(200));
  EXPECT_EQ(f.server->refused_connections(), 1)
      << "the impostor (the HTTP request is no frame at all)";
  EXPECT_TRUE(f.events.empty());
  // It was told nothing but the challenge: the next frame it reads is none (the server closed).
  auto challenge = net::ReadFrame(wrong.get(), DeadlineAfter(Millis(1000)), nullptr);
  ASSERT_TRUE(challenge.ok()) << challenge.status().ToString();
  EXPECT_EQ(challenge->type, net::kFrameChallenge);
  EXPECT_EQ(net::ReadFrame(wrong.get(), DeadlineAfter(Millis(1000)), nullptr).status().code(),
            StatusCode::kUnavailable);

  // A proper worker still gets through.
  UniqueFd good = Dial(f.server->address());
  std::thread client([&] { Join(good.get(), 7); });
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.events.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<WorkerJoined>(f.events[0]));
  EXPECT_EQ(std::get<WorkerJoined>(f.events[0]).msg.worker_id, 7);
}

// A frame from a worker altered on the way (its checksum made to match again) or injected by
// someone without the session key fails its MAC: not obeyed, counted, that connection closed.
TEST(ControlServerTest, AnAlteredOrInjectedFrameIsRefusedCountedAndClosesTheConnection) {
  ServerFixture f;
  UniqueFd altered = Dial(f.server->address()), injected = Dial(f.server->address());
  std::thread client([&] {
    Join(altered.get(), 1);
    Join(injected.get(), 2);
    std::string finished = control::Encode(control::FinishedMsg{});
    std::string sealed;
    {
      MutexLock lock(&channels_mu);
      sealed = Channels().at(altered.get()).send->Seal(control::kMsgFinished, finished);
    }
    std::string payload = sealed.substr(net::kFrameHeaderBytes);
    payload[0] ^= 0x20;
    std::string bytes = net::EncodeFrame(control::kMsgFinished, payload);
    ASSERT_GT(::send(altered.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL), 0);
    bytes = net::EncodeFrame(control::kMsgFinished, finished);  // no MAC at all
    ASSERT_GT(::send(injected.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL), 0);
  });
  f.RunFor(Millis(400));
  client.join();
  EXPECT_EQ(f.Count<WorkerJoined>(), 2);
  EXPECT_EQ(f.Count<FinishedReceived>(), 0) << "a frame that fails its MAC was obeyed";
  EXPECT_EQ(f.Count<ConnectionLost>(), 2);
  EXPECT_EQ(f.server->refused_frames(), 2);
  EXPECT_EQ(f.server->open_connections(), 0u);
}

TEST(ControlServerTest, MalformedMessageClosesOnlyThatWorker) {
  ServerFixture f;
  UniqueFd c = Dial(f.server->address());
  std::thread client([&] {
    Join(c.get(), 1);
    ASSERT_TRUE(SendSealed(c.get(), control::kMsgHeartbeat, "{\"step\": [1]}").ok());
  });
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.events.size(), 2u);
  ASSERT_TRUE(std::holds_alternative<ConnectionLost>(f.events[1]));
  EXPECT_NE(std::get<ConnectionLost>(f.events[1]).reason.find("step"), std::string::npos);
}

// A worker announces an injected fault and dies; the controller closes its
// connection (KillWorker) before its loop read the announcement: the frame is
// read first, so the controller learns that the fault fired (else the next
// plan hands it to the replacement, which fires it again).
TEST(ControlServerTest, ClosingAWorkerFirstReadsWhatItAlreadySent) {
  ServerFixture f;
  UniqueFd c = Dial(f.server->address());
  std::thread client([&] { Join(c.get(), 1); });
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.Count<WorkerJoined>(), 1);
  ASSERT_TRUE(SendSealed(c.get(), control::kMsgInjected,
                         control::Encode(control::InjectedMsg{7, "kill:rank=1,step=10"}))
                  .ok());
  c.Reset();  // the worker is gone; its frame waits in the server's socket, unread
  f.server->CloseWorker(1, "killed by the controller");
  ASSERT_EQ(f.Count<InjectedReceived>(), 1) << "the frame sent before the close was lost";
  const auto& injected = std::get<InjectedReceived>(f.events.back());
  EXPECT_EQ(injected.worker_id, 1);
  EXPECT_EQ(injected.msg.fault_id, 7);
  EXPECT_EQ(f.Count<ConnectionLost>(), 0) << "the controller closed it: not a loss to report";
}

TEST(ControlServerTest, WorkerThatStopsReadingIsReportedLostAndNeverBlocksTheLoop) {
  ServerFixture f;
  UniqueFd c = Dial(f.server->address());
  std::thread client([&] { Join(c.get(), 3); });  // then never reads again
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.Count<WorkerJoined>(), 1);
  // Far more than the socket buffers and the queue take: the server must
  // neither block nor leave a half-written frame; it drops the worker.
  std::string big(1 << 20, 'x');
  bool refused = false;
  for (int i = 0; i < 40 && !refused; ++i) refused = !f.server->Send(3, control::kMsgShutdown, big);
  f.RunFor(Millis(50));
  EXPECT_TRUE(refused);
  ASSERT_EQ(f.Count<ConnectionLost>(), 1);
  for (const auto& e : f.events) {
    if (const auto* lost = std::get_if<ConnectionLost>(&e)) {
      EXPECT_EQ(lost->worker_id, 3);
      EXPECT_NE(lost->reason.find("slow reader"), std::string::npos) << lost->reason;
    }
  }
}

TEST(ControlServerTest, WorkerThatPausesReadingGetsEveryFrameIntactAndInOrder) {
  ServerFixture f;
  UniqueFd c = Dial(f.server->address());
  std::vector<std::string> got;
  std::atomic<bool> joined{false};
  std::thread client([&] {
    Join(c.get(), 4);
    joined = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // a slow reader, not a dead one
    // First the controller's epoch (a ping), then the six frames.
    auto epoch = ReadSealed(c.get(), DeadlineAfter(Millis(5000)));
    ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
    EXPECT_EQ(epoch->type, control::kMsgPing);
    for (int i = 0; i < 6; ++i) {
      auto frame = ReadSealed(c.get(), DeadlineAfter(Millis(5000)));
      ASSERT_TRUE(frame.ok()) << frame.status().ToString();
      got.push_back(frame->payload);
    }
  });
  while (!joined) f.RunFor(Millis(10));
  f.RunFor(Millis(100));
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(f.server->Send(4, control::kMsgShutdown,
                               std::string(700 << 10, static_cast<char>('a' + i))));
  }
  f.RunFor(Millis(2500));
  client.join();
  ASSERT_EQ(got.size(), 6u);
  for (int i = 0; i < 6; ++i)
    EXPECT_EQ(got[static_cast<size_t>(i)], std::string(700 << 10, static_cast<char>('a' + i)));
  EXPECT_EQ(f.Count<ConnectionLost>(), 0);
}

// Fencing: a controller whose lease ran out while its output waited in the queue (a paused
// process, a slow reader) flushes none of it once it wakes: a newer leader may be giving orders.
TEST(ControlServerTest, OutputQueuedWhenTheSendGateClosesIsDroppedNotFlushed) {
  ControlServerOptions o;
  o.max_queued_bytes = 64u << 20;
  ServerFixture f(o);
  std::atomic<bool> may_send{true};
  f.server->SetSendGate([&] { return may_send.load(); });
  UniqueFd c = Dial(f.server->address());
  std::atomic<bool> joined{false}, read_now{false};
  std::atomic<uint64_t> received{0};
  std::thread client([&] {
    Join(c.get(), 4);
    joined = true;
    while (!read_now) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    char buf[64 << 10];
    while (true) {
      pollfd p{c.get(), POLLIN, 0};
      if (::poll(&p, 1, 1000) <= 0) break;  // a second of silence: nothing more comes
      ssize_t n = ::recv(c.get(), buf, sizeof(buf), 0);
      if (n <= 0) break;
      received += static_cast<uint64_t>(n);
    }
  });
  while (!joined) f.RunFor(Millis(10));
  f.RunFor(Millis(100));  // the join, and the ping that answers it
  const std::string payload(1 << 20, 'p');
  constexpr int kFrames = 24;  // more than the kernel's socket buffers take: the rest waits here
  for (int i = 0; i < kFrames; ++i) ASSERT_TRUE(f.server->Send(4, control::kMsgShutdown, payload));
  may_send = false;  // the lease ran out
  EXPECT_FALSE(f.server->Send(4, control::kMsgShutdown, payload)) << "a send after the gate closed";
  read_now = true;
  f.RunFor(Millis(2500));
  client.join();
  const uint64_t frame = payload.size() + net::kFrameHeaderBytes + net::kFrameTagBytes;
  const uint64_t ping =
      f.server->ping_payload().size() + net::kFrameHeaderBytes + net::kFrameTagBytes;
  EXPECT_GT(f.server->dropped_bytes(), 2 * frame) << "the queue was flushed";
  // every byte queued either reached the worker or was counted as dropped, the refused send too
  EXPECT_EQ(received.load() + f.server->dropped_bytes(), ping + (kFrames + 1) * frame);
  EXPECT_LT(received.load(), ping + kFrames * frame);
}

TEST(ControlServerTest, StuckReaderIsReportedLostAfterTheStallTimeout) {
  ControlServerOptions o;
  o.send_stall_timeout = Millis(300);
  ServerFixture f(o);
  UniqueFd c = Dial(f.server->address());
  std::thread client([&] { Join(c.get(), 5); });
  f.RunFor(Millis(300));
  client.join();
  // Fill the socket buffers; the rest stays queued and the peer takes nothing.
  for (int i = 0; i < 6; ++i)
    ASSERT_TRUE(f.server->Send(5, control::kMsgShutdown, std::string(1 << 20, 'y')));
  f.RunFor(Millis(800));
  ASSERT_EQ(f.Count<ConnectionLost>(), 1);
  for (const auto& e : f.events) {
    if (const auto* lost = std::get_if<ConnectionLost>(&e)) {
      EXPECT_NE(lost->reason.find("stuck reader"), std::string::npos) << lost->reason;
    }
  }
}

TEST(ControlServerTest, FloodOfIdleConnectionsCostsBoundedMemoryAndDoesNotKeepAWorkerOut) {
  ControlServerOptions o;
  o.max_unjoined = 16;
  o.handshake_timeout = Millis(400);
  ServerFixture f(o);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 100; ++i) {
    idle.push_back(Dial(f.server->address()));
    if (i % 10 == 0) {
      // a huge length
      std::string junk = i % 20 == 0 ? std::string("\xff\xff\xff\x7f", 4) : std::string();
      if (!junk.empty()) {
        ASSERT_GT(::send(idle.back().get(), junk.data(), junk.size(), MSG_NOSIGNAL), 0);
      }
    }
    f.RunFor(Millis(1));
  }
  EXPECT_LE(f.server->open_connections(), 16u);
  UniqueFd good = Dial(f.server->address());
  std::thread client([&] { Join(good.get(), 9); });
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.Count<WorkerJoined>(), 1);
  // The idle ones go when their handshake time is up; the worker stays.
  f.RunFor(Millis(600));
  EXPECT_EQ(f.server->open_connections(), 1u);
  EXPECT_EQ(f.Count<ConnectionLost>(), 0);
}

// A stranger from 127.0.0.2 (a worker on another host that has just
// connected) is not evicted by a flood of idle connections from 127.0.0.1:
// to make room the server closes the flooding address's own connections.
TEST(ControlServerTest, FloodFromOneAddressEvictsOnlyItsOwnConnections) {
  ControlServerOptions o;
  o.max_unjoined = 8;
  ServerFixture f(o);
  int raw = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(raw, 0);
  UniqueFd other(raw);
  sockaddr_in local{};
  local.sin_family = AF_INET;
  local.sin_addr.s_addr = htonl(0x7f000002);  // 127.0.0.2: loopback, another address
  ASSERT_EQ(::bind(raw, reinterpret_cast<sockaddr*>(&local), sizeof(local)), 0)
      << std::strerror(errno);
  sockaddr_in server{};
  server.sin_family = AF_INET;
  server.sin_port = htons(f.server->address().port);
  server.sin_addr.s_addr = htonl(0x7f000001);
  ASSERT_EQ(::connect(raw, reinterpret_cast<sockaddr*>(&server), sizeof(server)), 0)
      << std::strerror(errno);
  f.RunFor(Millis(20));  // accepted first: the oldest stranger of all
  std::vector<UniqueFd> flood;
  for (int i = 0; i < 40; ++i) {
    flood.push_back(Dial(f.server->address()));
    f.RunFor(Millis(1));
  }
  EXPECT_LE(f.server->open_connections(), 8u);
  // The worker on 127.0.0.2 was never closed: it joins on the connection it opened first.
  std::thread client([&] { Join(other.get(), 4); });
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.Count<WorkerJoined>(), 1);
  // Eight of the flood's connections were closed by the server: they read EOF.
  int closed = 0;
  for (auto& fd : flood) {
    char b;
    closed += ::recv(fd.get(), &b, 1, MSG_DONTWAIT) == 0 ? 1 : 0;
  }
  EXPECT_GE(closed, 32);
}

TEST(ControlServerTest, JoinAsAnotherWorkerThanTheHelloSaidIsRefused) {
  ServerFixture f;
  UniqueFd c = Dial(f.server->address());
  std::thread client([&] { HelloAndJoin(c.get(), /*worker_id=*/5, /*hello_id=*/2); });
  f.RunFor(Millis(300));
  client.join();
  EXPECT_EQ(f.Count<WorkerJoined>(), 0);
  EXPECT_EQ(f.server->open_connections(), 0u);
}

TEST(ControlServerTest, NegativeWorkerIdIsRefused) {
  ServerFixture f;
  UniqueFd c = Dial(f.server->address());
  bool accepted = true;
  std::thread client([&] { accepted = HelloAndJoin(c.get(), -3, -3); });
  f.RunFor(Millis(300));
  client.join();
  EXPECT_FALSE(accepted) << "the hello of worker -3 must be refused";
  EXPECT_EQ(f.Count<WorkerJoined>(), 0);
  EXPECT_EQ(f.server->open_connections(), 0u);
}

}  // namespace
}  // namespace nonstop::controller
