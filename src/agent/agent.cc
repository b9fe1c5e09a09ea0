#include "agent/agent.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
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

#include "common/logging.h"
#include "nonstop/settings.h"
#include "common/signals.h"
#include "control/messages.h"
#include "coord/leadership.h"
#include "net/handshake.h"
#include "net/socket.h"

namespace nonstop::agent {

namespace {

// An order is a few KiB at most (64 variables of ≤ 4 KiB each is the decoder's bound).
constexpr uint32_t kMaxOrderBytes = 1u << 20;
// The loop never sleeps longer than this: PollStopped's cadence.
constexpr Millis kTick{50};
// After the SIGKILL at the end, how long to wait for the processes to be reaped.
constexpr Millis kReapGrace{5'000};

// strerror with a lower-case first letter, to sit inside a sentence.
std::string ErrText(int err) {
  std::string s = std::strerror(err);
  if (!s.empty()) s[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(s[0])));
  return s;
}

std::string Seconds(Millis d) { return fmt::format("{:g} s", static_cast<double>(d.count()) / 1000.0); }

std::string LocalAddress(int fd) {
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return "";
  char text[INET_ADDRSTRLEN] = {};
  if (::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) == nullptr) return "";
  return text;
}

std::string Processes(int n) { return fmt::format("{} process{}", n, n == 1 ? "" : "es"); }

bool IsAgentVariable(std::string_view name) {
  namespace s = settings;
  return name == s::kControllerAddress.env || name == s::kJobToken.env || name == s::kHostId.env ||
         name == s::kDataHost.env || name == s::kEtcd.env || name == s::kEtcdJob.env;
}

}  // namespace

Status ValidateOptions(const AgentOptions& o) {
  if (o.etcd.empty() || !o.controller.empty()) {
    auto where = net::ParseHostPort(o.controller);
    if (!where.ok()) return InvalidArgumentError("controller address: " + where.status().message());
    if (where->port == 0) return InvalidArgumentError(fmt::format("controller address '{}' has port 0", o.controller));
  }
  if (!o.etcd.empty()) {
    auto c = etcd::Client::Create(o.etcd);
    if (!c.ok()) return InvalidArgumentError(c.status().message());
    NONSTOP_RETURN_IF_ERROR(coord::CheckJobName(o.etcd_job));
  }
  if (o.job_token.empty()) return InvalidArgumentError("the job token is empty");
  if (Status s = control::CheckHostId(o.host_id); !s.ok()) {
    return InvalidArgumentError(fmt::format("host id '{}': {}", o.host_id, s.message()));
  }
  if (o.program.empty()) return InvalidArgumentError("no program to run (it goes after `--`)");
  if (o.nproc < 0 || o.nproc > 1024) return InvalidArgumentError(fmt::format("nproc {} is not in [0, 1024]", o.nproc));
  if (o.spares < 0 || o.spares > 1024) {
    return InvalidArgumentError(fmt::format("spares {} is not in [0, 1024]", o.spares));
  }
  if (o.advertise_address.size() > 255) return InvalidArgumentError("the advertise address is over 255 characters");
  if (o.join_timeout <= Millis(0) || o.controller_timeout <= Millis(0) || o.fence_after <= Millis(0) || o.heartbeat_interval <= Millis(0) ||
      o.backoff_initial <= Millis(0) || o.backoff_max < o.backoff_initial || o.stop_grace < Millis(0)) {
    return InvalidArgumentError("timeouts must be positive, and backoff_max at least backoff_initial");
  }
  if (o.max_queued_bytes < 64 * 1024) return InvalidArgumentError("max_queued_bytes must be at least 64 KiB");
  return OkStatus();
}

Result<std::string> ReadJobTokenFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return ErrnoStatus(StatusCode::kInvalidArgument, fmt::format("job token file '{}'", path), errno);
  }
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(fmt::format("job token file '{}' is not a file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) return InvalidArgumentError(fmt::format("job token file '{}' cannot be read", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return InvalidArgumentError(fmt::format("job token file '{}' cannot be read", path));
  std::string token = ss.str();
  auto space = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!token.empty() && space(static_cast<unsigned char>(token.back()))) token.pop_back();
  size_t start = 0;
  while (start < token.size() && space(static_cast<unsigned char>(token[start]))) ++start;
  token.erase(0, start);
  if (token.empty()) return InvalidArgumentError(fmt::format("job token file '{}' is empty", path));
  if (token.size() > 1024) {
    return InvalidArgumentError(fmt::format("job token file '{}' holds {} bytes: not a job token", path, token.size()));
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    NONSTOP_LOG_WARNING("job token file '{}' may be read by group or others (mode {:o}); HINT: chmod 600 {}", path,
                        st.st_mode & 0777, path);
  }
  return token;
}

Agent::Agent(AgentOptions options)
    : options_(std::move(options)), decoder_(kMaxOrderBytes), rng_(std::random_device{}()) {
  controller_ = options_.controller;
  Status s = ValidateOptions(options_);
  NONSTOP_CHECK(s.ok()) << s.ToString();
  wake_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  NONSTOP_CHECK(wake_fd_.valid()) << "eventfd: " << std::strerror(errno);
}

Agent::~Agent() {
  CloseConnection();
  launcher_.reset();
}

void Agent::Stop() {
  stop_requested_.store(true);
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
  (void)n;
}

const char* Agent::PhaseName(Phase p) {
  switch (p) {
    case Phase::kDialing: return "dialing";
    case Phase::kConnecting: return "connecting";
    case Phase::kHandshake: return "handshake";
    case Phase::kRegistered: return "registered";
    case Phase::kFenced: return "fenced";
    case Phase::kEnding: return "ending";
  }
  return "?";
}

void Agent::ChangePhase(Phase next) {
  // /*from=*/ any but kEnding /*to=*/ any; kEnding is final.
  NONSTOP_CHECK(phase_ != Phase::kEnding || next == Phase::kEnding) << "agent: left kEnding for " << PhaseName(next);
  if (next != phase_) NONSTOP_LOG_DEBUG("{} -> {}", PhaseName(phase_), PhaseName(next));
  phase_ = next;
}

int Agent::Run() {
  NONSTOP_CHECK(!ran_) << "Agent::Run() is called once";
  ran_ = true;
  if (options_.handle_signals) {
    sigset_t mask = BlockTerminationSignals({SIGUSR1});  // sbatch --signal=USR1@N: the grace time is about to start
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
      [this](int worker_id, pid_t pid, int code, int sig) { OnChildExit(worker_id, pid, code, sig); },
      [this](int worker_id, pid_t pid, int sig) { OnChildStop(worker_id, pid, sig); },
      options_.out != nullptr ? options_.out : own_out_.get(), options_.err != nullptr ? options_.err : own_err_.get());

  Deadline now = Clock::now();
  reconnect_deadline_ = now + options_.join_timeout;
  next_dial_at_ = now;
  next_poll_stopped_ = now + kTick;
  backoff_ = options_.backoff_initial;
  while (true) {
    // Sleep until the next timer, never longer than one tick. The sockets are
    // read before the timers run, so bytes that arrived while this process
    // was not scheduled count before the silence check.
    now = Clock::now();
    Deadline wake = std::min(next_poll_stopped_, now + kTick);
    switch (phase_) {
      case Phase::kDialing: wake = std::min({wake, next_dial_at_, reconnect_deadline_}); break;
      case Phase::kConnecting:
      case Phase::kHandshake: wake = std::min(wake, attempt_deadline_); break;
      case Phase::kRegistered: wake = std::min({wake, next_heartbeat_, last_heard_ + options_.controller_timeout}); break;
      case Phase::kFenced: wake = std::min(wake, reconnect_deadline_); break;
      case Phase::kEnding: wake = std::min(wake, killed_ ? give_up_at_ : kill_at_); break;
    }
    loop_.RunOnce(std::chrono::ceil<Millis>(std::max(wake - now, Clock::duration::zero())));
    if (stop_requested_.exchange(false)) {
      if (phase_ == Phase::kEnding) {
        kill_at_ = Clock::now();
      } else {
        End(kExitInterrupted, "stopped: killing its processes", /*kill_now=*/true);
      }
    }
    Tick();
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
      NONSTOP_LOG_WARNING("{} not reaped {} after SIGKILL", Processes(launcher_->running()), Seconds(kReapGrace));
      break;
    }
  }
  CloseConnection();
  launcher_.reset();  // nothing runs now (or SIGKILLed processes that would not die: waited for here)
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
      NONSTOP_LOG_WARNING("{}: this host leaves the job; asked the controller to release its {} at the next step "
                          "boundary (a second SIGTERM, or SIGINT, kills them now)",
                          name, Processes(running));
      SendLeaving();
    } else {
      // Cut off: the controller it reaches next (this one again, or one that
      // took over) is asked when it registers.
      NONSTOP_LOG_WARNING("{}: this host leaves the job; its {} wait for a controller to release them (a second "
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
      fmt::format("interrupted by {}{}: killing its processes", name,
                  leaving_.empty() ? "" : fmt::format(" (after {}, while its workers waited for their release)",
                                                      leaving_)),
      /*kill_now=*/true);
}

void Agent::SendLeaving() { Send(control::kMsgAgentLeaving, control::Encode(control::AgentLeavingMsg{leaving_})); }

void Agent::Tick() {
  Deadline now = Clock::now();
  if (now >= next_poll_stopped_) {
    launcher_->PollStopped();  // frozen processes, seen within one tick
    next_poll_stopped_ = now + kTick;
  }
  if (fence_at_ && now >= *fence_at_ && (phase_ == Phase::kDialing || phase_ == Phase::kConnecting ||
                                          phase_ == Phase::kHandshake)) {
    Fence();
  }
  switch (phase_) {
    case Phase::kDialing:
      if (now >= reconnect_deadline_) {
        End(kExitControllerLost, Describe(last_error_.empty() ? "no dial finished" : last_error_), true);
      } else if (now >= next_dial_at_) {
        Dial();
      }
      break;
    case Phase::kConnecting:
    case Phase::kHandshake:
      if (now >= attempt_deadline_) {
        DialFailed(phase_ == Phase::kConnecting ? "connection timed out"
                                                : "the controller did not answer the hello in time");
      }
      break;
    case Phase::kRegistered:
      if (now - last_heard_ >= options_.controller_timeout) {
        Lose(fmt::format("the controller was silent for {} ms",
                         std::chrono::duration_cast<Millis>(now - last_heard_).count()));
      } else if (now >= next_heartbeat_) {
        Send(control::kMsgAgentHeartbeat, control::Encode(control::AgentHeartbeatMsg{launcher_->running()}));
        next_heartbeat_ = now + options_.heartbeat_interval;
      }
      break;
    case Phase::kFenced:
      if (launcher_->running() == 0) {
        DialAgain(now);  // every process is gone: only now may this host take part again
      } else if (now >= reconnect_deadline_) {
        End(kExitControllerLost,
            Describe(fmt::format("{} ({} not reaped yet)", last_error_, Processes(launcher_->running()))), true);
      }
      break;
    case Phase::kEnding:
      break;
  }
}

void Agent::Dial() {
  NONSTOP_CHECK(!conn_.valid());
  if (!options_.etcd.empty()) {
    // Who leads now (a short blocking read: etcd is near, and nothing else waits while no controller leads).
    if (!etcd_) etcd_ = std::move(etcd::Client::Create(options_.etcd, {Millis(300)}).value());  // valid: ValidateOptions
    int job_exit = 1;
    auto leader = coord::LookUpLeader(*etcd_, options_.etcd_job, &job_exit);
    if (!leader.ok()) {
      if (leader.status().code() == StatusCode::kAborted) {
        // The job ended while this agent looked for its controller: nobody will tell it otherwise.
        End(job_exit >= 0 && job_exit <= 255 ? job_exit : 1, leader.status().message(), /*kill_now=*/false);
        return;
      }
      DialFailed(leader.status().message());
      if (leader.status().code() == StatusCode::kNotFound) {
        // Nobody leads yet: etcd is cheap to ask, so ask often (a standby leads within its lease).
        backoff_ = options_.backoff_initial;
        next_dial_at_ = std::min(Clock::now() + Millis(200), reconnect_deadline_);
      }
      return;
    }
    if (!net::ParseHostPort(*leader).ok()) {
      DialFailed(fmt::format("etcd names '{}' as the leader: not host:port", *leader));
      return;
    }
    controller_ = *leader;
  }
  auto where = net::ParseHostPort(controller_);  // valid: checked by ValidateOptions (or just above)
  auto addr = net::Resolve(*where);
  if (!addr.ok()) {
    DialFailed(addr.status().message());
    return;
  }
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    DialFailed("socket: " + ErrText(errno));
    return;
  }
  net::ConfigureStreamSocket(fd.get());
  int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(sockaddr_in));
  int err = rc == 0 ? 0 : errno;
  if (err != 0 && err != EINPROGRESS) {
    DialFailed(ErrText(err));
    return;
  }
  conn_ = std::move(fd);
  attempt_deadline_ = std::min(Clock::now() + options_.controller_timeout, reconnect_deadline_);
  ChangePhase(Phase::kConnecting);
  loop_.Watch(conn_.get(), POLLOUT, [this](short revents) { OnSocketEvent(revents); });
  // A connect that completed at once (loopback can) is seen by the POLLOUT on the next turn.
}

void Agent::OnConnectReady() {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(conn_.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) {
    DialFailed(ErrText(err));
    return;
  }
  data_host_ = options_.advertise_address.empty() ? LocalAddress(conn_.get()) : options_.advertise_address;
  if (data_host_.empty()) {
    DialFailed("getsockname: cannot tell the local address of the control connection");
    return;
  }
  ChangePhase(Phase::kHandshake);
  attempt_deadline_ = std::min(Clock::now() + options_.controller_timeout, reconnect_deadline_);
  last_heard_ = Clock::now();
  net::Hello hello;
  hello.kind = net::ConnectionKind::kAgent;
  hello.generation = 0;
  hello.worker_id = 0;
  hello.job_token = options_.job_token;
  loop_.SetEvents(conn_.get(), POLLIN);
  Send(net::kFrameHello, net::EncodeHello(hello));
}

void Agent::DialFailed(const std::string& why) {
  CloseConnection();
  last_error_ = why;
  Deadline now = Clock::now();
  NONSTOP_LOG_DEBUG("dialing the controller at {}: {}", controller_, why);
  if (now >= reconnect_deadline_) {
    End(kExitControllerLost, Describe(why), true);
    return;
  }
  std::uniform_int_distribution<int64_t> jitter(0, backoff_.count() / 2);
  next_dial_at_ = std::min(now + backoff_ + Millis(jitter(rng_)), reconnect_deadline_);
  backoff_ = std::min(backoff_ * 2, options_.backoff_max);
  ChangePhase(Phase::kDialing);
}

std::string Agent::Describe(const std::string& error) const {
  return fmt::format("cannot reach the controller at {} within {}: {}", controller_,
                     Seconds(options_.join_timeout), error);
}

void Agent::OnSocketEvent(short revents) {
  if (!conn_.valid()) return;
  if (phase_ == Phase::kConnecting) {
    OnConnectReady();
    return;
  }
  if ((revents & POLLOUT) && !Flush()) return;
  if (revents & (POLLIN | POLLHUP | POLLERR)) OnReadable();
}

void Agent::OnReadable() {
  char buf[64 << 10];
  ssize_t n = ::recv(conn_.get(), buf, sizeof(buf), 0);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {
    std::string why = n == 0 ? "the controller closed the connection" : "recv: " + ErrText(errno);
    if (phase_ == Phase::kHandshake) {
      DialFailed(why + " during the hello");
    } else if (phase_ == Phase::kRegistered) {
      Lose(why);
    } else {
      CloseConnection();  // kEnding: the job is over anyway
    }
    return;
  }
  last_heard_ = Clock::now();
  Status s = decoder_.Feed(std::string_view(buf, static_cast<size_t>(n)));
  // Frames decoded before a corrupt one are still carried out (the decoder keeps them).
  const int fd = conn_.get();
  while (conn_.valid() && conn_.get() == fd) {
    auto frame = decoder_.Next();
    if (!frame) break;
    HandleFrame(*frame);
  }
  if (!s.ok() && conn_.valid() && conn_.get() == fd) {
    std::string why = "corrupt frame: " + s.message();
    if (phase_ == Phase::kHandshake) {
      DialFailed(why);
    } else if (phase_ == Phase::kRegistered) {
      Malformed(why);
    } else {
      CloseConnection();
    }
  }
}

void Agent::HandleFrame(const net::Frame& f) {
  switch (phase_) {
    case Phase::kHandshake:
      OnHelloAck(f);
      return;
    case Phase::kEnding:
      if (f.type != control::kMsgPing) NONSTOP_LOG_DEBUG("order of type {} after the end: ignored", f.type);
      return;
    case Phase::kRegistered:
      break;
    default:
      return;
  }
  switch (f.type) {
    case control::kMsgPing: {
      auto m = control::DecodePing(f.payload);
      if (!m.ok()) return Malformed(m.status().message());
      if (m->epoch < epoch_) {
        // A deposed leader (paused past its lease, or cut off from etcd): none of its orders is carried out.
        return Lose(fmt::format("the controller at {} is of epoch {}, older than epoch {} that led already: a deposed "
                                "leader, not followed",
                                controller_, m->epoch, epoch_));
      }
      epoch_ = m->epoch;
      return;
    }
    case control::kMsgShutdown: {
      auto m = control::DecodeShutdown(f.payload);
      if (!m.ok()) return Malformed(m.status().message());
      consecutive_malformed_ = 0;
      // A process exit status holds 0-255; any other code still means a failure.
      int code = m->exit_code >= 0 && m->exit_code <= 255 ? m->exit_code : 1;
      End(code, fmt::format("the controller ended this agent (exit code {}): {}", m->exit_code, m->reason),
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
      consecutive_malformed_ = 0;
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
    return it != ranks_.end() ? fmt::format("[rank {}] ", it->second) : fmt::format("[worker {}] ", worker_id);
  }
  return it != ranks_.end() ? fmt::format("[{} rank {}] ", options_.host_id, it->second)
                            : fmt::format("[{} w{}] ", options_.host_id, worker_id);
}

void Agent::OnHelloAck(const net::Frame& f) {
  if (f.type != net::kFrameHelloAck || f.payload.empty()) {
    DialFailed(fmt::format("the peer at {} is not a nonstop controller: expected a hello ack, got frame type {}",
                           controller_, f.type));
    return;
  }
  if (f.payload[0] != 1) {
    std::string reason = f.payload.substr(1);
    CloseConnection();
    End(kExitRefused, fmt::format("the controller at {} refused this agent: {}", controller_, reason),
        /*kill_now=*/true);
    return;
  }
  ChangePhase(Phase::kRegistered);
  backoff_ = options_.backoff_initial;
  last_error_.clear();
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
  ::nonstop::Log(ChatterLevel(), "registered with the controller at {} as host {} ({} workers, {} spares, address {}{})",
                   controller_, options_.host_id, options_.nproc, options_.spares, data_host_,
                   reg.running > 0 ? fmt::format("; {} kept running", Processes(reg.running)) : "");
  if (!Send(control::kMsgAgentRegister, control::Encode(reg))) return;
  next_heartbeat_ = Clock::now() + options_.heartbeat_interval;
  if (!leaving_.empty()) {
    SendLeaving();  // a controller that took over learns it too
    if (launcher_->running() == 0) {  // they ended while it was cut off
      End(kExitOk, fmt::format("left the job ({}): its workers are gone", leaving_), /*kill_now=*/false);
    }
  }
}

void Agent::OnStart(std::string_view payload) {
  auto m = control::DecodeAgentStart(payload);
  if (!m.ok()) return Malformed(m.status().message());
  consecutive_malformed_ = 0;
  control::AgentStartedMsg reply;
  reply.worker_id = m->worker_id;
  if (auto it = live_.find(m->worker_id); it != live_.end()) {
    reply.error = fmt::format("worker {} already runs on host {} (pid {})", m->worker_id, options_.host_id, it->second);
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
    NONSTOP_LOG_WARNING("start order for worker {} says {}={}: using {}", m->worker_id, worker_id, it->second,
                        id_text);
  }
  env[worker_id] = id_text;
  env[std::string(s::kSpare.env)] = m->spare ? "1" : "0";
  env[std::string(s::kControllerAddress.env)] = controller_;
  if (!options_.etcd.empty()) {
    env[std::string(s::kEtcd.env)] = options_.etcd;
    env[std::string(s::kEtcdJob.env)] = options_.etcd_job;
  }
  env[std::string(s::kJobToken.env)] = options_.job_token;
  env[std::string(s::kHostId.env)] = options_.host_id;
  env[std::string(s::kDataHost.env)] = data_host_;
  launcher::ChildSpec spec;
  spec.worker_id = m->worker_id;
  spec.argv = options_.program;
  spec.nice = m->nice;
  for (auto& [name, value] : env) spec.env.emplace_back(name, value);
  // The job's identity comes from the order alone: what the agent itself
  // inherited (a NONSTOP_RESUME, a checkpoint directory) never reaches a worker.
  spec.unset = launcher::kJobVariables;
  if (!options_.log_dir.empty()) spec.log_file = fmt::format("{}/worker-{}.log", options_.log_dir, m->worker_id);
  // Slurm signals every process of the step: the host's leave is the agent's to carry out.
  if (options_.handle_signals && LeavesOnSigterm()) spec.ignore_signals = {SIGTERM, SIGUSR1};
  auto pid = launcher_->Spawn(spec);
  if (!pid.ok()) {
    reply.error = pid.status().ToString();
    NONSTOP_LOG_WARNING("cannot start worker {}: {}", m->worker_id, reply.error);
  } else {
    reply.pid = *pid;
    live_[m->worker_id] = *pid;
    ::nonstop::Log(ChatterLevel(), "started worker {}{} as pid {}", m->worker_id, m->spare ? " (spare)" : "", *pid);
  }
  Send(control::kMsgAgentStarted, control::Encode(reply));
}

void Agent::OnSignal(std::string_view payload) {
  auto m = control::DecodeAgentSignal(payload);
  if (!m.ok()) return Malformed(m.status().message());
  consecutive_malformed_ = 0;
  if (!live_.count(m->worker_id)) {
    NONSTOP_LOG_DEBUG("signal {} for worker {}, which does not run here: ignored", m->signal, m->worker_id);
    return;
  }
  NONSTOP_LOG_DEBUG("signal {} to worker {}", m->signal, m->worker_id);
  launcher_->Signal(m->worker_id, m->signal);
}

void Agent::OnRenice(std::string_view payload) {
  auto m = control::DecodeAgentRenice(payload);
  if (!m.ok()) return Malformed(m.status().message());
  consecutive_malformed_ = 0;
  if (!live_.count(m->worker_id)) {
    NONSTOP_LOG_DEBUG("renice of worker {}, which does not run here: ignored", m->worker_id);
    return;
  }
  if (Status s = launcher_->Renice(m->worker_id, m->nice); !s.ok()) {
    NONSTOP_LOG_WARNING("renice of worker {} to {}: {}", m->worker_id, m->nice, s.ToString());
  }
}

void Agent::Malformed(const std::string& why) {
  ++consecutive_malformed_;
  std::string text = "malformed order from the controller: " + why;
  // Logged once: the same bad order after every reconnect is one line, not a flood.
  bool repeat = text == last_malformed_;
  last_malformed_ = text;
  Lose(text, /*log=*/!repeat);
}

void Agent::Lose(const std::string& why, bool log) {
  if (phase_ != Phase::kRegistered) {
    CloseConnection();
    return;
  }
  int running = launcher_->running();
  Deadline now = Clock::now();
  std::string line =
      running == 0
          ? fmt::format("cut off from the controller at {}: {}; dialing again", controller_, why)
          : fmt::format("cut off from the controller at {}: {}; its {} keep running, dialing again (fencing them in "
                        "{} if no controller answers)",
                        controller_, why, Processes(running), Seconds(options_.fence_after));
  if (log) {
    NONSTOP_LOG_WARNING("{}", line);
  } else {
    NONSTOP_LOG_DEBUG("{}", line);
  }
  CloseConnection();
  last_error_ = why;
  fence_at_ = now + options_.fence_after;
  reconnect_deadline_ = running == 0 ? now + options_.join_timeout : *fence_at_ + options_.join_timeout;
  DialAgain(now);
}

void Agent::DialAgain(Deadline now) {
  ChangePhase(Phase::kDialing);
  Millis wait{0};
  if (consecutive_malformed_ > 0) {
    // A controller that keeps sending a bad order is not redialed in a tight loop.
    wait = std::min(options_.backoff_max, options_.backoff_initial * (1 << std::min(consecutive_malformed_, 8)));
  }
  next_dial_at_ = now + wait;
  backoff_ = options_.backoff_initial;
}

void Agent::Fence() {
  fence_at_.reset();
  int running = launcher_->running();
  NONSTOP_LOG_WARNING("no controller for {} ({}): killing its {} (fencing); dialing on", Seconds(options_.fence_after),
                      last_error_, Processes(running));
  CloseConnection();
  launcher_->SignalAll(SIGKILL);
  reconnect_deadline_ = Clock::now() + options_.join_timeout;
  ChangePhase(Phase::kFenced);  // dials again once they are reaped
}

void Agent::CloseConnection() {
  if (!conn_.valid()) return;
  loop_.Unwatch(conn_.get());
  conn_.Reset();
  out_.clear();
  out_sent_ = 0;
  decoder_ = net::FrameDecoder(kMaxOrderBytes);
}

bool Agent::Send(uint16_t type, const std::string& payload) {
  if (!conn_.valid() || phase_ == Phase::kConnecting) return false;
  size_t queued = out_.size() - out_sent_;
  if (queued + payload.size() + net::kFrameHeaderBytes > options_.max_queued_bytes) {
    std::string why = fmt::format("the controller is not taking its messages: {} bytes wait for it (limit {})",
                                  queued, options_.max_queued_bytes);
    if (phase_ == Phase::kRegistered) {
      Lose(why);
    } else {
      CloseConnection();
    }
    return false;
  }
  out_ += net::EncodeFrame(type, payload);
  return Flush();
}

bool Agent::Flush() {
  while (out_sent_ < out_.size()) {
    ssize_t n = ::send(conn_.get(), out_.data() + out_sent_, out_.size() - out_sent_, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      out_sent_ += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    std::string why = "send: " + (n < 0 ? ErrText(errno) : std::string("nothing written"));
    if (phase_ == Phase::kHandshake) {
      DialFailed(why);
    } else if (phase_ == Phase::kRegistered) {
      Lose(why);
    } else {
      CloseConnection();
    }
    return false;
  }
  if (out_sent_ == out_.size()) {
    out_.clear();
    out_sent_ = 0;
    loop_.SetEvents(conn_.get(), POLLIN);
  } else {
    if (out_sent_ > (1u << 20)) {  // keep the queue compact
      out_.erase(0, out_sent_);
      out_sent_ = 0;
    }
    loop_.SetEvents(conn_.get(), POLLIN | POLLOUT);
  }
  return true;
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
  if (phase_ != Phase::kRegistered) CloseConnection();
  ChangePhase(Phase::kEnding);
  Deadline now = Clock::now();
  kill_at_ = kill_now ? now : now + options_.stop_grace;
  graceful_ = !kill_now;
}

void Agent::OnChildExit(int worker_id, pid_t pid, int exit_code, int signal) {
  live_.erase(worker_id);
  if (phase_ == Phase::kRegistered) {
    if (signal != 0) {
      ::nonstop::Log(ChatterLevel(), "worker {} (pid {}) was killed by signal {}", worker_id, pid, signal);
    } else {
      ::nonstop::Log(ChatterLevel(), "worker {} (pid {}) exited with code {}", worker_id, pid, exit_code);
    }
  }
  if (phase_ == Phase::kRegistered || phase_ == Phase::kEnding) {
    Send(control::kMsgAgentExited, control::Encode(control::AgentExitedMsg{worker_id, pid, exit_code, signal}));
  }
  if (!leaving_.empty() && live_.empty() && phase_ == Phase::kRegistered) {
    End(kExitOk, fmt::format("left the job ({}): its workers were released", leaving_), /*kill_now=*/false);
  }
}

void Agent::OnChildStop(int worker_id, pid_t pid, int signal) {
  NONSTOP_LOG_INFO("worker {} (pid {}) was stopped by signal {}", worker_id, pid, signal);
  if (phase_ == Phase::kRegistered || phase_ == Phase::kEnding) {
    Send(control::kMsgAgentStopped, control::Encode(control::AgentStoppedMsg{worker_id, pid, signal}));
  }
}

}  // namespace nonstop::agent
