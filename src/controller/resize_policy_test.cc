// The resize policy by tables: a view of the job at `now`, and exactly the
// decision it must get (the size, the refusal and its text, the grow gather).
#include "controller/resize_policy.h"

#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace nonstop::controller {
namespace {

using nlohmann::json;

const Clock::time_point kT0 = Clock::time_point() + std::chrono::hours(1);
Clock::time_point At(int64_t ms) { return kT0 + Millis(ms); }

ScalePolicy Policy(int min_world, int max_world, Millis stable = Millis(0),
                   std::vector<int> allowed = {}) {
  ScalePolicy p;
  p.min_world = min_world;
  p.max_world = max_world;
  p.allowed_sizes = std::move(allowed);
  p.stable_period = stable;
  return p;
}

// Changes at these times (ms), the last one the latest.
ResizeHistory Changes(std::vector<int64_t> at_ms) {
  ResizeHistory h;
  for (int64_t t : at_ms) h.Changed(At(t));
  return h;
}

TEST(ResizePolicyTest, SizePolicyResolvesTheMaximumToTheInitialWorld) {
  ScalePolicy p = Policy(2, 0, Millis(0), {2, 4});
  p.increment = 3;
  PlanPolicy got = SizePolicy(p, 6);
  EXPECT_EQ(got.min_world, 2);
  EXPECT_EQ(got.max_world, 6);
  EXPECT_EQ(got.allowed_sizes, (std::vector<int>{2, 4}));
  EXPECT_EQ(got.increment, 3);
  EXPECT_EQ(SizePolicy(Policy(1, 9), 6).max_world, 9);
}

TEST(ResizePolicyTest, TheStablePeriodBacksOffWhenChangesComeTooOften) {
  struct Case {
    std::string name;
    std::vector<int64_t> changes_ms;
    int64_t want_ms;
  };
  // stable 1 s; more than 3 changes within the last 60 s double it per extra change, up to 8×.
  const Case kCases[] = {
      {"NoChange", {}, 1'000},
      {"ThreeRecent", {-3'000, -2'000, -1'000}, 1'000},
      {"FourRecent", {-4'000, -3'000, -2'000, -1'000}, 2'000},
      {"FiveRecent", {-5'000, -4'000, -3'000, -2'000, -1'000}, 4'000},
      {"SevenRecentCapAtEight", {-7'000, -6'000, -5'000, -4'000, -3'000, -2'000, -1'000}, 8'000},
      {"OldOnesDoNotCount", {-90'000, -80'000, -70'000, -60'000, -2'000, -1'000}, 1'000},
  };
  ScalePolicy p = Policy(1, 8, Millis(1'000));
  p.backoff_changes = 3;
  p.backoff_window = Millis(60'000);
  for (const Case& c : kCases) {
    EXPECT_EQ(EffectiveStablePeriod(p, Changes(c.changes_ms), At(0)).count(), c.want_ms) << c.name;
  }
}

TEST(ResizePolicyTest, PolicyJsonShowsTheResolvedMaximumAndTheEffectivePeriod) {
  json j = ScalePolicyJson(Policy(2, 0, Millis(500), {2, 4}), 4, Millis(2'000));
  EXPECT_EQ(
      j.dump(),
      R"({"allowed_sizes":[2,4],"backoff_changes":3,"backoff_window_ms":60000,"effective_stable_period_ms":2000,)"
      R"("increment":1,"max_world":4,"min_world":2,"stable_period_ms":500})");
}

TEST(ResizePolicyTest, ScaleRequests) {
  struct Case {
    std::string name;
    json body;
    JobPhase phase = JobPhase::kRunning;
    int finished = 0;
    int shard_group = 0;
    std::vector<int64_t> changes_ms;  // before now (0)
    int want_status = 202;
    std::string want_error;
    int want_target = -1;
  };
  const std::string kShape = R"(expected {"world_size": N}, {"release": N} or {"grow": N})";
  const std::string kOne =
      R"(expected exactly one of world_size, release or grow, with a positive integer up to 1048576)";
  const std::string kPolicy =
      R"( ({"allowed_sizes":[],"backoff_changes":3,"backoff_window_ms":60000,"effective_stable_period_ms":1000,)"
      R"("increment":1,"max_world":8,"min_world":2,"stable_period_ms":1000}))";
  const Case kCases[] = {
      {.name = "WorldSize", .body = {{"world_size", 6}}, .want_target = 6},
      {.name = "Release", .body = {{"release", 2}}, .want_target = 2},
      {.name = "Grow", .body = {{"grow", 3}}, .want_target = 7},
      {.name = "SameSizeIsAccepted", .body = {{"world_size", 4}}, .want_target = 4},
      {.name = "NotAnObject", .body = json::array({1}), .want_status = 400, .want_error = kShape},
      {.name = "UnknownKey", .body = {{"size", 3}}, .want_status = 400, .want_error = kShape},
      {.name = "TwoKeys",
       .body = {{"world_size", 3}, {"grow", 1}},
       .want_status = 400,
       .want_error = kOne},
      {.name = "NotAnInteger",
       .body = {{"world_size", "3"}},
       .want_status = 400,
       .want_error = kOne},
      {.name = "Zero", .body = {{"grow", 0}}, .want_status = 400, .want_error = kOne},
      {.name = "Negative", .body = {{"release", -1}}, .want_status = 400, .want_error = kOne},
      // Bounded before any arithmetic: no overflow.
      {.name = "HugeGrow", .body = {{"grow", 2147483647}}, .want_status = 400, .want_error = kOne},
      {.name = "HugeUnsigned",
       .body = {{"world_size", uint64_t{1} << 63}},
       .want_status = 400,
       .want_error = kOne},
      {.name = "WhileForming",
       .body = {{"world_size", 6}},
       .phase = JobPhase::kForming,
       .want_status = 409,
       .want_error = "a membership change is in progress (the job is forming); retry shortly"},
      {.name = "WhileRecovering",
       .body = {{"world_size", 6}},
       .phase = JobPhase::kRecovering,
       .want_status = 409,
       .want_error = "a membership change is in progress (the job is recovering); retry shortly"},
      {.name = "WhileFinishing",
       .body = {{"world_size", 6}},
       .finished = 1,
       .want_status = 409,
       .want_error = "the job is finishing"},
      {.name = "AboveTheMaximum",
       .body = {{"grow", 5}},
       .want_status = 422,
       .want_error = "world size 9 is above the maximum 8" + kPolicy},
      {.name = "ReleaseBelowTheMinimum",
       .body = {{"release", 3}},
       .want_status = 422,
       .want_error = "world size 1 is below the minimum 2" + kPolicy},
      {.name = "NotWholeShardGroups",
       .body = {{"world_size", 5}},
       .shard_group = 2,
       .want_status = 422,
       .want_error = "world size 5 is not a multiple of optimizer.shard_group 2" + kPolicy},
      {.name = "TooSoon",
       .body = {{"world_size", 6}},
       .changes_ms = {-400},
       .want_status = 429,
       .want_error = "too soon: the last change was 0.4 s ago and the stable period is 1.0 s"},
      {.name = "TooSoonBackedOff",
       .body = {{"world_size", 6}},
       .changes_ms = {-9'000, -7'000, -5'000, -3'000, -1'500},
       .want_status = 429,
       .want_error = "too soon: the last change was 1.5 s ago and the stable period is 4.0 s "
                     "(backed off: changes "
                     "came too often)"},
      {.name = "AfterTheStablePeriod",
       .body = {{"world_size", 6}},
       .changes_ms = {-1'000},
       .want_target = 6},
  };
  const ScalePolicy policy = Policy(2, 8, Millis(1'000));
  for (const Case& c : kCases) {
    ScaleView v;
    v.phase = c.phase;
    v.world = 4;
    v.finished = c.finished;
    v.shard_group = c.shard_group;
    v.initial_world = 4;
    ScaleDecision d = DecideScaleRequest(c.body, v, policy, Changes(c.changes_ms), At(0));
    EXPECT_EQ(d.http_status, c.want_status) << c.name;
    EXPECT_EQ(d.error, c.want_error) << c.name;
    EXPECT_EQ(d.target, c.want_target) << c.name;
  }
}

TEST(ResizePolicyTest, GrowingIntoSpares) {
  struct Case {
    std::string name;
    int world = 4, spares = 2, target = 6;
    bool adoption_pending = false;
    JobPhase phase = JobPhase::kRunning;
    int finished = 0;
    std::vector<int64_t> changes_ms;
    std::optional<int64_t> gathering_since_ms;
    std::vector<int> allowed;
    int want_to = 0;
    std::optional<int64_t> want_gather_since_ms;
  };
  // Grow gather 3 s; stable period 1 s; the policy allows up to 8.
  const Case kCases[] = {
      {.name = "EnoughSparesForTheTarget", .want_to = 6},
      {.name = "MoreSparesThanNeeded", .spares = 5, .want_to = 6},
      {.name = "AtTheTarget", .target = 4},
      {.name = "NoSpares", .spares = 0},
      {.name = "TakeoverAdoptionFirst", .adoption_pending = true},
      {.name = "Recovering", .phase = JobPhase::kRecovering},
      {.name = "Finishing", .finished = 1},
      {.name = "WithinTheStablePeriod", .changes_ms = {-500}},
      {.name = "AfterTheStablePeriod", .changes_ms = {-1'000}, .want_to = 6},
      // Short of the target: the gather starts now and waits.
      {.name = "ShortStartsTheGather", .spares = 1, .want_gather_since_ms = 0},
      {.name = "ShortStillGathering",
       .spares = 1,
       .gathering_since_ms = -2'999,
       .want_gather_since_ms = -2'999},
      {.name = "ShortGatherOver", .spares = 1, .gathering_since_ms = -3'000, .want_to = 5},
      // The largest allowed size within reach: 5 is not allowed, 4 is the world already.
      {.name = "NoAllowedSizeWithinReach",
       .spares = 1,
       .gathering_since_ms = -3'000,
       .allowed = {2, 4, 6, 8}},
      {.name = "LargestAllowedWithinReach",
       .spares = 3,
       .target = 8,
       .gathering_since_ms = -5'000,
       .allowed = {2, 4, 6, 8},
       .want_to = 6},
      // A gather in progress is kept when the job is not ready to grow.
      {.name = "GatherKeptWhileRecovering",
       .phase = JobPhase::kRecovering,
       .gathering_since_ms = -100,
       .want_gather_since_ms = -100},
  };
  for (const Case& c : kCases) {
    ScalePolicy policy = Policy(1, 8, Millis(1'000), c.allowed);
    ResizeHistory history = Changes(c.changes_ms);
    if (c.gathering_since_ms) history.grow_waiting_since = At(*c.gathering_since_ms);
    GrowView v;
    v.adoption_pending = c.adoption_pending;
    v.phase = c.phase;
    v.finished = c.finished;
    v.world = c.world;
    v.spares = c.spares;
    v.target_world = c.target;
    v.initial_world = 4;
    v.grow_gather = Millis(3'000);
    GrowDecision d = DecideGrow(v, policy, history, At(0));
    EXPECT_EQ(d.to, c.want_to) << c.name;
    EXPECT_EQ(d.trigger, c.want_to > 0
                             ? "grow: " + std::to_string(c.spares) + " spare worker(s) available"
                             : "")
        << c.name;
    EXPECT_EQ(d.gather_since.has_value(), c.want_gather_since_ms.has_value()) << c.name;
    if (d.gather_since && c.want_gather_since_ms) {
      EXPECT_EQ(*d.gather_since, At(*c.want_gather_since_ms)) << c.name;
    }
  }
}

TEST(ResizePolicyTest, TheWorldWithoutLeavingHosts) {
  struct Case {
    std::string name;
    int world, leaving, spares;
    PlanPolicy policy;
    int shard_group;
    int want;
  };
  const PlanPolicy any{1, 8, {}, 1};
  const PlanPolicy min4{4, 8, {}, 1};
  const PlanPolicy even{2, 8, {2, 4, 6, 8}, 1};
  const Case kCases[] = {
      {"ShrinksByTheLeaving", 6, 2, 0, any, 0, 4},
      {"SparesNotNeededWhenSmallerIsAllowed", 6, 2, 5, any, 0, 4},
      {"SparesFillUpToTheMinimum", 6, 3, 1, min4, 0, 4},
      {"TooFewSparesForTheMinimum", 6, 3, 0, min4, 0, -1},
      {"TheNextAllowedSize", 6, 1, 1, even, 0, 6},
      {"WholeShardGroups", 6, 1, 0, any, 2, -1},
      {"WholeShardGroupsWithASpare", 6, 1, 1, any, 2, 6},
      {"EveryMemberLeaves", 2, 2, 0, any, 0, -1},
      {"EveryMemberLeavesASpareTakesOver", 2, 2, 1, any, 0, 1},
  };
  for (const Case& c : kCases) {
    EXPECT_EQ(WorldWithoutLeaving(c.world, c.leaving, c.spares, c.policy, c.shard_group), c.want)
        << c.name;
  }
}

}  // namespace
}  // namespace nonstop::controller
