// Agent: the per-host half of a multi-host job (`nonstop agent`,
// docs/architecture.md "Processes"). One agent runs on each host. It dials the controller, says
// hello as ConnectionKind::kAgent, registers its host (AgentRegister), and
// from then on carries out the controller's orders: start a worker process,
// signal it, renice it. It reports at once what happens to its processes
// (AgentStarted, AgentDying, AgentExited, AgentStopped) and that it is alive
// (AgentHeartbeat, every 200 ms). The agent decides nothing: which worker
// runs where, and what a dead one means, is the controller's business
// (docs/protocol.md, "Agents").
//
// Losing the controller. Training does not need the controller between
// faults (docs/architecture.md "Invariants"), and a controller that dies is replaced (a standby,
// or `nonstop controller --resume`) which adopts the running workers. So when
// the controller is silent for `controller_timeout` (no byte at all: it pings
// every 500 ms), or the connection breaks, overflows or carries a malformed
// order, the agent is *cut off* but its processes keep running: it dials
// again at once (then with back-off) and registers listing them (worker id and
// pid); the controller adopts those it counts on and orders the others
// killed. A split brain cannot follow: a partitioned host's workers are
// fenced out of the generations formed without them (their peers left, and
// a worker id the controller declared lost never joins again).
//
// Fencing. Only an agent cut off for `fence_after` without registering again
// SIGKILLs every process it supervises (nobody will adopt them), waits until
// they are reaped, and dials on; it gives up (exit 1) if it cannot register
// within `join_timeout` after that (or of the loss, with nothing running).
//
// Leaving. With handle_signals and leave_on_sigterm, SIGTERM or SIGUSR1 while
// registered sends AgentLeaving (again after each new registration, so a
// controller that takes over learns it too); the agent starts nothing more
// and returns 0 once its last process has exited on its release.
//
// Exit codes (Run()): 0 or whatever a controller's Shutdown says (0-255; another code is 1);
// kExitControllerLost (1) when the controller cannot be reached within the
// join timeout; kExitRefused (2) when the controller refuses the hello (a
// wrong job token); kExitInterrupted (130) on SIGINT/SIGTERM or Stop(). A
// refusal after the hello (say, a host id already in the job) comes as a
// Shutdown, with the controller's reason and code.
//
// The connection is a control::ControllerLink (src/control/controller_link.h),
// the client the workers' Session uses too: it finds the controller (the
// --controller address, or etcd's leader), dials, says the agent's hello,
// fences by epoch, carries the frames and dials again after a loss, with
// exponential back-off and jitter (backoff_initial up to backoff_max). The
// agent keeps what is its own: registering, the orders, the heartbeats,
// fencing and the join timeout.
//
// Thread model: one thread, one loop. Run() drives a net::EventLoop on the
// calling thread; it owns the link (attached to the loop: its socket is
// non-blocking, connect included), the LocalLauncher (pidfds and output
// pipes of the children), a signalfd (handle_signals) and a wake-up eventfd
// (Stop()). Nothing on the loop blocks on the controller: outgoing frames
// are queued (bounded by `max_queued_bytes`; an overflow is a lost
// controller) and written when the socket is writable; the loop never waits
// longer than 50 ms, so timers (heartbeats, the silence check, PollStopped
// for frozen children) run on time. The only other threads are the two
// OutputWriters (the agent's own, or the caller's) that copy the children's
// prefixed lines to stdout and stderr without ever blocking the loop, and,
// with etcd, the two threads of the leader watch (coord::LeaderWatch), which
// write the leader file and wake the loop through the eventfd. The blocking
// calls are the link's lookups before each dial: the controller's host name
// (getaddrinfo) and, with etcd, a read of the local leader file. Stop() is
// the only method another thread may call.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/logging.h"
#include "common/time.h"
#include "common/unique_fd.h"
#include "control/controller_link.h"
#include "coord/etcd_security.h"
#include "coord/leader_watch.h"
#include "launcher/local_launcher.h"
#include "launcher/output_writer.h"
#include "net/event_loop.h"
#include "net/frame.h"
#include "nonstop/settings.h"
#include "nonstop/status.h"

namespace nonstop::agent {

inline constexpr int kExitOk = 0;
// the controller could not be reached within the join timeout
inline constexpr int kExitControllerLost = 1;
inline constexpr int kExitRefused = 2;        // the controller refused the hello (wrong job token)
inline constexpr int kExitInterrupted = 130;  // SIGINT, SIGTERM or Stop()

struct AgentOptions {
  // "host:port" to dial; required unless etcd is set. Passed to workers as NONSTOP_CONTROLLER.
  std::string controller;
  // Find the controller through etcd instead (docs/controller-failover.md,
  // docs/leader-discovery.md): the agent watches who leads job `etcd_job`
  // there (one watch for the host, no poll) and keeps it in a leader file of
  // its run directory; its dials and its workers (NONSTOP_LEADER_FILE) read
  // that file. The workers get NONSTOP_ETCD and NONSTOP_ETCD_JOB too.
  std::string etcd;
  std::string etcd_job{settings::kEtcdJob.default_value};
  // etcd's TLS and user (docs/etcd-security.md): the watch's and the link's; the workers get
  // the paths (NONSTOP_ETCD_CACERT, …), never a secret.
  etcd::Security etcd_security;
  // Required. Workers get a credential of their own made from it (common/role_keys.h), in a
  // memfd (NONSTOP_JOB_TOKEN_FD); never the token.
  std::string job_token;
  std::string host_id;  // required, valid per control::CheckHostId; passed as NONSTOP_HOST_ID
  // Workers this host contributes to the world, and spares it keeps warm (told to the controller).
  int nproc = settings::kNprocPerHost.default_value;
  int spares = settings::kSparesPerHost.default_value;
  // The address this host's workers listen on for their peers (NONSTOP_DATA_HOST).
  // Empty: the local address of the control connection, i.e. the interface that reaches the
  // controller.
  std::string advertise_address;
  // Its workers' data ports: "LO-HI" (settings::kDataPorts; empty: a port from the OS each).
  std::string data_ports;
  std::vector<std::string> program;  // argv of every process it starts; required
  // Set: the workers run as this user (settings::kWorkerUser; the agent runs as root).
  std::optional<launcher::RunAs> run_as;
  // Its capacity follows the job (control::AgentRegisterMsg::elastic): the
  // agent `nonstop run` runs for its own machine. Its workers' lines are
  // prefixed as `nonstop run` always did ("[rank 3] …", "[worker 5] …").
  bool elastic = false;
  // Non-empty: each worker's stdout and stderr go to log_dir/worker-N.log
  // (appended) instead of this agent's prefixed output (`nonstop run` on a terminal).
  std::string log_dir;

  // How long to keep dialing before giving up (exit 1): from the start, and again from each loss.
  Millis join_timeout{settings::kAgentJoinTimeoutMs.default_value};
  // A controller that sends nothing for this long is lost (it pings every 500 ms).
  Millis controller_timeout{settings::kAgentControllerTimeoutMs.default_value};
  // Cut off this long without registering again, the agent kills its processes (fencing).
  Millis fence_after{settings::kFenceAfterMs.default_value};
  Millis heartbeat_interval{200};
  // Back-off between dials (control::BackoffPolicy): starts at backoff_initial, doubles up to
  // backoff_max, plus up to half of it at random.
  Millis backoff_initial{100};
  Millis backoff_max{2'000};
  // After a Shutdown, how long the processes get to exit on their own before SIGKILL.
  Millis stop_grace{10'000};
  // Outgoing bytes the controller has not taken yet; more is a lost controller.
  size_t max_queued_bytes = 8u << 20;
  // Read SIGINT and SIGTERM (exit 130). Run() blocks them in the calling thread
  // and reads them from a signalfd; threads started earlier must block them
  // too (the CLI blocks them before it starts any). Off for agents run in a
  // test's thread.
  bool handle_signals = false;
  // With handle_signals, what SIGTERM (and SIGUSR1) mean. True: the host's
  // capacity is being taken back (a Slurm preemption sends SIGTERM, or the
  // signal of sbatch --signal=USR1@N ahead of it): the agent asks the
  // controller to release its workers at the next step boundary and exits 0
  // once they are gone, a planned shrink and no fault; a second signal, or
  // SIGINT, kills them at once. Its workers start with SIGTERM and SIGUSR1
  // ignored, since Slurm signals every process of the job step. False:
  // SIGTERM is SIGINT (kill the processes, exit 130).
  bool leave_on_sigterm = true;
  // Where the children's prefixed lines ("[HOST rank 2] …", "[HOST w3] …") go; nullptr: writers
  // of the agent's own on stdout and stderr. Not owned; outlive Run().
  launcher::OutputWriter* out = nullptr;
  launcher::OutputWriter* err = nullptr;
};

// Checks options that do not need the network: a parsable controller
// address, a job token, a valid host id, a program, counts and timeouts in range.
Status ValidateOptions(const AgentOptions& options);

class Agent {
 public:
  // `options` must pass ValidateOptions (checked: a bug otherwise).
  explicit Agent(AgentOptions options);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Runs until the job ends for this host, and returns the exit code (see
  // the header comment). Call it once. Every process it started is gone when
  // it returns.
  int Run();

  // Thread-safe: makes Run() kill its processes and return kExitInterrupted
  // soon, as SIGINT would.
  void Stop();

  // After Run(): the line that says why it ended (also logged).
  const std::string& exit_message() const { return exit_message_; }

 private:
  // The agent's lifecycle. It moves kDialing → kRegistered and, after a
  // loss, back to kDialing; cut off for fence_after it goes through kFenced
  // (processes killed and reaped) back to kDialing; kEnding is final.
  enum class Phase {
    kDialing,     // the link looks for the controller (waits, connects, says hello)
    kRegistered,  // registered: carrying out orders
    kFenced,      // cut off: processes killed, waiting for them to be reaped (the link is stopped)
    kEnding,      // the job is over for this agent: waiting for the processes, then Run() returns
  };
  static const char* PhaseName(Phase p);
  void ChangePhase(Phase next);

  void Tick();
  // Takes what the link has to say: acceptance, frames, a loss, the end.
  void PumpLink();
  void OnAccepted();
  void OnLinkFailed(const Status& why);
  void HandleFrame(const net::Frame& frame);
  void OnStart(std::string_view payload);
  void AddTorchrunVariables(int worker_id, std::map<std::string, std::string>* env) const;
  void OnSignal(std::string_view payload);
  void OnRenice(std::string_view payload);
  // "[rank 3] " and the like: what the lines of worker `worker_id` start with.
  std::string OutputPrefix(int worker_id) const;
  // What the controller's own lines already say under `nonstop run` (its
  // agent is elastic): registering, starting workers, their exits (the fault
  // lines and the report name them), a clean end. Debug there.
  LogLevel ChatterLevel() const { return options_.elastic ? LogLevel::kDebug : LogLevel::kInfo; }
  // A malformed order: the link leaves the connection (and dials again after a pause).
  void Malformed(const std::string& why);
  // The controller is lost (the link dials again): fencing in fence_after if none takes this host
  // back.
  void Lose(const std::string& why, bool log = true);
  // Cut off for fence_after: kill every process (none will be adopted).
  void Fence();
  // Queues one frame to the controller; false if there is no connection or it overflowed (then
  // lost).
  bool Send(uint16_t type, const std::string& payload);
  // Ends Run(): with `kill_now`, SIGKILL at once; otherwise after stop_grace.
  void End(int code, const std::string& message, bool kill_now);
  std::string Describe(const std::string& error) const;

  void OnChildExit(int worker_id, pid_t pid, int exit_code, int signal);
  // SIGTERM and SIGUSR1 mean "this host leaves" (not for nonstop run's own agent).
  bool LeavesOnSigterm() const { return options_.leave_on_sigterm && !options_.elastic; }
  // SIGINT, SIGTERM or SIGUSR1 read from the signalfd.
  void OnTerminationSignal(int sig);
  // Asks the controller to release this host's workers (leaving_).
  void SendLeaving();
  void OnChildStop(int worker_id, pid_t pid, int signal);
  // Its lifeline fired (launcher::LocalLauncher::EnableLifelines): reported at once (AgentDying).
  void OnChildDying(int worker_id, pid_t pid);
  // With etcd: the watch of the job's leader that keeps leader_file_ (docs/leader-discovery.md).
  void StartLeaderWatch();
  void ShareWithWorkerUser();

  const AgentOptions options_;
  // With etcd: a directory of this agent's (removed by the destructor), the leader file in it.
  std::string run_dir_;
  std::string error_dir_;  // the workers' TORCHELASTIC_ERROR_FILE: log_dir, or run_dir_
  std::string leader_file_;
  net::EventLoop loop_;
  std::unique_ptr<control::ControllerLink> link_;  // after loop_: unwatches its descriptors first
  std::unique_ptr<launcher::OutputWriter> own_out_, own_err_;
  std::unique_ptr<launcher::LocalLauncher> launcher_;  // created in Run(), after the writers
  UniqueFd wake_fd_;                                   // eventfd: Stop() writes it
  UniqueFd signal_fd_;                                 // SIGINT/SIGTERM, with handle_signals
  std::atomic<bool> stop_requested_{false};
  std::unique_ptr<coord::LeaderWatch> leader_watch_;  // Run()'s, with etcd
  std::atomic<bool> leader_changed_{false};           // the watch wrote the file: dial now
  bool ran_ = false;

  Phase phase_ = Phase::kDialing;
  std::string data_host_;     // the advertise address in use on this connection
  Deadline next_slow_say_{};  // a slow turn is said at most once in 10 s
  Deadline next_heartbeat_{};
  Deadline next_poll_stopped_{};
  Deadline reconnect_deadline_{};     // exit 1 if not registered by then (the link's give-up time)
  std::optional<Deadline> fence_at_;  // cut off with processes running: they are killed then
  std::string last_malformed_;        // logged once: a repeat is a debug line
  std::map<int, pid_t> live_;         // worker id → pid of the processes that run now
  std::map<int, int> ranks_;  // worker id → its rank in the newest generation (kMsgAgentRanks)
  uint32_t ranks_generation_ = 0;

  int exit_code_ = 0;
  std::string exit_message_;
  Deadline kill_at_ = kNoDeadline;  // kEnding: SIGKILL whatever still runs
  // kEnding: the processes were given stop_grace to exit on their own
  bool graceful_ = false;
  Deadline give_up_at_ = kNoDeadline;  // kEnding: stop waiting for reaping
  bool killed_ = false;
  // Asked to leave (leave_on_sigterm): what asked, e.g. "SIGTERM"; empty: not leaving.
  std::string leaving_;
};

}  // namespace nonstop::agent
