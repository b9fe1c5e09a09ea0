// netns_echo: the tiny TCP peer that netns_test runs inside the cluster's namespaces.
//
//   netns_echo listen ADDR PORTFILE      binds ADDR:0, writes the port to PORTFILE (atomically: a
//   temporary
//                                        file renamed), then echoes one line per connection,
//                                        forever
//   netns_echo dial ADDR PORT [TIMEOUT_MS]  connects (TIMEOUT_MS, default 2000, for the connect and
//   for the
//                                        echo), sends a line and checks that the same line comes
//                                        back
//
// Exit codes: 0 ok, 1 failure (said on stderr), 2 usage.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

int Fail(const std::string& what) {
  fmt::print(stderr, "netns_echo: {}: {}\n", what, std::strerror(errno));
  return 1;
}

bool ParseAddress(const char* addr, int port, sockaddr_in* out) {
  *out = {};
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(port));
  return ::inet_pton(AF_INET, addr, &out->sin_addr) == 1;
}

int MillisLeft(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms > 0 ? static_cast<int>(ms) : 0;
}

// Waits for `events` on fd until the deadline; false on timeout (errno = ETIMEDOUT) or error.
bool WaitFor(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, MillisLeft(deadline));
    if (r > 0) return true;
    if (r == 0) {
      errno = ETIMEDOUT;
      return false;
    }
    if (errno != EINTR) return false;
  }
}

// Reads one line (up to '\n', which is kept) until the deadline.
bool ReadLine(int fd, std::string* line, Clock::time_point deadline) {
  line->clear();
  char c;
  while (line->size() < 4096) {
    if (!WaitFor(fd, POLLIN, deadline)) return false;
    ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = ECONNRESET;
      return false;
    }
    line->push_back(c);
    if (c == '\n') return true;
  }
  errno = EMSGSIZE;
  return false;
}

bool WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

int Listen(const char* addr, const std::string& port_file) {
  sockaddr_in sa;
  if (!ParseAddress(addr, 0, &sa)) {
    fmt::print(stderr, "netns_echo: bad IPv4 address {}\n", addr);
    return 2;
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Fail("socket");
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0)
    return Fail(fmt::format("bind {}:0", addr));
  if (::listen(fd, 64) != 0) return Fail("listen");
  socklen_t len = sizeof sa;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return Fail("getsockname");
  std::string tmp = port_file + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return Fail("open " + tmp);
  fmt::print(f, "{}\n", ntohs(sa.sin_port));
  if (std::fclose(f) != 0) return Fail("write " + tmp);
  if (std::rename(tmp.c_str(), port_file.c_str()) != 0) return Fail("rename to " + port_file);
  fmt::print("netns_echo: listening on {}:{}\n", addr, ntohs(sa.sin_port));
  std::fflush(stdout);
  for (;;) {
    int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return Fail("accept");
    }
    std::string line;
    // One line per connection; a slow or silent peer costs at most 5 s.
    if (ReadLine(c, &line, Clock::now() + std::chrono::seconds(5))) WriteAll(c, line);
    ::close(c);
  }
}

int Dial(const char* addr, int port, int timeout_ms) {
  sockaddr_in sa;
  if (!ParseAddress(addr, port, &sa) || port <= 0 || port > 65535) {
    fmt::print(stderr, "netns_echo: bad address {}:{}\n", addr, port);
    return 2;
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Fail("socket");
  const std::string where = fmt::format("{}:{}", addr, port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    if (errno != EINPROGRESS) return Fail("connect " + where);
    if (!WaitFor(fd, POLLOUT, deadline)) return Fail("connect " + where);
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      errno = err;
      return Fail("connect " + where);
    }
  }
  const std::string hello = fmt::format("hello from pid {}\n", ::getpid());
  if (!WriteAll(fd, hello)) return Fail("send to " + where);
  std::string echo;
  if (!ReadLine(fd, &echo, deadline)) return Fail("read echo from " + where);
  if (echo != hello) {
    fmt::print(stderr, "netns_echo: {} echoed \"{}\", expected \"{}\"\n", where, echo, hello);
    return 1;
  }
  fmt::print("netns_echo: {} echoed\n", where);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "listen" && argc == 4) return Listen(argv[2], argv[3]);
  if (mode == "dial" && (argc == 4 || argc == 5)) {
    return Dial(argv[2], std::atoi(argv[3]), argc == 5 ? std::atoi(argv[4]) : 2000);
  }
  fmt::print(stderr,
             "usage: netns_echo listen ADDR PORTFILE | netns_echo dial ADDR PORT [TIMEOUT_MS]\n");
  return 2;
}
