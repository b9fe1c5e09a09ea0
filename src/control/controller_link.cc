#include "control/controller_link.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "common/logging.h"
#include "control/messages.h"
#include "coord/etcd.h"
#include "coord/leader_watch.h"
#include "coord/leadership.h"
#include "net/abort_signal.h"

namespace nonstop::control {

namespace {

// strerror with a lower-case first letter, to sit inside a sentence.
std::string ErrText(int err) {
  std::string s = std::strerror(err);
  if (!s.empty()) s[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(s[0])));
  return s;
}

bool IsGarbage(const Status& s) {
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kDataLoss;
}

}  // namespace

Result<std::vector<net::HostPort>> ParseControllerList(std::string_view list) {
  std::vector<net::HostPort> out;
  size_t begin = 0;
  while (begin <= list.size()) {
    size_t end = std::min(list.find(',', begin), list.size());
    std::string_view one = list.substr(begin, end - begin);
    auto parsed = net::ParseHostPort(one);  // host:port or [IPv6]:port
    if (!parsed.ok()) return InvalidArgumentError("controller " + parsed.status().message());
    net::HostPort where = std::move(*parsed);
    if (where.port == 0)
      return InvalidArgumentError(fmt::format("controller address '{}' has port 0", one));
    out.push_back(std::move(where));
    begin = end + 1;
  }
  return out;
}

Millis BackoffDelay(const BackoffPolicy& policy, int failures, double u) {
  int64_t d = policy.initial.count();
  for (int i = 1; i < failures && d < policy.max.count(); ++i) d *= 2;
  d = std::min(d, policy.max.count());
  u = std::clamp(u, 0.0, 1.0);
  return Millis(d + static_cast<int64_t>(static_cast<double>(d) * policy.jitter * u));
}

const char* ControllerLink::StateName(State s) {
  switch (s) {
    case State::kIdle:
      return "idle";
    case State::kWaiting:
      return "waiting";
    case State::kConnecting:
      return "connecting";
    case State::kHello:
      return "hello";
    case State::kAccepted:
      return "accepted";
    case State::kOpen:
      return "open";
    case State::kFailed:
      return "failed";
  }
  return "?";
}

Result<std::unique_ptr<ControllerLink>> ControllerLink::Create(ControllerLinkOptions o) {
  if (o.controllers.empty() && o.etcd.empty() && o.leader_file.empty()) {
    return InvalidArgumentError(
        "no controller address, no etcd and no leader file to find the controller in");
  }
  const BackoffPolicy& b = o.backoff;
  if (o.try_timeout <= Millis(0) || o.silence_timeout <= Millis(0) ||
      o.reconnect_within <= Millis(0) || o.etcd_timeout <= Millis(0) ||
      o.leader_poll <= Millis(0) || b.initial <= Millis(0) || b.max < b.initial || b.jitter < 0 ||
      b.jitter > 1) {
    return InvalidArgumentError(
        "controller link: timeouts must be positive, the back-off's max at least its initial, its "
        "jitter in [0, 1]");
  }
  if (o.max_queued_bytes < 64 * 1024)
    return InvalidArgumentError("controller link: max_queued_bytes under 64 KiB");
  if (o.controller_public.size() != crypto::kEd25519PublicBytes) {
    return InvalidArgumentError("controller link: no controller public key");
  }
  std::vector<net::HostPort> list;
  if (!o.controllers.empty()) {
    auto parsed = ParseControllerList(o.controllers);
    if (!parsed.ok()) return parsed.status();  // "controller address '…': what is wrong"
    list = std::move(*parsed);
  }
  std::unique_ptr<etcd::Client> etcd;
  if (!o.etcd.empty() && o.leader_file.empty()) {
    NONSTOP_RETURN_IF_ERROR(coord::CheckJobName(o.etcd_job));
    auto c = etcd::Client::Create(o.etcd, {o.etcd_timeout, o.etcd_security});
    if (!c.ok()) return InvalidArgumentError(c.status().message());
    etcd = std::move(*c);
  }
  auto link = std::unique_ptr<ControllerLink>(new ControllerLink(std::move(o)));
  link->wake_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!link->wake_fd_.valid()) return ErrnoStatus(StatusCode::kInternal, "eventfd", errno);
  link->list_ = std::move(list);
  link->etcd_ = std::move(etcd);
  if (!link->options_.leader_file.empty()) {
    link->leader_file_ = std::make_unique<coord::LeaderFileReader>(
        link->options_.leader_file, link->options_.etcd_job, link->options_.controller_public);
  }
  if (!link->list_.empty()) link->controller_ = link->list_[0].ToString();
  return link;
}

ControllerLink::ControllerLink(ControllerLinkOptions options)
    : options_(std::move(options)), decoder_(options_.max_frame_bytes) {
  random_ = options_.random;
  if (!random_) {
    random_ = [rng = std::mt19937(std::random_device{}()),
               u = std::uniform_real_distribution<double>(0, 1)]() mutable { return u(rng); };
  }
}

ControllerLink::~ControllerLink() {
  CloseConnection();
  if (loop_ != nullptr) loop_->Unwatch(wake_fd_.get());
}

void ControllerLink::Attach(net::EventLoop* loop, std::function<void()> pump) {
  NONSTOP_CHECK(loop_ == nullptr && loop != nullptr) << "ControllerLink::Attach is called once";
  loop_ = loop;
  pump_ = std::move(pump);
  loop_->Watch(wake_fd_.get(), POLLIN, [this](short) {
    Advance(0, Clock::now());
    pump_();
  });
  if (fd_ >= 0) {
    loop_->Watch(fd_, events(), [this](short revents) {
      Advance(revents, Clock::now());
      pump_();
    });
  }
}

void ControllerLink::ChangeState(State next) {
  // /*from=*/ any /*to=*/ kIdle; kFailed is left only for kIdle; kIdle only for kWaiting.
  NONSTOP_CHECK(next == State::kIdle || state_ != State::kFailed)
      << "controller link: left failed for " << StateName(next);
  NONSTOP_CHECK(state_ != State::kIdle || next == State::kWaiting || next == State::kIdle)
      << "controller link: left idle for " << StateName(next);
  if (next != state_)
    NONSTOP_LOG_DEBUG("controller link: {} -> {}", StateName(state_), StateName(next));
  state_ = next;
}

bool ControllerLink::FromEtcd() const {
  return (etcd_ != nullptr || leader_file_ != nullptr) &&
         (list_.empty() || !options_.list_first || ever_accepted_);
}

double ControllerLink::Random() { return random_(); }

void ControllerLink::Start(Deadline give_up_at, Deadline now) {
  NONSTOP_CHECK(state_ == State::kIdle)
      << "controller link: Start() in state " << StateName(state_);
  give_up_at_ = give_up_at;
  next_try_at_ = now;
  failed_tries_ = 0;
  tried_in_round_ = 0;
  last_status_ = OkStatus();
  last_error_.clear();
  ChangeState(State::kWaiting);
  Rewatch();
}

void ControllerLink::Stop() {
  events_.clear();
  losing_ = false;
  took_frame_ = false;
  CloseConnection();
  ChangeState(State::kIdle);
}

short ControllerLink::events() const {
  switch (state_) {
    case State::kConnecting:
      return POLLOUT;
    case State::kHello:
    case State::kAccepted:
    case State::kOpen: {
      if (losing_) return 0;
      MutexLock lock(&mu_);
      return static_cast<short>(POLLIN | (out_sent_ < out_.size() ? POLLOUT : 0));
    }
    default:
      return 0;
  }
}

Deadline ControllerLink::wake_at() const {
  if (!events_.empty()) return Deadline{};  // at once: the owner takes them
  switch (state_) {
    case State::kWaiting:
      return std::min(next_try_at_, give_up_at_);
    case State::kConnecting:
    case State::kHello:
      return try_deadline_;
    case State::kAccepted:
    case State::kOpen:
      return last_heard_ + options_.silence_timeout;
    default:
      return kNoDeadline;
  }
}

// The numeric host of this end ("10.0.0.1", "fd00::1": no brackets, no port), IPv4 or IPv6.
std::string ControllerLink::local_address() const {
  if (fd_ < 0) return "";
  Result<net::HostPort> local = net::LocalAddressOf(fd_);
  return local.ok() ? local->host : "";
}

void ControllerLink::Advance(short revents, Deadline now) {
  DrainWake();
  if (!losing_) {
    switch (state_) {
      case State::kIdle:
      case State::kFailed:
        break;
      case State::kWaiting:
        if (now >= give_up_at_) {
          Fail(last_status_.ok() ? UnavailableError("no dial finished") : last_status_);
        } else if (now >= next_try_at_) {
          BeginTry(now);
        }
        break;
      case State::kConnecting:
        if (revents != 0) {
          OnConnected(now);
        } else if (now >= try_deadline_) {
          TryFailed(UnavailableError("connection timed out"), now);
        }
        break;
      case State::kHello:
      case State::kAccepted:
      case State::kOpen:
        Exchange(revents, now);
        break;
    }
  }
  Rewatch();
}

// One try: the address (the list's next, or etcd's leader), then a
// non-blocking connect.
void ControllerLink::BeginTry(Deadline now) {
  waiting_for_leader_ = false;
  try_from_etcd_ = FromEtcd();
  named_by_etcd_ = false;
  if (!try_from_etcd_) {
    controller_ = list_[next_].ToString();
    Connect(list_[next_], now);
    return;
  }
  int job_exit = 1;
  // The host's agent watches etcd and keeps the file: a local read, no request to etcd.
  Result<std::string> leader =
      leader_file_ != nullptr
          ? leader_file_->Read(&job_exit)
          : coord::LookUpLeader(*etcd_, options_.etcd_job, &job_exit, &options_.controller_public);
  if (!leader.ok()) {
    switch (leader.status().code()) {
      case StatusCode::kAborted:  // the job ended while no controller led: final
        job_exit_code_ = job_exit >= 0 && job_exit <= 255 ? job_exit : 1;
        return Fail(leader.status());
      case StatusCode::kNotFound:  // nobody leads yet: a standby leads within its lease
        return WaitForLeader(leader.status(), now);
      default:
        return TryFailed(leader.status(), now);
    }
  }
  auto where = net::ParseHostPort(*leader);
  if (!where.ok() || where->port == 0) {
    return TryFailed(
        UnavailableError(fmt::format("{} names '{}' as the leader: {}",
                                     leader_file_ != nullptr ? leader_file_->path() : "etcd",
                                     *leader, where.ok() ? "port 0" : where.status().message())),
        now);
  }
  controller_ = *leader;
  named_by_etcd_ = true;
  Connect(*where, now);
}

void ControllerLink::Connect(const net::HostPort& where, Deadline now) {
  auto addr = net::Resolve(where);  // IPv4 or IPv6: a name's first address
  if (!addr.ok()) return TryFailed(addr.status(), now);
  UniqueFd fd(::socket(addr->family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return TryFailed(UnavailableError("socket: " + ErrText(errno)), now);
  net::ConfigureStreamSocket(fd.get());
  int rc = ::connect(fd.get(), addr->get(), addr->length);
  int err = rc == 0 ? 0 : errno;
  if (err != 0 && err != EINPROGRESS) return TryFailed(UnavailableError(ErrText(err)), now);
  InstallConnection(std::move(fd));
  try_deadline_ = std::min(now + options_.try_timeout, give_up_at_);
  // A connect that completed at once (loopback can) shows as POLLOUT.
  ChangeState(State::kConnecting);
}

void ControllerLink::OnConnected(Deadline now) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  if (err != 0) return TryFailed(UnavailableError(ErrText(err)), now);
  ChangeState(State::kHello);
  try_deadline_ = std::min(now + options_.try_timeout, give_up_at_);
  last_heard_ = now;
  handshake_ = std::make_unique<net::DialerHandshake>(options_.key, options_.hello);
  Status s;
  {
    MutexLock lock(&mu_);
    out_ = handshake_->Start();
    out_sent_ = 0;
    s = FlushLocked();
  }
  if (!s.ok()) TryFailed(s, now);
}

void ControllerLink::Exchange(short revents, Deadline now) {
  const State before = state_;
  Status s = TakeSendError();
  if (s.ok() && (revents & POLLOUT)) {
    MutexLock lock(&mu_);
    s = FlushLocked();
  }
  if (!s.ok()) return before == State::kHello ? TryFailed(s, now) : Lose(s, now, Retry::kNow);
  if (revents & (POLLIN | POLLHUP | POLLERR)) Read(now);
  if (losing_ || state_ != before) return;
  if (state_ == State::kHello) {
    if (now >= try_deadline_) {
      TryFailed(DeadlineExceededError("the controller did not answer the hello in time"), now);
    }
  } else if (now - last_heard_ >= options_.silence_timeout) {
    Lose(UnavailableError(
             fmt::format("the controller was silent for {} ms",
                         std::chrono::duration_cast<Millis>(now - last_heard_).count())),
         now, Retry::kNow);
  }
}

void ControllerLink::Read(Deadline now) {
  char buf[64 << 10];
  ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {
    std::string why = n == 0 ? "the controller closed the connection" : "recv: " + ErrText(errno);
    if (state_ == State::kHello) return TryFailed(UnavailableError(why + " during the hello"), now);
    return Lose(UnavailableError(why), now, Retry::kNow);
  }
  last_heard_ = now;
  Status fed = decoder_.Feed(std::string_view(buf, static_cast<size_t>(n)));
  // Frames decoded before a corrupt one still count (the decoder keeps them).
  while (auto frame = decoder_.Next()) {
    if (!Take(std::move(*frame), now)) return;
  }
  if (fed.ok()) return;
  Status why = DataLossError("corrupt frame: " + fed.message());
  if (state_ == State::kHello) return TryFailed(why, now);
  Lose(why, now, Retry::kBackoff);
}

bool ControllerLink::Take(net::Frame frame, Deadline now) {
  if (state_ == State::kHello) return TakeHandshake(frame, now);
  if (Status opened = recv_mac_->Open(&frame); !opened.ok()) {
    // Nothing after a frame that fails its MAC can be trusted: the connection goes.
    ++refused_frames_;
    NONSTOP_LOG_WARNING("the controller at {}: {}", controller_, opened.message());
    Lose(opened, now, Retry::kBackoff);
    return false;
  }
  if (frame.type != kMsgPing) {
    events_.push_back({LinkEvent{LinkEvent::Kind::kFrame, std::move(frame), OkStatus()}});
    return true;
  }
  auto ping = DecodePing(frame.payload);
  if (!ping.ok()) {
    Lose(DataLossError("malformed ping: " + ping.status().message()), now, Retry::kBackoff);
    return false;
  }
  if (ping->epoch < epoch_) {
    // A deposed leader (paused past its lease, or cut off from etcd): nothing after this ping is
    // followed.
    Lose(UnavailableError(fmt::format(
             "the controller at {} is of epoch {}, older than epoch {} that led already: a "
             "deposed leader, not followed",
             controller_, ping->epoch, epoch_)),
         now, Retry::kBackoff);
    return false;
  }
  epoch_ = ping->epoch;
  return true;
}

bool ControllerLink::TakeHandshake(const net::Frame& frame, Deadline now) {
  net::HandshakeStep step = handshake_->OnFrame(frame);
  // An authenticated refusal (a kind or worker id the controller does not take) is final for a
  // link no controller took yet; once one did, the same refusal can only come of a relay (the
  // controller took this hello before), and the link looks on.
  if (step.error.code() == StatusCode::kFailedPrecondition && !ever_accepted_) {
    Fail(step.error);
    return false;
  }
  if (!step.error.ok()) {
    Status why = step.error.WithContext("the controller at " + controller_);
    // A process that never met its controller and meets only peers that cannot prove the key most
    // likely holds the wrong token: after a few tries that is final, with the fix named. Once a
    // controller accepted this link (its token is right) such a peer is an impostor or another
    // job's process: it is retried, as garbage, until the job's controller answers.
    if (handshake_->peer_unproven() && !ever_accepted_ && ++unproven_in_a_row_ >= kUnprovenTries) {
      Fail(FailedPreconditionError(fmt::format(
          "it did not prove the job key, {} tries in a row: this process's job token is most "
          "likely not that job's (check the job token file it was given), or it is another job's "
          "controller",
          unproven_in_a_row_)));
      return false;
    }
    if (handshake_->peer_unproven() && !warned_unproven_) {
      // Once per search: something answers where the controller should be, and it is not it.
      warned_unproven_ = true;
      NONSTOP_LOG_WARNING("{}: not followed; looking on for the job's controller", why.message());
    }
    TryFailed(why, now);
    return false;
  }
  if (!step.send.empty()) {
    Status s;
    {
      MutexLock lock(&mu_);
      out_ += step.send;
      s = FlushLocked();
    }
    if (!s.ok()) {
      TryFailed(s, now);
      return false;
    }
  }
  if (!step.done) return true;
  net::Channel channel = handshake_->TakeChannel();
  handshake_.reset();
  recv_mac_ = std::move(channel.recv);
  {
    MutexLock lock(&mu_);
    send_mac_ = std::move(channel.send);
  }
  failed_tries_ = 0;
  tried_in_round_ = 0;
  unproven_in_a_row_ = 0;
  warned_unproven_ = false;
  ever_accepted_ = true;
  ChangeState(State::kAccepted);
  events_.push_back({LinkEvent{LinkEvent::Kind::kAccepted, {}, OkStatus()}});
  return true;
}

Status ControllerLink::WithFileHint(const Status& why) const {
  if (leader_file_ == nullptr || !try_from_etcd_) return why;
  // The file is only as fresh as the agent's watch: a stream it can never open leaves the file
  // stale (or absent), and the agent's log, not this process's, says why.
  return Status(
      why.code(),
      fmt::format("{} (the host's agent keeps {} from its etcd watch; if this lasts, look "
                  "in the agent's log for \"the watch of job '{}''s leader key\")",
                  why.message(), leader_file_->path(), options_.etcd_job));
}

void ControllerLink::TryFailed(const Status& why0, Deadline now) {
  const Status why = WithFileHint(why0);
  CloseConnection();
  last_status_ = why;
  last_error_ = why.message();
  NONSTOP_LOG_DEBUG("dialing the controller at {}: {}", controller_, why.message());
  if (now >= give_up_at_) return Fail(why);
  // etcd named a leader that does not answer: it is starting, or it died and its lease has not
  // run out. etcd is asked again soon (it names the next leader within a lease), not after a
  // back-off. Garbage is backed off as ever.
  if (named_by_etcd_ && !IsGarbage(why)) return WaitForLeader(why, now);
  // The next address of the list at once; after a round (etcd's leader is a round of one), the
  // back-off.
  bool round_over = true;
  if (!try_from_etcd_) {
    next_ = (next_ + 1) % list_.size();
    round_over = ++tried_in_round_ >= list_.size();
  }
  Millis wait{0};
  if (round_over) {
    tried_in_round_ = 0;
    wait = BackoffDelay(options_.backoff, ++failed_tries_, Random());
  }
  next_try_at_ = std::min(now + wait, give_up_at_);
  ChangeState(State::kWaiting);
}

void ControllerLink::LeaderChanged(Deadline now) {
  if (state_ == State::kWaiting && waiting_for_leader_) next_try_at_ = std::min(next_try_at_, now);
}

void ControllerLink::WaitForLeader(const Status& why0, Deadline now) {
  const Status why = WithFileHint(why0);
  last_status_ = why;
  last_error_ = why.message();
  NONSTOP_LOG_DEBUG("looking up the controller in etcd: {}", why.message());
  failed_tries_ = 0;
  Millis poll = options_.leader_poll;
  Millis wait =
      poll + Millis(static_cast<int64_t>(static_cast<double>(poll.count()) *
                                         options_.backoff.jitter * std::clamp(Random(), 0.0, 1.0)));
  next_try_at_ = std::min(now + wait, give_up_at_);
  ChangeState(State::kWaiting);
  waiting_for_leader_ = true;
}

void ControllerLink::Fail(const Status& why) {
  CloseConnection();
  events_.clear();
  losing_ = false;
  last_status_ = why;
  last_error_ = why.message();
  ChangeState(State::kFailed);
  events_.push_back({LinkEvent{LinkEvent::Kind::kFailed, {}, why}});
}

void ControllerLink::Lose(const Status& why, Deadline now, Retry retry) {
  {
    MutexLock lock(&mu_);
    open_ = false;  // nothing more is queued on this connection
  }
  losing_ = true;
  Millis wait{0};
  if (retry == Retry::kBackoff) wait = BackoffDelay(options_.backoff, ++protocol_errors_, Random());
  Pending p{LinkEvent{LinkEvent::Kind::kLost, {}, why}, now, now + wait};
  events_.push_back(std::move(p));
}

void ControllerLink::FinishLoss(const Pending& p) {
  CloseConnection();
  losing_ = false;
  last_status_ = p.event.status;
  last_error_ = p.event.status.message();
  // The round starts at the controller that was lost: it may come back (--resume).
  tried_in_round_ = 0;
  give_up_at_ = p.at + options_.reconnect_within;
  next_try_at_ = std::min(p.next_try_at, give_up_at_);
  ChangeState(State::kWaiting);
}

std::optional<LinkEvent> ControllerLink::Next() {
  if (took_frame_)
    protocol_errors_ = 0;  // the owner kept the connection over the frame it took last
  took_frame_ = false;
  if (events_.empty()) return std::nullopt;
  Pending p = std::move(events_.front());
  events_.pop_front();
  if (p.event.kind == LinkEvent::Kind::kLost) {
    FinishLoss(p);
    Rewatch();
  }
  took_frame_ = p.event.kind == LinkEvent::Kind::kFrame;
  return std::move(p.event);
}

Status ControllerLink::Open(const std::vector<std::pair<uint16_t, std::string>>& first) {
  NONSTOP_CHECK(state_ == State::kAccepted)
      << "controller link: Open() in state " << StateName(state_);
  Status s;
  {
    MutexLock lock(&mu_);
    for (const auto& [type, payload] : first) out_ += send_mac_->Seal(type, payload);
    open_ = !losing_;
    s = FlushLocked();
    if (!s.ok()) send_error_ = s;
  }
  ChangeState(State::kOpen);
  if (!s.ok()) WakeOwner();  // lost at the next Advance()
  Rewatch();
  return s;
}

void ControllerLink::Drop(const Status& why, Deadline now) {
  events_.clear();
  took_frame_ = false;
  if (state_ != State::kAccepted && state_ != State::kOpen) return;
  Millis wait{0};
  if (IsGarbage(why)) wait = BackoffDelay(options_.backoff, ++protocol_errors_, Random());
  FinishLoss(Pending{LinkEvent{LinkEvent::Kind::kLost, {}, why}, now, now + wait});
  Rewatch();
}

Status ControllerLink::WaitAccepted(const net::AbortSignal* abort) {
  NONSTOP_CHECK(loop_ == nullptr) << "WaitAccepted drives a link that is not attached to a loop";
  while (true) {
    while (auto e = Next()) {
      if (e->kind == LinkEvent::Kind::kAccepted) return OkStatus();
      if (e->kind == LinkEvent::Kind::kFailed) return e->status;
    }
    if (state_ == State::kIdle)
      return FailedPreconditionError("the controller link was not started");
    pollfd fds[3] = {{fd_, events(), 0},
                     {wake_fd_.get(), POLLIN, 0},
                     {abort != nullptr ? abort->fd() : -1, POLLIN, 0}};
    int rc = ::poll(fds, 3, PollTimeoutMs(wake_at()));
    if (rc < 0 && errno != EINTR) return ErrnoStatus(StatusCode::kInternal, "poll", errno);
    if (abort != nullptr && abort->fired()) {
      Stop();
      return AbortedError("stopped while looking for the controller");
    }
    Advance(rc > 0 ? fds[0].revents : 0, Clock::now());
  }
}

Status ControllerLink::Send(uint16_t type, std::string_view payload) {
  MutexLock lock(&mu_);
  if (!open_) return UnavailableError("no controller connected");
  if (!send_error_.ok()) return send_error_;
  if (payload.size() + net::kFrameTagBytes > net::kMaxControlFrameBytes) {
    return InvalidArgumentError(
        fmt::format("a message of {} bytes exceeds the control frame limit of {} bytes",
                    payload.size(), net::kMaxControlFrameBytes - net::kFrameTagBytes));
  }
  const size_t queued = out_.size() - out_sent_;
  if (queued + payload.size() + net::kFrameHeaderBytes > options_.max_queued_bytes) {
    send_error_ = UnavailableError(
        fmt::format("the controller is not taking its messages: {} bytes wait for it "
                    "(limit {})",
                    queued, options_.max_queued_bytes));
    WakeOwner();
    return send_error_;
  }
  out_ += send_mac_->Seal(type, payload);
  Status s = FlushLocked();
  if (!s.ok()) {
    send_error_ = s;
    WakeOwner();
    return s;
  }
  if (queued == 0 && out_sent_ < out_.size())
    WakeOwner();  // the owner polls for POLLOUT from now on
  return OkStatus();
}

bool ControllerLink::open() const {
  MutexLock lock(&mu_);
  return open_;
}

Status ControllerLink::FlushLocked() {
  while (out_sent_ < out_.size()) {
    ssize_t n = ::send(conn_.get(), out_.data() + out_sent_, out_.size() - out_sent_,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      out_sent_ += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    return UnavailableError("send: " + (n < 0 ? ErrText(errno) : std::string("nothing written")));
  }
  if (out_sent_ == out_.size()) {
    out_.clear();
    out_sent_ = 0;
  } else if (out_sent_ > (1u << 20)) {  // keep the queue compact
    out_.erase(0, out_sent_);
    out_sent_ = 0;
  }
  return OkStatus();
}

Status ControllerLink::TakeSendError() {
  MutexLock lock(&mu_);
  return send_error_;
}

void ControllerLink::InstallConnection(UniqueFd fd) {
  decoder_ = net::FrameDecoder(options_.max_frame_bytes);
  handshake_.reset();
  recv_mac_.reset();
  fd_ = fd.get();
  {
    MutexLock lock(&mu_);
    send_mac_.reset();
    conn_ = std::move(fd);
    out_.clear();
    out_sent_ = 0;
    open_ = false;
    send_error_ = OkStatus();
  }
  if (loop_ != nullptr) {
    loop_->Watch(fd_, POLLOUT, [this](short revents) {
      Advance(revents, Clock::now());
      pump_();
    });
  }
}

void ControllerLink::CloseConnection() {
  if (fd_ < 0) return;
  if (loop_ != nullptr) loop_->Unwatch(fd_);  // before the number can be reused
  fd_ = -1;
  handshake_.reset();
  recv_mac_.reset();
  MutexLock lock(&mu_);
  send_mac_.reset();
  conn_.Reset();
  open_ = false;
  out_.clear();
  out_sent_ = 0;
  send_error_ = OkStatus();
}

void ControllerLink::WakeOwner() const {
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
  (void)n;
}

void ControllerLink::DrainWake() const {
  uint64_t v;
  while (::read(wake_fd_.get(), &v, sizeof(v)) == sizeof(v)) {
  }
}

void ControllerLink::Rewatch() {
  if (loop_ != nullptr && fd_ >= 0) loop_->SetEvents(fd_, events());
}

}  // namespace nonstop::control
