// `nonstop agent`: the per-host agent of a multi-host job (src/agent/agent.h).
// A thin front end: it reads its flags (each with a NONSTOP_* environment
// fallback), the job token file and the host id, prints the effective
// configuration, and runs an agent::Agent until the job ends for this host.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

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
  std::string controller_;
  std::string etcd_;
  std::string job_ = "default";
  std::string job_token_file_;
  std::string host_id_;  // empty: the hostname
  int nproc_per_host_ = 1;
  int spares_per_host_ = 0;
  std::string advertise_address_;  // empty: the local address of the connection to the controller
  int join_timeout_ms_ = 60'000;
  int controller_timeout_ms_ = 3'000;
  int fence_after_ms_ = 600'000;
  std::string on_sigterm_ = "leave";
  std::string log_level_ = "info";
  std::vector<std::string> program_;
};

}  // namespace nonstop::cli
