// The subcommands of the `nonstop` CLI. Each registers its flags (every flag
// has a NONSTOP_* environment fallback) and runs when selected.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "controller/runtime.h"

namespace nonstop::cli {

// The flags `nonstop run` and `nonstop controller` share: timeouts, the
// elastic policy, recovery, checkpoints, faults, the journal and HTTP.
struct JobFlags {
  std::string journal = "runs/journal.jsonl";
  int heartbeat_timeout_ms = 1000;
  int abort_timeout_ms = 2000;
  int join_timeout_ms = 300'000;
  int refill_nice = 10;
  int hang_floor_ms = 500;
  double hang_factor = 8.0;
  int stall_floor_ms = 30'000;
  std::string http_host = "127.0.0.1";
  int http_port = 0;
  int min_world = 1;
  int max_world = 0;
  std::vector<int> allowed_sizes;
  int world_increment = 1;
  int stable_period_ms = 0;
  std::vector<std::string> inject;
  std::string recovery = "checkpointless";
  std::string checkpoint_dir;
  int checkpoint_every = 0;
  double mtbf_seconds = 0;
  std::string log_level = "info";
};

// `nonstop run`: controller + local launcher for one job on this machine.
class RunCommand {
 public:
  void Register(CLI::App& app);
  // The worker program and its arguments (what followed `--`).
  void SetProgram(std::vector<std::string> program) { program_ = std::move(program); }
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  int nproc_ = 4;
  int spares_ = 1;
  std::string host_ = "127.0.0.1";
  int port_ = 0;
  bool resumable_ = true;
  bool verbose_ = false;
  JobFlags flags_;
  std::vector<std::string> program_;
  // The default: the controller in a child process, this process the local
  // agent (--single-process: both in this one, as before).
  int RunResumable(controller::RuntimeOptions o);
  std::string ResumeCommand(const std::string& journal, const std::string& token_file) const;
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
  std::string listen_ = "127.0.0.1:0";
  std::string advertise_address_;
  std::string nnodes_ = "1";
  std::string token_file_;
  std::string resume_;
  std::string etcd_;
  std::string job_ = "default";
  int lease_ttl_s_ = 2;
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
  std::string output_;
  uint64_t tokens_per_shard_ = 1 << 20;
  bool strip_fortune_ = false;
  std::string inspect_path_;
};

// `nonstop status`, `nonstop scale`, `nonstop worker`: talking to a running job.
class JobCommands {
 public:
  void Register(CLI::App& app);
  void SetProgram(std::vector<std::string> program) { program_ = std::move(program); }
  bool selected() const {
    return (status_ && status_->parsed()) || (scale_ && scale_->parsed()) || (worker_ && worker_->parsed());
  }
  int Execute();

 private:
  int ExecWorker();
  CLI::App* status_ = nullptr;
  CLI::App* scale_ = nullptr;
  CLI::App* worker_ = nullptr;
  std::string job_file_ = "runs/job.json";
  std::string http_;
  int world_size_ = 0, release_ = 0, grow_ = 0;
  CLI::Option* world_size_opt_ = nullptr;
  CLI::Option* release_opt_ = nullptr;
  int worker_id_ = -1;
  std::vector<std::string> program_;
};

// Directory of the running executable (to find sibling binaries such as nonstop-train).
std::string SelfDirectory();
// The job file that `nonstop run` writes beside its journal.
std::string JobFileFor(const std::string& journal_path);

}  // namespace nonstop::cli
