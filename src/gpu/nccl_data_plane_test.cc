// The NCCL data plane (nccl_data_plane.h) where it can be tested without a
// GPU: the arithmetic of a shrink, and a world whose members have no GPU,
// which must fail at Connect naming the CUDA error, at once and for good,
// instead of hanging in NCCL. Its collectives, abort and shrink on GPUs are
// nccl_gpu_test.cc (label gpu: two GPUs or more).
#include "gpu/nccl_data_plane.h"
#include "common/role_keys.h"

#include <gtest/gtest.h>

#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collective/tcp_data_plane.h"
#include "gpu/cuda_util.h"
#include "net/socket.h"
#include "state/protected_device_testing.h"

namespace nonstop::gpu {
namespace {

using collective::CommunicatorOptions;
using collective::Device;
using collective::DType;

TEST(ShrinkExclusionsTest, TheOldRanksThatAreGoneWhenTheRestKeepTheirOrder) {
  const std::vector<int> old_ids{10, 11, 12, 13};
  EXPECT_EQ(ShrinkExclusions(old_ids, std::vector<int>{10, 12, 13}), std::vector<int>{1});
  EXPECT_EQ(ShrinkExclusions(old_ids, std::vector<int>{11, 12}), (std::vector<int>{0, 3}));
  EXPECT_EQ(ShrinkExclusions(old_ids, std::vector<int>{13}), (std::vector<int>{0, 1, 2}));
}

TEST(ShrinkExclusionsTest, AFreshInitWhenAMemberJoinsMovesOrNoneIsLeftOut) {
  const std::vector<int> old_ids{10, 11, 12, 13};
  EXPECT_EQ(ShrinkExclusions(old_ids, std::vector<int>{10, 11, 12, 14}), std::nullopt)
      << "a spare took rank 3";
  EXPECT_EQ(ShrinkExclusions(old_ids, std::vector<int>{10, 12, 11}), std::nullopt)
      << "11 and 12 swapped: ncclCommShrink keeps the old order";
  EXPECT_EQ(ShrinkExclusions(old_ids, old_ids), std::nullopt) << "nothing to leave out";
  EXPECT_EQ(ShrinkExclusions(old_ids, std::vector<int>{}), std::nullopt);
  EXPECT_EQ(ShrinkExclusions(old_ids, std::vector<int>{10, 11, 12, 13, 14}), std::nullopt)
      << "a grow";
}

TEST(NcclDataPlaneTest, WithoutAGpuConnectFailsNamingTheCudaErrorAndTheFailureSticks) {
  if (Status here = DeviceExists(0); here.ok()) {
    GTEST_SKIP() << "a GPU is here: nccl_gpu_test (label gpu) tests the data plane on it";
  }
  constexpr int kWorld = 2;
  net::AbortSignal aborts[kWorld];
  std::vector<collective::Member> members;
  std::vector<net::Listener> listeners;
  for (int r = 0; r < kWorld; ++r) {
    auto l = net::Listen({"127.0.0.1", 0});
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    members.push_back({100 + r, l->address.ToString()});
    listeners.push_back(std::move(*l));
  }
  auto device = std::make_shared<state::ProtectedDevice>();
  std::vector<std::unique_ptr<NcclDataPlane>> planes;
  std::vector<std::unique_ptr<collective::Communicator>> comms;
  for (int r = 0; r < kWorld; ++r) {
    planes.push_back(std::make_unique<NcclDataPlane>(
        collective::TcpDataPlane::Create({WorkerDataKey(crypto::JobKey("nccl-test")), 100 + r},
                                         std::move(listeners[static_cast<size_t>(r)]), &aborts[r]),
        std::make_shared<collective::MemoryCopier>(device), &aborts[r]));
    EXPECT_TRUE(planes.back()->Supports(Device::kCuda));
    CommunicatorOptions o;
    o.generation = 4;
    o.rank = r;
    o.members = members;
    o.timeout_connect = std::chrono::milliseconds(30'000);
    o.timeout_collective = std::chrono::milliseconds(30'000);
    comms.push_back(planes.back()->NewCommunicator(o));
  }
  Status connected[kWorld];
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] { connected[r] = comms[r]->Connect(); });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    // Both ranks agreed over TCP (no shrink: nothing held) and rank 0's unique id reached rank 1;
    // then CUDA refuses: no device or no driver.
    EXPECT_FALSE(connected[r].ok()) << "rank " << r;
    EXPECT_NE(connected[r].message().find("the NCCL communicator of generation 4 on cuda:0"),
              std::string::npos)
        << connected[r].ToString();
    const std::string& m = connected[r].message();
    EXPECT_TRUE(m.find(": cudaGetDevice: ") != std::string::npos ||
                m.find(": cudaSetDevice: ") != std::string::npos)
        << "names the CUDA call that failed: " << connected[r].ToString();
    std::cout << "rank " << r << ": " << connected[r].ToString() << "\n";
    EXPECT_EQ(comms[r]->error().ToString(), connected[r].ToString()) << "sticky";
    std::vector<float> v(4, 1.0f);
    EXPECT_EQ(comms[r]->AllReduce(std::span<float>(v)).ToString(), connected[r].ToString())
        << "host memory too: every later call returns the first failure";
    EXPECT_EQ(comms[r]->Barrier().ToString(), connected[r].ToString());
  }
}

}  // namespace
}  // namespace nonstop::gpu
