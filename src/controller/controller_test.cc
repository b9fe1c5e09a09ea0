#include "controller/controller.h"

#include <gtest/gtest.h>

namespace nonstop::controller {
namespace {

class ControllerTest : public ::testing::Test {
 protected:
  Clock::time_point now_ = Clock::time_point() + std::chrono::hours(1);
  Controller c_{ControllerOptions{3, 1, Millis(1000)}};

  std::vector<Action> Do(Event e) { return c_.Handle(e, now_); }
  std::vector<Action> Join(int id, bool spare = false) {
    return Do(WorkerJoined{{id, 1000 + id, "127.0.0.1:" + std::to_string(5000 + id), spare}});
  }
  template <typename T>
  static std::vector<T> Find(const std::vector<Action>& actions) {
    std::vector<T> out;
    for (const auto& a : actions) {
      if (const T* t = std::get_if<T>(&a)) out.push_back(*t);
    }
    return out;
  }
  void StartJob() {
    Join(3, true);
    Join(2);
    Join(0);
    Join(1);
    ASSERT_EQ(c_.phase(), JobPhase::kRunning);
  }
};

TEST_F(ControllerTest, FirstGenerationFormsWhenAllMembersJoinedRanksByWorkerId) {
  EXPECT_TRUE(Find<SendPlan>(Join(2)).empty());
  EXPECT_TRUE(Find<SendPlan>(Join(4, /*spare=*/true)).empty());
  EXPECT_TRUE(Find<SendPlan>(Join(0)).empty());
  auto plans = Find<SendPlan>(Join(1));
  ASSERT_EQ(plans.size(), 3u) << "one plan per member, none to the spare";
  for (const auto& p : plans) {
    EXPECT_EQ(p.plan.generation, 1u);
    ASSERT_EQ(p.plan.members.size(), 3u);
    EXPECT_EQ(p.plan.members[0].worker_id, 0);
    EXPECT_EQ(p.plan.members[2].worker_id, 2);
    EXPECT_NE(p.worker_id, 4);
  }
  EXPECT_EQ(c_.RankOf(2), 2);
  EXPECT_EQ(c_.RankOf(4), -1);
}

TEST_F(ControllerTest, KilledMemberEndsJobNamingTheRank) {
  StartJob();
  Do(ProgressReceived{2, {17, 2.0, 0.1, 100, 3}});
  auto actions = Do(ProcessExited{2, 1002, -1, 9});
  auto ends = Find<EndJob>(actions);
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitPeerFailure);
  EXPECT_NE(ends[0].reason.find("rank 2"), std::string::npos) << ends[0].reason;
  EXPECT_NE(ends[0].reason.find("signal 9"), std::string::npos) << ends[0].reason;
  EXPECT_NE(ends[0].reason.find("17"), std::string::npos) << ends[0].reason;
  EXPECT_EQ(Find<KillWorker>(actions).size(), 3u) << "the other two members and the spare";
  EXPECT_EQ(c_.phase(), JobPhase::kEnded);
}

TEST_F(ControllerTest, SilentMemberIsDetectedByHeartbeatTimeout) {
  StartJob();
  now_ += Millis(600);
  Do(HeartbeatReceived{0, {1}});
  Do(HeartbeatReceived{2, {1}});
  EXPECT_TRUE(Find<EndJob>(Do(Tick{})).empty());
  now_ += Millis(600);  // worker 1 silent for 1.2 s > 1 s
  Do(HeartbeatReceived{0, {2}});
  Do(HeartbeatReceived{2, {2}});
  auto ends = Find<EndJob>(Do(Tick{}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_NE(ends[0].reason.find("rank 1"), std::string::npos) << ends[0].reason;
  EXPECT_NE(ends[0].reason.find("heartbeat"), std::string::npos) << ends[0].reason;
}

TEST_F(ControllerTest, LostConnectionWaitsBrieflyForTheExitThatExplainsIt) {
  StartJob();
  EXPECT_TRUE(Find<EndJob>(Do(ConnectionLost{1, "connection closed by peer"})).empty());
  now_ += Millis(10);
  auto ends = Find<EndJob>(Do(ProcessExited{1, 1001, -1, 9}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_NE(ends[0].reason.find("signal 9"), std::string::npos) << ends[0].reason;
}

TEST_F(ControllerTest, LostConnectionWithoutExitIsAFaultAfterTheGrace) {
  StartJob();
  Do(ConnectionLost{1, "connection reset"});
  now_ += Millis(50);
  EXPECT_TRUE(Find<EndJob>(Do(Tick{})).empty());
  now_ += Millis(60);
  auto ends = Find<EndJob>(Do(Tick{}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_NE(ends[0].reason.find("connection reset"), std::string::npos) << ends[0].reason;
}

TEST_F(ControllerTest, DeadSpareDoesNotEndTheJob) {
  StartJob();
  EXPECT_TRUE(Find<EndJob>(Do(ProcessExited{3, 1003, -1, 9})).empty());
  EXPECT_EQ(c_.phase(), JobPhase::kRunning);
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
  // Processes exiting afterwards change nothing.
  EXPECT_TRUE(Do(ProcessExited{0, 1000, 0, 0}).empty());
}

TEST_F(ControllerTest, DivergentChecksumsAreDataCorruption) {
  StartJob();
  Do(FinishedReceived{0, {100, "abcd"}});
  auto ends = Find<EndJob>(Do(FinishedReceived{1, {100, "ffff"}}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0].exit_code, kExitDataCorruption);
}

TEST_F(ControllerTest, DuplicateWorkerIdIsRefused) {
  Join(0);
  auto actions = Join(0);
  EXPECT_EQ(Find<SendShutdown>(actions).size(), 1u);
  EXPECT_EQ(c_.phase(), JobPhase::kForming);
}

TEST_F(ControllerTest, WorkerDyingBeforeJoinFailsTheForming) {
  Join(0);
  auto ends = Find<EndJob>(Do(ProcessExited{1, 1001, 127, 0}));
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_NE(ends[0].reason.find("before joining"), std::string::npos);
}

}  // namespace
}  // namespace nonstop::controller
