// The offers of the salvage exchange (TreeStepPlanner, nonstop/tree.h): the
// record each member contributes to the AllGather on the first step of a
// generation, saying which tree nodes it holds of the step in flight.
// Internal: the public half of the tree step is include/nonstop/tree.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "nonstop/status.h"
#include "nonstop/tree.h"

namespace nonstop::worker {

// One member's offer on the wire: a fixed-size record (little-endian int64
// words: step, count, then count × (level, index)). A step cut short holds at
// most 2·log2(M) + 1 nodes per run it computed; kMaxOfferedNodes bounds it.
inline constexpr size_t kMaxOfferedNodes = 127;
// Words: step, count, the nodes (two words each), then the member's options
// (kOfferDeclinesLoans), then one word unused.
inline constexpr size_t kOfferBytes = 8 * (2 + 2 * kMaxOfferedNodes + 2);
inline constexpr size_t kOfferOptionsWord = 2 + 2 * kMaxOfferedNodes;
inline constexpr int64_t kOfferDeclinesLoans = 1;  // the member runs with --no-loans
// Encodes what `held` has of `step` (nothing when it holds another step, or
// more nodes than fit: then all is computed again).
void EncodeOffer(const HeldSums& held, int64_t step, std::span<std::byte> record);
// The nodes a record offers for `step`, or none when it is for another step
// or malformed (a count out of range). The nodes are not validated here:
// PlanTreeStep drops those that are not the tree's or that overlap.
std::vector<collective::TreeNode> DecodeOffer(std::span<const std::byte> record, int64_t step);

// The exchange of offers, one fixed-size record per member (Session::AllGather):
// what each member holds of `step` (index = rank), `held` being this member's
// (pass HeldSums{} to offer nothing). Both salvage planners run it on the
// first step of each generation: TreeStepPlanner (world-invariant) and
// RingStepPlanner (nonstop/ring.h, the default ring mode). Fails only
// when the AllGather does (a fault).
// `lends`: this member's loans setting (the ring's; the tree has none); with
// `everyone_lends`, whether every member's is on: loans need all to agree.
Result<std::vector<std::vector<collective::TreeNode>>> ExchangeOffers(
    Session& session, int64_t step, const HeldSums& held, bool lends = true,
    bool* everyone_lends = nullptr);

}  // namespace nonstop::worker
