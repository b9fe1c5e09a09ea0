// Addresses as nonstop reads and prints them: IPv4 and IPv6 alike
// (docs/ports.md).
//
//   "10.0.0.1:29400"      IPv4 and a port
//   "ctl-a:29400"         a host name and a port
//   "[fd00::1]:29400"     IPv6 and a port: the brackets are required with a port
//   "10.0.0.1", "ctl-a", "[fd00::1]", "fd00::1"
//                         a host alone, where a port is optional (a default port)
//
// A HostPort holds the host without brackets ("fd00::1"); every address
// nonstop prints goes through FormatHostPort, which brackets an IPv6 host, so
// what one process prints another parses. Errors name the address and what
// is wrong with it ("address '[::1:4000': missing ']'").
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "nonstop/status.h"

namespace nonstop::net {

struct HostPort {
  std::string host;  // a name, an IPv4 literal or an IPv6 literal (no brackets)
  uint16_t port = 0;
  std::string ToString() const;  // FormatHostPort(host, port)
};

// "host:port", with brackets around an IPv6 host ("[::1]:4000"). A host that
// is bracketed already is printed as it is.
std::string FormatHostPort(std::string_view host, uint16_t port);
// The host as a URL or an address list writes it: "[::1]", "10.0.0.1", "ctl-a".
std::string FormatHost(std::string_view host);
// "[::1]" → "::1"; any other host is returned as it is.
std::string_view UnbracketHost(std::string_view host);

// Parses an address (see the top of this file). Without `default_port` the
// port is required; with one, a host alone takes it, and so does a bare IPv6
// literal ("fd00::1"). An IPv6 address with a port needs brackets:
// "::1:4000" is refused (it is also a valid IPv6 address) with a hint.
Result<HostPort> ParseHostPort(std::string_view text,
                               std::optional<uint16_t> default_port = std::nullopt);

// A host alone (no port): "ctl-a", "10.0.0.1", "fd00::1" or "[fd00::1]";
// returned without brackets.
Result<std::string> ParseHost(std::string_view text);

bool IsIpv6Literal(std::string_view host);  // "::1", "fd00::1%eth0" (no brackets)
bool IsIpv4Literal(std::string_view host);
// "0.0.0.0", "::" (or "[::]"), "": every interface.
bool IsWildcardHost(std::string_view host);
// 127.0.0.0/8, ::1, ::ffff:127.x.y.z and "localhost".
bool IsLoopbackHost(std::string_view host);

// A range of ports, both ends included; {0, 0}: none (a port from the OS).
struct PortRange {
  uint16_t lo = 0;
  uint16_t hi = 0;
  bool empty() const { return lo == 0 && hi == 0; }
  int size() const { return empty() ? 0 : hi - lo + 1; }
  std::string ToString() const;  // "40000-40003", "40000" for one port, "" when empty
};

// "LO-HI" (1 <= LO <= HI <= 65535), a single "PORT", or "" (empty: none).
Result<PortRange> ParsePortRange(std::string_view text);

// A socket address of either family, as getaddrinfo, getsockname and
// getpeername give it.
struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  int family() const { return storage.ss_family; }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
  sockaddr* get() { return reinterpret_cast<sockaddr*>(&storage); }
  // The numeric host and the port; an IPv4-mapped IPv6 address
  // (::ffff:10.0.0.1, what a dual-stack listener sees of an IPv4 peer) reads
  // as the IPv4 address.
  HostPort ToHostPort() const;
};

// The local and the remote end of a socket; kUnavailable when the socket has none.
Result<HostPort> LocalAddressOf(int fd);
Result<HostPort> PeerAddressOf(int fd);

}  // namespace nonstop::net
