#include "controller/runtime.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "common/logging.h"
#include "common/signals.h"
#include "common/unique_fd.h"
#include "control/fault_spec.h"
#include "controller/control_server.h"
#include "controller/http_api.h"
#include "controller/job_metrics.h"
#include "controller/journal.h"
#include "controller/progress_line.h"
#include "controller/takeover.h"
#include "launcher/local_launcher.h"
#include "launcher/output_writer.h"
#include "net/event_loop.h"

namespace nonstop::controller {

namespace {

std::string RandomToken() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

// Writes `text` to `path` readable by its owner only: into a temporary file
// renamed over it, so that a reader (an agent reading the token file on a
// shared filesystem) sees the old content or the new, never an empty file.
// A file that already holds `text` is left alone.
Status WritePrivateFile(const std::string& path, const std::string& text) {
  {
    std::ifstream in(path);
    std::string old((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (in && old == text) return OkStatus();
  }
  std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return InternalError(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
  UniqueFd guard(fd);
  (void)::fchmod(fd, 0600);  // an existing file keeps its mode otherwise
  size_t done = 0;
  while (done < text.size()) {
    ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ::unlink(tmp.c_str());
      return InternalError(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
    }
    done += static_cast<size_t>(w);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return InternalError(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
  }
  return OkStatus();
}


}  // namespace

std::string JobFileFor(const std::string& journal_path) {
  auto slash = journal_path.rfind('/');
  return (slash == std::string::npos ? std::string(".") : journal_path.substr(0, slash)) + "/job.json";
}

int RunController(const RuntimeOptions& options) {
  RuntimeOptions o = options;
  const std::string& name = o.name;
  coord::Leadership* const leadership = o.leadership;
  std::optional<JournalTakeover> takeover;
  std::vector<nlohmann::json> history;  // the records of the job so far (a takeover's)
  if (leadership != nullptr) {
    auto records = leadership->ReadJournal();
    if (!records.ok()) {
      fmt::print(stderr, "{}: reading the job's journal from etcd: {}\n", name, records.status().ToString());
      return 1;
    }
    history = std::move(*records);
    for (const auto& r : history) {
      if (!r.contains("event") || r["event"] != "job_end") continue;
      // A standby that wins after the job ended: nothing to lead.
      int code = r.contains("exit_code") && r["exit_code"].is_number_integer() ? r["exit_code"].get<int>() : 1;
      if (code == kExitDeposed || code < 0 || code > 255) code = 1;  // never read as "deposed: campaign again"
      fmt::print("{}: the job already ended (exit code {}): {}\n", name, code,
                 r.contains("reason") && r["reason"].is_string() ? r["reason"].get<std::string>() : "");
      leadership->Resign();
      return code;
    }
    if (!history.empty() && o.token.empty()) {
      // Workers and agents hold the job's token: a leader with another would refuse them all.
      fmt::print(stderr, "{}: cannot take over the running job: its token file {} is not here (this controller "
                 "needs the file the first one wrote, e.g. on a shared filesystem)\n", name, o.token_file);
      leadership->Resign();
      return 1;
    }
    if (!history.empty()) {
      auto t = TakeoverFromJournal(history);
      if (!t.ok()) {
        fmt::print(stderr, "{}: taking over from etcd's journal: {}\n", name, t.status().message());
        return 1;
      }
      takeover = std::move(*t);
    }
  } else if (!o.resume.empty()) {
    bool torn = false;
    auto records = Journal::Read(o.resume, &torn);
    if (records.ok() && torn) {
      NONSTOP_LOG_WARNING("--resume {}: its last line was torn (the controller died while writing it); left out",
                          o.resume);
    }
    if (!records.ok()) {
      fmt::print(stderr, "{}: --resume {}: {}\n", name, o.resume, records.status().ToString());
      return kExitUsage;
    }
    auto t = TakeoverFromJournal(*records);
    if (!t.ok()) {
      fmt::print(stderr, "{}: --resume {}: {}\n", name, o.resume, t.status().message());
      return kExitUsage;
    }
    takeover = std::move(*t);
    history = std::move(*records);
    if (o.listen.port == 0) {
      auto where = net::ParseHostPort(takeover->controller);
      if (!where.ok()) {
        fmt::print(stderr, "{}: --resume {}: the journal's controller address '{}' is not usable ({}); pass --listen\n",
                   name, o.resume, takeover->controller, where.status().message());
        return kExitUsage;
      }
      o.listen = *where;
    }
  }
  auto journal = !o.resume.empty() ? Journal::OpenForAppend(o.resume) : Journal::Open(o.journal);
  if (!journal.ok()) {
    fmt::print(stderr, "{}: {}\n", name, journal.status().ToString());
    return 1;
  }
  if (leadership != nullptr) {
    // The local journal is the whole job's: its predecessors' records first, as etcd holds them.
    for (const auto& r : history) (*journal)->Copy(r);
    (*journal)->set_mirror([leadership](const nlohmann::json& r) { leadership->Append(r); });
  }
  // This controller's epoch: a worker or agent never follows a controller of
  // an older one. With etcd, the leader key's create revision; with a
  // journal, one more than the controllers it records.
  int64_t epoch = 1;
  if (leadership != nullptr) {
    epoch = leadership->epoch();
  } else {
    for (const auto& r : history) {
      if (!r.contains("event") || (r["event"] != "job_start" && r["event"] != "controller_start")) continue;
      // Records from before epochs were journaled count as epoch 1.
      int64_t e = r.contains("epoch") && r["epoch"].is_number_integer() ? r["epoch"].get<int64_t>() : 1;
      epoch = std::max(epoch, e + 1);
    }
  }

  // SIGINT/SIGTERM end the job cleanly through the loop.
  sigset_t mask = BlockTerminationSignals();
  UniqueFd sigfd(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));

  net::EventLoop loop;
  std::deque<Event> events;
  Controller core(o.core);
  const std::string token = o.token.empty() ? RandomToken() : o.token;
  ControlServerOptions server_options;
  server_options.epoch = epoch;
  auto server = ControlServer::Create(
      &loop, o.listen, token, [&](Event e) { events.push_back(std::move(e)); }, server_options);
  if (!server.ok()) {
    fmt::print(stderr, "{}: cannot start the controller: {}\n", name, server.status().ToString());
    return 1;
  }
  std::string controller_address = (*server)->address().ToString();
  if (!o.advertise_address.empty()) {
    controller_address = fmt::format("{}:{}", o.advertise_address, (*server)->address().port);
  } else if ((*server)->address().host == "0.0.0.0" || (*server)->address().host == "::") {
    fmt::print(stderr, "{}: listening on {} needs --advertise-address: the address agents and workers dial\n", name,
               (*server)->address().ToString());
    return kExitUsage;
  }
  auto http = HttpApi::Start(o.http_host, o.http_port, (*journal)->path(), token);
  if (!http.ok()) {
    fmt::print(stderr, "{}: {}\n", name, http.status().ToString());
    return 1;
  }
  std::map<int, std::unique_ptr<ScaleCall>> scale_calls;
  loop.Watch((*http)->wake_fd(), POLLIN, [&](short) {
    for (auto& call : (*http)->TakeCalls()) {
      events.push_back(ScaleRequest{call->id, call->body, call->source});
      scale_calls[call->id] = std::move(call);
    }
  });
  if (leadership != nullptr) {
    // Workers and agents look the leader up in etcd: from now on they find this one.
    Status s = leadership->Publish({{"controller", controller_address}, {"http", (*http)->address()}});
    if (!s.ok()) {
      fmt::print(stderr, "{}: publishing this controller's address in etcd: {}\n", name, s.ToString());
      return leadership->deposed() ? kExitDeposed : 1;
    }
  }
  {
    // The job file: how `nonstop status`, `nonstop scale` and `nonstop worker` find this job.
    nlohmann::json job = {{"controller", controller_address}, {"http", (*http)->address()},
                          {"token", token}, {"journal", (*journal)->path()}, {"pid", ::getpid()},
                          {"env", nlohmann::json::object()}};
    if (!o.checkpoint_dir.empty()) {
      job["env"] = {{"NONSTOP_CHECKPOINT_DIR", o.checkpoint_dir},
                    {"NONSTOP_CHECKPOINT_EVERY", std::to_string(o.checkpoint_every)}};
    }
    Status s = WritePrivateFile(JobFileFor((*journal)->path()), job.dump(2) + "\n");
    if (!s.ok()) NONSTOP_LOG_WARNING("{}", s.ToString());
  }
  if (!o.token_file.empty()) {
    Status s = WritePrivateFile(o.token_file, token + "\n");
    if (!s.ok()) {
      fmt::print(stderr, "{}: --job-token-file: {}\n", name, s.ToString());
      return 1;
    }
  }
  // Everything this loop prints goes through bounded writers: a reader of our
  // output that does not keep up loses lines (counted), never stalls the job.
  // Log lines too (control-port refusals, lost workers): never a blocking write from the loop.
  launcher::BoundedStdio stdio;
  launcher::OutputWriter& out = stdio.out();
  launcher::OutputWriter& err = stdio.err();
  // With a progress line (a terminal), every line of ours clears it first and
  // it is drawn again under the line: the terminal keeps one live line at the bottom.
  std::string shown_progress;
  auto print = [&](const std::string& text) {
    if (!o.progress_line) {
      out.Write(text);
      return;
    }
    out.Write("\r\x1b[K" + text + shown_progress);
  };
  const bool local = !o.program.empty();
  std::optional<launcher::LocalLauncher> launcher;
  if (local) {
    launcher.emplace(
        &loop,
        [&](int worker_id) {
          int rank = core.RankOf(worker_id);
          return rank >= 0 ? fmt::format("[rank {}] ", rank) : fmt::format("[worker {}] ", worker_id);
        },
        [&](int worker_id, pid_t pid, int code, int sig) {
          events.push_back(ProcessExited{worker_id, pid, code, sig, ""});
        },
        [&](int worker_id, pid_t pid, int sig) { events.push_back(ProcessStopped{worker_id, pid, sig, ""}); }, &out,
        &err);
  }
  auto local_running = [&]() { return launcher ? launcher->running() : 0; };

  fmt::print("{}\n", name);
  fmt::print("  {:<20} {}{}\n", "controller", (*server)->address().ToString(),
             controller_address != (*server)->address().ToString() ? " (advertised as " + controller_address + ")"
                                                                    : "");
  fmt::print("  {:<20} {}\n", "http", (*http)->address());
  // The token rides in the fragment, which the browser never sends: the page reads it for GET /events.
  // Only a terminal sees it: a log file or CI output does not get the job's token.
  if (::isatty(STDOUT_FILENO)) {
    fmt::print("  {:<20} http://{}/#token={}\n", "dashboard", (*http)->address(), token);
  } else {
    fmt::print("  {:<20} http://{}/ (add #token=<the token in {}>)\n", "dashboard", (*http)->address(),
               JobFileFor((*journal)->path()));
  }
  if (o.core.min_hosts > 0 && o.core.world_size == 0) {
    fmt::print("  {:<20} {}{}\n", "hosts", o.core.min_hosts,
               o.core.max_hosts > 0 ? fmt::format(" to {}", o.core.max_hosts) : " or more");
  } else {  // one machine: nonstop run, whether its workers are this process's or its agent's
    fmt::print("  {:<20} {}\n", "workers", o.core.world_size);
    fmt::print("  {:<20} {}\n", "spares", o.core.spares);
  }
  if (!o.token_file.empty()) fmt::print("  {:<20} {}\n", "job token file", o.token_file);
  fmt::print("  {:<20} {} ms\n", "heartbeat timeout", o.core.heartbeat_timeout.count());
  fmt::print("  {:<20} {} ms\n", "abort timeout", o.core.abort_timeout.count());
  fmt::print("  {:<20} {}\n", "recovery", o.recovery_name);
  fmt::print("  {:<20} {}\n", "elastic policy", core.PolicyJson().dump());
  fmt::print("  {:<20} {}\n", "checkpoints",
             o.checkpoint_dir.empty()
                 ? std::string("none")
                 : fmt::format("{} (every {})", o.checkpoint_dir,
                               o.checkpoint_every > 0 ? std::to_string(o.checkpoint_every) + " steps"
                                                      : fmt::format("Young/Daly, MTBF {} s", o.mtbf_seconds)));
  std::string fault_text;
  for (const auto& f : o.core.faults) fault_text += (fault_text.empty() ? "" : "; ") + control::FormatFault(f);
  fmt::print("  {:<20} {}\n", "injected faults", fault_text.empty() ? "none" : fault_text);
  fmt::print("  {:<20} {}{}\n", "journal", (*journal)->path(),
             (*journal)->rotated_to().empty() ? "" : " (the previous one was kept as " + (*journal)->rotated_to() + ")");
  std::string cmdline;
  for (const auto& a : o.program) cmdline += (cmdline.empty() ? "" : " ") + a;
  if (local) fmt::print("  {:<20} {}\n", "program", cmdline);
  std::fflush(stdout);
  nlohmann::json start = {{"event", "job_start"}, {"world_size", o.core.world_size}, {"spares", o.core.spares},
                          {"controller", controller_address}, {"http", (*http)->address()},
                          {"policy", core.PolicyJson()}};
  if (local) start["program"] = o.program;
  if (o.core.min_hosts > 0) start["min_hosts"] = o.core.min_hosts;
  if (takeover) {
    // The journal goes on: this controller's start is not the job's.
    start["event"] = "controller_start";
    start["resume"] = true;
  }
  start["epoch"] = epoch;
  if (leadership != nullptr) start["etcd"] = leadership->endpoints();
  (*journal)->Append(start);

  JobMetrics metrics;  // GET /metrics, from the journal's records as they are written
  ProgressLine progress;  // the terminal's live line (o.progress_line), from the same records
  std::set<int> niced;  // local spares still at low priority
  std::set<int> at_normal_priority;  // an elastic host's workers told to run at nice 0 (with their first plan)
  // A refill warms up at a low priority only if it can be given normal
  // priority back when it takes a rank: an ordinary user cannot raise a
  // priority (CAP_SYS_NICE), and a worker stuck at nice 10 would be a
  // straggler for the rest of the job.
  // An elastic host is this machine, its agent this user's (nonstop run): its refills likewise.
  const bool can_restore_priority = launcher::LocalLauncher::CanRestorePriority();
  const bool low_priority_refills = local && can_restore_priority;
  if (local && !low_priority_refills && o.core.spares > 0) {
    out.Write("[nonstop] spares that refill the pool warm up at normal priority: this user cannot raise a process's "
              "priority back when it takes a rank (that needs CAP_SYS_NICE or `ulimit -e 20`)\n");
  }
  // The variables every worker gets from the controller; an agent adds its
  // own (NONSTOP_CONTROLLER, NONSTOP_JOB_TOKEN, NONSTOP_HOST_ID, NONSTOP_DATA_HOST).
  auto worker_env = [&](int id, bool spare, bool resume) {
    std::vector<std::pair<std::string, std::string>> env = {{"NONSTOP_WORKER_ID", std::to_string(id)},
                                                            {"NONSTOP_SPARE", spare ? "1" : "0"}};
    if (!o.checkpoint_dir.empty()) {
      env.push_back({"NONSTOP_CHECKPOINT_DIR", o.checkpoint_dir});
      env.push_back({"NONSTOP_CHECKPOINT_EVERY", std::to_string(o.checkpoint_every)});
      env.push_back({"NONSTOP_MTBF_SECONDS", fmt::format("{}", o.mtbf_seconds)});
    }
    if (resume) env.push_back({"NONSTOP_RESUME", "1"});
    return env;
  };
  auto spawn_local = [&](int id, bool spare, bool resume, bool background) -> Status {
    if (!launcher) return FailedPreconditionError(fmt::format("worker {} has no host to run on", id));
    launcher::ChildSpec spec;
    spec.worker_id = id;
    spec.argv = o.program;
    spec.env = {{"NONSTOP_CONTROLLER", controller_address},
                {"NONSTOP_JOB_TOKEN", token},
                {"NONSTOP_DATA_HOST", o.data_host}};
    spec.unset = launcher::kJobVariables;  // an inherited NONSTOP_HOST_ID or NONSTOP_RESUME is not this job's
    for (auto& kv : worker_env(id, spare, resume)) spec.env.push_back(std::move(kv));
    if (!o.worker_log_dir.empty()) spec.log_file = fmt::format("{}/worker-{}.log", o.worker_log_dir, id);
    // A spare started in the background (refilling the pool while the job
    // trains) warms up at a low priority, so that it does not slow the job's
    // steps; it gets normal priority when it takes a rank.
    if (background && low_priority_refills && o.refill_nice > 0) {
      spec.nice = o.refill_nice;
      niced.insert(id);
    }
    auto pid = launcher->Spawn(spec);
    if (!pid.ok()) return pid.status().WithContext(fmt::format("starting worker {}", id));
    (*journal)->Append({{"event", "spawn"}, {"worker_id", id}, {"pid", *pid}, {"spare", spare}, {"resume", resume}});
    return OkStatus();
  };
  if (local) {
    for (int id = 0; id < o.core.world_size + o.core.spares; ++id) {
      Status s = spawn_local(id, id >= o.core.world_size, /*resume=*/false, /*background=*/false);
      if (!s.ok()) {
        fmt::print(stderr, "{}: {}\n", name, s.ToString());
        launcher->SignalAll(SIGKILL);
        return 1;
      }
    }
  }

  std::optional<EndJob> ended;
  Deadline kill_at = kNoDeadline;
  Deadline agents_gone_by = kNoDeadline;
  bool interrupted = false;
  bool hand_over = false;  // SIGTERM with etcd: give the job to a standby instead of ending it
  if (sigfd.valid()) {
    loop.Watch(sigfd.get(), POLLIN, [&](short) {
      signalfd_siginfo si;
      while (::read(sigfd.get(), &si, sizeof(si)) == sizeof(si)) {
        if (leadership != nullptr && si.ssi_signo == SIGTERM) {
          hand_over = true;
        } else {
          interrupted = true;
        }
      }
    });
  }

  // Signals a worker wherever it runs: the local launcher, or its host's agent.
  auto signal_worker = [&](int id, int sig) {
    std::string host = core.HostOf(id);
    if (host.empty()) {
      if (launcher) launcher->Signal(id, sig);
      return;
    }
    (*server)->SendToAgent(host, control::kMsgAgentSignal, control::Encode(control::AgentSignalMsg{id, sig}));
  };
  // Each agent learns which ranks its workers hold, to label their output:
  // every agent with each new plan (`only_host` empty), an agent that
  // (re)joins at once. Only labels: sent as they are decided.
  auto send_ranks_to_agents = [&](uint32_t generation, const std::vector<int>& members,
                                  const std::string& only_host) {
    if (core.hosts().empty() || generation == 0) return;
    std::map<std::string, control::AgentRanksMsg> by_host;
    for (size_t r = 0; r < members.size(); ++r) {
      std::string host = core.HostOf(members[r]);
      if (!host.empty()) by_host[host].ranks.push_back({members[r], static_cast<int>(r)});
    }
    for (const auto& [id, h] : core.hosts()) {
      if (!h.alive || (!only_host.empty() && id != only_host)) continue;
      control::AgentRanksMsg& m = by_host[id];  // none of its workers is a member: an empty list
      m.generation = generation;
      (*server)->SendToAgent(id, control::kMsgAgentRanks, control::Encode(m));
    }
  };
  // Every member of a generation gets the same plan (one PlanMsg shared by
  // their SendPlan actions): it is encoded once, for all of them.
  std::shared_ptr<const control::PlanMsg> encoded_plan;
  std::string encoded_plan_payload;
  std::shared_ptr<const control::AbortMsg> encoded_abort;  // likewise the abort of a generation
  std::string encoded_abort_payload;
  auto execute = [&](const Action& a) {
    std::visit(
        [&](const auto& act) {
          using T = std::decay_t<decltype(act)>;
          if constexpr (std::is_same_v<T, SendPlan>) {
            const std::string host = core.HostOf(act.worker_id);
            if (host.empty()) {
              if (niced.erase(act.worker_id) > 0) {
                Status s = launcher->Renice(act.worker_id, 0);
                if (!s.ok()) NONSTOP_LOG_WARNING("promoted spare keeps its low priority: {}", s.ToString());
              }
            } else if (auto h = core.hosts().find(host);
                       h != core.hosts().end() && h->second.elastic && !at_normal_priority.count(act.worker_id)) {
              // Once per worker and controller, whatever this controller knows of its start: one
              // started niced by a controller before a takeover takes its rank at normal priority too.
              if ((*server)->SendToAgent(host, control::kMsgAgentRenice,
                                         control::Encode(control::AgentReniceMsg{act.worker_id, 0}))) {
                at_normal_priority.insert(act.worker_id);
              }
            }
            if (act.plan != encoded_plan) {
              encoded_plan_payload = control::Encode(*act.plan);
              encoded_plan = act.plan;
              std::vector<int> members;
              for (const auto& m : act.plan->members) members.push_back(m.worker_id);
              send_ranks_to_agents(act.plan->generation, members, "");  // sent before the plan: lines show the rank
            }
            (*server)->Send(act.worker_id, control::kMsgPlan, encoded_plan_payload);
          } else if constexpr (std::is_same_v<T, SendShutdown>) {
            (*server)->Send(act.worker_id, control::kMsgShutdown, control::Encode(act.msg));
          } else if constexpr (std::is_same_v<T, SendAbort>) {
            if (act.msg != encoded_abort) {
              encoded_abort_payload = control::Encode(*act.msg);
              encoded_abort = act.msg;
            }
            (*server)->Send(act.worker_id, control::kMsgAbort, encoded_abort_payload);
          } else if constexpr (std::is_same_v<T, SendDrain>) {
            (*server)->Send(act.worker_id, control::kMsgDrain, control::Encode(act.msg));
          } else if constexpr (std::is_same_v<T, ScaleReply>) {
            if (auto it = scale_calls.find(act.request_id); it != scale_calls.end()) {
              it->second->reply.set_value({act.http_status, act.body});
              scale_calls.erase(it);
            }
          } else if constexpr (std::is_same_v<T, KillWorker>) {
            signal_worker(act.worker_id, SIGKILL);
            // A remote worker may be cut off from its agent (a partition):
            // its control connection is closed, so nothing it sends counts.
            if (!core.HostOf(act.worker_id).empty()) (*server)->CloseWorker(act.worker_id, "killed by the controller");
          } else if constexpr (std::is_same_v<T, SignalWorker>) {
            signal_worker(act.worker_id, act.signal);
          } else if constexpr (std::is_same_v<T, SpawnWorker>) {
            if (ended) return;
            if (act.host.empty()) {
              Status s = spawn_local(act.worker_id, act.spare, act.resume, act.background);
              if (!s.ok()) {
                err.Write(fmt::format("{}[nonstop] {}\n", o.progress_line ? "\r\x1b[K" : "", s.ToString()));
                events.push_back(ProcessExited{act.worker_id, 0, 127, 0, ""});
              }
              return;
            }
            // Remote refills start at normal priority: the agent's user may not
            // be able to raise it back when the spare takes a rank. An elastic
            // host's agent runs on this machine as this user: it can.
            int nice = 0;
            auto h = core.hosts().find(act.host);
            if (act.background && h != core.hosts().end() && h->second.elastic && can_restore_priority &&
                o.refill_nice > 0) {
              nice = o.refill_nice;  // back to 0 with its first plan (above)
            }
            control::AgentStartMsg start{act.worker_id, act.spare, nice,
                                         worker_env(act.worker_id, act.spare, act.resume)};
            if (!(*server)->SendToAgent(act.host, control::kMsgAgentStart, control::Encode(start))) {
              events.push_back(ProcessExited{act.worker_id, 0, 127, 0, act.host});
            }
          } else if constexpr (std::is_same_v<T, CloseHost>) {
            (*server)->CloseAgent(act.host_id, act.reason, act.exit_code, /*send_shutdown=*/!act.fence);
          } else if constexpr (std::is_same_v<T, AppendJournal>) {
            metrics.Observe(act.record);
            progress.Observe(act.record);
            (*journal)->Append(act.record);
          } else if constexpr (std::is_same_v<T, PrintLine>) {
            print(fmt::format("[nonstop] {}\n", act.line));
          } else if constexpr (std::is_same_v<T, EndJob>) {
            if (ended) return;  // the first end stands
            ended = act;
            if (kill_at == kNoDeadline) kill_at = DeadlineAfter(Millis(act.exit_code == 0 ? 15'000 : 500));
            // Agents stop their processes and leave; they get a while for it.
            for (const auto& host : (*server)->agents()) {
              (*server)->SendToAgent(host, control::kMsgShutdown,
                                     control::Encode(control::ShutdownMsg{act.reason, act.exit_code}));
            }
            agents_gone_by = DeadlineAfter(Millis(20'000));
          }
        },
        a);
  };
  // Calls to core.Handle so far: /status changes only when this does.
  uint64_t handled = 0;
  // Write before acting: records are written at once, and the orders and
  // other actions that follow them wait until the records before them are
  // on their way to disk (flushed) and, with etcd, held by etcd, so that a
  // controller taking over knows every order that went out. With etcd an
  // order also waits while the lease is not known to be held.
  struct Pending {
    uint64_t after;  // leadership->appended() when it was decided
    Action action;
  };
  std::deque<Pending> pending;
  auto handle = [&](const Event& e) {
    ++handled;
    for (Action& a : core.Handle(e, Clock::now())) {
      if (auto* record = std::get_if<AppendJournal>(&a)) {
        metrics.Observe(record->record);
        progress.Observe(record->record);
        (*journal)->Append(std::move(record->record));
        continue;
      }
      pending.push_back({leadership != nullptr ? leadership->appended() : 0, std::move(a)});
    }
    // An agent that (re)joins after the plan went out (a takeover, a healed host) still labels right.
    if (const auto* joined = std::get_if<HostJoined>(&e)) {
      send_ranks_to_agents(core.generation(), core.members(), joined->msg.host_id);
    }
  };
  auto run_pending = [&]() {
    (*journal)->Flush();
    if (leadership != nullptr) leadership->Flush();
    while (!pending.empty()) {
      if (leadership != nullptr && (pending.front().after > leadership->durable() || !leadership->Valid())) break;
      Action a = std::move(pending.front().action);
      pending.pop_front();
      execute(a);
    }
  };
  auto drain_events = [&]() {
    do {
      while (!events.empty()) {
        Event e = std::move(events.front());
        events.pop_front();
        handle(e);
      }
      run_pending();  // may queue events (a spawn that failed)
    } while (!events.empty());
  };
  if (leadership != nullptr) {
    loop.Watch(leadership->wake_fd(), POLLIN, [&](short) {
      uint64_t n;
      while (::read(leadership->wake_fd(), &n, sizeof(n)) == sizeof(n)) {
      }
      run_pending();
    });
  }
  // This controller stops leading, the job goes on: the record says why in the local journal only
  // (etcd's is the next leader's), with the orders held back.
  auto step_down = [&](nlohmann::json record, const std::string& line, int code) {
    (*journal)->set_mirror(nullptr);
    record["epoch"] = epoch;
    record["orders_not_sent"] = pending.size();
    (*journal)->Append(std::move(record));
    (*journal)->Flush();
    print(fmt::format("[nonstop] {}\n", line));
    return code;
  };
  Deadline leaderless_warn_at = kNoDeadline;
  // /status and /metrics are published after every loop turn that changed
  // the state, as long as building them is cheap. Status() lists every
  // worker: with many thousands it takes milliseconds, so it is then
  // published at most once per 20 × its cost (at most ~5% of the loop's
  // time goes to it; docs/scale.md).
  uint64_t published = ~uint64_t{0};
  Deadline next_publish = Clock::now();
  auto publish_status = [&]() {
    if (handled == published || Clock::now() < next_publish) return;
    auto t0 = Clock::now();
    nlohmann::json st = core.Status();
    metrics.SetStatus(st);
    std::string text = metrics.Text();
    (*http)->Publish(std::move(st), std::move(text));
    published = handled;
    auto cost = Clock::now() - t0;
    next_publish = cost < Millis(1) ? Clock::now() : Clock::now() + 20 * cost;
  };

  if (takeover) handle(Takeover{std::move(takeover->state)});  // before any worker or agent is heard
  Deadline next_tick = Clock::now();
  Deadline next_progress = Clock::now();
  Deadline next_ping = Clock::now();
  while (true) {
    loop.RunOnce(Millis(20));
    drain_events();
    if (leadership != nullptr && leadership->deposed()) {
      // Another controller leads (etcd refused our epoch, or our lease expired
      // there): step down at once. Workers and agents find the new leader
      // through etcd; nothing of ours is killed, the job is the new leader's.
      std::string why = leadership->why_not_leading();
      return step_down({{"event", "deposed"}, {"reason", why}},
                       fmt::format("this controller (epoch {}) no longer leads: {}; the job goes on under the next "
                                   "leader",
                                   epoch, why),
                       kExitDeposed);
    }
    if (leadership != nullptr && !leadership->Valid()) {
      if (leaderless_warn_at == kNoDeadline || Clock::now() >= leaderless_warn_at) {
        print(fmt::format("[nonstop] orders wait: {}; training goes on\n", leadership->why_not_leading()));
        leaderless_warn_at = DeadlineAfter(Millis(5'000));
      }
    } else {
      leaderless_warn_at = kNoDeadline;
    }
    publish_status();
    if (hand_over && !ended) {
      // A controller host going down for maintenance (systemd, Slurm, Kubernetes send SIGTERM): the
      // job is not over. Give the lease back at once so a standby leads within its poll, not a TTL.
      leadership->Resign();
      return step_down({{"event", "handover"}},
                       fmt::format("SIGTERM: this controller (epoch {}) hands the job over to a standby; it goes on "
                                   "(SIGINT ends the job)",
                                   epoch),
                       kExitInterrupted);
    }
    if (interrupted && !ended) {
      interrupted = false;
      handle(Interrupted{leadership != nullptr ? "SIGINT" : "a signal (SIGINT or SIGTERM)"});
      run_pending();
    }
    if (Clock::now() >= next_tick) {
      if (launcher) launcher->PollStopped();  // frozen processes, seen within one tick
      (*server)->CheckTimers(Clock::now());
      drain_events();
      handle(Tick{});
      run_pending();
      next_tick = DeadlineAfter(Millis(50));
      if (o.progress_line && progress.changed() && Clock::now() >= next_progress) {
        shown_progress = progress.Text();
        winsize ws{};
        if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 8 && shown_progress.size() >= ws.ws_col) {
          shown_progress.resize(ws.ws_col - 1);  // a wrapped line could not be redrawn in place
        }
        out.Write("\r\x1b[K" + shown_progress);
        next_progress = DeadlineAfter(Millis(250));  // at most four redraws a second
      }
    }
    if (Clock::now() >= next_ping) {
      // Heartbeats the other way: a worker or agent that hears nothing for a
      // while has lost its controller; one that hears pings waits as long as
      // the job runs.
      // A controller that may not lead (its lease is not known to be held) pings nobody: silence makes
      // workers and agents look for the leader.
      if (leadership == nullptr || leadership->Valid()) {
        const std::string& ping = (*server)->ping_payload();
        for (const auto& [id, w] : core.workers()) {
          if (w.role != WorkerRole::kGone) (*server)->Send(id, control::kMsgPing, ping);
        }
        for (const auto& host : (*server)->agents()) (*server)->SendToAgent(host, control::kMsgPing, ping);
      }
      next_ping = DeadlineAfter(Millis(500));
    }
    run_pending();  // flushes the journal once per turn (what happened is on disk within ≤ 20 ms), then acts
    if (ended && local_running() == 0 && ((*server)->agents().empty() || Clock::now() >= agents_gone_by)) break;
    if (ended && launcher && Clock::now() >= kill_at) {
      launcher->SignalAll(SIGKILL);
      kill_at = DeadlineAfter(Millis(1000));
    }
  }

  (*journal)->Flush();
  if (leadership != nullptr) {
    // The end is the job's: etcd must hold it before the lease is given back
    // (a standby that wins then reads it and leaves instead of taking over).
    leadership->Flush();
    Deadline give_up = DeadlineAfter(Millis(5'000));
    while (leadership->durable() < leadership->appended() && Clock::now() < give_up && !leadership->deposed()) {
      std::this_thread::sleep_for(Millis(10));
    }
    if (leadership->durable() < leadership->appended()) {
      out.Write("[nonstop] the job's end could not be written to etcd: a standby may take over and find no one\n");
    }
    leadership->Resign();
  }
  int code = ended->exit_code;
  if (o.progress_line) {
    shown_progress = progress.Text() + "\n";  // the last state stays on the screen
    print("");
    shown_progress.clear();
  }
  out.Write(fmt::format("[nonstop] job {}: {}\n", code == 0 ? "finished" : "FAILED", ended->reason));
  out.Write(fmt::format("[nonstop] journal: {}\n", (*journal)->path()));
  return code;
}

}  // namespace nonstop::controller
