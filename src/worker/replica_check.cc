#include "worker/replica_check.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>

#include "common/coding.h"
#include "nonstop/check.h"
#include "nonstop/crc32c.h"

namespace nonstop::worker {

namespace {

constexpr size_t kFixedBytes = 16;  // step, held shard, region count
constexpr int kMaxNamed = 8;        // differences spelled out in `what`

std::string Member(int rank, const std::vector<int>& worker_ids) {
  return fmt::format("rank {} (worker {})", rank, worker_ids[static_cast<size_t>(rank)]);
}

// One set of holders of the same bytes: who holds which value.
struct Judgement {
  ReplicaVerdict* out;
  const std::vector<int>* worker_ids;
  int named = 0;
  std::set<int> diverged{};

  void Note(const std::string& line) {
    if (named++ < kMaxNamed) {
      out->what += (out->what.empty() ? "" : "; ") + line;
    } else if (named == kMaxNamed + 1) {
      out->what += "; and more";
    }
  }

  // `values[i]` is held by `holders[i]`; `what` names the bytes ("'params'", "the step").
  template <typename V, typename Show>
  void Judge(const std::string& what, const std::vector<int>& holders, const std::vector<V>& values,
             Show show) {
    if (holders.size() < 2) return;  // nothing to compare with
    std::map<V, std::vector<int>> by_value;
    for (size_t i = 0; i < holders.size(); ++i) by_value[values[i]].push_back(holders[i]);
    if (by_value.size() == 1) return;
    const auto majority = std::find_if(by_value.begin(), by_value.end(), [&](const auto& kv) {
      return 2 * kv.second.size() > holders.size();
    });
    if (majority == by_value.end()) {
      out->no_majority = true;
      std::string line = fmt::format("{}: no majority among", what);
      for (size_t i = 0; i < holders.size(); ++i)
        line += fmt::format(" {} {},", Member(holders[i], *worker_ids), show(values[i]));
      line.pop_back();
      Note(line);
      return;
    }
    for (const auto& [value, ranks] : by_value) {
      if (value == majority->first) continue;
      for (int r : ranks) {
        diverged.insert(r);
        Note(fmt::format("{} on {} is {}, the majority's ({} of {}) {}", what,
                         Member(r, *worker_ids), show(value), majority->second.size(),
                         holders.size(), show(majority->first)));
      }
    }
  }
};

std::string Crc(uint32_t c) { return fmt::format("crc32c {:08x}", c); }

}  // namespace

ReplicaRecord RecordOf(const state::StateRegistry& reg, int64_t step) {
  ReplicaRecord r;
  r.step = step;
  r.held_shard = reg.held_shard();
  r.region_crcs.reserve(reg.regions().size());
  for (size_t i = 0; i < reg.regions().size(); ++i) r.region_crcs.push_back(reg.RegionCrc(i));
  return r;
}

size_t ReplicaRecordBytes(const state::StateRegistry& reg) {
  return kFixedBytes + 4 * reg.regions().size() + 4;  // + the record's own CRC-32C
}

void EncodeReplicaRecord(const ReplicaRecord& r, std::span<std::byte> out) {
  std::string buf;
  PutFixed64(&buf, static_cast<uint64_t>(r.step));
  PutFixed32(&buf, static_cast<uint32_t>(r.held_shard));
  PutFixed32(&buf, static_cast<uint32_t>(r.region_crcs.size()));
  for (uint32_t c : r.region_crcs) PutFixed32(&buf, c);
  PutFixed32(&buf, Crc32c(buf.data(), buf.size()));
  NONSTOP_CHECK_EQ(buf.size(), out.size()) << "a replica record of another size";
  std::memcpy(out.data(), buf.data(), buf.size());
}

Result<ReplicaRecord> DecodeReplicaRecord(std::span<const std::byte> in,
                                          const state::StateRegistry& reg) {
  const char* p = reinterpret_cast<const char*>(in.data());
  const size_t regions = reg.regions().size();
  // The record's own CRC first: a damaged region count is damage, not another layout.
  if (in.size() == ReplicaRecordBytes(reg)) {
    const size_t body = in.size() - 4;
    if (uint32_t crc = Crc32c(p, body); crc != DecodeFixed32(p + body)) {
      return DataLossError(
          fmt::format("a replica record damaged on its way (crc32c {:08x}, the record says {:08x})",
                      crc, DecodeFixed32(p + body)));
    }
  }
  if (in.size() != ReplicaRecordBytes(reg) || DecodeFixed32(p + 12) != regions) {
    return DataLossError(fmt::format(
        "a replica record of {} bytes for {} regions, where this worker registers {} regions: "
        "every member must register the same state",
        in.size(), in.size() >= kFixedBytes ? DecodeFixed32(p + 12) : 0, regions));
  }
  ReplicaRecord r;
  r.step = static_cast<int64_t>(DecodeFixed64(p));
  r.held_shard = static_cast<int32_t>(DecodeFixed32(p + 8));
  r.region_crcs.resize(regions);
  for (size_t i = 0; i < regions; ++i) r.region_crcs[i] = DecodeFixed32(p + kFixedBytes + 4 * i);
  return r;
}

ReplicaVerdict CompareReplicas(const state::StateRegistry& reg,
                               const std::vector<ReplicaRecord>& records,
                               const std::vector<int>& worker_ids) {
  ReplicaVerdict out;
  Judgement judge{&out, &worker_ids};
  std::vector<int> everyone(records.size());
  std::vector<int64_t> steps(records.size());
  for (size_t q = 0; q < records.size(); ++q) {
    everyone[q] = static_cast<int>(q);
    steps[q] = records[q].step;
  }
  judge.Judge("the step its state holds", everyone, steps,
              [](int64_t s) { return fmt::format("step {}", s); });
  for (size_t i = 0; i < reg.regions().size(); ++i) {
    const state::Region& region = reg.regions()[i];
    if (region.per_rank) continue;  // each member's own values: nothing to agree on
    // Replicated: one set, every member. Sharded: a set per shard, its holders.
    std::map<int, std::pair<std::vector<int>, std::vector<uint32_t>>> sets;
    for (size_t q = 0; q < records.size(); ++q) {
      const int shard = region.shard_group > 0 ? records[q].held_shard : 0;
      if (shard < 0) continue;  // no one shard held (the initial state, a copy under way)
      sets[shard].first.push_back(static_cast<int>(q));
      sets[shard].second.push_back(records[q].region_crcs[i]);
    }
    for (const auto& [shard, set] : sets) {
      const std::string what = region.shard_group > 0
                                   ? fmt::format("'{}' (shard {})", region.name, shard)
                                   : fmt::format("'{}'", region.name);
      judge.Judge(what, set.first, set.second, Crc);
    }
  }
  out.diverged.assign(judge.diverged.begin(), judge.diverged.end());
  return out;
}

}  // namespace nonstop::worker
