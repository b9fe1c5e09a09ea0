// The offers members exchange to salvage a step in flight (tree_step.h): a
// record says what a rank holds of one step, and a malformed or stale one
// offers nothing.
#include "worker/tree_step.h"

#include <gtest/gtest.h>

#include <vector>

namespace nonstop::worker {
namespace {

using collective::TreeNode;

TEST(TreeStepTest, AnOfferRoundTripsForItsStepAndOffersNothingForAnother) {
  HeldSums held;
  held.step = 41;
  held.nodes = {{2, 0}, {0, 4}, {1, 3}};
  std::vector<std::byte> record(kOfferBytes);
  EncodeOffer(held, 41, record);
  EXPECT_EQ(DecodeOffer(record, 41), held.nodes);
  EXPECT_TRUE(DecodeOffer(record, 42).empty()) << "sums of step 41 are no use to step 42";
  EncodeOffer(held, 42, record);
  EXPECT_TRUE(DecodeOffer(record, 42).empty()) << "a rank that holds another step offers nothing";
  EXPECT_TRUE(DecodeOffer(std::vector<std::byte>(kOfferBytes - 8), 41).empty()) << "a short record";
}

TEST(TreeStepTest, MalformedOffersOfferNothing) {
  HeldSums held;
  held.step = 7;
  held.nodes = {{0, 1}};
  std::vector<std::byte> record(kOfferBytes);
  EncodeOffer(held, 7, record);
  auto corrupt = [&](size_t word, int64_t v) {
    std::vector<std::byte> r = record;
    for (size_t b = 0; b < 8; ++b)
      r[word * 8 + b] = static_cast<std::byte>((static_cast<uint64_t>(v) >> (8 * b)) & 0xff);
    return DecodeOffer(r, 7);
  };
  EXPECT_EQ(corrupt(1, 1), (std::vector<TreeNode>{{0, 1}}));
  EXPECT_TRUE(corrupt(1, -1).empty()) << "a negative count";
  EXPECT_TRUE(corrupt(1, static_cast<int64_t>(kMaxOfferedNodes) + 1).empty())
      << "more nodes than a record holds";
  EXPECT_TRUE(corrupt(2, -3).empty()) << "a negative level";
  EXPECT_TRUE(corrupt(3, int64_t{1} << 40).empty()) << "an index no tree here has";
}

TEST(TreeStepTest, MoreHeldNodesThanARecordHoldsOffersNothingInsteadOfPart) {
  HeldSums held;
  held.step = 3;
  for (int i = 0; i <= static_cast<int>(kMaxOfferedNodes); ++i) held.nodes.push_back({0, i});
  std::vector<std::byte> record(kOfferBytes);
  EncodeOffer(held, 3, record);
  EXPECT_TRUE(DecodeOffer(record, 3).empty());
}

TEST(TreeStepTest, KeepOnlyLeavesTheKeptSumsOfTheStepAndNothingOfAnother) {
  HeldSums held;
  held.step = 5;
  held.nodes = {{1, 0}, {0, 2}, {0, 3}};
  held.partials = {{1.0f}, {2.0f}, {3.0f}};
  HeldSums copy = held;
  std::vector<TreeNode> kept = {{1, 0}, {0, 3}};
  KeepOnly(&copy, 5, kept);
  EXPECT_EQ(copy.step, 5);
  EXPECT_EQ(copy.nodes, kept);
  EXPECT_EQ(copy.partials, (std::vector<std::vector<float>>{{1.0f}, {3.0f}}));
  KeepOnly(&held, 6, kept);
  EXPECT_EQ(held.step, -1) << "sums of step 5 are none of step 6";
  EXPECT_TRUE(held.nodes.empty());
  EXPECT_TRUE(held.partials.empty());
}

TEST(TreeStepTest, CollectSumsOrdersKeptAndFoldedSumsOverTheMicroBatches) {
  const int m = 8;
  HeldSums kept;
  kept.step = 9;
  kept.nodes = {{1, 2}};  // micro-batches 4-5, kept from the step in flight
  kept.partials = {{45.0f}};
  std::vector<collective::TreeFolder> folders;
  folders.emplace_back(m, 6, 8, 1);  // a run it computed again, whole
  for (float x : {6.0f, 7.0f}) folders.back().Add(std::span<const float>(&x, 1));
  folders.emplace_back(m, 0, 3, 1);  // a run cut short after two micro-batches
  for (float x : {0.0f, 1.0f}) folders.back().Add(std::span<const float>(&x, 1));
  HeldSums have = CollectSums(m, 9, std::move(kept), &folders);
  EXPECT_EQ(have.step, 9);
  EXPECT_EQ(have.nodes, (std::vector<TreeNode>{{1, 0}, {1, 2}, {1, 3}}));
  EXPECT_EQ(have.partials, (std::vector<std::vector<float>>{{1.0f}, {45.0f}, {13.0f}}));
  std::vector<collective::TreeShare> shares(2);
  shares[1].nodes = {{0, 5}, {2, 1}};
  EXPECT_EQ(NodeLists(shares),
            (std::vector<std::vector<std::pair<int, int>>>{{}, {{0, 5}, {2, 1}}}));
}

}  // namespace
}  // namespace nonstop::worker
