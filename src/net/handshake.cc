#include "net/handshake.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <span>

#include <fmt/format.h>

#include "common/check.h"
#include "common/coding.h"
#include "common/role_keys.h"
#include "net/socket.h"

namespace nonstop::net {

namespace {

constexpr std::string_view kAcceptorRole = "nonstop handshake v2: acceptor proof";
constexpr std::string_view kDialerRole = "nonstop handshake v2: dialer proof";

// The session keys of a connection: one per direction, from the job key and the transcript (the
// hello, with the dialer's nonce, and the acceptor's nonce).
Channel MakeChannel(const crypto::Key& key, std::string_view hello_payload,
                    std::string_view acceptor_nonce, bool dialer) {
  std::string transcript = std::string(hello_payload) + std::string(acceptor_nonce);
  crypto::Key to_acceptor =
      crypto::DeriveKey(key, "nonstop session: dialer to acceptor", transcript);
  crypto::Key to_dialer = crypto::DeriveKey(key, "nonstop session: acceptor to dialer", transcript);
  Channel c;
  c.send = std::make_unique<FrameMac>(dialer ? to_acceptor : to_dialer);
  c.recv = std::make_unique<FrameMac>(dialer ? to_dialer : to_acceptor);
  return c;
}

HandshakeStep Failed(Status why, std::string send = "") {
  HandshakeStep s;
  s.send = std::move(send);
  s.error = std::move(why);
  return s;
}

}  // namespace

std::string EncodeHello(const Hello& hello) {
  std::string out;
  PutFixed32(&out, kHelloMagic);
  PutFixed16(&out, hello.proto_major);
  PutFixed16(&out, hello.proto_minor);
  PutFixed16(&out, static_cast<uint16_t>(hello.kind));
  PutFixed32(&out, hello.generation);
  PutFixed32(&out, static_cast<uint32_t>(hello.worker_id));
  PutFixed16(&out, static_cast<uint16_t>(hello.nonce.size()));
  out += hello.nonce;
  PutFixed16(&out, hello.lane);
  return out;
}

Result<Hello> DecodeHello(std::string_view payload) {
  ByteReader r(payload);
  uint32_t magic = 0, generation = 0, worker = 0;
  uint16_t major = 0, minor = 0, kind = 0, nonce_len = 0;
  std::string_view nonce;
  if (!r.ReadFixed32(&magic) || magic != kHelloMagic) {
    return InvalidArgumentError("hello has a bad magic: not a nonstop peer");
  }
  if (!r.ReadFixed16(&major) || !r.ReadFixed16(&minor)) {
    return InvalidArgumentError("hello is truncated");
  }
  Hello h;
  h.proto_major = major;
  h.proto_minor = minor;
  if (major != kProtocolMajor) return h;  // the caller refuses it by its version
  if (!r.ReadFixed16(&kind) || !r.ReadFixed32(&generation) || !r.ReadFixed32(&worker) ||
      !r.ReadFixed16(&nonce_len) || !r.ReadBytes(nonce_len, &nonce)) {
    return InvalidArgumentError("hello is truncated");
  }
  if (nonce.size() != crypto::kNonceBytes) {
    return InvalidArgumentError(
        fmt::format("hello has a nonce of {} bytes, not {}", nonce.size(), crypto::kNonceBytes));
  }
  h.kind = static_cast<ConnectionKind>(kind);
  h.generation = generation;
  h.worker_id = static_cast<int32_t>(worker);
  h.nonce = std::string(nonce);
  if (!r.ReadFixed16(&h.lane)) return InvalidArgumentError("hello is truncated");
  return h;
}

Status CheckHello(const Hello& hello, ConnectionKind kind) {
  if (hello.kind != kind) {
    return FailedPreconditionError(fmt::format("connection kind {} is not accepted on this port",
                                               static_cast<int>(hello.kind)));
  }
  if (hello.worker_id < 0) {
    return FailedPreconditionError(
        fmt::format("worker id {} is negative: a worker id is a number >= 0 unique in the job",
                    hello.worker_id));
  }
  const int lanes = kind == ConnectionKind::kData ? kDataLanes : 1;
  if (hello.lane >= lanes) {
    return FailedPreconditionError(fmt::format(
        "lane {} is out of range: this port takes lanes 0 to {}", hello.lane, lanes - 1));
  }
  return OkStatus();
}

std::string HandshakeProof(const crypto::Key& key, std::string_view role,
                           std::string_view hello_payload, std::string_view acceptor_nonce) {
  return crypto::Mac(key, role, {hello_payload, acceptor_nonce});
}

// --- FrameMac ---

std::string FrameMac::Tag(uint16_t type, uint16_t flags, std::string_view payload) const {
  std::string head;
  PutFixed64(&head, seq_);
  PutFixed16(&head, type);
  PutFixed16(&head, flags);
  return key_.Mac({head, payload}).substr(0, kFrameTagBytes);
}

std::string FrameMac::Seal(uint16_t type, std::string_view payload, uint16_t flags) {
  std::string sealed;
  sealed.reserve(payload.size() + kFrameTagBytes);
  sealed.append(payload);
  sealed += Tag(type, flags, payload);
  ++seq_;
  return EncodeFrame(type, sealed, flags);
}

Status FrameMac::Open(Frame* frame) {
  if (frame->payload.size() < kFrameTagBytes) {
    return DataLossError(fmt::format("frame {} (type {}) has no MAC: refused", seq_, frame->type));
  }
  const size_t n = frame->payload.size() - kFrameTagBytes;
  std::string_view payload(frame->payload.data(), n);
  if (!crypto::MacEquals(Tag(frame->type, frame->flags, payload),
                         std::string_view(frame->payload).substr(n))) {
    return DataLossError(
        fmt::format("frame {} (type {}) fails its MAC: altered, injected or out of order; refused",
                    seq_, frame->type));
  }
  ++seq_;
  frame->payload.resize(n);
  return OkStatus();
}

// --- DialerHandshake ---

DialerHandshake::DialerHandshake(const crypto::Key& job_key, Hello hello)
    : key_(job_key), hello_(std::move(hello)) {
  hello_.nonce = crypto::RandomBytes(crypto::kNonceBytes);
  hello_payload_ = EncodeHello(hello_);
}

std::string DialerHandshake::Start() { return EncodeFrame(kFrameHello, hello_payload_); }

HandshakeStep DialerHandshake::OnFrame(const Frame& frame) {
  const Status unproven = DataLossError(
      "the peer did not prove the job key: another job's process or an impostor, or this side "
      "holds the wrong job token");
  if (!challenged_) {
    if (frame.type == kFrameHelloAck && !frame.payload.empty() && frame.payload[0] == 0) {
      // An old version's refusal, or anyone's: unauthenticated, so never taken as final.
      std::string said = frame.payload.substr(1, 200);  // unauthenticated: short, printable
      for (char& c : said) {
        if (c < 0x20 || c > 0x7e) c = '?';
      }
      return Failed(DataLossError(fmt::format(
          "the peer refused the hello without proving the job key ({}): not believed", said)));
    }
    ByteReader r(frame.payload);
    std::string_view nonce, proof;
    if (frame.type != kFrameChallenge || !r.ReadBytes(crypto::kNonceBytes, &nonce) ||
        !r.ReadBytes(crypto::kMacBytes, &proof) || r.remaining() != 0) {
      return Failed(DataLossError(fmt::format(
          "expected a handshake challenge, got frame type {} of {} bytes: not a nonstop peer",
          frame.type, frame.payload.size())));
    }
    if (!crypto::MacEquals(proof, HandshakeProof(key_, kAcceptorRole, hello_payload_, nonce))) {
      unproven_ = true;
      return Failed(unproven);
    }
    challenged_ = true;
    channel_ = MakeChannel(key_, hello_payload_, nonce, /*dialer=*/true);
    HandshakeStep step;
    step.send = EncodeFrame(kFrameProof, HandshakeProof(key_, kDialerRole, hello_payload_, nonce));
    return step;
  }
  Frame ack = frame;
  if (ack.type != kFrameHelloAck || !channel_.recv->Open(&ack).ok() || ack.payload.empty()) {
    return Failed(DataLossError(fmt::format(
        "the peer's handshake ack (frame type {}) is not sealed with this connection's key: "
        "refused",
        frame.type)));
  }
  if (ack.payload[0] != 1) {
    return Failed(FailedPreconditionError("connection refused by peer: " + ack.payload.substr(1)));
  }
  HandshakeStep step;
  step.done = true;
  return step;
}

// --- AcceptorHandshake ---

KeyOf JobRoles(const crypto::Key& job_key) {
  return [job_key](const Hello& hello) {
    switch (hello.kind) {
      case ConnectionKind::kControl:
        return WorkerControlKey(job_key, hello.worker_id);
      case ConnectionKind::kData:
        return WorkerDataKey(job_key);
      case ConnectionKind::kAgent:
        return job_key;
    }
    return crypto::DeriveKey(job_key, "no role", crypto::RandomBytes(16));  // a key nobody holds
  };
}

KeyOf OneKey(const crypto::Key& key) {
  return [key](const Hello&) { return key; };
}

AcceptorHandshake::AcceptorHandshake(KeyOf key_of, std::function<bool(ConnectionKind)> accepts,
                                     Check check)
    : key_of_(std::move(key_of)), accepts_(std::move(accepts)), check_(std::move(check)) {}

HandshakeStep AcceptorHandshake::OnFrame(const Frame& frame) {
  return nonce_.empty() ? OnHello(frame) : OnProof(frame);
}

HandshakeStep AcceptorHandshake::OnHello(const Frame& frame) {
  // A peer that cannot speak this handshake learns why in plain text; nothing else is said before
  // the peer proves the key.
  auto plain_refusal = [](const std::string& why) {
    return Failed(FailedPreconditionError(why),
                  EncodeFrame(kFrameHelloAck, std::string(1, '\0') + why));
  };
  if (frame.type != kFrameHello) {
    return plain_refusal(fmt::format("first frame has type {}, expected hello", frame.type));
  }
  Result<Hello> hello = DecodeHello(frame.payload);
  if (!hello.ok()) return plain_refusal(hello.status().message());
  if (hello->proto_major != kProtocolMajor) {
    return plain_refusal(
        fmt::format("protocol version {}.{} is not supported (this side speaks {}.{})",
                    hello->proto_major, hello->proto_minor, kProtocolMajor, kProtocolMinor));
  }
  if (!accepts_(hello->kind)) {
    return plain_refusal(fmt::format("connection kind {} is not accepted on this port",
                                     static_cast<int>(hello->kind)));
  }
  hello_ = std::move(*hello);
  hello_payload_ = frame.payload;
  key_ = key_of_(hello_);  // the key of the role the hello claims: proven below, both ways
  nonce_ = crypto::RandomBytes(crypto::kNonceBytes);
  HandshakeStep step;
  step.send = EncodeFrame(kFrameChallenge,
                          nonce_ + HandshakeProof(key_, kAcceptorRole, hello_payload_, nonce_));
  return step;
}

HandshakeStep AcceptorHandshake::OnProof(const Frame& frame) {
  if (frame.type != kFrameProof ||
      !crypto::MacEquals(frame.payload,
                         HandshakeProof(key_, kDialerRole, hello_payload_, nonce_))) {
    // No reason: a peer without the key learns nothing, not even what was wrong.
    return Failed(FailedPreconditionError("the peer did not prove the job key"));
  }
  channel_ = MakeChannel(key_, hello_payload_, nonce_, /*dialer=*/false);
  Status verdict = check_ ? check_(hello_) : OkStatus();
  if (!verdict.ok()) {
    return Failed(FailedPreconditionError(verdict.message()),
                  channel_.send->Seal(kFrameHelloAck, std::string(1, '\0') + verdict.message()));
  }
  HandshakeStep step;
  step.send = channel_.send->Seal(kFrameHelloAck, std::string(1, '\1'));
  step.done = true;
  return step;
}

// --- the blocking forms ---

Result<Channel> ClientHandshake(int fd, const crypto::Key& job_key, const Hello& hello,
                                Deadline deadline, const AbortSignal* abort) {
  DialerHandshake hs(job_key, hello);
  std::string out = hs.Start();
  while (true) {
    NONSTOP_RETURN_IF_ERROR(
        SendAll(fd, std::as_bytes(std::span(out)), deadline, abort, "handshake"));
    NONSTOP_ASSIGN_OR_RETURN(Frame in, ReadFrame(fd, deadline, abort, kMaxHandshakeBytes));
    HandshakeStep step = hs.OnFrame(in);
    if (!step.error.ok()) return step.error;
    if (step.done) return hs.TakeChannel();
    out = std::move(step.send);
  }
}

Result<Accepted> ServerHandshake(int fd, const KeyOf& key_of, ConnectionKind kind,
                                 Deadline deadline, const AbortSignal* abort) {
  HelloAcceptor acceptor(fd, key_of, kind);
  while (true) {
    switch (acceptor.Advance()) {
      case HelloAcceptor::State::kAccepted:
        return Accepted{acceptor.hello(), acceptor.TakeChannel()};
      case HelloAcceptor::State::kRefused:
        return acceptor.error();
      default:
        NONSTOP_RETURN_IF_ERROR(WaitFd(fd, acceptor.wanted_events(), deadline, abort, "hello"));
    }
  }
}

Status WriteSealedFrame(int fd, FrameMac& mac, uint16_t type, std::string_view payload,
                        Deadline deadline, const AbortSignal* abort) {
  std::string bytes = mac.Seal(type, payload);
  return SendAll(fd, std::as_bytes(std::span(bytes)), deadline, abort, "write frame");
}

Result<Frame> ReadSealedFrame(int fd, FrameMac& mac, Deadline deadline, const AbortSignal* abort,
                              uint32_t max_payload) {
  NONSTOP_ASSIGN_OR_RETURN(Frame f, ReadFrame(fd, deadline, abort, max_payload));
  NONSTOP_RETURN_IF_ERROR(mac.Open(&f));
  return f;
}

// --- HelloAcceptor ---

HelloAcceptor::HelloAcceptor(int fd, KeyOf key_of, ConnectionKind kind, Rule rule)
    : fd_(fd),
      handshake_(
          std::move(key_of), [kind](ConnectionKind k) { return k == kind; },
          [kind, rule = std::move(rule)](const Hello& h) {
            Status s = CheckHello(h, kind);
            if (s.ok() && rule) s = rule(h);
            return s;
          }) {}

short HelloAcceptor::wanted_events() const { return state_ == State::kWriting ? POLLOUT : POLLIN; }

HelloAcceptor::State HelloAcceptor::Advance() {
  // Reads only as many bytes as the frame in progress still needs.
  auto read_some = [&](char* dst, size_t want, size_t* got) -> bool {
    while (*got < want) {
      ssize_t n = ::recv(fd_, dst + *got, want - *got, 0);
      if (n > 0) {
        *got += static_cast<size_t>(n);
        continue;
      }
      if (n == 0) {
        Refuse(UnavailableError("connection closed by the peer during the handshake"));
        return false;
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        Refuse(ErrnoStatus(StatusCode::kUnavailable, "handshake: recv", errno));
      return false;
    }
    return true;
  };
  while (true) {
    if (state_ == State::kWriting) {
      if (Write() == State::kWriting) return state_;  // the socket takes no more now
      continue;
    }
    if (state_ != State::kReading) return state_;
    if (header_got_ < kFrameHeaderBytes) {
      if (!read_some(header_, kFrameHeaderBytes, &header_got_)) return state_;
      const uint32_t length = DecodeFixed32(header_);
      if (length > kMaxHandshakeBytes) {
        // Said in plain text, as to any peer that cannot speak the handshake.
        std::string why = fmt::format(
            "a handshake frame of {} bytes exceeds the limit of {} bytes: not a nonstop peer",
            length, kMaxHandshakeBytes);
        std::string ack = EncodeFrame(kFrameHelloAck, std::string(1, '\0') + why);
        (void)::send(fd_, ack.data(), ack.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        return Refuse(FailedPreconditionError(why));
      }
      payload_.assign(length, '\0');
      payload_got_ = 0;
    }
    if (!read_some(payload_.data(), payload_.size(), &payload_got_)) return state_;
    Take();
  }
}

HelloAcceptor::State HelloAcceptor::Take() {
  FrameDecoder decoder(kMaxHandshakeBytes);
  Status fed = decoder.Feed(std::string_view(header_, kFrameHeaderBytes));
  if (fed.ok()) fed = decoder.Feed(payload_);
  header_got_ = 0;
  if (!fed.ok()) return Refuse(fed);
  std::optional<Frame> frame = decoder.Next();
  NONSTOP_CHECK(frame.has_value()) << "a complete frame was fed";
  HandshakeStep step = handshake_.OnFrame(*frame);
  if (!step.error.ok()) {
    // Best effort, without waiting: what the handshake says to a refused peer, if anything.
    if (!step.send.empty())
      (void)::send(fd_, step.send.data(), step.send.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    return Refuse(step.error);
  }
  out_ = std::move(step.send);
  out_sent_ = 0;
  done_after_write_ = step.done;
  state_ = State::kWriting;
  return state_;
}

HelloAcceptor::State HelloAcceptor::Write() {
  while (out_sent_ < out_.size()) {
    ssize_t n = ::send(fd_, out_.data() + out_sent_, out_.size() - out_sent_, MSG_NOSIGNAL);
    if (n > 0) {
      out_sent_ += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return state_;
    return Refuse(ErrnoStatus(StatusCode::kUnavailable, "handshake: send", errno));
  }
  state_ = done_after_write_ ? State::kAccepted : State::kReading;
  return state_;
}

HelloAcceptor::State HelloAcceptor::Refuse(Status why) {
  error_ = why.code() == StatusCode::kFailedPrecondition
               ? FailedPreconditionError("refused connection: " + why.message())
               : std::move(why);
  state_ = State::kRefused;
  return state_;
}

}  // namespace nonstop::net
