// The sealed state copy (NONSTOP_SEALED_STATE_COPY; docs/security.md, "The state copy"): with
// it, every chunk a source sends and its CRC table carry an AES-256-GMAC tag, so a party on the
// path that rewrites a chunk's bytes and its CRCs alike (the CRCs alone stop only accidents) is
// caught before the chunk counts as copied.
//
// One key per source's serving of one receiver, derived from the key the data connections prove
// (the job key) and bound to what the copy is: its phase (the replicated state or a shard), the
// generation, both ranks, and the source's whole header (the step, the layout, the shard, and a
// fresh random nonce), so a header altered on the way gives the receiver another key. Under
// that key, a chunk's tag covers its index, its CRC and its bytes with the nonce {kind, request,
// index}: the request number (the source's count of the receiver's requests) makes each nonce
// unique even when a chunk is fetched again from the same source, as GCM requires. The table's
// tag has a kind of its own. A value recorded from another copy fails: its key differs.
//
// Thread-safety: immutable after construction; the lanes of one copy share it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "common/crypto.h"

namespace nonstop::worker {

class CopySeal {
 public:
  // The random bytes a source puts in its header for the receiver's side of the key.
  static constexpr size_t kNonceBytes = 16;
  static constexpr size_t kTagBytes = crypto::kGmacTagBytes;

  // `phase`: "replicated" or "shard". `header`: the source's header as it travels, its nonce
  // included (its CRC left out).
  CopySeal(const crypto::Key& key, std::string_view phase, uint64_t generation, int source_rank,
           int receiver_rank, std::string_view header);

  std::string ChunkTag(uint32_t request, uint32_t index, uint32_t crc,
                       std::span<const std::byte> bytes) const;
  bool ChunkVerifies(uint32_t request, uint32_t index, uint32_t crc,
                     std::span<const std::byte> bytes, std::string_view tag) const;
  // `table`: the table as it travels (EncodeTable).
  std::string TableTag(std::string_view table) const;
  bool TableVerifies(std::string_view table, std::string_view tag) const;

 private:
  crypto::Key key_;
};

}  // namespace nonstop::worker
