#include "controller/controller.h"

#include <signal.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "nonstop/state.h"
#include "state/shard_layout.h"

namespace nonstop::controller {

using nlohmann::json;

namespace {

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// Numbers from workers enter the controller's arithmetic only within sane
// ranges: a worker that lies (INT64_MAX steps, a NaN step time) is ignored,
// never a cause of overflow or undefined behaviour.
constexpr int64_t kMaxStep = int64_t{1} << 53;
bool SaneStep(int64_t step) { return step >= control::kNoValidState && step <= kMaxStep; }

// The start of a journal record that every member sends in a recovery (ready,
// connections), to be completed field by field: nlohmann's initializer lists
// build a temporary array per field and cost about three times as much, which
// adds up over 100,000 members (docs/scale.md).
json PerMemberRecord(const char* event, int worker_id) {
  json rec(json::value_t::object);
  rec["event"] = event;
  rec["worker_id"] = worker_id;
  return rec;
}

// Sharded state: the planner's shard moves into the plan, with the job's
// group size that the workers check them against (docs/sharding.md).
void SetShardMoves(std::vector<ShardMove> moves, control::PlanMsg* plan, int shard_group) {
  plan->shard_group = std::max(0, shard_group);
  plan->shard_moves.reserve(moves.size());
  for (ShardMove& m : moves) plan->shard_moves.push_back({m.receiver, m.shard, std::move(m.sources)});
}

// The plan's shard moves for its journal record: every copy the plan makes.
json ShardMovesJson(const control::PlanMsg& plan) {
  json moves = json::array();
  for (const auto& m : plan.shard_moves) {
    moves.push_back({{"receiver", m.receiver}, {"shard", m.shard}, {"sources", m.sources}});
  }
  return moves;
}

}  // namespace

std::vector<Action> Controller::Handle(const Event& event, Clock::time_point now) {
  now_ = now;
  if (!started_at_) {
    started_at_ = now;
    forming_since_ = now;
    // On one machine the runtime starts worker ids 0 … world + spares − 1
    // itself; on hosts the workers are started when the hosts are there.
    if (!multi_host()) {
      for (int id = 0; id < world_size_ + pool_size_; ++id) {
        awaiting_join_.emplace(id, AwaitedJoin{id >= world_size_, now});
        MarkLive(id);
      }
      next_worker_id_ = std::max(next_worker_id_, world_size_ + pool_size_);
    }
  }
  std::vector<Action> out;
  if (phase_ == JobPhase::kEnded) {
    if (const auto* e = std::get_if<ProcessExited>(&event)) {
      auto it = workers_.find(e->worker_id);
      if (it != workers_.end()) SetRole(it->second, WorkerRole::kGone);
      MarkEnded(e->worker_id);
    } else if (const auto* j = std::get_if<WorkerJoined>(&event)) {
      // Late (a refill that started as the job ended), or back after losing
      // its connection: it is told, instead of waiting for a plan that never comes.
      out.push_back(SendShutdown{j->msg.worker_id, {"the job has ended: " + end_reason_, end_code_}});
    }
    return out;
  }
  std::visit([&](const auto& e) { On(e, &out); }, event);
  return out;
}

void Controller::SetRole(WorkerInfo& w, WorkerRole role) {
  if (w.role == role) return;
  if (w.role == WorkerRole::kPending) pending_.erase(w.worker_id);
  if (w.role == WorkerRole::kSpare) --spare_count_;
  w.role = role;
  if (role == WorkerRole::kPending) pending_.insert(w.worker_id);
  if (role == WorkerRole::kSpare) ++spare_count_;
}

void Controller::MarkLive(int worker_id) {
  if (!live_processes_.insert(worker_id).second) return;
  if (auto h = host_of_.find(worker_id); h != host_of_.end()) ++live_on_host_[h->second];
}

void Controller::MarkEnded(int worker_id) {
  if (live_processes_.erase(worker_id) == 0) return;
  if (auto h = host_of_.find(worker_id); h != host_of_.end()) --live_on_host_[h->second];
}

void Controller::SetMembers(std::vector<int> ids, std::vector<WorkerInfo*> info) {
  members_ = std::move(ids);
  member_info_ = std::move(info);
  if (member_info_.size() == members_.size()) return;
  member_info_.clear();
  member_info_.reserve(members_.size());
  for (int id : members_) member_info_.push_back(&workers_[id]);
}

int Controller::RankOf(int worker_id) const {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || !IsLiveMember(it->second)) return -1;
  return it->second.rank;
}

std::string Controller::HostOf(int worker_id) const {
  auto it = host_of_.find(worker_id);
  return it == host_of_.end() ? "" : it->second;
}

std::string Controller::Describe(const WorkerInfo& w) const {
  // The one elastic host is this machine (nonstop run): naming it adds nothing.
  std::string on = w.host.empty() || w.host == elastic_host_ ? "" : " on host " + w.host;
  if (w.rank >= 0) return fmt::format("rank {} (worker {}, pid {}{})", w.rank, w.worker_id, w.pid, on);
  return fmt::format("spare worker {} (pid {}{})", w.worker_id, w.pid, on);
}

double Controller::MedianStepSeconds() const {
  if (step_seconds_.empty()) return 0;
  std::vector<double> v(step_seconds_.begin(), step_seconds_.end());
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// ---------------------------------------------------------------- joining

void Controller::On(const WorkerJoined& e, std::vector<Action>* out) {
  const auto& m = e.msg;
  if (!SaneStep(m.state_step) || m.worker_id > (1 << 30)) {
    out->push_back(SendShutdown{m.worker_id, {fmt::format("join refused: worker id {} or state step {} is out of range",
                                                          m.worker_id, m.state_step), kExitUsage}});
    return;
  }
  if (killed_before_join_.count(m.worker_id)) {
    // Its join was in flight when its join deadline passed: it was killed and replaced.
    out->push_back(SendShutdown{m.worker_id, {"joined after its join deadline; a replacement was started", kExitUsage}});
    return;
  }
  if (!multi_host() && !m.host_id.empty()) {
    // One machine: an inherited NONSTOP_HOST_ID means nothing here.
    control::JoinMsg local = m;
    local.host_id.clear();
    On(WorkerJoined{local}, out);
    return;
  }
  // A worker is on the host whose agent started it, and nowhere else.
  if (auto started = host_of_.find(m.worker_id); started != host_of_.end() && started->second != m.host_id) {
    std::string why = fmt::format("worker {} was started on host {} but joins as a worker of host '{}'", m.worker_id,
                                  started->second, m.host_id);
    out->push_back(AppendJournal{{{"event", "join_refused"}, {"worker_id", m.worker_id}, {"reason", why}}});
    out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, kExitUsage}});
    return;
  }
  if (!m.host_id.empty() && !host_of_.count(m.worker_id)) {
    std::string why = fmt::format("worker {} claims host '{}', whose agent did not start it", m.worker_id, m.host_id);
    out->push_back(AppendJournal{{{"event", "join_refused"}, {"worker_id", m.worker_id}, {"reason", why}}});
    out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, kExitUsage}});
    return;
  }
  if (!m.host_id.empty()) {
    auto h = hosts_.find(m.host_id);
    if (h == hosts_.end() || !h->second.alive) {
      // Its host was lost while it started: it is fenced with it.
      std::string why = fmt::format("host {} is no longer in the job", m.host_id);
      out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, kExitPeerFailure}});
      return;
    }
  }
  if (multi_host() && workers_.count(m.worker_id) && workers_[m.worker_id].role == WorkerRole::kGone) {
    // Fenced (its host was lost, or it was killed): a worker id never comes back.
    std::string why = fmt::format("worker {} left the job ({}) and cannot rejoin it", m.worker_id,
                                  workers_[m.worker_id].how_it_ended.empty() ? "fenced"
                                                                             : workers_[m.worker_id].how_it_ended);
    out->push_back(AppendJournal{{{"event", "join_refused"}, {"worker_id", m.worker_id}, {"reason", why}}});
    out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, kExitPeerFailure}});
    return;
  }
  if (shard_group_ >= 0 && m.shard_group != shard_group_) {
    std::string why = fmt::format("worker {} shards its optimizer state over groups of {}, the job over groups of {}: "
                                  "every worker must run the same optimizer.shard_group", m.worker_id, m.shard_group,
                                  shard_group_);
    out->push_back(AppendJournal{{{"event", "join_refused"}, {"worker_id", m.worker_id}, {"reason", why}}});
    out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, kExitUsage}});
    return;
  }
  if (unconfirmed_.count(m.worker_id)) {
    shard_group_ = m.shard_group;
    Rejoined(m, out);
    return;
  }
  next_worker_id_ = std::max(next_worker_id_, m.worker_id + 1);
  if (awaiting_join_.erase(m.worker_id) > 0 && m.spare) {
    refill_failures_ = 0;
    if (!m.host_id.empty()) host_refill_failures_.erase(m.host_id);
  }
  if (workers_.count(m.worker_id) && workers_[m.worker_id].role != WorkerRole::kGone) {
    out->push_back(AppendJournal{{{"event", "join_refused"}, {"worker_id", m.worker_id},
                                  {"reason", "worker id already in use"}}});
    out->push_back(SendShutdown{m.worker_id, {fmt::format("worker id {} is already in use", m.worker_id), kExitUsage}});
    return;
  }
  // A new entry, or one of a worker that is gone (a restarted job reuses no id, but a
  // hand-started worker may): either way its role so far counts nowhere.
  WorkerInfo& w = workers_[m.worker_id];
  w = WorkerInfo{};
  w.role = WorkerRole::kGone;
  w.worker_id = m.worker_id;
  w.pid = m.pid;
  w.address = m.data_address;
  w.host = m.host_id;
  SetRole(w, m.spare || phase_ != JobPhase::kForming ? WorkerRole::kSpare : WorkerRole::kPending);
  joined_step_[m.worker_id] = m.state_step;
  shard_group_ = m.shard_group;  // the first join taken fixes it; the check above keeps every later one equal
  w.held_shard = m.held_shard;
  w.last_heard = now_;
  json rec = {{"event", "join"}, {"worker_id", m.worker_id}, {"pid", m.pid}, {"address", m.data_address},
              {"spare", w.role == WorkerRole::kSpare}};
  if (!m.host_id.empty()) rec["host"] = m.host_id;
  out->push_back(AppendJournal{rec});
  if (phase_ == JobPhase::kForming) MaybeFormFirstGeneration(out);
  else MaybeGrow(out);
}

// Forms a generation from scratch: at the start, and after a restart from a
// durable checkpoint. Members may hold different steps (a checkpoint written
// while others were loading): the highest wins and the others copy it.
void Controller::MaybeFormFirstGeneration(std::vector<Action>* out) {
  if (world_size_ <= 0 || static_cast<int>(pending_.size()) < world_size_) return;
  if (shard_group_ > 1 && world_size_ % shard_group_ != 0) {
    End(kExitUsage, fmt::format("the world of {} workers is not groups of optimizer.shard_group {}: make --nproc a "
                                "multiple of {} or change the recipe's shard_group", world_size_, shard_group_,
                                shard_group_), out);
    return;
  }
  if (shard_group_ > 1 && world_size_ / shard_group_ + shard_group_ > kMaxShardSubGroups) {
    End(kExitUsage, CheckSize(world_size_), out);
    return;
  }
  if (shard_group_ > 1 && world_size_ == shard_group_ && !open_recovery_) {
    out->push_back(PrintLine{fmt::format("optimizer.shard_group {} is the whole world: each shard has one copy, so a "
                                         "fault loses it (the job then falls to its durable checkpoint); a world of "
                                         "{} or more keeps a replica", shard_group_, 2 * shard_group_)});
  }
  // The lowest worker ids.
  std::vector<int> pending(pending_.begin(), std::next(pending_.begin(), world_size_));
  ++generation_;
  SetMembers(pending);
  arrivals_.clear();
  arrival_step_ = -1;
  arrival_spreads_ms_.clear();  // a new membership has its own normal
  int64_t s_star = -1;
  for (int id : members_) s_star = std::max(s_star, joined_step_[id]);
  std::vector<int> holders;
  for (int id : members_) {
    if (joined_step_[id] == s_star) holders.push_back(id);
  }
  resume_step_ = s_star + 1;
  close_scan_ = 0;
  auto plan_ptr = std::make_shared<control::PlanMsg>();
  control::PlanMsg& plan = *plan_ptr;
  plan.generation = generation_;
  plan.resume_step = resume_step_;
  plan.faults = pending_faults_;
  plan.reason = open_recovery_ ? "restart" : "start";
  plan.members.reserve(members_.size());
  std::vector<ShardHolding> holdings;  // what each holds, from its join: the shard moves
  holdings.reserve(members_.size());
  for (size_t r = 0; r < members_.size(); ++r) {
    WorkerInfo& w = *member_info_[r];
    SetRole(w, WorkerRole::kMember);
    w.rank = static_cast<int>(r);
    w.last_heard = now_;
    w.last_step = joined_step_[w.worker_id];
    plan.members.push_back({w.worker_id, w.address});
    if (joined_step_[w.worker_id] != s_star) {
      plan.transfers.push_back({w.worker_id, SourcesFor(holders, plan.transfers.size())});
    }
    holdings.push_back({w.worker_id, joined_step_[w.worker_id], w.held_shard});
  }
  SetShardMoves(PlanShardMoves(holdings, s_star, shard_group_), &plan, shard_group_);
  // Late joiners wait as spares.
  for (int id : std::vector<int>(pending_.begin(), pending_.end())) SetRole(workers_[id], WorkerRole::kSpare);
  phase_ = JobPhase::kRunning;
  progress_at_ = now_;
  std::shared_ptr<const control::PlanMsg> shared = std::move(plan_ptr);
  out->reserve(out->size() + members_.size() + 2);
  for (int id : members_) out->push_back(SendPlan{id, shared});
  json first = {{"event", "plan"}, {"generation", generation_}, {"members", members_}, {"spares", SpareCount()},
                {"resume_step", resume_step_}, {"reason", plan.reason}};
  if (!plan.shard_moves.empty()) first["shard_moves"] = ShardMovesJson(plan);
  out->push_back(AppendJournal{std::move(first)});
  out->push_back(PrintLine{fmt::format("generation {}: {} workers, ranks by worker id {}{}", generation_,
                                       members_.size(), json(members_).dump(),
                                       s_star >= 0 ? fmt::format(", resuming at step {}", resume_step_) : "")});
  CheckShardPlacement(out);
  if (open_recovery_) {
    RecoveryRecord& rec = recoveries_[*open_recovery_];
    rec.plan_at = now_;
    rec.to_generation = generation_;
    rec.resume_step = resume_step_;
    rec.new_world = static_cast<int>(members_.size());
    rec.redone_steps = std::max<int64_t>(0, highest_step_ - s_star);
  }
}

void Controller::RestartFromCheckpoint(const std::string& why, std::vector<Action>* out) {
  if (!open_recovery_) OpenRecovery(why, /*planned=*/false, out);  // the aborts are moot
  resize_.reset();  // a planned change in progress is moot: every worker starts again
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  rec.restarted = true;
  rec.replacements.push_back("every worker restarted from the newest durable checkpoint");
  out->push_back(PrintLine{"restarting every worker from the newest durable checkpoint: " + why});
  out->push_back(AppendJournal{{{"event", "restart"}, {"recovery", rec.id}, {"reason", why},
                                {"highest_step", highest_step_}}});
  for (auto& [id, w] : workers_) {
    // Every slot takes a restarted worker at once, also the slots of members
    // already lost whose exits the agents have not reported yet (they were
    // killed when they were lost); else those slots filled with spares later.
    if (slotted()) MarkEnded(id);
    if (w.role == WorkerRole::kGone) continue;
    SetRole(w, WorkerRole::kGone);
    out->push_back(KillWorker{id});
  }
  if (multi_host()) {
    for (const auto& [id, a] : awaiting_join_) {  // started, not joined yet: they would join the old job
      out->push_back(KillWorker{id});
      killed_before_join_.insert(id);
      MarkEnded(id);
    }
    awaiting_join_.clear();
  }
  SetMembers({});
  ready_.clear();
  finished_ = 0;
  last_journaled_step_ = -1;  // the steps since the checkpoint are computed (and journaled) again
  phase_ = JobPhase::kForming;
  forming_since_ = now_;
  if (slotted()) {
    // Every worker starts again on the hosts' whole capacity: slots a shrink gave back count again
    // (the new generation forms from every non-spare slot; takeover.cc replays it the same way).
    withheld_.clear();
    PlaceOnHosts(/*resume=*/true, out);
    return;
  }
  for (int i = 0; i < world_size_ + pool_size_; ++i) {
    Spawn(next_worker_id_++, /*spare=*/i >= world_size_, /*resume=*/true, /*background=*/false, out);
  }
}

// ---------------------------------------------------------------- progress

void Controller::On(const HeartbeatReceived& e, std::vector<Action>*) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) return;
  if (!SaneStep(e.msg.step) || e.msg.waiting_ms < -1 || e.msg.waiting_ms > 86'400'000) return;
  it->second.last_heard = now_;
  if (e.msg.step > it->second.last_step && it->second.role == WorkerRole::kMember) progress_at_ = now_;
  it->second.last_step = std::max(it->second.last_step, e.msg.step);
  it->second.waiting_ms = e.msg.waiting_ms;
  if (e.msg.waiting_ms >= 0 && it->second.role == WorkerRole::kMember && phase_ == JobPhase::kRunning) {
    RecordArrival(it->second, e.msg.step + 1, e.msg.waiting_ms);
  }
}

// The members' arrival at each step's collective: the first arrival starts
// the clock of the hang detector; when all have arrived, the spread between
// first and last is what "normal" looks like for the next steps.
void Controller::RecordArrival(WorkerInfo& w, int64_t step, int64_t waiting_ms) {
  if (step < arrival_step_) return;
  if (step > arrival_step_) {
    arrival_step_ = step;
    arrivals_.clear();
  }
  if (!arrivals_.emplace(w.worker_id, now_ - Millis(waiting_ms)).second) return;
  if (arrivals_.size() < members_.size()) return;
  auto [lo, hi] = std::minmax_element(arrivals_.begin(), arrivals_.end(),
                                      [](const auto& a, const auto& b) { return a.second < b.second; });
  // Steps right after a change of membership include its cost: keep them out.
  if (!open_recovery_ && step > resume_step_) {
    arrival_spreads_ms_.push_back(Ms(hi->second - lo->second));
    if (arrival_spreads_ms_.size() > 32) arrival_spreads_ms_.pop_front();
  }
}

void Controller::On(const ProgressReceived& e, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) return;
  if (!SaneStep(e.msg.step) || e.msg.step < 0 || !std::isfinite(e.msg.step_seconds) || e.msg.step_seconds < 0 ||
      e.msg.step_seconds > 1e6) {
    return;
  }
  WorkerInfo& w = it->second;
  w.last_heard = now_;
  // Progress is a member completing a step it had not (in this generation:
  // steps redone after a restart from a checkpoint count too).
  if (e.msg.step > w.last_step) progress_at_ = now_;
  w.last_step = std::max(w.last_step, e.msg.step);
  w.waiting_ms = -1;
  highest_step_ = std::max(highest_step_, e.msg.step);
  // Every member reports the same (allreduced) loss: journal each step once,
  // from whichever member reports it first (rank 0 may have been aborted
  // inside a step that the others completed).
  if (IsLiveMember(w) && e.msg.step > last_journaled_step_) {
    last_journaled_step_ = e.msg.step;
    json record = {{"event", "step"}, {"step", e.msg.step}, {"loss", e.msg.loss},
                   {"step_seconds", e.msg.step_seconds}, {"tokens_per_second", e.msg.tokens_per_second},
                   {"world_size", e.msg.world_size}, {"generation", generation_}};
    if (e.msg.total_steps > 0) record["total_steps"] = e.msg.total_steps;
    out->push_back(AppendJournal{std::move(record)});
    // Steps right after a recovery include its cost: keep them out of the baseline.
    if (!open_recovery_ && e.msg.step > resume_step_) {
      step_seconds_.push_back(e.msg.step_seconds);
      if (step_seconds_.size() > 20) step_seconds_.pop_front();
    }
  }
  MaybeCloseRecovery(out);
}

void Controller::On(const FinishedReceived& e, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end() || it->second.role != WorkerRole::kMember) return;
  WorkerInfo& w = it->second;
  w.last_heard = now_;
  SetRole(w, WorkerRole::kFinished);
  w.last_step = std::max(w.last_step, e.msg.step);
  out->push_back(AppendJournal{{{"event", "finished"}, {"worker_id", w.worker_id}, {"rank", w.rank},
                                {"step", e.msg.step}, {"checksum", e.msg.checksum}}});
  if (checksum_ && *checksum_ != e.msg.checksum) {
    End(kExitDataCorruption,
        fmt::format("members disagree on the final parameters: {} has checksum {}, another member {}", Describe(w),
                    e.msg.checksum, *checksum_),
        out);
    return;
  }
  checksum_ = e.msg.checksum;
  MaybeCloseRecovery(out);
  if (phase_ == JobPhase::kRunning && ++finished_ == static_cast<int>(members_.size())) {
    End(kExitOk, fmt::format("training finished at step {}; parameter checksum {}", e.msg.step, e.msg.checksum), out);
  }
}

// ---------------------------------------------------------------- faults

void Controller::On(const FailureReported& e, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) return;
  if (e.msg.exit_code == kExitDataCorruption) {
    End(kExitDataCorruption, fmt::format("{} reported data corruption: {}", Describe(it->second), e.msg.reason), out);
    return;
  }
  if (it->second.role == WorkerRole::kSpare) {
    SpareLost(it->second, "reported a failure: " + e.msg.reason, out);
    return;
  }
  MemberFault(e.worker_id, "reported failure", e.msg.reason, out);
}

void Controller::On(const ConnectionLost& e, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end() || it->second.role == WorkerRole::kGone) return;
  if (it->second.role == WorkerRole::kSpare) {
    SpareLost(it->second, "lost its control connection", out);
    out->push_back(KillWorker{e.worker_id});
    return;
  }
  if (phase_ == JobPhase::kForming) {
    End(kExitPeerFailure, fmt::format("worker {} lost its control connection before the job formed: {}", e.worker_id, e.reason), out);
    return;
  }
  MemberFault(e.worker_id, "control connection lost", e.reason, out);
}

void Controller::On(const ProcessExited& e, std::vector<Action>* out) {
  if (!e.host.empty() && HostOf(e.worker_id) != e.host) {
    out->push_back(AppendJournal{{{"event", "report_ignored"}, {"host", e.host}, {"worker_id", e.worker_id},
                                  {"reason", "an agent reported the exit of a worker it did not start"}}});
    return;
  }
  const bool was_live = live_processes_.count(e.worker_id) > 0;
  MarkEnded(e.worker_id);
  std::string how = e.signal != 0 ? fmt::format("was killed by signal {}", e.signal)
                                  : fmt::format("exited with code {}", e.exit_code);
  out->push_back(AppendJournal{{{"event", "exit"}, {"worker_id", e.worker_id}, {"pid", e.pid}, {"how", how},
                                {"rank", RankOf(e.worker_id)}}});
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) {
    auto awaited = awaiting_join_.find(e.worker_id);
    bool was_refill = awaited != awaiting_join_.end() && awaited->second.spare;
    if (awaited != awaiting_join_.end()) awaiting_join_.erase(awaited);
    if (killed_before_join_.count(e.worker_id)) return;  // already replaced
    // On hosts, a process whose end was already accounted for (its host was
    // lost, or it was killed and its slot reused) changes nothing.
    if (multi_host() && !was_live) return;
    if (was_refill && e.exit_code != kExitDataCorruption && slotted()) {
      const std::string host = HostOf(e.worker_id);
      int failures = ++host_refill_failures_[host];
      if (failures <= 3) {
        out->push_back(PrintLine{fmt::format("spare worker {} on host {} (pid {}) {} before joining; starting another",
                                             e.worker_id, host, e.pid, how)});
        RefillSpare(out);
      } else {
        out->push_back(PrintLine{fmt::format("spare worker {} on host {} (pid {}) {} before joining; {} spares in a row "
                                             "died while starting there, so its slots are not refilled until it "
                                             "registers again (see their output)",
                                             e.worker_id, host, e.pid, how, failures)});
      }
      return;
    }
    if (was_refill && e.exit_code != kExitDataCorruption) {
      // A spare that died while starting: the pool refills, unless refills keep dying.
      if (++refill_failures_ <= 3) {
        out->push_back(PrintLine{fmt::format("spare worker {} (pid {}) {} before joining; starting another",
                                             e.worker_id, e.pid, how)});
        RefillSpare(out);
      } else {
        out->push_back(PrintLine{fmt::format("spare worker {} (pid {}) {} before joining; {} spares in a row died "
                                             "while starting, so the pool is not refilled (see their output)",
                                             e.worker_id, e.pid, how, refill_failures_)});
      }
      return;
    }
    if (phase_ == JobPhase::kForming) {
      End(e.exit_code == kExitDataCorruption ? kExitDataCorruption : kExitPeerFailure,
          fmt::format("worker {} (pid {}) {} before joining the job", e.worker_id, e.pid, how), out);
    } else if (e.exit_code == kExitDataCorruption) {
      End(kExitDataCorruption, fmt::format("worker {} (pid {}) {} before joining: its data is corrupt", e.worker_id, e.pid, how), out);
    } else if (e.exit_code != 0) {
      out->push_back(PrintLine{fmt::format("worker {} (pid {}) {} before joining", e.worker_id, e.pid, how)});
    }
    return;
  }
  WorkerInfo& w = it->second;
  w.how_it_ended = how;
  // Name the cause in an open recovery that this worker's loss started.
  if (open_recovery_) {
    for (auto& c : recoveries_[*open_recovery_].causes) {
      // Only the cause that names this worker as the one that failed (it starts with its description).
      if (c.rfind(Describe(w), 0) == 0 && c.find(" [") == std::string::npos) {
        c += " [" + how + "]";
      }
    }
  }
  switch (w.role) {
    case WorkerRole::kGone:
      return;
    case WorkerRole::kSpare:
      SpareLost(w, how, out);
      return;
    case WorkerRole::kPending:
      SetRole(w, WorkerRole::kGone);
      End(kExitPeerFailure, fmt::format("worker {} (pid {}) {} before the job formed", w.worker_id, w.pid, how), out);
      return;
    case WorkerRole::kMember:
    case WorkerRole::kFinished:
      if (e.signal == 0 && e.exit_code == kExitDataCorruption) {
        End(kExitDataCorruption, fmt::format("{} {}: data corruption (see its output)", Describe(w), how), out);
        return;
      }
      MemberFault(w.worker_id, "process exit", how, out);
      return;
  }
}

void Controller::On(const ProcessStopped& e, std::vector<Action>* out) {
  if (!e.host.empty() && HostOf(e.worker_id) != e.host) return;  // not its worker
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) {
    // Stopped before it joined: it will never join; replace it like a spare that died.
    if (awaiting_join_.count(e.worker_id)) {
      out->push_back(KillWorker{e.worker_id});  // its exit then refills or ends the forming
    }
    return;
  }
  it->second.stopped = true;
  WorkerUnresponsive(e.worker_id, "process stopped",
                     fmt::format("was stopped by signal {} (a frozen process)", e.signal), out);
}

void Controller::WorkerUnresponsive(int worker_id, const std::string& kind, const std::string& detail,
                                    std::vector<Action>* out) {
  WorkerInfo& w = workers_[worker_id];
  switch (w.role) {
    case WorkerRole::kMember:
    case WorkerRole::kFinished:
      MemberFault(worker_id, kind, detail, out);
      return;
    case WorkerRole::kSpare:
      out->push_back(KillWorker{worker_id});
      SpareLost(w, fmt::format("{} ({})", detail, kind), out, kind);
      return;
    case WorkerRole::kPending: {
      // The job is forming: a spare takes its place, or a new worker is started.
      SetRole(w, WorkerRole::kGone);
      if (multi_host()) MarkEnded(worker_id);  // killed now: its slot can take the replacement
      out->push_back(AppendJournal{{{"event", "fault"}, {"kind", kind}, {"worker_id", worker_id}, {"rank", -1},
                                    {"pid", w.pid}, {"detail", detail}, {"last_step", w.last_step},
                                    {"generation", generation_}}});
      out->push_back(KillWorker{worker_id});
      int spare = -1;
      for (auto& [id, other] : workers_) {
        if (other.role == WorkerRole::kSpare && !other.stopped) {
          spare = id;
          break;
        }
      }
      bool resume = open_recovery_.has_value();  // forming after a restart from a checkpoint
      if (spare >= 0 && !resume) {
        SetRole(workers_[spare], WorkerRole::kPending);
        out->push_back(PrintLine{fmt::format("worker {} (pid {}) {} before the job formed; spare worker {} takes its "
                                             "place", worker_id, w.pid, detail, spare)});
        if (pool_size_ > 0 || slotted()) RefillSpare(out);
      } else {
        out->push_back(PrintLine{fmt::format("worker {} (pid {}) {} before the job formed; starting another",
                                             worker_id, w.pid, detail)});
        if (slotted()) {
          // On a host with a free slot, else the job cannot form.
          std::string host;
          for (const auto& id : host_order_) {
            if (hosts_[id].alive && FreeSlots(hosts_[id]) > 0) {
              host = id;
              break;
            }
          }
          if (host.empty()) {
            End(kExitPeerFailure, fmt::format("worker {} {} before the job formed, and no host has a free slot "
                                              "for another", worker_id, detail), out);
            return;
          }
          Spawn(next_worker_id_++, /*spare=*/false, resume, /*background=*/false, out, host);
        } else {
          Spawn(next_worker_id_++, /*spare=*/false, resume, /*background=*/false, out);
        }
      }
      MaybeFormFirstGeneration(out);
      return;
    }
    case WorkerRole::kGone:
      return;
  }
}

void Controller::Spawn(int worker_id, bool spare, bool resume, bool background, std::vector<Action>* out,
                       const std::string& given_host) {
  const std::string& host = given_host.empty() ? elastic_host_ : given_host;
  awaiting_join_[worker_id] = AwaitedJoin{spare, now_};
  if (!host.empty()) host_of_[worker_id] = host;
  MarkLive(worker_id);
  out->push_back(SpawnWorker{worker_id, spare, resume, background, host});
}

void Controller::CheckJoinDeadlines(std::vector<Action>* out) {
  if (phase_ == JobPhase::kForming) {
    if (now_ - forming_since_ <= options_.forming_timeout) return;
    if (multi_host() && !placed_) {
      const int alive = alive_hosts_;
      End(kExitPeerFailure,
          fmt::format("the job did not form within {} s: {} of the {} hosts it needs registered (start `nonstop "
                      "agent` on each host; HINT: a slow start needs a longer --join-timeout-ms)",
                      options_.forming_timeout.count() / 1000, alive, options_.min_hosts),
          out);
      return;
    }
    std::vector<int> missing;
    for (const auto& [id, a] : awaiting_join_) {
      if (!a.spare) missing.push_back(id);
    }
    int pending = 0;
    for (const auto& [id, w] : workers_) pending += w.role == WorkerRole::kPending ? 1 : 0;
    End(kExitPeerFailure,
        fmt::format("the job did not form within {} s: {} of {} workers joined; not joined: worker(s) {} (see their "
                    "output; HINT: a slow start needs a longer --join-timeout-ms)",
                    options_.forming_timeout.count() / 1000, pending, world_size_, json(missing).dump()),
        out);
    return;
  }
  std::vector<int> late;
  for (const auto& [id, a] : awaiting_join_) {
    if (now_ - a.since.value_or(*started_at_) > options_.join_timeout) late.push_back(id);
  }
  for (int id : late) {
    bool spare = awaiting_join_[id].spare;
    awaiting_join_.erase(id);
    killed_before_join_.insert(id);
    out->push_back(KillWorker{id});
    out->push_back(AppendJournal{{{"event", "join_timeout"}, {"worker_id", id}, {"spare", spare}}});
    out->push_back(PrintLine{fmt::format("worker {} did not join within {} s; killed{}", id,
                                         options_.join_timeout.count() / 1000,
                                         spare ? ", starting another spare" : "")});
    if (spare) RefillSpare(out);
  }
}

void Controller::CheckHeartbeats(std::vector<Action>* out) {
  // Agents too: a silent agent is a lost host (a crash, or a partition).
  std::vector<std::string> silent_hosts;
  for (const auto& [id, h] : hosts_) {
    if (h.alive && now_ - h.last_heard > options_.heartbeat_timeout) silent_hosts.push_back(id);
  }
  for (const auto& id : silent_hosts) {
    std::string why = fmt::format("its agent sent no heartbeat for {:.0f} ms", Ms(now_ - hosts_[id].last_heard));
    HostDown(id, why, out);  // its workers are killed (if the agent still hears) and fenced
    // The connection closes without a shutdown: an agent that still lives
    // fences itself and registers again when it can.
    out->push_back(CloseHost{id, "declared lost: " + why, kExitPeerFailure, /*fence=*/true});
    if (phase_ == JobPhase::kEnded) return;
  }
  // Every worker that has joined, whatever its role, must be heard from.
  std::vector<int> silent;
  for (const auto& [id, w] : workers_) {
    bool watched = w.role == WorkerRole::kPending || w.role == WorkerRole::kSpare ||
                   (w.role == WorkerRole::kMember && phase_ == JobPhase::kRunning);
    if (watched && now_ - w.last_heard > options_.heartbeat_timeout) silent.push_back(id);
  }
  for (int id : silent) {
    if (phase_ == JobPhase::kEnded) return;
    const WorkerInfo& w = workers_[id];
    if (w.role == WorkerRole::kGone) continue;
    WorkerUnresponsive(id, "heartbeat timeout", fmt::format("sent no heartbeat for {:.0f} ms", Ms(now_ - w.last_heard)),
                       out);
  }
}

AppendJournal Controller::SpareLostRecord(const WorkerInfo& w, const std::string& kind, const std::string& detail) {
  // Every lost spare is in the journal: the spare counts drawn from it (dashboard, report) stay right.
  return AppendJournal{{{"event", "spare_lost"}, {"worker_id", w.worker_id}, {"pid", w.pid}, {"kind", kind},
                        {"detail", detail}}};
}

void Controller::SpareLost(WorkerInfo& w, const std::string& how, std::vector<Action>* out, const std::string& kind) {
  SetRole(w, WorkerRole::kGone);
  out->push_back(SpareLostRecord(w, kind, how));
  out->push_back(PrintLine{fmt::format("spare worker {} (pid {}) {}; starting another", w.worker_id, w.pid, how)});
  RefillSpare(out);
}

void Controller::MemberFault(int worker_id, const std::string& kind, const std::string& detail,
                             std::vector<Action>* out) {
  WorkerInfo& w = workers_[worker_id];
  if (!IsLiveMember(w)) return;
  SetRole(w, WorkerRole::kGone);
  if (open_recovery_ && !w.host.empty()) recoveries_[*open_recovery_].failed_hosts.insert(w.host);
  if (auto h = hosts_.find(w.host); h != hosts_.end() && h->second.leaving) h->second.member_lost = true;
  std::string what = fmt::format("{} {} ({}); its last completed step was {}", Describe(w), detail, kind,
                                 w.last_step >= 0 ? std::to_string(w.last_step) : "none");
  out->push_back(AppendJournal{{{"event", "fault"}, {"kind", kind}, {"worker_id", w.worker_id}, {"rank", w.rank},
                                {"pid", w.pid}, {"detail", detail}, {"last_step", w.last_step},
                                {"generation", generation_}}});
  out->push_back(PrintLine{"fault: " + what});
  out->push_back(KillWorker{worker_id});  // it may be hung, or half alive: make sure it is gone
  ready_.erase(worker_id);
  if (options_.recovery == RecoveryMode::kCheckpointRestart) {
    if (open_recovery_ && phase_ == JobPhase::kForming) {
      recoveries_[*open_recovery_].causes.push_back(what);  // a second fault during the restart
      return;
    }
    StartRecovery(what, out);
    RestartFromCheckpoint(what, out);
    return;
  }
  if (phase_ == JobPhase::kRecovering) {
    recoveries_[*open_recovery_].causes.push_back(what);
    EscalateResize(out);
    MaybeFinishAbort(out);
  } else {
    StartRecovery(what, out);
  }
}

// ---------------------------------------------------------------- recovery

void Controller::StartRecovery(const std::string& cause, std::vector<Action>* out, bool planned) {
  OpenRecovery(cause, planned, out);
  MaybeFinishAbort(out);
}

void Controller::OpenRecovery(const std::string& cause, bool planned, std::vector<Action>* out) {
  if (open_recovery_) {
    // A fault while the previous recovery had not finished: it is superseded.
    recoveries_[*open_recovery_].outcome = fmt::format("superseded by recovery {}", recoveries_.size() + 1);
    out->push_back(AppendJournal{{{"event", "recovery_end"}, {"recovery", RecordJson(recoveries_[*open_recovery_])}}});
  }
  RecoveryRecord rec;
  rec.id = recovery_id_base_ + static_cast<int>(recoveries_.size()) + 1;
  rec.from_generation = generation_;
  rec.causes.push_back(cause);
  rec.detected_at = now_;
  rec.old_world = static_cast<int>(members_.size());
  rec.normal_step_seconds = MedianStepSeconds();
  if (last_injected_ && now_ - last_injected_->first < std::chrono::seconds(10)) {
    rec.fault_at = last_injected_->first;
    rec.injected = last_injected_->second;
    last_injected_.reset();
  }
  for (const WorkerInfo* w : member_info_) {
    if (!IsLiveMember(*w) && !w->host.empty()) rec.failed_hosts.insert(w->host);
  }
  recoveries_.push_back(rec);
  open_recovery_ = recoveries_.size() - 1;
  phase_ = JobPhase::kRecovering;
  abort_scan_ = 0;
  finished_ = 0;
  // A healthy member answers the abort at its next check (between
  // micro-batches, or its collective): never sooner than the step it is
  // computing allows, so slow steps stretch the deadline.
  abort_deadline_ = now_ + std::max(options_.abort_timeout,
                                    std::chrono::duration_cast<Millis>(
                                        std::chrono::duration<double>(1.5 * MedianStepSeconds())));
  // Inherited members that have not joined this controller yet (a takeover)
  // answer once they have: the adoption bound first, then the abort's.
  if (!unconfirmed_.empty()) abort_deadline_ = std::max(abort_deadline_, adopt_until_ + options_.abort_timeout);
  auto abort = std::make_shared<const control::AbortMsg>(control::AbortMsg{generation_, cause});
  ready_.reserve(members_.size());
  if (!planned) out->reserve(out->size() + members_.size() + 4);
  for (WorkerInfo* w : member_info_) {
    if (!IsLiveMember(*w)) continue;
    if (w->role == WorkerRole::kFinished) SetRole(*w, WorkerRole::kMember);
    if (!planned && !unconfirmed_.count(w->worker_id)) out->push_back(SendAbort{w->worker_id, abort});
  }
  out->push_back(AppendJournal{{{"event", planned ? "resize_start" : "recovery_start"}, {"recovery", rec.id},
                                {"generation", generation_}, {"cause", cause}, {"injected", rec.injected}}});
}

void Controller::On(const ReadyReceived& e, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end() || !IsLiveMember(it->second)) return;
  // After a takeover that found a generation the journal missed, the others
  // still answer for the journal's.
  bool current = e.msg.generation == generation_ ||
                 (takeover_generation_ > 0 && e.msg.generation >= takeover_generation_ && e.msg.generation < generation_);
  if (!current) return;
  if (!SaneStep(e.msg.step)) {
    MemberFault(e.worker_id, "reported failure", fmt::format("reported an impossible step {}", e.msg.step), out);
    return;
  }
  if (phase_ == JobPhase::kRunning) {
    // The member saw a fault first (a peer's connection reset): recover.
    StartRecovery(fmt::format("{} reported: {}", Describe(it->second), e.msg.reason), out);
  }
  if (shard_group_ > 0 && e.msg.held_shard >= shard_group_) {
    MemberFault(e.worker_id, "reported failure",
                fmt::format("claims to hold shard {} of groups of {}", e.msg.held_shard, shard_group_), out);
    return;
  }
  if (phase_ != JobPhase::kRecovering) return;
  ready_[e.worker_id] = e.msg.step;
  it->second.held_shard = e.msg.held_shard;
  // Field by field: every member sends one (see PerMemberRecord).
  json rec = PerMemberRecord("ready", e.worker_id);
  rec["rank"] = it->second.rank;
  rec["generation"] = e.msg.generation;
  rec["step"] = e.msg.step;
  rec["reason"] = e.msg.reason;
  out->push_back(AppendJournal{std::move(rec)});
  MaybeFinishAbort(out);
}

void Controller::MaybeFinishAbort(std::vector<Action>* out) {
  if (phase_ != JobPhase::kRecovering) return;
  for (; abort_scan_ < members_.size(); ++abort_scan_) {
    const WorkerInfo& w = *member_info_[abort_scan_];
    if (IsLiveMember(w) && !ready_.count(w.worker_id)) return;  // still waiting
  }
  recoveries_[*open_recovery_].aborted_at = now_;
  FormNextGeneration(out);
}

PlanInput Controller::PlanView(const RecoveryRecord& rec) const {
  PlanInput view;
  view.members.reserve(members_.size());
  for (size_t r = 0; r < members_.size(); ++r) {
    const WorkerInfo& w = *member_info_[r];
    PlanInput::Member& m = view.members.emplace_back();
    m.worker_id = members_[r];
    m.host = w.host;
    m.alive = IsLiveMember(w);
    if (auto ready = ready_.find(members_[r]); ready != ready_.end()) {
      m.ready = true;
      m.step = ready->second;
    }
    m.held_shard = w.held_shard;
  }
  for (const auto& [id, w] : workers_) {  // only those heard from lately: a hung spare is never promoted
    if (Promotable(w)) view.spares.push_back({id, w.host});
  }
  view.failed_hosts = rec.failed_hosts;
  if (resize_) {
    view.resize = PlanInput::Resize{};  // not emplace(): clang 16 finds the nested struct not default-constructible
    PlanInput::Resize& resize = *view.resize;
    resize.to = resize_->to;
    for (int id : resize_->release) {
      auto it = workers_.find(id);
      resize.release[id] = it == workers_.end() ? "" : it->second.host;
    }
  }
  view.shard_group = shard_group_;
  view.multi_host = multi_host();
  view.highest_step = highest_step_;
  view.have_checkpoints = options_.have_checkpoints;
  return view;
}

void Controller::FormNextGeneration(std::vector<Action>* out) {
  using Verdict = NextGeneration::Verdict;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  NextGeneration next = PlanNextGeneration(PlanView(rec), SizePolicy());
  if (!next.lost_shards.empty()) {
    out->push_back(AppendJournal{{{"event", "shard_lost"}, {"shards", next.lost_shards}, {"step", next.s_star},
                                  {"recovery", rec.id}}});
  }
  if (next.verdict == Verdict::kRestart) {
    RestartFromCheckpoint(next.why, out);
    return;
  }
  if (next.verdict == Verdict::kFail) {
    rec.outcome = "failed";
    out->push_back(AppendJournal{{{"event", "recovery_end"}, {"recovery", RecordJson(rec)}}});
    End(kExitPeerFailure, next.why, out);
    return;
  }
  if (next.leaving_kept) out->push_back(PrintLine{*next.leaving_kept});
  for (const std::string& host : next.leave_refused_hosts) hosts_[host].leave_refused = true;
  rec.replacements.insert(rec.replacements.end(), std::make_move_iterator(next.replacements.begin()),
                          std::make_move_iterator(next.replacements.end()));
  resize_.reset();  // the plan carried it out
  if (next.verdict == Verdict::kNoneLeft) {
    rec.outcome = "failed";
    End(kExitPeerFailure, next.why, out);
    return;
  }
  ApplyPlan(std::move(next), rec, out);
}

void Controller::ApplyPlan(NextGeneration next, RecoveryRecord& rec, std::vector<Action>* out) {
  const size_t world = next.members.size();
  for (int id : next.released) {
    WorkerInfo& w = workers_[id];
    SetRole(w, WorkerRole::kGone);
    if (!w.host.empty()) ++withheld_[w.host];  // capacity given back: not refilled until a grow
    out->push_back(SendShutdown{id, {fmt::format("released: the world shrinks to {}", world), kExitOk}});
  }
  if (world != members_.size()) {
    last_change_at_ = now_;
    change_times_.push_back(now_);
  }
  std::vector<WorkerInfo*> next_info(world);
  for (size_t r = 0; r < world; ++r) {
    // Most keep their rank: their entry is known.
    next_info[r] = r < members_.size() && members_[r] == next.members[r] ? member_info_[r] : &workers_[next.members[r]];
  }
  ++generation_;
  SetMembers(std::move(next.members), std::move(next_info));
  arrivals_.clear();
  arrival_step_ = -1;
  arrival_spreads_ms_.clear();  // a new membership has its own normal
  resume_step_ = next.s_star + 1;
  close_scan_ = 0;
  rec.to_generation = generation_;
  rec.resume_step = resume_step_;
  rec.lost_steps = std::max<int64_t>(0, highest_step_ - next.s_star);
  rec.new_world = static_cast<int>(world);
  rec.sources = static_cast<int>(next.holders.size());

  auto plan_ptr = std::make_shared<control::PlanMsg>();
  control::PlanMsg& plan = *plan_ptr;
  plan.generation = generation_;
  plan.resume_step = resume_step_;
  plan.faults = pending_faults_;
  plan.reason = rec.kind == "resize" ? "resize: " + rec.causes.front() : "recovery";
  plan.members.reserve(world);
  for (size_t r = 0; r < world; ++r) {
    WorkerInfo& w = *member_info_[r];
    SetRole(w, WorkerRole::kMember);
    w.rank = static_cast<int>(r);
    w.last_heard = now_;
    w.waiting_ms = -1;
    w.last_step = next.had_step[r];
    plan.members.push_back({w.worker_id, w.address});
  }
  json transfers = json::array();
  for (NextGeneration::Transfer& t : next.transfers) {
    transfers.push_back({{"receiver", t.receiver}, {"sources", t.sources}, {"had_step", t.had_step}});
    plan.transfers.push_back({t.receiver, std::move(t.sources)});
  }
  SetShardMoves(std::move(next.shard_moves), &plan, shard_group_);
  ready_.clear();
  phase_ = JobPhase::kRunning;
  progress_at_ = now_;
  rec.plan_at = now_;
  std::shared_ptr<const control::PlanMsg> shared = std::move(plan_ptr);
  out->reserve(out->size() + members_.size() + next.spares_used + 4);
  for (int id : members_) out->push_back(SendPlan{id, shared});
  for (size_t i = 0; i < next.spares_used && (pool_size_ > 0 || slotted()); ++i) {
    if (slotted()) break;  // the hosts' free slots are filled on the next tick
    Spawn(next_worker_id_++, /*spare=*/true, /*resume=*/false, /*background=*/true, out);
    ++rec.spawned_spares;
  }
  json record = {{"event", "plan"}, {"generation", generation_}, {"members", members_}, {"spares", SpareCount()},
                 {"resume_step", resume_step_}, {"reason", plan.reason}, {"recovery", rec.id},
                 {"transfers", std::move(transfers)}, {"released", next.released}};
  if (!plan.shard_moves.empty()) record["shard_moves"] = ShardMovesJson(plan);
  out->push_back(AppendJournal{std::move(record)});
  out->push_back(PrintLine{fmt::format("generation {}: {} workers {}, resuming at step {}{}", generation_, members_.size(),
                                       json(members_).dump(), resume_step_,
                                       plan.transfers.empty() ? "" : fmt::format(", {} receiving state from {} source(s)",
                                                                                 plan.transfers.size(),
                                                                                 next.holders.size()))});
  CheckShardPlacement(out);
}
void Controller::On(const RecoveredReceived& e, std::vector<Action>* out) {
  if (e.msg.generation == generation_ && e.msg.connections >= 0 && e.msg.connections_opened >= 0) {
    // Connection setup at scale: each rank opens only what its algorithms need.
    json rec = PerMemberRecord("connections", e.worker_id);
    rec["generation"] = generation_;
    rec["rank"] = RankOf(e.worker_id);
    rec["open"] = e.msg.connections;
    rec["opened_total"] = e.msg.connections_opened;
    out->push_back(AppendJournal{std::move(rec)});
  }
  if (!open_recovery_ || e.msg.generation != generation_) return;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  rec.connect_seconds = std::max(rec.connect_seconds, e.msg.connect_seconds);
  rec.transfer_seconds = std::max(rec.transfer_seconds, e.msg.transfer_seconds);
  rec.bytes_copied += e.msg.bytes_received;
  rec.refetched_chunks += e.msg.refetched_chunks;
  if (++rec.recovered_reports == static_cast<int>(members_.size())) rec.state_ready_at = now_;
  MaybeCloseRecovery(out);
}

void Controller::MaybeCloseRecovery(std::vector<Action>* out) {
  if (!open_recovery_ || phase_ != JobPhase::kRunning) return;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  for (; close_scan_ < members_.size(); ++close_scan_) {
    const WorkerInfo& w = *member_info_[close_scan_];
    if (w.last_step < rec.resume_step && w.role != WorkerRole::kFinished) return;
  }
  rec.first_step_at = now_;
  if (!rec.state_ready_at) rec.state_ready_at = now_;
  rec.outcome = "completed";
  out->push_back(AppendJournal{{{"event", "recovery_end"}, {"recovery", RecordJson(rec)}}});
  open_recovery_.reset();
}

void Controller::On(const InjectedReceived& e, std::vector<Action>* out) {
  auto it = std::find_if(pending_faults_.begin(), pending_faults_.end(),
                         [&](const control::FaultSpec& f) { return f.id == e.msg.fault_id; });
  if (it != pending_faults_.end()) pending_faults_.erase(it);
  out->push_back(AppendJournal{{{"event", "fault_injected"}, {"worker_id", e.worker_id}, {"fault", e.msg.description}}});
  // The worker announces the fault on its control connection and then
  // carries it out; its exit may reach the controller first (the launcher's
  // report comes on another connection). The recovery that exit opened is
  // still this fault's: it is named there (when the fault happened is not
  // known then, so fault_at stays unset).
  if (open_recovery_) {
    RecoveryRecord& rec = recoveries_[*open_recovery_];
    auto w = workers_.find(e.worker_id);
    if (rec.injected.empty() && w != workers_.end() && now_ - rec.detected_at < std::chrono::seconds(10) &&
        std::any_of(rec.causes.begin(), rec.causes.end(),
                    [&](const std::string& c) { return c.rfind(Describe(w->second), 0) == 0; })) {
      rec.injected = e.msg.description;
      return;
    }
  }
  last_injected_ = {now_, e.msg.description};
}

// ---------------------------------------------------------------- elasticity

PlanPolicy Controller::SizePolicy() const {
  const ScalePolicy& p = options_.policy;
  return PlanPolicy{p.min_world, p.max_world > 0 ? p.max_world : world_size_, p.allowed_sizes, p.increment};
}

std::string Controller::CheckSize(int size) const { return CheckWorldSize(SizePolicy(), shard_group_, size); }

Millis Controller::EffectiveStablePeriod() const {
  const ScalePolicy& p = options_.policy;
  int recent = 0;
  for (auto t : change_times_) recent += now_ - t < p.backoff_window ? 1 : 0;
  int extra = std::max(0, recent - p.backoff_changes);
  return p.stable_period * (1 << std::min(extra, 3));
}

void Controller::On(const ScaleRequest& e, std::vector<Action>* out) {
  auto refuse = [&](int status, const std::string& why) {
    out->push_back(ScaleReply{e.request_id, status, {{"accepted", false}, {"error", why}}});
    out->push_back(AppendJournal{{{"event", "scale_refused"}, {"request", e.body}, {"source", e.source}, {"reason", why}}});
  };
  const json& b = e.body;
  int world = static_cast<int>(members_.size());
  int target = -1;
  // Sizes are bounded before any arithmetic: {"grow": 2147483647} must not overflow.
  constexpr int64_t kMaxWorld = 1 << 20;
  auto as_int = [&](const char* key) -> std::optional<int> {
    if (!b.is_object() || !b.contains(key)) return std::nullopt;
    if (!b[key].is_number_integer()) return -1000000;
    int64_t v = b[key].is_number_unsigned() && b[key].get<uint64_t>() > static_cast<uint64_t>(kMaxWorld)
                    ? kMaxWorld + 1
                    : b[key].get<int64_t>();
    if (v <= 0 || v > kMaxWorld) return -1000000;
    return static_cast<int>(v);
  };
  if (auto v = as_int("world_size")) target = *v;
  else if (auto r = as_int("release")) target = *r <= 0 ? -1000000 : world - *r;
  else if (auto g = as_int("grow")) target = *g <= 0 ? -1000000 : world + *g;
  else return refuse(400, R"(expected {"world_size": N}, {"release": N} or {"grow": N})");
  if (target == -1000000 || (b.size() != 1)) {
    return refuse(400, R"(expected exactly one of world_size, release or grow, with a positive integer up to 1048576)");
  }
  if (phase_ != JobPhase::kRunning) {
    return refuse(409, fmt::format("a membership change is in progress (the job is {}); retry shortly",
                                   phase_ == JobPhase::kForming ? "forming" : "recovering"));
  }
  if (finished_ > 0) return refuse(409, "the job is finishing");
  if (std::string why = CheckSize(target); !why.empty()) return refuse(422, why + " (" + PolicyJson().dump() + ")");
  Millis stable = EffectiveStablePeriod();
  if (last_change_at_ && now_ - *last_change_at_ < stable) {
    return refuse(429, fmt::format("too soon: the last change was {:.1f} s ago and the stable period is {:.1f} s{}",
                                   Ms(now_ - *last_change_at_) / 1000, stable.count() / 1000.0,
                                   stable > options_.policy.stable_period ? " (backed off: changes came too often)" : ""));
  }
  target_world_ = target;
  out->push_back(AppendJournal{{{"event", "scale_request"}, {"request", b}, {"source", e.source}, {"from", world},
                                {"to", target}}});
  out->push_back(ScaleReply{e.request_id, 202, {{"accepted", true}, {"world_size", target}, {"from", world},
                                                {"generation", generation_}}});
  if (target < world) {
    StartResize(target, fmt::format("shrink on request ({})", e.source), out);
  } else if (target > world) {
    // Declared capacity: start the workers that are missing; the job grows when they have joined.
    // (On hosts, capacity is the hosts' slots: slots given back by a shrink
    // are filled again; beyond them the job grows when a host brings some.)
    if (slotted()) {
      withheld_.clear();
      TopUpHosts(out);
    } else {
      for (int i = SpareCount(); i < target - world; ++i) Spawn(next_worker_id_++, /*spare=*/true, false, false, out);
    }
    MaybeGrow(out);
  }
}

void Controller::MaybeGrow(std::vector<Action>* out) {
  if (AdoptionPending()) return;  // a takeover: the inherited join first
  if (phase_ != JobPhase::kRunning || finished_ > 0) return;
  int world = static_cast<int>(members_.size());
  if (target_world_ <= world || SpareCount() == 0) return;
  if (last_change_at_ && now_ - *last_change_at_ < EffectiveStablePeriod()) return;  // a Tick retries
  // Capacity often arrives a worker at a time: wait a little for all of it,
  // so that one change (one pause) takes the job to its target.
  if (world + SpareCount() < target_world_) {
    if (!grow_waiting_since_) grow_waiting_since_ = now_;
    if (now_ - *grow_waiting_since_ < options_.grow_gather) return;
  }
  grow_waiting_since_.reset();
  int to = std::min(target_world_, world + SpareCount());
  while (to > world && !CheckSize(to).empty()) --to;  // the largest allowed size we can reach now
  if (to <= world) return;
  StartResize(to, fmt::format("grow: {} spare worker(s) available", SpareCount()), out);
}

void Controller::StartResize(int new_world, const std::string& trigger, std::vector<Action>* out,
                             std::set<int> release) {
  StartRecovery(trigger, out, /*planned=*/true);
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  rec.kind = "resize";
  resize_ = PlannedResize{new_world, std::move(release)};
  // Members stop at the first step boundary at or after `after`: the step
  // they are computing now completes; nothing is dropped.
  control::DrainMsg drain{generation_, highest_step_ + 1, trigger};
  abort_deadline_ = now_ + options_.abort_timeout + std::chrono::duration_cast<Millis>(
                                                       std::chrono::duration<double>(10 * MedianStepSeconds()));
  for (int id : members_) {
    if (IsLiveMember(workers_[id])) out->push_back(SendDrain{id, drain});
  }
  out->push_back(PrintLine{fmt::format("resize: world {} → {} at the step boundary after step {} ({})", members_.size(),
                                       new_world, drain.after_step, trigger)});
}

// ---------------------------------------------------------------- hosts

void Controller::On(const HostJoined& e, std::vector<Action>* out) {
  const auto& m = e.msg;
  auto refuse = [&](const std::string& why) {
    out->push_back(AppendJournal{{{"event", "host_refused"}, {"host", m.host_id}, {"reason", why}}});
    out->push_back(PrintLine{fmt::format("agent of host {} refused: {}", m.host_id, why)});
    out->push_back(CloseHost{m.host_id, why, kExitUsage});
  };
  if (!multi_host()) return refuse("this job runs on one machine (nonstop run): it takes no agents");
  auto it = hosts_.find(m.host_id);
  if (it != hosts_.end() && it->second.inherited) return HostRejoined(it->second, m, out);
  if (it != hosts_.end() && it->second.alive) return refuse(fmt::format("host id {} is already in the job", m.host_id));
  if (m.running != static_cast<int>(m.workers.size())) {
    return refuse(fmt::format("the agent still supervises {} process(es) from before but does not list them; it "
                              "must stop them first",
                              m.running));
  }
  const int alive = alive_hosts_;
  if (options_.max_hosts > 0 && alive >= options_.max_hosts) {
    return refuse(fmt::format("the job already has its maximum of {} hosts", options_.max_hosts));
  }
  if (!elastic_host_.empty() && m.host_id != elastic_host_) {
    return refuse(fmt::format("this job's one host is {}, nonstop run's own: it takes no other agents",
                              elastic_host_));
  }
  if (m.elastic && elastic_host_.empty() && (options_.max_hosts != 1 || placed_)) {
    return refuse("an agent whose capacity follows the job (nonstop run's own) can only be the one host of a job "
                  "of one host (--nnodes 1)");
  }
  HostInfo& h = it != hosts_.end() ? it->second : AddHost(m.host_id);
  h.nproc = m.nproc;
  h.spares = m.spares;
  h.address = m.address;
  h.pid = m.pid;
  h.alive = true;
  h.elastic = m.elastic || m.host_id == elastic_host_;
  if (h.elastic) {
    elastic_host_ = m.host_id;
    pool_size_ = m.spares;
  }
  ++alive_hosts_;
  h.lost_reason.clear();
  h.leaving = false;
  h.leave_reason.clear();
  h.leave_refused = false;
  h.member_lost = false;
  h.last_heard = now_;
  ++h.incarnation;
  host_refill_failures_.erase(m.host_id);  // a fresh start for its slots
  withheld_.erase(m.host_id);
  out->push_back(AppendJournal{{{"event", "host_join"}, {"host", m.host_id}, {"nproc", m.nproc}, {"spares", m.spares},
                                {"address", m.address}, {"incarnation", h.incarnation}, {"elastic", m.elastic}}});
  // Processes it kept from before (it was cut off, and the job went on
  // without them): none may take part again.
  for (const auto& [id, pid] : m.workers) {
    auto w = workers_.find(id);
    if (w != workers_.end() && w->second.role != WorkerRole::kGone) continue;  // cannot be: its host was lost
    FenceProcess(m.host_id, id, pid, "its host was lost; the job went on without it", out);
  }
  out->push_back(PrintLine{fmt::format("host {} ({}) registered{}: {} worker(s), {} spare(s)", m.host_id, m.address,
                                       h.incarnation > 1 ? " again" : "", m.nproc, m.spares)});
  if (!placed_) {
    if (alive + 1 >= options_.min_hosts) PlaceOnHosts(/*resume=*/false, out);
    return;
  }
  // A host that comes (back) after the start brings spares: the pool, or
  // capacity the job grows into (policy permitting).
  TopUpHosts(out);
}

HostInfo& Controller::AddHost(const std::string& host_id) {
  HostInfo& h = hosts_[host_id];
  h.host_id = host_id;
  host_order_.push_back(host_id);
  host_list_.push_back(&h);
  return h;
}

void Controller::PlaceOnHosts(bool resume, std::vector<Action>* out) {
  int world = 0;
  for (const HostInfo* h : host_list_) world += h->alive && !h->leaving ? h->nproc : 0;
  if (world == 0) {
    out->push_back(PrintLine{"the registered hosts bring no workers (all --nproc-per-host 0): waiting for more"});
    return;
  }
  placed_ = true;
  world_size_ = world;
  target_world_ = std::max(target_world_, std::max(world_size_, options_.policy.max_world));
  if (!resume) forming_since_ = now_;
  for (const HostInfo* hp : host_list_) {
    const HostInfo& h = *hp;
    if (!h.alive) continue;
    for (int i = 0; i < h.nproc + h.spares && FreeSlots(h) > 0; ++i) {
      Spawn(next_worker_id_++, /*spare=*/i >= h.nproc, resume, /*background=*/false, out, h.host_id);
    }
  }
  out->push_back(PrintLine{fmt::format("placed on {} host(s): world {}", host_order_.size(), world_size_)});
}

int Controller::FreeSlots(const HostInfo& h) const {
  if (h.leaving) return 0;  // its capacity is being taken back
  auto it = live_on_host_.find(h.host_id);
  int used = it == live_on_host_.end() ? 0 : it->second;
  auto w = withheld_.find(h.host_id);
  used += w == withheld_.end() ? 0 : w->second;
  return std::max(0, h.nproc + h.spares - used);
}

bool Controller::HostResponsive(const std::string& host_id) const {
  if (host_id.empty()) return true;
  auto it = hosts_.find(host_id);
  return it != hosts_.end() && it->second.alive && !it->second.inherited && !it->second.leaving &&
         now_ - it->second.last_heard <= options_.heartbeat_timeout / 2;
}

void Controller::EscalateResize(std::vector<Action>* out) {
  if (!open_recovery_ || phase_ != JobPhase::kRecovering) return;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  if (rec.kind != "resize") return;
  rec.kind = "recovery";  // a fault now, not a planned change
  abort_deadline_ = now_ + std::max(options_.abort_timeout,
                                    std::chrono::duration_cast<Millis>(
                                        std::chrono::duration<double>(1.5 * MedianStepSeconds())));
  auto abort = std::make_shared<const control::AbortMsg>(
      control::AbortMsg{generation_, "a member was lost during a resize"});
  for (int id : members_) {
    if (IsLiveMember(workers_[id]) && !ready_.count(id)) out->push_back(SendAbort{id, abort});
  }
  out->push_back(AppendJournal{{{"event", "resize_aborted"}, {"recovery", rec.id}, {"generation", generation_}}});
}

void Controller::ReplaceFormingWorker(const std::string& lost_host, std::vector<Action>* out) {
  for (auto& [id, w] : workers_) {
    if (w.role == WorkerRole::kSpare && !w.stopped && w.host != lost_host && HostResponsive(w.host)) {
      SetRole(w, WorkerRole::kPending);
      out->push_back(PrintLine{fmt::format("spare worker {} on host {} takes the place of a worker of host {}", id,
                                           w.host, lost_host)});
      return;
    }
  }
  for (const HostInfo* h : host_list_) {
    if (h->alive && FreeSlots(*h) > 0) {
      Spawn(next_worker_id_++, /*spare=*/false, /*resume=*/open_recovery_.has_value(), /*background=*/false, out,
            h->host_id);
      return;
    }
  }
  if (world_size_ - 1 >= std::max(1, options_.policy.min_world)) {
    --world_size_;
    out->push_back(PrintLine{fmt::format("no spare or free slot for a worker of host {}: the job forms with {} "
                                         "workers", lost_host, world_size_)});
    return;
  }
  End(kExitPeerFailure, fmt::format("host {} was lost while the job formed, and no other host can take its "
                                    "workers (the policy's minimum world is {})", lost_host,
                                    options_.policy.min_world),
      out);
}

void Controller::TopUpHosts(std::vector<Action>* out) {
  if (!placed_) return;  // the placement starts every host's workers
  if (!slotted()) return;  // an elastic host has no slots to fill: its spare pool refills as on one machine
  for (const HostInfo* hp : host_list_) {
    const HostInfo& h = *hp;
    if (!h.alive || h.inherited) continue;  // an inherited agent takes orders once it has joined this controller
    if (auto f = host_refill_failures_.find(h.host_id); f != host_refill_failures_.end() && f->second > 3) continue;
    for (int free = FreeSlots(h); free > 0; --free) {
      Spawn(next_worker_id_++, /*spare=*/true, /*resume=*/false, /*background=*/placed_ && phase_ != JobPhase::kForming,
            out, h.host_id);
    }
  }
}

void Controller::RefillSpare(std::vector<Action>* out) {
  if (slotted()) {
    TopUpHosts(out);  // wherever a slot is free; none: the pool waits for capacity
    return;
  }
  Spawn(next_worker_id_++, /*spare=*/true, /*resume=*/false, /*background=*/true, out);
}

void Controller::On(const HostHeartbeat& e, std::vector<Action>*) {
  auto it = hosts_.find(e.host_id);
  if (it != hosts_.end() && it->second.alive) it->second.last_heard = now_;
}

void Controller::On(const HostLost& e, std::vector<Action>* out) { HostDown(e.host_id, e.reason, out); }

void Controller::On(const WorkerStarted& e, std::vector<Action>* out) {
  if (HostOf(e.msg.worker_id) != e.host_id) return;  // not its worker
  if (!e.msg.error.empty() || e.msg.pid <= 0) {
    // As if it had died while starting.
    On(ProcessExited{e.msg.worker_id, 0, 127, 0, e.host_id}, out);
    return;
  }
  out->push_back(AppendJournal{{{"event", "spawn"}, {"worker_id", e.msg.worker_id}, {"pid", e.msg.pid},
                                {"host", e.host_id}}});
}

// ---------------------------------------------------------------- takeover

void Controller::On(const Takeover& e, std::vector<Action>* out) {
  const TakeoverState& s = e.state;
  takeovers_ = s.takeovers + 1;
  recovery_id_base_ = s.recoveries;
  if (!multi_host() || s.generation == 0 || s.members.empty()) {
    End(kExitUsage,
        s.generation == 0 ? "the job had not formed when its controller stopped: there is nothing to take over; start "
                            "the job again"
                          : "taking over needs a job whose workers are supervised by agents (nonstop controller "
                            "--nnodes …; nonstop agent on each host)",
        out);
    return;
  }
  generation_ = s.generation;
  takeover_generation_ = s.generation;
  adopt_until_ = now_ + options_.adopt_timeout;
  resume_step_ = s.resume_step;
  highest_step_ = s.highest_step;
  last_journaled_step_ = s.highest_step;
  next_worker_id_ = std::max(next_worker_id_, s.next_worker_id);
  // The inherited must join within adopt_timeout: until then they count as heard from.
  const Clock::time_point grace = now_ + options_.adopt_timeout - options_.heartbeat_timeout;
  world_size_ = 0;
  for (const auto& sh : s.hosts) {
    if (hosts_.count(sh.host_id)) continue;
    HostInfo& h = AddHost(sh.host_id);
    h.nproc = sh.nproc;
    h.spares = sh.spares;
    h.address = sh.address;
    h.incarnation = sh.incarnation;
    h.elastic = sh.elastic && s.hosts.size() == 1;
    if (h.elastic) {
      elastic_host_ = sh.host_id;
      pool_size_ = sh.spares;
    }
    h.alive = true;
    h.inherited = true;
    h.last_heard = grace;
    ++alive_hosts_;
    world_size_ += sh.nproc;
  }
  placed_ = true;
  target_world_ = std::max({target_world_, world_size_, options_.policy.max_world});
  // A scale request's target stands across controllers, and so do the slots its shrink gave back:
  // without them the new controller would grow the job back at once.
  if (s.target_world > 0) target_world_ = s.target_world;
  withheld_ = s.withheld;
  std::set<int> member_set(s.members.begin(), s.members.end());
  for (const auto& sw : s.workers) {
    if (!sw.host.empty()) host_of_[sw.worker_id] = sw.host;
    MarkLive(sw.worker_id);
    if (sw.address.empty() && !member_set.count(sw.worker_id)) {
      awaiting_join_[sw.worker_id] = AwaitedJoin{sw.spare, now_};  // started, not joined yet: it may still
      continue;
    }
    WorkerInfo& w = workers_[sw.worker_id];
    w = WorkerInfo{};
    w.worker_id = sw.worker_id;
    w.pid = sw.pid;
    w.address = sw.address;
    w.host = sw.host;
    w.role = WorkerRole::kGone;
    SetRole(w, member_set.count(sw.worker_id) ? WorkerRole::kMember : WorkerRole::kSpare);
    w.last_heard = grace;
    w.last_step = s.resume_step - 1;
    unconfirmed_.insert(sw.worker_id);
  }
  // A member the journal saw end keeps its rank, gone: the recovery below
  // gives its rank to a spare, as it would have before the takeover.
  int ended = 0;
  for (int id : s.members) {
    if (workers_.count(id)) continue;
    WorkerInfo& w = workers_[id];
    w.worker_id = id;
    w.role = WorkerRole::kGone;
    w.how_it_ended = "ended before the takeover";
    ++ended;
  }
  SetMembers(s.members);
  for (size_t r = 0; r < members_.size(); ++r) member_info_[r]->rank = static_cast<int>(r);
  phase_ = JobPhase::kRunning;
  progress_at_ = now_;
  out->push_back(AppendJournal{{{"event", "takeover"}, {"takeover", takeovers_}, {"generation", generation_},
                                {"members", members_}, {"highest_step", highest_step_},
                                {"workers", unconfirmed_.size()}, {"hosts", host_order_}}});
  out->push_back(PrintLine{fmt::format(
      "taking over the job (controller #{}): generation {}, {} members, {} host(s), last completed step {}; waiting "
      "up to {} ms for the workers and agents to join",
      takeovers_ + 1, generation_, members_.size(), host_order_.size(), highest_step_, options_.adopt_timeout.count())});
  if (ended > 0) {
    StartRecovery(fmt::format("{} member(s) of generation {} ended before the takeover", ended, generation_), out);
  }
}

void Controller::Rejoined(const control::JoinMsg& m, std::vector<Action>* out) {
  WorkerInfo& w = workers_[m.worker_id];
  if (m.generation > takeover_generation_ + 1) {
    // Plans go out one generation at a time, each recorded before the next:
    // a worker can be at most one ahead of the journal. It lies, or is broken.
    std::string why = fmt::format("rejoined claiming generation {}, but the journal's last is {}", m.generation,
                                  takeover_generation_);
    out->push_back(AppendJournal{{{"event", "join_refused"}, {"worker_id", m.worker_id}, {"reason", why}}});
    out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, kExitPeerFailure}});
    return;  // still unconfirmed: lost at the adoption bound
  }
  unconfirmed_.erase(m.worker_id);
  w.held_shard = m.held_shard;
  w.pid = m.pid;
  w.address = m.data_address;
  w.last_heard = now_;
  out->push_back(AppendJournal{{{"event", "rejoin"}, {"worker_id", m.worker_id}, {"pid", m.pid},
                                {"generation", m.generation}, {"waiting", m.waiting}, {"state_step", m.state_step},
                                {"role", w.role == WorkerRole::kSpare ? "spare" : "member"}}});
  // A generation newer than the journal's: a plan the previous controller
  // sent but did not record. The next plan must be newer still.
  bool out_of_sync = m.generation > takeover_generation_;
  generation_ = std::max(generation_, m.generation);
  if (w.role == WorkerRole::kSpare) {
    if (out_of_sync && phase_ == JobPhase::kRunning) {
      StartRecovery(fmt::format("spare worker {} is in generation {}, which the journal does not know",
                                m.worker_id, m.generation), out);
    }
    return;
  }
  w.last_step = std::max<int64_t>(-1, m.state_step);
  highest_step_ = std::max(highest_step_, m.state_step);
  // A member that never adopted a plan (a spare promoted by a plan it did not
  // get) waits for one, holding what its state holds.
  const bool waiting = m.waiting || m.generation == 0;
  if (waiting || m.generation != takeover_generation_) {
    // It left its generation (the previous controller was recovering), or it
    // is not in the one the journal names: the members form a new one.
    if (phase_ == JobPhase::kRunning) {
      StartRecovery(waiting ? fmt::format("worker {} was between generations when the previous controller stopped",
                                            m.worker_id)
                              : fmt::format("worker {} is in generation {}, the journal's last plan is generation {}",
                                            m.worker_id, m.generation, generation_),
                    out);
    }
  }
  if (phase_ != JobPhase::kRecovering) return;
  if (waiting) {
    ready_[m.worker_id] = m.state_step;
    out->push_back(AppendJournal{{{"event", "ready"}, {"worker_id", m.worker_id}, {"rank", w.rank},
                                  {"generation", m.generation}, {"step", m.state_step}, {"reason", "rejoined"}}});
    MaybeFinishAbort(out);
  } else {
    // The abort went out while it had no controller: it gets it now.
    out->push_back(SendAbort{m.worker_id, std::make_shared<const control::AbortMsg>(control::AbortMsg{
                                              generation_, "a controller took over during a recovery"})});
  }
}

void Controller::HostRejoined(HostInfo& h, const control::AgentRegisterMsg& m, std::vector<Action>* out) {
  if (m.running != static_cast<int>(m.workers.size())) {
    // Without the list, this controller cannot tell which processes it inherits.
    std::string why = fmt::format("the agent supervises {} process(es) but lists {}", m.running, m.workers.size());
    out->push_back(AppendJournal{{{"event", "host_refused"}, {"host", m.host_id}, {"reason", why}}});
    out->push_back(CloseHost{m.host_id, why, kExitUsage});
    return;  // still inherited: lost at the adoption bound
  }
  h.inherited = false;
  h.last_heard = now_;
  h.pid = m.pid;
  h.address = m.address;
  ++h.incarnation;
  out->push_back(AppendJournal{{{"event", "host_rejoin"}, {"host", h.host_id}, {"running", m.running},
                                {"incarnation", h.incarnation}}});
  out->push_back(PrintLine{fmt::format("host {} ({}) joined this controller with {} running worker(s)", h.host_id,
                                       m.address, m.running)});
  std::set<int> listed;
  for (const auto& [id, pid] : m.workers) {
    auto w = workers_.find(id);
    bool known = HostOf(id) == h.host_id && live_processes_.count(id) &&
                 ((w != workers_.end() && w->second.role != WorkerRole::kGone) || awaiting_join_.count(id));
    if (known) {
      listed.insert(id);
      continue;
    }
    FenceProcess(h.host_id, id, pid, "the job does not count on it (it left before the takeover)", out);
    listed.insert(id);  // dying, not dead: its slot is free when its exit is reported
  }
  // Processes of this host that the agent no longer runs ended while no controller led.
  std::vector<int> ended;
  for (const auto& [id, host] : host_of_) {
    if (host == h.host_id && live_processes_.count(id) && !listed.count(id)) ended.push_back(id);
  }
  for (int id : ended) {
    auto w = workers_.find(id);
    On(ProcessExited{id, w == workers_.end() ? 0 : w->second.pid, -1, 0, h.host_id}, out);
  }
  host_refill_failures_.erase(h.host_id);
  TopUpHosts(out);  // slots that ended while no controller led take spares again
}

void Controller::FenceProcess(const std::string& host, int worker_id, int64_t pid, const std::string& why,
                              std::vector<Action>* out) {
  if (auto it = host_of_.find(worker_id); it != host_of_.end() && it->second != host) {
    // The id belongs to a worker of another host: this agent's process is a stranger.
    out->push_back(AppendJournal{{{"event", "report_ignored"}, {"host", host}, {"worker_id", worker_id},
                                  {"reason", "an agent listed a process under another host's worker id"}}});
    return;
  }
  host_of_[worker_id] = host;
  if (worker_id < (1 << 30)) next_worker_id_ = std::max(next_worker_id_, worker_id + 1);  // never reused
  MarkLive(worker_id);  // it holds a slot until its exit is seen
  out->push_back(SignalWorker{worker_id, SIGKILL});
  out->push_back(AppendJournal{{{"event", "fence"}, {"host", host}, {"worker_id", worker_id}, {"pid", pid},
                                {"reason", why}}});
}

// The loss of a host is the loss of every worker on it, at once: one recovery.
void Controller::HostDown(const std::string& host_id, const std::string& reason, std::vector<Action>* out) {
  auto hit = hosts_.find(host_id);
  if (hit == hosts_.end() || !hit->second.alive) return;
  HostInfo& h = hit->second;
  h.alive = false;
  h.inherited = false;
  --alive_hosts_;
  h.lost_reason = reason;
  std::vector<int> members, others;
  int unjoined_workers = 0;  // workers the forming job waits for that will never join
  for (const auto& [id, host] : host_of_) {
    if (host != host_id) continue;
    MarkEnded(id);  // the host and all its processes are gone (or fenced)
    if (auto a = awaiting_join_.find(id); a != awaiting_join_.end()) {
      if (!a->second.spare && phase_ == JobPhase::kForming) ++unjoined_workers;
      awaiting_join_.erase(a);
    }
    auto w = workers_.find(id);
    if (w == workers_.end()) continue;
    if (IsLiveMember(w->second)) members.push_back(id);
    else if (w->second.role != WorkerRole::kGone) others.push_back(id);
  }
  std::vector<int> ranks;
  for (int id : members) ranks.push_back(workers_[id].rank);
  // A host that asked to leave and whose members were all released has left
  // as planned; one that still held members when it went is a fault like any other.
  const bool left = h.leaving && members.empty() && !h.member_lost;
  out->push_back(AppendJournal{{{"event", left ? "host_left" : "host_lost"}, {"host", host_id}, {"reason", reason},
                                {"members", members}, {"ranks", ranks}, {"others", others}}});
  if (left) {
    out->push_back(PrintLine{fmt::format("host {} left the job ({}); its workers were released", host_id,
                                         h.leave_reason)});
  } else {
    out->push_back(PrintLine{fmt::format("host {} lost: {}{}; {} member(s) on it {}", host_id, reason,
                                         h.leaving ? " (it was leaving, but its members were not released yet)" : "",
                                         members.size(), json(ranks).dump())});
  }
  for (int id : others) {  // its spares first: none of them may replace a worker of the same host
    WorkerInfo& w = workers_[id];
    if (w.role != WorkerRole::kSpare) continue;
    SetRole(w, WorkerRole::kGone);
    out->push_back(KillWorker{id});
  }
  for (int id : others) {  // workers of a job still forming
    if (workers_[id].role != WorkerRole::kPending) continue;
    WorkerUnresponsive(id, "host lost", fmt::format("was on host {} ({})", host_id, reason), out);
    if (phase_ == JobPhase::kEnded) return;
  }
  for (int i = 0; i < unjoined_workers && phase_ == JobPhase::kForming; ++i) ReplaceFormingWorker(host_id, out);
  if (phase_ == JobPhase::kEnded) return;
  if (unjoined_workers > 0) MaybeFormFirstGeneration(out);
  if (members.empty()) {
    // Its members may already be gone, each noticed on its own (their control
    // connections closed first): the open recovery names the host too.
    if (open_recovery_ && recoveries_[*open_recovery_].failed_hosts.count(host_id)) {
      recoveries_[*open_recovery_].causes.push_back(fmt::format("host {} lost ({})", host_id, reason));
    }
    TopUpHosts(out);
    return;
  }
  if (options_.recovery == RecoveryMode::kCheckpointRestart) {
    for (int id : members) MemberFault(id, "host lost", fmt::format("was on host {} ({})", host_id, reason), out);
    return;
  }
  std::string what = fmt::format("host {} lost ({}): ", host_id, reason);
  for (size_t i = 0; i < members.size(); ++i) {
    WorkerInfo& w = workers_[members[i]];
    what += (i ? ", " : "") + fmt::format("rank {} (worker {})", w.rank, w.worker_id);
    SetRole(w, WorkerRole::kGone);
    ready_.erase(w.worker_id);
    out->push_back(AppendJournal{{{"event", "fault"}, {"kind", "host lost"}, {"worker_id", w.worker_id},
                                  {"rank", w.rank}, {"pid", w.pid}, {"host", host_id}, {"detail", reason},
                                  {"last_step", w.last_step}, {"generation", generation_}}});
    out->push_back(KillWorker{w.worker_id});
  }
  out->push_back(PrintLine{"fault: " + what});
  if (phase_ == JobPhase::kRecovering) {
    recoveries_[*open_recovery_].causes.push_back(what);
    recoveries_[*open_recovery_].failed_hosts.insert(host_id);
    EscalateResize(out);
    MaybeFinishAbort(out);
  } else {
    StartRecovery(what, out);
  }
}

// ---------------------------------------------------------------- a host leaves

// Its capacity is taken back (a Slurm preemption): what runs there goes
// without a fault. Spares and workers still starting are let go at once; the
// members are released at the next step boundary (MaybeReleaseLeavingHosts).
void Controller::On(const HostLeaving& e, std::vector<Action>* out) {
  auto it = hosts_.find(e.host_id);
  if (it == hosts_.end() || !it->second.alive || it->second.leaving) return;
  HostInfo& h = it->second;
  h.leaving = true;
  h.leave_reason = e.msg.reason.empty() ? "its agent asked" : e.msg.reason;
  h.leave_refused = false;
  std::vector<int> members, spares, starting;
  for (const auto& [id, host] : host_of_) {
    if (host != e.host_id || !live_processes_.count(id)) continue;
    auto w = workers_.find(id);
    if (w == workers_.end()) {
      starting.push_back(id);
    } else if (IsLiveMember(w->second)) {
      members.push_back(id);
    } else if (w->second.role == WorkerRole::kSpare) {
      spares.push_back(id);
    }
  }
  out->push_back(AppendJournal{{{"event", "host_leaving"}, {"host", e.host_id}, {"reason", h.leave_reason},
                                {"members", members}, {"spares", spares}, {"starting", starting}}});
  out->push_back(PrintLine{fmt::format("host {} leaves the job ({}): {} member(s) released at the next step "
                                       "boundary, {} spare(s) let go",
                                       e.host_id, h.leave_reason, members.size(), spares.size() + starting.size())});
  if (!placed_ || phase_ == JobPhase::kForming) {
    // Nothing trains yet: the job forms without the host, as if it were lost.
    HostDown(e.host_id, "left the job while it formed (" + h.leave_reason + ")", out);
    out->push_back(CloseHost{e.host_id, "released: the job formed without this host", kExitOk});
    return;
  }
  for (int id : spares) {
    WorkerInfo& w = workers_[id];
    SetRole(w, WorkerRole::kGone);
    out->push_back(SpareLostRecord(w, "released", fmt::format("host {} leaves the job", e.host_id)));
    out->push_back(SendShutdown{id, {fmt::format("released: host {} leaves the job", e.host_id), kExitOk}});
  }
  for (int id : starting) {  // no connection to tell it on yet
    awaiting_join_.erase(id);
    killed_before_join_.insert(id);
    out->push_back(KillWorker{id});
  }
  MaybeReleaseLeavingHosts(out);
}

bool Controller::Promotable(const WorkerInfo& w) const {
  return w.role == WorkerRole::kSpare && !w.stopped && now_ - w.last_heard <= options_.heartbeat_timeout &&
         HostResponsive(w.host) && !unconfirmed_.count(w.worker_id);
}

bool Controller::AdoptionPending() const {
  for (int id : unconfirmed_) {
    auto it = workers_.find(id);
    if (it == workers_.end() || it->second.role != WorkerRole::kGone) return true;
  }
  return false;
}

void Controller::MaybeReleaseLeavingHosts(std::vector<Action>* out) {
  // At a step boundary of a running job; a membership change in progress, or
  // a takeover's adoption, comes first (the Tick retries).
  // A recovery record still open (its first step not done) closes first, so
  // that it is not recorded as superseded by this planned change.
  if (phase_ != JobPhase::kRunning || finished_ > 0 || AdoptionPending() || resize_ || open_recovery_) return;
  std::vector<int> leaving;
  std::set<std::string> hosts;
  for (const WorkerInfo* w : member_info_) {
    if (!IsLiveMember(*w) || w->host.empty()) continue;
    auto h = hosts_.find(w->host);
    if (h == hosts_.end() || !h->second.leaving || h->second.leave_refused) continue;
    leaving.push_back(w->worker_id);
    hosts.insert(w->host);
  }
  if (leaving.empty()) return;
  const int world = static_cast<int>(members_.size());
  const int smaller = world - static_cast<int>(leaving.size());
  int spares = 0;  // those FormNextGeneration would promote
  for (const auto& [id, w] : workers_) spares += Promotable(w);
  // The smallest world the policy allows from the members that stay, with
  // spares elsewhere taking released ranks where it must be larger.
  int to = -1;
  for (int size = std::max(1, smaller); size <= world && to < 0; ++size) {
    if (size - smaller <= spares && CheckSize(size).empty()) to = size;
  }
  std::string names;
  for (const std::string& h : hosts) names += (names.empty() ? "" : ", ") + h;
  if (to < 0) {
    std::string why = smaller >= 1 ? CheckSize(smaller) : "no member would be left";
    std::string text = fmt::format("host(s) {} cannot leave at a step boundary: without their {} member(s) the world "
                                   "would be {} ({}), and {} spare(s) can take their ranks; they stay until their "
                                   "agent goes (then a host fault)",
                                   names, leaving.size(), smaller, why, spares);
    for (const std::string& h : hosts) hosts_[h].leave_refused = true;
    out->push_back(AppendJournal{{{"event", "host_leave_refused"}, {"hosts", hosts}, {"reason", text}}});
    out->push_back(PrintLine{text});
    return;
  }
  std::string reason = hosts_[*hosts.begin()].leave_reason;
  StartResize(to, fmt::format("host(s) {} leave ({})", names, reason), out, std::set<int>(leaving.begin(), leaving.end()));
}

void Controller::CheckShardPlacement(std::vector<Action>* out) {
  if (shard_group_ <= 1 || !multi_host()) return;
  auto layout = state::LayoutOf(static_cast<int>(members_.size()), shard_group_);
  if (!layout.ok()) return;
  std::vector<std::string> host_of_rank;
  for (const WorkerInfo* w : member_info_) host_of_rank.push_back(w->host);
  if (std::set<std::string>(host_of_rank.begin(), host_of_rank.end()).size() < 2) return;  // one host holds all anyway
  std::vector<int> exposed = state::ShardsOnOneHost(*layout, host_of_rank);
  if (exposed.empty()) return;
  out->push_back(AppendJournal{{{"event", "shard_placement"}, {"generation", generation_}, {"shards", exposed}}});
  out->push_back(PrintLine{fmt::format("generation {}: every copy of shard {} is on one host, whose loss would lose "
                                       "it (optimizer.shard_group {} over these hosts)", generation_,
                                       fmt::join(exposed, ", "), shard_group_)});
}

// ---------------------------------------------------------------- timers

void Controller::On(const Tick&, std::vector<Action>* out) {
  FireTimedFaults(out);
  CheckJoinDeadlines(out);
  if (phase_ == JobPhase::kEnded) return;
  CheckHeartbeats(out);
  if (phase_ == JobPhase::kEnded) return;
  if (slotted() && placed_) TopUpHosts(out);
  if (phase_ == JobPhase::kRecovering && now_ >= abort_deadline_) {
    // Escalation: members that could not abort in time are killed and replaced.
    std::vector<int> late;
    for (const WorkerInfo* w : member_info_) {
      if (IsLiveMember(*w) && !ready_.count(w->worker_id)) late.push_back(w->worker_id);
    }
    for (int id : late) {
      MemberFault(id, "did not abort in time",
                  fmt::format("no answer {} ms after the abort", options_.abort_timeout.count()), out);
      if (phase_ != JobPhase::kRecovering) return;
    }
  }
  if (phase_ == JobPhase::kRunning) CheckWatchdogs(out);
  if (phase_ == JobPhase::kRunning) CheckStall(out);
  if (phase_ == JobPhase::kRunning) MaybeReleaseLeavingHosts(out);
  if (phase_ == JobPhase::kRunning) MaybeGrow(out);
}

void Controller::CheckWatchdogs(std::vector<Action>* out) {
  // Hang detector: some members reached the collective of arrival_step_, and
  // one still computes far longer after the first arrival than the spread
  // between first and last arrival normally is.
  if (!open_recovery_ && arrival_spreads_ms_.size() >= 5 && !arrivals_.empty() && arrivals_.size() < members_.size()) {
    double normal = *std::max_element(arrival_spreads_ms_.begin(), arrival_spreads_ms_.end());
    double threshold = std::max({static_cast<double>(options_.hang_floor.count()), options_.hang_factor * normal,
                                 0.5 * MedianStepSeconds() * 1000.0});
    Clock::time_point first = Clock::time_point::max();
    for (const auto& [id, t] : arrivals_) first = std::min(first, t);
    double lag = Ms(now_ - first);
    if (lag > threshold) {
      for (int id : members_) {
        WorkerInfo& w = workers_[id];
        if (w.role != WorkerRole::kMember || arrivals_.count(id) || w.last_step >= arrival_step_) continue;
        MemberFault(id, "hang detector",
                    fmt::format("has not reached the collective of step {} {:.0f} ms after the first member did "
                                "(the last of the recent steps' arrivals came at most {:.0f} ms after the first)",
                                arrival_step_, lag, normal),
                    out);
        return;
      }
    }
  }
  // Step progress: someone has waited in a collective far longer than a step
  // takes, while a member is still computing: that member is stuck.
  double threshold_ms = std::max<double>(static_cast<double>(options_.watchdog_floor.count()),
                                         options_.watchdog_factor * MedianStepSeconds() * 1000.0);
  int64_t longest_wait = -1;
  for (const WorkerInfo* w : member_info_) longest_wait = std::max(longest_wait, w->waiting_ms);
  if (static_cast<double>(longest_wait) <= threshold_ms) return;
  for (int id : members_) {
    WorkerInfo& w = workers_[id];
    if (w.role == WorkerRole::kMember && w.waiting_ms < 0) {
      MemberFault(id, "step-progress watchdog",
                  fmt::format("has not reached the collective of step {} while others waited {} ms", w.last_step + 1,
                              longest_wait),
                  out);
      return;
    }
  }
}

void Controller::CheckStall(std::vector<Action>* out) {
  // The watchdogs above blame one member that lags the others; when every
  // member is stuck (a world of one, all ranks hung, a collective that never
  // completes) no one lags and only the absence of progress tells.
  if (members_.empty()) return;
  for (const WorkerInfo* w : member_info_) {
    if (w->role == WorkerRole::kFinished) return;  // the job is ending
  }
  Millis bound = options_.forming_timeout;
  if (!step_seconds_.empty() && !open_recovery_) {
    bound = std::chrono::duration_cast<Millis>(
        std::chrono::duration<double>(options_.stall_factor * MedianStepSeconds()));
  }
  bound = std::max(bound, options_.stall_floor);
  if (now_ - progress_at_ <= bound) return;
  std::string cause = fmt::format(
      "no step completed for {:.0f} ms (stall watchdog: the bound is {} ms; the last completed step was {})",
      Ms(now_ - progress_at_), bound.count(), highest_step_);
  out->push_back(AppendJournal{{{"event", "fault"}, {"kind", "stall watchdog"}, {"detail", cause},
                                {"last_step", highest_step_}, {"generation", generation_}}});
  out->push_back(PrintLine{"fault: every member aborts: " + cause});
  StartRecovery(cause, out);
  if (options_.recovery == RecoveryMode::kCheckpointRestart) RestartFromCheckpoint(cause, out);
}

void Controller::FireTimedFaults(std::vector<Action>* out) {
  for (auto it = pending_faults_.begin(); it != pending_faults_.end();) {
    if (it->point != control::FaultPoint::kTime ||
        now_ - *started_at_ < std::chrono::duration<double>(it->time_seconds) ||
        static_cast<size_t>(it->rank) >= members_.size() || phase_ != JobPhase::kRunning) {
      ++it;
      continue;
    }
    int id = members_[static_cast<size_t>(it->rank)];
    std::string what = control::FormatFault(*it);
    out->push_back(SignalWorker{id, it->kind == control::FaultKind::kKill ? SIGKILL : SIGSTOP});
    out->push_back(AppendJournal{{{"event", "fault_injected"}, {"worker_id", id}, {"fault", what}}});
    last_injected_ = {now_, what};
    it = pending_faults_.erase(it);
  }
}

// ---------------------------------------------------------------- the end

void Controller::On(const Interrupted& e, std::vector<Action>* out) {
  End(kExitInterrupted, "interrupted by " + e.how, out);
}

void Controller::End(int exit_code, const std::string& reason, std::vector<Action>* out) {
  resize_.reset();
  phase_ = JobPhase::kEnded;
  end_code_ = exit_code;
  end_reason_ = reason;
  out->push_back(AppendJournal{{{"event", "job_end"}, {"exit_code", exit_code}, {"reason", reason},
                                {"generation", generation_}, {"highest_step", highest_step_}}});
  for (auto& [id, w] : workers_) {
    if (w.role == WorkerRole::kGone) continue;
    out->push_back(SendShutdown{id, {reason, exit_code}});
    if (exit_code != kExitOk) out->push_back(KillWorker{id});
  }
  Report(out);
  out->push_back(EndJob{exit_code, reason});
}

json Controller::RecordJson(const RecoveryRecord& r) const {
  auto since = [&](const std::optional<Clock::time_point>& t) -> json {
    if (!t) return nullptr;
    return Ms(*t - r.fault_at.value_or(r.detected_at));
  };
  json j = {{"id", r.id}, {"kind", r.kind}, {"from_generation", r.from_generation}, {"to_generation", r.to_generation},
            {"causes", r.causes}, {"injected", r.injected}, {"outcome", r.outcome},
            {"resume_step", r.resume_step}, {"lost_steps", r.lost_steps}, {"old_world", r.old_world},
            {"new_world", r.new_world}, {"replacements", r.replacements}, {"spawned_spares", r.spawned_spares},
            {"bytes_copied", r.bytes_copied}, {"sources", r.sources}, {"refetched_chunks", r.refetched_chunks},
            {"connect_ms", r.connect_seconds * 1000}, {"transfer_ms", r.transfer_seconds * 1000},
            {"normal_step_ms", r.normal_step_seconds * 1000}, {"fault_time_known", r.fault_at.has_value()},
            {"restarted_from_checkpoint", r.restarted}, {"redone_steps", r.redone_steps},
            {"ms_after_fault", {{"detected", since(r.detected_at)}, {"aborted", since(r.aborted_at)},
                                {"plan_published", since(r.plan_at)}, {"state_ready", since(r.state_ready_at)},
                                {"first_step_completed", since(r.first_step_at)}}}};
  if (r.first_step_at && r.kind == "resize" && r.aborted_at) {
    // From the step boundary until the next step completes, less a normal step.
    j["pause_ms"] = std::max(0.0, Ms(*r.first_step_at - *r.aborted_at) - r.normal_step_seconds * 1000);
  } else if (r.first_step_at) {
    double total = Ms(*r.first_step_at - r.fault_at.value_or(r.detected_at));
    j["downtime_ms"] = std::max(0.0, total - r.normal_step_seconds * 1000);
  }
  return j;
}

void Controller::Report(std::vector<Action>* out) const {
  if (recoveries_.empty()) return;
  int64_t lost = 0;
  for (const auto& r : recoveries_) lost += r.lost_steps;
  int resizes = 0;
  for (const auto& r : recoveries_) resizes += r.kind == "resize" ? 1 : 0;
  int recoveries = static_cast<int>(recoveries_.size()) - resizes;
  out->push_back(PrintLine{fmt::format("recovery report: {} recover{}, {} resize{}, {} completed step{} lost", recoveries,
                                       recoveries == 1 ? "y" : "ies", resizes, resizes == 1 ? "" : "s", lost,
                                       lost == 1 ? "" : "s")});
  for (const auto& r : recoveries_) {
    json j = RecordJson(r);
    out->push_back(PrintLine{fmt::format("  #{} {}{}{}", r.id, r.kind == "resize" ? "resize, " : "",
                                         r.injected.empty() ? "" : "injected " + r.injected + ": ",
                                         r.causes.empty() ? "" : r.causes.front())});
    for (size_t i = 1; i < r.causes.size(); ++i) out->push_back(PrintLine{"     and " + r.causes[i]});
    std::string handled = r.replacements.empty() ? "no member lost" : "";
    for (const auto& s : r.replacements) handled += (handled.empty() ? "" : "; ") + s;
    out->push_back(PrintLine{fmt::format("     handled: {}; generation {} → {}, world {} → {}, resumed at step {}{} ({})",
                                         handled, r.from_generation, r.to_generation, r.old_world, r.new_world,
                                         r.resume_step,
                                         r.restarted ? fmt::format(", {} completed steps redone", r.redone_steps) : "",
                                         r.outcome)});
    const json& p = j["ms_after_fault"];
    auto f = [](const json& v) { return v.is_null() ? std::string("-") : fmt::format("{:.0f}", v.get<double>()); };
    double mb = static_cast<double>(r.bytes_copied) / 1e6;
    std::string copied = r.bytes_copied == 0 ? "no state copied"
                                             : fmt::format("copied {:.2f} MB from {} source(s) in {:.0f} ms ({:.0f} MB/s){}", mb,
                                                           r.sources, r.transfer_seconds * 1000,
                                                           r.transfer_seconds > 0 ? mb / r.transfer_seconds : 0.0,
                                                           r.refetched_chunks > 0 ? fmt::format(", {} chunk(s) refetched after a checksum failure", r.refetched_chunks) : "");
    if (r.kind == "resize") {
      out->push_back(PrintLine{fmt::format("     ms after the request: boundary reached {}, plan {}, state ready {}, first step done {}",
                                           f(p["aborted"]), f(p["plan_published"]), f(p["state_ready"]),
                                           f(p["first_step_completed"]))});
      out->push_back(PrintLine{fmt::format("     {}; pause {} ms (a normal step {:.0f} ms)", copied,
                                           j.contains("pause_ms") ? fmt::format("{:.0f}", j["pause_ms"].get<double>()) : "-",
                                           r.normal_step_seconds * 1000)});
      continue;
    }
    out->push_back(PrintLine{fmt::format("     ms after the fault{}: detected {}, aborted {}, plan {}, state ready {}, "
                                         "first step done {}",
                                         r.fault_at ? "" : " (its detection; the fault time is unknown)",
                                         f(p["detected"]), f(p["aborted"]), f(p["plan_published"]), f(p["state_ready"]),
                                         f(p["first_step_completed"]))});
    out->push_back(PrintLine{fmt::format("     {}; downtime {} ms (a normal step {:.0f} ms)", copied,
                                         j.contains("downtime_ms") ? fmt::format("{:.0f}", j["downtime_ms"].get<double>()) : "-",
                                         r.normal_step_seconds * 1000)});
  }
}

json Controller::PolicyJson() const {
  const ScalePolicy& p = options_.policy;
  return {{"min_world", p.min_world}, {"max_world", p.max_world > 0 ? p.max_world : world_size_},
          {"allowed_sizes", p.allowed_sizes}, {"increment", p.increment},
          {"stable_period_ms", p.stable_period.count()}, {"effective_stable_period_ms", EffectiveStablePeriod().count()},
          {"backoff_changes", p.backoff_changes}, {"backoff_window_ms", p.backoff_window.count()}};
}

json Controller::Status() const {
  static const char* kPhase[] = {"forming", "running", "recovering", "ended"};
  static const char* kRole[] = {"pending", "member", "spare", "finished", "gone"};
  // One entry per worker, built field by field (three times faster than an
  // initializer list: this runs for every worker at every publication).
  json workers = json::array();
  workers.get_ptr<json::array_t*>()->reserve(workers_.size());
  for (const auto& [id, w] : workers_) {
    json entry(json::value_t::object);
    entry["worker_id"] = id;
    entry["pid"] = w.pid;
    entry["role"] = kRole[static_cast<int>(w.role)];
    entry["rank"] = w.rank;
    entry["last_step"] = w.last_step;
    entry["host"] = w.host;
    entry["heartbeat_age_ms"] = std::llround(Ms(now_ - w.last_heard));
    workers.push_back(std::move(entry));
  }
  json hosts = json::array();
  for (const auto& id : host_order_) {
    const HostInfo& h = hosts_.at(id);
    hosts.push_back({{"host_id", id}, {"alive", h.alive}, {"nproc", h.nproc}, {"spares", h.spares},
                     {"address", h.address}, {"incarnation", h.incarnation}, {"lost_reason", h.lost_reason}});
  }
  json members = json::array();
  for (int id : members_) members.push_back(id);
  return {{"phase", kPhase[static_cast<int>(phase_)]}, {"generation", generation_},
          {"world_size", members_.size()}, {"target_world_size", target_world_}, {"members", std::move(members)},
          {"spares", SpareCount()}, {"highest_step", highest_step_}, {"workers", std::move(workers)},
          {"recoveries", recoveries_.size()}, {"policy", PolicyJson()}, {"hosts", std::move(hosts)}};
}

}  // namespace nonstop::controller
