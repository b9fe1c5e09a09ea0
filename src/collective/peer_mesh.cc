#include "collective/peer_mesh.h"

#include <poll.h>
#include <sys/socket.h>

#include "common/logging.h"
#include "net/handshake.h"

namespace nonstop::collective {

bool ConnectionIsBroken(const Connection& c) {
  pollfd p{c.fd.get(), static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLRDHUP)) return true;
  if (p.revents & POLLIN) {
    // Readable: stale frames, or an EOF that POLLRDHUP did not flag.
    char byte;
    ssize_t n = ::recv(c.fd.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0;
  }
  return false;
}

Result<std::unique_ptr<PeerMesh>> PeerMesh::Create(PeerMeshOptions options) {
  NONSTOP_ASSIGN_OR_RETURN(net::Listener listener, net::Listen(options.listen));
  return Create(std::move(options), std::move(listener));
}

std::unique_ptr<PeerMesh> PeerMesh::Create(PeerMeshOptions options, net::Listener listener) {
  return std::unique_ptr<PeerMesh>(new PeerMesh(std::move(options), std::move(listener)));
}

PeerMesh::PeerMesh(PeerMeshOptions options, net::Listener listener)
    : options_(std::move(options)), listen_fd_(std::move(listener.fd)), address_(listener.address) {
  accept_thread_ = std::jthread([this](std::stop_token stop) { AcceptLoop(stop); });
}

PeerMesh::~PeerMesh() {
  accept_thread_.request_stop();
  stop_signal_.Fire();
  if (accept_thread_.joinable()) accept_thread_.join();
}

void PeerMesh::AcceptLoop(std::stop_token stop) {
  while (!stop.stop_requested()) {
    Status ready = net::WaitFd(listen_fd_.get(), POLLIN, kNoDeadline, &stop_signal_, "accept");
    if (!ready.ok()) return;  // aborted: shutting down
    Result<UniqueFd> fd = net::Accept(listen_fd_.get());
    if (!fd.ok()) continue;
    Result<net::Hello> hello =
        net::ServerHandshake(fd->get(), options_.job_token, net::ConnectionKind::kData,
                             DeadlineAfter(options_.timeout_handshake), &stop_signal_);
    if (!hello.ok()) {
      NONSTOP_LOG_WARNING("data port: closed an incoming connection: {}", hello.status().message());
      continue;
    }
    auto conn = std::make_unique<Connection>();
    conn->fd = std::move(*fd);
    conn->peer_id = hello->worker_id;
    conn->peer_address = "inbound";
    std::lock_guard<std::mutex> lock(mu_);
    auto& slot = connections_[hello->worker_id];
    if (slot) retired_.push_back(std::move(slot));  // the peer redialed: its old connection is dead
    slot = std::move(conn);
    ++connections_opened_;
    cv_.notify_all();
  }
}

Result<Connection*> PeerMesh::Get(int peer_id, const std::string& peer_address, uint32_t generation,
                                  Deadline deadline, const net::AbortSignal* abort) {
  NONSTOP_CHECK_NE(peer_id, options_.worker_id) << "a worker never connects to itself";
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (auto it = connections_.find(peer_id); it != connections_.end()) {
      if (!ConnectionIsBroken(*it->second)) return it->second.get();
      retired_.push_back(std::move(it->second));  // closed by the peer: open a new one
      connections_.erase(it);
    }
    if (peer_id < options_.worker_id) {
      // The peer dials us. Wait in short slices so that an abort is seen promptly.
      while (true) {
        if (auto it = connections_.find(peer_id); it != connections_.end() && !ConnectionIsBroken(*it->second)) {
          it->second->peer_address = peer_address;
          return it->second.get();
        }
        if (abort != nullptr && abort->fired()) {
          return AbortedError(fmt::format("waiting for worker {} ({}) to connect: aborted", peer_id, peer_address));
        }
        if (Clock::now() >= deadline) {
          return DeadlineExceededError(
              fmt::format("worker {} ({}) did not connect in time (generation {})", peer_id, peer_address, generation));
        }
        cv_.wait_for(lock, Millis(5));
      }
    }
  }
  return Dial(peer_id, peer_address, generation, deadline, abort);
}

Result<Connection*> PeerMesh::Dial(int peer_id, const std::string& peer_address, uint32_t generation,
                                   Deadline deadline, const net::AbortSignal* abort) {
  NONSTOP_ASSIGN_OR_RETURN(net::HostPort where, net::ParseHostPort(peer_address));
  NONSTOP_ASSIGN_OR_RETURN(UniqueFd fd, net::Dial(where, deadline, abort));
  net::Hello hello;
  hello.kind = net::ConnectionKind::kData;
  hello.generation = generation;
  hello.worker_id = options_.worker_id;
  hello.job_token = options_.job_token;
  Status hs = net::ClientHandshake(fd.get(), hello, deadline, abort);
  if (!hs.ok()) return hs.WithContext(fmt::format("handshake with worker {} ({})", peer_id, peer_address));
  auto conn = std::make_unique<Connection>();
  conn->fd = std::move(fd);
  conn->peer_id = peer_id;
  conn->peer_address = peer_address;
  std::lock_guard<std::mutex> lock(mu_);
  Connection* raw = conn.get();
  auto& slot = connections_[peer_id];
  if (slot) retired_.push_back(std::move(slot));
  slot = std::move(conn);
  ++connections_opened_;
  return raw;
}

void PeerMesh::Drop(int peer_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = connections_.find(peer_id);
  if (it == connections_.end()) return;
  ::shutdown(it->second->fd.get(), SHUT_RDWR);  // the peer sees the close and drops its end too
  retired_.push_back(std::move(it->second));
  connections_.erase(it);
}

int PeerMesh::connections_opened() const {
  std::lock_guard<std::mutex> lock(mu_);
  return connections_opened_;
}

}  // namespace nonstop::collective
