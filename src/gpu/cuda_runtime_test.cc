// Which device each thread of a worker touches (issue 56): src/gpu's CUDA
// calls against a fake runtime with four devices that keeps each thread's
// current context and every context it creates, as CUDA 12 and later do: a
// call that needs a context on a thread without one makes device 0's, and
// cudaSetDevice makes the device's. A worker on cuda:1 must never make one on
// cuda:0 (hundreds of MB each, and a failure in exclusive-process mode), and a
// thread must have the context it had before it called in.
#include "gpu/cuda_runtime.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gpu/cuda_copier.h"
#include "gpu/cuda_util.h"

namespace nonstop::gpu {
namespace {

class FakeCuda final : public CudaRuntime {
 public:
  // The devices whose primary context was created, and every call that needed a context, as
  // "call on cuda:N".
  std::set<int> contexts() const {
    std::lock_guard lock(mu_);
    return created_;
  }
  std::vector<std::string> calls() const {
    std::lock_guard lock(mu_);
    return calls_;
  }
  // Forgets a thread that ended (its id may be given to the next).
  void Forget(std::thread::id thread) {
    std::lock_guard lock(mu_);
    current_.erase(thread);
  }
  // The device of the calling thread's context; -1 when it has none.
  int ThreadDevice() const {
    std::lock_guard lock(mu_);
    auto it = current_.find(std::this_thread::get_id());
    return it == current_.end() ? -1 : it->second;
  }

  cudaError_t GetDeviceCount(int* count) override {
    *count = kDevices;
    return cudaSuccess;
  }
  cudaError_t GetDevice(int* device) override {
    const int d = ThreadDevice();
    *device = d < 0 ? 0 : d;
    return cudaSuccess;
  }
  cudaError_t SetDevice(int device) override {
    if (device < 0 || device >= kDevices) return cudaErrorInvalidDevice;
    std::lock_guard lock(mu_);
    created_.insert(device);
    current_[std::this_thread::get_id()] = device;
    return cudaSuccess;
  }
  cudaError_t GetCurrentContext(void** context) override {
    const int d = ThreadDevice();
    *context = d < 0 ? nullptr : &contexts_[d];
    return cudaSuccess;
  }
  cudaError_t SetCurrentContext(void* context) override {
    std::lock_guard lock(mu_);
    if (context == nullptr) {
      current_.erase(std::this_thread::get_id());
    } else {
      current_[std::this_thread::get_id()] = static_cast<int*>(context) - contexts_;
    }
    return cudaSuccess;
  }
  cudaError_t StreamCreate(cudaStream_t* stream, unsigned) override {
    Use("cudaStreamCreate");
    *stream = reinterpret_cast<cudaStream_t>(new int);
    return cudaSuccess;
  }
  cudaError_t StreamDestroy(cudaStream_t stream) override {
    Use("cudaStreamDestroy");
    delete reinterpret_cast<int*>(stream);
    return cudaSuccess;
  }
  cudaError_t StreamSynchronize(cudaStream_t) override { return Use("cudaStreamSynchronize"); }
  cudaError_t StreamQuery(cudaStream_t) override { return Use("cudaStreamQuery"); }
  cudaError_t HostAlloc(void** p, size_t bytes, unsigned) override {
    Use("cudaHostAlloc");
    *p = new std::byte[bytes];
    return cudaSuccess;
  }
  cudaError_t FreeHost(void* p) override {
    Use("cudaFreeHost");
    delete[] static_cast<std::byte*>(p);
    return cudaSuccess;
  }
  cudaError_t Malloc(void** p, size_t bytes) override {
    Use("cudaMalloc");
    *p = new std::byte[bytes];  // the fake's device memory is the host's
    return cudaSuccess;
  }
  cudaError_t Free(void* p) override {
    Use("cudaFree");
    delete[] static_cast<std::byte*>(p);
    return cudaSuccess;
  }
  cudaError_t Memset(void* p, int value, size_t bytes) override {
    std::memset(p, value, bytes);
    return Use("cudaMemset");
  }
  cudaError_t Memcpy(void* to, const void* from, size_t bytes, cudaMemcpyKind) override {
    std::memcpy(to, from, bytes);
    return Use("cudaMemcpy");
  }
  cudaError_t MemcpyAsync(void* to, const void* from, size_t bytes, cudaMemcpyKind,
                          cudaStream_t) override {
    std::memcpy(to, from, bytes);
    return Use("cudaMemcpyAsync");
  }
  cudaError_t DeviceSynchronize() override { return Use("cudaDeviceSynchronize"); }

 private:
  static constexpr int kDevices = 4;

  // A call that needs a context: on a thread without one, the runtime makes device 0's current.
  cudaError_t Use(const char* call) {
    std::lock_guard lock(mu_);
    auto [it, fresh] = current_.try_emplace(std::this_thread::get_id(), 0);
    if (fresh) created_.insert(0);
    calls_.push_back(fmt::format("{} on cuda:{}", call, it->second));
    return cudaSuccess;
  }

  mutable std::mutex mu_;
  int contexts_[kDevices] = {};  // a context is the address of its device's entry
  std::map<std::thread::id, int> current_;
  std::set<int> created_;
  std::vector<std::string> calls_;
};

class CudaRuntimeTest : public ::testing::Test {
 protected:
  // Runs `work` on a thread of its own that never chose a device (the state transfer's, the
  // staged data plane's lanes, the communication thread), and expects it to end without a
  // context, as it began.
  void OnAFreshThread(const std::function<void()>& work) {
    std::thread t([&] {
      work();
      EXPECT_EQ(fake_.ThreadDevice(), -1) << "the thread was left with a context";
    });
    const std::thread::id id = t.get_id();
    t.join();
    fake_.Forget(id);
  }

  // Every context made and every call were cuda:1's.
  void ExpectOnlyDevice1() {
    EXPECT_EQ(fake_.contexts(), std::set<int>{1}) << "contexts were created on other devices";
    for (const std::string& call : fake_.calls())
      EXPECT_EQ(call.substr(call.size() - 6), "cuda:1") << call;
  }

  FakeCuda fake_;
  ScopedCudaRuntimeForTesting installed_{&fake_};
};

TEST_F(CudaRuntimeTest, ADeviceScopeOnAThreadThatNeverChoseADeviceLeavesItWithout) {
  OnAFreshThread([&] {
    DeviceScope scope(1);
    ASSERT_TRUE(scope.status().ok()) << scope.status().ToString();
    EXPECT_EQ(fake_.ThreadDevice(), 1);
  });
  ExpectOnlyDevice1();
}

TEST_F(CudaRuntimeTest, ADeviceScopePutsBackTheDeviceTheThreadHad) {
  OnAFreshThread([&] {
    ASSERT_EQ(fake_.SetDevice(2), cudaSuccess);
    {
      DeviceScope scope(1);
      EXPECT_EQ(fake_.ThreadDevice(), 1);
    }
    EXPECT_EQ(fake_.ThreadDevice(), 2);
    {
      DeviceScope same(2);
      EXPECT_EQ(fake_.ThreadDevice(), 2);
    }
    EXPECT_EQ(fake_.ThreadDevice(), 2);
    ASSERT_EQ(fake_.SetCurrentContext(nullptr), cudaSuccess);
  });
  EXPECT_EQ(fake_.contexts(), (std::set<int>{1, 2}));
}

// The staged data plane's copier: made on one thread, its pinned buffers asked for on another, its
// lanes copied and waited on from two more, and destroyed on a fifth, none of which chose a device.
TEST_F(CudaRuntimeTest, TheCopierOfCuda1TouchesOnlyCuda1OnEveryThread) {
  std::shared_ptr<CudaCopier> copier;
  OnAFreshThread([&] {
    auto made = CudaCopier::Create(1);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    copier = *made;
  });
  ASSERT_NE(copier, nullptr);
  std::span<std::byte> host;
  OnAFreshThread([&] {
    auto buffer = copier->HostBuffer(1 << 12);
    ASSERT_TRUE(buffer.ok()) << buffer.status().ToString();
    host = *buffer;
  });
  ASSERT_EQ(host.size(), size_t{1} << 12);
  std::vector<std::byte> device(1 << 12, std::byte{7});
  for (int lane : {0, 1}) {
    OnAFreshThread([&] {
      EXPECT_TRUE(copier->ToHost(lane, host.data(), device.data(), host.size()).ok());
      EXPECT_TRUE(copier->Wait(lane).ok());
      EXPECT_TRUE(copier->ToDevice(lane, device.data(), host.data(), host.size()).ok());
      EXPECT_TRUE(copier->Wait(lane).ok());
    });
  }
  EXPECT_EQ(host[0], std::byte{7});
  OnAFreshThread([&] { copier.reset(); });
  ExpectOnlyDevice1();
}

// State registered on cuda:1 (CudaMemory): allocated, copied both ways, checked and freed from
// threads that never chose a device; and a health check from a thread whose device is cuda:3
// leaves it there.
TEST_F(CudaRuntimeTest, TheStateMemoryOfCuda1TouchesOnlyCuda1OnEveryThread) {
  auto memory = CudaMemory::Create(1);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  std::span<std::byte> region;
  OnAFreshThread([&] {
    auto allocated = (*memory)->Allocate(1 << 12);
    ASSERT_TRUE(allocated.ok()) << allocated.status().ToString();
    region = *allocated;
  });
  std::vector<std::byte> in(region.size(), std::byte{3}), out(region.size());
  OnAFreshThread([&] {
    EXPECT_TRUE((*memory)->ToDevice(region.data(), in.data(), in.size()).ok());
    EXPECT_TRUE((*memory)->ToHost(out.data(), region.data(), out.size()).ok());
  });
  EXPECT_EQ(out, in);
  OnAFreshThread([&] { EXPECT_TRUE((*memory)->Check().ok()); });
  OnAFreshThread([&] { EXPECT_TRUE(CheckDevice(1).ok()); });
  OnAFreshThread([&] { memory->reset(); });
  ExpectOnlyDevice1();

  OnAFreshThread([&] {
    ASSERT_EQ(fake_.SetDevice(3), cudaSuccess);
    EXPECT_TRUE(CheckDevice(1).ok());
    EXPECT_EQ(fake_.ThreadDevice(), 3) << "the health check changed the thread's device";
    ASSERT_EQ(fake_.SetCurrentContext(nullptr), cudaSuccess);
  });
}

}  // namespace
}  // namespace nonstop::gpu
