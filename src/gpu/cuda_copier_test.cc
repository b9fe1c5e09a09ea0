// The CUDA copier and the staged transport on a real GPU (label gpu: CI's
// machines have the toolkit and no GPU; bench/gpu/check.sh runs these where
// one is). Without a device every test says so and is skipped.
#include "gpu/cuda_copier.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "nonstop/crc32c.h"
#include "state/state_registry.h"

namespace nonstop::gpu {
namespace {

std::shared_ptr<CudaCopier> CopierOrSkip() {
  auto copier = CudaCopier::Create(0);
  if (!copier.ok()) return nullptr;
  return *copier;
}

#define SKIP_WITHOUT_GPU(copier)                                                       \
  if ((copier) == nullptr)                                                             \
  GTEST_SKIP() << "no CUDA device here (" << CudaCopier::Create(0).status().ToString() \
               << "): this test runs on a GPU machine (ctest -L gpu)"

TEST(CudaCopierTest, APieceGoesUpAndComesBackOnBothLanes) {
  auto copier = CopierOrSkip();
  SKIP_WITHOUT_GPU(copier);
  ASSERT_TRUE(CheckDevice(0).ok());
  const size_t n = 3 << 20;
  void* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, n), cudaSuccess);
  std::vector<std::byte> in(n), out(n);
  for (size_t i = 0; i < n; ++i) in[i] = static_cast<std::byte>(i * 7);
  auto host = copier->HostBuffer(n);
  ASSERT_TRUE(host.ok());
  std::memcpy(host->data(), in.data(), n);
  auto* dev = static_cast<std::byte*>(d);
  ASSERT_TRUE(copier->ToDevice(0, dev, host->data(), n).ok());
  ASSERT_TRUE(copier->Wait(0).ok());
  std::memset(host->data(), 0, n);
  ASSERT_TRUE(copier->ToHost(1, host->data(), dev, n).ok());
  ASSERT_TRUE(copier->Wait(1).ok());
  EXPECT_EQ(std::memcmp(host->data(), in.data(), n), 0);
  cudaFree(d);
}

// Issue 30: state on the GPU registered like host state; its chunks, digest and writes are those
// of the same bytes in host memory.
TEST(CudaMemoryTest, StateOnTheGpuReadsAndWritesLikeTheSameBytesInHostMemory) {
  auto memory = CudaMemory::Create(0);
  if (!memory.ok())
    GTEST_SKIP() << "no CUDA device here (" << memory.status().ToString()
                 << "): this test runs on a GPU machine (ctest -L gpu)";
  std::vector<float> host(100'000);
  for (size_t i = 0; i < host.size(); ++i) host[i] = 0.5f * static_cast<float>(i);
  auto dev = (*memory)->Allocate(host.size() * sizeof(float));
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  state::StateRegistry on_gpu(64 << 10), on_host(64 << 10);
  ASSERT_TRUE(on_gpu.RegisterOnDevice("w", *dev, *memory, "F32").ok());
  ASSERT_TRUE(on_host.RegisterFloats("w", host).ok());
  on_gpu.WriteRegion(0, 0, std::as_bytes(std::span(host)));
  EXPECT_EQ(on_gpu.Digest(), on_host.Digest());
  EXPECT_TRUE(on_gpu.ContiguousChunk(0).empty());
  std::vector<std::byte> chunk(on_host.chunk_size(1));
  on_host.ReadChunk(1, chunk);
  for (auto& b : chunk) b ^= std::byte{0xFF};
  ASSERT_TRUE(on_gpu.WriteChunk(1, chunk, Crc32c(chunk.data(), chunk.size())).ok());
  std::vector<std::byte> back(chunk.size());
  on_gpu.ReadChunk(1, back);
  EXPECT_EQ(back, chunk);
  EXPECT_EQ((*memory)->name(), "cuda:0");
  EXPECT_TRUE((*memory)->Check().ok()) << (*memory)->Check().ToString();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count >= 2) {
    // the caller's current device (1) is kept through a check and a copy of device 0
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    EXPECT_TRUE((*memory)->Check().ok());
    on_gpu.ReadChunk(1, back);
    int after = -1;
    ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
    EXPECT_EQ(after, 1) << "the current device was changed";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }
}

TEST(CudaCopierTest, ADeviceThatDoesNotExistIsNamed) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    GTEST_SKIP() << "no CUDA device here: this test runs on a GPU machine (ctest -L gpu)";
  auto copier = CudaCopier::Create(count);
  ASSERT_FALSE(copier.ok());
  EXPECT_NE(copier.status().message().find(fmt::format("cuda:{} does not exist", count)),
            std::string::npos)
      << copier.status().ToString();
}

}  // namespace
}  // namespace nonstop::gpu
