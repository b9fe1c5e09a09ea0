#include "collective/transfer.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "common/coding.h"
#include "common/crc32c.h"

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

// The sending half: one item at a time, header and payload in one writev.
class Sender {
 public:
  explicit Sender(const TransferSpec& spec) : spec_(spec) {}
  ~Sender() {
    // Ended mid-frame (abort, timeout): the stream owes the rest of this frame.
    if (spec_.send_to != nullptr && !done() && offset_ > 0) {
      Connection* c = spec_.send_to;
      if (offset_ < kDataHeaderBytes) {
        // The header's real bytes must go out: the receiver needs its length.
        c->send_header_tail_left = kDataHeaderBytes - offset_;
        std::memcpy(c->send_header_tail, header_ + offset_, c->send_header_tail_left);
        c->send_pad = spec_.sends[item_].bytes;
      } else {
        c->send_pad = kDataHeaderBytes + spec_.sends[item_].bytes - offset_;
      }
    }
  }

  bool done() const { return item_ >= spec_.sends.size(); }
  bool ready(size_t recvs_done) const {
    if (done()) return false;
    if (owes()) return true;
    int32_t dep = spec_.sends[item_].after_recv;
    return dep < 0 || static_cast<size_t>(dep) < recvs_done;
  }

  bool owes() const {
    return spec_.send_to->send_header_tail_left > 0 || spec_.send_to->send_pad > 0;
  }

  // Completes a frame left unfinished by an aborted operation: the rest of
  // its header as it was, then zeros for its payload.
  Result<Progress> PayPadding(TransferStats* stats) {
    static const std::byte kZeros[4096] = {};
    Progress progress = Progress::kBlocked;
    Connection* c = spec_.send_to;
    while (owes()) {
      const void* src = kZeros;
      size_t len = std::min(c->send_pad, sizeof(kZeros));
      if (c->send_header_tail_left > 0) {
        src = c->send_header_tail;
        len = c->send_header_tail_left;
      }
      ssize_t n = ::send(c->fd.get(), src, len, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
        if (stats) stats->failed_peer = spec_.send_to->peer_id;
        return UnavailableError(
            fmt::format("send to {} failed: {}", spec_.send_peer, std::strerror(errno)));
      }
      progress = Progress::kMoved;
      if (c->send_header_tail_left > 0) {
        auto sent = static_cast<size_t>(n);
        std::memmove(c->send_header_tail, c->send_header_tail + sent,
                     c->send_header_tail_left - sent);
        c->send_header_tail_left -= sent;
      } else {
        c->send_pad -= static_cast<size_t>(n);
      }
    }
    return progress;
  }

  Result<Progress> Pump(size_t recvs_done, TransferStats* stats) {
    Progress progress = Progress::kBlocked;
    if (!done() && owes()) {
      NONSTOP_ASSIGN_OR_RETURN(progress, PayPadding(stats));
      if (owes()) return progress;
    }
    while (ready(recvs_done)) {
      const SendItem& item = spec_.sends[item_];
      if (offset_ == 0 && !header_built_) {
        DataHeader h;
        h.length = static_cast<uint32_t>(item.bytes);
        h.flags = spec_.checksum ? kDataFlagChecksum : 0;
        h.generation = spec_.generation;
        h.op = spec_.op;
        h.seq = static_cast<uint32_t>(item_);
        h.crc = spec_.checksum ? Crc32c(item.data, item.bytes) : 0;
        EncodeHeader(h, header_);
        header_built_ = true;
      }
      size_t total = kDataHeaderBytes + item.bytes;
      iovec iov[2];
      int iovcnt = 0;
      if (offset_ < kDataHeaderBytes) {
        iov[iovcnt++] = {header_ + offset_, kDataHeaderBytes - offset_};
        if (item.bytes > 0) iov[iovcnt++] = {const_cast<std::byte*>(item.data), item.bytes};
      } else {
        iov[iovcnt++] = {const_cast<std::byte*>(item.data) + (offset_ - kDataHeaderBytes),
                         total - offset_};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<size_t>(iovcnt);
      ssize_t n = ::sendmsg(spec_.send_to->fd.get(), &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
        if (stats) stats->failed_peer = spec_.send_to->peer_id;
        return UnavailableError(fmt::format("send to {} failed: {} (generation {}, op {})",
                                            spec_.send_peer, std::strerror(errno), spec_.generation,
                                            spec_.op));
      }
      progress = Progress::kMoved;
      offset_ += static_cast<size_t>(n);
      if (stats) stats->bytes_sent += static_cast<uint64_t>(n);
      if (offset_ == total) {
        ++item_;
        offset_ = 0;
        header_built_ = false;
      }
    }
    return progress;
  }

 private:
  const TransferSpec& spec_;
  size_t item_ = 0;
  size_t offset_ = 0;  // bytes of the current frame (header + payload) already sent
  bool header_built_ = false;
  char header_[kDataHeaderBytes];
};

// The receiving half: header first, then the payload straight into the
// destination (or into scratch, to be reduced into the destination).
class Receiver {
 public:
  explicit Receiver(const TransferSpec& spec) : spec_(spec) {
    Connection* c = spec_.recv_from;
    if (c == nullptr || spec_.recvs.empty()) return;
    // Resume a frame abandoned by an aborted operation: it is stale by construction.
    if (c->recv_header_got > 0) {
      std::memcpy(raw_, c->recv_header, c->recv_header_got);
      header_got_ = c->recv_header_got;
    } else if (c->recv_skip > 0) {
      header_got_ = kDataHeaderBytes;
      skip_left_ = c->recv_skip;
    }
    c->recv_header_got = 0;
    c->recv_skip = 0;
  }
  ~Receiver() {
    Connection* c = spec_.recv_from;
    if (c == nullptr || done()) return;
    // Ended mid-frame: remember how to get back to a frame boundary.
    if (header_got_ > 0 && header_got_ < kDataHeaderBytes) {
      std::memcpy(c->recv_header, raw_, header_got_);
      c->recv_header_got = header_got_;
    } else if (header_got_ == kDataHeaderBytes) {
      c->recv_skip = skip_left_ > 0 ? skip_left_ : header_.length - payload_got_;
    }
  }

  bool done() const { return item_ >= spec_.recvs.size(); }
  size_t items_done() const { return item_; }

  Result<Progress> Pump(TransferStats* stats) {
    Progress progress = Progress::kBlocked;
    while (!done()) {
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
        ssize_t n = ::recv(spec_.recv_from->fd.get(), target, want, 0);
        if (n == 0) {
          if (stats) stats->failed_peer = spec_.recv_from->peer_id;
          return UnavailableError(
              fmt::format("connection to {} closed by peer (generation {}, op {})", spec_.recv_peer,
                          spec_.generation, spec_.op));
        }
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
          if (stats) stats->failed_peer = spec_.recv_from->peer_id;
          return UnavailableError(fmt::format("recv from {} failed: {} (generation {}, op {})",
                                              spec_.recv_peer, std::strerror(errno),
                                              spec_.generation, spec_.op));
        }
        progress = Progress::kMoved;
        if (stats) stats->bytes_received += static_cast<uint64_t>(n);
        if (header_got_ < kDataHeaderBytes) {
          header_got_ += static_cast<size_t>(n);
          if (header_got_ == kDataHeaderBytes) NONSTOP_RETURN_IF_ERROR(OnHeader(stats));
          continue;
        }
        if (skip_left_ > 0) {
          skip_left_ -= static_cast<size_t>(n);
          if (skip_left_ == 0) header_got_ = 0;  // the stale frame is gone; read the next header
          continue;
        }
        payload_got_ += static_cast<size_t>(n);
      }
      if (header_got_ == kDataHeaderBytes && skip_left_ == 0 &&
          payload_got_ == spec_.recvs[item_].bytes) {
        NONSTOP_RETURN_IF_ERROR(FinishItem());
      }
    }
    return progress;
  }

 private:
  std::byte* PayloadTarget() {
    const RecvItem& item = spec_.recvs[item_];
    return item.reduce == Reduce::kNone ? item.data : spec_.scratch.data();
  }

  Status OnHeader(TransferStats* stats) {
    header_ = DecodeHeader(raw_);
    const RecvItem& item = spec_.recvs[item_];
    if (header_.type != kFrameData) {
      return InternalError(
          fmt::format("{} sent a frame of type {} on the data path (generation {}, op {}): "
                      "not a nonstop data stream",
                      spec_.recv_peer, header_.type, spec_.generation, spec_.op));
    }
    if (header_.generation < spec_.generation) {
      // A frame of an operation aborted in an older generation: drop it.
      if (stats) ++stats->stale_frames_dropped;
      skip_left_ = header_.length;
      if (skip_left_ == 0) header_got_ = 0;
      return OkStatus();
    }
    if (header_.generation != spec_.generation || header_.op != spec_.op || header_.seq != item_ ||
        header_.length != item.bytes) {
      return InternalError(
          fmt::format("{} sent (generation {}, op {}, seq {}, {} bytes) where (generation {}, op "
                      "{}, seq {}, {} bytes) "
                      "was expected: the peers disagree on the sequence of collectives",
                      spec_.recv_peer, header_.generation, header_.op, header_.seq, header_.length,
                      spec_.generation, spec_.op, item_, item.bytes));
    }
    if (spec_.checksum && !(header_.flags & kDataFlagChecksum)) {
      return InternalError(fmt::format(
          "{} sent an unchecksummed piece where a checksum is required", spec_.recv_peer));
    }
    return OkStatus();
  }

  Status FinishItem() {
    const RecvItem& item = spec_.recvs[item_];
    const std::byte* payload = PayloadTarget();
    if (header_.flags & kDataFlagChecksum) {
      uint32_t got = Crc32c(payload, item.bytes);
      if (got != header_.crc) {
        return DataLossError(fmt::format(
            "piece {} of {} bytes from {} fails its checksum (crc32c {:08x}, "
            "sender says {:08x}; generation {}, op {})",
            item_, item.bytes, spec_.recv_peer, got, header_.crc, spec_.generation, spec_.op));
      }
    }
    if (item.reduce == Reduce::kSumFloat32) {
      AddFloat32(reinterpret_cast<float*>(item.data), reinterpret_cast<const float*>(payload),
                 item.bytes / sizeof(float));
    }
    ++item_;
    header_got_ = 0;
    payload_got_ = 0;
    return OkStatus();
  }

  const TransferSpec& spec_;
  size_t item_ = 0;
  size_t header_got_ = 0;
  size_t payload_got_ = 0;
  size_t skip_left_ = 0;
  DataHeader header_;
  char raw_[kDataHeaderBytes];
  std::byte discard_[4096];
};

}  // namespace

Status RunTransfer(const TransferSpec& spec, TransferStats* stats) {
  NONSTOP_CHECK(spec.sends.empty() || spec.send_to != nullptr);
  NONSTOP_CHECK(spec.recvs.empty() || spec.recv_from != nullptr);
  for (const RecvItem& r : spec.recvs) {
    if (r.reduce != Reduce::kNone) {
      NONSTOP_CHECK_LE(r.bytes, spec.scratch.size()) << "scratch too small";
    }
  }
  Sender sender(spec);
  Receiver receiver(spec);
  while (!sender.done() || !receiver.done()) {
    if (spec.abort != nullptr && spec.abort->fired()) {
      return AbortedError(
          fmt::format("collective aborted (generation {}, op {})", spec.generation, spec.op));
    }
    NONSTOP_ASSIGN_OR_RETURN(Progress rp, receiver.Pump(stats));
    NONSTOP_ASSIGN_OR_RETURN(Progress sp, sender.Pump(receiver.items_done(), stats));
    if (rp == Progress::kMoved || sp == Progress::kMoved) continue;
    if (sender.done() && receiver.done()) break;

    // Nothing moved: sleep until a socket is ready, the abort fires, or the deadline.
    pollfd fds[3];
    int n = 0;
    int send_fd = sender.ready(receiver.items_done()) ? spec.send_to->fd.get() : -1;
    int recv_fd = receiver.done() ? -1 : spec.recv_from->fd.get();
    if (send_fd >= 0 && send_fd == recv_fd) {
      fds[n++] = {send_fd, static_cast<short>(POLLIN | POLLOUT), 0};
    } else {
      if (send_fd >= 0) fds[n++] = {send_fd, POLLOUT, 0};
      if (recv_fd >= 0) fds[n++] = {recv_fd, POLLIN, 0};
    }
    if (spec.abort != nullptr) fds[n++] = {spec.abort->fd(), POLLIN, 0};
    int rc = ::poll(fds, static_cast<nfds_t>(n), PollTimeoutMs(spec.deadline));
    if (rc < 0 && errno != EINTR) return ErrnoStatus(StatusCode::kInternal, "poll", errno);
    if (rc == 0 && Clock::now() >= spec.deadline) {
      std::string waiting =
          !receiver.done() ? "receiving from " + spec.recv_peer : "sending to " + spec.send_peer;
      return DeadlineExceededError(
          fmt::format("timed out {} (generation {}, op {})", waiting, spec.generation, spec.op));
    }
  }
  return OkStatus();
}

}  // namespace nonstop::collective
