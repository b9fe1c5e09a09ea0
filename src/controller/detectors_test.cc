// The detectors by tables: a view of the job at `now`, and exactly what must
// fire (which worker, which kind, the detail), or nothing.
#include "controller/detectors.h"

#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace nonstop::controller {
namespace {

const Clock::time_point kT0 = Clock::time_point() + std::chrono::hours(1);
Clock::time_point At(int64_t ms) { return kT0 + Millis(ms); }

WorkerInfo Worker(int id, WorkerRole role, int64_t last_heard_ms = 0, int64_t last_step = -1,
                  int64_t waiting_ms = -1) {
  WorkerInfo w;
  w.worker_id = id;
  w.role = role;
  w.rank = role == WorkerRole::kMember ? id : -1;
  w.last_heard = At(last_heard_ms);
  w.last_step = last_step;
  w.waiting_ms = waiting_ms;
  return w;
}

std::vector<WorkerInfo*> Pointers(std::vector<WorkerInfo>& ws) {
  std::vector<WorkerInfo*> out;
  for (auto& w : ws) out.push_back(&w);
  return out;
}

ControllerOptions Thresholds() {
  ControllerOptions o;
  o.hang_factor = 8;
  o.busy_timeout = Millis(500);
  o.stall_factor = 10;
  o.stall_floor = Millis(30'000);
  o.forming_timeout = Millis(300'000);
  return o;
}

void ExpectFinding(const std::optional<Finding>& got, const std::optional<Finding>& want,
                   const std::string& name) {
  ASSERT_EQ(got.has_value(), want.has_value())
      << name << (got ? ": fired " + got->detail : ": did not fire");
  if (!want) return;
  EXPECT_EQ(got->worker_id, want->worker_id) << name;
  EXPECT_EQ(got->kind, want->kind) << name;
  EXPECT_EQ(got->detail, want->detail) << name;
}

// ---------------------------------------------------------------- heartbeats

TEST(DetectorsTest, SilentHostsAreLiveAgentsSilentForLongerThanTheTimeout) {
  struct Case {
    std::string name;
    bool alive;
    int64_t last_heard_ms;
    std::vector<std::string> want_details;  // empty: not silent
  };
  const Case kCases[] = {
      {"HeardJustNow", true, 1'900, {}},
      {"AtTheTimeoutExactly", true, 1'000, {}},
      {"OneMsPastTheTimeout", true, 999, {"its agent sent no heartbeat for 1001 ms"}},
      {"LongSilent", true, -3'000, {"its agent sent no heartbeat for 5000 ms"}},
      {"LostAlready", false, -3'000, {}},
  };
  for (const Case& c : kCases) {
    std::map<std::string, HostInfo> hosts;
    HostInfo& h = hosts["h1"];
    h.host_id = "h1";
    h.alive = c.alive;
    h.last_heard = At(c.last_heard_ms);
    auto silent = SilentHosts(hosts, At(2'000), Millis(1'000));
    ASSERT_EQ(silent.size(), c.want_details.size()) << c.name;
    for (size_t i = 0; i < silent.size(); ++i) {
      EXPECT_EQ(silent[i].host_id, "h1") << c.name;
      EXPECT_EQ(silent[i].detail, c.want_details[i]) << c.name;
    }
  }
}

TEST(DetectorsTest, SilentWorkersAreThoseWatchedInTheirRoleAndPhase) {
  struct Case {
    std::string name;
    WorkerRole role;
    JobPhase phase;
    int64_t last_heard_ms;
    bool want_silent;
  };
  const Case kCases[] = {
      {"PendingSilent", WorkerRole::kPending, JobPhase::kForming, 0, true},
      {"SpareSilent", WorkerRole::kSpare, JobPhase::kRecovering, 0, true},
      {"MemberSilentWhileRunning", WorkerRole::kMember, JobPhase::kRunning, 0, true},
      // During a recovery members may be busy aborting: the abort's deadline watches them.
      {"MemberSilentWhileRecovering", WorkerRole::kMember, JobPhase::kRecovering, 0, false},
      {"FinishedSilent", WorkerRole::kFinished, JobPhase::kRunning, 0, false},
      {"GoneSilent", WorkerRole::kGone, JobPhase::kRunning, 0, false},
      {"SpareHeardWithinTheTimeout", WorkerRole::kSpare, JobPhase::kRunning, 1'000, false},
  };
  for (const Case& c : kCases) {
    std::map<int, WorkerInfo> workers{{7, Worker(7, c.role, c.last_heard_ms)}};
    auto silent = SilentWorkers(workers, c.phase, At(2'000), Millis(1'000));
    EXPECT_EQ(silent, c.want_silent ? std::vector<int>{7} : std::vector<int>{}) << c.name;
  }
}

TEST(DetectorsTest, SilentWorkersComeInAscendingIdsAndTheDetailNamesTheSilence) {
  std::map<int, WorkerInfo> workers{{5, Worker(5, WorkerRole::kSpare)},
                                    {2, Worker(2, WorkerRole::kMember)},
                                    {3, Worker(3, WorkerRole::kMember, 1'500)}};
  EXPECT_EQ(SilentWorkers(workers, JobPhase::kRunning, At(2'000), Millis(1'000)),
            (std::vector<int>{2, 5}));
  EXPECT_EQ(HeartbeatDetail(At(0), At(1'234)), "sent no heartbeat for 1234 ms");
}

// ---------------------------------------------------------------- join deadlines

TEST(DetectorsTest, JoinDeadlines) {
  struct Case {
    std::string name;
    JobPhase phase;
    bool placed;  // the hosts registered and their workers were started
    std::map<int, AwaitedJoin> awaiting;
    int64_t now_ms;
    std::optional<std::string> want_not_formed;
    std::vector<int> want_late;
  };
  const std::string kHint = "HINT: a slow start needs a longer --join-timeout-ms)";
  const Case kCases[] = {
      {"FormingWithinTheBound", JobPhase::kForming, true, {{1, {false, At(0)}}}, 10'000, {}, {}},
      {"FormingPastTheBoundOncePlaced",
       JobPhase::kForming,
       true,
       {{1, {false, At(0)}}, {2, {true, At(0)}}, {4, {false, At(0)}}},
       10'001,
       "the job did not form within 10 s: 1 of 3 workers joined; not joined: worker(s) [1,4] (see "
       "their output; " +
           kHint,
       {}},
      {"FormingPastTheBoundWithTooFewHosts",
       JobPhase::kForming,
       false,
       {},
       10'001,
       "the job did not form within 10 s: 1 of the 2 hosts it needs registered (start `nonstop "
       "agent` on each "
       "host; " +
           kHint,
       {}},
      // While forming, the forming bound alone counts: no worker is late on its own.
      {"FormingLateWorkerIsNotReportedAlone",
       JobPhase::kForming,
       true,
       {{1, {false, At(-60'000)}}},
       1'000,
       {},
       {}},
      {"RunningLateOnesInAscendingIds",
       JobPhase::kRunning,
       true,
       {{9, {true, At(-5'001)}}, {3, {false, At(-6'000)}}, {4, {true, At(-4'999)}}},
       0,
       {},
       {3, 9}},
      // Unset `since`: since the controller's first event.
      {"RunningSinceTheStart",
       JobPhase::kRunning,
       true,
       {{2, {false, std::nullopt}}},
       5'001,
       {},
       {2}},
      {"RecoveringCountsToo", JobPhase::kRecovering, true, {{2, {true, At(-5'001)}}}, 0, {}, {2}},
  };
  for (const Case& c : kCases) {
    std::map<int, WorkerInfo> workers{{0, Worker(0, WorkerRole::kPending)},
                                      {5, Worker(5, WorkerRole::kSpare)}};
    JoinView v;
    v.phase = c.phase;
    v.awaiting = &c.awaiting;
    v.workers = &workers;
    v.started_at = At(0);
    v.forming_since = At(0);
    v.placed = c.placed;
    v.alive_hosts = 1;
    v.min_hosts = 2;
    v.world_size = 3;
    v.forming_timeout = Millis(10'000);
    v.join_timeout = Millis(5'000);
    JoinDeadlines got = DetectJoinDeadlines(v, At(c.now_ms));
    EXPECT_EQ(got.not_formed, c.want_not_formed) << c.name;
    EXPECT_EQ(got.late, c.want_late) << c.name;
  }
}

// ---------------------------------------------------------------- step times, arrivals

TEST(DetectorsTest, StepTimesKeepTheLastTwentyAndTheirMedian) {
  StepTimes t;
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.MedianSeconds(), 0);
  for (double s : {3.0, 1.0, 2.0}) t.Add(s);
  EXPECT_EQ(t.MedianSeconds(), 2.0);
  for (int i = 0; i < 20; ++i) t.Add(10.0);  // the first three fall out
  EXPECT_EQ(t.MedianSeconds(), 10.0);
}

TEST(DetectorsTest, ArrivalSpreadsAreRecordedWhenEveryMemberArrivedOnTheBaseline) {
  ArrivalTracker a;
  a.Record(0, 5, At(0), 3, true);
  a.Record(1, 5, At(40), 3, true);
  EXPECT_EQ(a.step(), 5);
  EXPECT_EQ(a.arrivals().size(), 2u);
  EXPECT_TRUE(a.spreads_ms().empty()) << "not every member arrived";
  a.Record(1, 5, At(90), 3, true);  // once each
  a.Record(0, 4, At(95), 3, true);  // an older step is ignored
  EXPECT_EQ(a.arrivals().size(), 2u);
  a.Record(2, 5, At(100), 3, true);
  ASSERT_EQ(a.spreads_ms().size(), 1u);
  EXPECT_EQ(a.spreads_ms().front(), 100.0);
  // a new step starts over; off the baseline, not recorded
  a.Record(0, 6, At(200), 1, /*baseline=*/false);
  EXPECT_EQ(a.step(), 6);
  EXPECT_EQ(a.arrivals().size(), 1u);
  EXPECT_EQ(a.spreads_ms().size(), 1u);
  for (int s = 7; s < 50; ++s) a.Record(0, s, At(300), 1, true);
  EXPECT_EQ(a.spreads_ms().size(), 32u) << "the recent 32";
  a.Reset();
  EXPECT_EQ(a.step(), -1);
  EXPECT_TRUE(a.arrivals().empty());
  EXPECT_TRUE(a.spreads_ms().empty());
}

// ---------------------------------------------------------------- hang detector

TEST(DetectorsTest, HangDetector) {
  struct Case {
    std::string name;
    int spreads = 5;           // recent complete steps (each a spread of 50 ms)
    std::vector<int> arrived;  // members at the collective of step 10, arriving at 0 ms
    int64_t now_ms = 0;
    double median_step_seconds = 0;
    int64_t member1_last_step = 9;
    WorkerRole member1_role = WorkerRole::kMember;
    std::string member1_section;  // a section its script marked busy, begun at 0 ms for 1 s
    std::optional<Finding> want;
  };
  // Threshold: max(busy timeout 500, 8 × the spread of 50 = 400, 8 × the median step).
  const std::string kHung1 =
      "has not reached the collective of step 10 while the others waited 501 ms (its heartbeats "
      "flow: a training thread deadlocked or spinning; the busy timeout is 500 ms, "
      "--busy-timeout-ms; a long section on some ranks only, such as an evaluation or a "
      "save on rank 0, goes inside `with session.busy(\"eval\")`)";
  const Case kCases[] = {
      {.name = "LagPastTheBusyTimeout",
       .arrived = {0, 2},
       .now_ms = 501,
       .want = Finding{1, kHangDetector, kHung1}},
      {.name = "LagAtTheBusyTimeout", .arrived = {0, 2}, .now_ms = 500},
      // Without a normal spread yet (the job's first steps) the busy timeout alone decides.
      {.name = "NoNormalYet",
       .spreads = 0,
       .arrived = {0, 2},
       .now_ms = 501,
       .want = Finding{1, kHangDetector, kHung1}},
      {.name = "EveryoneArrived", .arrived = {0, 1, 2}, .now_ms = 10'000},
      // Slow steps raise the threshold: 8 steps of 0.1 s.
      {.name = "SlowStepsRaiseTheBound",
       .arrived = {0, 2},
       .now_ms = 800,
       .median_step_seconds = 0.1},
      // It completed the step already (its heartbeat is behind): not hung.
      {.name = "AlreadyPastTheStep", .arrived = {0, 2}, .now_ms = 10'000, .member1_last_step = 10},
      {.name = "OnlyMembersAreBlamed",
       .arrived = {0, 2},
       .now_ms = 10'000,
       .member1_role = WorkerRole::kFinished},
      // A section its script marked busy: the wait counts from the section's bound on.
      {.name = "AMarkedSectionIsNotHung",
       .arrived = {0, 2},
       .now_ms = 900,
       .member1_section = "evaluation"},
      {.name = "AMarkedSectionJustPastItsBound",
       .arrived = {0, 2},
       .now_ms = 1'400,
       .member1_section = "evaluation"},
      {.name = "AMarkedSectionABusyTimeoutPastItsBound",
       .arrived = {0, 2},
       .now_ms = 1'501,
       .member1_section = "evaluation",
       .want = Finding{1, kHangDetector,
                       "has not reached the collective of step 10 while the others waited 501 "
                       "ms (its heartbeats flow: a training thread deadlocked or spinning; the "
                       "busy timeout is 500 ms, --busy-timeout-ms; a long section on some ranks "
                       "only, such as an evaluation or a "
                       "save on rank 0, goes inside `with session.busy(\"eval\")`)"}},
      {.name = "TheFirstByRank",
       .arrived = {2},
       .now_ms = 501,
       .want = Finding{0, kHangDetector,
                       "has not reached the collective of step 10 while the others waited 501 ms "
                       "(its heartbeats flow: a training thread deadlocked or spinning; the busy "
                       "timeout is 500 ms, --busy-timeout-ms; a long section on some ranks only, "
                       "such as an evaluation or a "
                       "save on rank 0, goes inside `with session.busy(\"eval\")`)"}},
  };
  const ControllerOptions options = Thresholds();
  for (const Case& c : kCases) {
    std::vector<WorkerInfo> ws{Worker(0, WorkerRole::kMember, 0, 9),
                               Worker(1, c.member1_role, 0, c.member1_last_step),
                               Worker(2, WorkerRole::kMember, 0, 9)};
    ws[1].busy = c.member1_section;
    ws[1].busy_since = At(0);
    ws[1].busy_bound = Millis(1'000);
    std::vector<WorkerInfo*> members = Pointers(ws);
    ArrivalTracker a;
    for (int s = 0; s < c.spreads; ++s) {
      for (int id = 0; id < 3; ++id) a.Record(id, s, At(id == 2 ? 50 : 0), 3, true);
    }
    for (int id : c.arrived) a.Record(id, 10, At(0), 3, true);
    ProgressView v;
    v.members = &members;
    v.options = &options;
    v.median_step_seconds = c.median_step_seconds;
    ExpectFinding(DetectHang(v, a, At(c.now_ms)), c.want, c.name);
  }
}

// The wait a heartbeat reports counts when the arrivals missed the step
// (the step-progress watchdog's case, now the hang detector's): the member
// still computing is the one waited for.
TEST(DetectorsTest, HangDetectorFromReportedWaits) {
  struct Case {
    std::string name;
    std::vector<int64_t> waiting_ms;  // per member (-1: computing), heard at 0 ms
    WorkerRole role1 = WorkerRole::kMember;
    std::optional<Finding> want;
    int64_t step0 = 7;  // member 0's last completed step (the others': 7)
  };
  const Case kCases[] = {
      {.name = "NobodyWaits", .waiting_ms = {-1, -1, -1}},
      {.name = "WaitAtTheBusyTimeout", .waiting_ms = {500, -1, 500}},
      {.name = "WaitPastTheBusyTimeout",
       .waiting_ms = {501, -1, 100},
       .want = Finding{1, kHangDetector,
                       "has not reached the collective of step 8 while the others waited 501 ms "
                       "(its heartbeats flow: a training thread deadlocked or spinning; the busy "
                       "timeout is 500 ms, --busy-timeout-ms; a long section on some ranks only, "
                       "such as an evaluation or a "
                       "save on rank 0, goes inside `with session.busy(\"eval\")`)"}},
      {.name = "EveryoneWaits", .waiting_ms = {3'000, 3'000, 3'000}},
      // Member 2's wait at step 8 is over (member 0 completed it; member 2's own report is on
      // its way), and member 1 computes step 9: nobody waits for it.
      {.name = "AWaitAtAStepAnotherCompleted", .waiting_ms = {-1, -1, 30'000}, .step0 = 8},
  };
  const ControllerOptions options = Thresholds();
  for (const Case& c : kCases) {
    std::vector<WorkerInfo> ws;
    for (int id = 0; id < 3; ++id) {
      ws.push_back(Worker(id, id == 1 ? c.role1 : WorkerRole::kMember, 0, id == 0 ? c.step0 : 7,
                          c.waiting_ms[static_cast<size_t>(id)]));
    }
    std::vector<WorkerInfo*> members = Pointers(ws);
    ProgressView v;
    v.members = &members;
    v.options = &options;
    v.highest_step = 7;
    ArrivalTracker none;
    ExpectFinding(DetectHang(v, none, At(0)), c.want, c.name);
  }
}

TEST(DetectorsTest, WaitingForNamesTheRankAndItsSection) {
  Lag lag{3, 0, 12'400, "evaluation"};
  EXPECT_EQ(WaitingText(lag),
            "the others have waited 12 s for rank 0 (worker 3), busy in 'evaluation'");
  nlohmann::json j = WaitingJson(lag);
  EXPECT_EQ(j["rank"], 0);
  EXPECT_EQ(j["waited_ms"], 12'400);
  lag.waited_ms = kShowWaitAfterMs - 1;
  EXPECT_TRUE(WaitingJson(lag).is_null()) << "a step's normal skew is not shown";
}

// ---------------------------------------------------------------- stall watchdog

TEST(DetectorsTest, StallWatchdog) {
  struct Case {
    std::string name;
    int members = 2;
    bool finished = false;
    bool have_step_times = true;
    bool recovery_open = false;
    double median_step_seconds = 5.0;
    int64_t silent_ms = 0;  // since the last progress
    std::optional<Finding> want;
  };
  const Case kCases[] = {
      {.name = "ProgressWithinTheBound", .silent_ms = 30'000},
      {.name = "PastTheFloor",
       .median_step_seconds = 1.0,
       .silent_ms = 30'001,
       .want = Finding{-1, kStallWatchdog,
                       "no step completed for 30001 ms (stall watchdog: the bound is 30000 ms; the "
                       "last completed "
                       "step was 41)"}},
      // 10 × a median step of 5 s.
      {.name = "SlowStepsRaiseTheBound", .silent_ms = 50'000},
      {.name = "PastTenSteps",
       .silent_ms = 50'001,
       .want = Finding{-1, kStallWatchdog,
                       "no step completed for 50001 ms (stall watchdog: the bound is 50000 ms; the "
                       "last completed "
                       "step was 41)"}},
      // Before the first step, and while a recovery moves state, the forming timeout bounds it.
      {.name = "BeforeTheFirstStep", .have_step_times = false, .silent_ms = 300'000},
      {.name = "WhileARecoveryMovesState", .recovery_open = true, .silent_ms = 300'000},
      {.name = "PastTheFormingTimeout",
       .recovery_open = true,
       .silent_ms = 300'001,
       .want = Finding{-1, kStallWatchdog,
                       "no step completed for 300001 ms (stall watchdog: the bound is 300000 ms; "
                       "the last completed "
                       "step was 41)"}},
      {.name = "NoMembers", .members = 0, .silent_ms = 1'000'000},
      {.name = "TheJobIsEnding", .finished = true, .silent_ms = 1'000'000},
  };
  const ControllerOptions options = Thresholds();
  for (const Case& c : kCases) {
    std::vector<WorkerInfo> ws;
    for (int id = 0; id < c.members; ++id) {
      ws.push_back(Worker(id, c.finished && id == 0 ? WorkerRole::kFinished : WorkerRole::kMember));
    }
    std::vector<WorkerInfo*> members = Pointers(ws);
    ProgressView v;
    v.members = &members;
    v.options = &options;
    v.recovery_open = c.recovery_open;
    v.median_step_seconds = c.median_step_seconds;
    v.have_step_times = c.have_step_times;
    v.progress_at = At(0);
    v.highest_step = 41;
    ExpectFinding(DetectStall(v, At(c.silent_ms)), c.want, c.name);
  }
}

// A member still in the script's code is busy, not stuck: the stall bound is
// then at least the busy timeout; a collective every member waits in is
// stuck at the stall floor; a marked section holds the watchdog off, and the
// time counts from its end (or its bound).
TEST(DetectorsTest, StallWatchdogWaitsTheBusyTimeoutForAComputingMember) {
  ControllerOptions options = Thresholds();
  options.busy_timeout = Millis(60'000);
  struct Case {
    std::string name;
    int64_t waiting_ms;   // every member's (-1: computing)
    std::string section;  // member 0's marked section, begun at 0 ms for 100 s
    int64_t silent_ms;
    bool fires;
    int64_t ended_ms = 0;  // when member 0's last section ended (0: never had one)
    int64_t heard_ms = 0;  // when member 0 said it waits (waiting_ms before then)
  };
  const Case kCases[] = {
      {"ComputingWithinTheBusyTimeout", -1, "", 59'000, false},
      {"ComputingPastTheBusyTimeout", -1, "", 60'001, true},
      {"EveryoneWaitsPastTheStallFloor", 100, "", 30'001, true},
      {"AMarkedSection", -1, "evaluation", 99'000, false},
      // Past its bound, the time counts from the bound on.
      {"AMarkedSectionJustPastItsBound", -1, "evaluation", 100'001, false},
      {"AMarkedSectionABusyTimeoutPastItsBound", -1, "evaluation", 160'001, true},
      // A section of 90 s that ended: the time counts from its end.
      {"AfterASectionEnded", -1, "", 150'000, false, 90'000},
      {"ABusyTimeoutAfterASectionEnded", -1, "", 150'001, true, 90'000},
      // Member 0 computed (a save) for 29.9 s, then joined the others' collective: every member
      // waits, stuck only from its arrival on, a stall floor (30 s) later.
      {"TheLastToArriveComputedUntilThen", 100, "", 59'900, false, 0, 30'000},
      {"AStallFloorAfterTheLastArrived", 100, "", 59'901, true, 0, 30'000},
  };
  for (const Case& c : kCases) {
    std::vector<WorkerInfo> ws{Worker(0, WorkerRole::kMember, c.heard_ms, 41, c.waiting_ms),
                               Worker(1, WorkerRole::kMember, 0, 41, c.waiting_ms)};
    ws[0].busy = c.section;
    ws[0].busy_since = At(0);
    ws[0].busy_bound = Millis(100'000);
    if (c.ended_ms > 0) ws[0].busy_ended = At(c.ended_ms);
    std::vector<WorkerInfo*> members = Pointers(ws);
    ProgressView v;
    v.members = &members;
    v.options = &options;
    v.median_step_seconds = 1.0;
    v.have_step_times = true;
    v.progress_at = At(0);
    v.highest_step = 41;
    EXPECT_EQ(DetectStall(v, At(c.silent_ms)).has_value(), c.fires) << c.name;
  }
}

}  // namespace
}  // namespace nonstop::controller
