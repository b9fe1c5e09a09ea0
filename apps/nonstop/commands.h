// The subcommands of the `nonstop` CLI. Each registers its flags (every flag
// has a NONSTOP_* environment fallback, from the settings registry:
// nonstop/settings.h, nonstop/settings_cli.h) and runs when selected.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "apps/nonstop/etcd_flags.h"
#include "controller/runtime.h"
#include "launcher/local_launcher.h"
#include "nonstop/settings.h"

namespace nonstop::agent {
struct AgentOptions;
}
namespace nonstop::launcher {
class BoundedStdio;
}

namespace nonstop::cli {

// The settings of the workers, the trainer and the Python package that `nonstop run` and
// `nonstop controller` take as flags (every registry entry read by a worker that no launcher sets:
// the job's choices, not a worker's identity), each checked here by its entry's range and handed
// as its variable to every worker of the job (RuntimeOptions::worker_env, in the controller's
// spawns and job.json alike).
class WorkerSettingFlags {
 public:
  // `sub` must outlive every later call: the flags read its options when asked.
  void Register(CLI::App* sub);
  // The variables of the flags given (on the command line, or by their variable here), as text.
  std::vector<std::pair<std::string, std::string>> Given() const;
  // The same as arguments ("--replica-check-every=7"), for a controller started again.
  std::vector<std::string> Arguments() const;

 private:
  struct Value {
    std::string env;
    std::string flag;  // its first name
    std::string text;
  };
  template <typename T>
  void Add(CLI::App* sub, const settings::Setting<T>& s);
  std::vector<Value> Values() const;
  std::vector<std::function<std::optional<Value>()>> given_;
};

// The flags `nonstop run` and `nonstop controller` share: timeouts, the
// elastic policy, recovery, checkpoints, faults, the journal and HTTP.
struct JobFlags {
  std::string journal{settings::kJournal.default_value};
  int heartbeat_timeout_ms = settings::kHeartbeatTimeoutMs.default_value;
  int abort_timeout_ms = settings::kAbortTimeoutMs.default_value;
  int join_timeout_ms = settings::kJoinTimeoutMs.default_value;
  int refill_nice = settings::kRefillNice.default_value;
  int busy_timeout_ms = settings::kBusyTimeoutMs.default_value;
  double hang_factor = settings::kHangFactor.default_value;
  int stall_floor_ms = settings::kStallFloorMs.default_value;
  double stall_factor = settings::kStallFactor.default_value;
  int failure_repeats = settings::kFailureRepeats.default_value;
  int failure_window_ms = settings::kFailureWindowMs.default_value;
  int recovery_budget = settings::kRecoveryBudget.default_value;
  int recovery_budget_window_s = settings::kRecoveryBudgetWindowS.default_value;
  std::string http_host{settings::kHttpHost.default_value};
  int http_port = settings::kHttpPort.default_value;
  std::string http_cert;  // kHttpCert: empty, plain HTTP
  std::string http_key;   // kHttpKey
  int min_world = settings::kMinWorld.default_value;
  int max_world = settings::kMaxWorld.default_value;
  std::vector<int> allowed_sizes;  // kAllowedSizes: empty
  int world_increment = settings::kWorldIncrement.default_value;
  int stable_period_ms = settings::kStablePeriodMs.default_value;
  std::vector<std::string> inject;  // kInject: empty
  std::string recovery{settings::kRecovery.default_value};
  std::string checkpoint_dir{settings::kCheckpointDir.default_value};
  int checkpoint_every = settings::kCheckpointEvery.default_value;
  double mtbf_seconds = settings::kMtbfSeconds.default_value;
  std::string log_level{settings::kLogLevel.default_value};
  WorkerSettingFlags workers;
};

// `nonstop run`: one job on this machine: its controller, and this process
// as the machine's agent (the parent of the workers).
class RunCommand {
 public:
  void Register(CLI::App& app);
  // The worker program and its arguments (what followed `--`).
  void SetProgram(std::vector<std::string> program) { program_ = std::move(program); }
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  int nproc_ = settings::kNproc.default_value;
  int spares_ = settings::kSpares.default_value;
  std::string host_{settings::kHost.default_value};
  std::string data_ports_{settings::kDataPorts.default_value};
  std::string worker_user_;
  std::optional<launcher::RunAs> run_as_;  // of worker_user_
  int port_ = settings::kPort.default_value;
  bool resumable_ = settings::kResumable.default_value;
  bool verbose_ = settings::kVerbose.default_value;
  JobFlags flags_;
  std::vector<std::string> program_;
  // The job: the controller in a child process (the default) or on a thread
  // (--single-process), and this process's agent dialing it, the same for both.
  int RunLocal(controller::RuntimeOptions o, const std::vector<std::string>& program,
               const std::string& log_dir);
  agent::AgentOptions LocalAgentOptions(const std::string& controller, const std::string& token,
                                        const std::vector<std::string>& program,
                                        const std::string& log_dir,
                                        launcher::BoundedStdio& stdio) const;
  // `nonstop controller --resume …` (after the program's name) for this run's journal and token.
  std::vector<std::string> ResumeArguments(const std::string& journal,
                                           const std::string& token_file) const;
};

// `nonstop controller`: the controller alone, a daemon that the hosts'
// agents (`nonstop agent`) register with; the job starts when --nnodes MIN
// hosts are there.
class ControllerCommand {
 public:
  void Register(CLI::App& app);
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  // --etcd: campaign, lead until the job ends or this process is deposed, then stand by again.
  int LeadThroughEtcd(const std::string& name, controller::RuntimeOptions o);
  CLI::App* sub_ = nullptr;
  std::string listen_{settings::kListen.default_value};
  std::string advertise_address_{settings::kControllerAdvertiseAddress.default_value};
  std::string nnodes_{settings::kNnodes.default_value};
  std::string token_file_{settings::kControllerJobTokenFile.default_value};
  std::string resume_;
  std::string etcd_{settings::kControllerEtcd.default_value};
  std::string job_{settings::kEtcdJob.default_value};
  EtcdSecurityFlags etcd_security_;
  int lease_ttl_s_ = settings::kLeaseTtlS.default_value;
  JobFlags flags_;
};

// `nonstop data prepare`: text files → token shards.
// `nonstop report JOURNAL [--output FILE]`: a self-contained HTML report of a
// finished (or crashed) job from its journal alone (docs/dashboard.md).
class ReportCommand {
 public:
  void Register(CLI::App& app);
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  std::string journal_;
  std::string output_;
};

class DataCommand {
 public:
  void Register(CLI::App& app);
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  CLI::App* prepare_ = nullptr;
  CLI::App* inspect_ = nullptr;
  std::vector<std::string> inputs_;
  std::string output_{settings::kDataOutput.default_value};
  uint64_t tokens_per_shard_ = settings::kTokensPerShard.default_value;
  bool strip_fortune_ = false;
  std::string inspect_path_;
};

// `nonstop status`, `nonstop scale`, `nonstop worker`: talking to a running job.
class JobCommands {
 public:
  void Register(CLI::App& app);
  void SetProgram(std::vector<std::string> program) { program_ = std::move(program); }
  bool selected() const {
    return (status_ && status_->parsed()) || (scale_ && scale_->parsed()) ||
           (worker_ && worker_->parsed());
  }
  int Execute();

 private:
  int ExecWorker();
  CLI::App* status_ = nullptr;
  CLI::App* scale_ = nullptr;
  CLI::App* worker_ = nullptr;
  std::string job_file_{settings::kJobFile.default_value};
  std::string http_{settings::kHttp.default_value};
  std::string http_cacert_;  // kHttpCacert: empty, the job file's http_cert or the system's CAs
  int world_size_ = 0, release_ = 0, grow_ = 0;
  CLI::Option* world_size_opt_ = nullptr;
  CLI::Option* release_opt_ = nullptr;
  int worker_id_ = -1;
  std::vector<std::string> program_;
};

// `nonstop settings`: every NONSTOP_* variable (include/nonstop/settings.h) as
// the Markdown that docs/settings.md holds between its two markers;
// --check FILE fails (exit 1) when FILE's copy is not that, --update FILE
// rewrites it.
class SettingsCommand {
 public:
  void Register(CLI::App& app);
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  std::string check_;
  std::string update_;
};

// Directory of the running executable (to find sibling binaries such as nonstop-train).
std::string SelfDirectory();
// The job file that `nonstop run` writes beside its journal.
std::string JobFileFor(const std::string& journal_path);

}  // namespace nonstop::cli
