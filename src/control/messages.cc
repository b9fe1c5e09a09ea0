#include "control/messages.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "control/message_fields.h"

namespace nonstop::control {

using nlohmann::json;

using fields::Convert;
using fields::Decode;
using fields::Dump;
using fields::FieldError;
using fields::Number;
using fields::Reader;
using fields::Shown;

namespace {

// A plan's shard moves (optional: a plan without sharded state has none).
// Nothing in them is trusted: a receiver or source is a worker id, a shard is
// one of the plan's groups, and no list is longer than the members allow
// (each receiver once, its sources the other members), so a hostile plan
// cannot make a worker allocate or loop beyond its members. Whether the
// receivers and sources are members, and the shards their ranks', is
// worker::ValidatePlan's (it knows the ranks); whether the sources hold the
// shards, worker::ExchangeShards's.
void ReadShardMoves(const Reader& r, PlanMsg& m) {
  r.Optional("shard_group", &m.shard_group);
  if (m.shard_group < 0 || m.shard_group > kMaxShardGroup) {
    throw FieldError{"shard_group", fmt::format("{} is not a group size (0 to {})", m.shard_group,
                                                kMaxShardGroup)};
  }
  if (!r.Has("shard_moves")) return;
  const std::vector<Reader> moves = r.Objects("shard_moves");
  const size_t members = m.members.size();
  if (moves.size() > members) {
    throw FieldError{"shard_moves",
                     fmt::format("has {} moves for {} members", moves.size(), members)};
  }
  for (const Reader& e : moves) {
    PlanShardMove move;
    e("receiver", &move.receiver);
    e("shard", &move.shard);
    e("sources", &move.sources);
    if (move.receiver < 0)
      throw FieldError{e.Path("receiver"), fmt::format("{} is not a worker id", move.receiver)};
    if (move.shard < 0 || move.shard >= m.shard_group) {
      throw FieldError{
          e.Path("shard"),
          m.shard_group == 0
              ? std::string("names a shard, but the plan has no shard_group")
              : fmt::format("{} is not a shard of groups of {}", move.shard, m.shard_group)};
    }
    if (move.sources.size() >= members) {
      throw FieldError{e.Path("sources"),
                       fmt::format("has {} sources for {} members", move.sources.size(), members)};
    }
    for (size_t i = 0; i < move.sources.size(); ++i) {
      if (move.sources[i] < 0) {
        throw FieldError{fmt::format("{}[{}]", e.Path("sources"), i),
                         fmt::format("{} is not a worker id", move.sources[i])};
      }
    }
    m.shard_moves.push_back(std::move(move));
  }
}

// Everything of a plan but its members, with `plan_transfers` for its transfers: a full plan and a
// delta share it.
json PlanBody(const PlanMsg& m, const std::vector<PlanTransfer>& plan_transfers) {
  json transfers = json::array();
  for (const auto& t : plan_transfers)
    transfers.push_back({{"receiver", t.receiver}, {"sources", t.sources}});
  json faults = json::array();
  for (const auto& f : m.faults) faults.push_back({{"id", f.id}, {"spec", FormatFault(f)}});
  json j = {{"generation", m.generation},
            {"resume_step", m.resume_step},
            {"transfers", transfers},
            {"faults", faults},
            {"reason", m.reason}};
  if (m.shard_group > 0) j["shard_group"] = m.shard_group;
  if (!m.shard_moves.empty()) {
    json moves = json::array();
    for (const auto& s : m.shard_moves) {
      moves.push_back({{"receiver", s.receiver}, {"shard", s.shard}, {"sources", s.sources}});
    }
    j["shard_moves"] = std::move(moves);
  }
  return j;
}

// The same read back, after the members (the shard moves are checked against their number).
void ReadPlanBody(const Reader& r, PlanMsg& m) {
  for (const Reader& e : r.Objects("transfers")) {
    PlanTransfer t;
    e("receiver", &t.receiver);
    e("sources", &t.sources);
    m.transfers.push_back(t);
  }
  for (const Reader& e : r.Objects("faults")) {
    int id = 0;
    std::string spec;
    e("id", &id);
    e("spec", &spec);
    auto parsed = ParseFaults(spec, id);
    if (!parsed.ok()) throw FieldError{e.Path("spec"), parsed.status().message()};
    if (parsed->size() != 1) throw FieldError{e.Path("spec"), "must hold exactly one fault"};
    m.faults.push_back((*parsed)[0]);
  }
  r("reason", &m.reason);
  ReadShardMoves(r, m);
}

}  // namespace

std::string Encode(const JoinMsg& m) {
  json j = {{"worker_id", m.worker_id},
            {"pid", m.pid},
            {"data_address", m.data_address},
            {"spare", m.spare},
            {"state_step", m.state_step}};
  if (!m.host_id.empty()) j["host_id"] = m.host_id;
  if (m.generation > 0) j["generation"] = m.generation;
  if (m.waiting) j["waiting"] = true;
  if (m.shard_group > 0) {
    j["shard_group"] = m.shard_group;
    j["held_shard"] = m.held_shard;
  }
  if (m.sealed_copy) j["sealed_copy"] = true;
  return Dump(j);
}
std::string Encode(const PlanMsg& m) {
  json members = json::array();
  for (const auto& p : m.members)
    members.push_back({{"worker_id", p.worker_id}, {"address", p.address}});
  json j = PlanBody(m, m.transfers);
  j["members"] = std::move(members);
  return Dump(j);
}
std::string Encode(const HeartbeatMsg& m) {
  json j = {{"step", m.step}, {"waiting_ms", m.waiting_ms}};
  if (!m.busy.empty()) {
    j["busy"] = m.busy;
    j["busy_ms"] = m.busy_ms;
    j["busy_bound_ms"] = m.busy_bound_ms;
  }
  return Dump(j);
}
std::string Encode(const ProgressMsg& m) {
  json j = {{"step", m.step},
            {"loss", Number(m.loss)},
            {"step_seconds", Number(m.step_seconds)},
            {"tokens_per_second", Number(m.tokens_per_second)},
            {"world_size", m.world_size}};
  if (m.total_steps > 0) j["total_steps"] = m.total_steps;
  if (m.replica_check_ms >= 0) j["replica_check_ms"] = Number(m.replica_check_ms);
  if (m.replica_crc_ms >= 0) j["replica_crc_ms"] = Number(m.replica_crc_ms);
  return Dump(j);
}
std::string Encode(const FinishedMsg& m) {
  return Dump({{"step", m.step}, {"checksum", m.checksum}});
}
std::string Encode(const FailureMsg& m) {
  json j = {{"generation", m.generation},
            {"step", m.step},
            {"reason", m.reason},
            {"exit_code", m.exit_code}};
  if (!m.traceback.empty()) j["traceback"] = m.traceback;
  return Dump(j);
}
std::string Encode(const ShutdownMsg& m) {
  return Dump({{"reason", m.reason}, {"exit_code", m.exit_code}});
}
std::string Encode(const PingMsg& m) { return Dump({{"epoch", m.epoch}}); }
std::string Encode(const AbortMsg& m) {
  return Dump({{"generation", m.generation}, {"reason", m.reason}});
}
std::string Encode(const DrainMsg& m) {
  return Dump({{"generation", m.generation}, {"after_step", m.after_step}, {"reason", m.reason}});
}
std::string Encode(const ReadyMsg& m) {
  return Dump({{"generation", m.generation},
               {"step", m.step},
               {"reason", m.reason},
               {"held_shard", m.held_shard}});
}
std::string Encode(const RecoveredMsg& m) {
  return Dump({{"generation", m.generation},
               {"connect_seconds", Number(m.connect_seconds)},
               {"transfer_seconds", Number(m.transfer_seconds)},
               {"bytes_received", m.bytes_received},
               {"sources", m.sources},
               {"refetched_chunks", m.refetched_chunks},
               {"connections", m.connections},
               {"connections_opened", m.connections_opened}});
}
std::string Encode(const InjectedMsg& m) {
  return Dump({{"fault_id", m.fault_id}, {"description", m.description}});
}

Result<JoinMsg> DecodeJoin(std::string_view p) {
  return Decode<JoinMsg>("join", p, [](const Reader& r, JoinMsg& m) {
    r("worker_id", &m.worker_id);
    r("pid", &m.pid);
    r("data_address", &m.data_address);
    r("spare", &m.spare);
    r("state_step", &m.state_step);
    r.Optional("host_id", &m.host_id);
    if (!m.host_id.empty()) {
      if (Status s = CheckHostId(m.host_id); !s.ok()) throw FieldError{"host_id", s.message()};
    }
    r.Optional("generation", &m.generation);
    r.Optional("waiting", &m.waiting);
    r.Optional("shard_group", &m.shard_group);
    r.Optional("held_shard", &m.held_shard);
    r.Optional("sealed_copy", &m.sealed_copy);
    if (m.shard_group < 0 || m.shard_group > kMaxShardGroup) {
      throw FieldError{"shard_group", fmt::format("{} is not a group size (0 to {})", m.shard_group,
                                                  kMaxShardGroup)};
    }
    if (m.held_shard < -2 || m.held_shard >= std::max(m.shard_group, 1)) {
      throw FieldError{"held_shard", fmt::format("{} is not a shard of groups of {}", m.held_shard,
                                                 m.shard_group)};
    }
  });
}
Result<PlanMsg> DecodePlan(std::string_view p) {
  return Decode<PlanMsg>("plan", p, [](const Reader& r, PlanMsg& m) {
    r("generation", &m.generation);
    r("resume_step", &m.resume_step);
    for (const Reader& e : r.Objects("members")) {
      PlanMember pm;
      e("worker_id", &pm.worker_id);
      e("address", &pm.address);
      m.members.push_back(pm);
    }
    ReadPlanBody(r, m);
  });
}

uint64_t MembersDigest(const std::vector<PlanMember>& members) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a 64
  auto mix = [&h](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i, v >>= 8) {
      h ^= v & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const auto& m : members) {
    // A fixed-width id and length before each address: two lists never hash the same bytes.
    mix(static_cast<uint32_t>(m.worker_id), 4);
    mix(m.address.size(), 8);
    for (char c : m.address) mix(static_cast<unsigned char>(c), 1);
  }
  return h;
}

PlanMembersDelta DiffMembers(const PlanMsg& plan, const PlanMsg* base) {
  PlanMembersDelta out;
  std::unordered_map<int, size_t> base_rank;
  if (base != nullptr) {
    out.has_base = true;
    out.base_generation = base->generation;
    out.base_digest = MembersDigest(base->members);
    base_rank.reserve(base->members.size());
    for (size_t r = 0; r < base->members.size(); ++r)
      base_rank.emplace(base->members[r].worker_id, r);
  }
  // Runs of consecutive base ranks that keep their worker and address, and the other members one
  // by one. A base rank is copied at most once (the decoder refuses more): a plan that lists a
  // member twice (ValidatePlan's to refuse) gets the second as an entry.
  std::vector<bool> copied(base_rank.empty() ? 0 : base->members.size(), false);
  for (const auto& m : plan.members) {
    auto it = base_rank.find(m.worker_id);
    if (it == base_rank.end() || base->members[it->second].address != m.address ||
        copied[it->second]) {
      out.runs.push_back({0, 0, m});
      continue;
    }
    copied[it->second] = true;
    PlanMemberRun* last = out.runs.empty() ? nullptr : &out.runs.back();
    if (last != nullptr && last->count > 0 && last->copy_from + last->count == it->second) {
      ++last->count;
    } else {
      out.runs.push_back({it->second, 1, {}});
    }
  }
  return out;
}

std::string EncodePlanDelta(const PlanMsg& plan, const PlanMembersDelta& members,
                            const std::vector<PlanTransfer>& transfers, uint64_t members_digest) {
  // Compact arrays: [from, count] copies base ranks, [worker id, "address"] is a member.
  json runs = json::array();
  for (const auto& r : members.runs) {
    if (r.count > 0) {
      runs.push_back(json::array({r.copy_from, r.count}));
    } else {
      runs.push_back(json::array({r.member.worker_id, r.member.address}));
    }
  }
  json j = PlanBody(plan, transfers);
  j["v"] = kPlanDeltaVersion;
  // The base's fields are there exactly when the delta has one: no generation means "none".
  if (members.has_base) {
    j["base_generation"] = members.base_generation;
    j["base_digest"] = fmt::format("{:016x}", members.base_digest);
  }
  j["world"] = plan.members.size();
  j["digest"] = fmt::format("{:016x}", members_digest);
  j["members"] = std::move(runs);
  return Dump(j);
}

std::string EncodePlanDelta(const PlanMsg& plan, const PlanMembersDelta& members,
                            const std::vector<PlanTransfer>& transfers) {
  return EncodePlanDelta(plan, members, transfers, MembersDigest(plan.members));
}

namespace {

// The members of a delta, rebuilt against `base` (checked by the caller to be the one it names).
void ReadMemberRuns(const Reader& r, const PlanMsg* base, PlanMsg& m) {
  const size_t base_size = base == nullptr ? 0 : base->members.size();
  size_t world = 0;
  r("world", &world);
  const json& runs = r.Array("members");
  // A legitimate delta copies each base rank at most once (`copied` checks that), so the runs
  // add up to at most the base's size: a hostile one cannot make the worker allocate more than
  // that and its entries.
  if (world > base_size + runs.size()) {
    throw FieldError{"world", fmt::format("{} members from a base of {} and {} entries", world,
                                          base_size, runs.size())};
  }
  m.members.reserve(world);
  std::vector<bool> copied(base_size, false);
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string path = fmt::format("members[{}]", i);
    const json& e = runs[i];
    if (!e.is_array() || e.size() != 2) {
      throw FieldError{
          path, fmt::format("must be [from, count] or [worker_id, \"address\"], got {}", Shown(e))};
    }
    if (e[1].is_string()) {
      m.members.push_back({Convert<int>(e[0], path + "[0]"), e[1].get<std::string>()});
      continue;
    }
    const size_t from = Convert<size_t>(e[0], path + "[0]");
    const size_t count = Convert<size_t>(e[1], path + "[1]");
    // Named by from and count, not [from, from + count): that sum may wrap.
    if (count == 0 || from >= base_size || count > base_size - from) {
      throw FieldError{path, fmt::format("copies {} ranks from rank {} of a base of {} members "
                                         "(a run must copy at least one rank, inside the base)",
                                         count, from, base_size)};
    }
    for (size_t k = from; k < from + count; ++k) {
      if (copied[k]) {
        throw FieldError{path, fmt::format("copies rank {} of the base again: each base rank "
                                           "appears at most once in a plan",
                                           k)};
      }
      copied[k] = true;
    }
    m.members.insert(m.members.end(), base->members.begin() + static_cast<ptrdiff_t>(from),
                     base->members.begin() + static_cast<ptrdiff_t>(from + count));
  }
  if (m.members.size() != world) {
    throw FieldError{"members", fmt::format("rebuild {} members, but the delta says {}",
                                            m.members.size(), world)};
  }
}

// The base a delta names, checked against the one the worker holds (nullptr: none), or nullptr
// when the delta has none.
const PlanMsg* CheckedBase(const Reader& r, const PlanMsg* held) {
  if (!r.Has("base_generation") && !r.Has("base_digest")) return nullptr;
  uint32_t base_generation = 0;
  std::string digest;
  r("base_generation", &base_generation);
  r("base_digest", &digest);
  if (held == nullptr) {
    throw FieldError{
        "base_generation",
        fmt::format("{} names the plan this worker holds, but it holds none", base_generation)};
  }
  const std::string held_digest = fmt::format("{:016x}", MembersDigest(held->members));
  if (held->generation != base_generation || digest != held_digest) {
    throw FieldError{"base_digest",
                     fmt::format("{} of generation {} is not the plan this worker holds "
                                 "(generation {}, digest {}): the controller sends the full "
                                 "plan on a new connection",
                                 digest, base_generation, held->generation, held_digest)};
  }
  return held;
}

}  // namespace

Result<PlanMsg> DecodePlanDelta(std::string_view p, const PlanMsg* base) {
  return Decode<PlanMsg>("plan delta", p, [base](const Reader& r, PlanMsg& m) {
    int version = 0;
    r("v", &version);
    if (version != kPlanDeltaVersion) {
      throw FieldError{"v", fmt::format("{} is not a version this worker reads ({}): run the same "
                                        "nonstop version on the controller and the workers",
                                        version, kPlanDeltaVersion)};
    }
    r("generation", &m.generation);
    r("resume_step", &m.resume_step);
    std::string digest;
    r("digest", &digest);
    ReadMemberRuns(r, CheckedBase(r, base), m);
    // The runs and entries were well formed; this says they rebuilt the list the controller meant.
    if (const std::string rebuilt = fmt::format("{:016x}", MembersDigest(m.members));
        digest != rebuilt) {
      throw FieldError{"digest", fmt::format("{} is not that of the {} members the delta rebuilds "
                                             "({}): a controller bug; the worker dials again and "
                                             "gets the plan against no base",
                                             digest, m.members.size(), rebuilt)};
    }
    ReadPlanBody(r, m);
  });
}

Result<HeartbeatMsg> DecodeHeartbeat(std::string_view p) {
  return Decode<HeartbeatMsg>("heartbeat", p, [](const Reader& r, HeartbeatMsg& m) {
    r("step", &m.step);
    r("waiting_ms", &m.waiting_ms);
    r.Optional("busy", &m.busy);
    if (m.busy.size() > kMaxBusyLabel)
      throw FieldError{"busy",
                       fmt::format("is {} bytes; at most {}", m.busy.size(), kMaxBusyLabel)};
    if (!m.busy.empty()) {
      r("busy_ms", &m.busy_ms);
      r("busy_bound_ms", &m.busy_bound_ms);
      if (m.busy_ms < 0 || m.busy_bound_ms <= 0)
        throw FieldError{"busy_ms", fmt::format("a section of {} ms bound to {} ms", m.busy_ms,
                                                m.busy_bound_ms)};
    }
  });
}
Result<ProgressMsg> DecodeProgress(std::string_view p) {
  return Decode<ProgressMsg>("progress", p, [](const Reader& r, ProgressMsg& m) {
    r("step", &m.step);
    r("loss", &m.loss);
    r("step_seconds", &m.step_seconds);
    r("tokens_per_second", &m.tokens_per_second);
    r("world_size", &m.world_size);
    r.Optional("total_steps", &m.total_steps);
    if (m.total_steps < 0)
      throw FieldError{"total_steps", fmt::format("must not be negative, got {}", m.total_steps)};
    for (auto [name, field] : {std::pair{"replica_check_ms", &m.replica_check_ms},
                               std::pair{"replica_crc_ms", &m.replica_crc_ms}}) {
      r.Optional(name, field);
      if (!std::isfinite(*field) || *field > 1e9)
        throw FieldError{name,
                         fmt::format("must be a finite number of milliseconds, got {}", *field)};
    }
  });
}
Result<FinishedMsg> DecodeFinished(std::string_view p) {
  return Decode<FinishedMsg>("finished", p, [](const Reader& r, FinishedMsg& m) {
    r("step", &m.step);
    r("checksum", &m.checksum);
  });
}
Result<FailureMsg> DecodeFailure(std::string_view p) {
  return Decode<FailureMsg>("failure", p, [](const Reader& r, FailureMsg& m) {
    r("generation", &m.generation);
    r("step", &m.step);
    r("reason", &m.reason);
    r("exit_code", &m.exit_code);
    r.Optional("traceback", &m.traceback);
    if (m.traceback.size() > kMaxTraceback)
      throw FieldError{"traceback",
                       fmt::format("is {} bytes; at most {}", m.traceback.size(), kMaxTraceback)};
  });
}
Result<PingMsg> DecodePing(std::string_view p) {
  return Decode<PingMsg>("ping", p,
                         [](const Reader& r, PingMsg& m) { r.Optional("epoch", &m.epoch); });
}
Result<AbortMsg> DecodeAbort(std::string_view p) {
  return Decode<AbortMsg>("abort", p, [](const Reader& r, AbortMsg& m) {
    r("generation", &m.generation);
    r("reason", &m.reason);
  });
}
Result<DrainMsg> DecodeDrain(std::string_view p) {
  return Decode<DrainMsg>("drain", p, [](const Reader& r, DrainMsg& m) {
    r("generation", &m.generation);
    r("after_step", &m.after_step);
    r("reason", &m.reason);
  });
}
Result<ReadyMsg> DecodeReady(std::string_view p) {
  return Decode<ReadyMsg>("ready", p, [](const Reader& r, ReadyMsg& m) {
    r("generation", &m.generation);
    r("step", &m.step);
    r("reason", &m.reason);
    r.Optional("held_shard", &m.held_shard);
    if (m.held_shard < -2 || m.held_shard >= kMaxShardGroup) {
      throw FieldError{"held_shard", fmt::format("{} is not a shard", m.held_shard)};
    }
  });
}
Result<RecoveredMsg> DecodeRecovered(std::string_view p) {
  return Decode<RecoveredMsg>("recovered", p, [](const Reader& r, RecoveredMsg& m) {
    r("generation", &m.generation);
    r("connect_seconds", &m.connect_seconds);
    r("transfer_seconds", &m.transfer_seconds);
    r("bytes_received", &m.bytes_received);
    r("sources", &m.sources);
    r("refetched_chunks", &m.refetched_chunks);
    r.Optional("connections", &m.connections);
    r.Optional("connections_opened", &m.connections_opened);
  });
}
Result<InjectedMsg> DecodeInjected(std::string_view p) {
  return Decode<InjectedMsg>("injected", p, [](const Reader& r, InjectedMsg& m) {
    r("fault_id", &m.fault_id);
    r("description", &m.description);
  });
}
Result<ShutdownMsg> DecodeShutdown(std::string_view p) {
  return Decode<ShutdownMsg>("shutdown", p, [](const Reader& r, ShutdownMsg& m) {
    r("reason", &m.reason);
    r("exit_code", &m.exit_code);
  });
}

// ---- controller ↔ agent ----

Status CheckHostId(std::string_view id) {
  if (id.empty() || id.size() > 64) {
    return InvalidArgumentError(
        fmt::format("host id must have 1 to 64 characters, has {}", id.size()));
  }
  for (char c : id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) {
      return InvalidArgumentError(fmt::format(
          "host id may hold only letters, digits, '.', '_' and '-'; it has byte 0x{:02x}",
          static_cast<unsigned char>(c)));
    }
  }
  return OkStatus();
}

std::string Encode(const AgentRegisterMsg& m) {
  json j = {{"host_id", m.host_id}, {"nproc", m.nproc}, {"spares", m.spares},
            {"address", m.address}, {"pid", m.pid},     {"running", m.running}};
  if (!m.workers.empty()) {
    json workers = json::array();
    for (const auto& [id, pid] : m.workers) workers.push_back({{"worker_id", id}, {"pid", pid}});
    j["workers"] = workers;
  }
  if (m.elastic) j["elastic"] = true;
  return Dump(j);
}
std::string Encode(const AgentStartMsg& m) {
  json env = json::array();
  for (const auto& [k, v] : m.env) env.push_back({{"name", k}, {"value", v}});
  return Dump({{"worker_id", m.worker_id}, {"spare", m.spare}, {"nice", m.nice}, {"env", env}});
}
std::string Encode(const AgentSignalMsg& m) {
  return Dump({{"worker_id", m.worker_id}, {"signal", m.signal}});
}
std::string Encode(const AgentReniceMsg& m) {
  return Dump({{"worker_id", m.worker_id}, {"nice", m.nice}});
}
std::string Encode(const AgentStartedMsg& m) {
  return Dump({{"worker_id", m.worker_id}, {"pid", m.pid}, {"error", m.error}});
}
std::string Encode(const AgentExitedMsg& m) {
  return Dump({{"worker_id", m.worker_id},
               {"pid", m.pid},
               {"exit_code", m.exit_code},
               {"signal", m.signal}});
}
std::string Encode(const AgentStoppedMsg& m) {
  return Dump({{"worker_id", m.worker_id}, {"pid", m.pid}, {"signal", m.signal}});
}
std::string Encode(const AgentDyingMsg& m) {
  return Dump({{"worker_id", m.worker_id}, {"pid", m.pid}});
}
std::string Encode(const AgentHeartbeatMsg& m) { return Dump({{"running", m.running}}); }
std::string Encode(const AgentRanksMsg& m) {
  json ranks = json::array();
  for (const auto& [id, rank] : m.ranks) ranks.push_back({{"worker_id", id}, {"rank", rank}});
  return Dump({{"generation", m.generation}, {"ranks", ranks}});
}
std::string Encode(const AgentLeavingMsg& m) { return Dump({{"reason", m.reason}}); }

namespace {

// Bounds shared by the agent messages: ids and counts an honest peer never exceeds.
void CheckRange(const Reader& r, const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    throw FieldError{r.Path(name), fmt::format("must be from {} to {}, got {}", lo, hi, v)};
}
constexpr int64_t kMaxWorkerId = int64_t{1} << 30;

}  // namespace

Result<AgentRegisterMsg> DecodeAgentRegister(std::string_view p) {
  return Decode<AgentRegisterMsg>("agent register", p, [](const Reader& r, AgentRegisterMsg& m) {
    r("host_id", &m.host_id);
    if (Status s = CheckHostId(m.host_id); !s.ok()) throw FieldError{"host_id", s.message()};
    r("nproc", &m.nproc);
    CheckRange(r, "nproc", m.nproc, 0, 1024);
    r("spares", &m.spares);
    CheckRange(r, "spares", m.spares, 0, 1024);
    r("address", &m.address);
    if (m.address.empty() || m.address.size() > 255)
      throw FieldError{"address", "must have 1 to 255 characters"};
    r("pid", &m.pid);
    r("running", &m.running);
    CheckRange(r, "running", m.running, 0, 1 << 20);
    if (r.Has("workers")) {
      auto workers = r.Objects("workers");
      if (workers.size() != static_cast<size_t>(m.running)) {
        throw FieldError{"workers", fmt::format("lists {} processes but running says {}",
                                                workers.size(), m.running)};
      }
      for (const Reader& e : workers) {
        int id = -1;
        int64_t pid = 0;
        e("worker_id", &id);
        e("pid", &pid);
        if (id < 0 || pid <= 0)
          throw FieldError{"workers", fmt::format("worker {} pid {} is not valid", id, pid)};
        m.workers.push_back({id, pid});
      }
    }
    r.Optional("elastic", &m.elastic);
  });
}
Result<AgentStartMsg> DecodeAgentStart(std::string_view p) {
  return Decode<AgentStartMsg>("agent start", p, [](const Reader& r, AgentStartMsg& m) {
    r("worker_id", &m.worker_id);
    CheckRange(r, "worker_id", m.worker_id, 0, kMaxWorkerId);
    r("spare", &m.spare);
    r("nice", &m.nice);
    CheckRange(r, "nice", m.nice, 0, 19);
    auto env = r.Objects("env");
    if (env.size() > 64)
      throw FieldError{"env", fmt::format("holds {} variables; at most 64", env.size())};
    for (const Reader& e : env) {
      std::string name, value;
      e("name", &name);
      e("value", &value);
      const bool torchrun =
          std::find(std::begin(kOrderedTorchrunVariables), std::end(kOrderedTorchrunVariables),
                    name) != std::end(kOrderedTorchrunVariables);
      if ((name.rfind("NONSTOP_", 0) != 0 && !torchrun) || name.size() > 128 ||
          name.find('=') != std::string::npos) {
        throw FieldError{e.Path("name"), fmt::format("'{}' is not a NONSTOP_ or torchrun variable",
                                                     name.substr(0, 64))};
      }
      if (value.size() > 4096 || value.find('\0') != std::string::npos) {
        throw FieldError{e.Path("value"), "must be at most 4096 bytes, without NUL"};
      }
      m.env.emplace_back(std::move(name), std::move(value));
    }
  });
}
Result<AgentSignalMsg> DecodeAgentSignal(std::string_view p) {
  return Decode<AgentSignalMsg>("agent signal", p, [](const Reader& r, AgentSignalMsg& m) {
    r("worker_id", &m.worker_id);
    CheckRange(r, "worker_id", m.worker_id, 0, kMaxWorkerId);
    r("signal", &m.signal);
    CheckRange(r, "signal", m.signal, 1, 64);
  });
}
Result<AgentReniceMsg> DecodeAgentRenice(std::string_view p) {
  return Decode<AgentReniceMsg>("agent renice", p, [](const Reader& r, AgentReniceMsg& m) {
    r("worker_id", &m.worker_id);
    CheckRange(r, "worker_id", m.worker_id, 0, kMaxWorkerId);
    r("nice", &m.nice);
    CheckRange(r, "nice", m.nice, 0, 19);
  });
}
Result<AgentStartedMsg> DecodeAgentStarted(std::string_view p) {
  return Decode<AgentStartedMsg>("agent started", p, [](const Reader& r, AgentStartedMsg& m) {
    r("worker_id", &m.worker_id);
    CheckRange(r, "worker_id", m.worker_id, 0, kMaxWorkerId);
    r("pid", &m.pid);
    r("error", &m.error);
  });
}
Result<AgentExitedMsg> DecodeAgentExited(std::string_view p) {
  return Decode<AgentExitedMsg>("agent exited", p, [](const Reader& r, AgentExitedMsg& m) {
    r("worker_id", &m.worker_id);
    CheckRange(r, "worker_id", m.worker_id, 0, kMaxWorkerId);
    r("pid", &m.pid);
    r("exit_code", &m.exit_code);
    r("signal", &m.signal);
    CheckRange(r, "signal", m.signal, 0, 64);
  });
}
Result<AgentStoppedMsg> DecodeAgentStopped(std::string_view p) {
  return Decode<AgentStoppedMsg>("agent stopped", p, [](const Reader& r, AgentStoppedMsg& m) {
    r("worker_id", &m.worker_id);
    CheckRange(r, "worker_id", m.worker_id, 0, kMaxWorkerId);
    r("pid", &m.pid);
    r("signal", &m.signal);
    CheckRange(r, "signal", m.signal, 0, 64);
  });
}
Result<AgentDyingMsg> DecodeAgentDying(std::string_view p) {
  return Decode<AgentDyingMsg>("agent dying", p, [](const Reader& r, AgentDyingMsg& m) {
    r("worker_id", &m.worker_id);
    CheckRange(r, "worker_id", m.worker_id, 0, kMaxWorkerId);
    r("pid", &m.pid);
  });
}
Result<AgentHeartbeatMsg> DecodeAgentHeartbeat(std::string_view p) {
  return Decode<AgentHeartbeatMsg>("agent heartbeat", p, [](const Reader& r, AgentHeartbeatMsg& m) {
    r("running", &m.running);
    CheckRange(r, "running", m.running, 0, 1 << 20);
  });
}
Result<AgentRanksMsg> DecodeAgentRanks(std::string_view p) {
  return Decode<AgentRanksMsg>("agent ranks", p, [](const Reader& r, AgentRanksMsg& m) {
    r("generation", &m.generation);
    std::set<int> ids;
    for (const Reader& e : r.Objects("ranks")) {
      int id = -1, rank = -1;
      e("worker_id", &id);
      CheckRange(e, "worker_id", id, 0, kMaxWorkerId);
      e("rank", &rank);
      CheckRange(e, "rank", rank, 0, kMaxWorkerId);
      if (!ids.insert(id).second)
        throw FieldError{e.Path("worker_id"), fmt::format("worker {} is listed twice", id)};
      m.ranks.push_back({id, rank});
    }
  });
}

Result<AgentLeavingMsg> DecodeAgentLeaving(std::string_view p) {
  return Decode<AgentLeavingMsg>("agent leaving", p, [](const Reader& r, AgentLeavingMsg& m) {
    r("reason", &m.reason);
    // A signal's name, printed in the controller's lines: short and plain.
    if (m.reason.size() > 64) throw FieldError{r.Path("reason"), "is longer than 64 bytes"};
    for (char c : m.reason) {
      if (c < 0x20 || c > 0x7e)
        throw FieldError{r.Path("reason"), "holds a byte that is not printable ASCII"};
    }
  });
}

}  // namespace nonstop::control
