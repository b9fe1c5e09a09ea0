// Planner: the decision of the next generation, as a pure function
// (docs/architecture.md "Invariants": planner(view, policy) → plan).
//
// When every live member of generation g has aborted and answered Ready with
// the step its state holds, the controller asks PlanNextGeneration what g+1 is:
// who survives, s* (the highest step a survivor holds), which members hold the
// state of s* and serve it (alternating over hosts), which spare takes each
// lost rank (away from the hosts that just failed, and for sharded state away
// from the surviving replicas of the rank's shard), what a planned resize
// releases or adds, which members copy the state and from whom, and with
// sharded state which member copies which shard from whom (every copy the
// plan makes: docs/architecture.md "Invariants") — or that the job must restart from its durable
// checkpoint, or end.
//
// The planner reads only its arguments: no clock, no socket, no Controller.
// The controller builds the view (PlanInput) from its state, calls it, and
// applies the result (roles, generation, records, journal, plan messages,
// spawns); planner_test.cc tests the decision by tables of views.
//
// Terms: a *survivor* is a member of g still alive that answered Ready; a
// *holder* is a survivor whose state holds s*; a *receiver* is a member of
// g+1 whose state does not (a spare, a member behind), and copies it from
// *sources*, a few holders.
//
// Thread-safety: pure functions over values; call them from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "nonstop/state.h"

namespace nonstop::controller {

// Each receiver opens a connection (and a thread) per source: at most this many.
inline constexpr size_t kMaxSourcesPerReceiver = 8;
// A generation's sub-groups of sharded state (its groups and its shards'
// replica sets) each need an op space of their own (Communicator::SubGroup).
inline constexpr int kMaxShardSubGroups = 126;

// What the policy allows the world size to be (ScalePolicy, resolved).
struct PlanPolicy {
  int min_world = 1;
  int max_world = 1;               // the policy's maximum, or the initial world when it names none
  std::vector<int> allowed_sizes;  // empty: min_world, min_world + increment, … up to max_world
  int increment = 1;
};

// Why `size` is not a world the job may have ("" when it may): the policy,
// and with sharded state (shard_group > 1) whole groups and the sub-group limit.
std::string CheckWorldSize(const PlanPolicy& policy, int shard_group, int size);

// The view of the job that the decision needs, by value.
struct PlanInput {
  // A member of the generation that ends.
  struct Member {
    int worker_id = -1;
    std::string host;    // the host it runs on ("" : joined by hand)
    bool alive = false;  // still a member (not lost during this recovery)
    bool ready = false;  // answered the abort (Ready): `step` is what its state holds
    // the step its state holds (-1: the initial state); meaningful when ready
    int64_t step = -1;
    // sharded state: the shard it holds (state::kEveryShard: every one; kNoShard: none)
    int held_shard = -1;
  };
  // A spare that may be promoted (heard from lately, not stopped, on a
  // responsive host): the controller's Promotable.
  struct Spare {
    int worker_id = -1;
    std::string host;  // "" : joined by hand
  };
  // A planned change of the world size, at a step boundary.
  struct Resize {
    int to = 0;  // the world size it asks for
    // members released by name (worker id → its host): leaving hosts
    std::map<int, std::string> release;
  };

  std::vector<Member> members;         // index = rank in the generation that ends
  std::vector<Spare> spares;           // ascending worker ids
  std::set<std::string> failed_hosts;  // hosts of the members lost: their spares are picked last
  std::optional<Resize> resize;        // none: a recovery from a fault
  int shard_group = 0;                 // optimizer.shard_group (0 or 1: nothing is sharded)
  int64_t highest_step = -1;           // the highest step any worker reported complete
  bool have_checkpoints = false;       // durable checkpoints exist: the last rung
};

// Sharded optimizer state (docs/sharding.md): a member of g+1 that does not
// hold the shard of its rank (rank r holds shard r mod G, state::LayoutOf)
// copies it from `sources` at the step boundary. The workers carry these out
// as planned and only check them (worker::ExchangeShards): this is the one
// place that decides which shard goes where.
struct ShardMove {
  int receiver = -1;  // worker id
  int shard = -1;     // the shard it ends holding: its rank mod G
  // worker ids of members of g+1 holding that shard of s* (the chunks are
  std::vector<int> sources;
  // striped over them in this order); empty: no member holds it
};

// What one member of g+1 holds before the shard moves, as the controller
// knows it from its join or its Ready.
struct ShardHolding {
  int worker_id = -1;
  int64_t step = -1;                 // the step its state holds (a spare: -1)
  int held_shard = state::kNoShard;  // the shard of it (state::kEveryShard: every one)
};

// The shard moves of a generation of `next` (index = rank) that resumes
// after step s_star, in groups of shard_group (0: nothing sharded, no
// moves), in rank order of the receivers. A member counts as a holder of
// shard s when its state holds s* and shard s or every shard; one that holds
// another step holds no shard of s* (the plan's transfers copy it only the
// step's counters); before the first step (s* = -1) every member holds every
// shard (the seeded parameters whole, zero moments). A receiver's sources
// are the holders of its shard in rank order, or, when there are more than
// kMaxSourcesPerReceiver, that many of them, rotating over the receivers of
// the shard (SourcesFor). A world that is not whole groups gets no moves:
// the workers refuse it (state::LayoutOf names the fix).
std::vector<ShardMove> PlanShardMoves(const std::vector<ShardHolding>& next, int64_t s_star,
                                      int shard_group);

// The decision, by value.
struct NextGeneration {
  enum class Verdict {
    kPlan,  // form generation g+1 from `members`
    // no live worker holds the state: restart every worker from the durable checkpoint (`why`)
    kRestart,
    // no live worker holds it and there is no checkpoint: the recovery fails, the job ends (`why`)
    kFail,
    // no worker is left to form a generation: the job ends (`why`); the fields below are set
    kNoneLeft,
  };
  // A receiver and the holders it copies the state from.
  struct Transfer {
    int receiver = -1;         // worker id
    std::vector<int> sources;  // worker ids: holders, at most kMaxSourcesPerReceiver
    int64_t had_step = -1;     // the step its state holds (-1: the initial state, a spare)
  };

  Verdict verdict = Verdict::kPlan;
  // kRestart: the reason; kFail, kNoneLeft: the message the job ends with
  std::string why;
  // sharded state: shards no holder holds, ascending (journaled shard_lost)
  std::vector<int> lost_shards;
  int64_t s_star = -1;  // the highest step a survivor holds; g+1 resumes at s_star + 1
  // worker ids: the state sources, consecutive ones on different hosts
  std::vector<int> holders;
  std::vector<int> members;       // worker ids, index = rank in g+1
  std::vector<int64_t> had_step;  // index = rank in g+1: the step its state holds (-1: a spare)
  // worker ids that leave (a shrink, leaving hosts, whole groups), in order
  std::vector<int> released;
  // lines for the recovery record, "rank 2: worker 2 → spare worker 5"
  std::vector<std::string> replacements;
  std::vector<Transfer> transfers;  // in rank order of the receivers
  // sharded state: in rank order of the receivers (PlanShardMoves)
  std::vector<ShardMove> shard_moves;
  // The members of leaving hosts stay (the world without them is not
  // allowed, or only they hold some state): the line to print, and the hosts
  // whose leave is refused for good (marked leave_refused) when it could only repeat.
  std::optional<std::string> leaving_kept;
  std::set<std::string> leave_refused_hosts;
  size_t spares_used = 0;  // spares promoted: the pool refills as many
};

// Decides generation g+1 from the view of g (see the top of this file).
NextGeneration PlanNextGeneration(const PlanInput& view, const PlanPolicy& policy);

// The state sources of the receiver_index-th receiver of a plan: every
// holder, or kMaxSourcesPerReceiver of them, rotating over the receivers.
std::vector<int> SourcesFor(const std::vector<int>& holders, size_t receiver_index);

}  // namespace nonstop::controller
