#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "net/abort_signal.h"

namespace nonstop::net {

namespace {

void SetPort(SocketAddress* a, uint16_t port) {
  if (a->family() == AF_INET) reinterpret_cast<sockaddr_in*>(&a->storage)->sin_port = htons(port);
  if (a->family() == AF_INET6)
    reinterpret_cast<sockaddr_in6*>(&a->storage)->sin6_port = htons(port);
}

// A literal needs no lookup: IPv4, or IPv6 without a zone.
std::optional<SocketAddress> FromLiteral(const std::string& host, uint16_t port) {
  SocketAddress a;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&a.storage);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
    a.length = sizeof(sockaddr_in);
    return a;
  }
  a = SocketAddress{};
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&a.storage);
  if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
    a.length = sizeof(sockaddr_in6);
    return a;
  }
  return std::nullopt;
}

}  // namespace

Result<std::vector<SocketAddress>> ResolveAll(const HostPort& where, bool passive) {
  std::string host(UnbracketHost(where.host));
  if (host.empty())
    return InvalidArgumentError(fmt::format("address '{}': no host", where.ToString()));
  // as the listeners bind it, whatever the resolver prefers
  if (host == "localhost") host = "127.0.0.1";
  if (auto a = FromLiteral(host, where.port)) return std::vector<SocketAddress>{*a};
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(where.port);
  int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    std::string why = rc == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(rc);
    return UnavailableError(fmt::format("cannot resolve host '{}': {}", host, why));
  }
  std::vector<SocketAddress> out;
  for (addrinfo* i = res; i != nullptr; i = i->ai_next) {
    if ((i->ai_family != AF_INET && i->ai_family != AF_INET6) ||
        i->ai_addrlen > sizeof(sockaddr_storage))
      continue;
    SocketAddress a;
    std::memcpy(&a.storage, i->ai_addr, i->ai_addrlen);
    a.length = static_cast<socklen_t>(i->ai_addrlen);
    bool seen = false;
    for (const auto& b : out)
      seen = seen || (b.length == a.length && std::memcmp(&b.storage, &a.storage, a.length) == 0);
    if (!seen) out.push_back(a);
  }
  ::freeaddrinfo(res);
  if (out.empty())
    return UnavailableError(fmt::format("cannot resolve host '{}': no IPv4 or IPv6 address", host));
  return out;
}

Result<SocketAddress> Resolve(const HostPort& where) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<SocketAddress> all, ResolveAll(where));
  return all.front();
}

Status SetNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return ErrnoStatus(StatusCode::kInternal, "fcntl(O_NONBLOCK)", errno);
  }
  return OkStatus();
}

void ConfigureStreamSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

namespace {

// Binds and listens on `addr`. A bind or listen that fails sets `*err` to its
// errno (EADDRINUSE: the port is taken), so that a range can try the next port.
Result<Listener> ListenOn(SocketAddress addr, std::string_view shown, int backlog, int* err) {
  *err = 0;
  UniqueFd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    return ErrnoStatus(
        StatusCode::kUnavailable,
        fmt::format("socket ({}) for {}", addr.family() == AF_INET6 ? "IPv6" : "IPv4", shown),
        errno);
  }
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (addr.family() == AF_INET6) {
    // "::" is every interface of both families (whatever net.ipv6.bindv6only says); "::1" or
    // "fd00::1" is that address alone either way.
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&addr.storage);
    int v6only = IN6_IS_ADDR_UNSPECIFIED(&v6->sin6_addr) ? 0 : 1;
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof(v6only));
  }
  if (::bind(fd.get(), addr.get(), addr.length) != 0) {
    *err = errno;
    return ErrnoStatus(StatusCode::kUnavailable, fmt::format("bind {}", shown), *err);
  }
  if (::listen(fd.get(), backlog) != 0) {
    *err = errno;
    return ErrnoStatus(StatusCode::kUnavailable, fmt::format("listen {}", shown), *err);
  }
  Result<HostPort> bound = LocalAddressOf(fd.get());
  if (!bound.ok()) return bound.status();
  if (bound->host == "0.0.0.0") bound->host = "127.0.0.1";  // the wildcard: dial it on loopback
  if (bound->host == "::") bound->host = "::1";
  return Listener{std::move(fd), std::move(*bound)};
}

}  // namespace

Result<Listener> Listen(const HostPort& where, int backlog) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<SocketAddress> all, ResolveAll(where, /*passive=*/true));
  const SocketAddress& addr = all.front();
  int err = 0;
  return ListenOn(addr, where.ToString(), backlog, &err);
}

Result<Listener> ListenInRange(const std::string& host, PortRange ports, int backlog,
                               std::string_view what) {
  if (ports.empty()) return Listen({host, 0}, backlog);
  if (ports.lo == 0 || ports.lo > ports.hi) {
    return InvalidArgumentError(
        fmt::format("{} range {}-{}: not 1 <= LO <= HI <= 65535", what, ports.lo, ports.hi));
  }
  NONSTOP_ASSIGN_OR_RETURN(std::vector<SocketAddress> all,
                           ResolveAll({host, ports.lo}, /*passive=*/true));
  SocketAddress addr = all.front();
  for (int port = ports.lo; port <= ports.hi; ++port) {
    SetPort(&addr, static_cast<uint16_t>(port));
    int err = 0;
    Result<Listener> l =
        ListenOn(addr, FormatHostPort(host, static_cast<uint16_t>(port)), backlog, &err);
    if (l.ok() || err != EADDRINUSE) return l;
  }
  const int n = ports.size();
  return UnavailableError(fmt::format("no free {} in {} ({} port{}, {} in use)", what,
                                      ports.ToString(), n, n == 1 ? "" : "s",
                                      n == 1 ? "it is" : "all"));
}

Result<UniqueFd> Accept(int listen_fd) {
  while (true) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      ConfigureStreamSocket(fd);
      return UniqueFd(fd);
    }
    int err = errno;
    // A connection that died while queued, or a signal: try the next one.
    if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
    if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
      return ErrnoStatus(
          StatusCode::kInternal,
          "accept (HINT: the process is out of descriptors or memory; raise `ulimit -n`)", err);
    }
    return ErrnoStatus(StatusCode::kUnavailable, "accept", err);
  }
}

namespace {

// One non-blocking connect to `addr`, waited for until `deadline`. A refused
// or failed connect sets `*err` to its errno; a deadline or an abort while it
// waits (or no socket at all) is final and leaves `*err` at 0.
Result<UniqueFd> ConnectOnce(const SocketAddress& addr, Deadline deadline, const AbortSignal* abort,
                             const std::string& shown, int* err) {
  *err = 0;
  UniqueFd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) {
    int e = errno;
    if (e == EAFNOSUPPORT) {  // no IPv6 (or IPv4) on this host: the next address may do
      *err = e;
      return ErrnoStatus(StatusCode::kUnavailable, shown, e);
    }
    return ErrnoStatus(StatusCode::kInternal, "socket", e);
  }
  ConfigureStreamSocket(fd.get());
  int rc = ::connect(fd.get(), addr.get(), addr.length);
  int e = rc == 0 ? 0 : errno;
  if (e == EINPROGRESS) {
    NONSTOP_RETURN_IF_ERROR(WaitFd(fd.get(), POLLOUT, deadline, abort, shown));
    socklen_t len = sizeof(e);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &e, &len);
  }
  if (e == 0) return fd;
  *err = e;
  return ErrnoStatus(StatusCode::kUnavailable, shown, e);
}

}  // namespace

Result<UniqueFd> Dial(const HostPort& where, Deadline deadline, const AbortSignal* abort) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<SocketAddress> addrs, ResolveAll(where));
  const std::string shown = "connect " + where.ToString();
  auto backoff = std::chrono::milliseconds(1);
  while (true) {
    bool again = false;  // one of the addresses refused: the peer may not listen yet
    int err = 0;
    for (const SocketAddress& addr : addrs) {
      Result<UniqueFd> fd = ConnectOnce(addr, deadline, abort, shown, &err);
      if (fd.ok() || err == 0) return fd;
      again = again || err == ECONNREFUSED || err == ETIMEDOUT || err == ECONNRESET;
    }
    if (!again) return ErrnoStatus(StatusCode::kUnavailable, shown, err);
    if (Clock::now() + backoff >= deadline) {
      return ErrnoStatus(StatusCode::kUnavailable, shown + " (gave up at deadline)", err);
    }
    if (abort != nullptr && abort->fired()) return AbortedError(shown + " aborted");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

Status WaitFd(int fd, short events, Deadline deadline, const AbortSignal* abort,
              std::string_view what) {
  while (true) {
    if (abort != nullptr && abort->fired()) return AbortedError(std::string(what) + ": aborted");
    pollfd fds[2] = {{fd, events, 0}, {abort != nullptr ? abort->fd() : -1, POLLIN, 0}};
    int rc = ::poll(fds, abort != nullptr ? 2 : 1, PollTimeoutMs(deadline));
    if (rc < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(StatusCode::kInternal, std::string(what) + ": poll", errno);
    }
    if (rc == 0 && Clock::now() >= deadline) {
      return DeadlineExceededError(std::string(what) + ": timed out");
    }
    if (abort != nullptr && (fds[1].revents & POLLIN))
      return AbortedError(std::string(what) + ": aborted");
    // readable, writable, or an error that the I/O call reports
    if (fds[0].revents != 0) return OkStatus();
  }
}

Status SendAll(int fd, std::span<const std::byte> data, Deadline deadline, const AbortSignal* abort,
               std::string_view what) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      NONSTOP_RETURN_IF_ERROR(WaitFd(fd, POLLOUT, deadline, abort, what));
      continue;
    }
    return ErrnoStatus(StatusCode::kUnavailable, std::string(what) + ": send", errno);
  }
  return OkStatus();
}

Status RecvAll(int fd, std::span<std::byte> data, Deadline deadline, const AbortSignal* abort,
               std::string_view what) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::recv(fd, data.data() + done, data.size() - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return UnavailableError(std::string(what) + ": connection closed by peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      NONSTOP_RETURN_IF_ERROR(WaitFd(fd, POLLIN, deadline, abort, what));
      continue;
    }
    return ErrnoStatus(StatusCode::kUnavailable, std::string(what) + ": recv", errno);
  }
  return OkStatus();
}

}  // namespace nonstop::net
