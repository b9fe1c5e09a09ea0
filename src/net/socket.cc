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
#include <thread>

#include "net/abort_signal.h"

namespace nonstop::net {

std::string HostPort::ToString() const { return host + ":" + std::to_string(port); }

Result<HostPort> ParseHostPort(std::string_view text) {
  size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return InvalidArgumentError("address '" + std::string(text) + "' is not host:port");
  }
  std::string_view port_text = text.substr(colon + 1);
  unsigned port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port > 65535) {
    return InvalidArgumentError("address '" + std::string(text) + "' has a bad port '" +
                                std::string(port_text) + "'");
  }
  return HostPort{std::string(text.substr(0, colon)), static_cast<uint16_t>(port)};
}

Result<sockaddr_in> Resolve(const HostPort& where) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(where.port);
  std::string host = where.host == "localhost" ? "127.0.0.1" : where.host;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return UnavailableError("cannot resolve host '" + where.host + "': " + ::gai_strerror(rc));
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return addr;
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

Result<Listener> Listen(const HostPort& where, int backlog) {
  NONSTOP_ASSIGN_OR_RETURN(sockaddr_in addr, Resolve(where));
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoStatus(StatusCode::kInternal, "socket", errno);
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable, "bind " + where.ToString(), errno);
  }
  if (::listen(fd.get(), backlog) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable, "listen " + where.ToString(), errno);
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
  char text[INET_ADDRSTRLEN];
  ::inet_ntop(AF_INET, &bound.sin_addr, text, sizeof(text));
  std::string host = text;
  if (host == "0.0.0.0") host = "127.0.0.1";
  return Listener{std::move(fd), HostPort{host, ntohs(bound.sin_port)}};
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
      return ErrnoStatus(StatusCode::kInternal,
                         "accept (HINT: the process is out of descriptors or memory; raise `ulimit -n`)", err);
    }
    return ErrnoStatus(StatusCode::kUnavailable, "accept", err);
  }
}

Result<UniqueFd> Dial(const HostPort& where, Deadline deadline, const AbortSignal* abort) {
  NONSTOP_ASSIGN_OR_RETURN(sockaddr_in addr, Resolve(where));
  auto backoff = std::chrono::milliseconds(1);
  while (true) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) return ErrnoStatus(StatusCode::kInternal, "socket", errno);
    ConfigureStreamSocket(fd.get());
    int rc = ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      NONSTOP_RETURN_IF_ERROR(WaitFd(fd.get(), POLLOUT, deadline, abort, "connect " + where.ToString()));
      socklen_t len = sizeof(err);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    }
    if (err == 0) return fd;
    if (err != ECONNREFUSED && err != ETIMEDOUT && err != ECONNRESET) {
      return ErrnoStatus(StatusCode::kUnavailable, "connect " + where.ToString(), err);
    }
    if (Clock::now() + backoff >= deadline) {
      return ErrnoStatus(StatusCode::kUnavailable, "connect " + where.ToString() + " (gave up at deadline)", err);
    }
    if (abort != nullptr && abort->fired()) return AbortedError("connect " + where.ToString() + " aborted");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
}

Status WaitFd(int fd, short events, Deadline deadline, const AbortSignal* abort, std::string_view what) {
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
    if (abort != nullptr && (fds[1].revents & POLLIN)) return AbortedError(std::string(what) + ": aborted");
    if (fds[0].revents != 0) return OkStatus();  // readable, writable, or an error that the I/O call reports
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
