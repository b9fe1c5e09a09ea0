#include "collective/transfer.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "common/coding.h"
#include "common/logging.h"
#include "nonstop/crc32c.h"

namespace nonstop::collective {

void AddFloat32(float* __restrict dst, const float* __restrict src, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] += src[i];
}

namespace {

struct DataHeader {
  uint32_t length = 0;
  uint16_t type = kFrameData;
  uint16_t flags = 0;
  uint32_t generation = 0;
  uint32_t op = 0;
  uint32_t seq = 0;
  uint32_t crc = 0;
};

void EncodeHeader(const DataHeader& h, char* out) {
  EncodeFixed32(out, h.length);
  EncodeFixed16(out + 4, h.type);
  EncodeFixed16(out + 6, h.flags);
  EncodeFixed32(out + 8, h.generation);
  EncodeFixed32(out + 12, h.op);
  EncodeFixed32(out + 16, h.seq);
  EncodeFixed32(out + 20, h.crc);
}

DataHeader DecodeHeader(const char* p) {
  DataHeader h;
  h.length = DecodeFixed32(p);
  h.type = DecodeFixed16(p + 4);
  h.flags = DecodeFixed16(p + 6);
  h.generation = DecodeFixed32(p + 8);
  h.op = DecodeFixed32(p + 12);
  h.seq = DecodeFixed32(p + 16);
  h.crc = DecodeFixed32(p + 20);
  return h;
}

enum class Progress { kBlocked, kMoved };

// The writing half of one connection: the transfer's pieces (when it is the
// send connection) and the control frames the receiving half answers with,
// one whole frame at a time (a control frame waits for the piece being
// written to end).
class Outbound {
 public:
  // `pieces`: this is spec.send_to and writes spec.sends.
  Outbound(const TransferSpec& spec, Connection* conn, const std::string& peer, bool pieces)
      : spec_(spec), conn_(conn), peer_(peer), pieces_(pieces) {
    awaiting_ack_ = pieces_ && spec_.checksum && spec_.retry && !spec_.sends.empty();
  }
  ~Outbound() {
    // Ended mid-frame (abort, timeout): the stream owes the rest of this frame.
    if (!in_frame_ || offset_ == 0) return;
    if (offset_ < kDataHeaderBytes) {
      // The header's real bytes must go out: the receiver needs its length.
      conn_->send_header_tail_left = kDataHeaderBytes - offset_;
      std::memcpy(conn_->send_header_tail, header_ + offset_, conn_->send_header_tail_left);
      conn_->send_pad = payload_bytes_;
    } else {
      conn_->send_pad = kDataHeaderBytes + payload_bytes_ - offset_;
    }
  }

  // Every piece written and, when checked, acknowledged; every control frame out.
  bool done() const {
    return !in_frame_ && control_.empty() && rewind_to_ < 0 && pieces_done() && !awaiting_ack_;
  }
  bool awaiting_ack() const { return awaiting_ack_; }
  bool wants_write(size_t recvs_done) const {
    return in_frame_ || !control_.empty() || rewind_to_ >= 0 || piece_ready(recvs_done);
  }
  const std::string& peer() const { return peer_; }

  // A control frame, written at the next frame boundary.
  void Queue(uint16_t type, uint32_t seq) { control_.push_back({type, seq}); }

  // The receiver's kFrameResend: go back to piece `seq`.
  Status OnResend(uint32_t seq) {
    if (!awaiting_ack_ || rewind_to_ >= 0 || seq >= item_) {
      return InternalError(fmt::format(
          "{} asked for piece {} again, which was not sent yet or not asked for (generation {}, "
          "op {}, {} of {} pieces sent)",
          peer_, seq, spec_.generation, spec_.op, item_, spec_.sends.size()));
    }
    rewind_to_ = static_cast<int64_t>(seq);
    return OkStatus();
  }
  // The receiver's kFrameAck: every piece arrived whole.
  Status OnAck(uint32_t count) {
    if (!awaiting_ack_ || rewind_to_ >= 0 || !pieces_done() || count != spec_.sends.size()) {
      return InternalError(
          fmt::format("{} acknowledged {} pieces where {} of {} were sent (generation {}, op {})",
                      peer_, count, item_, spec_.sends.size(), spec_.generation, spec_.op));
    }
    awaiting_ack_ = false;
    return OkStatus();
  }

  Result<Progress> Pump(size_t recvs_done, TransferStats* stats) {
    Progress progress = Progress::kBlocked;
    if (!wants_write(recvs_done)) return progress;
    if (owes()) {
      NONSTOP_ASSIGN_OR_RETURN(progress, PayPadding(stats));
      if (owes()) return progress;
    }
    while (in_frame_ || StartFrame(recvs_done)) {
      const size_t total = kDataHeaderBytes + payload_bytes_;
      iovec iov[2];
      int iovcnt = 0;
      if (offset_ < kDataHeaderBytes) {
        iov[iovcnt++] = {header_ + offset_, kDataHeaderBytes - offset_};
        if (payload_bytes_ > 0) iov[iovcnt++] = {const_cast<std::byte*>(payload_), payload_bytes_};
      } else {
        iov[iovcnt++] = {const_cast<std::byte*>(payload_) + (offset_ - kDataHeaderBytes),
                         total - offset_};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<size_t>(iovcnt);
      ssize_t n = ::sendmsg(conn_->fd.get(), &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
        if (stats) stats->failed_peer = conn_->peer_id;
        return UnavailableError(fmt::format("send to {} failed: {} (generation {}, op {})", peer_,
                                            std::strerror(errno), spec_.generation, spec_.op));
      }
      progress = Progress::kMoved;
      offset_ += static_cast<size_t>(n);
      if (stats) stats->bytes_sent += static_cast<uint64_t>(n);
      if (offset_ == total) {
        in_frame_ = false;
        offset_ = 0;
      }
    }
    return progress;
  }

 private:
  bool pieces_done() const { return !pieces_ || item_ >= spec_.sends.size(); }
  bool piece_ready(size_t recvs_done) const {
    if (pieces_done()) return false;
    int32_t dep = spec_.sends[item_].after_recv;
    return dep < 0 || static_cast<size_t>(dep) < recvs_done;
  }
  bool owes() const { return conn_->send_header_tail_left > 0 || conn_->send_pad > 0; }

  // At a frame boundary: builds the next frame (a control frame first, then
  // the next piece, from where a resend request went back to). False: none.
  bool StartFrame(size_t recvs_done) {
    DataHeader h;
    h.generation = spec_.generation;
    h.op = spec_.op;
    if (!control_.empty()) {
      h.type = control_.front().first;
      h.seq = control_.front().second;
      control_.erase(control_.begin());
      payload_ = nullptr;
      payload_bytes_ = 0;
    } else {
      if (rewind_to_ >= 0) {
        item_ = static_cast<size_t>(rewind_to_);
        rewind_to_ = -1;
      }
      if (!piece_ready(recvs_done)) return false;
      const SendItem& item = spec_.sends[item_];
      h.length = static_cast<uint32_t>(item.bytes);
      h.flags = static_cast<uint16_t>((spec_.checksum ? kDataFlagChecksum : 0) |
                                      (spec_.checksum && spec_.retry ? kDataFlagRetry : 0));
      h.seq = static_cast<uint32_t>(item_);
      h.crc = spec_.checksum ? Crc32c(item.data, item.bytes) : 0;
      payload_ = item.data;
      payload_bytes_ = item.bytes;
      if (static_cast<int64_t>(item_) == spec_.flip_send_item && !flipped_) FlipOnTheWire();
      ++item_;
    }
    EncodeHeader(h, header_);
    in_frame_ = true;
    offset_ = 0;
    return true;
  }

  // Fault injection: this transmission of the piece carries one bit flipped,
  // the mantissa's top bit of its first normal float (a value x1.5 or x0.75:
  // finite, nothing a loss check sees); in a piece with none, its first byte's.
  void FlipOnTheWire() {
    flipped_ = true;
    if (payload_bytes_ == 0) return;
    flip_copy_.assign(payload_, payload_ + payload_bytes_);
    size_t at = 0;
    std::byte bit{1};
    for (size_t f = 0; f + 4 <= flip_copy_.size(); f += 4) {
      uint32_t v;
      std::memcpy(&v, flip_copy_.data() + f, 4);
      if ((v & 0x7F800000u) != 0 && (v & 0x7F800000u) != 0x7F800000u) {
        at = f + 2;  // bits 16-23, little-endian: bit 22 is the mantissa's top
        bit = std::byte{0x40};
        break;
      }
    }
    flip_copy_[at] ^= bit;
    payload_ = flip_copy_.data();
    NONSTOP_LOG_WARNING("wireflip: piece {} to {} leaves with a bit of its byte {} flipped", item_,
                        peer_, at);
  }

  // Completes a frame left unfinished by an aborted operation: the rest of
  // its header as it was, then zeros for its payload.
  Result<Progress> PayPadding(TransferStats* stats) {
    static const std::byte kZeros[4096] = {};
    Progress progress = Progress::kBlocked;
    while (owes()) {
      const void* src = kZeros;
      size_t len = std::min(conn_->send_pad, sizeof(kZeros));
      if (conn_->send_header_tail_left > 0) {
        src = conn_->send_header_tail;
        len = conn_->send_header_tail_left;
      }
      ssize_t n = ::send(conn_->fd.get(), src, len, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
        if (stats) stats->failed_peer = conn_->peer_id;
        return UnavailableError(fmt::format("send to {} failed: {}", peer_, std::strerror(errno)));
      }
      progress = Progress::kMoved;
      if (conn_->send_header_tail_left > 0) {
        auto sent = static_cast<size_t>(n);
        std::memmove(conn_->send_header_tail, conn_->send_header_tail + sent,
                     conn_->send_header_tail_left - sent);
        conn_->send_header_tail_left -= sent;
      } else {
        conn_->send_pad -= static_cast<size_t>(n);
      }
    }
    return progress;
  }

  const TransferSpec& spec_;
  Connection* const conn_;
  const std::string& peer_;
  const bool pieces_;
  size_t item_ = 0;         // the next piece to write
  int64_t rewind_to_ = -1;  // a resend request not yet acted on
  bool awaiting_ack_ = false;
  std::vector<std::pair<uint16_t, uint32_t>> control_;  // {type, seq} to write
  bool in_frame_ = false;  // header_ and payload_ are a frame being written
  size_t offset_ = 0;      // bytes of it (header + payload) already written
  const std::byte* payload_ = nullptr;
  size_t payload_bytes_ = 0;
  char header_[kDataHeaderBytes];
  bool flipped_ = false;
  std::vector<std::byte> flip_copy_;
};

// The reading half of one connection: header first, then the payload
// straight into the destination (or into scratch, to be reduced into it);
// the control frames meant for this transfer's sender go to its Outbound.
class Inbound {
 public:
  // `pieces`: this is spec.recv_from and reads spec.recvs, answering on
  // `reply` (the Outbound of the same connection); `sender`: the Outbound
  // whose control frames come in here (the connection is spec.send_to), or null.
  Inbound(const TransferSpec& spec, Connection* conn, const std::string& peer, bool pieces,
          Outbound* reply, Outbound* sender)
      : spec_(spec), conn_(conn), peer_(peer), pieces_(pieces), reply_(reply), sender_(sender) {
    // Resume a frame abandoned by an aborted operation: it is stale by construction.
    if (conn_->recv_header_got > 0) {
      std::memcpy(raw_, conn_->recv_header, conn_->recv_header_got);
      header_got_ = conn_->recv_header_got;
    } else if (conn_->recv_skip > 0) {
      header_got_ = kDataHeaderBytes;
      skip_left_ = conn_->recv_skip;
    }
    conn_->recv_header_got = 0;
    conn_->recv_skip = 0;
  }
  ~Inbound() {
    // After a protocol violation the stream cannot be trusted: the mesh drops the connection.
    if (violated_) return;
    // Ended mid-frame: remember how to get back to a frame boundary.
    if (header_got_ > 0 && header_got_ < kDataHeaderBytes) {
      std::memcpy(conn_->recv_header, raw_, header_got_);
      conn_->recv_header_got = header_got_;
    } else if (header_got_ == kDataHeaderBytes) {
      conn_->recv_skip = skip_left_ > 0 ? skip_left_ : header_.length - payload_got_;
    }
  }

  bool pieces_done() const { return !pieces_ || item_ >= spec_.recvs.size(); }
  size_t items_done() const { return item_; }
  bool wants_read() const {
    return !pieces_done() || (sender_ != nullptr && sender_->awaiting_ack());
  }

  Result<Progress> Pump(TransferStats* stats) {
    Progress progress = Progress::kBlocked;
    while (wants_read()) {
      std::byte* target;
      size_t want;
      if (header_got_ < kDataHeaderBytes) {
        target = reinterpret_cast<std::byte*>(raw_) + header_got_;
        want = kDataHeaderBytes - header_got_;
      } else if (skip_left_ > 0) {
        target = discard_;
        want = std::min(skip_left_, sizeof(discard_));
      } else {
        target = PayloadTarget() + payload_got_;
        want = spec_.recvs[item_].bytes - payload_got_;
      }
      if (want > 0) {
        ssize_t n = ::recv(conn_->fd.get(), target, want, 0);
        if (n == 0) {
          if (stats) stats->failed_peer = conn_->peer_id;
          return UnavailableError(
              fmt::format("connection to {} closed by peer (generation {}, op {})", peer_,
                          spec_.generation, spec_.op));
        }
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
          if (stats) stats->failed_peer = conn_->peer_id;
          return UnavailableError(fmt::format("recv from {} failed: {} (generation {}, op {})",
                                              peer_, std::strerror(errno), spec_.generation,
                                              spec_.op));
        }
        progress = Progress::kMoved;
        if (stats) stats->bytes_received += static_cast<uint64_t>(n);
        if (header_got_ < kDataHeaderBytes) {
          header_got_ += static_cast<size_t>(n);
          if (header_got_ == kDataHeaderBytes) {
            if (Status st = OnHeader(stats); !st.ok()) {
              // Out of step (a bug, another program, a header damaged on the wire): no frame
              // boundary can be found again, so the connection is dropped and dialed anew.
              violated_ = true;
              if (stats) stats->failed_peer = conn_->peer_id;
              return st;
            }
          }
          continue;
        }
        if (skip_left_ > 0) {
          skip_left_ -= static_cast<size_t>(n);
          if (skip_left_ == 0) header_got_ = 0;  // the dropped frame is gone; read the next header
          continue;
        }
        payload_got_ += static_cast<size_t>(n);
      }
      if (header_got_ == kDataHeaderBytes && skip_left_ == 0 &&
          payload_got_ == spec_.recvs[item_].bytes) {
        NONSTOP_RETURN_IF_ERROR(FinishItem(stats));
      }
    }
    return progress;
  }

 private:
  std::byte* PayloadTarget() {
    const RecvItem& item = spec_.recvs[item_];
    return item.combine == nullptr ? item.data : spec_.scratch.data();
  }

  // Skips the payload of the frame whose header was just read.
  void Skip() {
    skip_left_ = header_.length;
    if (skip_left_ == 0) header_got_ = 0;
  }

  Status OnHeader(TransferStats* stats) {
    header_ = DecodeHeader(raw_);
    const bool control = header_.type == kFrameResend || header_.type == kFrameAck;
    if (header_.type != kFrameData && !control) {
      return InternalError(
          fmt::format("{} sent a frame of type {} on the data path (generation {}, op {}): "
                      "not a nonstop data stream",
                      peer_, header_.type, spec_.generation, spec_.op));
    }
    if (header_.generation < spec_.generation) {
      // A frame of an operation aborted in an older generation: drop it.
      if (stats) ++stats->stale_frames_dropped;
      Skip();
      return OkStatus();
    }
    const bool ours = header_.generation == spec_.generation && header_.op == spec_.op;
    if (control) {
      if (!ours || sender_ == nullptr || header_.length != 0) {
        return InternalError(fmt::format(
            "{} sent a {} frame (generation {}, op {}, seq {}) that answers nothing this rank "
            "sent (generation {}, op {})",
            peer_, header_.type == kFrameAck ? "ack" : "resend", header_.generation, header_.op,
            header_.seq, spec_.generation, spec_.op));
      }
      header_got_ = 0;
      return header_.type == kFrameAck ? sender_->OnAck(header_.seq)
                                       : sender_->OnResend(header_.seq);
    }
    if (ours && !pieces_done() && awaiting_resend_ && header_.seq > item_ &&
        header_.seq < spec_.recvs.size()) {
      Skip();  // sent before our resend request reached the sender: it comes again
      return OkStatus();
    }
    if (!ours || pieces_done() || header_.seq != item_ ||
        header_.length != spec_.recvs[item_].bytes) {
      const size_t want = pieces_done() ? 0 : spec_.recvs[item_].bytes;
      return InternalError(
          fmt::format("{} sent (generation {}, op {}, seq {}, {} bytes) where (generation {}, op "
                      "{}, seq {}, {} bytes) "
                      "was expected: the peers disagree on the sequence of collectives (or the "
                      "frame's header was damaged on the wire)",
                      peer_, header_.generation, header_.op, header_.seq, header_.length,
                      spec_.generation, spec_.op, item_, want));
    }
    // A checked collective's receiver follows its sender's flags (transfer.h); Recv insists.
    if (spec_.checksum && !spec_.retry && !(header_.flags & kDataFlagChecksum)) {
      return InternalError(
          fmt::format("{} sent an unchecksummed piece where a checksum is required", peer_));
    }
    return OkStatus();
  }

  Status FinishItem(TransferStats* stats) {
    const RecvItem& item = spec_.recvs[item_];
    const std::byte* payload = PayloadTarget();
    const bool retry = (header_.flags & kDataFlagRetry) != 0;
    header_got_ = 0;
    payload_got_ = 0;
    if (header_.flags & kDataFlagChecksum) {
      uint32_t got = Crc32c(payload, item.bytes);
      if (got != header_.crc) {
        std::string what = fmt::format(
            "piece {} of {} bytes from {} fails its checksum (crc32c {:08x}, sender says {:08x}; "
            "generation {}, op {})",
            item_, item.bytes, peer_, got, header_.crc, spec_.generation, spec_.op);
        if (!retry || resends_ >= spec_.max_resends) {
          if (resends_ > 0) what += fmt::format(", after {} resends in this transfer", resends_);
          return DataLossError(what);
        }
        // Not reduced, not forwarded (the pieces after it wait): fetched again.
        ++resends_;
        if (stats) ++stats->pieces_refetched;
        NONSTOP_LOG_WARNING("{}: asking for it again", what);
        reply_->Queue(kFrameResend, static_cast<uint32_t>(item_));
        awaiting_resend_ = true;
        return OkStatus();
      }
    }
    awaiting_resend_ = false;
    if (item.combine != nullptr) item.combine(item.data, payload, item.bytes);
    ++item_;
    if (pieces_done() && retry) reply_->Queue(kFrameAck, static_cast<uint32_t>(item_));
    return OkStatus();
  }

  const TransferSpec& spec_;
  Connection* const conn_;
  const std::string& peer_;
  const bool pieces_;
  Outbound* const reply_;
  Outbound* const sender_;
  size_t item_ = 0;
  size_t header_got_ = 0;
  size_t payload_got_ = 0;
  size_t skip_left_ = 0;
  int resends_ = 0;
  bool awaiting_resend_ = false;
  bool violated_ = false;  // a protocol violation: nothing to resume
  DataHeader header_;
  char raw_[kDataHeaderBytes];
  std::byte discard_[4096];
};

}  // namespace

Status RunTransfer(const TransferSpec& spec, TransferStats* stats) {
  NONSTOP_CHECK(spec.sends.empty() || spec.send_to != nullptr);
  NONSTOP_CHECK(spec.recvs.empty() || spec.recv_from != nullptr);
  for (const RecvItem& r : spec.recvs) {
    if (r.combine != nullptr) {
      NONSTOP_CHECK_LE(r.bytes, spec.scratch.size()) << "scratch too small";
    }
  }
  Connection* const send_conn = spec.sends.empty() ? nullptr : spec.send_to;
  Connection* const recv_conn = spec.recvs.empty() ? nullptr : spec.recv_from;
  const bool one_conn = send_conn != nullptr && send_conn == recv_conn;
  // Up to two connections, each with a writing and a reading half as needed.
  std::optional<Outbound> out, reply;
  std::optional<Inbound> in, acks;
  if (send_conn != nullptr) out.emplace(spec, send_conn, spec.send_peer, /*pieces=*/true);
  if (recv_conn != nullptr && !one_conn)
    reply.emplace(spec, recv_conn, spec.recv_peer, /*pieces=*/false);
  Outbound* sender = out ? &*out : nullptr;
  if (recv_conn != nullptr) {
    in.emplace(spec, recv_conn, spec.recv_peer, /*pieces=*/true, one_conn ? sender : &*reply,
               one_conn ? sender : nullptr);
  }
  if (sender != nullptr && !one_conn && sender->awaiting_ack())
    acks.emplace(spec, send_conn, spec.send_peer, /*pieces=*/false, nullptr, sender);

  auto recvs_done = [&] { return in ? in->items_done() : 0; };
  auto all_done = [&] {
    return (!out || out->done()) && (!reply || reply->done()) && (!in || in->pieces_done()) &&
           (!acks || !acks->wants_read());
  };
  // An abort ends the call only once nothing moves: data of live peers that is here, or still
  // flowing, completes it, as if the abort had come a moment later. Ranks that finish a
  // collective their peers gave up on would otherwise hold different steps of one state (sharded
  // state: a group that updates while a replica of its shard does not, docs/sharding.md).
  while (!all_done()) {
    bool moved = false;
    for (Inbound* i : {in ? &*in : nullptr, acks ? &*acks : nullptr}) {
      if (i == nullptr) continue;
      NONSTOP_ASSIGN_OR_RETURN(Progress p, i->Pump(stats));
      moved |= p == Progress::kMoved;
    }
    for (Outbound* o : {sender, reply ? &*reply : nullptr}) {
      if (o == nullptr) continue;
      NONSTOP_ASSIGN_OR_RETURN(Progress p, o->Pump(recvs_done(), stats));
      moved |= p == Progress::kMoved;
    }
    if (moved || all_done()) continue;
    if (spec.abort != nullptr && spec.abort->fired()) {
      return AbortedError(
          fmt::format("collective aborted (generation {}, op {})", spec.generation, spec.op));
    }

    // Nothing moved: sleep until a socket is ready, the abort fires, or the deadline.
    pollfd fds[3];
    nfds_t n = 0;
    auto watch = [&](Connection* c, bool write, bool read) {
      if (c == nullptr || !(write || read)) return;
      fds[n++] = {c->fd.get(), static_cast<short>((write ? POLLOUT : 0) | (read ? POLLIN : 0)), 0};
    };
    const bool send_wants = out && out->wants_write(recvs_done());
    if (one_conn) {
      watch(send_conn, send_wants, in->wants_read());
    } else {
      watch(send_conn, send_wants, acks && acks->wants_read());
      watch(recv_conn, reply && reply->wants_write(0), in && in->wants_read());
    }
    if (spec.abort != nullptr) fds[n++] = {spec.abort->fd(), POLLIN, 0};
    int rc = ::poll(fds, n, PollTimeoutMs(spec.deadline));
    if (rc < 0 && errno != EINTR) return ErrnoStatus(StatusCode::kInternal, "poll", errno);
    if (rc == 0 && Clock::now() >= spec.deadline) {
      std::string waiting = "sending to " + spec.send_peer;
      if (in && !in->pieces_done()) {
        waiting = "receiving from " + spec.recv_peer;
      } else if (reply && !reply->done()) {
        waiting = "answering " + spec.recv_peer;
      } else if (out && !send_wants && out->awaiting_ack()) {
        waiting = "waiting for " + spec.send_peer + " to acknowledge every piece";
      }
      return DeadlineExceededError(
          fmt::format("Timed out {} (generation {}, op {}): past the call's timeout", waiting,
                      spec.generation, spec.op));
    }
  }
  return OkStatus();
}

}  // namespace nonstop::collective
