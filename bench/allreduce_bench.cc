// nonstop-bench-allreduce: allreduce bus bandwidth of nonstop's ring against
// c10d's ProcessGroupGloo (from LibTorch) on the same process count and sizes,
// in the same run, plus the raw loopback TCP throughput of one connection as
// the ceiling.
//
// Bus bandwidth = 2·(n−1)/n · bytes / time (the bytes each rank must move in
// any allreduce, per second). Each backend runs in its own set of `--nproc`
// forked processes; rank 0 times `iters` back-to-back allreduces bracketed by
// barriers. Results: a table on stdout and a JSON file.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "collective/data_plane.h"
#include "collective/tcp_data_plane.h"
#include "common/role_keys.h"
#include "common/temp_dir.h"
#include "net/socket.h"
#include "nonstop/tree.h"

namespace nonstop::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Size {
  size_t bytes;
  int iters;
};

std::vector<Size> Sizes(size_t min_bytes, size_t max_bytes) {
  std::vector<Size> out;
  for (size_t b = min_bytes; b <= max_bytes; b *= 4) {
    // About 256 MiB of traffic per size, between 3 and 500 iterations.
    int iters = static_cast<int>(std::clamp<size_t>((256u << 20) / b, 3, 500));
    out.push_back({b, iters});
  }
  return out;
}

// Runs `body(rank)` in `n` forked processes; rank 0's return value (seconds
// per size) comes back through a pipe.
template <typename Body>
std::vector<double> RunRanks(int n, size_t count, Body body) {
  int fds[2];
  NONSTOP_CHECK_EQ(::pipe(fds), 0);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = ::fork();
    NONSTOP_CHECK_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      std::vector<double> secs = body(r);
      if (r == 0) {
        ssize_t w = ::write(fds[1], secs.data(), secs.size() * sizeof(double));
        (void)w;
      }
      _exit(secs.size() == count ? 0 : 1);
    }
    pids.push_back(pid);
  }
  ::close(fds[1]);
  std::vector<double> secs(count, 0.0);
  size_t got = 0;
  auto* p = reinterpret_cast<char*>(secs.data());
  while (got < count * sizeof(double)) {
    ssize_t r = ::read(fds[0], p + got, count * sizeof(double) - got);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  ::close(fds[0]);
  bool ok = got == count * sizeof(double);
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) {
    fmt::print(stderr, "a benchmark process failed\n");
    std::exit(1);
  }
  return secs;
}

// Runs `body(rank, comm)` in `n` forked processes, each a rank of one
// nonstop communicator on loopback; `count` values come back from rank 0.
template <typename Body>
std::vector<double> RunNonstopRanks(int n, size_t count, Body body, bool checked = false) {
  std::vector<net::Listener> listeners;
  std::vector<collective::Member> members;
  for (int r = 0; r < n; ++r) {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok()) << l.status().ToString();
    members.push_back({r, l->address.ToString()});
    listeners.push_back(std::move(*l));
  }
  return RunRanks(n, count, [&](int rank) {
    for (int o = 0; o < n; ++o) {
      if (o != rank) listeners[static_cast<size_t>(o)].fd.Reset();
    }
    net::AbortSignal abort;  // before the data plane: outlives it
    auto plane =
        collective::TcpDataPlane::Create({WorkerDataKey(crypto::JobKey("bench")), rank},
                                         std::move(listeners[static_cast<size_t>(rank)]), &abort);
    collective::CommunicatorOptions o;
    o.rank = rank;
    o.members = members;
    o.checked = checked;
    std::unique_ptr<collective::Communicator> comm = plane->NewCommunicator(o);
    NONSTOP_CHECK(comm->Connect().ok());
    return body(rank, *comm);
  });
}

// `checked`: checked collectives (a CRC-32C per piece, an ack per transfer; docs/integrity.md).
std::vector<double> BenchNonstop(int n, const std::vector<Size>& sizes, bool checked = false) {
  return RunNonstopRanks(
      n, sizes.size(),
      [&](int, collective::Communicator& comm) {
        std::vector<double> out;
        for (const Size& s : sizes) {
          std::vector<float> data(s.bytes / sizeof(float), 1.0f);
          NONSTOP_CHECK(comm.AllReduce(data).ok());  // warm-up
          NONSTOP_CHECK(comm.Barrier().ok());
          auto t0 = Clock::now();
          for (int i = 0; i < s.iters; ++i) NONSTOP_CHECK(comm.AllReduce(data).ok());
          NONSTOP_CHECK(comm.Barrier().ok());
          out.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / s.iters);
        }
        return out;
      },
      checked);
}

// The world-invariant all-reduce (nonstop/tree.h) against the ring
// on the same ranks: per size, {ring seconds, tree seconds, ring bytes
// sent, tree bytes sent} per operation (seconds: rank 0's; bytes: the most
// any rank sent). `m` micro-batches are split
// over the ranks as the trainer would; each rank's partial sums are folded
// before the clock starts (the ring's caller sums its micro-batches too).
std::vector<double> BenchTree(int n, int m, const std::vector<Size>& sizes) {
  std::vector<std::pair<int, int>> ranges;
  for (int q = 0; q < n; ++q) ranges.push_back({q * m / n, (q + 1) * m / n});
  return RunNonstopRanks(n, 4 * sizes.size(), [&](int rank, collective::Communicator& comm) {
    std::vector<double> out;
    for (const Size& s : sizes) {
      const size_t count = s.bytes / sizeof(float);
      auto [first, last] = ranges[static_cast<size_t>(rank)];
      collective::TreeFolder folder(m, first, last, count);
      std::vector<float> micro(count, 1.0f);
      for (int i = first; i < last; ++i) folder.Add(micro);
      std::vector<float> data(count, 1.0f), result(count);
      auto timed = [&](auto&& op) {
        op();  // warm-up
        NONSTOP_CHECK(comm.Barrier().ok());
        uint64_t sent = comm.stats().bytes_sent;
        auto t0 = Clock::now();
        for (int i = 0; i < s.iters; ++i) op();
        NONSTOP_CHECK(comm.Barrier().ok());
        double secs = std::chrono::duration<double>(Clock::now() - t0).count() / s.iters;
        // Bytes sent per operation by the rank that sends the most (ranks' shares differ for the
        // tree).
        std::vector<double> per_rank(static_cast<size_t>(n), 0.0);
        per_rank[static_cast<size_t>(rank)] =
            static_cast<double>(comm.stats().bytes_sent - sent) / s.iters;
        NONSTOP_CHECK(
            comm.AllGather(std::as_writable_bytes(std::span(per_rank)), sizeof(double)).ok());
        return std::pair{secs, *std::max_element(per_rank.begin(), per_rank.end())};
      };
      auto ring = timed([&] { NONSTOP_CHECK(comm.AllReduce(data).ok()); });
      auto tree = timed(
          [&] { NONSTOP_CHECK(comm.AllReduceTree(m, ranges, folder.partials(), result).ok()); });
      out.insert(out.end(), {ring.first, tree.first, ring.second, tree.second});
    }
    return out;
  });
}

int TreeMain(int m, const std::vector<int>& worlds, size_t min_bytes, size_t max_bytes,
             const std::string& json_path);

std::vector<double> BenchGloo(int n, const std::vector<Size>& sizes) {
  TempDir dir;
  std::string store_path = dir / "store";
  return RunRanks(n, sizes.size(), [&](int rank) {
    torch::set_num_threads(1);
    auto store = c10::make_intrusive<::c10d::FileStore>(store_path, n);
    auto opts = ::c10d::ProcessGroupGloo::Options::create();
    opts->devices.push_back(::c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    ::c10d::ProcessGroupGloo pg(store, rank, n, opts);
    std::vector<double> out;
    for (const Size& s : sizes) {
      std::vector<at::Tensor> t{
          torch::ones({static_cast<int64_t>(s.bytes / sizeof(float))}, torch::kFloat32)};
      pg.allreduce(t)->wait();  // warm-up
      pg.barrier()->wait();
      auto t0 = Clock::now();
      for (int i = 0; i < s.iters; ++i) pg.allreduce(t)->wait();
      pg.barrier()->wait();
      out.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / s.iters);
    }
    return out;
  });
}

// One loopback TCP connection, one writer, one reader: the ceiling for any
// transport that moves bytes through the kernel.
double BenchRawTcp(size_t total_bytes) {
  auto l = net::Listen({"127.0.0.1", 0});
  NONSTOP_CHECK(l.ok());
  pid_t pid = ::fork();
  if (pid == 0) {
    auto fd = net::Dial(l->address, DeadlineAfter(Millis(5000)));
    if (!fd.ok()) _exit(1);
    std::vector<std::byte> buf(4 << 20);
    size_t sent = 0;
    while (sent < total_bytes) {
      size_t n = std::min(buf.size(), total_bytes - sent);
      if (!net::SendAll(fd->get(), std::span(buf.data(), n), kNoDeadline, nullptr, "raw").ok())
        _exit(1);
      sent += n;
    }
    _exit(0);
  }
  NONSTOP_CHECK(
      net::WaitFd(l->fd.get(), POLLIN, DeadlineAfter(Millis(5000)), nullptr, "accept").ok());
  auto conn = net::Accept(l->fd.get());
  NONSTOP_CHECK(conn.ok());
  std::vector<std::byte> buf(4 << 20);
  size_t got = 0;
  auto t0 = Clock::now();
  while (got < total_bytes) {
    size_t n = std::min(buf.size(), total_bytes - got);
    NONSTOP_CHECK(
        net::RecvAll(conn->get(), std::span(buf.data(), n), kNoDeadline, nullptr, "raw").ok());
    got += n;
  }
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  ::waitpid(pid, nullptr, 0);
  return static_cast<double>(total_bytes) / secs;
}

std::string HumanBytes(size_t b) {
  if (b >= (1u << 20)) return fmt::format("{} MiB", b >> 20);
  if (b >= (1u << 10)) return fmt::format("{} KiB", b >> 10);
  return fmt::format("{} B", b);
}

int Main(int argc, char** argv) {
  CLI::App app{
      "Allreduce bus bandwidth: nonstop vs c10d Gloo, with raw loopback TCP as the ceiling"};
  int nproc = 4;
  size_t min_bytes = 4 << 10, max_bytes = 256u << 20;
  std::string json_path = "bench-results/allreduce.json";
  int tree = 0;
  std::vector<int> worlds = {2, 3, 4};
  app.add_option("--nproc", nproc, "Processes per backend")->capture_default_str();
  app.add_option("--min-bytes", min_bytes, "Smallest message")->capture_default_str();
  app.add_option("--max-bytes", max_bytes, "Largest message (sizes step by 4x)")
      ->capture_default_str();
  app.add_option("--json", json_path, "Where to write the results")->capture_default_str();
  app.add_option("--tree", tree,
                 "Instead: the world-invariant all-reduce over this many micro-batches against the "
                 "ring, at each "
                 "of --worlds")
      ->check(CLI::Range(1, 4096));
  app.add_option("--worlds", worlds, "World sizes for --tree")
      ->delimiter(',')
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  ::signal(SIGPIPE, SIG_IGN);
  if (tree > 0) {
    return TreeMain(tree, worlds, min_bytes, std::min<size_t>(max_bytes, 64u << 20),
                    json_path == "bench-results/allreduce.json"
                        ? "bench-results/allreduce-tree.json"
                        : json_path);
  }

  auto sizes = Sizes(min_bytes, max_bytes);
  fmt::print("allreduce, {} processes on loopback, {} sizes {}..{}\n", nproc, sizes.size(),
             HumanBytes(min_bytes), HumanBytes(max_bytes));
  std::fflush(stdout);
  double raw = BenchRawTcp(2u << 30);
  fmt::print("raw loopback TCP, one connection: {:.2f} GB/s\n", raw / 1e9);
  std::fflush(stdout);
  auto ns = BenchNonstop(nproc, sizes);
  auto checked = BenchNonstop(nproc, sizes, /*checked=*/true);
  auto gl = BenchGloo(nproc, sizes);

  double factor = 2.0 * (nproc - 1) / nproc;
  nlohmann::json results = nlohmann::json::array();
  fmt::print("\n{:>10} {:>6} {:>14} {:>14} {:>12} {:>14} {:>14} {:>16}\n", "size", "iters",
             "nonstop GB/s", "gloo GB/s", "nonstop/gloo", "nonstop/raw", "checked GB/s",
             "checked/unchecked");
  for (size_t i = 0; i < sizes.size(); ++i) {
    double bw_ns = factor * static_cast<double>(sizes[i].bytes) / ns[i];
    double bw_gl = factor * static_cast<double>(sizes[i].bytes) / gl[i];
    double bw_checked = factor * static_cast<double>(sizes[i].bytes) / checked[i];
    fmt::print("{:>10} {:>6} {:>14.3f} {:>14.3f} {:>12.2f} {:>13.1f}% {:>14.3f} {:>16.3f}\n",
               HumanBytes(sizes[i].bytes), sizes[i].iters, bw_ns / 1e9, bw_gl / 1e9, bw_ns / bw_gl,
               100.0 * bw_ns / raw, bw_checked / 1e9, bw_checked / bw_ns);
    results.push_back({{"bytes", sizes[i].bytes},
                       {"iters", sizes[i].iters},
                       {"nonstop_seconds", ns[i]},
                       {"gloo_seconds", gl[i]},
                       {"checked_seconds", checked[i]},
                       {"ratio_checked_over_unchecked_busbw", bw_checked / bw_ns},
                       {"nonstop_busbw_bytes_per_s", bw_ns},
                       {"gloo_busbw_bytes_per_s", bw_gl},
                       {"ratio_nonstop_over_gloo", bw_ns / bw_gl},
                       {"fraction_of_raw_tcp", bw_ns / raw}});
  }
  nlohmann::json doc = {{"benchmark", "allreduce"},
                        {"nproc", nproc},
                        {"raw_tcp_bytes_per_s", raw},
                        {"busbw_formula", "2*(n-1)/n*bytes/seconds"},
                        {"results", results}};
  std::filesystem::path p(json_path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream(json_path) << doc.dump(2) << "\n";
  fmt::print("\nwrote {}\n", json_path);
  return 0;
}

int TreeMain(int m, const std::vector<int>& worlds, size_t min_bytes, size_t max_bytes,
             const std::string& json_path) {
  auto sizes = Sizes(min_bytes, max_bytes);
  fmt::print(
      "world-invariant all-reduce ({} micro-batches, a fixed tree) against the ring, on loopback\n",
      m);
  fmt::print("{:>6} {:>10} {:>6} {:>12} {:>12} {:>10} {:>14} {:>14}\n", "world", "size", "iters",
             "ring ms", "tree ms", "tree/ring", "ring B max", "tree B max");
  nlohmann::json results = nlohmann::json::array();
  for (int w : worlds) {
    if (w < 1 || w > m) {
      fmt::print(stderr, "--worlds: {} is not in 1..{} (each rank needs a micro-batch)\n", w, m);
      return 2;
    }
    auto r = BenchTree(w, m, sizes);
    for (size_t i = 0; i < sizes.size(); ++i) {
      double ring = r[4 * i], tree = r[4 * i + 1], ring_b = r[4 * i + 2], tree_b = r[4 * i + 3];
      fmt::print("{:>6} {:>10} {:>6} {:>12.3f} {:>12.3f} {:>10.2f} {:>14.0f} {:>14.0f}\n", w,
                 HumanBytes(sizes[i].bytes), sizes[i].iters, ring * 1e3, tree * 1e3, tree / ring,
                 ring_b, tree_b);
      std::fflush(stdout);
      results.push_back({{"world", w},
                         {"bytes", sizes[i].bytes},
                         {"iters", sizes[i].iters},
                         {"ring_seconds", ring},
                         {"tree_seconds", tree},
                         {"ratio_tree_over_ring", tree / ring},
                         {"ring_bytes_sent_per_rank", ring_b},
                         {"tree_bytes_sent_per_rank", tree_b}});
    }
  }
  nlohmann::json doc = {
      {"benchmark", "allreduce-tree"}, {"micro_batches", m}, {"results", results}};
  std::filesystem::path p(json_path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream(json_path) << doc.dump(2) << "\n";
  fmt::print("\nwrote {}\n", json_path);
  return 0;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
