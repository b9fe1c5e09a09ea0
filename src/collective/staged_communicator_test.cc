// The staged transport (staged_communicator.h) over real TCP ranks, with a
// copier whose "device" is host memory: every collective on device regions
// gives the bits of the host collective (piece by piece for the pipelined
// ones), the pieces are pipelined (the copy up of piece k+1 starts before
// piece k is reduced), and a region on another device is refused. The CUDA
// copier itself is tested on a GPU (gpu/cuda_copier_test.cc, label gpu).
#include "collective/staged_communicator.h"
#include "common/role_keys.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective/tcp_data_plane.h"
#include "net/socket.h"

namespace nonstop::collective {
namespace {

// "cuda:0" that is host memory; copies are immediate and logged.
class StandInCopier : public DeviceCopier {
 public:
  Device device() const override { return Device::kCuda; }
  int device_index() const override { return 0; }
  Result<std::span<std::byte>> HostBuffer(size_t bytes) override {
    std::lock_guard lock(mu_);
    buffers_.emplace_back(bytes);
    return std::span<std::byte>(buffers_.back());
  }
  size_t host_buffers() {
    std::lock_guard lock(mu_);
    return buffers_.size();
  }
  Status ToHost(int lane, std::byte* host, const std::byte* device, size_t bytes) override {
    std::memcpy(host, device, bytes);
    Log(fmt::format("up{}", lane));
    return OkStatus();
  }
  Status ToDevice(int lane, std::byte* device, const std::byte* host, size_t bytes) override {
    std::memcpy(device, host, bytes);
    Log(fmt::format("down{}", lane));
    return OkStatus();
  }
  Status Wait(int lane) override {
    Log(fmt::format("wait{}", lane));
    return OkStatus();
  }
  void Log(std::string event) {
    std::lock_guard lock(mu_);
    log_.push_back(std::move(event));
  }
  std::vector<std::string> log() {
    std::lock_guard lock(mu_);
    return log_;
  }

 private:
  std::vector<std::vector<std::byte>> buffers_;
  std::mutex mu_;
  std::vector<std::string> log_;
};

constexpr int kWorld = 3;

struct World {
  World() {
    std::vector<net::Listener> listeners;
    for (int r = 0; r < kWorld; ++r) {
      auto l = net::Listen({"127.0.0.1", 0});
      NONSTOP_CHECK(l.ok()) << l.status().ToString();
      members.push_back({r, l->address.ToString()});
      listeners.push_back(std::move(*l));
    }
    for (int r = 0; r < kWorld; ++r) {
      planes.push_back(TcpDataPlane::Create({WorkerDataKey(crypto::JobKey("staged-test")), r},
                                            std::move(listeners[static_cast<size_t>(r)]),
                                            &aborts[r]));
      CommunicatorOptions o;
      o.rank = r;
      o.members = members;
      o.timeout_collective = Millis(30'000);
      copiers.push_back(std::make_shared<StandInCopier>());
      staged.push_back(std::make_unique<StagedCommunicator>(planes.back()->NewCommunicator(o),
                                                            copiers.back(), StagedOptions{1024}));
      o.op_space = 5;  // the host reference runs in its own frame space
      host.push_back(planes.back()->NewCommunicator(o));
    }
  }
  // Runs fn(rank) on every rank at once.
  void Each(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
  net::AbortSignal aborts[kWorld];
  std::vector<Member> members;
  std::vector<std::unique_ptr<TcpDataPlane>> planes;
  std::vector<std::shared_ptr<StandInCopier>> copiers;
  std::vector<std::unique_ptr<Communicator>> staged, host;
};

std::vector<float> Values(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = 0.1f * static_cast<float>(i % 97) + 1.3f * static_cast<float>(rank + 1);
  return v;
}

Region Cuda(std::vector<float>& v) {
  return {reinterpret_cast<std::byte*>(v.data()), v.size() * sizeof(float), Device::kCuda, 0};
}

TEST(StagedCommunicatorTest, AllReduceOnDeviceMemoryHasTheHostRingsBitsPieceByPiece) {
  World world;
  const size_t n = 1000;  // 4000 bytes: pieces of 1024, the last one short
  std::vector<std::vector<float>> device(kWorld), reference(kWorld);
  world.Each([&](int r) {
    device[r] = Values(r, n);
    reference[r] = Values(r, n);
    ASSERT_TRUE(world.staged[r]->AllReduce(Cuda(device[r]), DType::kFloat32, ReduceOp::kSum).ok());
    for (size_t begin = 0; begin < n; begin += 256) {  // the host ring over the same pieces
      std::span<float> piece =
          std::span(reference[r]).subspan(begin, std::min<size_t>(256, n - begin));
      ASSERT_TRUE(world.host[r]->AllReduce(piece).ok());
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(std::memcmp(device[r].data(), reference[r].data(), n * sizeof(float)), 0)
        << "rank " << r;
    EXPECT_EQ(std::memcmp(device[r].data(), device[0].data(), n * sizeof(float)), 0);
  }
  EXPECT_FLOAT_EQ(device[0][5], 3 * 0.5f + 1.3f * 6);
  // The copy up of the next piece starts before this one is reduced and copied down.
  EXPECT_EQ(
      world.copiers[0]->log(),
      (std::vector<std::string>{"up0", "wait0", "up1", "down0", "wait1", "up0", "down1", "wait0",
                                "up1", "down0", "wait1", "down1", "wait0", "wait1"}));
}

TEST(StagedCommunicatorTest, EveryOtherCollectiveMovesDeviceMemoryAsTheHostOneDoes) {
  World world;
  const size_t n = 600;
  world.Each([&](int r) {
    Communicator& c = *world.staged[r];
    std::vector<float> b = r == 1 ? Values(1, n) : std::vector<float>(n);
    ASSERT_TRUE(c.Broadcast(Cuda(b), 1).ok());
    EXPECT_EQ(b, Values(1, n)) << "broadcast, rank " << r;

    std::vector<float> g(n), want(n);
    auto [lo, hi] = ChunkRange(n, kWorld, r);
    for (size_t i = lo; i < hi; ++i) g[i] = static_cast<float>(r);
    for (int q = 0; q < kWorld; ++q) {
      auto [qlo, qhi] = ChunkRange(n, kWorld, q);
      for (size_t i = qlo; i < qhi; ++i) want[i] = static_cast<float>(q);
    }
    ASSERT_TRUE(c.AllGather(Cuda(g), sizeof(float)).ok());
    EXPECT_EQ(g, want) << "all-gather, rank " << r;

    std::vector<float> s(n, static_cast<float>(r + 1));
    ASSERT_TRUE(c.ReduceScatter(Cuda(s), DType::kFloat32, ReduceOp::kSum).ok());
    for (size_t i = lo; i < hi; ++i) ASSERT_EQ(s[i], 6.0f) << "reduce-scatter, rank " << r;

    // The tree: each rank one micro-batch, its partial on the device, the sum on the device.
    std::vector<float> partial(n, static_cast<float>(r) + 0.25f), out(n);
    const std::vector<std::vector<TreeNode>> nodes = {
        NodesOfRange(kWorld, 0, 1), NodesOfRange(kWorld, 1, 2), NodesOfRange(kWorld, 2, 3)};
    const std::vector<ConstRegion> partials = {Cuda(partial)};
    ASSERT_TRUE(c.AllReduceTree(kWorld, nodes, partials, Cuda(out)).ok());
    EXPECT_EQ(out, std::vector<float>(n, 3.75f)) << "tree, rank " << r;

    // Point to point: rank 0 sends its device buffer to rank 2's device buffer.
    std::vector<float> p = r == 0 ? Values(7, n) : std::vector<float>(n);
    if (r == 0) {
      ASSERT_TRUE(c.Send(2, ConstRegion(Cuda(p))).ok());
    }
    if (r == 2) {
      ASSERT_TRUE(c.Recv(0, Cuda(p)).ok());
      EXPECT_EQ(p, Values(7, n));
    }
  });
}

// The state copy's lanes pass through: host memory on each of the host communicator's lanes, device
// memory on lane 0 (staged), and refused on the others before anything moves.
TEST(StagedCommunicatorTest, LanesAreTheHostCommunicatorsAndDeviceMemoryTakesLaneZero) {
  World world;
  ASSERT_EQ(world.staged[0]->p2p_lanes(), world.host[0]->p2p_lanes());
  ASSERT_GT(world.staged[0]->p2p_lanes(), 1);
  const int last = world.staged[0]->p2p_lanes() - 1;
  const size_t n = 300;
  world.Each([&](int r) {
    Communicator& c = *world.staged[r];
    std::vector<float> on_host = r == 0 ? Values(3, n) : std::vector<float>(n);
    std::vector<float> on_device = r == 0 ? Values(4, n) : std::vector<float>(n);
    if (r == 0) {
      ASSERT_TRUE(c.SendOnLane(1, last, HostRegion(std::span<const float>(on_host)), false).ok());
      ASSERT_TRUE(c.SendOnLane(1, 0, ConstRegion(Cuda(on_device)), true).ok());
      Status refused = c.SendOnLane(1, last, ConstRegion(Cuda(on_device)), true);
      EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
      EXPECT_TRUE(c.error().ok()) << "a refusal is not sticky";
    }
    if (r == 1) {
      ASSERT_TRUE(c.RecvOnLane(0, last, HostRegion(std::span<float>(on_host)), false).ok());
      ASSERT_TRUE(c.RecvOnLane(0, 0, Cuda(on_device), true).ok());
      EXPECT_EQ(on_host, Values(3, n));
      EXPECT_EQ(on_device, Values(4, n));
    }
  });
  EXPECT_EQ(world.planes[0]->stats().connections_opened, 2) << "lane 0 and the last lane to rank 1";
}

TEST(StagedDataPlaneTest, SupportsTheCopiersDeviceAndMakesStagedCommunicators) {
  net::AbortSignal abort;
  auto listener = net::Listen({"127.0.0.1", 0});
  ASSERT_TRUE(listener.ok());
  const std::string address = listener->address.ToString();
  StagedDataPlane plane(TcpDataPlane::Create({WorkerDataKey(crypto::JobKey("staged-test")), 0},
                                             std::move(*listener), &abort),
                        std::make_shared<StandInCopier>());
  EXPECT_TRUE(plane.Supports(Device::kHost));
  EXPECT_TRUE(plane.Supports(Device::kCuda));
  EXPECT_EQ(plane.address().ToString(), address);
  CommunicatorOptions o;
  o.members = {{0, address}};
  auto comm = plane.NewCommunicator(o);
  ASSERT_NE(dynamic_cast<StagedCommunicator*>(comm.get()), nullptr);
  std::vector<float> v(8, 2.0f);
  ASSERT_TRUE(comm->AllReduce(Cuda(v), DType::kFloat32, ReduceOp::kSum).ok()) << "a world of one";
  EXPECT_EQ(v, std::vector<float>(8, 2.0f));
}

// Every communicator a staged data plane makes, each generation's and each sub-group's, stages
// through one pool of host buffers: fifty generations reuse what the first one took from the
// copier (two pieces and a whole buffer), where each used to take its own, kept until the end.
TEST(StagedDataPlaneTest, EveryCommunicatorOfADataPlaneSharesItsStagingBuffers) {
  net::AbortSignal abort;
  auto listener = net::Listen({"127.0.0.1", 0});
  ASSERT_TRUE(listener.ok());
  const std::string address = listener->address.ToString();
  auto copier = std::make_shared<StandInCopier>();
  StagedDataPlane plane(TcpDataPlane::Create({WorkerDataKey(crypto::JobKey("staged-test")), 0},
                                             std::move(*listener), &abort),
                        copier, StagedOptions{1024});
  for (int generation = 1; generation <= 50; ++generation) {
    CommunicatorOptions o;
    o.members = {{0, address}};
    auto comm = plane.NewCommunicator(o);
    const std::vector<int> group{0};
    auto sub = comm->SubGroup(group, 1, Millis(0));
    std::vector<float> v(4096, 1.0f);  // 16 KiB: 16 pieces of 1 KiB
    ASSERT_TRUE(comm->AllReduce(Cuda(v), DType::kFloat32, ReduceOp::kSum).ok());
    ASSERT_TRUE(sub->ReduceScatter(Cuda(v), DType::kFloat32, ReduceOp::kSum).ok());
    ASSERT_TRUE(sub->AllGather(Cuda(v), sizeof(float)).ok());
    ASSERT_EQ(v, std::vector<float>(4096, 1.0f)) << "a world of one: generation " << generation;
  }
  EXPECT_EQ(copier->host_buffers(), 3u);
  EXPECT_EQ(plane.pool().buffers(), 3u);
}

// A lease goes back to the pool when it ends, and the pool hands out the smallest free buffer that
// is large enough: a larger request takes a new one.
TEST(StagingPoolTest, ALeaseGoesBackAndTheSmallestBufferThatFitsIsTakenAgain) {
  auto copier = std::make_shared<StandInCopier>();
  StagingPool pool(copier);
  std::byte* small = nullptr;
  {
    auto a = pool.Take(100), b = pool.Take(1000);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->span().size(), 100u);
    small = a->span().data();
    EXPECT_NE(small, b->span().data()) << "two leases at once: two buffers";
  }
  auto again = pool.Take(50);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->span().data(), small) << "the 100-byte buffer fits 50 best";
  EXPECT_EQ(again->span().size(), 50u);
  auto larger = pool.Take(5000);
  ASSERT_TRUE(larger.ok());
  EXPECT_EQ(pool.buffers(), 3u);
  EXPECT_TRUE(pool.Take(0).ok());
  EXPECT_EQ(pool.buffers(), 3u) << "nothing for no bytes";
}

TEST(StagedCommunicatorTest, RefusesARegionOnAnotherDeviceAndPassesHostMemoryThrough) {
  World world;
  std::vector<float> v(16, 1.0f);
  Region other = Cuda(v);
  other.device_index = 2;
  Status s = world.staged[0]->AllReduce(other, DType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("AllReduce: this staged communicator moves host memory and cuda:0; "
                             "this region is on cuda:2"),
            std::string::npos)
      << s.ToString();
  std::vector<std::vector<float>> host(kWorld, std::vector<float>(16, 1.0f));
  world.Each(
      [&](int r) { ASSERT_TRUE(world.staged[r]->AllReduce(std::span<float>(host[r])).ok()); });
  EXPECT_EQ(host[1], std::vector<float>(16, 3.0f));
  EXPECT_TRUE(world.copiers[1]->log().empty()) << "host memory is not staged";
}

}  // namespace
}  // namespace nonstop::collective
