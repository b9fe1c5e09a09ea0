// For tests over IPv6 loopback: why this machine cannot run them, if it
// cannot. A test calls it first and skips with the reason:
//
//   if (std::string why = net::testing::NoIpv6Loopback(); !why.empty()) GTEST_SKIP() << why;
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace nonstop::net::testing {

// Empty when a TCP socket can listen on [::1]; else what failed, with the
// command that shows the loopback's IPv6 addresses.
inline std::string NoIpv6Loopback() {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    return std::string("no IPv6 on this machine: socket(AF_INET6): ") + std::strerror(errno) +
           " (the kernel has IPv6 off, e.g. ipv6.disable=1)";
  }
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  if (rc == 0) rc = ::listen(fd, 1);
  const int err = errno;
  ::close(fd);
  if (rc != 0) {
    return std::string("no IPv6 loopback on this machine: bind/listen [::1]:0: ") +
           std::strerror(err) +
           " (`ip -6 addr show lo` lists no ::1; net.ipv6.conf.lo.disable_ipv6=1?)";
  }
  return "";
}

}  // namespace nonstop::net::testing
