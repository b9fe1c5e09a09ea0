// nonstop-bench-state-copy: the state copy (src/worker/state_transfer.cc)
// against raw TCP between the same endpoints in the same run (issue 27,
// point 4; docs/recovery.md, "State copy at the link's speed").
//
// For each state size it measures, in this order and in one process:
//   raw 1     one loopback TCP connection: plain send(2)/recv(2) of the
//             source's bytes straight into the receiver's buffer, no checks;
//   raw N     the same bytes split over N connections at once (--streams);
//   raw N+crc the same, each chunk-sized piece CRC-32C'd by its sender just
//             before it goes out and by its receiver just after it lands: the
//             least CPU a checked copy spends, with no protocol at all;
//   copy 1·1  RunStateTransfers of a registered state of that size from one
//             source over one stream, over TcpDataPlane communicators on
//             loopback (the data plane a worker uses), every chunk CRC-32C checked;
//   copy 1    the same over the streams (lanes) the receiver picks by size
//             (one per 32 MiB asked of a source, at most 4: state_transfer.h);
//   copy 3    the same from three sources (chunks striped over them);
//   sealed 1, sealed 3  copy 1 and copy 3 with the sealed copy on (NONSTOP_SEALED_STATE_COPY:
//             an AES-256-GMAC tag per chunk at both ends, worker/copy_seal.h), shown in a table
//             of their own against the unsealed figures of the same run.
// Each is repeated --repeats times, interleaved, and the median is shown;
// the ratios are copy 1·1 / raw 1, copy 1 / raw N, copy 3 / raw N, the faster copy over
// the faster raw figure of the same size, and the faster copy over raw N+crc, all measured
// seconds apart. A second table gives each one's CPU time per byte (the process's user and system
// time: both ends): where the cores are few, that is what bounds the rates. Ranks are threads of
// this process (as in state_transfer_test), the sockets real. Every copy is checked byte for byte
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
#include "common/crypto.h"
#include "common/role_keys.h"
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
          {WorkerDataKey(crypto::JobKey(kToken)), r}, std::move(listeners[static_cast<size_t>(r)]),
          aborts.back().get()));
      collective::CommunicatorOptions o;
      o.rank = r;
      o.members = members;
      comms.push_back(planes.back()->NewCommunicator(o));
    }
  }
};

struct Timed {
  double secs = 0;  // on the receiver's clock
  double cpu = 0;   // the process's CPU seconds meanwhile (every rank's: both ends)
  int took = 0;     // the streams a source's chunks came over
};

// One copy of `regs[0]`'s state from regs[1..sources] (`streams` per source, 0: by size), sealed
// or not.
Timed Copy(Ranks& ranks, std::vector<std::unique_ptr<state::StateRegistry>>& regs, int sources,
           int streams, bool sealed) {
  control::PlanMsg plan;
  plan.generation = 1;
  plan.resume_step = 8;
  for (const auto& m : ranks.members) plan.members.push_back({m.worker_id, m.address});
  control::PlanTransfer t;
  t.receiver = 0;
  for (int s = 1; s <= sources; ++s) t.sources.push_back(s);
  plan.transfers.push_back(t);
  std::vector<Status> status(kSources + 1);
  Timed timed;
  worker::TransferHooks hooks;
  hooks.streams_per_source = streams;
  if (sealed) hooks.seal_key = crypto::JobKey(kToken);
  std::vector<std::thread> threads;
  const double cpu0 = ProcessCpuSeconds();
  for (int r = kSources; r >= 0; --r) {
    threads.emplace_back([&, r] {
      auto t0 = Clock::now();
      auto out = worker::RunStateTransfers(*ranks.comms[static_cast<size_t>(r)],
                                           *regs[static_cast<size_t>(r)], plan, r,
                                           plan.resume_step - 1, hooks);
      if (r == 0) {
        timed.secs = std::chrono::duration<double>(Clock::now() - t0).count();
        if (out.ok()) timed.took = out->streams_per_source;
      }
      status[static_cast<size_t>(r)] = out.status();
    });
  }
  for (auto& th : threads) th.join();
  timed.cpu = ProcessCpuSeconds() - cpu0;
  for (int r = 0; r <= kSources; ++r) {
    NONSTOP_CHECK(status[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << status[static_cast<size_t>(r)].ToString();
  }
  return timed;
}

// What is measured for each size, in this order.
enum Kind { kRaw1, kRawN, kRawNChecked, kCopy1One, kCopy1, kCopy3, kSealed1, kSealed3, kKinds };
constexpr const char* kKeys[kKinds] = {
    "raw_1_stream",  "raw_n_streams",  "raw_n_streams_checked", "copy_1_source_1_stream",
    "copy_1_source", "copy_3_sources", "sealed_1_source",       "sealed_3_sources"};

struct Figure {
  double bytes_per_s = 0;   // median
  double cpu_ns_per_b = 0;  // median CPU time (user + system, both ends) per byte
};

struct Row {
  size_t bytes;
  Figure of[kKinds];
  int streams1 = 0;  // the streams copy 1 took
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
  std::vector<double> rates[kKinds], cpus[kKinds];
  int streams1 = 0;
  // One measurement of `kind`: its seconds and CPU seconds (connections' set-up left out).
  auto run = [&](Kind kind) -> Timed {
    Timed t;
    switch (kind) {
      case kRaw1:
        t.secs = RawTcp(src, dst, 1, 0, &t.cpu);
        return t;
      case kRawN:
        t.secs = RawTcp(src, dst, streams, 0, &t.cpu);
        return t;
      case kRawNChecked:
        t.secs = RawTcp(src, dst, streams, chunk_bytes, &t.cpu);
        return t;
      default:
        break;
    }
    std::memset(dst.data(), 0, dst.size());
    t = Copy(ranks, regs, kind == kCopy3 || kind == kSealed3 ? kSources : 1,
             kind == kCopy1One ? 1 : 0, kind == kSealed1 || kind == kSealed3);
    NONSTOP_CHECK(std::memcmp(dst.data(), src.data(), bytes) == 0)
        << "the copy (kind " << kind << ") differs from the source";
    if (kind == kCopy1) streams1 = t.took;
    return t;
  };
  for (int i = 0; i < repeats; ++i) {
    for (int k = 0; k < kKinds; ++k) {
      const Timed t = run(static_cast<Kind>(k));
      rates[k].push_back(static_cast<double>(bytes) / t.secs);
      cpus[k].push_back(t.cpu * 1e9 / static_cast<double>(bytes));
    }
  }
  Row row{bytes, {}, streams1};
  for (int k = 0; k < kKinds; ++k) row.of[k] = {Median(rates[k]), Median(cpus[k])};
  return row;
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
  const std::string rawn = fmt::format("raw {}", streams);
  const std::vector<std::string> labels = {"raw 1",       rawn,
                                           rawn + "+crc", "copy 1src·1",
                                           "copy 1src",   fmt::format("copy {}src", kSources),
                                           "sealed 1src", fmt::format("sealed {}src", kSources)};
  const std::string per_rawn = fmt::format("raw{}", streams);  // in the ratios' narrow columns
  fmt::print("{:>6} {:>8} {:>8} {:>9} {:>11} {:>13} {:>9} {:>11} {:>9} {:>9} {:>9} {:>11}\n", "MiB",
             labels[kRaw1], labels[kRawN], labels[kRawNChecked], labels[kCopy1One], "copy 1src (s)",
             labels[kCopy3], "1src·1/raw1", "1src/" + per_rawn,
             fmt::format("{}src/{}", kSources, per_rawn), "best/best", "best/+crc");
  nlohmann::json rows = nlohmann::json::array();
  std::vector<Row> measured;
  for (size_t mb : sizes_mb) {
    const Row row = MeasureSize(ranks, mb << 20, streams, repeats, chunk_bytes);
    auto rate = [&](Kind k) { return row.of[k].bytes_per_s; };
    const double raw = std::max(rate(kRaw1), rate(kRawN));
    const double copy = std::max({rate(kCopy1One), rate(kCopy1), rate(kCopy3)});
    fmt::print(
        "{:>6} {:>8.0f} {:>8.0f} {:>9.0f} {:>11.0f} {:>9.0f} ({}) {:>9.0f} {:>10.0f}% {:>8.0f}% "
        "{:>8.0f}% {:>8.0f}% {:>10.0f}%\n",
        mb, rate(kRaw1) / 1e6, rate(kRawN) / 1e6, rate(kRawNChecked) / 1e6, rate(kCopy1One) / 1e6,
        rate(kCopy1) / 1e6, row.streams1, rate(kCopy3) / 1e6, 100 * rate(kCopy1One) / rate(kRaw1),
        100 * rate(kCopy1) / rate(kRawN), 100 * rate(kCopy3) / rate(kRawN), 100 * copy / raw,
        100 * copy / rate(kRawNChecked));
    std::fflush(stdout);
    measured.push_back(row);
    nlohmann::json cpu;
    for (int k = 0; k < kKinds; ++k) cpu[kKeys[k]] = row.of[k].cpu_ns_per_b;
    rows.push_back({{"bytes", row.bytes},
                    {"raw_1_stream_bytes_per_s", rate(kRaw1)},
                    {"raw_n_streams_bytes_per_s", rate(kRawN)},
                    {"raw_n_streams_checked_bytes_per_s", rate(kRawNChecked)},
                    {"streams", streams},
                    {"copy_1_source_1_stream_bytes_per_s", rate(kCopy1One)},
                    {"copy_1_source_bytes_per_s", rate(kCopy1)},
                    {"copy_1_source_streams", row.streams1},
                    {"copy_3_sources_bytes_per_s", rate(kCopy3)},
                    {"copy_1_source_1_stream_over_raw_1_stream", rate(kCopy1One) / rate(kRaw1)},
                    {"copy_1_source_over_raw_n_streams", rate(kCopy1) / rate(kRawN)},
                    {"copy_3_sources_over_raw_n_streams", rate(kCopy3) / rate(kRawN)},
                    {"best_copy_over_best_raw", copy / raw},
                    {"best_copy_over_raw_n_streams_checked", copy / rate(kRawNChecked)},
                    {"sealed_1_source_bytes_per_s", rate(kSealed1)},
                    {"sealed_3_sources_bytes_per_s", rate(kSealed3)},
                    {"sealed_1_source_over_copy_1_source", rate(kSealed1) / rate(kCopy1)},
                    {"sealed_3_sources_over_copy_3_sources", rate(kSealed3) / rate(kCopy3)},
                    {"cpu_ns_per_byte", cpu}});
  }
  fmt::print(
      "1src·1/raw1: one source over one stream against one connection; 1src/{0}: one source "
      "over the streams (s) it took against {1} connections; {2}src/{0}: three sources against {1} "
      "connections; best/best: the fastest copy against the faster raw figure of the same size; "
      "best/+crc: the fastest copy against {1} connections whose every {3} KiB is CRC-32C'd at "
      "both ends, the least a checked copy can do\n",
      per_rawn, streams, kSources, chunk_bytes >> 10);
  fmt::print(
      "the sealed copy (an AES-256-GMAC tag per chunk) against the same copy unsealed, MB/s:\n"
      "{:>6} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7}\n",
      "MiB", labels[kCopy1], labels[kSealed1], "ratio", labels[kCopy3], labels[kSealed3], "ratio");
  for (const Row& row : measured) {
    auto rate = [&](Kind k) { return row.of[k].bytes_per_s; };
    fmt::print("{:>6} {:>11.0f} {:>11.0f} {:>6.0f}% {:>11.0f} {:>11.0f} {:>6.0f}%\n",
               row.bytes >> 20, rate(kCopy1) / 1e6, rate(kSealed1) / 1e6,
               100 * rate(kSealed1) / rate(kCopy1), rate(kCopy3) / 1e6, rate(kSealed3) / 1e6,
               100 * rate(kSealed3) / rate(kCopy3));
  }
  fmt::print("CPU time per byte (ns, user + system of both ends, median):\n{:>6}", "MiB");
  for (const std::string& label : labels) fmt::print(" {:>11}", label);
  fmt::print("\n");
  for (const Row& row : measured) {
    fmt::print("{:>6}", row.bytes >> 20);
    for (const Figure& f : row.of) fmt::print(" {:>11.3f}", f.cpu_ns_per_b);
    fmt::print("\n");
  }
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
