#include "controller/control_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <cstring>
#include <tuple>

#include <fmt/format.h>

#include "common/logging.h"
#include "control/messages.h"
#include "net/handshake.h"

namespace nonstop::controller {

namespace {

// The peer's address, and the address with its port for logs ("10.0.0.1:5", "[fd00::1]:5").
std::pair<std::string, std::string> PeerAddress(int fd) {
  Result<net::HostPort> peer = net::PeerAddressOf(fd);
  if (!peer.ok()) return {"unknown", "unknown peer"};
  return {peer->host, peer->ToString()};
}

}  // namespace

Result<std::unique_ptr<ControlServer>> ControlServer::Create(net::EventLoop* loop,
                                                             const net::HostPort& where,
                                                             std::string job_token, EventSink sink,
                                                             ControlServerOptions options) {
  NONSTOP_ASSIGN_OR_RETURN(net::Listener listener, net::Listen(where));
  return std::unique_ptr<ControlServer>(
      new ControlServer(loop, std::move(listener), std::move(job_token), std::move(sink), options));
}

ControlServer::ControlServer(net::EventLoop* loop, net::Listener listener, std::string token,
                             EventSink sink, ControlServerOptions options)
    : loop_(loop),
      options_(options),
      listen_fd_(std::move(listener.fd)),
      address_(listener.address),
      job_key_(crypto::JobKey(token)),
      sink_(std::move(sink)),
      ping_payload_(control::Encode(control::PingMsg{options.epoch})) {
  loop_->Watch(listen_fd_.get(), POLLIN, [this](short) { OnAccept(); });
}

ControlServer::~ControlServer() {
  loop_->Unwatch(listen_fd_.get());
  for (auto& [fd, c] : conns_) loop_->Unwatch(fd);
}

void ControlServer::LogRefusal(const std::string& line) {
  auto now = Clock::now();
  if (now - log_window_start_ > std::chrono::seconds(1)) {
    if (suppressed_logs_ > 0) {
      NONSTOP_LOG_WARNING(
          "control: {} more connection(s) refused or closed in the last second (not logged one by "
          "one)",
          suppressed_logs_);
    }
    log_window_start_ = now;
    logged_in_window_ = 0;
    suppressed_logs_ = 0;
  }
  if (logged_in_window_ < 5) {
    ++logged_in_window_;
    NONSTOP_LOG_WARNING("control: {}", line);
  } else {
    ++suppressed_logs_;
  }
}

void ControlServer::OnAccept() {
  // A bounded batch per loop turn: a flood of connections never keeps the
  // loop from everything else it does.
  for (int batch = 0; batch < 64; ++batch) {
    Result<UniqueFd> fd = net::Accept(listen_fd_.get());
    if (!fd.ok()) {
      if (fd.status().code() == StatusCode::kInternal) {
        // Out of descriptors: the listener stays readable, so stop watching it
        // for a moment instead of spinning; CheckTimers watches it again.
        LogRefusal(fd.status().ToString());
        loop_->Unwatch(listen_fd_.get());
        accept_paused_until_ = Clock::now() + Millis(100);
      }
      return;
    }
    // Bounded memory under a flood: at most max_unjoined connections may wait
    // for their hello and join.
    if (unjoined_.size() >= static_cast<size_t>(options_.max_unjoined)) EvictAStranger();
    int raw = fd->get();
    auto c = std::make_unique<Conn>();
    c->fd = std::move(*fd);
    std::tie(c->ip, c->peer) = PeerAddress(raw);
    c->accepted_at = Clock::now();
    c->seq = next_seq_++;
    // Workers and agents share the port; the hello says which one speaks.
    c->handshake = std::make_unique<net::AcceptorHandshake>(
        net::JobRoles(job_key_),
        [](net::ConnectionKind k) {
          return k == net::ConnectionKind::kControl || k == net::ConnectionKind::kAgent;
        },
        [](const net::Hello& h) { return net::CheckHello(h, h.kind); });
    unjoined_[c->seq] = raw;
    strangers_[c->ip][c->seq] = raw;
    conns_[raw] = std::move(c);
    loop_->Watch(raw, POLLIN, [this, raw](short revents) { OnEvent(raw, revents); });
  }
}

void ControlServer::EvictAStranger() {
  // The address with the most strangers; of equals, the one whose oldest is oldest.
  const std::map<uint64_t, int>* worst = nullptr;
  std::string worst_ip;
  for (const auto& [ip, conns] : strangers_) {
    if (!worst || conns.size() > worst->size() ||
        (conns.size() == worst->size() && conns.begin()->first < worst->begin()->first)) {
      worst = &conns;
      worst_ip = ip;
    }
  }
  // every unjoined connection proved the job key: never evicted for strangers
  if (!worst) return;
  CloseConn(worst->begin()->second,
            fmt::format("{} connections have not joined yet: closing the oldest from {}, the "
                        "address with the most "
                        "({}) that sent no valid hello",
                        unjoined_.size(), worst_ip, worst->size()),
            false);
}

void ControlServer::Greeted(Conn& c) {
  c.greeted = true;
  if (!c.agent) c.decoder.set_max_payload(kMaxWorkerFrameBytes);
  auto it = strangers_.find(c.ip);
  if (it == strangers_.end()) return;
  it->second.erase(c.seq);
  if (it->second.empty()) strangers_.erase(it);
}

void ControlServer::Identified(Conn& c) { unjoined_.erase(c.seq); }

void ControlServer::OnEvent(int fd, short revents) {
  if ((revents & POLLOUT) && !Flush(fd)) return;
  if (revents & (POLLIN | POLLHUP | POLLERR)) OnReadable(fd);
}

void ControlServer::OnReadable(int fd, bool report_loss) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  Conn& c = *it->second;
  char buf[16 << 10];
  ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  if (n == 0) {
    CloseConn(fd, "connection closed by peer", report_loss);
    return;
  }
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return;
    CloseConn(fd, fmt::format("recv: {}", std::strerror(errno)), report_loss);
    return;
  }
  Status s = c.decoder.Feed(std::string_view(buf, static_cast<size_t>(n)));
  if (!s.ok()) {
    CloseConn(fd, s.message(), report_loss);
    return;
  }
  while (auto frame = c.decoder.Next()) {
    HandleFrame(c, *frame);
    if (!conns_.count(fd)) return;  // closed by the handler
  }
}

void ControlServer::HandleFrame(Conn& c, const net::Frame& f) {
  int fd = c.fd.get();
  if (!c.greeted) return HandleHandshakeFrame(c, f);
  net::Frame opened = f;
  if (Status mac = c.channel.recv->Open(&opened); !mac.ok()) {
    // Nothing after a frame that fails its MAC can be trusted: the connection goes.
    ++refused_frames_;
    CloseConn(fd, mac.message(), true);
    return;
  }
  HandleOpenedFrame(c, opened);
}

void ControlServer::HandleHandshakeFrame(Conn& c, const net::Frame& f) {
  int fd = c.fd.get();
  net::HandshakeStep step = c.handshake->OnFrame(f);
  // The handshake's answers go out past the send gate: they carry no order (the epoch-bearing
  // ping that follows a join, and every order, go through SendOn).
  if (!step.send.empty()) {
    (void)::send(fd, step.send.data(), step.send.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  if (!step.error.ok()) {
    ++refused_;
    CloseConn(fd, "refused: " + step.error.message(), false);
    return;
  }
  if (!step.done) return;
  c.hello_worker_id = c.handshake->hello().worker_id;
  c.agent = c.handshake->hello().kind == net::ConnectionKind::kAgent;
  c.channel = c.handshake->TakeChannel();
  c.handshake.reset();
  Greeted(c);
}

void ControlServer::HandleOpenedFrame(Conn& c, const net::Frame& f) {
  int fd = c.fd.get();
  if (c.agent) return HandleAgentFrame(c, f);
  auto bad = [&](const Status& s) { CloseConn(fd, s.ToString(), true); };
  if (c.worker_id < 0) {
    if (f.type != control::kMsgJoin) {
      bad(InvalidArgumentError(fmt::format("expected a join message, got type {}", f.type)));
      return;
    }
    auto join = control::DecodeJoin(f.payload);
    if (!join.ok()) return bad(join.status());
    if (join->worker_id < 0) {
      return bad(InvalidArgumentError(fmt::format("worker id {} is negative", join->worker_id)));
    }
    if (join->worker_id != c.hello_worker_id) {
      return bad(
          InvalidArgumentError(fmt::format("joins as worker {} after saying hello as worker {}",
                                           join->worker_id, c.hello_worker_id)));
    }
    if (fd_of_worker_.count(join->worker_id)) {
      return bad(
          InvalidArgumentError(fmt::format("worker id {} is already connected", join->worker_id)));
    }
    c.worker_id = join->worker_id;
    Identified(c);
    c.peer = fmt::format("worker {} ({})", join->worker_id, c.peer);
    fd_of_worker_[c.worker_id] = fd;
    SendOn(fd, control::kMsgPing, ping_payload_);  // the epoch, before any order
    sink_(WorkerJoined{*join});
    return;
  }
  int id = c.worker_id;
  Status s;
  switch (f.type) {
    case control::kMsgHeartbeat:
      s = Deliver<HeartbeatReceived>(id, f.payload, control::DecodeHeartbeat);
      break;
    case control::kMsgProgress:
      s = Deliver<ProgressReceived>(id, f.payload, control::DecodeProgress);
      break;
    case control::kMsgFinished:
      s = Deliver<FinishedReceived>(id, f.payload, control::DecodeFinished);
      break;
    case control::kMsgFailure:
      s = Deliver<FailureReported>(id, f.payload, control::DecodeFailure);
      break;
    case control::kMsgReady:
      s = Deliver<ReadyReceived>(id, f.payload, control::DecodeReady);
      break;
    case control::kMsgRecovered:
      s = Deliver<RecoveredReceived>(id, f.payload, control::DecodeRecovered);
      break;
    case control::kMsgInjected:
      s = Deliver<InjectedReceived>(id, f.payload, control::DecodeInjected);
      break;
    case control::kMsgStore:
      s = Deliver<StoreRequested>(id, f.payload, control::DecodeStoreRequest);
      break;
    default:
      s = InvalidArgumentError(fmt::format("unexpected message type {}", f.type));
  }
  if (!s.ok()) bad(s);
}

void ControlServer::HandleAgentFrame(Conn& c, const net::Frame& f) {
  int fd = c.fd.get();
  auto bad = [&](const Status& s) { CloseConn(fd, s.ToString(), true); };
  if (c.host_id.empty()) {
    if (f.type != control::kMsgAgentRegister) {
      return bad(InvalidArgumentError(
          fmt::format("expected an agent register message, got type {}", f.type)));
    }
    auto reg = control::DecodeAgentRegister(f.payload);
    if (!reg.ok()) return bad(reg.status());
    if (fd_of_host_.count(reg->host_id)) {
      std::string why = fmt::format(
          "host id {} is already in the job (another agent is connected with it)", reg->host_id);
      // the epoch first: a deposed leader's refusal is not obeyed
      SendOn(fd, control::kMsgPing, ping_payload_);
      SendOn(fd, control::kMsgShutdown, control::Encode(control::ShutdownMsg{why, kExitUsage}));
      ++refused_;
      CloseConn(fd, "refused: " + why, false);
      return;
    }
    c.host_id = reg->host_id;
    Identified(c);
    c.peer = fmt::format("agent of host {} ({})", reg->host_id, c.peer);
    fd_of_host_[c.host_id] = fd;
    SendOn(fd, control::kMsgPing, ping_payload_);  // the epoch, before any order
    sink_(HostJoined{*reg});
    return;
  }
  const std::string host = c.host_id;
  auto decoded = [&](auto result, auto make) -> Status {
    if (!result.ok()) return result.status();
    sink_(make(*result));
    return OkStatus();
  };
  Status s;
  switch (f.type) {
    case control::kMsgAgentHeartbeat:
      s = decoded(control::DecodeAgentHeartbeat(f.payload),
                  [&](const control::AgentHeartbeatMsg& m) {
                    return Event{HostHeartbeat{host, m}};
                  });
      break;
    case control::kMsgAgentStarted:
      s = decoded(control::DecodeAgentStarted(f.payload), [&](const control::AgentStartedMsg& m) {
        return Event{WorkerStarted{host, m}};
      });
      break;
    case control::kMsgAgentExited:
      s = decoded(control::DecodeAgentExited(f.payload), [&](const control::AgentExitedMsg& m) {
        ReadWhatIsLeft(m.worker_id, /*report_loss=*/true);  // its last words before its exit
        return Event{ProcessExited{m.worker_id, m.pid, m.exit_code, m.signal, host}};
      });
      break;
    case control::kMsgAgentDying:
      s = decoded(control::DecodeAgentDying(f.payload), [&](const control::AgentDyingMsg& m) {
        return Event{ProcessDying{m.worker_id, m.pid, host}};
      });
      break;
    case control::kMsgAgentStopped:
      s = decoded(control::DecodeAgentStopped(f.payload), [&](const control::AgentStoppedMsg& m) {
        return Event{ProcessStopped{m.worker_id, m.pid, m.signal, host}};
      });
      break;
    case control::kMsgAgentLeaving:
      s = decoded(control::DecodeAgentLeaving(f.payload), [&](const control::AgentLeavingMsg& m) {
        return Event{HostLeaving{host, m}};
      });
      break;
    default:
      s = InvalidArgumentError(fmt::format("unexpected message type {} from an agent", f.type));
  }
  if (!s.ok()) bad(s);
}

void ControlServer::CloseConn(int fd, const std::string& reason, bool report_loss) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  int worker = it->second->worker_id;
  std::string host = it->second->host_id;
  if (reason == "connection closed by peer" ||
      reason.find("Connection reset") != std::string::npos) {
    NONSTOP_LOG_DEBUG("control: {} closed its connection", it->second->peer);
  } else if (worker >= 0 || !host.empty()) {
    NONSTOP_LOG_WARNING("control: closing {}: {}", it->second->peer, reason);
  } else {
    LogRefusal(fmt::format("closing {}: {}", it->second->peer, reason));
  }
  loop_->Unwatch(fd);
  if (!it->second->greeted) Greeted(*it->second);
  Identified(*it->second);
  backlogged_.erase(fd);
  conns_.erase(it);
  if (worker >= 0) {
    fd_of_worker_.erase(worker);
    if (report_loss) sink_(ConnectionLost{worker, reason});
  }
  if (!host.empty()) {
    fd_of_host_.erase(host);
    if (report_loss) sink_(HostLost{host, reason});
  }
}

bool ControlServer::Flush(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return false;
  Conn& c = *it->second;
  if (c.out_sent < c.out.size() && fenced()) {
    // queued before the lease ran out: dropped, not flushed (a newer leader may be giving orders)
    dropped_bytes_ += c.out.size() - c.out_sent;
    CloseConn(fd, "this controller's lease ran out: its queued messages are dropped", false);
    return false;
  }
  while (c.out_sent < c.out.size()) {
    ssize_t n = ::send(fd, c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      c.out_sent += static_cast<size_t>(n);
      c.out_progress_at = Clock::now();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    CloseConn(fd, fmt::format("send: {}", n < 0 ? std::strerror(errno) : "closed"), true);
    return false;
  }
  if (c.out_sent == c.out.size()) {
    c.out.clear();
    c.out_sent = 0;
    backlogged_.erase(fd);
    loop_->SetEvents(fd, POLLIN);
  } else {
    backlogged_.insert(fd);
    if (c.out_sent > (1u << 20)) {  // keep the queue compact
      c.out.erase(0, c.out_sent);
      c.out_sent = 0;
    }
    loop_->SetEvents(fd, POLLIN | POLLOUT);
  }
  return true;
}

bool ControlServer::Send(int worker_id, uint16_t type, const std::string& payload) {
  auto it = fd_of_worker_.find(worker_id);
  if (it == fd_of_worker_.end()) return false;
  return SendOn(it->second, type, payload);
}

uint64_t ControlServer::connection_of(int worker_id) const {
  auto it = fd_of_worker_.find(worker_id);
  if (it == fd_of_worker_.end()) return 0;
  auto c = conns_.find(it->second);
  return c == conns_.end() ? 0 : c->second->seq + 1;
}

bool ControlServer::SendToAgent(const std::string& host_id, uint16_t type,
                                const std::string& payload) {
  auto it = fd_of_host_.find(host_id);
  if (it == fd_of_host_.end()) return false;
  return SendOn(it->second, type, payload);
}

void ControlServer::CloseAgent(const std::string& host_id, const std::string& reason, int exit_code,
                               bool send_shutdown) {
  auto it = fd_of_host_.find(host_id);
  if (it == fd_of_host_.end()) return;
  int fd = it->second;
  if (!send_shutdown ||
      SendOn(fd, control::kMsgShutdown, control::Encode(control::ShutdownMsg{reason, exit_code}))) {
    CloseConn(fd, reason, false);
  }
}

void ControlServer::ReadWhatIsLeft(int worker_id, bool report_loss) {
  // Bounded: a worker that keeps writing cannot hold the loop here.
  for (int chunks = 0; chunks < 64; ++chunks) {
    auto it = fd_of_worker_.find(worker_id);
    if (it == fd_of_worker_.end()) return;
    pollfd p{it->second, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0 || (p.revents & (POLLIN | POLLHUP | POLLERR)) == 0) return;
    OnReadable(it->second, report_loss);
  }
}

void ControlServer::CloseWorker(int worker_id, const std::string& reason) {
  ReadWhatIsLeft(worker_id, /*report_loss=*/false);
  auto it = fd_of_worker_.find(worker_id);
  if (it != fd_of_worker_.end()) CloseConn(it->second, reason, false);
}

std::vector<std::string> ControlServer::agents() const {
  std::vector<std::string> out;
  for (const auto& [host, fd] : fd_of_host_) out.push_back(host);
  return out;
}

bool ControlServer::SendOn(int fd, uint16_t type, const std::string& payload) {
  Conn& c = *conns_.at(fd);
  NONSTOP_CHECK(c.channel.send != nullptr) << "a message to a connection still in handshake";
  if (payload.size() + net::kFrameTagBytes > net::kMaxControlFrameBytes) {
    NONSTOP_LOG_ERROR(
        "control: a message of type {} and {} bytes to {} exceeds the frame limit of "
        "{} bytes: not sent",
        type, payload.size(), c.peer, net::kMaxControlFrameBytes - net::kFrameTagBytes);
    return false;
  }
  if (fenced()) {
    dropped_bytes_ += payload.size() + net::kFrameHeaderBytes + net::kFrameTagBytes;
    Flush(fd);  // drops what is queued too
    return false;
  }
  size_t queued = c.out.size() - c.out_sent;
  if (queued + payload.size() + net::kFrameHeaderBytes > options_.max_queued_bytes) {
    CloseConn(fd,
              fmt::format("slow reader: {} bytes of control messages are waiting for it (limit {})",
                          queued, options_.max_queued_bytes),
              true);
    return false;
  }
  // the stall clock starts with the first queued byte
  if (queued == 0) c.out_progress_at = Clock::now();
  c.out += c.channel.send->Seal(type, payload);
  return Flush(fd);
}

void ControlServer::CheckTimers(Clock::time_point now) {
  if (accept_paused_until_ && now >= *accept_paused_until_) {
    accept_paused_until_.reset();
    loop_->Watch(listen_fd_.get(), POLLIN, [this](short) { OnAccept(); });
  }
  std::vector<std::pair<int, std::string>> close;
  std::vector<std::pair<int, std::string>> lost;
  // Both scans touch only the connections concerned (at scale most are
  // neither): unjoined ones in accept order, so the expired ones come first.
  for (const auto& [seq, fd] : unjoined_) {
    if (now - conns_.at(fd)->accepted_at <= options_.handshake_timeout) break;
    close.push_back(
        {fd, fmt::format("no hello and join within {} ms", options_.handshake_timeout.count())});
  }
  for (int fd : backlogged_) {
    const Conn& c = *conns_.at(fd);
    if (now - c.out_progress_at > options_.send_stall_timeout) {
      lost.push_back(
          {fd, fmt::format("stuck reader: it took none of its {} queued bytes for {} ms",
                           c.out.size() - c.out_sent, options_.send_stall_timeout.count())});
    }
  }
  for (const auto& [fd, why] : close) CloseConn(fd, why, false);
  for (const auto& [fd, why] : lost) CloseConn(fd, why, true);
}

}  // namespace nonstop::controller
