#include "nonstop/elastic.h"

#include <gtest/gtest.h>

#include <cmath>

namespace nonstop::elastic {
namespace {

TEST(BatchPolicyTest, FixedModeKeepsBatchAndLearningRate) {
  EXPECT_EQ(GlobalBatch(BatchMode::kFixed, 32, 4, 3), 32u);
  EXPECT_EQ(LrFactor(BatchMode::kFixed, LrScaling::kLinear, 4, 2), 1.0);
}

TEST(BatchPolicyTest, ScaleWithWorldFollowsTheWorldLinearlyOrBySquareRoot) {
  EXPECT_EQ(GlobalBatch(BatchMode::kScaleWithWorld, 32, 2, 4), 64u);
  EXPECT_EQ(GlobalBatch(BatchMode::kScaleWithWorld, 32, 2, 3), 48u);
  EXPECT_DOUBLE_EQ(LrFactor(BatchMode::kScaleWithWorld, LrScaling::kLinear, 2, 4), 2.0);
  EXPECT_DOUBLE_EQ(LrFactor(BatchMode::kScaleWithWorld, LrScaling::kSqrt, 2, 4), std::sqrt(2.0));
}

TEST(BatchPolicyTest, WarmUpGoesLinearlyFromTheOldFactorToTheNew) {
  EXPECT_DOUBLE_EQ(WarmedFactor(1.0, 2.0, 9, 10, 4), 1.0);
  EXPECT_DOUBLE_EQ(WarmedFactor(1.0, 2.0, 10, 10, 4), 1.25);
  EXPECT_DOUBLE_EQ(WarmedFactor(1.0, 2.0, 12, 10, 4), 1.75);
  EXPECT_DOUBLE_EQ(WarmedFactor(1.0, 2.0, 13, 10, 4), 2.0);
  EXPECT_DOUBLE_EQ(WarmedFactor(2.0, 1.0, 100, 10, 4), 1.0);
  EXPECT_DOUBLE_EQ(WarmedFactor(1.0, 2.0, 10, 10, 0), 2.0);
}

TEST(BatchPolicyTest, BadNamesAreRefused) {
  EXPECT_FALSE(ParseBatchMode("elastic").ok());
  EXPECT_FALSE(ParseLrScaling("cubic").ok());
  EXPECT_TRUE(ParseBatchMode("scale-with-world").ok());
}

}  // namespace
}  // namespace nonstop::elastic
