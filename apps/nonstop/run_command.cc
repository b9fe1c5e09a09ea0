// `nonstop run`: the controller and a local launcher in one process, on one
// event loop (src/controller/runtime.h). It starts --nproc workers and
// --spares spares, forms generation 1, forwards every worker's output with a
// rank prefix, watches heartbeats and process exits, carries out the
// controller's recoveries (abort, kill, start a new spare), writes the
// journal, prints the recovery report, and exits with a code that means
// something to a supervisor (0 ok, 2 usage, 10 the job could not continue
// after a worker failed, 11 data corruption).
//
// With no program, it runs the built-in demonstration: nonstop-train on its
// default recipe, with one fault injected (kill:rank=2,step=30) unless
// --inject says otherwise.
//
// `nonstop controller`: the same runtime without a local launcher, for jobs
// over several hosts: each host runs `nonstop agent`, which registers with it.
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <sys/wait.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "agent/agent.h"
#include "launcher/output_writer.h"
#include "apps/nonstop/commands.h"
#include "apps/nonstop/settings_cli.h"
#include "common/logging.h"
#include "nonstop/settings.h"
#include "common/signals.h"
#include "common/unique_fd.h"
#include "coord/leadership.h"
#include "control/fault_spec.h"
#include "controller/journal.h"
#include "controller/runtime.h"

namespace nonstop::cli {

std::string SelfDirectory() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

std::string JobFileFor(const std::string& journal_path) { return controller::JobFileFor(journal_path); }

namespace {

void RegisterJobFlags(CLI::App* sub, JobFlags* f) {
  namespace s = settings;
  AddSetting(sub, s::kJournal, f->journal);
  AddSetting(sub, s::kHeartbeatTimeoutMs, f->heartbeat_timeout_ms);
  AddSetting(sub, s::kAbortTimeoutMs, f->abort_timeout_ms);
  AddSetting(sub, s::kHangFloorMs, f->hang_floor_ms);
  AddSetting(sub, s::kHangFactor, f->hang_factor);
  AddSetting(sub, s::kStallFloorMs, f->stall_floor_ms);
  AddSetting(sub, s::kRefillNice, f->refill_nice);
  AddSetting(sub, s::kJoinTimeoutMs, f->join_timeout_ms);
  AddSetting(sub, s::kInject, f->inject);
  AddSetting(sub, s::kRecovery, f->recovery);
  AddSetting(sub, s::kCheckpointDir, f->checkpoint_dir);
  AddSetting(sub, s::kCheckpointEvery, f->checkpoint_every);
  AddSetting(sub, s::kMtbfSeconds, f->mtbf_seconds);
  AddSetting(sub, s::kHttpHost, f->http_host);
  AddSetting(sub, s::kHttpPort, f->http_port);
  AddSetting(sub, s::kMinWorld, f->min_world);
  AddSetting(sub, s::kMaxWorld, f->max_world);
  AddSetting(sub, s::kAllowedSizes, f->allowed_sizes);
  AddSetting(sub, s::kWorldIncrement, f->world_increment);
  AddSetting(sub, s::kStablePeriodMs, f->stable_period_ms);
  AddSetting(sub, s::kLogLevel, f->log_level);
}

// The runtime's options from the shared flags; a usage error is printed and
// returned as its exit code.
std::optional<int> FillOptions(const std::string& name, const JobFlags& f, int max_rank,
                               controller::RuntimeOptions* o) {
  SetLogRole("nonstop");
  LogLevel level;
  if (!ParseLogLevel(f.log_level, &level)) {
    fmt::print(stderr, "{}: --log-level '{}' is not one of debug, info, warning, error\n", name, f.log_level);
    return controller::kExitUsage;
  }
  SetLogLevel(level);
  o->name = name;
  for (const auto& text : f.inject) {
    if (text == "none") continue;
    auto parsed = control::ParseFaults(text, static_cast<int>(o->core.faults.size()));
    if (!parsed.ok()) {
      fmt::print(stderr, "{}: --inject: {}\n", name, parsed.status().message());
      return controller::kExitUsage;
    }
    for (auto& fault : *parsed) {
      if (max_rank > 0 && fault.rank >= max_rank) {
        fmt::print(stderr, "{}: --inject {}: there is no rank {} with --nproc {}\n", name, control::FormatFault(fault),
                   fault.rank, max_rank);
        return controller::kExitUsage;
      }
      o->core.faults.push_back(fault);
    }
  }
  if (f.recovery == "checkpoint" && f.checkpoint_dir.empty()) {
    fmt::print(stderr, "{}: --recovery checkpoint needs --checkpoint-dir (where the checkpoints go)\n", name);
    return controller::kExitUsage;
  }
  controller::ControllerOptions& c = o->core;
  c.recovery = f.recovery == "checkpoint" ? controller::RecoveryMode::kCheckpointRestart
                                          : controller::RecoveryMode::kCheckpointless;
  c.have_checkpoints = !f.checkpoint_dir.empty();
  c.policy.min_world = f.min_world;
  c.policy.max_world = f.max_world;
  c.policy.allowed_sizes = f.allowed_sizes;
  c.policy.increment = f.world_increment;
  c.policy.stable_period = Millis(f.stable_period_ms);
  c.heartbeat_timeout = Millis(f.heartbeat_timeout_ms);
  c.abort_timeout = Millis(f.abort_timeout_ms);
  c.forming_timeout = Millis(f.join_timeout_ms);
  c.join_timeout = Millis(f.join_timeout_ms);
  c.hang_floor = Millis(f.hang_floor_ms);
  c.hang_factor = f.hang_factor;
  c.stall_floor = Millis(f.stall_floor_ms);
  o->journal = f.journal;
  o->http_host = f.http_host;
  o->http_port = f.http_port;
  o->checkpoint_dir = f.checkpoint_dir;
  o->checkpoint_every = f.checkpoint_every;
  o->mtbf_seconds = f.mtbf_seconds;
  o->refill_nice = f.refill_nice;
  o->recovery_name = f.recovery;
  return std::nullopt;
}

}  // namespace

void RunCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand("run", "Run a training job on this machine: controller + local workers (like torchrun)");
  AddSetting(sub_, settings::kNproc, nproc_);
  AddSetting(sub_, settings::kSpares, spares_);
  AddSetting(sub_, settings::kHost, host_);
  AddSetting(sub_, settings::kPort, port_);
  AddSetting(sub_, settings::kResumable, resumable_);
  AddSetting(sub_, settings::kVerbose, verbose_);
  RegisterJobFlags(sub_, &flags_);
  sub_->footer("After `--`: the worker program and its arguments. Without one, the built-in demonstration runs: "
               "nonstop-train on its llama-tiny recipe with --inject kill:rank=2,step=30.");
}

int RunCommand::Execute() {
  controller::RuntimeOptions o;
  JobFlags flags = flags_;
  o.program = program_;
  if (o.program.empty()) {
    o.program = {SelfDirectory() + "/nonstop-train"};
    if (flags.inject.empty()) flags.inject = {"kill:rank=2,step=30"};  // the demonstration's fault
  }
  if (auto code = FillOptions("nonstop run", flags, nproc_, &o)) return *code;
  if (flags.max_world > 0 && flags.max_world < nproc_) {
    fmt::print(stderr, "nonstop run: --max-world {} is below --nproc {}\n", flags.max_world, nproc_);
    return controller::kExitUsage;
  }
  if (flags.min_world > nproc_) {
    fmt::print(stderr, "nonstop run: --min-world {} is above --nproc {}\n", flags.min_world, nproc_);
    return controller::kExitUsage;
  }
  o.core.world_size = nproc_;
  o.core.spares = spares_;
  o.listen = {host_, static_cast<uint16_t>(port_)};
  o.data_host = host_;
  const char* term = std::getenv("TERM");
  if (!verbose_ && ::isatty(STDOUT_FILENO) && !(term != nullptr && std::string(term) == "dumb")) {
    // A person watching: one live line; the workers' logs go to files beside the journal.
    std::filesystem::path journal(o.journal);
    std::filesystem::path logs = (journal.has_parent_path() ? journal.parent_path() : ".") / "logs";
    std::error_code ec;
    std::filesystem::create_directories(logs, ec);
    if (ec) {
      fmt::print(stderr, "nonstop run: cannot create {}: {} (or pass --verbose)\n", logs.string(), ec.message());
      return 1;
    }
    o.progress_line = true;
    o.worker_log_dir = logs.string();
    fmt::print("nonstop run: the workers' output goes to {}/worker-N.log (--verbose: here)\n", logs.string());
  }
  if (resumable_) return RunResumable(std::move(o));
  return controller::RunController(o);
}

// The command that adopts this run's workers if its controller dies: the
// job's own flags as given (on the command line or in NONSTOP_* variables)
// come along, so that the new controller runs the job the same way.
std::string RunCommand::ResumeCommand(const std::string& journal, const std::string& token_file) const {
  auto quoted = [](const std::string& v) {
    bool plain = !v.empty() && v.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                                   "._-/:=,@+") == std::string::npos;
    if (plain) return v;
    std::string q = "'";
    for (char c : v) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  std::string cmd = fmt::format("nonstop controller --resume {} --nnodes 1 --job-token-file {}", quoted(journal),
                                quoted(token_file));
  namespace s = settings;
  for (std::string_view name :
       {s::kHeartbeatTimeoutMs.flag, s::kAbortTimeoutMs.flag, s::kHangFloorMs.flag, s::kHangFactor.flag,
        s::kStallFloorMs.flag, s::kRefillNice.flag, s::kJoinTimeoutMs.flag, s::kRecovery.flag, s::kCheckpointDir.flag,
        s::kCheckpointEvery.flag, s::kMtbfSeconds.flag, s::kMinWorld.flag, s::kMaxWorld.flag, s::kAllowedSizes.flag,
        s::kWorldIncrement.flag, s::kStablePeriodMs.flag, s::kLogLevel.flag}) {
    const CLI::Option* opt = sub_->get_option_no_throw(std::string(name));
    if (opt == nullptr || opt->results().empty()) continue;
    std::string value;
    for (const std::string& v : opt->results()) value += (value.empty() ? "" : ",") + v;
    cmd += fmt::format(" {} {}", name, quoted(value));
  }
  return cmd;
}

// `nonstop run --resumable`: the same job as two processes, so that the
// controller can die without the workers (docs/controller-failover.md).
// A child process runs the controller as `nonstop controller --nnodes 1`
// would; this process is the host's agent, the parent of the workers. The
// job's exit code is the agent's: the one the controller's shutdown names.
int RunCommand::RunResumable(controller::RuntimeOptions o) {
  const std::string name = "nonstop run";
  std::filesystem::path journal(o.journal);
  std::filesystem::path dir = journal.has_parent_path() ? journal.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string job_file = controller::JobFileFor(o.journal);
  const std::string token_file = (dir / "job.token").string();
  std::filesystem::remove(job_file, ec);  // the one the controller writes now is this job's
  std::vector<std::string> program = o.program;

  controller::RuntimeOptions c = o;
  c.name = "nonstop run";
  c.worker_log_dir.clear();  // the agent below starts the workers: it writes their logs
  c.program.clear();  // no local launcher: the agent below starts the workers
  c.core.min_hosts = 1;
  c.core.max_hosts = 1;
  c.token_file = token_file;
  // SIGINT and SIGTERM are blocked before the fork: the controller reads its own from a signalfd,
  // this process forwards them to it (below), and none is lost in between.
  sigset_t mask = BlockTerminationSignals();
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  pid_t child = ::fork();
  if (child < 0) {
    fmt::print(stderr, "{}: fork: {}\n", name, std::strerror(errno));
    return 1;
  }
  if (child == 0) {
    // The controller ends the job if the process that supervises the workers dies.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) std::_Exit(1);
    int code = controller::RunController(c);
    std::fflush(nullptr);
    std::_Exit(code);
  }

  int child_code = -1;  // set once the child is reaped
  auto reap = [&](bool wait) {
    if (child_code >= 0) return true;
    int status = 0;
    if (::waitpid(child, &status, wait ? 0 : WNOHANG) != child) return false;
    child_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  };
  auto stop_child = [&]() {  // bounded: SIGTERM, then SIGKILL
    for (int i = 0; i < 100 && !reap(false); ++i) {
      if (i == 0) ::kill(child, SIGTERM);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!reap(false)) {
      ::kill(child, SIGKILL);
      reap(true);
    }
  };
  auto take_signal = [&](int timeout_ms) {
    timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1'000'000L};
    return ::sigtimedwait(&mask, nullptr, &ts);
  };

  // Wait for this controller's job file: its address and the job's token.
  std::string address, token;
  for (int i = 0; i < 600 && address.empty(); ++i) {
    if (int sig = take_signal(0); sig > 0) {
      ::kill(child, sig);
      stop_child();
      return controller::kExitInterrupted;
    }
    if (reap(false)) {
      fmt::print(stderr, "{}: the controller exited (code {}) before the job started\n", name, child_code);
      return child_code == 0 ? 1 : child_code;
    }
    std::ifstream in(job_file);
    auto job = in ? nlohmann::json::parse(in, nullptr, false) : nlohmann::json();
    if (job.is_object() && job.value("pid", int64_t{-1}) == child && job.contains("controller") &&
        job["controller"].is_string() && job.contains("token") && job["token"].is_string()) {
      address = job["controller"].get<std::string>();
      token = job["token"].get<std::string>();
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (address.empty()) {
    fmt::print(stderr, "{}: the controller did not start within 30 s (no job file at {})\n", name, job_file);
    stop_child();
    return 1;
  }
  agent::AgentOptions a;
  a.controller = address;
  a.job_token = token;
  a.host_id = "local";
  a.nproc = nproc_;
  a.spares = spares_;
  a.advertise_address = host_;
  a.program = program;
  a.elastic = true;  // the controller starts here whatever the job needs, as on one machine
  a.log_dir = o.worker_log_dir;
  a.handle_signals = false;  // the watcher below reads them
  if (Status st = agent::ValidateOptions(a); !st.ok()) {
    fmt::print(stderr, "{}: {}\n", name, st.message());
    stop_child();
    return controller::kExitUsage;
  }
  launcher::BoundedStdio stdio;
  a.out = &stdio.out();
  a.err = &stdio.err();
  const std::string resume = ResumeCommand(o.journal, token_file);
  stdio.out().Write(fmt::format("[nonstop] resumable: the controller runs as pid {}; the workers are this process's "
                                "({}). If the controller dies: {}\n",
                                child, ::getpid(), resume));
  agent::Agent agent(a);
  // The watcher: a signal goes to the controller, which ends the job (the agent follows its
  // shutdown; if it does not within 20 s, or the controller is gone, the agent stops). A controller
  // that dies before the job formed ends the run with its code; one that dies later is replaced by
  // `nonstop controller --resume`.
  std::atomic<bool> done{false};
  std::atomic<int> failed_start{-1};
  std::thread watcher([&] {
    std::optional<Deadline> stop_at;
    bool told = false;
    bool signalled = false;  // the job is ending on a signal: the controller's exit is expected
    while (!done) {
      int sig = take_signal(100);
      bool gone = reap(false);
      if (sig > 0) {
        signalled = true;
        if (!gone) ::kill(child, sig);
        stop_at = gone ? Clock::now() : DeadlineAfter(Millis(20'000));
      }
      if (stop_at && Clock::now() >= *stop_at) {
        agent.Stop();
        stop_at.reset();
      }
      if (gone && !told) {
        told = true;
        auto plans = controller::Journal::Read(o.journal);
        bool formed = false, ended = false;  // a controller that ended the job (job_end) did not die
        if (plans.ok()) {
          for (const auto& r : *plans) {
            formed = formed || r.value("event", "") == "plan";
            ended = ended || r.value("event", "") == "job_end";
          }
        }
        if (!formed) {
          failed_start = child_code;
          agent.Stop();
        } else if (child_code != 0 && !signalled && !ended) {
          stdio.err().Write(fmt::format("[nonstop] the controller (pid {}) died ({}): the workers train on; to adopt "
                                        "them: {}\n",
                                        child, child_code, resume));
        }
      }
    }
  });
  int code = agent.Run();
  done = true;
  watcher.join();
  // The controller (ours, if it was not replaced) leaves once the agent has; one that does not is stopped.
  for (int i = 0; i < 400 && !reap(false); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (!reap(false)) stop_child();
  if (failed_start >= 0) {
    fmt::print(stderr, "{}: the controller exited (code {}) before the job formed\n", name, failed_start.load());
    return failed_start == 0 ? 1 : failed_start.load();
  }
  return code;
}

void ControllerCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand("controller",
                            "Run the controller of a job over several hosts; each host runs `nonstop agent`");
  AddSetting(sub_, settings::kListen, listen_);
  AddSetting(sub_, settings::kControllerAdvertiseAddress, advertise_address_);
  AddSetting(sub_, settings::kNnodes, nnodes_);
  AddSetting(sub_, settings::kControllerJobTokenFile, token_file_);
  sub_->add_option("--resume", resume_,
                   "Take over the running job of this journal (its controller stopped): adopt the workers and agents "
                   "it recorded, on the control port it recorded (unless --listen names one), and go on appending "
                   "to it; the same --nnodes and --job-token-file as the first controller")
      ->check(CLI::ExistingFile);
  AddSetting(sub_, settings::kControllerEtcd, etcd_);
  AddSetting(sub_, settings::kEtcdJob, job_);
  sub_->add_option("--lease-ttl-s", lease_ttl_s_,
                   "The leader's etcd lease in seconds: a leader that dies is replaced within about this")
      ->capture_default_str()->check(CLI::Range(1, 60));
  RegisterJobFlags(sub_, &flags_);
}

int ControllerCommand::Execute() {
  const std::string name = "nonstop controller";
  controller::RuntimeOptions o;
  if (auto code = FillOptions(name, flags_, /*max_rank=*/0, &o)) return *code;
  auto listen = net::ParseHostPort(listen_);
  if (!listen.ok()) {
    fmt::print(stderr, "{}: --listen '{}': {}\n", name, listen_, listen.status().message());
    return controller::kExitUsage;
  }
  o.listen = *listen;
  o.advertise_address = advertise_address_;
  int min_hosts = 0, max_hosts = 0;
  {
    size_t colon = nnodes_.find(':');
    try {
      size_t used = 0;
      min_hosts = std::stoi(nnodes_.substr(0, colon), &used);
      if (used != (colon == std::string::npos ? nnodes_.size() : colon)) throw std::invalid_argument(nnodes_);
      if (colon != std::string::npos) {
        max_hosts = std::stoi(nnodes_.substr(colon + 1), &used);
        if (used != nnodes_.size() - colon - 1) throw std::invalid_argument(nnodes_);
      }
    } catch (...) {
      fmt::print(stderr, "{}: --nnodes '{}' is not MIN or MIN:MAX (e.g. 4 or 2:8)\n", name, nnodes_);
      return controller::kExitUsage;
    }
    if (min_hosts < 1 || (max_hosts != 0 && max_hosts < min_hosts) || min_hosts > 100'000 || max_hosts > 100'000) {
      fmt::print(stderr, "{}: --nnodes '{}': MIN must be at least 1 and MAX at least MIN\n", name, nnodes_);
      return controller::kExitUsage;
    }
  }
  o.core.min_hosts = min_hosts;
  o.core.max_hosts = max_hosts;
  // An existing token file keeps its token (agents may already have read
  // it), read exactly as the agents read it.
  if (std::filesystem::exists(token_file_)) {
    auto token = agent::ReadJobTokenFile(token_file_);
    if (token.ok()) o.token = *token;
  }
  o.token_file = token_file_;
  if (!resume_.empty()) {
    if (!std::filesystem::exists(token_file_)) {
      fmt::print(stderr, "{}: --resume needs the job's token: --job-token-file {} does not exist\n", name, token_file_);
      return controller::kExitUsage;
    }
    o.resume = resume_;
    o.journal = resume_;
  }
  if (etcd_.empty()) return controller::RunController(o);
  if (!resume_.empty()) {
    fmt::print(stderr, "{}: --resume and --etcd: with etcd, the journal to take over is etcd's (leave out --resume)\n",
               name);
    return controller::kExitUsage;
  }
  return LeadThroughEtcd(name, o);
}

int ControllerCommand::LeadThroughEtcd(const std::string& name, controller::RuntimeOptions o) {
  // SIGINT/SIGTERM stop a standby too: read from a signalfd while it waits.
  sigset_t mask = BlockTerminationSignals();
  UniqueFd sigfd(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
  auto interrupted = [&]() {
    signalfd_siginfo si;
    return sigfd.valid() && ::read(sigfd.get(), &si, sizeof(si)) == sizeof(si);
  };
  while (true) {
    coord::LeadershipOptions lo;
    lo.endpoints = etcd_;
    lo.job = job_;
    lo.ttl_seconds = lease_ttl_s_;
    auto leadership = coord::Leadership::Connect(lo);
    if (!leadership.ok()) {
      fmt::print(stderr, "{}: {}\n", name, leadership.status().ToString());
      return 1;
    }
    fmt::print("{}: job '{}' in etcd {}: campaigning to lead (lease {} s)\n", name, job_, etcd_, lease_ttl_s_);
    std::fflush(stdout);
    auto epoch = (*leadership)->Campaign(interrupted, [&](const std::string& leader) {
      fmt::print("{}: standing by; the leader is {}\n", name, leader);
      std::fflush(stdout);
    });
    if (!epoch.ok()) {
      fmt::print("{}: {}\n", name, epoch.status().message());
      return controller::kExitInterrupted;
    }
    fmt::print("{}: leading job '{}' (epoch {})\n", name, job_, *epoch);
    std::fflush(stdout);
    // The job's token: the first leader wrote it; every later one reads it (agents and workers hold it).
    if (std::filesystem::exists(token_file_)) {
      auto token = agent::ReadJobTokenFile(token_file_);
      if (!token.ok()) {
        fmt::print(stderr, "{}: {}\n", name, token.status().message());
        return 1;
      }
      o.token = *token;
    }
    o.leadership = leadership->get();
    int code = controller::RunController(o);
    if (code != controller::kExitDeposed) return code;
    fmt::print("{}: deposed; standing by again\n", name);
  }
}

}  // namespace nonstop::cli
