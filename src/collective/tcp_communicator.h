// TcpCommunicator: the Communicator of the TCP data plane (data_plane.h has
// the contract; docs/architecture.md "The data plane"): host memory over a PeerMesh's connections.
//
// It is built from a plan: this worker's rank and the ordered list of
// members with their data addresses. It asks the PeerMesh for the
// connections its algorithms need (the two ring neighbours, in parallel; a
// point-to-point peer when first used) and runs:
//   AllReduce      ring reduce-scatter + all-gather, pipelined in pieces
//   ReduceScatter  the first half: rank r ends with chunk r reduced
//   AllGather      the second half: chunk r comes from rank r
//   Broadcast      a pipelined chain along the ring from the root
//   Barrier        a ring pass of empty pieces
//   AllReduceTree  a deterministic reduce-scatter of the partial sums, then an all-gather
//   Send/Recv      point-to-point transfer of large buffers, checksummed
//                  (SendUnchecked/RecvUnchecked: the same frames, the caller checks)
// With CommunicatorOptions::checked the collectives' pieces are checked too,
// and a damaged one is fetched again (transfer.h).
// Every piece travels as one data frame tagged (generation, op, seq)
// (transfer.h, docs/protocol.md).
//
// Regions: it reads and writes host memory only; a region on another device
// is refused with kInvalidArgument before anything is sent.
//
// Failure: a peer that dies makes the blocked call return kUnavailable as
// soon as its socket reports it, and the mesh drops that connection; the
// next generation's communicator over the same mesh dials it again, and
// reuses every connection that survived (frames an aborted generation left
// in flight are dropped as stale).
//
// It is reached through the Communicator interface (TcpDataPlane makes it):
// its overrides hide the interface's host-span overloads here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "collective/data_plane.h"
#include "collective/peer_mesh.h"
#include "collective/transfer.h"
#include "common/mutex.h"
#include "common/time.h"
#include "net/abort_signal.h"
#include "nonstop/status.h"
#include "nonstop/tree.h"

namespace nonstop::collective {

class TcpCommunicator final : public Communicator {
 public:
  // `mesh` and `abort` must outlive the communicator (the TcpDataPlane owns
  // the mesh, the worker session the signal, both across generations).
  TcpCommunicator(PeerMesh* mesh, net::AbortSignal* abort, CommunicatorOptions options);

  // Opens the ring neighbours' connections in parallel (or reuses them).
  Status Connect() override;
  // Over the same mesh and abort signal.
  std::unique_ptr<Communicator> SubGroup(std::span<const int> ranks, uint32_t op_space,
                                         Millis timeout) const override;

  Status AllReduce(Region data, DType dtype, ReduceOp op) override;
  Status ReduceScatter(Region data, DType dtype, ReduceOp op) override;
  Status AllGather(Region data, size_t element_bytes) override;
  Status Broadcast(Region data, int root) override;
  Status Barrier() override;
  Status AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                       std::span<const ConstRegion> partials, Region out) override;
  Status Send(int to_rank, ConstRegion data) override;
  Status Recv(int from_rank, Region data) override;
  // The same frames without their CRC-32C (flags 0): the caller checks the bytes.
  Status SendUnchecked(int to_rank, ConstRegion data) override;
  Status RecvUnchecked(int from_rank, Region data) override;
  // Lanes 1.. are further connections of the mesh to the same peer (PeerMesh: lanes).
  int p2p_lanes() const override { return net::kDataLanes; }
  Status SendOnLane(int to_rank, int lane, ConstRegion data, bool checked) override;
  Status RecvOnLane(int from_rank, int lane, Region data, bool checked) override;
  Result<int> RecvOnAnyLane(std::span<const std::pair<int, int>> from, Region data,
                            bool checked) override;

  // The next ring collective shuts its connection to the right neighbour
  // down after acquiring it, so the link breaks under the operation (a
  // connection dropped between operations is simply redialed).
  void InjectDropOfNextRingLink() override { inject_drop_ = true; }
  void InjectWireFlip(bool gather) override { inject_flip_ = gather ? 1 : 0; }

  void Abort(const std::string& reason) override;
  Status error() const override;
  // error(), or ABORTED once the abort signal fired: what a call checks before it starts.
  Status MayStart() const;
  CommunicatorStats stats() const override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return static_cast<int>(options_.members.size()); }
  uint32_t generation() const override { return options_.generation; }

 private:
  // kInvalidArgument unless `region` is in host memory; `op` names the call.
  Status CheckHost(const ConstRegion& region, std::string_view op) const;
  // Runs global ring steps [t_begin, t_end) over `data` (see tcp_communicator.cc).
  Status RingPass(std::byte* data, size_t count, size_t element_bytes, int t_begin, int t_end,
                  Combine combine);
  // AllReduce's and ReduceScatter's checks, then ring steps [0, t_end) with `op`'s combine.
  Status Reduce(std::string_view what, Region data, DType dtype, ReduceOp op, int t_end);
  Status Run(TransferSpec spec);
  // Send/Recv and their unchecked forms: `checksum` says whether the frames carry a CRC-32C.
  Status SendTo(int to_rank, int lane, ConstRegion data, bool checksum, std::string_view op);
  Status RecvFrom(int from_rank, int lane, Region data, bool checksum, std::string_view op);
  Status Fail(Status status);
  void CountOp();
  Result<Connection*> Peer(int rank, int lane = 0);
  // op_ as it travels in frames: the space in bits 24-30, the sequence in 0-23
  // (wrapping identically on every rank); bit 31 is point-to-point's.
  uint32_t FramedOp() const { return (options_.op_space << 24) | (op_ & 0xFFFFFFu); }
  std::string PeerName(int rank) const;
  Deadline OpDeadline() const { return DeadlineAfter(options_.timeout_collective); }

  PeerMesh* const mesh_;           // owned by the TcpDataPlane; outlives this
  net::AbortSignal* const abort_;  // owned by the worker session; outlives this
  const CommunicatorOptions options_;
  uint32_t op_ = 0;  // collective sequence number, identical on every rank
  // point-to-point sequence numbers, per peer and lane ([rank * net::kDataLanes + lane])
  std::vector<uint32_t> p2p_ops_;
  std::vector<std::byte> scratch_;  // one piece, for reducing receives

  mutable Mutex mu_;
  Status error_ NONSTOP_GUARDED_BY(mu_);  // sticky first error
  CommunicatorStats stats_ NONSTOP_GUARDED_BY(mu_);
  // Not under mu_: set and cleared by the thread that drives the collectives
  // (the fault is injected just before the collective it breaks).
  bool inject_drop_ = false;
  int inject_flip_ =
      -1;  // -1: none; 0: the last reduce step's first piece; 1: the last gather step's
};

}  // namespace nonstop::collective
