#include "state/state_registry.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <numeric>

#include "common/coding.h"
#include "common/crc32c.h"

// An allocation probe for this test binary: while a test sets
// g_allocation_limit, any single allocation larger than it is refused with
// std::bad_alloc (and its size recorded) instead of being made. It lets a test
// show that a lying size does not reach the allocator, without allocating it.
namespace {
std::atomic<size_t> g_allocation_limit{SIZE_MAX};
std::atomic<size_t> g_refused_allocation{0};
}  // namespace

void* operator new(std::size_t n) {
  if (n > g_allocation_limit.load(std::memory_order_relaxed)) {
    g_refused_allocation.store(n);
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

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

// A snapshot of `reg`'s layout whose chunk table says what the caller wants,
// with a header CRC that matches: only the layout checks can refuse it.
std::string CraftSnapshot(const StateRegistry& reg, uint64_t chunk_bytes, uint32_t nchunks,
                          const std::vector<uint32_t>& crcs, std::string_view data) {
  std::string out("NSSTATE1", 8);
  PutFixed32(&out, static_cast<uint32_t>(reg.regions().size()));
  for (const auto& r : reg.regions()) {
    PutFixed16(&out, static_cast<uint16_t>(r.name.size()));
    out += r.name;
    PutFixed64(&out, r.bytes.size());
  }
  PutFixed64(&out, chunk_bytes);
  PutFixed32(&out, nchunks);
  for (uint32_t c : crcs) PutFixed32(&out, c);
  PutFixed32(&out, Crc32c(out));
  out += data;
  return out;
}

// Loads `snap` while every allocation over 1 MiB is refused; `too_much`: one was tried.
Status LoadWithSmallAllocations(StateRegistry& reg, const std::string& snap, bool* too_much) {
  Status s;
  g_allocation_limit = 1 << 20;
  try {
    s = reg.Load(snap);
  } catch (const std::bad_alloc&) {
    *too_much = true;
  }
  g_allocation_limit = SIZE_MAX;
  return s;
}

TEST(StateRegistryTest, LyingChunkCountIsRefusedWithoutAllocatingIt) {
  Model b;
  StateRegistry rb(512);
  b.Register(&rb);
  // 2^32-1 chunks of one byte, and no chunk table at all: believing the count
  // means allocating 16 GiB for checksums that are not there.
  std::string snap = CraftSnapshot(rb, /*chunk_bytes=*/1, /*nchunks=*/UINT32_MAX, {}, "");
  bool too_much = false;
  Status s = LoadWithSmallAllocations(rb, snap, &too_much);
  ASSERT_FALSE(too_much) << "Load tried to allocate " << g_refused_allocation.load() << " bytes for a " << snap.size()
                         << "-byte snapshot of a " << rb.total_bytes() << "-byte state";
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("4294967295"), std::string::npos) << "names the lying count: " << s.ToString();
  EXPECT_NE(s.message().find("7116"), std::string::npos) << "names the state's size: " << s.ToString();
}

TEST(StateRegistryTest, LyingSmallChunkSizeOfALargeStateIsRefusedWithoutTilingIt) {
  std::vector<std::byte> big(8 << 20);  // a chunk table of 1-byte chunks for it would take 200 MB
  StateRegistry rb;
  ASSERT_TRUE(rb.Register("big", big).ok());
  std::string snap = CraftSnapshot(rb, /*chunk_bytes=*/1, /*nchunks=*/UINT32_MAX, {}, "");
  bool too_much = false;
  Status s = LoadWithSmallAllocations(rb, snap, &too_much);
  ASSERT_FALSE(too_much) << "Load tried to allocate " << g_refused_allocation.load() << " bytes";
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
}

TEST(StateRegistryTest, ChunkSizeThatOverflowsCannotSkipTheChecksums) {
  Model a, b;
  a.params.assign(1000, 1.0f);
  StateRegistry ra(512), rb(512);
  a.Register(&ra);
  b.Register(&rb);
  std::string snap = ra.Serialize();
  std::string data = snap.substr(snap.size() - ra.total_bytes());
  data[0] ^= 0x7f;  // corrupt state, vouched for by no checksum:
  // with a chunk size of 2^64-1, ceil(total / chunk) computed as
  // (total + chunk - 1) / chunk wraps to 0, the count this header claims.
  std::string lie = CraftSnapshot(rb, /*chunk_bytes=*/UINT64_MAX, /*nchunks=*/0, {}, data);
  Status s = rb.Load(lie);
  EXPECT_FALSE(s.ok()) << "loaded a state that no chunk checksum covers";
  EXPECT_EQ(b.params[0], 0.0f) << "nothing loaded";
}

TEST(StateRegistryTest, ZeroChunkSizeIsRefusedByName) {
  Model b;
  StateRegistry rb(512);
  b.Register(&rb);
  Status s = rb.Load(CraftSnapshot(rb, /*chunk_bytes=*/0, /*nchunks=*/0, {}, std::string(rb.total_bytes(), '\0')));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("chunk size 0"), std::string::npos) << s.ToString();
}

TEST(StateRegistryTest, EveryTruncationOfASnapshotIsRefusedAndLoadsNothing) {
  Model a, b;
  a.params.assign(1000, 2.0f);
  StateRegistry ra(2048), rb(2048);
  a.Register(&ra);
  b.Register(&rb);
  std::string snap = ra.Serialize();
  for (size_t n = 0; n < snap.size(); n += (n < 200 ? 1 : 97)) {
    std::string prefix = snap.substr(0, n);
    EXPECT_FALSE(rb.Load(prefix).ok()) << "accepted a " << n << "-byte prefix";
  }
  EXPECT_EQ(b.params[0], 0.0f) << "nothing loaded";
}

TEST(StateRegistryTest, ShapeThatIsNotTheValuesIsRejected) {
  std::vector<float> w(600);
  StateRegistry r;
  Status s = r.RegisterFloats("w", w, {20, 31});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("'w'"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("[20, 31]"), std::string::npos) << s.ToString();
  EXPECT_EQ(r.RegisterFloats("w", w, {-20, -30}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.RegisterFloats("w", w, {INT64_MAX, INT64_MAX, 4}).code(), StatusCode::kInvalidArgument);
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
  EXPECT_EQ(chunks[0].size, 8u) << "the step is a chunk of its own, not the first bytes of the parameters' shard";
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
  EXPECT_EQ(reinterpret_cast<const float*>(params.bytes.data()), a.params.data() + 200) << "shard 2 of 3";
  EXPECT_EQ(params.bytes.size(), 100 * sizeof(float));
  EXPECT_EQ(reinterpret_cast<const float*>(reg.regions()[2].bytes.data()), a.m.data()) << "own memory stays";
  EXPECT_EQ(reg.BindShard(3).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.BindShard(-1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.held_shard(), 2) << "a refused bind changes nothing";
  // A view becomes the shard's own memory (a resumed checkpoint's whole buffer freed).
  std::vector<float> own(100, 1.0f);
  ASSERT_TRUE(reg.RebindShard("params", own).ok());
  ASSERT_TRUE(reg.BindShard(0).ok());
  EXPECT_EQ(reinterpret_cast<const float*>(reg.regions()[1].bytes.data()), own.data());
  EXPECT_EQ(reg.RebindShard("params", std::span(own).first(99)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RebindShard("step", own).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.RebindShard("nothing", own).code(), StatusCode::kNotFound);
}

TEST(StateRegistryTest, ShardedSnapshotLoadsInPlace) {
  ShardedModel a, b;
  std::iota(a.params.begin(), a.params.end(), 1.0f);
  std::iota(a.v.begin(), a.v.end(), -7.0f);
  a.step = 9;
  StateRegistry ra(100), rb(100);
  ASSERT_TRUE(a.Register(&ra).ok());
  ASSERT_TRUE(b.Register(&rb).ok());
  ASSERT_TRUE(ra.BindShard(1).ok());
  ASSERT_TRUE(rb.BindShard(1).ok());
  ASSERT_TRUE(rb.Load(ra.Serialize()).ok());
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
