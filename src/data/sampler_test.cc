#include "nonstop/data.h"

#include <gtest/gtest.h>

#include <set>

namespace nonstop::data {
namespace {

Sampler Make(uint64_t n, uint64_t b, uint64_t m, uint64_t seed = 42) {
  auto s = Sampler::Create({n, seed, b, m});
  NONSTOP_CHECK(s.ok()) << s.status().ToString();
  return std::move(*s);
}

TEST(SamplerTest, EachEpochVisitsEverySampleOnce) {
  Sampler s = Make(1000, 40, 8);
  std::set<uint64_t> seen;
  for (uint64_t step = 0; step < 25; ++step) {
    for (uint64_t mb = 0; mb < s.micro_batches_per_step(); ++mb) {
      for (uint64_t x : s.MicroBatchSamples(step, mb)) EXPECT_TRUE(seen.insert(x).second) << x;
    }
  }
  EXPECT_EQ(seen.size(), 1000u);
}

TEST(SamplerTest, BatchDependsOnlyOnSeedAndStep) {
  Sampler a = Make(500, 32, 4);
  Sampler b = Make(500, 32, 4);
  // b is asked in a different order (as after a fault): same answers.
  auto late = b.MicroBatchSamples(40, 3);
  auto early = b.MicroBatchSamples(2, 1);
  EXPECT_EQ(a.MicroBatchSamples(2, 1), early);
  EXPECT_EQ(a.MicroBatchSamples(40, 3), late);
  Sampler c = Make(500, 32, 4, /*seed=*/43);
  EXPECT_NE(c.MicroBatchSamples(2, 1), early);
}

TEST(SamplerTest, MicroBatchesAreDealtAsEvenContiguousBlocks) {
  Sampler s = Make(1000, 28, 4);  // 7 micro-batches
  for (int w : {1, 2, 3, 4, 5, 7, 8}) {
    uint64_t next = 0;
    for (int r = 0; r < w; ++r) {
      auto [lo, hi] = s.MicroBatchesFor(r, w);
      EXPECT_EQ(lo, next) << "contiguous";
      uint64_t n = hi - lo;
      EXPECT_TRUE(n == 7 / static_cast<uint64_t>(w) || n == 7 / static_cast<uint64_t>(w) + 1)
          << "even";
      next = hi;
    }
    EXPECT_EQ(next, 7u) << "all dealt at world size " << w;
  }
}

TEST(SamplerTest, RejectsBadShapes) {
  EXPECT_FALSE(Sampler::Create({100, 1, 30, 4}).ok());
  EXPECT_FALSE(Sampler::Create({0, 1, 8, 4}).ok());
  EXPECT_FALSE(Sampler::Create({100, 1, 8, 0}).ok());
}

}  // namespace
}  // namespace nonstop::data
