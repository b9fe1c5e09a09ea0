// Detectors: the controller's checks of time (docs/architecture.md
// "Failure detection", docs/controller.md, docs/recovery.md "Detection").
//
// What it decides: what fired, and why — a silent agent or worker
// (heartbeats), a worker that did not join in time or a job that did not form
// (join deadlines), a member that has not reached the step's collective long
// after the others did, its heartbeats still flowing (the hang detector: past
// the busy timeout, learnt from the recent arrival spreads and step times
// above its floor), no step completed at all for far longer than a step takes
// (the stall watchdog). Each is a pure
// function of a view of the job and `now`: no clock is read inside; the
// Controller acts on what they return (MemberFault, WorkerUnresponsive,
// HostDown, a recovery of every member, the end of the job).
// What it owns: the two small records the detectors learn "normal" from —
// the recent step times (StepTimes) and the members' arrivals at each step's
// collective with the recent spreads (ArrivalTracker); the Controller feeds them.
// Thread-safety: none; values and pure functions (the Controller's thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/time.h"
#include "controller/core_types.h"

namespace nonstop::controller {

// The kinds of fault the detectors report (the journal's "fault" records).
inline constexpr const char* kHeartbeatTimeout = "heartbeat timeout";
inline constexpr const char* kHangDetector = "hang detector";
inline constexpr const char* kStallWatchdog = "stall watchdog";

// What fired: the worker (-1: none in particular), the kind, and the detail text.
struct Finding {
  int worker_id = -1;
  std::string kind;
  std::string detail;
};

// Recent step times (rank order does not matter: the first member to report a step).
class StepTimes {
 public:
  void Add(double seconds);  // keeps the last 20
  double MedianSeconds() const;
  bool empty() const { return seconds_.empty(); }

 private:
  std::deque<double> seconds_;
};

// The members' arrival at each step's collective: the first arrival starts
// the clock of the hang detector; when all have arrived, the spread between
// first and last is what "normal" looks like for the next steps.
class ArrivalTracker {
 public:
  // Member `worker_id` arrived at the collective of `step` at `at`; `world`
  // members take part. `baseline`: a complete step's spread counts as normal
  // (not so right after a change of membership, which includes its cost).
  void Record(int worker_id, int64_t step, Clock::time_point at, size_t world, bool baseline);
  // A new membership has its own normal.
  void Reset();
  // The controller did not run for `away` (ControllerStalled): the arrivals move on by it, never
  // past `now`, so a member late only by that stall is not a hang.
  void MoveOn(Millis away, Clock::time_point now);
  int64_t step() const { return step_; }
  const std::map<int, Clock::time_point>& arrivals() const { return arrivals_; }
  const std::deque<double>& spreads_ms() const { return spreads_ms_; }

 private:
  int64_t step_ = -1;
  std::map<int, Clock::time_point> arrivals_;  // worker id → when
  std::deque<double> spreads_ms_;              // the last 32
};

// ---- heartbeats

// Live agents silent for longer than the heartbeat timeout: the host and the detail.
struct SilentHost {
  std::string host_id;
  std::string detail;  // "its agent sent no heartbeat for 1200 ms"
};
std::vector<SilentHost> SilentHosts(const std::map<std::string, HostInfo>& hosts,
                                    Clock::time_point now, Millis heartbeat_timeout);
// Workers that must be heard from (pending and spare workers, and members
// while the job runs) and were silent for longer than the heartbeat timeout,
// ascending ids. The detail is HeartbeatDetail at the moment the Controller
// acts on each: an action on an earlier one may have changed the worker.
std::vector<int> SilentWorkers(const std::map<int, WorkerInfo>& workers, JobPhase phase,
                               Clock::time_point now, Millis heartbeat_timeout);
std::string HeartbeatDetail(Clock::time_point last_heard, Clock::time_point now);

// ---- join deadlines

struct JoinView {
  JobPhase phase = JobPhase::kForming;
  const std::map<int, AwaitedJoin>* awaiting = nullptr;  // started, not joined yet
  const std::map<int, WorkerInfo>* workers = nullptr;
  Clock::time_point started_at{};     // the controller's first event
  Clock::time_point forming_since{};  // when the current forming phase began
  bool placed = false;  // the hosts it needs registered and their workers were started
  int alive_hosts = 0, min_hosts = 1;
  int world_size = 0;  // the world the job forms with
  Millis forming_timeout{0}, join_timeout{0};
};
struct JoinDeadlines {
  std::optional<std::string> not_formed;  // the job did not form in time: why it ends
  // workers that did not join in time (the job runs), ascending ids
  std::vector<int> late;
};
JoinDeadlines DetectJoinDeadlines(const JoinView& view, Clock::time_point now);

// ---- the members' progress

struct ProgressView {
  const std::vector<WorkerInfo*>* members = nullptr;  // the generation's, by rank
  // the thresholds (hang_*, watchdog_*, stall_*, forming_timeout)
  const ControllerOptions* options = nullptr;
  bool recovery_open = false;  // a recovery or resize whose first step has not completed
  double median_step_seconds = 0;
  bool have_step_times = false;
  Clock::time_point progress_at{};  // a step last completed, or the members were last given a plan
  int64_t highest_step = -1;
};
// Whether `w` runs a section its script marked busy (Session::Busy), within the section's bound.
bool InMarkedSection(const WorkerInfo& w, Clock::time_point now);
// A member that others wait for: it has not reached the collective that
// another member waits in (the tracked step's, or a wait a heartbeat
// reported). The first such member by rank, how long the first of the others
// has waited, and its marked section ("" : none).
struct Lag {
  int worker_id = -1;
  int rank = -1;
  double waited_ms = 0;
  std::string section;
};
std::optional<Lag> FindLag(const ProgressView& view, const ArrivalTracker& arrivals,
                           Clock::time_point now);
// "the others have waited 12 s for rank 0 (worker 3), busy in 'evaluation'"
std::string WaitingText(const Lag& lag);
// The lag for /status: rank, worker_id, waited_ms, section and text; null when none.
nlohmann::json WaitingJson(const std::optional<Lag>& lag);
// A member waited for this long is shown (journal, status, progress line): a
// step's normal skew is shorter.
inline constexpr double kShowWaitAfterMs = 2'000;
// The hang detector: the member others wait for (FindLag), outside a marked
// section, for longer than the busy timeout (at least; and hang_factor × the
// recent arrival spread, and × the median step).
std::optional<Finding> DetectHang(const ProgressView& view, const ArrivalTracker& arrivals,
                                  Clock::time_point now);
// The stall watchdog: no step completed for stall_factor × the median step (at
// least stall_floor, and busy_timeout while a member computes; forming_timeout
// before the first step and while a recovery moves state; never while a member
// runs a marked section). The finding names no worker: every member aborts.
std::optional<Finding> DetectStall(const ProgressView& view, Clock::time_point now);

}  // namespace nonstop::controller
