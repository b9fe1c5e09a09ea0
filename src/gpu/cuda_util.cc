#include "gpu/cuda_util.h"

#include <cuda_runtime.h>

#include <fmt/format.h>

namespace nonstop::gpu {

Status CudaError(int error, const char* what) {
  const auto e = static_cast<cudaError_t>(error);
  if (e == cudaSuccess) return OkStatus();
  return InternalError(
      fmt::format("{}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

Status DeviceExists(int device_index) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
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
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

DeviceScope::DeviceScope(int device_index) {
  status_ = CudaError(cudaGetDevice(&previous_), "cudaGetDevice");
  if (!status_.ok()) {
    previous_ = -1;
    return;
  }
  if (previous_ == device_index) {
    previous_ = -1;  // nothing to put back
    return;
  }
  status_ = CudaError(cudaSetDevice(device_index), "cudaSetDevice");
}

DeviceScope::~DeviceScope() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace nonstop::gpu
