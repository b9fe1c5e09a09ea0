// The Controller's handlers of hosts (agents registering, heartbeating, lost,
// leaving), its use of the placement, and the takeover of a running job
// (docs/multihost.md, docs/controller-failover.md). Workers and the recovery
// state machine: controller.cc, controller_recovery.cc.
#include <signal.h>

#include <algorithm>

#include <fmt/format.h>

#include "controller/controller.h"
#include "controller/report.h"
#include "net/address.h"

namespace nonstop::controller {

using nlohmann::json;

// ---------------------------------------------------------------- hosts

void Controller::On(const HostJoined& e, std::vector<Action>* out) {
  const auto& m = e.msg;
  auto refuse = [&](const std::string& why) {
    out->push_back(
        AppendJournal{{{"event", "host_refused"}, {"host", m.host_id}, {"reason", why}}});
    out->push_back(PrintLine{fmt::format("agent of host {} refused: {}", m.host_id, why)});
    out->push_back(CloseHost{m.host_id, why, kExitUsage});
  };
  HostInfo* known = placement_.FindHost(m.host_id);
  if (known != nullptr && known->inherited) return HostRejoined(*known, m, out);
  if (known != nullptr && known->alive)
    return refuse(fmt::format("host id {} is already in the job", m.host_id));
  if (m.running != static_cast<int>(m.workers.size())) {
    return refuse(fmt::format(
        "the agent still supervises {} process(es) from before but does not list them; it "
        "must stop them first",
        m.running));
  }
  const int alive = placement_.alive_hosts();
  if (options_.max_hosts > 0 && alive >= options_.max_hosts) {
    return refuse(fmt::format("the job already has its maximum of {} hosts", options_.max_hosts));
  }
  const std::string& elastic_host = placement_.elastic_host();
  if (!elastic_host.empty() && m.host_id != elastic_host) {
    return refuse(fmt::format(
        "this job's one host is {}, nonstop run's own: it takes no other agents", elastic_host));
  }
  if (m.elastic && elastic_host.empty() && (options_.max_hosts != 1 || placement_.placed())) {
    return refuse(
        "an agent whose capacity follows the job (nonstop run's own) can only be the one host of a "
        "job "
        "of one host (--nnodes 1)");
  }
  HostInfo& h = known != nullptr ? *known : placement_.AddHost(m.host_id);
  h.nproc = m.nproc;
  h.spares = m.spares;
  h.address = m.address;
  h.pid = m.pid;
  h.elastic = m.elastic || m.host_id == elastic_host;
  if (h.elastic) placement_.SetElasticHost(m.host_id, m.spares);
  placement_.MarkAlive(h);
  h.lost_reason.clear();
  h.leaving = false;
  h.leave_reason.clear();
  h.leave_refused = false;
  h.member_lost = false;
  h.last_heard = now_;
  ++h.incarnation;
  placement_.HostRefillsResume(m.host_id);  // a fresh start for its slots
  placement_.HostRegistered(m.host_id);
  placement_.ReleaseWithheld(m.host_id);
  out->push_back(AppendJournal{{{"event", "host_join"},
                                {"host", m.host_id},
                                {"nproc", m.nproc},
                                {"spares", m.spares},
                                {"address", m.address},
                                {"incarnation", h.incarnation},
                                {"elastic", m.elastic}}});
  // Processes it kept from before (it was cut off, and the job went on
  // without them): none may take part again.
  for (const auto& [id, pid] : m.workers) {
    const WorkerInfo* w = membership_.Find(id);
    if (w != nullptr && w->role != WorkerRole::kGone) continue;  // cannot be: its host was lost
    FenceProcess(m.host_id, id, pid, "its host was lost; the job went on without it", out);
  }
  out->push_back(
      PrintLine{fmt::format("host {} ({}) registered{}: {} worker(s), {} spare(s)", m.host_id,
                            m.address, h.incarnation > 1 ? " again" : "", m.nproc, m.spares)});
  if (!placement_.placed()) {
    if (alive + 1 >= options_.min_hosts) PlaceOnHosts(/*resume=*/false, out);
    return;
  }
  // A host that comes (back) after the start brings spares: the pool, or
  // capacity the job grows into (policy permitting).
  TopUpHosts(out);
}

void Controller::PlaceOnHosts(bool resume, std::vector<Action>* out) {
  const int world = placement_.PlacedWorld();
  if (world == 0) {
    out->push_back(PrintLine{
        "the registered hosts bring no workers (all --nproc-per-host 0): waiting for more"});
    return;
  }
  placement_.SetPlaced();
  world_size_ = world;
  target_world_ = std::max(target_world_, std::max(world_size_, options_.policy.max_world));
  if (!resume) forming_since_ = now_;
  for (const Placement::Slot& slot : placement_.PlaceAll()) {
    Spawn(membership_.NewWorkerId(), slot.spare, resume, /*background=*/false, out, slot.host_id);
  }
  out->push_back(PrintLine{
      fmt::format("placed on {} host(s): world {}", placement_.host_order().size(), world_size_)});
}

void Controller::TopUpHosts(std::vector<Action>* out) {
  if (!placement_.placed()) return;  // the placement starts every host's workers
  // an elastic host has no slots to fill: its spare pool refills one for one (RefillSpare)
  if (!slotted()) return;
  const bool background = phase_ != JobPhase::kForming;
  for (const std::string& host : placement_.TopUpTargets()) {
    Spawn(membership_.NewWorkerId(), /*spare=*/true, /*resume=*/false, background, out, host);
  }
}

void Controller::ReplaceFormingWorker(const std::string& lost_host, std::vector<Action>* out) {
  for (auto& [id, w] : membership_.mutable_workers()) {
    if (w.role == WorkerRole::kSpare && !w.stopped && w.host != lost_host &&
        placement_.HostResponsive(w.host, now_, options_.heartbeat_timeout)) {
      membership_.SetRole(w, WorkerRole::kPending);
      out->push_back(
          PrintLine{fmt::format("spare worker {} on host {} takes the place of a worker of host {}",
                                id, w.host, lost_host)});
      return;
    }
  }
  if (const HostInfo* h = placement_.FirstHostWithFreeSlot()) {
    Spawn(membership_.NewWorkerId(), /*spare=*/false, /*resume=*/open_recovery_.has_value(),
          /*background=*/false, out, h->host_id);
    return;
  }
  if (world_size_ - 1 >= std::max(1, options_.policy.min_world)) {
    --world_size_;
    out->push_back(PrintLine{
        fmt::format("no spare or free slot for a worker of host {}: the job forms with {} "
                    "workers",
                    lost_host, world_size_)});
    return;
  }
  End(kExitPeerFailure,
      fmt::format("host {} was lost while the job formed, and no other host can take its "
                  "workers (the policy's minimum world is {})",
                  lost_host, options_.policy.min_world),
      out);
}

void Controller::On(const HostHeartbeat& e, std::vector<Action>*) {
  if (HostInfo* h = placement_.FindHost(e.host_id); h != nullptr && h->alive) h->last_heard = now_;
}

void Controller::On(const ControllerStalled& e, std::vector<Action>*) {
  // Never backwards: a clock set ahead (a takeover's grace for the peers to reconnect) stays.
  auto move_on = [&](Clock::time_point& t) {
    if (t < now_) t = std::min(t + e.away, now_);
  };
  for (auto& [id, w] : membership_.mutable_workers()) move_on(w.last_heard);
  for (HostInfo* host : placement_.host_list()) move_on(host->last_heard);
  move_on(progress_at_);           // the stall watchdog's clock
  move_on(forming_since_);         // the join deadline's
  arrivals_.MoveOn(e.away, now_);  // the hang detector's
  abort_deadline_ += e.away;       // the members' window to answer an abort pauses too
  if (spare_wait_until_) *spare_wait_until_ += e.away;
}

void Controller::On(const HostLost& e, std::vector<Action>* out) {
  HostDown(e.host_id, e.reason, out);
}

void Controller::On(const WorkerStarted& e, std::vector<Action>* out) {
  if (HostOf(e.msg.worker_id) != e.host_id) return;  // not its worker
  if (!e.msg.error.empty() || e.msg.pid <= 0) {
    // As if it had died while starting.
    On(ProcessExited{e.msg.worker_id, 0, 127, 0, e.host_id}, out);
    return;
  }
  out->push_back(AppendJournal{{{"event", "spawn"},
                                {"worker_id", e.msg.worker_id},
                                {"pid", e.msg.pid},
                                {"host", e.host_id}}});
}

// The loss of a host is the loss of every worker on it, at once: one recovery.
void Controller::HostDown(const std::string& host_id, const std::string& reason,
                          std::vector<Action>* out) {
  HostInfo* found = placement_.FindHost(host_id);
  if (found == nullptr || !found->alive) return;
  HostInfo& h = *found;
  placement_.MarkDown(h);
  h.inherited = false;
  h.lost_reason = reason;
  std::vector<int> members, others;
  int unjoined_workers = 0;  // workers the forming job waits for that will never join
  for (const auto& [id, host] : placement_.host_of()) {
    if (host != host_id) continue;
    placement_.MarkEnded(id);  // the host and all its processes are gone (or fenced)
    auto& awaiting = membership_.awaiting();
    if (auto a = awaiting.find(id); a != awaiting.end()) {
      if (!a->second.spare && phase_ == JobPhase::kForming) ++unjoined_workers;
      awaiting.erase(a);
    }
    const WorkerInfo* w = membership_.Find(id);
    if (w == nullptr) continue;
    if (IsLiveMember(*w))
      members.push_back(id);
    else if (w->role != WorkerRole::kGone)
      others.push_back(id);
  }
  std::vector<int> ranks;
  for (int id : members) ranks.push_back(membership_.at(id).rank);
  // A host that asked to leave and whose members were all released has left
  // as planned; one that still held members when it went is a fault like any other.
  const bool left = h.leaving && members.empty() && !h.member_lost;
  out->push_back(AppendJournal{{{"event", left ? "host_left" : "host_lost"},
                                {"host", host_id},
                                {"reason", reason},
                                {"members", members},
                                {"ranks", ranks},
                                {"others", others}}});
  if (left) {
    out->push_back(PrintLine{fmt::format("host {} left the job ({}); its workers were released",
                                         host_id, h.leave_reason)});
  } else {
    out->push_back(PrintLine{
        fmt::format("host {} lost: {}{}; {} member(s) on it {}", host_id, reason,
                    h.leaving ? " (it was leaving, but its members were not released yet)" : "",
                    members.size(), json(ranks).dump())});
  }
  for (int id : others) {  // its spares first: none of them may replace a worker of the same host
    WorkerInfo& w = membership_.at(id);
    if (w.role != WorkerRole::kSpare) continue;
    membership_.SetRole(w, WorkerRole::kGone);
    out->push_back(KillWorker{id});
  }
  for (int id : others) {  // workers of a job still forming
    if (membership_.at(id).role != WorkerRole::kPending) continue;
    WorkerUnresponsive(id, "host lost", fmt::format("was on host {} ({})", host_id, reason), out);
    if (phase_ == JobPhase::kEnded) return;
  }
  for (int i = 0; i < unjoined_workers && phase_ == JobPhase::kForming; ++i)
    ReplaceFormingWorker(host_id, out);
  if (phase_ == JobPhase::kEnded) return;
  if (unjoined_workers > 0) MaybeFormFirstGeneration(out);
  if (members.empty()) {
    // Its members may already be gone, each noticed on its own (their control
    // connections closed first): the open recovery names the host too.
    if (open_recovery_ && recoveries_[*open_recovery_].failed_hosts.count(host_id)) {
      recoveries_[*open_recovery_].causes.push_back(
          fmt::format("host {} lost ({})", host_id, reason));
    }
    TopUpHosts(out);
    return;
  }
  if (options_.recovery == RecoveryMode::kCheckpointRestart) {
    for (int id : members)
      MemberFault(id, "host lost", fmt::format("was on host {} ({})", host_id, reason), out);
    return;
  }
  std::string what = fmt::format("host {} lost ({}): ", host_id, reason);
  for (size_t i = 0; i < members.size(); ++i) {
    WorkerInfo& w = membership_.at(members[i]);
    what += (i ? ", " : "") + fmt::format("rank {} (worker {})", w.rank, w.worker_id);
    membership_.SetRole(w, WorkerRole::kGone);
    ready_.erase(w.worker_id);
    out->push_back(AppendJournal{{{"event", "fault"},
                                  {"kind", "host lost"},
                                  {"worker_id", w.worker_id},
                                  {"rank", w.rank},
                                  {"pid", w.pid},
                                  {"host", host_id},
                                  {"detail", reason},
                                  {"last_step", w.last_step},
                                  {"generation", generation_}}});
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
  HostInfo* found = placement_.FindHost(e.host_id);
  if (found == nullptr || !found->alive || found->leaving) return;
  HostInfo& h = *found;
  h.leaving = true;
  h.leave_reason = e.msg.reason.empty() ? "its agent asked" : e.msg.reason;
  h.leave_refused = false;
  std::vector<int> members, spares, starting;
  for (const auto& [id, host] : placement_.host_of()) {
    if (host != e.host_id || !placement_.IsLive(id)) continue;
    const WorkerInfo* w = membership_.Find(id);
    if (w == nullptr) {
      starting.push_back(id);
    } else if (IsLiveMember(*w)) {
      members.push_back(id);
    } else if (w->role == WorkerRole::kSpare) {
      spares.push_back(id);
    }
  }
  out->push_back(AppendJournal{{{"event", "host_leaving"},
                                {"host", e.host_id},
                                {"reason", h.leave_reason},
                                {"members", members},
                                {"spares", spares},
                                {"starting", starting}}});
  out->push_back(PrintLine{
      fmt::format("host {} leaves the job ({}): {} member(s) released at the next step "
                  "boundary, {} spare(s) let go",
                  e.host_id, h.leave_reason, members.size(), spares.size() + starting.size())});
  if (!placement_.placed() || phase_ == JobPhase::kForming) {
    // Nothing trains yet: the job forms without the host, as if it were lost.
    HostDown(e.host_id, "left the job while it formed (" + h.leave_reason + ")", out);
    out->push_back(CloseHost{e.host_id, "released: the job formed without this host", kExitOk});
    return;
  }
  for (int id : spares) {
    WorkerInfo& w = membership_.at(id);
    membership_.SetRole(w, WorkerRole::kGone);
    out->push_back(AppendJournal{
        SpareLostRecord(w, "released", fmt::format("host {} leaves the job", e.host_id))});
    out->push_back(
        SendShutdown{id, {fmt::format("released: host {} leaves the job", e.host_id), kExitOk}});
  }
  for (int id : starting) {  // no connection to tell it on yet
    membership_.awaiting().erase(id);
    membership_.killed_before_join().insert(id);
    out->push_back(KillWorker{id});
  }
  MaybeReleaseLeavingHosts(out);
}

void Controller::MaybeReleaseLeavingHosts(std::vector<Action>* out) {
  // At a step boundary of a running job; a membership change in progress, or
  // a takeover's adoption, comes first (the Tick retries).
  // A recovery record still open (its first step not done) closes first, so
  // that it is not recorded as superseded by this planned change.
  if (phase_ != JobPhase::kRunning || finished_ > 0 || membership_.AdoptionPending() || resize_ ||
      open_recovery_) {
    return;
  }
  std::vector<int> leaving;
  std::set<std::string> hosts;
  for (const WorkerInfo* w : membership_.member_info()) {
    if (!IsLiveMember(*w) || w->host.empty()) continue;
    const HostInfo* h = placement_.FindHost(w->host);
    if (h == nullptr || !h->leaving || h->leave_refused) continue;
    leaving.push_back(w->worker_id);
    hosts.insert(w->host);
  }
  if (leaving.empty()) return;
  const int world = static_cast<int>(membership_.members().size());
  const int smaller = world - static_cast<int>(leaving.size());
  int spares = 0;  // those FormNextGeneration would promote
  for (const auto& [id, w] : membership_.workers()) spares += Promotable(w);
  const PlanPolicy sizes = SizePolicy(options_.policy, world_size_);
  const int to =
      WorldWithoutLeaving(world, static_cast<int>(leaving.size()), spares, sizes, shard_group_);
  std::string names;
  for (const std::string& h : hosts) names += (names.empty() ? "" : ", ") + h;
  if (to < 0) {
    std::string why =
        smaller >= 1 ? CheckWorldSize(sizes, shard_group_, smaller) : "no member would be left";
    std::string text = fmt::format(
        "host(s) {} cannot leave at a step boundary: without their {} member(s) the world "
        "would be {} ({}), and {} spare(s) can take their ranks; they stay until their "
        "agent goes (then a host fault)",
        names, leaving.size(), smaller, why, spares);
    for (const std::string& h : hosts) placement_.host(h).leave_refused = true;
    out->push_back(
        AppendJournal{{{"event", "host_leave_refused"}, {"hosts", hosts}, {"reason", text}}});
    out->push_back(PrintLine{text});
    return;
  }
  std::string reason = placement_.host(*hosts.begin()).leave_reason;
  StartResize(to, fmt::format("host(s) {} leave ({})", names, reason), out,
              std::set<int>(leaving.begin(), leaving.end()));
}

// ---------------------------------------------------------------- takeover

void Controller::On(const Takeover& e, std::vector<Action>* out) {
  const TakeoverState& s = e.state;
  takeovers_ = s.takeovers + 1;
  recovery_id_base_ = s.recoveries;
  if (s.generation == 0 || s.members.empty()) {
    End(kExitUsage,
        s.generation == 0
            ? "the job had not formed when its controller stopped: there is nothing to take over; "
              "start "
              "the job again"
            : fmt::format("generation {} of the job has no members: there is nothing to take over; "
                          "start the job again",
                          s.generation),
        out);
    return;
  }
  if (!s.store.is_null()) {
    Result<JobStore> store = JobStore::Load(s.store);
    if (!store.ok()) {
      End(kExitUsage,
          fmt::format("the journal's store cannot be read: {}", store.status().message()), out);
      return;
    }
    store_ = std::move(*store);
  }
  generation_ = s.generation;
  takeover_generation_ = s.generation;
  journal_cut_ = s.journal_cut;
  adopt_until_ = now_ + options_.adopt_timeout;
  resume_step_ = s.resume_step;
  highest_step_ = s.highest_step;
  last_journaled_step_ = s.highest_step;
  clock_step_ = s.highest_step;  // its start unseen: the first step completed here starts a clock
  clock_exact_ = false;
  membership_.UseIdsBelow(s.next_worker_id);
  // The inherited must join within adopt_timeout: until then they count as heard from.
  const Clock::time_point grace = now_ + options_.adopt_timeout - options_.heartbeat_timeout;
  world_size_ = 0;
  for (const auto& sh : s.hosts) {
    if (placement_.FindHost(sh.host_id) != nullptr) continue;
    HostInfo& h = placement_.AddHost(sh.host_id);
    h.nproc = sh.nproc;
    h.spares = sh.spares;
    h.address = sh.address;
    h.incarnation = sh.incarnation;
    h.elastic = sh.elastic && s.hosts.size() == 1;
    if (h.elastic) placement_.SetElasticHost(sh.host_id, sh.spares);
    placement_.MarkAlive(h);
    h.inherited = true;
    h.last_heard = grace;
    world_size_ += sh.nproc;
  }
  placement_.SetPlaced();
  target_world_ = std::max({target_world_, world_size_, options_.policy.max_world});
  // A scale request's target stands across controllers, and so do the slots its shrink gave back:
  // without them the new controller would grow the job back at once.
  if (s.target_world > 0) target_world_ = s.target_world;
  placement_.SetWithheld(s.withheld);
  std::set<int> member_set(s.members.begin(), s.members.end());
  for (const auto& sw : s.workers) {
    if (!sw.host.empty()) placement_.SetHostOf(sw.worker_id, sw.host);
    placement_.MarkLive(sw.worker_id);
    if (sw.address.empty() && !member_set.count(sw.worker_id)) {
      // started, not joined yet: it may still
      membership_.awaiting()[sw.worker_id] = AwaitedJoin{sw.spare, now_};
      continue;
    }
    WorkerInfo& w = membership_.at(sw.worker_id);
    w = WorkerInfo{};
    w.worker_id = sw.worker_id;
    w.pid = sw.pid;
    w.address = sw.address;
    w.host = sw.host;
    w.role = WorkerRole::kGone;
    membership_.SetRole(w,
                        member_set.count(sw.worker_id) ? WorkerRole::kMember : WorkerRole::kSpare);
    w.last_heard = grace;
    w.last_step = s.resume_step - 1;
    membership_.unconfirmed().insert(sw.worker_id);
  }
  // A member the journal saw end keeps its rank, gone: the recovery below
  // gives its rank to a spare, as it would have before the takeover.
  int ended = 0;
  for (int id : s.members) {
    if (membership_.Has(id)) continue;
    WorkerInfo& w = membership_.at(id);
    w.worker_id = id;
    w.role = WorkerRole::kGone;
    w.how_it_ended = "ended before the takeover";
    ++ended;
  }
  membership_.SetMembers(s.members);
  const std::vector<WorkerInfo*>& members = membership_.member_info();
  for (size_t r = 0; r < members.size(); ++r) members[r]->rank = static_cast<int>(r);
  phase_ = JobPhase::kRunning;
  progress_at_ = now_;
  out->push_back(AppendJournal{{{"event", "takeover"},
                                {"takeover", takeovers_},
                                {"generation", generation_},
                                {"members", membership_.members()},
                                {"highest_step", highest_step_},
                                {"workers", membership_.unconfirmed().size()},
                                {"hosts", placement_.host_order()}}});
  out->push_back(PrintLine{
      fmt::format("taking over the job (controller #{}): generation {}, {} members, {} host(s), "
                  "last completed step {}; waiting "
                  "up to {} ms for the workers and agents to join",
                  takeovers_ + 1, generation_, members.size(), placement_.host_order().size(),
                  highest_step_, options_.adopt_timeout.count())});
  if (s.open_recovery) AdoptOpenRecovery(s, out);
  if (ended > 0) {
    StartRecovery(
        fmt::format("{} member(s) of generation {} ended before the takeover", ended, generation_),
        out);
  }
}

void Controller::AdoptOpenRecovery(const TakeoverState& s, std::vector<Action>* out) {
  const UnfinishedRecovery& o = *s.open_recovery;
  // A record's time, from its age when the journal was read (now, if it has none).
  auto at = [&](int64_t us) {
    return us > 0 && s.read_at_us >= us ? now_ - std::chrono::microseconds(s.read_at_us - us)
                                        : now_;
  };
  RecoveryRecord rec;
  rec.id = o.id;
  rec.kind = o.planned ? "resize" : "recovery";
  rec.from_generation = o.from_generation;
  rec.old_world = static_cast<int>(o.old_members.size());
  rec.causes.push_back(o.cause);
  rec.injected = o.injected;
  rec.detected_at = at(o.started_us);
  // this record takes id o.id; the next ones follow it and every id the journal used
  recovery_id_base_ = std::max(0, std::max(s.recoveries, o.id) - 1);
  if (o.plan_generation == generation_) {
    rec.causes.push_back(
        fmt::format("its controller stopped after its plan; controller #{} finished it (the state "
                    "copied was reported to the one that stopped)",
                    takeovers_ + 1));
    rec.aborted_at = rec.plan_at = at(o.plan_us);
    rec.to_generation = generation_;
    rec.resume_step = resume_step_;
    const std::vector<int>& members = membership_.members();
    rec.new_world = static_cast<int>(members.size());
    for (size_t r = 0; r < members.size() && r < o.old_members.size(); ++r) {
      if (members[r] != o.old_members[r]) {
        rec.replacements.push_back(
            fmt::format("rank {}: worker {} → worker {}", r, o.old_members[r], members[r]));
      }
    }
    recoveries_.push_back(std::move(rec));
    open_recovery_ = recoveries_.size() - 1;
    close_scan_ = 0;
    return;
  }
  rec.outcome = fmt::format(
      "interrupted: its controller stopped before its plan; controller #{} took over "
      "generation {}",
      takeovers_ + 1, generation_);
  recoveries_.push_back(std::move(rec));
  out->push_back(
      AppendJournal{{{"event", "recovery_end"}, {"recovery", RecordJson(recoveries_.back())}}});
}

void Controller::Rejoined(const control::JoinMsg& m, std::vector<Action>* out) {
  WorkerInfo& w = membership_.at(m.worker_id);
  // A journal cut short (a forged value in etcd) may lack plans the members adopted, not a
  // million of them.
  const uint32_t ahead = journal_cut_ ? 1u << 20 : 1u;
  if (m.generation > takeover_generation_ + ahead) {
    // Plans go out one generation at a time, each recorded before the next:
    // a worker can be at most one ahead of the journal (unless the journal
    // was cut short at a forged value in etcd). It lies, or is broken.
    std::string why = fmt::format("rejoined claiming generation {}, but the journal's last is {}",
                                  m.generation, takeover_generation_);
    out->push_back(AppendJournal{JoinRefusedRecord(m.worker_id, why)});
    out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, kExitPeerFailure}});
    return;  // still unconfirmed: lost at the adoption bound
  }
  membership_.unconfirmed().erase(m.worker_id);
  w.held_shard = m.held_shard;
  w.pid = m.pid;
  w.address = m.data_address;
  w.last_heard = now_;
  out->push_back(AppendJournal{{{"event", "rejoin"},
                                {"worker_id", m.worker_id},
                                {"pid", m.pid},
                                {"generation", m.generation},
                                {"waiting", m.waiting},
                                {"state_step", m.state_step},
                                {"role", w.role == WorkerRole::kSpare ? "spare" : "member"}}});
  // A generation newer than the journal's: a plan the previous controller
  // sent but did not record. The next plan must be newer still.
  bool out_of_sync = m.generation > takeover_generation_;
  generation_ = std::max(generation_, m.generation);
  if (w.role == WorkerRole::kSpare) {
    if (out_of_sync && phase_ == JobPhase::kRunning) {
      StartRecovery(
          fmt::format("spare worker {} is in generation {}, which the journal does not know",
                      m.worker_id, m.generation),
          out);
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
      StartRecovery(
          waiting ? fmt::format(
                        "worker {} was between generations when the previous controller stopped",
                        m.worker_id)
                  : fmt::format(
                        "worker {} is in generation {}, the journal's last plan is generation {}",
                        m.worker_id, m.generation, generation_),
          out);
    }
  }
  if (phase_ != JobPhase::kRecovering) return;
  if (waiting) {
    ready_[m.worker_id] = m.state_step;
    out->push_back(AppendJournal{{{"event", "ready"},
                                  {"worker_id", m.worker_id},
                                  {"rank", w.rank},
                                  {"generation", m.generation},
                                  {"step", m.state_step},
                                  {"reason", "rejoined"}}});
    MaybeFinishAbort(out);
  } else {
    // The abort went out while it had no controller: it gets it now.
    out->push_back(
        SendAbort{m.worker_id, std::make_shared<const control::AbortMsg>(control::AbortMsg{
                                   generation_, "a controller took over during a recovery"})});
  }
}

void Controller::HostRejoined(HostInfo& h, const control::AgentRegisterMsg& m,
                              std::vector<Action>* out) {
  if (m.running != static_cast<int>(m.workers.size())) {
    // Without the list, this controller cannot tell which processes it inherits.
    std::string why = fmt::format("the agent supervises {} process(es) but lists {}", m.running,
                                  m.workers.size());
    out->push_back(
        AppendJournal{{{"event", "host_refused"}, {"host", m.host_id}, {"reason", why}}});
    out->push_back(CloseHost{m.host_id, why, kExitUsage});
    return;  // still inherited: lost at the adoption bound
  }
  h.inherited = false;
  h.last_heard = now_;
  h.pid = m.pid;
  h.address = m.address;
  ++h.incarnation;
  out->push_back(AppendJournal{{{"event", "host_rejoin"},
                                {"host", h.host_id},
                                {"running", m.running},
                                {"incarnation", h.incarnation}}});
  out->push_back(
      PrintLine{fmt::format("host {} ({}) joined this controller with {} running worker(s)",
                            h.host_id, m.address, m.running)});
  std::set<int> listed;
  for (const auto& [id, pid] : m.workers) {
    const WorkerInfo* w = membership_.Find(id);
    bool known =
        HostOf(id) == h.host_id && placement_.IsLive(id) &&
        ((w != nullptr && w->role != WorkerRole::kGone) || membership_.awaiting().count(id));
    if (known) {
      listed.insert(id);
      continue;
    }
    FenceProcess(h.host_id, id, pid, "the job does not count on it (it left before the takeover)",
                 out);
    listed.insert(id);  // dying, not dead: its slot is free when its exit is reported
  }
  // Processes of this host that the agent no longer runs ended while no controller led.
  std::vector<int> ended;
  for (const auto& [id, host] : placement_.host_of()) {
    if (host == h.host_id && placement_.IsLive(id) && !listed.count(id)) ended.push_back(id);
  }
  for (int id : ended) {
    const WorkerInfo* w = membership_.Find(id);
    On(ProcessExited{id, w == nullptr ? 0 : w->pid, -1, 0, h.host_id}, out);
  }
  placement_.HostRefillsResume(h.host_id);
  TopUpHosts(out);  // slots that ended while no controller led take spares again
}

// A process with this id runs (an agent lists it, or it joined and was refused): no new worker
// takes the id. A deposed leader may have started it with an order whose record never reached
// etcd, so the journal this controller took over does not know the id.
void Controller::ReserveWorkerId(int worker_id) {
  if (worker_id >= 0 && worker_id <= kMaxWorkerId) membership_.UseIdsBelow(worker_id + 1);
}

void Controller::FenceProcess(const std::string& host, int worker_id, int64_t pid,
                              const std::string& why, std::vector<Action>* out) {
  if (placement_.StartedOnHost(worker_id) && placement_.HostOf(worker_id) != host) {
    // The id belongs to a worker of another host: this agent's process is a stranger.
    out->push_back(
        AppendJournal{{{"event", "report_ignored"},
                       {"host", host},
                       {"worker_id", worker_id},
                       {"reason", "an agent listed a process under another host's worker id"}}});
    return;
  }
  placement_.SetHostOf(worker_id, host);
  ReserveWorkerId(worker_id);      // never reused
  placement_.MarkLive(worker_id);  // it holds a slot until its exit is seen
  out->push_back(SignalWorker{worker_id, SIGKILL});
  out->push_back(AppendJournal{{{"event", "fence"},
                                {"host", host},
                                {"worker_id", worker_id},
                                {"pid", pid},
                                {"reason", why}}});
}

std::vector<std::pair<std::string, std::string>> Controller::TorchrunAtSpawn(
    int worker_id, bool spare, const std::string& host) const {
  int rank = -1;
  if (!spare && phase_ == JobPhase::kForming) {
    rank = 0;
    for (const auto& [id, awaited] : membership_.awaiting()) {
      if (!awaited.spare && id < worker_id) ++rank;
    }
    for (int id : membership_.pending()) {
      if (id < worker_id && !membership_.awaiting().contains(id)) ++rank;
    }
    if (rank >= world_size_) rank = -1;
  }
  // The hosts that train, in order, each with its share of the ranks: the elastic host holds
  // the whole world; a host of fixed slots its nproc, ranks in host order (Placement::PlaceAll).
  std::vector<std::pair<const HostInfo*, int>> hosts;
  for (const HostInfo* h : placement_.host_list()) {
    const int share = h->elastic ? world_size_ : h->nproc;
    if (h->alive && share > 0) hosts.emplace_back(h, share);
  }
  int local_rank = -1, local_world = 0, group_rank = -1, first = 0;
  std::string master = "127.0.0.1";
  for (size_t i = 0; i < hosts.size(); ++i) {
    const auto [h, share] = hosts[i];
    if (i == 0 && !h->address.empty()) {
      Result<net::HostPort> at = net::ParseHostPort(h->address);
      master = at.ok() ? at->host : h->address;
    }
    if (h->host_id == host || (host.empty() && h->elastic)) {
      group_rank = static_cast<int>(i);
      local_world = share;
      if (rank >= first && rank < first + share) local_rank = rank - first;
    }
    first += share;
  }
  // A worker with no rank yet (a spare, a replacement, a grow) has one past every member's: not
  // -1, which scripts take to mean "not distributed" (`int(os.environ.get("RANK", -1)) != -1`) and
  // would train alone on. Its LOCAL_RANK is one of its host's slots, its worker id's (a GPU that
  // exists: `torch.cuda.set_device(LOCAL_RANK)` before the join is torchrun scripts' first line).
  if (rank < 0) rank = world_size_;
  if (local_rank < 0) local_rank = local_world > 0 ? std::max(worker_id, 0) % local_world : 0;
  const std::string world = std::to_string(world_size_);
  const auto restarts = std::count_if(recoveries_.begin(), recoveries_.end(),
                                      [](const RecoveryRecord& r) { return r.restarted; });
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", world},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
          {"GROUP_RANK", std::to_string(group_rank)},
          {"GROUP_WORLD_SIZE", std::to_string(hosts.size())},
          {"ROLE_RANK", std::to_string(rank)},
          {"ROLE_WORLD_SIZE", world},
          {"MASTER_ADDR", master},
          {"TORCHELASTIC_RESTART_COUNT", std::to_string(restarts)}};
}

}  // namespace nonstop::controller
