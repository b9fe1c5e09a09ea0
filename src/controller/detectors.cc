#include "controller/detectors.h"

#include <algorithm>

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

std::optional<Finding> DetectHang(const ProgressView& v, const ArrivalTracker& arrivals,
                                  Clock::time_point now) {
  const std::vector<WorkerInfo*>& members = *v.members;
  const auto& arrived = arrivals.arrivals();
  const auto& spreads = arrivals.spreads_ms();
  if (v.recovery_open || spreads.size() < 5 || arrived.empty() ||
      arrived.size() >= members.size()) {
    return std::nullopt;
  }
  double normal = *std::max_element(spreads.begin(), spreads.end());
  const ControllerOptions& o = *v.options;
  double threshold = std::max({static_cast<double>(o.hang_floor.count()), o.hang_factor * normal,
                               0.5 * v.median_step_seconds * 1000.0});
  Clock::time_point first = Clock::time_point::max();
  for (const auto& [id, t] : arrived) first = std::min(first, t);
  double lag = Ms(now - first);
  if (lag <= threshold) return std::nullopt;
  for (const WorkerInfo* w : members) {
    if (w->role != WorkerRole::kMember || arrived.count(w->worker_id) ||
        w->last_step >= arrivals.step())
      continue;
    return Finding{
        w->worker_id, kHangDetector,
        fmt::format(
            "has not reached the collective of step {} {:.0f} ms after the first member did "
            "(the last of the recent steps' arrivals came at most {:.0f} ms after the first)",
            arrivals.step(), lag, normal)};
  }
  return std::nullopt;
}

std::optional<Finding> DetectSlowMember(const ProgressView& v) {
  const ControllerOptions& o = *v.options;
  double threshold_ms = std::max<double>(static_cast<double>(o.watchdog_floor.count()),
                                         o.watchdog_factor * v.median_step_seconds * 1000.0);
  int64_t longest_wait = -1;
  for (const WorkerInfo* w : *v.members) longest_wait = std::max(longest_wait, w->waiting_ms);
  if (static_cast<double>(longest_wait) <= threshold_ms) return std::nullopt;
  for (const WorkerInfo* w : *v.members) {
    if (w->role == WorkerRole::kMember && w->waiting_ms < 0) {
      return Finding{
          w->worker_id, kStepProgressWatchdog,
          fmt::format("has not reached the collective of step {} while others waited {} ms",
                      w->last_step + 1, longest_wait)};
    }
  }
  return std::nullopt;
}

std::optional<Finding> DetectStall(const ProgressView& v, Clock::time_point now) {
  // The watchdogs above blame one member that lags the others; when every
  // member is stuck (a world of one, all ranks hung, a collective that never
  // completes) no one lags and only the absence of progress tells.
  if (v.members->empty()) return std::nullopt;
  for (const WorkerInfo* w : *v.members) {
    if (w->role == WorkerRole::kFinished) return std::nullopt;  // the job is ending
  }
  const ControllerOptions& o = *v.options;
  Millis bound = o.forming_timeout;
  if (v.have_step_times && !v.recovery_open) {
    bound = std::chrono::duration_cast<Millis>(
        std::chrono::duration<double>(o.stall_factor * v.median_step_seconds));
  }
  bound = std::max(bound, o.stall_floor);
  if (now - v.progress_at <= bound) return std::nullopt;
  return Finding{
      -1, kStallWatchdog,
      fmt::format(
          "no step completed for {:.0f} ms (stall watchdog: the bound is {} ms; the last completed "
          "step was {})",
          Ms(now - v.progress_at), bound.count(), v.highest_step)};
}

}  // namespace nonstop::controller
