#include "state/state_registry.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "nonstop/crc32c.h"

namespace nonstop::state {

namespace {

// A device's copy that failed ends the process (nonstop/state.h says why).
void CheckCopy(const Status& s, const Region& r, const char* what) {
  NONSTOP_CHECK(s.ok()) << "state region '" << r.name << "' on " << r.device->name() << ": " << what
                        << " failed: " << s.ToString();
}

// `n` bytes at `src`, which lie in region `r`, copied to host memory at `out`.
void CopyToHost(const Region& r, const std::byte* src, std::byte* out, size_t n) {
  if (r.device == nullptr) {
    std::memcpy(out, src, n);
    return;
  }
  CheckCopy(r.device->ToHost(out, src, n), r, "a copy to the host");
}

// `n` host bytes at `in` copied to `dst`, which lies in region `r`.
void CopyFromHost(const Region& r, std::byte* dst, const std::byte* in, size_t n) {
  if (r.device == nullptr) {
    std::memcpy(dst, in, n);
    return;
  }
  CheckCopy(r.device->ToDevice(dst, in, n), r, "a copy to the device");
}

// `crc` extended over `n` bytes at `src` in region `r` (device bytes a piece at a time).
uint32_t ExtendCrc(uint32_t crc, const Region& r, const std::byte* src, size_t n) {
  if (r.device == nullptr) return Crc32cExtend(crc, src, n);
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<std::byte> buf(std::min(n, kPiece));
  for (size_t at = 0; at < n; at += kPiece) {
    const size_t take = std::min(kPiece, n - at);
    CopyToHost(r, src + at, buf.data(), take);
    crc = Crc32cExtend(crc, buf.data(), take);
  }
  return crc;
}

// INVALID_ARGUMENT when `shape` (empty: any) does not hold `elements` values.
Status CheckShape(const std::string& name, const std::vector<int64_t>& shape, uint64_t elements) {
  uint64_t product = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d != 0 && product > UINT64_MAX / static_cast<uint64_t>(d))) {
      product = UINT64_MAX;
      break;
    }
    product *= static_cast<uint64_t>(d);
  }
  if (!shape.empty() && product != elements) {
    return InvalidArgumentError(
        fmt::format("state region '{}' has shape [{}], which is not its {} values", name,
                    fmt::join(shape, ", "), elements));
  }
  return OkStatus();
}

}  // namespace

Status StateRegistry::AddRegion(std::string name, std::span<std::byte> bytes) {
  for (const auto& r : regions_) {
    if (r.name == name)
      return InvalidArgumentError(fmt::format("state region '{}' is registered twice", name));
  }
  total_bytes_ += bytes.size();
  Region r;
  r.name = std::move(name);
  r.bytes = bytes;
  regions_.push_back(std::move(r));
  return OkStatus();
}

Status StateRegistry::Register(std::string name, std::span<std::byte> bytes) {
  NONSTOP_RETURN_IF_ERROR(AddRegion(std::move(name), bytes));
  chunks_ = Tiling(chunk_bytes_);
  return OkStatus();
}

Status StateRegistry::AddShardRegion(std::string name, std::span<float> bytes,
                                     std::span<float> whole, int group_size,
                                     std::shared_ptr<const DeviceMemory> device) {
  if (group_size < 1) {
    return InvalidArgumentError(
        fmt::format("state region '{}' is sharded over groups of {}: a group has at least 1 "
                    "member",
                    name, group_size));
  }
  if (shard_group_ != 0 && group_size != shard_group_) {
    return InvalidArgumentError(
        fmt::format("state region '{}' is sharded over groups of {}, the others over groups of "
                    "{}: one registry has one group size",
                    name, group_size, shard_group_));
  }
  NONSTOP_RETURN_IF_ERROR(AddRegion(std::move(name), std::as_writable_bytes(bytes)));
  Region& r = regions_.back();
  r.dtype = "F32";
  r.shape = {static_cast<int64_t>(bytes.size())};
  r.shard_group = group_size;
  r.whole = std::as_writable_bytes(whole);
  r.device = std::move(device);
  shard_group_ = group_size;
  chunks_ = Tiling(chunk_bytes_);
  return OkStatus();
}

Status StateRegistry::RegisterShard(std::string name, std::span<float> shard, int group_size,
                                    std::shared_ptr<const DeviceMemory> device) {
  return AddShardRegion(std::move(name), shard, {}, group_size, std::move(device));
}

Status StateRegistry::RegisterShardView(std::string name, std::span<float> whole, int group_size,
                                        std::shared_ptr<const DeviceMemory> device) {
  if (group_size < 1 || whole.size() % static_cast<size_t>(group_size) != 0) {
    return InvalidArgumentError(
        fmt::format("state region '{}' of {} values is not {} shards of one size: pad the buffer "
                    "to a multiple of the group size",
                    name, whole.size(), group_size));
  }
  size_t shard = whole.size() / static_cast<size_t>(group_size);
  int at = held_shard_ >= 0 ? held_shard_ : 0;
  return AddShardRegion(std::move(name), whole.subspan(static_cast<size_t>(at) * shard, shard),
                        whole, group_size, std::move(device));
}

Status StateRegistry::RebindShard(std::string_view name, std::span<float> shard) {
  for (auto& r : regions_) {
    if (r.name != name) continue;
    if (r.shard_group == 0)
      return InvalidArgumentError(fmt::format("state region '{}' is not sharded", name));
    if (shard.size_bytes() != r.bytes.size()) {
      return InvalidArgumentError(fmt::format("state region '{}' is {} bytes, its new memory {}",
                                              name, r.bytes.size(), shard.size_bytes()));
    }
    r.bytes = std::as_writable_bytes(shard);
    r.whole = {};
    return OkStatus();
  }
  return NotFoundError(fmt::format("no state region '{}'", name));
}

Status StateRegistry::AdoptShard(std::string_view name, std::span<float> shard) {
  if (held_shard_ < 0) {
    return FailedPreconditionError(
        fmt::format("state region '{}': no shard is bound yet (Join or Recover binds "
                    "this member's)",
                    name));
  }
  for (const auto& r : regions_) {
    if (r.name != name) continue;
    if (r.whole.empty())
      return InvalidArgumentError(fmt::format("state region '{}' is not a shard view", name));
    if (shard.size_bytes() != r.bytes.size()) break;  // RebindShard says so
    auto* to = reinterpret_cast<std::byte*>(shard.data());
    if (r.device == nullptr) {
      std::memcpy(to, r.bytes.data(), r.bytes.size());
      break;
    }
    // device to device through host memory, a piece at a time
    constexpr size_t kPiece = size_t{1} << 20;
    std::vector<std::byte> buf(std::min(r.bytes.size(), kPiece));
    for (size_t at = 0; at < r.bytes.size(); at += kPiece) {
      const size_t take = std::min(kPiece, r.bytes.size() - at);
      CopyToHost(r, r.bytes.data() + at, buf.data(), take);
      CopyFromHost(r, to + at, buf.data(), take);
    }
  }
  return RebindShard(name, shard);
}

Status StateRegistry::BindShard(int shard) {
  if (shard_group_ == 0) return FailedPreconditionError("the state has no sharded region");
  if (shard < 0 || shard >= shard_group_) {
    return InvalidArgumentError(
        fmt::format("shard {} does not exist (groups of {} hold shards 0..{})", shard, shard_group_,
                    shard_group_ - 1));
  }
  for (auto& r : regions_) {
    if (r.whole.empty()) continue;
    r.bytes = r.whole.subspan(static_cast<size_t>(shard) * r.bytes.size(), r.bytes.size());
  }
  held_shard_ = shard;
  return OkStatus();
}

uint64_t StateRegistry::sharded_bytes() const {
  uint64_t n = 0;
  for (const auto& r : regions_) n += r.shard_group > 0 ? r.bytes.size() : 0;
  return n;
}

std::vector<StateRegistry::Piece> StateRegistry::Runs() const {
  std::vector<Piece> runs;
  uint64_t base = 0;
  for (size_t i = 0; i < regions_.size();) {
    const bool sharded = regions_[i].shard_group > 0, per_rank = regions_[i].per_rank;
    uint64_t len = 0;
    for (; i < regions_.size() && (regions_[i].shard_group > 0) == sharded &&
           regions_[i].per_rank == per_rank;
         ++i)
      len += regions_[i].bytes.size();
    runs.push_back({base, len, sharded, per_rank});
    base += len;
  }
  return runs;
}

std::vector<StateRegistry::Piece> StateRegistry::Tiling(uint64_t chunk_bytes) const {
  std::vector<Piece> out;
  // Each run of regions of one kind is cut into chunks on its own.
  for (const Piece& run : Runs()) {
    for (uint64_t off = 0; off < run.size;) {
      uint64_t take = std::min(chunk_bytes, run.size - off);
      out.push_back({run.offset + off, take, run.sharded, run.per_rank});
      off += take;
    }
  }
  return out;
}

Status StateRegistry::RegisterFloats(std::string name, std::span<float> values,
                                     std::vector<int64_t> shape) {
  // Checkpoints describe the region by this shape, and loading checks it
  // against the bytes: a shape that disagrees would make every checkpoint unloadable.
  NONSTOP_RETURN_IF_ERROR(CheckShape(name, shape, values.size()));
  NONSTOP_RETURN_IF_ERROR(Register(std::move(name), std::as_writable_bytes(values)));
  regions_.back().dtype = "F32";
  regions_.back().shape =
      shape.empty() ? std::vector<int64_t>{static_cast<int64_t>(values.size())} : std::move(shape);
  return OkStatus();
}

Status StateRegistry::RegisterOnDevice(std::string name, std::span<std::byte> bytes,
                                       std::shared_ptr<const DeviceMemory> device,
                                       std::string dtype, std::vector<int64_t> shape) {
  if (device == nullptr) {
    return InvalidArgumentError(fmt::format(
        "state region '{}': RegisterOnDevice without a device (host memory is Register's)", name));
  }
  if (dtype == "F32") {
    if (bytes.size() % sizeof(float) != 0) {
      return InvalidArgumentError(
          fmt::format("state region '{}' on {}: {} bytes are not a whole number of F32 values",
                      name, device->name(), bytes.size()));
    }
    NONSTOP_RETURN_IF_ERROR(CheckShape(name, shape, bytes.size() / sizeof(float)));
    if (shape.empty()) shape = {static_cast<int64_t>(bytes.size() / sizeof(float))};
  } else if (dtype == "U8") {
    NONSTOP_RETURN_IF_ERROR(CheckShape(name, shape, bytes.size()));
  } else {
    return InvalidArgumentError(
        fmt::format("state region '{}' on {}: dtype {} is not taken on a device (F32 or U8 are)",
                    name, device->name(), dtype));
  }
  NONSTOP_RETURN_IF_ERROR(AddRegion(std::move(name), bytes));
  Region& r = regions_.back();
  r.dtype = std::move(dtype);
  r.shape = std::move(shape);
  r.device = std::move(device);
  chunks_ = Tiling(chunk_bytes_);
  return OkStatus();
}

std::vector<std::string> StateRegistry::RegionsOfChunk(uint32_t index) const {
  const Piece& c = chunks_.at(index);
  std::vector<std::string> names;
  uint64_t at = 0;
  for (const Region& r : regions_) {
    const uint64_t end = at + r.bytes.size();
    if (at < c.offset + c.size && c.offset < end) names.push_back(r.name);
    at = end;
  }
  return names;
}

// Region `index`, of which bytes [offset, offset + n) must exist (a bug in the caller otherwise).
static const Region& RegionRange(const std::vector<Region>& regions, size_t index, uint64_t offset,
                                 size_t n) {
  NONSTOP_CHECK_LT(index, regions.size());
  const Region& r = regions[index];
  NONSTOP_CHECK(offset <= r.bytes.size() && n <= r.bytes.size() - offset)
      << "bytes [" << offset << ", +" << n << ") of region '" << r.name << "' of "
      << r.bytes.size();
  return r;
}

void StateRegistry::ReadRegion(size_t index, uint64_t offset, std::span<std::byte> out) const {
  const Region& r = RegionRange(regions_, index, offset, out.size());
  CopyToHost(r, r.bytes.data() + offset, out.data(), out.size());
}

void StateRegistry::WriteRegion(size_t index, uint64_t offset, std::span<const std::byte> in) {
  const Region& r = RegionRange(regions_, index, offset, in.size());
  CopyFromHost(r, r.bytes.data() + offset, in.data(), in.size());
}

uint32_t StateRegistry::RegionCrc(size_t index) const {
  const Region& r = RegionRange(regions_, index, 0, 0);
  return ExtendCrc(0, r, r.bytes.data(), r.bytes.size());
}

// Walks the regions that overlap [offset, offset + n) of the concatenated
// state, each region's bytes as `bytes_of` gives them (default: its own).
template <typename F, typename B>
static void ForEachSpan(const std::vector<Region>& regions, uint64_t offset, size_t n, F f,
                        B bytes_of) {
  uint64_t base = 0;
  size_t done = 0;
  for (const auto& r : regions) {
    std::span<std::byte> bytes = bytes_of(r);
    uint64_t end = base + bytes.size();
    if (offset + done < end && done < n) {
      uint64_t in_region = offset + done - base;
      size_t take = static_cast<size_t>(std::min<uint64_t>(end - (offset + done), n - done));
      f(r, bytes.data() + in_region, done, take);
      done += take;
    }
    base = end;
  }
}
template <typename F>
static void ForEachSpan(const std::vector<Region>& regions, uint64_t offset, size_t n, F f) {
  ForEachSpan(regions, offset, n, f, [](const Region& r) { return r.bytes; });
}

void StateRegistry::ReadChunkOfShard(uint32_t index, int shard, std::span<std::byte> out) const {
  NONSTOP_CHECK_LT(index, num_chunks());
  NONSTOP_CHECK(chunks_[index].sharded) << "chunk " << index << " is not sharded";
  NONSTOP_CHECK(shard >= 0 && shard < shard_group_) << "shard " << shard << " of " << shard_group_;
  NONSTOP_CHECK_EQ(out.size(), chunks_[index].size);
  ForEachSpan(
      regions_, chunks_[index].offset, out.size(),
      [&](const Region& r, const std::byte* src, size_t at, size_t n) {
        CopyToHost(r, src, out.data() + at, n);
      },
      [&](const Region& r) {
        return r.whole.empty()
                   ? r.bytes
                   : r.whole.subspan(static_cast<size_t>(shard) * r.bytes.size(), r.bytes.size());
      });
}

void StateRegistry::CopyOut(uint64_t offset, std::span<std::byte> out) const {
  ForEachSpan(regions_, offset, out.size(),
              [&](const Region& r, const std::byte* src, size_t at, size_t n) {
                CopyToHost(r, src, out.data() + at, n);
              });
}

void StateRegistry::CopyIn(uint64_t offset, std::span<const std::byte> in) {
  ForEachSpan(regions_, offset, in.size(),
              [&](const Region& r, std::byte* dst, size_t at, size_t n) {
                CopyFromHost(r, dst, in.data() + at, n);
              });
}

ChunkInfo StateRegistry::Chunk(uint32_t index) const {
  ChunkInfo c;
  c.index = index;
  c.offset = chunks_[index].offset;
  c.size = static_cast<uint32_t>(chunks_[index].size);
  c.sharded = chunks_[index].sharded;
  uint32_t crc = 0;
  ForEachSpan(regions_, c.offset, c.size,
              [&](const Region& r, const std::byte* src, size_t, size_t n) {
                crc = ExtendCrc(crc, r, src, n);
              });
  c.crc = crc;
  return c;
}

std::vector<ChunkInfo> StateRegistry::Chunks() const {
  std::vector<ChunkInfo> out;
  for (uint32_t i = 0; i < num_chunks(); ++i) out.push_back(Chunk(i));
  return out;
}

void StateRegistry::ReadChunk(uint32_t index, std::span<std::byte> out) const {
  NONSTOP_CHECK_LT(index, num_chunks());
  NONSTOP_CHECK_EQ(out.size(), chunks_[index].size);
  CopyOut(chunks_[index].offset, out);
}

std::span<std::byte> StateRegistry::ContiguousChunk(uint32_t index) {
  NONSTOP_CHECK_LT(index, num_chunks());
  std::span<std::byte> out;
  int spans = 0;
  ForEachSpan(regions_, chunks_[index].offset, chunks_[index].size,
              [&](const Region& r, std::byte* p, size_t, size_t n) {
                out = std::span<std::byte>(p, n);
                spans += r.device == nullptr ? 1 : 2;  // device bytes are staged, never in place
              });
  if (spans != 1) return {};
  return out;
}

std::span<const std::byte> StateRegistry::ContiguousChunk(uint32_t index) const {
  return const_cast<StateRegistry*>(this)->ContiguousChunk(index);
}

Status StateRegistry::WriteChunk(uint32_t index, std::span<const std::byte> data, uint32_t crc) {
  if (index >= num_chunks()) {
    return InvalidArgumentError(
        fmt::format("state chunk {} does not exist (the state has {})", index, num_chunks()));
  }
  uint64_t offset = chunks_[index].offset;
  uint64_t want = chunks_[index].size;
  if (data.size() != want) {
    return InvalidArgumentError(
        fmt::format("state chunk {} has {} bytes, expected {}", index, data.size(), want));
  }
  uint32_t got = Crc32c(data.data(), data.size());
  if (got != crc) {
    return DataLossError(fmt::format(
        "state chunk {} fails its checksum (crc32c {:08x}, expected {:08x})", index, got, crc));
  }
  CopyIn(offset, data);
  return OkStatus();
}

Status StateRegistry::MarkPerRank(std::string_view name) {
  for (Region& r : regions_) {
    if (r.name != name) continue;
    if (r.shard_group > 0) {
      return InvalidArgumentError(fmt::format(
          "state region '{}' is sharded: each member holds its own shard already, per-rank is for "
          "replicated regions",
          name));
    }
    r.per_rank = true;
    chunks_ = Tiling(chunk_bytes_);  // per-rank runs are chunks of their own
    return OkStatus();
  }
  return NotFoundError(fmt::format("no state region is named '{}'", name));
}

std::string StateRegistry::Digest() const {
  uint32_t crc = 0;
  ForEachSpan(regions_, 0, total_bytes_,
              [&](const Region& r, const std::byte* src, size_t, size_t n) {
                if (!r.per_rank) crc = ExtendCrc(crc, r, src, n);
              });
  return fmt::format("{:08x}", crc);
}

}  // namespace nonstop::state
