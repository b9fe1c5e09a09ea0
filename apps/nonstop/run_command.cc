// `nonstop run`: one job on this machine. Its controller (src/controller/
// runtime.h) runs in a child process (the default: it can die without the
// workers, docs/controller-failover.md) or, with --single-process, on a
// thread of this process; either way this process runs the machine's agent
// (src/agent/agent.h: host `local`, elastic), which dials the controller on
// loopback and starts --nproc workers and --spares spares. The controller
// forms generation 1, watches heartbeats and process exits, carries out the
// recoveries (abort, kill, start a new spare), writes the journal, prints
// the recovery report, and ends the job with a code that means something to
// a supervisor (0 ok, 2 usage, 10 the job could not continue after a worker
// failed, 11 data corruption); the agent forwards every worker's output with
// a rank prefix.
//
// With no program, it runs the built-in demonstration: nonstop-train on its
// default recipe, with one fault injected (kill:rank=2,step=30) unless
// --inject says otherwise.
//
// `nonstop controller`: the same runtime alone, for jobs over several hosts:
// each host runs `nonstop agent`, which registers with it.
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>

#include <fmt/format.h>

#include "agent/agent.h"
#include "apps/nonstop/commands.h"
#include "common/job_token.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/unique_fd.h"
#include "control/fault_spec.h"
#include "controller/journal.h"
#include "controller/runtime.h"
#include "coord/leadership.h"
#include "launcher/local_launcher.h"
#include "launcher/output_writer.h"
#include "nonstop/settings.h"
#include "nonstop/settings_cli.h"

namespace nonstop::cli {

std::string SelfDirectory() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

std::string JobFileFor(const std::string& journal_path) {
  return controller::JobFileFor(journal_path);
}

namespace {

void RegisterJobFlags(CLI::App* sub, JobFlags* f) {
  namespace s = settings;
  AddSetting(sub, s::kJournal, f->journal);
  AddSetting(sub, s::kHeartbeatTimeoutMs, f->heartbeat_timeout_ms);
  AddSetting(sub, s::kAbortTimeoutMs, f->abort_timeout_ms);
  AddSetting(sub, s::kBusyTimeoutMs, f->busy_timeout_ms);
  AddSetting(sub, s::kHangFactor, f->hang_factor);
  AddSetting(sub, s::kStallFloorMs, f->stall_floor_ms);
  AddSetting(sub, s::kStallFactor, f->stall_factor);
  AddSetting(sub, s::kFailureRepeats, f->failure_repeats);
  AddSetting(sub, s::kFailureWindowMs, f->failure_window_ms);
  AddSetting(sub, s::kRecoveryBudget, f->recovery_budget);
  AddSetting(sub, s::kRecoveryBudgetWindowS, f->recovery_budget_window_s);
  AddSetting(sub, s::kRefillNice, f->refill_nice);
  AddSetting(sub, s::kJoinTimeoutMs, f->join_timeout_ms);
  AddSetting(sub, s::kInject, f->inject);
  AddSetting(sub, s::kRecovery, f->recovery);
  AddSetting(sub, s::kCheckpointDir, f->checkpoint_dir);
  AddSetting(sub, s::kCheckpointEvery, f->checkpoint_every);
  AddSetting(sub, s::kMtbfSeconds, f->mtbf_seconds);
  AddSetting(sub, s::kHttpHost, f->http_host);
  AddSetting(sub, s::kHttpPort, f->http_port);
  AddSetting(sub, s::kHttpCert, f->http_cert);
  AddSetting(sub, s::kHttpKey, f->http_key);
  AddSetting(sub, s::kMinWorld, f->min_world);
  AddSetting(sub, s::kMaxWorld, f->max_world);
  AddSetting(sub, s::kAllowedSizes, f->allowed_sizes);
  AddSetting(sub, s::kWorldIncrement, f->world_increment);
  AddSetting(sub, s::kStablePeriodMs, f->stable_period_ms);
  AddSetting(sub, s::kLogLevel, f->log_level);
  f->workers.Register(sub);
}

// The runtime's options from the shared flags; a usage error is printed and
// returned as its exit code.
std::optional<int> FillOptions(const std::string& name, const JobFlags& f, int max_rank,
                               controller::RuntimeOptions* o) {
  SetLogRole("nonstop");
  LogLevel level;
  if (!ParseLogLevel(f.log_level, &level)) {
    fmt::print(stderr, "{}: --log-level '{}' is not one of debug, info, warning, error\n", name,
               f.log_level);
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
        fmt::print(stderr, "{}: --inject {}: there is no rank {} with --nproc {}\n", name,
                   control::FormatFault(fault), fault.rank, max_rank);
        return controller::kExitUsage;
      }
      o->core.faults.push_back(fault);
    }
  }
  if (f.recovery == "checkpoint" && f.checkpoint_dir.empty()) {
    fmt::print(stderr,
               "{}: --recovery checkpoint needs --checkpoint-dir (where the checkpoints go)\n",
               name);
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
  c.busy_timeout = Millis(f.busy_timeout_ms);
  c.hang_factor = f.hang_factor;
  c.stall_floor = Millis(f.stall_floor_ms);
  c.stall_factor = f.stall_factor;
  c.failure_repeats = f.failure_repeats;
  c.failure_window = Millis(f.failure_window_ms);
  c.recovery_budget = f.recovery_budget;
  c.recovery_budget_window = Millis(int64_t{f.recovery_budget_window_s} * 1000);
  o->journal = f.journal;
  o->http_host = f.http_host;
  o->http_port = f.http_port;
  o->http_cert = f.http_cert;
  o->http_key = f.http_key;
  o->checkpoint_dir = f.checkpoint_dir;
  o->checkpoint_every = f.checkpoint_every;
  o->mtbf_seconds = f.mtbf_seconds;
  // Refills warm up niced only where they can be set back to normal priority when they take a rank
  // (RuntimeOptions::refill_nice): the elastic host's agent is this user's, on this machine.
  o->refill_nice = launcher::LocalLauncher::CanRestorePriority() ? f.refill_nice : 0;
  o->recovery_name = f.recovery;
  o->worker_env = f.workers.Given();
  return std::nullopt;
}

}  // namespace

void RunCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand(
      "run", "Run a training job on this machine: controller + local workers (like torchrun)");
  AddSetting(sub_, settings::kNproc, nproc_);
  AddSetting(sub_, settings::kSpares, spares_);
  AddSetting(sub_, settings::kHost, host_);
  AddSetting(sub_, settings::kDataPorts, data_ports_);
  AddSetting(sub_, settings::kWorkerUser, worker_user_);
  AddSetting(sub_, settings::kPort, port_);
  AddSetting(sub_, settings::kResumable, resumable_);
  AddSetting(sub_, settings::kVerbose, verbose_);
  RegisterJobFlags(sub_, &flags_);
  sub_->footer(
      "After `--`: the worker program and its arguments. Without one, the built-in demonstration "
      "runs: "
      "nonstop-train on its llama-tiny recipe with --inject kill:rank=2,step=30.");
}

int RunCommand::Execute() {
  controller::RuntimeOptions o;
  JobFlags flags = flags_;
  std::vector<std::string> program = program_;
  if (program.empty()) {
    program = {SelfDirectory() + "/nonstop-train"};
    if (flags.inject.empty()) flags.inject = {"kill:rank=2,step=30"};  // the demonstration's fault
  }
  if (auto code = FillOptions("nonstop run", flags, nproc_, &o)) return *code;
  if (flags.max_world > 0 && flags.max_world < nproc_) {
    fmt::print(stderr, "nonstop run: --max-world {} is below --nproc {}\n", flags.max_world,
               nproc_);
    return controller::kExitUsage;
  }
  if (flags.min_world > nproc_) {
    fmt::print(stderr, "nonstop run: --min-world {} is above --nproc {}\n", flags.min_world,
               nproc_);
    return controller::kExitUsage;
  }
  o.core.world_size = nproc_;
  o.core.spares = spares_;
  o.listen = {host_, static_cast<uint16_t>(port_)};
  if (!worker_user_.empty()) {
    auto user = launcher::LookUpRunAs(worker_user_);
    if (!user.ok()) {
      fmt::print(stderr, "nonstop run: {}\n", user.status().message());
      return controller::kExitUsage;
    }
    run_as_ = std::move(*user);
    fmt::print(
        "[nonstop] the workers run as user {} (uid {}): docs/security.md, \"A user for the "
        "workers\"\n",
        run_as_->name, run_as_->uid);
  }
  std::string log_dir;  // the agent's: where the workers' output goes instead of this terminal
  const char* term = std::getenv("TERM");
  if (!verbose_ && ::isatty(STDOUT_FILENO) && !(term != nullptr && std::string(term) == "dumb")) {
    // A person watching: one live line; the workers' logs go to files beside the journal.
    std::filesystem::path journal(o.journal);
    std::filesystem::path logs = (journal.has_parent_path() ? journal.parent_path() : ".") / "logs";
    std::error_code ec;
    std::filesystem::create_directories(logs, ec);
    if (ec) {
      fmt::print(stderr, "nonstop run: cannot create {}: {} (or pass --verbose)\n", logs.string(),
                 ec.message());
      return 1;
    }
    o.progress_line = true;
    log_dir = logs.string();
    fmt::print("nonstop run: the workers' output goes to {}/worker-N.log (--verbose: here)\n",
               logs.string());
  }
  return RunLocal(std::move(o), program, log_dir);
}

// The arguments of `nonstop controller` that adopt this run's workers if its
// controller dies: the job's own flags as given (on the command line or in
// NONSTOP_* variables) come along, so that the new controller runs the job
// the same way.
std::vector<std::string> RunCommand::ResumeArguments(const std::string& journal,
                                                     const std::string& token_file) const {
  std::vector<std::string> args = {"controller", "--resume",         journal,   "--nnodes",
                                   "1",          "--job-token-file", token_file};
  namespace s = settings;
  for (std::string_view name : {s::kHeartbeatTimeoutMs.flag, s::kAbortTimeoutMs.flag,
                                s::kBusyTimeoutMs.flag,      s::kHangFactor.flag,
                                s::kStallFloorMs.flag,       s::kStallFactor.flag,
                                s::kFailureRepeats.flag,     s::kFailureWindowMs.flag,
                                s::kRecoveryBudget.flag,     s::kRecoveryBudgetWindowS.flag,
                                s::kRefillNice.flag,         s::kJoinTimeoutMs.flag,
                                s::kRecovery.flag,           s::kCheckpointDir.flag,
                                s::kCheckpointEvery.flag,    s::kMtbfSeconds.flag,
                                s::kMinWorld.flag,           s::kMaxWorld.flag,
                                s::kAllowedSizes.flag,       s::kWorldIncrement.flag,
                                s::kStablePeriodMs.flag,     s::kLogLevel.flag}) {
    const CLI::Option* opt = sub_->get_option_no_throw(std::string(name));
    if (opt == nullptr || opt->results().empty()) continue;
    std::string value;
    for (const std::string& v : opt->results()) value += (value.empty() ? "" : ",") + v;
    args.emplace_back(name);
    args.push_back(value);
  }
  // The workers' settings, which the new controller's spawns (refills) carry as this one's did.
  for (std::string& a : flags_.workers.Arguments()) args.push_back(std::move(a));
  return args;
}

namespace {

// The same as a command a person can paste into a shell.
std::string ShellCommand(const std::vector<std::string>& args) {
  auto quoted = [](const std::string& v) {
    bool plain = !v.empty() && v.find_first_not_of(
                                   "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                   "._-/:=,@+") == std::string::npos;
    if (plain) return v;
    std::string q = "'";
    for (char c : v) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  std::string cmd = "nonstop";
  for (const std::string& a : args) cmd += " " + quoted(a);
  return cmd;
}

// The controller of a `nonstop run`: the runtime of a job of one host, this
// process's agent. It runs in a child process (the default) or on a thread
// of this process (--single-process); everything around it is the same for
// both (RunCommand::RunLocal).
class LocalController {
 public:
  virtual ~LocalController() = default;
  virtual pid_t pid() const = 0;  // the pid its job file names
  // Whether it has ended, without waiting; then exit_code() is its code.
  virtual bool Ended() = 0;
  int exit_code() const { return code_.load(); }
  // Passes on a SIGINT or SIGTERM this process received: the controller ends the job.
  virtual void Forward(int sig) = 0;
  // Ends it (SIGTERM) and waits for it, bounded (a child still there 5 s later gets SIGKILL).
  virtual void Stop() = 0;
  // Whether it can die while this process lives: its workers then train on, for `--resume` to
  // adopt.
  virtual bool separate() const = 0;

 protected:
  std::atomic<int> code_{-1};
};

// The default: the controller as a child process, as `nonstop controller --nnodes 1` would run it.
class ControllerProcess final : public LocalController {
 public:
  // Forks; the child runs the controller and exits with its code. nullptr (said why) if fork fails.
  // Called before this process starts any thread.
  static std::unique_ptr<ControllerProcess> Start(const controller::RuntimeOptions& c) {
    std::fflush(nullptr);
    const pid_t parent = ::getpid();
    pid_t child = ::fork();
    if (child < 0) {
      fmt::print(stderr, "{}: fork: {}\n", c.name, std::strerror(errno));
      return nullptr;
    }
    if (child == 0) {
      // The controller ends the job if the process that supervises the workers dies.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) std::_Exit(1);
      int code = controller::RunController(c);
      std::fflush(nullptr);
      std::_Exit(code);
    }
    return std::unique_ptr<ControllerProcess>(new ControllerProcess(child));
  }
  // Starts `this program` with `args` (`nonstop controller --resume …`): a fresh process, since
  // this one runs threads by now (a fork that did not exec could inherit a lock a thread held).
  // nullptr (said why) if it cannot start.
  static std::unique_ptr<ControllerProcess> Exec(const std::vector<std::string>& args,
                                                 std::string* why) {
    std::error_code ec;
    const std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    if (ec) {
      *why = "cannot find this program (/proc/self/exe): " + ec.message();
      return nullptr;
    }
    std::vector<std::string> argv = {self};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> cargv;
    for (std::string& a : argv) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    // The running program itself, even if its file was replaced or deleted since (an upgrade
    // during a long job): argv[0] keeps its name for ps and the logs.
    static const char kSelf[] = "/proc/self/exe";
    std::fflush(nullptr);
    const pid_t parent = ::getpid();
    pid_t child = ::fork();
    if (child < 0) {
      *why = std::string("fork: ") + std::strerror(errno);
      return nullptr;
    }
    if (child == 0) {  // only async-signal-safe calls until exec
      // The signal comes when the thread that forked ends: the watcher's, which ends with the job
      // (JobWatcher::Finish, after the agent returned) or with this process. Either way the
      // controller is to go then, as ~ControllerProcess would tell it.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(1);
      ::execv(kSelf, cargv.data());
      ::execv(cargv[0], cargv.data());  // no /proc: the path it was started from
      ::_exit(127);
    }
    return std::unique_ptr<ControllerProcess>(new ControllerProcess(child));
  }
  ~ControllerProcess() override { Stop(); }
  pid_t pid() const override { return child_; }
  bool Ended() override { return Reap(false); }
  void Forward(int sig) override {
    if (!Ended()) ::kill(child_, sig);
  }
  void Stop() override {
    for (int i = 0; i < 100 && !Reap(false); ++i) {
      if (i == 0) ::kill(child_, SIGTERM);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!Reap(false)) {
      ::kill(child_, SIGKILL);
      Reap(true);
    }
  }
  bool separate() const override { return true; }

 private:
  explicit ControllerProcess(pid_t child) : child_(child) {}
  bool Reap(bool wait) {
    if (code_ >= 0) return true;
    int status = 0;
    if (::waitpid(child_, &status, wait ? 0 : WNOHANG) != child_) return false;
    code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  }
  const pid_t child_;
};

// --single-process: the controller on a thread of this process. It reads SIGINT and SIGTERM from a
// signalfd like the child does: sent to this process (every thread blocks them) or passed on to its
// thread (Forward). A SIGTERM ends its job within the runtime's own bounds.
class ControllerThread final : public LocalController {
 public:
  explicit ControllerThread(controller::RuntimeOptions c)
      : thread_([this, c = std::move(c)] {
          code_ = controller::RunController(c);
          ended_ = true;
        }) {}
  ~ControllerThread() override { Stop(); }
  pid_t pid() const override { return ::getpid(); }
  bool Ended() override { return ended_.load(); }
  void Forward(int sig) override {
    if (!ended_) ::pthread_kill(thread_.native_handle(), sig);  // valid until joined
  }
  void Stop() override {
    if (!thread_.joinable()) return;
    Forward(SIGTERM);
    thread_.join();
  }
  bool separate() const override { return false; }

 private:
  std::atomic<bool> ended_{false};
  std::thread thread_;  // last: started once the members it uses exist
};

int TakeSignal(const sigset_t& mask, int timeout_ms) {
  timespec ts{timeout_ms / 1000, (timeout_ms % 1000) * 1'000'000L};
  return ::sigtimedwait(&mask, nullptr, &ts);
}

struct JobAddress {
  std::string controller;  // the control port its agent dials
  std::string token;
};

// Waits (≤ 30 s) for the controller's job file: its address and the job's token (from the file the
// job file names). An exit code when
// the run ends first: on a signal (passed on; the controller is stopped), when the controller
// ended, or when no job file came.
std::optional<int> WaitForJobFile(LocalController& controller, const std::string& job_file,
                                  const sigset_t& mask, const std::string& name,
                                  JobAddress* address) {
  for (int i = 0; i < 600; ++i) {
    if (int sig = TakeSignal(mask, 0); sig > 0) {
      controller.Forward(sig);
      controller.Stop();
      return controller::kExitInterrupted;
    }
    // interrupted: a signal its thread took (--single-process), its lines say so
    if (controller.Ended()) {
      if (controller.exit_code() != controller::kExitInterrupted) {
        fmt::print(stderr, "{}: the controller exited (code {}) before the job started\n", name,
                   controller.exit_code());
      }
      return controller.exit_code() == 0 ? 1 : controller.exit_code();
    }
    // Only a private file of this user's (the controller writes it so): never one another user
    // planted in the job's directory.
    Result<std::string> text = ReadPrivateFile(job_file, "job file", 1 << 20);
    auto job = text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
    if (job.is_object() && job.value("pid", int64_t{-1}) == controller.pid() &&
        job.contains("controller") && job["controller"].is_string() && job.contains("token_file") &&
        job["token_file"].is_string()) {
      // The controller wrote the token's file before the job file.
      auto token = ReadJobTokenFile(job["token_file"].get<std::string>());
      if (!token.ok()) {
        fmt::print(stderr, "{}: {}\n", name, token.status().message());
        controller.Stop();
        return 1;
      }
      address->controller = job["controller"].get<std::string>();
      address->token = *token;
      return std::nullopt;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  fmt::print(stderr, "{}: the controller did not start within 30 s (no job file at {})\n", name,
             job_file);
  controller.Stop();
  return 1;
}

// While the agent runs. A SIGINT or SIGTERM goes to the controller, which ends the job: the agent
// follows its shutdown, or is stopped 20 s later (at once if the controller is gone). A controller
// that ends before the job formed ends the run with its code (failed_start). One that ends later:
// a thread has ended the job, and an agent still running is stopped (nothing will lead it again);
// a child process that died (not on a signal to this run, and without ending the job) is started
// again at once with `--resume` from the journal, the workers training on meanwhile
// (docs/controller-failover.md). Each restart is journaled ("controller_restart"). After
// kMaxQuickRestarts deaths in a row, each within kQuickDeath of its start, the next restarts wait
// 1, 2, 4, 8 and 16 s; after those the run stops restarting and prints the command that would.
class JobWatcher {
 public:
  static constexpr int kMaxQuickRestarts = 5;
  static constexpr Millis kQuickDeath{60'000};

  // `controller` is the watcher's until Finish(); `resume` (empty: none) restarts a dead one.
  JobWatcher(std::unique_ptr<LocalController>& controller, agent::Agent* agent,
             const sigset_t& mask, std::string journal, launcher::OutputWriter* err,
             std::vector<std::string> resume)
      : controller_(controller),
        agent_(agent),
        mask_(mask),
        journal_(std::move(journal)),
        err_(err),
        resume_(std::move(resume)),
        thread_([this] { Run(); }) {}
  ~JobWatcher() { Finish(); }
  // Once the agent has returned: stops watching; the code of a controller that ended before the job
  // formed.
  std::optional<int> Finish() {
    done_ = true;
    if (thread_.joinable()) thread_.join();
    return failed_start_;
  }

 private:
  void Run() {
    std::optional<Deadline> stop_at;
    bool seen_end = false;
    bool signalled = false;  // the job is ending on a signal: the controller's exit is expected
    while (!done_) {
      int sig = TakeSignal(mask_, 100);
      bool ended = controller_->Ended();
      if (sig > 0) {
        signalled = true;
        restart_at_.reset();
        controller_->Forward(sig);
        stop_at = ended ? Clock::now() : DeadlineAfter(Millis(20'000));
      }
      if (stop_at && Clock::now() >= *stop_at) {
        agent_->Stop();
        stop_at.reset();
      }
      if (ended && !seen_end) {
        seen_end = true;
        ControllerEnded(signalled);
      }
      if (restart_at_ && Clock::now() >= *restart_at_ && Restart()) seen_end = false;
    }
  }
  void ControllerEnded(bool signalled) {
    bool torn = false;  // a controller killed mid-line leaves a torn last line: not a failed start
    auto records = controller::Journal::Read(journal_, &torn);
    // a controller that ended the job (job_end) did not die
    bool formed = false, job_ended = false;
    if (records.ok()) {
      for (const auto& r : *records) {
        formed = formed || r.value("event", "") == "plan";
        job_ended = job_ended || r.value("event", "") == "job_end";
      }
    }
    // Ended with code 0 before forming: every worker ran a script that never joined (torchrun's).
    if (!formed && !(job_ended && controller_->exit_code() == 0)) {
      failed_start_ = controller_->exit_code();
      agent_->Stop();
    } else if (!controller_->separate()) {
      agent_->Stop();
    } else if (!signalled && !job_ended) {
      // Whatever its exit code: a controller that leaves a formed job without its end died.
      ScheduleRestart();
    }
  }
  // After a death: at once, unless the controllers die quickly one after another.
  // `why`: what happened (empty: the controller now running died).
  void ScheduleRestart(std::string why = "") {
    const bool quick = Clock::now() - started_ < kQuickDeath;
    quick_deaths_ = quick ? quick_deaths_ + 1 : 1;
    const std::string died = why.empty() ? fmt::format("the controller (pid {}) died ({})",
                                                       controller_->pid(), controller_->exit_code())
                                         : std::move(why);
    if (resume_.empty() || quick_deaths_ > 2 * kMaxQuickRestarts) {
      err_->Write(fmt::format(
          "[nonstop] {}: the workers train on; {}to adopt them: {}\n", died,
          resume_.empty() ? "" : fmt::format("{} restarts in a row failed; ", quick_deaths_ - 1),
          ShellCommand(resume_)));
      return;
    }
    Millis wait{0};
    if (quick_deaths_ > kMaxQuickRestarts)
      wait = Millis(1000 << (quick_deaths_ - kMaxQuickRestarts - 1));
    err_->Write(fmt::format(
        "[nonstop] {}: the workers train on; restarting it {}\n", died,
        wait.count() == 0 ? std::string("now") : fmt::format("in {} ms", wait.count())));
    restart_at_ = DeadlineAfter(wait);
    restart_wait_ = wait;
  }
  // Journals the restart, then starts `nonstop controller --resume`. Whether it started.
  bool Restart() {
    restart_at_.reset();
    ++restarts_;
    {  // closed (and its lock released) before the new controller opens it
      auto journal = controller::Journal::OpenForAppend(journal_);
      if (journal.ok()) {
        (*journal)->Append({{"event", "controller_restart"},
                            {"restart", restarts_},
                            {"previous_pid", controller_->pid()},
                            {"previous_exit_code", controller_->exit_code()},
                            {"waited_ms", restart_wait_.count()}});
        (*journal)->Flush();
      } else {
        err_->Write(fmt::format("[nonstop] the restart is not journaled: {}\n",
                                journal.status().ToString()));
      }
    }
    std::string why;
    std::unique_ptr<LocalController> next = ControllerProcess::Exec(resume_, &why);
    if (next == nullptr) {
      started_ = Clock::now();  // a restart that could not start counts as a quick death
      ScheduleRestart("the controller could not be restarted: " + why);
      return false;
    }
    err_->Write(fmt::format("[nonstop] restarted the controller as pid {} (restart {}): {}\n",
                            next->pid(), restarts_, ShellCommand(resume_)));
    controller_ = std::move(next);
    started_ = Clock::now();
    return true;
  }

  std::unique_ptr<LocalController>& controller_;
  agent::Agent* const agent_;
  const sigset_t mask_;
  const std::string journal_;
  launcher::OutputWriter* const err_;
  const std::vector<std::string> resume_;
  // The restarts (the watcher thread's).
  Deadline started_ = Clock::now();  // of the controller now running
  std::optional<Deadline> restart_at_;
  Millis restart_wait_{0};
  int quick_deaths_ = 0;  // in a row, each within kQuickDeath of its start
  int restarts_ = 0;
  std::atomic<bool> done_{false};
  std::optional<int> failed_start_;  // the watcher's until Finish() joins it
  std::thread thread_;               // last: started once the members it uses exist
};

}  // namespace

// The agent of this machine (host `local`): elastic, so the controller starts here whatever the job
// needs, as on one machine; it prints through this process's bounded stdio, and leaves the signals
// to the watcher (JobWatcher).
agent::AgentOptions RunCommand::LocalAgentOptions(const std::string& controller,
                                                  const std::string& token,
                                                  const std::vector<std::string>& program,
                                                  const std::string& log_dir,
                                                  launcher::BoundedStdio& stdio) const {
  agent::AgentOptions a;
  a.controller = controller;
  a.job_token = token;
  a.host_id = "local";
  a.nproc = nproc_;
  a.spares = spares_;
  a.advertise_address = host_;
  a.data_ports = data_ports_;
  a.program = program;
  a.run_as = run_as_;
  a.elastic = true;
  a.log_dir = log_dir;
  a.handle_signals = false;
  a.out = &stdio.out();
  a.err = &stdio.err();
  return a;
}

// Both modes alike: the controller starts (a child process, or a thread with --single-process), its
// job file gives the address and the token, and this process's agent runs the workers until the
// controller's shutdown, under a JobWatcher. The job's exit code is the agent's: the one the
// controller's shutdown names (or the controller's own, if it ended before the job formed).
int RunCommand::RunLocal(controller::RuntimeOptions o, const std::vector<std::string>& program,
                         const std::string& log_dir) {
  std::filesystem::path journal(o.journal);
  std::filesystem::path dir =
      journal.has_parent_path() ? journal.parent_path() : std::filesystem::path(".");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string job_file = controller::JobFileFor(o.journal);
  std::filesystem::remove(job_file, ec);  // the one the controller writes now is this job's
  const std::string token_file = (dir / "job.token").string();
  o.name = "nonstop run";
  o.core.min_hosts = o.core.max_hosts = 1;    // this process's agent
  if (resumable_) o.token_file = token_file;  // what `nonstop controller --resume` needs
  // SIGINT and SIGTERM are blocked before any thread or child starts: the controller reads its own
  // from a signalfd, the watcher passes on those sent to this process, and none is lost in between.
  const sigset_t mask = BlockTerminationSignals();
  std::optional<launcher::BoundedStdio> stdio;
  // after stdio: a thread that prints through it ends first
  std::unique_ptr<LocalController> controller;
  if (resumable_) {
    controller = ControllerProcess::Start(o);
    if (controller == nullptr) return 1;
    stdio.emplace();  // after the fork: the child prints through writers of its own
  } else {
    o.stdio = &stdio.emplace();  // one stdout and one log sink for the controller and the agent
    controller = std::make_unique<ControllerThread>(o);
  }
  JobAddress address;
  if (auto code = WaitForJobFile(*controller, job_file, mask, o.name, &address)) return *code;
  agent::AgentOptions a =
      LocalAgentOptions(address.controller, address.token, program, log_dir, *stdio);
  if (Status st = agent::ValidateOptions(a); !st.ok()) {
    fmt::print(stderr, "{}: {}\n", o.name, st.message());
    controller->Stop();
    return controller::kExitUsage;
  }
  std::vector<std::string> resume;
  if (resumable_) {
    resume = ResumeArguments(o.journal, token_file);
    stdio->out().Write(
        fmt::format("[nonstop] resumable: the controller runs as pid {}; the workers are this "
                    "process's ({}); if the controller dies, this process starts it again: {}\n",
                    controller->pid(), ::getpid(), ShellCommand(resume)));
  }
  if (spares_ > 0 && !launcher::LocalLauncher::CanRestorePriority()) {
    stdio->out().Write(
        "[nonstop] spares that refill the pool warm up at normal priority: this user cannot raise "
        "a "
        "process's priority back when it takes a rank (that needs CAP_SYS_NICE or `ulimit -e "
        "20`)\n");
  }
  agent::Agent agent(a);
  JobWatcher watcher(controller, &agent, mask, o.journal, &stdio->err(), resume);
  int code = agent.Run();
  std::optional<int> failed_start = watcher.Finish();
  // The controller (the last one started) leaves once the agent has; one that does not is stopped.
  for (int i = 0; i < 400 && !controller->Ended(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // The agent ends with the code the job's end told it; a member whose script failed after that
  // (Controller::ExitedAfterTheEnd) changed the controller's.
  if (code == 0 && controller->Ended() && controller->exit_code() != 0)
    code = controller->exit_code();
  controller->Stop();
  if (failed_start) {
    fmt::print(stderr, "{}: the controller exited (code {}) before the job formed\n", o.name,
               *failed_start);
    return *failed_start == 0 ? 1 : *failed_start;
  }
  return code;
}

void ControllerCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand(
      "controller",
      "Run the controller of a job over several hosts; each host runs `nonstop agent`");
  AddSetting(sub_, settings::kListen, listen_);
  AddSetting(sub_, settings::kControllerAdvertiseAddress, advertise_address_);
  AddSetting(sub_, settings::kNnodes, nnodes_);
  AddSetting(sub_, settings::kControllerJobTokenFile, token_file_);
  sub_->add_option("--resume", resume_,
                   "Take over the running job of this journal (its controller stopped): adopt the "
                   "workers and agents "
                   "it recorded, on the control port it recorded (unless --listen names one), and "
                   "go on appending "
                   "to it; the same --nnodes and --job-token-file as the first controller")
      ->check(CLI::ExistingFile);
  AddSetting(sub_, settings::kControllerEtcd, etcd_);
  AddSetting(sub_, settings::kEtcdJob, job_);
  etcd_security_.Register(sub_);
  AddSetting(sub_, settings::kLeaseTtlS, lease_ttl_s_);
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
      if (used != (colon == std::string::npos ? nnodes_.size() : colon))
        throw std::invalid_argument(nnodes_);
      if (colon != std::string::npos) {
        max_hosts = std::stoi(nnodes_.substr(colon + 1), &used);
        if (used != nnodes_.size() - colon - 1) throw std::invalid_argument(nnodes_);
      }
    } catch (...) {
      fmt::print(stderr, "{}: --nnodes '{}' is not MIN or MIN:MAX (e.g. 4 or 2:8)\n", name,
                 nnodes_);
      return controller::kExitUsage;
    }
    if (min_hosts < 1 || (max_hosts != 0 && max_hosts < min_hosts) || min_hosts > 100'000 ||
        max_hosts > 100'000) {
      fmt::print(stderr, "{}: --nnodes '{}': MIN must be at least 1 and MAX at least MIN\n", name,
                 nnodes_);
      return controller::kExitUsage;
    }
  }
  o.core.min_hosts = min_hosts;
  o.core.max_hosts = max_hosts;
  // An existing token file keeps its token (agents may already have read
  // it), read exactly as the agents read it; one that is not safe to read
  // (a symlink, another user's, readable by others) is refused, not replaced.
  auto token = ReadJobTokenFile(token_file_);
  if (token.ok()) {
    o.token = *token;
  } else if (token.status().code() == StatusCode::kFailedPrecondition) {
    fmt::print(stderr, "{}: --job-token-file: {}\n", name, token.status().message());
    return controller::kExitUsage;
  }
  o.token_file = token_file_;
  if (!resume_.empty()) {
    if (!token.ok()) {
      fmt::print(stderr, "{}: --resume needs the job's token: {}\n", name,
                 token.status().message());
      return controller::kExitUsage;
    }
    o.resume = resume_;
    o.journal = resume_;
  }
  if (etcd_.empty()) return controller::RunController(o);
  if (!resume_.empty()) {
    fmt::print(stderr,
               "{}: --resume and --etcd: with etcd, the journal to take over is etcd's (leave out "
               "--resume)\n",
               name);
    return controller::kExitUsage;
  }
  return LeadThroughEtcd(name, o);
}

}  // namespace nonstop::cli
