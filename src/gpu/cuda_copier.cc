#include "gpu/cuda_copier.h"

#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "gpu/cuda_runtime.h"
#include "gpu/cuda_util.h"
#include "nonstop/cuda.h"

namespace nonstop::gpu {
namespace {

cudaStream_t Stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

Result<std::shared_ptr<CudaCopier>> CudaCopier::Create(int device_index) {
  NONSTOP_RETURN_IF_ERROR(DeviceExists(device_index));
  auto copier = std::shared_ptr<CudaCopier>(new CudaCopier(device_index));
  DeviceScope scope(device_index);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  for (void*& s : copier->streams_) {
    cudaStream_t stream = nullptr;
    NONSTOP_RETURN_IF_ERROR(
        CudaError(Cuda().StreamCreate(&stream, cudaStreamNonBlocking), "cudaStreamCreate"));
    s = stream;
  }
  return copier;
}

CudaCopier::~CudaCopier() {
  DeviceScope scope(device_index_);
  for (void* s : streams_) {
    if (s != nullptr) {
      Cuda().StreamSynchronize(Stream(s));
      Cuda().StreamDestroy(Stream(s));
    }
  }
  for (void* p : pinned_) Cuda().FreeHost(p);
}

Result<std::span<std::byte>> CudaCopier::HostBuffer(size_t bytes) {
  DeviceScope scope(device_index_);  // pinned memory belongs to a context
  NONSTOP_RETURN_IF_ERROR(scope.status());
  void* p = nullptr;
  NONSTOP_RETURN_IF_ERROR(
      CudaError(Cuda().HostAlloc(&p, bytes, cudaHostAllocPortable), "cudaHostAlloc"));
  std::lock_guard lock(mu_);
  pinned_.push_back(p);
  return std::span<std::byte>(static_cast<std::byte*>(p), bytes);
}

Status CudaCopier::ToHost(int lane, std::byte* host, const std::byte* device, size_t bytes) {
  DeviceScope scope(device_index_);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  return CudaError(
      Cuda().MemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, Stream(streams_[lane & 1])),
      "cudaMemcpyAsync to the host");
}

Status CudaCopier::ToDevice(int lane, std::byte* device, const std::byte* host, size_t bytes) {
  DeviceScope scope(device_index_);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  return CudaError(
      Cuda().MemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, Stream(streams_[lane & 1])),
      "cudaMemcpyAsync to the device");
}

Status CudaCopier::Wait(int lane) {
  DeviceScope scope(device_index_);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  return CudaError(Cuda().StreamSynchronize(Stream(streams_[lane & 1])), "cudaStreamSynchronize");
}

Result<std::shared_ptr<CudaMemory>> CudaMemory::Create(int device_index) {
  NONSTOP_RETURN_IF_ERROR(DeviceExists(device_index));
  return std::shared_ptr<CudaMemory>(new CudaMemory(device_index));
}

CudaMemory::~CudaMemory() {
  DeviceScope scope(device_index_);
  for (void* p : allocated_) Cuda().Free(p);
}

Result<std::span<std::byte>> CudaMemory::Allocate(size_t bytes) {
  DeviceScope scope(device_index_);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  void* p = nullptr;
  NONSTOP_RETURN_IF_ERROR(CudaError(Cuda().Malloc(&p, bytes), "cudaMalloc"));
  std::lock_guard lock(mu_);
  allocated_.push_back(p);
  return std::span<std::byte>(static_cast<std::byte*>(p), bytes);
}

std::string CudaMemory::name() const { return fmt::format("cuda:{}", device_index_); }

// A copy between the device and the host that is over, for every stream of the device, when it
// returns: the device is synchronized before (work on any stream that writes the bytes, a
// framework's side streams included, is done) and after (a copy from pageable memory may return
// before it lands). The calling thread's current device is put back.
Status CudaMemory::Copy(void* to, const void* from, size_t bytes, bool to_host) const {
  DeviceScope scope(device_index_);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  Status s = CudaError(Cuda().DeviceSynchronize(), "cudaDeviceSynchronize");
  if (s.ok()) {
    s = CudaError(
        Cuda().Memcpy(to, from, bytes, to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice),
        to_host ? "cudaMemcpy to the host" : "cudaMemcpy to the device");
  }
  if (s.ok()) s = CudaError(Cuda().DeviceSynchronize(), "cudaDeviceSynchronize");
  return s;
}

Status CudaMemory::ToHost(std::byte* host, const std::byte* device, size_t bytes) const {
  return Copy(host, device, bytes, /*to_host=*/true);
}

Status CudaMemory::ToDevice(std::byte* device, const std::byte* host, size_t bytes) const {
  return Copy(device, host, bytes, /*to_host=*/false);
}

Status CudaMemory::Check() const { return CheckDevice(device_index_); }

std::function<Result<std::unique_ptr<collective::DataPlane>>(
    std::unique_ptr<collective::DataPlane> tcp, net::AbortSignal* abort)>
StagedDataPlaneMaker(int device_index) {
  return [device_index](
             std::unique_ptr<collective::DataPlane> tcp,
             net::AbortSignal* /*abort*/) -> Result<std::unique_ptr<collective::DataPlane>> {
    NONSTOP_ASSIGN_OR_RETURN(std::shared_ptr<CudaCopier> copier, CudaCopier::Create(device_index));
    return std::unique_ptr<collective::DataPlane>(
        std::make_unique<collective::StagedDataPlane>(std::move(tcp), std::move(copier)));
  };
}

Status CheckDevice(int device_index) {
  DeviceScope scope(device_index);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  constexpr size_t kBytes = 1 << 20;
  std::vector<unsigned char> pattern(kBytes), back(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<unsigned char>(i * 131 + 7);
  void* d = nullptr;
  NONSTOP_RETURN_IF_ERROR(CudaError(Cuda().Malloc(&d, kBytes), "cudaMalloc"));
  Status s = CudaError(Cuda().Memset(d, 0xA5, kBytes), "cudaMemset");
  if (s.ok())
    s = CudaError(Cuda().Memcpy(back.data(), d, kBytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  if (s.ok() && back != std::vector<unsigned char>(kBytes, 0xA5))
    s = DataLossError(fmt::format("cuda:{} returned other bytes than it was set to", device_index));
  if (s.ok())
    s = CudaError(Cuda().Memcpy(d, pattern.data(), kBytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  if (s.ok())
    s = CudaError(Cuda().Memcpy(back.data(), d, kBytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  if (s.ok() && back != pattern)
    s = DataLossError(
        fmt::format("cuda:{} returned other bytes than were copied in", device_index));
  Cuda().Free(d);
  return s.WithContext(fmt::format("health check of cuda:{}", device_index));
}

}  // namespace nonstop::gpu

namespace nonstop {

Result<std::shared_ptr<const state::DeviceMemory>> CudaDeviceMemory(int index) {
  NONSTOP_ASSIGN_OR_RETURN(std::shared_ptr<gpu::CudaMemory> memory, gpu::CudaMemory::Create(index));
  return std::shared_ptr<const state::DeviceMemory>(std::move(memory));
}

int CudaDeviceCount() { return gpu::DeviceCount(); }

}  // namespace nonstop
