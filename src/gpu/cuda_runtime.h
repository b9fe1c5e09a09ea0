// The CUDA runtime calls of src/gpu behind one seam, so that a test can put
// a fake runtime with several devices in its place and see which device each
// thread touches (cuda_runtime_test.cc). The real one calls libcudart; the
// current context is read and set through the driver's entry points, which
// the runtime API has no call for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace nonstop::gpu {

class CudaRuntime {
 public:
  virtual ~CudaRuntime() = default;

  virtual cudaError_t GetDeviceCount(int* count) = 0;
  // The device of the calling thread's context; 0 when it has none (and none is made).
  virtual cudaError_t GetDevice(int* device) = 0;
  // Makes `device`'s primary context the calling thread's (creating it if it is not yet).
  virtual cudaError_t SetDevice(int device) = 0;
  // The calling thread's current context (nullptr when it never chose a device), and putting one
  // back (nullptr: none).
  virtual cudaError_t GetCurrentContext(void** context) = 0;
  virtual cudaError_t SetCurrentContext(void* context) = 0;

  virtual cudaError_t StreamCreate(cudaStream_t* stream, unsigned flags) = 0;
  virtual cudaError_t StreamDestroy(cudaStream_t stream) = 0;
  virtual cudaError_t StreamSynchronize(cudaStream_t stream) = 0;
  virtual cudaError_t StreamQuery(cudaStream_t stream) = 0;
  virtual cudaError_t HostAlloc(void** p, size_t bytes, unsigned flags) = 0;
  virtual cudaError_t FreeHost(void* p) = 0;
  virtual cudaError_t Malloc(void** p, size_t bytes) = 0;
  virtual cudaError_t Free(void* p) = 0;
  virtual cudaError_t Memset(void* p, int value, size_t bytes) = 0;
  virtual cudaError_t Memcpy(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) = 0;
  virtual cudaError_t MemcpyAsync(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                                  cudaStream_t stream) = 0;
  virtual cudaError_t DeviceSynchronize() = 0;
};

// The runtime src/gpu calls: libcudart's, unless a test installed another.
CudaRuntime& Cuda();

// Puts `fake` in place of libcudart's runtime for its lifetime (tests only; not thread-safe
// against calls in flight).
class ScopedCudaRuntimeForTesting {
 public:
  explicit ScopedCudaRuntimeForTesting(CudaRuntime* fake);
  ~ScopedCudaRuntimeForTesting();
  ScopedCudaRuntimeForTesting(const ScopedCudaRuntimeForTesting&) = delete;
  ScopedCudaRuntimeForTesting& operator=(const ScopedCudaRuntimeForTesting&) = delete;

 private:
  CudaRuntime* previous_;
};

}  // namespace nonstop::gpu
