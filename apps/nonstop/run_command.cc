// `nonstop run`: the controller and a local launcher in one process, on one
// event loop. It starts --nproc workers and --spares spares, forms generation
// 1, forwards every worker's output with a rank prefix, watches heartbeats
// and process exits, carries out the controller's recoveries (abort, kill,
// start a new spare), writes the journal, prints the recovery report, and
// exits with a code that means something to a supervisor (0 ok, 2 usage, 10
// the job could not continue after a worker failed, 11 data corruption).
//
// With no program, it runs the built-in demonstration: nonstop-train on its
// default recipe, with one fault injected (kill:rank=2,step=30) unless
// --inject says otherwise.
#include <fcntl.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cstdio>
#include <deque>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include <fmt/format.h>

#include "apps/nonstop/commands.h"
#include "apps/nonstop/http_api.h"
#include "common/logging.h"
#include "controller/control_server.h"
#include "control/fault_spec.h"
#include "controller/controller.h"
#include "controller/journal.h"
#include "launcher/local_launcher.h"
#include "launcher/output_writer.h"
#include "net/event_loop.h"

namespace nonstop::cli {

using controller::Action;
using controller::Event;

std::string SelfDirectory() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

namespace {

std::string RandomToken() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

}  // namespace

void RunCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand("run", "Run a training job on this machine: controller + local workers (like torchrun)");
  sub_->add_option("--nproc", nproc_, "Worker processes that train (the world size)")->capture_default_str()
      ->envname("NONSTOP_NPROC")->check(CLI::Range(1, 1024));
  sub_->add_option("--spares", spares_, "Pre-warmed spare workers that wait without a rank")->capture_default_str()
      ->envname("NONSTOP_SPARES")->check(CLI::Range(0, 1024));
  sub_->add_option("--host", host_, "Address the controller and the workers listen on")->capture_default_str()
      ->envname("NONSTOP_HOST");
  sub_->add_option("--port", port_, "Controller port (0: chosen by the OS)")->capture_default_str()
      ->envname("NONSTOP_PORT")->check(CLI::Range(0, 65535));
  sub_->add_option("--journal", journal_, "Event journal (JSON lines)")->capture_default_str()
      ->envname("NONSTOP_JOURNAL");
  sub_->add_option("--heartbeat-timeout-ms", heartbeat_timeout_ms_,
                   "A worker silent this long is declared failed")->capture_default_str()
      ->envname("NONSTOP_HEARTBEAT_TIMEOUT_MS")->check(CLI::Range(100, 3'600'000));
  sub_->add_option("--abort-timeout-ms", abort_timeout_ms_,
                   "Members that have not aborted this long after a fault are killed and replaced")
      ->capture_default_str()->envname("NONSTOP_ABORT_TIMEOUT_MS")->check(CLI::Range(100, 3'600'000));
  sub_->add_option("--hang-floor-ms", hang_floor_ms_,
                   "Hang detector: a member is hung when it reaches a step's collective this long (at least) after "
                   "the first member did")
      ->capture_default_str()->envname("NONSTOP_HANG_FLOOR_MS")->check(CLI::Range(50, 3'600'000));
  sub_->add_option("--hang-factor", hang_factor_,
                   "Hang detector: … and this many times the recent spread between first and last arrival")
      ->capture_default_str()->envname("NONSTOP_HANG_FACTOR")->check(CLI::Range(1.0, 1000.0));
  sub_->add_option("--refill-nice", refill_nice_,
                   "Niceness at which spares that refill the pool warm up while the job trains (0: normal priority; "
                   "used only where the priority can be raised back when the spare takes a rank)")
      ->capture_default_str()->envname("NONSTOP_REFILL_NICE")->check(CLI::Range(0, 19));
  sub_->add_option("--join-timeout-ms", join_timeout_ms_,
                   "The job must form within this long of its start, and a spare started later must join within it "
                   "(else it is killed and replaced)")
      ->capture_default_str()->envname("NONSTOP_JOIN_TIMEOUT_MS")->check(CLI::Range(1'000, 86'400'000));
  sub_->add_option("--inject", inject_,
                   "Faults to inject, e.g. kill:rank=2,step=30 or hang:rank=1,time=5 (kinds: kill, hang, exception, "
                   "drop, corrupt; see docs/faults.md); 'none' for no fault")
      ->expected(1)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)->envname("NONSTOP_INJECT");
  sub_->add_option("--recovery", recovery_,
                   "checkpointless (in-process recovery, spares, peer state transfer) or checkpoint (the "
                   "checkpoint-restart baseline: on a fault restart every worker from the newest checkpoint)")
      ->capture_default_str()->envname("NONSTOP_RECOVERY")->check(CLI::IsMember({"checkpointless", "checkpoint"}));
  sub_->add_option("--checkpoint-dir", checkpoint_dir_,
                   "Durable checkpoints go here (passed to workers as NONSTOP_CHECKPOINT_DIR); also the last rung of "
                   "checkpointless recovery")
      ->envname("NONSTOP_CHECKPOINT_DIR");
  sub_->add_option("--checkpoint-every", checkpoint_every_,
                   "Steps between checkpoints (0: the Young/Daly optimum for --mtbf, measured by the trainer)")
      ->capture_default_str()->envname("NONSTOP_CHECKPOINT_EVERY")->check(CLI::Range(0, 1'000'000));
  sub_->add_option("--mtbf", mtbf_seconds_, "Mean time between failures assumed for the checkpoint interval (seconds)")
      ->capture_default_str()->envname("NONSTOP_MTBF_SECONDS")->check(CLI::Range(0.0, 1e9));
  sub_->add_option("--http-host", http_host_, "Address of the HTTP endpoint (/status /metrics /events /scale)")
      ->capture_default_str()->envname("NONSTOP_HTTP_HOST");
  sub_->add_option("--http-port", http_port_, "Port of the HTTP endpoint (0: chosen by the OS)")
      ->capture_default_str()->envname("NONSTOP_HTTP_PORT")->check(CLI::Range(0, 65535));
  sub_->add_option("--min-world", min_world_, "Elastic policy: the smallest world size")->capture_default_str()
      ->envname("NONSTOP_MIN_WORLD")->check(CLI::Range(1, 1024));
  sub_->add_option("--max-world", max_world_, "Elastic policy: the largest world size (0: --nproc)")
      ->capture_default_str()->envname("NONSTOP_MAX_WORLD")->check(CLI::Range(0, 1024));
  sub_->add_option("--allowed-sizes", allowed_sizes_, "Elastic policy: the only world sizes allowed, e.g. 2,4,8")
      ->delimiter(',')->envname("NONSTOP_ALLOWED_SIZES");
  sub_->add_option("--world-increment", world_increment_, "Elastic policy: sizes are min-world + k × this")
      ->capture_default_str()->envname("NONSTOP_WORLD_INCREMENT")->check(CLI::Range(1, 1024));
  sub_->add_option("--stable-period-ms", stable_period_ms_,
                   "Elastic policy: the least time between two changes (doubles when changes come too often)")
      ->capture_default_str()->envname("NONSTOP_STABLE_PERIOD_MS")->check(CLI::Range(0, 86'400'000));
  sub_->add_option("--log-level", log_level_, "debug, info, warning or error")->capture_default_str()
      ->envname("NONSTOP_LOG_LEVEL");
  sub_->footer("After `--`: the worker program and its arguments. Without one, the built-in demonstration runs: "
               "nonstop-train on its llama-tiny recipe with --inject kill:rank=2,step=30.");
}

int RunCommand::Execute() {
  SetLogRole("nonstop");
  LogLevel level;
  if (!ParseLogLevel(log_level_, &level)) {
    fmt::print(stderr, "nonstop run: --log-level '{}' is not one of debug, info, warning, error\n", log_level_);
    return controller::kExitUsage;
  }
  SetLogLevel(level);
  std::vector<std::string> program = program_;
  std::vector<std::string> inject = inject_;
  if (program.empty()) {
    program = {SelfDirectory() + "/nonstop-train"};
    if (inject.empty()) inject = {"kill:rank=2,step=30"};  // the demonstration's fault
  }
  std::vector<control::FaultSpec> faults;
  for (const auto& text : inject) {
    if (text == "none") continue;
    auto parsed = control::ParseFaults(text, static_cast<int>(faults.size()));
    if (!parsed.ok()) {
      fmt::print(stderr, "nonstop run: --inject: {}\n", parsed.status().message());
      return controller::kExitUsage;
    }
    for (auto& f : *parsed) {
      if (f.rank >= nproc_) {
        fmt::print(stderr, "nonstop run: --inject {}: there is no rank {} with --nproc {}\n", control::FormatFault(f),
                   f.rank, nproc_);
        return controller::kExitUsage;
      }
      faults.push_back(f);
    }
  }

  auto journal = controller::Journal::Open(journal_);
  if (!journal.ok()) {
    fmt::print(stderr, "nonstop run: {}\n", journal.status().ToString());
    return 1;
  }

  // SIGINT/SIGTERM end the job cleanly through the loop; SIGPIPE is ignored (sockets say EPIPE).
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  ::sigprocmask(SIG_BLOCK, &mask, nullptr);
  UniqueFd sigfd(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));

  net::EventLoop loop;
  std::deque<Event> events;
  if (recovery_ == "checkpoint" && checkpoint_dir_.empty()) {
    fmt::print(stderr, "nonstop run: --recovery checkpoint needs --checkpoint-dir (where the checkpoints go)\n");
    return controller::kExitUsage;
  }
  controller::ControllerOptions copts;
  copts.recovery = recovery_ == "checkpoint" ? controller::RecoveryMode::kCheckpointRestart
                                             : controller::RecoveryMode::kCheckpointless;
  copts.have_checkpoints = !checkpoint_dir_.empty();
  copts.policy.min_world = min_world_;
  copts.policy.max_world = max_world_;
  copts.policy.allowed_sizes = allowed_sizes_;
  copts.policy.increment = world_increment_;
  copts.policy.stable_period = Millis(stable_period_ms_);
  if (max_world_ > 0 && max_world_ < nproc_) {
    fmt::print(stderr, "nonstop run: --max-world {} is below --nproc {}\n", max_world_, nproc_);
    return controller::kExitUsage;
  }
  if (min_world_ > nproc_) {
    fmt::print(stderr, "nonstop run: --min-world {} is above --nproc {}\n", min_world_, nproc_);
    return controller::kExitUsage;
  }
  copts.world_size = nproc_;
  copts.spares = spares_;
  copts.heartbeat_timeout = Millis(heartbeat_timeout_ms_);
  copts.abort_timeout = Millis(abort_timeout_ms_);
  copts.forming_timeout = Millis(join_timeout_ms_);
  copts.hang_floor = Millis(hang_floor_ms_);
  copts.hang_factor = hang_factor_;
  copts.join_timeout = Millis(join_timeout_ms_);
  copts.faults = faults;
  controller::Controller core(copts);
  const std::string token = RandomToken();
  auto server = controller::ControlServer::Create(&loop, {host_, static_cast<uint16_t>(port_)}, token,
                                                  [&](Event e) { events.push_back(std::move(e)); });
  if (!server.ok()) {
    fmt::print(stderr, "nonstop run: cannot start the controller: {}\n", server.status().ToString());
    return 1;
  }
  auto http = HttpApi::Start(http_host_, http_port_, (*journal)->path(), token);
  if (!http.ok()) {
    fmt::print(stderr, "nonstop run: {}\n", http.status().ToString());
    return 1;
  }
  std::map<int, std::unique_ptr<ScaleCall>> scale_calls;
  loop.Watch((*http)->wake_fd(), POLLIN, [&](short) {
    for (auto& call : (*http)->TakeCalls()) {
      events.push_back(controller::ScaleRequest{call->id, call->body, call->source});
      scale_calls[call->id] = std::move(call);
    }
  });
  {
    // The job file: how `nonstop status`, `nonstop scale` and `nonstop worker` find this job.
    nlohmann::json job = {{"controller", (*server)->address().ToString()}, {"http", (*http)->address()},
                          {"token", token}, {"journal", (*journal)->path()}, {"pid", ::getpid()},
                          {"env", nlohmann::json::object()}};
    if (!checkpoint_dir_.empty()) {
      job["env"] = {{"NONSTOP_CHECKPOINT_DIR", checkpoint_dir_}, {"NONSTOP_CHECKPOINT_EVERY", std::to_string(checkpoint_every_)}};
    }
    std::string path = JobFileFor((*journal)->path());
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) {
      std::string text = job.dump(2) + "\n";
      ssize_t w = ::write(fd, text.data(), text.size());
      (void)w;
      ::close(fd);
    }
  }
  // Everything this loop prints goes through bounded writers: a reader of our
  // output that does not keep up loses lines (counted), never stalls the job.
  launcher::OutputWriter out(STDOUT_FILENO);
  launcher::OutputWriter err(STDERR_FILENO);
  // Log lines too (control-port refusals, lost workers): never a blocking
  // write from the loop. The guard restores stderr before `err` goes away.
  SetLogSink([&err](std::string_view line) { err.Write(line); });
  struct LogSinkGuard {
    ~LogSinkGuard() { SetLogSink(nullptr); }
  } log_sink_guard;
  launcher::LocalLauncher launcher(
      &loop,
      [&](int worker_id) {
        int rank = core.RankOf(worker_id);
        return rank >= 0 ? fmt::format("[rank {}] ", rank) : fmt::format("[worker {}] ", worker_id);
      },
      [&](int worker_id, pid_t pid, int code, int sig) {
        events.push_back(controller::ProcessExited{worker_id, pid, code, sig});
      },
      [&](int worker_id, pid_t pid, int sig) { events.push_back(controller::ProcessStopped{worker_id, pid, sig}); },
      &out, &err);

  fmt::print("nonstop run\n");
  fmt::print("  {:<20} {}\n", "controller", (*server)->address().ToString());
  fmt::print("  {:<20} {}\n", "http", (*http)->address());
  fmt::print("  {:<20} {}\n", "workers", nproc_);
  fmt::print("  {:<20} {}\n", "spares", spares_);
  fmt::print("  {:<20} {} ms\n", "heartbeat timeout", heartbeat_timeout_ms_);
  fmt::print("  {:<20} {} ms\n", "abort timeout", abort_timeout_ms_);
  fmt::print("  {:<20} {}\n", "recovery", recovery_);
  fmt::print("  {:<20} {}\n", "elastic policy", core.PolicyJson().dump());
  fmt::print("  {:<20} {}\n", "checkpoints",
             checkpoint_dir_.empty() ? std::string("none")
                                     : fmt::format("{} (every {})", checkpoint_dir_,
                                                   checkpoint_every_ > 0 ? std::to_string(checkpoint_every_) + " steps"
                                                                         : fmt::format("Young/Daly, MTBF {} s", mtbf_seconds_)));
  std::string fault_text;
  for (const auto& f : faults) fault_text += (fault_text.empty() ? "" : "; ") + control::FormatFault(f);
  fmt::print("  {:<20} {}\n", "injected faults", fault_text.empty() ? "none" : fault_text);
  fmt::print("  {:<20} {}{}\n", "journal", (*journal)->path(),
             (*journal)->rotated_to().empty() ? "" : " (the previous one was kept as " + (*journal)->rotated_to() + ")");
  std::string cmdline;
  for (const auto& a : program) cmdline += (cmdline.empty() ? "" : " ") + a;
  fmt::print("  {:<20} {}\n", "program", cmdline);
  std::fflush(stdout);
  (*journal)->Append({{"event", "job_start"}, {"world_size", nproc_}, {"spares", spares_},
                      {"controller", (*server)->address().ToString()}, {"http", (*http)->address()},
                      {"program", program}, {"policy", core.PolicyJson()}});

  std::set<int> niced;  // spares still at low priority
  // A refill warms up at a low priority only if it can be given normal
  // priority back when it takes a rank: an ordinary user cannot raise a
  // priority (CAP_SYS_NICE), and a worker stuck at nice 10 would be a
  // straggler for the rest of the job.
  const bool low_priority_refills = launcher::LocalLauncher::CanRestorePriority();
  if (!low_priority_refills && spares_ > 0) {
    out.Write("[nonstop] spares that refill the pool warm up at normal priority: this user cannot raise a process's "
              "priority back when it takes a rank (that needs CAP_SYS_NICE or `ulimit -e 20`)\n");
  }
  auto spawn = [&](int id, bool spare, bool resume, bool background) -> Status {
    launcher::ChildSpec spec;
    spec.worker_id = id;
    spec.argv = program;
    spec.env = {{"NONSTOP_CONTROLLER", (*server)->address().ToString()},
                {"NONSTOP_JOB_TOKEN", token},
                {"NONSTOP_WORKER_ID", std::to_string(id)},
                {"NONSTOP_SPARE", spare ? "1" : "0"},
                {"NONSTOP_DATA_HOST", host_}};
    if (!checkpoint_dir_.empty()) {
      spec.env.push_back({"NONSTOP_CHECKPOINT_DIR", checkpoint_dir_});
      spec.env.push_back({"NONSTOP_CHECKPOINT_EVERY", std::to_string(checkpoint_every_)});
      spec.env.push_back({"NONSTOP_MTBF_SECONDS", fmt::format("{}", mtbf_seconds_)});
    }
    if (resume) spec.env.push_back({"NONSTOP_RESUME", "1"});
    // A spare started in the background (refilling the pool while the job
    // trains) warms up at a low priority, so that it does not slow the job's
    // steps; it gets normal priority when it takes a rank.
    if (background && low_priority_refills && refill_nice_ > 0) {
      spec.nice = refill_nice_;
      niced.insert(id);
    }
    auto pid = launcher.Spawn(spec);
    if (!pid.ok()) return pid.status().WithContext(fmt::format("starting worker {}", id));
    (*journal)->Append({{"event", "spawn"}, {"worker_id", id}, {"pid", *pid}, {"spare", spare}, {"resume", resume}});
    return OkStatus();
  };
  for (int id = 0; id < nproc_ + spares_; ++id) {
    Status s = spawn(id, id >= nproc_, /*resume=*/false, /*background=*/false);
    if (!s.ok()) {
      fmt::print(stderr, "nonstop run: {}\n", s.ToString());
      launcher.SignalAll(SIGKILL);
      return 1;
    }
  }

  std::optional<controller::EndJob> ended;
  Deadline kill_at = kNoDeadline;
  bool interrupted = false;
  if (sigfd.valid()) {
    loop.Watch(sigfd.get(), POLLIN, [&](short) {
      signalfd_siginfo si;
      while (::read(sigfd.get(), &si, sizeof(si)) == sizeof(si)) interrupted = true;
    });
  }

  auto execute = [&](const Action& a) {
    std::visit(
        [&](const auto& act) {
          using T = std::decay_t<decltype(act)>;
          if constexpr (std::is_same_v<T, controller::SendPlan>) {
            if (niced.erase(act.worker_id) > 0) {
              Status s = launcher.Renice(act.worker_id, 0);
              if (!s.ok()) NONSTOP_LOG_WARNING("promoted spare keeps its low priority: {}", s.ToString());
            }
            (*server)->Send(act.worker_id, control::kMsgPlan, control::Encode(act.plan));
          } else if constexpr (std::is_same_v<T, controller::SendShutdown>) {
            (*server)->Send(act.worker_id, control::kMsgShutdown, control::Encode(act.msg));
          } else if constexpr (std::is_same_v<T, controller::SendAbort>) {
            (*server)->Send(act.worker_id, control::kMsgAbort, control::Encode(act.msg));
          } else if constexpr (std::is_same_v<T, controller::SendDrain>) {
            (*server)->Send(act.worker_id, control::kMsgDrain, control::Encode(act.msg));
          } else if constexpr (std::is_same_v<T, controller::ScaleReply>) {
            if (auto it = scale_calls.find(act.request_id); it != scale_calls.end()) {
              it->second->reply.set_value({act.http_status, act.body});
              scale_calls.erase(it);
            }
          } else if constexpr (std::is_same_v<T, controller::KillWorker>) {
            launcher.Signal(act.worker_id, SIGKILL);
          } else if constexpr (std::is_same_v<T, controller::SignalWorker>) {
            launcher.Signal(act.worker_id, act.signal);
          } else if constexpr (std::is_same_v<T, controller::SpawnWorker>) {
            if (!ended) {
              Status s = spawn(act.worker_id, act.spare, act.resume, act.background);
              if (!s.ok()) err.Write(fmt::format("[nonstop] {}\n", s.ToString()));
            }
          } else if constexpr (std::is_same_v<T, controller::AppendJournal>) {
            (*journal)->Append(act.record);
          } else if constexpr (std::is_same_v<T, controller::PrintLine>) {
            out.Write(fmt::format("[nonstop] {}\n", act.line));
          } else if constexpr (std::is_same_v<T, controller::EndJob>) {
            if (ended) return;  // the first end stands
            ended = act;
            if (kill_at == kNoDeadline) kill_at = DeadlineAfter(Millis(act.exit_code == 0 ? 15'000 : 500));
          }
        },
        a);
  };

  Deadline next_tick = Clock::now();
  Deadline next_ping = Clock::now();
  while (true) {
    loop.RunOnce(Millis(20));
    while (!events.empty()) {
      Event e = std::move(events.front());
      events.pop_front();
      for (const Action& a : core.Handle(e, Clock::now())) execute(a);
    }
    {
      nlohmann::json st = core.Status();
      std::string metrics = fmt::format(
          "# TYPE nonstop_generation gauge\nnonstop_generation {}\n"
          "# TYPE nonstop_world_size gauge\nnonstop_world_size {}\n"
          "# TYPE nonstop_target_world_size gauge\nnonstop_target_world_size {}\n"
          "# TYPE nonstop_spares gauge\nnonstop_spares {}\n"
          "# TYPE nonstop_highest_step gauge\nnonstop_highest_step {}\n"
          "# TYPE nonstop_membership_changes_total counter\nnonstop_membership_changes_total {}\n",
          st["generation"].get<uint32_t>(), st["world_size"].get<size_t>(), st["target_world_size"].get<int>(),
          st["spares"].get<int>(), st["highest_step"].get<int64_t>(), st["recoveries"].get<size_t>());
      (*http)->Publish(std::move(st), std::move(metrics));
    }
    if (interrupted && !ended) {
      interrupted = false;
      for (const Action& a : core.Handle(controller::Interrupted{"a signal (SIGINT or SIGTERM)"}, Clock::now())) execute(a);
    }
    if (Clock::now() >= next_tick) {
      launcher.PollStopped();  // frozen processes, seen within one tick
      (*server)->CheckTimers(Clock::now());
      while (!events.empty()) {
        Event e = std::move(events.front());
        events.pop_front();
        for (const Action& a : core.Handle(e, Clock::now())) execute(a);
      }
      for (const Action& a : core.Handle(controller::Tick{}, Clock::now())) execute(a);
      next_tick = DeadlineAfter(Millis(50));
    }
    if (Clock::now() >= next_ping) {
      // Heartbeats the other way: a worker that hears nothing for a while has
      // lost its controller; one that hears pings waits as long as the job runs.
      for (const auto& [id, w] : core.workers()) {
        if (w.role != controller::WorkerRole::kGone) (*server)->Send(id, control::kMsgPing, "{}");
      }
      next_ping = DeadlineAfter(Millis(500));
    }
    if (ended && launcher.running() == 0) break;
    if (ended && Clock::now() >= kill_at) {
      launcher.SignalAll(SIGKILL);
      kill_at = DeadlineAfter(Millis(1000));
    }
  }

  int code = ended->exit_code;
  out.Write(fmt::format("[nonstop] job {}: {}\n", code == 0 ? "finished" : "FAILED", ended->reason));
  out.Write(fmt::format("[nonstop] journal: {}\n", (*journal)->path()));
  return code;
}

}  // namespace nonstop::cli
