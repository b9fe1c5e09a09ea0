// ControllerLink against real sockets on loopback: a real ControlServer on an
// EventLoop the test turns, or a fake listener the test scripts byte by byte.
// Time is the test's: the link is driven with a `now` that moves only when
// the test moves it, and its randomness is scripted, so the back-off is
// asserted exactly and nothing here is a timed assertion.
#include "control/controller_link.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "common/crypto.h"
#include "common/file_util.h"
#include "common/role_keys.h"
#include "common/temp_dir.h"
#include "control/messages.h"
#include "controller/control_server.h"
#include "coord/etcd.h"
#include "coord/leader_watch.h"
#include "coord/leadership.h"
#include "net/event_loop.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "tests/integration/etcd_server.h"

namespace nonstop::control {
namespace {

using namespace std::chrono_literals;
using Kind = LinkEvent::Kind;

constexpr char kToken[] = "link-test-token";

// An address where nobody listens (the OS gave the port, then it was closed).
std::string ClosedAddress() {
  auto l = net::Listen({"127.0.0.1", 0});
  NONSTOP_CHECK(l.ok()) << l.status().ToString();
  return l->address.ToString();
}

// A worker's link to `controllers`, with the given randomness (default: always 0, no jitter drawn).
ControllerLinkOptions Options(
    std::string controllers, std::function<double()> random = [] { return 0.0; }) {
  ControllerLinkOptions o;
  o.controllers = std::move(controllers);
  o.hello.kind = net::ConnectionKind::kControl;
  o.hello.worker_id = 3;
  o.key = WorkerControlKey(crypto::JobKey(kToken), 3);
  o.controller_public = ControllerPublicKey(crypto::JobKey(kToken));
  o.try_timeout = 2s;
  o.silence_timeout = 5s;
  o.reconnect_within = 60s;
  o.backoff = {100ms, 400ms, 0.5};
  o.random = std::move(random);
  return o;
}

std::unique_ptr<ControllerLink> MakeLink(ControllerLinkOptions o) {
  auto link = ControllerLink::Create(std::move(o));
  NONSTOP_CHECK(link.ok()) << link.status().ToString();
  return std::move(*link);
}

// Drives `link` at the test's time `now` (real sockets, real waits of a few
// ms at a time; `loop`, a ControlServer's, turns too) until `done` holds or
// `budget` of real time passes. The events the link hands out are kept in
// `events`; none is taken once `done` holds (as an owner that drops the
// connection over the event it just took).
bool Drive(ControllerLink& link, Deadline now, std::vector<LinkEvent>* events,
           const std::function<bool()>& done, net::EventLoop* loop = nullptr, Millis budget = 5s) {
  Deadline give_up = DeadlineAfter(budget);
  while (Clock::now() < give_up) {
    if (done()) return true;
    if (loop != nullptr) loop->RunOnce(Millis(0));
    pollfd fds[2] = {{link.fd(), link.events(), 0}, {link.wake_fd(), POLLIN, 0}};
    int rc = ::poll(fds, 2, 2);
    link.Advance(rc > 0 ? fds[0].revents : 0, now);
    while (!done()) {
      auto e = link.Next();
      if (!e) break;
      events->push_back(std::move(*e));
    }
  }
  return done();
}

bool Has(const std::vector<LinkEvent>& events, Kind kind) {
  for (const auto& e : events) {
    if (e.kind == kind) return true;
  }
  return false;
}

// A real ControlServer on a loop the test turns; it records who joined.
struct RealController {
  explicit RealController(int64_t epoch, std::string token = kToken) {
    controller::ControlServerOptions o;
    o.epoch = epoch;
    auto s = controller::ControlServer::Create(
        &loop, {"127.0.0.1", 0}, std::move(token),
        [this](controller::Event e) {
          if (auto* j = std::get_if<controller::WorkerJoined>(&e)) {
            joined.push_back(j->msg.worker_id);
            if (on_join) on_join(j->msg.worker_id);
          }
        },
        o);
    NONSTOP_CHECK(s.ok()) << s.status().ToString();
    server = std::move(*s);
  }
  std::string address() const { return server->address().ToString(); }

  net::EventLoop loop;
  std::unique_ptr<controller::ControlServer> server;
  std::vector<int> joined;
  std::function<void(int)> on_join;
};

// A listener the test scripts: it accepts and then reads and writes by hand.
class FakeController {
 public:
  FakeController() {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok()) << l.status().ToString();
    listener_ = std::move(*l);
  }
  std::string address() const { return listener_.address.ToString(); }
  Result<UniqueFd> Accept(Millis timeout = 5s) {
    NONSTOP_RETURN_IF_ERROR(
        net::WaitFd(listener_.fd.get(), POLLIN, DeadlineAfter(timeout), nullptr, "accept"));
    return net::Accept(listener_.fd.get());
  }

 private:
  net::Listener listener_;
};

// ---- pure parts ----

TEST(BackoffTest, DelayDoublesFromInitialToMaxAndJitterAddsUpToItsFraction) {
  const BackoffPolicy p{100ms, 1'000ms, 0.5};
  struct Row {
    int failures;
    double u;
    Millis want;
  } rows[] = {
      {1, 0.0, 100ms},   {2, 0.0, 200ms},      {3, 0.0, 400ms},
      {4, 0.0, 800ms},   {5, 0.0, 1'000ms},    {9, 0.0, 1'000ms},
      {1, 0.5, 125ms},   {4, 0.5, 1'000ms},    {6, 0.5, 1'250ms},
      {1, 0.999, 149ms}, {40, 0.999, 1'499ms}, {3, 1.5, 600ms},  // u is clamped to [0, 1]
  };
  for (const Row& r : rows) {
    EXPECT_EQ(BackoffDelay(p, r.failures, r.u), r.want)
        << "failures " << r.failures << ", u " << r.u;
  }
  EXPECT_EQ(BackoffDelay({100ms, 1'000ms, 0.0}, 2, 0.9), 200ms) << "no jitter";
}

TEST(ControllerListTest, ParsesEveryAddressAndRefusesBadOnes) {
  auto two = ParseControllerList("10.0.0.1:29400,ctl-b:29401");
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[0].ToString(), "10.0.0.1:29400");
  EXPECT_EQ((*two)[1].ToString(), "ctl-b:29401");
  EXPECT_FALSE(ParseControllerList("a:1,").ok()) << "an empty item";
  EXPECT_FALSE(ParseControllerList("a:1,b").ok()) << "no port";
  EXPECT_NE(ParseControllerList("a:0").status().message().find("port 0"), std::string::npos);
  EXPECT_FALSE(ControllerLink::Create(Options("")).ok()) << "no list and no etcd";
}

// ---- against servers ----

TEST(ControllerLinkTest, DialsTheSecondAddressAtOnceWhenTheFirstRefusesAndJoinsIt) {
  RealController b(/*epoch=*/7);
  const std::string a = ClosedAddress();
  auto link = MakeLink(Options(a + "," + b.address()));
  const Deadline t0 = Clock::now();
  link->Start(t0 + 60s, t0);
  std::vector<LinkEvent> events;
  // The first address refuses: the next one is due at once (no back-off within a round).
  ASSERT_TRUE(Drive(*link, t0, &events, [&] {
    return link->state() == ControllerLink::State::kWaiting && link->controller() == a &&
           !link->last_error().empty();
  }));
  EXPECT_EQ(link->last_error(), "connection refused");
  EXPECT_EQ(link->wake_at(), t0);
  ASSERT_TRUE(Drive(
      *link, t0, &events, [&] { return Has(events, Kind::kAccepted); }, &b.loop));
  EXPECT_EQ(link->controller(), b.address());
  EXPECT_FALSE(link->open());
  EXPECT_EQ(link->Send(kMsgHeartbeat, "{}").code(), StatusCode::kUnavailable)
      << "nothing goes out before Open()";
  JoinMsg join;
  join.worker_id = 3;
  ASSERT_TRUE(link->Open({{kMsgJoin, Encode(join)}}).ok());
  // The controller's first frame, a ping, carries its epoch; the link keeps it and the owner never
  // sees it.
  ASSERT_TRUE(Drive(
      *link, t0, &events, [&] { return link->epoch() == 7; }, &b.loop));
  EXPECT_EQ(b.joined, std::vector<int>{3});
  EXPECT_FALSE(Has(events, Kind::kFrame));
  EXPECT_TRUE(link->Send(kMsgHeartbeat, Encode(HeartbeatMsg{5, -1})).ok());
}

TEST(ControllerLinkTest, BacksOffWithJitterWithinTheBoundsAfterEachRound) {
  // Two addresses that refuse: the second of each round is dialed at once,
  // and each failed round waits min(100 ms·2^(n−1), 400 ms) plus u/2 of it.
  std::deque<double> u = {0.0, 0.5, 0.999, 0.2, 0.6};
  const std::vector<Millis> want = {100ms, 250ms, 599ms, 440ms, 520ms};
  const std::vector<std::string> addresses = {ClosedAddress(), ClosedAddress()};
  auto link = MakeLink(Options(addresses[0] + "," + addresses[1], [&] {
    double next = u.front();
    u.pop_front();
    return next;
  }));
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  std::vector<LinkEvent> events;
  for (size_t round = 0; round < want.size(); ++round) {
    for (size_t address = 0; address < 2; ++address) {
      link->Advance(0, now);  // the try that is due (it may fail at once: loopback refuses quickly)
      ASSERT_TRUE(Drive(*link, now, &events,
                        [&] { return link->state() == ControllerLink::State::kWaiting; }));
      EXPECT_EQ(link->controller(), addresses[address]) << "round " << round;
      EXPECT_EQ(link->last_error(), "connection refused");
      if (address == 0) {
        EXPECT_EQ(link->wake_at(), now) << "the next address of the round at once";
      }
    }
    const Millis waited = std::chrono::duration_cast<Millis>(link->wake_at() - now);
    EXPECT_EQ(waited, want[round]) << "round " << round;
    const Millis bound = std::min(Millis(100 << round), Millis(400));
    EXPECT_GE(waited, bound);
    EXPECT_LT(waited, bound * 3 / 2);
    link->Advance(0, now + waited - 1ms);
    EXPECT_EQ(link->state(), ControllerLink::State::kWaiting) << "dialed before its back-off ended";
    now += waited;
  }
  EXPECT_TRUE(events.empty());
  // The give-up time ends it with the last try's error.
  link->set_give_up_at(now);
  link->Advance(0, now);
  ASSERT_EQ(link->state(), ControllerLink::State::kFailed);
  auto e = link->Next();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->kind, Kind::kFailed);
  EXPECT_EQ(e->status.message(), "connection refused");
}

TEST(ControllerLinkTest, RefusesAControllerOfAnOlderEpochAndNothingItSendsAfterItsPing) {
  auto leader = std::make_unique<RealController>(/*epoch=*/5);
  RealController deposed(/*epoch=*/3);
  // The deposed leader's order right behind its ping (a plan, ControlServer::Send's queue).
  deposed.on_join = [&](int worker_id) {
    PlanMsg plan;
    plan.generation = 9;
    plan.members = {{worker_id, "127.0.0.1:1"}};
    deposed.server->Send(worker_id, kMsgPlan, Encode(plan));
  };
  const std::string leader_address = leader->address();
  auto link = MakeLink(Options(leader_address + "," + deposed.address()));
  JoinMsg join;
  join.worker_id = 3;
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  std::vector<LinkEvent> events;
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return Has(events, Kind::kAccepted); }, &leader->loop));
  ASSERT_TRUE(link->Open({{kMsgJoin, Encode(join)}}).ok());
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return link->epoch() == 5; }, &leader->loop));
  // The leader of epoch 5 dies: the link dials again at once, and the next address answers.
  leader.reset();
  events.clear();
  ASSERT_TRUE(Drive(*link, now, &events, [&] { return Has(events, Kind::kLost); }));
  EXPECT_EQ(events.back().status.message(), "the controller closed the connection");
  EXPECT_EQ(link->wake_at(), now) << "a loss is dialed again at once";
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return Has(events, Kind::kAccepted); }, &deposed.loop));
  EXPECT_EQ(link->controller(), deposed.address());
  ASSERT_TRUE(link->Open({{kMsgJoin, Encode(join)}}).ok());
  events.clear();
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return Has(events, Kind::kLost); }, &deposed.loop));
  EXPECT_EQ(deposed.joined, std::vector<int>{3});
  ASSERT_EQ(events.size(), 1u) << "the deposed leader's plan reached the owner";
  EXPECT_NE(events[0].status.message().find("is of epoch 3, older than epoch 5 that led already"),
            std::string::npos)
      << events[0].status.ToString();
  EXPECT_EQ(link->epoch(), 5);
  EXPECT_FALSE(link->open());
  EXPECT_GT(link->wake_at(), now) << "a deposed leader is not redialed in a tight loop";
}

// A controller of another job (or this link's token is wrong, or an impostor) cannot prove the
// job key: the link never sends its proof nor its join, dials again after the back-off, and after
// three such tries in a row, never having been accepted, gives up naming the likely fix.
TEST(ControllerLinkTest, AControllerThatCannotProveTheJobKeyIsNeverJoinedAndEndsTheSearch) {
  RealController other_job(/*epoch=*/1, "another-jobs-token");
  auto link = MakeLink(Options(other_job.address()));
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  std::vector<LinkEvent> events;
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return !link->last_error().empty(); }, &other_job.loop));
  EXPECT_NE(link->last_error().find("did not prove the job key"), std::string::npos)
      << link->last_error();
  EXPECT_EQ(link->state(), ControllerLink::State::kWaiting) << "retried, not final at once";
  EXPECT_EQ(link->wake_at(), now + 100ms) << "after the back-off";
  for (int tries = 1; tries < 3; ++tries) {
    now = link->wake_at();
    ASSERT_TRUE(Drive(
        *link, now, &events,
        [&] {
          return link->state() == ControllerLink::State::kFailed ||
                 (link->state() == ControllerLink::State::kWaiting && link->wake_at() > now);
        },
        &other_job.loop));
  }
  while (auto e = link->Next()) events.push_back(std::move(*e));
  ASSERT_TRUE(Has(events, Kind::kFailed)) << link->last_error();
  EXPECT_EQ(events.back().status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(events.back().status.message().find("3 tries in a row"), std::string::npos)
      << events.back().status.ToString();
  EXPECT_NE(events.back().status.message().find("job token"), std::string::npos);
  EXPECT_TRUE(other_job.joined.empty());
  EXPECT_EQ(other_job.server->refused_connections(), 0) << "the link left before its proof";
}

TEST(ControllerLinkTest, GarbageFromTheServerClosesTheConnectionWithAClearErrorAndIsRetried) {
  FakeController fake;
  auto link = MakeLink(Options(fake.address(), [] { return 0.5; }));
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  std::vector<LinkEvent> events;
  // 1. An answer to the hello that is not a frame at all (an HTTP server, say).
  std::thread server([&] {
    auto c = fake.Accept();
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto hello = net::ReadFrame(c->get(), DeadlineAfter(5s), nullptr, net::kMaxHandshakeBytes);
    ASSERT_TRUE(hello.ok()) << hello.status().ToString();
    const std::string garbage = "HTTP/1.1 400 Bad Request\r\n\r\n";
    ASSERT_TRUE(net::SendAll(c->get(), std::as_bytes(std::span(garbage)), DeadlineAfter(5s),
                             nullptr, "garbage")
                    .ok());
    net::WaitFd(c->get(), POLLIN, DeadlineAfter(5s), nullptr, "close")
        .IgnoreError();  // until the link closes it
  });
  ASSERT_TRUE(Drive(*link, now, &events, [&] { return !link->last_error().empty(); }));
  server.join();
  EXPECT_NE(link->last_error().find("corrupt frame"), std::string::npos) << link->last_error();
  EXPECT_EQ(link->state(), ControllerLink::State::kWaiting) << "garbage is retried";
  EXPECT_EQ(link->fd(), -1) << "and its connection closed";
  EXPECT_EQ(link->wake_at(), now + 125ms) << "after the back-off (100 ms, and u = 0.5 of its half)";
  now = link->wake_at();
  // 2. The next try meets a controller, which sends a corrupt frame after the join.
  server = std::thread([&] {
    auto c = fake.Accept();
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    auto accepted = net::ServerHandshake(c->get(), net::JobRoles(crypto::JobKey(kToken)),
                                         net::ConnectionKind::kControl, DeadlineAfter(5s), nullptr);
    ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
    auto join = net::ReadFrame(c->get(), DeadlineAfter(5s), nullptr);
    ASSERT_TRUE(join.ok()) << join.status().ToString();
    std::string ping = accepted->channel.send->Seal(kMsgPing, Encode(PingMsg{2}));
    std::string plan = accepted->channel.send->Seal(kMsgPlan, "{}");
    plan[8] ^= 0x5a;  // the CRC no longer matches
    const std::string bytes = ping + plan;
    ASSERT_TRUE(net::SendAll(c->get(), std::as_bytes(std::span(bytes)), DeadlineAfter(5s), nullptr,
                             "frames")
                    .ok());
    net::WaitFd(c->get(), POLLIN, DeadlineAfter(5s), nullptr, "close").IgnoreError();
  });
  events.clear();
  ASSERT_TRUE(Drive(*link, now, &events, [&] { return Has(events, Kind::kAccepted); }));
  ASSERT_TRUE(link->Open({{kMsgJoin, Encode(JoinMsg{3, 1, "127.0.0.1:2", false, -1, ""})}}).ok());
  ASSERT_TRUE(Drive(*link, now, &events, [&] { return Has(events, Kind::kLost); }));
  server.join();
  EXPECT_EQ(link->epoch(), 2) << "the ping before the corrupt frame counted";
  EXPECT_FALSE(Has(events, Kind::kFrame));
  EXPECT_EQ(events.back().status.code(), StatusCode::kDataLoss);
  EXPECT_NE(events.back().status.message().find("corrupt frame"), std::string::npos)
      << events.back().status.ToString();
  EXPECT_EQ(link->state(), ControllerLink::State::kWaiting);
  EXPECT_EQ(link->wake_at(), now + 125ms) << "garbage after the hello waits too";
}

// A frame altered on the way (its checksum made to match again, as an attacker would) or
// injected fails its MAC: the connection is lost over it, the frame never reaches the owner, and
// it is counted.
TEST(ControllerLinkTest, AnAlteredOrInjectedFrameIsRefusedCountedAndCostsTheConnection) {
  FakeController fake;
  auto link = MakeLink(Options(fake.address()));
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  for (bool inject : {false, true}) {
    std::thread server([&] {
      auto c = fake.Accept();
      ASSERT_TRUE(c.ok()) << c.status().ToString();
      auto accepted =
          net::ServerHandshake(c->get(), net::JobRoles(crypto::JobKey(kToken)),
                               net::ConnectionKind::kControl, DeadlineAfter(5s), nullptr);
      ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
      ASSERT_TRUE(net::ReadFrame(c->get(), DeadlineAfter(5s), nullptr).ok());  // the join
      std::string bytes = accepted->channel.send->Seal(kMsgPing, Encode(PingMsg{2}));
      if (inject) {
        bytes += net::EncodeFrame(kMsgShutdown, Encode(ShutdownMsg{"injected", 0}));
      } else {
        std::string order = Encode(AbortMsg{1, "genuine"});
        std::string sealed = accepted->channel.send->Seal(kMsgAbort, order);
        std::string altered = sealed.substr(net::kFrameHeaderBytes);
        altered[order.find("genuine")] = 'G';
        bytes += net::EncodeFrame(kMsgAbort, altered);  // a checksum that matches again
      }
      ASSERT_TRUE(net::SendAll(c->get(), std::as_bytes(std::span(bytes)), DeadlineAfter(5s),
                               nullptr, "frames")
                      .ok());
      net::WaitFd(c->get(), POLLIN, DeadlineAfter(5s), nullptr, "close").IgnoreError();
    });
    std::vector<LinkEvent> events;
    ASSERT_TRUE(Drive(*link, now, &events, [&] { return Has(events, Kind::kAccepted); }));
    ASSERT_TRUE(link->Open({{kMsgJoin, Encode(JoinMsg{3, 1, "127.0.0.1:2", false, -1, ""})}}).ok());
    ASSERT_TRUE(Drive(*link, now, &events, [&] { return Has(events, Kind::kLost); }));
    server.join();
    EXPECT_FALSE(Has(events, Kind::kFrame)) << (inject ? "injected" : "altered");
    EXPECT_NE(events.back().status.message().find("fails its MAC"), std::string::npos)
        << events.back().status.ToString();
    EXPECT_EQ(link->refused_frames(), inject ? 2 : 1);
    now = link->wake_at();
  }
}

// The owner drops a connection over a malformed order: garbage, so the
// redial waits, longer each time in a row; a frame it keeps clears the count.
TEST(ControllerLinkTest, OrdersTheOwnerFindsMalformedAreRetriedAfterAGrowingPause) {
  RealController c(/*epoch=*/1);
  c.on_join = [&](int worker_id) {
    c.server->Send(worker_id, kMsgAbort, Encode(AbortMsg{1, "x"}));
  };
  auto link = MakeLink(Options(c.address()));
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  JoinMsg join;
  join.worker_id = 3;
  std::vector<Millis> waits;
  for (int i = 0; i < 3; ++i) {
    std::vector<LinkEvent> events;
    ASSERT_TRUE(Drive(
        *link, now, &events, [&] { return Has(events, Kind::kAccepted); }, &c.loop));
    ASSERT_TRUE(link->Open({{kMsgJoin, Encode(join)}}).ok());
    ASSERT_TRUE(Drive(
        *link, now, &events, [&] { return Has(events, Kind::kFrame); }, &c.loop));
    link->Drop(InvalidArgumentError("malformed order"), now);
    EXPECT_EQ(link->state(), ControllerLink::State::kWaiting);
    EXPECT_EQ(link->last_error(), "malformed order");
    waits.push_back(std::chrono::duration_cast<Millis>(link->wake_at() - now));
    // The server forgets the worker (its connection closed) before the link joins again.
    ASSERT_TRUE(Drive(
        *link, now, &events, [&] { return c.server->open_connections() == 0; }, &c.loop));
    now = link->wake_at();
  }
  EXPECT_EQ(waits, (std::vector<Millis>{100ms, 200ms, 400ms}));
}

// With etcd (a real one): the link dials whom the leader key names. While
// nobody leads, or the leader it names does not answer (it died, and its
// lease has not run out), it asks again after leader_poll, without growing
// the back-off; a job that ended there is final, with the job's exit code.
TEST(ControllerLinkEtcdTest, DialsTheLeaderEtcdNamesAsksAgainSoonWhileItIsGoneAndEndsWithTheJob) {
  if (::access(nonstop::testing::EtcdServer::kBinary, X_OK) != 0) GTEST_SKIP() << "no etcd here";
  TempDir dir;
  nonstop::testing::EtcdServer etcd_server(dir.path());
  ASSERT_FALSE(etcd_server.endpoint().empty()) << etcd_server.Output();
  auto client = etcd::Client::Create(etcd_server.endpoint());
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  const std::string job = "link-test";
  // The value a leader holding the job token publishes: MAC'd, with the key's create revision as
  // its epoch (the key is made first, then given its value).
  auto name_leader = [&](const std::string& address) {
    auto kvs = (*client)->Range(coord::LeaderKey(job));
    ASSERT_TRUE(kvs.ok());
    int64_t epoch = kvs->empty() ? 0 : (*kvs)[0].create_revision;
    if (epoch == 0) {
      auto created = (*client)->Put(coord::LeaderKey(job), R"({"pid":1})");
      ASSERT_TRUE(created.ok());
      epoch = *created;
    }
    ASSERT_TRUE((*client)
                    ->Put(coord::LeaderKey(job),
                          coord::SignLeaderValue(crypto::JobKey(kToken), job,
                                                 {{"controller", address}, {"epoch", epoch}}))
                    .ok());
  };
  ControllerLinkOptions o = Options("");
  o.etcd = etcd_server.endpoint();
  o.etcd_job = job;
  o.etcd_timeout = 2s;
  o.leader_poll = 30ms;  // the back-off starts at 100 ms: the two never meet
  auto link = MakeLink(o);
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  std::vector<LinkEvent> events;
  // Nobody leads yet.
  link->Advance(0, now);
  EXPECT_EQ(link->state(), ControllerLink::State::kWaiting);
  EXPECT_NE(link->last_error().find("no controller leads job 'link-test'"), std::string::npos)
      << link->last_error();
  EXPECT_EQ(link->wake_at(), now + 30ms);
  // The leader it names is gone: asked again soon, each time.
  const std::string gone = ClosedAddress();
  name_leader(gone);
  for (int i = 0; i < 3; ++i) {
    now = link->wake_at();
    link->Advance(0, now);
    ASSERT_TRUE(Drive(*link, now, &events,
                      [&] { return link->state() == ControllerLink::State::kWaiting; }));
    EXPECT_EQ(link->controller(), gone);
    EXPECT_EQ(link->last_error(), "connection refused");
    EXPECT_EQ(link->wake_at(), now + 30ms) << "try " << i;
  }
  // The next leader publishes its address.
  RealController next(/*epoch=*/4);
  name_leader(next.address());
  now = link->wake_at();
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return Has(events, Kind::kAccepted); }, &next.loop));
  EXPECT_EQ(link->controller(), next.address());
  JoinMsg join;
  join.worker_id = 3;
  ASSERT_TRUE(link->Open({{kMsgJoin, Encode(join)}}).ok());
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return link->epoch() == 4; }, &next.loop));
  // The job ends in etcd, then its leader goes: final, with the job's exit code.
  auto ended =
      (*client)->Txn({}, {etcd::Op::Put(coord::JobPrefix(job) + "end",
                                        coord::SignEndValue(crypto::JobKey(kToken), job,
                                                            R"({"exit_code":3,"reason":"done"})")),
                          etcd::Op::Delete(coord::LeaderKey(job))});
  ASSERT_TRUE(ended.ok()) << ended.status().ToString();
  next.server.reset();
  events.clear();
  ASSERT_TRUE(Drive(*link, now, &events, [&] { return Has(events, Kind::kFailed); }));
  EXPECT_EQ(events.back().status.code(), StatusCode::kAborted) << events.back().status.ToString();
  EXPECT_EQ(link->job_exit_code(), 3);
}

// The leader file of the host's agent (docs/leader-discovery.md) instead of etcd: etcd here is an
// address where nobody listens, so a try that asked it would fail otherwise.
TEST(ControllerLinkLeaderFileTest, FollowsTheAgentsLeaderFileWithoutAskingEtcd) {
  TempDir dir;
  const std::string path = dir / "leader.json";
  // A leader value MAC'd with the job key, for the key of epoch 7.
  auto genuine = [](const std::string& address) {
    return coord::SignLeaderValue(crypto::JobKey(kToken), "link-test",
                                  {{"controller", address}, {"epoch", 7}});
  };
  auto write = [&](std::optional<std::string> leader, std::optional<std::string> end) {
    coord::LeaderKeys keys;
    keys.job = "link-test";
    keys.leader = std::move(leader);
    keys.leader_epoch = 7;
    keys.end = std::move(end);
    ASSERT_TRUE(WriteFileAtomically(path, coord::EncodeLeaderFile(keys)).ok());
  };
  ControllerLinkOptions o = Options("");
  o.etcd = ClosedAddress();
  o.etcd_job = "link-test";
  o.leader_file = path;
  o.leader_poll = 30ms;
  auto link = MakeLink(o);
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  std::vector<LinkEvent> events;
  // No file yet (the agent has not read etcd): it waits for one, reading it again soon.
  link->Advance(0, now);
  EXPECT_EQ(link->state(), ControllerLink::State::kWaiting);
  EXPECT_NE(link->last_error().find("has not written the leader file"), std::string::npos)
      << link->last_error();
  // ...and says where to look if that lasts: the agent's log line for its watch.
  EXPECT_NE(link->last_error().find("agent's log for \"the watch of job 'link-test''s leader key"),
            std::string::npos)
      << link->last_error();
  EXPECT_EQ(link->wake_at(), now + 30ms);
  // The file names a leader that is gone: read again after the poll, or at once when the owner
  // says the file changed.
  const std::string gone = ClosedAddress();
  write(genuine(gone), std::nullopt);
  now = link->wake_at();
  link->Advance(0, now);
  ASSERT_TRUE(
      Drive(*link, now, &events, [&] { return link->state() == ControllerLink::State::kWaiting; }));
  EXPECT_EQ(link->controller(), gone);
  EXPECT_EQ(link->wake_at(), now + 30ms);
  EXPECT_NE(link->last_error().find("agent's log"), std::string::npos) << link->last_error();
  RealController next(/*epoch=*/5);
  // A value without the job key's MAC (whoever wrote it does not hold the job token) names the
  // next leader: not followed, the link goes on waiting and says why.
  write(fmt::format(R"({{"controller":"{}","epoch":7}})", next.address()), std::nullopt);
  link->LeaderChanged(now);
  link->Advance(0, now);
  EXPECT_EQ(link->state(), ControllerLink::State::kWaiting);
  EXPECT_NE(link->last_error().find("not followed"), std::string::npos) << link->last_error();
  EXPECT_NE(link->controller(), next.address());
  write(genuine(next.address()), std::nullopt);
  link->LeaderChanged(now);
  EXPECT_EQ(link->wake_at(), now) << "the news did not cut the wait short";
  ASSERT_TRUE(Drive(
      *link, now, &events, [&] { return Has(events, Kind::kAccepted); }, &next.loop));
  EXPECT_EQ(link->controller(), next.address());
  // The job ends: the file says so once its leader is gone; final, with the job's exit code.
  write(std::nullopt, coord::SignEndValue(crypto::JobKey(kToken), "link-test",
                                          R"({"exit_code":4,"reason":"done"})"));
  link->Stop();
  events.clear();
  link->Start(now + 60s, now);
  ASSERT_TRUE(Drive(*link, now, &events, [&] { return Has(events, Kind::kFailed); }));
  EXPECT_EQ(events.back().status.code(), StatusCode::kAborted) << events.back().status.ToString();
  EXPECT_EQ(link->job_exit_code(), 4);
}

// A leader file of another job (an agent's file handed to a worker of another job) is not
// followed: the error names both jobs.
TEST(ControllerLinkLeaderFileTest, DoesNotFollowAnotherJobsLeaderFile) {
  TempDir dir;
  const std::string path = dir / "leader.json";
  RealController other(/*epoch=*/1);
  coord::LeaderKeys keys;
  keys.job = "other-job";
  keys.leader = fmt::format(R"({{"controller":"{}"}})", other.address());
  ASSERT_TRUE(WriteFileAtomically(path, coord::EncodeLeaderFile(keys)).ok());
  ControllerLinkOptions o = Options("");
  o.etcd = ClosedAddress();
  o.etcd_job = "link-test";
  o.leader_file = path;
  auto link = MakeLink(o);
  Deadline now = Clock::now();
  link->Start(now + 60s, now);
  link->Advance(0, now);
  EXPECT_EQ(link->state(), ControllerLink::State::kWaiting);
  EXPECT_NE(link->controller(), other.address());
  EXPECT_NE(link->last_error().find("'other-job'"), std::string::npos) << link->last_error();
  EXPECT_NE(link->last_error().find("'link-test'"), std::string::npos) << link->last_error();
}

}  // namespace
}  // namespace nonstop::control
