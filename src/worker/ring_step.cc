#include "nonstop/ring.h"

#include <algorithm>

#include "nonstop/data.h"
#include "nonstop/session.h"
#include "worker/tree_step.h"

namespace nonstop::worker {

namespace {

int Block(int m, int world, int q) {
  return static_cast<int>(data::BlockBegin(static_cast<uint64_t>(m), world, q));
}

// The fault-free split keeps every block whole, but after a fault the blocks
// left differ (a spare's whole block, survivors' rests): each block's tail
// beyond the even load goes to the ranks with less, in rank order.
void LendTheExcess(std::vector<RingShare>* shares) {
  const int world = static_cast<int>(shares->size());
  int left = 0;
  for (const auto& s : *shares) left += static_cast<int>(s.compute.size());
  const size_t even = static_cast<size_t>((left + world - 1) / std::max(world, 1));
  std::vector<int> lent;  // ascending: the blocks in rank order, each tail in order
  for (auto& s : *shares) {
    if (s.compute.size() <= even) continue;
    s.lent.assign(s.compute.begin() + static_cast<std::ptrdiff_t>(even), s.compute.end());
    s.compute.resize(even);
    lent.insert(lent.end(), s.lent.begin(), s.lent.end());
  }
  size_t next = 0;
  for (auto& s : *shares) {
    while (next < lent.size() && s.compute.size() + s.borrowed.size() < even)
      s.borrowed.push_back(lent[next++]);
  }
}

}  // namespace

std::vector<Loan> LoansOf(std::span<const RingShare> shares) {
  std::vector<Loan> loans;
  for (size_t owner = 0; owner < shares.size(); ++owner) {
    for (int mb : shares[owner].lent) {
      for (size_t b = 0; b < shares.size(); ++b) {
        const auto& borrowed = shares[b].borrowed;
        if (std::find(borrowed.begin(), borrowed.end(), mb) != borrowed.end())
          loans.push_back({mb, static_cast<int>(owner), static_cast<int>(b)});
      }
    }
  }
  return loans;  // ascending: the owners' blocks are in rank order
}

std::vector<RingShare> PlanRingStep(int m, std::span<const std::vector<int>> offered, bool lend) {
  const int world = static_cast<int>(offered.size());
  std::vector<RingShare> shares(offered.size());
  std::vector<bool> covered(static_cast<size_t>(std::max(m, 0)), false);
  for (size_t q = 0; q < offered.size(); ++q) {
    std::vector<int> mine(offered[q].begin(), offered[q].end());
    std::sort(mine.begin(), mine.end());
    bool valid = std::adjacent_find(mine.begin(), mine.end()) == mine.end();
    for (int mb : mine) valid = valid && mb >= 0 && mb < m && !covered[static_cast<size_t>(mb)];
    if (!valid) continue;
    for (int mb : mine) covered[static_cast<size_t>(mb)] = true;
    shares[q].kept = std::move(mine);
  }
  // The fault-free order: every kept set is the start of its own rank's block.
  bool split = true;
  for (int q = 0; q < world; ++q) {
    const auto& kept = shares[static_cast<size_t>(q)].kept;
    const int begin = Block(m, world, q), end = Block(m, world, q + 1);
    split = split && static_cast<int>(kept.size()) <= end - begin;
    for (size_t k = 0; k < kept.size() && split; ++k)
      split = kept[k] == begin + static_cast<int>(k);
  }
  if (split) {
    for (int q = 0; q < world; ++q) {
      auto& share = shares[static_cast<size_t>(q)];
      for (int mb = Block(m, world, q) + static_cast<int>(share.kept.size());
           mb < Block(m, world, q + 1); ++mb)
        share.compute.push_back(mb);
    }
    if (lend) LendTheExcess(&shares);
    return shares;
  }
  std::vector<int> missing;
  for (int mb = 0; mb < m; ++mb)
    if (!covered[static_cast<size_t>(mb)]) missing.push_back(mb);
  const int left = static_cast<int>(missing.size());
  for (int q = 0; q < world; ++q) {
    auto& share = shares[static_cast<size_t>(q)];
    share.compute.assign(missing.begin() + Block(left, world, q),
                         missing.begin() + Block(left, world, q + 1));
  }
  return shares;
}

std::vector<collective::TreeNode> NodesOfMicroBatches(int m, std::span<const int> micro_batches) {
  std::vector<int> sorted(micro_batches.begin(), micro_batches.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<collective::TreeNode> nodes;
  for (size_t k = 0; k < sorted.size();) {
    size_t end = k + 1;  // the run sorted[k], sorted[k] + 1, …
    while (end < sorted.size() && sorted[end] == sorted[end - 1] + 1) ++end;
    for (const auto& node : collective::NodesOfRange(m, sorted[k], sorted[end - 1] + 1))
      nodes.push_back(node);
    k = end;
  }
  return nodes;
}

std::vector<int> MicroBatchesOfNodes(int m, std::span<const collective::TreeNode> nodes) {
  std::vector<int> out;
  for (const auto& node : nodes) {
    if (!collective::IsTreeNode(m, node)) return {};
    auto [first, last] = collective::NodeRange(m, node);
    for (int mb = first; mb < last; ++mb) out.push_back(mb);
  }
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end()) return {};  // overlapping nodes
  return out;
}

Result<std::vector<RingShare>> RingStepPlanner::Plan(Session& session, int m, int64_t step,
                                                     int64_t held_step, std::span<const int> held) {
  std::vector<std::vector<int>> offered(static_cast<size_t>(session.world_size()));
  kept_ = 0;
  kept_by_ = 0;
  computing_ = 0;
  if (session.generation() != exchanged_generation_) {
    // A new membership: what does each member still hold of this step?
    HeldSums mine;
    if (salvage_ && held_step == step && !held.empty()) {
      mine.step = step;
      mine.nodes = NodesOfMicroBatches(m, held);
    }
    auto offers = ExchangeOffers(session, step, mine, lend_, &everyone_lends_);
    if (!offers.ok()) return offers.status();
    exchanged_generation_ = session.generation();
    for (size_t q = 0; q < offered.size(); ++q) offered[q] = MicroBatchesOfNodes(m, (*offers)[q]);
  }
  // Loans change which collectives run: only when every member's setting allows them.
  std::vector<RingShare> shares = PlanRingStep(m, offered, everyone_lends_);
  for (const auto& share : shares) {
    kept_ += static_cast<int>(share.kept.size());
    kept_by_ += share.kept.empty() ? 0 : 1;
    computing_ += share.compute.empty() && share.borrowed.empty() ? 0 : 1;
  }
  return shares;
}

}  // namespace nonstop::worker
