#include "controller/planner.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <string_view>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "nonstop/state.h"
#include "state/shard_layout.h"

namespace nonstop::controller {

namespace {

using Verdict = NextGeneration::Verdict;

// The workers a plan may hold, by candidate index: a member of the
// generation that ends (index = its rank) or a promotable spare (index =
// members.size() + its index in view.spares). The helpers below work on
// candidate indices, so that nothing is looked up by worker id.
class Candidates {
 public:
  explicit Candidates(const PlanInput& view) : view_(view), members_(view.members.size()) {}
  size_t members() const { return members_; }
  size_t spares() const { return view_.spares.size(); }
  int id(size_t c) const {
    return c < members_ ? view_.members[c].worker_id : view_.spares[c - members_].worker_id;
  }
  const std::string& host(size_t c) const {
    return c < members_ ? view_.members[c].host : view_.spares[c - members_].host;
  }
  // Its rank in the generation that ends (-1: a spare).
  int rank(size_t c) const { return c < members_ ? static_cast<int>(c) : -1; }
  // The step its state holds: a survivor's Ready, or the initial state (a spare).
  int64_t step(size_t c) const { return c < members_ ? view_.members[c].step : -1; }
  int held_shard(size_t c) const {
    return c < members_ ? view_.members[c].held_shard : state::kNoShard;
  }
  std::vector<int> ids(const std::vector<size_t>& cs) const {
    std::vector<int> out;
    out.reserve(cs.size());
    for (size_t c : cs) out.push_back(id(c));
    return out;
  }

 private:
  const PlanInput& view_;
  const size_t members_;
};

// Orders state sources so that consecutive ones sit on different hosts.
std::vector<size_t> SpreadOverHosts(const Candidates& w, const std::vector<size_t>& holders) {
  // One queue per host, in the order the hosts first appear among the holders;
  // then rounds that take the next holder of every host that has one left.
  std::unordered_map<std::string_view, size_t> index;
  std::vector<std::vector<size_t>> queues;
  for (size_t c : holders) {
    auto [it, fresh] = index.try_emplace(w.host(c), queues.size());
    if (fresh) queues.emplace_back();
    queues[it->second].push_back(c);
  }
  std::vector<size_t> out;
  out.reserve(holders.size());
  std::vector<size_t> active(queues.size());
  for (size_t q = 0; q < queues.size(); ++q) active[q] = q;
  for (size_t round = 0; !active.empty(); ++round) {
    size_t kept = 0;
    for (size_t q : active) {
      out.push_back(queues[q][round]);
      if (round + 1 < queues[q].size()) active[kept++] = q;
    }
    active.resize(kept);
  }
  return out;
}

// Sharded optimizer state (docs/sharding.md): the shards of which none of
// `holders` holds a copy, ascending; empty when nothing is sharded.
std::vector<int> LostShards(const Candidates& w, const std::vector<size_t>& holders,
                            int shard_group) {
  if (shard_group <= 1) return {};
  std::vector<char> held(static_cast<size_t>(shard_group), 0);
  for (size_t c : holders) {
    int s = w.held_shard(c);
    if (s == state::kEveryShard) return {};  // the initial state, or whole buffers: every shard
    if (s >= 0 && s < shard_group) held[static_cast<size_t>(s)] = 1;
  }
  std::vector<int> lost;
  for (int s = 0; s < shard_group; ++s) {
    if (!held[static_cast<size_t>(s)]) lost.push_back(s);
  }
  return lost;
}

// Takes `count` candidates off the end of `next` (the highest ranks first),
// skipping a holder of a shard no candidate that stays would hold: the
// released ones leave, so they cannot serve their shard. Returns them.
std::vector<size_t> ReleaseFromTheEnd(const Candidates& w, std::vector<size_t>* next, size_t count,
                                      const std::vector<size_t>& holders, int shard_group) {
  std::vector<char> holding(w.members(), 0);  // by rank
  for (size_t c : holders) holding[c] = 1;
  auto shard_of = [&](size_t c) {
    return c < w.members() && holding[c] ? w.held_shard(c) : state::kNoShard;
  };
  std::map<int, int> copies;  // shard → holders of it that stay
  for (size_t c : *next) copies[shard_of(c)]++;
  std::vector<size_t> released;
  for (size_t i = next->size(); i-- > 0 && released.size() < count;) {
    size_t c = (*next)[i];
    int s = shard_of(c);
    // the last holder of its shard stays
    if (shard_group > 1 && s >= 0 && copies[s] == 1) continue;
    copies[s]--;
    released.push_back(c);
    next->erase(next->begin() + static_cast<std::ptrdiff_t>(i));
  }
  // Nothing more can go without losing a shard: the highest ranks go anyway (the exchange then
  // names the shard).
  while (released.size() < count && !next->empty()) {
    released.push_back(next->back());
    next->pop_back();
  }
  return released;
}

// Orders the spares for a plan: those on hosts that just failed last.
void OrderSpares(const Candidates& w, std::vector<size_t>* spares,
                 const std::set<std::string>& failed_hosts) {
  std::stable_sort(spares->begin(), spares->end(), [&](size_t a, size_t b) {
    return failed_hosts.count(w.host(a)) < failed_hosts.count(w.host(b));
  });
}

// Moves to spares[first] the first spare from there on whose host holds no
// surviving replica of the shard of `rank` (sharded state): a spare beside
// a replica would put two copies of a shard on one host. On one host no
// spare is away from the replicas: the first stays first.
// host_at: by rank, the host of the member that holds it next ("" : not known yet).
void PreferSpareAwayFromReplicas(const Candidates& w, const PlanInput& view,
                                 std::vector<size_t>* spares, size_t first, size_t rank,
                                 const std::vector<std::string_view>& host_at) {
  if (view.shard_group <= 1) return;
  const auto g = static_cast<size_t>(view.shard_group);
  // where the other copies of this rank's shard are (or go)
  std::set<std::string_view> replica_hosts;
  for (size_t q = rank % g; q < host_at.size(); q += g) {
    if (q != rank && !host_at[q].empty()) replica_hosts.insert(host_at[q]);
  }
  // Not on a host that just failed either (OrderSpares put those last).
  auto away = std::find_if(spares->begin() + static_cast<std::ptrdiff_t>(first), spares->end(),
                           [&](size_t c) {
                             const std::string& host = w.host(c);
                             return !replica_hosts.count(host) && !view.failed_hosts.count(host);
                           });
  if (away != spares->end())
    std::rotate(spares->begin() + static_cast<std::ptrdiff_t>(first), away, away + 1);
}

// The plan as it is built: candidates by rank, the spares in the order they
// are promoted, and the state sources.
struct Draft {
  std::vector<char> survived;   // by rank
  size_t alive = 0;             // survivors
  std::vector<size_t> holders;  // candidates, spread over hosts
  std::vector<size_t> spares;   // candidates, in the order they are promoted
  size_t spare_i = 0;           // spares[0 .. spare_i) are promoted
  std::vector<size_t> next;     // candidates, index = rank in g+1
  std::vector<size_t> released;
};

// Survivors, s*, holders; the verdict when no survivor holds the state.
void FindHolders(const Candidates& w, const PlanInput& view, Draft* d, NextGeneration* out) {
  const size_t m = view.members.size();
  d->survived.assign(m, 0);
  int64_t s_star = -1;
  for (size_t r = 0; r < m; ++r) {
    const PlanInput::Member& member = view.members[r];
    if (!member.alive || !member.ready) continue;
    d->survived[r] = 1;
    ++d->alive;
    s_star = std::max(s_star, member.step);
  }
  for (size_t r = 0; r < m; ++r) {
    if (d->survived[r] && view.members[r].step == s_star) d->holders.push_back(r);
  }
  d->holders = SpreadOverHosts(w, d->holders);
  out->s_star = s_star;
  // The initial state (step -1) is the same everywhere (seeded), so anyone holds it.
  const bool state_everywhere = s_star == -1 && view.highest_step < 0;
  if (d->holders.empty() && !state_everywhere) {
    const int64_t step = std::max(s_star, view.highest_step);
    if (view.have_checkpoints) {
      out->verdict = Verdict::kRestart;
      out->why = fmt::format("the state of step {} exists on no live worker", step);
    } else {
      out->verdict = Verdict::kFail;
      out->why = fmt::format(
          "the state of step {} exists on no live worker (every member that held it is gone); "
          "without a durable checkpoint (nonstop run --checkpoint-dir) the job cannot continue",
          step);
    }
    return;
  }
  if (state_everywhere) return;
  out->lost_shards = LostShards(w, d->holders, view.shard_group);
  if (out->lost_shards.empty()) return;
  // Sharded state: the step's parameters and moments of these shards are on
  // no live member (every replica was hit). Never a plan that cannot load.
  std::string what = fmt::format(
      "every copy of shard {} of the optimizer state of step {} is lost (optimizer."
      "shard_group {}: every replica of it was hit)",
      fmt::join(out->lost_shards, ", "), s_star, view.shard_group);
  if (view.have_checkpoints) {
    out->verdict = Verdict::kRestart;
    out->why = std::move(what);
  } else {
    out->verdict = Verdict::kFail;
    out->why =
        what +
        "; without a durable checkpoint (nonstop run --checkpoint-dir) the job cannot continue";
  }
}

// Survivors keep their ranks; a spare takes each lost rank while there is one
// (sharded state: within whole groups), or the rank goes (a shrink).
void ReplaceLostRanks(const Candidates& w, const PlanInput& view, Draft* d, NextGeneration* out) {
  const size_t m = view.members.size();
  for (size_t i = 0; i < w.spares(); ++i) d->spares.push_back(m + i);
  OrderSpares(w, &d->spares, view.failed_hosts);
  // Sharded state needs whole groups: no more spares than make the world a
  // multiple of G (the members beyond it would be released again below).
  size_t spare_cap = d->spares.size();
  if (view.shard_group > 1 && !view.resize) {
    const auto g = static_cast<size_t>(view.shard_group);
    const size_t reach = d->alive + std::min(m - d->alive, d->spares.size());
    spare_cap = reach / g * g > d->alive ? reach / g * g - d->alive : 0;
  }
  std::vector<std::string_view> host_at(m);  // the host of whoever holds each rank next
  for (size_t r = 0; r < m; ++r) {
    if (d->survived[r]) host_at[r] = w.host(r);
  }
  for (size_t r = 0; r < m; ++r) {
    const int id = w.id(r);
    if (d->survived[r]) {
      d->next.push_back(r);
    } else if (d->spare_i < std::min(d->spares.size(), spare_cap) &&
               // a leaving host's rank goes with it
               !(view.resize && view.resize->release.count(id))) {
      PreferSpareAwayFromReplicas(w, view, &d->spares, d->spare_i, r, host_at);
      const size_t s = d->spares[d->spare_i++];
      host_at[r] = w.host(s);
      d->next.push_back(s);
      out->replacements.push_back(
          fmt::format("rank {}: worker {} → spare worker {}", r, id, w.id(s)));
    } else {
      out->replacements.push_back(fmt::format("rank {}: worker {} → none (shrink)", r, id));
    }
  }
}

// Members of leaving hosts: released by name, the others keep their order;
// or all stay, when the world without them is not allowed or they alone hold
// some state. Returns the size the resize goes to.
size_t ReleaseLeaving(const Candidates& w, const PlanInput& view, const PlanPolicy& policy,
                      Draft* d, NextGeneration* out) {
  const std::map<int, std::string>& release = view.resize->release;
  size_t want = static_cast<size_t>(view.resize->to);
  std::vector<size_t> kept;
  for (size_t c : d->next) {
    if (!release.count(w.id(c))) kept.push_back(c);
  }
  std::vector<size_t> staying;  // state for any spare that joins comes from members that stay
  for (size_t c : d->holders) {
    if (!release.count(w.id(c))) staying.push_back(c);
  }
  // Sharded: only leaving members hold some shard.
  if (!LostShards(w, staying, view.shard_group).empty()) staying.clear();
  // Checked again at the boundary: a spare counted on may have died
  // during the drain, and the members that stay must hold the state.
  const size_t reach = std::min(want, kept.size() + (d->spares.size() - d->spare_i));
  const std::string refused = CheckWorldSize(policy, view.shard_group, static_cast<int>(reach));
  if (kept.size() < d->next.size() && (!refused.empty() || staying.empty())) {
    out->leaving_kept = fmt::format(
        "the members of leaving hosts stay for now: without them the world would be {} ({})", reach,
        staying.empty() ? "no member that stays holds all of the state" : refused);
    kept = d->next;  // MaybeReleaseLeavingHosts tries again (or refuses) at the next boundary
    want = std::max(want, d->next.size());
    if (staying.empty()) {
      // it could only repeat
      for (const auto& [id, host] : release) out->leave_refused_hosts.insert(host);
    }
  } else if (!staying.empty()) {
    d->holders = std::move(staying);
  }
  if (kept.size() < d->next.size()) {
    for (size_t c : d->next) {
      if (!release.count(w.id(c))) continue;
      d->released.push_back(c);
      out->replacements.push_back(fmt::format("rank {}: worker {} released (host {} leaves)",
                                              w.rank(c), w.id(c), w.host(c)));
    }
  }
  d->next = std::move(kept);
  return want;
}

// A planned resize: leaving hosts go, then the highest ranks (a shrink), or
// spares join at the end (a grow).
void Resize(const Candidates& w, const PlanInput& view, const PlanPolicy& policy, Draft* d,
            NextGeneration* out) {
  size_t want = static_cast<size_t>(view.resize->to);
  if (!view.resize->release.empty()) want = ReleaseLeaving(w, view, policy, d, out);
  if (d->next.size() > want) {  // shrink: the highest ranks leave
    for (size_t c :
         ReleaseFromTheEnd(w, &d->next, d->next.size() - want, d->holders, view.shard_group)) {
      d->released.push_back(c);
      out->replacements.push_back(fmt::format("rank {}: worker {} released", w.rank(c), w.id(c)));
    }
  }
  size_t goal = want;  // sharded: whole groups only, or the spares joining would be released again
  if (view.shard_group > 1) {
    const auto g = static_cast<size_t>(view.shard_group);
    goal = std::max(d->next.size(),
                    std::min(want, d->next.size() + (d->spares.size() - d->spare_i)) / g * g);
  }
  while (d->next.size() < goal && d->spare_i < d->spares.size()) {  // grow: spares join at the end
    out->replacements.push_back(
        fmt::format("rank {}: spare worker {} joins", d->next.size(), w.id(d->spares[d->spare_i])));
    d->next.push_back(d->spares[d->spare_i++]);
  }
}

}  // namespace

std::string CheckWorldSize(const PlanPolicy& p, int shard_group, int size) {
  if (size < p.min_world)
    return fmt::format("world size {} is below the minimum {}", size, p.min_world);
  if (size > p.max_world)
    return fmt::format("world size {} is above the maximum {}", size, p.max_world);
  if (shard_group > 1 && size % shard_group != 0) {
    return fmt::format("world size {} is not a multiple of optimizer.shard_group {}", size,
                       shard_group);
  }
  if (shard_group > 1 && size / shard_group + shard_group > kMaxShardSubGroups) {
    return fmt::format(
        "world size {} is {} groups of optimizer.shard_group {}: more than the {} sub-groups a "
        "generation has (use a larger shard_group)",
        size, size / shard_group, shard_group, kMaxShardSubGroups);
  }
  if (!p.allowed_sizes.empty()) {
    if (std::find(p.allowed_sizes.begin(), p.allowed_sizes.end(), size) == p.allowed_sizes.end()) {
      return fmt::format("world size {} is not an allowed size (allowed: [{}])", size,
                         fmt::join(p.allowed_sizes, ","));
    }
  } else if (p.increment > 1 && (size - p.min_world) % p.increment != 0) {
    return fmt::format("world size {} is not the minimum {} plus a multiple of the increment {}",
                       size, p.min_world, p.increment);
  }
  return "";
}

std::vector<int> SourcesFor(const std::vector<int>& holders, size_t receiver_index) {
  // Each receiver opens a connection (and a thread) per source: a few sources
  // saturate its link, and more only cost connections. Consecutive receivers
  // start at different holders, so the serving is spread over all of them
  // (and, the holders being listed alternating over hosts, over hosts).
  if (holders.size() <= kMaxSourcesPerReceiver) return holders;
  std::vector<int> out;
  out.reserve(kMaxSourcesPerReceiver);
  for (size_t j = 0; j < kMaxSourcesPerReceiver; ++j) {
    out.push_back(holders[(receiver_index * kMaxSourcesPerReceiver + j) % holders.size()]);
  }
  return out;
}

std::vector<ShardMove> PlanShardMoves(const std::vector<ShardHolding>& next, int64_t s_star,
                                      int shard_group) {
  // The initial state is the same everywhere (seeded parameters, zero
  // moments): before the first step every member holds every shard.
  if (shard_group <= 0 || s_star == -1) return {};
  Result<state::ShardLayout> layout = state::LayoutOf(static_cast<int>(next.size()), shard_group);
  if (!layout.ok()) return {};
  const auto g = static_cast<size_t>(shard_group);
  // What a member holds of s*: a member behind it (a spare, a member one
  // step behind) gets the step's counters from the plan's transfers, not its
  // shard: it holds none of s*.
  auto held = [&](size_t q) {
    return next[q].step == s_star ? next[q].held_shard : state::kNoShard;
  };
  // Holders by shard in one pass, those of every shard apart (a restart's
  // loaded checkpoint), merged in only for a shard that some member needs:
  // linear in the world, as the controller plans for 100,000 members.
  std::vector<std::vector<size_t>> holders(g);  // by shard: the ranks that hold just it
  std::vector<size_t> every;                    // the ranks that hold every shard
  for (size_t q = 0; q < next.size(); ++q) {
    const int h = held(q);
    if (h == state::kEveryShard) every.push_back(q);
    if (h >= 0 && static_cast<size_t>(h) < g) holders[static_cast<size_t>(h)].push_back(q);
  }
  // by shard: its holders' worker ids, in rank order
  std::vector<std::optional<std::vector<int>>> sources_of(g);
  std::vector<size_t> served(g, 0);  // by shard: its receivers so far
  std::vector<ShardMove> moves;
  for (size_t r = 0; r < next.size(); ++r) {
    const int need = layout->shard_of_rank[r];
    const auto s = static_cast<size_t>(need);
    if (held(r) == need || held(r) == state::kEveryShard) continue;
    if (!sources_of[s]) {
      std::vector<size_t> ranks;
      std::merge(holders[s].begin(), holders[s].end(), every.begin(), every.end(),
                 std::back_inserter(ranks));
      std::vector<int>& ids = sources_of[s].emplace();
      for (size_t q : ranks) ids.push_back(next[q].worker_id);
    }
    // A receiver stripes its chunks over its sources, a connection and a
    // thread each: at most kMaxSourcesPerReceiver of the shard's holders
    // (it has one per replica group), the next receiver of the same shard
    // starting at the next ones. r never holds the shard it needs: never its own source.
    moves.push_back({next[r].worker_id, need, SourcesFor(*sources_of[s], served[s]++)});
  }
  return moves;
}

NextGeneration PlanNextGeneration(const PlanInput& view, const PlanPolicy& policy) {
  NextGeneration out;
  const Candidates w(view);
  Draft d;
  FindHolders(w, view, &d, &out);
  if (out.verdict != Verdict::kPlan) return out;
  ReplaceLostRanks(w, view, &d, &out);
  if (view.resize) Resize(w, view, policy, &d, &out);
  if (view.shard_group > 1 && d.next.size() % static_cast<size_t>(view.shard_group) != 0) {
    // Sharded state needs whole groups: the members beyond the last whole one leave.
    const size_t beyond = d.next.size() % static_cast<size_t>(view.shard_group);
    for (size_t c : ReleaseFromTheEnd(w, &d.next, beyond, d.holders, view.shard_group)) {
      d.released.push_back(c);
      out.replacements.push_back(
          fmt::format("worker {} released (the world must be a multiple of "
                      "optimizer.shard_group {})",
                      w.id(c), view.shard_group));
    }
  }
  out.holders = w.ids(d.holders);
  out.members = w.ids(d.next);
  out.released = w.ids(d.released);
  out.spares_used = d.spare_i;
  if (d.next.empty()) {
    out.verdict = Verdict::kNoneLeft;
    out.why = "no worker is left to continue the job";
    return out;
  }
  out.had_step.reserve(d.next.size());
  std::vector<ShardHolding> holdings;
  holdings.reserve(d.next.size());
  for (size_t c : d.next) {
    const int64_t holds = w.step(c);
    out.had_step.push_back(holds);
    holdings.push_back({w.id(c), holds, w.held_shard(c)});
    if (holds != out.s_star) {
      out.transfers.push_back({w.id(c), SourcesFor(out.holders, out.transfers.size()), holds});
    }
  }
  out.shard_moves = PlanShardMoves(holdings, out.s_star, view.shard_group);
  return out;
}

}  // namespace nonstop::controller
