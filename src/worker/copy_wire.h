// The state copy's wire (docs/protocol.md, "State transfer"), what its two phases share: the
// replicated state's copy (state_transfer.cc) and the shard exchange (shard_exchange.cc). A
// source's header and CRC table, the requests, a source serving one receiver (Serve), a receiver
// fetching from one source (Fetch, FetchInPlace), and the seal on them (copy_seal.h). Internal to
// the worker: state_transfer.h is what the session calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "collective/data_plane.h"
#include "control/messages.h"
#include "nonstop/state.h"
#include "nonstop/status.h"
#include "worker/copy_seal.h"
#include "worker/state_transfer.h"

namespace nonstop::worker {

// A source's header: {magic "NSX6", step, total bytes, chunk bytes, chunks, shard group, shard,
// flags, the seal's nonce, crc32c}.
inline constexpr size_t kHeaderBytes = 60;

// The rank of `worker_id` in `plan` (-1: not a member).
int RankOf(const control::PlanMsg& plan, int worker_id);

// Whether a copy is sealed and, if so, with what: the key of the data connections and the
// generation each copy's key is bound to (CopySeal).
struct SealSpec {
  const crypto::Key* key = nullptr;  // none: unsealed
  uint64_t generation = 0;
};

inline SealSpec SealOf(const TransferHooks& hooks, uint64_t generation) {
  return {hooks.seal_key ? &*hooks.seal_key : nullptr, generation};
}

// The seal of one request's chunks: the copy's (none: unsealed) and the request's number.
struct RequestSeal {
  const CopySeal* seal = nullptr;
  uint32_t request = 0;
};

// The faults a source injects (TransferHooks), each into one chunk across all its receivers.
struct SourceFaults {
  explicit SourceFaults(const TransferHooks& hooks)
      : corrupt(hooks.corrupt_first_chunk),
        tamper_pending(hooks.tamper_first_chunk != nullptr),
        tamper(hooks.tamper_first_chunk),
        tamper_table(hooks.tamper_table) {}
  std::atomic<bool> corrupt;
  std::atomic<bool> tamper_pending;
  const std::function<void(std::span<std::byte>)>& tamper;
  const std::function<void(std::string&)>& tamper_table;  // every table sent
};

// What a source's header says beyond the layout: the step it holds, and, sealed, the header's
// bytes that the seal's key is bound to (empty: unsealed).
struct Header {
  int64_t step = 0;
  std::string sealed;
};

// Checks a source's header against this worker's state (magic, checksum,
// group size, layout, the seal this worker's setting asks for: `sealed`; with `want_shard` >= 0,
// the receiver copies the sharded chunks, which must be of that shard) and returns the step it
// names, which is the caller's to judge, and the seal's nonce.
Result<Header> ParseHeader(const std::string& h, const state::StateRegistry& reg,
                           const std::string& source, bool sealed, int want_shard = -1);

// ParseHeader, and the step must be `want_step` (the shard exchange, whose
// sources' steps ExchangeShards checked against what they all-gathered).
Result<Header> CheckHeader(const std::string& h, int64_t want_step, const state::StateRegistry& reg,
                           const std::string& source, bool sealed, int want_shard = -1);

// The CRC-32C table a source sends (entry c: chunk c as it serves it; 0 for the chunks the copy
// does not take and those `skip` marks), computed on up to 8 threads (copy_wire.cc).
std::vector<uint32_t> CrcTable(const state::StateRegistry& reg, bool sharded, int shard = -1,
                               const std::vector<char>* skip = nullptr, unsigned busy = 0);

// A source's CRC table, which follows its first request's chunks (of this worker's layout: its
// header said so). DATA_LOSS when `seal` and the table fails it.
Result<std::vector<uint32_t>> RecvTable(collective::Communicator& comm,
                                        const state::StateRegistry& reg, int source,
                                        const CopySeal* seal);

// A list of numbers (a request; empty: done), in two messages: its count, then its values.
Status SendU32s(collective::Communicator& comm, int rank, const std::vector<uint32_t>& values);

// Tells each of `sources` that this receiver is done with it (the empty request), every one of them
// even after a send failed: the first failure.
Status TellDone(collective::Communicator& comm, const std::vector<int>& sources);

// The streams (lanes) for copying `chunks` from one source: `asked` (> 0: the caller's), else
// one per kBytesPerStream of them, within the transport's lanes and the number of chunks.
int StreamsFor(const collective::Communicator& comm, const state::StateRegistry& reg,
               const std::vector<uint32_t>& chunks, int asked);

// Of the results of work run at once, where a failure aborts the rest: the cause (the first error
// that is no abort), else the first error, else OK.
Status CauseOf(std::span<const Status> results);

// Source side: serve one receiver until it says it is done. It sends its header (`step`: the step
// its state holds) and waits for a request; it streams the chunks asked for over the lanes the
// request names (SendRequest), the bytes unchecked by the transport
// (Communicator::SendUnchecked), then, after the first request's chunks, its CRC table, against
// which the receiver judges them (with the tables of all its sources); later requests (chunks
// fetched again) come after the table. `known`: the table, computed before (the shard exchange:
// its digest was all-gathered; the state transfer to several receivers); without it the chunks
// asked are checksummed by SendChunks as they go out, and the others by a thread of their own
// meanwhile, so no pass over the state stands between the receiver's request and its first byte
// (docs/recovery.md). `sharded`: the shard exchange (its chunks are the sharded ones). `shard` >=
// 0: the receiver's shard, read from a registry that holds every shard. With `spec` sealed, a
// fresh nonce in the header and a tag on every chunk and on the table (CopySeal).
Status Serve(collective::Communicator& comm, state::StateRegistry& reg, int receiver, int64_t step,
             const std::vector<uint32_t>* known, bool sharded, SourceFaults* faults, SealSpec spec,
             int shard = -1);

// A source whose state holds another step than the plan says (`refusal`
// names both): it still sends its header, naming the step it holds, so that
// the receiver learns at once that it serves nothing; then it waits for the
// receiver's done and returns `refusal`.
Status ServeRefusal(collective::Communicator& comm, const state::StateRegistry& reg, int receiver,
                    int64_t held_step, const Status& refusal, SealSpec spec);

// Where a fetched chunk goes: the live state (WriteChunk), or a staging buffer.
// DATA_LOSS: the chunk failed its checksum (fetched again).
using ChunkSink =
    std::function<Status(uint32_t index, std::span<const std::byte> data, uint32_t crc)>;

// What a source said of the chunks it sent (`claims`: the CRC in each {index, crc}) against its
// table, which came after them: DATA_LOSS naming the first chunk where they differ.
Status CheckClaims(int source, const std::vector<uint32_t>& indices,
                   const std::vector<uint32_t>& claims, const std::vector<uint32_t>& table);

// Receiver side: fetch `indices` from one source, on lane 0, into a buffer, each chunk handed to
// `sink` with the CRC the source sent ahead of it (the sink checks it). Chunks that fail go to
// `failed`; what the source said of each goes to `claims`. The request goes even for no chunk:
// the first one is what the source sends its table after.
Status Fetch(collective::Communicator& comm, const state::StateRegistry& reg, int source,
             const std::vector<uint32_t>& indices, std::vector<uint32_t>* claims,
             std::vector<uint32_t>* failed, std::atomic<uint64_t>* bytes, const ChunkSink& sink,
             RequestSeal seal);

// Receiver side of RunStateTransfers: fetch `indices` from one source
// straight into the live state, over `lanes` streams at once (a chunk that spans regions goes
// through a buffer and WriteChunk, which checks it at once). Until the transfer has succeeded
// the state holds no step (the session says so while it runs), and a chunk that fails its check,
// or that the majority of the sources' tables gives another CRC, is fetched again over it. The
// request goes even for no chunk (the first one is what the source sends its table after).
Status FetchInPlace(collective::Communicator& comm, state::StateRegistry& reg, int source,
                    const std::vector<uint32_t>& indices, int lanes, std::vector<uint32_t>* claims,
                    std::vector<uint32_t>* failed, std::atomic<uint64_t>* bytes, RequestSeal seal);

// "rank R (worker W)", for messages.
std::string SourceName(const control::PlanMsg& plan, int rank);

}  // namespace nonstop::worker
