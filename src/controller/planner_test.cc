// The planner by tables: a view of generation g, and exactly the generation
// g+1 (or the verdict) it must get. Every field of the result is compared.
#include "controller/planner.h"

#include <tuple>

#include <gtest/gtest.h>

#include "nonstop/state.h"

namespace nonstop::controller {
namespace {

using Verdict = NextGeneration::Verdict;
using Member = PlanInput::Member;
using Spare = PlanInput::Spare;

// A member that answered the abort holding `step` (and, sharded, `shard`).
Member Held(int id, int64_t step, std::string host = "", int shard = state::kEveryShard) {
  return Member{id, std::move(host), /*alive=*/true, /*ready=*/true, step, shard};
}
// A member lost in this recovery.
Member Lost(int id, std::string host = "") {
  return Member{id, std::move(host), /*alive=*/false, /*ready=*/false, -1, state::kEveryShard};
}
// Members 0 … n−1, every one holding `step` on `host`.
std::vector<Member> AllHeld(int n, int64_t step, const std::string& host = "") {
  std::vector<Member> out;
  for (int id = 0; id < n; ++id) out.push_back(Held(id, step, host));
  return out;
}

// Members 0 … n−1 holding `step`, sharded in groups of `group`: member r holds shard r mod group.
std::vector<Member> ShardedHeld(int n, int64_t step, int group) {
  std::vector<Member> out;
  for (int id = 0; id < n; ++id) out.push_back(Held(id, step, "", id % group));
  return out;
}

using TransferRow = std::tuple<int, std::vector<int>, int64_t>;  // receiver, sources, had_step
using MoveRow = std::tuple<int, int, std::vector<int>>;          // receiver, shard, sources

struct Expected {
  Verdict verdict = Verdict::kPlan;
  std::string why;
  int64_t s_star = -1;
  std::vector<int> holders;
  std::vector<int> members;
  std::vector<int64_t> had_step;
  std::vector<int> released;
  std::vector<std::string> replacements;
  std::vector<TransferRow> transfers;
  std::vector<MoveRow> shard_moves;
  std::vector<int> lost_shards;
  std::optional<std::string> leaving_kept;
  std::set<std::string> leave_refused_hosts;
  size_t spares_used = 0;
};

struct Case {
  std::string name;
  PlanInput view;
  Expected want;
  PlanPolicy policy{/*min_world=*/1, /*max_world=*/64, /*allowed_sizes=*/{}, /*increment=*/1};
};

const std::string kNoCheckpoint =
    "; without a durable checkpoint (nonstop run --checkpoint-dir) the job cannot continue";

const Case kCases[] = {
    {.name = "OneLostWithASpare",
     .view = {.members = {Held(0, 5), Lost(1), Held(2, 5)}, .spares = {{3, ""}}, .highest_step = 5},
     .want = {.s_star = 5,
              .holders = {0, 2},
              .members = {0, 3, 2},
              .had_step = {5, -1, 5},
              .replacements = {"rank 1: worker 1 → spare worker 3"},
              .transfers = {{3, {0, 2}, -1}},
              .spares_used = 1}},
    {.name = "LostWithoutASpareShrinks",
     .view = {.members = {Held(0, 5), Lost(1), Held(2, 5)}, .highest_step = 5},
     .want = {.s_star = 5,
              .holders = {0, 2},
              .members = {0, 2},
              .had_step = {5, 5},
              .replacements = {"rank 1: worker 1 → none (shrink)"}}},
    {.name = "TwoLostOneSpare",
     .view = {.members = {Held(0, 7), Lost(1), Lost(2), Held(3, 7)},
              .spares = {{9, ""}},
              .highest_step = 7},
     .want = {.s_star = 7,
              .holders = {0, 3},
              .members = {0, 9, 3},
              .had_step = {7, -1, 7},
              .replacements = {"rank 1: worker 1 → spare worker 9",
                               "rank 2: worker 2 → none (shrink)"},
              .transfers = {{9, {0, 3}, -1}},
              .spares_used = 1}},
    {.name = "AMemberOneStepBehindCopies",
     .view = {.members = {Held(0, 4), Held(1, 3), Held(2, 4)}, .highest_step = 4},
     .want = {.s_star = 4,
              .holders = {0, 2},
              .members = {0, 1, 2},
              .had_step = {4, 3, 4},
              .transfers = {{1, {0, 2}, 3}}}},
    {.name = "NobodyHoldsTheStateRestartsFromTheCheckpoint",
     .view = {.members = {Lost(0), Lost(1)},
              .spares = {{5, ""}},
              .highest_step = 9,
              .have_checkpoints = true},
     .want = {.verdict = Verdict::kRestart, .why = "the state of step 9 exists on no live worker"}},
    {.name = "NobodyHoldsTheStateWithoutACheckpointFails",
     .view = {.members = {Lost(0), Lost(1)}, .spares = {{5, ""}}, .highest_step = 9},
     .want =
         {.verdict = Verdict::kFail,
          .why =
              "the state of step 9 exists on no live worker (every member that held it is gone)" +
              kNoCheckpoint}},
    {.name = "ASurvivorWithNoValidStateHoldsNothing",
     .view = {.members = {Held(0, -2), Lost(1)}, .highest_step = 3, .have_checkpoints = true},
     .want = {.verdict = Verdict::kRestart, .why = "the state of step 3 exists on no live worker"}},
    {.name = "TheInitialStateNeedsNoTransfer",
     .view = {.members = {Held(0, -1), Lost(1)}, .spares = {{4, ""}}, .highest_step = -1},
     .want = {.s_star = -1,
              .holders = {0},
              .members = {0, 4},
              .had_step = {-1, -1},
              .replacements = {"rank 1: worker 1 → spare worker 4"},
              .spares_used = 1}},
    {.name = "EveryMemberLostBeforeTheFirstStepSparesTakeOver",
     .view = {.members = {Lost(0), Lost(1)}, .spares = {{5, ""}, {6, ""}}, .highest_step = -1},
     .want = {.s_star = -1,
              .members = {5, 6},
              .had_step = {-1, -1},
              .replacements = {"rank 0: worker 0 → spare worker 5",
                               "rank 1: worker 1 → spare worker 6"},
              .spares_used = 2}},
    {.name = "EveryMemberLostBeforeTheFirstStepWithoutSparesLeavesNone",
     .view = {.members = {Lost(0), Lost(1)}, .highest_step = -1},
     .want = {.verdict = Verdict::kNoneLeft,
              .why = "no worker is left to continue the job",
              .replacements = {"rank 0: worker 0 → none (shrink)",
                               "rank 1: worker 1 → none (shrink)"}}},
    {.name = "SparesOnAHostThatJustFailedArePickedLast",
     .view = {.members = {Held(0, 2, "hA"), Lost(1, "hB")},
              .spares = {{5, "hB"}, {6, "hC"}},
              .failed_hosts = {"hB"},
              .highest_step = 2},
     .want = {.s_star = 2,
              .holders = {0},
              .members = {0, 6},
              .had_step = {2, -1},
              .replacements = {"rank 1: worker 1 → spare worker 6"},
              .transfers = {{6, {0}, -1}},
              .spares_used = 1}},
    {.name = "ShardedEveryReplicaOfAShardHitFails",
     .view = {.members = {Held(0, 5, "", 0), Lost(1), Held(2, 5, "", 0), Lost(3)},
              .spares = {{8, ""}, {9, ""}},
              .shard_group = 2,
              .highest_step = 5},
     .want = {.verdict = Verdict::kFail,
              .why = "every copy of shard 1 of the optimizer state of step 5 is lost "
                     "(optimizer.shard_group 2: every "
                     "replica of it was hit)" +
                     kNoCheckpoint,
              .s_star = 5,
              .lost_shards = {1}}},
    {.name = "ShardedEveryReplicaOfAShardHitRestarts",
     .view = {.members = {Held(0, 5, "", 0), Lost(1), Held(2, 5, "", 0), Lost(3)},
              .shard_group = 2,
              .highest_step = 5,
              .have_checkpoints = true},
     .want = {.verdict = Verdict::kRestart,
              .why = "every copy of shard 1 of the optimizer state of step 5 is lost "
                     "(optimizer.shard_group 2: every "
                     "replica of it was hit)",
              .s_star = 5,
              .lost_shards = {1}}},
    {.name = "ShardedSpareCapKeepsWholeGroups",
     .view = {.members = {Held(0, 5, "", 0), Held(1, 5, "", 1), Lost(2), Lost(3)},
              .spares = {{8, ""}},
              .shard_group = 2,
              .highest_step = 5},
     .want = {.s_star = 5,
              .holders = {0, 1},
              .members = {0, 1},
              .had_step = {5, 5},
              .replacements = {"rank 2: worker 2 → none (shrink)",
                               "rank 3: worker 3 → none (shrink)"}}},
    {.name = "ShardedWholeGroupReleaseSkipsTheLastHolderOfAShard",
     .view = {.members = {Held(0, 5, "", 0), Lost(1), Held(2, 5, "", 0), Held(3, 5, "", 1)},
              .shard_group = 2,
              .highest_step = 5},
     .want = {.s_star = 5,
              .holders = {0, 2, 3},
              .members = {0, 3},
              .had_step = {5, 5},
              .released = {2},
              .replacements =
                  {"rank 1: worker 1 → none (shrink)",
                   "worker 2 released (the world must be a multiple of optimizer.shard_group 2)"}}},
    {.name = "ShardedSparePreferredAwayFromTheReplicasHost",
     .view = {.members = {Held(0, 5, "hA", 0), Held(1, 5, "hA", 1), Held(2, 5, "hB", 0),
                          Lost(3, "hB")},
              .spares = {{8, "hA"}, {9, "hC"}},
              .shard_group = 2,
              .highest_step = 5},
     .want = {.s_star = 5,
              .holders = {0, 2, 1},
              .members = {0, 1, 2, 9},
              .had_step = {5, 5, 5, -1},
              .replacements = {"rank 3: worker 3 → spare worker 9"},
              .transfers = {{9, {0, 2, 1}, -1}},
              .shard_moves = {{9, 1, {1}}},
              .spares_used = 1}},
    // The job's one host (nonstop run's elastic one) holds every copy anyway: no spare is away from
    // the replicas.
    {.name = "ShardedOnOneHostTheFirstSpareIsTaken",
     .view = {.members = {Held(0, 5, "local", 0), Held(1, 5, "local", 1), Held(2, 5, "local", 0),
                          Lost(3, "local")},
              .spares = {{8, "local"}, {9, "local"}},
              .failed_hosts = {"local"},
              .shard_group = 2,
              .highest_step = 5},
     .want = {.s_star = 5,
              .holders = {0, 1, 2},
              .members = {0, 1, 2, 8},
              .had_step = {5, 5, 5, -1},
              .replacements = {"rank 3: worker 3 → spare worker 8"},
              .transfers = {{8, {0, 1, 2}, -1}},
              .shard_moves = {{8, 1, {1}}},
              .spares_used = 1}},
    // Sharded state, the shard moves (docs/sharding.md): rank r holds shard r mod G; every member
    // of g+1 that does not hold its rank's shard of s* fetches it from every member that does, in
    // rank order.
    {.name = "ShardedSpareFetchesTheLostRanksShardStripedOverItsReplicas",
     .view =
         [] {
           PlanInput v{.members = ShardedHeld(6, 9, 2),
                       .spares = {{8, ""}},
                       .shard_group = 2,
                       .highest_step = 9};
           v.members[3] = Lost(3);
           return v;
         }(),
     .want = {.s_star = 9,
              .holders = {0, 1, 2, 4, 5},
              .members = {0, 1, 2, 8, 4, 5},
              .had_step = {9, 9, 9, -1, 9, 9},
              .replacements = {"rank 3: worker 3 → spare worker 8"},
              .transfers = {{8, {0, 1, 2, 4, 5}, -1}},
              .shard_moves = {{8, 1, {1, 5}}},
              .spares_used = 1}},
    {.name = "ShardedShrink6To4ReshardsTheRanksThatMoved",
     .view =
         [] {
           PlanInput v{.members = ShardedHeld(6, 12, 2), .shard_group = 2, .highest_step = 12};
           v.members[1] = Lost(1);
           return v;
         }(),
     .want = {.s_star = 12,
              .holders = {0, 2, 3, 4, 5},
              .members = {0, 2, 3, 4},
              .had_step = {12, 12, 12, 12},
              .released = {5},
              .replacements =
                  {"rank 1: worker 1 → none (shrink)",
                   "worker 5 released (the world must be a multiple of optimizer.shard_group 2)"},
              // Workers 2 and 3 swap shards; worker 2 serves shard 0 while it fetches shard 1.
              .shard_moves = {{2, 1, {3}}, {3, 0, {0, 2, 4}}, {4, 1, {3}}}}},
    {.name = "ShardedShrink4To2SwapsTheShards",
     .view = {.members = {Lost(0), Held(2, 12, "", 1), Held(3, 12, "", 0), Held(4, 12, "", 1)},
              .shard_group = 2,
              .highest_step = 12},
     .want = {.s_star = 12,
              .holders = {2, 3, 4},
              .members = {2, 3},
              .had_step = {12, 12},
              .released = {4},
              .replacements =
                  {"rank 0: worker 0 → none (shrink)",
                   "worker 4 released (the world must be a multiple of optimizer.shard_group 2)"},
              .shard_moves = {{2, 0, {3}}, {3, 1, {2}}}}},
    {.name = "ShardedResizeShrinkFromTheEndMovesNoShard",
     .view = {.members = ShardedHeld(6, 12, 2),
              .resize = PlanInput::Resize{4, {}},
              .shard_group = 2,
              .highest_step = 12},
     .want = {.s_star = 12,
              .holders = {0, 1, 2, 3, 4, 5},
              .members = {0, 1, 2, 3},
              .had_step = {12, 12, 12, 12},
              .released = {5, 4},
              .replacements = {"rank 5: worker 5 released", "rank 4: worker 4 released"}}},
    {.name = "ShardedGrow2To4SparesFetchTheirRanksShards",
     .view = {.members = ShardedHeld(2, 10, 2),
              .spares = {{4, ""}, {5, ""}},
              .resize = PlanInput::Resize{4, {}},
              .shard_group = 2,
              .highest_step = 10},
     .want = {.s_star = 10,
              .holders = {0, 1},
              .members = {0, 1, 4, 5},
              .had_step = {10, 10, -1, -1},
              .replacements = {"rank 2: spare worker 4 joins", "rank 3: spare worker 5 joins"},
              .transfers = {{4, {0, 1}, -1}, {5, {0, 1}, -1}},
              .shard_moves = {{4, 0, {0}}, {5, 1, {1}}},
              .spares_used = 2}},
    {.name = "ShardedAMemberHoldingEveryShardServesEachReceiverItsOwn",
     // Only worker 3 holds step 7, whole (a checkpoint it loaded): it serves every shard, and binds
     // its own.
     .view = {.members = {Held(0, 6, "", 0), Held(1, 6, "", 1), Held(2, 6, "", 0),
                          Held(3, 7, "", state::kEveryShard)},
              .shard_group = 2,
              .highest_step = 7},
     .want = {.s_star = 7,
              .holders = {3},
              .members = {0, 1, 2, 3},
              .had_step = {6, 6, 6, 7},
              .transfers = {{0, {3}, 6}, {1, {3}, 6}, {2, {3}, 6}},
              .shard_moves = {{0, 0, {3}}, {1, 1, {3}}, {2, 0, {3}}}}},
    {.name = "ShardedBeforeTheFirstStepEveryMemberHoldsEveryShard",
     // Survivors bound to shard 0 since, and a spare: the initial state is every shard's, nothing
     // moves.
     .view = {.members = {Held(0, -1, "", 0), Lost(1), Held(2, -1, "", 0), Lost(3)},
              .spares = {{7, ""}, {8, ""}},
              .shard_group = 2,
              .highest_step = -1},
     .want = {.s_star = -1,
              .holders = {0, 2},
              .members = {0, 7, 2, 8},
              .had_step = {-1, -1, -1, -1},
              .replacements = {"rank 1: worker 1 → spare worker 7",
                               "rank 3: worker 3 → spare worker 8"},
              .spares_used = 2}},
    {.name = "ResizeShrinkReleasesTheHighestRanks",
     .view = {.members = AllHeld(4, 10), .resize = PlanInput::Resize{2, {}}, .highest_step = 10},
     .want = {.s_star = 10,
              .holders = {0, 1, 2, 3},
              .members = {0, 1},
              .had_step = {10, 10},
              .released = {3, 2},
              .replacements = {"rank 3: worker 3 released", "rank 2: worker 2 released"}}},
    {.name = "ResizeGrowAddsSparesAtTheEnd",
     .view = {.members = AllHeld(2, 10),
              .spares = {{4, ""}, {5, ""}, {6, ""}},
              .resize = PlanInput::Resize{4, {}},
              .highest_step = 10},
     .want = {.s_star = 10,
              .holders = {0, 1},
              .members = {0, 1, 4, 5},
              .had_step = {10, 10, -1, -1},
              .replacements = {"rank 2: spare worker 4 joins", "rank 3: spare worker 5 joins"},
              .transfers = {{4, {0, 1}, -1}, {5, {0, 1}, -1}},
              .spares_used = 2}},
    {.name = "ResizeShrinkReleasesAPromotedSpareFirst",
     .view = {.members = {Held(0, 3), Held(1, 3), Lost(2)},
              .spares = {{7, ""}},
              .resize = PlanInput::Resize{2, {}},
              .highest_step = 3},
     .want = {.s_star = 3,
              .holders = {0, 1},
              .members = {0, 1},
              .had_step = {3, 3},
              .released = {7},
              .replacements = {"rank 2: worker 2 → spare worker 7", "rank -1: worker 7 released"},
              .spares_used = 1}},
    {.name = "LeavingHostsReleasedByName",
     .view = {.members = {Held(0, 6, "hA"), Held(1, 6, "hB"), Held(2, 6, "hA"), Held(3, 6, "hB")},
              .resize = PlanInput::Resize{2, {{1, "hB"}, {3, "hB"}}},
              .highest_step = 6},
     .want = {.s_star = 6,
              .holders = {0, 2},
              .members = {0, 2},
              .had_step = {6, 6},
              .released = {1, 3},
              .replacements = {"rank 1: worker 1 released (host hB leaves)",
                               "rank 3: worker 3 released (host hB leaves)"}}},
    {.name = "LeavingHostsRanksGoToSparesElsewhere",
     .view = {.members = {Held(0, 6, "hA"), Held(1, 6, "hB"), Held(2, 6, "hA"), Held(3, 6, "hB")},
              .spares = {{9, "hC"}},
              .resize = PlanInput::Resize{3, {{1, "hB"}, {3, "hB"}}},
              .highest_step = 6},
     .want = {.s_star = 6,
              .holders = {0, 2},
              .members = {0, 2, 9},
              .had_step = {6, 6, -1},
              .released = {1, 3},
              .replacements = {"rank 1: worker 1 released (host hB leaves)",
                               "rank 3: worker 3 released (host hB leaves)",
                               "rank 2: spare worker 9 joins"},
              .transfers = {{9, {0, 2}, -1}},
              .spares_used = 1}},
    {.name = "LeavingHostsStayWhenThePolicyRefusesTheSmallerWorld",
     .view = {.members = {Held(0, 6, "hA"), Held(1, 6, "hB"), Held(2, 6, "hA"), Held(3, 6, "hB")},
              .resize = PlanInput::Resize{2, {{1, "hB"}, {3, "hB"}}},
              .highest_step = 6},
     .want =
         {.s_star = 6,
          .holders = {0, 1, 2, 3},
          .members = {0, 1, 2, 3},
          .had_step = {6, 6, 6, 6},
          .leaving_kept =
              "the members of leaving hosts stay for now: without them the world would be 2 (world "
              "size 2 is below the minimum 4)"},
     .policy = {/*min_world=*/4, /*max_world=*/8, /*allowed_sizes=*/{}, /*increment=*/1}},
    {.name = "ShardedLeavingHostsStayWhenOnlyTheyHoldAShard",
     .view = {.members = {Held(0, 6, "hA", 0), Held(1, 6, "hB", 1), Held(2, 6, "hA", 0),
                          Held(3, 6, "hB", 1)},
              .resize = PlanInput::Resize{2, {{1, "hB"}, {3, "hB"}}},
              .shard_group = 2,
              .highest_step = 6},
     .want =
         {.s_star = 6,
          .holders = {0, 1, 2, 3},
          .members = {0, 1, 2, 3},
          .had_step = {6, 6, 6, 6},
          .leaving_kept =
              "the members of leaving hosts stay for now: without them the world would be 2 (no "
              "member that stays holds all of the state)",
          .leave_refused_hosts = {"hB"}}},
    {.name = "SourcesLimitedPerReceiverAndRotated",
     .view =
         [] {
           PlanInput v{
               .members = AllHeld(12, 3), .spares = {{20, ""}, {21, ""}}, .highest_step = 3};
           v.members[10] = Lost(10);
           v.members[11] = Lost(11);
           return v;
         }(),
     .want = {.s_star = 3,
              .holders = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9},
              .members = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 20, 21},
              .had_step = {3, 3, 3, 3, 3, 3, 3, 3, 3, 3, -1, -1},
              .replacements = {"rank 10: worker 10 → spare worker 20",
                               "rank 11: worker 11 → spare worker 21"},
              .transfers = {{20, {0, 1, 2, 3, 4, 5, 6, 7}, -1}, {21, {8, 9, 0, 1, 2, 3, 4, 5}, -1}},
              .spares_used = 2}},
    {.name = "SourcesAlternateOverHosts",
     .view = {.members = {Held(0, 8, "hA"), Held(1, 8, "hA"), Held(2, 8, "hA"), Held(3, 8, "hB"),
                          Held(4, 8, "hB"), Lost(5, "hC")},
              .spares = {{7, "hD"}},
              .failed_hosts = {"hC"},
              .highest_step = 8},
     .want = {.s_star = 8,
              .holders = {0, 3, 1, 4, 2},
              .members = {0, 1, 2, 3, 4, 7},
              .had_step = {8, 8, 8, 8, 8, -1},
              .replacements = {"rank 5: worker 5 → spare worker 7"},
              .transfers = {{7, {0, 3, 1, 4, 2}, -1}},
              .spares_used = 1}},
};

class PlannerTest : public ::testing::TestWithParam<Case> {};

TEST_P(PlannerTest, PlansExactlyTheExpectedGeneration) {
  const Case& c = GetParam();
  const NextGeneration got = PlanNextGeneration(c.view, c.policy);
  const Expected& want = c.want;
  EXPECT_EQ(static_cast<int>(got.verdict), static_cast<int>(want.verdict));
  EXPECT_EQ(got.why, want.why);
  EXPECT_EQ(got.lost_shards, want.lost_shards);
  EXPECT_EQ(got.s_star, want.s_star);
  EXPECT_EQ(got.holders, want.holders);
  EXPECT_EQ(got.members, want.members);
  EXPECT_EQ(got.had_step, want.had_step);
  EXPECT_EQ(got.released, want.released);
  EXPECT_EQ(got.replacements, want.replacements);
  std::vector<TransferRow> transfers;
  for (const auto& t : got.transfers) transfers.emplace_back(t.receiver, t.sources, t.had_step);
  EXPECT_EQ(transfers, want.transfers);
  std::vector<MoveRow> moves;
  for (const auto& m : got.shard_moves) moves.emplace_back(m.receiver, m.shard, m.sources);
  EXPECT_EQ(moves, want.shard_moves);
  EXPECT_EQ(got.leaving_kept, want.leaving_kept);
  EXPECT_EQ(got.leave_refused_hosts, want.leave_refused_hosts);
  EXPECT_EQ(got.spares_used, want.spares_used);
}

INSTANTIATE_TEST_SUITE_P(Table, PlannerTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The policy's check of a world size, by table.
struct SizeCase {
  PlanPolicy policy;
  int shard_group;
  int size;
  std::string want;
};

TEST(CheckWorldSizeTest, NamesWhyASizeIsNotAllowed) {
  const PlanPolicy p{/*min_world=*/2, /*max_world=*/8, /*allowed_sizes=*/{}, /*increment=*/1};
  const PlanPolicy inc{/*min_world=*/2, /*max_world=*/8, /*allowed_sizes=*/{}, /*increment=*/2};
  const PlanPolicy allowed{/*min_world=*/1, /*max_world=*/8, /*allowed_sizes=*/{2, 4, 8},
                           /*increment=*/3};
  const PlanPolicy big{/*min_world=*/1, /*max_world=*/1 << 20, /*allowed_sizes=*/{},
                       /*increment=*/1};
  const SizeCase cases[] = {
      {p, 0, 4, ""},
      {p, 0, 1, "world size 1 is below the minimum 2"},
      {p, 0, 9, "world size 9 is above the maximum 8"},
      {p, 2, 5, "world size 5 is not a multiple of optimizer.shard_group 2"},
      {p, 2, 6, ""},
      {big, 2, 250,
       "world size 250 is 125 groups of optimizer.shard_group 2: more than the 126 sub-groups a "
       "generation has (use a larger shard_group)"},
      {big, 2, 248, ""},
      {inc, 0, 5, "world size 5 is not the minimum 2 plus a multiple of the increment 2"},
      {inc, 0, 6, ""},
      {allowed, 0, 3, "world size 3 is not an allowed size (allowed: [2,4,8])"},
      {allowed, 0, 4, ""},  // allowed sizes, when listed, replace the increment
  };
  for (const SizeCase& c : cases) {
    EXPECT_EQ(CheckWorldSize(c.policy, c.shard_group, c.size), c.want) << "size " << c.size;
  }
}

// PlanShardMoves alone, as the first generation (MaybeFormFirstGeneration)
// uses it too: the moves of a world of holdings, by table.
TEST(PlanShardMovesTest, EveryMemberLackingItsRanksShardFetchesItFromItsHolders) {
  using H = ShardHolding;
  constexpr int kNone = state::kNoShard, kEvery = state::kEveryShard;
  struct MovesCase {
    std::string what;
    std::vector<ShardHolding> next;
    int64_t s_star;
    int group;
    std::vector<MoveRow> want;
  };
  const MovesCase cases[] = {
      {"a spare and a member one step behind: a stale copy is no source",
       {H{0, 7, 0}, H{1, 7, 1}, H{2, 7, 0}, H{3, -1, kNone}, H{4, 6, 0}, H{5, 7, 1}},
       7,
       2,
       {{3, 1, {1, 5}}, {4, 0, {0, 2}}}},
      {"both holders of shard 1 gone: its receivers get no source",
       {H{0, 7, 0}, H{1, -1, kNone}, H{2, 7, 0}, H{3, -1, kNone}},
       7,
       2,
       {{1, 1, {}}, {3, 1, {}}}},
      {"a member holding every shard (a loaded checkpoint) serves each receiver and moves nothing "
       "itself",
       {H{10, 7, kEvery}, H{11, 5, kEvery}, H{12, 7, 0}, H{13, -1, kNone}},
       7,
       2,
       {{11, 1, {10}}, {13, 1, {10}}}},
      {"every member loaded the checkpoint: nothing moves",
       {H{0, 7, kEvery}, H{1, 7, kEvery}},
       7,
       2,
       {}},
      {"the initial state is every shard's, whatever the shard held",
       {H{0, -1, 1}, H{1, -2, kNone}},
       -1,
       2,
       {}},
      {"groups of 3, a shard held by another group's rank",
       {H{0, 4, 0}, H{1, 4, 2}, H{2, 4, 1}, H{3, 4, 0}, H{4, 4, 1}, H{5, 4, 2}},
       4,
       3,
       {{1, 1, {2, 4}}, {2, 2, {1, 5}}}},
      {"more holders than a receiver's sources: a window of them, rotating over the shard's "
       "receivers",
       [] {
         std::vector<ShardHolding> next;
         for (int id = 0; id < 22; ++id) next.push_back(H{id, 5, id % 2});
         // two spares take ranks of shard 1: nine holders of it are left
         next[19] = H{19, -1, kNone};
         next[21] = H{21, -1, kNone};
         return next;
       }(),
       5,
       2,
       {{19, 1, {1, 3, 5, 7, 9, 11, 13, 15}}, {21, 1, {17, 1, 3, 5, 7, 9, 11, 13}}}},
      {"one group of one: a spare fetches shard 0",
       {H{0, 3, 0}, H{1, -1, kNone}},
       3,
       1,
       {{1, 0, {0}}}},
      {"nothing sharded", {H{0, 3, kNone}, H{1, -1, kNone}}, 3, 0, {}},
      {"part groups: no moves (the workers refuse the world)",
       {H{0, 3, 0}, H{1, 3, 1}, H{2, -1, kNone}},
       3,
       2,
       {}},
  };
  for (const MovesCase& c : cases) {
    std::vector<MoveRow> got;
    for (const ShardMove& m : PlanShardMoves(c.next, c.s_star, c.group))
      got.emplace_back(m.receiver, m.shard, m.sources);
    EXPECT_EQ(got, c.want) << c.what;
  }
}

TEST(SourcesForTest, EveryHolderUpToTheLimitThenARotatingWindow) {
  const std::vector<int> few = {4, 2, 9};
  EXPECT_EQ(SourcesFor(few, 0), few);
  EXPECT_EQ(SourcesFor(few, 5), few);
  std::vector<int> many;
  // 11
  for (int id = 100; id < 100 + static_cast<int>(kMaxSourcesPerReceiver) + 3; ++id)
    many.push_back(id);
  EXPECT_EQ(SourcesFor(many, 0), (std::vector<int>{100, 101, 102, 103, 104, 105, 106, 107}));
  EXPECT_EQ(SourcesFor(many, 1), (std::vector<int>{108, 109, 110, 100, 101, 102, 103, 104}));
  EXPECT_EQ(SourcesFor(many, 2), (std::vector<int>{105, 106, 107, 108, 109, 110, 100, 101}));
}

}  // namespace
}  // namespace nonstop::controller
