// The data-plane engine under every collective: one send stream to a peer and
// one receive stream from a peer (possibly the same connection), progressed
// together in a single poll(2) loop so that sending and receiving overlap.
//
// A stream is a list of items ("pieces"); each piece travels as one data frame
// {u32 length, u16 type, u16 flags, u32 generation, u32 op, u32 seq, u32 crc}
// + payload (docs/protocol.md). A send item may depend on a receive item: it
// goes out only after that piece has arrived (and been reduced), which is what
// pipelines a ring: piece p of step t+1 leaves as soon as piece p of step t is
// in. Frames from an older generation are recognised by their tag and
// dropped; any other mismatch is a protocol violation (kInternal).
//
// Buffers: every pointer in a TransferSpec must stay valid until RunTransfer
// returns; it blocks until the transfer is done, failed or aborted.
//
// Abort and reuse: when a transfer ends early (aborted, timed out), the
// position of each stream inside its current frame is saved in the
// Connection; the next transfer on that connection first completes the frame
// it owes (zero padding) and discards the rest of the frame it was reading,
// whose old generation tag marks it stale. So a surviving connection stays
// usable across generations without a reconnect.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "collective/peer_mesh.h"
#include "common/status.h"
#include "common/time.h"
#include "net/abort_signal.h"

namespace nonstop::collective {

inline constexpr size_t kDataHeaderBytes = 24;
inline constexpr uint16_t kFrameData = 16;
inline constexpr uint16_t kDataFlagChecksum = 1;
static_assert(kFrameData == 16, "wire numbers are pinned");

enum class Reduce : uint8_t { kNone, kSumFloat32 };

struct SendItem {
  const std::byte* data = nullptr;
  size_t bytes = 0;
  int32_t after_recv = -1;  // index of the receive item that must complete first; -1: none
};

struct RecvItem {
  std::byte* data = nullptr;  // destination: written (kNone) or accumulated into (kSumFloat32)
  size_t bytes = 0;
  Reduce reduce = Reduce::kNone;
};

struct TransferSpec {
  Connection* send_to = nullptr;
  std::string send_peer;  // "rank 2 (worker 2, 127.0.0.1:4242)", for messages
  std::vector<SendItem> sends;

  Connection* recv_from = nullptr;
  std::string recv_peer;
  std::vector<RecvItem> recvs;

  uint32_t generation = 0;
  uint32_t op = 0;
  bool checksum = false;         // CRC32C on every payload; a mismatch is kDataLoss
  std::span<std::byte> scratch;  // >= the largest reducing receive item
  Deadline deadline = kNoDeadline;
  const net::AbortSignal* abort = nullptr;
};

struct TransferStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t stale_frames_dropped = 0;
  int failed_peer = -1;  // worker id of the connection that broke (kUnavailable), else -1
};

Status RunTransfer(const TransferSpec& spec, TransferStats* stats = nullptr);

// dst[i] += src[i] for `count` floats, in index order (deterministic).
void AddFloat32(float* dst, const float* src, size_t count);

}  // namespace nonstop::collective
