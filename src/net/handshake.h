// The handshake that opens every nonstop connection, control, agent or data
// (docs/protocol.md, "Handshake"): both ends prove they hold the job key, and
// the job token never crosses the wire.
//
//   dialer   -> hello     {magic, version, kind, generation, worker id, nonce_d}
//   acceptor -> challenge {nonce_a, proof_a = MAC(K, "acceptor", hello, nonce_a)}
//   dialer   -> proof     {proof_d = MAC(K, "dialer", hello, nonce_a)}
//   acceptor -> ack       {1 | 0 + reason}, sealed with the acceptor's session key
//
// K is the key of the role the hello claims (common/role_keys.h): a worker's own control key,
// the workers' data key, or the job key itself for an agent. The acceptor proves itself
// first, over the dialer's fresh nonce: a dialer sends its own proof only to
// a peer that showed it holds K, so an impostor on the controller's address
// learns nothing from any worker or agent. Each proof covers both nonces and
// the hello (kind, worker id, generation), and names its role, so a recorded
// handshake is worthless on another connection (the other side's nonce is
// new) and a proof cannot be reflected back as the other role's. The ack is
// the first frame sealed with the session keys, derived from K and the
// transcript: it tells an authenticated dialer why it was refused (kind,
// worker id, the caller's rule), and nobody else anything. A peer that fails
// its proof is closed without a reason.
//
// After the handshake, control and agent connections seal every frame
// (FrameMac): a MAC over a per-direction sequence number, the type, the flags
// and the payload, so an injected, altered, replayed, reordered or dropped
// frame is refused and the connection closed. Data connections carry bulk
// tensors and are not sealed (docs/security.md says why).
//
// The handshake logic is I/O-free (DialerHandshake, AcceptorHandshake: frames
// in, frames out), driven by four kinds of owner: ClientHandshake and
// ServerHandshake block (with a deadline and an abort); HelloAcceptor never
// blocks, so one poll loop can hold many connections in handshake at once
// (PeerMesh's data port); ControlServer and ControllerLink feed the frames of
// their own event loops.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/crypto.h"
#include "common/time.h"
#include "net/frame.h"
#include "nonstop/status.h"

namespace nonstop::net {

class AbortSignal;

inline constexpr uint32_t kHelloMagic = 0x5054534E;  // "NSTP" on the wire
// 2: the mutual challenge-response (1 sent the token in the hello).
// 3: a data connection's lane follows the nonce, and the state copy asks each source for
// several streams (a 2.x worker would take a lane's hello for its one connection and read a
// request it does not know: refused at the handshake instead, by its version).
// 4: keys by role (a control or data connection proves a key derived for its role, not the job
// key: a 3.x peer would fail the proof and read as one holding the wrong token; refused by its
// version instead).
inline constexpr uint16_t kProtocolMajor = 4;
inline constexpr uint16_t kProtocolMinor = 0;
// Data connections between two workers at once (PeerMesh): lanes 0 .. kDataLanes - 1. Lane 0
// carries the collectives; a state copy streams on lanes 0 .. kStateCopyLanes - 1; point-to-point
// calls take lanes 1 and 2 (the script's) and 3 and 4 (those of collectives made of them), one a
// direction (Session::Send).
inline constexpr int kDataLanes = 5;
inline constexpr int kStateCopyLanes = 4;
// Handshake frames are a few dozen bytes; a longer length is refused before anything is read.
inline constexpr uint32_t kMaxHandshakeBytes = 4096;

inline constexpr uint16_t kFrameHello = 1;
inline constexpr uint16_t kFrameHelloAck = 2;
inline constexpr uint16_t kFrameChallenge = 3;
inline constexpr uint16_t kFrameProof = 4;
static_assert(kFrameHello == 1 && kFrameHelloAck == 2 && kFrameChallenge == 3 && kFrameProof == 4,
              "wire numbers are pinned");

// The bytes of a sealed frame's tag (HMAC-SHA256 truncated to 128 bits, as RFC 4868 does).
inline constexpr size_t kFrameTagBytes = 16;

// kAgent: an agent on the control port
enum class ConnectionKind : uint16_t { kControl = 1, kData = 2, kAgent = 3 };

// What the dialer says of itself. The nonce is made by DialerHandshake.
struct Hello {
  uint16_t proto_major = kProtocolMajor;
  uint16_t proto_minor = kProtocolMinor;
  ConnectionKind kind = ConnectionKind::kData;
  uint32_t generation = 0;
  int32_t worker_id = -1;
  std::string nonce;
  // Which of the data connections between the two workers this is (kData only; 0 for the others).
  uint16_t lane = 0;
};

std::string EncodeHello(const Hello& hello);
Result<Hello> DecodeHello(std::string_view payload);

// The acceptor's checks on an authenticated hello: connection kind, a
// worker id that is not negative, a lane below kDataLanes (0 unless kData). OK, or
// kFailedPrecondition whose message is the reason the sealed ack carries.
Status CheckHello(const Hello& hello, ConnectionKind kind);

// One direction of a sealed connection: Seal() makes the next frame of the
// sender, Open() checks the next frame of the receiver and strips its tag.
// Each side numbers its frames from 0 (the ack is the acceptor's frame 0).
//
// Thread-safety: none; the owner serialises the calls of one direction.
class FrameMac {
 public:
  explicit FrameMac(const crypto::Key& key) : key_(key) {}
  // The whole encoded frame: the payload followed by its tag.
  std::string Seal(uint16_t type, std::string_view payload, uint16_t flags = 0);
  // kDataLoss naming the frame's number when the tag does not verify (the
  // owner closes the connection: nothing after a bad frame can be trusted).
  Status Open(Frame* frame);
  uint64_t frames() const { return seq_; }

 private:
  std::string Tag(uint16_t type, uint16_t flags, std::string_view payload) const;
  crypto::MacKey key_;
  uint64_t seq_ = 0;
};

// The session keys of one connection, one per direction, from this side's view.
struct Channel {
  std::unique_ptr<FrameMac> send;
  std::unique_ptr<FrameMac> recv;
};

// One step of a handshake: the frame to send now (empty: none), and whether
// the handshake is over (done) or failed (error set; the owner sends `send`
// if any, then closes).
struct HandshakeStep {
  std::string send;
  bool done = false;
  Status error;
};

// The dialer's side. Start() is the hello frame; OnFrame() takes the
// challenge (answering with the proof) and then the ack.
//
// Errors: kDataLoss when the peer did not prove the job key or sent
// something that is no handshake (an impostor, another job's process, or
// this side has the wrong token; an unauthenticated refusal, such as an old
// version's, is reported the same way: nothing unproven is believed);
// kFailedPrecondition when an authenticated acceptor refused (its reason).
class DialerHandshake {
 public:
  DialerHandshake(const crypto::Key& job_key, Hello hello);
  std::string Start();
  HandshakeStep OnFrame(const Frame& frame);
  // After done: the connection's session keys.
  Channel TakeChannel() { return std::move(channel_); }
  const Hello& hello() const { return hello_; }
  // After an error: the peer answered with a challenge whose proof failed (it does not hold this
  // side's key), as opposed to something that is no handshake at all.
  bool peer_unproven() const { return unproven_; }

 private:
  const crypto::Key key_;
  Hello hello_;
  std::string hello_payload_;
  bool challenged_ = false;
  bool unproven_ = false;
  Channel channel_;
};

// The key an acceptor proves for a hello (its kind and worker id), chosen before the dialer
// proved anything: a dialer that claims a role it does not hold fails its proof.
using KeyOf = std::function<crypto::Key(const Hello&)>;
// A holder of the job key (a controller): each role's key (role_keys.h).
KeyOf JobRoles(const crypto::Key& job_key);
// One key for every hello (a worker's data port: the data key).
KeyOf OneKey(const crypto::Key& key);

// The acceptor's side. OnFrame() takes the hello (answering with the
// challenge) and then the proof (answering with the sealed ack). `check`
// runs on the authenticated hello: OK accepts, otherwise its message is the
// reason the ack carries.
//
// Errors: kFailedPrecondition for a refused connection (a bad proof: no
// reason is sent; a bad magic, version or kind: a plain refusal is sent,
// since the peer cannot speak this handshake or dialed the wrong port; a
// refusal by `check`: sealed), kDataLoss for a frame out of place.
class AcceptorHandshake {
 public:
  using Check = std::function<Status(const Hello&)>;
  // `accepts`: the kinds of connection this port takes. A hello of another kind is refused before
  // any challenge (its kind is public), so that no port ever proves the key over a hello meant for
  // another: a peer without the key cannot relay a dialer's hello to the wrong port and hand the
  // dialer that port's authenticated refusal.
  AcceptorHandshake(KeyOf key_of, std::function<bool(ConnectionKind)> accepts, Check check);
  HandshakeStep OnFrame(const Frame& frame);
  const Hello& hello() const { return hello_; }  // valid once done
  Channel TakeChannel() { return std::move(channel_); }

 private:
  HandshakeStep OnHello(const Frame& frame);
  HandshakeStep OnProof(const Frame& frame);
  const KeyOf key_of_;
  crypto::Key key_{};  // key_of_(hello_), once the hello came
  const std::function<bool(ConnectionKind)> accepts_;
  const Check check_;
  Hello hello_;
  std::string hello_payload_;
  std::string nonce_;  // ours; empty until the hello came
  Channel channel_;
};

// The job key's proofs and session keys, shared by both sides.
std::string HandshakeProof(const crypto::Key& key, std::string_view role,
                           std::string_view hello_payload, std::string_view acceptor_nonce);

// Dialer side, blocking: the whole handshake; the session keys when accepted.
Result<Channel> ClientHandshake(int fd, const crypto::Key& job_key, const Hello& hello,
                                Deadline deadline, const AbortSignal* abort);

// Acceptor side, blocking.
struct Accepted {
  Hello hello;
  Channel channel;
};
Result<Accepted> ServerHandshake(int fd, const KeyOf& key_of, ConnectionKind kind,
                                 Deadline deadline, const AbortSignal* abort);

// Blocking-style sealed frames over a non-blocking socket: WriteFrame and ReadFrame through one
// direction of a Channel (ReadSealedFrame: kDataLoss for a frame that fails its MAC).
Status WriteSealedFrame(int fd, FrameMac& mac, uint16_t type, std::string_view payload,
                        Deadline deadline, const AbortSignal* abort);
Result<Frame> ReadSealedFrame(int fd, FrameMac& mac, Deadline deadline, const AbortSignal* abort,
                              uint32_t max_payload = kMaxControlFrameBytes);

// Acceptor side, non-blocking: the state of one connection's handshake,
// advanced by the caller's poll loop. It reads exactly the dialer's frames
// (never a byte past the proof, so the stream stays aligned for what
// follows), refuses a length over kMaxHandshakeBytes as soon as a frame
// header is in, and writes the challenge and the ack. `rule` runs after
// CheckHello on the authenticated hello. The caller owns the socket and the
// deadline.
//
// Thread-safety: none; one loop drives it.
class HelloAcceptor {
 public:
  using Rule = std::function<Status(const Hello&)>;

  enum class State { kReading, kWriting, kAccepted, kRefused };

  // `fd` is a connected non-blocking socket that outlives this object.
  HelloAcceptor(int fd, KeyOf key_of, ConnectionKind kind, Rule rule = nullptr);

  // Does all the I/O the socket allows now, without blocking, and returns the
  // new state. kReading/kWriting: wait for wanted_events() and call again.
  State Advance();

  State state() const { return state_; }
  short wanted_events() const;  // POLLIN while reading, POLLOUT while writing
  const Hello& hello() const { return handshake_.hello(); }  // valid in kAccepted
  Channel TakeChannel() { return handshake_.TakeChannel(); }
  // Why the connection was refused or failed (kRefused): kFailedPrecondition
  // for a refused handshake, kDataLoss for a corrupt frame, kUnavailable when
  // the peer closed or reset the connection.
  const Status& error() const { return error_; }

 private:
  State Refuse(Status why);
  State Take();   // one whole frame is in: hand it to the handshake
  State Write();  // what the socket takes of out_

  const int fd_;
  AcceptorHandshake handshake_;
  State state_ = State::kReading;
  char header_[kFrameHeaderBytes] = {};
  size_t header_got_ = 0;
  std::string payload_;
  size_t payload_got_ = 0;
  std::string out_;  // the frame still to send
  size_t out_sent_ = 0;
  bool done_after_write_ = false;
  Status error_;
};

}  // namespace nonstop::net
