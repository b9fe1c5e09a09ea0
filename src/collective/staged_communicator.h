// Collectives over device memory staged through host buffers (issue 30, the
// "staged transport"; docs/gpu.md): a StagedCommunicator wraps a
// Communicator that moves host memory (TCP) and accepts regions on one
// device too, moving their bytes through pinned host buffers with a
// DeviceCopier (CUDA streams: gpu/cuda_copier.h). It needs no NCCL, and
// several processes may share one GPU.
//
// AllReduce and Broadcast are pipelined: the buffer goes in pieces of
// `piece_bytes`, two host buffers in turn, and the copy of piece k+1 to the
// host runs (on its own lane) while piece k is reduced over the network and
// copied back. Every rank cuts the same pieces, so the order of every sum
// still depends only on the world size (data_plane.h's determinism); the
// bits are those of the host collective run piece by piece. AllGather,
// ReduceScatter, AllReduceTree and Send/Recv stage their whole buffers (one
// copy each way): their chunk layout and framing are the host call's.
//
// Host regions go straight to the wrapped communicator; a region on another
// device than the copier's is refused (kInvalidArgument), as the TCP data
// plane refuses device memory. Everything else is data_plane.h's contract.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "collective/data_plane.h"
#include "common/mutex.h"
#include "nonstop/state.h"

namespace nonstop::collective {

// The copy engine between a device's memory and host memory: two lanes
// (CUDA: two streams) whose copies each run in the order they were started.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  virtual Device device() const = 0;
  virtual int device_index() const = 0;
  // Host memory the device copies to and from fast (CUDA: pinned), freed
  // with the copier. Never fails for a size the machine has.
  virtual Result<std::span<std::byte>> HostBuffer(size_t bytes) = 0;
  // Start a copy on `lane` (0 or 1); Wait(lane) returns once every copy
  // started on it is done, or the first error of one.
  virtual Status ToHost(int lane, std::byte* host, const std::byte* device, size_t bytes) = 0;
  virtual Status ToDevice(int lane, std::byte* device, const std::byte* host, size_t bytes) = 0;
  virtual Status Wait(int lane) = 0;
};

// A DeviceCopier over a state::DeviceMemory (nonstop/state.h): what a
// session whose SessionOptions name a device stages its collectives with.
// Its lanes copy at once (a DeviceMemory's copies are synchronous), so its
// copies do not overlap the wire; its host buffers are ordinary memory. The
// data plane calls its device cuda:N, N the memory's index().
class MemoryCopier final : public DeviceCopier {
 public:
  explicit MemoryCopier(std::shared_ptr<const state::DeviceMemory> memory)
      : memory_(std::move(memory)) {}
  Device device() const override { return Device::kCuda; }
  int device_index() const override { return memory_->index(); }
  Result<std::span<std::byte>> HostBuffer(size_t bytes) override;
  Status ToHost(int lane, std::byte* host, const std::byte* device, size_t bytes) override;
  Status ToDevice(int lane, std::byte* device, const std::byte* host, size_t bytes) override;
  Status Wait(int /*lane*/) override { return OkStatus(); }  // every copy is done when it returns

 private:
  std::shared_ptr<const state::DeviceMemory> memory_;
  Mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> buffers_ NONSTOP_GUARDED_BY(mu_);  // freed with it
};

struct StagedOptions {
  size_t piece_bytes = 4 << 20;  // a multiple of 4 (float32 sums)
};

// The copier's host buffers that staged communicators stage through, shared by every
// communicator of a StagedDataPlane (each generation's, each sub-group's): a call takes what it
// needs and gives it back when it returns. So a job that recovers many times keeps reusing the
// few buffers its calls need at once, instead of keeping a new set for every generation (the
// copier frees its buffers only with itself). Thread-safe.
class StagingPool {
 public:
  explicit StagingPool(std::shared_ptr<DeviceCopier> copier) : copier_(std::move(copier)) {}

  // A buffer taken from the pool until the lease is destroyed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    ~Lease();
    std::span<std::byte> span() const { return buffer_.first(bytes_); }

   private:
    friend class StagingPool;
    StagingPool* pool_ = nullptr;
    std::span<std::byte> buffer_;  // the whole buffer, at least bytes_
    size_t bytes_ = 0;
  };
  // The smallest free buffer of at least `bytes`, or a new one from the copier.
  Result<Lease> Take(size_t bytes);
  size_t buffers() const;  // how many the pool made (for tests)

 private:
  void Give(std::span<std::byte> buffer);

  std::shared_ptr<DeviceCopier> copier_;
  mutable Mutex mu_;
  std::vector<std::span<std::byte>> free_ NONSTOP_GUARDED_BY(mu_);
  size_t made_ NONSTOP_GUARDED_BY(mu_) = 0;
};

class StagedCommunicator : public Communicator {
 public:
  // `pool`: the buffers it stages through, shared with the communicators made before and after
  // it (StagedDataPlane's); null: a pool of its own.
  StagedCommunicator(std::unique_ptr<Communicator> host, std::shared_ptr<DeviceCopier> copier,
                     StagedOptions options = {}, std::shared_ptr<StagingPool> pool = nullptr);

  Status Connect() override { return host_->Connect(); }
  std::unique_ptr<Communicator> SubGroup(std::span<const int> ranks, uint32_t op_space,
                                         Millis timeout) const override;
  Status AllReduce(Region data, DType dtype, ReduceOp op) override;
  Status ReduceScatter(Region data, DType dtype, ReduceOp op) override;
  Status AllGather(Region data, size_t element_bytes) override;
  Status Broadcast(Region data, int root) override;
  Status Barrier() override { return host_->Barrier(); }
  Status AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                       std::span<const ConstRegion> partials, Region out) override;
  Status Send(int to_rank, ConstRegion data) override;
  Status Recv(int from_rank, Region data) override;
  Status SendUnchecked(int to_rank, ConstRegion data) override;
  Status RecvUnchecked(int from_rank, Region data) override;
  // The host communicator's lanes. Device memory goes over lane 0 only (its staging buffer is
  // one); the state copy stages device chunks itself and sends host memory on every lane.
  int p2p_lanes() const override { return host_->p2p_lanes(); }
  Status SendOnLane(int to_rank, int lane, ConstRegion data, bool checked) override;
  Status RecvOnLane(int from_rank, int lane, Region data, bool checked) override;
  // Host memory only (Session::RecvFromAny's): passed to the TCP communicator.
  Result<int> RecvOnAnyLane(std::span<const std::pair<int, int>> from, Region data,
                            bool checked) override;
  void InjectDropOfNextRingLink() override { host_->InjectDropOfNextRingLink(); }
  void InjectWireFlip(bool gather) override { host_->InjectWireFlip(gather); }
  void Abort(const std::string& reason) override { host_->Abort(reason); }
  Status error() const override { return host_->error(); }
  CommunicatorStats stats() const override { return host_->stats(); }
  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  uint32_t generation() const override { return host_->generation(); }

 private:
  // kInvalidArgument unless the region is on the host or the copier's device.
  Status CheckDevice(const char* op, Device device, int index) const;
  bool OnDevice(Device device) const { return device != Device::kHost; }
  // Runs `host_op` on each piece of `data` in turn, staged as the top of this
  // file says: `to_host`/`to_device` say whether a piece's bytes go up
  // before it and come back after.
  template <typename HostOp>
  Status Pipeline(Region data, bool to_host, bool to_device, HostOp host_op);
  // The whole region in one host buffer: copied up (`up`), `host_op` on it,
  // copied back (`down`).
  template <typename HostOp>
  Status Whole(Region data, bool up, bool down, HostOp host_op);
  // kInvalidArgument for device memory on a lane other than 0 (one staging buffer).
  Status CheckLane(const char* op, int lane, Device device) const;
  // Point to point on `lane`, through a whole-buffer stage: `send`/`recv` is the host
  // communicator's call (checked or not, on a lane or not).
  Status SendVia(const char* op, int lane, ConstRegion data,
                 const std::function<Status(ConstRegion)>& send);
  Status RecvVia(const char* op, int lane, Region data, const std::function<Status(Region)>& recv);

  std::unique_ptr<Communicator> host_;
  std::shared_ptr<DeviceCopier> copier_;
  StagedOptions options_;
  std::shared_ptr<StagingPool> pool_;
};

// A data plane whose communicators stage one device's memory over another
// data plane's (TCP): what a worker with CUDA state makes in place of the
// TCP data plane alone.
class StagedDataPlane final : public DataPlane {
 public:
  StagedDataPlane(std::unique_ptr<DataPlane> host, std::shared_ptr<DeviceCopier> copier,
                  StagedOptions options = {})
      : host_(std::move(host)),
        copier_(std::move(copier)),
        options_(options),
        pool_(std::make_shared<StagingPool>(copier_)) {}

  net::HostPort address() const override { return host_->address(); }
  bool Supports(Device device) const override {
    return device == copier_->device() || host_->Supports(device);
  }
  DataPlaneStats stats() const override { return host_->stats(); }
  std::unique_ptr<Communicator> NewCommunicator(CommunicatorOptions options) override {
    return std::make_unique<StagedCommunicator>(host_->NewCommunicator(std::move(options)), copier_,
                                                options_, pool_);
  }
  const StagingPool& pool() const { return *pool_; }

 private:
  std::unique_ptr<DataPlane> host_;
  std::shared_ptr<DeviceCopier> copier_;
  StagedOptions options_;
  std::shared_ptr<StagingPool> pool_;  // every communicator's, every generation's
};

}  // namespace nonstop::collective
