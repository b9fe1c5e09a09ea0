#include "net/handshake.h"

#include <fmt/format.h>

#include "common/coding.h"
#include "net/frame.h"

namespace nonstop::net {

namespace {
constexpr uint32_t kMaxHandshakeBytes = 4096;
}

std::string EncodeHello(const Hello& hello) {
  std::string out;
  PutFixed32(&out, kHelloMagic);
  PutFixed16(&out, hello.proto_major);
  PutFixed16(&out, hello.proto_minor);
  PutFixed16(&out, static_cast<uint16_t>(hello.kind));
  PutFixed32(&out, hello.generation);
  PutFixed32(&out, static_cast<uint32_t>(hello.worker_id));
  PutFixed16(&out, static_cast<uint16_t>(hello.job_token.size()));
  out += hello.job_token;
  return out;
}

Result<Hello> DecodeHello(std::string_view payload) {
  ByteReader r(payload);
  uint32_t magic = 0, generation = 0, worker = 0;
  uint16_t major = 0, minor = 0, kind = 0, token_len = 0;
  std::string_view token;
  if (!r.ReadFixed32(&magic) || magic != kHelloMagic) {
    return InvalidArgumentError("hello has a bad magic: not a nonstop peer");
  }
  if (!r.ReadFixed16(&major) || !r.ReadFixed16(&minor) || !r.ReadFixed16(&kind) ||
      !r.ReadFixed32(&generation) || !r.ReadFixed32(&worker) || !r.ReadFixed16(&token_len) ||
      !r.ReadBytes(token_len, &token)) {
    return InvalidArgumentError("hello is truncated");
  }
  Hello h;
  h.proto_major = major;
  h.proto_minor = minor;
  h.kind = static_cast<ConnectionKind>(kind);
  h.generation = generation;
  h.worker_id = static_cast<int32_t>(worker);
  h.job_token = std::string(token);
  return h;
}

Status ClientHandshake(int fd, const Hello& hello, Deadline deadline, const AbortSignal* abort) {
  NONSTOP_RETURN_IF_ERROR(WriteFrame(fd, kFrameHello, EncodeHello(hello), deadline, abort));
  NONSTOP_ASSIGN_OR_RETURN(Frame ack, ReadFrame(fd, deadline, abort, kMaxHandshakeBytes));
  if (ack.type != kFrameHelloAck || ack.payload.empty()) {
    return InternalError(fmt::format("expected a hello ack, got frame type {}", ack.type));
  }
  if (ack.payload[0] != 1) {
    return FailedPreconditionError("connection refused by peer: " + ack.payload.substr(1));
  }
  return OkStatus();
}

Result<Hello> ServerHandshake(int fd, const std::string& job_token, ConnectionKind kind, Deadline deadline,
                              const AbortSignal* abort) {
  NONSTOP_ASSIGN_OR_RETURN(Frame frame, ReadFrame(fd, deadline, abort, kMaxHandshakeBytes));
  std::string refusal;
  Result<Hello> hello = InvalidArgumentError("unset");
  if (frame.type != kFrameHello) {
    refusal = fmt::format("first frame has type {}, expected hello", frame.type);
  } else {
    hello = DecodeHello(frame.payload);
    if (!hello.ok()) {
      refusal = hello.status().message();
    } else if (hello->proto_major != kProtocolMajor) {
      refusal = fmt::format("protocol version {}.{} is not supported (this side speaks {}.{})",
                            hello->proto_major, hello->proto_minor, kProtocolMajor, kProtocolMinor);
    } else if (hello->job_token != job_token) {
      refusal = "job token mismatch: this connection belongs to another job";
    } else if (hello->kind != kind) {
      refusal = fmt::format("connection kind {} is not accepted on this port",
                            static_cast<int>(hello->kind));
    }
  }
  if (!refusal.empty()) {
    // Best effort: the peer learns why, then we close.
    (void)WriteFrame(fd, kFrameHelloAck, std::string(1, '\0') + refusal, DeadlineAfter(Millis(100)), abort);
    return FailedPreconditionError("refused connection: " + refusal);
  }
  NONSTOP_RETURN_IF_ERROR(WriteFrame(fd, kFrameHelloAck, std::string(1, '\1'), deadline, abort));
  return hello;
}

}  // namespace nonstop::net
