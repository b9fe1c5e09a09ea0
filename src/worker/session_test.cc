// Session against a scripted controller on loopback: the control-plane races
// that the multi-process tests cannot drive deterministically.
#include "nonstop/session.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "collective/peer_mesh.h"
#include "collective/staged_communicator.h"
#include "common/role_keys.h"
#include "control/messages.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "state/protected_device_testing.h"
#include "worker/session_testing.h"

namespace nonstop {
namespace {

// A controller that accepts one worker, and a silent second member (a real
// data port that accepts connections but never takes part in a collective).
class ScriptedJob {
 public:
  ScriptedJob() {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok());
    listener_ = std::move(*l);
    collective::PeerMeshOptions mo;
    mo.data_key = WorkerDataKey(crypto::JobKey("tok"));
    mo.worker_id = 1;
    auto mesh = collective::PeerMesh::Create(mo);
    NONSTOP_CHECK(mesh.ok());
    peer_ = std::move(*mesh);
  }

  std::string address() const { return listener_.address.ToString(); }

  // Accepts the worker's control connection and answers its join with a
  // plan of two members: the worker (rank 0) and the silent peer (rank 1);
  // `edit` may spoil it.
  void AcceptAndPlan(std::function<void(control::PlanMsg&)> edit = nullptr) {
    Accept();
    control::JoinMsg join;
    while (true) {
      auto f = net::ReadSealedFrame(control_.get(), *channel_.recv, DeadlineAfter(Millis(5000)),
                                    nullptr);
      NONSTOP_CHECK(f.ok()) << f.status().ToString();
      if (f->type != control::kMsgJoin) continue;
      join = *control::DecodeJoin(f->payload);
      break;
    }
    control::PlanMsg plan;
    plan.generation = 1;
    plan.resume_step = 0;
    plan.reason = "start";
    plan.members = {{join.worker_id, join.data_address}, {1, peer_->address().ToString()}};
    if (edit) edit(plan);
    Send(control::kMsgPlan, control::Encode(plan));
  }

  // Accepts the worker's control connection and its handshake, and no more.
  void Accept() {
    NONSTOP_CHECK(
        net::WaitFd(listener_.fd.get(), POLLIN, DeadlineAfter(Millis(10'000)), nullptr, "accept")
            .ok());
    auto fd = net::Accept(listener_.fd.get());
    NONSTOP_CHECK(fd.ok());
    control_ = std::move(*fd);
    auto accepted =
        net::ServerHandshake(control_.get(), net::JobRoles(crypto::JobKey("tok")),
                             net::ConnectionKind::kControl, DeadlineAfter(Millis(5000)), nullptr);
    NONSTOP_CHECK(accepted.ok()) << accepted.status().ToString();
    channel_ = std::move(accepted->channel);
  }

  // The controller's end of the connection closes (a controller dies).
  void Close() {
    std::lock_guard<std::mutex> lock(write_mu_);
    control_.Reset();
  }

  // Accepts the worker's next control connection (it dials again) and reads its join.
  Result<control::JoinMsg> AcceptJoin() {
    NONSTOP_RETURN_IF_ERROR(
        net::WaitFd(listener_.fd.get(), POLLIN, DeadlineAfter(Millis(10'000)), nullptr, "accept"));
    NONSTOP_ASSIGN_OR_RETURN(UniqueFd fd, net::Accept(listener_.fd.get()));
    NONSTOP_ASSIGN_OR_RETURN(
        net::Accepted accepted,
        net::ServerHandshake(fd.get(), net::JobRoles(crypto::JobKey("tok")),
                             net::ConnectionKind::kControl, DeadlineAfter(Millis(5000)), nullptr));
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      control_ = std::move(fd);
      channel_ = std::move(accepted.channel);
    }
    NONSTOP_ASSIGN_OR_RETURN(net::Frame f, Expect(control::kMsgJoin));
    return control::DecodeJoin(f.payload);
  }

  // True when the worker closes the connection within `timeout` (what it sends meanwhile is
  // skipped).
  bool ClosedByWorker(Millis timeout) {
    Deadline deadline = DeadlineAfter(timeout);
    while (true) {
      auto f = net::ReadSealedFrame(control_.get(), *channel_.recv, deadline, nullptr);
      if (f.ok()) continue;
      return f.status().code() == StatusCode::kUnavailable;
    }
  }

  // Waits for the worker's next message of `type`.
  Result<net::Frame> Expect(uint16_t type) {
    while (true) {
      NONSTOP_ASSIGN_OR_RETURN(net::Frame f,
                               net::ReadSealedFrame(control_.get(), *channel_.recv,
                                                    DeadlineAfter(Millis(10'000)), nullptr));
      if (f.type == type) return f;
    }
  }

  void Send(uint16_t type, const std::string& payload) {
    std::lock_guard<std::mutex> lock(write_mu_);
    NONSTOP_CHECK(net::WriteSealedFrame(control_.get(), *channel_.send, type, payload,
                                        DeadlineAfter(Millis(5000)), nullptr)
                      .ok());
  }

  // Reads and drops what the worker sends (heartbeats, progress), so that its writes never block.
  void StartDraining() {
    drain_thread_ = std::jthread([this](std::stop_token st) {
      while (!st.stop_requested()) {
        auto f = net::ReadSealedFrame(control_.get(), *channel_.recv, DeadlineAfter(Millis(100)),
                                      nullptr);
        if (!f.ok() && f.status().code() != StatusCode::kDeadlineExceeded) return;
      }
    });
  }

 private:
  net::Listener listener_;
  std::unique_ptr<collective::PeerMesh> peer_;
  UniqueFd control_;
  net::Channel channel_;  // control_'s session keys
  std::mutex write_mu_;
  std::jthread drain_thread_;
};

// A worker (id 0) joined to a ScriptedJob, and a way to wait until its I/O
// thread has handled a Drain.
class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(state_.Register("params", std::as_writable_bytes(std::span(params_))).ok());
    // Installed before any session starts: its I/O thread reads the seam.
    testing::control_frame_hook = [this](uint16_t type) {
      if (type != control::kMsgDrain) return;
      std::lock_guard<std::mutex> lock(mu_);
      drained_ = true;
      cv_.notify_all();
    };
  }
  void TearDown() override {
    testing::before_collective_hook = nullptr;
    testing::control_frame_hook = nullptr;
    testing::before_plan_decode_hook = nullptr;
  }

  // Joins; `controller` plays the controller's side (AcceptAndPlan by default).
  Result<std::unique_ptr<Session>> Join(std::function<void()> controller = nullptr,
                                        SessionOptions o = {}) {
    std::thread t(controller ? controller : [this] { job_.AcceptAndPlan(); });
    o.controller_address = job_.address();
    o.secret = "tok";
    o.worker_id = 0;
    o.timeout_collective = Millis(3000);  // what a member left blocked would wait for
    auto session = Session::Join(o, &state_);
    t.join();
    return session;
  }

  void WaitForDrain() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return drained_; });
  }
  void SendDrainAfterStep0() {
    job_.Send(control::kMsgDrain, control::Encode(control::DrainMsg{1, 0, "resize on request"}));
  }

  ScriptedJob job_;
  state::StateRegistry state_;
  std::vector<float> params_ = std::vector<float>(16, 1.0f);
  std::mutex mu_;
  std::condition_variable cv_;
  bool drained_ = false;
};

// The worker variables that are ints in a range: a value in it is taken, one outside it or
// not a number is refused naming the variable and the range.
TEST(SessionOptionsTest, RangedIntVariablesAreTakenOrRefusedNamingTheirRange) {
  ::setenv("NONSTOP_CONTROLLER", "127.0.0.1:1", 1);
  ::setenv("NONSTOP_JOB_TOKEN", "t", 1);
  ::setenv("NONSTOP_WORKER_ID", "3", 1);
  ::setenv("NONSTOP_REPLICA_CHECK_EVERY", "7", 1);
  ::setenv("NONSTOP_MASTER_PORT", "29600", 1);
  Result<SessionOptions> o = SessionOptions::FromEnvironment();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->replica_check_every, 7);
  EXPECT_EQ(o->master_port, 29600);
  ::setenv("NONSTOP_MASTER_PORT", "70000", 1);
  o = SessionOptions::FromEnvironment();
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(o.status().message().find("NONSTOP_MASTER_PORT='70000' is not a port from 1 to 65535"),
            std::string::npos)
      << o.status().ToString();
  ::setenv("NONSTOP_MASTER_PORT", "29600", 1);
  ::setenv("NONSTOP_REPLICA_CHECK_EVERY", "5x", 1);
  o = SessionOptions::FromEnvironment();
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("NONSTOP_REPLICA_CHECK_EVERY='5x' is not a number of steps "
                                      "from 0 to 1000000 (0: never compare the replicas)"),
            std::string::npos)
      << o.status().ToString();
  ::setenv("NONSTOP_REPLICA_CHECK_EVERY", "7", 1);
  ::setenv("NONSTOP_SPARE_CHECK_MS", "250", 1);
  o = SessionOptions::FromEnvironment();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->spare_check_interval, Millis(250));
  for (const char* bad : {"0", "86400001", "1s"}) {
    ::setenv("NONSTOP_SPARE_CHECK_MS", bad, 1);
    o = SessionOptions::FromEnvironment();
    ASSERT_FALSE(o.ok()) << bad;
    EXPECT_NE(
        o.status().message().find(fmt::format(
            "NONSTOP_SPARE_CHECK_MS='{}' is not a number of milliseconds from 1 to 86400000", bad)),
        std::string::npos)
        << o.status().ToString();
  }
  for (const char* v :
       {"NONSTOP_CONTROLLER", "NONSTOP_JOB_TOKEN", "NONSTOP_WORKER_ID",
        "NONSTOP_REPLICA_CHECK_EVERY", "NONSTOP_MASTER_PORT", "NONSTOP_SPARE_CHECK_MS"})
    ::unsetenv(v);
}

// The switches (1/0, true/false): taken, or refused naming the variable and what it switches.
TEST(SessionOptionsTest, SwitchVariablesAreTakenOrRefusedNamingWhatTheySwitch) {
  ::setenv("NONSTOP_CONTROLLER", "127.0.0.1:1", 1);
  ::setenv("NONSTOP_JOB_TOKEN", "t", 1);
  ::setenv("NONSTOP_WORKER_ID", "3", 1);
  Result<SessionOptions> o = SessionOptions::FromEnvironment();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_FALSE(o->sealed_state_copy);
  EXPECT_FALSE(o->checked_collectives);
  ::setenv("NONSTOP_SEALED_STATE_COPY", "1", 1);
  ::setenv("NONSTOP_CHECKED_COLLECTIVES", "true", 1);
  o = SessionOptions::FromEnvironment();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->sealed_state_copy);
  EXPECT_TRUE(o->checked_collectives);
  ::setenv("NONSTOP_SEALED_STATE_COPY", "yes", 1);
  o = SessionOptions::FromEnvironment();
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("NONSTOP_SEALED_STATE_COPY='yes' is not 1 or 0 (true or "
                                      "false): whether every chunk of a state copy carries a tag"),
            std::string::npos)
      << o.status().ToString();
  for (const char* v : {"NONSTOP_CONTROLLER", "NONSTOP_JOB_TOKEN", "NONSTOP_WORKER_ID",
                        "NONSTOP_SEALED_STATE_COPY", "NONSTOP_CHECKED_COLLECTIVES"})
    ::unsetenv(v);
}

TEST_F(SessionTest, DrainArrivingJustAsTheCollectiveStartsEndsItInsteadOfBlocking) {
  auto session = Join();
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  job_.StartDraining();
  (*session)->ReportStep({0, 1.0, 0.1, 1});  // step 0 complete: the boundary after step 0 is next
  // The Drain for the boundary after step 0 lands in the window between the
  // Session's drain check and the start of the collective of step 1; the
  // hook waits until the I/O thread has handled it.
  testing::before_collective_hook = [&] {
    SendDrainAfterStep0();
    WaitForDrain();
  };
  std::vector<float> grads(16, 1.0f);
  Status s = (*session)->AllReduce(grads);
  // Before the fix the member stayed in a collective its peers had left (the
  // silent peer here) until timeout_collective: DEADLINE_EXCEEDED, a planned
  // resize turned into a fault.
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("step boundary"), std::string::npos) << s.ToString();
}

TEST_F(SessionTest, BarrierAndBroadcastHonourADrainLikeAllReduce) {
  auto session = Join();
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  job_.StartDraining();
  (*session)->ReportStep({0, 1.0, 0.1, 1});
  SendDrainAfterStep0();
  WaitForDrain();
  EXPECT_EQ((*session)->Barrier().code(), StatusCode::kAborted);
  std::vector<std::byte> buf(8);
  EXPECT_EQ((*session)->Broadcast(buf, 0).code(), StatusCode::kAborted);
}

TEST_F(SessionTest, AnAbortWakesTheBucketsInFlightAndDropsTheWholeStep) {
  auto session = Join();
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  job_.StartDraining();
  // Three buckets of one step. The silent peer never takes part, so the first
  // blocks in its collective on the communication thread, as a bucket does
  // while a peer is dead or hung; the training thread goes on.
  std::atomic<int> entered{0};  // buckets that entered a collective
  testing::before_collective_hook = [&] { ++entered; };
  std::vector<float> b0(8, 1.0f), b1(8, 2.0f), b2(8, 3.0f);
  // Each bucket's completion is told, in order, with the step's first error
  // (the Python package's torch.distributed futures rely on it).
  std::mutex done_mu;
  std::vector<std::pair<int, Status>> done;
  auto on_done = [&](int bucket) {
    return [&, bucket](const Status& st) {
      std::lock_guard<std::mutex> lock(done_mu);
      done.push_back({bucket, st});
    };
  };
  (*session)->StartAllReduce(b0, on_done(0));
  (*session)->StartAllReduce(b1, on_done(1));
  (*session)->StartAllReduce(b2, on_done(2));
  EXPECT_FALSE((*session)->aborted());
  job_.Send(control::kMsgAbort, control::Encode(control::AbortMsg{1, "a member failed"}));
  // Without the abort reaching the communication thread WaitAll would return
  // DEADLINE_EXCEEDED after timeout_collective (3 s here).
  Status s = (*session)->WaitAll();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("a member failed"), std::string::npos) << s.ToString();
  EXPECT_TRUE((*session)->aborted());
  // The step is dropped whole: the buckets behind the failed one never entered a collective.
  EXPECT_EQ(entered.load(), 1);
  EXPECT_EQ(b1, std::vector<float>(8, 2.0f));
  EXPECT_EQ(b2, std::vector<float>(8, 3.0f));
  {
    std::lock_guard<std::mutex> lock(done_mu);  // WaitAll returned: every completion was told
    ASSERT_EQ(done.size(), 3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(done[i].first, i);
      EXPECT_EQ(done[i].second.code(), StatusCode::kAborted) << done[i].second.ToString();
    }
  }
  // The error is reported once; the collectives that follow still fail (the generation is over).
  EXPECT_TRUE((*session)->WaitAll().ok());
  std::vector<float> more(4, 1.0f);
  EXPECT_EQ((*session)->AllReduce(more).code(), StatusCode::kAborted);
}

TEST_F(SessionTest, BucketsOfAStepAfterADrainedBoundaryEnterNoCollective) {
  auto session = Join();
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  job_.StartDraining();
  (*session)->ReportStep({0, 1.0, 0.1, 1});
  SendDrainAfterStep0();
  WaitForDrain();
  // Step 1's buckets start after the drain for the boundary after step 0: none may enter a
  // collective.
  std::atomic<int> entered{0};
  testing::before_collective_hook = [&] { ++entered; };
  std::vector<float> b0(8, 1.0f), b1(8, 2.0f);
  (*session)->StartAllReduce(b0);
  (*session)->StartAllReduce(b1);
  Status s = (*session)->WaitAll();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("step boundary"), std::string::npos) << s.ToString();
  EXPECT_EQ(entered.load(), 0);
  EXPECT_EQ(b0, std::vector<float>(8, 1.0f));
}

TEST_F(SessionTest, PlanNamingASourceOutsideTheMembershipIsAnsweredWithAReasonNotACrash) {
  std::string ready_reason;
  auto session = Join([&] {
    // 7 is no member
    job_.AcceptAndPlan([](control::PlanMsg& plan) { plan.transfers.push_back({0, {7}}); });
    auto ready = job_.Expect(control::kMsgReady);
    ASSERT_TRUE(ready.ok()) << ready.status().ToString();
    ready_reason = control::DecodeReady(ready->payload)->reason;
    job_.Send(control::kMsgShutdown, control::Encode(control::ShutdownMsg{"test over", 0}));
  });
  EXPECT_EQ(session.status().code(), StatusCode::kCancelled) << session.status().ToString();
  EXPECT_NE(ready_reason.find("source worker 7 of receiver 0 is not a member"), std::string::npos)
      << ready_reason;
}

// The controller sends a member the next plan written against the one it holds
// (docs/plan-wire.md): the worker rebuilds it and adopts it; here the two
// members swap ranks.
TEST_F(SessionTest, APlanDeltaIsAppliedToThePlanTheWorkerHolds) {
  control::PlanMsg first;
  auto session = Join([&] { job_.AcceptAndPlan([&](control::PlanMsg& plan) { first = plan; }); });
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  EXPECT_EQ((*session)->rank(), 0);
  control::PlanMsg next = first;
  next.generation = 2;
  next.resume_step = 5;
  next.reason = "recovery";
  std::swap(next.members[0], next.members[1]);
  job_.Send(control::kMsgAbort, control::Encode(control::AbortMsg{1, "a member failed"}));
  job_.Send(control::kMsgPlanDelta,
            control::EncodePlanDelta(next, control::DiffMembers(next, &first), next.transfers));
  auto resumed = (*session)->Recover();
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ(*resumed, 5);
  EXPECT_EQ((*session)->rank(), 1);
  EXPECT_EQ((*session)->world_size(), 2);
  EXPECT_EQ((*session)->last_change().generation, 2u);
}

// A plan is decoded without the Session's lock (a plan of 100,000 members is megabytes of JSON,
// and the training thread takes that lock around every collective): while the I/O thread is
// about to decode a delta, another thread can take the lock (Session::shutdown_exit_code does).
TEST_F(SessionTest, APlanDeltaIsDecodedWithoutTheSessionsLock) {
  std::atomic<Session*> probed{nullptr};
  std::atomic<int> decodes{0}, locked_out{0};
  // Kept past the hook: a probe still waiting for the lock finishes once the I/O thread lets go.
  std::mutex probes_mu;
  std::vector<std::future<int>> probes;
  // Installed before the session starts: its I/O thread reads the seam.
  testing::before_plan_decode_hook = [&] {
    Session* s = probed.load();
    if (s == nullptr) return;  // the first plan, before the session is known
    ++decodes;
    auto taken = std::async(std::launch::async, [s] { return s->shutdown_exit_code(); });
    if (taken.wait_for(std::chrono::seconds(5)) != std::future_status::ready) ++locked_out;
    std::lock_guard<std::mutex> lock(probes_mu);
    probes.push_back(std::move(taken));
  };
  control::PlanMsg first;
  auto session = Join([&] { job_.AcceptAndPlan([&](control::PlanMsg& plan) { first = plan; }); });
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  probed = session->get();
  control::PlanMsg next = first;
  next.generation = 2;
  next.reason = "recovery";
  job_.Send(control::kMsgAbort, control::Encode(control::AbortMsg{1, "a member failed"}));
  job_.Send(control::kMsgPlanDelta,
            control::EncodePlanDelta(next, control::DiffMembers(next, &first), next.transfers));
  auto resumed = (*session)->Recover();
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  EXPECT_EQ((*session)->last_change().generation, 2u);
  EXPECT_EQ(decodes.load(), 1);
  EXPECT_EQ(locked_out.load(), 0) << "the I/O thread held the Session's lock while decoding";
  probed = nullptr;
  std::lock_guard<std::mutex> lock(probes_mu);
  for (auto& p : probes) p.wait();
}

// A delta that rebuilds another member list than the plan's (a controller bug) is refused, never
// adopted: the worker leaves the connection and stays in the generation it has.
TEST_F(SessionTest, APlanDeltaThatRebuildsAnotherMemberListIsRefused) {
  control::PlanMsg first;
  auto session = Join([&] { job_.AcceptAndPlan([&](control::PlanMsg& plan) { first = plan; }); });
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  control::PlanMsg next = first;
  next.generation = 2;
  control::PlanMsg swapped = next;
  std::swap(swapped.members[0], swapped.members[1]);
  // Runs of another order of the same members, written into `next`: a well-formed delta.
  const control::PlanMembersDelta members = control::DiffMembers(swapped, &first);
  job_.Send(control::kMsgPlanDelta, control::EncodePlanDelta(next, members, next.transfers));
  EXPECT_TRUE(job_.ClosedByWorker(Millis(5000))) << "the worker adopted a wrong member list";
  EXPECT_EQ((*session)->generation(), 1u);
}

// A delta against a plan the worker does not hold is refused (a bad order: the worker leaves the
// connection and dials again), never applied to the plan it has.
TEST_F(SessionTest, APlanDeltaAgainstAnotherPlanIsRefused) {
  control::PlanMsg first;
  auto session = Join([&] { job_.AcceptAndPlan([&](control::PlanMsg& plan) { first = plan; }); });
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  control::PlanMsg other = first;
  other.generation = 7;  // never sent to this worker
  control::PlanMsg next = first;
  next.generation = 8;
  job_.Send(control::kMsgPlanDelta,
            control::EncodePlanDelta(next, control::DiffMembers(next, &other), next.transfers));
  EXPECT_TRUE(job_.ClosedByWorker(Millis(5000))) << "the worker applied a delta of another base";
  EXPECT_EQ((*session)->generation(), 1u);
}

// Fencing at the worker (docs/controller-failover.md): once it has followed
// a controller of epoch 5, a controller of epoch 3 (a deposed leader that
// woke up) is left at its first ping, and what it sends after is not acted on.
TEST_F(SessionTest, AControllerOfAnOlderEpochIsLeftAndItsOrdersAreNotActedOn) {
  auto session = Join();
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  job_.Send(control::kMsgPing, control::Encode(control::PingMsg{5}));
  job_.Close();  // the leader of epoch 5 dies; the worker dials again
  auto rejoin = job_.AcceptJoin();
  ASSERT_TRUE(rejoin.ok()) << rejoin.status().ToString();
  EXPECT_EQ(rejoin->generation, 1u);
  job_.Send(control::kMsgPing, control::Encode(control::PingMsg{3}));
  job_.Send(control::kMsgAbort, control::Encode(control::AbortMsg{1, "from a deposed leader"}));
  EXPECT_TRUE(job_.ClosedByWorker(Millis(5000)))
      << "the worker followed a controller of an older epoch";
  EXPECT_FALSE((*session)->aborted()) << "the deposed leader's abort was carried out";
  // It looks for the leader again, and follows one of epoch 5 or newer.
  auto again = job_.AcceptJoin();
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  job_.Send(control::kMsgPing, control::Encode(control::PingMsg{6}));
  job_.Send(control::kMsgAbort, control::Encode(control::AbortMsg{1, "from the leader"}));
  for (int i = 0; i < 200 && !(*session)->aborted(); ++i) std::this_thread::sleep_for(Millis(10));
  EXPECT_TRUE((*session)->aborted()) << "the leader's abort was not carried out";
}

// Issue 30: a worker whose device fails its health check does not join (nothing is dialed: the
// controller's address is never used), and says which device failed and why.
// Issue 30: the world-invariant sum of partials in device memory goes up from the device and its
// sum comes back down into the device's `out`. The plan is cut to this worker alone (the scripted
// peer never sums), so its one partial (the root's) is the sum: the order of the additions is
// StagedCommunicatorTest's (several ranks, several nodes) and the integration test's
// (TheTreeOnADeviceEndsOnTheChecksumOfAnotherWorldInHostMemory). A call that does not fit the
// tree is refused by name.
TEST_F(SessionTest, TheTreeOfPartialsOnADeviceCopiesThePartialsUpAndTheSumDown) {
  auto device = std::make_shared<state::ProtectedDevice>();
  SessionOptions o;
  o.device = device;
  auto session =
      Join([this] { job_.AcceptAndPlan([](control::PlanMsg& p) { p.members.resize(1); }); }, o);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  const int m = 5;
  const std::vector<std::pair<int, int>> ranges{{0, m}};
  const size_t n = 1000;
  std::vector<std::vector<float>> partials(collective::NodesOfRange(m, 0, m).size(),
                                           std::vector<float>(n));
  std::vector<std::span<const float>> on_device;
  for (size_t k = 0; k < partials.size(); ++k) {
    for (size_t i = 0; i < n; ++i) partials[k][i] = 0.1f * static_cast<float>(i) + 0.37f * (k + 1);
    std::span<std::byte> d = device->Allocate(n * sizeof(float));
    ASSERT_TRUE(
        device->ToDevice(d.data(), reinterpret_cast<const std::byte*>(partials[k].data()), d.size())
            .ok());
    on_device.push_back({reinterpret_cast<const float*>(d.data()), n});
  }
  std::span<std::byte> out = device->Allocate(n * sizeof(float));
  ASSERT_TRUE(
      (*session)
          ->AllReduceTreeOnDevice(m, ranges, on_device, {reinterpret_cast<float*>(out.data()), n})
          .ok());
  std::vector<float> from_device(n), on_host(n);
  ASSERT_TRUE(
      device->ToHost(reinterpret_cast<std::byte*>(from_device.data()), out.data(), out.size())
          .ok());
  ASSERT_TRUE((*session)->AllReduceTree(m, ranges, partials, on_host).ok());
  EXPECT_EQ(std::memcmp(from_device.data(), on_host.data(), n * sizeof(float)), 0);
  EXPECT_EQ(from_device[999], partials[0][999]) << "not the device's zeros";
  const std::vector<std::span<const float>> two{on_device[0], on_device[0]};
  Status refused =
      (*session)->AllReduceTreeOnDevice(m, ranges, two, {reinterpret_cast<float*>(out.data()), n});
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("2 partial sums for the 1 tree node(s) of this rank's range"),
            std::string::npos)
      << refused.ToString();
}

// A DeviceCopier that counts the copies a StagedDataPlane makes through it.
class CountingCopier final : public collective::DeviceCopier {
 public:
  explicit CountingCopier(std::shared_ptr<const state::DeviceMemory> memory) : inner_(memory) {}
  collective::Device device() const override { return inner_.device(); }
  int device_index() const override { return inner_.device_index(); }
  Result<std::span<std::byte>> HostBuffer(size_t bytes) override {
    return inner_.HostBuffer(bytes);
  }
  Status ToHost(int lane, std::byte* host, const std::byte* device, size_t bytes) override {
    ++copies;
    return inner_.ToHost(lane, host, device, bytes);
  }
  Status ToDevice(int lane, std::byte* device, const std::byte* host, size_t bytes) override {
    ++copies;
    return inner_.ToDevice(lane, device, host, bytes);
  }
  Status Wait(int lane) override { return inner_.Wait(lane); }
  std::atomic<int> copies{0};

 private:
  collective::MemoryCopier inner_;
};

// Issue 30: SessionOptions::device_data_plane makes the data plane of the device's sums from the
// TCP one (NCCL's in a GPU job); a maker that fails fails the join, naming why.
TEST_F(SessionTest, TheDeviceDataPlaneMakerCarriesTheDevicesSumsAndItsFailureStopsTheJoin) {
  auto device = std::make_shared<state::ProtectedDevice>();
  int made = 0;
  auto copier = std::make_shared<CountingCopier>(device);
  SessionOptions o;
  o.device = device;
  o.device_data_plane = [&](std::unique_ptr<collective::DataPlane> tcp,
                            net::AbortSignal*) -> Result<std::unique_ptr<collective::DataPlane>> {
    ++made;
    return std::unique_ptr<collective::DataPlane>(
        std::make_unique<collective::StagedDataPlane>(std::move(tcp), copier));
  };
  auto session =
      Join([this] { job_.AcceptAndPlan([](control::PlanMsg& p) { p.members.resize(1); }); }, o);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  EXPECT_EQ(made, 1);
  std::span<std::byte> d = device->Allocate(16 * sizeof(float));
  std::vector<float> v(16, 2.5f);
  ASSERT_TRUE(
      device->ToDevice(d.data(), reinterpret_cast<const std::byte*>(v.data()), d.size()).ok());
  Status summed = (*session)->AllReduceOnDevice({reinterpret_cast<float*>(d.data()), 16});
  EXPECT_TRUE(summed.ok()) << summed.ToString();
  EXPECT_EQ(copier->copies.load(), 2) << "up and down through the maker's data plane";
}

// Device buckets overlap like host ones: reduced on the communication thread through the
// device's data plane (their copies there too), in the order started, mixed with host buckets.
TEST_F(SessionTest, DeviceBucketsAreReducedOnTheCommunicationThreadInOrderWithHostOnes) {
  auto device = std::make_shared<state::ProtectedDevice>();
  auto copier = std::make_shared<CountingCopier>(device);
  SessionOptions o;
  o.device = device;
  o.device_data_plane = [&](std::unique_ptr<collective::DataPlane> tcp,
                            net::AbortSignal*) -> Result<std::unique_ptr<collective::DataPlane>> {
    return std::unique_ptr<collective::DataPlane>(
        std::make_unique<collective::StagedDataPlane>(std::move(tcp), copier));
  };
  auto session =
      Join([this] { job_.AcceptAndPlan([](control::PlanMsg& p) { p.members.resize(1); }); }, o);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  std::span<std::byte> d = device->Allocate(8 * sizeof(float));
  std::vector<float> v(8, 1.5f), host(4, 2.0f), back(8, 0.0f);
  ASSERT_TRUE(
      device->ToDevice(d.data(), reinterpret_cast<const std::byte*>(v.data()), d.size()).ok());
  std::mutex mu;
  std::vector<std::pair<int, std::thread::id>> done;
  auto on_done = [&](int bucket) {
    return [&, bucket](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      done.push_back({s.ok() ? bucket : -1, std::this_thread::get_id()});
    };
  };
  (*session)->StartAllReduceOnDevice({reinterpret_cast<float*>(d.data()), 8}, on_done(0));
  (*session)->StartAllReduce(host, on_done(1));
  Status s = (*session)->WaitAll();
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].first, 0);
  EXPECT_EQ(done[1].first, 1);
  EXPECT_NE(done[0].second, std::this_thread::get_id()) << "reduced on the communication thread";
  EXPECT_EQ(copier->copies.load(), 2) << "up and down through the device's data plane";
  ASSERT_TRUE(device->ToHost(reinterpret_cast<std::byte*>(back.data()), d.data(), d.size()).ok());
  EXPECT_EQ(back, v) << "a world of one: the sum is the bucket";
  EXPECT_EQ(host, std::vector<float>(4, 2.0f));
}

TEST_F(SessionTest, ADeviceBucketWithoutADeviceFailsTheStepNamingWhy) {
  auto session =
      Join([this] { job_.AcceptAndPlan([](control::PlanMsg& p) { p.members.resize(1); }); });
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  std::vector<float> x(4, 1.0f);
  (*session)->StartAllReduceOnDevice(x);
  Status s = (*session)->WaitAll();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("StartAllReduceOnDevice: this session has no device"),
            std::string::npos)
      << s.ToString();
}

TEST_F(SessionTest, ADeviceDataPlaneMakerThatFailsStopsTheJoinNamingWhy) {
  SessionOptions broken;
  broken.device = std::make_shared<state::ProtectedDevice>();
  broken.device_data_plane =
      [](std::unique_ptr<collective::DataPlane>,
         net::AbortSignal*) -> Result<std::unique_ptr<collective::DataPlane>> {
    return FailedPreconditionError("no CUDA device can be used: a test says so");
  };
  broken.join_timeout = Millis(2000);
  auto refused = Join([this] { job_.Accept(); }, broken);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("no CUDA device can be used: a test says so"),
            std::string::npos)
      << refused.status().ToString();
}

TEST(SessionJoinTest, AWorkerWhoseDeviceFailsItsHealthCheckDoesNotJoin) {
  auto device = std::make_shared<state::ProtectedDevice>();
  ASSERT_TRUE(device->Check().ok());
  device->set_broken(true);
  EXPECT_FALSE(device->Check().ok());
  // the device of the sums, of a state region only, or one the program only computes in
  enum class Use { kSums, kState, kComputes };
  for (Use use : {Use::kSums, Use::kState, Use::kComputes}) {
    state::StateRegistry state;
    std::span<std::byte> mem = device->Allocate(64);
    if (use == Use::kState) {
      ASSERT_TRUE(state.RegisterOnDevice("w", mem, device).ok());
    }
    SessionOptions o;
    o.controller_address = "127.0.0.1:1";  // nobody: a join that dialed would fail otherwise
    o.secret = "tok";
    o.worker_id = 3;
    o.join_timeout = Millis(500);  // without the check: fails fast, with another error
    if (use == Use::kSums) o.device = device;
    if (use == Use::kComputes) o.checked_devices.push_back(device);
    auto joined = Session::Join(o, &state);
    ASSERT_FALSE(joined.ok());
    EXPECT_EQ(joined.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(joined.status().message().find(
                  "worker 3: stand-in:0 failed its health check, so this worker does not join: "
                  "the stand-in device is broken"),
              std::string::npos)
        << joined.status().ToString();
  }
}

// A spare (worker 4) of a ScriptedJob whose state is on a stand-in device, which the test breaks.
struct SpareOnAStandIn {
  ScriptedJob job;
  std::shared_ptr<state::ProtectedDevice> device = std::make_shared<state::ProtectedDevice>();
  state::StateRegistry state;
  SessionOptions options;

  explicit SpareOnAStandIn(Millis check_interval) {
    NONSTOP_CHECK(state.RegisterOnDevice("w", device->Allocate(64), device).ok());
    options.controller_address = job.address();
    options.secret = "tok";
    options.worker_id = 4;
    options.spare = true;
    options.spare_check_interval = check_interval;
    // a spare that never leaves gives up when its silent controller is lost (5 s), 2 s later
    options.leaderless_timeout = Millis(2000);
  }

  // The worker's report to the controller (after its Join failed): its reason, in `generation`.
  void ExpectReported(uint32_t generation, const std::string& reason) {
    Result<net::Frame> f = job.Expect(control::kMsgFailure);
    ASSERT_TRUE(f.ok()) << "the spare tells the controller why it leaves: "
                        << f.status().ToString();
    Result<control::FailureMsg> m = control::DecodeFailure(f->payload);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    EXPECT_EQ(m->generation, generation);
    EXPECT_NE(m->reason.find(reason), std::string::npos) << m->reason;
    EXPECT_TRUE(job.ClosedByWorker(Millis(5000))) << "the spare hangs up on the controller";
  }
};

// A spare re-checks its devices while it waits for a rank: once its device breaks, it leaves the
// job (its Join fails, naming the device and why, and the controller is told) instead of waiting
// to be promoted with it.
TEST(SessionJoinTest, ASpareWhoseDeviceBreaksWhileItWaitsLeavesTheJob) {
  SpareOnAStandIn spare(Millis(20));
  std::atomic<bool> broken{false};
  std::thread controller([&] {
    spare.job.Accept();
    ASSERT_TRUE(spare.job.Expect(control::kMsgJoin).ok());
    const int before = spare.device->copies();
    // several checks pass while the spare waits (within 10 s), and then the device breaks
    const Deadline deadline = DeadlineAfter(Millis(10'000));
    while (spare.device->copies() < before + 6 && Clock::now() < deadline)
      std::this_thread::sleep_for(Millis(5));
    broken = true;
    spare.device->set_broken(true);
  });
  auto joined = Session::Join(spare.options, &spare.state);
  const bool after_break = broken.load();
  controller.join();
  ASSERT_FALSE(joined.ok()) << "a spare whose device broke must not stay in the job";
  EXPECT_TRUE(after_break) << "the spare left before its device broke: "
                           << joined.status().ToString();
  EXPECT_EQ(joined.status().code(), StatusCode::kFailedPrecondition);
  const std::string why =
      "worker 4: stand-in:0 failed its health check while this worker waited as a spare, so it "
      "leaves the job's spares: the stand-in device is broken";
  EXPECT_NE(joined.status().message().find(why), std::string::npos) << joined.status().ToString();
  spare.ExpectReported(0, why);
}

// A spare's devices are checked once more as it is promoted, before it takes state: a device that
// broke since its last check (here, with no check between) fails it, naming the generation.
TEST(SessionJoinTest, ASpareWhoseDeviceBrokeIsNotPromoted) {
  SpareOnAStandIn spare(std::chrono::hours(1));
  std::thread controller(
      [&] { spare.job.AcceptAndPlan([&](control::PlanMsg&) { spare.device->set_broken(true); }); });
  auto joined = Session::Join(spare.options, &spare.state);
  controller.join();
  ASSERT_FALSE(joined.ok()) << "a spare whose device broke must not take a rank";
  EXPECT_EQ(joined.status().code(), StatusCode::kFailedPrecondition);
  const std::string why =
      "worker 4: stand-in:0 failed its health check as this spare was promoted (generation 1), "
      "so it does not take part: the stand-in device is broken";
  EXPECT_NE(joined.status().message().find(why), std::string::npos) << joined.status().ToString();
  spare.ExpectReported(1, why);
}

}  // namespace
}  // namespace nonstop
