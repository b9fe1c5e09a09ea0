// StateRegistry: what a worker must not lose (DESIGN.md §6).
//
// The training program registers live memory regions (parameters, optimizer
// moments, the step counter, RNG state) by name. Concatenated in registration
// order they form the state, cut into fixed-size chunks, each with a CRC-32C.
// The registry can produce a self-describing snapshot of the regions and load
// one back into the same live memory in place, after checking that the layout
// matches and that every chunk's checksum is right: a snapshot that fails any
// check changes nothing (format: docs/formats.md).
//
// Thread-safety: not thread-safe; the training thread owns it. The regions
// must stay valid (and not move) while registered.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::state {

inline constexpr size_t kDefaultChunkBytes = 1 << 20;

struct Region {
  std::string name;
  std::span<std::byte> bytes;
  // How durable checkpoints describe the region (safetensors): "F32", "I64", "U8"…
  std::string dtype = "U8";
  std::vector<int64_t> shape;  // empty: one dimension of bytes / element size
};

struct ChunkInfo {
  uint32_t index = 0;
  uint64_t offset = 0;  // in the concatenated state
  uint32_t size = 0;
  uint32_t crc = 0;
};

class StateRegistry {
 public:
  explicit StateRegistry(size_t chunk_bytes = kDefaultChunkBytes) : chunk_bytes_(chunk_bytes) {}

  // Registers a live region. Names are unique.
  Status Register(std::string name, std::span<std::byte> bytes);
  // Registers fp32 values with their tensor shape (checkpoints keep it).
  Status RegisterFloats(std::string name, std::span<float> values, std::vector<int64_t> shape = {});
  template <typename T>
  Status RegisterValue(std::string name, T* value) {
    static_assert(std::is_integral_v<T> && sizeof(T) == 8, "scalars are 64-bit integers");
    NONSTOP_RETURN_IF_ERROR(Register(std::move(name), std::as_writable_bytes(std::span<T>(value, 1))));
    regions_.back().dtype = std::is_signed_v<T> ? "I64" : "U64";
    regions_.back().shape = {1};
    return OkStatus();
  }

  const std::vector<Region>& regions() const { return regions_; }
  uint64_t total_bytes() const { return total_bytes_; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t num_chunks() const;

  // Chunk layout with checksums of the current contents.
  std::vector<ChunkInfo> Chunks() const;
  // Copies chunk `index` of the current state into `out` (out.size() == chunk size).
  void ReadChunk(uint32_t index, std::span<std::byte> out) const;
  // Verifies `data` against `crc` and writes it into chunk `index` in place.
  Status WriteChunk(uint32_t index, std::span<const std::byte> data, uint32_t crc);

  // A whole-state snapshot: header (layout + chunk CRCs) then the bytes.
  std::string Serialize() const;
  // Checks layout and every checksum, then loads the snapshot in place.
  Status Load(std::string_view snapshot);

  // CRC-32C over the whole state, as 8 hex digits: equal states, equal digests.
  std::string Digest() const;

 private:
  ChunkInfo Chunk(uint32_t index) const;
  void CopyOut(uint64_t offset, std::span<std::byte> out) const;
  void CopyIn(uint64_t offset, std::span<const std::byte> in);

  size_t chunk_bytes_;
  std::vector<Region> regions_;
  uint64_t total_bytes_ = 0;
};

}  // namespace nonstop::state
