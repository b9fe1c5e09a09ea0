// LocalLauncher: starts worker processes on this host and watches them on an
// EventLoop (DESIGN.md §2).
//
// Each child gets its own stdout/stderr pipes; their lines are forwarded with
// a prefix ("[rank 2] ", "[spare 4] ") that the caller chooses at the time the
// line is printed, so a line shows the rank the worker holds then. A child's
// exit is seen at once through a pidfd (no polling of waitpid), and the child
// gets SIGKILL if the launcher itself dies (PR_SET_PDEATHSIG), so no worker
// outlives its job.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "net/event_loop.h"

namespace nonstop::launcher {

struct ChildSpec {
  int worker_id = -1;
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;  // added to this process's environment
  int nice = 0;  // scheduling niceness (spares start at a low priority: they must not slow the job)
};

class LocalLauncher {
 public:
  using PrefixFn = std::function<std::string(int worker_id)>;
  // exit_code is valid when signal == 0.
  using ExitFn = std::function<void(int worker_id, pid_t pid, int exit_code, int signal)>;

  LocalLauncher(net::EventLoop* loop, PrefixFn prefix, ExitFn on_exit);
  ~LocalLauncher();
  LocalLauncher(const LocalLauncher&) = delete;
  LocalLauncher& operator=(const LocalLauncher&) = delete;

  Result<pid_t> Spawn(const ChildSpec& spec);
  void Signal(int worker_id, int sig);
  // Sets a running worker's niceness (a spare promoted to a rank goes back to 0).
  Status Renice(int worker_id, int nice);
  void SignalAll(int sig);
  int running() const;
  pid_t pid(int worker_id) const;

 private:
  struct Child {
    int worker_id;
    pid_t pid;
    UniqueFd pidfd;
    UniqueFd out, err;
    std::string out_partial, err_partial;
    bool exited = false;
  };
  void OnOutput(Child& c, bool is_err);
  void OnExit(Child& c);
  void Emit(Child& c, bool is_err, std::string_view text, bool flush);

  net::EventLoop* const loop_;  // owned by the caller; outlives this
  PrefixFn prefix_;
  ExitFn on_exit_;
  std::map<int, std::unique_ptr<Child>> children_;  // by worker id
};

}  // namespace nonstop::launcher
