// The controller runtime: everything around the Controller state machine
// that makes it a running job (DESIGN.md §2, §9, §13). One thread, one
// event loop (docs/thread-model.md):
//   - the ControlServer (workers and agents on one port) and the HTTP
//     endpoint turn traffic into Events;
//   - a local launcher (`nonstop run`) or the hosts' agents (`nonstop
//     controller`) start, signal and supervise the worker processes;
//   - Actions are carried out: messages to workers, orders to agents, the
//     journal, the job file, printed lines, the end of the job;
//   - every 50 ms a Tick (timers), every 500 ms a ping to every worker and
//     agent (heartbeats the other way), and /status and /metrics published.
//
// RunController runs one Runtime (runtime.cc): a class whose start-up reads
// in order (history, journal, epoch, servers, job files, banner, local
// workers), whose loop turn is Turn(), and which carries out each Action type
// in a handler of its own (Runtime::Do).
//
// Two front ends use it: `nonstop run` (controller + one local launcher in
// one process: the single-machine default) and `nonstop controller` (the
// controller alone, as a daemon that agents register with).
#pragma once

#include <string>
#include <vector>

#include "nonstop/settings.h"
#include "controller/controller.h"
#include "coord/leadership.h"
#include "net/socket.h"

namespace nonstop::controller {

struct RuntimeOptions {
  std::string name = "nonstop run";  // how messages name this program
  // A terminal's view (`nonstop run` on a TTY without --verbose): one live
  // progress line under the controller's own lines, and the local workers'
  // output in worker_log_dir/worker-N.log instead of on the terminal.
  bool progress_line = false;
  std::string worker_log_dir;
  ControllerOptions core;
  // The control port (workers and agents).
  net::HostPort listen{std::string(settings::kHost.default_value),
                       static_cast<uint16_t>(settings::kPort.default_value)};
  // The address workers and agents are told to dial; empty: the listening
  // address (which must then not be a wildcard).
  std::string advertise_address;
  std::string http_host{settings::kHttpHost.default_value};
  int http_port = settings::kHttpPort.default_value;
  std::string journal{settings::kJournal.default_value};
  // The job token (empty: a random one). With token_file set it is written
  // there (mode 0600) for the agents' --job-token-file.
  std::string token;
  std::string token_file;
  // Local workers (`nonstop run`): the program, and the address they listen
  // on for their peers. An empty program: no local launcher (agents only).
  std::vector<std::string> program;
  std::string data_host{settings::kDataHost.default_value};
  std::string checkpoint_dir{settings::kCheckpointDir.default_value};
  int checkpoint_every = settings::kCheckpointEvery.default_value;
  double mtbf_seconds = settings::kMtbfSeconds.default_value;
  int refill_nice = settings::kRefillNice.default_value;
  std::string recovery_name{settings::kRecovery.default_value};
  // Take over the running job of this journal (its controller stopped): the
  // workers and agents it recorded are adopted, and the journal goes on.
  // With listen's port 0, the control port is the one the journal records.
  std::string resume;
  // etcd (`nonstop controller --etcd`): this process won the election of
  // `leadership` (not owned). The job's journal in etcd is replayed (a new
  // job if it is empty), a copy goes to `journal`, and every record is
  // replicated to etcd before the orders that follow it go out. Returns
  // kExitDeposed when the leadership is lost: the job is the next leader's.
  coord::Leadership* leadership = nullptr;
};

// Runs the job until it ends; returns the exit code (kExitOk, kExitPeerFailure, …).
int RunController(const RuntimeOptions& options);

// Where the job file lives: job.json beside the journal.
std::string JobFileFor(const std::string& journal_path);

}  // namespace nonstop::controller
