// `nonstop agent`: the per-host agent of a multi-host job (src/agent/agent.h).
// A thin front end: it reads its flags (each with a NONSTOP_* environment
// fallback), the job token file and the host id, prints the effective
// configuration, and runs an agent::Agent until the job ends for this host.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "apps/nonstop/etcd_flags.h"
#include "nonstop/settings.h"

namespace nonstop::cli {

class AgentCommand {
 public:
  void Register(CLI::App& app);
  // The worker program and its arguments (what followed `--`).
  void SetProgram(std::vector<std::string> program) { program_ = std::move(program); }
  bool selected() const { return sub_ != nullptr && sub_->parsed(); }
  int Execute();

 private:
  CLI::App* sub_ = nullptr;
  std::string controller_{settings::kAgentController.default_value};
  std::string etcd_{settings::kEtcd.default_value};
  std::string job_{settings::kEtcdJob.default_value};
  EtcdSecurityFlags etcd_security_;
  std::string job_token_file_{settings::kAgentJobTokenFile.default_value};
  std::string host_id_{settings::kAgentHostId.default_value};  // empty: the hostname
  int nproc_per_host_ = settings::kNprocPerHost.default_value;
  int spares_per_host_ = settings::kSparesPerHost.default_value;
  // Empty: the local address of the connection to the controller.
  std::string advertise_address_{settings::kAgentAdvertiseAddress.default_value};
  std::string data_ports_{settings::kDataPorts.default_value};
  int join_timeout_ms_ = settings::kAgentJoinTimeoutMs.default_value;
  int controller_timeout_ms_ = settings::kAgentControllerTimeoutMs.default_value;
  int fence_after_ms_ = settings::kFenceAfterMs.default_value;
  std::string on_sigterm_{settings::kOnSigterm.default_value};
  std::string worker_user_;
  std::string log_level_{settings::kLogLevel.default_value};
  std::vector<std::string> program_;
};

}  // namespace nonstop::cli
