// Device regions in the state registry (nonstop/state.h, issue 30): through a
// stand-in device whose memory this process cannot touch
// (protected_device_testing.h), so that reading a device region's bytes in
// place instead of through its DeviceMemory crashes the test.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "common/temp_dir.h"
#include "nonstop/crc32c.h"
#include "state/checkpoint.h"
#include "state/protected_device_testing.h"
#include "state/state_registry.h"

namespace nonstop::state {
namespace {

// "w" (fp32, 3000 values), a step counter and "h" (host memory, 4 KiB); w on the stand-in device
// or in host memory.
struct Model {
  explicit Model(std::shared_ptr<ProtectedDevice> device = nullptr) : reg(1024) {
    std::vector<float> init(3000);
    std::iota(init.begin(), init.end(), 0.25f);
    if (device) {
      w_device = device->Allocate(init.size() * sizeof(float));
      NONSTOP_CHECK(device
                        ->ToDevice(w_device.data(), reinterpret_cast<std::byte*>(init.data()),
                                   w_device.size())
                        .ok());
      NONSTOP_CHECK(reg.RegisterOnDevice("w", w_device, device, "F32", {30, 100}).ok());
    } else {
      w_host = init;
      NONSTOP_CHECK(reg.RegisterFloats("w", w_host, {30, 100}).ok());
    }
    NONSTOP_CHECK(reg.RegisterValue("step", &step).ok());
    NONSTOP_CHECK(reg.RegisterFloats("h", h).ok());
  }
  std::vector<float> W() const {
    std::vector<float> out(3000);
    reg.ReadRegion(0, 0, std::as_writable_bytes(std::span(out)));
    return out;
  }
  std::span<std::byte> w_device;
  std::vector<float> w_host;
  int64_t step = 7;
  std::vector<float> h = std::vector<float>(1024, 2.0f);
  StateRegistry reg;
};

TEST(DeviceRegionTest, ChunksDigestAndReadsAreThoseOfTheSameBytesInHostMemory) {
  auto device = std::make_shared<ProtectedDevice>();
  Model on_device(device), on_host;
  ASSERT_EQ(on_device.reg.num_chunks(), on_host.reg.num_chunks());
  EXPECT_EQ(on_device.reg.Digest(), on_host.reg.Digest());
  auto a = on_device.reg.Chunks(), b = on_host.reg.Chunks();
  for (size_t c = 0; c < a.size(); ++c) {
    EXPECT_EQ(a[c].crc, b[c].crc) << "chunk " << c;
    std::vector<std::byte> x(a[c].size), y(b[c].size);
    on_device.reg.ReadChunk(static_cast<uint32_t>(c), x);
    on_host.reg.ReadChunk(static_cast<uint32_t>(c), y);
    EXPECT_EQ(x, y) << "chunk " << c;
  }
  const int before = device->copies();
  EXPECT_EQ(on_device.reg.RegionCrc(0), on_host.reg.RegionCrc(0));
  EXPECT_GT(device->copies(), before);
}

TEST(DeviceRegionTest, ADeviceChunkIsNeverContiguousAndWriteChunkLandsOnTheDevice) {
  auto device = std::make_shared<ProtectedDevice>();
  Model on_device(device), on_host;
  // w's chunks are on the device: staged, never handed out in place; h's lie in host memory
  int in_place = 0;
  for (uint32_t c = 0; c < on_device.reg.num_chunks(); ++c) {
    const ChunkInfo info = on_device.reg.Chunks()[c];
    const bool touches_w = info.offset < 12'000;
    const bool within_h = info.offset >= 12'008 && info.offset + info.size <= 16'104;
    EXPECT_EQ(on_device.reg.ContiguousChunk(c).empty(), touches_w || !within_h) << "chunk " << c;
    in_place += within_h ? 1 : 0;
  }
  EXPECT_GE(in_place, 3) << "h's chunks are handed out in place";
  // chunk 1 from another state, written in: the device's memory holds it
  std::vector<float> other(256, -3.5f);
  auto bytes = std::as_bytes(std::span(other));
  ASSERT_TRUE(on_device.reg.WriteChunk(1, bytes, Crc32c(bytes.data(), bytes.size())).ok());
  std::vector<float> w = on_device.W();
  EXPECT_EQ(w[255], 255.25f);
  EXPECT_EQ(w[256], -3.5f);
  EXPECT_EQ(w[511], -3.5f);
  EXPECT_EQ(w[512], 512.25f);
  // a chunk that fails its checksum changes nothing
  std::vector<float> bad(256, 9.0f);
  auto bad_bytes = std::as_bytes(std::span(bad));
  EXPECT_EQ(on_device.reg.WriteChunk(2, bad_bytes, 1234).code(), StatusCode::kDataLoss);
  EXPECT_EQ(on_device.W()[600], 600.25f);
}

TEST(DeviceRegionTest, RegisteringOnADeviceRefusesWhatItCannotDescribe) {
  auto device = std::make_shared<ProtectedDevice>();
  StateRegistry reg;
  std::span<std::byte> mem = device->Allocate(4096);
  auto no_device = reg.RegisterOnDevice("a", mem, nullptr);
  EXPECT_EQ(no_device.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_device.message().find("without a device"), std::string::npos);
  auto odd = reg.RegisterOnDevice("a", mem.first(4095), device, "F32");
  EXPECT_NE(odd.message().find("4095 bytes are not a whole number of F32 values"),
            std::string::npos)
      << odd.message();
  auto shape = reg.RegisterOnDevice("a", mem, device, "F32", {10, 10});
  EXPECT_NE(shape.message().find("shape [10, 10], which is not its 1024 values"), std::string::npos)
      << shape.message();
  auto dtype = reg.RegisterOnDevice("a", mem, device, "BF16");
  EXPECT_NE(dtype.message().find("dtype BF16 is not taken on a device (F32 or U8 are)"),
            std::string::npos)
      << dtype.message();
  EXPECT_TRUE(reg.regions().empty());
  EXPECT_TRUE(reg.RegisterOnDevice("a", mem, device).ok());
  EXPECT_EQ(reg.total_bytes(), 4096u);
}

TEST(DeviceRegionTest, ACheckpointOfDeviceStateLoadsOnTheDeviceOrInHostMemory) {
  TempDir dir;
  auto device = std::make_shared<ProtectedDevice>();
  Model saved(device);
  saved.step = 12;
  {
    CheckpointWriter writer(dir.path(), 2);
    CheckpointMeta meta;
    meta.step = 12;
    meta.recipe = "test";
    ASSERT_TRUE(writer.Save(saved.reg, meta).ok());
    ASSERT_TRUE(writer.Wait().ok());
  }
  Model to_device(device), to_host;
  std::vector<float> zeros(3000, 0.0f);
  to_device.reg.WriteRegion(0, 0, std::as_bytes(std::span(zeros)));
  to_host.w_host.assign(3000, 0.0f);
  for (Model* m : {&to_device, &to_host}) {
    auto loaded = LoadNewestCheckpoint(dir.path(), m->reg);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ(m->step, 12);
    EXPECT_EQ(m->W(), saved.W());
    EXPECT_EQ(m->reg.Digest(), saved.reg.Digest());
  }
}

// Sharded state on a device (RegisterShardView / RegisterShard with a device): a view of a whole
// buffer of 4 shards ("p", 4 × 600 values) and a shard of the device's own memory ("m", 600
// values), beside the same in host memory.
struct ShardedModel {
  explicit ShardedModel(std::shared_ptr<ProtectedDevice> device = nullptr) : reg(1024) {
    std::vector<float> whole(2400), moment(600);
    std::iota(whole.begin(), whole.end(), 0.5f);
    std::iota(moment.begin(), moment.end(), -7.0f);
    if (device) {
      p_device = device->Allocate(whole.size() * sizeof(float));
      m_device = device->Allocate(moment.size() * sizeof(float));
      NONSTOP_CHECK(device->ToDevice(p_device.data(), AsBytes(whole), p_device.size()).ok());
      NONSTOP_CHECK(device->ToDevice(m_device.data(), AsBytes(moment), m_device.size()).ok());
      NONSTOP_CHECK(reg.RegisterShardView("p", Floats(p_device), 4, device).ok());
      NONSTOP_CHECK(reg.RegisterShard("m", Floats(m_device), 4, device).ok());
    } else {
      p_host = whole;
      m_host = moment;
      NONSTOP_CHECK(reg.RegisterShardView("p", p_host, 4).ok());
      NONSTOP_CHECK(reg.RegisterShard("m", m_host, 4).ok());
    }
    NONSTOP_CHECK(reg.RegisterValue("step", &step).ok());
  }
  static const std::byte* AsBytes(const std::vector<float>& v) {
    return reinterpret_cast<const std::byte*>(v.data());
  }
  static std::span<float> Floats(std::span<std::byte> b) {
    return {reinterpret_cast<float*>(b.data()), b.size() / sizeof(float)};
  }
  std::vector<float> Region(size_t index, size_t values) const {
    std::vector<float> out(values);
    reg.ReadRegion(index, 0, std::as_writable_bytes(std::span(out)));
    return out;
  }
  std::span<std::byte> p_device, m_device;
  std::vector<float> p_host, m_host;
  int64_t step = 3;
  StateRegistry reg;
};

TEST(DeviceRegionTest, ShardedRegionsOnADeviceBindReadAndWriteAsInHostMemory) {
  auto device = std::make_shared<ProtectedDevice>();
  ShardedModel on_device(device), on_host;
  ASSERT_EQ(on_device.reg.num_chunks(), on_host.reg.num_chunks());
  for (int shard : {2, 0}) {
    ASSERT_TRUE(on_device.reg.BindShard(shard).ok());
    ASSERT_TRUE(on_host.reg.BindShard(shard).ok());
    EXPECT_EQ(on_device.reg.Digest(), on_host.reg.Digest()) << "shard " << shard;
    EXPECT_EQ(on_device.Region(0, 600)[0], 600.0f * static_cast<float>(shard) + 0.5f);
  }
  // what a holder of every shard serves of each, chunk by chunk (the whole buffer is on the device)
  for (uint32_t c = 0; c < on_device.reg.num_chunks(); ++c) {
    if (!on_device.reg.chunk_sharded(c)) continue;
    EXPECT_TRUE(on_device.reg.ContiguousChunk(c).empty()) << "device bytes are staged";
    for (int shard = 0; shard < 4; ++shard) {
      std::vector<std::byte> x(on_device.reg.chunk_size(c)), y(x.size());
      on_device.reg.ReadChunkOfShard(c, shard, x);
      on_host.reg.ReadChunkOfShard(c, shard, y);
      EXPECT_EQ(x, y) << "chunk " << c << " of shard " << shard;
    }
  }
  // a chunk of another member's state, written in, lands in the bound shard on the device
  std::vector<float> other(256, 42.0f);
  auto bytes = std::as_bytes(std::span(other));
  ASSERT_TRUE(on_device.reg.WriteChunk(0, bytes, Crc32c(bytes.data(), bytes.size())).ok());
  std::vector<float> whole(2400);
  ASSERT_TRUE(device
                  ->ToHost(reinterpret_cast<std::byte*>(whole.data()), on_device.p_device.data(),
                           on_device.p_device.size())
                  .ok());
  EXPECT_EQ(whole[0], 42.0f) << "shard 0's first chunk";
  EXPECT_EQ(whole[256], 256.5f);
  EXPECT_EQ(whole[600], 600.5f) << "shard 1 untouched";
}

TEST(DeviceRegionTest, AdoptShardCopiesADeviceViewsShardIntoDeviceMemoryOfItsOwn) {
  auto device = std::make_shared<ProtectedDevice>();
  ShardedModel m(device);
  ASSERT_TRUE(m.reg.BindShard(3).ok());
  const std::string digest = m.reg.Digest();
  std::span<std::byte> own = device->Allocate(600 * sizeof(float));
  ASSERT_TRUE(m.reg.AdoptShard("p", ShardedModel::Floats(own)).ok());
  EXPECT_EQ(m.reg.regions()[0].bytes.data(), own.data());
  EXPECT_TRUE(m.reg.regions()[0].whole.empty());
  EXPECT_EQ(m.reg.Digest(), digest) << "the same bytes, now in memory of its own";
  std::vector<float> copied(600);
  ASSERT_TRUE(
      device->ToHost(reinterpret_cast<std::byte*>(copied.data()), own.data(), own.size()).ok());
  EXPECT_EQ(copied[0], 1800.5f);
  EXPECT_EQ(copied[599], 2399.5f);
}

TEST(DeviceRegionTest, ACheckpointOfAShardOnADeviceLoadsOnTheDeviceOrInHostMemory) {
  TempDir dir;
  auto device = std::make_shared<ProtectedDevice>();
  ShardedModel saved(device);
  ASSERT_TRUE(saved.reg.BindShard(2).ok());
  {
    CheckpointWriter writer(dir.path(), 2);
    CheckpointMeta meta;
    meta.step = 3;
    meta.recipe = "test";
    ASSERT_TRUE(writer.Save(saved.reg, meta).ok());
    ASSERT_TRUE(writer.Wait().ok());
  }
  ShardedModel to_device(device), to_host;
  for (ShardedModel* m : {&to_device, &to_host}) {
    ASSERT_TRUE(m->reg.BindShard(2).ok());
    std::vector<float> zeros(600, 0.0f);
    m->reg.WriteRegion(0, 0, std::as_bytes(std::span(zeros)));
    m->reg.WriteRegion(1, 0, std::as_bytes(std::span(zeros)));
    ASSERT_NE(m->reg.Digest(), saved.reg.Digest());
    auto loaded = LoadNewestCheckpoint(dir.path(), m->reg);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    EXPECT_EQ(m->reg.Digest(), saved.reg.Digest());
    EXPECT_EQ(m->Region(0, 600), saved.Region(0, 600)) << "shard 2 of p";
    EXPECT_EQ(m->Region(1, 600), saved.Region(1, 600)) << "m";
  }
}

TEST(DeviceRegionTest, ADeviceThatCannotCopyEndsTheProcessNamingTheRegionAndDevice) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto device = std::make_shared<ProtectedDevice>();
  Model m(device);
  device->set_broken(true);
  EXPECT_DEATH((void)m.reg.Digest(),
               "state region 'w' on stand-in:0: a copy to the host failed: .*broken");
}

}  // namespace
}  // namespace nonstop::state
