// The NCCL data plane on GPUs (label gpu): two ranks, each on a GPU of its
// own (NCCL refuses two ranks on one device), as threads of this process over
// real TCP data planes. The collectives on device memory give the exact sums
// (small integers in float32), an Abort() from another thread ends a
// collective that a peer never joins, and a generation that leaves a rank out
// after a drain at a step boundary is made by ncclCommShrink while one after
// an abort in flight is a fresh init. With fewer than two GPUs every test says so and is skipped.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collective/tcp_data_plane.h"
#include "common/role_keys.h"
#include "gpu/cuda_copier.h"
#include "gpu/cuda_util.h"
#include "gpu/nccl_data_plane.h"
#include "net/socket.h"

namespace nonstop::gpu {
namespace {

using collective::Communicator;
using collective::CommunicatorOptions;
using collective::Device;
using collective::DType;
using collective::Region;

constexpr int kWorld = 2;

#define SKIP_WITHOUT_TWO_GPUS()                                                           \
  do {                                                                                    \
    int gpus = 0;                                                                         \
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < kWorld)                        \
      GTEST_SKIP() << "the NCCL data plane needs two GPUs (NCCL puts one rank on each); " \
                   << "this machine has " << gpus;                                        \
  } while (0)

// A buffer of floats on cuda:`device`, freed with it.
struct DeviceFloats {
  DeviceFloats(int device, const std::vector<float>& values) : device(device), n(values.size()) {
    DeviceScope scope(device);
    NONSTOP_CHECK(cudaMalloc(&data, n * sizeof(float)) == cudaSuccess);
    NONSTOP_CHECK(cudaMemcpy(data, values.data(), n * sizeof(float), cudaMemcpyHostToDevice) ==
                  cudaSuccess);
  }
  ~DeviceFloats() {
    DeviceScope scope(device);
    cudaFree(data);
  }
  std::vector<float> Read() const {
    DeviceScope scope(device);
    std::vector<float> v(n);
    NONSTOP_CHECK(cudaMemcpy(v.data(), data, n * sizeof(float), cudaMemcpyDeviceToHost) ==
                  cudaSuccess);
    return v;
  }
  Region region() const {
    return {static_cast<std::byte*>(data), n * sizeof(float), Device::kCuda, device};
  }
  int device;
  size_t n;
  void* data = nullptr;
};

struct World {
  World() {
    std::vector<net::Listener> listeners;
    for (int r = 0; r < kWorld; ++r) {
      auto l = net::Listen({"127.0.0.1", 0});
      NONSTOP_CHECK(l.ok()) << l.status().ToString();
      members.push_back({200 + r, l->address.ToString()});
      listeners.push_back(std::move(*l));
    }
    for (int r = 0; r < kWorld; ++r) {
      auto copier = CudaCopier::Create(r);
      NONSTOP_CHECK(copier.ok()) << copier.status().ToString();
      planes.push_back(std::make_unique<NcclDataPlane>(
          collective::TcpDataPlane::Create(
              {WorkerDataKey(crypto::JobKey("nccl-gpu-test")), 200 + r},
              std::move(listeners[static_cast<size_t>(r)]), &aborts[r]),
          *copier, &aborts[r]));
    }
  }
  // Generation `generation` of the members in `ranks` (indices into members), connected.
  void Generation(uint32_t generation, const std::vector<int>& ranks) {
    comms.clear();  // the old generation first: a healthy one is kept to shrink
    comms.resize(kWorld);
    std::vector<collective::Member> in;
    for (int r : ranks) in.push_back(members[static_cast<size_t>(r)]);
    for (size_t i = 0; i < ranks.size(); ++i) {
      CommunicatorOptions o;
      o.generation = generation;
      o.rank = static_cast<int>(i);
      o.members = in;
      o.timeout_collective = std::chrono::milliseconds(60'000);
      comms[static_cast<size_t>(ranks[i])] =
          planes[static_cast<size_t>(ranks[i])]->NewCommunicator(o);
    }
    Each(ranks, [&](int r) {
      Status s = comms[static_cast<size_t>(r)]->Connect();
      ASSERT_TRUE(s.ok()) << s.ToString();
    });
  }
  void Each(const std::vector<int>& ranks, const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r : ranks) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
  NcclCommunicator& nccl(int r) {
    return dynamic_cast<NcclCommunicator&>(*comms[static_cast<size_t>(r)]);
  }
  net::AbortSignal aborts[kWorld];
  std::vector<collective::Member> members;
  std::vector<std::unique_ptr<NcclDataPlane>> planes;
  std::vector<std::unique_ptr<Communicator>> comms;
};

std::vector<float> Ramp(size_t n, float rank) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 1000) + 1000.0f * rank;
  return v;
}

TEST(NcclGpuTest, TheCollectivesOnDeviceMemoryGiveTheExactSums) {
  SKIP_WITHOUT_TWO_GPUS();
  World world;
  world.Generation(1, {0, 1});
  EXPECT_FALSE(world.nccl(0).setup().shrunk) << "the first generation is a fresh init";
  const size_t n = (1 << 20) + 2;  // even over 2 ranks
  std::vector<std::unique_ptr<DeviceFloats>> buffers;
  for (int r = 0; r < kWorld; ++r)
    buffers.push_back(std::make_unique<DeviceFloats>(r, Ramp(n, static_cast<float>(r))));
  world.Each({0, 1}, [&](int r) {
    Status s = world.comms[r]->AllReduce(buffers[r]->region(), DType::kFloat32, ReduceOp::kSum);
    ASSERT_TRUE(s.ok()) << s.ToString();
  });
  for (int r = 0; r < kWorld; ++r) {
    const std::vector<float> v = buffers[r]->Read();
    for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(v[i], 2.0f * (i % 1000) + 1000.0f) << i;
  }
  // Broadcast from rank 1, and an all-gather of uneven chunks (5 records of 4 bytes over 2).
  world.Each({0, 1},
             [&](int r) { ASSERT_TRUE(world.comms[r]->Broadcast(buffers[r]->region(), 1).ok()); });
  EXPECT_EQ(buffers[0]->Read(), buffers[1]->Read());
  std::vector<std::unique_ptr<DeviceFloats>> records;
  for (int r = 0; r < kWorld; ++r)
    records.push_back(std::make_unique<DeviceFloats>(r, std::vector<float>(5, 10.0f * (r + 1))));
  world.Each({0, 1}, [&](int r) {
    Status s = world.comms[r]->AllGather(records[r]->region(), sizeof(float));
    ASSERT_TRUE(s.ok()) << s.ToString();
  });
  for (int r = 0; r < kWorld; ++r)
    EXPECT_EQ(records[r]->Read(), (std::vector<float>{10, 10, 20, 20, 20})) << "rank " << r;
}

TEST(NcclGpuTest, AnAbortFromAnotherThreadEndsACollectiveAPeerNeverJoins) {
  SKIP_WITHOUT_TWO_GPUS();
  World world;
  world.Generation(1, {0, 1});
  DeviceFloats buffer(0, std::vector<float>(1 << 20, 1.0f));
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    world.comms[0]->Abort("the controller aborted generation 1");
  });
  // Rank 1 never calls: without the abort this waits for timeout_collective (60 s).
  Status s = world.comms[0]->AllReduce(buffer.region(), DType::kFloat32, ReduceOp::kSum);
  aborter.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("the controller aborted generation 1"), std::string::npos);
  EXPECT_EQ(world.comms[0]->error().code(), StatusCode::kAborted) << "sticky";
  // Aborted with a call in flight: its communicator is gone, and the next generation is a fresh
  // init even though it only leaves rank 1 out.
  world.Generation(2, {0});
  EXPECT_FALSE(world.nccl(0).setup().shrunk);
}

TEST(NcclGpuTest, AGenerationDrainedAtAStepBoundaryIsShrunkWhenItLeavesARankOut) {
  SKIP_WITHOUT_TWO_GPUS();
  World world;
  world.Generation(1, {0, 1});
  // The session ends a generation at a step boundary by aborting it with nothing in flight: its
  // communicator stays whole, and generation 2, rank 0 alone, is made from it by ncclCommShrink.
  world.comms[0]->Abort("drain at step 10");
  world.comms[1]->Abort("drain at step 10");
  world.Generation(2, {0});
  EXPECT_TRUE(world.nccl(0).setup().shrunk);
  EXPECT_EQ(world.nccl(0).setup().excluded, 1);
  DeviceFloats one(0, std::vector<float>(64, 3.0f));
  Status s = world.comms[0]->AllReduce(one.region(), DType::kFloat32, ReduceOp::kSum);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(one.Read(), std::vector<float>(64, 3.0f)) << "a world of one";
  // Generation 3 brings rank 1 back: a member joins, so a fresh init.
  world.Generation(3, {0, 1});
  EXPECT_FALSE(world.nccl(0).setup().shrunk);
  EXPECT_FALSE(world.nccl(1).setup().shrunk);
  DeviceFloats a(0, std::vector<float>(64, 1.0f)), b(1, std::vector<float>(64, 2.0f));
  world.Each({0, 1}, [&](int r) {
    Status st =
        world.comms[r]->AllReduce((r == 0 ? a : b).region(), DType::kFloat32, ReduceOp::kSum);
    ASSERT_TRUE(st.ok()) << st.ToString();
  });
  EXPECT_EQ(a.Read(), std::vector<float>(64, 3.0f));
  EXPECT_EQ(b.Read(), std::vector<float>(64, 3.0f));
}

}  // namespace
}  // namespace nonstop::gpu
