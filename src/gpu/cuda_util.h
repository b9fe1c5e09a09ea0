// What the CUDA sources share (docs/gpu.md): CUDA errors as statuses, the
// check that a device can be used, and a scope that keeps the calling
// thread's current device.
#pragma once

#include "nonstop/status.h"

namespace nonstop::gpu {

// OK for cudaSuccess; else INTERNAL naming `what` and the error (a cudaError_t).
Status CudaError(int error, const char* what);

// OK when cuda:`device_index` exists and the driver answers; FAILED_PRECONDITION
// naming the reason when not (no driver, no such device).
Status DeviceExists(int device_index);

// The CUDA devices this process sees: 0 when none can be used.
int DeviceCount();

// Makes cuda:`device_index` the calling thread's current device until it
// ends, then puts the thread's previous context back: none on a thread that
// never chose a device, so that a worker touches no device but its own. Every
// CUDA call of src/gpu runs inside one.
class DeviceScope {
 public:
  explicit DeviceScope(int device_index);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  const Status& status() const { return status_; }

 private:
  void* previous_ = nullptr;  // a CUcontext; nullptr: the thread had none
  bool restore_ = false;
  Status status_;
};

}  // namespace nonstop::gpu
