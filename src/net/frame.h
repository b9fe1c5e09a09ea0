// Control-plane framing: {u32 length, u16 type, u16 flags, u32 crc32c} + payload,
// little-endian, the CRC over the payload. See docs/protocol.md.
//
// FrameDecoder turns a byte stream into frames and never trusts it: a length
// over the limit or a CRC mismatch is an error that names what was wrong, so
// the owner can log it and close the connection.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>

#include "common/time.h"
#include "nonstop/status.h"

namespace nonstop::net {

class AbortSignal;

inline constexpr size_t kFrameHeaderBytes = 12;
inline constexpr uint32_t kMaxControlFrameBytes = 16u << 20;

struct Frame {
  uint16_t type = 0;
  uint16_t flags = 0;
  std::string payload;
};

std::string EncodeFrame(uint16_t type, std::string_view payload, uint16_t flags = 0);

class FrameDecoder {
 public:
  explicit FrameDecoder(uint32_t max_payload = kMaxControlFrameBytes) : max_payload_(max_payload) {}

  // Appends bytes; complete frames become available through Next(). The
  // first error is sticky: the frames decoded before it stay available, and
  // every later Feed returns the same error without reading its bytes.
  Status Feed(std::string_view bytes);
  std::optional<Frame> Next();
  // A longer payload is an error from now on (a peer that proved who it is may send larger ones).
  void set_max_payload(uint32_t max_payload) { max_payload_ = max_payload; }

 private:
  uint32_t max_payload_;
  Status error_;  // the first error; OK until then
  std::string buffer_;
  std::deque<Frame> ready_;
};

// Blocking-style helpers over a non-blocking socket (poll + deadline + abort).
Status WriteFrame(int fd, uint16_t type, std::string_view payload, Deadline deadline,
                  const AbortSignal* abort);
Result<Frame> ReadFrame(int fd, Deadline deadline, const AbortSignal* abort,
                        uint32_t max_payload = kMaxControlFrameBytes);

}  // namespace nonstop::net
