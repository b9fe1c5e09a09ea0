// The fixed reduction tree (issue 13): every split of M ≤ 16 micro-batches
// over every world size sums to the same bits as one rank folding them all.
#include "collective/tree_reduce.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace nonstop::collective {
namespace {

// Micro-batch gradients whose sum depends on the order: magnitudes 1e-4 … 1e4.
std::vector<std::vector<float>> Gradients(int m, size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-4, 4);
  std::vector<std::vector<float>> g(static_cast<size_t>(m), std::vector<float>(n));
  for (auto& v : g) {
    for (auto& x : v) x = mantissa(rng) * std::pow(10.0f, static_cast<float>(exponent(rng)));
  }
  return g;
}

// The tree's sum, straight from its definition.
void Reference(const std::vector<std::vector<float>>& g, int l, int i, std::vector<float>* out) {
  const int m = static_cast<int>(g.size());
  if (l == 0) {
    *out = g[static_cast<size_t>(i)];
    return;
  }
  Reference(g, l - 1, 2 * i, out);
  if ((static_cast<long long>(2 * i + 1) << (l - 1)) >= m) return;
  std::vector<float> right;
  Reference(g, l - 1, 2 * i + 1, &right);
  for (size_t j = 0; j < out->size(); ++j) (*out)[j] = (*out)[j] + right[j];
}

// Ranges of a split of m micro-batches over w ranks: contiguous, sizes differing by at most one.
std::vector<std::pair<int, int>> Split(int m, int w) {
  std::vector<std::pair<int, int>> r;
  for (int k = 0; k < w; ++k) r.push_back({k * m / w, (k + 1) * m / w});
  return r;
}

TEST(TreeReduceTest, NodesOfARangeAreMaximalAndCoverItExactly) {
  EXPECT_EQ(NodesOfRange(8, 0, 8), (std::vector<TreeNode>{{3, 0}}));
  EXPECT_EQ(NodesOfRange(8, 1, 8), (std::vector<TreeNode>{{0, 1}, {1, 1}, {2, 1}}));
  EXPECT_EQ(NodesOfRange(8, 3, 6), (std::vector<TreeNode>{{0, 3}, {1, 2}}));
  EXPECT_EQ(NodesOfRange(3, 2, 3), (std::vector<TreeNode>{{1, 1}})) << "a node whose right child covers nothing";
  EXPECT_EQ(NodesOfRange(5, 0, 5), (std::vector<TreeNode>{{3, 0}}));
  EXPECT_TRUE(NodesOfRange(8, 4, 4).empty());
}

TEST(TreeReduceTest, EverySplitOfUpTo16MicroBatchesSumsToTheSameBitsAsTheTree) {
  const size_t n = 33;
  int differs_from_a_plain_sum = 0;
  for (int m = 1; m <= 16; ++m) {
    auto g = Gradients(m, n, 1000u + static_cast<unsigned>(m));
    std::vector<float> want;
    Reference(g, TreeLevels(m), 0, &want);
    std::vector<float> plain(n, 0.0f);
    for (const auto& v : g) {
      for (size_t j = 0; j < n; ++j) plain[j] += v[j];
    }
    if (std::memcmp(plain.data(), want.data(), n * sizeof(float)) != 0) ++differs_from_a_plain_sum;
    for (int w = 1; w <= m; ++w) {
      std::vector<TreeFolder> folders;
      std::vector<TreeNode> nodes;
      std::vector<const float*> values;
      for (auto [first, last] : Split(m, w)) {
        folders.emplace_back(m, first, last, n);
        for (int i = first; i < last; ++i) folders.back().Add(g[static_cast<size_t>(i)]);
        ASSERT_TRUE(folders.back().complete());
        EXPECT_EQ(folders.back().nodes(), NodesOfRange(m, first, last)) << "m " << m << " range " << first << "-"
                                                                          << last;
        EXPECT_LE(folders.back().partials().size(), static_cast<size_t>(2 * TreeLevels(m) + 1));
      }
      for (const auto& f : folders) {
        for (size_t k = 0; k < f.nodes().size(); ++k) {
          nodes.push_back(f.nodes()[k]);
          values.push_back(f.partials()[k].data());
        }
      }
      std::vector<float> got(n);
      CombineInTreeOrder(m, nodes, values, n, got.data());
      ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0) << "m " << m << " world " << w;
    }
  }
  // The test can tell orders apart: for most M the tree's bits are not a plain left-to-right sum's.
  EXPECT_GT(differs_from_a_plain_sum, 8);
}

TEST(TreeReduceTest, AFolderHoldsLogarithmicallyManyPartialSums) {
  TreeFolder f(16, 0, 16, 1);
  size_t most = 0;
  for (int i = 0; i < 16; ++i) {
    float x = static_cast<float>(i);
    f.Add(std::span<const float>(&x, 1));
    most = std::max(most, f.partials().size());
  }
  EXPECT_LE(most, 5u);
  ASSERT_EQ(f.partials().size(), 1u);
  EXPECT_EQ(f.partials()[0][0], 120.0f);
}

}  // namespace
}  // namespace nonstop::collective
