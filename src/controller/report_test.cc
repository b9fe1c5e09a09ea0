// The recovery record's time lost (report.cc, docs/recovery.md "Time lost"):
// the step across a fault less the job's normal pace, split along the
// phases so that the parts sum to it.
#include "controller/report.h"

#include <gtest/gtest.h>

#include <string>

namespace nonstop::controller {
namespace {

using std::chrono::milliseconds;

// A recovery of step 30 (step 29 the last completed), with a normal step of 2000 ms: step 30
// began at t0, the kill came 1400 ms into it.
RecoveryRecord Killed(Clock::time_point t0) {
  RecoveryRecord r;
  r.id = 1;
  r.causes = {"worker 2 (rank 2) killed by signal 9"};
  r.injected = "kill:rank=2,step=30";
  r.normal_step_seconds = 2.0;
  r.step_began_at = t0;
  r.step_before = 29;
  r.resume_step = 30;
  r.fault_at = t0 + milliseconds(1400);
  r.detected_at = t0 + milliseconds(1410);
  r.aborted_at = t0 + milliseconds(1450);
  r.plan_at = t0 + milliseconds(1451);
  r.state_ready_at = t0 + milliseconds(1480);
  r.outcome = "completed";
  return r;
}

TEST(ReportTest, TimeLostIsTheStepAcrossTheFaultLessANormalStepSplitAlongThePhases) {
  const Clock::time_point t0 = Clock::now();
  RecoveryRecord r = Killed(t0);
  r.first_step_at = t0 + milliseconds(3480);  // the step computed again whole: 2000 ms
  auto j = RecordJson(r);
  ASSERT_TRUE(j["time_lost"].is_object()) << j.dump(2);
  EXPECT_NEAR(j["time_lost_ms"].get<double>(), 1480, 1e-6);
  EXPECT_NEAR(j["time_lost"]["normal_steps"].get<double>(), 0.74, 1e-9);
  const auto& s = j["time_lost"]["split_ms"];
  EXPECT_NEAR(s["in_flight"].get<double>(), 1400, 1e-6);
  EXPECT_NEAR(s["detect"].get<double>(), 10, 1e-6);
  EXPECT_NEAR(s["abort"].get<double>(), 40, 1e-6);
  EXPECT_NEAR(s["plan"].get<double>(), 1, 1e-6);
  EXPECT_NEAR(s["state_copy"].get<double>(), 29, 1e-6);
  EXPECT_NEAR(s["resumed_step_vs_normal"].get<double>(), 0, 1e-6);
  EXPECT_NEAR(s["redone_steps"].get<double>(), 0, 1e-6);
  // The old figure, which subtracts a whole step from fault → first step: it reads 80 ms here.
  EXPECT_NEAR(j["downtime_ms"].get<double>(), 80, 1e-6);
}

TEST(ReportTest, ASalvagedStepShowsAsAResumedStepShorterThanANormalOne) {
  const Clock::time_point t0 = Clock::now();
  RecoveryRecord r = Killed(t0);
  r.first_step_at = t0 + milliseconds(1480 + 600);  // only the lost rank's share computed again
  auto j = RecordJson(r);
  EXPECT_NEAR(j["time_lost_ms"].get<double>(), 80, 1e-6);
  EXPECT_NEAR(j["time_lost"]["split_ms"]["resumed_step_vs_normal"].get<double>(), -1400, 1e-6);
  EXPECT_NEAR(j["downtime_ms"].get<double>(), 0, 1e-6) << "the old figure clips at zero";
  std::string text;
  for (const auto& l : ReportLines({r})) text += l + "\n";
  EXPECT_NE(text.find("state copy 29, the resumed step 1400 ms shorter than a normal one"),
            std::string::npos)
      << text;
  r.first_step_at = t0 + milliseconds(1480 + 2250);  // a slow resumed step
  text.clear();
  for (const auto& l : ReportLines({r})) text += l + "\n";
  EXPECT_NE(text.find("the resumed step 250 ms longer than a normal one"), std::string::npos)
      << text;
}

TEST(ReportTest, CompletedStepsComputedAgainCountAtTheNormalPace) {
  const Clock::time_point t0 = Clock::now();
  RecoveryRecord r = Killed(t0);
  r.restarted = true;
  r.resume_step = 26;  // a checkpoint at step 25: steps 26..29 are computed again, then 30
  r.first_step_at = t0 + milliseconds(3480);
  auto j = RecordJson(r);
  EXPECT_NEAR(j["time_lost"]["split_ms"]["redone_steps"].get<double>(), 4 * 2000, 1e-6);
  EXPECT_NEAR(j["time_lost_ms"].get<double>(), 1480 + 8000, 1e-6);
}

TEST(ReportTest, AMissingPhaseTakesNoTimeAndAnUnknownFaultTimeIsItsDetection) {
  const Clock::time_point t0 = Clock::now();
  RecoveryRecord r = Killed(t0);
  r.fault_at.reset();
  r.aborted_at.reset();
  r.first_step_at = t0 + milliseconds(3480);
  auto j = RecordJson(r);
  const auto& s = j["time_lost"]["split_ms"];
  EXPECT_NEAR(s["in_flight"].get<double>(), 1410, 1e-6);
  EXPECT_NEAR(s["detect"].get<double>(), 0, 1e-6);
  EXPECT_NEAR(s["abort"].get<double>(), 0, 1e-6);
  EXPECT_NEAR(s["plan"].get<double>(), 41, 1e-6);
  EXPECT_NEAR(j["time_lost_ms"].get<double>(), 1480, 1e-6);
}

TEST(ReportTest, AnUnfinishedRecoveryHasNoTimeLostAndTheReportSaysWhy) {
  const Clock::time_point t0 = Clock::now();
  RecoveryRecord open = Killed(t0);
  open.outcome = "superseded by recovery 2";
  RecoveryRecord done = Killed(t0);
  done.id = 2;
  done.first_step_at = t0 + milliseconds(3480);
  EXPECT_TRUE(RecordJson(open)["time_lost"].is_null());
  EXPECT_FALSE(RecordJson(open).contains("time_lost_ms"));
  auto lines = ReportLines({open, done});
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  EXPECT_NE(lines.front().find("time lost 1.48 s (0.74 of a normal step)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("time lost: counted in the recovery that superseded it"), std::string::npos)
      << text;
  EXPECT_NE(text.find("time lost 1480 ms, 0.74 of a normal step (2000 ms): the step in flight had "
                      "run 1400 ms, detection 10, abort 40, plan 1, state copy 29, the resumed "
                      "step as long as a normal one"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace nonstop::controller
