// StateRegistry: what a worker must not lose (docs/architecture.md "State").
//
// The training program registers live memory regions (parameters, optimizer
// moments, the step counter, RNG state) by name. Concatenated in registration
// order they form the state, cut into fixed-size chunks, each with a CRC-32C.
// A peer's chunks are written back into the same live memory in place, each
// after its checksum is verified (WriteChunk): a chunk that fails changes
// nothing. That is the one byte format of the state in memory; state transfers
// frame it (src/worker/state_transfer.h) and durable checkpoints store it as
// safetensors (docs/formats.md).
//
// Sharded state (ZeRO-1, docs/sharding.md): a region may be this member's
// shard of a buffer sharded over shard groups of G members. Every member's
// sharded regions have the same sizes (a shard is 1/G of a buffer padded to a
// multiple of G), so every member's chunk layout is the same; which shard
// the sharded regions hold is held_shard(). Chunks never mix sharded and
// replicated bytes, so a transfer can copy the replicated chunks from anyone
// and the sharded ones from the holders of the right shard.
//
// Device memory (issue 30, docs/gpu.md): a region may live on an
// accelerator (RegisterOnDevice; sharded: RegisterShard and RegisterShardView with a device). The
// registry reads and writes it through its DeviceMemory, a piece at a time through host memory: its
// chunks, CRCs, digest, transfers and checkpoints are byte for byte those of the same bytes in host
// memory, so a member with CUDA state and one with host state copy state from each other. Such a
// chunk is never contiguous (ContiguousChunk is empty): the state transfer stages it. A device
// whose copy fails ends the process (NONSTOP_CHECK, naming the region, the device and its error): a
// device that cannot copy is a lost member, which the job recovers from.
//
// Thread-safety: not thread-safe; the training thread owns it, though its
// const reads may run on several threads at once (the state transfer's CRC
// table does) where the DeviceMemory allows it. The regions must stay valid
// (and not move) while registered.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::state {

inline constexpr size_t kDefaultChunkBytes = 1 << 20;

// An accelerator's memory, as the registry reaches it: synchronous copies to
// and from host memory (the CUDA one: nonstop_gpu's gpu::CudaMemory).
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual std::string name() const = 0;    // "cuda:0": for messages
  virtual int index() const { return 0; }  // the device's number among its kind (cuda:N's N)
  // Both return once the bytes are copied; safe from several threads at once.
  virtual Status ToHost(std::byte* host, const std::byte* device, size_t bytes) const = 0;
  virtual Status ToDevice(std::byte* device, const std::byte* host, size_t bytes) const = 0;
  // A health check before the device is trusted with state (Session::Join runs it): memory of
  // the device set, written, read back and compared. OK, or what failed.
  virtual Status Check() const = 0;
};

struct Region {
  std::string name;
  std::span<std::byte> bytes;
  // How durable checkpoints describe the region (safetensors): "F32", "I64", "U8"…
  std::string dtype = "U8";
  std::vector<int64_t> shape;  // empty: one dimension of bytes / element size
  // 0: replicated (every member holds the same bytes). G > 0: this member's
  // shard of a buffer sharded over groups of G (StateRegistry::held_shard).
  int shard_group = 0;
  // A shard view (RegisterShardView): the whole padded buffer, of which
  // `bytes` is the held shard's 1/G. Empty: the region is the shard's own memory.
  std::span<std::byte> whole;
  // Per-rank state (MarkPerRank): each member's own values (a module's running statistics, a
  // sample counter, an RNG state), which may differ between members. Never compared by the
  // replica check nor part of Digest(); a member whose state is copied from its peers (a spare
  // that takes a rank, a joiner, a repaired member) gets a peer's values, as for any region.
  bool per_rank = false;
  // Where `bytes` are: null for host memory, else the device's (RegisterOnDevice). Never
  // dereference `bytes` of a device region: read and write it through the registry.
  std::shared_ptr<const DeviceMemory> device;
};

// held_shard() of a registry whose sharded regions hold the same bytes for
// every shard: the initial state (zeros), or a whole buffer behind every view.
inline constexpr int kEveryShard = -1;
// held_shard() of a registry whose sharded regions hold no valid shard (a
// transfer copied the rest of the state of a newer step into it).
inline constexpr int kNoShard = -2;

struct ChunkInfo {
  uint32_t index = 0;
  uint64_t offset = 0;  // in the concatenated state
  uint32_t size = 0;
  uint32_t crc = 0;
  bool sharded = false;  // its bytes belong to the held shard
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
    NONSTOP_RETURN_IF_ERROR(
        Register(std::move(name), std::as_writable_bytes(std::span<T>(value, 1))));
    regions_.back().dtype = std::is_signed_v<T> ? "I64" : "U64";
    regions_.back().shape = {1};
    return OkStatus();
  }

  // A region of `device`'s memory (`bytes` are device addresses): fp32 values
  // of `shape` (empty: one dimension) when dtype is "F32", else raw bytes of
  // `dtype`. Replicated: sharded state on a device is RegisterShard's and
  // RegisterShardView's, with their `device`.
  Status RegisterOnDevice(std::string name, std::span<std::byte> bytes,
                          std::shared_ptr<const DeviceMemory> device, std::string dtype = "U8",
                          std::vector<int64_t> shape = {});

  // Marks region `name` (replicated, registered already) per-rank (Region::per_rank).
  // NOT_FOUND when there is no such region, INVALID_ARGUMENT for a sharded one.
  Status MarkPerRank(std::string_view name);

  // Region `index` (of regions()), wherever it lives: `out.size()` bytes from
  // byte `offset` of it copied out, `in` copied in, its CRC-32C.
  void ReadRegion(size_t index, uint64_t offset, std::span<std::byte> out) const;
  void WriteRegion(size_t index, uint64_t offset, std::span<const std::byte> in);
  uint32_t RegionCrc(size_t index) const;

  // Sharded regions (docs/sharding.md); every one of a registry has the same
  // group size G. RegisterShard: `shard` is this member's shard, in its own
  // memory (optimizer moments), and holds the same for every shard until
  // written (zeros): held_shard() starts at kEveryShard. RegisterShardView:
  // `whole` is a whole buffer padded to a multiple of G (the parameters, which
  // every member holds whole) and the region is the held shard's 1/G of it,
  // moved by BindShard. With a `device`, `shard` or `whole` is that device's
  // memory (as RegisterOnDevice's bytes), read and written through it.
  Status RegisterShard(std::string name, std::span<float> shard, int group_size,
                       std::shared_ptr<const DeviceMemory> device = nullptr);
  Status RegisterShardView(std::string name, std::span<float> whole, int group_size,
                           std::shared_ptr<const DeviceMemory> device = nullptr);
  // Makes a view the shard's own memory (`shard`, of the region's size, which
  // the caller filled from the view; on the region's device if it has one): a
  // resumed checkpoint's whole moments can then be freed.
  Status RebindShard(std::string_view name, std::span<float> shard);
  // RebindShard after copying the held shard of view `name` into `shard`:
  // how a program that resumed whole moments from a checkpoint (views of
  // whole buffers, every shard there) keeps its own shard once Join or
  // Recover bound it, and can free the whole buffers (`shard` is on the
  // view's device if it has one: the copy goes through host memory). FAILED_PRECONDITION
  // while no one shard is bound (held_shard() < 0); INVALID_ARGUMENT when
  // `name` is not a view or `shard` is not its size, NOT_FOUND when there is
  // no such region; `shard` is untouched then.
  Status AdoptShard(std::string_view name, std::span<float> shard);
  // Moves every view to shard `shard` (0 <= shard < G) and records that the
  // sharded regions hold it. The bytes of own-memory shards are not touched:
  // a caller binding a shard it does not hold writes them next.
  Status BindShard(int shard);
  int shard_group() const { return shard_group_; }  // 0: nothing is sharded
  int held_shard() const { return held_shard_; }
  void set_held_shard(int shard) { held_shard_ = shard; }
  uint64_t sharded_bytes() const;  // of this member's sharded regions

  const std::vector<Region>& regions() const { return regions_; }
  uint64_t total_bytes() const { return total_bytes_; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  uint32_t num_chunks() const { return static_cast<uint32_t>(chunks_.size()); }

  uint32_t chunk_size(uint32_t index) const {
    return static_cast<uint32_t>(chunks_.at(index).size);
  }
  bool chunk_sharded(uint32_t index) const { return chunks_.at(index).sharded; }
  // A chunk of per-rank regions (Region::per_rank): the members' copies differ.
  bool chunk_per_rank(uint32_t index) const { return chunks_.at(index).per_rank; }
  // Where chunk `index` starts in the concatenated state, and the regions it covers (for messages).
  uint64_t chunk_offset(uint32_t index) const { return chunks_.at(index).offset; }
  std::vector<std::string> RegionsOfChunk(uint32_t index) const;
  // Chunk layout with checksums of the current contents.
  std::vector<ChunkInfo> Chunks() const;
  // Copies chunk `index` of the current state into `out` (out.size() == chunk size).
  void ReadChunk(uint32_t index, std::span<std::byte> out) const;
  // A sharded chunk as it would read with BindShard(shard): what a registry
  // holding every shard (kEveryShard) serves of each.
  void ReadChunkOfShard(uint32_t index, int shard, std::span<std::byte> out) const;
  // Verifies `data` against `crc` and writes it into chunk `index` in place.
  Status WriteChunk(uint32_t index, std::span<const std::byte> data, uint32_t crc);
  // Chunk `index`'s live bytes when they lie in one region (most do: a chunk
  // spans regions only where one ends), else an empty span. What the state
  // transfer sends from and receives into without a copy; a chunk received
  // this way is verified after it landed (the state holds no step meanwhile).
  std::span<std::byte> ContiguousChunk(uint32_t index);
  std::span<const std::byte> ContiguousChunk(uint32_t index) const;

  // CRC-32C over the state but its per-rank regions, as 8 hex digits: members that hold the
  // same replicated state have equal digests.
  std::string Digest() const;

 private:
  struct Piece {
    uint64_t offset = 0;
    uint64_t size = 0;
    bool sharded = false;
    bool per_rank = false;
  };
  // The chunks of `chunk_bytes`: each run of consecutive regions of the same
  // kind (sharded or not, per-rank or not) is cut on its own, so no chunk mixes two.
  std::vector<Piece> Tiling(uint64_t chunk_bytes) const;
  std::vector<Piece> Runs() const;  // each run of consecutive regions of one kind
  Status AddRegion(std::string name, std::span<std::byte> bytes);  // without tiling
  Status AddShardRegion(std::string name, std::span<float> bytes, std::span<float> whole,
                        int group_size, std::shared_ptr<const DeviceMemory> device);
  ChunkInfo Chunk(uint32_t index) const;
  void CopyOut(uint64_t offset, std::span<std::byte> out) const;
  void CopyIn(uint64_t offset, std::span<const std::byte> in);

  size_t chunk_bytes_;
  std::vector<Region> regions_;
  uint64_t total_bytes_ = 0;
  std::vector<Piece> chunks_;  // Tiling(chunk_bytes_), kept with the regions
  int shard_group_ = 0;
  int held_shard_ = kEveryShard;
};

}  // namespace nonstop::state
