// World-invariant steps (issue 13, docs/determinism.md), for a training
// loop with `determinism: world-invariant`: the gradient of a step is the sum
// of its M micro-batch gradients in one fixed binary tree over the
// micro-batch index 0..M-1, whoever computed which micro-batch. The
// floating-point result then has the same bits at every world size, and a
// step a fault cut short can keep the sums the members already hold.
//
// The tree. Node (level l, index i) covers the micro-batches
// [i·2^l, (i+1)·2^l) ∩ [0, M); a leaf (0, i) is micro-batch i's gradient; an
// inner node is left + right, element by element, or its left child alone
// when its right child covers nothing (M not a power of two). The root is
// (L, 0) with 2^L ≥ M.
//
// A rank that computes a contiguous range [first, last) of micro-batches
// folds them as they come (TreeFolder): complete subtrees are summed at once,
// so it holds O(log M) partial sums, never M gradients. Its partial sums are
// the maximal tree nodes inside its range (NodesOfRange). The ranks' nodes
// partition [0, M); CombineInTreeOrder sums such a partition into the root
// along the same tree, so every partition (every world size, every split)
// gives the same bits as one rank folding all M. Session::AllReduceTree is
// that sum across the members.
//
// Salvage. When a fault ends a generation in the middle of a step, the
// members keep the partial sums they had folded (HeldSums). On the first
// step of the next generation every member offers what it holds of that step
// (one small AllGather, TreeStepPlanner), and PlanTreeStep keeps those sums
// and deals only the missing micro-batches over all members: the spare and
// the survivors share the lost rank's work, and the result has the bits of
// the fault-free step. One step of a loop:
//
//   auto shares = planner.Plan(*session, m, step, held);     // a fault: Recover()
//   const collective::TreeShare& mine = shares->at(session->rank());
//   worker::KeepOnly(&held, step, mine.kept);
//   std::vector<collective::TreeFolder> folders;
//   for (auto [first, last] : mine.compute) {
//     folders.emplace_back(m, first, last, n);
//     for (int mb = first; mb < last; ++mb) folders.back().Add(gradient of mb);
//   }
//   worker::HeldSums have = worker::CollectSums(m, step, std::move(held), &folders);
//   Status s = session->AllReduceTree(m, worker::NodeLists(*shares), have.partials, out);
//   held = s.ok() ? worker::HeldSums{} : std::move(have);   // kept for the retry
//
// The tree (collective::) is implemented by src/collective/tree_reduce.cc,
// the planner (worker::) by src/worker/tree_step.cc. Thread-safety: values
// and pure functions; a TreeFolder and a TreeStepPlanner belong to one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "nonstop/status.h"

namespace nonstop {

class Session;  // nonstop/session.h

namespace collective {

struct TreeNode {
  int level = 0;
  int index = 0;
  bool operator==(const TreeNode&) const = default;
};

// The level of the root for M leaves: the smallest L with 2^L ≥ M.
int TreeLevels(int m);

// The maximal nodes of the tree over [0, m) whose micro-batches all lie in
// [first, last), left to right: their leaves are exactly [first, last).
std::vector<TreeNode> NodesOfRange(int m, int first, int last);

// Folds the gradients of micro-batches first, first+1, …, last-1 (in that
// order) into the partial sums of NodesOfRange(m, first, last).
class TreeFolder {
 public:
  TreeFolder(int m, int first, int last, size_t elements);
  // The next micro-batch's gradient (`elements` floats). Checked: in order, inside the range.
  void Add(std::span<const float> gradient);
  bool complete() const { return next_ == last_; }
  // After the last Add: one partial sum per node of NodesOfRange, in that order.
  const std::vector<TreeNode>& nodes() const { return nodes_; }
  const std::vector<std::vector<float>>& partials() const { return partials_; }
  // Moves the sums out (complete or not: before the last Add, nodes() are
  // the tree nodes of the prefix folded so far). The folder is spent then.
  std::vector<std::vector<float>> TakePartials() { return std::move(partials_); }

 private:
  int m_, first_, last_, next_;
  size_t elements_;
  std::vector<TreeNode> nodes_;               // the stack: completed nodes, left to right
  std::vector<std::vector<float>> partials_;  // their sums
};

// The micro-batches node (l, i) covers: [first, last), clipped to m.
std::pair<int, int> NodeRange(int m, TreeNode node);
// Whether `node` is a node of the tree over [0, m) (a peer's claim is checked with it).
bool IsTreeNode(int m, TreeNode node);

// Salvaging the step in flight (docs/determinism.md). After a fault the
// members of the next generation may still hold partial sums they folded for
// the step that failed; any partition of [0, m) into tree nodes combines to
// the same bits, so those are kept and only the micro-batches no one holds
// are computed again, spread over every member.
struct TreeShare {
  std::vector<TreeNode> kept;                // the offered nodes this rank contributes as they are
  std::vector<std::pair<int, int>> compute;  // runs [first, last) it computes now, left to right
  // all its nodes: kept ∪ NodesOfRange(each run), left to right
  std::vector<TreeNode> nodes;
};
// offered[q]: the nodes rank q holds for this step (empty: none). Each rank,
// in rank order, keeps the offered nodes that are tree nodes and cover no
// micro-batch an earlier one covers (a peer's list is not trusted); the
// micro-batches left are dealt in contiguous blocks of that list, as even as
// possible (with nothing offered: rank q computes [q·m/W, (q+1)·m/W), the
// sampler's split), or, with `counts` (one per rank, summing to the number
// left), counts[q] of them to rank q. Every rank computes the same shares
// from the same offers.
std::vector<TreeShare> PlanTreeStep(int m, std::span<const std::vector<TreeNode>> offered,
                                    std::span<const int> counts = {});

// A split of m micro-batches over w ranks where every rank's count is a power
// of two, as even as possible: m's binary digits, the largest halved until
// there are w, largest first. Empty when there is none (w > m, or m has more
// than w ones in binary). A loss that is a mean over a rank's samples then
// differs between splits by powers of two only, which scale every float
// exactly: the Python package's world-invariant DistributedDataParallel deals
// so (docs/python.md).
std::vector<int> PowersOfTwoSplit(int m, int w);

// Sums partial sums whose nodes partition [0, m) into the root, along the
// tree: `values[k]` (n floats) is node `nodes[k]`'s sum. Checked: a partition.
void CombineInTreeOrder(int m, std::span<const TreeNode> nodes,
                        std::span<const float* const> values, size_t n, float* out);

}  // namespace collective

namespace worker {

// The partial sums a rank folded for `step` before it was cut short.
struct HeldSums {
  int64_t step = -1;                         // -1: none
  std::vector<collective::TreeNode> nodes;   // left to right
  std::vector<std::vector<float>> partials;  // one per node
};

// Drops what `held` has that the plan does not keep (`kept`, this rank's
// TreeShare::kept; all of it when held is of another step than `step`).
void KeepOnly(HeldSums* held, int64_t step, std::span<const collective::TreeNode> kept);

// What this rank holds of `step` once its runs are folded: the kept sums
// (moved from `kept`) and every folder's (moved out; complete or cut short),
// left to right over the micro-batches.
HeldSums CollectSums(int m, int64_t step, HeldSums kept,
                     std::vector<collective::TreeFolder>* folders);

// Every rank's node list of a plan, as Session::AllReduceTree takes it.
std::vector<std::vector<std::pair<int, int>>> NodeLists(
    std::span<const collective::TreeShare> shares);

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
  // `counts`: as PlanTreeStep's, dealing the whole step (no offer is kept).
  Result<std::vector<collective::TreeShare>> Plan(Session& session, int m, int64_t step,
                                                  const HeldSums& held,
                                                  std::span<const int> counts = {});

  // Of the last plan: micro-batches kept from the step in flight, and the members that kept some.
  int kept_micro_batches() const { return kept_; }
  int kept_by() const { return kept_by_; }

 private:
  bool salvage_;
  uint32_t exchanged_generation_ = 0;  // the generation whose offers were exchanged
  int kept_ = 0;
  int kept_by_ = 0;
};

}  // namespace worker

}  // namespace nonstop
