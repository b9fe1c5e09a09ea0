// The plan of a ring step after a fault (nonstop/ring.h): survivors holding a
// prefix of their block continue it and the spare computes the lost block
// (the fault-free order); after a shrink what nobody holds is dealt over the
// members; every micro-batch is in exactly one sum, and lying offers keep nothing.
#include "nonstop/ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "nonstop/data.h"

namespace nonstop::worker {
namespace {

using List = std::vector<int>;

// Every micro-batch of [0, m) in exactly one rank's kept ∪ compute ∪ borrowed.
void ExpectEachMicroBatchOnce(int m, const std::vector<RingShare>& shares) {
  std::vector<int> count(static_cast<size_t>(m), 0);
  for (const auto& s : shares) {
    for (int mb : s.kept) ++count[static_cast<size_t>(mb)];
    for (int mb : s.compute) ++count[static_cast<size_t>(mb)];
    for (int mb : s.borrowed) ++count[static_cast<size_t>(mb)];
  }
  for (int mb = 0; mb < m; ++mb)
    EXPECT_EQ(count[static_cast<size_t>(mb)], 1) << "micro-batch " << mb;
}

List BlockOf(int m, int world, int q, int from = 0) {
  List out;
  for (auto mb = data::BlockBegin(m, world, q) + static_cast<uint64_t>(from);
       mb < data::BlockBegin(m, world, q + 1); ++mb)
    out.push_back(static_cast<int>(mb));
  return out;
}

TEST(RingStepTest, NothingOfferedIsTheSamplersSplit) {
  for (int m : {1, 3, 8, 13}) {
    for (int world : {1, 2, 3, 4, 5}) {
      auto shares = PlanRingStep(m, std::vector<List>(static_cast<size_t>(world)));
      for (int q = 0; q < world; ++q) {
        EXPECT_TRUE(shares[static_cast<size_t>(q)].kept.empty());
        EXPECT_EQ(shares[static_cast<size_t>(q)].compute, BlockOf(m, world, q))
            << "m " << m << " world " << world << " rank " << q;
      }
    }
  }
}

// A spare in the lost rank's place: every survivor, whatever prefix of its block it had
// completed (0, part, all), continues its own block, and each block's sum is made in the block's
// order (kept, computed, then lent); no rank computes more than the even load of what is left.
TEST(RingStepTest, WithASpareEachSurvivorContinuesItsOwnBlockAndTheExcessIsLent) {
  for (int m : {4, 8, 13}) {
    for (int world : {2, 3, 4}) {
      for (int lost = 0; lost < world; ++lost) {
        for (int done = 0; done <= 3; ++done) {
          std::vector<List> offered(static_cast<size_t>(world));
          for (int q = 0; q < world; ++q) {
            if (q == lost) continue;  // the spare holds nothing
            List block = BlockOf(m, world, q);
            offered[static_cast<size_t>(q)].assign(
                block.begin(), block.begin() + std::min<size_t>(block.size(), done));
          }
          auto shares = PlanRingStep(m, offered);
          ExpectEachMicroBatchOnce(m, shares);
          size_t left = 0, most = 0;
          for (const auto& s : shares) left += s.compute.size() + s.borrowed.size();
          for (const auto& s : shares) most = std::max(most, s.compute.size() + s.borrowed.size());
          EXPECT_EQ(most, (left + static_cast<size_t>(world) - 1) / static_cast<size_t>(world))
              << "the even load";
          for (int q = 0; q < world; ++q) {
            const auto& s = shares[static_cast<size_t>(q)];
            EXPECT_EQ(s.kept, offered[static_cast<size_t>(q)]) << "everything offered is kept";
            List order = s.kept;
            order.insert(order.end(), s.compute.begin(), s.compute.end());
            order.insert(order.end(), s.lent.begin(), s.lent.end());
            EXPECT_EQ(order, BlockOf(m, world, q))
                << "m " << m << " world " << world << " lost " << lost << " done " << done;
          }
          const std::vector<Loan> loans = LoansOf(shares);
          EXPECT_TRUE(std::is_sorted(loans.begin(), loans.end(), [](const Loan& a, const Loan& b) {
            return a.micro_batch < b.micro_batch;
          })) << "loans go in micro-batch order";
          for (const auto& s : shares)
            EXPECT_TRUE(std::is_sorted(s.borrowed.begin(), s.borrowed.end()));
          for (const Loan& loan : loans) {
            const auto& lent = shares[static_cast<size_t>(loan.owner)].lent;
            const auto& borrowed = shares[static_cast<size_t>(loan.borrower)].borrowed;
            EXPECT_NE(std::find(lent.begin(), lent.end(), loan.micro_batch), lent.end());
            EXPECT_NE(std::find(borrowed.begin(), borrowed.end(), loan.micro_batch),
                      borrowed.end());
          }
        }
      }
    }
  }
}

// A kill at the reduction of a step of 8 micro-batches over 4 ranks: the survivors hold their
// blocks whole, the spare would compute rank 2's two alone; it computes 4 and lends 5 to rank 0.
TEST(RingStepTest, AKillAtTheReductionLendsHalfTheLostBlock) {
  auto shares = PlanRingStep(8, std::vector<List>{{0, 1}, {2, 3}, {}, {6, 7}});
  ExpectEachMicroBatchOnce(8, shares);
  EXPECT_EQ(shares[2].compute, List{4});
  EXPECT_EQ(shares[2].lent, List{5});
  EXPECT_EQ(shares[0].borrowed, List{5});
  EXPECT_TRUE(shares[1].borrowed.empty());
  EXPECT_EQ(LoansOf(shares), (std::vector<Loan>{{5, 2, 0}}));
  // --no-loans: the spare computes the lost block whole
  shares = PlanRingStep(8, std::vector<List>{{0, 1}, {2, 3}, {}, {6, 7}}, /*lend=*/false);
  EXPECT_EQ(shares[2].compute, (List{4, 5}));
  EXPECT_TRUE(LoansOf(shares).empty());
  // nothing kept (a kill as the step starts, or no fault): nothing lent
  for (int world : {3, 4}) {
    shares = PlanRingStep(13, std::vector<List>(static_cast<size_t>(world)));
    EXPECT_TRUE(LoansOf(shares).empty()) << world;
  }
}

// A shrink 4 → 3 after a kill at the reduction: the survivors keep their old blocks whole and
// the lost block is dealt over them.
TEST(RingStepTest, AfterAShrinkTheMicroBatchesNobodyHoldsAreDealtOverTheMembers) {
  const int m = 8;
  // old world 4, rank 3 lost: the survivors (new ranks 0, 1, 2) hold old blocks 0, 1, 2
  std::vector<List> offered = {{0, 1}, {2, 3}, {4, 5}};
  auto shares = PlanRingStep(m, offered);
  ExpectEachMicroBatchOnce(m, shares);
  for (size_t q = 0; q < 3; ++q) EXPECT_EQ(shares[q].kept, offered[q]);
  EXPECT_EQ(shares[0].compute, List{});
  EXPECT_EQ(shares[1].compute, List{6});
  EXPECT_EQ(shares[2].compute, List{7});
  // cut mid-step: each survivor holds the first micro-batch of its old block
  shares = PlanRingStep(m, std::vector<List>{{0}, {2}, {4}});
  ExpectEachMicroBatchOnce(m, shares);
  EXPECT_EQ(shares[0].compute, List{1});
  EXPECT_EQ(shares[1].compute, (List{3, 5}));
  EXPECT_EQ(shares[2].compute, (List{6, 7}));
  // every old world, lost rank and prefix: each micro-batch once, the offers kept
  for (int old_world : {2, 3, 4, 5}) {
    for (int lost = 0; lost < old_world; ++lost) {
      for (int done = 0; done <= 2; ++done) {
        std::vector<List> survivors;
        for (int q = 0; q < old_world; ++q) {
          if (q == lost) continue;
          List block = BlockOf(13, old_world, q);
          survivors.emplace_back(block.begin(),
                                 block.begin() + std::min<size_t>(block.size(), done));
        }
        auto s = PlanRingStep(13, survivors);
        ExpectEachMicroBatchOnce(13, s);
        for (size_t q = 0; q < survivors.size(); ++q) EXPECT_EQ(s[q].kept, survivors[q]);
      }
    }
  }
}

TEST(RingStepTest, ALyingOfferKeepsNothing) {
  const int m = 8;
  // rank 1 claims micro-batch 1, which rank 0 keeps; rank 2 one out of range; rank 3 a duplicate
  auto shares = PlanRingStep(m, std::vector<List>{{0, 1}, {1, 2}, {9}, {6, 6}});
  ExpectEachMicroBatchOnce(m, shares);
  EXPECT_EQ(shares[0].kept, (List{0, 1}));
  EXPECT_TRUE(shares[1].kept.empty());
  EXPECT_TRUE(shares[2].kept.empty());
  EXPECT_TRUE(shares[3].kept.empty());
  EXPECT_EQ(shares[1].compute, (List{2, 3})) << "rank 0's prefix is the fault-free order";
}

TEST(RingStepTest, MicroBatchSetsRoundTripThroughTreeNodes) {
  for (const List& set : {List{}, List{0}, List{2, 3}, List{0, 1, 2, 3, 4}, List{1, 4, 5, 6, 12}}) {
    auto nodes = NodesOfMicroBatches(13, set);
    EXPECT_EQ(MicroBatchesOfNodes(13, nodes), set);
  }
  EXPECT_TRUE(MicroBatchesOfNodes(8, std::vector<collective::TreeNode>{{1, 0}, {0, 1}}).empty())
      << "overlapping nodes";
  EXPECT_TRUE(MicroBatchesOfNodes(8, std::vector<collective::TreeNode>{{0, 9}}).empty())
      << "not a node of the tree over 8";
}

}  // namespace
}  // namespace nonstop::worker
