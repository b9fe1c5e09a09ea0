// The NCCL data plane (issue 30, docs/gpu.md): the sums of device memory go
// through NCCL, behind the same seam as TCP (collective/data_plane.h).
//
// An NcclCommunicator is one generation's: an NCCL communicator on one CUDA
// device, made when the generation connects, and the staged communicator
// (staged_communicator.h: the host one over TCP, with device memory staged
// through host buffers) beside it. AllReduce, ReduceScatter, AllGather and
// Broadcast of regions on its device run on NCCL; host regions, the
// world-invariant tree (its fixed order of additions), Barrier, Send/Recv,
// the lanes and the sub-groups stay on the staged path, so the state copy
// keeps its per-chunk checks and the tree its bits.
//
// Setting up a generation (Connect), with no store:
//  - Every member says over the host communicator whether it holds the
//    previous generation's NCCL communicator, healthy (it never failed, and
//    no NCCL call was in flight when the generation was aborted: a drain at a
//    step boundary, or a fault while this member computed), and whether this
//    generation's members are that one's less some, in the same order
//    (ShrinkExclusions). When every member does, the communicator is made by
//    ncclCommShrink from it (NCCL_SHRINK_ABORT: the lost member's pending
//    work is ended first).
//  - Otherwise (after a fault, a spare joining, a grow) every member drops
//    the one it holds (ncclCommAbort: it may have work in flight) and makes a
//    fresh one: rank 0 calls ncclGetUniqueId, which starts NCCL's bootstrap
//    root in rank 0's process, and broadcasts the id over the host
//    communicator (after a byte saying whether it has one), so no store and
//    no extra service is involved.
//  Both are non-blocking (config.blocking = 0), polled against
//  timeout_connect, the abort signal and Abort(), and timed (setup()).
//
// Waits: an NCCL call is enqueued on the communicator's own stream and the
// call returns once the stream is done, polling ncclCommGetAsyncError and
// cudaStreamQuery. That stream does not wait for the caller's: the work that
// writes a buffer must be done (synchronized) before the buffer is passed. A
// call that fails aborts the communicator and waits for its kernels to stop
// before it returns, so the region is free again. Abort() from any thread
// (the session's I/O thread, when the controller's abort arrives) records the
// failure; the waiting thread sees it, the data plane's abort signal or a
// failure of the staged side within 50 µs and calls ncclCommAbort, which
// stops the kernels in flight. ncclCommAbort is not made on the I/O thread:
// the session holds its lock there, and the call may take seconds when a peer
// is gone. NCCL allows one thread at a time on a communicator: every call on
// it is made under one lock, and a wait holds it only for each poll.
//
// Determinism: NCCL's sums are the same bits run to run for the same
// communicator (the same ranks on the same topology, NCCL's algorithm and
// protocol fixed by NCCL_ALGO/NCCL_PROTO where they would differ), but not
// the host ring's bits, and a recovery that moves a rank to another GPU or
// host may change them: a job that must end bitwise equal to a fault-free run
// uses the world-invariant mode, whose tree stays on the staged path.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "collective/data_plane.h"
#include "collective/staged_communicator.h"
#include "common/mutex.h"
#include "net/abort_signal.h"

namespace nonstop::gpu {

// The ranks of the previous generation (`old_ids`, its worker ids in rank
// order) that ncclCommShrink excludes to give this one (`new_ids`): set when
// the new members are the old ones less at least one, in the same order (the
// order ncclCommShrink gives the rest); nullopt when they are not (a member
// joined or moved, or none left), where a fresh communicator is made.
std::optional<std::vector<int>> ShrinkExclusions(std::span<const int> old_ids,
                                                 std::span<const int> new_ids);

// How a generation's NCCL communicator was made: what Connect timed.
struct NcclSetup {
  bool shrunk = false;  // by ncclCommShrink (else a fresh init)
  int excluded = 0;     // ranks ncclCommShrink left out
  double agree_ms =
      0;               // the members' agreement over the host communicator (and the id's broadcast)
  double nccl_ms = 0;  // ncclCommShrink, or ncclCommInitRankConfig, until the communicator is ready
};

class NcclDataPlane;

class NcclCommunicator final : public collective::Communicator {
 public:
  NcclCommunicator(NcclDataPlane* plane, std::unique_ptr<collective::Communicator> staged,
                   collective::CommunicatorOptions options);
  // Hands a healthy NCCL communicator to the data plane for the next
  // generation to shrink; aborts one that is not.
  ~NcclCommunicator() override;

  Status Connect() override;
  std::unique_ptr<collective::Communicator> SubGroup(std::span<const int> ranks, uint32_t op_space,
                                                     Millis timeout) const override {
    return staged_->SubGroup(ranks, op_space, timeout);
  }
  Status AllReduce(collective::Region data, collective::DType dtype, ReduceOp op) override;
  Status ReduceScatter(collective::Region data, collective::DType dtype, ReduceOp op) override;
  Status AllGather(collective::Region data, size_t element_bytes) override;
  Status Broadcast(collective::Region data, int root) override;
  Status Barrier() override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->Barrier();
  }
  Status AllReduceTree(int m, std::span<const std::vector<collective::TreeNode>> nodes_of,
                       std::span<const collective::ConstRegion> partials,
                       collective::Region out) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->AllReduceTree(m, nodes_of, partials, out);
  }
  Status Send(int to_rank, collective::ConstRegion data) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->Send(to_rank, data);
  }
  Status Recv(int from_rank, collective::Region data) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->Recv(from_rank, data);
  }
  Status SendUnchecked(int to_rank, collective::ConstRegion data) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->SendUnchecked(to_rank, data);
  }
  Status RecvUnchecked(int from_rank, collective::Region data) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->RecvUnchecked(from_rank, data);
  }
  int p2p_lanes() const override { return staged_->p2p_lanes(); }
  Status SendOnLane(int to_rank, int lane, collective::ConstRegion data, bool checked) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->SendOnLane(to_rank, lane, data, checked);
  }
  Status RecvOnLane(int from_rank, int lane, collective::Region data, bool checked) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->RecvOnLane(from_rank, lane, data, checked);
  }
  Result<int> RecvOnAnyLane(std::span<const std::pair<int, int>> from, collective::Region data,
                            bool checked) override {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->RecvOnAnyLane(from, data, checked);
  }
  // The wire faults act on the TCP ring (host regions); NCCL's links are not ours to cut.
  void InjectDropOfNextRingLink() override { staged_->InjectDropOfNextRingLink(); }
  void InjectWireFlip(bool gather) override { staged_->InjectWireFlip(gather); }
  // Keeps `reason` as the failure and aborts the staged side. A call in flight sees it at its
  // next poll and stops its work with ncclCommAbort on its own thread; an idle communicator is
  // kept, so that the next generation may shrink it (a drain at a step boundary aborts the
  // generation with nothing in flight).
  void Abort(const std::string& reason) override NONSTOP_LOCKS_EXCLUDED(mu_);
  Status error() const override;
  collective::CommunicatorStats stats() const override;
  int rank() const override { return staged_->rank(); }
  int world_size() const override { return staged_->world_size(); }
  uint32_t generation() const override { return staged_->generation(); }

  // How Connect made the NCCL communicator (zeros before it did).
  NcclSetup setup() const;

 private:
  using Clock = std::chrono::steady_clock;
  bool OnNccl(collective::Device device, int index) const;
  // The kept failure, this one's or the staged communicator's (OK when none): what every call
  // returns once one failed.
  Status Sticky() const NONSTOP_LOCKS_EXCLUDED(mu_);
  // The first failure is kept (sticky) and the NCCL communicator aborted (outside the lock:
  // ncclCommAbort may take a while).
  Status Fail(Status status) NONSTOP_LOCKS_EXCLUDED(mu_);
  // Agrees with the other members on shrinking or a fresh init, and makes the NCCL communicator.
  Status SetUp();
  // `s` named as a failure of SetUp (the generation and the device).
  Status InSetUp(Status s) const;
  // Runs `enqueue` (NCCL calls on comm_ and stream_) under the lock, then waits until the
  // communicator and the stream are done: `op` names it in errors.
  template <typename Enqueue>
  Status Run(const char* op, Enqueue enqueue) NONSTOP_LOCKS_EXCLUDED(mu_);
  // Polls until the communicator is no longer in progress and, when `stream`, the stream is
  // done; fails at `deadline`, at an abort, and at NCCL's or CUDA's first error.
  Status Await(const char* op, bool stream, Clock::time_point deadline) NONSTOP_LOCKS_EXCLUDED(mu_);

  NcclDataPlane* const plane_;
  const std::unique_ptr<collective::Communicator> staged_;
  const collective::CommunicatorOptions options_;
  const int device_index_;

  mutable Mutex mu_;  // every NCCL call on comm_, and comm_'s replacement
  // ncclComm_t, kept out of this header. Null once aborted: a communicator that is not null when
  // this one ends never failed and was idle when aborted, and may be shrunk.
  void* comm_ NONSTOP_GUARDED_BY(mu_) = nullptr;
  void* stream_ = nullptr;  // cudaStream_t, made in SetUp (before any call uses it)
  Status error_ NONSTOP_GUARDED_BY(mu_);
  NcclSetup setup_ NONSTOP_GUARDED_BY(mu_);
  uint64_t ops_ NONSTOP_GUARDED_BY(mu_) = 0;  // NCCL calls enqueued
};

// A worker's NCCL data plane: the staged data plane (`host` over the copier,
// for everything NCCL does not do) and the NCCL communicators of one CUDA
// device, the copier's. `abort` is the process's signal (data_plane.h).
class NcclDataPlane final : public collective::DataPlane {
 public:
  NcclDataPlane(std::unique_ptr<collective::DataPlane> host,
                std::shared_ptr<collective::DeviceCopier> copier, net::AbortSignal* abort);
  ~NcclDataPlane() override;

  net::HostPort address() const override { return staged_.address(); }
  bool Supports(collective::Device device) const override { return staged_.Supports(device); }
  collective::DataPlaneStats stats() const override { return staged_.stats(); }
  std::unique_ptr<collective::Communicator> NewCommunicator(
      collective::CommunicatorOptions options) override;

  int device_index() const { return device_index_; }

 private:
  friend class NcclCommunicator;
  // The previous generation's healthy communicator and its members' worker ids (null: none).
  struct Parent {
    void* comm = nullptr;
    std::vector<int> members;
  };
  Parent TakeParent();
  void KeepParent(Parent parent);

  collective::StagedDataPlane staged_;
  const int device_index_;
  net::AbortSignal* const abort_;
  Mutex mu_;
  Parent parent_ NONSTOP_GUARDED_BY(mu_);
};

// SessionOptions::device_data_plane for cuda:`device_index` (nonstop/session.h): the TCP data
// plane it is given stays the host transport; the device's memory is staged with a CudaCopier
// (two streams, pinned buffers) where NCCL does not sum it. FAILED_PRECONDITION naming the
// reason when the device cannot be used.
std::function<Result<std::unique_ptr<collective::DataPlane>>(
    std::unique_ptr<collective::DataPlane> tcp, net::AbortSignal* abort)>
NcclDataPlaneMaker(int device_index);

}  // namespace nonstop::gpu
