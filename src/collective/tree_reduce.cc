#include "nonstop/tree.h"

#include <algorithm>
#include <map>

#include "common/check.h"

namespace nonstop::collective {

namespace {

// The first micro-batch after node (l, i), clipped to m: its range is [i << l, End(l, i)).
int End(int m, int l, int i) {
  return static_cast<int>(std::min<long long>(m, (static_cast<long long>(i) + 1) << l));
}

bool RightChildEmpty(int m, int l, int i) {  // node (l, i) with l ≥ 1
  return (static_cast<long long>(2 * i + 1) << (l - 1)) >= m;
}

}  // namespace

int TreeLevels(int m) {
  NONSTOP_CHECK_GE(m, 1);
  int l = 0;
  while ((1LL << l) < m) ++l;
  return l;
}

std::vector<TreeNode> NodesOfRange(int m, int first, int last) {
  NONSTOP_CHECK(0 <= first && first <= last && last <= m) << first << " " << last << " " << m;
  const int top = TreeLevels(m);
  std::vector<TreeNode> out;
  int pos = first;
  while (pos < last) {
    int l = 0;
    // The largest aligned node starting at pos whose (clipped) range ends within last.
    while (l < top && pos % (1 << (l + 1)) == 0 && End(m, l + 1, pos >> (l + 1)) <= last) ++l;
    out.push_back({l, pos >> l});
    pos = End(m, l, pos >> l);
  }
  return out;
}

TreeFolder::TreeFolder(int m, int first, int last, size_t elements)
    : m_(m), first_(first), last_(last), next_(first), elements_(elements) {
  NONSTOP_CHECK(0 <= first && first <= last && last <= m);
}

void TreeFolder::Add(std::span<const float> gradient) {
  NONSTOP_CHECK_LT(next_, last_) << "more micro-batches than the range holds";
  NONSTOP_CHECK_EQ(gradient.size(), elements_);
  const int top = TreeLevels(m_);
  nodes_.push_back({0, next_++});
  partials_.emplace_back(gradient.begin(), gradient.end());
  while (true) {
    TreeNode& t = nodes_.back();
    if (t.level == top) break;
    if (t.index % 2 == 0) {
      // A left child: it is its parent when the right one covers nothing.
      if (!RightChildEmpty(m_, t.level + 1, t.index / 2)) break;
      t = {t.level + 1, t.index / 2};
      continue;
    }
    // A right child whose left sibling is below it: both are ours, the parent is complete.
    if (nodes_.size() < 2) break;
    const TreeNode& left = nodes_[nodes_.size() - 2];
    if (left.level != t.level || left.index != t.index - 1) break;
    TreeNode parent{t.level + 1, t.index / 2};
    std::vector<float>& sum = partials_[partials_.size() - 2];
    const std::vector<float>& right = partials_.back();
    for (size_t j = 0; j < elements_; ++j) sum[j] = sum[j] + right[j];
    partials_.pop_back();
    nodes_.pop_back();
    nodes_.back() = parent;
  }
  if (complete()) {
    NONSTOP_CHECK(nodes_ == NodesOfRange(m_, first_, last_)) << "folding went astray";
  }
}

std::pair<int, int> NodeRange(int m, TreeNode node) {
  return {node.index << node.level, End(m, node.level, node.index)};
}

bool IsTreeNode(int m, TreeNode node) {
  if (m < 1 || node.level < 0 || node.level > TreeLevels(m) || node.index < 0) return false;
  return (static_cast<long long>(node.index) << node.level) < m;
}

std::vector<TreeShare> PlanTreeStep(int m, std::span<const std::vector<TreeNode>> offered,
                                    std::span<const int> counts) {
  NONSTOP_CHECK_GE(m, 1);
  const int w = static_cast<int>(offered.size());
  NONSTOP_CHECK_GE(w, 1);
  std::vector<TreeShare> shares(static_cast<size_t>(w));
  std::vector<char> covered(static_cast<size_t>(m), 0);
  for (int q = 0; q < w; ++q) {
    for (const TreeNode& node : offered[static_cast<size_t>(q)]) {
      if (!IsTreeNode(m, node)) continue;
      auto [first, last] = NodeRange(m, node);
      if (std::any_of(covered.begin() + first, covered.begin() + last,
                      [](char c) { return c != 0; }))
        continue;
      std::fill(covered.begin() + first, covered.begin() + last, 1);
      shares[static_cast<size_t>(q)].kept.push_back(node);
    }
  }
  std::vector<int> missing;
  for (int i = 0; i < m; ++i) {
    if (!covered[static_cast<size_t>(i)]) missing.push_back(i);
  }
  const auto n = static_cast<long long>(missing.size());
  std::vector<size_t> begins(static_cast<size_t>(w) + 1, 0);
  if (counts.empty()) {
    for (int q = 0; q <= w; ++q)  // as data::BlockBegin: n/W each, the remainder spread evenly
      begins[static_cast<size_t>(q)] = static_cast<size_t>((n / w) * q + (n % w) * q / w);
  } else {
    NONSTOP_CHECK_EQ(counts.size(), static_cast<size_t>(w));
    for (int q = 0; q < w; ++q) {
      NONSTOP_CHECK_GE(counts[static_cast<size_t>(q)], 0);
      begins[static_cast<size_t>(q) + 1] =
          begins[static_cast<size_t>(q)] + static_cast<size_t>(counts[static_cast<size_t>(q)]);
    }
    NONSTOP_CHECK_EQ(begins.back(), missing.size()) << "the counts do not deal what is left";
  }
  auto block_begin = [&](int q) { return begins[static_cast<size_t>(q)]; };
  for (int q = 0; q < w; ++q) {
    TreeShare& share = shares[static_cast<size_t>(q)];
    for (size_t k = block_begin(q); k < block_begin(q + 1); ++k) {
      int mb = missing[k];
      if (!share.compute.empty() && share.compute.back().second == mb) {
        ++share.compute.back().second;
      } else {
        share.compute.push_back({mb, mb + 1});
      }
    }
    share.nodes = share.kept;
    for (auto [first, last] : share.compute) {
      for (const TreeNode& node : NodesOfRange(m, first, last)) share.nodes.push_back(node);
    }
    std::sort(share.nodes.begin(), share.nodes.end(), [m](const TreeNode& a, const TreeNode& b) {
      return NodeRange(m, a).first < NodeRange(m, b).first;
    });
  }
  return shares;
}

std::vector<int> PowersOfTwoSplit(int m, int w) {
  if (w < 1 || m < w) return {};
  std::vector<int> parts;
  for (int bit = 30; bit >= 0; --bit) {
    if (m & (1 << bit)) parts.push_back(1 << bit);
  }
  if (static_cast<int>(parts.size()) > w) return {};
  while (static_cast<int>(parts.size()) <
         w) {  // halve the largest: parts stay sorted, largest first
    int largest = parts.front() / 2;
    parts.erase(parts.begin());
    auto at = std::find_if(parts.begin(), parts.end(), [&](int p) { return p <= largest; });
    parts.insert(parts.insert(at, largest), largest);
  }
  return parts;
}

void CombineInTreeOrder(int m, std::span<const TreeNode> nodes,
                        std::span<const float* const> values, size_t n, float* out) {
  NONSTOP_CHECK_EQ(nodes.size(), values.size());
  std::map<std::pair<int, int>, const float*> have;
  int covered = 0;
  for (size_t k = 0; k < nodes.size(); ++k) {
    have[{nodes[k].level, nodes[k].index}] = values[k];
    covered += End(m, nodes[k].level, nodes[k].index) - (nodes[k].index << nodes[k].level);
  }
  NONSTOP_CHECK_EQ(covered, m) << "the nodes do not partition the micro-batches";
  // Depth-first along the tree; `into` receives node (l, i)'s sum.
  auto sum = [&](auto&& self, int l, int i, float* into) -> void {
    if (auto it = have.find({l, i}); it != have.end()) {
      std::copy(it->second, it->second + n, into);
      return;
    }
    NONSTOP_CHECK_GT(l, 0) << "micro-batch " << i << " is in no node";
    self(self, l - 1, 2 * i, into);
    if (RightChildEmpty(m, l, i)) return;
    const float* right = nullptr;
    std::vector<float> computed;
    if (auto it = have.find({l - 1, 2 * i + 1}); it != have.end()) {
      right = it->second;  // a partial sum as it came: added in place, not copied first
    } else {
      computed.resize(n);
      self(self, l - 1, 2 * i + 1, computed.data());
      right = computed.data();
    }
    for (size_t j = 0; j < n; ++j) into[j] = into[j] + right[j];
  };
  sum(sum, TreeLevels(m), 0, out);
}

}  // namespace nonstop::collective
