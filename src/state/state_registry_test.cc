#include "state/state_registry.h"

#include <gtest/gtest.h>

#include <numeric>

namespace nonstop::state {
namespace {

struct Model {
  std::vector<float> params = std::vector<float>(1000);
  std::vector<float> moments = std::vector<float>(777);
  int64_t step = 0;
  void Register(StateRegistry* reg) {
    ASSERT_TRUE(reg->Register("params", std::as_writable_bytes(std::span(params))).ok());
    ASSERT_TRUE(reg->Register("adam.m", std::as_writable_bytes(std::span(moments))).ok());
    ASSERT_TRUE(reg->RegisterValue("step", &step).ok());
  }
};

TEST(StateRegistryTest, SnapshotLoadsInPlace) {
  Model a, b;
  std::iota(a.params.begin(), a.params.end(), 0.5f);
  std::iota(a.moments.begin(), a.moments.end(), -3.0f);
  a.step = 42;
  StateRegistry ra(1000), rb(1000);
  a.Register(&ra);
  b.Register(&rb);
  const float* where = b.params.data();
  ASSERT_TRUE(rb.Load(ra.Serialize()).ok());
  EXPECT_EQ(b.params, a.params);
  EXPECT_EQ(b.moments, a.moments);
  EXPECT_EQ(b.step, 42);
  EXPECT_EQ(b.params.data(), where) << "loaded in place";
  EXPECT_EQ(ra.Digest(), rb.Digest());
}

TEST(StateRegistryTest, CorruptChunkIsDataLossAndLoadsNothing) {
  Model a, b;
  a.params.assign(1000, 1.0f);
  StateRegistry ra(512), rb(512);
  a.Register(&ra);
  b.Register(&rb);
  std::string snap = ra.Serialize();
  snap[snap.size() - 100] ^= 1;
  Status s = rb.Load(snap);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("chunk"), std::string::npos);
  EXPECT_EQ(b.params[0], 0.0f) << "nothing loaded";
}

TEST(StateRegistryTest, LayoutMismatchNamesTheRegion) {
  Model a;
  StateRegistry ra, rb;
  a.Register(&ra);
  std::vector<float> other(999);
  int64_t step = 0;
  std::vector<float> m(777);
  ASSERT_TRUE(rb.Register("params", std::as_writable_bytes(std::span(other))).ok());
  ASSERT_TRUE(rb.Register("adam.m", std::as_writable_bytes(std::span(m))).ok());
  ASSERT_TRUE(rb.RegisterValue("step", &step).ok());
  Status s = rb.Load(ra.Serialize());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("params"), std::string::npos) << s.ToString();
}

TEST(StateRegistryTest, ChunksRoundTripThroughWriteChunk) {
  Model a, b;
  std::iota(a.params.begin(), a.params.end(), 1.0f);
  StateRegistry ra(300), rb(300);
  a.Register(&ra);
  b.Register(&rb);
  for (const ChunkInfo& c : ra.Chunks()) {
    std::vector<std::byte> buf(c.size);
    ra.ReadChunk(c.index, buf);
    ASSERT_TRUE(rb.WriteChunk(c.index, buf, c.crc).ok());
  }
  EXPECT_EQ(b.params, a.params);
  std::vector<std::byte> junk(300);
  EXPECT_EQ(rb.WriteChunk(0, junk, 1234).code(), StatusCode::kDataLoss);
}

TEST(StateRegistryTest, DuplicateNameIsRejected) {
  StateRegistry r;
  int64_t x = 0;
  ASSERT_TRUE(r.RegisterValue("x", &x).ok());
  EXPECT_EQ(r.RegisterValue("x", &x).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nonstop::state
