// The Controller's recovery state machine (docs/architecture.md "Steps and faults";
// docs/recovery.md): a fault or a planned resize opens a recovery (OpenRecovery: the record, the
// aborts or drains), the members answer Ready (MaybeFinishAbort), the planner
// decides generation g+1 from the view (FormNextGeneration), and the plan is
// applied (ApplyPlan) — or every worker restarts from the durable checkpoint
// (RestartFromCheckpoint), and the job forms again (MaybeFormFirstGeneration).
// Also the elasticity that drives it: scale requests, grows, resizes.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "controller/controller.h"
#include "controller/report.h"

namespace nonstop::controller {

using nlohmann::json;

namespace {

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
  for (ShardMove& m : moves)
    plan->shard_moves.push_back({m.receiver, m.shard, std::move(m.sources)});
}

// The plan's shard moves for its journal record: every copy the plan makes.
json ShardMovesJson(const control::PlanMsg& plan) {
  json moves = json::array();
  for (const auto& m : plan.shard_moves) {
    moves.push_back({{"receiver", m.receiver}, {"shard", m.shard}, {"sources", m.sources}});
  }
  return moves;
}

// Sharded state over hosts: the shards every copy of which generation
// `generation` holds on one host (printed and journaled).
void ReportExposedShards(uint32_t generation, int shard_group,
                         const std::vector<WorkerInfo*>& members, std::vector<Action>* out) {
  std::vector<int> exposed = ExposedShards(members, shard_group);
  if (exposed.empty()) return;
  out->push_back(AppendJournal{
      {{"event", "shard_placement"}, {"generation", generation}, {"shards", exposed}}});
  out->push_back(PrintLine{
      fmt::format("generation {}: every copy of shard {} is on one host, whose loss would lose "
                  "it (optimizer.shard_group {} over these hosts)",
                  generation, fmt::join(exposed, ", "), shard_group)});
}

}  // namespace

// ---------------------------------------------------------------- forming

// Forms a generation from scratch: at the start, and after a restart from a
// durable checkpoint. Members may hold different steps (a checkpoint written
// while others were loading): the highest wins and the others copy it.
void Controller::MaybeFormFirstGeneration(std::vector<Action>* out) {
  const std::set<int>& pending = membership_.pending();
  if (world_size_ <= 0 || static_cast<int>(pending.size()) < world_size_) return;
  if (shard_group_ > 1 && world_size_ % shard_group_ != 0) {
    End(kExitUsage,
        fmt::format(
            "the world of {} workers is not groups of optimizer.shard_group {}: make --nproc a "
            "multiple of {} or change the recipe's shard_group",
            world_size_, shard_group_, shard_group_),
        out);
    return;
  }
  if (shard_group_ > 1 && world_size_ / shard_group_ + shard_group_ > kMaxShardSubGroups) {
    End(kExitUsage,
        CheckWorldSize(SizePolicy(options_.policy, world_size_), shard_group_, world_size_), out);
    return;
  }
  if (shard_group_ > 1 && world_size_ == shard_group_ && !open_recovery_) {
    out->push_back(PrintLine{
        fmt::format("optimizer.shard_group {} is the whole world: each shard has one copy, so a "
                    "fault loses it (the job then falls to its durable checkpoint); a world of "
                    "{} or more keeps a replica",
                    shard_group_, 2 * shard_group_)});
  }
  // The lowest worker ids.
  ++generation_;
  membership_.SetMembers(
      std::vector<int>(pending.begin(), std::next(pending.begin(), world_size_)));
  arrivals_.Reset();  // a new membership has its own normal
  const std::vector<int>& members = membership_.members();
  int64_t s_star = -1;
  for (int id : members) s_star = std::max(s_star, membership_.joined_step(id));
  std::vector<int> holders;
  for (int id : members) {
    if (membership_.joined_step(id) == s_star) holders.push_back(id);
  }
  resume_step_ = s_star + 1;
  close_scan_ = 0;
  auto plan_ptr = std::make_shared<control::PlanMsg>();
  control::PlanMsg& plan = *plan_ptr;
  plan.generation = generation_;
  plan.resume_step = resume_step_;
  plan.faults = pending_faults_;
  plan.reason = open_recovery_ ? "restart" : "start";
  plan.members.reserve(members.size());
  std::vector<ShardHolding> holdings;  // what each holds, from its join: the shard moves
  holdings.reserve(members.size());
  for (size_t r = 0; r < members.size(); ++r) {
    WorkerInfo& w = *membership_.member_info()[r];
    membership_.SetRole(w, WorkerRole::kMember);
    w.rank = static_cast<int>(r);
    w.last_heard = now_;
    const int64_t joined_step = membership_.joined_step(w.worker_id);
    w.last_step = joined_step;
    plan.members.push_back({w.worker_id, w.address});
    if (joined_step != s_star)
      plan.transfers.push_back({w.worker_id, SourcesFor(holders, plan.transfers.size())});
    holdings.push_back({w.worker_id, joined_step, w.held_shard});
  }
  SetShardMoves(PlanShardMoves(holdings, s_star, shard_group_), &plan, shard_group_);
  // Late joiners wait as spares.
  for (int id : std::vector<int>(pending.begin(), pending.end())) {
    membership_.SetRole(membership_.at(id), WorkerRole::kSpare);
  }
  phase_ = JobPhase::kRunning;
  progress_at_ = now_;
  // The members resume after s*: steps at or below the last one completed are the job's course
  // again (a restart from a checkpoint, a step only the lost member held). The step across a
  // recovery began before it; the job's first step begins now.
  clock_step_ = resume_step_ - 1;
  if (!open_recovery_) step_began_at_ = now_;
  clock_exact_ = !open_recovery_;
  std::shared_ptr<const control::PlanMsg> shared = std::move(plan_ptr);
  out->reserve(out->size() + members.size() + 2);
  for (int id : members) out->push_back(SendPlan{id, shared});
  json first = {{"event", "plan"},
                {"generation", generation_},
                {"members", members},
                {"spares", membership_.spare_count()},
                {"resume_step", resume_step_},
                {"reason", plan.reason}};
  // the restart from a checkpoint that formed it (a takeover adopts that recovery as planned)
  if (open_recovery_) first["recovery"] = recoveries_[*open_recovery_].id;
  if (!plan.shard_moves.empty()) first["shard_moves"] = ShardMovesJson(plan);
  out->push_back(AppendJournal{std::move(first)});
  out->push_back(PrintLine{
      fmt::format("generation {}: {} workers, ranks by worker id {}{}", generation_, members.size(),
                  json(members).dump(),
                  s_star >= 0 ? fmt::format(", resuming at step {}", resume_step_) : "")});
  ReportExposedShards(generation_, shard_group_, membership_.member_info(), out);
  if (open_recovery_) {
    RecoveryRecord& rec = recoveries_[*open_recovery_];
    rec.plan_at = now_;
    rec.to_generation = generation_;
    rec.resume_step = resume_step_;
    rec.new_world = static_cast<int>(members.size());
    rec.redone_steps = std::max<int64_t>(0, highest_step_ - s_star);
  }
}

// ---------------------------------------------------------------- recovery

void Controller::StartRecovery(const std::string& cause, std::vector<Action>* out, bool planned) {
  if (!planned &&
      recovery_budget_.Spend(now_, options_.recovery_budget, options_.recovery_budget_window)) {
    End(kExitPeerFailure,
        fmt::format("more than {} recoveries within {} s (--recovery-budget, "
                    "--recovery-budget-window-s): something fails again and again; the last: {}",
                    options_.recovery_budget, options_.recovery_budget_window.count() / 1000,
                    cause),
        out);
    return;
  }
  OpenRecovery(cause, planned, out);
  MaybeFinishAbort(out);
}

void Controller::OpenRecovery(const std::string& cause, bool planned, std::vector<Action>* out) {
  if (open_recovery_) {
    // A fault while the previous recovery had not finished: it is superseded.
    recoveries_[*open_recovery_].outcome = fmt::format(
        "superseded by recovery {}", recovery_id_base_ + static_cast<int>(recoveries_.size()) + 1);
    out->push_back(AppendJournal{
        {{"event", "recovery_end"}, {"recovery", RecordJson(recoveries_[*open_recovery_])}}});
  }
  const std::vector<WorkerInfo*>& members = membership_.member_info();
  const double median_step = step_times_.MedianSeconds();
  RecoveryRecord rec;
  rec.id = recovery_id_base_ + static_cast<int>(recoveries_.size()) + 1;
  rec.from_generation = generation_;
  rec.causes.push_back(cause);
  rec.detected_at = now_;
  rec.old_world = static_cast<int>(members.size());
  rec.normal_step_seconds = median_step;
  rec.step_began_at = step_began_at_;
  rec.step_before = clock_step_;
  if (last_injected_ && now_ - last_injected_->first < std::chrono::seconds(10)) {
    rec.fault_at = last_injected_->first;
    rec.injected = last_injected_->second;
    last_injected_.reset();
  }
  for (const WorkerInfo* w : members) {
    if (!IsLiveMember(*w) && !w->host.empty()) rec.failed_hosts.insert(w->host);
  }
  recoveries_.push_back(rec);
  open_recovery_ = recoveries_.size() - 1;
  spare_wait_until_.reset();
  phase_ = JobPhase::kRecovering;
  abort_scan_ = 0;
  finished_ = 0;
  first_finished_at_.reset();
  // A healthy member answers the abort at its next check (between
  // micro-batches, or its collective): never sooner than the step it is
  // computing allows, so slow steps stretch the deadline.
  ArmAbortDeadline(AbortWindow());
  // Inherited members that have not joined this controller yet (a takeover)
  // answer once they have: the adoption bound first, then the abort's.
  if (!membership_.unconfirmed().empty()) {
    abort_deadline_ = std::max(abort_deadline_, adopt_until_ + options_.abort_timeout);
  }
  auto abort = std::make_shared<const control::AbortMsg>(control::AbortMsg{generation_, cause});
  ready_.reserve(members.size());
  if (!planned) out->reserve(out->size() + members.size() + 4);
  for (WorkerInfo* w : members) {
    if (!IsLiveMember(*w)) continue;
    if (w->role == WorkerRole::kFinished) membership_.SetRole(*w, WorkerRole::kMember);
    if (!planned && !membership_.Unconfirmed(w->worker_id))
      out->push_back(SendAbort{w->worker_id, abort});
  }
  out->push_back(AppendJournal{{{"event", planned ? "resize_start" : "recovery_start"},
                                {"recovery", rec.id},
                                {"generation", generation_},
                                {"cause", cause},
                                {"injected", rec.injected}}});
}

void Controller::On(const ReadyReceived& e, std::vector<Action>* out) {
  WorkerInfo* w = membership_.Find(e.worker_id);
  if (w == nullptr || !IsLiveMember(*w)) return;
  // After a takeover that found a generation the journal missed, the others
  // still answer for the journal's.
  bool current = e.msg.generation == generation_ ||
                 (takeover_generation_ > 0 && e.msg.generation >= takeover_generation_ &&
                  e.msg.generation < generation_);
  if (!current) return;
  if (!SaneStep(e.msg.step)) {
    MemberFault(e.worker_id, "reported failure",
                fmt::format("reported an impossible step {}", e.msg.step), out);
    return;
  }
  if (e.msg.step == control::kNoValidState && e.msg.reason.rfind("state_diverged", 0) == 0) {
    // Its replica check found its state unlike the majority's (docs/integrity.md): a fault of its
    // own kind, repaired by the copy the next plan makes into it.
    out->push_back(AppendJournal{{{"event", "fault"},
                                  {"kind", "state_diverged"},
                                  {"worker_id", w->worker_id},
                                  {"rank", w->rank},
                                  {"detail", e.msg.reason},
                                  {"last_step", w->last_step},
                                  {"generation", generation_}}});
    out->push_back(PrintLine{
        fmt::format("fault: {} {}", Describe(*w, placement_.elastic_host()), e.msg.reason)});
  }
  // A peer's failure held for its window (its process has left, so this member's collective
  // failed): what it means is decided when the window ends; this Ready counts then.
  const bool held = phase_ == JobPhase::kRunning && HoldingALiveMembersFailure();
  if (phase_ == JobPhase::kRunning && !held) {
    // The member saw a fault first (a peer's connection reset): recover.
    StartRecovery(
        fmt::format("{} reported: {}", Describe(*w, placement_.elastic_host()), e.msg.reason), out);
    if (phase_ == JobPhase::kEnded) return;
  }
  if (shard_group_ > 0 && e.msg.held_shard >= shard_group_) {
    MemberFault(
        e.worker_id, "reported failure",
        fmt::format("claims to hold shard {} of groups of {}", e.msg.held_shard, shard_group_),
        out);
    return;
  }
  if (phase_ != JobPhase::kRecovering && !held) return;
  ready_[e.worker_id] = e.msg.step;
  w->held_shard = e.msg.held_shard;
  // Field by field: every member sends one (see PerMemberRecord).
  json rec = PerMemberRecord("ready", e.worker_id);
  rec["rank"] = w->rank;
  rec["generation"] = e.msg.generation;
  rec["step"] = e.msg.step;
  rec["reason"] = e.msg.reason;
  out->push_back(AppendJournal{std::move(rec)});
  MaybeFinishAbort(out);
}

void Controller::MaybeFinishAbort(std::vector<Action>* out) {
  if (phase_ != JobPhase::kRecovering) return;
  const std::vector<WorkerInfo*>& members = membership_.member_info();
  for (; abort_scan_ < members.size(); ++abort_scan_) {
    const WorkerInfo& w = *members[abort_scan_];
    if (IsLiveMember(w) && !ready_.count(w.worker_id)) return;  // still waiting
  }
  if (!recoveries_[*open_recovery_].aborted_at) recoveries_[*open_recovery_].aborted_at = now_;
  if (WaitForStartingSpare(out)) return;
  FormNextGeneration(out);
}

bool Controller::WaitForStartingSpare(std::vector<Action>* out) {
  if (resize_ || options_.recovery == RecoveryMode::kCheckpointRestart) return false;
  const RecoveryRecord& rec = recoveries_[*open_recovery_];
  size_t lost = 0, promotable = 0;
  for (const WorkerInfo* w : membership_.member_info()) lost += IsLiveMember(*w) ? 0 : 1;
  for (const auto& [id, w] : membership_.workers()) promotable += Promotable(w) ? 1 : 0;
  // Spares started before the fault, warming up: one started for it would start cold, and the
  // shrink is then the cheaper way on.
  std::vector<int> starting;
  for (const auto& [id, a] : membership_.awaiting()) {
    if (a.spare && (!a.since || *a.since < rec.detected_at)) starting.push_back(id);
  }
  if (lost == 0 || promotable >= lost || starting.empty()) return false;
  if (!spare_wait_until_) {
    spare_wait_until_ = now_ + options_.spare_wait;
    out->push_back(AppendJournal{{{"event", "recovery_waits_for_spare"},
                                  {"recovery", rec.id},
                                  {"starting_spares", starting},
                                  {"wait_ms", options_.spare_wait.count()}}});
    out->push_back(PrintLine{fmt::format(
        "recovery {}: waiting up to {} ms for spare worker {} to finish starting, rather than "
        "shrinking now and growing again when it joins",
        rec.id, options_.spare_wait.count(), starting.front())});
  }
  return now_ < *spare_wait_until_;
}

PlanInput Controller::PlanView(const RecoveryRecord& rec) const {
  const std::vector<int>& ids = membership_.members();
  PlanInput view;
  view.members.reserve(ids.size());
  for (size_t r = 0; r < ids.size(); ++r) {
    const WorkerInfo& w = *membership_.member_info()[r];
    PlanInput::Member& m = view.members.emplace_back();
    m.worker_id = ids[r];
    m.host = w.host;
    m.alive = IsLiveMember(w);
    if (auto ready = ready_.find(ids[r]); ready != ready_.end()) {
      m.ready = true;
      m.step = ready->second;
    }
    m.held_shard = w.held_shard;
  }
  // only those heard from lately: a hung spare is never promoted
  for (const auto& [id, w] : membership_.workers()) {
    if (Promotable(w)) view.spares.push_back({id, w.host});
  }
  view.failed_hosts = rec.failed_hosts;
  if (resize_) {
    // not emplace(): clang 16 finds the nested struct not default-constructible
    view.resize = PlanInput::Resize{};
    PlanInput::Resize& resize = *view.resize;
    resize.to = resize_->to;
    for (int id : resize_->release) {
      const WorkerInfo* w = membership_.Find(id);
      resize.release[id] = w == nullptr ? "" : w->host;
    }
  }
  view.shard_group = shard_group_;
  view.highest_step = highest_step_;
  view.have_checkpoints = options_.have_checkpoints;
  return view;
}

void Controller::FormNextGeneration(std::vector<Action>* out) {
  using Verdict = NextGeneration::Verdict;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  NextGeneration next = PlanNextGeneration(PlanView(rec), SizePolicy(options_.policy, world_size_));
  if (!next.lost_shards.empty()) {
    out->push_back(AppendJournal{{{"event", "shard_lost"},
                                  {"shards", next.lost_shards},
                                  {"step", next.s_star},
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
  for (const std::string& host : next.leave_refused_hosts)
    placement_.host(host).leave_refused = true;
  rec.replacements.insert(rec.replacements.end(),
                          std::make_move_iterator(next.replacements.begin()),
                          std::make_move_iterator(next.replacements.end()));
  resize_.reset();  // the plan carried it out
  if (next.verdict == Verdict::kNoneLeft) {
    rec.outcome = "failed";
    End(kExitPeerFailure, next.why, out);
    return;
  }
  ApplyPlan(std::move(next), rec, out);
}

void Controller::SpendFaultsOfTheLost(RecoveryRecord& rec, std::vector<Action>* out) {
  using control::FaultKind;
  const std::vector<WorkerInfo*>& info = membership_.member_info();
  for (auto it = pending_faults_.begin(); it != pending_faults_.end();) {
    const control::FaultSpec& f = *it;
    const bool stops = f.kind == FaultKind::kKill || f.kind == FaultKind::kHang ||
                       f.kind == FaultKind::kStall || f.kind == FaultKind::kSpin;
    const size_t r = static_cast<size_t>(f.rank);
    // In step f.step when it was lost: it had reported the step before (a spare that died in
    // its state copy has reported nothing since).
    if (f.point != control::FaultPoint::kStep || !stops || f.rank < 0 || r >= info.size() ||
        IsLiveMember(*info[r]) || info[r]->last_step + 1 != f.step) {
      ++it;
      continue;
    }
    const std::string what = control::FormatFault(f);
    out->push_back(AppendJournal{{{"event", "fault_injected"},
                                  {"worker_id", info[r]->worker_id},
                                  {"fault", what},
                                  {"announced", false}}});
    if (rec.injected.empty()) rec.injected = what;
    spent_unannounced_.insert(f.id);
    it = pending_faults_.erase(it);
  }
}

void Controller::ApplyPlan(NextGeneration next, RecoveryRecord& rec, std::vector<Action>* out) {
  const size_t world = next.members.size();
  SpendFaultsOfTheLost(rec, out);  // before the released leave: they are live, not lost
  for (int id : next.released) {
    WorkerInfo& w = membership_.at(id);
    membership_.SetRole(w, WorkerRole::kGone);
    // capacity given back: not refilled until a grow
    if (!w.host.empty()) placement_.Withhold(w.host);
    out->push_back(
        SendShutdown{id, {fmt::format("released: the world shrinks to {}", world), kExitOk}});
  }
  if (world != membership_.members().size()) resize_history_.Changed(now_);
  std::vector<WorkerInfo*> next_info(world);
  for (size_t r = 0; r < world; ++r) {
    // Most keep their rank: their entry is known.
    const std::vector<int>& ids = membership_.members();
    next_info[r] = r < ids.size() && ids[r] == next.members[r] ? membership_.member_info()[r]
                                                               : &membership_.at(next.members[r]);
  }
  ++generation_;
  membership_.SetMembers(std::move(next.members), std::move(next_info));
  arrivals_.Reset();  // a new membership has its own normal
  resume_step_ = next.s_star + 1;
  clock_step_ = next.s_star;  // a step only the lost member held is the job's course again
  clock_exact_ = false;       // step_began_at_ is the start of the step across the fault
  close_scan_ = 0;
  rec.to_generation = generation_;
  rec.resume_step = resume_step_;
  rec.lost_steps = std::max<int64_t>(0, highest_step_ - next.s_star);
  rec.new_world = static_cast<int>(world);
  rec.sources = static_cast<int>(next.holders.size());

  const std::vector<int>& members = membership_.members();
  auto plan_ptr = std::make_shared<control::PlanMsg>();
  control::PlanMsg& plan = *plan_ptr;
  plan.generation = generation_;
  plan.resume_step = resume_step_;
  plan.faults = pending_faults_;
  plan.reason = rec.kind == "resize" ? "resize: " + rec.causes.front() : "recovery";
  plan.members.reserve(world);
  for (size_t r = 0; r < world; ++r) {
    WorkerInfo& w = *membership_.member_info()[r];
    membership_.SetRole(w, WorkerRole::kMember);
    w.rank = static_cast<int>(r);
    w.last_heard = now_;
    w.waiting_ms = -1;
    w.last_step = next.had_step[r];
    plan.members.push_back({w.worker_id, w.address});
  }
  json transfers = json::array();
  for (NextGeneration::Transfer& t : next.transfers) {
    transfers.push_back(
        {{"receiver", t.receiver}, {"sources", t.sources}, {"had_step", t.had_step}});
    plan.transfers.push_back({t.receiver, std::move(t.sources)});
  }
  SetShardMoves(std::move(next.shard_moves), &plan, shard_group_);
  ready_.clear();
  phase_ = JobPhase::kRunning;
  progress_at_ = now_;
  rec.plan_at = now_;
  std::shared_ptr<const control::PlanMsg> shared = std::move(plan_ptr);
  out->reserve(out->size() + members.size() + next.spares_used + 4);
  for (int id : members) out->push_back(SendPlan{id, shared});
  // The spares used are replaced on the elastic host; on hosts of fixed
  // slots, the free slots are filled on the next tick.
  for (size_t i = 0; i < next.spares_used && placement_.pool_size() > 0 && !slotted(); ++i) {
    Spawn(membership_.NewWorkerId(), /*spare=*/true, /*resume=*/false, /*background=*/true, out);
    ++rec.spawned_spares;
  }
  json record = {{"event", "plan"},
                 {"generation", generation_},
                 {"members", members},
                 {"spares", membership_.spare_count()},
                 {"resume_step", resume_step_},
                 {"reason", plan.reason},
                 {"recovery", rec.id},
                 {"transfers", std::move(transfers)},
                 {"released", next.released}};
  if (!plan.shard_moves.empty()) record["shard_moves"] = ShardMovesJson(plan);
  out->push_back(AppendJournal{std::move(record)});
  out->push_back(PrintLine{fmt::format(
      "generation {}: {} workers {}, resuming at step {}{}", generation_, members.size(),
      json(members).dump(), resume_step_,
      plan.transfers.empty() ? ""
                             : fmt::format(", {} receiving state from {} source(s)",
                                           plan.transfers.size(), next.holders.size()))});
  ReportExposedShards(generation_, shard_group_, membership_.member_info(), out);
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
  // The copy's time is its receivers': a source's includes its wait for a receiver that had not
  // connected yet (a spare setting up), which the state-copy phase counts.
  if (e.msg.bytes_received > 0)
    rec.transfer_seconds = std::max(rec.transfer_seconds, e.msg.transfer_seconds);
  rec.bytes_copied += e.msg.bytes_received;
  rec.refetched_chunks += e.msg.refetched_chunks;
  if (++rec.recovered_reports == static_cast<int>(membership_.members().size()))
    rec.state_ready_at = now_;
  MaybeCloseRecovery(out);
}

void Controller::MaybeCloseRecovery(std::vector<Action>* out) {
  if (!open_recovery_ || phase_ != JobPhase::kRunning) return;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  const std::vector<WorkerInfo*>& members = membership_.member_info();
  for (; close_scan_ < members.size(); ++close_scan_) {
    const WorkerInfo& w = *members[close_scan_];
    if (w.last_step < rec.resume_step && w.role != WorkerRole::kFinished) return;
  }
  rec.first_step_at = now_;
  if (!rec.state_ready_at) rec.state_ready_at = now_;
  rec.outcome = "completed";
  out->push_back(AppendJournal{{{"event", "recovery_end"}, {"recovery", RecordJson(rec)}}});
  open_recovery_.reset();
}

// ---------------------------------------------------------------- restart from a checkpoint

void Controller::RestartFromCheckpoint(const std::string& why, std::vector<Action>* out) {
  if (!open_recovery_) OpenRecovery(why, /*planned=*/false, out);  // the aborts are moot
  resize_.reset();  // a planned change in progress is moot: every worker starts again
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  SpendFaultsOfTheLost(rec, out);  // the restarted job would reach their step again
  rec.restarted = true;
  rec.replacements.push_back("every worker restarted from the newest durable checkpoint");
  out->push_back(PrintLine{"restarting every worker from the newest durable checkpoint: " + why});
  out->push_back(AppendJournal{{{"event", "restart"},
                                {"recovery", rec.id},
                                {"reason", why},
                                {"highest_step", highest_step_}}});
  for (auto& [id, w] : membership_.mutable_workers()) {
    // Every slot takes a restarted worker at once, also the slots of members
    // already lost whose exits the agents have not reported yet (they were
    // killed when they were lost); else those slots filled with spares later.
    if (slotted()) placement_.MarkEnded(id);
    if (w.role == WorkerRole::kGone) continue;
    membership_.SetRole(w, WorkerRole::kGone);
    out->push_back(KillWorker{id});
  }
  // started, not joined yet: they would join the old job
  for (const auto& [id, a] : membership_.awaiting()) {
    out->push_back(KillWorker{id});
    membership_.killed_before_join().insert(id);
    placement_.MarkEnded(id);
  }
  membership_.awaiting().clear();
  membership_.SetMembers({});
  ready_.clear();
  finished_ = 0;
  first_finished_at_.reset();
  last_journaled_step_ = -1;  // the steps since the checkpoint are computed (and journaled) again
  phase_ = JobPhase::kForming;
  forming_since_ = now_;
  if (slotted()) {
    // Every worker starts again on the hosts' whole capacity: slots a shrink gave back count again
    // (the new generation forms from every non-spare slot; takeover.cc replays it the same way).
    placement_.ClearWithheld();
    PlaceOnHosts(/*resume=*/true, out);
    return;
  }
  // The elastic host: the world and its spare pool start again there.
  for (int i = 0; i < world_size_ + placement_.pool_size(); ++i) {
    Spawn(membership_.NewWorkerId(), /*spare=*/i >= world_size_, /*resume=*/true,
          /*background=*/false, out);
  }
}

// ---------------------------------------------------------------- elasticity

void Controller::On(const ScaleRequest& e, std::vector<Action>* out) {
  const int world = static_cast<int>(membership_.members().size());
  ScaleView view;
  view.phase = phase_;
  view.world = world;
  view.finished = finished_;
  view.shard_group = shard_group_;
  view.initial_world = world_size_;
  const ScaleDecision d = DecideScaleRequest(e.body, view, options_.policy, resize_history_, now_);
  if (d.http_status != 202) {
    out->push_back(
        ScaleReply{e.request_id, d.http_status, {{"accepted", false}, {"error", d.error}}});
    out->push_back(AppendJournal{{{"event", "scale_refused"},
                                  {"request", e.body},
                                  {"source", e.source},
                                  {"reason", d.error}}});
    return;
  }
  const int target = d.target;
  target_world_ = target;
  out->push_back(AppendJournal{{{"event", "scale_request"},
                                {"request", e.body},
                                {"source", e.source},
                                {"from", world},
                                {"to", target}}});
  out->push_back(ScaleReply{
      e.request_id,
      202,
      {{"accepted", true}, {"world_size", target}, {"from", world}, {"generation", generation_}}});
  if (target < world) {
    StartResize(target, fmt::format("shrink on request ({})", e.source), out);
  } else if (target > world) {
    // Declared capacity: on the elastic host, start the workers that are
    // missing; the job grows when they have joined. (On hosts of fixed
    // slots, capacity is the slots: slots given back by a shrink are filled
    // again; beyond them the job grows when a host brings some.)
    if (slotted()) {
      placement_.ClearWithheld();
      TopUpHosts(out);
    } else {
      for (int i = membership_.spare_count(); i < target - world; ++i) {
        Spawn(membership_.NewWorkerId(), /*spare=*/true, false, false, out);
      }
    }
    MaybeGrow(out);
  }
}

void Controller::MaybeGrow(std::vector<Action>* out) {
  GrowView view;
  view.adoption_pending = membership_.AdoptionPending();
  view.phase = phase_;
  view.finished = finished_;
  view.world = static_cast<int>(membership_.members().size());
  view.spares = membership_.spare_count();
  view.target_world = target_world_;
  view.shard_group = shard_group_;
  view.initial_world = world_size_;
  view.grow_gather = options_.grow_gather;
  GrowDecision d = DecideGrow(view, options_.policy, resize_history_, now_);
  resize_history_.grow_waiting_since = d.gather_since;
  if (d.to > 0) StartResize(d.to, d.trigger, out);
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
  ArmAbortDeadline(options_.abort_timeout +
                   std::chrono::duration_cast<Millis>(
                       std::chrono::duration<double>(10 * step_times_.MedianSeconds())));
  for (int id : membership_.members()) {
    if (IsLiveMember(membership_.at(id))) out->push_back(SendDrain{id, drain});
  }
  out->push_back(
      PrintLine{fmt::format("resize: world {} → {} at the step boundary after step {} ({})",
                            membership_.members().size(), new_world, drain.after_step, trigger)});
}

Millis Controller::AbortWindow() const {
  return std::max(options_.abort_timeout,
                  std::chrono::duration_cast<Millis>(
                      std::chrono::duration<double>(1.5 * step_times_.MedianSeconds())));
}

void Controller::ArmAbortDeadline(Millis window) {
  abort_window_ = window;
  abort_deadline_ = now_ + window;
}

// An abort or drain waits for the journal's sync, or went out now: nobody is late while it waits,
// and the members' window to answer it starts when it goes out (a hung disk under the journal must
// not turn into "did not abort in time" for every survivor).
void Controller::On(const StopOrdersHeld& e, std::vector<Action>*) {
  stop_orders_held_ = e.held;
  if (!e.held) abort_deadline_ = std::max(abort_deadline_, now_ + abort_window_);
}

void Controller::EscalateResize(std::vector<Action>* out) {
  if (!open_recovery_ || phase_ != JobPhase::kRecovering) return;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  if (rec.kind != "resize") return;
  rec.kind = "recovery";  // a fault now, not a planned change
  ArmAbortDeadline(AbortWindow());
  auto abort = std::make_shared<const control::AbortMsg>(
      control::AbortMsg{generation_, "a member was lost during a resize"});
  for (int id : membership_.members()) {
    if (IsLiveMember(membership_.at(id)) && !ready_.count(id)) out->push_back(SendAbort{id, abort});
  }
  out->push_back(AppendJournal{
      {{"event", "resize_aborted"}, {"recovery", rec.id}, {"generation", generation_}}});
}

}  // namespace nonstop::controller
