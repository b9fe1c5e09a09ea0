// nonstop-bench-etcd-journal: what a long job leaves in etcd, and what the
// takeover that reads it costs (docs/controller-failover.md, "A bounded journal
// in etcd").
//
// One real etcd (Debian's etcd-server) per mode. A leader (coord::Leadership)
// is handed the journal of a job through --recoveries recoveries of every kind
// (controller::testing::JournalMaker: a member's fault, a host lost and back,
// a shrink and a grow, a restart, a takeover; each with its spawn, join,
// ready per member, plan, recovery_end and steps), in batches of 50 records
// per loop turn as the runtime flushes them. Then a second Leadership
// campaigns (the first resigns), reads the journal and replays it
// (controller::TakeoverFromJournal). Measured: the bytes in etcd (every key
// and value under the job's prefix), its keys, and the takeover's time
// (campaign, read, replay), each measured here; and, for comparison, the time of
// reading the whole prefix in one request, as the journal was read before.
//
// Modes: "bounded" (what `nonstop controller --etcd` does: only what a takeover reads is
// mirrored, compacted into a snapshot past --compact-records) and "every-record" (no filter,
// no compaction: how etcd's journal grew before; it is read in pages now, as every read is).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/temp_dir.h"
#include "controller/takeover.h"
#include "controller/takeover_test_records.h"
#include "coord/etcd.h"
#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"

namespace {

using nlohmann::json;
using namespace nonstop;

double MsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

struct Measured {
  size_t records = 0, bytes = 0, keys = 0;
  double write_s = 0, campaign_ms = 0, read_ms = 0, replay_ms = 0, one_request_ms = 0;
  size_t read_records = 0;
};

int Run(const std::string& mode, const std::vector<json>& all, size_t compact_records,
        Measured* out) {
  const bool bounded = mode == "bounded";
  TempDir dir;
  testing::EtcdServer etcd(dir.path());
  if (etcd.endpoint().empty()) {
    fmt::print(stderr, "etcd did not start (scripts/setup.sh installs etcd-server):\n{}\n",
               etcd.Output());
    return 1;
  }
  coord::LeadershipOptions o;
  o.endpoints = etcd.endpoint();
  o.job = "bench";
  o.ttl_seconds = 5;
  o.journal_timeout = Millis(30'000);  // the every-record mode's pages can be large
  if (bounded) {
    o.compact = controller::CompactJournal;
    o.compact_records = compact_records;
  }
  auto first = coord::Leadership::Connect(o);
  if (!first.ok()) return fmt::print(stderr, "{}\n", first.status().ToString()), 1;
  auto epoch = (*first)->Campaign([] { return false; }, [](const std::string&) {});
  if (!epoch.ok() || !(*first)->ReadJournal(crypto::JobKey("bench")).ok())
    return fmt::print(stderr, "no lead\n"), 1;
  auto t = std::chrono::steady_clock::now();
  size_t turn = 0;
  for (const auto& r : all) {
    if (bounded && !controller::TakeoverReads(r)) continue;
    (*first)->Append(r);
    ++out->records;
    if (++turn % 50 == 0) {
      (*first)->Flush();
      // as the runtime does: orders wait for the records before them (here: a turn's worth)
      while ((*first)->durable() + 2000 < (*first)->appended() && !(*first)->deposed())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  (*first)->Flush();
  while ((*first)->durable() < (*first)->appended() && !(*first)->deposed())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if ((*first)->deposed()) return fmt::print(stderr, "{}\n", (*first)->why_not_leading()), 1;
  out->write_s = MsSince(t) / 1000;

  auto client = etcd::Client::Create(etcd.endpoint(), {std::chrono::milliseconds(30'000)});
  auto kvs = (*client)->RangeAll(coord::JobPrefix("bench"),
                                 etcd::PrefixEnd(coord::JobPrefix("bench")), 1000);
  if (!kvs.ok()) return fmt::print(stderr, "{}\n", kvs.status().ToString()), 1;
  for (const auto& kv : *kvs) out->bytes += kv.key.size() + kv.value.size();
  out->keys = kvs->size();
  // How the journal was read before: the whole prefix in one request (its timeout was 2 s).
  t = std::chrono::steady_clock::now();
  auto whole = (*client)->Prefix(coord::JobPrefix("bench"));
  out->one_request_ms = MsSince(t);
  if (!whole.ok()) out->one_request_ms = -1;

  auto second = coord::Leadership::Connect(o);
  if (!second.ok()) return 1;
  (*first)->Resign();
  t = std::chrono::steady_clock::now();
  auto epoch2 = (*second)->Campaign([] { return false; }, [](const std::string&) {});
  out->campaign_ms = MsSince(t);
  t = std::chrono::steady_clock::now();
  auto read = (*second)->ReadJournal(crypto::JobKey("bench"));
  out->read_ms = MsSince(t);
  if (!epoch2.ok() || !read.ok()) return fmt::print(stderr, "{}\n", read.status().ToString()), 1;
  out->read_records = read->records.size();
  t = std::chrono::steady_clock::now();
  auto takeover = controller::TakeoverFromJournal(read->records);
  out->replay_ms = MsSince(t);
  if (!takeover.ok()) return fmt::print(stderr, "{}\n", takeover.status().ToString()), 1;
  auto expected = controller::TakeoverFromJournal(all);
  if (!expected.ok() || expected->state.members != takeover->state.members ||
      expected->state.recoveries != takeover->state.recoveries ||
      expected->state.workers.size() != takeover->state.workers.size()) {
    fmt::print(stderr, "{}: the takeover from etcd differs from the one from every record\n", mode);
    return 1;
  }
  (*second)->Resign();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"etcd's copy of the controller's journal: its size, and the takeover's time"};
  int recoveries = 1000, world = 64, hosts = 8;
  size_t compact_records = 512;
  std::vector<std::string> modes = {"bounded", "every-record"};
  app.add_option("--recoveries", recoveries, "recoveries (and resizes) of the job");
  app.add_option("--world", world, "members of the job");
  app.add_option("--hosts", hosts, "hosts (each with one spare)");
  app.add_option("--compact-records", compact_records, "the tail's bound (records)");
  app.add_option("--modes", modes, "bounded, every-record");
  CLI11_PARSE(app, argc, argv);
  controller::testing::JournalMaker maker(world, hosts);
  for (int i = 0; i < recoveries; ++i) maker.Recovery();
  size_t all_bytes = 0;
  for (const auto& r : maker.records()) all_bytes += r.dump().size();
  fmt::print("job: world {}, {} hosts, {} recoveries: {} records, {:.1f} MiB\n", world, hosts,
             recoveries, maker.records().size(), all_bytes / 1048576.0);
  fmt::print("{:<13} {:>9} {:>11} {:>7} {:>8} | {:>11} {:>8} {:>9} {:>9} {:>8} | {:>13}\n", "mode",
             "mirrored", "etcd bytes", "keys", "write s", "campaign ms", "read ms", "records",
             "replay ms", "total ms", "1-request ms");
  for (const auto& mode : modes) {
    Measured r;
    if (int rc = Run(mode, maker.records(), compact_records, &r); rc != 0) return rc;
    fmt::print(
        "{:<13} {:>9} {:>11} {:>7} {:>8.1f} | {:>11.1f} {:>8.1f} {:>9} {:>9.1f} {:>8.1f} | "
        "{:>13.1f}\n",
        mode, r.records, r.bytes, r.keys, r.write_s, r.campaign_ms, r.read_ms, r.read_records,
        r.replay_ms, r.campaign_ms + r.read_ms + r.replay_ms, r.one_request_ms);
    std::fflush(stdout);
  }
  return 0;
}
