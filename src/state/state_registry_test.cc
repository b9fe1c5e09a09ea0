#include "state/state_registry.h"

#include <gtest/gtest.h>

#include <numeric>
#include <utility>

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

// Copies every chunk of `from` into `to` as a state transfer does: read,
// then written in place after its checksum is verified.
void CopyByChunks(const StateRegistry& from, StateRegistry& to) {
  for (const ChunkInfo& c : from.Chunks()) {
    std::vector<std::byte> buf(c.size);
    from.ReadChunk(c.index, buf);
    ASSERT_TRUE(to.WriteChunk(c.index, buf, c.crc).ok()) << "chunk " << c.index;
  }
}

TEST(StateRegistryTest, ChunksLoadInPlace) {
  Model a, b;
  std::iota(a.params.begin(), a.params.end(), 0.5f);
  std::iota(a.moments.begin(), a.moments.end(), -3.0f);
  a.step = 42;
  StateRegistry ra(1000), rb(1000);
  a.Register(&ra);
  b.Register(&rb);
  const float* where = b.params.data();
  CopyByChunks(ra, rb);
  EXPECT_EQ(b.params, a.params);
  EXPECT_EQ(b.moments, a.moments);
  EXPECT_EQ(b.step, 42);
  EXPECT_EQ(b.params.data(), where) << "loaded in place";
  EXPECT_EQ(ra.Digest(), rb.Digest());
}

// What the state transfer sends from and receives into: a chunk inside one
// region is that region's own bytes; one across a region's end has no such view.
TEST(StateRegistryTest, ContiguousChunkIsTheLiveBytesOfAChunkInsideOneRegion) {
  Model m;
  StateRegistry reg(1024);  // params: 4000 bytes, chunks 0-2 inside, chunk 3 across into adam.m
  m.Register(&reg);
  std::span<std::byte> first = reg.ContiguousChunk(0);
  ASSERT_EQ(first.size(), 1024u);
  EXPECT_EQ(first.data(), reinterpret_cast<std::byte*>(m.params.data()));
  std::span<std::byte> third = reg.ContiguousChunk(2);
  EXPECT_EQ(third.data(), reinterpret_cast<std::byte*>(m.params.data()) + 2048);
  EXPECT_TRUE(reg.ContiguousChunk(3).empty()) << "bytes 3072-4095 span params and adam.m";
  const uint32_t last = reg.num_chunks() - 1;  // the end of adam.m and the step
  EXPECT_TRUE(reg.ContiguousChunk(last).empty());
  std::span<const std::byte> inside_m = std::as_const(reg).ContiguousChunk(4);
  EXPECT_EQ(inside_m.data(),
            reinterpret_cast<const std::byte*>(m.moments.data()) + 96);  // 4096 - 4000
  EXPECT_EQ(inside_m.size(), 1024u);
}

TEST(StateRegistryTest, CorruptChunkIsDataLossAndWritesNothing) {
  Model a, b;
  std::iota(a.params.begin(), a.params.end(), 1.0f);
  StateRegistry ra(300), rb(300);
  a.Register(&ra);
  b.Register(&rb);
  std::vector<std::byte> buf(ra.chunk_size(0));
  ra.ReadChunk(0, buf);
  const uint32_t crc = ra.Chunks()[0].crc;
  buf[7] ^= std::byte{1};
  Status s = rb.WriteChunk(0, buf, crc);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("chunk 0"), std::string::npos) << s.ToString();
  EXPECT_EQ(b.params[1], 0.0f) << "nothing written";
}

TEST(StateRegistryTest, ShapeThatIsNotTheValuesIsRejected) {
  std::vector<float> w(600);
  StateRegistry r;
  Status s = r.RegisterFloats("w", w, {20, 31});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("[20, 31]"), std::string::npos) << s.ToString();
  EXPECT_EQ(r.RegisterFloats("w", w, {-20, -30}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.RegisterFloats("w", w, {INT64_MAX, INT64_MAX, 4}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(r.regions().empty());
  EXPECT_TRUE(r.RegisterFloats("w", w, {20, 30}).ok());
  EXPECT_TRUE(r.RegisterFloats("v", w).ok());
}

TEST(StateRegistryTest, DuplicateNameIsRejected) {
  StateRegistry r;
  int64_t x = 0;
  ASSERT_TRUE(r.RegisterValue("x", &x).ok());
  EXPECT_EQ(r.RegisterValue("x", &x).code(), StatusCode::kInvalidArgument);
}

// Sharded state (docs/sharding.md): the layout a shard-aware transfer relies on.
struct ShardedModel {
  static constexpr int kGroup = 3;
  std::vector<float> params = std::vector<float>(300);  // whole, padded to a multiple of 3
  std::vector<float> m = std::vector<float>(100), v = std::vector<float>(100);
  int64_t step = 0;
  Status Register(StateRegistry* reg) {
    NONSTOP_RETURN_IF_ERROR(reg->RegisterValue("step", &step));
    NONSTOP_RETURN_IF_ERROR(reg->RegisterShardView("params", params, kGroup));
    NONSTOP_RETURN_IF_ERROR(reg->RegisterShard("m", m, kGroup));
    return reg->RegisterShard("v", v, kGroup);
  }
};

TEST(StateRegistryTest, ChunksNeverMixShardedAndReplicatedBytes) {
  ShardedModel a;
  StateRegistry reg(256);
  ASSERT_TRUE(a.Register(&reg).ok());
  EXPECT_EQ(reg.shard_group(), 3);
  EXPECT_EQ(reg.held_shard(), kEveryShard) << "the initial state is every shard's";
  EXPECT_EQ(reg.sharded_bytes(), 3u * 400);
  EXPECT_EQ(reg.total_bytes(), 8u + 3 * 400);
  auto chunks = reg.Chunks();
  ASSERT_FALSE(chunks.empty());
  EXPECT_FALSE(chunks[0].sharded);
  EXPECT_EQ(chunks[0].size, 8u)
      << "the step is a chunk of its own, not the first bytes of the parameters' shard";
  uint64_t sharded = 0, at = 0;
  for (const auto& c : chunks) {
    EXPECT_EQ(c.offset, at) << "chunk " << c.index;
    at += c.size;
    if (c.sharded) {
      EXPECT_GE(c.offset, 8u) << "chunk " << c.index;
      sharded += c.size;
    }
    EXPECT_LE(c.size, 256u);
  }
  EXPECT_EQ(at, reg.total_bytes());
  EXPECT_EQ(sharded, reg.sharded_bytes());
}

TEST(StateRegistryTest, BindShardMovesTheViewsAndKeepsOwnMemory) {
  ShardedModel a;
  std::iota(a.params.begin(), a.params.end(), 0.0f);
  std::fill(a.m.begin(), a.m.end(), 5.0f);
  StateRegistry reg(256);
  ASSERT_TRUE(a.Register(&reg).ok());
  ASSERT_TRUE(reg.BindShard(2).ok());
  EXPECT_EQ(reg.held_shard(), 2);
  const Region& params = reg.regions()[1];
  EXPECT_EQ(reinterpret_cast<const float*>(params.bytes.data()), a.params.data() + 200)
      << "shard 2 of 3";
  EXPECT_EQ(params.bytes.size(), 100 * sizeof(float));
  EXPECT_EQ(reinterpret_cast<const float*>(reg.regions()[2].bytes.data()), a.m.data())
      << "own memory stays";
  EXPECT_EQ(reg.BindShard(3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.BindShard(-1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.held_shard(), 2) << "a refused bind changes nothing";
  // A view becomes the shard's own memory (a resumed checkpoint's whole buffer freed).
  std::vector<float> own(100, 1.0f);
  ASSERT_TRUE(reg.RebindShard("params", own).ok());
  ASSERT_TRUE(reg.BindShard(0).ok());
  EXPECT_EQ(reinterpret_cast<const float*>(reg.regions()[1].bytes.data()), own.data());
  EXPECT_EQ(reg.RebindShard("params", std::span(own).first(99)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RebindShard("step", own).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RebindShard("nothing", own).code(), StatusCode::kNotFound);
}

TEST(StateRegistryTest, AdoptShardKeepsTheHeldShardOfAViewInOwnMemory) {
  ShardedModel a;
  std::iota(a.params.begin(), a.params.end(), 0.0f);
  StateRegistry reg(256);
  ASSERT_TRUE(a.Register(&reg).ok());
  std::vector<float> own(100, -1.0f);
  EXPECT_EQ(reg.AdoptShard("params", own).code(), StatusCode::kFailedPrecondition)
      << "no shard bound yet";
  EXPECT_EQ(own[0], -1.0f);
  ASSERT_TRUE(reg.BindShard(1).ok());
  EXPECT_EQ(reg.AdoptShard("m", own).code(), StatusCode::kInvalidArgument) << "own memory already";
  EXPECT_EQ(reg.AdoptShard("params", std::span(own).first(99)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.AdoptShard("nothing", own).code(), StatusCode::kNotFound);
  EXPECT_EQ(own[0], -1.0f) << "a refused adoption copies nothing";
  const std::string digest = reg.Digest();
  ASSERT_TRUE(reg.AdoptShard("params", own).ok());
  EXPECT_EQ(own[0], 100.0f) << "shard 1 of 3";
  EXPECT_EQ(own[99], 199.0f);
  EXPECT_EQ(reinterpret_cast<const float*>(reg.regions()[1].bytes.data()), own.data());
  EXPECT_EQ(reg.Digest(), digest) << "the state is the same bytes, in other memory";
  std::fill(a.params.begin(), a.params.end(), 7.0f);
  EXPECT_EQ(reg.Digest(), digest) << "the whole buffer is no longer state";
}

TEST(StateRegistryTest, ShardedChunksLoadInPlace) {
  ShardedModel a, b;
  std::iota(a.params.begin(), a.params.end(), 1.0f);
  std::iota(a.v.begin(), a.v.end(), -7.0f);
  a.step = 9;
  StateRegistry ra(100), rb(100);
  ASSERT_TRUE(a.Register(&ra).ok());
  ASSERT_TRUE(b.Register(&rb).ok());
  ASSERT_TRUE(ra.BindShard(1).ok());
  ASSERT_TRUE(rb.BindShard(1).ok());
  CopyByChunks(ra, rb);
  EXPECT_EQ(b.step, 9);
  EXPECT_EQ(b.v, a.v);
  EXPECT_EQ(std::vector<float>(b.params.begin() + 100, b.params.begin() + 200),
            std::vector<float>(a.params.begin() + 100, a.params.begin() + 200));
  EXPECT_EQ(b.params[0], 0.0f) << "only the held shard of the view is state";
  EXPECT_EQ(ra.Digest(), rb.Digest());
}

TEST(StateRegistryTest, ShardedRegionsThatCannotBeLaidOutAreRefused) {
  std::vector<float> whole(10), other(5);
  StateRegistry r;
  Status s = r.RegisterShardView("params", whole, 3);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("pad"), std::string::npos) << s.ToString();
  EXPECT_EQ(r.RegisterShard("m", other, 0).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(r.RegisterShard("m", other, 2).ok());
  s = r.RegisterShard("v", other, 4);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("groups of 2"), std::string::npos) << s.ToString();
  StateRegistry none;
  EXPECT_EQ(none.BindShard(0).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace nonstop::state
