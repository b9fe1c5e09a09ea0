#include "collective/peer_mesh.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <future>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "collective/tcp_data_plane.h"
#include "common/coding.h"
#include "common/role_keys.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/ipv6_testing.h"

namespace nonstop::collective {
namespace {

constexpr char kToken[] = "mesh-test-token";

std::unique_ptr<PeerMesh> MakeMesh(int worker_id, Millis timeout_handshake = Millis(30'000),
                                   int max_pending = 64) {
  PeerMeshOptions o;
  o.data_key = WorkerDataKey(crypto::JobKey(kToken));
  o.worker_id = worker_id;
  o.timeout_handshake = timeout_handshake;
  o.max_pending_handshakes = max_pending;
  auto mesh = PeerMesh::Create(o);
  NONSTOP_CHECK(mesh.ok()) << mesh.status().ToString();
  return std::move(*mesh);
}

UniqueFd RawConnect(const net::HostPort& where) {
  auto fd = net::Dial(where, DeadlineAfter(Millis(5'000)));
  NONSTOP_CHECK(fd.ok()) << fd.status().ToString();
  return std::move(*fd);
}

void SendRaw(int fd, std::string_view bytes) {
  Status s = net::SendAll(fd, std::as_bytes(std::span(bytes.data(), bytes.size())),
                          DeadlineAfter(Millis(5'000)), nullptr, "junk");
  NONSTOP_CHECK(s.ok()) << s.ToString();
}

// Dials `mesh` by hand with the given hello; returns the dialer's view of the handshake.
Status HandDial(const PeerMesh& mesh, int worker_id, uint32_t generation, UniqueFd* out = nullptr) {
  UniqueFd fd = RawConnect(mesh.address());
  net::Hello h;
  h.kind = net::ConnectionKind::kData;
  h.worker_id = worker_id;
  h.generation = generation;
  Result<net::Channel> s = net::ClientHandshake(fd.get(), WorkerDataKey(crypto::JobKey(kToken)), h,
                                                DeadlineAfter(Millis(5'000)), nullptr);
  if (out != nullptr) *out = std::move(fd);
  return s.status();
}

// True when the peer closed `fd` (EOF or reset) within `wait`.
bool ClosedByPeer(int fd, Millis wait) {
  char buf[64];
  Deadline until = DeadlineAfter(wait);
  while (true) {
    Status ready = net::WaitFd(fd, POLLIN, until, nullptr, "closed?");
    if (!ready.ok()) return false;
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
  }
}

// Regression: the accept thread performed each handshake inline, so one silent
// connection stalled every accept for timeout_handshake.
TEST(PeerMeshTest, IdleAndGarbageConnectionsDoNotDelayALegitimatePeer) {
  auto acceptor = MakeMesh(/*worker_id=*/1, /*timeout_handshake=*/Millis(30'000));
  std::vector<UniqueFd> junk;
  // idle: never speak
  for (int i = 0; i < 20; ++i) junk.push_back(RawConnect(acceptor->address()));
  for (int i = 0; i < 3; ++i) {
    junk.push_back(RawConnect(acceptor->address()));
    SendRaw(junk.back().get(), "GET / HTTP/1.1\r\nHost: x\r\n\r\n");  // not a nonstop peer
  }
  for (int i = 0; i < 3; ++i) {
    junk.push_back(RawConnect(acceptor->address()));
    std::string header;
    PutFixed32(&header, 0xFFFFFFF0u);  // a frame header with a huge length
    PutFixed16(&header, net::kFrameHello);
    PutFixed16(&header, 0);
    PutFixed32(&header, 0);
    SendRaw(junk.back().get(), header);
  }
  for (int i = 0; i < 3; ++i) {
    junk.push_back(RawConnect(acceptor->address()));
    std::string hello = net::EncodeFrame(net::kFrameHello, std::string(40, 'x'));
    SendRaw(junk.back().get(), hello.substr(0, 17));  // a hello that stops halfway
  }

  auto dialer = MakeMesh(/*worker_id=*/0);
  auto dialed = std::async(std::launch::async, [&] {
    return dialer->Get(1, acceptor->address().ToString(), 1, DeadlineAfter(Millis(5'000)), nullptr);
  });
  // A correctness bound, not a benchmark: far below the 30 s handshake timeout.
  Result<Connection*> accepted =
      acceptor->Get(0, dialer->address().ToString(), 1, DeadlineAfter(Millis(5'000)), nullptr);
  Result<Connection*> out = dialed.get();
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(acceptor->connections_opened(), 1);
  // The garbage senders were refused at once, without waiting for their deadline.
  for (size_t i = 20; i < 26; ++i) EXPECT_TRUE(ClosedByPeer(junk[i].get(), Millis(5'000))) << i;
}

TEST(PeerMeshTest, HandshakeDeadlineClosesASilentConnection) {
  auto acceptor = MakeMesh(/*worker_id=*/1, /*timeout_handshake=*/Millis(200));
  UniqueFd idle = RawConnect(acceptor->address());
  EXPECT_TRUE(ClosedByPeer(idle.get(), Millis(20'000)));
  EXPECT_EQ(acceptor->connections_refused(), 1);
}

// Bounded memory: beyond max_pending_handshakes idle connections, the oldest are closed.
TEST(PeerMeshTest, FloodOfIdleConnectionsBeyondTheCapClosesTheOldest) {
  auto acceptor =
      MakeMesh(/*worker_id=*/1, /*timeout_handshake=*/Millis(30'000), /*max_pending=*/8);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(RawConnect(acceptor->address()));
  // The first 32 are evicted (oldest first); the last 8 stay in handshake.
  for (int i = 0; i < 32; ++i)
    EXPECT_TRUE(ClosedByPeer(idle[static_cast<size_t>(i)].get(), Millis(10'000))) << i;
  EXPECT_FALSE(ClosedByPeer(idle.back().get(), Millis(50)));
  EXPECT_GE(acceptor->connections_refused(), 32);
  // And a legitimate peer still gets in.
  auto dialer = MakeMesh(/*worker_id=*/0);
  auto dialed = std::async(std::launch::async, [&] {
    return dialer->Get(1, acceptor->address().ToString(), 1, DeadlineAfter(Millis(5'000)), nullptr);
  });
  Result<Connection*> accepted =
      acceptor->Get(0, dialer->address().ToString(), 1, DeadlineAfter(Millis(5'000)), nullptr);
  EXPECT_TRUE(dialed.get().ok());
  EXPECT_TRUE(accepted.ok()) << accepted.status().ToString();
}

TEST(PeerMeshTest, AbortWakesAWaitingGet) {
  auto acceptor = MakeMesh(/*worker_id=*/1);
  net::AbortSignal abort;
  std::thread fire([&] {
    std::this_thread::sleep_for(Millis(50));
    abort.Fire();
  });
  // The deadline is far away: only the abort can end this wait.
  Result<Connection*> c = acceptor->Get(0, "127.0.0.1:1", 1, DeadlineAfter(Millis(40'000)), &abort);
  fire.join();
  EXPECT_EQ(c.status().code(), StatusCode::kAborted) << c.status().ToString();
}

TEST(PeerMeshTest, AbortFiredBeforeTheWaitEndsItAtOnce) {
  auto acceptor = MakeMesh(/*worker_id=*/1);
  net::AbortSignal abort;
  abort.Fire();
  Result<Connection*> c = acceptor->Get(0, "127.0.0.1:1", 1, DeadlineAfter(Millis(40'000)), &abort);
  EXPECT_EQ(c.status().code(), StatusCode::kAborted) << c.status().ToString();
}

// Regression: Get() polled every 5 ms while waiting for a peer to dial in.
// Counts the waiting thread's voluntary context switches (wake-ups), not time.
TEST(PeerMeshTest, WaitingGetDoesNotPoll) {
  auto acceptor = MakeMesh(/*worker_id=*/1);
  net::AbortSignal abort;
  rusage before{}, after{};
  ::getrusage(RUSAGE_THREAD, &before);
  Result<Connection*> c = acceptor->Get(0, "127.0.0.1:1", 1, DeadlineAfter(Millis(1'000)), &abort);
  ::getrusage(RUSAGE_THREAD, &after);
  EXPECT_EQ(c.status().code(), StatusCode::kDeadlineExceeded) << c.status().ToString();
  long wakeups = after.ru_nvcsw - before.ru_nvcsw;
  EXPECT_LT(wakeups, 20) << "a 1 s wait woke up " << wakeups << " times: it polls";
}

TEST(PeerMeshTest, HelloWithANegativeWorkerIdIsRefused) {
  auto acceptor = MakeMesh(/*worker_id=*/1);
  Status s = HandDial(*acceptor, /*worker_id=*/-3, /*generation=*/1);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("negative"), std::string::npos) << s.ToString();
  EXPECT_EQ(acceptor->connections_opened(), 0);
}

TEST(PeerMeshTest, HelloFromAWorkerThatShouldNotDialIsRefused) {
  auto acceptor = MakeMesh(/*worker_id=*/1);
  // The lower id dials: worker 1 accepts only from worker 0.
  for (int id : {1, 2}) {
    Status s = HandDial(*acceptor, id, /*generation=*/1);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << id << ": " << s.ToString();
    EXPECT_NE(s.message().find("lower worker id dials"), std::string::npos) << s.ToString();
  }
  EXPECT_EQ(acceptor->connections_opened(), 0);
}

// Regression: the hello's generation was never checked. A connection opened by
// a peer in generation 5 must not serve this worker's generation 3.
TEST(PeerMeshTest, ConnectionOfANewerGenerationIsNotHandedToAnOlderOne) {
  auto acceptor = MakeMesh(/*worker_id=*/1);
  UniqueFd fd;
  ASSERT_TRUE(HandDial(*acceptor, /*worker_id=*/0, /*generation=*/5, &fd).ok());
  Result<Connection*> old_gen =
      acceptor->Get(0, "127.0.0.1:1", 3, DeadlineAfter(Millis(5'000)), nullptr);
  EXPECT_EQ(old_gen.status().code(), StatusCode::kAborted) << old_gen.status().ToString();
  EXPECT_NE(old_gen.status().message().find("generation 3 is over"), std::string::npos);
  // The connection stays for generation 5 and later.
  Result<Connection*> gen5 =
      acceptor->Get(0, "127.0.0.1:1", 5, DeadlineAfter(Millis(5'000)), nullptr);
  ASSERT_TRUE(gen5.ok()) << gen5.status().ToString();
  EXPECT_EQ((*gen5)->generation, 5u);
  Result<Connection*> gen6 =
      acceptor->Get(0, "127.0.0.1:1", 6, DeadlineAfter(Millis(5'000)), nullptr);
  ASSERT_TRUE(gen6.ok()) << gen6.status().ToString();
  EXPECT_EQ(*gen6, *gen5) << "connections survive into newer generations";
}

// Regression: a late hello of an older generation replaced the live
// connection of a newer one.
TEST(PeerMeshTest, StaleHelloDoesNotReplaceANewerConnection) {
  auto acceptor = MakeMesh(/*worker_id=*/1);
  UniqueFd current;
  ASSERT_TRUE(HandDial(*acceptor, /*worker_id=*/0, /*generation=*/7, &current).ok());
  Result<Connection*> first =
      acceptor->Get(0, "127.0.0.1:1", 7, DeadlineAfter(Millis(5'000)), nullptr);
  ASSERT_TRUE(first.ok()) << first.status().ToString();

  UniqueFd stale;
  Status s = HandDial(*acceptor, /*worker_id=*/0, /*generation=*/6, &stale);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("stale"), std::string::npos) << s.ToString();

  Result<Connection*> again =
      acceptor->Get(0, "127.0.0.1:1", 7, DeadlineAfter(Millis(5'000)), nullptr);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, *first);
  EXPECT_EQ(acceptor->connections_opened(), 1);
  // A redial in a newer generation does replace it (the peer dropped its end first).
  current.Reset();
  UniqueFd newer;
  ASSERT_TRUE(HandDial(*acceptor, /*worker_id=*/0, /*generation=*/8, &newer).ok());
  Result<Connection*> gen8 =
      acceptor->Get(0, "127.0.0.1:1", 8, DeadlineAfter(Millis(5'000)), nullptr);
  ASSERT_TRUE(gen8.ok()) << gen8.status().ToString();
  EXPECT_EQ((*gen8)->generation, 8u);
}

// Lanes: further connections between the same two workers, each its own socket, reused across
// generations like lane 0, and all dropped with their peer.
TEST(PeerMeshTest, EachLaneIsAConnectionOfItsOwnAndDropForgetsThemAll) {
  auto low = MakeMesh(/*worker_id=*/0);
  auto high = MakeMesh(/*worker_id=*/1);
  const std::string high_at = high->address().ToString();
  const std::string low_at = low->address().ToString();
  std::vector<Connection*> dialed, accepted;
  for (int lane = 0; lane < net::kDataLanes; ++lane) {
    auto d = low->Get(1, high_at, 2, DeadlineAfter(Millis(5'000)), nullptr, lane);
    ASSERT_TRUE(d.ok()) << lane << ": " << d.status().ToString();
    auto a = high->Get(0, low_at, 2, DeadlineAfter(Millis(5'000)), nullptr, lane);
    ASSERT_TRUE(a.ok()) << lane << ": " << a.status().ToString();
    EXPECT_EQ((*a)->lane, lane);
    dialed.push_back(*d);
    accepted.push_back(*a);
  }
  EXPECT_EQ(low->connections_open(), net::kDataLanes);
  EXPECT_EQ(high->connections_opened(), net::kDataLanes);
  // A byte sent on lane l arrives on lane l, and only there.
  for (int lane = 0; lane < net::kDataLanes; ++lane) {
    const char c = static_cast<char>('a' + lane);
    ASSERT_EQ(::send(dialed[static_cast<size_t>(lane)]->fd.get(), &c, 1, MSG_NOSIGNAL), 1);
  }
  for (int lane = net::kDataLanes - 1; lane >= 0; --lane) {
    char got = 0;
    ASSERT_TRUE(net::WaitFd(accepted[static_cast<size_t>(lane)]->fd.get(), POLLIN,
                            DeadlineAfter(Millis(5'000)), nullptr, "lane")
                    .ok());
    ASSERT_EQ(::recv(accepted[static_cast<size_t>(lane)]->fd.get(), &got, 1, 0), 1);
    EXPECT_EQ(got, static_cast<char>('a' + lane)) << "lane " << lane;
  }
  // The next generation gets the same sockets.
  auto again = low->Get(1, high_at, 3, DeadlineAfter(Millis(5'000)), nullptr, 2);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, dialed[2]);
  low->Drop(1);
  EXPECT_EQ(low->connections_open(), 0);
  for (Connection* c : accepted) EXPECT_TRUE(ClosedByPeer(c->fd.get(), Millis(5'000)));
}

// ---- IPv6 and data-port ranges (docs/ports.md) ----

// Three ranks whose data ports listen on IPv6 loopback: the plan's addresses
// are "[::1]:port", every rank dials or accepts over IPv6, and the all-reduce
// sums as over IPv4.
TEST(PeerMeshIpv6Test, AllReduceOfThreeRanksOverIpv6Loopback) {
  if (std::string why = net::testing::NoIpv6Loopback(); !why.empty()) GTEST_SKIP() << why;
  constexpr int kWorld = 3;
  constexpr size_t kFloats = 100'003;  // several pieces, not a multiple of the world
  net::AbortSignal aborts[kWorld];     // first: outlive the data planes
  std::vector<std::unique_ptr<TcpDataPlane>> planes;
  std::vector<Member> members;
  for (int r = 0; r < kWorld; ++r) {
    PeerMeshOptions o;
    o.data_key = WorkerDataKey(crypto::JobKey(kToken));
    o.worker_id = r;
    o.listen = {"::1", 0};
    auto plane = TcpDataPlane::Create(o, &aborts[r]);
    ASSERT_TRUE(plane.ok()) << plane.status().ToString();
    const std::string address = (*plane)->address().ToString();
    EXPECT_EQ(address.rfind("[::1]:", 0), 0u) << address;
    members.push_back({r, address});
    planes.push_back(std::move(*plane));
  }
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < kWorld; ++r) {
    CommunicatorOptions o;
    o.rank = r;
    o.members = members;
    o.timeout_collective = Millis(30'000);
    o.piece_bytes = 16 << 10;
    comms.push_back(planes[static_cast<size_t>(r)]->NewCommunicator(o));
  }
  std::vector<std::vector<float>> data(kWorld);
  std::vector<Status> results(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto& d = data[static_cast<size_t>(r)];
      d.resize(kFloats);
      for (size_t i = 0; i < kFloats; ++i) d[i] = static_cast<float>((r + 1) * (i % 97));
      Communicator& comm = *comms[static_cast<size_t>(r)];
      Status s = comm.Connect();
      if (s.ok()) s = comm.AllReduce(d);
      results[static_cast<size_t>(r)] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << results[static_cast<size_t>(r)].ToString();
    for (size_t i = 0; i < kFloats; ++i) {
      ASSERT_EQ(data[static_cast<size_t>(r)][i], static_cast<float>(6 * (i % 97)))
          << "rank " << r << ", element " << i;
    }
  }
  for (const auto& p : planes)
    EXPECT_EQ(p->stats().connections_opened, 2) << "a ring of three: two neighbours each";
}

// Two ports the OS says are free now, adjacent: [lo, lo + 1].
net::PortRange TwoFreePorts() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto a = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(a.ok()) << a.status().ToString();
    uint16_t p = a->address.port;
    if (p >= 65535) continue;
    if (net::Listen({"127.0.0.1", static_cast<uint16_t>(p + 1)}).ok())
      return {p, static_cast<uint16_t>(p + 1)};
  }
  return {};
}

// --data-ports: two meshes in a range of two take both ports; a third fails
// with the range named and what to do.
TEST(PeerMeshPortRangeTest, MeshesTakeTheRangesPortsAndTheNextFailsNamingIt) {
  net::PortRange range = TwoFreePorts();
  ASSERT_FALSE(range.empty()) << "no two adjacent free ports on this machine";
  auto make = [&](int worker_id) {
    PeerMeshOptions o;
    o.data_key = WorkerDataKey(crypto::JobKey(kToken));
    o.worker_id = worker_id;
    o.ports = range;
    return PeerMesh::Create(o);
  };
  auto first = make(0);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  auto second = make(1);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ((*first)->address().port, range.lo);
  EXPECT_EQ((*second)->address().port, range.hi);
  auto third = make(2);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(third.status().message(),
            fmt::format("no free data port in {}-{} (2 ports, all in use): widen --data-ports",
                        range.lo, range.hi));
  // The meshes in the range work: worker 0 dials worker 1 on its port.
  auto dialed = std::async(std::launch::async, [&] {
    return (*first)->Get(1, (*second)->address().ToString(), 1, DeadlineAfter(Millis(5'000)),
                         nullptr);
  });
  Result<Connection*> accepted =
      (*second)->Get(0, (*first)->address().ToString(), 1, DeadlineAfter(Millis(5'000)), nullptr);
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  Result<Connection*> d = dialed.get();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  // A port given back is taken again.
  first->reset();
  auto again = make(3);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->address().port, range.lo);
}

// The same over IPv6, where the range is bound on ::1.
TEST(PeerMeshPortRangeTest, RangeWorksOnIpv6) {
  if (std::string why = net::testing::NoIpv6Loopback(); !why.empty()) GTEST_SKIP() << why;
  net::PortRange range = TwoFreePorts();
  ASSERT_FALSE(range.empty());
  PeerMeshOptions o;
  o.data_key = WorkerDataKey(crypto::JobKey(kToken));
  o.worker_id = 0;
  o.listen = {"::1", 0};
  o.ports = {range.lo, range.lo};
  auto mesh = PeerMesh::Create(o);
  ASSERT_TRUE(mesh.ok()) << mesh.status().ToString();
  EXPECT_EQ((*mesh)->address().ToString(), fmt::format("[::1]:{}", range.lo));
  o.worker_id = 1;
  auto full = PeerMesh::Create(o);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(
      full.status().message(),
      fmt::format("no free data port in {} (1 port, it is in use): widen --data-ports", range.lo));
}

}  // namespace
}  // namespace nonstop::collective
