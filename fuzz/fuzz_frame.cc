// Fuzz target: net::FrameDecoder, the first code that touches the bytes of a
// control connection (docs/protocol.md).
//
// Input: byte 0 chooses the payload limit and seeds how the stream is cut;
// the rest is the stream, fed to one decoder whole and to another in pieces
// of 1 to 64 bytes. Checked: no crash, leak or UB; both decoders agree on the
// frames and on the verdict; an error is DATA_LOSS; every frame re-encodes
// to the bytes it came from and respects the limit.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/check.h"
#include "net/frame.h"

namespace {

using nonstop::Status;
using nonstop::StatusCode;
using nonstop::net::Frame;
using nonstop::net::FrameDecoder;

struct Outcome {
  std::vector<Frame> frames;
  Status status;
};

void Drain(FrameDecoder& d, Outcome& out) {
  while (auto f = d.Next()) out.frames.push_back(std::move(*f));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const std::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);
  const uint32_t limit = (control & 1) ? 64 : nonstop::net::kMaxControlFrameBytes;

  Outcome whole;
  FrameDecoder a(limit);
  whole.status = a.Feed(stream);
  Drain(a, whole);

  Outcome pieces;
  FrameDecoder b(limit);
  uint32_t rng = 0x9E3779B9u ^ control;
  for (size_t pos = 0; pos < stream.size() && pieces.status.ok();) {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    size_t n = std::min<size_t>(1 + rng % 64, stream.size() - pos);
    pieces.status = b.Feed(stream.substr(pos, n));
    Drain(b, pieces);
    pos += n;
  }

  NONSTOP_CHECK_EQ(whole.status.ok(), pieces.status.ok())
      << whole.status.ToString() << " / " << pieces.status.ToString();
  if (!whole.status.ok()) {
    NONSTOP_CHECK(whole.status.code() == StatusCode::kDataLoss) << whole.status.ToString();
    NONSTOP_CHECK(pieces.status.code() == StatusCode::kDataLoss) << pieces.status.ToString();
    NONSTOP_CHECK(!whole.status.message().empty());
  }
  NONSTOP_CHECK_EQ(whole.frames.size(), pieces.frames.size());
  std::string reencoded;
  for (size_t i = 0; i < whole.frames.size(); ++i) {
    const Frame& f = whole.frames[i];
    NONSTOP_CHECK_EQ(f.type, pieces.frames[i].type);
    NONSTOP_CHECK_EQ(f.flags, pieces.frames[i].flags);
    NONSTOP_CHECK(f.payload == pieces.frames[i].payload) << "frame " << i;
    NONSTOP_CHECK_LE(f.payload.size(), limit);
    reencoded += nonstop::net::EncodeFrame(f.type, f.payload, f.flags);
  }
  NONSTOP_CHECK(stream.substr(0, reencoded.size()) == reencoded)
      << "decoded frames are not the stream's prefix";
  return 0;
}
