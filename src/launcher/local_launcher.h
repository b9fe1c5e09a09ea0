// LocalLauncher: starts worker processes on this host and watches them on an
// EventLoop (docs/architecture.md "Processes").
//
// Each child gets its own stdout/stderr pipes; their lines are forwarded with
// a prefix ("[rank 2] ", "[spare 4] ") that the caller chooses at the time the
// line is printed, so a line shows the rank the worker holds then. Forwarded
// output goes through a bounded OutputWriter: a reader that does not keep up
// loses lines (counted), never blocks the loop. A child's exit is seen at once
// through a pidfd (no polling of waitpid); a child that is stopped (SIGSTOP, a
// frozen process) is seen by PollStopped() (waitid WSTOPPED), which the caller
// runs on its timer. The child gets SIGKILL if the launcher itself dies
// (PR_SET_PDEATHSIG), so no worker outlives its job. With an on_dying callback
// set, each child also gets a lifeline (common/lifeline.h, NONSTOP_LIFELINE_FD):
// a worker that holds it and dies is reported as dying at once, as the kernel
// begins its exit, before its memory is freed and before its pidfd says it.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/lifeline.h"
#include "common/unique_fd.h"
#include "launcher/output_writer.h"
#include "net/event_loop.h"
#include "nonstop/settings.h"
#include "nonstop/status.h"

namespace nonstop::launcher {

// Another user the children run as (docs/security.md, "A user for the workers"): a launcher that
// runs as root starts its workers as this user, so that what only root may read (the job token
// file, the launcher's and the controller's processes) is out of their reach.
struct RunAs {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // its supplementary groups, from the group database
  std::string name;
  std::string home;
};

// The user `name_or_uid` from the password database. kFailedPrecondition when this process is not
// root (only root can start a process as another user) or the user is root; kInvalidArgument when
// there is no such user. Each message names the setting and the fix.
Result<RunAs> LookUpRunAs(const std::string& name_or_uid);

struct ChildSpec {
  int worker_id = -1;
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;  // added to this process's environment
  int nice = 0;  // scheduling niceness (spares start at a low priority: they must not slow the job)
  // Inherited variables the child must not see (besides those `env` replaces).
  std::vector<std::string> unset;
  // Non-empty: the child's stdout and stderr go to this file (appended to,
  // created if missing) instead of through the launcher's prefixed writers.
  std::string log_file;
  // Signals the child starts with ignored (SIG_IGN survives exec; a program
  // may still install a handler of its own).
  std::vector<int> ignore_signals;
  // Non-empty: the worker's secret (its credential: common/role_keys.h), passed in a sealed memfd
  // the child inherits and NONSTOP_JOB_TOKEN_FD names, never in its environment
  // (docs/security.md).
  std::string secret;
  // Set: the child runs as this user (its groups, HOME, USER and LOGNAME too).
  std::optional<RunAs> run_as;
};

// The variables that say which job and which worker a process is: a launcher
// sets those it means to and drops any it inherited.
inline const std::vector<std::string> kJobVariables = {
    std::string(settings::kControllerAddress.env),
    std::string(settings::kJobToken.env),
    std::string(settings::kJobTokenFd.env),
    std::string(settings::kLifelineFd.env),
    std::string(settings::kWorkerId.env),
    std::string(settings::kSpare.env),
    std::string(settings::kHostId.env),
    std::string(settings::kDataHost.env),
    std::string(settings::kWorkerAdvertiseAddress.env),
    std::string(settings::kResume.env),
    std::string(settings::kTrainCheckpointDir.env),
    std::string(settings::kTrainCheckpointEvery.env),
    std::string(settings::kTrainMtbfSeconds.env)};

// torchrun's variables a worker gets from the machine it starts on, whoever starts it (an agent's
// spawns, `nonstop worker`), added to the variables `env` starts it with: MASTER_PORT
// (NONSTOP_MASTER_PORT: of `env`, the job's, else of this process, else its default) and
// OMP_NUM_THREADS 1 where this process's caller left it unset, as torchrun does (docs/python.md,
// "The environment contract").
void AddTorchrunHostVariables(std::map<std::string, std::string>* env);

class LocalLauncher {
 public:
  using PrefixFn = std::function<std::string(int worker_id)>;
  // exit_code is valid when signal == 0.
  using ExitFn = std::function<void(int worker_id, pid_t pid, int exit_code, int signal)>;
  using StopFn = std::function<void(int worker_id, pid_t pid, int signal)>;
  // The worker's lifeline fired: it is dying now (its exit is reported later, through on_exit).
  using DyingFn = std::function<void(int worker_id, pid_t pid)>;

  // `out` and `err` receive the children's prefixed lines; by default
  // (nullptr) writers on this process's stdout and stderr.
  LocalLauncher(net::EventLoop* loop, PrefixFn prefix, ExitFn on_exit, StopFn on_stop = nullptr,
                OutputWriter* out = nullptr, OutputWriter* err = nullptr);
  ~LocalLauncher();
  LocalLauncher(const LocalLauncher&) = delete;
  LocalLauncher& operator=(const LocalLauncher&) = delete;

  // Gives every child spawned from now on a lifeline; `on_dying` runs on the
  // loop's thread, at most once per child and never after its on_exit.
  Status EnableLifelines(DyingFn on_dying);
  Result<pid_t> Spawn(const ChildSpec& spec);
  void Signal(int worker_id, int sig);
  // Sets a running worker's niceness (a spare promoted to a rank goes back to 0).
  Status Renice(int worker_id, int nice);
  // Whether this process may raise a child's priority back to nice 0 after
  // lowering it (root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it). An
  // ordinary user may not: a worker started at a low priority would stay a
  // straggler for good, so callers start workers at normal priority then.
  static bool CanRestorePriority();
  void SignalAll(int sig);
  int running() const;
  // Reports (once per stop) children that are stopped by a signal. Cheap: one
  // waitid per child. Call it every few tens of milliseconds.
  void PollStopped();
  pid_t pid(int worker_id) const;

 private:
  struct Child {
    int worker_id;
    pid_t pid;
    UniqueFd pidfd;
    UniqueFd out, err;
    std::string out_partial, err_partial;
    bool exited = false;
    bool stopped = false;  // reported stopped, not continued since
    uint64_t serial = 0;   // tells a report from its lifeline's thread from a later child's
    // Its lifeline's watcher (joined when the child is reaped or the launcher goes).
    std::unique_ptr<LifelineWatcher> lifeline;
  };
  void OnOutput(Child& c, bool is_err);
  void OnExit(Child& c);
  void OnDyingWake();
  void Emit(Child& c, bool is_err, std::string_view text, bool flush);

  net::EventLoop* const loop_;  // owned by the caller; outlives this
  PrefixFn prefix_;
  ExitFn on_exit_;
  StopFn on_stop_;
  std::unique_ptr<OutputWriter> own_out_, own_err_;  // when the caller gave none
  OutputWriter* out_;                                // the caller's or own_out_; outlives this
  OutputWriter* err_;
  std::map<int, std::unique_ptr<Child>> children_;  // by worker id
  uint64_t next_serial_ = 1;
  // Lifelines: the watchers' threads queue the serials of the children dying and wake the loop.
  DyingFn on_dying_;
  UniqueFd dying_wake_;  // eventfd, watched on the loop
  std::mutex dying_mu_;
  std::vector<uint64_t> dying_;  // under dying_mu_
};

}  // namespace nonstop::launcher
