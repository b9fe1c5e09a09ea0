// `nonstop agent`: see agent_command.h. Exit codes: 0 (or the code of the
// controller's Shutdown) when the job is over; 1 the controller could not be
// reached within --join-timeout-ms (at the start, or after a loss); 2 a usage
// error or a refusal by the controller (a wrong job token); 130 SIGINT or
// SIGTERM.
#include "apps/nonstop/agent_command.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "agent/agent.h"
#include "common/job_token.h"
#include "common/logging.h"
#include "common/signals.h"
#include "control/messages.h"
#include "launcher/output_writer.h"
#include "nonstop/settings_cli.h"

namespace nonstop::cli {

namespace {

// Whether `name` would be found by execvp: a path, or a name on the PATH.
bool FindProgram(const std::string& name) {
  auto executable = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
           ::access(path.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) return executable(name);
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(start, end - start);
    if (executable((dir.empty() ? "." : dir) + "/" + name)) return true;
    start = end + 1;
  }
  return false;
}

}  // namespace

void AgentCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand(
      "agent",
      "Run this host's agent of a multi-host job: it starts and kills the workers the "
      "controller assigns to this host");
  AddSetting(sub_, settings::kAgentController, controller_);
  AddSetting(sub_, settings::kEtcd, etcd_);
  AddSetting(sub_, settings::kEtcdJob, job_);
  etcd_security_.Register(sub_);
  AddSetting(sub_, settings::kAgentJobTokenFile, job_token_file_);
  AddSetting(sub_, settings::kAgentHostId, host_id_);
  AddSetting(sub_, settings::kNprocPerHost, nproc_per_host_);
  AddSetting(sub_, settings::kSparesPerHost, spares_per_host_);
  AddSetting(sub_, settings::kAgentAdvertiseAddress, advertise_address_);
  AddSetting(sub_, settings::kDataPorts, data_ports_);
  AddSetting(sub_, settings::kAgentJoinTimeoutMs, join_timeout_ms_);
  AddSetting(sub_, settings::kAgentControllerTimeoutMs, controller_timeout_ms_);
  AddSetting(sub_, settings::kFenceAfterMs, fence_after_ms_);
  AddSetting(sub_, settings::kOnSigterm, on_sigterm_);
  AddSetting(sub_, settings::kWorkerUser, worker_user_);
  AddSetting(sub_, settings::kLogLevel, log_level_);
  sub_->footer(
      "After `--`: the worker program and its arguments, started once per worker the controller "
      "assigns "
      "here, with NONSTOP_WORKER_ID, NONSTOP_CONTROLLER, NONSTOP_HOST_ID, NONSTOP_DATA_HOST, "
      "the controller's other NONSTOP_* variables, and the job token in an inherited memfd "
      "(NONSTOP_JOB_TOKEN_FD), never in the environment.\n"
      "Exit codes: 0 (or the controller's) when the job is over; 1 the controller could not be "
      "reached "
      "within --join-timeout-ms; 2 a usage error or a refusal by the controller; 130 SIGINT (or "
      "SIGTERM with "
      "--on-sigterm stop, or a second SIGTERM while leaving).");
}

int AgentCommand::Execute() {
  constexpr int kExitUsage = 2;
  LogLevel level;
  if (!ParseLogLevel(log_level_, &level)) {
    fmt::print(stderr,
               "nonstop agent: --log-level '{}' is not one of debug, info, warning, error\n",
               log_level_);
    return kExitUsage;
  }
  SetLogLevel(level);
  if (program_.empty()) {
    fmt::print(stderr,
               "nonstop agent: no program: put the worker program and its arguments after `--`\n");
    return kExitUsage;
  }
  if (!FindProgram(program_[0])) {
    fmt::print(stderr, "nonstop agent: program '{}' is not an executable file{}\n", program_[0],
               program_[0].find('/') == std::string::npos ? " on the PATH" : "");
    return kExitUsage;
  }
  std::string host_id = host_id_;
  if (host_id.empty()) {
    char name[HOST_NAME_MAX + 1] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0) {
      fmt::print(stderr, "nonstop agent: cannot read the hostname; HINT: pass --host-id\n");
      return kExitUsage;
    }
    host_id = name;
    if (Status s = control::CheckHostId(host_id); !s.ok()) {
      fmt::print(
          stderr,
          "nonstop agent: the hostname '{}' is not a valid host id: {}; HINT: pass --host-id\n",
          host_id, s.message());
      return kExitUsage;
    }
  } else if (Status s = control::CheckHostId(host_id); !s.ok()) {
    fmt::print(stderr, "nonstop agent: --host-id '{}': {}\n", host_id, s.message());
    return kExitUsage;
  }
  SetLogRole("agent " + host_id);
  auto token = ReadJobTokenFile(job_token_file_);
  if (!token.ok()) {
    fmt::print(stderr, "nonstop agent: {}\n", token.status().message());
    return kExitUsage;
  }

  if (controller_.empty() && etcd_.empty()) {
    fmt::print(stderr,
               "nonstop agent: where is the controller? pass --controller HOST:PORT or --etcd "
               "ENDPOINTS\n");
    return kExitUsage;
  }
  agent::AgentOptions options;
  options.controller = controller_;
  options.etcd = etcd_;
  options.etcd_job = job_;
  options.etcd_security = etcd_security_.security();
  options.job_token = *token;
  options.host_id = host_id;
  options.nproc = nproc_per_host_;
  options.spares = spares_per_host_;
  options.advertise_address = advertise_address_;
  options.data_ports = data_ports_;
  options.program = program_;
  options.join_timeout = Millis(join_timeout_ms_);
  options.controller_timeout = Millis(controller_timeout_ms_);
  options.fence_after = Millis(fence_after_ms_);
  options.handle_signals = true;
  options.leave_on_sigterm = on_sigterm_ == "leave";
  if (!worker_user_.empty()) {
    auto user = launcher::LookUpRunAs(worker_user_);
    if (!user.ok()) {
      fmt::print(stderr, "nonstop agent: {}\n", user.status().message());
      return kExitUsage;
    }
    options.run_as = std::move(*user);
  }
  if (Status s = agent::ValidateOptions(options); !s.ok()) {
    fmt::print(stderr, "nonstop agent: {}\n", s.message());
    return kExitUsage;
  }

  // SIGINT/SIGTERM are read by the agent's loop (a signalfd): blocked here,
  // before any thread starts, so that every thread inherits the mask.
  BlockTerminationSignals({SIGUSR1});  // --on-sigterm leave: SIGUSR1 is read by the loop too

  // Everything the agent prints goes through bounded writers, log lines
  // included: a slow reader of our output never stalls the loop.
  launcher::BoundedStdio stdio;
  launcher::OutputWriter& out = stdio.out();
  launcher::OutputWriter& err = stdio.err();
  options.out = &out;
  options.err = &err;

  std::string cmdline;
  for (const auto& a : program_) cmdline += (cmdline.empty() ? "" : " ") + a;
  std::string table = "nonstop agent\n";
  auto row = [&table](std::string_view key, const std::string& value) {
    table += fmt::format("  {:<20} {}\n", key, value);
  };
  row("controller",
      etcd_.empty() ? controller_ : fmt::format("the leader of job '{}' in etcd {}", job_, etcd_));
  row("host id", host_id);
  row("workers", std::to_string(nproc_per_host_));
  row("spares", std::to_string(spares_per_host_));
  row("advertise address", advertise_address_.empty() ? "the interface that reaches the controller"
                                                      : advertise_address_);
  row("data ports", data_ports_.empty() ? "a port from the OS for each worker" : data_ports_);
  row("join timeout", fmt::format("{} ms", join_timeout_ms_));
  row("controller timeout", fmt::format("{} ms", controller_timeout_ms_));
  row("fence after", fmt::format("{} ms", fence_after_ms_));
  row("on SIGTERM", on_sigterm_ == "leave"
                        ? "leave: release the workers at the next step boundary, then exit 0"
                        : "stop: kill the workers now");
  row("job token", "from " + job_token_file_);
  row("workers run as", worker_user_.empty() ? "this user" : worker_user_);
  row("program", cmdline);
  out.Write(table);

  agent::Agent agent(std::move(options));
  return agent.Run();
}

}  // namespace nonstop::cli
