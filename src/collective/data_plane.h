// The data plane (docs/architecture.md "The data plane", docs/data_plane.md): the seam between a
// worker's session and the transport that moves its bytes.
//
// A DataPlane is one per worker process and lives across generations: it
// owns the transport's endpoint (TCP: a listening socket and the connections
// to peers), says where peers reach it, and makes each generation's
// Communicator. A Communicator runs the collectives of one generation over
// memory regions (Region) that name their device. Another transport (shared
// memory between the ranks of a host, CUDA memory, NCCL) is another pair of
// implementations of these two interfaces, not a change to the session. Built:
// TCP over host memory (tcp_data_plane.h, tcp_communicator.h), CUDA memory
// staged over it (staged_communicator.h) and NCCL (gpu/nccl_data_plane.h).
//
// The collectives, every rank calling the same ones in the same order with
// buffers of the same size:
//   AllReduce      every rank ends with the element-wise reduction (nonstop/reduce.h: a
//                  sum, product, min, max or bitwise op of any DType) of every rank's buffer
//   ReduceScatter  rank r ends with chunk r of that reduction (its other chunks: unspecified)
//   AllGather      rank r contributes chunk r; every rank ends with every chunk
//   Broadcast      every rank ends with the root's buffer
//   Barrier        returns once every rank has entered it
//   AllReduceTree  the world-invariant sum of micro-batch partial sums (nonstop/tree.h)
//   Send/Recv      point-to-point transfer of large buffers (TCP checksums them;
//                  SendUnchecked/RecvUnchecked leave the check to the caller)
// Chunk c of an n-element buffer is [c·n/W, (c+1)·n/W) (ChunkRange). A
// transport may reduce fewer types or operations than reduce.h names: it
// refuses the others with kInvalidArgument, having moved nothing.
//
// The contract every implementation keeps:
//  - Determinism: the order of every floating-point sum depends only on the
//    world size and the ranks (AllReduceTree's: only on the tree), so every
//    rank ends with the same bytes, and a world of the same size gives the
//    same bits run to run (docs/determinism.md). NCCL's sums
//    (gpu/nccl_data_plane.h) keep this for one communicator on one topology
//    only: a rank moved to another GPU or host may change the bits.
//  - Sticky failure: the first non-OK status is kept, and every later call
//    returns it (a stream may be left mid-frame). The owner then makes the
//    next generation's Communicator from the same DataPlane.
//  - Abort: Abort() from any thread, or the data plane's abort signal fired
//    by its owner, wakes a blocked call within microseconds with kAborted;
//    Abort() of any communicator of a generation aborts its sub-groups too.
//    A peer that dies makes the blocked call return kUnavailable as soon as
//    the transport sees it; timeout_collective bounds every call
//    (kDeadlineExceeded).
//  - Regions: a region on a device the data plane does not move
//    (DataPlane::Supports) is refused with kInvalidArgument naming the device,
//    before anything moves: the call has no effect (not sticky, no operation
//    counted). A region must stay valid, and unread and unwritten by others,
//    until its call returns; every call blocks until done, failed or aborted.
//    A size that does not fit the call (not a whole number of elements) is a
//    bug in the caller (NONSTOP_CHECK).
//  - Thread-safety: one thread at a time drives the collectives of a
//    generation (its communicator's and its sub-groups'); Abort(), error()
//    and stats() are safe from any thread. Send/Recv (and SendOnLane/
//    RecvOnLane) may run on several threads at once provided each thread has
//    a (peer, lane) of its own (the state transfer does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/time.h"
#include "net/socket.h"
#include "nonstop/reduce.h"
#include "nonstop/status.h"
#include "nonstop/tree.h"

namespace nonstop::collective {

using nonstop::DType;
using nonstop::ElementBytes;
using nonstop::ReduceOp;

// Where a region's bytes are.
enum class Device : uint8_t { kHost, kCuda };

// "host", "cuda:0": for messages.
std::string DeviceName(Device device, int device_index);

// Memory a collective reads: `bytes` bytes at `data` on `device` (the CUDA
// device `device_index`; 0 for host memory). Not owned.
struct ConstRegion {
  const std::byte* data = nullptr;
  size_t bytes = 0;
  Device device = Device::kHost;
  int device_index = 0;
};

// Memory a collective writes (and reads).
struct Region {
  std::byte* data = nullptr;
  size_t bytes = 0;
  Device device = Device::kHost;
  int device_index = 0;

  // NOLINT: implicit by design
  operator ConstRegion() const { return {data, bytes, device, device_index}; }
};

inline Region HostRegion(std::span<std::byte> data) {
  return {data.data(), data.size(), Device::kHost, 0};
}
inline Region HostRegion(std::span<float> data) { return HostRegion(std::as_writable_bytes(data)); }
inline ConstRegion HostRegion(std::span<const std::byte> data) {
  return {data.data(), data.size(), Device::kHost, 0};
}
inline ConstRegion HostRegion(std::span<const float> data) {
  return HostRegion(std::as_bytes(data));
}

struct Member {
  int worker_id = -1;
  std::string address;  // data-plane "host:port"
};

struct CommunicatorOptions {
  uint32_t generation = 1;
  int rank = 0;
  std::vector<Member> members;  // index = rank
  Millis timeout_collective{300'000};
  Millis timeout_connect{30'000};
  size_t piece_bytes = 256 << 10;  // pipelining granularity of the ring
  // 0: the generation's communicator. 1-127: a sub-group's (SubGroup).
  // Collectives number their frames (op_space << 24) | (sequence mod 2^24),
  // so the spaces stay apart from each other and from point-to-point
  // transfers (bit 31).
  uint32_t op_space = 0;
  // Checked collectives (issue 28, docs/integrity.md): every piece of the
  // ring, the tree and the broadcast carries a CRC-32C, and a damaged piece
  // is fetched again from its sender (transfer.h), so a byte flipped on the
  // wire never reaches the result. Point-to-point Send/Recv always check
  // (and fail with kDataLoss); SendUnchecked/RecvUnchecked never do.
  bool checked = false;
};

// [begin, end) of chunk `c` when `n` elements are split into `parts`.
std::pair<size_t, size_t> ChunkRange(size_t n, int parts, int c);

// Each rank's tree nodes when ranges[q] is rank q's [first, last) of the m
// micro-batches (NodesOfRange of each): the nodes_of of AllReduceTree.
std::vector<std::vector<TreeNode>> NodesOfRanges(int m,
                                                 std::span<const std::pair<int, int>> ranges);

struct CommunicatorStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t stale_frames_dropped = 0;
  uint64_t ops = 0;
  uint64_t pieces_refetched = 0;  // damaged pieces this rank asked for again
};

// The collectives of one generation (see the top of this file).
class Communicator {
 public:
  Communicator() = default;
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Sets up what the generation's collectives need first (TCP: opens the
  // ring neighbours' connections in parallel, or reuses them).
  virtual Status Connect() = 0;

  // A communicator over some of this generation's ranks (`ranks`, ascending
  // or not: their order is the group's rank order; this rank must be one),
  // sharing this one's transport and abort: Abort() of any communicator of
  // the generation wakes the others' calls too. Its ops are numbered in their
  // own space (CommunicatorOptions::op_space, 1-127), so the world's and
  // several groups' collectives may follow one another; like the world's,
  // they are driven by one thread at a time. Sharded optimizer state (issue
  // 12): reduce-scatter inside a shard group, all-reduce across the replicas
  // of a shard, all-gather in the group. `timeout` bounds each of its calls
  // (torch.distributed's new_group(timeout=...); zero: this one's
  // timeout_collective).
  virtual std::unique_ptr<Communicator> SubGroup(std::span<const int> ranks, uint32_t op_space,
                                                 Millis timeout) const = 0;

  // Reductions of `dtype` elements (data.bytes a multiple of its size).
  virtual Status AllReduce(Region data, DType dtype, ReduceOp op) = 0;
  virtual Status ReduceScatter(Region data, DType dtype, ReduceOp op) = 0;
  // Chunks of whole `element_bytes` records (data.bytes a multiple of it).
  virtual Status AllGather(Region data, size_t element_bytes) = 0;
  virtual Status Broadcast(Region data, int root) = 0;
  virtual Status Barrier() = 0;
  // The world-invariant all-reduce (nonstop/tree.h, issue 13). nodes_of[q]
  // is rank q's list of tree nodes (left to right; together a partition of
  // [0, m)); `partials` holds this rank's float32 sum of each of its nodes,
  // in that order, each out.bytes long. `out` receives the tree's sum over
  // all m: the same bits whatever the world size and the split. A salvaged
  // step (PlanTreeStep) gives a rank nodes that are not one range.
  virtual Status AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                               std::span<const ConstRegion> partials, Region out) = 0;
  virtual Status Send(int to_rank, ConstRegion data) = 0;
  virtual Status Recv(int from_rank, Region data) = 0;
  // Send/Recv of bytes the caller checksums itself: a state chunk carries its
  // own CRC-32C, and the state transfer verifies it on another thread while
  // the next chunks arrive (worker/state_transfer.h). The transport may skip
  // its own checksum, so that the bytes are read once on each side, by the
  // kernel's copy; a corrupt byte then reaches `data` and only the caller's
  // check catches it. Both ends of a transfer use the same pair (the framing
  // may differ from Send/Recv's). The default is Send/Recv: checked twice.
  virtual Status SendUnchecked(int to_rank, ConstRegion data) { return Send(to_rank, data); }
  virtual Status RecvUnchecked(int from_rank, Region data) { return Recv(from_rank, data); }
  // Point-to-point lanes: lane 0 is the connection of Send/Recv; lanes 1 .. p2p_lanes() - 1
  // are further connections to the same peers (TCP: a socket each, opened when first used), so
  // that several threads move one transfer between the same two ranks at once (the state copy's
  // streams per source, worker/state_transfer.h). One thread at a time drives a (peer, lane),
  // and both ends use the same lane for the same bytes; `checked` picks Send's or
  // SendUnchecked's frames. A transport without lanes says 1 (lane 0 is Send/Recv).
  virtual int p2p_lanes() const { return 1; }
  virtual Status SendOnLane(int to_rank, int lane, ConstRegion data, bool checked);
  virtual Status RecvOnLane(int from_rank, int lane, Region data, bool checked);
  // A receive from whichever of `from` ((rank, lane) pairs) sends first (torch's recv without a
  // source): waits until one of those connections has bytes to read, receives `data` from it as
  // RecvOnLane does and returns its rank. The same thread rules as RecvOnLane, for every pair. A
  // transport without it says kFailedPrecondition.
  virtual Result<int> RecvOnAnyLane(std::span<const std::pair<int, int>> from, Region data,
                                    bool checked);

  // Fault injection (FaultKind::kDrop): the next ring collective loses its
  // link to the right neighbour under it (TCP: the connection is shut down
  // after it is acquired, so the operation fails with kUnavailable).
  virtual void InjectDropOfNextRingLink() = 0;
  // Fault injection (FaultKind::kWireflip): in the next ring collective that
  // has the phase, the first piece this rank sends in the last step of its
  // reduce-scatter (`gather` false) or of its all-gather (true) leaves with
  // one bit flipped after its checksum was computed, as a bad NIC or cable
  // would flip it. A flip in the last gather step reaches one rank only (the
  // right neighbour keeps the piece); one in the last reduce step reaches
  // the sum every rank gets.
  virtual void InjectWireFlip(bool gather) = 0;

  // Makes every blocked and future call return kAborted with `reason`.
  virtual void Abort(const std::string& reason) = 0;
  virtual Status error() const = 0;
  virtual CommunicatorStats stats() const = 0;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual uint32_t generation() const = 0;

  // The same over host memory: what the session and the state transfer use.
  Status AllReduce(std::span<float> data) {
    return AllReduce(HostRegion(data), DType::kFloat32, ReduceOp::kSum);
  }
  Status ReduceScatter(std::span<float> data) {
    return ReduceScatter(HostRegion(data), DType::kFloat32, ReduceOp::kSum);
  }
  Status AllGather(std::span<std::byte> data, size_t element_bytes) {
    return AllGather(HostRegion(data), element_bytes);
  }
  Status Broadcast(std::span<std::byte> data, int root) {
    return Broadcast(HostRegion(data), root);
  }
  Status Send(int to_rank, std::span<const std::byte> data) {
    return Send(to_rank, HostRegion(data));
  }
  Status Recv(int from_rank, std::span<std::byte> data) {
    return Recv(from_rank, HostRegion(data));
  }
  Status SendUnchecked(int to_rank, std::span<const std::byte> data) {
    return SendUnchecked(to_rank, HostRegion(data));
  }
  Status RecvUnchecked(int from_rank, std::span<std::byte> data) {
    return RecvUnchecked(from_rank, HostRegion(data));
  }
  Status AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                       std::span<const std::vector<float>> partials, std::span<float> out);
  // Each rank's nodes given as a range: ranges[q] is rank q's [first, last)
  // of the m micro-batches, and `partials` are its TreeFolder sums (one per
  // node of NodesOfRange).
  Status AllReduceTree(int m, std::span<const std::pair<int, int>> ranges,
                       std::span<const std::vector<float>> partials, std::span<float> out);
};

struct DataPlaneStats {
  // Connections established since creation (dialed + accepted): what shows
  // that generations reuse them.
  int connections_opened = 0;
  int connections_open = 0;  // now: one per peer and lane used and not dropped
  // Incoming connections closed without becoming a peer's (refused hello,
  // handshake deadline, stale generation).
  int connections_refused = 0;
};

// One worker process's transport, across generations.
//
// Lifetime: the abort signal given to an implementation's constructor and
// the DataPlane itself outlive every communicator it makes. The signal is
// the process's: every communicator's calls watch it, Abort() fires it, and
// the owner may fire it itself (to cut a call short at shutdown) and resets
// it between generations, before making the next communicator.
//
// Thread-safety: every method is safe from any thread.
class DataPlane {
 public:
  DataPlane() = default;
  virtual ~DataPlane() = default;
  DataPlane(const DataPlane&) = delete;
  DataPlane& operator=(const DataPlane&) = delete;

  // Where this process's data port listens (its host may be a wildcard: the
  // session advertises a reachable one, SessionOptions::advertise_address).
  virtual net::HostPort address() const = 0;
  // Whether its communicators move regions on `device`.
  virtual bool Supports(Device device) const = 0;
  virtual DataPlaneStats stats() const = 0;
  // The communicator of one generation (options.members: the plan's, with
  // their data addresses).
  virtual std::unique_ptr<Communicator> NewCommunicator(CommunicatorOptions options) = 0;
};

}  // namespace nonstop::collective
