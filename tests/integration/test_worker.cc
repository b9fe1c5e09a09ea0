// A LibTorch-free worker for integration tests, shaped like a training loop:
// state = an accumulator vector and the step counter. At step s the global
// "batch" is 12 items; each rank sums its contiguous block of items (dealt as
// the sampler deals micro-batches), the allreduce sums the blocks, and the
// accumulator adds the result. Every value is a small integer, so sums are
// exact in any order: the final checksum is the same at any world size and
// after any recovery, and differs if a step is lost or applied twice.
//
// --device puts the accumulator on a device (issue 30, docs/gpu.md): cuda (the
// GPU cuda:0) or stand-in (host memory this process reaches only through
// copies, for machines without a GPU). The state then lives there: each step
// reads it from the device, adds the step's sum and writes it back (no
// kernel: the sum is made on the host), so a state copied in by a recovery
// is what the next step builds on, and the checksum is of the device's bytes.
// The step's sum is reduced on the device too (Session::StartAllReduceOnDevice, two buckets:
// staged through host memory over the TCP collectives, or with
// --data-plane nccl summed by NCCL). A worker's GPU is cuda:(worker id mod
// the GPUs it sees): the workers and spares of one machine spread over its
// GPUs (NCCL needs one each).
//
// --shard-group G shards the accumulator as ZeRO-1 shards parameters (docs/sharding.md): it is
// registered as a shard view (StateRegistry::RegisterShardView, on the device with --device), the
// step's sum is reduced with Session::ReduceShards (ReduceShardsOnDevice), each rank adds its
// shard of it to its shard of the accumulator, and the group gathers the whole accumulator back
// (GatherShards, GatherShardsOnDevice) at the start of each step and before the end. A spare
// then copies only its shard, from that shard's holders.
//
// --tree makes the sums world-invariant (docs/determinism.md): each rank folds
// its block of items into the partial sums of its tree nodes (TreeFolder) and
// the members sum them with Session::AllReduceTree (AllReduceTreeOnDevice
// with --device). The items are then tenths, so the bits depend on the order
// of the additions, and the checksum is the same at every world size and
// after a recovery only because the tree's order is.
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "nonstop/crc32c.h"
#include "nonstop/data.h"
#include "nonstop/session.h"
#include "nonstop/tree.h"
#include "state/protected_device_testing.h"
#ifdef NONSTOP_WITH_CUDA
#include "gpu/cuda_copier.h"
#include "gpu/cuda_util.h"
#endif
#ifdef NONSTOP_WITH_NCCL
#include "gpu/nccl_data_plane.h"
#endif

namespace {

constexpr uint64_t kItems = 12;

float Item(int64_t step, uint64_t item, size_t i) {
  return static_cast<float>((static_cast<uint64_t>(step) * 31 + item * 7 + i) % 7);
}

// Two buffers of `bytes` on `device` ("stand-in" or "cuda"), with the DeviceMemory that reaches
// them.
// (With --tree, `partials` more, one per tree node a rank can hold.)
struct DeviceBuffers {
  std::shared_ptr<const nonstop::state::DeviceMemory> memory;
  std::span<std::byte> state, sum;
  std::vector<std::span<std::byte>> partials;
  std::shared_ptr<nonstop::state::ProtectedDevice> stand_in;  // `memory`, with --device stand-in
};
nonstop::Result<DeviceBuffers> AllocateOn(const std::string& device, size_t bytes, int worker_id,
                                          int partials) {
  DeviceBuffers out;
  if (device == "stand-in") {
    auto d = std::make_shared<nonstop::state::ProtectedDevice>();
    out = {d, d->Allocate(bytes), d->Allocate(bytes), {}, d};
    for (int k = 0; k < partials; ++k) out.partials.push_back(d->Allocate(bytes));
    return out;
  }
#ifdef NONSTOP_WITH_CUDA
  const int gpus = nonstop::gpu::DeviceCount();
  NONSTOP_ASSIGN_OR_RETURN(auto cuda,
                           nonstop::gpu::CudaMemory::Create(gpus > 0 ? worker_id % gpus : 0));
  out.memory = cuda;
  NONSTOP_ASSIGN_OR_RETURN(out.state, cuda->Allocate(bytes));
  NONSTOP_ASSIGN_OR_RETURN(out.sum, cuda->Allocate(bytes));
  for (int k = 0; k < partials; ++k) {
    NONSTOP_ASSIGN_OR_RETURN(std::span<std::byte> p, cuda->Allocate(bytes));
    out.partials.push_back(p);
  }
  return out;
#else
  return nonstop::FailedPreconditionError(
      "--device cuda: this build has no CUDA (CMake found no CUDA toolkit, or a sanitizer build)");
#endif
}

// The step's world-invariant sum into `v`: this rank folds items [lo, hi) (fractions) into the
// partial sums of its tree nodes, and the members sum every rank's partials in the tree's order,
// in the device's memory when `dev` is set.
nonstop::Status TreeSum(nonstop::Session& s, int64_t step, uint64_t lo, uint64_t hi,
                        const DeviceBuffers* dev, std::vector<float>& v) {
  const int m = static_cast<int>(kItems);
  nonstop::collective::TreeFolder folder(m, static_cast<int>(lo), static_cast<int>(hi), v.size());
  std::vector<float> g(v.size());
  for (uint64_t item = lo; item < hi; ++item) {
    for (size_t i = 0; i < g.size(); ++i) g[i] = 0.1f * Item(step, item, i);
    folder.Add(g);
  }
  std::vector<std::pair<int, int>> ranges;
  for (int q = 0; q < s.world_size(); ++q) {
    ranges.emplace_back(static_cast<int>(nonstop::data::BlockBegin(kItems, s.world_size(), q)),
                        static_cast<int>(nonstop::data::BlockBegin(kItems, s.world_size(), q + 1)));
  }
  std::vector<std::vector<float>> partials = folder.TakePartials();
  if (dev == nullptr) return s.AllReduceTree(m, ranges, partials, v);
  std::vector<std::span<const float>> on_device;
  for (size_t k = 0; k < partials.size(); ++k) {
    if (k >= dev->partials.size()) {
      return nonstop::InternalError(fmt::format("{} tree nodes, but {} device buffers for them",
                                                partials.size(), dev->partials.size()));
    }
    auto bytes = std::as_bytes(std::span(partials[k]));
    NONSTOP_RETURN_IF_ERROR(
        dev->memory->ToDevice(dev->partials[k].data(), bytes.data(), bytes.size()));
    on_device.emplace_back(reinterpret_cast<const float*>(dev->partials[k].data()), v.size());
  }
  NONSTOP_RETURN_IF_ERROR(s.AllReduceTreeOnDevice(
      m, ranges, on_device, std::span(reinterpret_cast<float*>(dev->sum.data()), v.size())));
  auto out = std::as_writable_bytes(std::span(v));
  return dev->memory->ToHost(out.data(), dev->sum.data(), out.size());
}

std::span<float> DeviceFloats(std::span<std::byte> bytes) {
  return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
}

// --shard-group: the group's all-gather of the whole accumulator, into `acc` (and first into
// its device buffer with --device).
nonstop::Status GatherAcc(nonstop::Session& s, const DeviceBuffers& dev, std::vector<float>& acc) {
  auto bytes = std::as_writable_bytes(std::span(acc));
  if (dev.memory == nullptr) return s.GatherShards(bytes, sizeof(float));
  NONSTOP_RETURN_IF_ERROR(s.GatherShardsOnDevice(dev.state, sizeof(float)));
  return dev.memory->ToHost(bytes.data(), dev.state.data(), bytes.size());
}

// --shard-group: the step's sum reduced so that this rank's shard of `v` holds the world's sum
// (the rest of `v` is scratch), on the device with --device.
nonstop::Status ReduceShardsOf(nonstop::Session& s, const DeviceBuffers& dev,
                               std::vector<float>& v) {
  if (dev.memory == nullptr) return s.ReduceShards(v);
  auto bytes = std::as_writable_bytes(std::span(v));
  NONSTOP_RETURN_IF_ERROR(dev.memory->ToDevice(dev.sum.data(), bytes.data(), bytes.size()));
  NONSTOP_RETURN_IF_ERROR(s.ReduceShardsOnDevice(DeviceFloats(dev.sum)));
  return dev.memory->ToHost(bytes.data(), dev.sum.data(), bytes.size());
}

// --shard-group: this rank's shard of the accumulator (region 0, wherever it lives) += its shard
// of the step's sum, as an optimizer steps its shard of the parameters.
void AddToHeldShard(nonstop::state::StateRegistry& state, const std::vector<float>& v) {
  const int shard = state.held_shard();
  NONSTOP_CHECK(shard >= 0) << "no shard is bound after a join or a recovery";
  const size_t n = v.size() / static_cast<size_t>(state.shard_group());
  std::vector<float> mine(n);
  state.ReadRegion(0, 0, std::as_writable_bytes(std::span(mine)));
  for (size_t i = 0; i < n; ++i) mine[i] += v[static_cast<size_t>(shard) * n + i];
  state.WriteRegion(0, 0, std::as_bytes(std::span(mine)));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"nonstop integration-test worker"};
  int64_t steps = 10;
  size_t elements = 1000;
  int sleep_ms = 0;
  int recovered_sleep_ms = 0;
  app.add_option("--steps", steps);
  app.add_option("--elements", elements);
  app.add_option("--sleep-ms", sleep_ms);
  // The first step after a recovery takes this much longer: the recovery stays open (it ends when
  // every member has completed that step) long enough for a test to act during it.
  app.add_option("--recovered-step-sleep-ms", recovered_sleep_ms);
  // PREFIX-<pid>.self: this process's environment as it started (/proc/self/environ); .child: the
  // environment of a child it starts now; .fds: that child's open descriptors (secrets_test).
  std::string dump_environ;
  app.add_option("--dump-environ", dump_environ);
  std::string device = "host";
  app.add_option("--device", device, "where the state lives (see the top of test_worker.cc)")
      ->check(CLI::IsMember({"host", "cuda", "stand-in"}));
  bool tree = false;
  app.add_flag("--tree", tree,
               "world-invariant sums: each rank folds its items into tree partials (TreeFolder) "
               "summed by AllReduceTree (on the device with --device), and the items are "
               "fractions, so the bits depend on the order of the additions");
  int shard_group = 0;
  app.add_option("--shard-group", shard_group,
                 "shard the accumulator over groups of G ranks (see the top of test_worker.cc)")
      ->check(CLI::Range(0, 64));
  // The stand-in device of worker W breaks (its copies and health checks fail) MS after it built
  // its state: a GPU that fails while its worker waits as a spare.
  int break_device_worker = -1, break_device_after_ms = 0;
  app.add_option("--break-device-worker", break_device_worker);
  app.add_option("--break-device-after-ms", break_device_after_ms);
  std::string data_plane = "staged";
  app.add_option("--data-plane", data_plane,
                 "what sums the device's memory: staged (over TCP) or nccl (--device cuda)")
      ->check(CLI::IsMember({"staged", "nccl"}));
  // Join first, then build and register the state and CompleteJoin (SessionOptions::defer_state:
  // a script that makes its process group before its model). Its setup in between fills the
  // accumulator with 7s and sleeps MS: a spare must train on the peers' state all the same.
  int register_after_join_ms = -1;
  app.add_option("--register-after-join", register_after_join_ms, "MS of setup between the two");
  CLI11_PARSE(app, argc, argv);
  const bool deferred = register_after_join_ms >= 0;
  if (deferred && (device != "host" || shard_group > 0)) {
    fmt::print(stderr, "--register-after-join keeps its state in host memory, unsharded\n");
    return 2;
  }
  if (shard_group > 0 && tree) {
    fmt::print(stderr, "--shard-group and --tree: choose one (a sharded step sums on the ring)\n");
    return 2;
  }
  if (!dump_environ.empty()) {
    const std::string prefix = fmt::format("{}-{}", dump_environ, ::getpid());
    {
      std::ifstream in("/proc/self/environ", std::ios::binary);
      std::ofstream(prefix + ".self", std::ios::binary) << in.rdbuf();
    }
    // The shell std::system starts is this process's child: its environment and descriptors.
    const std::string cmd =
        fmt::format("cat /proc/$$/environ > {0}.child; ls -l /proc/$$/fd/ > {0}.fds", prefix);
    if (std::system(cmd.c_str()) != 0) return 3;
  }

  auto options = nonstop::SessionOptions::FromEnvironment();
  if (!options.ok()) {
    fmt::print(stderr, "{}\n", options.status().ToString());
    return 2;
  }
  // the state, or its host copy with --device; sharded, padded to a multiple of the group
  const size_t padded =
      shard_group > 0 ? (elements + shard_group - 1) / shard_group * shard_group : elements;
  std::vector<float> acc(padded, 0.0f);
  auto acc_bytes = std::as_writable_bytes(std::span(acc));
  int64_t completed = -1;
  nonstop::state::StateRegistry state(64 << 10);
  const bool on_device = device != "host";
  DeviceBuffers dev;
  if (on_device) {
    // a range's tree nodes are at most two per level
    const int max_nodes = 2 * nonstop::collective::TreeLevels(static_cast<int>(kItems));
    auto buffers = AllocateOn(device, acc_bytes.size(), options->worker_id, tree ? max_nodes : 0);
    if (!buffers.ok()) {
      fmt::print(stderr, "{}\n", buffers.status().ToString());
      return 2;
    }
    dev = *buffers;
    options->device = dev.memory;
#ifdef NONSTOP_WITH_CUDA
    // staged with the CUDA copier's streams and pinned buffers (the default copies synchronously)
    if (device == "cuda")
      options->device_data_plane = nonstop::gpu::StagedDataPlaneMaker(dev.memory->index());
#endif
    if (data_plane == "nccl") {
#ifdef NONSTOP_WITH_NCCL
      if (device != "cuda") {
        fmt::print(stderr, "--data-plane nccl needs --device cuda (NCCL sums GPU memory)\n");
        return 2;
      }
      options->device_data_plane = nonstop::gpu::NcclDataPlaneMaker(dev.memory->index());
#else
      fmt::print(stderr,
                 "--data-plane nccl: this build has no NCCL (CMake found none beside the "
                 "CUDA toolkit: set NCCL_ROOT)\n");
      return 2;
#endif
    }
  }
  auto register_state = [&]() -> nonstop::Status {
    nonstop::Status built;
    if (on_device && shard_group > 0) {
      built = dev.memory->ToDevice(dev.state.data(), acc_bytes.data(), acc_bytes.size());  // zeros
      if (built.ok())
        built = state.RegisterShardView("acc", DeviceFloats(dev.state), shard_group, dev.memory);
    } else if (on_device) {
      built = state.RegisterOnDevice("acc", dev.state, dev.memory);
      if (built.ok()) state.WriteRegion(0, 0, acc_bytes);  // zeros
    } else if (shard_group > 0) {
      built = state.RegisterShardView("acc", acc, shard_group);
    } else {
      built = state.Register("acc", acc_bytes);
    }
    if (built.ok()) built = state.RegisterValue("step", &completed);
    if (built.ok()) {
      fmt::print("worker pid {} built its state{}\n", ::getpid(),
                 on_device ? " on " + state.regions()[0].device->name() : "");
      std::fflush(stdout);
    }
    return built;
  };
  if (nonstop::Status built = deferred ? nonstop::OkStatus() : register_state(); !built.ok()) {
    fmt::print(stderr, "the state: {}\n", built.ToString());
    return 2;
  }
  options->defer_state = deferred;
  if (break_device_worker == options->worker_id) {
    if (dev.stand_in == nullptr) {
      fmt::print(stderr, "--break-device-worker needs --device stand-in\n");
      return 2;
    }
    std::thread([d = dev.stand_in, after = break_device_after_ms] {
      std::this_thread::sleep_for(std::chrono::milliseconds(after));
      fmt::print(stderr, "the stand-in device breaks now (--break-device-after-ms {})\n", after);
      d->set_broken(true);
    }).detach();
  }

  auto joined = nonstop::Session::Join(*options, &state);
  if (!joined.ok()) {
    // a spare that was never needed
    if (joined.status().code() == nonstop::StatusCode::kCancelled) return 0;
    fmt::print(stderr, "join failed: {}\n", joined.status().ToString());
    return 10;
  }
  auto& s = **joined;
  fmt::print("worker {} (pid {}) is rank {} of {}\n", s.worker_id(), ::getpid(), s.rank(),
             s.world_size());
  std::fflush(stdout);
  if (deferred) {
    std::fill(acc.begin(), acc.end(), 7.0f);  // the setup's own values
    std::this_thread::sleep_for(std::chrono::milliseconds(register_after_join_ms));
    nonstop::Status done = register_state();
    if (done.ok()) done = s.CompleteJoin();
    if (done.code() == nonstop::StatusCode::kCancelled) return 0;  // the job ended meanwhile
    if (!done.ok()) {
      fmt::print(stderr, "completing the join failed: {}\n", done.ToString());
      return 10;
    }
  }
  std::vector<float> v(padded);
  int64_t step = s.resume_step();
  bool released = false;
  int extra_sleep_ms = 0;  // this step's share of --recovered-step-sleep-ms
  auto recover = [&]() -> bool {
    auto next = s.Recover();
    if (!next.ok()) {
      if (next.status().code() == nonstop::StatusCode::kCancelled && s.shutdown_exit_code() == 0) {
        fmt::print("worker {} released\n", s.worker_id());
        released = true;
        return false;
      }
      fmt::print(stderr, "recovery failed: {}\n", next.status().ToString());
      return false;
    }
    step = *next;
    auto c = s.last_change();
    fmt::print("{}: rank {} of {} (was {} of {}), resuming at step {}\n", c.reason, c.new_rank,
               c.new_world, c.old_rank, c.old_world, step);
    std::fflush(stdout);
    extra_sleep_ms = recovered_sleep_ms;
    return true;
  };
  while (true) {
    while (step < steps) {
      const auto began = std::chrono::steady_clock::now();
      if (s.InjectedExceptionAt(step)) {
        fmt::print(stderr, "step {}: injected exception in the training loop\n", step);
        s.ReportFailure(nonstop::InternalError("injected exception"), step, 10);
        return 10;
      }
      nonstop::Status st = shard_group > 0 ? GatherAcc(s, dev, acc) : nonstop::OkStatus();
      // The "loss" every member reports alike: sharded, acc[0] as gathered, before shard 0's
      // holders update it in this step (with --device, acc is the device's host copy); unsharded,
      // acc[0] after the step (below).
      double loss = acc[0];
      std::fill(v.begin(), v.end(), 0.0f);
      uint64_t lo = nonstop::data::BlockBegin(kItems, s.world_size(), s.rank());
      uint64_t hi = nonstop::data::BlockBegin(kItems, s.world_size(), s.rank() + 1);
      if (!tree) {
        for (uint64_t item = lo; item < hi; ++item) {
          for (size_t i = 0; i < elements; ++i) v[i] += Item(step, item, i);
        }
      }
      if (sleep_ms + extra_sleep_ms > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms + extra_sleep_ms));
      extra_sleep_ms = 0;
      if (!st.ok()) {
        // the gather failed: the generation ended
      } else if (shard_group > 0) {
        st = ReduceShardsOf(s, dev, v);
      } else if (tree) {
        st = TreeSum(s, step, lo, hi, on_device ? &dev : nullptr, v);
      } else if (on_device) {
        // the step's sum reduced on the device, in two overlapped buckets
        auto v_bytes = std::as_writable_bytes(std::span(v));
        st = dev.memory->ToDevice(dev.sum.data(), v_bytes.data(), v_bytes.size());
        if (st.ok()) {
          std::span<float> sum(reinterpret_cast<float*>(dev.sum.data()), v.size());
          s.StartAllReduceOnDevice(sum.first(v.size() / 2));
          s.StartAllReduceOnDevice(sum.subspan(v.size() / 2));
          st = s.WaitAll();
        }
        if (st.ok()) st = dev.memory->ToHost(v_bytes.data(), dev.sum.data(), v_bytes.size());
      } else {
        st = s.AllReduce(v);
      }
      if (!st.ok()) {
        fmt::print("step {}: {}\n", step, st.ToString());
        if (!recover())
          return released ? 0 : (s.shutdown_exit_code() != 0 ? s.shutdown_exit_code() : 10);
        continue;
      }
      if (shard_group > 0) {
        AddToHeldShard(state, v);
      } else {
        if (on_device) state.ReadRegion(0, 0, acc_bytes);
        for (size_t i = 0; i < elements; ++i) acc[i] += v[i];
        if (on_device) state.WriteRegion(0, 0, acc_bytes);
      }
      completed = step;
      // the step's wall time: the job's normal step, against which a fault's time lost is set
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
      if (shard_group == 0) loss = acc[0];
      s.ReportStep({step, loss, seconds, 0, steps});
      if (s.rank() == 0) {
        fmt::print("step {} ok\n", step);
        std::fflush(stdout);
      }
      ++step;
    }
    if (shard_group > 0) {
      if (nonstop::Status g = GatherAcc(s, dev, acc); !g.ok()) {
        fmt::print("final gather: {}\n", g.ToString());
        if (!recover())
          return released ? 0 : (s.shutdown_exit_code() != 0 ? s.shutdown_exit_code() : 10);
        continue;
      }
    } else if (on_device) {
      state.ReadRegion(0, 0, acc_bytes);  // the device's bytes
    }
    std::string checksum =
        fmt::format("{:08x}", nonstop::Crc32c(acc.data(), elements * sizeof(float)));
    nonstop::Status fin = s.Finish(steps - 1, checksum);
    if (fin.code() == nonstop::StatusCode::kAborted) {
      if (!recover()) return released ? 0 : 10;
      continue;
    }
    if (!fin.ok()) {
      fmt::print(stderr, "finish: {}\n", fin.ToString());
      return 10;
    }
    if (s.rank() == 0) fmt::print("final checksum {}\n", checksum);
    errno = 0;
    fmt::print("worker {} finished at nice {}\n", s.worker_id(), ::getpriority(PRIO_PROCESS, 0));
    return 0;
  }
}
