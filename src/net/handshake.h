// The versioned hello that opens every nonstop connection, control or data
// (docs/protocol.md). The dialer speaks first; the acceptor checks the magic,
// the protocol major version, the job token (in constant time), the kind and
// the worker id, and answers with an ack. A connection that does not present
// the job token is refused and closed, and the acceptor never sends its own
// token.
//
// The acceptor's side exists in two forms: ServerHandshake blocks (with a
// deadline and an abort) on one connection; HelloAcceptor never blocks, so a
// single poll loop can hold many connections in handshake at once and one
// silent connection cannot delay the others (PeerMesh's data port).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "common/time.h"
#include "net/frame.h"

namespace nonstop::net {

class AbortSignal;

inline constexpr uint32_t kHelloMagic = 0x5054534E;  // "NSTP" on the wire
inline constexpr uint16_t kProtocolMajor = 1;
inline constexpr uint16_t kProtocolMinor = 0;
// A hello frame is a few dozen bytes; a longer length is refused before anything is read.
inline constexpr uint32_t kMaxHandshakeBytes = 4096;

inline constexpr uint16_t kFrameHello = 1;
inline constexpr uint16_t kFrameHelloAck = 2;
static_assert(kFrameHello == 1 && kFrameHelloAck == 2, "wire numbers are pinned");

// kAgent: an agent on the control port
enum class ConnectionKind : uint16_t { kControl = 1, kData = 2, kAgent = 3 };

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

// The acceptor's checks on a decoded hello: protocol major version, job token
// (compared in constant time), connection kind, and a worker id that is not
// negative. OK, or kFailedPrecondition whose message is the reason to send
// back to the dialer (it never contains the acceptor's token).
Status CheckHello(const Hello& hello, std::string_view job_token, ConnectionKind kind);

// Dialer side: sends `hello`, waits for the ack. kFailedPrecondition when refused.
Status ClientHandshake(int fd, const Hello& hello, Deadline deadline, const AbortSignal* abort);

// Acceptor side, blocking: reads a hello, validates it with CheckHello,
// answers, and returns the peer's hello. On refusal the reason is returned
// (and the caller closes the connection).
Result<Hello> ServerHandshake(int fd, const std::string& job_token, ConnectionKind kind,
                              Deadline deadline, const AbortSignal* abort);

// Acceptor side, non-blocking: the state of one connection's hello, advanced
// by the caller's poll loop. It reads exactly the hello frame (never a byte
// past it, so the stream stays aligned for what follows), refuses a length
// over kMaxHandshakeBytes as soon as the frame header is in, checks the hello
// with CheckHello and then with the caller's `rule`, and writes the ack.
// The caller owns the socket and the deadline.
//
// Thread-safety: none; one loop drives it.
class HelloAcceptor {
 public:
  // The caller's own check, run after CheckHello: OK accepts, otherwise the
  // status message is the reason sent back to the dialer.
  using Rule = std::function<Status(const Hello&)>;

  enum class State { kReading, kWriting, kAccepted, kRefused };

  // `fd` is a connected non-blocking socket that outlives this object.
  HelloAcceptor(int fd, std::string job_token, ConnectionKind kind, Rule rule = nullptr);

  // Does all the I/O the socket allows now, without blocking, and returns the
  // new state. kReading/kWriting: wait for wanted_events() and call again.
  State Advance();

  State state() const { return state_; }
  short wanted_events() const;                   // POLLIN while reading, POLLOUT while writing
  const Hello& hello() const { return hello_; }  // valid in kAccepted
  // Why the connection was refused or failed (kRefused): kFailedPrecondition
  // for a refused hello, kDataLoss for a corrupt frame, kUnavailable when the
  // peer closed or reset the connection.
  const Status& error() const { return error_; }

 private:
  State Refuse(Status why);
  State Decide();

  const int fd_;
  const std::string job_token_;
  const ConnectionKind kind_;
  const Rule rule_;
  State state_ = State::kReading;
  char header_[kFrameHeaderBytes] = {};
  size_t header_got_ = 0;
  std::string payload_;
  size_t payload_got_ = 0;
  uint32_t payload_length_ = 0;
  std::string out_;  // the ack still to send
  size_t out_sent_ = 0;
  Hello hello_;
  Status error_;
};

}  // namespace nonstop::net
