// The data-plane seam (data_plane.h): regions name their device, and the TCP
// data plane refuses memory that is not on the host, with no effect on the
// communicator.
#include "collective/data_plane.h"
#include "common/role_keys.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "collective/tcp_data_plane.h"
#include "net/socket.h"

namespace nonstop::collective {
namespace {

TEST(DataPlaneTest, HostRegionsNameHostMemoryAndTheirBytes) {
  std::vector<float> floats(5);
  Region r = HostRegion(std::span<float>(floats));
  EXPECT_EQ(r.data, reinterpret_cast<std::byte*>(floats.data()));
  EXPECT_EQ(r.bytes, 5 * sizeof(float));
  EXPECT_EQ(r.device, Device::kHost);
  ConstRegion c = r;  // a writable region is readable
  EXPECT_EQ(c.data, r.data);
  EXPECT_EQ(c.bytes, r.bytes);
  const std::vector<std::byte> bytes(3);
  ConstRegion b = HostRegion(std::span<const std::byte>(bytes));
  EXPECT_EQ(b.bytes, 3u);
  EXPECT_EQ(b.device, Device::kHost);
  EXPECT_EQ(DeviceName(Device::kHost, 0), "host");
  EXPECT_EQ(DeviceName(Device::kCuda, 1), "cuda:1");
  EXPECT_EQ(ElementBytes(DType::kFloat32), sizeof(float));
}

// Two ranks of a TCP data plane on loopback.
struct World {
  World() {
    std::vector<net::Listener> listeners;
    for (int r = 0; r < 2; ++r) {
      auto l = net::Listen({"127.0.0.1", 0});
      NONSTOP_CHECK(l.ok()) << l.status().ToString();
      members.push_back({r, l->address.ToString()});
      listeners.push_back(std::move(*l));
    }
    for (int r = 0; r < 2; ++r) {
      planes.push_back(TcpDataPlane::Create({WorkerDataKey(crypto::JobKey("data-plane-test")), r},
                                            std::move(listeners[static_cast<size_t>(r)]),
                                            &aborts[r]));
      CommunicatorOptions o;
      o.rank = r;
      o.members = members;
      o.timeout_collective = Millis(30'000);
      comms.push_back(planes.back()->NewCommunicator(o));
    }
  }
  net::AbortSignal aborts[2];  // first: outlive the data planes
  std::vector<Member> members;
  std::vector<std::unique_ptr<TcpDataPlane>> planes;
  std::vector<std::unique_ptr<Communicator>> comms;
};

TEST(TcpDataPlaneTest, MovesHostMemoryOnlyAndAdvertisesItsPort) {
  World world;
  EXPECT_TRUE(world.planes[0]->Supports(Device::kHost));
  EXPECT_FALSE(world.planes[0]->Supports(Device::kCuda));
  EXPECT_EQ(world.planes[1]->address().ToString(), world.members[1].address);
  EXPECT_EQ(world.planes[0]->stats().connections_opened, 0)
      << "nothing is dialed before a communicator needs it";
}

// Every call that takes a region refuses one on a CUDA device, naming the
// call and the device, before anything moves: the communicator keeps no
// error and counts no operation, so the ranks' next collectives still meet.
TEST(TcpDataPlaneTest, RefusesEveryRegionThatIsNotInHostMemory) {
  World world;
  Communicator& comm = *world.comms[0];
  std::vector<float> host(64, 1.0f);
  std::vector<float> elsewhere(64);  // stands for device memory: never touched
  Region cuda0{reinterpret_cast<std::byte*>(elsewhere.data()), elsewhere.size() * sizeof(float),
               Device::kCuda, 0};
  Region cuda3 = cuda0;
  cuda3.device_index = 3;
  const std::vector<std::vector<TreeNode>> one_rank_each = {NodesOfRange(2, 0, 1),
                                                            NodesOfRange(2, 1, 2)};
  const std::vector<ConstRegion> host_partials = {HostRegion(std::span<const float>(host))};
  const std::vector<ConstRegion> cuda_partials = {cuda3};
  struct Call {
    std::string op;
    std::string device;
    std::function<Status()> run;
  };
  const std::vector<Call> calls = {
      {"AllReduce", "cuda:0",
       [&] { return comm.AllReduce(cuda0, DType::kFloat32, ReduceOp::kSum); }},
      {"ReduceScatter", "cuda:0",
       [&] { return comm.ReduceScatter(cuda0, DType::kFloat32, ReduceOp::kSum); }},
      {"AllGather", "cuda:0", [&] { return comm.AllGather(cuda0, sizeof(float)); }},
      {"Broadcast", "cuda:0", [&] { return comm.Broadcast(cuda0, 1); }},
      {"AllReduceTree", "cuda:0",
       [&] { return comm.AllReduceTree(2, one_rank_each, host_partials, cuda0); }},
      {"AllReduceTree", "cuda:3",
       [&] {
         return comm.AllReduceTree(2, one_rank_each, cuda_partials,
                                   HostRegion(std::span<float>(host)));
       }},
      {"Send", "cuda:0", [&] { return comm.Send(1, cuda0); }},
      {"Recv", "cuda:3", [&] { return comm.Recv(1, cuda3); }},
  };
  for (const Call& call : calls) {
    Status s = call.run();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << call.op << ": " << s.ToString();
    EXPECT_NE(
        s.message().find(
            call.op + ": the TCP data plane reads and writes host memory only; this region is on " +
            call.device),
        std::string::npos)
        << s.ToString();
  }
  EXPECT_TRUE(comm.error().ok()) << "a refused region is not sticky: " << comm.error().ToString();
  EXPECT_EQ(comm.stats().ops, 0u);
  EXPECT_EQ(comm.stats().bytes_sent, 0u);

  // Both ranks' next collectives meet: rank 0's refusals left its operation sequence as it was.
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> data(2, std::vector<float>(1000));
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Communicator& c = *world.comms[static_cast<size_t>(r)];
      ASSERT_TRUE(c.Connect().ok());
      auto& mine = data[static_cast<size_t>(r)];
      for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<float>(i * (r + 1));
      Status s = c.AllReduce(mine);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE(c.Barrier().ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < 1000; ++i)
      ASSERT_EQ(data[static_cast<size_t>(r)][i], static_cast<float>(3 * i)) << r;
  }
}

}  // namespace
}  // namespace nonstop::collective
