#include "worker/state_transfer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/coding.h"
#include "common/mutex.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/crc32c.h"
#include "nonstop/log.h"
#include "nonstop/settings.h"
#include "state/shard_layout.h"
#include "worker/copy_seal.h"
#include "worker/copy_wire.h"

namespace nonstop::worker {

namespace {

// The shape of the plan's shard moves (ValidatePlan): whether their sources
// hold the shards is ExchangeShards's to check, against what they say.
Status ValidateShardMoves(const control::PlanMsg& plan, const std::set<int>& ids,
                          const std::function<Status(const std::string&)>& bad) {
  if (!plan.shard_moves.empty() && plan.shard_group <= 0)
    return bad("it moves shards but names no shard_group");
  std::set<int> receivers;
  for (const auto& m : plan.shard_moves) {
    const int rank = RankOf(plan, m.receiver);
    if (rank < 0) return bad(fmt::format("shard receiver worker {} is not a member", m.receiver));
    if (!receivers.insert(m.receiver).second)
      return bad(fmt::format("worker {} receives a shard twice", m.receiver));
    // state::LayoutOf: rank r holds shard r mod G, whatever the world.
    if (m.shard != rank % plan.shard_group) {
      return bad(fmt::format(
          "worker {} is to receive shard {}, but its rank {} holds shard {} of groups of {}",
          m.receiver, m.shard, rank, rank % plan.shard_group, plan.shard_group));
    }
    std::set<int> seen;
    for (int src : m.sources) {
      if (!ids.count(src)) {
        return bad(fmt::format("source worker {} of shard {} for worker {} is not a member", src,
                               m.shard, m.receiver));
      }
      if (src == m.receiver)
        return bad(fmt::format("worker {} is its own source of shard {}", src, m.shard));
      if (!seen.insert(src).second) {
        return bad(fmt::format("worker {} is a source of shard {} for worker {} twice", src,
                               m.shard, m.receiver));
      }
    }
  }
  return OkStatus();
}

// What a source of the state transfer offers: its header's step, and its CRC table once its
// first request's chunks have come.
struct Offer {
  int rank = -1;
  int64_t step = 0;
  std::vector<uint32_t> table;
  std::optional<CopySeal> seal;  // sealed copies
  uint32_t requests = 0;         // sent to it so far (the seal's request numbers)
};

// Receiver side: every source's header, checked (a corrupt header, another
// layout or group size: DATA_LOSS). Sources that hold another step than
// `step` are dropped with a warning and told at once that the receiver is
// done with them; the others are returned. DATA_LOSS naming each source and
// its step when none holds `step`. On a failure, every source is told
// "done" (best effort), so none waits for a request that will not come.
Result<std::vector<Offer>> GatherOffers(collective::Communicator& comm,
                                        const state::StateRegistry& reg,
                                        const control::PlanMsg& plan, int64_t step,
                                        const std::vector<int>& sources, SealSpec spec) {
  std::vector<Offer> offers;
  // Every source sent its header at once and waits for a request: all of them, read or not, are
  // told "done", so that none waits for a request that will not come.
  auto end_all = [&](const Status& s) {
    (void)TellDone(comm, sources);
    return s;
  };
  for (int source : sources) {
    std::string header(kHeaderBytes, '\0');
    Status s = comm.Recv(source, std::as_writable_bytes(std::span(header)));
    if (!s.ok()) return end_all(s);
    Result<Header> held = ParseHeader(header, reg, SourceName(plan, source), spec.key != nullptr);
    if (!held.ok()) return end_all(held.status());
    Offer& o = offers.emplace_back(Offer{source, held->step, {}, std::nullopt, 0});
    if (spec.key != nullptr) {
      o.seal.emplace(*spec.key, "replicated", spec.generation, source, comm.rank(), held->sealed);
    }
  }
  std::vector<Offer> valid;
  std::vector<std::string> others;
  for (Offer& o : offers) {
    if (o.step == step) {
      valid.push_back(std::move(o));
      continue;
    }
    others.push_back(fmt::format("{} holds step {}", SourceName(plan, o.rank), o.step));
    NONSTOP_LOG_WARNING(
        "state transfer of generation {}: {} holds the state of step {}, not step {} that the "
        "plan resumes after: dropped, its chunks are copied from the other sources",
        plan.generation, SourceName(plan, o.rank), o.step, step);
    (void)SendU32s(comm, o.rank, {});  // done: it serves nothing
  }
  if (valid.empty()) {
    return DataLossError(fmt::format(
        "no source holds the state of step {} that the plan of generation {} resumes after: {}",
        step, plan.generation, fmt::join(others, ", ")));
  }
  return valid;
}

std::string ListChunks(const std::vector<uint32_t>& chunks) {
  constexpr size_t kShown = 16;
  if (chunks.size() <= kShown) return fmt::format("{}", fmt::join(chunks, ", "));
  return fmt::format("{} and {} more", fmt::join(chunks.begin(), chunks.begin() + kShown, ", "),
                     chunks.size() - kShown);
}

// Which sources' copies of each wanted chunk the receiver keeps: those whose
// table gives it the CRC a majority of the sources' tables give it. A chunk
// of per-rank regions is the first source's, unvoted: the members' copies
// differ by design, and each such region then comes from one source.
// `agrees[i][c]`: source i's table gives chunk c that CRC. Replicas that
// disagree are logged once, naming the chunks and the sources in the minority.
struct Expected {
  std::vector<std::vector<char>> agrees;  // [source][chunk]
};

// A chunk whose sources disagree with no majority (two sources, one of them
// silently corrupt) is kept from none of them: which copy is right cannot be
// told, and keeping one would hand the next replica check a false majority.
// The plan names every holder as a source up to kMaxSourcesPerReceiver (8),
// so no other holder can break the tie (beyond 8, a tie needs 4 sources
// corrupt alike): the copy fails as data loss, and what the first round
// wrote is left as a state that holds no valid step.
Status NoMajority(const state::StateRegistry& reg, const std::vector<Offer>& offers,
                  const std::vector<uint32_t>& undecided, const control::PlanMsg& plan) {
  const uint32_t c = undecided.front();
  std::vector<std::string> crcs;
  for (const Offer& o : offers)
    crcs.push_back(fmt::format("{} {:08x}", SourceName(plan, o.rank), o.table[c]));
  return DataLossError(fmt::format(
      "the sources of state chunk {} (bytes {}+{} of the state, in {}) of step {} {} ({}){}: it "
      "is not copied",
      c, reg.chunk_offset(c), reg.chunk_size(c), fmt::join(reg.RegionsOfChunk(c), ", "),
      plan.resume_step - 1, kReplicaDisagreement, fmt::join(crcs, ", "),
      undecided.size() > 1 ? fmt::format(", and of {} more chunk(s)", undecided.size() - 1) : ""));
}

Result<Expected> MajorityOf(const state::StateRegistry& reg, const std::vector<Offer>& offers,
                            const std::vector<uint32_t>& wanted, const control::PlanMsg& plan) {
  const size_t k = offers.size();
  Expected e;
  for (const Offer& o : offers) e.agrees.emplace_back(o.table.size(), 1);
  std::map<int, std::vector<uint32_t>> minority;  // source rank → chunks
  std::vector<uint32_t> undecided;                // chunks without a majority
  for (uint32_t c : wanted) {
    if (reg.chunk_per_rank(c)) {
      for (size_t i = 1; i < k; ++i) e.agrees[i][c] = offers[i].table[c] == offers[0].table[c];
      continue;
    }
    std::map<uint32_t, size_t> votes;
    for (const Offer& o : offers) ++votes[o.table[c]];
    if (votes.size() == 1) continue;  // every table agrees
    auto best = std::max_element(votes.begin(), votes.end(),
                                 [](const auto& x, const auto& y) { return x.second < y.second; });
    if (2 * best->second <= k) {
      undecided.push_back(c);
      continue;
    }
    for (size_t i = 0; i < k; ++i) {
      if (offers[i].table[c] == best->first) continue;
      e.agrees[i][c] = 0;
      minority[offers[i].rank].push_back(c);
    }
  }
  if (!undecided.empty()) return NoMajority(reg, offers, undecided, plan);
  if (!minority.empty()) {
    std::vector<std::string> parts;
    for (const auto& [rank, chunks] : minority) {
      parts.push_back(
          fmt::format("{} differs from the majority on chunk(s) {} (copied from the "
                      "others)",
                      SourceName(plan, rank), ListChunks(chunks)));
    }
    NONSTOP_LOG_WARNING("state transfer of generation {}: the sources' states diverge: {}",
                        plan.generation, fmt::join(parts, "; "));
  }
  return e;
}

// One round of the receiver's fetches, from every source at once, each over the lanes StreamsFor
// gives its list: the chunks lists[i] from source i (in the first round every source gets its
// request, even for no chunk, and answers it with its table too, read here; later rounds skip
// sources with nothing to fetch). Chunks that fail their check go to failed[i]; each source's word
// on its chunks goes to claims[i] and is checked against its table. Returns the first error, its
// cause rather than the abort it made of the other sources' copies (FetchInPlace).
Status FetchRound(collective::Communicator& comm, state::StateRegistry& reg,
                  std::vector<Offer>& offers, const std::vector<std::vector<uint32_t>>& lists,
                  bool first, int streams_per_source, std::vector<std::vector<uint32_t>>* claims,
                  std::vector<std::vector<uint32_t>>* failed, std::atomic<uint64_t>* bytes,
                  int* most_streams) {
  const size_t k = offers.size();
  std::vector<Status> results(k);
  std::vector<int> streams(k, 0);
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < k; ++i) {
      if (!first && lists[i].empty()) continue;
      threads.emplace_back([&, i] {
        streams[i] = StreamsFor(comm, reg, lists[i], streams_per_source);
        Offer& o = offers[i];
        const CopySeal* seal = o.seal ? &*o.seal : nullptr;
        Status s = FetchInPlace(comm, reg, o.rank, lists[i], streams[i], &(*claims)[i],
                                &(*failed)[i], bytes, RequestSeal{seal, o.requests++});
        if (s.ok() && first) {
          Result<std::vector<uint32_t>> table = RecvTable(comm, reg, o.rank, seal);
          if (table.ok()) offers[i].table = std::move(*table);
          s = table.status();
        }
        if (s.ok()) s = CheckClaims(offers[i].rank, lists[i], (*claims)[i], offers[i].table);
        results[i] = s;
      });
    }
  }
  *most_streams = std::max(*most_streams, *std::max_element(streams.begin(), streams.end()));
  return CauseOf(results);
}

}  // namespace

Status ValidatePlan(const control::PlanMsg& plan, int my_worker_id) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError(
        fmt::format("plan of generation {} is malformed: {}", plan.generation, what));
  };
  if (plan.members.empty()) return bad("it has no members");
  if (plan.resume_step < 0) return bad(fmt::format("resume step {} is negative", plan.resume_step));
  std::set<int> ids;
  for (const auto& m : plan.members) {
    if (m.worker_id < 0) return bad(fmt::format("member worker id {} is negative", m.worker_id));
    if (!ids.insert(m.worker_id).second)
      return bad(fmt::format("worker {} is a member twice", m.worker_id));
    if (!net::ParseHostPort(m.address).ok()) {
      return bad(fmt::format("worker {}'s address '{}' is not host:port", m.worker_id, m.address));
    }
  }
  if (!ids.count(my_worker_id))
    return bad(fmt::format("it does not include this worker ({})", my_worker_id));
  std::set<int> receivers;
  for (const auto& t : plan.transfers) {
    if (!ids.count(t.receiver))
      return bad(fmt::format("receiver worker {} is not a member", t.receiver));
    if (!receivers.insert(t.receiver).second)
      return bad(fmt::format("worker {} receives twice", t.receiver));
    if (t.sources.empty()) return bad(fmt::format("worker {} receives from no source", t.receiver));
    for (int src : t.sources) {
      if (!ids.count(src))
        return bad(fmt::format("source worker {} of receiver {} is not a member", src, t.receiver));
      if (src == t.receiver) return bad(fmt::format("worker {} is its own source", src));
    }
  }
  return ValidateShardMoves(plan, ids, bad);
}

Result<TransferOutcome> RunStateTransfers(collective::Communicator& comm, state::StateRegistry& reg,
                                          const control::PlanMsg& plan, int my_worker_id,
                                          int64_t held_step, const TransferHooks& hooks) {
  TransferOutcome outcome;
  const int64_t step = plan.resume_step - 1;
  std::vector<int> serve_to;    // receiver ranks
  std::vector<int> fetch_from;  // source ranks
  for (const auto& t : plan.transfers) {
    if (t.receiver == my_worker_id) {
      for (int s : t.sources) fetch_from.push_back(RankOf(plan, s));
    } else if (std::find(t.sources.begin(), t.sources.end(), my_worker_id) != t.sources.end()) {
      serve_to.push_back(RankOf(plan, t.receiver));
    }
  }
  if (serve_to.empty() && fetch_from.empty()) return outcome;
  if (hooks.on_start) hooks.on_start();

  if (!serve_to.empty()) {
    outcome.served = true;
    const Status refusal = held_step == step
                               ? OkStatus()
                               : FailedPreconditionError(fmt::format(
                                     "the plan of generation {} asks worker {} to serve the state "
                                     "of step {}, but its state holds step {}: refused",
                                     plan.generation, my_worker_id, step, held_step));
    SourceFaults faults(hooks);
    const SealSpec spec = SealOf(hooks, plan.generation);
    // One receiver: its chunks are checksummed as they go out, the rest meanwhile (Serve).
    // Several (two spares at once): one table for all, computed first, not a pass per receiver.
    const bool shared = refusal.ok() && serve_to.size() > 1;
    const std::vector<uint32_t> table =
        shared ? CrcTable(reg, /*sharded=*/false) : std::vector<uint32_t>{};
    std::vector<Status> results(serve_to.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < serve_to.size(); ++i) {
      threads.emplace_back([&, i] {
        results[i] = refusal.ok()
                         ? Serve(comm, reg, serve_to[i], held_step, shared ? &table : nullptr,
                                 /*sharded=*/false, &faults, spec)
                         : ServeRefusal(comm, reg, serve_to[i], held_step, refusal, spec);
      });
    }
    for (auto& t : threads) t.join();
    for (const Status& s : results) NONSTOP_RETURN_IF_ERROR(s);
    return outcome;
  }

  outcome.received = true;
  // Sharded chunks are this receiver's shard, which ExchangeShards copies
  // from its holders; the plan's sources may hold other shards.
  std::vector<uint32_t> wanted;
  for (uint32_t c = 0; c < reg.num_chunks(); ++c) {
    if (!reg.chunk_sharded(c)) wanted.push_back(c);
  }
  NONSTOP_ASSIGN_OR_RETURN(
      std::vector<Offer> offers,
      GatherOffers(comm, reg, plan, step, fetch_from, SealOf(hooks, plan.generation)));
  const size_t k = offers.size();
  outcome.sources = static_cast<int>(k);
  // Striped: chunk i from source i mod k, all at once; each source's table follows its chunks.
  std::vector<std::vector<uint32_t>> assigned(k);
  // Per-rank chunks from the first source alone (MajorityOf): each such region is one source's.
  for (size_t i = 0; i < wanted.size(); ++i)
    assigned[reg.chunk_per_rank(wanted[i]) ? 0 : i % k].push_back(wanted[i]);
  std::vector<std::vector<uint32_t>> failed(k);
  std::vector<std::vector<uint32_t>> claims(k, std::vector<uint32_t>(reg.num_chunks(), 0));
  std::atomic<uint64_t> bytes{0};
  // Every source has a request from here on. On a failure each is told it is done (best effort:
  // one that has sent all it was asked returns at once) and this worker's communicator is
  // aborted, which stops what of the copy still runs here.
  std::vector<int> from;  // the sources' ranks
  for (const Offer& o : offers) from.push_back(o.rank);
  auto fail = [&](const Status& s) {
    // What landed is a mix of sources: the state holds no valid step (the session's mark), nor
    // a valid shard.
    if (reg.shard_group() > 0) reg.set_held_shard(state::kNoShard);
    (void)TellDone(comm, from);
    comm.Abort(
        fmt::format("the state copy of generation {} failed: {}", plan.generation, s.message()));
    return s;
  };
  if (Status s = FetchRound(comm, reg, offers, assigned, /*first=*/true, hooks.streams_per_source,
                            &claims, &failed, &bytes, &outcome.streams_per_source);
      !s.ok()) {
    return fail(s);
  }
  const Result<Expected> majority = MajorityOf(reg, offers, wanted, plan);
  if (!majority.ok()) return fail(majority.status());
  const Expected& expected = *majority;
  // Fetched again, from the next source whose table agrees with the majority (a round per
  // attempt, each source's share in one request): the chunks that failed their check, and those
  // whose source's table is not the majority's (their bytes are that source's, outvoted).
  std::map<uint32_t, size_t> pending;  // chunk → the source it came from first
  for (size_t i = 0; i < k; ++i) {
    for (uint32_t c : assigned[i]) {
      if (!expected.agrees[i][c]) pending[c] = i;
    }
    for (uint32_t c : failed[i]) pending[c] = i;
  }
  for (size_t attempt = 1; attempt <= k && !pending.empty(); ++attempt) {
    std::vector<std::vector<uint32_t>> lists(k), again(k);
    for (const auto& [c, from] : pending) {
      const size_t to = (from + attempt) % k;
      if (expected.agrees[to][c]) lists[to].push_back(c);
    }
    if (Status s = FetchRound(comm, reg, offers, lists, /*first=*/false, hooks.streams_per_source,
                              &claims, &again, &bytes, &outcome.streams_per_source);
        !s.ok()) {
      return fail(s);
    }
    for (size_t to = 0; to < k; ++to) {
      outcome.refetched_chunks += static_cast<int>(lists[to].size());
      const std::set<uint32_t> bad(again[to].begin(), again[to].end());
      for (uint32_t c : lists[to]) {
        if (!bad.count(c)) pending.erase(c);
      }
    }
  }
  if (!pending.empty()) {
    return fail(DataLossError(fmt::format("state chunk {} failed its checksum from every source",
                                          pending.begin()->first)));
  }
  NONSTOP_RETURN_IF_ERROR(TellDone(comm, from));
  outcome.bytes_received = bytes.load();
  // The rest of the state is of the newer step now, the shards it holds are not.
  if (reg.shard_group() > 0) reg.set_held_shard(state::kNoShard);
  return outcome;
}

bool IsDisagreement(const Status& s) {
  return s.code() == StatusCode::kDataLoss &&
         (s.message().find(kShardDisagreement) != std::string_view::npos ||
          s.message().find(kReplicaDisagreement) != std::string_view::npos);
}

}  // namespace nonstop::worker
