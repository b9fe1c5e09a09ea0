// The value types the controller core's parts share (docs/controller.md):
// the job's options, the phase and roles, and the records of workers, hosts
// and recoveries. The Controller (controller.h) and its parts (membership,
// placement, detectors, resize policy, report) all speak in these.
//
// What it decides: nothing; plain values.
// Thread-safety: none (values; one thread drives the core).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/time.h"
#include "control/fault_spec.h"
#include "control/messages.h"
#include "nonstop/exit_codes.h"
#include "nonstop/settings.h"

namespace nonstop::controller {

// Exit codes of `nonstop run`, meaningful to a supervisor (README).
inline constexpr int kExitOk = 0;
using nonstop::kExitUsage;
// a worker failed and the job could not continue; restartable
inline constexpr int kExitPeerFailure = 10;
inline constexpr int kExitInterrupted = 130;
// RunController only: this controller stopped leading (its etcd lease ran out,
// or another controller leads); the job goes on under the next leader.
inline constexpr int kExitDeposed = 75;

enum class RecoveryMode {
  kCheckpointless,  // in-process recovery; durable checkpoints (if any) are the last rung
  // the baseline: on any fault stop everything, restart all, reload the newest checkpoint
  kCheckpointRestart,
};

// When and how the world may change size (docs/elastic.md).
struct ScalePolicy {
  int min_world = 1;
  int max_world = 0;               // 0: the initial world size
  std::vector<int> allowed_sizes;  // empty: min, min+increment, … up to max
  int increment = 1;
  Millis stable_period{0};  // the least time between two changes
  // Back-off: more than `backoff_changes` changes within `backoff_window`
  // doubles the stable period for each extra change (up to 8×).
  int backoff_changes = 3;
  Millis backoff_window{60'000};
};

struct ControllerOptions {
  ScalePolicy policy;
  RecoveryMode recovery = RecoveryMode::kCheckpointless;
  // Durable checkpoints are being written (nonstop run --checkpoint-dir): the
  // job can restart from them when no live worker holds the state.
  bool have_checkpoints = false;
  // What the front end asked for (`nonstop run --nproc, --spares`), for the
  // banner and the journal's job_start. The core takes the world and the
  // spares from the hosts' registrations (nproc and spares each).
  int world_size = 1;
  int spares = 0;
  // A member silent this long is declared failed (a hung or stopped process).
  Millis heartbeat_timeout{settings::kHeartbeatTimeoutMs.default_value};
  // Members that have not aborted and answered Ready this long (or 1.5 ×
  // the median step, if longer) after the abort are killed (escalation).
  Millis abort_timeout{settings::kAbortTimeoutMs.default_value};
  // A member lost while a spare is still starting: the recovery waits this long for the spare
  // (rather than shrink now and grow again when it joins, a second reconfiguration and, in the
  // ring mode, other bits).
  Millis spare_wait{10'000};
  std::vector<control::FaultSpec> faults;  // injected faults, fired once each
  // A grow waits this long for all the capacity it needs, to change once.
  Millis grow_gather{3'000};
  // Bounds on the phases before a worker trains (docs/thread-model.md):
  // the job must form within forming_timeout of its start (or restart), and a
  // spare started later must join within join_timeout of its start, or it is
  // killed and replaced.
  Millis forming_timeout{settings::kJoinTimeoutMs.default_value};
  Millis join_timeout{settings::kJoinTimeoutMs.default_value};
  // A live member that has not reached a step's collective busy_timeout
  // after the first member did is hung; the bound learns the job's pace
  // above it: hang_factor × the recent arrival spread, and × the median step.
  Millis busy_timeout{settings::kBusyTimeoutMs.default_value};
  double hang_factor = settings::kHangFactor.default_value;
  // Stall watchdog: when no step has completed for stall_factor × the median
  // step (at least stall_floor, and busy_timeout while a member computes;
  // forming_timeout before the first step and while a recovery moves state),
  // every member is aborted. Members that answer re-form (a stuck
  // collective); members that cannot (every rank hung, or a world of one)
  // are killed by the abort's escalation.
  double stall_factor = settings::kStallFactor.default_value;
  Millis stall_floor{settings::kStallFloorMs.default_value};
  // A failure the script raised (FailureMsg) that recurs failure_repeats
  // times ends the job (kExitScriptFailure); each is acted on failure_window
  // after its report, so that the other members' reports come with it.
  int failure_repeats = settings::kFailureRepeats.default_value;
  Millis failure_window{settings::kFailureWindowMs.default_value};
  // More than recovery_budget recoveries within recovery_budget_window end the job.
  int recovery_budget = settings::kRecoveryBudget.default_value;
  Millis recovery_budget_window{int64_t{settings::kRecoveryBudgetWindowS.default_value} * 1000};
  // Every job runs on hosts, each supervised by an agent (`nonstop run`'s own
  // agent is one, elastic): the job is placed when this many hosts have
  // registered. At least 1 (ValidateOptions, controller.h).
  int min_hosts = 1;
  int max_hosts = 0;  // 0: no limit; more agents are refused
  // A controller that takes over a running job (Takeover) waits this long
  // for the workers and agents it inherits to join it; those that do not
  // are lost (docs/controller-failover.md).
  Millis adopt_timeout{10'000};
};

enum class JobPhase { kForming, kRunning, kRecovering, kEnded };
enum class WorkerRole { kPending, kMember, kSpare, kFinished, kGone };

struct WorkerInfo {
  int worker_id = -1;
  int64_t pid = 0;
  std::string address;
  WorkerRole role = WorkerRole::kPending;
  int rank = -1;
  int64_t last_step = -1;
  int64_t waiting_ms = -1;
  Clock::time_point last_heard{};
  bool stopped = false;  // the launcher saw its process stop
  // A section its script marked busy (Session::Busy): its label ("" : none),
  // when it began and how long it may last; its peers' waits do not count
  // against it meanwhile.
  std::string busy;
  Clock::time_point busy_since{};
  Millis busy_bound{0};
  // When its last marked section ended: the others' wait counts against it from then on.
  Clock::time_point busy_ended{};
  std::string how_it_ended;  // set when its process exited
  std::string host;          // the host it runs on ("" : joined by hand, no agent started it)
  // Sharded optimizer state: the shard its state holds (state::kEveryShard:
  // every one, the initial state; kNoShard: none), from its join and Ready.
  int held_shard = -1;
};

struct HostInfo {
  std::string host_id;
  int nproc = 0, spares = 0;  // its slots: nproc + spares processes
  std::string address;
  int64_t pid = 0;
  bool alive = false;
  int incarnation = 0;  // registrations so far (a host that heals registers again)
  // taken over from a previous controller: its agent has not registered with this one yet
  bool inherited = false;
  // Its capacity follows the job (the agent of `nonstop run`, the job's only
  // host): the controller starts the workers and spares the job needs there,
  // and keeps its spare pool full, instead of filling fixed slots.
  bool elastic = false;
  // Its agent asked to leave (HostLeaving): nothing starts there any more,
  // its spares are let go and its members are released at the next step
  // boundary. Cleared when it registers again.
  bool leaving = false;
  std::string leave_reason;
  bool leave_refused = false;  // the release was refused (journaled once): its members stay
  // a member of it failed while it was leaving: its end is a loss, not a leave
  bool member_lost = false;
  Clock::time_point last_heard{};
  std::string lost_reason;
};

// One recovery, with its phases (journal "recovery_end", and the end-of-job report).
struct RecoveryRecord {
  int id = 0;
  // "recovery" (a fault) or "resize" (a planned change at a step boundary)
  std::string kind = "recovery";
  uint32_t from_generation = 0;
  uint32_t to_generation = 0;
  std::vector<std::string> causes;
  std::string injected;                       // the injected fault, if one caused it
  std::optional<Clock::time_point> fault_at;  // when the fault happened (injected faults)
  Clock::time_point detected_at{};
  std::optional<Clock::time_point> aborted_at;  // every live member had answered Ready
  std::optional<Clock::time_point> plan_at;
  // every member reported connections and state ready
  std::optional<Clock::time_point> state_ready_at;
  std::optional<Clock::time_point> first_step_at;  // every member completed the resume step
  // When the step across the fault began: the last step completed before it
  // (its first report), or the generation's start if none had been.
  std::optional<Clock::time_point> step_began_at;
  int64_t step_before = -1;  // the highest step completed before the fault
  int64_t resume_step = 0;
  int64_t lost_steps = 0;  // completed steps no survivor held
  int old_world = 0, new_world = 0;
  std::vector<std::string> replacements;  // "rank 2: worker 2 → spare worker 5"
  int spawned_spares = 0;
  double connect_seconds = 0, transfer_seconds = 0;
  uint64_t bytes_copied = 0;
  int sources = 0, refetched_chunks = 0, recovered_reports = 0;
  double normal_step_seconds = 0;
  // normal_step_seconds is the job's median step at its end: the controller knew no step time
  // when the fault came (the job's second step: the first builds the model; soon after a
  // takeover).
  bool normal_step_from_the_end = false;
  std::string outcome = "in progress";  // "completed", "superseded by recovery N", "failed"
  bool restarted = false;               // every worker was restarted from a durable checkpoint
  int64_t redone_steps = 0;             // completed steps to be computed again after a restart
  std::set<std::string> failed_hosts;   // hosts of the members lost (their spares are picked last)
};

// A worker started and not joined yet.
struct AwaitedJoin {
  bool spare = false;
  std::optional<Clock::time_point> since;  // unset: since the job started
};

// Numbers from workers enter the controller's arithmetic only within sane
// ranges: a worker that lies (INT64_MAX steps, a NaN step time) is ignored,
// never a cause of overflow or undefined behaviour.
inline constexpr int64_t kMaxStep = int64_t{1} << 53;
inline bool SaneStep(int64_t step) { return step >= control::kNoValidState && step <= kMaxStep; }

// A member of the current generation still taking part (it may have finished training).
inline bool IsLiveMember(const WorkerInfo& w) {
  return w.role == WorkerRole::kMember || w.role == WorkerRole::kFinished;
}

}  // namespace nonstop::controller
