#include "controller/control_server.h"

#include <sys/socket.h>

#include <cstring>

#include <fmt/format.h>

#include "common/logging.h"
#include "control/messages.h"
#include "net/handshake.h"

namespace nonstop::controller {

Result<std::unique_ptr<ControlServer>> ControlServer::Create(net::EventLoop* loop, const net::HostPort& where,
                                                             std::string job_token, EventSink sink) {
  NONSTOP_ASSIGN_OR_RETURN(net::Listener listener, net::Listen(where));
  return std::unique_ptr<ControlServer>(new ControlServer(loop, std::move(listener), std::move(job_token), std::move(sink)));
}

ControlServer::ControlServer(net::EventLoop* loop, net::Listener listener, std::string token, EventSink sink)
    : loop_(loop), listen_fd_(std::move(listener.fd)), address_(listener.address), token_(std::move(token)),
      sink_(std::move(sink)) {
  loop_->Watch(listen_fd_.get(), POLLIN, [this](short) { OnAccept(); });
}

ControlServer::~ControlServer() {
  loop_->Unwatch(listen_fd_.get());
  for (auto& [fd, c] : conns_) loop_->Unwatch(fd);
}

void ControlServer::OnAccept() {
  while (true) {
    Result<UniqueFd> fd = net::Accept(listen_fd_.get());
    if (!fd.ok()) return;
    int raw = fd->get();
    auto c = std::make_unique<Conn>();
    c->fd = std::move(*fd);
    c->peer = fmt::format("connection {}", raw);
    conns_[raw] = std::move(c);
    loop_->Watch(raw, POLLIN, [this, raw](short) { OnReadable(raw); });
  }
}

void ControlServer::OnReadable(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  Conn& c = *it->second;
  char buf[16 << 10];
  ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
  if (n == 0) {
    CloseConn(fd, "connection closed by peer", true);
    return;
  }
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return;
    CloseConn(fd, fmt::format("recv: {}", std::strerror(errno)), true);
    return;
  }
  Status s = c.decoder.Feed(std::string_view(buf, static_cast<size_t>(n)));
  if (!s.ok()) {
    CloseConn(fd, s.message(), true);
    return;
  }
  while (auto frame = c.decoder.Next()) {
    HandleFrame(c, *frame);
    if (!conns_.count(fd)) return;  // closed by the handler
  }
}

void ControlServer::HandleFrame(Conn& c, const net::Frame& f) {
  int fd = c.fd.get();
  if (!c.greeted) {
    std::string refusal;
    if (f.type != net::kFrameHello) {
      refusal = fmt::format("first frame has type {}, expected hello", f.type);
    } else {
      auto hello = net::DecodeHello(f.payload);
      if (!hello.ok()) refusal = hello.status().message();
      else if (hello->proto_major != net::kProtocolMajor) refusal = fmt::format("protocol version {} is not supported", hello->proto_major);
      else if (hello->job_token != token_) refusal = "job token mismatch: this connection belongs to another job";
      else if (hello->kind != net::ConnectionKind::kControl) refusal = "not a control connection";
    }
    if (!refusal.empty()) {
      std::string ack = net::EncodeFrame(net::kFrameHelloAck, std::string(1, '\0') + refusal);
      (void)::send(fd, ack.data(), ack.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      ++refused_;
      CloseConn(fd, "refused: " + refusal, false);
      return;
    }
    c.greeted = true;
    std::string ack = net::EncodeFrame(net::kFrameHelloAck, std::string(1, '\1'));
    (void)::send(fd, ack.data(), ack.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    return;
  }
  auto bad = [&](const Status& s) { CloseConn(fd, s.ToString(), true); };
  if (c.worker_id < 0) {
    if (f.type != control::kMsgJoin) {
      bad(InvalidArgumentError(fmt::format("expected a join message, got type {}", f.type)));
      return;
    }
    auto join = control::DecodeJoin(f.payload);
    if (!join.ok()) return bad(join.status());
    if (fd_of_worker_.count(join->worker_id)) {
      return bad(InvalidArgumentError(fmt::format("worker id {} is already connected", join->worker_id)));
    }
    c.worker_id = join->worker_id;
    c.peer = fmt::format("worker {}", join->worker_id);
    fd_of_worker_[c.worker_id] = fd;
    sink_(WorkerJoined{*join});
    return;
  }
  int id = c.worker_id;
  Status s;
  switch (f.type) {
    case control::kMsgHeartbeat: s = Deliver<HeartbeatReceived>(id, f.payload, control::DecodeHeartbeat); break;
    case control::kMsgProgress: s = Deliver<ProgressReceived>(id, f.payload, control::DecodeProgress); break;
    case control::kMsgFinished: s = Deliver<FinishedReceived>(id, f.payload, control::DecodeFinished); break;
    case control::kMsgFailure: s = Deliver<FailureReported>(id, f.payload, control::DecodeFailure); break;
    case control::kMsgReady: s = Deliver<ReadyReceived>(id, f.payload, control::DecodeReady); break;
    case control::kMsgRecovered: s = Deliver<RecoveredReceived>(id, f.payload, control::DecodeRecovered); break;
    case control::kMsgInjected: s = Deliver<InjectedReceived>(id, f.payload, control::DecodeInjected); break;
    default: s = InvalidArgumentError(fmt::format("unexpected message type {}", f.type));
  }
  if (!s.ok()) bad(s);
}

void ControlServer::CloseConn(int fd, const std::string& reason, bool report_loss) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  int worker = it->second->worker_id;
  if (reason == "connection closed by peer" || reason.find("Connection reset") != std::string::npos) {
    NONSTOP_LOG_DEBUG("control: {} closed its connection", it->second->peer);
  } else {
    NONSTOP_LOG_WARNING("control: closing {}: {}", it->second->peer, reason);
  }
  loop_->Unwatch(fd);
  conns_.erase(it);
  if (worker >= 0) {
    fd_of_worker_.erase(worker);
    if (report_loss) sink_(ConnectionLost{worker, reason});
  }
}

bool ControlServer::Send(int worker_id, uint16_t type, const std::string& payload) {
  auto it = fd_of_worker_.find(worker_id);
  if (it == fd_of_worker_.end()) return false;
  Status s = net::WriteFrame(it->second, type, payload, DeadlineAfter(Millis(1000)), nullptr);
  if (!s.ok()) {
    NONSTOP_LOG_WARNING("control: send to worker {} failed: {}", worker_id, s.ToString());
    return false;
  }
  return true;
}

}  // namespace nonstop::controller
