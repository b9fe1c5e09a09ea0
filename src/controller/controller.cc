// The Controller's event handlers for workers (joins, progress, faults), the
// detectors' findings acted on at each Tick, and the end of the job. The
// recovery state machine and elasticity: controller_recovery.cc; hosts and the
// takeover: controller_hosts.cc.
#include "controller/controller.h"

#include <signal.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "controller/report.h"
#include "nonstop/check.h"
#include "nonstop/settings.h"

namespace nonstop::controller {

using nlohmann::json;

Status ValidateOptions(const ControllerOptions& o) {
  if (o.min_hosts < 1) {
    return InvalidArgumentError(
        fmt::format("ControllerOptions::min_hosts is {}: a job runs on the hosts of agents, "
                    "at least 1 (nonstop run's own agent is one)",
                    o.min_hosts));
  }
  if (o.max_hosts != 0 && o.max_hosts < o.min_hosts) {
    return InvalidArgumentError(
        fmt::format("ControllerOptions::max_hosts {} is below min_hosts {} (0: no limit)",
                    o.max_hosts, o.min_hosts));
  }
  return OkStatus();
}

Controller::Controller(ControllerOptions options)
    : options_(std::move(options)),
      pending_faults_(options_.faults),
      // The job grows up to the policy's maximum as capacity appears (and to the hosts' world once
      // placed).
      target_world_(options_.policy.max_world) {
  const nonstop::Status valid = ValidateOptions(options_);  // (Status alone is the member function)
  NONSTOP_CHECK(valid.ok()) << valid.ToString();
}

std::vector<Action> Controller::Handle(const Event& event, Clock::time_point now) {
  now_ = now;
  if (!started_at_) {
    started_at_ = now;
    forming_since_ = now;  // the workers start when the hosts are there (PlaceOnHosts)
  }
  std::vector<Action> out;
  if (phase_ == JobPhase::kEnded) {
    if (const auto* e = std::get_if<ProcessExited>(&event)) {
      ExitedAfterTheEnd(*e, &out);
    } else if (const auto* j = std::get_if<WorkerJoined>(&event)) {
      // Late (a refill that started as the job ended), or back after losing
      // its connection: it is told, instead of waiting for a plan that never comes.
      out.push_back(
          SendShutdown{j->msg.worker_id, {"the job has ended: " + end_reason_, end_code_}});
    }
    return out;
  }
  std::visit([&](const auto& e) { On(e, &out); }, event);
  // A member told to abort ends its store waits too (StoreClient::AbortWaits): so do they here.
  for (const Action& a : out)
    if (const auto* abort = std::get_if<SendAbort>(&a)) store_.Forget(abort->worker_id);
  // A recovery waiting for a starting spare asks again after anything that may change the answer:
  // the spare joined, died or was killed at its join deadline, or the wait ran out.
  if (phase_ == JobPhase::kRecovering && spare_wait_until_) MaybeFinishAbort(&out);
  return out;
}

// ---------------------------------------------------------------- joining

void Controller::On(const WorkerJoined& e, std::vector<Action>* out) {
  const auto& m = e.msg;
  auto refuse = [&](const std::string& why, int exit_code, bool journal) {
    if (journal) out->push_back(AppendJournal{JoinRefusedRecord(m.worker_id, why)});
    out->push_back(SendShutdown{m.worker_id, {"join refused: " + why, exit_code}});
  };
  if (!SaneStep(m.state_step) || m.worker_id > kMaxWorkerId) {
    out->push_back(
        SendShutdown{m.worker_id,
                     {fmt::format("join refused: worker id {} or state step {} is out of range",
                                  m.worker_id, m.state_step),
                      kExitUsage}});
    return;
  }
  if (membership_.KilledBeforeJoin(m.worker_id)) {
    // Its join was in flight when its join deadline passed: it was killed and replaced.
    out->push_back(SendShutdown{
        m.worker_id, {"joined after its join deadline; a replacement was started", kExitUsage}});
    return;
  }
  // A worker is on the host whose agent started it, and nowhere else.
  if (placement_.StartedOnHost(m.worker_id) && placement_.HostOf(m.worker_id) != m.host_id) {
    return refuse(fmt::format("worker {} was started on host {} but joins as a worker of host '{}'",
                              m.worker_id, placement_.HostOf(m.worker_id), m.host_id),
                  kExitUsage, true);
  }
  if (!m.host_id.empty() && !placement_.StartedOnHost(m.worker_id)) {
    ReserveWorkerId(m.worker_id);  // it runs: a worker started later must not be its twin
    return refuse(fmt::format("worker {} claims host '{}', whose agent did not start it",
                              m.worker_id, m.host_id),
                  kExitUsage, true);
  }
  if (!m.host_id.empty()) {
    const HostInfo* h = placement_.FindHost(m.host_id);
    // Its host was lost while it started: it is fenced with it.
    if (h == nullptr || !h->alive)
      return refuse(fmt::format("host {} is no longer in the job", m.host_id), kExitPeerFailure,
                    false);
  }
  if (const WorkerInfo* gone = membership_.Find(m.worker_id);
      gone != nullptr && gone->role == WorkerRole::kGone) {
    // Fenced (its host was lost, or it was killed): a worker id never comes back.
    return refuse(fmt::format("worker {} left the job ({}) and cannot rejoin it", m.worker_id,
                              gone->how_it_ended.empty() ? "fenced" : gone->how_it_ended),
                  kExitPeerFailure, true);
  }
  if (shard_group_ >= 0 && m.shard_group != shard_group_) {
    return refuse(
        fmt::format(
            "worker {} shards its optimizer state over groups of {}, the job over groups of {}: "
            "every worker must run the same optimizer.shard_group",
            m.worker_id, m.shard_group, shard_group_),
        kExitUsage, true);
  }
  if (sealed_copy_ >= 0 && m.sealed_copy != (sealed_copy_ == 1)) {
    return refuse(fmt::format("worker {} {} its state copies and the job's workers {}: every "
                              "worker must have the same {} (docs/security.md, \"The state copy\")",
                              m.worker_id, m.sealed_copy ? "seals" : "does not seal",
                              sealed_copy_ == 1 ? "do" : "do not", settings::kSealedStateCopy.env),
                  kExitUsage, true);
  }
  if (membership_.Unconfirmed(m.worker_id)) {
    shard_group_ = m.shard_group;
    sealed_copy_ = m.sealed_copy ? 1 : 0;
    Rejoined(m, out);
    return;
  }
  membership_.UseIdsBelow(m.worker_id + 1);
  if (membership_.awaiting().erase(m.worker_id) > 0 && m.spare) {
    placement_.PoolRefillJoined();
    if (!m.host_id.empty()) placement_.HostRefillsResume(m.host_id);
  }
  if (const WorkerInfo* known = membership_.Find(m.worker_id);
      known != nullptr && known->role != WorkerRole::kGone) {
    out->push_back(AppendJournal{JoinRefusedRecord(m.worker_id, "worker id already in use")});
    out->push_back(SendShutdown{
        m.worker_id, {fmt::format("worker id {} is already in use", m.worker_id), kExitUsage}});
    return;
  }
  // A new entry (an id that is gone, or in use, was refused above): its role so far counts nowhere.
  WorkerInfo& w = membership_.at(m.worker_id);
  w = WorkerInfo{};
  w.role = WorkerRole::kGone;
  w.worker_id = m.worker_id;
  w.pid = m.pid;
  w.address = m.data_address;
  w.host = m.host_id;
  membership_.SetRole(
      w, m.spare || phase_ != JobPhase::kForming ? WorkerRole::kSpare : WorkerRole::kPending);
  membership_.joined_step(m.worker_id) = m.state_step;
  // the first join taken fixes them; the checks above keep every later one equal
  shard_group_ = m.shard_group;
  sealed_copy_ = m.sealed_copy ? 1 : 0;
  w.held_shard = m.held_shard;
  w.last_heard = now_;
  json rec = {{"event", "join"},
              {"worker_id", m.worker_id},
              {"pid", m.pid},
              {"address", m.data_address},
              {"spare", w.role == WorkerRole::kSpare}};
  if (!m.host_id.empty()) rec["host"] = m.host_id;
  out->push_back(AppendJournal{rec});
  if (phase_ == JobPhase::kForming && unjoined_exits_ > 0 && !m.spare) {
    End(kExitUsage,
        fmt::format("worker {} joined the job, but {} other worker(s) exited with code 0 without "
                    "joining: every worker of a job joins it (nonstop.join, "
                    "nonstop.torch.init_process_group), or none does (a script run as under "
                    "torchrun)",
                    m.worker_id, unjoined_exits_),
        out);
    return;
  }
  if (phase_ == JobPhase::kForming)
    MaybeFormFirstGeneration(out);
  else if (phase_ != JobPhase::kRecovering)  // a recovery waiting for this spare: Handle asks
    MaybeGrow(out);
}

void Controller::Spawn(int worker_id, bool spare, bool resume, bool background,
                       std::vector<Action>* out, const std::string& given_host) {
  const std::string& host = given_host.empty() ? placement_.elastic_host() : given_host;
  membership_.awaiting()[worker_id] = AwaitedJoin{spare, now_};
  placement_.Started(worker_id, host);
  out->push_back(SpawnWorker{worker_id, spare, resume, background, host,
                             TorchrunAtSpawn(worker_id, spare, host)});
}

void Controller::RefillSpare(std::vector<Action>* out) {
  if (slotted()) {
    TopUpHosts(out);  // wherever a slot is free; none: the pool waits for capacity
    return;
  }
  Spawn(membership_.NewWorkerId(), /*spare=*/true, /*resume=*/false, /*background=*/true, out);
}

// ---------------------------------------------------------------- progress

void Controller::On(const HeartbeatReceived& e, std::vector<Action>*) {
  WorkerInfo* w = membership_.Find(e.worker_id);
  if (w == nullptr) return;
  if (!SaneStep(e.msg.step) || e.msg.waiting_ms < -1 || e.msg.waiting_ms > 86'400'000) return;
  w->last_heard = now_;
  if (e.msg.step > w->last_step && w->role == WorkerRole::kMember) progress_at_ = now_;
  w->last_step = std::max(w->last_step, e.msg.step);
  w->waiting_ms = e.msg.waiting_ms;
  if (!w->busy.empty() && e.msg.busy.empty()) w->busy_ended = now_;
  w->busy = e.msg.busy.substr(0, control::kMaxBusyLabel);
  if (!w->busy.empty()) {
    w->busy_since = now_ - Millis(std::min<int64_t>(e.msg.busy_ms, 86'400'000));
    w->busy_bound = Millis(std::clamp<int64_t>(e.msg.busy_bound_ms, 1, int64_t{86'400'000} * 30));
  }
  if (e.msg.waiting_ms >= 0 && w->role == WorkerRole::kMember && phase_ == JobPhase::kRunning) {
    // It arrived at the collective of the step after the one it completed.
    const int64_t step = e.msg.step + 1;
    arrivals_.Record(w->worker_id, step, now_ - Millis(e.msg.waiting_ms),
                     membership_.members().size(),
                     /*baseline=*/!open_recovery_ && step > resume_step_);
  }
}

void Controller::On(const ProgressReceived& e, std::vector<Action>* out) {
  WorkerInfo* found = membership_.Find(e.worker_id);
  if (found == nullptr) return;
  if (!SaneStep(e.msg.step) || e.msg.step < 0 || !std::isfinite(e.msg.step_seconds) ||
      e.msg.step_seconds < 0 || e.msg.step_seconds > 1e6) {
    return;
  }
  WorkerInfo& w = *found;
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
  if (IsLiveMember(w) && e.msg.step > clock_step_) {
    // The next step of the job's course (steps redone after a restart or a lost step included).
    clock_step_ = e.msg.step;
    step_began_at_ = StepReportedLate(e.msg).value_or(now_);
    clock_exact_ = true;
  }
  if (IsLiveMember(w) && e.msg.step > last_journaled_step_) {
    last_journaled_step_ = e.msg.step;
    json record = {{"event", "step"},
                   {"step", e.msg.step},
                   {"loss", e.msg.loss},
                   {"step_seconds", e.msg.step_seconds},
                   {"tokens_per_second", e.msg.tokens_per_second},
                   {"world_size", e.msg.world_size},
                   {"generation", generation_}};
    if (e.msg.total_steps > 0) record["total_steps"] = e.msg.total_steps;
    if (e.msg.replica_check_ms >= 0) record["replica_check_ms"] = e.msg.replica_check_ms;
    if (e.msg.replica_crc_ms >= 0) record["replica_crc_ms"] = e.msg.replica_crc_ms;
    out->push_back(AppendJournal{std::move(record)});
    // Steps right after a recovery include its cost: keep them out of the baseline.
    if (!open_recovery_ && e.msg.step > resume_step_) step_times_.Add(e.msg.step_seconds);
  }
  MaybeCloseRecovery(out);
}

// A step the members completed before a fault, first reported after its recovery opened (on a
// loaded machine a survivor's report can trail the dead member's notice): the step across the
// fault is the one after it, which began when this one ended. That is estimated as the start of
// this step plus its own duration (else a normal step's), never later than this report, so the
// time lost does not count a completed step as work in flight; the record takes it, and so does
// the job's clock (a recovery that supersedes this one starts from it too). Nullopt where it does
// not apply: no fault's recovery open (a resize's drain completes a step by design), its plan
// out, another step, no duration known, or a clock whose start is not that step's (kept across
// an earlier recovery's plan: a fault that supersedes it counts from the first fault's step).
std::optional<Clock::time_point> Controller::StepReportedLate(const control::ProgressMsg& m) {
  if (!open_recovery_) return std::nullopt;
  RecoveryRecord& rec = recoveries_[*open_recovery_];
  if (rec.kind == "resize" || rec.plan_at || !rec.step_began_at || !clock_exact_ ||
      m.step != rec.step_before + 1)
    return std::nullopt;
  const double seconds = m.step_seconds > 0 ? m.step_seconds : rec.normal_step_seconds;
  if (seconds <= 0) return std::nullopt;
  const auto took =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  rec.step_began_at = std::min(now_, *rec.step_began_at + took);
  rec.step_before = m.step;
  return rec.step_began_at;
}

void Controller::On(const FinishedReceived& e, std::vector<Action>* out) {
  WorkerInfo* found = membership_.Find(e.worker_id);
  if (found == nullptr || found->role != WorkerRole::kMember) return;
  WorkerInfo& w = *found;
  w.last_heard = now_;
  membership_.SetRole(w, WorkerRole::kFinished);
  w.last_step = std::max(w.last_step, e.msg.step);
  out->push_back(AppendJournal{{{"event", "finished"},
                                {"worker_id", w.worker_id},
                                {"rank", w.rank},
                                {"step", e.msg.step},
                                {"checksum", e.msg.checksum}}});
  if (checksum_ && *checksum_ != e.msg.checksum) {
    End(kExitDataCorruption,
        fmt::format(
            "members disagree on the final parameters: {} has checksum {}, another member {}",
            Describe(w, placement_.elastic_host()), e.msg.checksum, *checksum_),
        out);
    return;
  }
  checksum_ = e.msg.checksum;
  if (!first_finished_at_) first_finished_at_ = now_;
  MaybeCloseRecovery(out);
  if (phase_ == JobPhase::kRunning &&
      ++finished_ == static_cast<int>(membership_.members().size())) {
    if (std::string unfired = UnfiredFaults(e.msg.step); !unfired.empty()) {
      End(kExitUsage,
          fmt::format("training finished at step {}, but {} (HINT: inject at a step and rank the "
                      "job reaches; a job that was to be tested under a fault was not)",
                      e.msg.step, unfired),
          out);
      return;
    }
    End(kExitOk,
        fmt::format("training finished at step {}; parameter checksum {}", e.msg.step,
                    e.msg.checksum),
        out);
  }
}

std::string Controller::UnfiredFaults(int64_t final_step) const {
  // A successor's list is the one it was started with, not what fired under its predecessors.
  if (takeovers_ > 0) return "";
  // Judged from the job's course, not from the workers' announcements (one sent while the control
  // connection was down is lost): a step the job never reached, or a time fault this controller
  // never sent (it sends those itself).
  std::vector<std::string> faults;
  for (const control::FaultSpec& f : pending_faults_) {
    const bool never = f.point == control::FaultPoint::kTime ||
                       (f.point != control::FaultPoint::kTime && f.step > final_step);
    if (never) faults.push_back(control::FormatFault(f));
  }
  if (faults.empty()) return "";
  return fmt::format("the injected fault(s) {} never fired", fmt::join(faults, "; "));
}

void Controller::On(const InjectedReceived& e, std::vector<Action>* out) {
  if (spent_unannounced_.erase(e.msg.fault_id) > 0) return;  // journaled when it was spent
  auto it = std::find_if(pending_faults_.begin(), pending_faults_.end(),
                         [&](const control::FaultSpec& f) { return f.id == e.msg.fault_id; });
  if (it != pending_faults_.end()) pending_faults_.erase(it);
  out->push_back(AppendJournal{
      {{"event", "fault_injected"}, {"worker_id", e.worker_id}, {"fault", e.msg.description}}});
  // The worker announces the fault on its control connection and then
  // carries it out; its exit may reach the controller first (the launcher's
  // report comes on another connection). The recovery that exit opened is
  // still this fault's: it is named there (when the fault happened is not
  // known then, so fault_at stays unset).
  if (open_recovery_) {
    RecoveryRecord& rec = recoveries_[*open_recovery_];
    const WorkerInfo* w = membership_.Find(e.worker_id);
    if (rec.injected.empty() && w != nullptr && now_ - rec.detected_at < std::chrono::seconds(10)) {
      const std::string who = Describe(*w, placement_.elastic_host());
      if (std::any_of(rec.causes.begin(), rec.causes.end(),
                      [&](const std::string& c) { return c.rfind(who, 0) == 0; })) {
        rec.injected = e.msg.description;
        return;
      }
    }
  }
  last_injected_ = {now_, e.msg.description};
}

// ---------------------------------------------------------------- faults

void Controller::On(const FailureReported& e, std::vector<Action>* out) {
  WorkerInfo* w = membership_.Find(e.worker_id);
  if (w == nullptr) return;
  if (e.msg.exit_code == kExitUsage && e.msg.reason.rfind(control::kCannotInject, 0) == 0) {
    // An injected fault the worker cannot carry out: the job it was to test is not tested.
    End(kExitUsage,
        fmt::format("{} cannot carry out an injected fault: {}",
                    Describe(*w, placement_.elastic_host()), e.msg.reason),
        out);
    return;
  }
  if (e.msg.exit_code == kExitDataCorruption) {
    End(kExitDataCorruption,
        fmt::format("{} reported data corruption: {}", Describe(*w, placement_.elastic_host()),
                    e.msg.reason),
        out);
    return;
  }
  if (w->role == WorkerRole::kSpare) {
    // A spare that failed while it waited (its device's health check): replaced, unless 3 of its
    // host's (or its pool's) have failed so since the host registered.
    const std::string host = HostOf(w->worker_id);
    if (const int failed = placement_.SpareFailedWhileWaiting(host); failed > 3) {
      membership_.SetRole(*w, WorkerRole::kGone);
      out->push_back(
          AppendJournal{SpareLostRecord(*w, "failure", "reported a failure: " + e.msg.reason)});
      out->push_back(PrintLine{fmt::format(
          "spare worker {} (pid {}) reported a failure: {}; {} spares on host {} failed so after "
          "joining, so {} not refilled{}",
          w->worker_id, w->pid, e.msg.reason, failed, host.empty() ? "(none)" : host,
          slotted() ? "its slots are" : "the spare pool is",
          slotted() ? " until it registers again" : "")});
    } else {
      SpareLost(*w, "reported a failure: " + e.msg.reason, out, "failure");
    }
    out->push_back(KillWorker{w->worker_id});  // it is leaving: make sure it is gone
    return;
  }
  if (!IsLiveMember(*w)) return;
  // Held for the failure window: the other members' reports of the same step come with it.
  script_failures_.Hold({e.worker_id, w->rank, e.msg.step, e.msg.reason,
                         e.msg.traceback.substr(0, control::kMaxTraceback), now_},
                        membership_.members(), options_.failure_window);
  if (script_failures_.EveryMemberRaised()) {
    const FailureReport& first = script_failures_.first_held();
    End(kExitScriptFailure,
        ScriptFailureMessage(first, fmt::format("every member ({}) raised the same exception at "
                                                "step {}",
                                                membership_.members().size(), first.step)),
        out);
    return;
  }
  ActOnHeldFailures(out);  // a window of 0
}

void Controller::ActOnHeldFailures(std::vector<Action>* out) {
  for (const FailureReport& r : script_failures_.Due(now_)) {
    if (phase_ == JobPhase::kEnded) return;
    const int repeats = script_failures_.Record(r, options_.recovery_budget_window);
    if (repeats >= options_.failure_repeats) {
      End(kExitScriptFailure,
          ScriptFailureMessage(
              r, fmt::format("the same exception was raised {} times (on rank {}'s replacements "
                             "or at step {}; --failure-repeats {})",
                             repeats + 1, r.rank, r.step, options_.failure_repeats)),
          out);
      return;
    }
    const WorkerInfo* w = membership_.Find(r.worker_id);
    if (w != nullptr && IsLiveMember(*w)) {
      std::string detail = r.reason;
      if (!w->how_it_ended.empty()) detail += " [" + w->how_it_ended + "]";
      MemberFault(r.worker_id, "reported failure", detail, out);
    }
  }
  // Members that reported their collective failed while the failure was held (ready_): if it
  // faulted no one (its worker was gone already), they still need the recovery they asked for.
  if (phase_ == JobPhase::kRunning && !ready_.empty() && !HoldingALiveMembersFailure())
    StartRecovery("a member's collective failed while a failure report was held", out);
}

bool Controller::HoldingALiveMembersFailure() const {
  for (const FailureReport& r : script_failures_.held()) {
    const WorkerInfo* w = membership_.Find(r.worker_id);
    if (w != nullptr && IsLiveMember(*w)) return true;
  }
  return false;
}

void Controller::On(const ConnectionLost& e, std::vector<Action>* out) {
  store_.Forget(e.worker_id);  // it asks again once it is back
  WorkerInfo* w = membership_.Find(e.worker_id);
  if (w == nullptr || w->role == WorkerRole::kGone) return;
  if (w->role == WorkerRole::kSpare) {
    SpareLost(*w, "lost its control connection", out);
    out->push_back(KillWorker{e.worker_id});
    return;
  }
  if (phase_ == JobPhase::kForming) {
    End(kExitPeerFailure,
        fmt::format("worker {} lost its control connection before the job formed: {}", e.worker_id,
                    e.reason),
        out);
    return;
  }
  if (script_failures_.Holding(e.worker_id)) return;  // its report came first
  MemberFault(e.worker_id, "control connection lost", e.reason, out);
}

void Controller::On(const ProcessExited& e, std::vector<Action>* out) {
  if (!e.host.empty() && HostOf(e.worker_id) != e.host) {
    out->push_back(
        AppendJournal{{{"event", "report_ignored"},
                       {"host", e.host},
                       {"worker_id", e.worker_id},
                       {"reason", "an agent reported the exit of a worker it did not start"}}});
    return;
  }
  const bool was_live = placement_.IsLive(e.worker_id);
  placement_.MarkEnded(e.worker_id);
  store_.Gone(e.worker_id);
  std::string how = e.signal != 0 ? fmt::format("was killed by signal {}", e.signal)
                                  : fmt::format("exited with code {}", e.exit_code);
  out->push_back(AppendJournal{{{"event", "exit"},
                                {"worker_id", e.worker_id},
                                {"pid", e.pid},
                                {"how", how},
                                {"rank", RankOf(e.worker_id)}}});
  WorkerInfo* joined = membership_.Find(e.worker_id);
  if (joined == nullptr) {
    auto& awaiting = membership_.awaiting();
    auto awaited = awaiting.find(e.worker_id);
    bool was_refill = awaited != awaiting.end() && awaited->second.spare;
    if (awaited != awaiting.end()) awaiting.erase(awaited);
    if (membership_.KilledBeforeJoin(e.worker_id)) return;  // already replaced
    // A process whose end was already accounted for (its host was lost, or
    // it was killed and its slot reused) changes nothing.
    if (!was_live) return;
    if (was_refill && e.exit_code != kExitDataCorruption && slotted()) {
      const std::string host = HostOf(e.worker_id);
      int failures = placement_.HostRefillFailed(host);
      if (failures <= 3) {
        out->push_back(PrintLine{
            fmt::format("spare worker {} on host {} (pid {}) {} before joining; starting another",
                        e.worker_id, host, e.pid, how)});
        RefillSpare(out);
      } else {
        out->push_back(PrintLine{
            fmt::format("spare worker {} on host {} (pid {}) {} before joining; {} spares in a row "
                        "died while starting there, so its slots are not refilled until it "
                        "registers again (see their output)",
                        e.worker_id, host, e.pid, how, failures)});
      }
      return;
    }
    if (was_refill && e.exit_code != kExitDataCorruption) {
      // A spare that died while starting: the pool refills, unless refills keep dying.
      if (placement_.PoolRefillFailed() <= 3) {
        out->push_back(
            PrintLine{fmt::format("spare worker {} (pid {}) {} before joining; starting another",
                                  e.worker_id, e.pid, how)});
        RefillSpare(out);
      } else {
        out->push_back(PrintLine{
            fmt::format("spare worker {} (pid {}) {} before joining; {} spares in a row died "
                        "while starting, so the pool is not refilled (see their output)",
                        e.worker_id, e.pid, how, placement_.pool_refill_failures())});
      }
      return;
    }
    if (phase_ == JobPhase::kForming && generation_ == 0 && e.signal == 0 && e.exit_code == 0 &&
        membership_.pending().empty()) {
      // A script that never joins (one written for torchrun alone) ran to its end: the job ends
      // as torchrun's would, once every worker has, unless one joins meanwhile (OnJoin).
      ++unjoined_exits_;
      if (std::none_of(awaiting.begin(), awaiting.end(),
                       [](const auto& a) { return !a.second.spare; })) {
        End(0,
            fmt::format("every worker ({}) exited with code 0 without joining the job: the script "
                        "ran as under torchrun, with none of nonstop's recovery (docs/python.md, "
                        "\"The environment contract\")",
                        unjoined_exits_),
            out);
      }
    } else if (phase_ == JobPhase::kForming) {
      End(e.exit_code == kExitDataCorruption ? kExitDataCorruption : kExitPeerFailure,
          fmt::format("worker {} (pid {}) {} before joining the job", e.worker_id, e.pid, how),
          out);
    } else if (e.exit_code == kExitDataCorruption) {
      End(kExitDataCorruption,
          fmt::format("worker {} (pid {}) {} before joining: its data is corrupt", e.worker_id,
                      e.pid, how),
          out);
    } else if (e.exit_code != 0) {
      out->push_back(
          PrintLine{fmt::format("worker {} (pid {}) {} before joining", e.worker_id, e.pid, how)});
    }
    return;
  }
  WorkerInfo& w = *joined;
  w.how_it_ended = how;
  // Name the cause in an open recovery that this worker's loss started.
  if (open_recovery_) {
    for (auto& c : recoveries_[*open_recovery_].causes) {
      // Only the cause that names this worker as the one that failed (it starts with its
      // description).
      if (c.rfind(Describe(w, placement_.elastic_host()), 0) == 0 &&
          c.find(" [") == std::string::npos) {
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
      membership_.SetRole(w, WorkerRole::kGone);
      End(kExitPeerFailure,
          fmt::format("worker {} (pid {}) {} before the job formed", w.worker_id, w.pid, how), out);
      return;
    case WorkerRole::kMember:
    case WorkerRole::kFinished:
      if (e.signal == 0 && e.exit_code == kExitDataCorruption) {
        End(kExitDataCorruption,
            fmt::format("{} {}: data corruption (see its output)",
                        Describe(w, placement_.elastic_host()), how),
            out);
        return;
      }
      // A member whose failure report is held exits as it said: acted on at the window's end.
      if (script_failures_.Holding(w.worker_id)) return;
      MemberFault(w.worker_id, "process exit", how, out);
      return;
  }
}

// A member's death seen as it begins (its lifeline): the fault now, before its memory is freed.
// Its exit and its connection closing follow and change nothing more (it is gone by then). Only
// members: a spare, a joining worker or a finished one is accounted for at its exit.
void Controller::On(const ProcessDying& e, std::vector<Action>* out) {
  if (!e.host.empty() && HostOf(e.worker_id) != e.host) {
    out->push_back(
        AppendJournal{{{"event", "report_ignored"},
                       {"host", e.host},
                       {"worker_id", e.worker_id},
                       {"reason", "an agent reported the death of a worker it did not start"}}});
    return;
  }
  WorkerInfo* w = membership_.Find(e.worker_id);
  if (w == nullptr || w->role != WorkerRole::kMember || (e.pid != 0 && w->pid != e.pid)) return;
  if (script_failures_.Holding(w->worker_id)) return;  // its report came first
  MemberFault(w->worker_id, "process died",
              "is dying (its lifeline fired: the kernel released the lock it held as its exit "
              "began)",
              out);
}

void Controller::On(const ProcessStopped& e, std::vector<Action>* out) {
  if (!e.host.empty() && HostOf(e.worker_id) != e.host) return;  // not its worker
  WorkerInfo* w = membership_.Find(e.worker_id);
  if (w == nullptr) {
    // Stopped before it joined: it will never join; replace it like a spare that died.
    if (membership_.awaiting().count(e.worker_id)) {
      out->push_back(KillWorker{e.worker_id});  // its exit then refills or ends the forming
    }
    return;
  }
  w->stopped = true;
  WorkerUnresponsive(e.worker_id, "process stopped",
                     fmt::format("was stopped by signal {} (a frozen process)", e.signal), out);
}

void Controller::WorkerUnresponsive(int worker_id, const std::string& kind,
                                    const std::string& detail, std::vector<Action>* out) {
  WorkerInfo& w = membership_.at(worker_id);
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
      membership_.SetRole(w, WorkerRole::kGone);
      placement_.MarkEnded(worker_id);  // killed now: its slot can take the replacement
      out->push_back(AppendJournal{{{"event", "fault"},
                                    {"kind", kind},
                                    {"worker_id", worker_id},
                                    {"rank", -1},
                                    {"pid", w.pid},
                                    {"detail", detail},
                                    {"last_step", w.last_step},
                                    {"generation", generation_}}});
      out->push_back(KillWorker{worker_id});
      WorkerInfo* spare = nullptr;
      for (auto& [id, other] : membership_.mutable_workers()) {
        if (other.role == WorkerRole::kSpare && !other.stopped) {
          spare = &other;
          break;
        }
      }
      bool resume = open_recovery_.has_value();  // forming after a restart from a checkpoint
      if (spare != nullptr && !resume) {
        membership_.SetRole(*spare, WorkerRole::kPending);
        out->push_back(PrintLine{
            fmt::format("worker {} (pid {}) {} before the job formed; spare worker {} takes its "
                        "place",
                        worker_id, w.pid, detail, spare->worker_id)});
        if (placement_.pool_size() > 0 || slotted()) RefillSpare(out);
      } else {
        out->push_back(
            PrintLine{fmt::format("worker {} (pid {}) {} before the job formed; starting another",
                                  worker_id, w.pid, detail)});
        if (slotted()) {
          // On a host with a free slot, else the job cannot form.
          const HostInfo* host = placement_.FirstHostWithFreeSlot();
          if (host == nullptr) {
            End(kExitPeerFailure,
                fmt::format("worker {} {} before the job formed, and no host has a free slot "
                            "for another",
                            worker_id, detail),
                out);
            return;
          }
          Spawn(membership_.NewWorkerId(), /*spare=*/false, resume, /*background=*/false, out,
                host->host_id);
        } else {
          Spawn(membership_.NewWorkerId(), /*spare=*/false, resume, /*background=*/false, out);
        }
      }
      MaybeFormFirstGeneration(out);
      return;
    }
    case WorkerRole::kGone:
      return;
  }
}

void Controller::SpareLost(WorkerInfo& w, const std::string& how, std::vector<Action>* out,
                           const std::string& kind) {
  membership_.SetRole(w, WorkerRole::kGone);
  out->push_back(AppendJournal{SpareLostRecord(w, kind, how)});
  out->push_back(PrintLine{
      fmt::format("spare worker {} (pid {}) {}; starting another", w.worker_id, w.pid, how)});
  RefillSpare(out);
}

void Controller::MemberFault(int worker_id, const std::string& kind, const std::string& detail,
                             std::vector<Action>* out) {
  WorkerInfo& w = membership_.at(worker_id);
  if (!IsLiveMember(w)) return;
  membership_.SetRole(w, WorkerRole::kGone);
  if (open_recovery_ && !w.host.empty()) recoveries_[*open_recovery_].failed_hosts.insert(w.host);
  if (HostInfo* h = placement_.FindHost(w.host); h != nullptr && h->leaving) h->member_lost = true;
  std::string what = fmt::format("{} {} ({}); its last completed step was {}",
                                 Describe(w, placement_.elastic_host()), detail, kind,
                                 w.last_step >= 0 ? std::to_string(w.last_step) : "none");
  out->push_back(AppendJournal{{{"event", "fault"},
                                {"kind", kind},
                                {"worker_id", w.worker_id},
                                {"rank", w.rank},
                                {"pid", w.pid},
                                {"detail", detail},
                                {"last_step", w.last_step},
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
    if (phase_ != JobPhase::kEnded) RestartFromCheckpoint(what, out);
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

bool Controller::Promotable(const WorkerInfo& w) const {
  return w.role == WorkerRole::kSpare && !w.stopped &&
         now_ - w.last_heard <= options_.heartbeat_timeout &&
         placement_.HostResponsive(w.host, now_, options_.heartbeat_timeout) &&
         !membership_.Unconfirmed(w.worker_id);
}

// ---------------------------------------------------------------- the job's store

void Controller::On(const StoreRequested& e, std::vector<Action>* out) {
  // Only a worker of the job: one the job let go (faulted, fenced, replaced) may still be running,
  // and its calls must not change what its replacement reads.
  const WorkerInfo* w = membership_.Find(e.worker_id);
  if (w == nullptr || w->role == WorkerRole::kGone) {
    control::StoreReplyMsg refused;
    refused.seq = e.msg.seq;
    refused.code = "invalid";
    refused.error = fmt::format(
        "worker {} is no longer in the job: the job's store answers its workers only", e.worker_id);
    out->push_back(SendStoreReply{e.worker_id, std::move(refused)});
    return;
  }
  JobStore::Outcome o = store_.Handle(e.worker_id, e.msg, now_);
  if (o.record) out->push_back(AppendJournal{std::move(*o.record)});  // before the answers
  Answer(std::move(o.answers), out);
}

void Controller::Answer(std::vector<JobStore::Answer> answers, std::vector<Action>* out) {
  for (JobStore::Answer& a : answers)
    out->push_back(SendStoreReply{a.worker_id, std::move(a.reply)});
}

// ---------------------------------------------------------------- timers

void Controller::On(const Tick&, std::vector<Action>* out) {
  Answer(store_.Expire(now_), out);
  // Injected faults that are due (by time since the start).
  for (auto it = pending_faults_.begin(); it != pending_faults_.end();) {
    if (it->point != control::FaultPoint::kTime ||
        now_ - *started_at_ < std::chrono::duration<double>(it->time_seconds) ||
        static_cast<size_t>(it->rank) >= membership_.members().size() ||
        phase_ != JobPhase::kRunning) {
      ++it;
      continue;
    }
    int id = membership_.members()[static_cast<size_t>(it->rank)];
    std::string what = control::FormatFault(*it);
    out->push_back(SignalWorker{id, it->kind == control::FaultKind::kKill ? SIGKILL : SIGSTOP});
    out->push_back(
        AppendJournal{{{"event", "fault_injected"}, {"worker_id", id}, {"fault", what}}});
    last_injected_ = {now_, what};
    it = pending_faults_.erase(it);
  }
  CheckJoinDeadlines(out);
  if (phase_ == JobPhase::kEnded) return;
  ActOnHeldFailures(out);
  if (phase_ == JobPhase::kEnded) return;
  CheckHeartbeats(out);
  if (phase_ == JobPhase::kEnded) return;
  CheckFinishedWhileOthersWait(out);
  if (phase_ == JobPhase::kEnded) return;
  if (slotted() && placement_.placed()) TopUpHosts(out);
  if (phase_ == JobPhase::kRecovering && !stop_orders_held_ && now_ >= abort_deadline_) {
    // Escalation: members that could not abort in time are killed and replaced.
    std::vector<int> late;
    for (const WorkerInfo* w : membership_.member_info()) {
      if (IsLiveMember(*w) && !ready_.count(w->worker_id)) late.push_back(w->worker_id);
    }
    for (int id : late) {
      MemberFault(id, "did not abort in time",
                  fmt::format("no answer {} ms after the abort", options_.abort_timeout.count()),
                  out);
      if (phase_ != JobPhase::kRecovering) return;
    }
  }
  if (phase_ == JobPhase::kRunning) {
    ProgressView view;
    view.members = &membership_.member_info();
    view.options = &options_;
    view.recovery_open = open_recovery_.has_value();
    view.median_step_seconds = step_times_.MedianSeconds();
    view.have_step_times = !step_times_.empty();
    view.progress_at = progress_at_;
    view.highest_step = highest_step_;
    NoteWaiting(FindLag(view, arrivals_, now_), out);
    // A member that lags the others past the busy timeout, else a job that does not progress.
    if (std::optional<Finding> lagging = DetectHang(view, arrivals_, now_)) {
      if (HangRepeats(*lagging, out)) return;
      MemberFault(lagging->worker_id, lagging->kind, lagging->detail, out);
    } else if (std::optional<Finding> stall = DetectStall(view, now_)) {
      // No member lags, but nothing progresses: every member aborts.
      const std::string& cause = stall->detail;
      out->push_back(AppendJournal{{{"event", "fault"},
                                    {"kind", stall->kind},
                                    {"detail", cause},
                                    {"last_step", highest_step_},
                                    {"generation", generation_}}});
      out->push_back(PrintLine{"fault: every member aborts: " + cause});
      StartRecovery(cause, out);
      if (phase_ != JobPhase::kEnded && options_.recovery == RecoveryMode::kCheckpointRestart)
        RestartFromCheckpoint(cause, out);
    }
  }
  if (phase_ != JobPhase::kRunning) NoteWaiting(std::nullopt, out);
  if (phase_ == JobPhase::kRunning) MaybeReleaseLeavingHosts(out);
  if (phase_ == JobPhase::kRunning) MaybeGrow(out);
}

// A rank found hung at the same step on its replacements is the script's doing (an evaluation
// or a save longer than the busy timeout, a deadlock in its code): a failure that repeats.
bool Controller::HangRepeats(const Finding& hang, std::vector<Action>* out) {
  const WorkerInfo* w = membership_.Find(hang.worker_id);
  if (w == nullptr) return false;
  const int64_t step = arrivals_.arrivals().empty() ? highest_step_ + 1 : arrivals_.step();
  FailureReport r{w->worker_id,
                  w->rank,
                  step,
                  fmt::format("kept the others waiting at the collective of step {} past the busy "
                              "timeout",
                              step),
                  "",
                  now_};
  const int repeats = script_failures_.Record(r, options_.recovery_budget_window);
  if (repeats < options_.failure_repeats) return false;
  End(kExitScriptFailure,
      fmt::format(
          "rank {} {} {} times (on its replacements or at that step; --failure-repeats {}): "
          "the script holds a rank there longer than --busy-timeout-ms ({} ms), every "
          "time. Mark that section (`with session.busy(\"evaluation\"):`, "
          "Session::BeginBusy) or raise --busy-timeout-ms; a deadlock in the script does "
          "this too. Do not restart it unchanged",
          r.rank, r.reason, repeats + 1, options_.failure_repeats, options_.busy_timeout.count()),
      out);
  return true;
}

void Controller::NoteWaiting(std::optional<Lag> lag, std::vector<Action>* out) {
  waiting_ = std::move(lag);
  const bool shown = waiting_ && waiting_->waited_ms >= kShowWaitAfterMs;
  const int who = shown ? waiting_->worker_id : -1;
  if (who == waiting_journaled_) return;
  if (waiting_journaled_ >= 0) {
    out->push_back(AppendJournal{{{"event", "waiting_end"}, {"worker_id", waiting_journaled_}}});
  }
  waiting_journaled_ = who;
  if (!shown) return;
  json rec = WaitingJson(waiting_);
  rec["event"] = "waiting";
  out->push_back(AppendJournal{std::move(rec)});
}

void Controller::CheckJoinDeadlines(std::vector<Action>* out) {
  JoinView view;
  view.phase = phase_;
  view.awaiting = &membership_.awaiting();
  view.workers = &membership_.workers();
  view.started_at = *started_at_;
  view.forming_since = forming_since_;
  view.placed = placement_.placed();
  view.alive_hosts = placement_.alive_hosts();
  view.min_hosts = options_.min_hosts;
  view.world_size = world_size_;
  view.forming_timeout = options_.forming_timeout;
  view.join_timeout = options_.join_timeout;
  JoinDeadlines passed = DetectJoinDeadlines(view, now_);
  if (passed.not_formed) {
    End(kExitPeerFailure, *passed.not_formed, out);
    return;
  }
  for (int id : passed.late) {
    bool spare = membership_.awaiting()[id].spare;
    membership_.awaiting().erase(id);
    membership_.killed_before_join().insert(id);
    out->push_back(KillWorker{id});
    out->push_back(AppendJournal{{{"event", "join_timeout"}, {"worker_id", id}, {"spare", spare}}});
    out->push_back(PrintLine{fmt::format("worker {} did not join within {} s; killed{}", id,
                                         options_.join_timeout.count() / 1000,
                                         spare ? ", starting another spare" : "")});
    if (spare) RefillSpare(out);
  }
}

void Controller::CheckHeartbeats(std::vector<Action>* out) {
  // While the job forms, its workers start on every host at once (each imports its framework:
  // seconds of CPU on every core), and an agent may go unheard for more than a heartbeat timeout
  // without being lost; nothing is lost by waiting longer for it then.
  constexpr Millis kFormingHostSilence{5'000};
  const Millis host_timeout = phase_ == JobPhase::kForming
                                  ? std::max(options_.heartbeat_timeout, kFormingHostSilence)
                                  : options_.heartbeat_timeout;
  for (const SilentHost& silent : SilentHosts(placement_.hosts(), now_, host_timeout)) {
    // its workers are killed (if the agent still hears) and fenced
    HostDown(silent.host_id, silent.detail, out);
    // The connection closes without a shutdown: an agent that still lives
    // fences itself and registers again when it can.
    out->push_back(CloseHost{silent.host_id, "declared lost: " + silent.detail, kExitPeerFailure,
                             /*fence=*/true});
    if (phase_ == JobPhase::kEnded) return;
  }
  for (int id : SilentWorkers(membership_.workers(), phase_, now_, options_.heartbeat_timeout)) {
    if (phase_ == JobPhase::kEnded) return;
    const WorkerInfo& w = membership_.at(id);
    if (w.role == WorkerRole::kGone) continue;
    WorkerUnresponsive(id, kHeartbeatTimeout, HeartbeatDetail(w.last_heard, now_), out);
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
  out->push_back(AppendJournal{{{"event", "job_end"},
                                {"exit_code", exit_code},
                                {"reason", reason},
                                {"generation", generation_},
                                {"highest_step", highest_step_}}});
  for (const auto& [id, w] : membership_.workers()) {
    if (w.role == WorkerRole::kGone) continue;
    out->push_back(SendShutdown{id, {reason, exit_code}});
    if (exit_code != kExitOk) out->push_back(KillWorker{id});
  }
  // Started and not joined (a refill spare still starting): it holds no state and cannot hear the
  // shutdown; the job's end does not wait for it.
  // Counted as killed, so that its exit is not taken for a fault.
  for (const auto& [id, awaited] : membership_.awaiting()) {
    if (membership_.Has(id)) continue;
    membership_.killed_before_join().insert(id);
    out->push_back(KillWorker{id});
  }
  // A fault before this controller knew a normal step (the job's second step, or soon after a
  // takeover) is set against the job's median step now, the best estimate of what the step across
  // it would have taken (its recovery_end counted the whole step). Not a resize: no fault.
  if (!step_times_.empty()) {
    for (RecoveryRecord& r : recoveries_) {
      if (r.normal_step_seconds > 0 || r.kind == "resize") continue;
      r.normal_step_seconds = step_times_.MedianSeconds();
      r.normal_step_from_the_end = true;
    }
  }
  for (std::string& line : ReportLines(recoveries_)) out->push_back(PrintLine{std::move(line)});
  out->push_back(EndJob{exit_code, reason});
}

void Controller::CheckFinishedWhileOthersWait(std::vector<Action>* out) {
  if (phase_ != JobPhase::kRunning || !first_finished_at_) return;
  // A member finished training after step s, while another, past s, was waiting in a collective
  // already then and still is, by a heartbeat 2 s later: the finished one will never come to
  // it, and the job would wait for ever. The ranks ran different numbers of steps (a spare that
  // loaded the script's own snapshot of an earlier epoch starts its loop there). A wait that a
  // heartbeat from before the finish still shows, or one that began after it, is no evidence.
  constexpr Millis kStillWaiting{2'000};
  const Clock::time_point finished_at = *first_finished_at_;
  const WorkerInfo* finished = nullptr;
  const WorkerInfo* waiting = nullptr;
  for (const WorkerInfo* w : membership_.member_info()) {
    if (w->role == WorkerRole::kFinished && (!finished || w->last_step < finished->last_step))
      finished = w;
  }
  if (finished == nullptr) return;
  for (const WorkerInfo* w : membership_.member_info()) {
    if (w->role == WorkerRole::kMember && w->waiting_ms >= 0 &&
        w->last_step >= finished->last_step && w->last_heard - finished_at >= kStillWaiting &&
        w->last_heard - Millis(w->waiting_ms) <= finished_at)
      waiting = w;
  }
  if (waiting == nullptr) return;
  End(kExitScriptFailure,
      fmt::format(
          "rank {} finished training after step {}, while rank {} waits in the collective "
          "of step {} ({} ms): the ranks ran different numbers of steps, and it would wait "
          "for ever. Every rank must run the same steps; a spare that loads the script's "
          "own snapshot starts its loop where that snapshot was (docs/python.md, \"Porting a "
          "DDP script\")",
          finished->rank, finished->last_step, waiting->rank, waiting->last_step + 1,
          waiting->waiting_ms),
      out);
}

void Controller::ExitedAfterTheEnd(const ProcessExited& e, std::vector<Action>* out) {
  const int rank = RankOf(e.worker_id);
  if (WorkerInfo* w = membership_.Find(e.worker_id)) membership_.SetRole(*w, WorkerRole::kGone);
  placement_.MarkEnded(e.worker_id);
  // A member that exits with an error after training ended (its script failed after
  // destroy_process_group: saving the model, say) fails the job, as torchrun's would. A signal is
  // no such failure: the agents stop what outlives the job.
  if (end_code_ != kExitOk || rank < 0 || e.signal != 0 || e.exit_code == 0) return;
  end_code_ = kExitScriptFailure;
  end_reason_ = fmt::format(
      "rank {} (worker {}) exited with code {} after training ended: the script failed after "
      "destroy_process_group() (its output says why)",
      rank, e.worker_id, e.exit_code);
  out->push_back(AppendJournal{{{"event", "failed_after_end"},
                                {"worker_id", e.worker_id},
                                {"rank", rank},
                                {"exit_code", e.exit_code}}});
  out->push_back(EndJob{end_code_, end_reason_});
}

json Controller::PolicyJson() const {
  return ScalePolicyJson(options_.policy, world_size_,
                         EffectiveStablePeriod(options_.policy, resize_history_, now_));
}

json Controller::Status() const {
  StatusView view;
  view.phase = phase_;
  view.generation = generation_;
  view.members = &membership_.members();
  view.target_world = target_world_;
  view.spares = membership_.spare_count();
  view.highest_step = highest_step_;
  view.workers = &membership_.workers();
  view.hosts = &placement_.host_list();
  view.recoveries = recoveries_.size();
  view.policy = PolicyJson();
  view.waiting = &waiting_;
  return StatusJson(view, now_);
}

}  // namespace nonstop::controller
