#include "net/address.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cctype>
#include <charconv>
#include <cstring>

#include <fmt/format.h>

namespace nonstop::net {

namespace {

Status Bad(std::string_view text, std::string_view what) {
  return InvalidArgumentError(fmt::format("address '{}': {}", text, what));
}

// A port: 0-65535, digits only.
Result<uint16_t> ParsePort(std::string_view text, std::string_view port) {
  unsigned value = 0;
  auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || end != port.data() + port.size() || value > 65535) {
    return Bad(text, fmt::format("bad port '{}' (a number from 0 to 65535)", port));
  }
  return static_cast<uint16_t>(value);
}

// A host name or an IPv4 literal: letters, digits, '-', '.' and '_'.
Status CheckName(std::string_view text, std::string_view host) {
  if (host.empty()) return Bad(text, "no host before the port");
  if (host.size() > 253) return Bad(text, "the host is over 253 characters");
  for (char c : host) {
    bool ok = std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '.' || c == '_';
    if (!ok) {
      std::string shown = std::isprint(static_cast<unsigned char>(c)) != 0
                              ? fmt::format("'{}'", c)
                              : fmt::format("byte 0x{:02x}", c);
      return Bad(text, fmt::format("{} is not allowed in a host name", shown));
    }
  }
  return OkStatus();
}

// "[v6]" or "[v6]:port".
Result<HostPort> ParseBracketed(std::string_view text, std::optional<uint16_t> default_port) {
  size_t close = text.find(']');
  if (close == std::string_view::npos) return Bad(text, "missing ']'");
  std::string_view host = text.substr(1, close - 1);
  if (host.empty()) return Bad(text, "nothing between '[' and ']'");
  if (!IsIpv6Literal(host))
    return Bad(text, fmt::format("'{}' in brackets is not an IPv6 address", host));
  std::string_view rest = text.substr(close + 1);
  if (rest.empty()) {
    if (!default_port) return Bad(text, fmt::format("no port (HINT: [{}]:PORT)", host));
    return HostPort{std::string(host), *default_port};
  }
  if (rest[0] != ':')
    return Bad(text, fmt::format("unexpected '{}' after ']' (HINT: [{}]:PORT)", rest, host));
  NONSTOP_ASSIGN_OR_RETURN(uint16_t port, ParsePort(text, rest.substr(1)));
  return HostPort{std::string(host), port};
}

}  // namespace

std::string_view UnbracketHost(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    return host.substr(1, host.size() - 2);
  return host;
}

std::string FormatHost(std::string_view host) {
  if (!host.empty() && host.front() == '[') return std::string(host);
  if (host.find(':') != std::string_view::npos) return fmt::format("[{}]", host);
  return std::string(host);
}

std::string FormatHostPort(std::string_view host, uint16_t port) {
  return fmt::format("{}:{}", FormatHost(host), port);
}

std::string HostPort::ToString() const { return FormatHostPort(host, port); }

bool IsIpv6Literal(std::string_view host) {
  // a zone ("%eth0") is getaddrinfo's to read
  std::string_view address = host.substr(0, host.find('%'));
  if (address.empty() || address.size() >= INET6_ADDRSTRLEN || address.size() == host.size() - 1)
    return false;
  in6_addr out{};
  return ::inet_pton(AF_INET6, std::string(address).c_str(), &out) == 1;
}

bool IsIpv4Literal(std::string_view host) {
  if (host.empty() || host.size() >= INET_ADDRSTRLEN) return false;
  in_addr out{};
  return ::inet_pton(AF_INET, std::string(host).c_str(), &out) == 1;
}

bool IsWildcardHost(std::string_view host) {
  host = UnbracketHost(host);
  if (host.empty() || host == "0.0.0.0") return true;
  if (!IsIpv6Literal(host)) return false;
  in6_addr a{};
  ::inet_pton(AF_INET6, std::string(host).c_str(), &a);
  return IN6_IS_ADDR_UNSPECIFIED(&a);
}

bool IsLoopbackHost(std::string_view host) {
  host = UnbracketHost(host);
  if (host == "localhost") return true;
  if (IsIpv4Literal(host)) {
    in_addr a{};
    ::inet_pton(AF_INET, std::string(host).c_str(), &a);
    return (ntohl(a.s_addr) >> 24) == 127;
  }
  if (!IsIpv6Literal(host) || host.find('%') != std::string_view::npos) return false;
  in6_addr a{};
  ::inet_pton(AF_INET6, std::string(host).c_str(), &a);
  if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
  return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
}

Result<HostPort> ParseHostPort(std::string_view text, std::optional<uint16_t> default_port) {
  if (text.empty())
    return InvalidArgumentError("address '': empty (HINT: host:port, or [IPv6]:port)");
  if (text.front() == '[') return ParseBracketed(text, default_port);
  if (text.find(']') != std::string_view::npos) return Bad(text, "']' without '['");
  size_t colon = text.find(':');
  if (colon == std::string_view::npos) {  // a host alone
    if (!default_port) return Bad(text, "no port (HINT: host:port, or [IPv6]:port)");
    NONSTOP_RETURN_IF_ERROR(CheckName(text, text));
    return HostPort{std::string(text), *default_port};
  }
  if (text.find(':', colon + 1) != std::string_view::npos) {  // two colons or more: IPv6
    if (default_port && IsIpv6Literal(text)) return HostPort{std::string(text), *default_port};
    size_t last = text.rfind(':');
    std::string_view head = text.substr(0, last);
    if (IsIpv6Literal(head)) {  // "::1:4000" (an IPv6 address too, but with a port it is ambiguous)
      return Bad(text, fmt::format("an IPv6 address with a port needs brackets (HINT: [{}]:{})",
                                   head, text.substr(last + 1)));
    }
    if (IsIpv6Literal(text)) return Bad(text, fmt::format("no port (HINT: [{}]:PORT)", text));
    return Bad(text, "not host:port, [IPv6]:port nor an IPv6 address");
  }
  std::string_view host = text.substr(0, colon);
  NONSTOP_RETURN_IF_ERROR(CheckName(text, host));
  NONSTOP_ASSIGN_OR_RETURN(uint16_t port, ParsePort(text, text.substr(colon + 1)));
  return HostPort{std::string(host), port};
}

Result<std::string> ParseHost(std::string_view text) {
  if (text.empty()) return InvalidArgumentError("host '': empty");
  auto parsed = ParseHostPort(text, uint16_t{0});
  if (!parsed.ok()) return parsed.status();
  // "name:80" and "[::1]:80" parse as addresses with a port, which is not a host alone.
  bool with_port = text.front() == '['
                       ? text.back() != ']'
                       : text.find(':') != std::string_view::npos && !IsIpv6Literal(text);
  if (with_port)
    return InvalidArgumentError(fmt::format("host '{}': a host alone, without a port", text));
  return parsed->host;
}

std::string PortRange::ToString() const {
  if (empty()) return "";
  if (lo == hi) return std::to_string(lo);
  return fmt::format("{}-{}", lo, hi);
}

Result<PortRange> ParsePortRange(std::string_view text) {
  if (text.empty()) return PortRange{};
  auto bad = [&] {
    return InvalidArgumentError(fmt::format(
        "port range '{}': not LO-HI with 1 <= LO <= HI <= 65535 (e.g. 40000-40099), nor one port",
        text));
  };
  size_t dash = text.find('-');
  std::string_view lo_text = text.substr(0, dash);
  std::string_view hi_text = dash == std::string_view::npos ? lo_text : text.substr(dash + 1);
  auto number = [](std::string_view t) -> std::optional<unsigned> {
    unsigned v = 0;
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size()) return std::nullopt;
    return v;
  };
  auto lo = number(lo_text);
  auto hi = number(hi_text);
  if (!lo || !hi || *lo < 1 || *hi > 65535 || *lo > *hi) return bad();
  return PortRange{static_cast<uint16_t>(*lo), static_cast<uint16_t>(*hi)};
}

HostPort SocketAddress::ToHostPort() const {
  char text[INET6_ADDRSTRLEN] = {};
  if (family() == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&storage);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    return {text, ntohs(a->sin_port)};
  }
  if (family() == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&storage);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
      ::inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], text, sizeof(text));
    } else {
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    }
    return {text, ntohs(a->sin6_port)};
  }
  return {"", 0};
}

namespace {

Result<HostPort> EndOf(int fd, bool local) {
  SocketAddress a;
  a.length = sizeof(a.storage);
  int rc = local ? ::getsockname(fd, a.get(), &a.length) : ::getpeername(fd, a.get(), &a.length);
  if (rc != 0)
    return ErrnoStatus(StatusCode::kUnavailable, local ? "getsockname" : "getpeername", errno);
  if (a.family() != AF_INET && a.family() != AF_INET6) {
    return UnavailableError(fmt::format("{}: not an IP socket (family {})",
                                        local ? "getsockname" : "getpeername", a.family()));
  }
  return a.ToHostPort();
}

}  // namespace

Result<HostPort> LocalAddressOf(int fd) { return EndOf(fd, /*local=*/true); }
Result<HostPort> PeerAddressOf(int fd) { return EndOf(fd, /*local=*/false); }

}  // namespace nonstop::net
