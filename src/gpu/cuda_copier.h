// The staged transport's copy engine for CUDA (staged_communicator.h,
// docs/gpu.md): two streams of one device, pinned host buffers. Built when
// CMake finds the CUDA toolkit (NONSTOP_WITH_CUDA); its test needs a GPU
// (label gpu).
#pragma once

#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "collective/staged_communicator.h"

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

// A health check of a device before it is trusted with state (a spare's
// GPU): a buffer written, copied to the host and back, and compared.
Status CheckDevice(int device_index);

}  // namespace nonstop::gpu
