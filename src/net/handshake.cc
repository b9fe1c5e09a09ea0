#include "net/handshake.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

#include <fmt/format.h>

#include "common/coding.h"
#include "common/constant_time.h"
#include "net/socket.h"

namespace nonstop::net {

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

Status CheckHello(const Hello& hello, std::string_view job_token, ConnectionKind kind) {
  if (hello.proto_major != kProtocolMajor) {
    return FailedPreconditionError(
        fmt::format("protocol version {}.{} is not supported (this side speaks {}.{})",
                    hello.proto_major, hello.proto_minor, kProtocolMajor, kProtocolMinor));
  }
  if (!ConstantTimeEquals(hello.job_token, job_token)) {
    return FailedPreconditionError("job token mismatch: this connection belongs to another job");
  }
  if (hello.kind != kind) {
    return FailedPreconditionError(fmt::format("connection kind {} is not accepted on this port",
                                               static_cast<int>(hello.kind)));
  }
  if (hello.worker_id < 0) {
    return FailedPreconditionError(
        fmt::format("worker id {} is negative: a worker id is a number >= 0 unique in the job",
                    hello.worker_id));
  }
  return OkStatus();
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

Result<Hello> ServerHandshake(int fd, const std::string& job_token, ConnectionKind kind,
                              Deadline deadline, const AbortSignal* abort) {
  HelloAcceptor acceptor(fd, job_token, kind);
  while (true) {
    switch (acceptor.Advance()) {
      case HelloAcceptor::State::kAccepted:
        return acceptor.hello();
      case HelloAcceptor::State::kRefused:
        return acceptor.error();
      default:
        NONSTOP_RETURN_IF_ERROR(WaitFd(fd, acceptor.wanted_events(), deadline, abort, "hello"));
    }
  }
}

HelloAcceptor::HelloAcceptor(int fd, std::string job_token, ConnectionKind kind, Rule rule)
    : fd_(fd), job_token_(std::move(job_token)), kind_(kind), rule_(std::move(rule)) {}

short HelloAcceptor::wanted_events() const { return state_ == State::kWriting ? POLLOUT : POLLIN; }

HelloAcceptor::State HelloAcceptor::Advance() {
  // Reads only as many bytes as the hello frame still needs.
  auto read_some = [&](char* dst, size_t want, size_t* got) -> bool {
    while (*got < want) {
      ssize_t n = ::recv(fd_, dst + *got, want - *got, 0);
      if (n > 0) {
        *got += static_cast<size_t>(n);
        continue;
      }
      if (n == 0) {
        Refuse(UnavailableError("connection closed by the peer during the hello"));
        return false;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        Refuse(ErrnoStatus(StatusCode::kUnavailable, "hello: recv", errno));
      return false;
    }
    return true;
  };
  if (state_ == State::kReading) {
    if (header_got_ < kFrameHeaderBytes) {
      if (!read_some(header_, kFrameHeaderBytes, &header_got_)) return state_;
      payload_length_ = DecodeFixed32(header_);
      if (payload_length_ > kMaxHandshakeBytes) {
        return Refuse(FailedPreconditionError(
            fmt::format("a hello of {} bytes exceeds the limit of {} bytes: not a nonstop peer",
                        payload_length_, kMaxHandshakeBytes)));
      }
      payload_.resize(payload_length_);
    }
    if (!read_some(payload_.data(), payload_.size(), &payload_got_)) return state_;
    return Decide();
  }
  if (state_ == State::kWriting) {
    while (out_sent_ < out_.size()) {
      ssize_t n = ::send(fd_, out_.data() + out_sent_, out_.size() - out_sent_, MSG_NOSIGNAL);
      if (n > 0) {
        out_sent_ += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return state_;
      return Refuse(ErrnoStatus(StatusCode::kUnavailable, "hello ack: send", errno));
    }
    state_ = State::kAccepted;
  }
  return state_;
}

HelloAcceptor::State HelloAcceptor::Decide() {
  FrameDecoder decoder(kMaxHandshakeBytes);
  Status fed = decoder.Feed(std::string_view(header_, kFrameHeaderBytes));
  if (fed.ok()) fed = decoder.Feed(payload_);
  if (!fed.ok()) return Refuse(fed);
  std::optional<Frame> frame = decoder.Next();
  NONSTOP_CHECK(frame.has_value()) << "a complete frame was fed";
  if (frame->type != kFrameHello) {
    return Refuse(FailedPreconditionError(
        fmt::format("first frame has type {}, expected hello", frame->type)));
  }
  Result<Hello> hello = DecodeHello(frame->payload);
  if (!hello.ok()) return Refuse(FailedPreconditionError(hello.status().message()));
  Status verdict = CheckHello(*hello, job_token_, kind_);
  if (verdict.ok() && rule_) verdict = rule_(*hello);
  if (!verdict.ok()) return Refuse(FailedPreconditionError(verdict.message()));
  hello_ = std::move(*hello);
  out_ = EncodeFrame(kFrameHelloAck, std::string(1, '\1'));
  state_ = State::kWriting;
  return Advance();
}

HelloAcceptor::State HelloAcceptor::Refuse(Status why) {
  if (why.code() == StatusCode::kFailedPrecondition || why.code() == StatusCode::kDataLoss) {
    // Best effort, without waiting: the peer learns why, then the caller closes.
    std::string ack = EncodeFrame(kFrameHelloAck, std::string(1, '\0') + why.message());
    (void)::send(fd_, ack.data(), ack.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  error_ = why.code() == StatusCode::kFailedPrecondition
               ? FailedPreconditionError("refused connection: " + why.message())
               : std::move(why);
  state_ = State::kRefused;
  return state_;
}

}  // namespace nonstop::net
