// TCP sockets: listen on an OS-chosen port, dial with a deadline, and wait on
// a descriptor together with an AbortSignal. All sockets nonstop creates are
// non-blocking and TCP_NODELAY; blocking behaviour is built from poll(2) with
// a deadline and an abort descriptor, so no wait in nonstop is unbounded or
// deaf to an abort.
#pragma once

#include <netinet/in.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "common/time.h"
#include "common/unique_fd.h"

namespace nonstop::net {

class AbortSignal;

struct HostPort {
  std::string host;
  uint16_t port = 0;
  std::string ToString() const;
};

// Parses "host:port" ("127.0.0.1:29500", "localhost:0").
Result<HostPort> ParseHostPort(std::string_view text);

struct Listener {
  UniqueFd fd;
  HostPort address;  // the bound address, with the OS-chosen port filled in
};

// Binds and listens on host:port; port 0 takes one from the OS.
Result<Listener> Listen(const HostPort& where, int backlog = 128);

// Accepts one connection if one is pending; kUnavailable with EAGAIN otherwise.
// Connections that died in the queue are skipped. kInternal when the process
// is out of descriptors or memory: the listening socket stays readable, so a
// poll loop should stop watching it for a moment instead of spinning.
Result<UniqueFd> Accept(int listen_fd);

// Dials `where`, retrying refused connections until `deadline` (the peer may
// not be listening yet).
Result<UniqueFd> Dial(const HostPort& where, Deadline deadline, const AbortSignal* abort = nullptr);
// The IPv4 address of `where` (a literal, or a name looked up with
// getaddrinfo, which may block): the control and data planes speak IPv4.
Result<sockaddr_in> Resolve(const HostPort& where);

Status SetNonBlocking(int fd);
void ConfigureStreamSocket(int fd);  // TCP_NODELAY, keepalive

// Waits until `fd` has `events` (POLLIN/POLLOUT), the deadline passes
// (kDeadlineExceeded) or `abort` fires (kAborted).
Status WaitFd(int fd, short events, Deadline deadline, const AbortSignal* abort, std::string_view what);

// Blocking-style full send/receive over a non-blocking socket. A closed or
// reset connection is kUnavailable.
Status SendAll(int fd, std::span<const std::byte> data, Deadline deadline, const AbortSignal* abort,
               std::string_view what);
Status RecvAll(int fd, std::span<std::byte> data, Deadline deadline, const AbortSignal* abort,
               std::string_view what);

}  // namespace nonstop::net
