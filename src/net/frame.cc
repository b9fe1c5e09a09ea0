#include "net/frame.h"

#include <fmt/format.h>

#include "common/coding.h"
#include "net/socket.h"
#include "nonstop/crc32c.h"

namespace nonstop::net {

std::string EncodeFrame(uint16_t type, std::string_view payload, uint16_t flags) {
  NONSTOP_CHECK_LE(payload.size(), kMaxControlFrameBytes);
  std::string out;
  out.reserve(kFrameHeaderBytes + payload.size());
  PutFixed32(&out, static_cast<uint32_t>(payload.size()));
  PutFixed16(&out, type);
  PutFixed16(&out, flags);
  PutFixed32(&out, Crc32c(payload));
  out.append(payload);
  return out;
}

namespace {

Status CheckHeader(const char* p, uint32_t max_payload, uint32_t* length) {
  *length = DecodeFixed32(p);
  if (*length > max_payload) {
    return DataLossError(
        fmt::format("frame of {} bytes (type {}) exceeds the limit of {} bytes: "
                    "not a nonstop peer, or a corrupt stream",
                    *length, DecodeFixed16(p + 4), max_payload));
  }
  return OkStatus();
}

Status CheckCrc(const char* header, std::string_view payload) {
  uint32_t want = DecodeFixed32(header + 8);
  uint32_t got = Crc32c(payload);
  if (want != got) {
    return DataLossError(
        fmt::format("frame type {} of {} bytes fails its checksum (crc32c {:08x}, "
                    "header says {:08x})",
                    DecodeFixed16(header + 4), payload.size(), got, want));
  }
  return OkStatus();
}

}  // namespace

Status FrameDecoder::Feed(std::string_view bytes) {
  if (!error_.ok()) return error_;
  buffer_.append(bytes);
  size_t pos = 0;
  Status s;
  while (s.ok() && buffer_.size() - pos >= kFrameHeaderBytes) {
    const char* h = buffer_.data() + pos;
    uint32_t length;
    s = CheckHeader(h, max_payload_, &length);
    if (!s.ok() || buffer_.size() - pos - kFrameHeaderBytes < length) break;
    std::string_view payload(h + kFrameHeaderBytes, length);
    s = CheckCrc(h, payload);
    if (!s.ok()) break;
    ready_.push_back(Frame{DecodeFixed16(h + 4), DecodeFixed16(h + 6), std::string(payload)});
    pos += kFrameHeaderBytes + length;
  }
  if (!s.ok()) {
    // The stream is corrupt from here on: nothing after this point is a frame.
    error_ = s;
    buffer_.clear();
    return s;
  }
  buffer_.erase(0, pos);
  return OkStatus();
}

std::optional<Frame> FrameDecoder::Next() {
  if (ready_.empty()) return std::nullopt;
  Frame f = std::move(ready_.front());
  ready_.pop_front();
  return f;
}

Status WriteFrame(int fd, uint16_t type, std::string_view payload, Deadline deadline,
                  const AbortSignal* abort) {
  std::string bytes = EncodeFrame(type, payload);
  return SendAll(fd, std::as_bytes(std::span(bytes)), deadline, abort, "write frame");
}

Result<Frame> ReadFrame(int fd, Deadline deadline, const AbortSignal* abort, uint32_t max_payload) {
  char header[kFrameHeaderBytes];
  NONSTOP_RETURN_IF_ERROR(
      RecvAll(fd, std::as_writable_bytes(std::span(header)), deadline, abort, "read frame header"));
  uint32_t length;
  NONSTOP_RETURN_IF_ERROR(CheckHeader(header, max_payload, &length));
  Frame frame{DecodeFixed16(header + 4), DecodeFixed16(header + 6), std::string(length, '\0')};
  NONSTOP_RETURN_IF_ERROR(RecvAll(fd, std::as_writable_bytes(std::span(frame.payload)), deadline,
                                  abort, "read frame payload"));
  NONSTOP_RETURN_IF_ERROR(CheckCrc(header, frame.payload));
  return frame;
}

}  // namespace nonstop::net
