// TCP sockets over IPv4 and IPv6: listen on a port (one from the OS, or the
// first free one of a range), dial with a deadline, and wait on a descriptor
// together with an AbortSignal. All sockets nonstop creates are non-blocking
// and TCP_NODELAY; blocking behaviour is built from poll(2) with a deadline
// and an abort descriptor, so no wait in nonstop is unbounded or deaf to an
// abort. Addresses: net/address.h (docs/ports.md).
#pragma once

#include <netinet/in.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/time.h"
#include "common/unique_fd.h"
#include "net/address.h"
#include "nonstop/status.h"

namespace nonstop::net {

class AbortSignal;

struct Listener {
  UniqueFd fd;
  // The bound address, with the OS-chosen port filled in. A wildcard host
  // reads as the loopback address of its family ("0.0.0.0" as 127.0.0.1,
  // "::" as ::1): an address this host can dial.
  HostPort address;
};

// Binds and listens on host:port; port 0 takes one from the OS. The host is
// an IPv4 or IPv6 literal (bracketed or not) or a name (its first address).
// "::" listens on every interface of both families; "0.0.0.0" on IPv4 only.
Result<Listener> Listen(const HostPort& where, int backlog = 128);

// Binds the first port of `ports` that is free on `host` (ports in use are
// skipped); an empty range takes one from the OS. When every port is in use:
// kUnavailable "no free <what> in LO-HI (N ports, all in use)".
Result<Listener> ListenInRange(const std::string& host, PortRange ports, int backlog = 128,
                               std::string_view what = "port");

// Accepts one connection if one is pending; kUnavailable with EAGAIN otherwise.
// Connections that died in the queue are skipped. kInternal when the process
// is out of descriptors or memory: the listening socket stays readable, so a
// poll loop should stop watching it for a moment instead of spinning.
Result<UniqueFd> Accept(int listen_fd);

// Dials `where`, retrying refused connections until `deadline` (the peer may
// not be listening yet). A name with several addresses: each in turn.
Result<UniqueFd> Dial(const HostPort& where, Deadline deadline, const AbortSignal* abort = nullptr);

// The addresses of `where`: a literal (IPv4, or IPv6 with or without
// brackets) at once; a name through getaddrinfo (either family, in the
// system's order of preference; this may block). "localhost" is 127.0.0.1,
// as the listeners bind it. kUnavailable when a name does not resolve.
// `passive`: the addresses are to listen on (getaddrinfo AI_PASSIVE).
Result<std::vector<SocketAddress>> ResolveAll(const HostPort& where, bool passive = false);
// The first of them.
Result<SocketAddress> Resolve(const HostPort& where);

Status SetNonBlocking(int fd);
void ConfigureStreamSocket(int fd);  // TCP_NODELAY, keepalive

// Waits until `fd` has `events` (POLLIN/POLLOUT), the deadline passes
// (kDeadlineExceeded) or `abort` fires (kAborted).
Status WaitFd(int fd, short events, Deadline deadline, const AbortSignal* abort,
              std::string_view what);

// Blocking-style full send/receive over a non-blocking socket. A closed or
// reset connection is kUnavailable.
Status SendAll(int fd, std::span<const std::byte> data, Deadline deadline, const AbortSignal* abort,
               std::string_view what);
Status RecvAll(int fd, std::span<std::byte> data, Deadline deadline, const AbortSignal* abort,
               std::string_view what);

}  // namespace nonstop::net
