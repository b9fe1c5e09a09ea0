// nonstop-bench-state-copy: the state copy (src/worker/state_transfer.cc)
// against raw TCP between the same endpoints in the same run (issue 27,
// point 4; docs/recovery.md, "State copy at the link's speed").
//
// For each state size it measures, in this order and in one process:
//   raw 1     one loopback TCP connection: plain send(2)/recv(2) of the
//             source's bytes straight into the receiver's buffer, no checks;
//   raw N     the same bytes split over N connections at once (--streams);
//   copy 1·1  RunStateTransfers of a registered state of that size from one
//             source over one stream, over TcpDataPlane communicators on
//             loopback (the data plane a worker uses), every chunk CRC-32C checked;
//   copy 1    the same over the streams (lanes) the receiver picks by size
//             (one per 32 MiB asked of a source, at most 4: state_transfer.h);
//   copy 3    the same from three sources (chunks striped over them).
// Each is repeated --repeats times, interleaved, and the median is shown;
// the ratios are copy 1·1 / raw 1, copy 1 / raw N, copy 3 / raw N, and the faster copy over
// the faster raw figure of the same size, all measured seconds apart. Ranks are threads of this
// process (as in state_transfer_test), the sockets real. Every copy is checked byte for byte
// against the source after it is timed.
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/bench_util.h"
#include "collective/tcp_data_plane.h"
#include "net/socket.h"
#include "nonstop/state.h"
#include "worker/state_transfer.h"

namespace nonstop::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kToken[] = "bench-token";
constexpr int kSources = 3;  // the most sources a copy uses here

// Rank 0 receives, ranks 1..kSources serve: one data plane and communicator
// each, made once and reused by every copy (as a worker's mesh is).
struct Ranks {
  std::vector<collective::Member> members;
  std::vector<std::unique_ptr<net::AbortSignal>> aborts;
  std::vector<std::unique_ptr<collective::DataPlane>> planes;
  std::vector<std::unique_ptr<collective::Communicator>> comms;

  Ranks() {
    std::vector<net::Listener> listeners;
    for (int r = 0; r <= kSources; ++r) {
      auto l = net::Listen({"127.0.0.1", 0});
      NONSTOP_CHECK(l.ok()) << l.status().ToString();
      members.push_back({r, l->address.ToString()});
      listeners.push_back(std::move(*l));
    }
    for (int r = 0; r <= kSources; ++r) {
      aborts.push_back(std::make_unique<net::AbortSignal>());
      planes.push_back(collective::TcpDataPlane::Create(
          {kToken, r}, std::move(listeners[static_cast<size_t>(r)]), aborts.back().get()));
      collective::CommunicatorOptions o;
      o.rank = r;
      o.members = members;
      comms.push_back(planes.back()->NewCommunicator(o));
    }
  }
};

// One copy of `regs[0]`'s state from regs[1..sources] (`streams` per source, 0: by size); seconds
// on the receiver, and the streams it took from a source.
std::pair<double, int> Copy(Ranks& ranks, std::vector<std::unique_ptr<state::StateRegistry>>& regs,
                            int sources, int streams) {
  control::PlanMsg plan;
  plan.generation = 1;
  plan.resume_step = 8;
  for (const auto& m : ranks.members) plan.members.push_back({m.worker_id, m.address});
  control::PlanTransfer t;
  t.receiver = 0;
  for (int s = 1; s <= sources; ++s) t.sources.push_back(s);
  plan.transfers.push_back(t);
  std::vector<Status> status(kSources + 1);
  double secs = 0;
  int took = 0;
  worker::TransferHooks hooks;
  hooks.streams_per_source = streams;
  std::vector<std::thread> threads;
  for (int r = kSources; r >= 0; --r) {
    threads.emplace_back([&, r] {
      auto t0 = Clock::now();
      auto out = worker::RunStateTransfers(*ranks.comms[static_cast<size_t>(r)],
                                           *regs[static_cast<size_t>(r)], plan, r,
                                           plan.resume_step - 1, hooks);
      if (r == 0) {
        secs = std::chrono::duration<double>(Clock::now() - t0).count();
        if (out.ok()) took = out->streams_per_source;
      }
      status[static_cast<size_t>(r)] = out.status();
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r <= kSources; ++r) {
    NONSTOP_CHECK(status[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << status[static_cast<size_t>(r)].ToString();
  }
  return {secs, took};
}

struct Row {
  size_t bytes;
  double raw1, rawn, copy1_one, copy1, copy3;  // bytes per second (medians)
  int streams1 = 0;                            // the streams copy 1 took
};

Row MeasureSize(Ranks& ranks, size_t bytes, int streams, int repeats, size_t chunk_bytes) {
  // One source buffer behind every source's registry (they serve, never
  // write), and the receiver's own.
  std::vector<std::byte> src(bytes), dst(bytes);
  for (size_t i = 0; i < bytes; i += 8) {
    uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(src.data() + i, &v, std::min<size_t>(8, bytes - i));
  }
  std::vector<std::unique_ptr<state::StateRegistry>> regs;
  for (int r = 0; r <= kSources; ++r) {
    regs.push_back(std::make_unique<state::StateRegistry>(chunk_bytes));
    NONSTOP_CHECK(regs.back()->Register("state", r == 0 ? std::span(dst) : std::span(src)).ok());
  }
  auto rate = [&](double secs) { return static_cast<double>(bytes) / secs; };
  std::vector<double> raw1, rawn, copy1_one, copy1, copy3;
  int streams1 = 0;
  struct Kind {
    int sources, streams;
    std::vector<double>* out;
  };
  for (int i = 0; i < repeats; ++i) {
    raw1.push_back(rate(RawTcp(src, dst, 1)));
    rawn.push_back(rate(RawTcp(src, dst, streams)));
    for (Kind k : {Kind{1, 1, &copy1_one}, Kind{1, 0, &copy1}, Kind{kSources, 0, &copy3}}) {
      std::memset(dst.data(), 0, dst.size());
      auto [secs, took] = Copy(ranks, regs, k.sources, k.streams);
      NONSTOP_CHECK(std::memcmp(dst.data(), src.data(), bytes) == 0)
          << "the copy from " << k.sources << " source(s) differs from the source";
      k.out->push_back(rate(secs));
      if (k.out == &copy1) streams1 = took;
    }
  }
  return {bytes,         Median(raw1),  Median(rawn), Median(copy1_one),
          Median(copy1), Median(copy3), streams1};
}

int Main(int argc, char** argv) {
  CLI::App app{"State copy (RunStateTransfers) against raw loopback TCP, in the same run"};
  std::vector<size_t> sizes_mb{4, 64, 256, 1024};
  int streams = 3, repeats = 3;
  size_t chunk_bytes = state::kDefaultChunkBytes;
  std::string json_path;
  app.add_option("--sizes", sizes_mb, "state sizes in MiB")->delimiter(',')->capture_default_str();
  app.add_option("--streams", streams, "connections of the N-stream raw figure")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--repeats", repeats, "runs of each measurement (the median is shown)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--chunk-bytes", chunk_bytes, "the state registry's chunk size")
      ->check(CLI::Range(size_t{4096}, size_t{64} << 20))
      ->capture_default_str();
  app.add_option("--json", json_path, "also write the results here");
  CLI11_PARSE(app, argc, argv);

  Ranks ranks;
  fmt::print(
      "state copy vs raw loopback TCP (MB/s = 1e6 bytes/s, median of {}; chunks of {} KiB)\n",
      repeats, chunk_bytes >> 10);
  fmt::print("{:>6} {:>9} {:>9} {:>10} {:>13} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "MiB", "raw 1",
             fmt::format("raw {}", streams), "copy 1src·1", "copy 1src (s)",
             fmt::format("copy {}src", kSources), "1src·1/raw1", fmt::format("1src/raw{}", streams),
             fmt::format("{}src/raw{}", kSources, streams), "best/best");
  nlohmann::json rows = nlohmann::json::array();
  for (size_t mb : sizes_mb) {
    Row row = MeasureSize(ranks, mb << 20, streams, repeats, chunk_bytes);
    const double raw = std::max(row.raw1, row.rawn);
    const double copy = std::max({row.copy1_one, row.copy1, row.copy3});
    fmt::print(
        "{:>6} {:>9.0f} {:>9.0f} {:>10.0f} {:>9.0f} ({}) {:>10.0f} {:>9.0f}% {:>9.0f}% {:>9.0f}% "
        "{:>9.0f}%\n",
        mb, row.raw1 / 1e6, row.rawn / 1e6, row.copy1_one / 1e6, row.copy1 / 1e6, row.streams1,
        row.copy3 / 1e6, 100 * row.copy1_one / row.raw1, 100 * row.copy1 / row.rawn,
        100 * row.copy3 / row.rawn, 100 * copy / raw);
    std::fflush(stdout);
    rows.push_back({{"bytes", row.bytes},
                    {"raw_1_stream_bytes_per_s", row.raw1},
                    {"raw_n_streams_bytes_per_s", row.rawn},
                    {"streams", streams},
                    {"copy_1_source_1_stream_bytes_per_s", row.copy1_one},
                    {"copy_1_source_bytes_per_s", row.copy1},
                    {"copy_1_source_streams", row.streams1},
                    {"copy_3_sources_bytes_per_s", row.copy3},
                    {"copy_1_source_1_stream_over_raw_1_stream", row.copy1_one / row.raw1},
                    {"copy_1_source_over_raw_n_streams", row.copy1 / row.rawn},
                    {"copy_3_sources_over_raw_n_streams", row.copy3 / row.rawn},
                    {"best_copy_over_best_raw", copy / raw}});
  }
  fmt::print(
      "1src·1/raw1: one source over one stream against one connection; 1src/raw{}: one "
      "source over the streams (s) it took against {} connections; {}src/raw{}: three sources "
      "against {} connections; best/best: the fastest copy against the faster raw figure of the "
      "same size\n",
      streams, streams, kSources, streams, streams);
  if (!json_path.empty()) {
    std::ofstream(json_path)
        << nlohmann::json{{"repeats", repeats}, {"chunk_bytes", chunk_bytes}, {"rows", rows}}.dump(
               2)
        << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
