// The versioned hello that opens every nonstop connection, control or data
// (docs/protocol.md). The dialer speaks first; the acceptor checks the magic,
// the protocol major version and the job token, and answers with an ack. A
// connection that does not present the job token is refused and closed, and
// the acceptor never sends its own token.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "common/time.h"

namespace nonstop::net {

class AbortSignal;

inline constexpr uint32_t kHelloMagic = 0x5054534E;  // "NSTP" on the wire
inline constexpr uint16_t kProtocolMajor = 1;
inline constexpr uint16_t kProtocolMinor = 0;

inline constexpr uint16_t kFrameHello = 1;
inline constexpr uint16_t kFrameHelloAck = 2;
static_assert(kFrameHello == 1 && kFrameHelloAck == 2, "wire numbers are pinned");

enum class ConnectionKind : uint16_t { kControl = 1, kData = 2 };

struct Hello {
  uint16_t proto_major = kProtocolMajor;
  uint16_t proto_minor = kProtocolMinor;
  ConnectionKind kind = ConnectionKind::kData;
  uint32_t generation = 0;
  int32_t worker_id = -1;
  std::string job_token;
};

std::string EncodeHello(const Hello& hello);
Result<Hello> DecodeHello(std::string_view payload);

// Dialer side: sends `hello`, waits for the ack. kFailedPrecondition when refused.
Status ClientHandshake(int fd, const Hello& hello, Deadline deadline, const AbortSignal* abort);

// Acceptor side: reads a hello, validates it against `job_token` and `kind`,
// answers, and returns the peer's hello. On refusal the reason is returned
// (and the caller closes the connection).
Result<Hello> ServerHandshake(int fd, const std::string& job_token, ConnectionKind kind, Deadline deadline,
                              const AbortSignal* abort);

}  // namespace nonstop::net
