#include "gpu/cuda_util.h"

#include <cuda_runtime.h>

#include <fmt/format.h>

#include "gpu/cuda_runtime.h"

namespace nonstop::gpu {

Status CudaError(int error, const char* what) {
  const auto e = static_cast<cudaError_t>(error);
  if (e == cudaSuccess) return OkStatus();
  return InternalError(
      fmt::format("{}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

Status DeviceExists(int device_index) {
  int count = 0;
  if (cudaError_t e = Cuda().GetDeviceCount(&count); e != cudaSuccess) {
    return FailedPreconditionError(
        fmt::format("no CUDA device can be used: {}", cudaGetErrorString(e)));
  }
  if (device_index < 0 || device_index >= count) {
    return FailedPreconditionError(fmt::format(
        "cuda:{} does not exist: this machine has {} CUDA device(s)", device_index, count));
  }
  return OkStatus();
}

int DeviceCount() {
  int count = 0;
  return Cuda().GetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// The previous context, not the previous device, is what is put back: a thread that never chose a
// device has none, and setting device 0 back would create device 0's context on it (CUDA 12 and
// later make the primary context at cudaSetDevice).
DeviceScope::DeviceScope(int device_index) {
  CudaRuntime& cuda = Cuda();
  int current = -1;
  status_ = CudaError(cuda.GetDevice(&current), "cudaGetDevice");
  void* context = nullptr;
  if (status_.ok()) status_ = CudaError(cuda.GetCurrentContext(&context), "cuCtxGetCurrent");
  if (!status_.ok()) return;
  if (context != nullptr && current == device_index) return;  // nothing to put back
  status_ = CudaError(cuda.SetDevice(device_index), "cudaSetDevice");
  if (status_.ok()) {
    previous_ = context;
    restore_ = true;
  }
}

DeviceScope::~DeviceScope() {
  if (restore_) Cuda().SetCurrentContext(previous_);
}

}  // namespace nonstop::gpu
