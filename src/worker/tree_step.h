// World-invariant steps that survive a fault (issue 13, docs/determinism.md).
//
// With `determinism: world-invariant` a step's gradient is the tree sum of its
// M micro-batch gradients (collective/tree_reduce.h), so it does not matter
// who computed which micro-batch. When a fault ends a generation in the middle
// of a step, the members keep the partial sums they had folded (HeldSums). On
// the first step of the next generation every member offers what it holds of
// that step (one small AllGather), and collective::PlanTreeStep keeps those
// sums and deals only the missing micro-batches over all members: the spare
// and the survivors share the lost rank's work, and the result has the bits
// of the fault-free step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "collective/tree_reduce.h"
#include "nonstop/session.h"

namespace nonstop::worker {

// The partial sums a rank folded for `step` before it was cut short.
struct HeldSums {
  int64_t step = -1;  // -1: none
  std::vector<collective::TreeNode> nodes;    // left to right
  std::vector<std::vector<float>> partials;   // one per node
};

// Drops what `held` has that the plan does not keep (`kept`, this rank's
// TreeShare::kept; all of it when held is of another step than `step`).
void KeepOnly(HeldSums* held, int64_t step, std::span<const collective::TreeNode> kept);

// What this rank holds of `step` once its runs are folded: the kept sums
// (moved from `kept`) and every folder's (moved out; complete or cut short),
// left to right over the micro-batches.
HeldSums CollectSums(int m, int64_t step, HeldSums kept, std::vector<collective::TreeFolder>* folders);

// Every rank's node list of a plan, as Session::AllReduceTree takes it.
std::vector<std::vector<std::pair<int, int>>> NodeLists(std::span<const collective::TreeShare> shares);

// One member's offer on the wire: a fixed-size record (little-endian int64
// words: step, count, then count × (level, index)). A step cut short holds at
// most 2·log2(M) + 1 nodes per run it computed; kMaxOfferedNodes bounds it.
inline constexpr size_t kMaxOfferedNodes = 128;
inline constexpr size_t kOfferBytes = 8 * (2 + 2 * kMaxOfferedNodes);
// Encodes what `held` has of `step` (nothing when it holds another step, or
// more nodes than fit: then all is computed again).
void EncodeOffer(const HeldSums& held, int64_t step, std::span<std::byte> record);
// The nodes a record offers for `step`, or none when it is for another step
// or malformed (a count out of range). The nodes are not validated here:
// PlanTreeStep drops those that are not the tree's or that overlap.
std::vector<collective::TreeNode> DecodeOffer(std::span<const std::byte> record, int64_t step);

// Plans each step of a world-invariant loop: the plain split, except on the
// first step of a generation, where the members' offers are exchanged first.
// Every member takes part in the exchange whatever its own setting, so that
// the collectives of all members line up: a member with salvage off (its
// --no-salvage) offers nothing.
class TreeStepPlanner {
 public:
  explicit TreeStepPlanner(bool salvage) : salvage_(salvage) {}

  // The shares of `step` for every rank (index = rank). Fails only when the
  // exchange does (a fault: recover, and plan the step again).
  Result<std::vector<collective::TreeShare>> Plan(Session& session, int m, int64_t step, const HeldSums& held);

  // Of the last plan: micro-batches kept from the step in flight, and the members that kept some.
  int kept_micro_batches() const { return kept_; }
  int kept_by() const { return kept_by_; }

 private:
  bool salvage_;
  uint32_t exchanged_generation_ = 0;  // the generation whose offers were exchanged
  int kept_ = 0;
  int kept_by_ = 0;
};

}  // namespace nonstop::worker
