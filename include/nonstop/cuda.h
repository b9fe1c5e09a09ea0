// CUDA memory for the state registry (issue 30, docs/gpu.md), in the library
// nonstop_gpu, which is built where CMake finds the CUDA toolkit.
#pragma once

#include <memory>

#include "nonstop/state.h"
#include "nonstop/status.h"

namespace nonstop {

// The DeviceMemory of cuda:`index`, for StateRegistry::RegisterOnDevice: regions
// of memory allocated on that device by anyone (PyTorch's caching allocator
// included), read and written with the CUDA runtime. FAILED_PRECONDITION naming
// the reason when the device cannot be used (no driver, no such device).
Result<std::shared_ptr<const state::DeviceMemory>> CudaDeviceMemory(int index);

// The CUDA devices this process sees: 0 when none can be used (no driver, none visible).
int CudaDeviceCount();

}  // namespace nonstop
