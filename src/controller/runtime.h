// The controller runtime: everything around the Controller state machine
// that makes it a running job (docs/architecture.md "Processes", "The control plane"). One
// thread, one event loop (docs/thread-model.md):
//   - the ControlServer (workers and agents on one port) and the HTTP
//     endpoint turn traffic into Events;
//   - the hosts' agents start, signal and supervise the worker processes
//     (`nonstop run` runs one for its own machine: an elastic host);
//   - Actions are carried out: messages to workers, orders to agents, the
//     journal, the job file, printed lines, the end of the job;
//   - every 50 ms a Tick (timers), every 500 ms a ping to every worker and
//     agent (heartbeats the other way), and /status and /metrics published.
//
// RunController checks the core's options (ValidateOptions: a usage error,
// before anything starts) and runs one Runtime (runtime.cc): a class whose
// start-up reads in order (history, journal, epoch, servers, job files,
// banner), whose loop turn is Turn(), and which carries out each Action type
// in a handler of its own (Runtime::Do).
//
// Two front ends use it: `nonstop run` (the controller of one machine, in a
// child process or, --single-process, on a thread of its own process, with
// that process's agent, the job's one elastic host, for the workers) and
// `nonstop controller` (the controller alone, as a daemon that agents
// register with). Neither starts worker processes itself: every worker runs
// on the host of an agent (ControllerOptions::min_hosts is at least 1).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "controller/controller.h"
#include "coord/leadership.h"
#include "net/socket.h"
#include "nonstop/settings.h"

namespace nonstop::launcher {
class BoundedStdio;
}

namespace nonstop::controller {

struct RuntimeOptions {
  std::string name = "nonstop run";  // how messages name this program
  // A terminal's view (`nonstop run` on a TTY without --verbose): one live
  // progress line under the controller's own lines (the workers' output goes
  // to files: its agent's log_dir).
  bool progress_line = false;
  // The bounded stdout and stderr the runtime prints through, the log sink
  // with them; nullptr: its own. `nonstop run --single-process` passes the
  // one it shares with its agent (one process: one stdout, one log sink).
  // Not owned; outlives RunController.
  launcher::BoundedStdio* stdio = nullptr;
  ControllerOptions core;
  // The control port (workers and agents).
  net::HostPort listen{std::string(settings::kHost.default_value),
                       static_cast<uint16_t>(settings::kPort.default_value)};
  // The address workers and agents are told to dial; empty: the listening
  // address (which must then not be a wildcard).
  std::string advertise_address;
  std::string http_host{settings::kHttpHost.default_value};
  int http_port = settings::kHttpPort.default_value;
  // HTTPS: the certificate and key files (both empty: plain HTTP).
  std::string http_cert;
  std::string http_key;
  std::string journal{settings::kJournal.default_value};
  // The job token (empty: a random one). It is written to token_file (empty:
  // job.token beside the journal), mode 0600, for the agents'
  // --job-token-file; the job file names that file (docs/security.md).
  std::string token;
  std::string token_file;
  // What every worker is told (Runtime::JobEnv, the job file's "env" too): checkpoints.
  std::string checkpoint_dir{settings::kCheckpointDir.default_value};
  int checkpoint_every = settings::kCheckpointEvery.default_value;
  double mtbf_seconds = settings::kMtbfSeconds.default_value;
  // The workers' settings given to the launcher as flags (`nonstop run --replica-check-every 7`):
  // variables every worker of the job is started with (JobEnv).
  std::vector<std::pair<std::string, std::string>> worker_env;
  // The niceness at which an elastic host's refills (spares started while
  // the job trains) warm up; back to 0 with their first plan. 0: normal
  // priority. The elastic host is `nonstop run`'s own agent, this user's on
  // this machine: the front end sets 0 where this user could not raise the
  // priority back (launcher::LocalLauncher::CanRestorePriority). Other
  // hosts' refills always start at normal priority.
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
// Where the job token is written without RuntimeOptions::token_file: job.token beside the journal.
std::string TokenFileFor(const std::string& journal_path);
// Where the HTTP endpoint's token (HttpCredential of the job token) is written: job.http-token
// beside the journal, for curl and Prometheus (its credentials_file).
std::string HttpTokenFileFor(const std::string& journal_path);

}  // namespace nonstop::controller
