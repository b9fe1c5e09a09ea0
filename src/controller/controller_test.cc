#include "controller/controller.h"
#include "controller/report.h"
#include "controller/takeover.h"
#include "nonstop/state.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <functional>

#include <limits>
#include <map>
#include <set>
#include <tuple>

namespace nonstop::controller {
namespace {

// An agent's registration: `nproc` workers and `spares` spares on `host` at `address`, no
// processes running yet.
control::AgentRegisterMsg Agent(const std::string& host, int nproc, int spares,
                                const std::string& address, int64_t pid) {
  control::AgentRegisterMsg m;
  m.host_id = host;
  m.nproc = nproc;
  m.spares = spares;
  m.address = address;
  m.pid = pid;
  return m;
}

// A job as `nonstop run` runs it (Make): one host, `local`, whose agent (in
// the same process, elastic) brings the world and the spares; the controller
// starts worker ids 0 … world − 1 there, then the spares. The agent stays
// alive throughout: its heartbeat reaches the controller before every event,
// as the real one's does every 500 ms whatever the workers do. The faults of
// these tests are the workers'; an agent's own are HostControllerTest's.
class ControllerTest : public ::testing::Test {
 protected:
  static constexpr const char* kHost = "local";
  Clock::time_point now_ = Clock::time_point() + std::chrono::hours(1);
  std::unique_ptr<Controller> c_;
  bool local_agent_ = false;  // c_ is Make's: its agent heartbeats before every event

  ControllerTest() { Make(3, 1); }

  // `nonstop run --nproc world --spares spares [--inject faults]`.
  void Make(int world, int spares, std::vector<control::FaultSpec> faults = {}) {
    ControllerOptions o;
    o.world_size = world;
    o.spares = spares;
    o.heartbeat_timeout = Millis(1000);
    o.abort_timeout = Millis(2000);
    o.faults = std::move(faults);
    Make(std::move(o));
  }
  // The job of `o.world_size` workers and `o.spares` spares, as run_command.cc
  // sets it up: one host at most and at least, its agent registered (elastic).
  void Make(ControllerOptions o) {
    o.min_hosts = o.max_hosts = 1;
    c_ = std::make_unique<Controller>(o);
    local_agent_ = true;
    control::AgentRegisterMsg m;
    m.host_id = kHost;
    m.nproc = o.world_size;
    m.spares = o.spares;
    m.address = "127.0.0.1";
    m.pid = 4000;
    m.elastic = true;
    spawned_ = Find<SpawnWorker>(Do(HostJoined{m}));
    EXPECT_EQ(spawned_.size(), static_cast<size_t>(o.world_size + o.spares))
        << "the placement starts the world and its spares";
  }
  std::vector<SpawnWorker> spawned_;  // Make's
  std::vector<Action> Do(Event e) {
    if (local_agent_) c_->Handle(HostHeartbeat{kHost, {0}}, now_);
    return c_->Handle(e, now_);
  }
  std::vector<Action> Join(int id, bool spare = false) {
    return Do(
        WorkerJoined{{id, 1000 + id, "127.0.0.1:" + std::to_string(5000 + id), spare, -1, kHost}});
  }
  std::vector<Action> Ready(int id, int64_t step) {
    return Do(ReadyReceived{id, {c_->generation(), step, "aborted"}});
  }
  void Step(int id, int64_t step) { Do(ProgressReceived{id, {step, 2.0, 0.1, 100, 3}}); }
  // Steps 0 … last on the three members (workers 0, 1, 2), each reported 100 ms after the one
  // before (Step() reports 0.1 s).
  void StepsOf100Ms(int64_t last) {
    for (int64_t s = 0; s <= last; ++s) {
      now_ += Millis(100);
      for (int id : {0, 1, 2}) Step(id, s);
    }
  }
  template <typename T>
  static std::vector<T> Find(const std::vector<Action>& actions) {
    std::vector<T> out;
    for (const auto& a : actions) {
      if (const T* t = std::get_if<T>(&a)) out.push_back(*t);
    }
    return out;
  }
  // What the actions print, a line each.
  static std::string Printed(const std::vector<Action>& actions) {
    std::string lines;
    for (const auto& p : Find<PrintLine>(actions)) lines += p.line + "\n";
    return lines;
  }
  void StartJob() {
    Join(3, true);
    Join(2);
    Join(0);
    Join(1);
    ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  }
};

TEST_F(ControllerTest, FirstGenerationFormsWhenAllMembersJoinedRanksByWorkerId) {
  EXPECT_TRUE(Find<SendPlan>(Join(2)).empty());
  EXPECT_TRUE(Find<SendPlan>(Join(3, /*spare=*/true)).empty());
  EXPECT_TRUE(Find<SendPlan>(Join(0)).empty());
  auto plans = Find<SendPlan>(Join(1));
  ASSERT_EQ(plans.size(), 3u) << "one plan per member, none to the spare";
  for (const auto& p : plans) {
    EXPECT_EQ(p.plan->generation, 1u);
    ASSERT_EQ(p.plan->members.size(), 3u);
    EXPECT_EQ(p.plan->members[0].worker_id, 0);
    EXPECT_EQ(p.plan->members[2].worker_id, 2);
    EXPECT_NE(p.worker_id, 3);
  }
  EXPECT_EQ(c_->RankOf(2), 2);
  EXPECT_EQ(c_->RankOf(3), -1);
}

// torchrun's variables a worker starts with: the rank the first generation gives it; for a spare
// one past every member's (the world, 3), never -1, which scripts read as "not distributed", and a
// local rank among its host's slots (its worker id mod 3: a GPU that exists).
TEST_F(ControllerTest, EachWorkerStartsWithTheRankTheFirstGenerationGivesIt) {
  ASSERT_EQ(spawned_.size(), 4u);
  for (const SpawnWorker& s : spawned_) {
    std::map<std::string, std::string> env(s.torchrun.begin(), s.torchrun.end());
    const std::string rank = s.spare ? "3" : std::to_string(s.worker_id);
    EXPECT_EQ(env["RANK"], rank) << s.worker_id;
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(s.worker_id % 3)) << s.worker_id;
    EXPECT_EQ(env["WORLD_SIZE"], "3");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
  }
  StartJob();
  for (int id : {0, 1, 2}) EXPECT_EQ(c_->RankOf(id), id);
}

// A script written for torchrun alone never joins: the job ends with 0 once every worker exited 0.
TEST_F(ControllerTest, AScriptThatNeverJoinsEndsTheJobAsTorchrunWouldOnceEveryWorkerExited) {
  Make(3, 0);
  EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{0, 1000, 0, 0, kHost})).empty());
  EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{2, 1002, 0, 0, kHost})).empty());
  auto ends = Find<EndJob>(Do(ProcessExited{1, 1001, 0, 0, kHost}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, 0);
  EXPECT_NE(ends[0].reason.find("without joining"), std::string::npos) << ends[0].reason;
}

TEST_F(ControllerTest, AJoinAfterAWorkerExitedWithoutJoiningEndsTheJobNamingWhy) {
  Make(3, 0);
  Do(ProcessExited{0, 1000, 0, 0, kHost});
  auto ends = Find<EndJob>(Join(1));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitUsage);
  EXPECT_NE(ends[0].reason.find("or none does"), std::string::npos) << ends[0].reason;
}

TEST_F(ControllerTest, KilledMemberIsReplacedBySpareWhichCopiesStateFromSurvivors) {
  StartJob();
  for (int id : {0, 1, 2}) Step(id, 16);
  Step(0, 17);  // rank 0 completed step 17 before the fault; ranks 1 and 2 did not
  auto actions = Do(ProcessExited{2, 1002, -1, 9, kHost});
  EXPECT_EQ(Find<SendAbort>(actions).size(), 2u) << "the two survivors abort generation 1";
  EXPECT_TRUE(Find<EndJob>(actions).empty());
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  EXPECT_TRUE(Find<SendPlan>(Ready(0, 17)).empty()) << "still waiting for rank 1";
  auto plan_actions = Ready(1, 16);
  auto plans = Find<SendPlan>(plan_actions);
  ASSERT_EQ(plans.size(), 3u);
  const auto& plan = *plans[0].plan;
  EXPECT_EQ(plan.generation, 2u);
  EXPECT_EQ(plan.resume_step, 18) << "s* is the highest step a survivor holds";
  ASSERT_EQ(plan.members.size(), 3u);
  EXPECT_EQ(plan.members[0].worker_id, 0);
  EXPECT_EQ(plan.members[1].worker_id, 1);
  EXPECT_EQ(plan.members[2].worker_id, 3) << "the spare takes the lost rank";
  ASSERT_EQ(plan.transfers.size(), 2u) << "rank 1 is one step behind, the spare has nothing";
  for (const auto& t : plan.transfers) EXPECT_EQ(t.sources, std::vector<int>{0});
  auto spawns = Find<SpawnWorker>(plan_actions);
  ASSERT_EQ(spawns.size(), 1u) << "the spare pool is refilled";
  EXPECT_TRUE(spawns[0].spare);
  EXPECT_EQ(spawns[0].worker_id, 4);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  // The recovery closes when every member has completed the resume step.
  for (int id : {0, 1, 3}) Step(id, 18);
  ASSERT_EQ(c_->recoveries().size(), 1u);
  EXPECT_EQ(c_->recoveries()[0].outcome, "completed");
  EXPECT_EQ(c_->recoveries()[0].lost_steps, 0);
}

// An injected kill is announced on the worker's control connection, and its
// exit may be reported (on the launcher's) first: the recovery it opened
// still names the injected fault; a later recovery does not take it.
TEST_F(ControllerTest, AnInjectedFaultAnnouncedAfterItsExitStillNamesItsRecovery) {
  StartJob();
  for (int id : {0, 1, 2}) Step(id, 16);
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  ASSERT_EQ(c_->recoveries().size(), 1u);
  EXPECT_EQ(c_->recoveries()[0].injected, "");
  Do(InjectedReceived{2, {0, "kill:rank=2,step=17"}});
  EXPECT_EQ(c_->recoveries()[0].injected, "kill:rank=2,step=17");
  Ready(0, 16);
  Ready(1, 16);
  for (int id : {0, 1, 3}) Step(id, 17);
  ASSERT_EQ(c_->recoveries()[0].outcome, "completed");
  now_ += Millis(100);
  Do(ProcessExited{1, 1001, -1, 9, kHost});  // a fault nobody injected
  ASSERT_EQ(c_->recoveries().size(), 2u);
  EXPECT_EQ(c_->recoveries()[1].injected, "") << "the first fault's announcement was used up";
}

// A member's lifeline fired (the agent's AgentDying, as the kernel begins its exit): the fault is
// taken at once, kind "process died", and the exit and the connection closing that follow make no
// second fault and no second recovery.
TEST_F(ControllerTest, DyingMemberIsOneFaultAndItsExitAndConnectionLossChangeNothing) {
  StartJob();
  for (int id : {0, 1, 2}) Step(id, 16);
  auto actions = Do(ProcessDying{2, 1002, kHost});
  EXPECT_EQ(Find<SendAbort>(actions).size(), 2u) << "the two survivors abort at once";
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  int faults = 0;
  for (const auto& j : Find<AppendJournal>(actions)) {
    if (j.record.value("event", "") != "fault") continue;
    ++faults;
    EXPECT_EQ(j.record.value("kind", ""), "process died");
    EXPECT_EQ(j.record.value("worker_id", -1), 2);
  }
  EXPECT_EQ(faults, 1);
  auto count_faults = [&](const std::vector<Action>& later) {
    int n = 0;
    for (const auto& j : Find<AppendJournal>(later)) n += j.record.value("event", "") == "fault";
    return n;
  };
  auto exit = Do(ProcessExited{2, 1002, -1, 9, kHost});
  EXPECT_EQ(count_faults(exit), 0);
  EXPECT_TRUE(Find<SendAbort>(exit).empty());
  auto lost = Do(ConnectionLost{2, "connection closed"});
  EXPECT_EQ(count_faults(lost), 0);
  EXPECT_TRUE(Find<SendAbort>(lost).empty());
  Ready(0, 16);
  auto plans = Find<SendPlan>(Ready(1, 16));
  ASSERT_EQ(plans.size(), 3u);
  EXPECT_EQ(plans[0].plan->members[2].worker_id, 3) << "the spare takes the lost rank";
  for (int id : {0, 1, 3}) Step(id, 17);
  ASSERT_EQ(c_->recoveries().size(), 1u);
  EXPECT_EQ(c_->recoveries()[0].outcome, "completed");
}

// Only a live member's lifeline is a fault: a spare's, another host's report or a report about an
// earlier process of that id change nothing (their exits are accounted for as before).
TEST_F(ControllerTest, DyingReportOfNoLiveMemberIsNoFault) {
  StartJob();
  for (int id : {0, 1, 2}) Step(id, 16);
  EXPECT_TRUE(Find<SendAbort>(Do(ProcessDying{3, 1003, kHost})).empty()) << "a spare";
  EXPECT_TRUE(Find<SendAbort>(Do(ProcessDying{2, 999, kHost})).empty()) << "another pid";
  auto other = Do(ProcessDying{2, 1002, "elsewhere"});
  EXPECT_TRUE(Find<SendAbort>(other).empty()) << "another host's agent";
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
}

TEST_F(ControllerTest, WithoutSpareTheJobShrinks) {
  Make(3, 0);
  Join(0);
  Join(1);
  Join(2);
  for (int id : {0, 1, 2}) Step(id, 5);
  Do(ProcessExited{1, 1001, -1, 9, kHost});
  Ready(0, 5);
  auto plans = Find<SendPlan>(Ready(2, 5));
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].plan->members.size(), 2u);
  EXPECT_EQ(plans[0].plan->members[1].worker_id, 2) << "survivors keep their order";
  EXPECT_TRUE(plans[0].plan->transfers.empty()) << "everyone holds step 5";
  EXPECT_EQ(plans[0].plan->resume_step, 6);
}

// The recovery's time lost comes from the controller's own clock of the job's course: the step
// across the fault began when the step before it was first reported, and it ends when every member
// completed the resume step (report.cc turns that into the figure; report_test checks the sums).
TEST_F(ControllerTest, TimeLostRunsFromTheStepBeforeTheFaultToTheResumedStepLessANormalStep) {
  StartJob();
  StepsOf100Ms(4);
  now_ += Millis(40);  // 40 ms into step 5
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  now_ += Millis(10);
  Ready(0, 4);
  ASSERT_EQ(Find<SendPlan>(Ready(1, 4)).size(), 3u);
  now_ += Millis(130);  // step 5, computed again whole (and a little slower)
  Step(0, 5);
  Step(1, 5);
  nlohmann::json rec;
  for (const auto& j : Find<AppendJournal>(Do(ProgressReceived{3, {5, 2.0, 0.13, 100, 3}})))
    if (j.record.value("event", "") == "recovery_end") rec = j.record["recovery"];
  ASSERT_TRUE(rec.is_object()) << "the recovery closed when the spare completed step 5";
  ASSERT_TRUE(rec["time_lost"].is_object()) << rec.dump(2);
  // From step 4's report to step 5's completion: 180 ms, less a normal step of 100 ms.
  EXPECT_NEAR(rec["time_lost_ms"].get<double>(), 80, 1e-6) << rec.dump(2);
  EXPECT_NEAR(rec["time_lost"]["split_ms"]["in_flight"].get<double>(), 40, 1e-6) << rec.dump(2);
  EXPECT_NEAR(rec["time_lost"]["split_ms"]["abort"].get<double>(), 10, 1e-6);
  EXPECT_NEAR(rec["time_lost"]["split_ms"]["redone_steps"].get<double>(), 0, 1e-6);
}

// A spare that reports a failure while it waits (its GPU failed its health check) is replaced and
// journaled with the reason; after 3 such spares the pool is not refilled: a flaky device that
// passes the join's check and fails later must not start spares for ever.
TEST_F(ControllerTest, SparesThatReportAFailureWhileTheyWaitAreReplacedThreeTimes) {
  StartJob();  // spare: worker 3
  auto why = [](int id) {
    return "worker " + std::to_string(id) +
           ": stand-in:0 failed its health check while this worker waited";
  };
  int spare = 3;
  for (int n = 1; n <= 4; ++n) {
    auto actions = Do(FailureReported{spare, {0, -1, why(spare)}});
    int lost = 0;
    for (const auto& j : Find<AppendJournal>(actions)) {
      if (j.record.value("event", "") != "spare_lost") continue;
      ++lost;
      EXPECT_EQ(j.record.value("kind", ""), "failure");
      EXPECT_EQ(j.record.value("detail", ""), "reported a failure: " + why(spare));
    }
    EXPECT_EQ(lost, 1) << "failure " << n;
    auto kills = Find<KillWorker>(actions);
    ASSERT_EQ(kills.size(), 1u) << "failure " << n << ": the spare is made sure to be gone";
    EXPECT_EQ(kills[0].worker_id, spare);
    auto spawns = Find<SpawnWorker>(actions);
    if (n <= 3) {
      ASSERT_EQ(spawns.size(), 1u) << "failure " << n << ": the pool refills";
      EXPECT_TRUE(spawns[0].spare);
      spare = spawns[0].worker_id;
      Join(spare, /*spare=*/true);
      continue;
    }
    EXPECT_TRUE(spawns.empty()) << "the fourth spare that failed is not replaced";
    const std::string lines = Printed(actions);
    EXPECT_NE(lines.find("4 spares on host local failed so after joining, so the spare pool is "
                         "not refilled"),
              std::string::npos)
        << lines;
  }
  EXPECT_EQ(c_->phase(), JobPhase::kRunning) << "the members train on";
}

// The copy's time and rate in the record and the report are the receiver's: the sources, which
// served it, waited for the spare to set up first, and their time says so, not the copy's speed.
TEST_F(ControllerTest, TheCopysTimeIsItsReceiversNotTheSourcesThatWaitedForIt) {
  StartJob();
  for (int id : {0, 1, 2}) Step(id, 4);
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 4);
  ASSERT_EQ(Find<SendPlan>(Ready(1, 4)).size(), 3u);
  const uint32_t g = c_->generation();
  // {generation, connect_seconds, transfer_seconds, bytes_received, sources, refetched, ...}
  Do(RecoveredReceived{0, {g, 0.001, 0.020, 0, 0, 0, 2, 2}});
  Do(RecoveredReceived{1, {g, 0.001, 0.019, 0, 0, 0, 2, 2}});
  Do(RecoveredReceived{3, {g, 0.008, 0.010, 10'000'000, 2, 0, 2, 2}});
  Step(0, 5);
  Step(1, 5);
  nlohmann::json rec;
  for (const auto& j : Find<AppendJournal>(Do(ProgressReceived{3, {5, 2.0, 0.1, 100, 3}})))
    if (j.record.value("event", "") == "recovery_end") rec = j.record["recovery"];
  ASSERT_TRUE(rec.is_object()) << "the recovery closed when the spare completed step 5";
  EXPECT_NEAR(rec["transfer_ms"].get<double>(), 10, 1e-9) << rec.dump(2);
  EXPECT_NEAR(rec["connect_ms"].get<double>(), 8, 1e-9) << rec.dump(2);
  EXPECT_EQ(rec["bytes_copied"].get<uint64_t>(), 10'000'000u);
  std::string lines;
  for (const std::string& l : ReportLines(c_->recoveries())) lines += l + "\n";
  EXPECT_NE(lines.find("copied 10.00 MB from 2 source(s) in 10 ms (1000 MB/s)"), std::string::npos)
      << lines;
}

// On a loaded machine the survivors' report of the step the dead member had completed can come
// after its death's notice. That step was not in flight: the step across the fault began at its
// end (its start plus its own 90 ms), and the time lost is the same as with a timely report.
TEST_F(ControllerTest, AStepReportedAfterTheFaultIsNotCountedAsWorkInFlight) {
  StartJob();
  StepsOf100Ms(3);
  now_ += Millis(95);  // step 4 done on every rank at +90 ms; rank 2 dies as step 5 starts
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  now_ += Millis(5);  // the survivors' reports of step 4 come now
  Do(ProgressReceived{0, {4, 2.0, 0.09, 100, 3}});
  Do(ProgressReceived{1, {4, 2.0, 0.09, 100, 3}});
  now_ += Millis(10);
  Ready(0, 4);
  ASSERT_EQ(Find<SendPlan>(Ready(1, 4)).size(), 3u);
  now_ += Millis(100);
  Step(0, 5);
  Step(1, 5);
  nlohmann::json rec;
  for (const auto& j : Find<AppendJournal>(Do(ProgressReceived{3, {5, 2.0, 0.1, 100, 3}})))
    if (j.record.value("event", "") == "recovery_end") rec = j.record["recovery"];
  ASSERT_TRUE(rec.is_object()) << "the recovery closed when the spare completed step 5";
  // step 5 began at +90 ms (step 4's end), and ended 120 ms after that less a normal step
  EXPECT_NEAR(rec["time_lost"]["split_ms"]["in_flight"].get<double>(), 5, 1e-6) << rec.dump(2);
  EXPECT_NEAR(rec["time_lost"]["split_ms"]["redone_steps"].get<double>(), 0, 1e-6) << rec.dump(2);
  EXPECT_NEAR(rec["time_lost_ms"].get<double>(), 20, 1e-6) << rec.dump(2);
}

// The same without the step's own duration (a program that reports none): a normal step stands for
// it. A second fault after the plan supersedes the recovery, and the new one starts from the same
// corrected clock.
TEST_F(ControllerTest, AStepReportedLateWithoutItsDurationEndsANormalStepOn) {
  StartJob();
  const Clock::time_point t0 = now_;
  StepsOf100Ms(3);     // step 3 reported at t0 + 400 ms
  now_ += Millis(60);  // rank 2 dies at +460 ms; the step 4 it completed is reported at +520 ms
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  now_ += Millis(60);
  Do(ProgressReceived{0, {4, 2.0, 0.0, 100, 3}});
  ASSERT_EQ(c_->recoveries().size(), 1u);
  EXPECT_EQ(c_->recoveries()[0].step_before, 4);
  EXPECT_EQ(*c_->recoveries()[0].step_began_at, t0 + Millis(500)) << "+400 ms and a normal step";
  now_ += Millis(5);
  Ready(0, 4);
  ASSERT_EQ(Find<SendPlan>(Ready(1, 4)).size(), 3u);
  now_ += Millis(5);
  Do(ProcessExited{1, 1001, -1, 9, kHost});  // before the resumed step 5 completed
  ASSERT_EQ(c_->recoveries().size(), 2u);
  EXPECT_NE(c_->recoveries()[0].outcome.find("superseded"), std::string::npos);
  EXPECT_EQ(c_->recoveries()[1].step_before, 4);
  EXPECT_EQ(*c_->recoveries()[1].step_began_at, t0 + Millis(500)) << "not the report's +520 ms";
}

// A fault after a recovery's plan supersedes it and counts from the first fault's step (its clock
// kept across the plan): the report of the resumed step, coming after the second death's notice,
// is no step that began at that clock, and moves nothing.
TEST_F(ControllerTest, AResumedStepReportedAfterASupersedingFaultMovesNothing) {
  StartJob();
  const Clock::time_point t0 = now_;
  StepsOf100Ms(3);
  now_ += Millis(40);
  Do(ProcessExited{2, 1002, -1, 9, kHost});  // in step 4
  now_ += Millis(10);
  Ready(0, 3);
  ASSERT_EQ(Find<SendPlan>(Ready(1, 3)).size(), 3u);  // resumes at step 4
  now_ += Millis(150);
  Do(ProcessExited{1, 1001, -1, 9, kHost});
  ASSERT_EQ(c_->recoveries().size(), 2u);
  now_ += Millis(10);
  Do(ProgressReceived{0, {4, 2.0, 0.15, 100, 3}});
  EXPECT_EQ(c_->recoveries()[1].step_before, 3);
  EXPECT_EQ(*c_->recoveries()[1].step_began_at, t0 + Millis(400)) << "step 4's first start";
}

// A reported duration longer than the time since the step began (clocks and reports are not
// exact): the step ended no later than its report came.
TEST_F(ControllerTest, AStepReportedLateEndsNoLaterThanItsReport) {
  StartJob();
  const Clock::time_point t0 = now_;
  StepsOf100Ms(3);
  now_ += Millis(60);
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  now_ += Millis(10);
  Do(ProgressReceived{1, {4, 2.0, 0.5, 100, 3}});  // "500 ms" at +470 ms
  ASSERT_EQ(c_->recoveries().size(), 1u);
  EXPECT_EQ(*c_->recoveries()[0].step_began_at, t0 + Millis(470));
}

// A fault in the job's second step comes before any normal step (the first builds the model): its
// recovery_end counts the whole step across it and says so (normal_steps null), and the report at
// the job's end sets it against the job's median step by then, saying where that came from.
TEST_F(ControllerTest, AFaultBeforeAnyNormalStepIsSetAgainstTheJobsMedianStepAtItsEnd) {
  StartJob();
  now_ += Millis(500);  // the first step builds the model
  for (int id : {0, 1, 2}) Step(id, 0);
  now_ += Millis(40);  // 40 ms into step 1
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  now_ += Millis(10);
  Ready(0, 0);
  ASSERT_EQ(Find<SendPlan>(Ready(1, 0)).size(), 3u);
  now_ += Millis(130);
  Step(0, 1);
  Step(1, 1);
  nlohmann::json rec;
  for (const auto& j : Find<AppendJournal>(Do(ProgressReceived{3, {1, 2.0, 0.13, 100, 3}})))
    if (j.record.value("event", "") == "recovery_end") rec = j.record["recovery"];
  ASSERT_TRUE(rec.is_object()) << "the recovery closed when the spare completed step 1";
  EXPECT_NEAR(rec["time_lost_ms"].get<double>(), 180, 1e-6) << "the whole step: " << rec.dump(2);
  EXPECT_TRUE(rec["time_lost"]["normal_steps"].is_null()) << rec.dump(2);
  for (int64_t s = 2; s <= 6; ++s) {
    now_ += Millis(100);
    for (int id : {0, 1, 3}) Step(id, s);  // each reports 0.1 s
  }
  std::vector<Action> all;
  for (int id : {0, 1, 3}) {
    auto a = Do(FinishedReceived{id, {6, "abcd"}});
    all.insert(all.end(), a.begin(), a.end());
  }
  ASSERT_FALSE(Find<EndJob>(all).empty());
  const std::string report = Printed(all);
  // 180 ms less the median of steps 2-6 (100 ms): 80 ms, 0.80 of a normal step.
  EXPECT_NE(report.find("time lost 80 ms, 0.80 of a normal step (100 ms, the job's median at its "
                        "end: no step time was known at the fault)"),
            std::string::npos)
      << report;
}

// A member lost while the spare started with the job is still warming up: the recovery waits for
// it (bounded) instead of shrinking now and growing again when it joins (a second
// reconfiguration, and other bits in the ring mode).
TEST_F(ControllerTest, ALostMemberWaitsForTheSpareStillStartingAndItTakesTheRank) {
  Join(2);
  Join(0);
  Join(1);  // the job runs; spare 3 has not joined yet
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  for (int id : {0, 1, 2}) Step(id, 5);
  now_ += Millis(100);  // the spare was started before the fault
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 5);
  auto waiting = Ready(1, 5);
  EXPECT_TRUE(Find<SendPlan>(waiting).empty()) << "planned without the spare that is starting";
  bool journaled = false;
  for (const auto& j : Find<AppendJournal>(waiting))
    journaled |= j.record.value("event", "") == "recovery_waits_for_spare";
  EXPECT_TRUE(journaled);
  now_ += Millis(300);
  EXPECT_TRUE(Find<SendPlan>(Do(Tick{})).empty()) << "within the wait";
  auto plans = Find<SendPlan>(Join(3, /*spare=*/true));
  ASSERT_EQ(plans.size(), 3u);
  ASSERT_EQ(plans[0].plan->members.size(), 3u) << "the world is kept";
  EXPECT_EQ(plans[0].plan->members[2].worker_id, 3) << "the spare takes the lost rank";
}

TEST_F(ControllerTest, TheWaitForAStartingSpareIsBoundedThenTheJobShrinks) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 1;
  o.heartbeat_timeout = Millis(1000);
  o.abort_timeout = Millis(2000);
  o.spare_wait = Millis(500);
  Make(std::move(o));
  Join(2);
  Join(0);
  Join(1);
  for (int id : {0, 1, 2}) Step(id, 5);
  now_ += Millis(100);  // the spare was started before the fault
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 5);
  EXPECT_TRUE(Find<SendPlan>(Ready(1, 5)).empty());
  now_ += Millis(499);
  EXPECT_TRUE(Find<SendPlan>(Do(Tick{})).empty());
  now_ += Millis(2);
  Do(Tick{});  // (any event after the wait ran out plans: here the agent's heartbeat before it)
  EXPECT_EQ(c_->phase(), JobPhase::kRunning) << "the spare did not come: the survivors go on";
  EXPECT_EQ(c_->generation(), 2u);
  EXPECT_EQ(c_->RankOf(1), 1);
  EXPECT_EQ(c_->RankOf(3), -1) << "the spare that never joined has no rank";
}

// A spare that dies while the recovery waits for it ends the wait at once: the replacement
// started for it starts cold and is not waited for.
TEST_F(ControllerTest, ASpareThatDiesWhileTheRecoveryWaitsForItEndsTheWait) {
  Join(2);
  Join(0);
  Join(1);
  for (int id : {0, 1, 2}) Step(id, 5);
  now_ += Millis(100);
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 5);
  EXPECT_TRUE(Find<SendPlan>(Ready(1, 5)).empty()) << "waiting for spare 3";
  Do(ProcessExited{3, 1003, 1, 0, kHost});  // it dies before joining
  EXPECT_EQ(c_->phase(), JobPhase::kRunning) << "planned without it, not 10 s later";
  EXPECT_EQ(c_->RankOf(3), -1);
}

// At scale a plan lists every member: its members get one shared plan (and
// one shared abort), never a copy each (docs/scale.md).
TEST_F(ControllerTest, MembersShareOnePlanAndOneAbort) {
  Make(3, 0);
  Join(0);
  Join(1);
  auto first = Find<SendPlan>(Join(2));
  ASSERT_EQ(first.size(), 3u);
  for (const auto& p : first) EXPECT_EQ(p.plan.get(), first[0].plan.get());
  for (int id : {0, 1, 2}) Step(id, 5);
  auto aborts = Find<SendAbort>(Do(ProcessExited{1, 1001, -1, 9, kHost}));
  ASSERT_EQ(aborts.size(), 2u);
  EXPECT_EQ(aborts[0].msg.get(), aborts[1].msg.get());
  EXPECT_EQ(aborts[0].msg->generation, 1u);
  Ready(0, 5);
  auto next = Find<SendPlan>(Ready(2, 5));
  ASSERT_EQ(next.size(), 2u);
  EXPECT_EQ(next[0].plan.get(), next[1].plan.get());
  EXPECT_NE(next[0].plan.get(), first[0].plan.get());
  EXPECT_EQ(next[0].plan->generation, 2u);
}

TEST_F(ControllerTest, SilentMemberIsDetectedByHeartbeatTimeoutAndKilled) {
  StartJob();
  now_ += Millis(600);
  Do(HeartbeatReceived{0, {1, -1}});
  Do(HeartbeatReceived{2, {1, -1}});
  EXPECT_TRUE(Find<SendAbort>(Do(Tick{})).empty());
  now_ += Millis(600);  // worker 1 silent for 1.2 s > 1 s
  Do(HeartbeatReceived{0, {2, -1}});
  Do(HeartbeatReceived{2, {2, -1}});
  Do(HeartbeatReceived{3, {-1, -1}});  // the spare is watched too
  auto actions = Do(Tick{});
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 1);
  EXPECT_EQ(Find<SendAbort>(actions).size(), 2u);
}

TEST_F(ControllerTest, TheMemberStuckOutsideTheCollectiveIsFoundAtTheBusyTimeout) {
  StartJob();
  // Ranks 0 and 2 wait in the collective; rank 1 is alive (heartbeats) but computing: busy, and
  // hung only once the others have waited the busy timeout (60 s by default).
  std::vector<Action> all;
  for (int t = 500; t <= 60'500; t += 500) {
    now_ += Millis(500);
    Do(HeartbeatReceived{0, {3, t}});
    Do(HeartbeatReceived{2, {3, t}});
    Do(HeartbeatReceived{1, {3, -1}});
    Do(HeartbeatReceived{3, {-1, -1}});
    auto actions = Do(Tick{});
    if (t <= 60'000) {
      ASSERT_TRUE(Find<KillWorker>(actions).empty()) << t << " ms: " << Printed(actions);
    } else {
      all = actions;
    }
  }
  auto kills = Find<KillWorker>(all);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 1);
}

TEST_F(ControllerTest, MemberThatDoesNotAbortInTimeIsKilledAndTheRecoveryGoesOn) {
  StartJob();
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 4);
  now_ += Millis(2100);                // rank 1 never answers
  Do(HeartbeatReceived{3, {-1, -1}});  // the spare is alive
  auto actions = Do(Tick{});
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 1);
  auto plans = Find<SendPlan>(actions);
  ASSERT_EQ(plans.size(), 2u) << "rank 0 and the spare";
}

// An abort the runtime holds back for the journal's sync (a hung disk: up to 11 s) makes nobody
// late; the members' 2 s to answer it start when it goes out.
TEST_F(ControllerTest, AnAbortHeldBackForTheJournalMakesNobodyLateUntilItGoesOut) {
  StartJob();
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Do(StopOrdersHeld{true});
  auto alive = [&] {
    for (int id : {0, 1, 3}) Do(HeartbeatReceived{id, {-1, -1}});
  };
  for (int second = 1; second <= 11; ++second) {
    now_ += Millis(1000);
    alive();
    EXPECT_TRUE(Find<KillWorker>(Do(Tick{})).empty()) << "held for " << second << " s";
  }
  Do(StopOrdersHeld{false});  // it goes out now
  now_ += Millis(1900);
  alive();
  EXPECT_TRUE(Find<KillWorker>(Do(Tick{})).empty()) << "2 s from its sending, not its decision";
  Ready(0, 4);
  now_ += Millis(200);
  alive();
  auto kills = Find<KillWorker>(Do(Tick{}));
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 1) << "rank 1 did not answer the abort it got 2.1 s ago";
}

TEST_F(ControllerTest, TwoFaultsInOneStepNeedTwoSparesOrShrink) {
  StartJob();
  Do(ProcessExited{1, 1001, -1, 9, kHost});
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  auto plans = Find<SendPlan>(Ready(0, 7));
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].plan->members.size(), 2u) << "one spare: ranks 0 and 1 remain";
  EXPECT_EQ(plans[0].plan->members[1].worker_id, 3);
}

TEST_F(ControllerTest, FaultDuringRecoveryStartsANewRecovery) {
  StartJob();
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 9);
  Ready(1, 9);  // plan 2: [0, 1, 3]
  ASSERT_EQ(c_->generation(), 2u);
  // The spare is receiving state when rank 1 dies.
  auto actions = Do(ProcessExited{1, 1001, -1, 9, kHost});
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  auto aborts = Find<SendAbort>(actions);
  ASSERT_EQ(aborts.size(), 2u);
  EXPECT_EQ(aborts[0].msg->generation, 2u);
  Ready(3, control::kNoValidState);  // its transfer was interrupted
  auto plans = Find<SendPlan>(Ready(0, 9));
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].plan->generation, 3u);
  ASSERT_EQ(plans[0].plan->transfers.size(), 1u);
  EXPECT_EQ(plans[0].plan->transfers[0].receiver, 3);
  EXPECT_EQ(c_->recoveries()[0].outcome, "superseded by recovery 2");
}

TEST_F(ControllerTest, StateHeldByNoSurvivorEndsTheJobWithAReason) {
  Make(1, 1);
  Join(0);
  Join(1, true);
  Step(0, 3);
  auto actions = Do(ProcessExited{0, 1000, -1, 9, kHost});
  auto ends = Find<EndJob>(actions);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitPeerFailure);
  EXPECT_NE(ends[0].reason.find("state of step 3 exists on no live worker"), std::string::npos)
      << ends[0].reason;
}

TEST_F(ControllerTest, MemberReportingACollectiveFailureStartsRecovery) {
  StartJob();
  auto actions = Ready(0, 4);
  EXPECT_EQ(Find<SendAbort>(actions).size(), 3u);
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  Ready(1, 4);
  auto plans = Find<SendPlan>(Ready(2, 4));
  ASSERT_EQ(plans.size(), 3u) << "nobody lost: same members, next generation";
  EXPECT_TRUE(plans[0].plan->transfers.empty());
}

TEST_F(ControllerTest, DeadSpareIsReplaced) {
  StartJob();
  auto spawns = Find<SpawnWorker>(Do(ProcessExited{3, 1003, -1, 9, kHost}));
  ASSERT_EQ(spawns.size(), 1u);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
}

TEST_F(ControllerTest, JobEndsWhenEveryMemberFinishedWithTheSameChecksum) {
  StartJob();
  EXPECT_TRUE(Find<EndJob>(Do(FinishedReceived{0, {100, "abcd"}})).empty());
  EXPECT_TRUE(Find<EndJob>(Do(FinishedReceived{1, {100, "abcd"}})).empty());
  auto actions = Do(FinishedReceived{2, {100, "abcd"}});
  auto ends = Find<EndJob>(actions);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitOk);
  EXPECT_TRUE(Find<KillWorker>(actions).empty());
  EXPECT_EQ(Find<SendShutdown>(actions).size(), 4u);
  EXPECT_TRUE(Do(ProcessExited{0, 1000, 0, 0, kHost}).empty());
}

// The job's store answers the job's workers (a write is journaled before its answer), and
// refuses a worker the job let go: it may still be running, and must not change what its
// replacement reads.
TEST_F(ControllerTest, TheStoreAnswersTheJobsWorkersAndRefusesOneTheJobLetGo) {
  StartJob();
  control::StoreRequestMsg set;
  set.client = "c1";
  set.seq = 1;
  set.op = control::StoreOp::kSet;
  set.keys = {"k"};
  set.value = "v";
  auto actions = Do(StoreRequested{1, set});
  auto replies = Find<SendStoreReply>(actions);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].worker_id, 1);
  EXPECT_TRUE(replies[0].msg.error.empty()) << replies[0].msg.error;
  ASSERT_FALSE(actions.empty());
  ASSERT_TRUE(std::holds_alternative<AppendJournal>(actions[0])) << "the record before the answer";
  EXPECT_EQ(std::get<AppendJournal>(actions[0]).record["event"], "store");
  EXPECT_EQ(c_->store().keys(), 1u);
  Do(ProcessExited{1, 1001, -1, 9, kHost});  // worker 1 is gone: a spare takes rank 1
  set.seq = 2;
  set.value = "from a worker the job let go";
  auto refused = Find<SendStoreReply>(Do(StoreRequested{1, set}));
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].msg.code, "invalid");
  EXPECT_NE(refused[0].msg.error.find("no longer in the job"), std::string::npos);
  control::StoreRequestMsg get;
  get.client = "c0";
  get.seq = 1;
  get.op = control::StoreOp::kGet;
  get.keys = {"k"};
  auto got = Find<SendStoreReply>(Do(StoreRequested{0, get}));
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].msg.value, "v");
}

// A member that finished while the others, past its last step, wait in a collective: it will
// never come, and the job would wait for ever (a spare whose loop started elsewhere). The job
// ends with 12 saying so; a wait of under 2 s (the last step's ring finishing) does not.
TEST_F(ControllerTest, AMemberThatFinishedWhileTheOthersWaitInALaterStepEndsTheJob) {
  StartJob();
  for (int id : {0, 1, 2}) Do(ProgressReceived{id, {10, 2.0, 0.1, 100, 3}});
  Do(HeartbeatReceived{0, {10, 2'500}});  // before the finish: stale once it comes
  EXPECT_TRUE(Find<EndJob>(Do(FinishedReceived{2, {10, "abcd"}})).empty());
  EXPECT_TRUE(Find<EndJob>(Do(Tick{})).empty()) << "a heartbeat from before the finish";
  now_ += Millis(1'000);
  Do(HeartbeatReceived{1, {10, 1'500}});
  EXPECT_TRUE(Find<EndJob>(Do(Tick{})).empty()) << "1 s after the finish";
  now_ += Millis(1'500);
  Do(HeartbeatReceived{0, {10, -1}});     // its collective ended: it computes
  Do(HeartbeatReceived{1, {10, 1'000}});  // began after the finish: no evidence
  EXPECT_TRUE(Find<EndJob>(Do(Tick{})).empty());
  Do(HeartbeatReceived{1, {10, 4'000}});  // waiting since before the finish, 2.5 s after it
  auto ends = Find<EndJob>(Do(Tick{}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitScriptFailure);
  EXPECT_NE(ends[0].reason.find("rank 2 finished training after step 10, while rank 1 waits in the "
                                "collective of step 11"),
            std::string::npos)
      << ends[0].reason;
}

// A member whose script fails after training ended (after destroy_process_group: saving the
// model, say) fails the job, as torchrun's would; the spare told to go, or a signal from the
// agents' stop, does not.
TEST_F(ControllerTest, AMemberThatExitsWithAnErrorAfterTheEndFailsTheJob) {
  StartJob();
  Do(FinishedReceived{0, {100, "abcd"}});
  Do(FinishedReceived{1, {100, "abcd"}});
  ASSERT_EQ(Find<EndJob>(Do(FinishedReceived{2, {100, "abcd"}})).size(), 1u);
  EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{0, 1000, 0, 0, kHost})).empty());
  EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{3, 1003, 1, 0, kHost})).empty()) << "the spare";
  EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{2, 1002, -1, 9, kHost})).empty()) << "a signal";
  auto actions = Do(ProcessExited{1, 1001, 3, 0, kHost});
  auto ends = Find<EndJob>(actions);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitScriptFailure);
  EXPECT_NE(ends[0].reason.find("rank 1 (worker 1) exited with code 3"), std::string::npos)
      << ends[0].reason;
  int failed_after_end = 0;
  for (const auto& j : Find<AppendJournal>(actions))
    failed_after_end += j.record.value("event", "") == "failed_after_end";
  EXPECT_EQ(failed_after_end, 1);
  EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{1, 1001, 3, 0, kHost})).empty()) << "once";
}

// A process that holds no state (started, not joined yet: a refill spare
// still starting) is ended with the job at once; it cannot hear the
// shutdown, and the job's end does not wait for it.
TEST_F(ControllerTest, AtTheEndASpareThatHasNotJoinedYetIsKilledAtOnce) {
  StartJob();
  // the spare died: a refill starts
  auto spawns = Find<SpawnWorker>(Do(ProcessExited{3, 1003, -1, 9, kHost}));
  ASSERT_EQ(spawns.size(), 1u);
  const int refill = spawns[0].worker_id;
  Do(FinishedReceived{0, {100, "abcd"}});
  Do(FinishedReceived{1, {100, "abcd"}});
  auto actions = Do(FinishedReceived{2, {100, "abcd"}});
  ASSERT_EQ(Find<EndJob>(actions).size(), 1u);
  EXPECT_EQ(Find<EndJob>(actions)[0].exit_code, kExitOk);
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u) << "only the refill that has not joined";
  EXPECT_EQ(kills[0].worker_id, refill);
  EXPECT_EQ(Find<SendShutdown>(actions).size(), 3u)
      << "the members are told, and they exit on their own";
}

TEST_F(ControllerTest, FaultAfterSomeMembersFinishedRecoversThemToo) {
  StartJob();
  Do(FinishedReceived{0, {100, "abcd"}});
  Do(FinishedReceived{1, {100, "abcd"}});
  auto aborts = Find<SendAbort>(Do(ProcessExited{2, 1002, -1, 9, kHost}));
  EXPECT_EQ(aborts.size(), 2u) << "finished members hold the state and take part";
  Ready(0, 100);
  auto plans = Find<SendPlan>(Ready(1, 100));
  ASSERT_EQ(plans.size(), 3u);
  EXPECT_EQ(plans[0].plan->resume_step, 101);
}

TEST_F(ControllerTest, DivergentChecksumsAreDataCorruption) {
  StartJob();
  Do(FinishedReceived{0, {100, "abcd"}});
  auto ends = Find<EndJob>(Do(FinishedReceived{1, {100, "ffff"}}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitDataCorruption);
}

TEST_F(ControllerTest, TimedFaultSignalsTheWorkerHoldingTheRank) {
  Make(3, 1, *control::ParseFaults("hang:rank=1,time=2"));
  StartJob();
  now_ += Millis(1000);
  EXPECT_TRUE(Find<SignalWorker>(Do(Tick{})).empty());
  now_ += Millis(1100);
  auto sigs = Find<SignalWorker>(Do(Tick{}));
  ASSERT_EQ(sigs.size(), 1u);
  EXPECT_EQ(sigs[0].worker_id, 1);
  EXPECT_EQ(sigs[0].signal, SIGSTOP);
  EXPECT_TRUE(c_->pending_faults().empty()) << "fired once";
}

// A worker killed by its step fault before its announcement left: the fault is spent all the same,
// so the spare taking its rank at that step is not killed by it again.
TEST_F(ControllerTest, AStepFaultWhoseWorkerDiedUnannouncedIsNotHandedToItsSpare) {
  Make(3, 1, *control::ParseFaults("kill:rank=1,step=41;kill:rank=2,step=41;hang:rank=1,step=60"));
  StartJob();
  for (int id : {0, 1, 2}) Step(id, 40);
  Do(ProcessExited{1, 1001, -1, 9, kHost});  // no InjectedReceived: the announcement was lost
  Ready(0, 40);
  auto plans = Find<SendPlan>(Ready(2, 40));
  ASSERT_EQ(plans.size(), 3u);
  ASSERT_EQ(plans[0].plan->resume_step, 41);
  std::vector<std::string> handed;
  for (const control::FaultSpec& f : plans[0].plan->faults)
    handed.push_back(control::FormatFault(f));
  EXPECT_EQ(handed, (std::vector<std::string>{"kill:rank=2,step=41", "hang:rank=1,step=60"}))
      << "only rank 1's fault at step 41 fired; rank 2 lives and a later step is to come";
  EXPECT_EQ(c_->pending_faults().size(), 2u);
  // Its announcement, late: said already, so not journaled again.
  auto late = Do(InjectedReceived{1, {/*fault_id=*/0, "kill:rank=1,step=41"}});
  for (const AppendJournal& j : Find<AppendJournal>(late))
    EXPECT_NE(j.record.value("event", ""), "fault_injected") << j.record.dump();
}

// A member lost before the step of its fault (here at step 39): the fault has not fired, and the
// spare that takes the rank is handed it.
TEST_F(ControllerTest, AStepFaultOfAMemberLostBeforeItsStepIsHandedToItsSpare) {
  Make(3, 1, *control::ParseFaults("kill:rank=1,step=41"));
  StartJob();
  for (int id : {0, 1, 2}) Step(id, 38);
  Do(ProcessExited{1, 1001, -1, 9, kHost});
  Ready(0, 38);
  auto plans = Find<SendPlan>(Ready(2, 38));
  ASSERT_EQ(plans.size(), 3u);
  ASSERT_EQ(plans[0].plan->faults.size(), 1u);
  EXPECT_EQ(control::FormatFault(plans[0].plan->faults[0]), "kill:rank=1,step=41");
}

TEST_F(ControllerTest, DuplicateWorkerIdIsRefused) {
  Join(0);
  auto actions = Join(0);
  EXPECT_EQ(Find<SendShutdown>(actions).size(), 1u);
  EXPECT_EQ(c_->phase(), JobPhase::kForming);
}

TEST_F(ControllerTest, WorkerDyingBeforeJoinFailsTheForming) {
  Join(0);
  auto ends = Find<EndJob>(Do(ProcessExited{1, 1001, 127, 0, kHost}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_NE(ends[0].reason.find("before joining"), std::string::npos);
}

// ---- hardening (issue 8): every worker watched in every phase

TEST_F(ControllerTest, SpareThatGoesSilentIsKilledReplacedAndNeverPromoted) {
  StartJob();
  now_ += Millis(1200);  // the members speak, the spare (worker 3) does not
  for (int id : {0, 1, 2}) Do(HeartbeatReceived{id, {1, -1}});
  auto actions = Do(Tick{});
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 3);
  auto spawns = Find<SpawnWorker>(actions);
  ASSERT_EQ(spawns.size(), 1u);
  EXPECT_TRUE(spawns[0].spare);
  EXPECT_NE(spawns[0].worker_id, 3);
  EXPECT_TRUE(Find<SendAbort>(actions).empty()) << "losing a spare is no recovery";
  // A member dies now: the hung spare must not take its rank.
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 1);
  auto plans = Find<SendPlan>(Ready(1, 1));
  ASSERT_EQ(plans.size(), 2u);
  for (const auto& m : plans[0].plan->members) EXPECT_NE(m.worker_id, 3);
}

TEST_F(ControllerTest, StoppedProcessIsAFaultAtOnceWhateverItsRole) {
  StartJob();
  auto actions = Do(ProcessStopped{1, 1001, SIGSTOP, kHost});
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 1);
  EXPECT_EQ(Find<SendAbort>(actions).size(), 2u);
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  // A stopped spare is replaced, and not used by the recovery in progress.
  actions = Do(ProcessStopped{3, 1003, SIGSTOP, kHost});
  ASSERT_EQ(Find<KillWorker>(actions).size(), 1u);
  ASSERT_EQ(Find<SpawnWorker>(actions).size(), 1u);
  Ready(0, 4);
  auto plans = Find<SendPlan>(Ready(2, 4));
  ASSERT_EQ(plans.size(), 2u) << "shrink: the stopped spare is not promoted";
}

TEST_F(ControllerTest, HangDetectorFindsAMemberFarBehindTheUsualArrivalSpread) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 1;
  o.busy_timeout = Millis(500);  // a test's: the default is 60 s
  Make(o);
  StartJob();
  // Ten normal steps: everyone reaches the collective within 20 ms.
  for (int64_t step = 0; step < 10; ++step) {
    for (int id : {0, 1, 2}) {
      Do(HeartbeatReceived{id, {step - 1, 0}});
      now_ += Millis(10);
    }
    now_ += Millis(100);
    for (int id : {0, 1, 2}) Step(id, step);
    Do(HeartbeatReceived{3, {-1, -1}});
  }
  // Step 10: ranks 0 and 2 arrive; rank 1 still computes (its heartbeats go on).
  Do(HeartbeatReceived{0, {9, 0}});
  Do(HeartbeatReceived{2, {9, 0}});
  now_ += Millis(700);
  for (int id : {1, 3}) Do(HeartbeatReceived{id, {id == 1 ? 9 : -1, -1}});
  EXPECT_TRUE(Find<KillWorker>(Do(Tick{})).empty())
      << "700 ms is within max(500 ms, 8 × 20 ms, 8 × the median step of 100 ms)";
  now_ += Millis(200);
  for (int id : {1, 3}) Do(HeartbeatReceived{id, {id == 1 ? 9 : -1, -1}});
  auto actions = Do(Tick{});
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 1);
  bool journaled = false;
  for (const auto& j : Find<AppendJournal>(actions)) {
    journaled = journaled || (j.record["event"] == "fault" && j.record["kind"] == "hang detector");
  }
  EXPECT_TRUE(journaled);
}

// Slow is not hung: rank 0 saving a snapshot for 6 s while the others wait
// in the next collective (PyTorch's DDP tutorial) is no fault under the
// default busy timeout; the wait is journaled and shown, and ends.
TEST_F(ControllerTest, ARankSavingForSixSecondsIsNotHungAndTheWaitIsShown) {
  StartJob();
  StepsOf100Ms(9);
  Do(HeartbeatReceived{1, {9, 0}});
  Do(HeartbeatReceived{2, {9, 0}});
  std::vector<Action> all;
  for (int t = 0; t < 6'000; t += 250) {
    now_ += Millis(250);
    Do(HeartbeatReceived{0, {9, -1}});  // computing: writing its snapshot
    Do(HeartbeatReceived{1, {9, t + 250}});
    Do(HeartbeatReceived{2, {9, t + 250}});
    Do(HeartbeatReceived{3, {-1, -1}});
    auto actions = Do(Tick{});
    all.insert(all.end(), actions.begin(), actions.end());
  }
  EXPECT_TRUE(Find<KillWorker>(all).empty()) << Printed(all);
  EXPECT_TRUE(Find<SendAbort>(all).empty()) << Printed(all);
  int waiting = 0;
  for (const auto& j : Find<AppendJournal>(all)) {
    if (j.record.value("event", "") != "waiting") continue;
    ++waiting;
    EXPECT_EQ(j.record.value("rank", -1), 0);
  }
  EXPECT_EQ(waiting, 1) << "journaled once, when the wait passed 2 s";
  const nlohmann::json status = c_->Status();
  ASSERT_TRUE(status["waiting_for"].is_object()) << status.dump();
  EXPECT_EQ(status["waiting_for"]["rank"], 0);
  EXPECT_GE(status["waiting_for"]["waited_ms"].get<int64_t>(), 5'900);
  for (int id : {0, 1, 2}) Step(id, 10);
  bool ended = false;
  for (const auto& j : Find<AppendJournal>(Do(Tick{}))) {
    ended = ended || j.record.value("event", "") == "waiting_end";
  }
  EXPECT_TRUE(ended);
  EXPECT_TRUE(c_->Status()["waiting_for"].is_null());
}

// A section the script marked busy holds the hang detector off until its
// bound, however low the busy timeout; past the bound the wait counts, and
// a busy timeout later it is a hang.
TEST_F(ControllerTest, AMarkedBusySectionIsNotHungUntilItsBound) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 1;
  o.busy_timeout = Millis(500);
  Make(o);
  StartJob();
  StepsOf100Ms(9);
  Do(HeartbeatReceived{1, {9, 0}});
  Do(HeartbeatReceived{2, {9, 0}});
  int t = 0;  // ms since rank 0 entered its section and the others began to wait
  auto wait = [&](int ms) {
    std::vector<Action> all;
    for (int end = t + ms; t < end;) {
      t += 250;
      now_ += Millis(250);
      control::HeartbeatMsg busy{9, -1, "evaluation", t, 5'000};
      Do(HeartbeatReceived{0, busy});
      Do(HeartbeatReceived{1, {9, t}});
      Do(HeartbeatReceived{2, {9, t}});
      Do(HeartbeatReceived{3, {-1, -1}});
      auto actions = Do(Tick{});
      all.insert(all.end(), actions.begin(), actions.end());
    }
    return all;
  };
  auto within = wait(4'750);
  EXPECT_TRUE(Find<KillWorker>(within).empty()) << Printed(within);
  EXPECT_EQ(c_->Status()["waiting_for"]["section"], "evaluation");
  auto bound = wait(500);
  EXPECT_TRUE(Find<KillWorker>(bound).empty()) << "past its bound, the wait counts from there";
  auto past = wait(1000);
  auto kills = Find<KillWorker>(past);
  // The threshold: the busy timeout, or 8 x the median step of 100 ms.
  ASSERT_EQ(kills.size(), 1u) << "6.25 s into a section bound to 5 s, past the threshold of 0.8 s";
  EXPECT_EQ(kills[0].worker_id, 0);
}

// The others' wait during a marked section does not count once it ends: the
// rank has a busy timeout from then on to reach the collective.
TEST_F(ControllerTest, AWaitDuringAMarkedSectionDoesNotCountAfterItEnds) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 1;
  o.busy_timeout = Millis(500);
  Make(o);
  StartJob();
  StepsOf100Ms(9);
  int t = 0;
  auto wait = [&](int ms, bool busy) {
    std::vector<Action> all;
    for (int end = t + ms; t < end;) {
      t += 250;
      now_ += Millis(250);
      control::HeartbeatMsg beat{9, -1};
      if (busy) beat = {9, -1, "evaluation", t, 60'000};
      Do(HeartbeatReceived{0, beat});
      Do(HeartbeatReceived{1, {9, t}});
      Do(HeartbeatReceived{2, {9, t}});
      Do(HeartbeatReceived{3, {-1, -1}});
      auto actions = Do(Tick{});
      all.insert(all.end(), actions.begin(), actions.end());
    }
    return all;
  };
  auto busy = wait(3'000, true);
  EXPECT_TRUE(Find<KillWorker>(busy).empty()) << Printed(busy);
  auto after = wait(500, false);  // the first heartbeat without the section says it ended
  EXPECT_TRUE(Find<KillWorker>(after).empty())
      << "3.5 s of waiting, 0.25 s of it after the section";
  auto late = wait(750, false);
  // The threshold: the busy timeout, or 8 x the median step of 100 ms.
  ASSERT_EQ(Find<KillWorker>(late).size(), 1u)
      << "1 s after the section, past the threshold of 0.8 s";
}

// A failure the script raised is held for the failure window (the others'
// failed collective with it), then the rank is replaced; the same exception
// on the replacement is a repeat, and the second repeat ends the job with
// exit 12, the traceback in its reason, without a third recovery.
TEST_F(ControllerTest, AFailureThatRecursOnTheReplacementsEndsTheJob) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 1;
  o.failure_window = Millis(300);
  Make(o);
  StartJob();
  StepsOf100Ms(4);
  int failing = 1;  // the worker that holds rank 1
  int spare = 3;
  int next_worker = 4;
  for (int round = 0; round < 3; ++round) {
    control::FailureMsg f{c_->generation(), 5, "ValueError: bad sample 17", 1,
                          "Traceback (most recent call last):\n  File \"train.py\"\n"};
    auto reported = Do(FailureReported{failing, f});
    EXPECT_TRUE(Find<KillWorker>(reported).empty()) << "held for the window";
    Do(ProcessExited{failing, 1000 + failing, 1, 0, kHost});
    // The others' collective fails as the raising process leaves: their Ready waits for the
    // window, and counts when it ends (no abort to wait for).
    for (int id : std::vector<int>(c_->members())) {  // Ready may form the next generation
      if (id != failing) Ready(id, 4);
    }
    ASSERT_EQ(c_->phase(), JobPhase::kRunning) << "no recovery before the window ends";
    now_ += Millis(300);
    auto acted = Do(Tick{});
    if (round == 2) {
      auto ends = Find<EndJob>(acted);
      ASSERT_EQ(ends.size(), 1u) << Printed(acted);
      EXPECT_EQ(ends[0].exit_code, kExitScriptFailure);
      EXPECT_NE(ends[0].reason.find("the same exception was raised 3 times"), std::string::npos)
          << ends[0].reason;
      EXPECT_NE(ends[0].reason.find("Rank 1 raised at step 5: ValueError: bad sample 17"),
                std::string::npos)
          << ends[0].reason;
      EXPECT_NE(ends[0].reason.find("File \"train.py\""), std::string::npos) << ends[0].reason;
      EXPECT_TRUE(Find<SendPlan>(acted).empty());
      return;
    }
    ASSERT_FALSE(Find<SendPlan>(acted).empty()) << "the survivors were ready: " << Printed(acted);
    Join(next_worker, /*spare=*/true);  // the refill
    ASSERT_EQ(c_->RankOf(spare), 1) << "the spare takes rank 1";
    failing = spare;
    spare = next_worker++;
  }
}

// A rank found hung at the same step on its replacements (an evaluation on
// rank 1 longer than the busy timeout, every time) ends the job with exit 12
// at the second repeat, saying what to do.
TEST_F(ControllerTest, AHangThatRecursAtTheSameStepOnTheReplacementsEndsTheJob) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 1;
  o.busy_timeout = Millis(500);
  // A recovery's first step allows the join timeout (a spare in the script's setup).
  o.forming_timeout = Millis(1500);
  Make(o);
  StartJob();
  StepsOf100Ms(9);
  int hung = 1, spare = 3, next_worker = 4;
  for (int round = 0; round < 3; ++round) {
    std::vector<Action> all;
    for (int t = 0; t < 3000 && Find<KillWorker>(all).empty() && c_->phase() == JobPhase::kRunning;
         t += 100) {
      now_ += Millis(100);
      for (int id : c_->members()) Do(HeartbeatReceived{id, {9, id == hung ? -1 : t + 100}});
      Do(HeartbeatReceived{spare, {-1, -1}});
      auto actions = Do(Tick{});
      all.insert(all.end(), actions.begin(), actions.end());
    }
    if (round == 2) {
      auto ends = Find<EndJob>(all);
      ASSERT_EQ(ends.size(), 1u) << Printed(all);
      EXPECT_EQ(ends[0].exit_code, kExitScriptFailure);
      EXPECT_NE(ends[0].reason.find("rank 1 kept the others waiting at the collective of step 10 "
                                    "past the busy timeout 3 times"),
                std::string::npos)
          << ends[0].reason;
      EXPECT_NE(ends[0].reason.find("session.busy"), std::string::npos) << ends[0].reason;
      return;
    }
    ASSERT_EQ(Find<KillWorker>(all).size(), 1u) << Printed(all);
    ASSERT_EQ(c_->phase(), JobPhase::kRecovering) << Printed(all);
    for (int id : std::vector<int>(c_->members())) {  // Ready may form the next generation
      if (id != hung) Ready(id, 9);
    }
    Join(next_worker, /*spare=*/true);  // the refill
    ASSERT_EQ(c_->RankOf(spare), 1) << "the spare takes rank 1";
    hung = spare;
    spare = next_worker++;
  }
}

// A held report whose worker was faulted meanwhile (its heartbeats stopped
// first, with a window longer than the heartbeat timeout) holds nothing: a
// member's Ready then starts the recovery it asks for at once.
TEST_F(ControllerTest, AReadyIsActedOnWhenTheHeldFailuresWorkerIsGoneAlready) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 2;
  o.failure_window = Millis(2000);
  Make(o);
  StartJob();
  Join(4, /*spare=*/true);
  StepsOf100Ms(4);
  Do(FailureReported{1, {c_->generation(), 5, "ValueError: bad sample", 1, ""}});
  for (int t = 0; t < 1200; t += 100) {  // worker 1 is silent: the heartbeat timeout faults it
    now_ += Millis(100);
    for (int id : {0, 2, 3, 4}) Do(HeartbeatReceived{id, {4, -1}});
    Do(Tick{});
  }
  ASSERT_EQ(c_->phase(), JobPhase::kRecovering);
  Ready(0, 4);
  Ready(2, 4);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning) << "generation 2, with a spare in rank 1";
  auto ready = Ready(2, 4);  // its connection to the new rank 1 broke
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering)
      << "the held report is of a worker no longer in the job: " << Printed(ready);
}

// Every member raising the same exception at the same step is the script's
// bug at once: no rank is replaced.
TEST_F(ControllerTest, EveryMemberRaisingTheSameExceptionEndsTheJobAtOnce) {
  StartJob();
  StepsOf100Ms(4);
  std::vector<Action> all;
  for (int id : {0, 1, 2}) {
    control::FailureMsg f{c_->generation(), 5,
                          "RuntimeError: call sampler.set_epoch(epoch) before iterating", 1, ""};
    auto actions = Do(FailureReported{id, f});
    all.insert(all.end(), actions.begin(), actions.end());
  }
  auto ends = Find<EndJob>(all);
  ASSERT_EQ(ends.size(), 1u) << Printed(all);
  EXPECT_EQ(ends[0].exit_code, kExitScriptFailure);
  EXPECT_NE(ends[0].reason.find("every member (3) raised the same exception at step 5"),
            std::string::npos)
      << ends[0].reason;
  EXPECT_TRUE(Find<SendPlan>(all).empty());
  EXPECT_TRUE(c_->recoveries().empty()) << "no recovery was started";
}

// Different failures on different ranks are not the script's: each is
// replaced, and the first member's exit does not act before the window ends.
TEST_F(ControllerTest, DifferentFailuresAreReplacedAsFaults) {
  StartJob();
  StepsOf100Ms(4);
  Do(FailureReported{0, {c_->generation(), 5, "RuntimeError: CUDA error: ECC", 1, ""}});
  auto exit = Do(ProcessExited{0, 1000, 1, 0, kHost});
  EXPECT_TRUE(Find<SendAbort>(exit).empty()) << "its report is held: the exit waits for it";
  now_ += Millis(300);
  auto acted = Do(Tick{});
  EXPECT_EQ(Find<SendAbort>(acted).size(), 2u) << Printed(acted);
  EXPECT_TRUE(Find<EndJob>(acted).empty());
}

// The last guard: more recoveries than the budget within its window end the job.
TEST_F(ControllerTest, TheRecoveryBudgetEndsALoopOfFaults) {
  ControllerOptions o;
  o.world_size = 3;
  o.spares = 1;
  o.recovery_budget = 2;
  o.recovery_budget_window = Millis(60'000);
  Make(o);
  StartJob();
  StepsOf100Ms(4);
  int victim = 2, spare = 3, next_worker = 4;
  for (int round = 0; round < 3; ++round) {
    auto actions = Do(ProcessExited{victim, 1000 + victim, -1, 9, kHost});
    if (round == 2) {
      auto ends = Find<EndJob>(actions);
      ASSERT_EQ(ends.size(), 1u) << Printed(actions);
      EXPECT_EQ(ends[0].exit_code, kExitPeerFailure);
      EXPECT_NE(ends[0].reason.find("more than 2 recoveries within 60 s"), std::string::npos)
          << ends[0].reason;
      return;
    }
    for (int id : std::vector<int>(c_->members())) {  // Ready may form the next generation
      if (id != victim) Ready(id, 4);
    }
    Join(next_worker, /*spare=*/true);
    ASSERT_EQ(c_->RankOf(spare), 2);
    for (int id : c_->members()) Step(id, 5 + round);
    victim = spare;
    spare = next_worker++;
    now_ += Millis(1'000);
  }
}

// The stall watchdog: a world of one whose training thread hangs (its I/O
// thread still heartbeats) has no other member to lag behind, so only the
// absence of completed steps can tell. It is aborted, cannot answer, and is
// killed; with no other holder of the state the job ends saying why.
TEST_F(ControllerTest, StallWatchdogEndsAWorldOfOneThatStopsCompletingSteps) {
  ControllerOptions o;
  o.world_size = 1;
  o.stall_floor = Millis(10'000);
  o.stall_factor = 10.0;
  o.busy_timeout = Millis(10'000);  // its member computes: the bound is at least this
  Make(o);
  Join(0);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  for (int64_t step = 0; step < 5; ++step) {
    now_ += Millis(2000);
    // 2 s steps: the bound is max(10 s, 10 × 2 s) = 20 s
    Do(ProgressReceived{0, {step, 3.0, 2.0, 100, 1}});
  }
  auto silent_for = [&](int ms) {
    std::vector<Action> all;
    for (int t = 0; t < ms; t += 500) {
      now_ += Millis(500);
      Do(HeartbeatReceived{0, {4, -1}});
      auto actions = Do(Tick{});
      all.insert(all.end(), actions.begin(), actions.end());
    }
    return all;
  };
  EXPECT_TRUE(Find<SendAbort>(silent_for(19'500)).empty())
      << "19.5 s without a step is within the bound";
  auto aborted = silent_for(1000);
  ASSERT_EQ(Find<SendAbort>(aborted).size(), 1u) << "20 s without a step: the member is aborted";
  EXPECT_TRUE(Find<KillWorker>(aborted).empty()) << "a stuck collective could still answer";
  bool journaled = false;
  for (const auto& j : Find<AppendJournal>(aborted)) {
    journaled = journaled || (j.record["event"] == "fault" && j.record["kind"] == "stall watchdog");
  }
  EXPECT_TRUE(journaled);
  auto escalated = silent_for(3500);  // never answers: the escalation kills it
  ASSERT_EQ(Find<KillWorker>(escalated).size(), 1u);
  auto ends = Find<EndJob>(escalated);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitPeerFailure);
  EXPECT_NE(ends[0].reason.find("exists on no live worker"), std::string::npos) << ends[0].reason;
}

// Every member waits in a collective that never completes (no one computes, so
// no one lags): the stall watchdog aborts them all; they answer and re-form.
TEST_F(ControllerTest, StallWatchdogReformsMembersStuckTogetherInACollective) {
  ControllerOptions o;
  o.world_size = 3;
  o.stall_floor = Millis(10'000);
  Make(o);
  for (int id : {0, 1, 2}) Join(id);
  for (int64_t step = 0; step < 5; ++step) {
    now_ += Millis(200);
    for (int id : {0, 1, 2}) Step(id, step);
  }
  std::vector<Action> actions;
  for (int t = 0; t < 10'500 && Find<SendAbort>(actions).empty(); t += 500) {
    now_ += Millis(500);
    for (int id : {0, 1, 2}) Do(HeartbeatReceived{id, {4, t + 500}});
    actions = Do(Tick{});
    EXPECT_TRUE(Find<KillWorker>(actions).empty())
        << "no one computes: the hang detector blames no one";
  }
  ASSERT_EQ(Find<SendAbort>(actions).size(), 3u);
  Ready(0, 4);
  Ready(1, 4);
  auto plans = Find<SendPlan>(Ready(2, 4));
  ASSERT_EQ(plans.size(), 3u) << "the same members form the next generation";
  EXPECT_EQ(plans[0].plan->generation, 2u);
  EXPECT_EQ(plans[0].plan->resume_step, 5);
}

TEST_F(ControllerTest, StallWatchdogAllowsTheFirstStepTheFormingTimeout) {
  ControllerOptions o;
  o.world_size = 1;
  o.stall_floor = Millis(10'000);
  o.forming_timeout = Millis(60'000);
  Make(o);
  Join(0);
  for (int t = 0; t < 59'000; t += 500) {
    now_ += Millis(500);
    Do(HeartbeatReceived{0, {-1, -1}});
    ASSERT_TRUE(Find<SendAbort>(Do(Tick{})).empty())
        << "aborted at " << t << " ms, before the first step";
  }
  now_ += Millis(1500);
  Do(HeartbeatReceived{0, {-1, -1}});
  EXPECT_EQ(Find<SendAbort>(Do(Tick{})).size(), 1u) << "the first step is bounded too";
}

// A refill that joins after the end (or a worker that lost its connection
// and dials again) is told the job ended, rather than waiting for a plan.
// Issue 52: a worker whose NONSTOP_SEALED_STATE_COPY differs from the job's is refused at its join
// (exit 2, naming the setting), before a plan gives it a rank: every copy to or from it would fail,
// and each recovery would give it the rank again (a new-user trial: 20 in 0.4 s, then exit 10).
TEST_F(ControllerTest, AWorkerThatSealsItsStateCopiesOtherwiseThanTheJobIsRefusedAtJoin) {
  StartJob();
  control::JoinMsg m{7, 1007, "127.0.0.1:5007", /*spare=*/true, -1, ""};
  m.sealed_copy = true;
  auto shutdowns = Find<SendShutdown>(Do(WorkerJoined{m}));
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_EQ(shutdowns[0].worker_id, 7);
  EXPECT_EQ(shutdowns[0].msg.exit_code, kExitUsage);
  EXPECT_NE(shutdowns[0].msg.reason.find("worker 7 seals its state copies and the job's workers "
                                         "do not: every worker must have the same "
                                         "NONSTOP_SEALED_STATE_COPY"),
            std::string::npos)
      << shutdowns[0].msg.reason;
  EXPECT_EQ(c_->RankOf(7), -1);
  m.sealed_copy = false;  // the same worker as the job: taken
  m.worker_id = 8;
  EXPECT_TRUE(Find<SendShutdown>(Do(WorkerJoined{m})).empty());
}

TEST_F(ControllerTest, WorkerJoiningAfterTheEndIsToldTheJobEnded) {
  StartJob();
  Do(Interrupted{"a test"});
  ASSERT_EQ(c_->phase(), JobPhase::kEnded);
  auto shutdowns = Find<SendShutdown>(Join(7, /*spare=*/true));
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_EQ(shutdowns[0].worker_id, 7);
  EXPECT_NE(shutdowns[0].msg.reason.find("the job has ended: interrupted by a test"),
            std::string::npos)
      << shutdowns[0].msg.reason;
  EXPECT_EQ(shutdowns[0].msg.exit_code, kExitInterrupted);
}

TEST_F(ControllerTest, WorkerThatHangsWhileTheJobFormsIsReplacedByASpare) {
  Join(0);
  Join(3, true);
  now_ += Millis(1200);  // worker 0 silent
  Do(HeartbeatReceived{3, {-1, -1}});
  auto actions = Do(Tick{});
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 0);
  ASSERT_EQ(Find<SpawnWorker>(actions).size(), 1u) << "the pool refills";
  Join(1);
  auto plans = Find<SendPlan>(Join(2));
  ASSERT_EQ(plans.size(), 3u);
  EXPECT_EQ(plans[0].plan->members[0].worker_id, 1);
  EXPECT_EQ(plans[0].plan->members[2].worker_id, 3) << "the spare took the hung worker's place";
}

TEST_F(ControllerTest, JobThatDoesNotFormInTimeEndsNamingTheMissingWorkers) {
  ControllerOptions o;
  o.world_size = 3;
  o.forming_timeout = Millis(5000);
  Make(o);
  Join(0);
  Join(2);
  std::vector<EndJob> ends;
  for (int i = 0; i < 6 && ends.empty(); ++i) {
    now_ += Millis(900);
    Do(HeartbeatReceived{0, {-1, -1}});
    Do(HeartbeatReceived{2, {-1, -1}});
    ends = Find<EndJob>(Do(Tick{}));
    if (i < 5) {
      EXPECT_TRUE(ends.empty()) << "ended early, at " << (i + 1) * 900 << " ms";
    }
  }
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitPeerFailure);
  EXPECT_NE(ends[0].reason.find("did not form within 5 s"), std::string::npos) << ends[0].reason;
  EXPECT_NE(ends[0].reason.find("[1]"), std::string::npos) << ends[0].reason;
  ASSERT_EQ(c_->phase(), JobPhase::kEnded);
}

TEST_F(ControllerTest, SpareThatNeverJoinsIsKilledAndReplaced) {
  ControllerOptions o;
  o.world_size = 2;
  o.spares = 1;
  o.join_timeout = Millis(3000);
  o.heartbeat_timeout = Millis(100'000);
  Make(o);
  Join(0);
  Join(1);  // worker 2, the spare, never joins
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  now_ += Millis(3100);
  auto actions = Do(Tick{});
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 2);
  auto spawns = Find<SpawnWorker>(actions);
  ASSERT_EQ(spawns.size(), 1u);
  EXPECT_TRUE(spawns[0].spare);
  EXPECT_GT(spawns[0].worker_id, 2);
}

TEST_F(ControllerTest, HugeScaleRequestIsRefusedWithoutOverflow) {
  StartJob();
  for (const char* body : {R"({"grow": 2147483647})", R"({"grow": 18446744073709551615})",
                           R"({"world_size": -5})", R"({"release": 9223372036854775807})"}) {
    auto actions = Do(ScaleRequest{1, nlohmann::json::parse(body), "test"});
    auto replies = Find<ScaleReply>(actions);
    ASSERT_EQ(replies.size(), 1u) << body;
    EXPECT_EQ(replies[0].http_status, 400) << body;
  }
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
}

TEST_F(ControllerTest, SpareSilentPastTheTimeoutIsNotPromotedEvenBeforeATickNoticedIt) {
  StartJob();
  now_ += Millis(1200);  // the spare (worker 3) has been silent 1.2 s; no Tick has run since
  for (int id : {0, 1}) Do(HeartbeatReceived{id, {1, -1}});
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 1);
  auto plans = Find<SendPlan>(Ready(1, 1));
  ASSERT_EQ(plans.size(), 2u) << "shrink rather than promote a spare that may be hung";
  for (const auto& m : plans[0].plan->members) EXPECT_NE(m.worker_id, 3);
}

TEST_F(ControllerTest, LyingNumbersFromAWorkerAreIgnoredNotOverflowed) {
  StartJob();
  Do(HeartbeatReceived{0, {INT64_MAX, INT64_MAX}});
  Do(ProgressReceived{1, {5, 2.0, std::numeric_limits<double>::quiet_NaN(), 100, 3}});
  Do(ProgressReceived{1, {INT64_MAX, 2.0, 1.0, 100, 3}});
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  auto actions = Do(ReadyReceived{2, {c_->generation(), INT64_MAX, "lying"}});
  ASSERT_EQ(Find<KillWorker>(actions).size(), 1u)
      << "a member that reports an impossible step is faulty";
  EXPECT_EQ(Find<KillWorker>(actions)[0].worker_id, 2);
}

TEST_F(ControllerTest, SpareThatDiesWhileTheJobFormsIsReplacedNotFatal) {
  Join(0);
  // spare worker 3 (world 3 + 1 spare) dies before joining
  auto actions = Do(ProcessExited{3, 1003, 1, 0, kHost});
  EXPECT_EQ(Find<EndJob>(actions).size(), 0u);
  ASSERT_EQ(Find<SpawnWorker>(actions).size(), 1u);
  EXPECT_TRUE(Find<SpawnWorker>(actions)[0].spare);
  EXPECT_EQ(c_->phase(), JobPhase::kForming);
}

TEST_F(ControllerTest, AbortDeadlineStretchesWithSlowSteps) {
  StartJob();
  for (int64_t step = 0; step < 6; ++step) {  // 5 s steps
    now_ += Millis(5000);
    for (int id : {0, 1, 2}) Do(ProgressReceived{id, {step, 2.0, 5.0, 100, 3}});
    Do(HeartbeatReceived{3, {-1, -1}});
  }
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  Ready(0, 5);
  now_ += Millis(2100);  // past --abort-timeout-ms, but rank 1 is mid-step
  Do(HeartbeatReceived{3, {-1, -1}});
  EXPECT_TRUE(Find<KillWorker>(Do(Tick{})).empty())
      << "a healthy member in a 5 s step must not be killed";
  now_ += Millis(5600);  // 7.7 s > 1.5 × 5 s
  Do(HeartbeatReceived{3, {-1, -1}});
  auto kills = Find<KillWorker>(Do(Tick{}));
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, 1);
}

// Every job runs on the hosts of agents (`nonstop run`'s own agent is one):
// the core has no mode without them, and options that ask for one are refused.
TEST(ControllerOptionsTest, AJobWithoutHostsIsRefusedNamingTheField) {
  ControllerOptions o;
  EXPECT_EQ(o.min_hosts, 1) << "the default is a job of one host";
  EXPECT_TRUE(ValidateOptions(o).ok());
  o.min_hosts = 0;
  Status s = ValidateOptions(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("ControllerOptions::min_hosts is 0"), std::string::npos)
      << s.message();
  o.min_hosts = 3;
  o.max_hosts = 2;
  s = ValidateOptions(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("ControllerOptions::max_hosts 2 is below min_hosts 3"),
            std::string::npos)
      << s.message();
  o.max_hosts = 0;  // no limit
  EXPECT_TRUE(ValidateOptions(o).ok());
}

TEST(ControllerOptionsDeathTest, AControllerWithoutHostsIsAProgrammingError) {
  ControllerOptions o;
  o.min_hosts = 0;
  EXPECT_DEATH({ Controller c(o); }, "min_hosts");
}

}  // namespace
}  // namespace nonstop::controller

namespace nonstop::controller {
namespace {

// ---------------------------------------------------------------- hosts

// A job over hosts: three hosts with two workers each, and a fourth with two
// spares (the layout of the multi-host tests).
class HostControllerTest : public ControllerTest {
 protected:
  void SetUp() override {
    ControllerOptions o;
    o.min_hosts = 4;
    o.heartbeat_timeout = Millis(1000);
    o.abort_timeout = Millis(2000);
    c_ = std::make_unique<Controller>(o);
    local_agent_ = false;  // these tests' hosts heartbeat when a test says so
  }
  std::vector<Action> Register(const std::string& host, int nproc, int spares) {
    return Do(HostJoined{Agent(host, nproc, spares, "10.0.0." + host.substr(1), 4000)});
  }
  std::vector<Action> JoinOn(int id, const std::string& host, bool spare = false) {
    control::JoinMsg m{id, 1000 + id, "addr" + std::to_string(id), spare, -1, host};
    return Do(WorkerJoined{m});
  }
  // Registers the four hosts and joins every worker they start; returns the spawn orders.
  std::vector<SpawnWorker> StartHostJob() {
    std::vector<SpawnWorker> spawns;
    for (auto [h, n, s] : {std::tuple{"h1", 2, 0}, {"h2", 2, 0}, {"h3", 2, 0}, {"h4", 0, 2}}) {
      for (const auto& sp : Find<SpawnWorker>(Register(h, n, s))) spawns.push_back(sp);
    }
    for (const auto& sp : spawns) JoinOn(sp.worker_id, sp.host, sp.spare);
    return spawns;
  }
  void Heartbeats() {
    for (const auto& [id, w] : c_->workers()) {
      if (w.role != WorkerRole::kGone) Do(HeartbeatReceived{id, {w.last_step, -1}});
    }
    for (const auto& [id, h] : c_->hosts()) {
      if (h.alive) Do(HostHeartbeat{id, {0}});
    }
  }
};

TEST_F(HostControllerTest, PlacedWhenTheHostsAreThereWorldIsTheirWorkers) {
  EXPECT_TRUE(Find<SpawnWorker>(Register("h1", 2, 0)).empty())
      << "nothing starts before min_hosts registered";
  EXPECT_TRUE(Find<SpawnWorker>(Register("h2", 2, 0)).empty());
  EXPECT_TRUE(Find<SpawnWorker>(Register("h3", 2, 0)).empty());
  auto spawns = Find<SpawnWorker>(Register("h4", 0, 2));
  ASSERT_EQ(spawns.size(), 8u);
  std::map<std::string, int> workers, spares;
  for (const auto& s : spawns) (s.spare ? spares : workers)[s.host]++;
  EXPECT_EQ(workers, (std::map<std::string, int>{{"h1", 2}, {"h2", 2}, {"h3", 2}}));
  EXPECT_EQ(spares, (std::map<std::string, int>{{"h4", 2}}));
  for (const auto& s : spawns) JoinOn(s.worker_id, s.host, s.spare);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  EXPECT_EQ(c_->world_size(), 6u);
}

TEST_F(HostControllerTest, LosingAHostIsOneRecoveryAndSparesOfAnotherHostTakeBothRanks) {
  StartHostJob();
  for (const auto& [id, w] : c_->workers()) {
    if (w.role == WorkerRole::kMember) Step(id, 10);
  }
  std::vector<int> lost;
  for (const auto& [id, w] : c_->workers()) {
    if (w.host == "h2") lost.push_back(id);
  }
  ASSERT_EQ(lost.size(), 2u);
  auto actions = Do(HostLost{"h2", "connection reset"});
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  EXPECT_EQ(Find<SendAbort>(actions).size(), 4u) << "the four members on other hosts abort, once";
  EXPECT_EQ(Find<KillWorker>(actions).size(), 2u) << "both workers of the host are killed (fenced)";
  ASSERT_EQ(c_->recoveries().size(), 1u);
  std::vector<int> survivors;
  for (const auto& [id, w] : c_->workers()) {
    if (w.role == WorkerRole::kMember) survivors.push_back(id);
  }
  ASSERT_EQ(survivors.size(), 4u);
  std::vector<SendPlan> plans;
  for (int id : survivors) {
    for (const auto& p : Find<SendPlan>(Ready(id, 10))) plans.push_back(p);
  }
  ASSERT_EQ(plans.size(), 6u);
  ASSERT_EQ(c_->recoveries().size(), 1u) << "one recovery for the whole host";
  const auto& plan = *plans[0].plan;
  for (int rank : {2, 3}) {
    int id = plan.members[static_cast<size_t>(rank)].worker_id;
    EXPECT_EQ(c_->workers().at(id).host, "h4")
        << "rank " << rank << " goes to a spare of the spare host";
  }
  // State sources alternate over hosts.
  ASSERT_EQ(plan.transfers.size(), 2u);
  const auto& sources = plan.transfers[0].sources;
  ASSERT_EQ(sources.size(), 4u);
  EXPECT_NE(c_->workers().at(sources[0]).host, c_->workers().at(sources[1]).host);
  EXPECT_EQ(c_->hosts().at("h2").alive, false);
}

TEST_F(HostControllerTest, SilentAgentIsALostHostAndIsFenced) {
  StartHostJob();
  now_ += Millis(600);
  Heartbeats();
  now_ += Millis(1100);
  // Everyone but h3's agent speaks; h3's workers too (their own connections are fine).
  for (const auto& [id, w] : c_->workers()) Do(HeartbeatReceived{id, {w.last_step, -1}});
  for (const char* h : {"h1", "h2", "h4"}) Do(HostHeartbeat{h, {0}});
  auto actions = Do(Tick{});
  auto closed = Find<CloseHost>(actions);
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].host_id, "h3");
  EXPECT_NE(closed[0].reason.find("no heartbeat"), std::string::npos) << closed[0].reason;
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
}

TEST_F(HostControllerTest, AHealedHostComesBackWithSparesNeverIntoTheOldGeneration) {
  StartHostJob();
  Do(HostLost{"h1", "partition"});
  EXPECT_TRUE(Find<SpawnWorker>(Register("h1", 2, 0)).size() == 2u)
      << "its slots are filled with spares";
  EXPECT_TRUE(Find<SpawnWorker>(Register("h1", 2, 0)).empty()) << "registered twice";
  auto refused = Find<CloseHost>(Register("h1", 2, 0));
  ASSERT_EQ(refused.size(), 1u) << "a second agent with a live host id is refused";
  EXPECT_NE(refused[0].reason.find("already in the job"), std::string::npos);
  // A fenced worker of the old incarnation that tries to join again is refused: its id is gone.
  int old_worker = -1;
  for (const auto& [id, w] : c_->workers()) {
    if (w.host == "h1") old_worker = id;
  }
  auto again = Find<SendShutdown>(JoinOn(old_worker, "h1"));
  ASSERT_EQ(again.size(), 1u);
  EXPECT_NE(again[0].msg.exit_code, 0);
  EXPECT_NE(again[0].msg.reason.find("cannot rejoin"), std::string::npos) << again[0].msg.reason;
  EXPECT_NE(c_->workers().at(old_worker).role, WorkerRole::kMember);
}

TEST_F(HostControllerTest, WorkerClaimingAnotherHostIsRefused) {
  Register("h1", 1, 0);
  Register("h2", 1, 0);
  Register("h3", 1, 0);
  auto spawns = Find<SpawnWorker>(Register("h4", 1, 0));
  ASSERT_EQ(spawns.size(), 4u);
  auto refused = Find<SendShutdown>(JoinOn(spawns[0].worker_id, "h2"));
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_NE(refused[0].msg.reason.find("was started on host h1"), std::string::npos)
      << refused[0].msg.reason;
  auto unknown = Find<SendShutdown>(JoinOn(999, "h2"));
  ASSERT_EQ(unknown.size(), 1u);
  EXPECT_NE(unknown[0].msg.reason.find("did not start it"), std::string::npos)
      << unknown[0].msg.reason;
  // An agent may not report on another host's worker.
  auto ignored = Do(ProcessExited{spawns[0].worker_id, 1, 0, 9, "h3"});
  EXPECT_TRUE(Find<EndJob>(ignored).empty()) << "the report was taken: the forming job ended";
  EXPECT_EQ(c_->phase(), JobPhase::kForming);
  auto journal = Find<AppendJournal>(ignored);
  ASSERT_EQ(journal.size(), 1u);
  EXPECT_EQ(journal[0].record["event"], "report_ignored");
  // The same report from the worker's own host is taken (and ends the forming job).
  EXPECT_EQ(Find<EndJob>(Do(ProcessExited{spawns[0].worker_id, 1, 0, 9, "h1"})).size(), 1u);
}

TEST_F(HostControllerTest, LateHostGrowsTheJobUpToThePolicyMaximum) {
  ControllerOptions o;
  o.min_hosts = 2;
  o.policy.max_world = 6;
  c_ = std::make_unique<Controller>(o);
  std::vector<SpawnWorker> spawns;
  for (const auto& s : Find<SpawnWorker>(Register("h1", 2, 0))) spawns.push_back(s);
  for (const auto& s : Find<SpawnWorker>(Register("h2", 2, 0))) spawns.push_back(s);
  for (const auto& s : spawns) JoinOn(s.worker_id, s.host, s.spare);
  ASSERT_EQ(c_->world_size(), 4u);
  auto late = Find<SpawnWorker>(Register("h3", 2, 0));
  ASSERT_EQ(late.size(), 2u);
  for (const auto& s : late) EXPECT_TRUE(s.spare);
  now_ += Millis(10);
  for (const auto& s : late) JoinOn(s.worker_id, s.host, true);
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering) << "a resize to 6 started";
  EXPECT_EQ(c_->recoveries().back().kind, "resize");
}

// `nonstop run`'s job has one host, its own agent's: it takes no other.
TEST_F(HostControllerTest, AgentsAreRefusedByASingleMachineJob) {
  Make(2, 0);
  auto closed = Find<CloseHost>(Do(HostJoined{Agent("h1", 1, 0, "10.0.0.1", 1)}));
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_EQ(closed[0].host_id, "h1");
  EXPECT_NE(closed[0].reason.find("its maximum of 1 hosts"), std::string::npos) << closed[0].reason;
  EXPECT_TRUE(c_->hosts().at(kHost).alive) << "its own agent stays";
  EXPECT_EQ(c_->hosts().count("h1"), 0u);
}

// ---- what a review found (each failed before its fix) ----

class HostFaultsTest : public HostControllerTest {
 protected:
  void Use(ControllerOptions o) {
    o.heartbeat_timeout = Millis(1000);
    o.abort_timeout = Millis(2000);
    c_ = std::make_unique<Controller>(o);
  }
  // Advances `ms` in 50 ms ticks, everyone alive heartbeating; returns every action.
  std::vector<Action> Run(int ms) {
    std::vector<Action> all;
    for (int t = 0; t < ms; t += 50) {
      now_ += Millis(50);
      Heartbeats();
      for (auto& a : Do(Tick{})) all.push_back(a);
    }
    return all;
  }
  // As StartOn, every worker joining with sharded state in groups of `group`.
  void StartShardedOn(const std::vector<std::tuple<std::string, int, int>>& hosts, int group) {
    std::vector<SpawnWorker> spawns;
    for (const auto& [h, n, sp] : hosts) {
      for (auto& s : Find<SpawnWorker>(Register(h, n, sp))) spawns.push_back(s);
    }
    for (auto& s : spawns) {
      control::JoinMsg m{
          s.worker_id, 1000 + s.worker_id, "addr" + std::to_string(s.worker_id), s.spare, -1,
          s.host};
      m.shard_group = group;
      m.held_shard = nonstop::state::kEveryShard;
      Do(WorkerJoined{m});
    }
  }
  std::vector<SpawnWorker> StartOn(const std::vector<std::tuple<std::string, int, int>>& hosts) {
    std::vector<SpawnWorker> spawns;
    for (const auto& [h, n, sp] : hosts) {
      for (auto& s : Find<SpawnWorker>(Register(h, n, sp))) spawns.push_back(s);
    }
    for (auto& s : spawns) JoinOn(s.worker_id, s.host, s.spare);
    return spawns;
  }
};

// A host partitioned during a resize: the survivors may be stuck in a
// collective with it; the drain never ends that, so they must be aborted.
TEST_F(HostFaultsTest, HostLostDuringAResizeAbortsTheSurvivors) {
  ControllerOptions o;
  o.min_hosts = 2;
  o.policy.max_world = 6;
  Use(o);
  auto spawns = StartOn({{"h1", 2, 0}, {"h2", 2, 0}});
  for (auto& s : spawns) Step(s.worker_id, 5);
  auto late = Find<SpawnWorker>(Register("h3", 2, 0));
  now_ += Millis(10);
  for (auto& s : late) JoinOn(s.worker_id, s.host, true);
  ASSERT_EQ(c_->phase(), JobPhase::kRecovering);
  ASSERT_EQ(c_->recoveries().back().kind, "resize");
  auto a = Do(HostLost{"h2", "partition"});
  auto aborts = Find<SendAbort>(a);
  ASSERT_EQ(aborts.size(), 2u) << "both members of h1 are aborted";
  for (auto& ab : aborts) EXPECT_EQ(c_->HostOf(ab.worker_id), "h1");
  EXPECT_EQ(c_->recoveries().back().kind, "recovery");
  // They answer, and the job goes on with the spares of h3.
  std::vector<SendPlan> plans;
  for (auto& ab : aborts) {
    for (auto& p : Find<SendPlan>(Ready(ab.worker_id, 5))) plans.push_back(p);
  }
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(plans[0].plan->members.size(), 4u);
}

// Checkpoint-restart on hosts: the killed workers' slots take the restarted workers at once.
TEST_F(HostFaultsTest, CheckpointRestartOnHostsFormsAgain) {
  ControllerOptions o;
  o.min_hosts = 2;
  o.recovery = RecoveryMode::kCheckpointRestart;
  o.have_checkpoints = true;
  Use(o);
  auto spawns = StartOn({{"h1", 2, 0}, {"h2", 2, 0}});
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  for (auto& s : spawns) Step(s.worker_id, 10);
  auto a = Do(ProcessExited{spawns[0].worker_id, 1, -1, 9, spawns[0].host});
  auto restarted = Find<SpawnWorker>(a);
  ASSERT_EQ(restarted.size(), 4u);
  for (auto& s : restarted) {
    EXPECT_TRUE(s.resume);
    EXPECT_FALSE(s.spare);
  }
  for (size_t i = 1; i < spawns.size(); ++i)
    Do(ProcessExited{spawns[i].worker_id, 1, -1, 9, spawns[i].host});
  EXPECT_TRUE(Find<SpawnWorker>(Run(500)).empty())
      << "no extra spares in the restarted workers' slots";
  for (auto& s : restarted) JoinOn(s.worker_id, s.host);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  EXPECT_EQ(c_->world_size(), 4u);
}

// Every holder of the state lost its control connection (their exits not
// reported yet): the restart from the checkpoint starts workers in their slots,
// not spares once the exits come in (the job then never formed again).
TEST_F(HostFaultsTest, CheckpointRestartAfterEveryHolderWasLostStartsWorkersInTheirSlots) {
  ControllerOptions o;
  o.min_hosts = 1;
  o.have_checkpoints = true;
  Use(o);
  auto spawns = StartOn({{"h1", 2, 0}});
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  for (auto& s : spawns) Step(s.worker_id, 12);
  Do(ConnectionLost{spawns[0].worker_id, "reset"});
  auto a = Do(ConnectionLost{spawns[1].worker_id, "reset"});
  auto restarted = Find<SpawnWorker>(a);
  ASSERT_EQ(restarted.size(), 2u) << "the restart must not wait for the lost workers' exits";
  for (auto& s : restarted) {
    EXPECT_TRUE(s.resume);
    EXPECT_FALSE(s.spare);
  }
  for (auto& s : spawns) Do(ProcessExited{s.worker_id, 1, -1, 9, s.host});
  EXPECT_TRUE(Find<SpawnWorker>(Run(500)).empty()) << "no spares in the restarted workers' slots";
  for (auto& s : restarted) JoinOn(s.worker_id, s.host);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  EXPECT_EQ(c_->world_size(), 2u);
}

// `nonstop run`'s agent is elastic: the job's one host starts what the job
// needs, not a fixed set of slots.
class ElasticHostTest : public HostFaultsTest {
 protected:
  std::vector<SpawnWorker> StartElastic(int nproc, int spares, int max_world = 0) {
    ControllerOptions o;
    o.min_hosts = 1;
    o.max_hosts = 1;
    o.have_checkpoints = true;
    o.policy.max_world = max_world;
    Use(o);
    control::AgentRegisterMsg m = Agent("local", nproc, spares, "127.0.0.1", 1);
    m.elastic = true;
    auto spawns = Find<SpawnWorker>(Do(HostJoined{m}));
    for (auto& s : spawns) JoinOn(s.worker_id, s.host, s.spare);
    return spawns;
  }
};

TEST_F(ElasticHostTest, AGrowOnRequestStartsWorkersBeyondItsNproc) {
  auto spawns = StartElastic(2, 0, /*max_world=*/4);
  ASSERT_EQ(spawns.size(), 2u);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  for (auto& s : spawns) Step(s.worker_id, 5);
  EXPECT_TRUE(Find<SpawnWorker>(Run(500)).empty()) << "nothing is started before a request";
  auto r = Do(ScaleRequest{1, {{"world_size", 4}}, "test"});
  ASSERT_EQ(Find<ScaleReply>(r)[0].http_status, 202);
  auto more = Find<SpawnWorker>(r);
  ASSERT_EQ(more.size(), 2u) << "a host of fixed slots (nproc 2) would start none";
  for (auto& s : more) {
    EXPECT_EQ(s.host, "local");
    EXPECT_TRUE(s.spare);
  }
}

TEST_F(ElasticHostTest, AShrinkWithoutASpareIsNotRefilledAndFaultsNameNoHost) {
  auto spawns = StartElastic(3, 0);
  for (auto& s : spawns) Step(s.worker_id, 5);
  auto a = Do(ProcessExited{spawns[1].worker_id, 1001, -1, 9, "local"});
  bool named = false;
  for (auto& p : Find<PrintLine>(a)) {
    if (p.line.rfind("fault: ", 0) == 0) {
      named = true;
      EXPECT_EQ(p.line.find("on host"), std::string::npos) << p.line;
    }
  }
  EXPECT_TRUE(named);
  for (auto& s : spawns) {
    if (s.worker_id != spawns[1].worker_id) Ready(s.worker_id, 5);
  }
  EXPECT_EQ(c_->world_size(), 2u);
  EXPECT_TRUE(Find<SpawnWorker>(Run(500)).empty())
      << "the lost worker's place is not refilled (no spares asked)";
  EXPECT_EQ(c_->world_size(), 2u);
}

TEST_F(ElasticHostTest, ARestartFromTheCheckpointStartsTheWorldAndItsSparesThere) {
  auto spawns = StartElastic(2, 1);
  for (auto& s : spawns) Step(s.worker_id, 12);
  Do(ConnectionLost{spawns[0].worker_id, "reset"});
  auto restarted = Find<SpawnWorker>(Do(ConnectionLost{spawns[1].worker_id, "reset"}));
  ASSERT_EQ(restarted.size(), 3u) << "two workers and the spare";
  int spares = 0;
  for (auto& s : restarted) {
    EXPECT_TRUE(s.resume);
    EXPECT_EQ(s.host, "local");
    spares += s.spare;
  }
  EXPECT_EQ(spares, 1);
}

TEST_F(ElasticHostTest, AnElasticAgentIsRefusedByAJobOfSeveralHosts) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  control::AgentRegisterMsg m = Agent("local", 2, 0, "127.0.0.1", 1);
  m.elastic = true;
  auto closed = Find<CloseHost>(Do(HostJoined{m}));
  ASSERT_EQ(closed.size(), 1u);
  EXPECT_NE(closed[0].reason.find("one host"), std::string::npos) << closed[0].reason;
}

// A host lost while the job forms, before its workers joined: a spare of
// another host takes a place, then the job forms smaller; the runtime's
// invented exit for a start order to the vanished agent changes nothing.
TEST_F(HostFaultsTest, HostLostWhileFormingIsReplacedNotWaitedFor) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  std::vector<SpawnWorker> spawns;
  for (auto& s : Find<SpawnWorker>(Register("h1", 2, 1))) spawns.push_back(s);
  for (auto& s : Find<SpawnWorker>(Register("h2", 2, 0))) spawns.push_back(s);
  ASSERT_EQ(spawns.size(), 5u);
  for (auto& s : spawns) {
    if (s.host == "h1") JoinOn(s.worker_id, s.host, s.spare);
  }
  auto lost = Do(HostLost{"h2", "connection reset"});
  EXPECT_TRUE(Find<EndJob>(lost).empty());
  for (auto& s : spawns) {
    if (s.host == "h2") {
      EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{s.worker_id, 0, 127, 0, "h2"})).empty());
    }
  }
  EXPECT_EQ(c_->phase(), JobPhase::kRunning)
      << "h1's spare took one place and the job formed with 3";
  EXPECT_EQ(c_->world_size(), 3u);
}

// A host lost before the job is placed: no spare starts anywhere before the placement.
TEST_F(HostFaultsTest, HostLostBeforePlacementStartsNothingEarly) {
  ControllerOptions o;
  o.min_hosts = 3;
  Use(o);
  Register("h1", 2, 0);
  Register("h2", 2, 0);
  EXPECT_TRUE(Find<SpawnWorker>(Do(HostLost{"h2", "agent restarted"})).empty());
  auto spawns = StartOn({{"h2", 2, 0}, {"h3", 2, 0}});
  EXPECT_EQ(spawns.size(), 6u);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  EXPECT_EQ(c_->world_size(), 6u);
}

// While the job forms, its workers start on every host at once: an agent unheard for more than
// the heartbeat timeout is waited for, up to 5 s (its host's workers import their framework).
TEST_F(HostFaultsTest, ASilentHostWhileTheJobFormsIsWaitedForFiveSeconds) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  std::vector<SpawnWorker> spawns;
  for (auto& s : Find<SpawnWorker>(Register("h1", 2, 0))) spawns.push_back(s);
  for (auto& s : Find<SpawnWorker>(Register("h2", 2, 0))) spawns.push_back(s);
  ASSERT_EQ(spawns.size(), 4u);
  ASSERT_EQ(c_->phase(), JobPhase::kForming);
  now_ += Millis(3'000);
  Do(HostHeartbeat{"h1", {0}});
  EXPECT_TRUE(Find<CloseHost>(Do(Tick{})).empty()) << "3 s unheard while forming";
  now_ += Millis(2'100);
  Do(HostHeartbeat{"h1", {0}});
  auto closes = Find<CloseHost>(Do(Tick{}));
  ASSERT_EQ(closes.size(), 1u) << "5.1 s unheard";
  EXPECT_EQ(closes[0].host_id, "h2");
}

// A host declared lost by heartbeats is fenced, not told to exit: its workers
// are killed first (the kills reach an agent that still lives), then only
// its connection closes; it may register again.
TEST_F(HostFaultsTest, SilentHostIsKilledThenFencedAndMayComeBack) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  StartOn({{"h1", 2, 0}, {"h2", 2, 0}});
  now_ += Millis(1100);
  for (const auto& [id, w] : c_->workers()) Do(HeartbeatReceived{id, {w.last_step, -1}});
  Do(HostHeartbeat{"h1", {0}});
  auto a = Do(Tick{});
  int close_at = -1, last_kill = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    if (const auto* c = std::get_if<CloseHost>(&a[i])) {
      EXPECT_TRUE(c->fence);
      EXPECT_EQ(c->host_id, "h2");
      close_at = static_cast<int>(i);
    }
    if (const auto* k = std::get_if<KillWorker>(&a[i]); k && c_->HostOf(k->worker_id) == "h2") {
      last_kill = static_cast<int>(i);
    }
  }
  ASSERT_GE(close_at, 0);
  ASSERT_GE(last_kill, 0);
  EXPECT_LT(last_kill, close_at) << "the kills go out before the connection closes";
  EXPECT_FALSE(Find<SpawnWorker>(Register("h2", 2, 0)).empty()) << "it registers again";
}

// A controller that did not run for a while (a starved machine, a suspended laptop) does not count
// that time as its peers' silence: the same 1.1 s that loses h2 above loses nothing after a 0.9 s
// stall of its own, and the silence after it is judged from then on.
TEST_F(HostFaultsTest, TheControllersOwnStallIsNotItsPeersSilence) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  StartOn({{"h1", 2, 0}, {"h2", 2, 0}});
  now_ += Millis(1100);
  Do(ControllerStalled{Millis(900)});
  auto a = Do(Tick{});
  EXPECT_TRUE(Find<CloseHost>(a).empty()) << "no host is lost for a stall of the controller";
  EXPECT_TRUE(Find<KillWorker>(a).empty()) << "nor a worker";
  now_ += Millis(850);  // 1.05 s of silence since the stall's credit
  a = Do(Tick{});
  ASSERT_EQ(Find<CloseHost>(a).size(), 2u) << "silent past the timeout after the stall: both lost";
}

// A shrink on request gives the capacity back: the released slot is not refilled until a grow.
TEST_F(HostFaultsTest, ReleasedSlotsAreNotRefilledUntilAGrow) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  auto spawns = StartOn({{"h1", 2, 0}, {"h2", 2, 0}});
  for (auto& s : spawns) Step(s.worker_id, 5);
  auto r = Do(ScaleRequest{1, {{"release", 1}}, "test"});
  ASSERT_EQ(Find<ScaleReply>(r)[0].http_status, 202);
  std::vector<SendShutdown> released;
  for (auto& s : spawns) {
    for (auto& sd : Find<SendShutdown>(Ready(s.worker_id, 6))) released.push_back(sd);
  }
  ASSERT_EQ(released.size(), 1u);
  int id = released[0].worker_id;
  Do(ProcessExited{id, 1, 0, 0, c_->HostOf(id)});
  EXPECT_TRUE(Find<SpawnWorker>(Run(500)).empty()) << "the released slot was refilled";
  now_ += Millis(1000);
  auto grow = Do(ScaleRequest{2, {{"world_size", 4}}, "test"});
  ASSERT_EQ(Find<ScaleReply>(grow)[0].http_status, 202);
  EXPECT_EQ(Find<SpawnWorker>(grow).size(), 1u) << "a grow takes the slot back";
}

// ---- a host leaves: its capacity is taken back (a Slurm preemption) ----

class HostLeavingTest : public HostFaultsTest {
 protected:
  static int Count(const std::vector<Action>& actions, const std::string& event) {
    int n = 0;
    for (const auto& j : Find<AppendJournal>(actions)) n += j.record.value("event", "") == event;
    return n;
  }
  std::vector<int> MembersOn(const std::string& host) const {
    std::vector<int> ids;
    for (int id : c_->members()) {
      if (c_->HostOf(id) == host) ids.push_back(id);
    }
    return ids;
  }
  // h1 with 2 workers, h2 with 1, h4 with a spare (*spare); step 5 done; h2 asks to leave, and the
  // drain starts.
  void StartWithASpareHostAndLetH2Leave(int* spare) {
    StartOn({{"h1", 2, 0}, {"h2", 1, 0}, {"h4", 0, 1}});
    for (int id : c_->members()) Step(id, 5);
    for (const auto& [id, w] : c_->workers()) {
      if (w.role == WorkerRole::kSpare) *spare = id;
    }
    ASSERT_GE(*spare, 0);
    ASSERT_FALSE(Find<SendDrain>(Do(HostLeaving{"h2", {"SIGTERM"}})).empty());
  }
  // Every member reports step `step` done and then Ready at it (the drain's boundary).
  std::vector<Action> AllReady(int64_t step) {
    std::vector<Action> all;
    std::vector<int> members = c_->members();
    for (int id : members) {
      for (auto& a : Ready(id, step)) all.push_back(a);
    }
    return all;
  }
};

TEST_F(HostLeavingTest, ItsMembersAreReleasedAtTheNextStepBoundaryWithoutAFault) {
  ControllerOptions o;
  o.min_hosts = 3;
  Use(o);
  StartOn({{"h1", 1, 0}, {"h2", 1, 0}, {"h3", 1, 0}});
  ASSERT_EQ(c_->world_size(), 3u);
  for (int id : c_->members()) Step(id, 5);
  std::vector<int> leaving = MembersOn("h2");
  ASSERT_EQ(leaving.size(), 1u);
  ASSERT_EQ(c_->RankOf(leaving[0]), 1) << "a rank in the middle: released by name, not the highest";
  auto a = Do(HostLeaving{"h2", {"SIGTERM"}});
  EXPECT_EQ(Count(a, "host_leaving"), 1);
  EXPECT_EQ(Find<SendDrain>(a).size(), 3u) << "every member stops at the step boundary";
  EXPECT_TRUE(Find<SendAbort>(a).empty()) << "a planned change aborts nothing";
  EXPECT_TRUE(Find<KillWorker>(a).empty());
  ASSERT_EQ(c_->phase(), JobPhase::kRecovering);
  EXPECT_EQ(c_->recoveries().back().kind, "resize");
  auto done = AllReady(6);
  EXPECT_EQ(Count(done, "fault"), 0);
  auto plans = Find<SendPlan>(done);
  ASSERT_EQ(plans.size(), 2u);
  for (const auto& m : plans[0].plan->members) EXPECT_NE(c_->HostOf(m.worker_id), "h2");
  EXPECT_EQ(plans[0].plan->resume_step, 7) << "no completed step is lost";
  EXPECT_TRUE(plans[0].plan->transfers.empty()) << "the members that stay hold the state";
  auto shutdowns = Find<SendShutdown>(done);
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_EQ(shutdowns[0].worker_id, leaving[0]);
  EXPECT_EQ(shutdowns[0].msg.exit_code, 0);
  EXPECT_EQ(c_->world_size(), 2u);
  // Its worker exits on the release, then its agent: the host has left, no recovery follows.
  Do(ProcessExited{leaving[0], 1, 0, 0, "h2"});
  auto gone = Do(HostLost{"h2", "connection closed by peer"});
  EXPECT_EQ(Count(gone, "host_left"), 1);
  EXPECT_EQ(Count(gone, "host_lost"), 0);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  EXPECT_EQ(c_->recoveries().size(), 1u);
  EXPECT_TRUE(Find<SpawnWorker>(Run(500)).empty());
}

TEST_F(HostLeavingTest, ItsSparesAreLetGoAtOnceAndItsSlotsStayEmptyUntilItRegistersAgain) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  StartOn({{"h1", 2, 0}, {"h2", 0, 1}});
  for (int id : c_->members()) Step(id, 5);
  int spare = -1;
  for (const auto& [id, w] : c_->workers()) {
    if (w.role == WorkerRole::kSpare) spare = id;
  }
  ASSERT_EQ(c_->HostOf(spare), "h2");
  auto a = Do(HostLeaving{"h2", {"SIGUSR1"}});
  auto shutdowns = Find<SendShutdown>(a);
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_EQ(shutdowns[0].worker_id, spare);
  EXPECT_EQ(shutdowns[0].msg.exit_code, 0);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning) << "no member leaves: the world stays";
  EXPECT_TRUE(Find<SendDrain>(a).empty());
  Do(ProcessExited{spare, 1, 0, 0, "h2"});
  EXPECT_TRUE(Find<SpawnWorker>(Run(500)).empty()) << "a leaving host's free slot is refilled";
  EXPECT_EQ(Count(Do(HostLost{"h2", "connection closed by peer"}), "host_left"), 1);
  auto back = Find<SpawnWorker>(Register("h2", 0, 1));
  ASSERT_EQ(back.size(), 1u) << "registered again, its slots are the job's again";
  EXPECT_TRUE(back[0].spare);
}

TEST_F(HostLeavingTest, WhereThePolicyForbidsTheSmallerWorldASpareElsewhereTakesTheRank) {
  ControllerOptions o;
  o.min_hosts = 3;
  o.policy.min_world = 3;
  Use(o);
  StartOn({{"h1", 2, 0}, {"h2", 1, 0}, {"h4", 0, 1}});
  ASSERT_EQ(c_->world_size(), 3u);
  for (int id : c_->members()) Step(id, 5);
  int leaving = MembersOn("h2").at(0);
  ASSERT_FALSE(Find<SendDrain>(Do(HostLeaving{"h2", {"SIGTERM"}})).empty());
  auto done = AllReady(6);
  auto plans = Find<SendPlan>(done);
  ASSERT_FALSE(plans.empty());
  const auto& plan = *plans[0].plan;
  ASSERT_EQ(plan.members.size(), 3u);
  int newcomer = -1;
  for (const auto& m : plan.members) {
    EXPECT_NE(m.worker_id, leaving);
    if (c_->HostOf(m.worker_id) == "h4") newcomer = m.worker_id;
  }
  ASSERT_GE(newcomer, 0) << "the spare of h4 joins";
  ASSERT_EQ(plan.transfers.size(), 1u);
  EXPECT_EQ(plan.transfers[0].receiver, newcomer);
  for (int src : plan.transfers[0].sources)
    EXPECT_NE(src, leaving) << "a released member is no state source";
  EXPECT_EQ(Count(done, "fault"), 0);
  EXPECT_EQ(Find<SendShutdown>(done).size(), 1u);
}

TEST_F(HostLeavingTest, ALeaveTheJobCannotAbsorbIsRefusedOnceAndItsLossIsThenAFault) {
  ControllerOptions o;
  o.min_hosts = 2;
  o.policy.min_world = 3;
  Use(o);
  StartOn({{"h1", 2, 0}, {"h2", 1, 0}});
  for (int id : c_->members()) Step(id, 5);
  auto a = Do(HostLeaving{"h2", {"SIGTERM"}});
  EXPECT_EQ(Count(a, "host_leave_refused"), 1);
  EXPECT_TRUE(Find<SendDrain>(a).empty());
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  EXPECT_EQ(Count(Run(500), "host_leave_refused"), 0) << "refused once, not on every tick";
  auto lost = Do(HostLost{"h2", "connection reset"});
  EXPECT_EQ(Count(lost, "host_lost"), 1);
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  EXPECT_EQ(c_->recoveries().back().kind, "recovery");
}

TEST_F(HostLeavingTest, ALeaveDuringARecoveryWaitsForItToEnd) {
  ControllerOptions o;
  o.min_hosts = 3;
  Use(o);
  StartOn({{"h1", 2, 0}, {"h2", 1, 0}, {"h3", 1, 0}});
  for (int id : c_->members()) Step(id, 5);
  int victim = MembersOn("h1").at(0);
  Do(ProcessExited{victim, 1, 0, 9, "h1"});
  ASSERT_EQ(c_->phase(), JobPhase::kRecovering);
  auto a = Do(HostLeaving{"h3", {"SIGTERM"}});
  EXPECT_TRUE(Find<SendDrain>(a).empty()) << "the recovery first";
  std::vector<int> members = c_->members();
  for (int id : members) {
    if (id != victim) Ready(id, 5);
  }
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  ASSERT_EQ(c_->world_size(), 3u) << "the recovery shrank by the lost worker only";
  EXPECT_TRUE(Find<SendDrain>(Run(100)).empty()) << "not before the recovery's first step is done";
  for (int id : c_->members()) Step(id, 6);
  auto later = Run(100);
  EXPECT_EQ(Find<SendDrain>(later).size(), 3u) << "then the leave, at the next step boundary";
  EXPECT_EQ(c_->recoveries()[0].outcome, "completed")
      << "the recovery is not recorded as superseded";
}

// What a review found (each failed before its fix).

// A checkpoint restart while a host leaves: the job forms again without the
// leaving host's slots instead of waiting for them.
TEST_F(HostLeavingTest, ACheckpointRestartWhileAHostLeavesFormsWithoutIt) {
  ControllerOptions o;
  o.min_hosts = 3;
  o.recovery = RecoveryMode::kCheckpointRestart;
  o.have_checkpoints = true;
  Use(o);
  auto spawns = StartOn({{"h1", 2, 0}, {"h2", 1, 0}, {"h3", 1, 0}});
  for (int id : c_->members()) Step(id, 5);
  ASSERT_FALSE(Find<SendDrain>(Do(HostLeaving{"h3", {"SIGTERM"}})).empty());
  auto restarted =
      Find<SpawnWorker>(Do(ProcessExited{spawns[0].worker_id, 1, -1, 9, spawns[0].host}));
  for (const auto& sp : restarted) EXPECT_NE(sp.host, "h3") << "nothing starts on a leaving host";
  for (size_t i = 1; i < spawns.size(); ++i)
    Do(ProcessExited{spawns[i].worker_id, 1, -1, 9, spawns[i].host});
  for (const auto& sp : restarted) JoinOn(sp.worker_id, sp.host);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  EXPECT_EQ(c_->world_size(), 3u) << "the world of the hosts that stay";
}

// A resize that a checkpoint restart abandoned leaves nothing behind that
// blocks a later leave.
TEST_F(HostLeavingTest, AResizeAbandonedByACheckpointRestartDoesNotBlockALaterLeave) {
  ControllerOptions o;
  o.min_hosts = 2;
  o.policy.max_world = 3;
  o.recovery = RecoveryMode::kCheckpointRestart;
  o.have_checkpoints = true;
  Use(o);
  auto spawns = StartOn({{"h1", 1, 0}, {"h2", 1, 0}});
  for (int id : c_->members()) Step(id, 5);
  auto late = Find<SpawnWorker>(Register("h3", 1, 0));
  ASSERT_EQ(late.size(), 1u);
  ASSERT_FALSE(Find<SendDrain>(JoinOn(late[0].worker_id, "h3", true)).empty())
      << "a grow to 3 starts";
  auto restarted = Find<SpawnWorker>(Do(ProcessExited{spawns[0].worker_id, 1, -1, 9, "h1"}));
  Do(ProcessExited{spawns[1].worker_id, 1, -1, 9, "h2"});
  Do(ProcessExited{late[0].worker_id, 1, -1, 9, "h3"});
  for (const auto& sp : restarted) JoinOn(sp.worker_id, sp.host);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  ASSERT_EQ(c_->world_size(), 3u);
  for (int id : c_->members()) Step(id, 6);
  Run(200);
  auto drains = Find<SendDrain>(Do(HostLeaving{"h3", {"SIGTERM"}}));
  for (const auto& d : Find<SendDrain>(Run(500))) drains.push_back(d);
  EXPECT_EQ(drains.size(), 3u) << "the leave drains";
}

// A spare counted on for the released rank dies during the drain: the
// policy's minimum still holds (the members stay, the leave is refused).
TEST_F(HostLeavingTest, ASpareThatDiesDuringTheDrainLeavesTheWorldWithinThePolicy) {
  ControllerOptions o;
  o.min_hosts = 3;
  o.policy.min_world = 3;
  Use(o);
  int spare = -1;
  ASSERT_NO_FATAL_FAILURE(StartWithASpareHostAndLetH2Leave(&spare));
  Do(ProcessExited{spare, 1, -1, 9, "h4"});
  auto done = AllReady(6);
  auto plans = Find<SendPlan>(done);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(plans[0].plan->members.size(), 3u);
  EXPECT_TRUE(Find<SendShutdown>(done).empty()) << "nobody is released below the minimum";
  for (int id : c_->members()) Step(id, 7);
  EXPECT_EQ(Count(Run(200), "host_leave_refused"), 1)
      << "and the leave is then refused, with the reason";
}

// The leaving host dies during the drain: its rank goes with it, and no spare
// is promoted only to be released at once.
TEST_F(HostLeavingTest, ALeavingHostThatDiesDuringTheDrainTakesItsRankWithItAndKeepsTheSpares) {
  ControllerOptions o;
  o.min_hosts = 3;
  Use(o);
  int spare = -1;
  ASSERT_NO_FATAL_FAILURE(StartWithASpareHostAndLetH2Leave(&spare));
  Do(HostLost{"h2", "connection reset"});
  std::vector<Action> done;
  for (int id : MembersOn("h1")) {
    for (auto& a : Ready(id, 6)) done.push_back(a);
  }
  auto plans = Find<SendPlan>(done);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(plans[0].plan->members.size(), 2u);
  EXPECT_TRUE(Find<SendShutdown>(done).empty()) << "the spare is not released";
  EXPECT_EQ(c_->workers().at(spare).role, WorkerRole::kSpare);
}

// A leaving host's spare is journaled as lost, as every spare that goes.
TEST_F(HostLeavingTest, ALeavingHostsSparesAreJournaledAsLost) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  StartOn({{"h1", 2, 0}, {"h2", 0, 2}});
  EXPECT_EQ(Count(Do(HostLeaving{"h2", {"SIGTERM"}}), "spare_lost"), 2);
}

// Spares that keep dying while starting on one host stop refills there, not everywhere.
TEST_F(HostFaultsTest, RefillFailuresOnOneHostDoNotStopOtherHosts) {
  ControllerOptions o;
  o.min_hosts = 1;
  o.policy.max_world = 4;
  Use(o);
  auto spawns = Find<SpawnWorker>(Register("h1", 2, 1));
  for (auto& s : spawns) {
    if (!s.spare) JoinOn(s.worker_id, s.host, false);
  }
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  int failing = -1;
  for (auto& s : spawns) {
    if (s.spare) failing = s.worker_id;
  }
  int attempts = 0;
  while (failing >= 0 && attempts < 10) {
    ++attempts;
    auto sp = Find<SpawnWorker>(Do(WorkerStarted{"h1", {failing, 0, "exec: no such file"}}));
    failing = sp.empty() ? -1 : sp[0].worker_id;
  }
  EXPECT_EQ(attempts, 4) << "three replacements, then h1 is left alone";
  EXPECT_EQ(Find<SpawnWorker>(Register("h2", 2, 0)).size(), 2u)
      << "a healthy host still gets its spares";
}

// One worker silent while a job on hosts of fixed slots forms, no spare: it
// is killed and another starts in its slot.
TEST_F(HostFaultsTest, SilentWorkerWhileFormingIsReplacedInItsSlot) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  std::vector<SpawnWorker> spawns;
  for (auto& s : Find<SpawnWorker>(Register("h1", 2, 0))) spawns.push_back(s);
  for (auto& s : Find<SpawnWorker>(Register("h2", 2, 0))) spawns.push_back(s);
  JoinOn(spawns[0].worker_id, spawns[0].host);
  std::vector<Action> all;
  for (int t = 0; t < 1500; t += 50) {
    now_ += Millis(50);
    Do(HostHeartbeat{"h1", {0}});
    Do(HostHeartbeat{"h2", {0}});
    for (auto& a : Do(Tick{})) all.push_back(a);
  }
  EXPECT_TRUE(Find<EndJob>(all).empty());
  auto again = Find<SpawnWorker>(all);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].host, spawns[0].host);
  EXPECT_FALSE(again[0].spare);
}

// A spare on a host whose agent has gone quiet is not promoted: the host is
// probably failing (its member just timed out), and a second recovery would follow.
TEST_F(HostFaultsTest, SpareOfAQuietHostIsNotPromoted) {
  ControllerOptions o;
  o.min_hosts = 2;
  Use(o);
  auto spawns = StartOn({{"h1", 1, 1}, {"h2", 1, 1}});
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  int m1 = -1, m2 = -1, sp1 = -1, sp2 = -1;
  for (auto& s : spawns) {
    if (s.host == "h1")
      (s.spare ? sp1 : m1) = s.worker_id;
    else
      (s.spare ? sp2 : m2) = s.worker_id;
  }
  for (int id : {m1, m2}) Step(id, 5);
  Heartbeats();
  now_ += Millis(600);  // h1's agent quiet for 600 ms (half the timeout is 500)
  for (int id : {m2, sp1, sp2}) Do(HeartbeatReceived{id, {5, -1}});
  Do(HostHeartbeat{"h2", {0}});
  Do(ProcessExited{m1, 1, -1, 9, "h1"});
  auto plans = Find<SendPlan>(Ready(m2, 5));
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(plans[0].plan->members[0].worker_id, sp2) << "the spare of the healthy host";
}

}  // namespace
}  // namespace nonstop::controller

namespace nonstop::controller {
namespace {

// Connection setup at scale: a receiver copies from at most 8 holders, and
// consecutive receivers from different ones.
TEST_F(ControllerTest, AReceiverCopiesFromAtMostEightSourcesSpreadOverTheHolders) {
  Make(20, 2);
  for (int id = 0; id < 20; ++id) Join(id);
  Join(20, true);
  Join(21, true);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  for (int id = 0; id < 20; ++id) Step(id, 7);
  Do(ProcessExited{3, 1003, -1, 9, kHost});
  Do(ProcessExited{4, 1004, -1, 9, kHost});
  std::vector<SendPlan> plans;
  for (int id = 0; id < 20; ++id) {
    if (id == 3 || id == 4) continue;
    for (auto& p : Find<SendPlan>(Ready(id, 7))) plans.push_back(p);
  }
  ASSERT_FALSE(plans.empty());
  const auto& transfers = plans[0].plan->transfers;
  ASSERT_EQ(transfers.size(), 2u);
  std::set<int> used;
  for (const auto& t : transfers) {
    EXPECT_EQ(t.sources.size(), 8u) << "18 holders, 8 sources each";
    used.insert(t.sources.begin(), t.sources.end());
  }
  EXPECT_EQ(used.size(), 16u) << "the two receivers copy from different holders";
}

// ---- a controller that takes over a running job (docs/controller-failover.md)

class TakeoverTest : public HostControllerTest {
 protected:
  std::vector<nlohmann::json> journal_;
  // Runs an event on the first controller, keeping its journal.
  std::vector<Action> Record(Event e) {
    auto actions = Do(std::move(e));
    for (const auto& j : Find<AppendJournal>(actions)) journal_.push_back(j.record);
    return actions;
  }
  // The first controller: four hosts, six members at step 20, two spares.
  void RunFirstController() {
    journal_.push_back({{"event", "job_start"}, {"controller", "10.0.0.9:7000"}});
    std::vector<SpawnWorker> spawns;
    for (auto [h, n, sp] : {std::tuple{"h1", 2, 0}, {"h2", 2, 0}, {"h3", 2, 0}, {"h4", 0, 2}}) {
      for (const auto& x : Find<SpawnWorker>(
               Record(HostJoined{Agent(h, n, sp, std::string("10.0.0.") + (h + 1), 4000)}))) {
        spawns.push_back(x);
      }
    }
    for (const auto& x : spawns) {
      Record(WorkerJoined{{x.worker_id, 1000 + x.worker_id, "addr" + std::to_string(x.worker_id),
                           x.spare, -1, x.host}});
    }
    for (int64_t step = 0; step <= 20; ++step) {
      for (const auto& [id, w] : c_->workers()) {
        if (w.role == WorkerRole::kMember) Record(ProgressReceived{id, {step, 2.0, 0.1, 100, 6}});
      }
    }
    ASSERT_EQ(c_->generation(), 1u);
    first_members_.clear();
    for (const auto& [id, w] : c_->workers()) {
      if (w.role == WorkerRole::kMember) first_members_[w.rank] = id;
    }
  }
  // The second controller, from the first one's journal.
  void TakeOver() {
    auto t = TakeoverFromJournal(journal_);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(t->controller, "10.0.0.9:7000");
    ControllerOptions o;
    o.min_hosts = 4;
    o.heartbeat_timeout = Millis(1000);
    o.abort_timeout = Millis(2000);
    o.adopt_timeout = Millis(5000);
    c_ = std::make_unique<Controller>(o);
    now_ += Millis(3000);  // the time it took to start it
    auto actions = Do(Takeover{t->state});
    EXPECT_TRUE(Find<SendAbort>(actions).empty());
    now_ += Millis(50);
    actions = Do(Tick{});
    EXPECT_TRUE(Find<SpawnWorker>(actions).empty())
        << "every slot is taken by an inherited process, and no order goes to an agent not joined "
           "yet";
  }
  control::AgentRegisterMsg Reregister(const std::string& host) {
    control::AgentRegisterMsg m =
        Agent(host, host == "h4" ? 0 : 2, host == "h4" ? 2 : 0, "10.0.0." + host.substr(1), 4000);
    for (const auto& [id, w] : c_->workers()) {
      if (w.host == host) m.workers.push_back({id, w.pid});
    }
    m.running = static_cast<int>(m.workers.size());
    return m;
  }
  std::vector<Action> Rejoin(int id, uint32_t generation, bool waiting, int64_t step) {
    const WorkerInfo& w = c_->workers().at(id);
    control::JoinMsg m{id, w.pid, w.address, w.role == WorkerRole::kSpare, step, w.host};
    m.generation = generation;
    m.waiting = waiting;
    return Do(WorkerJoined{m});
  }
  // Takes over; every inherited worker but the member of rank 3 rejoins, and
  // time passes (500 ms a tick, `each_tick` sees each) until the others are
  // aborted. Returns that tick's actions; *missing: the member that stayed away.
  std::vector<Action> TakeOverWithoutOneMember(
      int* missing, const std::function<void(int, const std::vector<Action>&)>& each_tick = {}) {
    RunFirstController();
    TakeOver();
    for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostJoined{Reregister(host)});
    *missing = first_members_[3];
    for (const auto& [id, w] : std::map<int, WorkerInfo>(c_->workers())) {
      if (id != *missing) Rejoin(id, w.role == WorkerRole::kSpare ? 0 : 1, false, 20);
    }
    std::vector<Action> actions;
    for (int i = 0; i < 12 && Find<SendAbort>(actions).empty(); ++i) {
      now_ += Millis(500);
      for (const auto& [id, w] : c_->workers()) {
        if (id != *missing && w.role != WorkerRole::kGone) Do(HeartbeatReceived{id, {20, -1}});
      }
      for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostHeartbeat{host, {2}});
      actions = Do(Tick{});
      if (each_tick) each_tick(i, actions);
    }
    return actions;
  }
  std::map<int, int> first_members_;  // rank → worker id
};

TEST_F(TakeoverTest, InheritedWorkersAndAgentsJoinAndTrainingGoesOnWithoutARecovery) {
  RunFirstController();
  TakeOver();
  EXPECT_EQ(c_->generation(), 1u) << "the same generation goes on";
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
  for (const auto& [rank, id] : first_members_) EXPECT_EQ(c_->RankOf(id), rank) << "the same ranks";
  std::vector<Action> all;
  for (const std::string host : {"h1", "h2", "h3", "h4"}) {
    auto a = Do(HostJoined{Reregister(host)});
    all.insert(all.end(), a.begin(), a.end());
  }
  for (const auto& [id, w] : std::map<int, WorkerInfo>(c_->workers())) {
    auto a = Rejoin(id, w.role == WorkerRole::kSpare ? 0 : 1, false,
                    w.role == WorkerRole::kSpare ? -1 : 21);
    all.insert(all.end(), a.begin(), a.end());
  }
  EXPECT_TRUE(Find<SendPlan>(all).empty()) << "nothing changes: no plan";
  EXPECT_TRUE(Find<SendAbort>(all).empty()) << "and no abort";
  EXPECT_TRUE(Find<SignalWorker>(all).empty()) << "no process is fenced";
  EXPECT_TRUE(Find<SendShutdown>(all).empty()) << "no join is refused";
  // Well past the adoption bound, with heartbeats: still no recovery.
  for (int i = 0; i < 20; ++i) {
    now_ += Millis(500);
    Heartbeats();
    auto a = Do(Tick{});
    ASSERT_TRUE(Find<SendAbort>(a).empty()) << "recovery at " << i * 500 << " ms";
  }
  EXPECT_TRUE(c_->recoveries().empty());
  for (const auto& [rank, id] : first_members_) Step(id, 21);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning);
}

// `nonstop controller --resume` of a `nonstop run` job: the journal says its
// one host was elastic, so the new controller keeps its spare pool, refills
// a lost spare there, and takes no other agent.
TEST_F(TakeoverTest, AnElasticJobStaysElasticAfterATakeover) {
  ControllerOptions first;
  first.min_hosts = 1;
  first.max_hosts = 1;
  first.heartbeat_timeout = Millis(1000);
  c_ = std::make_unique<Controller>(first);
  journal_.push_back({{"event", "job_start"}, {"controller", "127.0.0.1:7000"}});
  control::AgentRegisterMsg reg = Agent("local", 2, 1, "127.0.0.1", 4000);
  reg.elastic = true;
  auto spawns = Find<SpawnWorker>(Record(HostJoined{reg}));
  ASSERT_EQ(spawns.size(), 3u);
  for (const auto& x : spawns) {
    Record(WorkerJoined{{x.worker_id, 1000 + x.worker_id, "addr" + std::to_string(x.worker_id),
                         x.spare, -1, x.host}});
  }
  for (int64_t step = 0; step <= 5; ++step) {
    for (const auto& x : spawns) {
      if (!x.spare) Record(ProgressReceived{x.worker_id, {step, 2.0, 0.1, 100, 2}});
    }
  }
  auto t = TakeoverFromJournal(journal_);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ControllerOptions o;
  o.min_hosts = 1;  // --nnodes 1: no maximum
  o.heartbeat_timeout = Millis(1000);
  o.adopt_timeout = Millis(5000);
  c_ = std::make_unique<Controller>(o);
  now_ += Millis(1000);
  Do(Takeover{t->state});
  for (const auto& x : spawns) reg.workers.push_back({x.worker_id, 1000 + x.worker_id});
  reg.running = 3;
  Do(HostJoined{reg});
  for (const auto& x : spawns) Rejoin(x.worker_id, x.spare ? 0 : 1, false, x.spare ? -1 : 6);
  ASSERT_TRUE(c_->hosts().at("local").elastic);

  auto other = Find<CloseHost>(Do(HostJoined{Agent("h2", 2, 0, "10.0.0.2", 4001)}));
  ASSERT_EQ(other.size(), 1u) << "a second agent in nonstop run's job";
  EXPECT_NE(other[0].reason.find("one host is local"), std::string::npos) << other[0].reason;

  // Its spare dies: the pool (one spare) is refilled on the host, as nonstop run did.
  int spare = -1;
  for (const auto& x : spawns) spare = x.spare ? x.worker_id : spare;
  auto refill = Find<SpawnWorker>(Do(ProcessExited{spare, 1000 + spare, -1, 9, "local"}));
  ASSERT_EQ(refill.size(), 1u);
  EXPECT_TRUE(refill[0].spare);
  EXPECT_EQ(refill[0].host, "local");
}

// A shrink on request before the takeover stands after it: the new
// controller neither refills the released slot nor grows back to the hosts' capacity.
TEST_F(TakeoverTest, AShrinkOnRequestOutlivesItsControllerTheWorldDoesNotGrowBack) {
  RunFirstController();
  now_ += Millis(1000);
  auto r = Record(ScaleRequest{1, {{"release", 1}}, "test"});
  ASSERT_EQ(Find<ScaleReply>(r)[0].http_status, 202);
  int released = -1;
  for (const auto& [rank, id] : first_members_) {
    for (const auto& sd : Find<SendShutdown>(Record(ReadyReceived{id, {1, 21, "drained"}})))
      released = sd.worker_id;
  }
  ASSERT_GE(released, 0);
  std::string host = c_->HostOf(released);
  Record(ProcessExited{released, 1000 + released, 0, 0, host});
  ASSERT_EQ(c_->generation(), 2u);
  for (const auto& [id, w] : std::map<int, WorkerInfo>(c_->workers())) {
    if (w.role == WorkerRole::kMember) Record(ProgressReceived{id, {22, 2.0, 0.1, 100, 5}});
  }
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  ASSERT_EQ(c_->world_size(), 5u);
  TakeOver();
  EXPECT_EQ(c_->target_world(), 5) << "the requested world was forgotten";
  for (const std::string h : {"h1", "h2", "h3", "h4"}) Do(HostJoined{Reregister(h)});
  for (const auto& [id, w] : std::map<int, WorkerInfo>(c_->workers())) {
    if (w.role == WorkerRole::kGone) continue;
    Rejoin(id, w.role == WorkerRole::kSpare ? 0 : 2, false, w.role == WorkerRole::kSpare ? -1 : 22);
  }
  for (int i = 0; i < 20; ++i) {
    now_ += Millis(500);
    Heartbeats();
    auto a = Do(Tick{});
    EXPECT_TRUE(Find<SpawnWorker>(a).empty())
        << "the slot host " << host << " gave back was refilled";
    EXPECT_TRUE(Find<SendDrain>(a).empty()) << "the job grew back to the hosts' capacity";
  }
  EXPECT_EQ(c_->world_size(), 5u);
}

// The replay of scale requests matches what the live controller does with them.
TEST(TakeoverFromJournalTest, ScaleRequestsAreReplayedAsTheControllerAppliedThem) {
  using J = nlohmann::json;
  std::vector<J> base = {{{"event", "job_start"}, {"controller", "10.0.0.9:7000"}},
                         {{"event", "host_join"}, {"host", "h1"}, {"nproc", 2}, {"spares", 0}},
                         {{"event", "host_join"}, {"host", "h2"}, {"nproc", 2}, {"spares", 0}}};
  for (int id = 0; id < 4; ++id) {
    std::string host = id < 2 ? "h1" : "h2";
    base.push_back({{"event", "spawn"},
                    {"worker_id", id},
                    {"pid", 100 + id},
                    {"spare", false},
                    {"host", host}});
    base.push_back({{"event", "join"},
                    {"worker_id", id},
                    {"pid", 100 + id},
                    {"address", "a"},
                    {"host", host}});
  }
  base.push_back(
      {{"event", "plan"}, {"generation", 1}, {"members", {0, 1, 2, 3}}, {"resume_step", 0}});
  auto replay = [&](std::vector<J> more) {
    std::vector<J> all = base;
    all.insert(all.end(), more.begin(), more.end());
    auto t = TakeoverFromJournal(all);
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t.ok() ? t->state : TakeoverState{};
  };
  const J shrink = {{"event", "scale_request"}, {"from", 4}, {"to", 3}};
  const J shrunk = {{"event", "plan"},
                    {"generation", 2},
                    {"members", {0, 1, 2}},
                    {"resume_step", 9},
                    {"released", {3}}};
  // A shrink whose plan was not journaled yet: not applied (its drain is finished as a recovery of
  // all).
  auto mid = replay({shrink});
  EXPECT_EQ(mid.target_world, 0);
  EXPECT_TRUE(mid.withheld.empty());
  // Applied: the target, and the slot its released worker held.
  auto done = replay({shrink, shrunk});
  EXPECT_EQ(done.target_world, 3);
  EXPECT_EQ(done.withheld, (std::map<std::string, int>{{"h2", 1}}));
  // A grow takes every slot back.
  auto grown = replay({shrink, shrunk, {{"event", "scale_request"}, {"from", 3}, {"to", 4}}});
  EXPECT_EQ(grown.target_world, 4);
  EXPECT_TRUE(grown.withheld.empty());
  // A restart from a checkpoint starts on the hosts' whole capacity.
  auto restarted = replay({shrink, shrunk, {{"event", "restart"}, {"recovery", 2}}});
  EXPECT_EQ(restarted.target_world, 0);
  EXPECT_TRUE(restarted.withheld.empty());
  // A host lost, or joining afresh, gives back nothing withheld.
  auto lost = replay({shrink, shrunk, {{"event", "host_lost"}, {"host", "h2"}}});
  EXPECT_TRUE(lost.withheld.empty());
  // A refused request changes nothing.
  auto refused = replay({{{"event", "scale_refused"}, {"request", {{"world_size", 9}}}}});
  EXPECT_EQ(refused.target_world, 0);
}

TEST_F(TakeoverTest, AMemberThatDoesNotRejoinInTimeIsLostAndTheOthersRecover) {
  int missing = -1;
  auto actions = TakeOverWithoutOneMember(&missing, [&](int i, const std::vector<Action>& tick) {
    if (i < 6) {
      EXPECT_TRUE(Find<SendAbort>(tick).empty())
          << "before the adoption bound, at " << (i + 1) * 500;
    }
  });
  ASSERT_EQ(Find<SendAbort>(actions).size(), 5u) << "the five others abort";
  auto kills = Find<KillWorker>(actions);
  ASSERT_EQ(kills.size(), 1u);
  EXPECT_EQ(kills[0].worker_id, missing);
}

// A stall of the new controller right after it took over keeps the grace its inherited agents and
// workers have to reconnect (their silence clocks are set ahead): it moves no clock backwards.
TEST_F(TakeoverTest, AStallRightAfterATakeoverKeepsThePeersGraceToReconnect) {
  RunFirstController();
  TakeOver();
  Do(ControllerStalled{Millis(1200)});
  now_ += Millis(1100);
  auto actions = Do(Tick{});
  EXPECT_TRUE(Find<CloseHost>(actions).empty()) << "no inherited agent is lost before its grace";
  EXPECT_TRUE(Find<KillWorker>(actions).empty());
  EXPECT_TRUE(Find<SendAbort>(actions).empty());
}

// After a takeover in which one member never rejoined (lost, recovered
// from), a host can still leave: the adoption no longer holds changes back.
TEST_F(TakeoverTest, AHostCanLeaveAfterATakeoverInWhichAMemberNeverRejoined) {
  int missing = -1;
  auto actions = TakeOverWithoutOneMember(&missing);
  for (auto& ab : Find<SendAbort>(actions))
    Do(ReadyReceived{ab.worker_id, {c_->generation(), 20, "aborted"}});
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  ASSERT_EQ(c_->workers().at(missing).role, WorkerRole::kGone);
  for (int id : c_->members()) Do(ProgressReceived{id, {21, 2.0, 0.1, 100, 6}});
  std::vector<Action> all = Do(HostLeaving{"h1", {"SIGTERM"}});
  for (int i = 0; i < 20; ++i) {
    now_ += Millis(200);
    for (const auto& [id, w] : c_->workers()) {
      if (w.role != WorkerRole::kGone) Do(HeartbeatReceived{id, {21, -1}});
    }
    for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostHeartbeat{host, {2}});
    for (auto& x : Do(Tick{})) all.push_back(x);
  }
  EXPECT_FALSE(Find<SendDrain>(all).empty()) << "the leave drains";
}

TEST_F(TakeoverTest, AMemberBetweenGenerationsMakesTheNewControllerFinishTheRecovery) {
  RunFirstController();
  TakeOver();
  for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostJoined{Reregister(host)});
  // Rank 0 had left generation 1 (its collective failed) when the first controller stopped.
  auto first = Rejoin(first_members_[0], 1, /*waiting=*/true, 20);
  EXPECT_EQ(c_->phase(), JobPhase::kRecovering);
  // The others take 3 s to find the new controller: longer than the abort
  // timeout (2 s), within the adoption bound (5 s). Nobody is killed.
  for (int i = 0; i < 6; ++i) {
    now_ += Millis(500);
    Do(HeartbeatReceived{first_members_[0], {20, -1}});
    for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostHeartbeat{host, {2}});
    ASSERT_TRUE(Find<KillWorker>(Do(Tick{})).empty())
        << "killed an inherited member at " << (i + 1) * 500 << " ms";
  }
  std::map<int, int> aborted;
  for (const auto& [id, w] : std::map<int, WorkerInfo>(c_->workers())) {
    if (id == first_members_[0]) continue;
    auto a = Rejoin(id, w.role == WorkerRole::kSpare ? 0 : 1, false, 20);
    for (const auto& x : Find<SendAbort>(a)) aborted[x.worker_id]++;
  }
  for (int r = 1; r < 6; ++r) {
    EXPECT_EQ(aborted[first_members_[r]], 1)
        << "rank " << r << " is told once to abort generation 1";
  }
  std::vector<Action> all;
  for (int r = 1; r < 6; ++r) all = Ready(first_members_[r], 20);
  auto plans = Find<SendPlan>(all);
  ASSERT_EQ(plans.size(), 6u);
  EXPECT_EQ(plans[0].plan->generation, 2u);
  EXPECT_EQ(plans[0].plan->resume_step, 21);
  EXPECT_TRUE(plans[0].plan->transfers.empty()) << "everyone holds step 20";
}

// The first controller dies during a recovery, after its plan went out:
// the next one keeps the recovery's record open (same id) and ends it when
// every member completes the resume step, as the first would have.
TEST_F(TakeoverTest, ARecoveryWhosePlanWentOutIsFinishedByTheNextController) {
  RunFirstController();
  const int victim = first_members_[2];
  Record(ProcessExited{victim, 1000 + victim, -1, 9, c_->HostOf(victim)});
  std::vector<Action> planned;
  for (const auto& [rank, id] : first_members_) {
    if (id != victim) planned = Record(ReadyReceived{id, {1, 20, "aborted"}});
  }
  ASSERT_FALSE(Find<SendPlan>(planned).empty()) << "generation 2 is planned";
  ASSERT_EQ(c_->generation(), 2u);
  const int recovery = c_->recoveries().back().id;
  TakeOver();
  ASSERT_EQ(c_->recoveries().size(), 1u) << "the open recovery is adopted";
  EXPECT_EQ(c_->recoveries()[0].id, recovery);
  EXPECT_EQ(c_->recoveries()[0].outcome, "in progress");
  ASSERT_EQ(c_->recoveries()[0].replacements.size(), 1u);
  EXPECT_EQ(
      c_->recoveries()[0].replacements[0],
      "rank 2: worker " + std::to_string(victim) + " → worker " + std::to_string(c_->members()[2]));
  for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostJoined{Reregister(host)});
  for (int id : c_->members()) Rejoin(id, 2, false, 20);
  std::vector<Action> all;
  for (int id : c_->members()) {
    auto a = Do(ProgressReceived{id, {21, 2.0, 0.1, 100, 6}});
    all.insert(all.end(), a.begin(), a.end());
  }
  std::vector<nlohmann::json> ends;
  for (const auto& j : Find<AppendJournal>(all)) {
    if (j.record["event"] == "recovery_end") ends.push_back(j.record["recovery"]);
  }
  ASSERT_EQ(ends.size(), 1u) << "the recovery ends once every member completed step 21";
  EXPECT_EQ(ends[0]["id"], recovery);
  EXPECT_EQ(ends[0]["outcome"], "completed");
  EXPECT_EQ(ends[0]["resume_step"], 21);
  EXPECT_TRUE(c_->recoveries().size() == 1u && c_->recoveries()[0].first_step_at.has_value());
}

// The first controller dies after a recovery started and before its plan:
// the next one ends that record as interrupted (its id is not reused) and
// recovers from the member lost in a recovery of its own.
TEST_F(TakeoverTest, ARecoveryInterruptedBeforeItsPlanEndsAsSuchAndItsIdIsNotReused) {
  RunFirstController();
  const int victim = first_members_[2];
  Record(ProcessExited{victim, 1000 + victim, -1, 9, c_->HostOf(victim)});
  ASSERT_EQ(c_->recoveries().size(), 1u);
  const int interrupted = c_->recoveries()[0].id;
  auto t = TakeoverFromJournal(journal_);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(t->state.open_recovery.has_value());
  EXPECT_EQ(t->state.open_recovery->id, interrupted);
  EXPECT_EQ(t->state.open_recovery->plan_generation, 0u) << "its plan did not go out";
  ControllerOptions o;
  o.min_hosts = 4;
  o.heartbeat_timeout = Millis(1000);
  o.abort_timeout = Millis(2000);
  o.adopt_timeout = Millis(5000);
  c_ = std::make_unique<Controller>(o);
  auto actions = Do(Takeover{t->state});
  std::vector<nlohmann::json> ends;
  for (const auto& j : Find<AppendJournal>(actions)) {
    if (j.record["event"] == "recovery_end") ends.push_back(j.record["recovery"]);
  }
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0]["id"], interrupted);
  EXPECT_NE(ends[0]["outcome"].get<std::string>().find("interrupted"), std::string::npos)
      << ends[0].dump();
  ASSERT_EQ(c_->recoveries().size(), 2u) << "and a recovery of its own for the member that ended";
  EXPECT_EQ(c_->recoveries()[1].id, interrupted + 1);
}

TEST_F(TakeoverTest, AnAgentListingAProcessTheJobDoesNotKnowIsToldToKillIt) {
  RunFirstController();
  TakeOver();
  auto reg = Reregister("h1");
  reg.workers.push_back({999, 4242});
  reg.running = static_cast<int>(reg.workers.size());
  auto signals = Find<SignalWorker>(Do(HostJoined{reg}));
  ASSERT_EQ(signals.size(), 1u);
  EXPECT_EQ(signals[0].worker_id, 999);
  EXPECT_EQ(signals[0].signal, SIGKILL);
  EXPECT_EQ(c_->HostOf(999), "h1") << "the order goes to the agent that listed it";
}

// A deposed leader started a worker whose spawn record never reached etcd: the journal taken over
// does not know its id. The worker joins the new leader before its agent lists it, and is refused;
// no worker started later takes its id (the agent would run two processes of one id, and the job
// refuse the new one as the old one's twin).
TEST_F(TakeoverTest, TheIdOfAWorkerTheJournalDoesNotKnowIsNotGivenToANewWorker) {
  RunFirstController();
  TakeOver();
  // the id the old leader gave its last spawn: one past every id the journal knows
  const int unrecorded = c_->workers().rbegin()->first + 1;
  auto refused = Find<SendShutdown>(Do(WorkerJoined{{unrecorded, 4242, "addrX", true, -1, "h4"}}));
  ASSERT_EQ(refused.size(), 1u);
  for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostJoined{Reregister(host)});
  for (const auto& [id, w] : std::map<int, WorkerInfo>(c_->workers())) {
    Rejoin(id, w.role == WorkerRole::kSpare ? 0 : 1, false, 20);
  }
  // a member dies: a spare takes its place and a refill is started
  const WorkerInfo victim = c_->workers().at(first_members_[0]);
  auto actions = Do(ProcessExited{first_members_[0], victim.pid, -1, 9, victim.host});
  for (int i = 0; i < 20; ++i) {
    now_ += Millis(100);
    auto more = Do(Tick{});
    actions.insert(actions.end(), more.begin(), more.end());
  }
  std::vector<int> spawned;
  for (const auto& s : Find<SpawnWorker>(actions)) spawned.push_back(s.worker_id);
  ASSERT_FALSE(spawned.empty()) << "no refill was started";
  for (int id : spawned) EXPECT_GT(id, unrecorded) << "a new worker took the id of a running one";
}

// Plans are recorded one at a time: a worker can be at most one generation
// ahead of the journal. A claim beyond that is refused, and the generation
// counter is not moved by it (a lie of 0xFFFFFFFF would wrap the next plan's).
TEST_F(TakeoverTest, ARejoinClaimingAGenerationFarAheadOfTheJournalIsRefused) {
  RunFirstController();
  TakeOver();
  for (const std::string host : {"h1", "h2", "h3", "h4"}) Do(HostJoined{Reregister(host)});
  auto actions = Rejoin(first_members_[2], 0xFFFFFFFFu, false, 20);
  auto shutdowns = Find<SendShutdown>(actions);
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_NE(shutdowns[0].msg.reason.find("the journal's last is 1"), std::string::npos)
      << shutdowns[0].msg.reason;
  EXPECT_EQ(c_->generation(), 1u);
  EXPECT_EQ(c_->phase(), JobPhase::kRunning) << "a lie starts no recovery";
}

TEST_F(TakeoverTest, AJournalWhoseJobEndedOrNeverFormedCannotBeTakenOver) {
  RunFirstController();
  journal_.push_back({{"event", "job_end"}, {"exit_code", 0}, {"reason", "done"}});
  auto ended = TakeoverFromJournal(journal_);
  ASSERT_FALSE(ended.ok());
  EXPECT_NE(ended.status().message().find("already ended"), std::string::npos)
      << ended.status().ToString();
  auto unformed = TakeoverFromJournal({{{"event", "job_start"}, {"controller", "x:1"}}});
  ASSERT_FALSE(unformed.ok());
  EXPECT_NE(unformed.status().message().find("never formed"), std::string::npos)
      << unformed.status().ToString();
  auto garbage =
      TakeoverFromJournal({{{"event", "job_start"}}, {{"event", "plan"}, {"generation", "two"}}});
  ASSERT_FALSE(garbage.ok());
  EXPECT_NE(garbage.status().message().find("wrong shape"), std::string::npos)
      << garbage.status().ToString();
}

// Sharded optimizer state (docs/sharding.md): the controller knows the group
// size and the shard each member holds, from the joins and the Readies.
class ShardedControllerTest : public ControllerTest {
 protected:
  static constexpr int kGroup = 2;
  std::vector<Action> JoinSharded(int id, bool spare = false, int group = kGroup) {
    control::JoinMsg m{id, 1000 + id, "127.0.0.1:" + std::to_string(5000 + id), spare, -1, kHost};
    m.shard_group = group;
    m.held_shard = nonstop::state::kEveryShard;
    return Do(WorkerJoined{m});
  }
  std::vector<Action> ReadyHolding(int id, int64_t step, int shard) {
    control::ReadyMsg m{c_->generation(), step, "aborted", shard};
    return Do(ReadyReceived{id, m});
  }
  // World 4 in groups of 2 (rank r holds shard r mod 2), every member at step
  // 7; the spares are workers 4, 5, … (joined unless `join_spares` is false).
  void StartSharded(int spares, bool join_spares = true) {
    Make(4, spares);
    for (int s = 0; s < spares && join_spares; ++s) JoinSharded(4 + s, true);
    for (int id = 0; id < 4; ++id) JoinSharded(id);
    ASSERT_EQ(c_->phase(), JobPhase::kRunning);
    for (int id = 0; id < 4; ++id) Step(id, 7);
  }
  static std::vector<int> Members(const control::PlanMsg& plan) {
    std::vector<int> ids;
    for (const auto& m : plan.members) ids.push_back(m.worker_id);
    return ids;
  }
};

TEST_F(ShardedControllerTest, AWorkerOfAnotherGroupSizeIsRefused) {
  StartSharded(2, /*join_spares=*/false);
  auto shutdowns = Find<SendShutdown>(JoinSharded(4, /*spare=*/true, /*group=*/4));
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_NE(shutdowns[0].msg.reason.find("groups of 4, the job over groups of 2"),
            std::string::npos)
      << shutdowns[0].msg.reason;
  shutdowns = Find<SendShutdown>(Join(5, /*spare=*/true));  // unsharded
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_NE(shutdowns[0].msg.reason.find("optimizer.shard_group"), std::string::npos);
}

TEST_F(ShardedControllerTest, AWorldOfPartGroupsIsRefusedBeforeItForms) {
  Make(3, 0);
  std::vector<Action> all;
  for (int id = 0; id < 3; ++id) all = JoinSharded(id);
  auto ends = Find<EndJob>(all);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitUsage);
  EXPECT_NE(ends[0].reason.find("not groups of optimizer.shard_group 2"), std::string::npos)
      << ends[0].reason;
}

TEST_F(ShardedControllerTest, LosingEveryHolderOfAShardEndsTheJobNamingTheShardAndStep) {
  StartSharded(2);
  Do(ProcessExited{1, 1001, -1, 9, kHost});  // ranks 1 and 3: both copies of shard 1
  Do(ProcessExited{3, 1003, -1, 9, kHost});
  ReadyHolding(0, 7, 0);
  auto actions = ReadyHolding(2, 7, 0);
  EXPECT_TRUE(Find<SendPlan>(actions).empty()) << "no plan that cannot load";
  auto ends = Find<EndJob>(actions);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitPeerFailure);
  EXPECT_NE(ends[0].reason.find("every copy of shard 1 of the optimizer state of step 7 is lost"),
            std::string::npos)
      << ends[0].reason;
}

TEST_F(ShardedControllerTest, AKillWithASpareGivesTheSpareTheLostRankAndMovesNothingElse) {
  StartSharded(1);
  Do(ProcessExited{1, 1001, -1, 9, kHost});
  std::vector<Action> last;
  for (int id : {0, 2, 3}) last = ReadyHolding(id, 7, id % kGroup);
  auto plans = Find<SendPlan>(last);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(Members(*plans[0].plan), (std::vector<int>{0, 4, 2, 3}))
      << "the spare takes rank 1, nothing moves";
}

TEST_F(ShardedControllerTest, AFaultWithoutASpareKeepsWholeGroupsAndAHolderOfEveryShard) {
  StartSharded(0);
  // Rank 1 (shard 1) is lost: of the survivors 0 (shard 0), 2 (shard 0), 3 (shard 1), the
  // world of 3 must go to 2; rank 3 is the last holder of shard 1, so rank 2 leaves.
  Do(ProcessExited{1, 1001, -1, 9, kHost});
  ReadyHolding(0, 7, 0);
  ReadyHolding(2, 7, 0);
  auto actions = ReadyHolding(3, 7, 1);
  auto plans = Find<SendPlan>(actions);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(Members(*plans[0].plan), (std::vector<int>{0, 3}));
  auto shutdowns = Find<SendShutdown>(actions);
  ASSERT_EQ(shutdowns.size(), 1u);
  EXPECT_EQ(shutdowns[0].worker_id, 2);
  EXPECT_EQ(shutdowns[0].msg.exit_code, kExitOk) << "released, not failed";
  // And the policy allows only whole groups from now on.
  auto reply = Find<ScaleReply>(Do(ScaleRequest{1, {{"world_size", 3}}, "test"}));
  ASSERT_EQ(reply.size(), 1u);
  EXPECT_NE(reply[0].body.dump().find("not a multiple of optimizer.shard_group 2"),
            std::string::npos)
      << reply[0].body.dump();
}

TEST_F(ShardedControllerTest, ASpareThatWouldMakeAPartGroupIsNotPromoted) {
  StartSharded(1);
  // Ranks 1 and 2 (shards 1 and 0) die; the survivors 0 and 3 hold both shards; one spare would
  // make 3.
  Do(ProcessExited{1, 1001, -1, 9, kHost});
  Do(ProcessExited{2, 1002, -1, 9, kHost});
  ReadyHolding(0, 7, 0);
  auto actions = ReadyHolding(3, 7, 1);
  auto plans = Find<SendPlan>(actions);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(Members(*plans[0].plan), (std::vector<int>{0, 3}));
  for (const auto& sd : Find<SendShutdown>(actions))
    EXPECT_NE(sd.worker_id, 4) << "the spare stays a spare";
  EXPECT_EQ(c_->workers().at(4).role, WorkerRole::kSpare);
}

TEST_F(ShardedControllerTest, AGrowThatCanReachOnlyAPartGroupAddsNoSpare) {
  ControllerOptions o;
  o.world_size = 4;
  o.spares = 2;
  o.heartbeat_timeout = Millis(1000);
  o.abort_timeout = Millis(2000);
  o.policy.max_world = 6;
  Make(o);
  for (int id : {4, 5}) JoinSharded(id, true);
  for (int id = 0; id < 4; ++id) JoinSharded(id);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  for (int id = 0; id < 4; ++id) Step(id, 7);
  auto reply = Find<ScaleReply>(Do(ScaleRequest{1, {{"world_size", 6}}, "test"}));
  ASSERT_EQ(reply.size(), 1u);
  ASSERT_EQ(reply[0].http_status, 202) << reply[0].body.dump();
  // one of the two spares dies during the drain: 5 is all it can reach
  Do(ProcessExited{4, 1004, -1, 9, kHost});
  std::vector<Action> last;
  for (int id = 0; id < 4; ++id) last = ReadyHolding(id, 7, id % kGroup);
  auto plans = Find<SendPlan>(last);
  ASSERT_FALSE(plans.empty());
  EXPECT_EQ(Members(*plans[0].plan), (std::vector<int>{0, 1, 2, 3})) << "no part group of one";
  for (const auto& sd : Find<SendShutdown>(last))
    EXPECT_NE(sd.worker_id, 5) << "the spare is not released";
  EXPECT_EQ(c_->workers().at(5).role, WorkerRole::kSpare);
}

// A spare beside a replica of the lost rank's shard would put both copies on
// one host: a spare on another host is preferred.
TEST_F(HostFaultsTest, ShardedSpareIsTakenFromAHostHoldingNoOtherCopyOfTheShard) {
  ControllerOptions o;
  o.min_hosts = 3;
  Use(o);
  StartShardedOn({{"h1", 2, 1}, {"h2", 2, 0}, {"h3", 0, 1}}, 2);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  std::vector<int> by_rank(4, -1);
  for (const auto& [id, w] : c_->workers()) {
    if (w.role == WorkerRole::kMember) by_rank[static_cast<size_t>(w.rank)] = id;
  }
  ASSERT_EQ(c_->HostOf(by_rank[0]), "h1");
  ASSERT_EQ(c_->HostOf(by_rank[2]), "h2");
  for (int id : by_rank) Step(id, 5);
  // Rank 2 (shard 0; its other copy is rank 0's, on h1) dies.
  Do(ProcessExited{by_rank[2], 1000 + by_rank[2], -1, 9, ""});
  std::vector<Action> last;
  for (int r : {0, 1, 3}) {
    last =
        Do(ReadyReceived{by_rank[static_cast<size_t>(r)], {c_->generation(), 5, "aborted", r % 2}});
  }
  auto plans = Find<SendPlan>(last);
  ASSERT_FALSE(plans.empty());
  const int taker = plans[0].plan->members[2].worker_id;
  EXPECT_EQ(c_->HostOf(taker), "h3") << "not h1's spare, beside rank 0's copy of shard 0";
}

// A leaving host whose members hold every copy of a shard: releasing them
// would lose it, so they stay (and the leave is refused with the reason).
TEST_F(HostLeavingTest, ShardedMembersHoldingTheOnlyCopiesOfAShardStay) {
  ControllerOptions o;
  o.min_hosts = 3;
  Use(o);
  // h1: ranks 0, 1, 2 (shards 0, 1, 0: both copies of shard 0); h2: rank 3 (shard 1); h3: two
  // spares.
  StartShardedOn({{"h1", 3, 0}, {"h2", 1, 0}, {"h3", 0, 2}}, 2);
  ASSERT_EQ(c_->phase(), JobPhase::kRunning);
  std::vector<int> on_h1 = MembersOn("h1");
  ASSERT_EQ(on_h1.size(), 3u);
  for (int id : c_->members()) Step(id, 5);
  ASSERT_FALSE(Find<SendDrain>(Do(HostLeaving{"h1", {"SIGTERM"}})).empty());
  std::vector<Action> all;
  std::vector<int> members = c_->members();
  for (int id : members) {
    for (auto& a : Do(ReadyReceived{id, {c_->generation(), 5, "drained", c_->RankOf(id) % 2}}))
      all.push_back(a);
  }
  auto plans = Find<SendPlan>(all);
  ASSERT_FALSE(plans.empty());
  std::set<int> next;
  for (const auto& m : plans[0].plan->members) next.insert(m.worker_id);
  for (int id : on_h1)
    EXPECT_TRUE(next.count(id)) << "worker " << id << " of h1 holds shard 0's copies: it stays";
  for (const auto& sd : Find<SendShutdown>(all)) {
    EXPECT_EQ(std::find(on_h1.begin(), on_h1.end(), sd.worker_id), on_h1.end())
        << "worker " << sd.worker_id;
  }
  bool said = false;
  for (const auto& p : Find<PrintLine>(all))
    said = said || p.line.find("holds all of the state") != std::string::npos;
  EXPECT_TRUE(said) << "the reason is printed";
}

}  // namespace
}  // namespace nonstop::controller
