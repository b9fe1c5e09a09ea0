// The staged transport's copy engine for CUDA (staged_communicator.h,
// docs/gpu.md): two streams of one device, pinned host buffers. Built when
// CMake finds the CUDA toolkit (NONSTOP_WITH_CUDA); its test needs a GPU
// (label gpu).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "collective/staged_communicator.h"
#include "net/abort_signal.h"
#include "nonstop/state.h"

namespace nonstop::gpu {

class CudaCopier : public collective::DeviceCopier {
 public:
  // FAILED_PRECONDITION naming the reason when the device cannot be used
  // (no driver, no such device).
  static Result<std::shared_ptr<CudaCopier>> Create(int device_index);
  ~CudaCopier() override;

  collective::Device device() const override { return collective::Device::kCuda; }
  int device_index() const override { return device_index_; }
  Result<std::span<std::byte>> HostBuffer(size_t bytes) override;
  Status ToHost(int lane, std::byte* host, const std::byte* device, size_t bytes) override;
  Status ToDevice(int lane, std::byte* device, const std::byte* host, size_t bytes) override;
  Status Wait(int lane) override;

 private:
  explicit CudaCopier(int device_index) : device_index_(device_index) {}
  int device_index_;
  void* streams_[2] = {nullptr, nullptr};  // cudaStream_t, kept out of this header
  std::mutex mu_;
  std::vector<void*> pinned_;  // freed with the copier
};

// One device's memory as the state registry reaches it (nonstop/state.h's
// DeviceMemory): cudaMemcpy between two synchronizations of the device, from
// whichever thread asks (the state transfer's run on several), which keeps
// its current device. Allocate hands out device memory that is freed with
// this object (the test worker's state).
class CudaMemory final : public state::DeviceMemory {
 public:
  // FAILED_PRECONDITION as CudaCopier::Create says.
  static Result<std::shared_ptr<CudaMemory>> Create(int device_index);
  ~CudaMemory() override;

  Result<std::span<std::byte>> Allocate(size_t bytes);
  std::string name() const override;
  int index() const override { return device_index_; }
  Status ToHost(std::byte* host, const std::byte* device, size_t bytes) const override;
  Status ToDevice(std::byte* device, const std::byte* host, size_t bytes) const override;
  Status Check() const override;  // CheckDevice, keeping the caller's current device

 private:
  explicit CudaMemory(int device_index) : device_index_(device_index) {}
  Status Copy(void* to, const void* from, size_t bytes, bool to_host) const;
  int device_index_;
  std::mutex mu_;
  std::vector<void*> allocated_;  // freed with this object
};

// A health check of a device before it is trusted with state (a spare's
// GPU): a buffer written, copied to the host and back, and compared.
Status CheckDevice(int device_index);

// SessionOptions::device_data_plane for cuda:`device_index` (nonstop/session.h): the staged data
// plane over the TCP one, copying with a CudaCopier (two streams, pinned buffers, the copies of
// the next piece overlapping the wire) rather than the session's default MemoryCopier (synchronous
// copies). Its streams do not wait for the caller's: the work that writes a buffer must be done
// (synchronized) before the buffer is reduced. FAILED_PRECONDITION naming the reason when the
// device cannot be used.
std::function<Result<std::unique_ptr<collective::DataPlane>>(
    std::unique_ptr<collective::DataPlane> tcp, net::AbortSignal* abort)>
StagedDataPlaneMaker(int device_index);

}  // namespace nonstop::gpu
