#include "collective/peer_mesh.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <deque>

#include "common/logging.h"
#include "net/handshake.h"

namespace nonstop::collective {

namespace {

// How long accepting pauses when the process runs out of descriptors.
constexpr Millis kAcceptPause{100};

// Logs the first `shown` messages of a burst in full and only counts the
// rest; the count is logged once the window is over. A flood of junk
// connections costs a few log lines, not one per connection.
class BurstLog {
 public:
  explicit BurstLog(int shown) : shown_(shown) {}

  void Note(const std::string& message) {
    Deadline now = Clock::now();
    if (now >= window_end_) Flush(now);
    if (logged_ < shown_) {
      ++logged_;
      NONSTOP_LOG_WARNING("{}", message);
    } else {
      ++suppressed_;
    }
  }
  // When the loop must wake up to report what it counted.
  Deadline next_flush() const { return suppressed_ > 0 ? window_end_ : kNoDeadline; }
  void Tick(Deadline now) {
    if (now >= window_end_) Flush(now);
  }

 private:
  static constexpr Millis kWindow{10'000};
  void Flush(Deadline now) {
    if (suppressed_ > 0) {
      NONSTOP_LOG_WARNING(
          "data port: {} more incoming connections were closed for the same kinds of reasons in "
          "the last {} s",
          suppressed_, kWindow.count() / 1000);
    }
    logged_ = 0;
    suppressed_ = 0;
    window_end_ = now + kWindow;
  }

  const int shown_;
  int logged_ = 0;
  int suppressed_ = 0;
  Deadline window_end_{};
};

std::string PeerNameOf(int fd) {
  Result<net::HostPort> peer = net::PeerAddressOf(fd);
  return peer.ok() ? peer->ToString() : "an unknown address";
}

}  // namespace

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

// One incoming connection whose hello is not complete yet.
struct PeerMesh::Pending {
  UniqueFd fd;
  std::string from;  // the dialer's address, for messages
  Deadline deadline;
  std::unique_ptr<net::HelloAcceptor> hello;  // reads and writes `fd`, which outlives it
};

Result<std::unique_ptr<PeerMesh>> PeerMesh::Create(PeerMeshOptions options) {
  Result<net::Listener> listener =
      options.ports.empty()
          ? net::Listen(options.listen)
          : net::ListenInRange(options.listen.host, options.ports, 128, "data port");
  if (!listener.ok()) {
    if (!options.ports.empty() && listener.status().code() == StatusCode::kUnavailable &&
        listener.status().message().rfind("no free data port", 0) == 0) {
      return UnavailableError(listener.status().message() + ": widen --data-ports");
    }
    return listener.status().WithContext("the data port");
  }
  return Create(std::move(options), std::move(*listener));
}

std::unique_ptr<PeerMesh> PeerMesh::Create(PeerMeshOptions options, net::Listener listener) {
  return std::unique_ptr<PeerMesh>(new PeerMesh(std::move(options), std::move(listener)));
}

PeerMesh::PeerMesh(PeerMeshOptions options, net::Listener listener)
    : options_(std::move(options)),
      listen_fd_(std::move(listener.fd)),
      address_(listener.address),
      wake_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  NONSTOP_CHECK(wake_fd_.valid()) << "eventfd failed";
  NONSTOP_CHECK_GE(options_.max_pending_handshakes, 1);
  accept_thread_ = std::jthread([this](std::stop_token stop) { AcceptLoop(stop); });
}

PeerMesh::~PeerMesh() {
  accept_thread_.request_stop();
  stop_signal_.Fire();
  if (accept_thread_.joinable()) accept_thread_.join();
}

void PeerMesh::WakeAcceptLoop() {
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
  (void)n;  // a full counter is still readable: the wake-up is not lost
}

Status PeerMesh::CheckInbound(int peer_id, int lane, uint32_t generation) const {
  if (peer_id >= options_.worker_id) {
    return FailedPreconditionError(
        fmt::format("worker {} may not dial worker {}: the lower worker id dials, so worker {} "
                    "accepts only ids below {}",
                    peer_id, options_.worker_id, options_.worker_id, options_.worker_id));
  }
  MutexLock lock(&mu_);
  auto it = connections_.find({peer_id, lane});
  if (it != connections_.end() && it->second->generation > generation &&
      !ConnectionIsBroken(*it->second)) {
    return FailedPreconditionError(fmt::format(
        "worker {} is already connected for generation {}: a hello of generation {} is stale",
        peer_id, it->second->generation, generation));
  }
  return OkStatus();
}

bool PeerMesh::InstallInbound(UniqueFd fd, int peer_id, int lane, uint32_t generation) {
  MutexLock lock(&mu_);
  auto& slot = connections_[{peer_id, lane}];
  if (slot && slot->generation > generation && !ConnectionIsBroken(*slot)) {
    ++connections_refused_;  // a newer connection won the race while this one sent its ack
    return false;
  }
  auto conn = std::make_unique<Connection>();
  conn->fd = std::move(fd);
  conn->peer_id = peer_id;
  conn->lane = lane;
  conn->peer_address = "inbound";
  conn->generation = generation;
  if (slot) retired_.push_back(std::move(slot));  // the peer redialed: its old connection is dead
  slot = std::move(conn);
  ++connections_opened_;
  cv_.NotifyAll();
  return true;
}

// The accept thread: one poll loop over the listening socket, every
// connection still in handshake (each with its own deadline), the stop
// signal, and the abort signals of threads waiting in Get().
void PeerMesh::AcceptLoop(std::stop_token stop) {
  std::deque<std::unique_ptr<Pending>> pending;  // oldest first
  BurstLog refusals(/*shown=*/3);
  BurstLog evictions(/*shown=*/1);
  Deadline accept_paused_until{};
  std::vector<pollfd> fds;
  std::vector<int> watched;  // descriptors of waiters' abort signals (never dereferenced unlocked)

  // Settles a connection whose hello is done or overdue; false while it is still in handshake.
  auto settle = [&](Pending& p, Deadline now) {
    switch (p.hello->state()) {
      case net::HelloAcceptor::State::kAccepted: {
        const net::Hello& h = p.hello->hello();
        if (!InstallInbound(std::move(p.fd), h.worker_id, h.lane, h.generation)) {
          refusals.Note(fmt::format(
              "data port: closed the connection of worker {} (generation {}) from {}: a "
              "newer one replaced it",
              h.worker_id, h.generation, p.from));
        }
        return true;
      }
      case net::HelloAcceptor::State::kRefused: {
        {
          MutexLock lock(&mu_);
          ++connections_refused_;
        }
        refusals.Note(fmt::format("data port: closed an incoming connection from {}: {}", p.from,
                                  p.hello->error().message()));
        return true;
      }
      default:
        if (now < p.deadline) return false;
        {
          MutexLock lock(&mu_);
          ++connections_refused_;
        }
        refusals.Note(
            fmt::format("data port: closed an incoming connection from {}: no hello within {} ms",
                        p.from, options_.timeout_handshake.count()));
        return true;
    }
  };
  auto rule = [this](const net::Hello& h) {
    return CheckInbound(h.worker_id, h.lane, h.generation);
  };

  while (!stop.stop_requested()) {
    // The abort signals to watch; a waiter whose signal fired already is woken now.
    watched.clear();
    {
      MutexLock lock(&mu_);
      bool fired = false;
      for (const auto& [signal, count] : waiting_aborts_) {
        if (signal->fired())
          fired = true;
        else
          watched.push_back(signal->fd());
      }
      if (fired) cv_.NotifyAll();
    }
    Deadline now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    fds.clear();
    fds.push_back({stop_signal_.fd(), POLLIN, 0});
    fds.push_back({wake_fd_.get(), POLLIN, 0});
    fds.push_back({accepting ? listen_fd_.get() : -1, POLLIN, 0});
    for (int fd : watched) fds.push_back({fd, POLLIN, 0});
    const size_t first_pending = fds.size();
    Deadline wake_at = std::min(refusals.next_flush(), evictions.next_flush());
    if (!accepting) wake_at = std::min(wake_at, accept_paused_until);
    for (const auto& p : pending) {
      fds.push_back({p->fd.get(), p->hello->wanted_events(), 0});
      wake_at = std::min(wake_at, p->deadline);
    }
    int rc = ::poll(fds.data(), fds.size(), PollTimeoutMs(wake_at));
    if (rc < 0 && errno != EINTR) {
      NONSTOP_LOG_ERROR("data port: poll failed: {}; no more incoming connections",
                        std::strerror(errno));
      return;
    }
    if (rc < 0) continue;
    if (fds[0].revents != 0) return;  // shutting down
    if (fds[1].revents != 0) {
      uint64_t value;
      while (::read(wake_fd_.get(), &value, sizeof(value)) > 0) {
      }
    }
    for (size_t i = 0; i < watched.size(); ++i) {
      if (fds[3 + i].revents != 0) {
        MutexLock lock(&mu_);
        cv_.NotifyAll();
        break;
      }
    }

    now = Clock::now();
    std::deque<std::unique_ptr<Pending>> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = *pending[i];
      if (fds[first_pending + i].revents != 0) p.hello->Advance();
      if (!settle(p, now)) still.push_back(std::move(pending[i]));
    }
    pending = std::move(still);

    if (accepting && (fds[2].revents & POLLIN)) {
      // A bounded batch per round, so that a flood cannot starve the hellos in progress.
      for (int batch = 0; batch < 64; ++batch) {
        Result<UniqueFd> fd = net::Accept(listen_fd_.get());
        if (!fd.ok()) {
          if (fd.status().code() == StatusCode::kInternal) {
            evictions.Note(fmt::format("data port: {}; pausing accepts for {} ms",
                                       fd.status().message(), kAcceptPause.count()));
            accept_paused_until = Clock::now() + kAcceptPause;
          }
          break;
        }
        auto p = std::make_unique<Pending>();
        p->fd = std::move(*fd);
        p->from = PeerNameOf(p->fd.get());
        p->deadline = DeadlineAfter(options_.timeout_handshake);
        p->hello = std::make_unique<net::HelloAcceptor>(p->fd.get(), net::OneKey(options_.data_key),
                                                        net::ConnectionKind::kData, rule);
        p->hello->Advance();  // the hello often arrives with the connection
        if (settle(*p, Clock::now())) continue;
        pending.push_back(std::move(p));
        if (static_cast<int>(pending.size()) > options_.max_pending_handshakes) {
          std::unique_ptr<Pending> oldest = std::move(pending.front());
          pending.pop_front();
          {
            MutexLock lock(&mu_);
            ++connections_refused_;
          }
          evictions.Note(
              fmt::format("data port: {} incoming connections are in handshake, the limit "
                          "(max_pending_handshakes): closing the "
                          "oldest ones first, starting with {} (a flood of idle connections?)",
                          options_.max_pending_handshakes, oldest->from));
        }
      }
    }
    now = Clock::now();
    refusals.Tick(now);
    evictions.Tick(now);
  }
}

Result<Connection*> PeerMesh::Get(int peer_id, const std::string& peer_address, uint32_t generation,
                                  Deadline deadline, const net::AbortSignal* abort, int lane) {
  NONSTOP_CHECK_NE(peer_id, options_.worker_id) << "a worker never connects to itself";
  NONSTOP_CHECK(lane >= 0 && lane < net::kDataLanes) << "lane " << lane;
  {
    MutexLock lock(&mu_);
    // Generation check on the connection in the slot: usable (OK, `*out` set),
    // newer (kAborted), or none/broken (OK, `*out` null).
    auto usable = [&](Connection** out) NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> Status {
      *out = nullptr;
      auto it = connections_.find({peer_id, lane});
      if (it == connections_.end()) return OkStatus();
      if (ConnectionIsBroken(*it->second)) {
        retired_.push_back(std::move(it->second));  // closed by the peer: a new one is needed
        connections_.erase(it);
        return OkStatus();
      }
      if (it->second->generation > generation) {
        return AbortedError(fmt::format(
            "worker {} ({}) is already connected for generation {}: generation {} is over", peer_id,
            peer_address, it->second->generation, generation));
      }
      *out = it->second.get();
      return OkStatus();
    };
    Connection* conn = nullptr;
    NONSTOP_RETURN_IF_ERROR(usable(&conn));
    if (conn != nullptr) return conn;
    if (peer_id < options_.worker_id) {
      // The peer dials us. The accept thread wakes cv_ when a connection
      // arrives, and when `abort` fires (it polls the signals of waiters).
      if (abort != nullptr) {
        ++waiting_aborts_[abort];
        WakeAcceptLoop();
      }
      Status outcome;
      cv_.WaitUntil(&mu_, deadline, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        outcome = usable(&conn);
        return conn != nullptr || !outcome.ok() || (abort != nullptr && abort->fired());
      });
      if (abort != nullptr && --waiting_aborts_[abort] == 0) waiting_aborts_.erase(abort);
      NONSTOP_RETURN_IF_ERROR(outcome);
      if (conn != nullptr) {
        conn->peer_address = peer_address;
        return conn;
      }
      if (abort != nullptr && abort->fired()) {
        return AbortedError(
            fmt::format("waiting for worker {} ({}) to connect: aborted", peer_id, peer_address));
      }
      return DeadlineExceededError(
          fmt::format("worker {} ({}) did not connect in time (generation {})", peer_id,
                      peer_address, generation));
    }
  }
  return Dial(peer_id, lane, peer_address, generation, deadline, abort);
}

Result<Connection*> PeerMesh::Dial(int peer_id, int lane, const std::string& peer_address,
                                   uint32_t generation, Deadline deadline,
                                   const net::AbortSignal* abort) {
  NONSTOP_ASSIGN_OR_RETURN(net::HostPort where, net::ParseHostPort(peer_address));
  NONSTOP_ASSIGN_OR_RETURN(UniqueFd fd, net::Dial(where, deadline, abort));
  net::Hello hello;
  hello.kind = net::ConnectionKind::kData;
  hello.generation = generation;
  hello.worker_id = options_.worker_id;
  hello.lane = static_cast<uint16_t>(lane);
  Result<net::Channel> hs =
      net::ClientHandshake(fd.get(), options_.data_key, hello, deadline, abort);
  if (!hs.ok())
    return hs.status().WithContext(
        fmt::format("handshake with worker {} ({})", peer_id, peer_address));
  auto conn = std::make_unique<Connection>();
  conn->fd = std::move(fd);
  conn->peer_id = peer_id;
  conn->lane = lane;
  conn->peer_address = peer_address;
  conn->generation = generation;
  MutexLock lock(&mu_);
  Connection* raw = conn.get();
  auto& slot = connections_[{peer_id, lane}];
  if (slot) retired_.push_back(std::move(slot));
  slot = std::move(conn);
  ++connections_opened_;
  return raw;
}

void PeerMesh::Drop(int peer_id) {
  MutexLock lock(&mu_);
  auto it = connections_.lower_bound({peer_id, 0});
  while (it != connections_.end() && it->first.first == peer_id) {
    ::shutdown(it->second->fd.get(), SHUT_RDWR);  // the peer sees the close and drops its end too
    retired_.push_back(std::move(it->second));
    it = connections_.erase(it);
  }
}

int PeerMesh::connections_opened() const {
  MutexLock lock(&mu_);
  return connections_opened_;
}

int PeerMesh::connections_open() const {
  MutexLock lock(&mu_);
  return static_cast<int>(connections_.size());
}

int PeerMesh::connections_refused() const {
  MutexLock lock(&mu_);
  return connections_refused_;
}

}  // namespace nonstop::collective
