// The fixed reduction tree (issue 13): every split of M ≤ 16 micro-batches
// over every world size sums to the same bits as one rank folding them all.
#include "nonstop/tree.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <numeric>
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
  EXPECT_EQ(NodesOfRange(3, 2, 3), (std::vector<TreeNode>{{1, 1}}))
      << "a node whose right child covers nothing";
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
        EXPECT_EQ(folders.back().nodes(), NodesOfRange(m, first, last))
            << "m " << m << " range " << first << "-" << last;
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
      ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0)
          << "m " << m << " world " << w;
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

// The step in flight, salvaged: a split over w_old ranks in which every rank
// but `lost` had folded a prefix of its range when the fault came; the next
// generation (the spare in the lost rank's place, or one rank fewer) keeps
// those partial sums and computes only the rest. For every M ≤ 16, world,
// lost rank, progress and both ways on, the sum has the tree's bits.
TEST(TreeReduceTest, SalvagedPartialSumsPlusTheRecomputedRestGiveTheTreesBitsForEveryFault) {
  const size_t n = 17;
  int cases = 0;
  for (int m = 1; m <= 16; ++m) {
    auto g = Gradients(m, n, 2000u + static_cast<unsigned>(m));
    std::vector<float> want;
    Reference(g, TreeLevels(m), 0, &want);
    for (int w_old = 1; w_old <= std::min(m, 6); ++w_old) {
      auto ranges = Split(m, w_old);
      for (int lost = 0; lost < w_old; ++lost) {
        for (int progress : {0, 1, 2, 100}) {  // micro-batches each survivor had folded (100: all)
          // What each survivor holds: the folder of the prefix it computed.
          std::vector<TreeFolder> held;
          std::vector<int> survivors;
          for (int q = 0; q < w_old; ++q) {
            if (q == lost) continue;
            auto [first, last] = ranges[static_cast<size_t>(q)];
            held.emplace_back(m, first, last, n);
            for (int i = first; i < std::min(last, first + progress); ++i)
              held.back().Add(g[static_cast<size_t>(i)]);
            survivors.push_back(q);
          }
          for (bool spare : {true, false}) {
            if (!spare && w_old == 1) continue;  // nobody left
            // The new ranks: survivors keep their order; the spare takes the lost rank's place.
            std::vector<int> owner;  // new rank → index into `held`, or -1 (the spare)
            for (size_t k = 0; k < survivors.size(); ++k) owner.push_back(static_cast<int>(k));
            if (spare) owner.insert(owner.begin() + lost, -1);
            std::vector<std::vector<TreeNode>> offered;
            for (int o : owner)
              offered.push_back(o < 0 ? std::vector<TreeNode>{}
                                      : held[static_cast<size_t>(o)].nodes());
            auto shares = PlanTreeStep(m, offered);
            ASSERT_EQ(shares.size(), owner.size());
            std::vector<TreeNode> nodes;
            std::deque<std::vector<float>> storage;  // recomputed partial sums (stable addresses)
            std::vector<const float*> values;
            int salvaged = 0, recomputed = 0;
            for (size_t r = 0; r < shares.size(); ++r) {
              const TreeShare& share = shares[r];
              // Kept: everything this rank offered, since the offers do not overlap.
              ASSERT_EQ(share.kept, offered[r]) << "m " << m << " lost " << lost;
              for (const TreeNode& node : share.kept) {
                const TreeFolder& f = held[static_cast<size_t>(owner[r])];
                size_t k = static_cast<size_t>(std::find(f.nodes().begin(), f.nodes().end(), node) -
                                               f.nodes().begin());
                nodes.push_back(node);
                values.push_back(f.partials()[k].data());
                salvaged += NodeRange(m, node).second - NodeRange(m, node).first;
              }
              for (auto [first, last] : share.compute) {
                TreeFolder f(m, first, last, n);
                for (int i = first; i < last; ++i) f.Add(g[static_cast<size_t>(i)]);
                recomputed += last - first;
                for (size_t k = 0; k < f.nodes().size(); ++k) {
                  nodes.push_back(f.nodes()[k]);
                  storage.push_back(f.partials()[k]);
                  values.push_back(storage.back().data());
                }
              }
            }
            ASSERT_EQ(salvaged + recomputed, m);
            int held_total = 0;
            for (const auto& f : held) {
              for (const TreeNode& node : f.nodes())
                held_total += NodeRange(m, node).second - NodeRange(m, node).first;
            }
            EXPECT_EQ(salvaged, held_total) << "nothing held is computed again";
            std::vector<float> got(n);
            CombineInTreeOrder(m, nodes, values, n, got.data());
            ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0)
                << "m " << m << " world " << w_old << " lost " << lost << " progress " << progress
                << " spare " << spare;
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

// A peer's list is not trusted: nodes that are not the tree's, or that cover a
// micro-batch an earlier rank's node covers, are left out and computed again.
TEST(TreeReduceTest, OverlappingOrInvalidOffersAreDroppedAndEveryMicroBatchIsCoveredOnce) {
  const int m = 8;
  std::vector<std::vector<TreeNode>> offered = {
      {{0, 0}, {0, 1}},           // micro-batches 0, 1
      {{1, 0}, {9, 0}, {0, -1}},  // 0-1 again, a level above the root, a negative index
      {{2, 2}, {0, 5}},           // beyond m (index 2 at level 2 starts at 8), then 5
      {{1, 3}},                   // 6-7
  };
  auto shares = PlanTreeStep(m, offered);
  EXPECT_EQ(shares[0].kept, (std::vector<TreeNode>{{0, 0}, {0, 1}}));
  EXPECT_TRUE(shares[1].kept.empty());
  EXPECT_EQ(shares[2].kept, (std::vector<TreeNode>{{0, 5}}));
  EXPECT_EQ(shares[3].kept, (std::vector<TreeNode>{{1, 3}}));
  std::vector<int> count(m, 0);
  for (const auto& share : shares) {
    for (const TreeNode& node : share.nodes) {
      auto [first, last] = NodeRange(m, node);
      for (int i = first; i < last; ++i) ++count[static_cast<size_t>(i)];
    }
  }
  EXPECT_EQ(count, std::vector<int>(m, 1));
  // The missing 2, 3, 4 are dealt over the four ranks in contiguous blocks of that list.
  int computed = 0;
  for (const auto& share : shares) {
    for (auto [first, last] : share.compute) computed += last - first;
  }
  EXPECT_EQ(computed, 3);
  // Aliases: at M = 6, (1, 2) and (2, 1) both cover micro-batches 4-5. The second is an overlap,
  // dropped; whatever is kept and computed sums to the tree's bits.
  const int m6 = 6;
  auto g = Gradients(m6, 9, 77);
  std::vector<float> want;
  Reference(g, TreeLevels(m6), 0, &want);
  std::vector<std::vector<TreeNode>> aliased = {{{1, 2}}, {{2, 1}, {0, 0}}, {}};
  auto alias_shares = PlanTreeStep(m6, aliased);
  EXPECT_EQ(alias_shares[0].kept, (std::vector<TreeNode>{{1, 2}}));
  EXPECT_EQ(alias_shares[1].kept, (std::vector<TreeNode>{{0, 0}}));
  std::vector<TreeNode> nodes;
  std::deque<std::vector<float>> sums;
  std::vector<const float*> values;
  for (const auto& share : alias_shares) {
    for (const TreeNode& node : share.kept) {
      auto [first, last] = NodeRange(m6, node);
      TreeFolder f(m6, first, last, 9);
      for (int i = first; i < last; ++i) f.Add(g[static_cast<size_t>(i)]);
      nodes.push_back(node);
      sums.push_back(f.partials()[0]);
      values.push_back(sums.back().data());
    }
    for (auto [first, last] : share.compute) {
      TreeFolder f(m6, first, last, 9);
      for (int i = first; i < last; ++i) f.Add(g[static_cast<size_t>(i)]);
      for (size_t k = 0; k < f.nodes().size(); ++k) {
        nodes.push_back(f.nodes()[k]);
        sums.push_back(f.partials()[k]);
        values.push_back(sums.back().data());
      }
    }
  }
  std::vector<float> got(9);
  CombineInTreeOrder(m6, nodes, values, 9, got.data());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), 9 * sizeof(float)), 0);
}

TEST(TreeReduceTest, WithNothingOfferedTheSharesAreTheSamplersContiguousSplit) {
  for (int m = 1; m <= 16; ++m) {
    for (int w = 1; w <= 6; ++w) {
      auto shares = PlanTreeStep(m, std::vector<std::vector<TreeNode>>(static_cast<size_t>(w)));
      for (int q = 0; q < w; ++q) {
        int first = (m / w) * q + (m % w) * q / w, last = (m / w) * (q + 1) + (m % w) * (q + 1) / w;
        const TreeShare& share = shares[static_cast<size_t>(q)];
        if (first == last) {
          EXPECT_TRUE(share.compute.empty());
        } else {
          EXPECT_EQ(share.compute, (std::vector<std::pair<int, int>>{{first, last}}))
              << m << " " << w << " " << q;
        }
        EXPECT_EQ(share.nodes, NodesOfRange(m, first, last));
      }
    }
  }
}

// By search: the smallest largest part of any split of m into w powers of two (0: none).
int SmallestLargestPart(int m, int w) {
  if (w == 0) return m == 0 ? 1 : 0;
  int best = 0;
  for (int p = 1; p <= m; p *= 2) {
    int rest = SmallestLargestPart(m - p, w - 1);
    if (rest != 0 && (best == 0 || std::max(p, rest) < best)) best = std::max(p, rest);
  }
  return best;
}

TEST(TreeReduceTest, PowersOfTwoSplitsAreEvenPowersOfTwoOrNone) {
  EXPECT_EQ(PowersOfTwoSplit(4, 3), (std::vector<int>{2, 1, 1}));
  EXPECT_EQ(PowersOfTwoSplit(8, 3), (std::vector<int>{4, 2, 2}));
  EXPECT_EQ(PowersOfTwoSplit(5, 2), (std::vector<int>{4, 1}));
  EXPECT_EQ(PowersOfTwoSplit(12, 5), (std::vector<int>{4, 2, 2, 2, 2}));
  EXPECT_TRUE(PowersOfTwoSplit(6, 1).empty());  // 6 = 4 + 2: two ranks at least
  EXPECT_TRUE(PowersOfTwoSplit(3, 4).empty());  // more ranks than micro-batches
  for (int m = 1; m <= 24; ++m) {
    for (int w = 1; w <= 7; ++w) {
      std::vector<int> split = PowersOfTwoSplit(m, w);
      const bool possible = w <= m && __builtin_popcount(static_cast<unsigned>(m)) <= w;
      ASSERT_EQ(!split.empty(), possible) << m << " over " << w;
      if (!possible) continue;
      ASSERT_EQ(static_cast<int>(split.size()), w);
      EXPECT_EQ(std::accumulate(split.begin(), split.end(), 0), m);
      EXPECT_TRUE(std::is_sorted(split.rbegin(), split.rend())) << m << " over " << w;
      for (int c : split) EXPECT_EQ(c & (c - 1), 0) << c << " in " << m << " over " << w;
      EXPECT_EQ(split.front(), SmallestLargestPart(m, w)) << m << " over " << w;
    }
  }
}

TEST(TreeReduceTest, CountsDealTheStepInContiguousBlocksOfThoseSizes) {
  const int m = 8;
  std::vector<int> counts = {4, 2, 2};
  auto shares = PlanTreeStep(m, std::vector<std::vector<TreeNode>>(3), counts);
  EXPECT_EQ(shares[0].compute, (std::vector<std::pair<int, int>>{{0, 4}}));
  EXPECT_EQ(shares[1].compute, (std::vector<std::pair<int, int>>{{4, 6}}));
  EXPECT_EQ(shares[2].compute, (std::vector<std::pair<int, int>>{{6, 8}}));
  EXPECT_EQ(shares[1].nodes, NodesOfRange(m, 4, 6));
  EXPECT_DEATH(PlanTreeStep(m, std::vector<std::vector<TreeNode>>(3), std::vector<int>{4, 2, 1}),
               "the counts do not deal what is left");
}

}  // namespace
}  // namespace nonstop::collective
