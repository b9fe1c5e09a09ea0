#include "agent/agent.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>

#include "common/crypto.h"
#include "common/logging.h"
#include "common/role_keys.h"
#include "common/signals.h"
#include "control/messages.h"
#include "coord/etcd.h"
#include "coord/leadership.h"
#include "net/address.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/settings.h"

namespace nonstop::agent {

namespace {

// An order is a few KiB at most (64 variables of ≤ 4 KiB each is the decoder's bound).
constexpr uint32_t kMaxOrderBytes = 1u << 20;
// The loop never sleeps longer than this: PollStopped's cadence.
constexpr Millis kTick{50};
// After the SIGKILL at the end, how long to wait for the processes to be reaped.
constexpr Millis kReapGrace{5'000};
// The leader file names nobody, or a leader that does not answer: read it again this soon (plus
// up to half of it at random). A local file: the watch's news also cut the wait short.
constexpr Millis kLeaderPoll{200};
// One etcd request, made on the loop (nothing else waits while no controller leads).
constexpr Millis kEtcdTimeout{300};

std::string Seconds(Millis d) {
  return fmt::format("{:g} s", static_cast<double>(d.count()) / 1000.0);
}

// The agent's link: its hello (kind agent, worker id 0), and its timing.
control::ControllerLinkOptions LinkOptions(const AgentOptions& o, const std::string& leader_file) {
  control::ControllerLinkOptions l;
  l.controllers = o.controller;
  l.etcd = o.etcd;
  l.etcd_job = o.etcd_job;
  l.etcd_security = o.etcd_security;
  // The agent's own watch keeps it (docs/leader-discovery.md): its dials read it, not etcd.
  l.leader_file = leader_file;
  l.etcd_timeout = kEtcdTimeout;
  l.hello.kind = net::ConnectionKind::kAgent;
  l.hello.generation = 0;
  l.hello.worker_id = 0;
  l.key = crypto::JobKey(o.job_token);  // an agent proves the job key itself
  l.controller_public = ControllerPublicKey(l.key);
  l.try_timeout = o.controller_timeout;  // the connect, then the hello
  l.silence_timeout = o.controller_timeout;
  l.reconnect_within = o.join_timeout;  // Lose() moves it past the fencing when processes run
  l.backoff = {o.backoff_initial, o.backoff_max, /*jitter=*/0.5};
  l.leader_poll = kLeaderPoll;
  l.max_frame_bytes = kMaxOrderBytes;
  l.max_queued_bytes = o.max_queued_bytes;
  return l;
}

std::string Processes(int n) { return fmt::format("{} process{}", n, n == 1 ? "" : "es"); }

bool IsAgentVariable(std::string_view name) {
  namespace s = settings;
  return name == s::kControllerAddress.env || name == s::kJobToken.env ||
         name == s::kJobTokenFd.env || name == s::kLifelineFd.env || name == s::kHostId.env ||
         name == s::kDataHost.env || name == s::kDataPorts.env || name == s::kEtcd.env ||
         name == s::kEtcdJob.env || name == s::kLeaderFile.env || name == s::kEtcdCacert.env ||
         name == s::kEtcdCert.env || name == s::kEtcdKey.env || name == s::kEtcdAuthFile.env ||
         name == s::kEtcdAllowPlaintext.env;
}

}  // namespace

Status ValidateOptions(const AgentOptions& o) {
  if (o.etcd.empty() || !o.controller.empty()) {
    // One address or a list (a leader and its standbys), IPv4 or [IPv6]:port, as the link dials
    // them.
    auto where = control::ParseControllerList(o.controller);
    if (!where.ok()) return where.status();  // "controller address '…': what is wrong"
  }
  if (!o.etcd.empty()) {
    etcd::ClientOptions co;
    co.security = o.etcd_security;
    auto c = etcd::Client::Create(o.etcd, co);
    if (!c.ok()) return InvalidArgumentError(c.status().message());
    NONSTOP_RETURN_IF_ERROR(coord::CheckJobName(o.etcd_job));
  }
  if (o.job_token.empty()) return InvalidArgumentError("the job token is empty");
  if (Status s = control::CheckHostId(o.host_id); !s.ok()) {
    return InvalidArgumentError(fmt::format("host id '{}': {}", o.host_id, s.message()));
  }
  if (o.program.empty()) return InvalidArgumentError("no program to run (it goes after `--`)");
  if (o.nproc < 0 || o.nproc > 1024)
    return InvalidArgumentError(fmt::format("nproc {} is not in [0, 1024]", o.nproc));
  if (o.spares < 0 || o.spares > 1024) {
    return InvalidArgumentError(fmt::format("spares {} is not in [0, 1024]", o.spares));
  }
  if (o.advertise_address.size() > 255)
    return InvalidArgumentError("the advertise address is over 255 characters");
  if (auto ports = net::ParsePortRange(o.data_ports); !ports.ok()) {
    return InvalidArgumentError(
        fmt::format("--data-ports '{}': {}", o.data_ports, ports.status().message()));
  }
  if (o.join_timeout <= Millis(0) || o.controller_timeout <= Millis(0) ||
      o.fence_after <= Millis(0) || o.heartbeat_interval <= Millis(0) ||
      o.backoff_initial <= Millis(0) || o.backoff_max < o.backoff_initial ||
      o.stop_grace < Millis(0)) {
    return InvalidArgumentError(
        "timeouts must be positive, and backoff_max at least backoff_initial");
  }
  if (o.max_queued_bytes < 64 * 1024)
    return InvalidArgumentError("max_queued_bytes must be at least 64 KiB");
  return OkStatus();
}

Agent::Agent(AgentOptions options) : options_(std::move(options)) {
  Status s = ValidateOptions(options_);
  NONSTOP_CHECK(s.ok()) << s.ToString();
  // The host's run directory: the leader file its etcd watch keeps for the agent and its workers,
  // and the workers' error files where no log directory holds them (left when one was written).
  const char* tmp = std::getenv("TMPDIR");
  std::string dir = fmt::format("{}/nonstop-agent-XXXXXX", tmp != nullptr && *tmp ? tmp : "/tmp");
  const bool made = ::mkdtemp(dir.data()) != nullptr;
  NONSTOP_CHECK(made || options_.etcd.empty())
      << "mkdtemp " << dir << ": " << std::strerror(errno) << " (HINT: set TMPDIR to a writable "
      << "directory)";
  if (made) run_dir_ = dir;
  // Without a directory (an unwritable TMPDIR and no log directory) the workers get no error file.
  error_dir_ = options_.log_dir.empty() ? run_dir_ : options_.log_dir;
  if (options_.run_as) ShareWithWorkerUser();
  if (!options_.etcd.empty()) leader_file_ = run_dir_ + "/leader.json";
  auto link = control::ControllerLink::Create(LinkOptions(options_, leader_file_));
  NONSTOP_CHECK(link.ok()) << link.status().ToString();  // what it checks, ValidateOptions did
  link_ = std::move(*link);
  link_->Attach(&loop_, [this] { PumpLink(); });
  wake_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  NONSTOP_CHECK(wake_fd_.valid()) << "eventfd: " << std::strerror(errno);
}

Agent::~Agent() {
  link_->Stop();
  launcher_.reset();
  leader_watch_.reset();
  if (!leader_file_.empty()) ::unlink(leader_file_.c_str());
  if (options_.run_as && !error_dir_.empty()) ::rmdir(error_dir_.c_str());  // if empty
  if (!run_dir_.empty()) ::rmdir(run_dir_.c_str());  // unless a worker's error file is in it
}

// Workers of another user (RunAs) read the leader file, and write their error files: the run
// directory (made just now by mkdtemp, this user's alone) is theirs to pass through, not to list
// or write (the agent's temporary leader file lies there), and their error files go to a directory
// of their own made in it, never in a directory another user could have prepared (a log directory
// may be theirs: a link planted there would have this process give them any file).
void Agent::ShareWithWorkerUser() {
  const launcher::RunAs& user = *options_.run_as;
  error_dir_.clear();
  if (run_dir_.empty()) return;
  const std::string dir = run_dir_ + "/worker-errors";
  UniqueFd fd;
  if (::mkdir(dir.c_str(), 0700) == 0) {
    fd.Reset(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  }
  if (!fd.valid() || ::fchown(fd.get(), user.uid, user.gid) != 0) {
    NONSTOP_LOG_WARNING("{}: {}: workers of user {} write no error file", dir, std::strerror(errno),
                        user.name);
  } else {
    error_dir_ = dir;
  }
  if (::chmod(run_dir_.c_str(), 0711) != 0) {
    NONSTOP_LOG_WARNING("chmod {}: {}: workers of user {} cannot read its leader file", run_dir_,
                        std::strerror(errno), user.name);
  }
}

void Agent::StartLeaderWatch() {
  if (options_.etcd.empty()) return;
  // One etcd client for the host's leader discovery: the agent's watch, not a poll of each worker.
  auto watch = coord::LeaderWatch::Start(
      options_.etcd, options_.etcd_job, leader_file_,
      [this] {
        leader_changed_.store(true);
        uint64_t one = 1;
        ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
        (void)n;
      },
      options_.etcd_security, ControllerPublicKey(crypto::JobKey(options_.job_token)));
  NONSTOP_CHECK(watch.ok()) << watch.status().ToString();  // ValidateOptions checked them
  leader_watch_ = std::move(*watch);
}

void Agent::Stop() {
  stop_requested_.store(true);
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
  (void)n;
}

const char* Agent::PhaseName(Phase p) {
  switch (p) {
    case Phase::kDialing:
      return "dialing";
    case Phase::kRegistered:
      return "registered";
    case Phase::kFenced:
      return "fenced";
    case Phase::kEnding:
      return "ending";
  }
  return "?";
}

void Agent::ChangePhase(Phase next) {
  // /*from=*/ any but kEnding /*to=*/ any; kEnding is final.
  NONSTOP_CHECK(phase_ != Phase::kEnding || next == Phase::kEnding)
      << "agent: left kEnding for " << PhaseName(next);
  if (next != phase_) NONSTOP_LOG_DEBUG("{} -> {}", PhaseName(phase_), PhaseName(next));
  phase_ = next;
}

int Agent::Run() {
  NONSTOP_CHECK(!ran_) << "Agent::Run() is called once";
  ran_ = true;
  if (options_.handle_signals) {
    // sbatch --signal=USR1@N: the grace time is about to start
    sigset_t mask = BlockTerminationSignals({SIGUSR1});
    signal_fd_.Reset(::signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK));
    if (signal_fd_.valid()) {
      loop_.Watch(signal_fd_.get(), POLLIN, [this](short) {
        signalfd_siginfo si;
        while (::read(signal_fd_.get(), &si, sizeof(si)) == sizeof(si)) {
          OnTerminationSignal(static_cast<int>(si.ssi_signo));
        }
      });
    }
  }
  loop_.Watch(wake_fd_.get(), POLLIN, [this](short) {
    uint64_t v;
    while (::read(wake_fd_.get(), &v, sizeof(v)) == sizeof(v)) {
    }
  });
  if (options_.out == nullptr) own_out_ = std::make_unique<launcher::OutputWriter>(STDOUT_FILENO);
  if (options_.err == nullptr) own_err_ = std::make_unique<launcher::OutputWriter>(STDERR_FILENO);
  launcher_ = std::make_unique<launcher::LocalLauncher>(
      &loop_, [this](int worker_id) { return OutputPrefix(worker_id); },
      [this](int worker_id, pid_t pid, int code, int sig) {
        OnChildExit(worker_id, pid, code, sig);
      },
      [this](int worker_id, pid_t pid, int sig) { OnChildStop(worker_id, pid, sig); },
      options_.out != nullptr ? options_.out : own_out_.get(),
      options_.err != nullptr ? options_.err : own_err_.get());
  // A worker that holds its lifeline (Session::Join) is reported dying as its exit begins, before
  // the kernel has freed its memory (milliseconds for a large one) and before its pidfd says it.
  if (Status s = launcher_->EnableLifelines(
          [this](int worker_id, pid_t pid) { OnChildDying(worker_id, pid); });
      !s.ok()) {
    NONSTOP_LOG_WARNING("no lifelines ({}): a worker's death is seen through its pidfd alone",
                        s.ToString());
  }

  StartLeaderWatch();
  Deadline now = Clock::now();
  reconnect_deadline_ = now + options_.join_timeout;
  next_poll_stopped_ = now + kTick;
  link_->Start(reconnect_deadline_, now);
  while (true) {
    // Sleep until the next timer, never longer than one tick. The sockets are
    // read before the timers run, so bytes that arrived while this process
    // was not scheduled count before the silence check.
    now = Clock::now();
    Deadline wake = std::min({next_poll_stopped_, now + kTick, link_->wake_at()});
    switch (phase_) {
      case Phase::kDialing:
        break;
      case Phase::kRegistered:
        wake = std::min(wake, next_heartbeat_);
        break;
      case Phase::kFenced:
        wake = std::min(wake, reconnect_deadline_);
        break;
      case Phase::kEnding:
        wake = std::min(wake, killed_ ? give_up_at_ : kill_at_);
        break;
    }
    const Millis wait = std::chrono::ceil<Millis>(std::max(wake - now, Clock::duration::zero()));
    loop_.RunOnce(wait);
    if (leader_changed_.exchange(false)) link_->LeaderChanged(Clock::now());
    if (stop_requested_.exchange(false)) {
      if (phase_ == Phase::kEnding) {
        kill_at_ = Clock::now();
      } else {
        End(kExitInterrupted, "stopped: killing its processes", /*kill_now=*/true);
      }
    }
    Tick();
    // The heartbeats leave from this loop: a turn that took long (a spawn, a starved process) is
    // said while it sends them, so that a controller's "no heartbeat" can be told from a silent
    // network. A turn may wait `wait` for its sockets; beyond that it was busy.
    if (const auto took = std::chrono::duration_cast<Millis>(Clock::now() - now);
        phase_ == Phase::kRegistered && took >= wait + options_.heartbeat_interval &&
        Clock::now() >= next_slow_say_) {
      NONSTOP_LOG_WARNING(
          "one turn of this agent's loop took {} ms (its heartbeats wait for it; said at most "
          "once in 10 s)",
          took.count());
      next_slow_say_ = Clock::now() + std::chrono::seconds(10);
    }
    if (phase_ != Phase::kEnding) continue;
    now = Clock::now();
    if (launcher_->running() == 0) break;
    if (!killed_ && now >= kill_at_) {
      if (graceful_) {
        NONSTOP_LOG_WARNING("{} still running after the shutdown's grace of {}: SIGKILL",
                            Processes(launcher_->running()), Seconds(options_.stop_grace));
      }
      launcher_->SignalAll(SIGKILL);
      killed_ = true;
      give_up_at_ = now + kReapGrace;
    } else if (killed_ && now >= give_up_at_) {
      NONSTOP_LOG_WARNING("{} not reaped {} after SIGKILL", Processes(launcher_->running()),
                          Seconds(kReapGrace));
      break;
    }
  }
  link_->Stop();
  // nothing runs now (or SIGKILLed processes that would not die: waited for here)
  launcher_.reset();
  leader_watch_.reset();
  if (signal_fd_.valid()) loop_.Unwatch(signal_fd_.get());
  loop_.Unwatch(wake_fd_.get());
  return exit_code_;
}

void Agent::OnTerminationSignal(int sig) {
  const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGUSR1";
  if (phase_ == Phase::kEnding) {
    kill_at_ = Clock::now();  // a second interrupt: no more grace
    return;
  }
  const bool leave = sig != SIGINT && LeavesOnSigterm();
  if (leave && leaving_.empty()) {
    leaving_ = name;
    int running = launcher_->running();
    if (running == 0) {
      End(kExitOk, fmt::format("left the job ({}): nothing ran here", name), /*kill_now=*/false);
      return;
    }
    if (phase_ == Phase::kRegistered) {
      NONSTOP_LOG_WARNING(
          "{}: this host leaves the job; asked the controller to release its {} at the next step "
          "boundary (a second SIGTERM, or SIGINT, kills them now)",
          name, Processes(running));
      SendLeaving();
    } else {
      // Cut off: the controller it reaches next (this one again, or one that
      // took over) is asked when it registers.
      NONSTOP_LOG_WARNING(
          "{}: this host leaves the job; its {} wait for a controller to release them (a second "
          "SIGTERM, or SIGINT, kills them now)",
          name, Processes(running));
    }
    return;
  }
  if (leave && !leaving_.empty() && (sig == SIGUSR1 || leaving_ == "SIGUSR1")) {
    // sbatch --signal=USR1@N came first; the scheduler's SIGTERM that follows
    // it (or a repeated SIGUSR1) is the same notice, not a second interrupt.
    NONSTOP_LOG_INFO("{} while leaving after {}: still waiting for the release", name, leaving_);
    leaving_ = sig == SIGTERM ? "SIGTERM" : leaving_;
    return;
  }
  if (sig == SIGUSR1 && !leave) {
    NONSTOP_LOG_INFO("SIGUSR1 ignored (--on-sigterm stop)");
    return;
  }
  End(kExitInterrupted,
      fmt::format(
          "interrupted by {}{}: killing its processes", name,
          leaving_.empty()
              ? ""
              : fmt::format(" (after {}, while its workers waited for their release)", leaving_)),
      /*kill_now=*/true);
}

void Agent::SendLeaving() {
  Send(control::kMsgAgentLeaving, control::Encode(control::AgentLeavingMsg{leaving_}));
}

void Agent::Tick() {
  Deadline now = Clock::now();
  if (now >= next_poll_stopped_) {
    launcher_->PollStopped();  // frozen processes, seen within one tick
    next_poll_stopped_ = now + kTick;
  }
  // its timers: a dial that is due, a try's deadline, the controller's silence
  link_->Advance(0, now);
  PumpLink();
  if (fence_at_ && now >= *fence_at_ && phase_ == Phase::kDialing) Fence();
  switch (phase_) {
    case Phase::kRegistered:
      if (now >= next_heartbeat_) {
        Send(control::kMsgAgentHeartbeat,
             control::Encode(control::AgentHeartbeatMsg{launcher_->running()}));
        next_heartbeat_ = now + options_.heartbeat_interval;
      }
      break;
    case Phase::kFenced:
      if (launcher_->running() == 0) {
        // Every process is gone: only now may this host take part again.
        ChangePhase(Phase::kDialing);
        link_->Start(reconnect_deadline_, now);
      } else if (now >= reconnect_deadline_) {
        End(kExitControllerLost,
            Describe(fmt::format("{} ({} not reaped yet)", link_->last_error(),
                                 Processes(launcher_->running()))),
            true);
      }
      break;
    case Phase::kDialing:
    case Phase::kEnding:
      break;
  }
}

void Agent::PumpLink() {
  while (auto e = link_->Next()) {
    switch (e->kind) {
      case control::LinkEvent::Kind::kAccepted:
        OnAccepted();
        break;
      case control::LinkEvent::Kind::kFrame:
        HandleFrame(e->frame);
        break;
      case control::LinkEvent::Kind::kLost:
        Lose(e->status.message());
        break;
      case control::LinkEvent::Kind::kFailed:
        OnLinkFailed(e->status);
        break;
    }
  }
}

// The link gives up only while looking for a controller (kDialing).
void Agent::OnLinkFailed(const Status& why) {
  switch (why.code()) {
    case StatusCode::kFailedPrecondition:  // the hello was refused (a wrong job token): no retry
      End(kExitRefused,
          fmt::format("cannot join the controller at {}: {}", link_->controller(), why.message()),
          /*kill_now=*/true);
      return;
    case StatusCode::kAborted:  // the job ended while this agent looked for its controller
      End(link_->job_exit_code(), why.message(), /*kill_now=*/false);
      return;
    default:  // no controller within the join timeout
      End(kExitControllerLost, Describe(why.message()), /*kill_now=*/true);
      return;
  }
}

std::string Agent::Describe(const std::string& error) const {
  return fmt::format("cannot reach the controller at {} within {}: {}", link_->controller(),
                     Seconds(options_.join_timeout), error);
}

void Agent::HandleFrame(const net::Frame& f) {
  switch (phase_) {
    case Phase::kEnding:
      NONSTOP_LOG_DEBUG("order of type {} after the end: ignored", f.type);
      return;
    case Phase::kRegistered:
      break;
    default:
      return;
  }
  // Pings never come here: the link checks their epochs (a deposed leader's connection is left).
  switch (f.type) {
    case control::kMsgShutdown: {
      auto m = control::DecodeShutdown(f.payload);
      if (!m.ok()) return Malformed(m.status().message());
      // A process exit status holds 0-255; any other code still means a failure.
      int code = m->exit_code >= 0 && m->exit_code <= 255 ? m->exit_code : 1;
      // Its first line: the controller prints the whole reason (a script's traceback) once.
      End(code,
          fmt::format("the controller ended this agent (exit code {}): {}", m->exit_code,
                      m->reason.substr(0, m->reason.find('\n'))),
          /*kill_now=*/false);
      return;
    }
    case control::kMsgAgentStart:
      return OnStart(f.payload);
    case control::kMsgAgentSignal:
      return OnSignal(f.payload);
    case control::kMsgAgentRenice:
      return OnRenice(f.payload);
    case control::kMsgAgentRanks: {
      auto m = control::DecodeAgentRanks(f.payload);
      if (!m.ok()) return Malformed(m.status().message());
      if (m->generation < ranks_generation_) return;  // an older generation's, overtaken
      ranks_generation_ = m->generation;
      ranks_.clear();
      for (const auto& [id, rank] : m->ranks) ranks_[id] = rank;
      return;
    }
    default:
      return Malformed(fmt::format("unexpected message type {}", f.type));
  }
}

std::string Agent::OutputPrefix(int worker_id) const {
  auto it = ranks_.find(worker_id);
  if (options_.elastic) {  // as `nonstop run` on one machine: the host is this one
    return it != ranks_.end() ? fmt::format("[rank {}] ", it->second)
                              : fmt::format("[worker {}] ", worker_id);
  }
  return it != ranks_.end() ? fmt::format("[{} rank {}] ", options_.host_id, it->second)
                            : fmt::format("[{} w{}] ", options_.host_id, worker_id);
}

void Agent::OnAccepted() {
  if (phase_ != Phase::kDialing) {  // kEnding: the job is over for this host anyway
    link_->Stop();
    return;
  }
  data_host_ =
      options_.advertise_address.empty() ? link_->local_address() : options_.advertise_address;
  if (data_host_.empty()) {
    link_->Drop(
        InternalError("getsockname: cannot tell the local address of the control connection"),
        Clock::now());
    return;
  }
  ChangePhase(Phase::kRegistered);
  control::AgentRegisterMsg reg;
  reg.host_id = options_.host_id;
  reg.nproc = options_.nproc;
  reg.spares = options_.spares;
  reg.address = data_host_;
  reg.pid = ::getpid();
  reg.elastic = options_.elastic;
  for (const auto& [id, pid] : live_) reg.workers.push_back({id, pid});
  reg.running = static_cast<int>(reg.workers.size());
  fence_at_.reset();
  ::nonstop::Log(
      ChatterLevel(),
      "registered with the controller at {} as host {} ({} workers, {} spares, address {}{})",
      link_->controller(), options_.host_id, options_.nproc, options_.spares, data_host_,
      reg.running > 0 ? fmt::format("; {} kept running", Processes(reg.running)) : "");
  // The register goes first, before anything else this agent sends on the connection.
  // lost: the link says so
  if (!link_->Open({{control::kMsgAgentRegister, control::Encode(reg)}}).ok()) return;
  next_heartbeat_ = Clock::now() + options_.heartbeat_interval;
  if (!leaving_.empty()) {
    SendLeaving();                    // a controller that took over learns it too
    if (launcher_->running() == 0) {  // they ended while it was cut off
      End(kExitOk, fmt::format("left the job ({}): its workers are gone", leaving_),
          /*kill_now=*/false);
    }
  }
}

void Agent::OnStart(std::string_view payload) {
  auto m = control::DecodeAgentStart(payload);
  if (!m.ok()) return Malformed(m.status().message());
  control::AgentStartedMsg reply;
  reply.worker_id = m->worker_id;
  if (auto it = live_.find(m->worker_id); it != live_.end()) {
    reply.error = fmt::format("worker {} already runs on host {} (pid {})", m->worker_id,
                              options_.host_id, it->second);
    NONSTOP_LOG_WARNING("start order refused: {}", reply.error);
    Send(control::kMsgAgentStarted, control::Encode(reply));
    return;
  }
  if (!leaving_.empty()) {
    reply.error = fmt::format("host {} is leaving the job ({})", options_.host_id, leaving_);
    NONSTOP_LOG_DEBUG("start order refused: {}", reply.error);
    Send(control::kMsgAgentStarted, control::Encode(reply));
    return;
  }
  // The order's variables, then the agent's own four, which win. The order's
  // structured fields say which worker it is: they win over its variables.
  std::map<std::string, std::string> env;
  for (const auto& [name, value] : m->env) {
    if (!IsAgentVariable(name)) env[name] = value;
  }
  const std::string id_text = std::to_string(m->worker_id);
  namespace s = settings;
  const std::string worker_id(s::kWorkerId.env);
  if (auto it = env.find(worker_id); it != env.end() && it->second != id_text) {
    NONSTOP_LOG_WARNING("start order for worker {} says {}={}: using {}", m->worker_id, worker_id,
                        it->second, id_text);
  }
  env[worker_id] = id_text;
  env[std::string(s::kSpare.env)] = m->spare ? "1" : "0";
  env[std::string(s::kControllerAddress.env)] = link_->controller();
  if (!options_.etcd.empty()) {
    env[std::string(s::kEtcd.env)] = options_.etcd;
    env[std::string(s::kEtcdJob.env)] = options_.etcd_job;
    // who leads, as this agent's watch sees it: the workers read it instead of asking etcd
    env[std::string(s::kLeaderFile.env)] = leader_file_;
    // etcd's TLS and user, should a worker ask etcd itself: paths, no secret
    const etcd::Security& sec = options_.etcd_security;
    for (const auto& [name, value] :
         {std::pair{s::kEtcdCacert.env, &sec.ca_file}, std::pair{s::kEtcdCert.env, &sec.cert_file},
          std::pair{s::kEtcdKey.env, &sec.key_file},
          std::pair{s::kEtcdAuthFile.env, &sec.auth_file}}) {
      if (!value->empty()) env[std::string(name)] = *value;
    }
    if (sec.allow_plaintext) env[std::string(s::kEtcdAllowPlaintext.env)] = "1";
  }
  env[std::string(s::kHostId.env)] = options_.host_id;
  env[std::string(s::kDataHost.env)] = data_host_;
  if (!options_.data_ports.empty()) env[std::string(s::kDataPorts.env)] = options_.data_ports;
  AddTorchrunVariables(m->worker_id, &env);
  launcher::ChildSpec spec;
  spec.worker_id = m->worker_id;
  spec.argv = options_.program;
  spec.nice = m->nice;
  // The worker's credential (its keys, never the job token: role_keys.h), in a memfd, not the
  // environment: the program's children never see it (docs/security.md).
  spec.secret =
      EncodeWorkerCredential(WorkerKeysOf(crypto::JobKey(options_.job_token), m->worker_id));
  spec.run_as = options_.run_as;
  for (auto& [name, value] : env) spec.env.emplace_back(name, value);
  // The job's identity comes from the order alone: what the agent itself
  // inherited (a NONSTOP_RESUME, a checkpoint directory) never reaches a worker.
  spec.unset = launcher::kJobVariables;
  if (!options_.log_dir.empty())
    spec.log_file = fmt::format("{}/worker-{}.log", options_.log_dir, m->worker_id);
  // Slurm signals every process of the step: the host's leave is the agent's to carry out.
  if (options_.handle_signals && LeavesOnSigterm()) spec.ignore_signals = {SIGTERM, SIGUSR1};
  auto pid = launcher_->Spawn(spec);
  if (!pid.ok()) {
    reply.error = pid.status().ToString();
    NONSTOP_LOG_WARNING("cannot start worker {}: {}", m->worker_id, reply.error);
  } else {
    reply.pid = *pid;
    live_[m->worker_id] = *pid;
    ::nonstop::Log(ChatterLevel(), "started worker {}{} as pid {}", m->worker_id,
                   m->spare ? " (spare)" : "", *pid);
  }
  Send(control::kMsgAgentStarted, control::Encode(reply));
}

// torchrun's variables of this host (the order brings the job's and the rank's): MASTER_PORT and
// OMP_NUM_THREADS (launcher::AddTorchrunHostVariables), and TORCHELASTIC_ERROR_FILE, where
// nonstop's Python package writes a failure of the script in torchelastic's format
// (docs/python.md, "The environment contract").
void Agent::AddTorchrunVariables(int worker_id, std::map<std::string, std::string>* env) const {
  launcher::AddTorchrunHostVariables(env);
  if (!error_dir_.empty()) {
    (*env)["TORCHELASTIC_ERROR_FILE"] =
        fmt::format("{}/error-worker-{}.json", error_dir_, worker_id);
  }
}

void Agent::OnSignal(std::string_view payload) {
  auto m = control::DecodeAgentSignal(payload);
  if (!m.ok()) return Malformed(m.status().message());
  if (!live_.count(m->worker_id)) {
    NONSTOP_LOG_DEBUG("signal {} for worker {}, which does not run here: ignored", m->signal,
                      m->worker_id);
    return;
  }
  NONSTOP_LOG_DEBUG("signal {} to worker {}", m->signal, m->worker_id);
  launcher_->Signal(m->worker_id, m->signal);
}

void Agent::OnRenice(std::string_view payload) {
  auto m = control::DecodeAgentRenice(payload);
  if (!m.ok()) return Malformed(m.status().message());
  if (!live_.count(m->worker_id)) {
    NONSTOP_LOG_DEBUG("renice of worker {}, which does not run here: ignored", m->worker_id);
    return;
  }
  if (Status s = launcher_->Renice(m->worker_id, m->nice); !s.ok()) {
    NONSTOP_LOG_WARNING("renice of worker {} to {}: {}", m->worker_id, m->nice, s.ToString());
  }
}

void Agent::Malformed(const std::string& why) {
  std::string text = "malformed order from the controller: " + why;
  // Logged once: the same bad order after every reconnect is one line, not a flood.
  bool repeat = text == last_malformed_;
  last_malformed_ = text;
  // Garbage: a controller that keeps sending a bad order is not redialed in a tight loop.
  link_->Drop(InvalidArgumentError(text), Clock::now());
  Lose(text, /*log=*/!repeat);
}

void Agent::Lose(const std::string& why, bool log) {
  if (phase_ != Phase::kRegistered) {
    link_->Stop();  // kEnding: the job is over anyway
    return;
  }
  int running = launcher_->running();
  Deadline now = Clock::now();
  std::string line =
      running == 0
          ? fmt::format("cut off from the controller at {}: {}; dialing again", link_->controller(),
                        why)
          : fmt::format(
                "cut off from the controller at {}: {}; its {} keep running, dialing again "
                "(fencing them in "
                "{} if no controller answers)",
                link_->controller(), why, Processes(running), Seconds(options_.fence_after));
  if (log) {
    NONSTOP_LOG_WARNING("{}", line);
  } else {
    NONSTOP_LOG_DEBUG("{}", line);
  }
  fence_at_ = now + options_.fence_after;
  reconnect_deadline_ =
      running == 0 ? now + options_.join_timeout : *fence_at_ + options_.join_timeout;
  link_->set_give_up_at(reconnect_deadline_);
  ChangePhase(Phase::kDialing);
}

void Agent::Fence() {
  fence_at_.reset();
  int running = launcher_->running();
  NONSTOP_LOG_WARNING("no controller for {} ({}): killing its {} (fencing); dialing on",
                      Seconds(options_.fence_after), link_->last_error(), Processes(running));
  link_->Stop();
  launcher_->SignalAll(SIGKILL);
  reconnect_deadline_ = Clock::now() + options_.join_timeout;
  ChangePhase(Phase::kFenced);  // dials again once they are reaped
}

bool Agent::Send(uint16_t type, const std::string& payload) {
  if (phase_ != Phase::kRegistered && phase_ != Phase::kEnding) return false;
  // An overflow or a broken connection is a loss, which the link reports at its next turn.
  return link_->Send(type, payload).ok();
}

void Agent::End(int code, const std::string& message, bool kill_now) {
  if (phase_ == Phase::kEnding) return;  // the first end stands
  exit_code_ = code;
  exit_message_ = message;
  if (code == kExitOk) {
    ::nonstop::Log(ChatterLevel(), "{}", message);
  } else if (code == kExitInterrupted) {
    NONSTOP_LOG_WARNING("{}", message);
  } else {
    NONSTOP_LOG_ERROR("{}", message);
  }
  // A registered connection stays open: the exits of its processes are still reported.
  if (phase_ != Phase::kRegistered) link_->Stop();
  ChangePhase(Phase::kEnding);
  Deadline now = Clock::now();
  kill_at_ = kill_now ? now : now + options_.stop_grace;
  graceful_ = !kill_now;
}

void Agent::OnChildExit(int worker_id, pid_t pid, int exit_code, int signal) {
  live_.erase(worker_id);
  if (phase_ == Phase::kRegistered) {
    if (signal != 0) {
      ::nonstop::Log(ChatterLevel(), "worker {} (pid {}) was killed by signal {}", worker_id, pid,
                     signal);
    } else {
      ::nonstop::Log(ChatterLevel(), "worker {} (pid {}) exited with code {}", worker_id, pid,
                     exit_code);
    }
  }
  if (phase_ == Phase::kRegistered || phase_ == Phase::kEnding) {
    Send(control::kMsgAgentExited,
         control::Encode(control::AgentExitedMsg{worker_id, pid, exit_code, signal}));
  }
  if (!leaving_.empty() && live_.empty() && phase_ == Phase::kRegistered) {
    End(kExitOk, fmt::format("left the job ({}): its workers were released", leaving_),
        /*kill_now=*/false);
  }
}

void Agent::OnChildDying(int worker_id, pid_t pid) {
  ::nonstop::Log(ChatterLevel(), "worker {} (pid {}) is dying (its lifeline fired)", worker_id,
                 pid);
  if (phase_ == Phase::kRegistered || phase_ == Phase::kEnding) {
    Send(control::kMsgAgentDying, control::Encode(control::AgentDyingMsg{worker_id, pid}));
  }
}

void Agent::OnChildStop(int worker_id, pid_t pid, int signal) {
  NONSTOP_LOG_INFO("worker {} (pid {}) was stopped by signal {}", worker_id, pid, signal);
  if (phase_ == Phase::kRegistered || phase_ == Phase::kEnding) {
    Send(control::kMsgAgentStopped,
         control::Encode(control::AgentStoppedMsg{worker_id, pid, signal}));
  }
}

}  // namespace nonstop::agent
