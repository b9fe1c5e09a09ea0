// Communicator: the collectives of one generation of a job (DESIGN.md §5).
//
// A Communicator is built from a plan: this worker's rank and the ordered
// list of members with their data addresses. It asks the PeerMesh for the
// connections its algorithms need (the two ring neighbours, in parallel; a
// point-to-point peer when first used) and runs:
//   AllReduce      ring reduce-scatter + all-gather, pipelined in pieces
//   ReduceScatter  the first half: rank r ends with chunk r reduced
//   AllGather      the second half: chunk r comes from rank r
//   Broadcast      a pipelined chain along the ring from the root
//   Barrier        a ring pass of empty pieces
//   Send/Recv      point-to-point transfer of large buffers, checksummed
// Chunk c of an n-element buffer is [c·n/W, (c+1)·n/W) (ChunkRange).
//
// Determinism: the order of every floating-point sum depends only on the
// world size and the ranks, so results are bitwise reproducible run to run,
// and every rank ends with the same bytes.
//
// Failure: the first non-OK status is sticky: every later call returns it
// (the stream may be mid-frame). Abort() from any thread wakes a blocked call
// within microseconds with kAborted. A peer that dies makes the blocked call
// return kUnavailable as soon as its socket reports it. The owner then builds
// the next generation's Communicator over the same PeerMesh.
//
// Thread-safety: one thread drives the collectives; Abort(), error() and
// stats() are safe from any thread. Send/Recv may run on several threads at
// once provided each thread talks to a different peer (state transfer does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "collective/peer_mesh.h"
#include "collective/transfer.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/time.h"
#include "net/abort_signal.h"
#include "nonstop/tree.h"

namespace nonstop::collective {

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
};

// [begin, end) of chunk `c` when `n` elements are split into `parts`.
std::pair<size_t, size_t> ChunkRange(size_t n, int parts, int c);

struct CommunicatorStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t stale_frames_dropped = 0;
  uint64_t ops = 0;
};

class Communicator {
 public:
  // `mesh` and `abort` must outlive the Communicator (the worker session owns
  // both across generations).
  Communicator(PeerMesh* mesh, net::AbortSignal* abort, CommunicatorOptions options);
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Opens the ring neighbours' connections in parallel (or reuses them).
  Status Connect();

  // A communicator over some of this generation's ranks (`ranks`, ascending
  // or not: their order is the group's rank order; this rank must be one),
  // over the same connections and the same abort signal: Abort() of any
  // communicator of the generation wakes the others' calls too. Its ops are
  // numbered in their own space (CommunicatorOptions::op_space, 1-127), so
  // the world's and several groups' collectives may follow one another on the
  // same connections; like the world's, they are driven by one thread at a
  // time. Sharded optimizer state (issue 12): reduce-scatter inside a shard
  // group, all-reduce across the replicas of a shard, all-gather in the group.
  std::unique_ptr<Communicator> SubGroup(std::span<const int> ranks, uint32_t op_space) const;

  Status AllReduce(std::span<float> data);
  Status ReduceScatter(std::span<float> data);
  Status AllGather(std::span<std::byte> data, size_t element_bytes);
  Status Broadcast(std::span<std::byte> data, int root);
  Status Barrier();
  // The world-invariant all-reduce (nonstop/tree.h, issue 13). The step's m
  // micro-batches are split over the ranks: ranges[q] is rank q's [first,
  // last). `partials` are this rank's TreeFolder sums (one per node of
  // NodesOfRange, each out.size() floats). `out` receives the tree's sum over
  // all m: the same bits whatever the world size and the split. A
  // deterministic reduce-scatter (rank q combines chunk q of every rank's
  // partial sums in tree order) and an all-gather.
  Status AllReduceTree(int m, std::span<const std::pair<int, int>> ranges,
                       std::span<const std::vector<float>> partials, std::span<float> out);
  // The same with each rank's nodes given: nodes_of[q] is rank q's list (tree
  // nodes, left to right; together a partition of [0, m)), and `partials`
  // holds one sum per node of nodes_of[rank()], in that order. A salvaged step
  // (nonstop/tree.h, PlanTreeStep) gives a rank nodes that are not one range.
  Status AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                       std::span<const std::vector<float>> partials, std::span<float> out);
  Status Send(int to_rank, std::span<const std::byte> data);
  Status Recv(int from_rank, std::span<std::byte> data);

  // Fault injection: the next ring collective shuts its connection to the
  // right neighbour down after acquiring it, so the link breaks under the
  // operation (a connection dropped between operations is simply redialed).
  void InjectDropOfNextRingLink() { inject_drop_ = true; }

  // Makes every blocked and future call return kAborted with `reason`.
  void Abort(const std::string& reason);
  Status error() const;

  int rank() const { return options_.rank; }
  int world_size() const { return static_cast<int>(options_.members.size()); }
  uint32_t generation() const { return options_.generation; }
  CommunicatorStats stats() const;

 private:
  // Runs global ring steps [t_begin, t_end) over `data` (see communicator.cc).
  Status RingPass(std::byte* data, size_t count, size_t element_bytes, int t_begin, int t_end, Reduce reduce);
  Status Run(TransferSpec spec);
  Status Fail(Status status);
  void CountOp();
  Result<Connection*> Peer(int rank);
  // op_ as it travels in frames: the space in bits 24-30, the sequence in 0-23
  // (wrapping identically on every rank); bit 31 is point-to-point's.
  uint32_t FramedOp() const { return (options_.op_space << 24) | (op_ & 0xFFFFFFu); }
  std::string PeerName(int rank) const;
  Deadline OpDeadline() const { return DeadlineAfter(options_.timeout_collective); }

  PeerMesh* const mesh_;          // owned by the worker session; outlives this
  net::AbortSignal* const abort_;  // owned by the worker session; outlives this
  const CommunicatorOptions options_;
  uint32_t op_ = 0;                  // collective sequence number, identical on every rank
  std::vector<uint32_t> p2p_ops_;    // per-peer point-to-point sequence numbers
  std::vector<std::byte> scratch_;   // one piece, for reducing receives

  mutable Mutex mu_;
  Status error_ NONSTOP_GUARDED_BY(mu_);            // sticky first error
  CommunicatorStats stats_ NONSTOP_GUARDED_BY(mu_);
  // Not under mu_: set and cleared by the thread that drives the collectives
  // (the fault is injected just before the collective it breaks).
  bool inject_drop_ = false;
};

}  // namespace nonstop::collective
