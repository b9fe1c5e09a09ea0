// nonstop-bench-staged: the staged all-reduce's bus bandwidth (issue 30,
// docs/gpu.md) against what bounds it, measured in the same run:
//   staged    AllReduce of device memory through a StagedCommunicator (pieces
//             copied up, summed over the TCP ring, copied down; two lanes)
//   host      the same AllReduce of host memory (the TCP ring alone)
//   d-h-d     the buffer copied device→host→device by one rank's copier
//   raw 1     one loopback TCP stream of the buffer (bench_util.h RawTcp)
// Ranks are threads of this process, each with its data plane over loopback
// and, for cuda, a CudaCopier of one GPU they share (the staged transport
// needs no NCCL, and several processes may share a GPU). Bus bandwidth =
// 2·(W−1)/W · bytes / time. `--device host` measures the host and raw figures
// only: what a machine without a GPU can run.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "collective/staged_communicator.h"
#include "collective/tcp_data_plane.h"
#include "common/role_keys.h"
#include "gpu/cuda_copier.h"
#include "gpu/cuda_util.h"
#include "net/socket.h"

namespace nonstop::bench {
namespace {

using Clock = std::chrono::steady_clock;
using collective::Communicator;

struct Ranks {
  int world;
  std::vector<std::unique_ptr<net::AbortSignal>> aborts;
  std::vector<std::unique_ptr<collective::DataPlane>> planes;
  std::vector<std::unique_ptr<Communicator>> comms;
  std::vector<std::shared_ptr<gpu::CudaCopier>> copiers;  // empty for --device host

  Ranks(int w, bool cuda) : world(w) {
    std::vector<collective::Member> members;
    std::vector<net::Listener> listeners;
    for (int r = 0; r < w; ++r) {
      auto l = net::Listen({"127.0.0.1", 0});
      NONSTOP_CHECK(l.ok()) << l.status().ToString();
      members.push_back({r, l->address.ToString()});
      listeners.push_back(std::move(*l));
    }
    for (int r = 0; r < w; ++r) {
      aborts.push_back(std::make_unique<net::AbortSignal>());
      std::unique_ptr<collective::DataPlane> tcp = collective::TcpDataPlane::Create(
          {WorkerDataKey(crypto::JobKey("bench-staged")), r},
          std::move(listeners[static_cast<size_t>(r)]), aborts.back().get());
      if (cuda) {
        auto copier = gpu::CudaCopier::Create(0);
        NONSTOP_CHECK(copier.ok()) << copier.status().ToString();
        copiers.push_back(*copier);
        tcp = std::make_unique<collective::StagedDataPlane>(std::move(tcp), *copier);
      }
      planes.push_back(std::move(tcp));
      collective::CommunicatorOptions o;
      o.rank = r;
      o.members = members;
      comms.push_back(planes.back()->NewCommunicator(o));
    }
    Each([&](int r) { NONSTOP_CHECK(comms[static_cast<size_t>(r)]->Connect().ok()); });
  }
  void Each(const std::function<void(int)>& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }
  // Seconds per AllReduce of each rank's region (`iters` back to back, between barriers).
  double AllReduce(const std::vector<collective::Region>& regions, int iters) {
    double secs = 0;
    Each([&](int r) {
      Communicator& c = *comms[static_cast<size_t>(r)];
      NONSTOP_CHECK(c.Barrier().ok());
      const auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        Status s = c.AllReduce(regions[static_cast<size_t>(r)], collective::DType::kFloat32,
                               collective::ReduceOp::kSum);
        NONSTOP_CHECK(s.ok()) << s.ToString();
      }
      NONSTOP_CHECK(c.Barrier().ok());
      if (r == 0) secs = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
    });
    return secs;
  }
};

struct Row {
  size_t bytes;
  double staged = 0, host = 0, dhd = 0, raw1 = 0;  // bytes per second (medians); 0: not measured
};

Row MeasureSize(Ranks& ranks, size_t bytes, int repeats) {
  const size_t n = bytes / sizeof(float);
  const double bus = 2.0 * (ranks.world - 1) / ranks.world * static_cast<double>(bytes);
  const int iters = static_cast<int>(std::clamp<size_t>((256u << 20) / bytes, 2, 50));
  // Each rank's buffer in host memory, small integers; the device buffers start as copies.
  std::vector<std::vector<float>> host(static_cast<size_t>(ranks.world), std::vector<float>(n));
  std::vector<collective::Region> host_regions, device_regions;
  for (size_t r = 0; r < host.size(); ++r) {
    for (size_t i = 0; i < n; ++i) host[r][i] = static_cast<float>((i + r) % 5);
    host_regions.push_back(collective::HostRegion(std::span<float>(host[r])));
  }
  std::shared_ptr<gpu::CudaMemory> memory;  // every rank's buffer, freed with it
  std::span<std::byte> pinned;              // the d-h-d copy's host side
  if (!ranks.copiers.empty()) {
    auto m = gpu::CudaMemory::Create(0);
    NONSTOP_CHECK(m.ok()) << m.status().ToString();
    memory = *m;
    for (int r = 0; r < ranks.world; ++r) {
      auto d = memory->Allocate(bytes);
      NONSTOP_CHECK(d.ok()) << d.status().ToString();
      NONSTOP_CHECK(
          memory->ToDevice(d->data(), host_regions[static_cast<size_t>(r)].data, bytes).ok());
      device_regions.push_back({d->data(), bytes, collective::Device::kCuda, 0});
    }
    auto p = ranks.copiers[0]->HostBuffer(bytes);
    NONSTOP_CHECK(p.ok()) << p.status().ToString();
    pinned = *p;
  }
  std::vector<std::byte> src(bytes, std::byte{7}), dst(bytes);
  std::vector<double> staged, on_host, dhd, raw1;
  for (int i = 0; i < repeats; ++i) {
    raw1.push_back(static_cast<double>(bytes) / RawTcp(src, dst, 1));
    on_host.push_back(bus / ranks.AllReduce(host_regions, iters));
    if (ranks.copiers.empty()) continue;
    staged.push_back(bus / ranks.AllReduce(device_regions, iters));
    gpu::CudaCopier& copier = *ranks.copiers[0];
    const auto t0 = Clock::now();
    NONSTOP_CHECK(copier.ToHost(0, pinned.data(), device_regions[0].data, bytes).ok());
    NONSTOP_CHECK(copier.Wait(0).ok());
    NONSTOP_CHECK(copier.ToDevice(0, device_regions[0].data, pinned.data(), bytes).ok());
    NONSTOP_CHECK(copier.Wait(0).ok());
    dhd.push_back(static_cast<double>(bytes) /
                  std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return {bytes, Median(staged), Median(on_host), Median(dhd), Median(raw1)};
}

int Main(int argc, char** argv) {
  CLI::App app{
      "The staged all-reduce of device memory against the host ring, a device-host-device "
      "copy and raw TCP, in the same run"};
  std::string device = "cuda";
  app.add_option("--device", device, "cuda (cuda:0, shared by every rank) or host (no GPU)")
      ->check(CLI::IsMember({"cuda", "host"}));
  int world = 4;
  app.add_option("--world", world, "ranks (threads of this process)")->check(CLI::Range(2, 16));
  std::vector<int> sizes_mib{4, 64, 256};
  app.add_option("--sizes", sizes_mib, "buffer sizes in MiB")
      ->delimiter(',')
      ->check(CLI::Range(1, 65536));
  int repeats = 3;
  app.add_option("--repeats", repeats, "measurements per size (the median is shown)")
      ->check(CLI::Range(1, 50));
  CLI11_PARSE(app, argc, argv);
  if (Status here = gpu::DeviceExists(0); device == "cuda" && !here.ok()) {
    fmt::print(stderr,
               "nonstop-bench-staged: {} (HINT: --device host measures the host ring and raw "
               "TCP without one)\n",
               here.ToString());
    return 2;
  }

  Ranks ranks(world, device == "cuda");
  fmt::print(
      "staged all-reduce, {} ranks on {} (GB/s = 1e9 bytes/s, median of {}; bus bandwidth "
      "for the all-reduces)\n",
      world, device == "cuda" ? "cuda:0" : "the host (no device: staged and d-h-d not run)",
      repeats);
  fmt::print("{:>6} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12}\n", "MiB", "staged", "host", "d-h-d",
             "raw 1", "staged/host", "staged/d-h-d");
  auto gb = [](double v) { return v > 0 ? fmt::format("{:.2f}", v / 1e9) : std::string("-"); };
  auto ratio = [](double a, double b) {
    return a > 0 && b > 0 ? fmt::format("{:.0f}%", 100 * a / b) : std::string("-");
  };
  for (int mib : sizes_mib) {
    const Row row = MeasureSize(ranks, static_cast<size_t>(mib) << 20, repeats);
    fmt::print("{:>6} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12}\n", mib, gb(row.staged), gb(row.host),
               gb(row.dhd), gb(row.raw1), ratio(row.staged, row.host), ratio(row.staged, row.dhd));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
