// The offers of the salvage exchange (TreeStepPlanner, nonstop/tree.h): the
// record each member contributes to the AllGather on the first step of a
// generation, saying which tree nodes it holds of the step in flight.
// Internal: the public half of the tree step is include/nonstop/tree.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "nonstop/tree.h"

namespace nonstop::worker {

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

}  // namespace nonstop::worker
