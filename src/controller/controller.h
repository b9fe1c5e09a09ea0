// Controller: the job's brain, as a pure state machine (docs/architecture.md "The control plane").
//
// Handle(event, now) → actions. It owns no socket, clock or process: the
// runtime around it (src/controller/runtime.cc) turns socket traffic,
// process exits and timer ticks into Events, and carries out the Actions it
// returns (send a plan, abort a generation, kill or start a worker, append to
// the journal, end the job). Every membership decision is therefore testable
// without threads (controller_test.cc).
//
// Generations. A generation is one membership: who is in, in which rank
// order, from which step. Generation 1 forms when the world's non-spare
// workers have joined; ranks follow worker ids. Spares join and wait.
//
// Faults and recovery (checkpointless, in-process):
//   1. A fault is detected: a member's process exits, its control connection
//      drops, its heartbeats stop, the step-progress watchdog fires, it
//      reports a failure, or a member reports that its collective failed.
//   2. The failed worker is killed (it may be hung) and every live member is
//      told to abort generation g. Each answers Ready with the step its state
//      holds. A member that has not answered within abort_timeout is killed
//      too (escalation).
//   3. Plan g+1: survivors keep their rank order; a spare takes each lost
//      rank, or the job shrinks when none is left. It resumes at s*+1, s* the
//      highest step a survivor holds; every member not at s* (a spare, a
//      member one step behind) copies the state from the members at s*.
//      If no live worker holds s*, the job ends with a clear message.
//      The decision is the planner's (planner.h), a pure function of a view
//      of the job; the controller builds the view and applies the result.
//   4. Members report when connections and state are ready; the recovery ends
//      when every member has completed the resume step. Its phases are
//      journaled and summarised at the end of the job.
// A fault during a recovery starts a new one from the current members.
//
// Hosts (docs/multihost.md). Every worker runs on a host whose agent started
// it; a host is a failure domain. The job is placed when min_hosts agents
// have registered: each host starts its nproc workers (the world is their
// sum) and its spares. A host that registers later (or again, after it was
// lost) fills its slots with spares, which grow the job up to the policy's
// maximum. Every host keeps its slots (nproc + spares processes) filled with
// spares as processes end. The loss of a host (its agent's connection or
// heartbeats) is the loss of every worker on it, handled as ONE recovery; its
// workers are fenced (their control connections closed). Plans prefer spares
// on hosts that did not just fail, and list state sources alternating over
// hosts.
// One elastic host (`nonstop run`'s own agent, the job's only one): its
// capacity follows the job. The workers and spares the job needs start
// there (a grow on request, a restart), and its spare pool is refilled one
// for one, instead of fixed slots being filled.
//
// The parts (docs/controller.md). The Controller is their composition: it
// keeps the event handlers (On) and the recovery state machine (OpenRecovery
// → MaybeFinishAbort → FormNextGeneration → ApplyPlan, RestartFromCheckpoint),
// and calls
//   - Membership (membership.h): the workers, their roles, the members by rank;
//   - Placement (placement.h): the hosts, their slots, where processes run and go;
//   - the detectors (detectors.h): pure checks of time that say what fired;
//   - the resize policy (resize_policy.h): pure size rules and timing;
//   - the planner (planner.h): the next generation, from a view;
//   - the report (report.h): the records as JSON and text.
// The parts call no part and never the Controller.
//
// Thread-safety: none; one thread drives it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/time.h"
#include "control/fault_spec.h"
#include "control/messages.h"
#include "controller/core_types.h"
#include "controller/detectors.h"
#include "controller/job_store.h"
#include "controller/membership.h"
#include "controller/placement.h"
#include "controller/planner.h"
#include "controller/resize_policy.h"
#include "controller/script_failures.h"
#include "nonstop/status.h"

namespace nonstop::controller {

// The recovery (or resize) a journal saw start and not end: its controller
// stopped during it (TakeoverState::open_recovery). Times are the records'
// time_us (wall clock, 0: not recorded), read against
// TakeoverState::read_at_us.
struct UnfinishedRecovery {
  int id = 0;
  bool planned = false;  // a resize
  uint32_t from_generation = 0;
  std::vector<int> old_members;  // of from_generation, by rank
  std::string cause, injected;
  int64_t started_us = 0;
  uint32_t plan_generation = 0;  // its plan's generation (0: its plan did not go out)
  int64_t plan_us = 0;
};

// What a controller taking over a running job knows of it: the last state
// its predecessor recorded (the journal: TakeoverFromJournal; or etcd).
struct TakeoverState {
  uint32_t generation = 0;
  std::vector<int> members;  // worker ids, index = rank
  int64_t resume_step = 0;
  int64_t highest_step = -1;
  struct Worker {
    int worker_id = -1;
    int64_t pid = 0;
    std::string address;  // empty: started, not joined yet
    bool spare = false;
    std::string host;
  };
  std::vector<Worker> workers;  // alive at the last record: members, spares, and started ones
  struct Host {
    std::string host_id;
    int nproc = 0, spares = 0;
    std::string address;
    int incarnation = 0;
    bool elastic = false;  // its capacity follows the job (HostInfo::elastic)
  };
  std::vector<Host> hosts;  // alive at the last record
  int next_worker_id = 0;
  // What scale requests left behind: the world size asked for (0: none
  // asked), and per host the slots a shrink gave back, not to be refilled.
  int target_world = 0;
  std::map<std::string, int> withheld;
  int recoveries = 0;  // recovery ids so far (new ones continue from here)
  int takeovers = 0;   // controllers that took over before this one
  std::optional<UnfinishedRecovery> open_recovery;
  nlohmann::json store;    // the job's store (JobStore::Save); null: empty
  int64_t read_at_us = 0;  // wall clock when the journal was read
  // The journal stopped at a value that does not verify (coord::JournalRead::cut): members may
  // rejoin generations ahead of it, which a journal read whole never allows.
  bool journal_cut = false;
};

// ---- events ----
struct WorkerJoined {
  control::JoinMsg msg;
};
struct HeartbeatReceived {
  int worker_id;
  control::HeartbeatMsg msg;
};
struct ProgressReceived {
  int worker_id;
  control::ProgressMsg msg;
};
struct FinishedReceived {
  int worker_id;
  control::FinishedMsg msg;
};
struct FailureReported {
  int worker_id;
  control::FailureMsg msg;
};
struct ReadyReceived {
  int worker_id;
  control::ReadyMsg msg;
};
struct RecoveredReceived {
  int worker_id;
  control::RecoveredMsg msg;
};
struct InjectedReceived {
  int worker_id;
  control::InjectedMsg msg;
};
// A request to the job's store (JobStore).
struct StoreRequested {
  int worker_id;
  control::StoreRequestMsg msg;
};
struct ConnectionLost {
  int worker_id;
  std::string reason;
};
// host: the agent that reported it; an agent's report about a worker of
// another host is ignored.
// signal 0: exited normally
struct ProcessExited {
  int worker_id;
  int64_t pid;
  int exit_code;
  int signal;
  std::string host;
};
// The process is dying now: the lifeline it held fired as the kernel began its
// exit (common/lifeline.h), milliseconds before its exit is seen
// (ProcessExited) and its control connection closes.
struct ProcessDying {
  int worker_id;
  int64_t pid;
  std::string host;
};
// The launcher saw the process stop (SIGSTOP, SIGTSTP: a frozen worker).
struct ProcessStopped {
  int worker_id;
  int64_t pid;
  int signal;
  std::string host;
};
// An agent registered its host.
struct HostJoined {
  control::AgentRegisterMsg msg;
};
struct HostHeartbeat {
  std::string host_id;
  control::AgentHeartbeatMsg msg;
};
// An agent's connection closed or broke.
struct HostLost {
  std::string host_id;
  std::string reason;
};
// An agent asks that its host leave the job (its capacity is taken back: a
// Slurm preemption): its workers are released at the next step boundary.
struct HostLeaving {
  std::string host_id;
  control::AgentLeavingMsg msg;
};
// An agent started a worker process (pid), or could not (error).
struct WorkerStarted {
  std::string host_id;
  control::AgentStartedMsg msg;
};
struct Tick {};
// An abort or drain the core ordered waits for the journal's sync (`held`; Runtime::RunPending: a
// hung disk holds it up to 11 s, etcd as long as the lease holds and the write has not landed), or
// has gone out now (!held). The members' answers are awaited from when it went out, not from when
// it was decided. Both are job-wide: a held order pauses every member's deadline (the kills that
// would follow queue behind it anyway), one that goes out gives every member the window again.
struct StopOrdersHeld {
  bool held = false;
};
// A request to change the world size: {"world_size": N}, {"release": N} or {"grow": N} (POST
// /scale).
struct ScaleRequest {
  int request_id;
  nlohmann::json body;
  std::string source;
};
// The launcher was told to stop (SIGINT, SIGTERM): end the job now.
struct Interrupted {
  std::string how;
};
// This controller takes over a running job; the first event it handles.
struct Takeover {
  TakeoverState state;
};
// This controller's process did not run for `away` (Runtime::Tick: a starved process, a machine
// or VM that stalled). Every peer's silence clock moves on by it, and so do the stall watchdog's,
// the hang detector's arrivals, the join deadline's start, the abort window and a spare's wait,
// never past now and never backwards. What peers sent meanwhile was read before this event, so a
// peer still silent had no chance to send if its process stalled with this one (the same
// machine); a peer that really died is found `away` later.
struct ControllerStalled {
  Millis away{0};
};
using Event =
    std::variant<WorkerJoined, HeartbeatReceived, ProgressReceived, FinishedReceived,
                 FailureReported, ReadyReceived, RecoveredReceived, InjectedReceived,
                 ConnectionLost, ProcessExited, ProcessStopped, Tick, ScaleRequest, Interrupted,
                 HostJoined, HostHeartbeat, HostLost, WorkerStarted, Takeover, HostLeaving,
                 ProcessDying, StopOrdersHeld, ControllerStalled, StoreRequested>;

// ---- actions ----
// Every member of a generation gets the same plan: one PlanMsg, shared by the
// SendPlan actions of all members (a plan lists every member, so a copy per
// member would cost O(world²) memory and time), and encoded once by the
// runtime (docs/scale.md).
struct SendPlan {
  int worker_id;
  std::shared_ptr<const control::PlanMsg> plan;
};
// Likewise one AbortMsg for all members of the generation that ends.
struct SendAbort {
  int worker_id;
  std::shared_ptr<const control::AbortMsg> msg;
};
struct SendDrain {
  int worker_id;
  control::DrainMsg msg;
};
struct ScaleReply {
  int request_id;
  int http_status;
  nlohmann::json body;
};
struct SendShutdown {
  int worker_id;
  control::ShutdownMsg msg;
};
// SIGKILL now; a remote worker's control connection is closed too
struct KillWorker {
  int worker_id;
};
struct SignalWorker {
  int worker_id;
  int signal;
};  // injected time-based faults
// resume: load the newest checkpoint. background: a pool refill, started at a
// low priority so that it warms up without slowing the job.
// host: the agent that starts it.
struct SpawnWorker {
  int worker_id;
  bool spare;
  bool resume = false;
  bool background = false;
  std::string host;
  // torchrun's variables the worker starts with (Controller::TorchrunAtSpawn).
  std::vector<std::pair<std::string, std::string>> torchrun;
};
// Tell an agent why it must go (a refusal, or a host declared lost: fencing)
// and close its connection.
// fence: only close the connection (a host declared lost): the agent, if it
// still lives, kills its processes and registers again; otherwise a shutdown
// with the reason and exit code goes first (a refusal: the agent exits).
struct CloseHost {
  std::string host_id;
  std::string reason;
  int exit_code = kExitPeerFailure;
  bool fence = false;
};
// The job's store answers a worker (a write's answer goes out after its journal record, as every
// order: a controller that takes over knows what it answered).
struct SendStoreReply {
  int worker_id;
  control::StoreReplyMsg msg;
};
struct AppendJournal {
  nlohmann::json record;
};
struct PrintLine {
  std::string line;
};
struct EndJob {
  int exit_code;
  std::string reason;
};
using Action = std::variant<SendPlan, SendAbort, SendDrain, SendShutdown, KillWorker, SignalWorker,
                            SpawnWorker, AppendJournal, PrintLine, EndJob, ScaleReply, CloseHost,
                            SendStoreReply>;

// The largest worker id a join may claim (and an agent may list).
constexpr int kMaxWorkerId = 1 << 30;

// Whether the options describe a job the core can run, naming the field that
// does not: every job runs on hosts (min_hosts at least 1), and max_hosts is
// 0 (no limit) or at least min_hosts. The runtime checks before it starts
// (RunController); the Controller requires it.
Status ValidateOptions(const ControllerOptions& options);

class Controller {
 public:
  // `options` must pass ValidateOptions (checked: a programming error otherwise).
  explicit Controller(ControllerOptions options);

  std::vector<Action> Handle(const Event& event, Clock::time_point now);

  JobPhase phase() const { return phase_; }
  uint32_t generation() const { return generation_; }
  const std::map<int, WorkerInfo>& workers() const { return membership_.workers(); }
  const std::vector<RecoveryRecord>& recoveries() const { return recoveries_; }
  nlohmann::json Status() const;
  nlohmann::json PolicyJson() const;
  int target_world() const { return target_world_; }
  const JobStore& store() const { return store_; }
  // The members of the current generation, by rank (worker ids).
  const std::vector<int>& members() const { return membership_.members(); }
  size_t world_size() const { return membership_.members().size(); }
  // The rank a worker holds now, or -1 (spare, gone, not yet placed).
  int RankOf(int worker_id) const { return membership_.RankOf(worker_id); }
  const std::map<std::string, HostInfo>& hosts() const { return placement_.hosts(); }
  // The host a worker was started on ("" : unknown, or joined by hand).
  std::string HostOf(int worker_id) const { return placement_.HostOf(worker_id); }
  // Capacity is the hosts' fixed slots (nproc + spares each). Not so for a job
  // whose one host is elastic: it starts what the job needs there.
  bool slotted() const { return placement_.slotted(); }
  // The pending injected faults, for workers started later.
  const std::vector<control::FaultSpec>& pending_faults() const { return pending_faults_; }
  // The rank, world and hosts torchrun would give worker `worker_id` on `host`
  // as it starts (docs/python.md, "The environment contract"): at the job's
  // forming, a worker's rank is its place among the workers started to train
  // (the first generation takes the lowest ids), its host's workers are its
  // LOCAL_WORLD_SIZE, and rank 0's host is MASTER_ADDR. A spare, or a worker
  // started later, has RANK = WORLD_SIZE and LOCAL_RANK = its worker id mod its
  // host's slots until it takes a rank; the session then sets the live values.
  std::vector<std::pair<std::string, std::string>> TorchrunAtSpawn(int worker_id, bool spare,
                                                                   const std::string& host) const;

 private:
  // ---- events (controller.cc; hosts and takeover: controller_hosts.cc)
  void On(const WorkerJoined& e, std::vector<Action>* out);
  void On(const HeartbeatReceived& e, std::vector<Action>* out);
  void On(const ProgressReceived& e, std::vector<Action>* out);
  void On(const FinishedReceived& e, std::vector<Action>* out);
  void On(const FailureReported& e, std::vector<Action>* out);
  void On(const ReadyReceived& e, std::vector<Action>* out);
  void On(const RecoveredReceived& e, std::vector<Action>* out);
  void On(const InjectedReceived& e, std::vector<Action>* out);
  void On(const ConnectionLost& e, std::vector<Action>* out);
  void On(const ProcessExited& e, std::vector<Action>* out);
  void On(const ProcessStopped& e, std::vector<Action>* out);
  void On(const ProcessDying& e, std::vector<Action>* out);
  void On(const Tick& e, std::vector<Action>* out);
  void On(const StopOrdersHeld& e, std::vector<Action>* out);
  void On(const ControllerStalled& e, std::vector<Action>* out);
  void On(const ScaleRequest& e, std::vector<Action>* out);
  void On(const Interrupted& e, std::vector<Action>* out);
  void On(const HostJoined& e, std::vector<Action>* out);
  void On(const HostHeartbeat& e, std::vector<Action>* out);
  void On(const HostLost& e, std::vector<Action>* out);
  void On(const WorkerStarted& e, std::vector<Action>* out);
  void On(const Takeover& e, std::vector<Action>* out);
  void On(const HostLeaving& e, std::vector<Action>* out);
  void On(const StoreRequested& e, std::vector<Action>* out);
  // A member finished while another waits in a later step's collective: the job ends (exit 12).
  void CheckFinishedWhileOthersWait(std::vector<Action>* out);
  // "the injected fault(s) … never fired" for faults of the job's list that cannot have fired by
  // the end of training at `final_step` (exit 2 then: a test built on them would pass untested):
  // a step fault past it, a time fault never sent. Else empty.
  std::string UnfiredFaults(int64_t final_step) const;
  // A process that exits once the job has ended: a member's error fails the job.
  void ExitedAfterTheEnd(const ProcessExited& e, std::vector<Action>* out);
  // The store's answers, as orders.
  static void Answer(std::vector<JobStore::Answer> answers, std::vector<Action>* out);

  // ---- workers
  // Forms a generation from scratch: at the start, and after a restart from a checkpoint.
  void MaybeFormFirstGeneration(std::vector<Action>* out);
  // Emits SpawnWorker (on `host`; "": the elastic host) and remembers that
  // the worker must join in time.
  void Spawn(int worker_id, bool spare, bool resume, bool background, std::vector<Action>* out,
             const std::string& host = "");
  // A spare to replace one that was used or lost: one for one on the elastic
  // host; on hosts of fixed slots, wherever a slot is free.
  void RefillSpare(std::vector<Action>* out);
  // A worker of any role stopped answering (frozen, heartbeats gone): it is
  // killed, and replaced according to its role.
  void WorkerUnresponsive(int worker_id, const std::string& kind, const std::string& detail,
                          std::vector<Action>* out);
  // A member failed: it leaves the membership (and is killed); recovery starts or continues.
  void MemberFault(int worker_id, const std::string& kind, const std::string& detail,
                   std::vector<Action>* out);
  void SpareLost(WorkerInfo& w, const std::string& how, std::vector<Action>* out,
                 const std::string& kind = "exit");
  // A spare a plan may promote: heard from lately, not stopped, on a responsive host, not still to
  // be adopted.
  bool Promotable(const WorkerInfo& w) const;

  // ---- the detectors' findings, acted on (each Tick)
  void CheckJoinDeadlines(std::vector<Action>* out);
  void CheckHeartbeats(std::vector<Action>* out);
  // The member the others wait for (FindLag), journaled ("waiting") once it
  // has been waited for a while and again when the wait ends, for the
  // status, the dashboard and the progress line.
  void NoteWaiting(std::optional<Lag> lag, std::vector<Action>* out);
  // Failures the script raised whose window has passed: the job ends if one
  // recurs too often, else each member is replaced (MemberFault).
  void ActOnHeldFailures(std::vector<Action>* out);
  bool HoldingALiveMembersFailure() const;  // a held report of a member still in the generation
  // Records a hang the detector found; ends the job (true) when it repeats too often.
  bool HangRepeats(const Finding& hang, std::vector<Action>* out);

  // ---- recovery: OpenRecovery → MaybeFinishAbort → FormNextGeneration → ApplyPlan
  // Opens a recovery record (and aborts the members, unless `planned`), then
  // forms the next generation at once when no live member is left to answer.
  void StartRecovery(const std::string& cause, std::vector<Action>* out, bool planned = false);
  // Only the first part of StartRecovery: the record, the aborts, the journal.
  void OpenRecovery(const std::string& cause, bool planned, std::vector<Action>* out);
  void MaybeFinishAbort(std::vector<Action>* out);
  // Whether the plan waits for a spare that is still starting (see spare_wait_until_).
  bool WaitForStartingSpare(std::vector<Action>* out);
  // Every live member answered the abort: the planner decides generation
  // g+1 from PlanView(), and it is applied (or the job restarts, or ends).
  void FormNextGeneration(std::vector<Action>* out);
  PlanInput PlanView(const RecoveryRecord& rec) const;
  // Carries out a plan (verdict kPlan): roles, generation, record, plan messages, spawns, journal.
  void ApplyPlan(NextGeneration next, RecoveryRecord& rec, std::vector<Action>* out);
  // Step faults that stop a worker (kill, hang, stall, spin), of a rank whose member is lost while
  // in the fault's step: fired, announced or not (an announcement is lost when the worker dies
  // before it leaves), so no newcomer to that rank is handed them again.
  void SpendFaultsOfTheLost(RecoveryRecord& rec, std::vector<Action>* out);
  void MaybeCloseRecovery(std::vector<Action>* out);
  std::optional<Clock::time_point> StepReportedLate(const control::ProgressMsg& m);
  // The recovery a takeover found open: if its plan is the generation taken
  // over, it stays open and ends as any does (MaybeCloseRecovery); if its
  // plan never went out, it ends now, interrupted.
  void AdoptOpenRecovery(const TakeoverState& s, std::vector<Action>* out);
  // Kills every worker and starts the job again from the newest durable
  // checkpoint. The recovery record is the open one (opened if none is).
  void RestartFromCheckpoint(const std::string& why, std::vector<Action>* out);
  void End(int exit_code, const std::string& reason, std::vector<Action>* out);

  // ---- elasticity: a planned change of the world size at a step boundary
  void StartResize(int new_world, const std::string& trigger, std::vector<Action>* out,
                   std::set<int> release = {});
  void MaybeGrow(std::vector<Action>* out);
  // A member lost during a planned resize: the survivors may be blocked in a
  // collective with it, which the drain alone never ends; they are aborted.
  void EscalateResize(std::vector<Action>* out);
  // The members have `window` to answer the abort or drain decided now (abort_deadline_).
  void ArmAbortDeadline(Millis window);
  // An abort's window: abort_timeout, or 1.5 normal steps where that is longer (a healthy member
  // answers at its next check, which a slow step puts off).
  Millis AbortWindow() const;
  // Releases the members of leaving hosts at the next step boundary, once the
  // job runs (a planned resize; spares elsewhere take their ranks where the
  // policy does not allow the smaller world).
  void MaybeReleaseLeavingHosts(std::vector<Action>* out);

  // ---- hosts (controller_hosts.cc)
  void PlaceOnHosts(bool resume, std::vector<Action>* out);
  // Fills every free slot of every live host with a spare.
  void TopUpHosts(std::vector<Action>* out);
  void HostDown(const std::string& host_id, const std::string& reason, std::vector<Action>* out);
  // A worker the job was forming with is gone for good: a joined spare takes
  // its place, or a new worker where a slot is free, or the job forms smaller.
  void ReplaceFormingWorker(const std::string& lost_host, std::vector<Action>* out);

  // ---- takeover (controller_hosts.cc)
  // A worker inherited from the previous controller joined this one.
  void Rejoined(const control::JoinMsg& m, std::vector<Action>* out);
  // An agent inherited from the previous controller registered with this one,
  // listing the processes it kept running.
  void HostRejoined(HostInfo& h, const control::AgentRegisterMsg& m, std::vector<Action>* out);
  // Orders the agent of `host` to kill a process the job does not count on.
  void ReserveWorkerId(int worker_id);
  void FenceProcess(const std::string& host, int worker_id, int64_t pid, const std::string& why,
                    std::vector<Action>* out);

  const ControllerOptions options_;
  int world_size_ = 0;  // the initial world: the hosts' nproc, once placed
  Membership membership_;
  Placement placement_;
  Clock::time_point now_{};
  std::optional<Clock::time_point> started_at_;
  Clock::time_point forming_since_{};  // when the current forming phase began
  JobPhase phase_ = JobPhase::kForming;
  uint32_t generation_ = 0;
  // Workers that exited with code 0 before the job formed, without joining (a torchrun script).
  int unjoined_exits_ = 0;
  // optimizer.shard_group of the job's workers: -1 until one joins, 0 when
  // nothing is sharded. A worker of another group size is refused.
  int shard_group_ = -1;
  int sealed_copy_ = -1;  // whether the workers seal their state copies (as shard_group_: -1 none)
  int64_t resume_step_ = 0;
  int64_t highest_step_ = -1;  // highest step any worker ever reported complete
  int64_t last_journaled_step_ = -1;
  // The job's course for the time lost: the last step it completed (its first report; after a
  // plan, the step the members resume after) and when the step after it began: that report, or
  // the generation's start. Unset after a takeover until a step completes.
  int64_t clock_step_ = -1;
  std::optional<Clock::time_point> step_began_at_;
  // step_began_at_ is the start of step clock_step_ + 1 (set by its first report or the
  // generation's start), not a start kept across a recovery's plan, which resets clock_step_:
  // only then can a late report estimate that step's end from it (StepReportedLate).
  bool clock_exact_ = false;
  int finished_ = 0;
  // When the first member of the generation finished (CheckFinishedWhileOthersWait).
  std::optional<Clock::time_point> first_finished_at_;
  std::optional<std::string> checksum_;
  // Injected faults not fired yet, and the last one fired (its recovery names it).
  std::vector<control::FaultSpec> pending_faults_;
  // Faults SpendFaultsOfTheLost took as fired: an announcement that still comes is not a new one.
  std::set<int> spent_unannounced_;
  std::optional<std::pair<Clock::time_point, std::string>> last_injected_;
  // What the detectors learn normal from, and the last progress.
  StepTimes step_times_;             // recent step times
  ArrivalTracker arrivals_;          // the members' arrivals at each step's collective
  Clock::time_point progress_at_{};  // a step last completed, or the members were last given a plan
  std::optional<Lag> waiting_;       // the member the others wait for, at the last tick
  int waiting_journaled_ = -1;       // the worker of the journaled "waiting" record (-1: none)
  ScriptFailures script_failures_;   // the failures the members reported, held and acted on
  JobStore store_;                   // the job's key-value store (docs/store.md)
  RecoveryBudget recovery_budget_;

  // The recovery state machine.
  std::vector<RecoveryRecord> recoveries_;
  std::optional<size_t> open_recovery_;  // index into recoveries_
  // live member → the step its state holds (during an abort)
  std::unordered_map<int, int64_t> ready_;
  // During an abort, members[0 .. abort_scan_) are known to be gone or
  // ready (a member that is either stays so until the next generation), so
  // that each Ready costs O(1) amortised instead of a scan of every member.
  size_t abort_scan_ = 0;
  // After a plan, members[0 .. close_scan_) are known to have completed the
  // resume step or finished (last_step only grows while the members stay).
  size_t close_scan_ = 0;
  Clock::time_point abort_deadline_{};
  // How long the members have to answer an abort or a drain once it has gone out
  // (ArmAbortDeadline): abort_deadline_ is at least that after it was sent (StopOrdersHeld), and
  // nobody is late while it is held back.
  Millis abort_window_{0};
  bool stop_orders_held_ = false;
  // Every survivor answered the abort, but a lost member's spare is still starting: the plan waits
  // for it until then (options_.spare_wait after the survivors were ready).
  std::optional<Clock::time_point> spare_wait_until_;
  // A planned resize in progress: its new world size, and the members it
  // releases by name (those of leaving hosts; the others by rank, highest first).
  struct PlannedResize {
    int to = 0;
    std::set<int> release;
  };
  std::optional<PlannedResize> resize_;
  int target_world_ = 0;  // the world size the job should have (policy, requests)
  ResizeHistory resize_history_;

  // Takeover.
  // the journal's last generation (0: this controller started the job)
  uint32_t takeover_generation_ = 0;
  bool journal_cut_ = false;         // TakeoverState::journal_cut
  Clock::time_point adopt_until_{};  // the inherited may join until then
  int takeovers_ = 0;                // controllers before this one (this one's number in the job)
  int recovery_id_base_ = 0;         // recoveries run by the controllers before this one
  int end_code_ = 0;                 // once ended: how, for workers that join after the end
  std::string end_reason_;
};

}  // namespace nonstop::controller
