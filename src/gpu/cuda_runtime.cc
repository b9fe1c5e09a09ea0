#include "gpu/cuda_runtime.h"

#include <cuda.h>

namespace nonstop::gpu {
namespace {

// The driver's context calls, reached through the runtime (libcudart loads the driver itself:
// nothing links libcuda, so the binaries start on machines without one).
struct ContextCalls {
  CUresult (*get)(CUcontext*) = nullptr;
  CUresult (*set)(CUcontext) = nullptr;
  cudaError_t error = cudaSuccess;
};

const ContextCalls& Contexts() {
  static const ContextCalls calls = [] {
    ContextCalls c;
    void* get = nullptr;
    void* set = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    c.error =
        cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 4000, cudaEnableDefault, &found);
    if (c.error == cudaSuccess && found == cudaDriverEntryPointSuccess) {
      c.error = cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 4000, cudaEnableDefault,
                                                 &found);
    }
    if (c.error == cudaSuccess && found != cudaDriverEntryPointSuccess)
      c.error = cudaErrorSymbolNotFound;
    if (c.error == cudaSuccess) {
      c.get = reinterpret_cast<CUresult (*)(CUcontext*)>(get);
      c.set = reinterpret_cast<CUresult (*)(CUcontext)>(set);
    }
    return c;
  }();
  return calls;
}

cudaError_t FromDriver(CUresult r) { return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown; }

class RealRuntime final : public CudaRuntime {
 public:
  cudaError_t GetDeviceCount(int* count) override { return cudaGetDeviceCount(count); }
  cudaError_t GetDevice(int* device) override { return cudaGetDevice(device); }
  cudaError_t SetDevice(int device) override { return cudaSetDevice(device); }
  cudaError_t GetCurrentContext(void** context) override {
    const ContextCalls& calls = Contexts();
    if (calls.get == nullptr) return calls.error;
    CUcontext c = nullptr;
    const CUresult r = calls.get(&c);
    *context = c;
    // A driver not initialized yet has no context on any thread.
    return r == CUDA_ERROR_NOT_INITIALIZED ? cudaSuccess : FromDriver(r);
  }
  cudaError_t SetCurrentContext(void* context) override {
    const ContextCalls& calls = Contexts();
    if (calls.set == nullptr) return calls.error;
    return FromDriver(calls.set(static_cast<CUcontext>(context)));
  }
  cudaError_t StreamCreate(cudaStream_t* stream, unsigned flags) override {
    return cudaStreamCreateWithFlags(stream, flags);
  }
  cudaError_t StreamDestroy(cudaStream_t stream) override { return cudaStreamDestroy(stream); }
  cudaError_t StreamSynchronize(cudaStream_t stream) override {
    return cudaStreamSynchronize(stream);
  }
  cudaError_t StreamQuery(cudaStream_t stream) override { return cudaStreamQuery(stream); }
  cudaError_t HostAlloc(void** p, size_t bytes, unsigned flags) override {
    return cudaHostAlloc(p, bytes, flags);
  }
  cudaError_t FreeHost(void* p) override { return cudaFreeHost(p); }
  cudaError_t Malloc(void** p, size_t bytes) override { return cudaMalloc(p, bytes); }
  cudaError_t Free(void* p) override { return cudaFree(p); }
  cudaError_t Memset(void* p, int value, size_t bytes) override {
    return cudaMemset(p, value, bytes);
  }
  cudaError_t Memcpy(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) override {
    return cudaMemcpy(to, from, bytes, kind);
  }
  cudaError_t MemcpyAsync(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                          cudaStream_t stream) override {
    return cudaMemcpyAsync(to, from, bytes, kind, stream);
  }
  cudaError_t DeviceSynchronize() override { return cudaDeviceSynchronize(); }
};

CudaRuntime* installed = nullptr;  // a test's

}  // namespace

CudaRuntime& Cuda() {
  // Never destroyed: a thread still copying at exit, or another file's static destructor, may call.
  static CudaRuntime* const real = new RealRuntime;
  return installed != nullptr ? *installed : *real;
}

ScopedCudaRuntimeForTesting::ScopedCudaRuntimeForTesting(CudaRuntime* fake) : previous_(installed) {
  installed = fake;
}

ScopedCudaRuntimeForTesting::~ScopedCudaRuntimeForTesting() { installed = previous_; }

}  // namespace nonstop::gpu
