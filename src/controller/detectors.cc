#include "controller/detectors.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace nonstop::controller {

namespace {

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

void StepTimes::Add(double seconds) {
  seconds_.push_back(seconds);
  if (seconds_.size() > 20) seconds_.pop_front();
}

double StepTimes::MedianSeconds() const {
  if (seconds_.empty()) return 0;
  std::vector<double> v(seconds_.begin(), seconds_.end());
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

void ArrivalTracker::Record(int worker_id, int64_t step, Clock::time_point at, size_t world,
                            bool baseline) {
  if (step < step_) return;
  if (step > step_) {
    step_ = step;
    arrivals_.clear();
  }
  if (!arrivals_.emplace(worker_id, at).second) return;
  if (arrivals_.size() < world) return;
  auto [lo, hi] =
      std::minmax_element(arrivals_.begin(), arrivals_.end(),
                          [](const auto& a, const auto& b) { return a.second < b.second; });
  if (baseline) {
    spreads_ms_.push_back(Ms(hi->second - lo->second));
    if (spreads_ms_.size() > 32) spreads_ms_.pop_front();
  }
}

void ArrivalTracker::MoveOn(Millis away, Clock::time_point now) {
  for (auto& [id, at] : arrivals_) at = std::min(at + away, now);
}

void ArrivalTracker::Reset() {
  arrivals_.clear();
  step_ = -1;
  spreads_ms_.clear();
}

// ---------------------------------------------------------------- heartbeats

std::vector<SilentHost> SilentHosts(const std::map<std::string, HostInfo>& hosts,
                                    Clock::time_point now, Millis heartbeat_timeout) {
  // A silent agent is a lost host (a crash, or a partition).
  std::vector<SilentHost> silent;
  for (const auto& [id, h] : hosts) {
    if (h.alive && now - h.last_heard > heartbeat_timeout) {
      silent.push_back(
          {id, fmt::format("its agent sent no heartbeat for {:.0f} ms", Ms(now - h.last_heard))});
    }
  }
  return silent;
}

std::vector<int> SilentWorkers(const std::map<int, WorkerInfo>& workers, JobPhase phase,
                               Clock::time_point now, Millis heartbeat_timeout) {
  // Every worker that has joined, whatever its role, must be heard from.
  std::vector<int> silent;
  for (const auto& [id, w] : workers) {
    bool watched = w.role == WorkerRole::kPending || w.role == WorkerRole::kSpare ||
                   (w.role == WorkerRole::kMember && phase == JobPhase::kRunning);
    if (watched && now - w.last_heard > heartbeat_timeout) silent.push_back(id);
  }
  return silent;
}

std::string HeartbeatDetail(Clock::time_point last_heard, Clock::time_point now) {
  return fmt::format("sent no heartbeat for {:.0f} ms", Ms(now - last_heard));
}

// ---------------------------------------------------------------- join deadlines

JoinDeadlines DetectJoinDeadlines(const JoinView& v, Clock::time_point now) {
  JoinDeadlines out;
  if (v.phase == JobPhase::kForming) {
    if (now - v.forming_since <= v.forming_timeout) return out;
    if (!v.placed) {
      out.not_formed = fmt::format(
          "the job did not form within {} s: {} of the {} hosts it needs registered (start "
          "`nonstop agent` on each "
          "host; HINT: a slow start needs a longer --join-timeout-ms)",
          v.forming_timeout.count() / 1000, v.alive_hosts, v.min_hosts);
      return out;
    }
    std::vector<int> missing;
    for (const auto& [id, a] : *v.awaiting) {
      if (!a.spare) missing.push_back(id);
    }
    int pending = 0;
    for (const auto& [id, w] : *v.workers) pending += w.role == WorkerRole::kPending ? 1 : 0;
    out.not_formed = fmt::format(
        "the job did not form within {} s: {} of {} workers joined; not joined: worker(s) {} (see "
        "their output; "
        "HINT: a slow start needs a longer --join-timeout-ms)",
        v.forming_timeout.count() / 1000, pending, v.world_size, nlohmann::json(missing).dump());
    return out;
  }
  for (const auto& [id, a] : *v.awaiting) {
    if (now - a.since.value_or(v.started_at) > v.join_timeout) out.late.push_back(id);
  }
  return out;
}

// ---------------------------------------------------------------- progress

bool InMarkedSection(const WorkerInfo& w, Clock::time_point now) {
  return !w.busy.empty() && now - w.busy_since <= w.busy_bound;
}

std::optional<Lag> FindLag(const ProgressView& v, const ArrivalTracker& arrivals,
                           Clock::time_point now) {
  const std::vector<WorkerInfo*>& members = *v.members;
  const auto& arrived = arrivals.arrivals();
  // The first arrival at the tracked step's collective, or the longest wait a
  // member reported (a step whose arrivals the tracker missed).
  Clock::time_point first = Clock::time_point::max();
  if (arrived.size() < members.size()) {
    for (const auto& [id, t] : arrived) first = std::min(first, t);
  }
  int64_t highest = -1;
  for (const WorkerInfo* w : members) {
    if (w->role == WorkerRole::kMember) highest = std::max(highest, w->last_step);
  }
  for (const WorkerInfo* w : members) {
    // A wait at a step another member completed is over (its report is on its way): no wait.
    if (w->role == WorkerRole::kMember && w->waiting_ms >= 0 && w->last_step >= highest)
      first = std::min(first, w->last_heard - Millis(w->waiting_ms));
  }
  if (first == Clock::time_point::max()) return std::nullopt;
  for (const WorkerInfo* w : members) {
    if (w->role != WorkerRole::kMember || w->waiting_ms >= 0) continue;
    if (arrived.size() < members.size() && arrived.count(w->worker_id)) continue;
    if (!arrived.empty() && w->last_step >= arrivals.step()) continue;  // it completed that step
    // The others' wait during its last marked section (up to the section's bound) does not
    // count against it: from the section's end on, it does.
    const bool in_section = InMarkedSection(*w, now);
    Clock::time_point from = first;
    if (!in_section) {
      const Clock::time_point bound_end = w->busy_since + w->busy_bound;
      from = std::max(from, w->busy.empty() ? std::min(w->busy_ended, bound_end) : bound_end);
    }
    return Lag{w->worker_id, w->rank, Ms(now - from), in_section ? w->busy : ""};
  }
  return std::nullopt;
}

std::string WaitingText(const Lag& lag) {
  std::string text = fmt::format("the others have waited {:.0f} s for rank {} (worker {})",
                                 lag.waited_ms / 1000, lag.rank, lag.worker_id);
  if (!lag.section.empty()) text += fmt::format(", busy in '{}'", lag.section);
  return text;
}

nlohmann::json WaitingJson(const std::optional<Lag>& lag) {
  if (!lag || lag->waited_ms < kShowWaitAfterMs) return nullptr;
  return {{"rank", lag->rank},
          {"worker_id", lag->worker_id},
          {"waited_ms", std::llround(lag->waited_ms)},
          {"section", lag->section},
          {"text", WaitingText(*lag)}};
}

std::optional<Finding> DetectHang(const ProgressView& v, const ArrivalTracker& arrivals,
                                  Clock::time_point now) {
  // Slow is not hung: a member that is alive (its heartbeats flow; a stopped
  // or dead process is found by the launcher and the heartbeats) but still in
  // the script's code while the others wait is busy. It is a fault only past
  // the busy timeout, which learns the job's pace above its floor.
  std::optional<Lag> lag = FindLag(v, arrivals, now);
  if (!lag || !lag->section.empty()) return std::nullopt;
  const ControllerOptions& o = *v.options;
  const auto& spreads = arrivals.spreads_ms();
  double normal = spreads.empty() ? 0 : *std::max_element(spreads.begin(), spreads.end());
  double threshold = std::max({static_cast<double>(o.busy_timeout.count()), o.hang_factor * normal,
                               o.hang_factor * v.median_step_seconds * 1000.0});
  // A recovery's first step: a spare may still be in the script's setup (imports, its model,
  // its own snapshot load), as the stall watchdog allows it.
  if (v.recovery_open)
    threshold = std::max(threshold, static_cast<double>(o.forming_timeout.count()));
  if (lag->waited_ms <= threshold) return std::nullopt;
  return Finding{
      lag->worker_id, kHangDetector,
      fmt::format(
          "has not reached the collective of step {} while the others waited {:.0f} ms "
          "(its heartbeats flow: a training thread deadlocked or spinning; the busy "
          "timeout is {:.0f} ms, --busy-timeout-ms; a long section on some ranks only, such as an "
          "evaluation or a save on rank 0, goes inside `with session.busy(\"eval\")`)",
          arrivals.arrivals().empty() ? v.highest_step + 1 : arrivals.step(), lag->waited_ms,
          threshold)};
}

std::optional<Finding> DetectStall(const ProgressView& v, Clock::time_point now) {
  // The hang detector blames one member that lags the others; when every
  // member is stuck (a world of one, all ranks hung, a collective that never
  // completes) no one lags and only the absence of progress tells.
  if (v.members->empty()) return std::nullopt;
  bool computing = false;
  // No step can complete while a member is in a section its script marked: the time counts
  // from the end of the last one (or its bound).
  Clock::time_point since = v.progress_at;
  for (const WorkerInfo* w : *v.members) {
    if (w->role == WorkerRole::kFinished) return std::nullopt;  // the job is ending
    if (InMarkedSection(*w, now)) return std::nullopt;          // its script says it is busy
    computing = computing || w->waiting_ms < 0;
    const Clock::time_point bound_end = w->busy_since + w->busy_bound;
    since = std::max(since, w->busy.empty() ? std::min(w->busy_ended, bound_end) : bound_end);
    // Waiting members are stuck only since the last of them arrived: each was busy in the
    // script's code until then, which is no stall (a rank 0 that saved for 30 s, then came).
    if (w->waiting_ms >= 0) since = std::max(since, w->last_heard - Millis(w->waiting_ms));
  }
  const ControllerOptions& o = *v.options;
  Millis bound = o.forming_timeout;
  if (v.have_step_times && !v.recovery_open) {
    bound = std::chrono::duration_cast<Millis>(
        std::chrono::duration<double>(o.stall_factor * v.median_step_seconds));
  }
  bound = std::max(bound, o.stall_floor);
  // A member still in the script's code is busy, not stuck, up to the busy timeout.
  if (computing) bound = std::max(bound, o.busy_timeout);
  if (now - since <= bound) return std::nullopt;
  return Finding{
      -1, kStallWatchdog,
      fmt::format(
          "no step completed for {:.0f} ms (stall watchdog: the bound is {} ms; the last completed "
          "step was {})",
          Ms(now - since), bound.count(), v.highest_step)};
}

}  // namespace nonstop::controller
