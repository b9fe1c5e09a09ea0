#include "controller/controller.h"

#include <algorithm>

#include <fmt/format.h>

namespace nonstop::controller {

using nlohmann::json;

std::vector<Action> Controller::Handle(const Event& event, Clock::time_point now) {
  std::vector<Action> out;
  if (phase_ == JobPhase::kEnded) {
    // After the end only process exits matter (for the record).
    if (const auto* e = std::get_if<ProcessExited>(&event)) {
      auto it = workers_.find(e->worker_id);
      if (it != workers_.end()) it->second.role = WorkerRole::kGone;
    }
    return out;
  }
  std::visit([&](const auto& e) { On(e, now, &out); }, event);
  return out;
}

int Controller::RankOf(int worker_id) const {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.role != WorkerRole::kMember) return -1;
  return it->second.rank;
}

std::string Controller::Describe(const WorkerInfo& w) const {
  if (w.role == WorkerRole::kMember || w.rank >= 0) {
    return fmt::format("rank {} (worker {}, pid {})", w.rank, w.worker_id, w.pid);
  }
  return fmt::format("spare worker {} (pid {})", w.worker_id, w.pid);
}

void Controller::On(const WorkerJoined& e, Clock::time_point now, std::vector<Action>* out) {
  const auto& m = e.msg;
  if (workers_.count(m.worker_id) && workers_[m.worker_id].role != WorkerRole::kGone) {
    out->push_back(AppendJournal{{{"event", "join_refused"}, {"worker_id", m.worker_id},
                                  {"reason", "worker id already in use"}}});
    out->push_back(SendShutdown{m.worker_id, {fmt::format("worker id {} is already in use", m.worker_id), kExitUsage}});
    return;
  }
  WorkerInfo w;
  w.worker_id = m.worker_id;
  w.pid = m.pid;
  w.address = m.data_address;
  w.role = m.spare ? WorkerRole::kSpare : WorkerRole::kPending;
  w.last_heard = now;
  workers_[m.worker_id] = w;
  out->push_back(AppendJournal{{{"event", "join"}, {"worker_id", m.worker_id}, {"pid", m.pid},
                                {"address", m.data_address}, {"spare", m.spare}}});
  if (phase_ == JobPhase::kForming) MaybeFormFirstGeneration(out);
}

void Controller::MaybeFormFirstGeneration(std::vector<Action>* out) {
  std::vector<int> pending;
  for (const auto& [id, w] : workers_) {
    if (w.role == WorkerRole::kPending) pending.push_back(id);
  }
  if (static_cast<int>(pending.size()) < options_.world_size) return;
  pending.resize(static_cast<size_t>(options_.world_size));  // the lowest worker ids
  generation_ = 1;
  members_ = pending;
  control::PlanMsg plan;
  plan.generation = generation_;
  plan.resume_step = 0;
  json members = json::array();
  for (size_t r = 0; r < members_.size(); ++r) {
    WorkerInfo& w = workers_[members_[r]];
    w.role = WorkerRole::kMember;
    w.rank = static_cast<int>(r);
    plan.members.push_back({w.worker_id, w.address});
    members.push_back(w.worker_id);
  }
  // Late non-spare joiners beyond world_size wait as spares.
  for (auto& [id, w] : workers_) {
    if (w.role == WorkerRole::kPending) w.role = WorkerRole::kSpare;
  }
  phase_ = JobPhase::kRunning;
  for (int id : members_) out->push_back(SendPlan{id, plan});
  out->push_back(AppendJournal{{{"event", "plan"}, {"generation", generation_}, {"members", members},
                                {"resume_step", 0}, {"reason", "start"}}});
  out->push_back(PrintLine{fmt::format("generation {}: {} workers, ranks by worker id {}", generation_,
                                       members_.size(), members.dump())});
}

void Controller::On(const HeartbeatReceived& e, Clock::time_point now, std::vector<Action>*) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) return;
  it->second.last_heard = now;
  it->second.last_step = std::max(it->second.last_step, e.msg.step);
}

void Controller::On(const ProgressReceived& e, Clock::time_point now, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) return;
  WorkerInfo& w = it->second;
  w.last_heard = now;
  w.last_step = std::max(w.last_step, e.msg.step);
  if (w.rank == 0 && w.role == WorkerRole::kMember) {
    out->push_back(AppendJournal{{{"event", "step"}, {"step", e.msg.step}, {"loss", e.msg.loss},
                                  {"step_seconds", e.msg.step_seconds}, {"tokens_per_second", e.msg.tokens_per_second},
                                  {"world_size", e.msg.world_size}, {"generation", generation_}}});
  }
  int64_t all = INT64_MAX;
  for (int id : members_) all = std::min(all, workers_[id].last_step);
  completed_step_ = std::max(completed_step_, all);
}

void Controller::On(const FinishedReceived& e, Clock::time_point now, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end() || it->second.role != WorkerRole::kMember) return;
  WorkerInfo& w = it->second;
  w.last_heard = now;
  w.role = WorkerRole::kFinished;
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
  if (++finished_ == static_cast<int>(members_.size())) {
    End(kExitOk, fmt::format("training finished at step {}; parameter checksum {}", e.msg.step, e.msg.checksum), out);
  }
}

void Controller::On(const FailureReported& e, Clock::time_point, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) return;
  MemberFault(it->second, "reported failure", e.msg.reason, e.msg.exit_code, out);
}

void Controller::On(const ConnectionLost& e, Clock::time_point now, std::vector<Action>*) {
  auto it = workers_.find(e.worker_id);
  if (it == workers_.end()) return;
  if (it->second.role == WorkerRole::kFinished || it->second.role == WorkerRole::kGone) return;
  // Declared on a Tick after the grace period, unless the process exit comes first.
  it->second.connection_lost_at = now;
  it->second.connection_lost_reason = e.reason;
}

void Controller::On(const ProcessExited& e, Clock::time_point, std::vector<Action>* out) {
  auto it = workers_.find(e.worker_id);
  std::string how = e.signal != 0 ? fmt::format("was killed by signal {}", e.signal)
                                  : fmt::format("exited with code {}", e.exit_code);
  if (it == workers_.end()) {
    // Died before it joined: it cannot have been a member, but the job cannot form without it.
    WorkerInfo w;
    w.worker_id = e.worker_id;
    w.pid = e.pid;
    out->push_back(AppendJournal{{{"event", "exit"}, {"worker_id", e.worker_id}, {"pid", e.pid}, {"how", how}}});
    if (phase_ == JobPhase::kForming) {
      End(e.exit_code == kExitDataCorruption ? kExitDataCorruption : kExitPeerFailure,
          fmt::format("worker {} (pid {}) {} before joining the job", e.worker_id, e.pid, how), out);
    }
    return;
  }
  const WorkerInfo before = it->second;  // as it was when it died, for the report
  it->second.role = WorkerRole::kGone;
  out->push_back(AppendJournal{{{"event", "exit"}, {"worker_id", e.worker_id}, {"pid", e.pid}, {"how", how},
                                {"rank", before.rank}}});
  if (before.role == WorkerRole::kFinished) return;
  if (before.role == WorkerRole::kSpare) {
    out->push_back(PrintLine{fmt::format("spare worker {} (pid {}) {}", before.worker_id, before.pid, how)});
    return;
  }
  int code = e.signal == 0 && e.exit_code == kExitDataCorruption ? kExitDataCorruption : kExitPeerFailure;
  MemberFault(before, "process exit", how, code, out);
}

void Controller::On(const Tick&, Clock::time_point now, std::vector<Action>* out) {
  if (phase_ != JobPhase::kRunning) return;
  for (int id : members_) {
    WorkerInfo& w = workers_[id];
    if (w.role != WorkerRole::kMember) continue;
    if (w.connection_lost_at && now - *w.connection_lost_at >= options_.connection_loss_grace) {
      MemberFault(w, "control connection lost", w.connection_lost_reason, kExitPeerFailure, out);
      return;
    }
    if (now - w.last_heard > options_.heartbeat_timeout) {
      MemberFault(w, "heartbeat timeout",
                  fmt::format("no heartbeat for {} ms", std::chrono::duration_cast<Millis>(now - w.last_heard).count()),
                  kExitPeerFailure, out);
      return;
    }
  }
}

void Controller::MemberFault(const WorkerInfo& w, const std::string& kind, const std::string& detail, int exit_code,
                             std::vector<Action>* out) {
  if (w.role != WorkerRole::kMember && w.role != WorkerRole::kPending) {
    out->push_back(AppendJournal{{{"event", "fault_ignored"}, {"worker_id", w.worker_id}, {"kind", kind},
                                  {"detail", detail}}});
    return;
  }
  out->push_back(AppendJournal{{{"event", "fault"}, {"kind", kind}, {"worker_id", w.worker_id}, {"rank", w.rank},
                                {"pid", w.pid}, {"detail", detail}, {"last_step", w.last_step},
                                {"generation", generation_}}});
  End(exit_code,
      fmt::format("{} {} ({}); its last completed step was {}", Describe(w), detail, kind,
                  w.last_step >= 0 ? std::to_string(w.last_step) : "none"),
      out);
}

void Controller::End(int exit_code, const std::string& reason, std::vector<Action>* out) {
  phase_ = JobPhase::kEnded;
  out->push_back(AppendJournal{{{"event", "job_end"}, {"exit_code", exit_code}, {"reason", reason},
                                {"generation", generation_}, {"completed_step", completed_step_}}});
  for (auto& [id, w] : workers_) {
    if (w.role == WorkerRole::kGone) continue;
    out->push_back(SendShutdown{id, {reason, exit_code}});
    if (exit_code != kExitOk) out->push_back(KillWorker{id});
  }
  out->push_back(EndJob{exit_code, reason});
}

json Controller::Status() const {
  static const char* kPhase[] = {"forming", "running", "ended"};
  static const char* kRole[] = {"pending", "member", "spare", "finished", "gone"};
  json workers = json::array();
  for (const auto& [id, w] : workers_) {
    workers.push_back({{"worker_id", id}, {"pid", w.pid}, {"role", kRole[static_cast<int>(w.role)]},
                       {"rank", w.rank}, {"last_step", w.last_step}});
  }
  return {{"phase", kPhase[static_cast<int>(phase_)]}, {"generation", generation_},
          {"world_size", members_.size()}, {"completed_step", completed_step_}, {"workers", workers}};
}

}  // namespace nonstop::controller
