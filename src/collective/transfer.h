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
// Checked transfers (spec.checksum and spec.retry; docs/protocol.md
// "Checked collectives"): every piece carries a CRC-32C and the flag
// kDataFlagRetry. A receiver that finds a piece damaged asks the sender for
// it again with a kFrameResend {seq} on the same connection, going the other
// way, and drops the frames already on their way after it (go back N); the
// sender starts over from that piece. When every piece is in, the receiver
// sends kFrameAck {count}, and the sender's transfer ends only then, so a
// piece is never asked for after its sender has moved on. The sender's
// buffers stay valid that long: in every collective built on this engine the
// memory of a piece sent is written again only after the bytes that depend
// on that piece came back around, which a piece still asked for holds up.
// The receiver acts on the flags of the frames it gets, so a job whose
// workers disagree on the setting still runs (checked where the sender is).
//
// Abort: a fired `abort` ends a transfer once nothing moves; bytes of a live peer that are here,
// or keep coming, complete it first (a peer's piece still on its way when nothing moved is not
// waited for: docs/sharding.md, "Fast steps commit a group at a time").
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

#include "collective/combine.h"
#include "collective/peer_mesh.h"
#include "common/time.h"
#include "net/abort_signal.h"
#include "nonstop/status.h"

namespace nonstop::collective {

inline constexpr size_t kDataHeaderBytes = 24;
inline constexpr uint16_t kFrameData = 16;
inline constexpr uint16_t kFrameResend =
    17;  // receiver to sender: send piece `seq` and the rest again
inline constexpr uint16_t kFrameAck = 18;  // receiver to sender: all `seq` pieces arrived whole
inline constexpr uint16_t kDataFlagChecksum = 1;
inline constexpr uint16_t kDataFlagRetry = 2;  // the receiver answers with kFrameResend / kFrameAck
static_assert(kFrameData == 16 && kFrameResend == 17 && kFrameAck == 18, "wire numbers are pinned");

struct SendItem {
  const std::byte* data = nullptr;
  size_t bytes = 0;
  int32_t after_recv = -1;  // index of the receive item that must complete first; -1: none
};

struct RecvItem {
  std::byte* data = nullptr;  // destination: written (no combine) or combined into
  size_t bytes = 0;
  Combine combine = nullptr;  // the reduction's step (combine.h); null: a plain write
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
  bool checksum = false;  // CRC32C on every payload; a mismatch is kDataLoss
  // With checksum: a damaged piece is fetched again (up to max_resends times
  // in the transfer, then kDataLoss), and the sender waits for the ack.
  bool retry = false;
  int max_resends = 8;
  // Fault injection (a byte flipped on the wire): the first transmission of
  // send item `flip_send_item` leaves with one bit of its payload flipped
  // after its checksum was computed. -1: none.
  int32_t flip_send_item = -1;
  std::span<std::byte> scratch;  // >= the largest reducing receive item
  Deadline deadline = kNoDeadline;
  const net::AbortSignal* abort = nullptr;
};

struct TransferStats {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t stale_frames_dropped = 0;
  uint64_t pieces_refetched = 0;  // resend requests this receiver made
  int failed_peer = -1;           // worker id of the connection that broke (kUnavailable), else -1
};

Status RunTransfer(const TransferSpec& spec, TransferStats* stats = nullptr);

// dst[i] += src[i] for `count` floats, in index order (deterministic).
void AddFloat32(float* dst, const float* src, size_t count);

}  // namespace nonstop::collective
