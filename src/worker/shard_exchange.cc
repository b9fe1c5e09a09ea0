// The shard exchange (ExchangeShards, state_transfer.h): members re-shard sharded optimizer state
// peer to peer after a plan, over the state copy's wire (copy_wire.h).
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

// What one member tells the others before re-sharding (24 bytes): the
// digest is ShardDigest of the one shard it holds (0 for none or every).
struct ShardRecord {
  int group = 0;
  int held = state::kNoShard;
  int64_t step = control::kNoValidState;
  uint32_t digest = 0;
};
constexpr size_t kShardRecordBytes = 24;

std::string EncodeShardRecord(const ShardRecord& r) {
  std::string out;
  PutFixed32(&out, static_cast<uint32_t>(r.group));
  PutFixed32(&out, static_cast<uint32_t>(r.held));
  PutFixed64(&out, static_cast<uint64_t>(r.step));
  PutFixed32(&out, r.digest);
  PutFixed32(&out, 0);
  return out;
}

ShardRecord DecodeShardRecord(const std::byte* p) {
  const char* c = reinterpret_cast<const char*>(p);
  return {static_cast<int>(static_cast<int32_t>(DecodeFixed32(c))),
          static_cast<int32_t>(DecodeFixed32(c + 4)), static_cast<int64_t>(DecodeFixed64(c + 8)),
          DecodeFixed32(c + 16)};
}

// A shard's digest: the CRC-32C of its chunks' CRCs, in chunk order (a
// CrcTable of the shard's chunks, 0 elsewhere). A holder computes it from
// the table it serves from; a receiver from the checked CRCs of what it staged.
uint32_t ShardDigest(std::span<const uint32_t> table) {
  std::string bytes;
  for (uint32_t crc : table) PutFixed32(&bytes, crc);  // the wire's byte order, not the host's
  return Crc32c(bytes);
}

// What every member says its sharded state holds, by rank.
struct Holdings {
  std::vector<int> held;          // a shard, kEveryShard or kNoShard
  std::vector<int64_t> steps;     // of which step
  std::vector<uint32_t> digests;  // ShardDigest of the one shard held

  bool Holds(int q, int shard, int64_t step) const {
    const int h = held[static_cast<size_t>(q)];
    return steps[static_cast<size_t>(q)] == step && (h == shard || h == state::kEveryShard);
  }
  std::string Describe(int q) const {
    const int h = held[static_cast<size_t>(q)];
    const int64_t s = steps[static_cast<size_t>(q)];
    if (h == state::kNoShard) return fmt::format("no shard (its state is of step {})", s);
    if (h == state::kEveryShard) return fmt::format("every shard of step {}", s);
    return fmt::format("shard {} of step {}", h, s);
  }
};

// All-gathers (group size, held shard, step, digest of the held shard) of every member. Not to
// plan: to check the plan's moves against what each member says it holds, the same claims on every
// member.
Result<Holdings> GatherHoldings(collective::Communicator& comm, int group, int held,
                                int64_t held_step, uint32_t digest) {
  constexpr size_t kRecord = kShardRecordBytes;
  std::vector<std::byte> records(kRecord * static_cast<size_t>(comm.world_size()));
  std::string mine = EncodeShardRecord({group, held, held_step, digest});
  std::memcpy(records.data() + kRecord * static_cast<size_t>(comm.rank()), mine.data(), kRecord);
  NONSTOP_RETURN_IF_ERROR(comm.AllGather(records, kRecord));
  Holdings out;
  out.held.resize(static_cast<size_t>(comm.world_size()));
  out.steps.resize(out.held.size());
  out.digests.resize(out.held.size());
  for (size_t q = 0; q < out.held.size(); ++q) {
    ShardRecord r = DecodeShardRecord(records.data() + kRecord * q);
    if (r.group != group) {
      return InvalidArgumentError(
          fmt::format("rank {} shards its optimizer state over groups of {}, this worker over "
                      "groups of {}: every worker must run the same optimizer.shard_group",
                      q, r.group, group));
    }
    if (r.held < state::kNoShard || r.held >= group) {
      return DataLossError(
          fmt::format("rank {} claims to hold shard {} of groups of {}", q, r.held, group));
    }
    out.held[q] = r.held;
    out.steps[q] = r.step;
    out.digests[q] = r.digest;
  }
  return out;
}

// The plan's shard moves, by rank.
struct RankedMoves {
  std::vector<int> receivers;  // ranks, in the plan's order
  // index = rank: the ranks of its sources, in the plan's order
  std::vector<std::vector<int>> sources;
};

// Checks the plan's shard moves against every member's claims and returns
// them by rank. The plan is the controller's decision, made from the joins
// and Readies; the claims are what the members hold now. Where they differ,
// copying would put wrong state live, so the generation fails instead.
Result<RankedMoves> CheckShardMoves(const control::PlanMsg& plan, const state::ShardLayout& layout,
                                    const Holdings& holdings, int64_t step) {
  auto disagree = [&](const std::string& what) {
    return FailedPreconditionError(fmt::format(
        "the shard moves of the plan of generation {} disagree with what the members hold: {}",
        plan.generation, what));
  };
  const int group = layout.group_size;
  if (plan.shard_group != group) {
    return InvalidArgumentError(
        fmt::format("the plan of generation {} shards the optimizer state over groups of {}, "
                    "this worker over groups of {}: every worker must run the same "
                    "optimizer.shard_group",
                    plan.generation, plan.shard_group, group));
  }
  if (plan.members.size() != static_cast<size_t>(layout.world())) {
    return InternalError(
        fmt::format("plan of {} members for a world of {}", plan.members.size(), layout.world()));
  }
  RankedMoves out;
  out.sources.resize(plan.members.size());
  std::vector<char> moved(plan.members.size(), 0);
  std::vector<int> lost;
  for (const control::PlanShardMove& m : plan.shard_moves) {
    const int r = RankOf(plan, m.receiver);
    if (r < 0 || moved[static_cast<size_t>(r)]) {
      return disagree(fmt::format("worker {} is no member, or receives twice", m.receiver));
    }
    const int need = layout.shard_of_rank[static_cast<size_t>(r)];
    if (m.shard != need) {
      return disagree(
          fmt::format("{} is to receive shard {}, but its rank holds shard {} (rank mod {})",
                      SourceName(plan, r), m.shard, need, group));
    }
    if (holdings.Holds(r, need, step)) {
      return disagree(fmt::format("{} is to receive shard {} of step {}, which it holds already",
                                  SourceName(plan, r), need, step));
    }
    moved[static_cast<size_t>(r)] = 1;
    out.receivers.push_back(r);
    for (int id : m.sources) {
      const int q = RankOf(plan, id);
      if (q < 0 || q == r)
        return disagree(fmt::format("worker {} is no source for {}", id, SourceName(plan, r)));
      if (!holdings.Holds(q, need, step)) {
        return disagree(fmt::format("{} is to serve shard {} of step {} to {}, but it holds {}",
                                    SourceName(plan, q), need, step, SourceName(plan, r),
                                    holdings.Describe(q)));
      }
      out.sources[static_cast<size_t>(r)].push_back(q);
    }
    if (m.sources.empty()) lost.push_back(need);
  }
  for (int r = 0; r < layout.world(); ++r) {
    const int need = layout.shard_of_rank[static_cast<size_t>(r)];
    if (!moved[static_cast<size_t>(r)] && !holdings.Holds(r, need, step)) {
      return disagree(fmt::format(
          "{} holds {}, not shard {} of step {} (its rank's), and the plan moves nothing to "
          "it",
          SourceName(plan, r), holdings.Describe(r), need, step));
    }
  }
  // the controller planned it so (a shard its releases left nobody): every member says it
  if (!lost.empty()) {
    std::sort(lost.begin(), lost.end());
    lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
    return DataLossError(
        fmt::format("every copy of shard {} of the optimizer state of step {} is lost: no member "
                    "holds it",
                    fmt::join(lost, ", "), step));
  }
  return out;
}

// One member's part of the moves: with each peer, serve it, fetch from it,
// or both (two members swapping shards).
struct PeerWork {
  bool serve = false;  // it is a receiver, and this member one of its sources
  // it is one of this member's sources: header, request, the chunks (maybe none), table, done
  bool fetch = false;
  std::vector<uint32_t> chunks;  // what this member fetches from it
};

std::map<int, PeerWork> PeersOf(const RankedMoves& moves, int me,
                                const std::vector<uint32_t>& sharded) {
  std::map<int, PeerWork> peers;  // rank → the work with it
  const std::vector<int>& mine = moves.sources[static_cast<size_t>(me)];
  if (!mine.empty()) {  // a receiver (CheckShardMoves refused one without sources)
    // Striped: chunk i from the i-th source modulo their count, in the plan's order.
    for (int q : mine) peers[q].fetch = true;
    for (size_t i = 0; i < sharded.size(); ++i)
      peers[mine[i % mine.size()]].chunks.push_back(sharded[i]);
  }
  for (int r : moves.receivers) {
    const auto& src = moves.sources[static_cast<size_t>(r)];
    if (std::find(src.begin(), src.end(), me) != src.end()) peers[r].serve = true;
  }
  return peers;
}

// The digest of each shard moved that its holders' majority has.
using ShardDigests = std::map<int, uint32_t>;

// The holders of a shard are its witnesses, as the replicas are for the
// replicated state: for each shard moved, the digest more than half of its
// holders of `step` have is the shard's, a holder with another one serves
// nobody (it is taken off every receiver's sources: every member drops the
// same ones, from the same claims), and a shard whose holders have no
// majority (two that differ) is not copied at all. Returns the shard → its
// majority digest, for the receivers' check of what they staged. A member
// holding every shard (the initial state) is no witness and stays a source.
Result<ShardDigests> TrustTheMajority(const Holdings& holdings, int64_t step,
                                      const state::ShardLayout& layout, int me,
                                      RankedMoves* moves) {
  ShardDigests majority;
  for (int receiver : moves->receivers) {
    const int shard = layout.shard_of_rank[static_cast<size_t>(receiver)];
    if (majority.count(shard)) continue;
    std::map<uint32_t, int> votes;
    int holders = 0;
    for (size_t q = 0; q < holdings.held.size(); ++q) {
      if (holdings.held[q] != shard || holdings.steps[q] != step) continue;
      ++votes[holdings.digests[q]];
      ++holders;
    }
    if (holders == 0) continue;  // served by members holding every shard
    auto best = std::max_element(votes.begin(), votes.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    if (2 * best->second <= holders) {
      std::string who;
      for (size_t q = 0; q < holdings.held.size(); ++q) {
        if (holdings.held[q] == shard && holdings.steps[q] == step)
          who += fmt::format("{}rank {} {:08x}", who.empty() ? "" : ", ", q, holdings.digests[q]);
      }
      return DataLossError(fmt::format(
          "{} {} of step {} disagree and no majority can tell which is right ({}): it is not "
          "copied",
          kShardDisagreement, shard, step, who));
    }
    majority[shard] = best->first;
  }
  for (int receiver : moves->receivers) {
    const int shard = layout.shard_of_rank[static_cast<size_t>(receiver)];
    auto it = majority.find(shard);
    if (it == majority.end()) continue;
    std::vector<int>& sources = moves->sources[static_cast<size_t>(receiver)];
    std::vector<int> trusted;
    for (int q : sources) {
      // With witnesses to check against, a member holding every shard (unchecked) serves nobody.
      if (holdings.held[static_cast<size_t>(q)] != shard) continue;
      if (holdings.digests[static_cast<size_t>(q)] != it->second) {
        if (me == receiver)
          NONSTOP_LOG_WARNING(
              "rank {}'s shard {} of step {} (digest {:08x}) differs from the majority of its "
              "holders ({:08x}): rank {} copies it from the others",
              q, shard, step, holdings.digests[static_cast<size_t>(q)], it->second, receiver);
        continue;
      }
      trusted.push_back(q);
    }
    if (trusted.empty()) {
      return DataLossError(fmt::format(
          "{} {} of step {} that the plan names as rank {}'s sources all differ from the "
          "majority of its holders: it is not copied",
          kShardDisagreement, shard, step, receiver));
    }
    sources = std::move(trusted);
  }
  return majority;
}

// Fetched shard chunks, held back until the commit: a member keeps serving
// the shard it holds while it fetches the one it will hold.
struct Staging {
  std::map<uint32_t, std::pair<size_t, uint32_t>> where;  // chunk → (offset in bytes, crc)
  std::vector<std::byte> bytes;

  Staging(const state::StateRegistry& reg, const std::vector<uint32_t>& chunks) {
    size_t size = 0;
    for (uint32_t c : chunks) {
      where[c] = {size, 0};
      size += reg.chunk_size(c);
    }
    bytes.resize(size);
  }
  Status Put(uint32_t index, std::span<const std::byte> data, uint32_t crc) {
    if (Crc32c(data.data(), data.size()) != crc)
      return DataLossError(fmt::format("state chunk {} fails its checksum", index));
    auto& [offset, kept_crc] = where.at(index);  // every index was asked for: it is there
    std::memcpy(bytes.data() + offset, data.data(), data.size());
    kept_crc = crc;
    return OkStatus();
  }
};

// A receiver's last word before anything is committed: what it staged has
// the digest the majority of the shard's holders have.
Status CheckStaged(const Staging& staging, const state::StateRegistry& reg, int shard, int64_t step,
                   const ShardDigests& majority) {
  auto it = majority.find(shard);
  if (it == majority.end()) return OkStatus();  // from members holding every shard
  std::vector<uint32_t> table(reg.num_chunks(), 0);
  for (const auto& [index, where] : staging.where) table[index] = where.second;
  const uint32_t staged = ShardDigest(table);
  if (staged == it->second) return OkStatus();
  return DataLossError(fmt::format(
      "shard {} of step {} as copied (digest {:08x}) differs from its holders' majority ({:08x})",
      shard, step, staged, it->second));
}

// This member's side of the moves with every peer at once, one thread each.
Status MoveWithPeers(collective::Communicator& comm, state::StateRegistry& reg,
                     const state::ShardLayout& layout, const std::map<int, PeerWork>& peers,
                     int64_t step, int64_t held_step, bool every,
                     const std::vector<uint32_t>& held_table, const TransferHooks& hooks,
                     SealSpec spec, Staging* staging, TransferOutcome* outcome) {
  const int me = comm.rank();
  const int need = layout.shard_of_rank[static_cast<size_t>(me)];
  const ChunkSink into_staging = [staging](uint32_t index, std::span<const std::byte> data,
                                           uint32_t crc) { return staging->Put(index, data, crc); };
  SourceFaults faults(hooks);
  std::atomic<uint64_t> bytes{0};
  std::atomic<int> refetched{0};
  // The CRC tables it serves, each computed once: of its held shard, or of
  // each receiver's shard when it holds every shard.
  std::map<int, std::vector<uint32_t>> tables;  // shard served (-1: the held one) → table
  for (const auto& [peer, work] : peers) {
    if (!work.serve) continue;
    const int shard = every ? layout.shard_of_rank[static_cast<size_t>(peer)] : -1;
    if (tables.count(shard)) continue;
    tables[shard] =
        shard == -1 && !held_table.empty() ? held_table : CrcTable(reg, /*sharded=*/true, shard);
  }
  std::vector<int> order;  // the peers, a thread each
  for (const auto& [peer, work] : peers) order.push_back(peer);
  std::vector<Status> results(order.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] {
      const int peer = order[i];
      const PeerWork& work = peers.at(peer);
      auto do_serve = [&]() -> Status {
        if (!work.serve) return OkStatus();
        const int shard = every ? layout.shard_of_rank[static_cast<size_t>(peer)] : -1;
        return Serve(comm, reg, peer, held_step, &tables.at(shard), /*sharded=*/true, &faults, spec,
                     shard);
      };
      auto do_fetch = [&]() -> Status {
        if (!work.fetch) return OkStatus();
        std::string header(kHeaderBytes, '\0');
        NONSTOP_RETURN_IF_ERROR(comm.Recv(peer, std::as_writable_bytes(std::span(header))));
        // The existing check stays: a source's header must name this group size and the shard asked
        // for.
        NONSTOP_ASSIGN_OR_RETURN(const Header h,
                                 CheckHeader(header, step, reg, fmt::format("rank {}", peer),
                                             spec.key != nullptr, need));
        std::optional<CopySeal> sealed;
        if (spec.key != nullptr)
          sealed.emplace(*spec.key, "shard", spec.generation, peer, me, h.sealed);
        const CopySeal* seal = sealed ? &*sealed : nullptr;
        std::vector<uint32_t> claims(reg.num_chunks(), 0);
        std::vector<uint32_t> failed;
        NONSTOP_RETURN_IF_ERROR(Fetch(comm, reg, peer, work.chunks, &claims, &failed, &bytes,
                                      into_staging, RequestSeal{seal, 0}));
        NONSTOP_ASSIGN_OR_RETURN(std::vector<uint32_t> table, RecvTable(comm, reg, peer, seal));
        NONSTOP_RETURN_IF_ERROR(CheckClaims(peer, work.chunks, claims, table));
        if (!failed.empty()) {  // once more from the same holder: a chunk damaged on the way
          refetched += static_cast<int>(failed.size());
          std::vector<uint32_t> again;
          NONSTOP_RETURN_IF_ERROR(Fetch(comm, reg, peer, failed, &claims, &again, &bytes,
                                        into_staging, RequestSeal{seal, 1}));
          NONSTOP_RETURN_IF_ERROR(CheckClaims(peer, failed, claims, table));
          if (!again.empty()) {
            return DataLossError(
                fmt::format("state chunk {} of shard {} failed its checksum twice from rank {}",
                            again.front(), need, peer));
          }
        }
        return SendU32s(comm, peer, {});
      };
      // The lower rank serves first, the higher fetches first: two members
      // that swap shards never both wait for a request.
      Status s = me < peer ? do_serve() : do_fetch();
      if (s.ok()) s = me < peer ? do_fetch() : do_serve();
      // A failure ends this member's exchanges with every peer at once (its other threads stop
      // instead of serving or fetching what no one will commit).
      if (!s.ok() && s.code() != StatusCode::kAborted) {
        comm.Abort(fmt::format("the shard exchange with rank {} failed: {}", peer, s.message()));
      }
      results[i] = s;
    });
  }
  for (auto& t : threads) t.join();
  // The cause, not the abort it made of the exchanges with the other peers.
  NONSTOP_RETURN_IF_ERROR(CauseOf(results));
  outcome->served =
      std::any_of(peers.begin(), peers.end(), [](const auto& p) { return p.second.serve; });
  outcome->bytes_received = bytes.load();
  outcome->refetched_chunks = refetched.load();
  return OkStatus();
}

}  // namespace

Result<TransferOutcome> ExchangeShards(collective::Communicator& comm, state::StateRegistry& reg,
                                       const control::PlanMsg& plan, int64_t held_step,
                                       const TransferHooks& hooks) {
  TransferOutcome outcome;
  const int group = reg.shard_group();
  if (group == 0) {
    if (plan.shard_group == 0 && plan.shard_moves.empty()) return outcome;
    return InvalidArgumentError(
        fmt::format("the plan of generation {} shards the optimizer state over groups of {}, "
                    "this worker's state is not sharded",
                    plan.generation, plan.shard_group));
  }
  const int64_t step = plan.resume_step - 1;
  NONSTOP_ASSIGN_OR_RETURN(state::ShardLayout layout, state::LayoutOf(comm.world_size(), group));
  const int me = comm.rank();
  const int need = layout.shard_of_rank[static_cast<size_t>(me)];
  // A state of another step holds no shard of this one. A member holding
  // every shard (the initial state, or whole buffers behind every view) says
  // so, serves each receiver its shard, and binds its own at the end.
  if (held_step != step && reg.held_shard() != state::kNoShard) reg.set_held_shard(state::kNoShard);
  // The initial state (no step done: zero moments, the seeded parameters
  // whole) is every shard's, whichever one the views were bound to since.
  if (held_step == -1 && step == -1) reg.set_held_shard(state::kEveryShard);
  const bool every = reg.held_shard() == state::kEveryShard;

  // The table it serves its shard from, computed once: its digest is its word on what it holds.
  // Only a shard that moves is compared: the others cost no CRC pass.
  std::vector<uint32_t> held_table;
  const bool single = reg.held_shard() >= 0 && held_step == step &&
                      std::any_of(plan.shard_moves.begin(), plan.shard_moves.end(),
                                  [&](const auto& m) { return m.shard == reg.held_shard(); });
  if (single) held_table = CrcTable(reg, /*sharded=*/true);
  NONSTOP_ASSIGN_OR_RETURN(Holdings holdings,
                           GatherHoldings(comm, group, reg.held_shard(), held_step,
                                          single ? ShardDigest(held_table) : 0));
  NONSTOP_ASSIGN_OR_RETURN(RankedMoves moves, CheckShardMoves(plan, layout, holdings, step));
  NONSTOP_ASSIGN_OR_RETURN(ShardDigests majority,
                           TrustTheMajority(holdings, step, layout, me, &moves));
  if (moves.receivers.empty()) {
    if (every) NONSTOP_RETURN_IF_ERROR(reg.BindShard(need));
    return outcome;
  }

  std::vector<uint32_t> sharded;
  for (uint32_t c = 0; c < reg.num_chunks(); ++c) {
    if (reg.chunk_sharded(c)) sharded.push_back(c);
  }
  const std::map<int, PeerWork> peers = PeersOf(moves, me, sharded);
  const bool receiving =
      std::find(moves.receivers.begin(), moves.receivers.end(), me) != moves.receivers.end();
  if (!peers.empty() && hooks.on_start) hooks.on_start();
  Staging staging(reg, receiving ? sharded : std::vector<uint32_t>{});
  NONSTOP_RETURN_IF_ERROR(MoveWithPeers(comm, reg, layout, peers, step, held_step, every,
                                        held_table, hooks, SealOf(hooks, plan.generation), &staging,
                                        &outcome));
  if (receiving) NONSTOP_RETURN_IF_ERROR(CheckStaged(staging, reg, need, step, majority));
  // Nobody commits before everybody has staged: a receiver's commit
  // overwrites the shard it held, which may be the last copy of it if a
  // holder that serves it dies now. After the barrier every member has its
  // new shard staged. (Two faults inside the barrier's own round trip can
  // still leave a mix of committed and uncommitted members: docs/sharding.md.)
  NONSTOP_RETURN_IF_ERROR(comm.Barrier());
  // it served every receiver from its whole buffers
  if (every) NONSTOP_RETURN_IF_ERROR(reg.BindShard(need));
  if (!receiving) return outcome;
  // Commit: the views move to the new shard, then the checked bytes go in.
  NONSTOP_RETURN_IF_ERROR(reg.BindShard(need));
  for (const auto& [index, where] : staging.where) {
    NONSTOP_RETURN_IF_ERROR(reg.WriteChunk(
        index, std::span(staging.bytes).subspan(where.first, reg.chunk_size(index)), where.second));
  }
  outcome.received = true;
  outcome.sources = static_cast<int>(moves.sources[static_cast<size_t>(me)].size());
  return outcome;
}

}  // namespace nonstop::worker
