// Peer-to-peer state transfer (docs/architecture.md "State"): how a member that lacks the
// state of step s* (a spare taking a rank, a member one step behind) copies it
// from the members that hold it, over the generation's Communicator
// (collective/data_plane.h: any data plane's; the state is in host memory).
//
// Protocol, per (receiver, source) pair, over point-to-point transfers
// (docs/protocol.md):
//   source → receiver  header {magic "NSX6", step held, total bytes, chunk bytes,
//                      chunks, shard group, shard, sealed, seal's nonce, crc32c}
//   receiver → source  request {count, lanes, chunk indices…}   (count 0: done)
//   source → receiver  per chunk {index, crc32c[, tag]} then the chunk's bytes, the chunk
//                      at position p of the request over lane p mod lanes
//   source → receiver  after the first request's chunks: its CRC table {crc32c of
//                      chunk c, for every chunk c}
//   (receiver → source further requests, chunks fetched again; then done)
// Everything but the chunks travels on lane 0, the connection of Send/Recv. A
// request names how many streams (Communicator lanes, connections of their own
// between the same two workers) carry its chunks: the receiver picks one per
// 32 MiB it asks of a source (TransferHooks::streams_per_source), so a large
// copy is not held to what one TCP stream and one thread per side reach; each
// lane runs on a thread of its own at both ends. The first request goes even
// when it names no chunk: it is what the source sends its table after.
// The header names the step the source's state really holds (not the
// plan's). The table holds the CRC-32C of each chunk as the source serves it
// (the replicated chunks here, the shard's in ExchangeShards; 0 for chunks
// the transfer does not copy), and each {index, crc32c} is the source's word
// on its chunk, which the table must repeat. Here the source computes the
// CRC of each chunk asked for from the bytes it is about to send (in cache,
// for the kernel's copy too) and those of the other chunks on a thread of
// their own meanwhile, so no pass over the state stands between the request
// and the first byte; a source serving several receivers at once computes
// one table for all first, and the shard exchange sends the table it
// computed before (its digest was all-gathered). The header, table, requests and {index,
// crc32c} travel checksummed by the transport (Send/Recv); a chunk's bytes
// travel unchecked by it (SendUnchecked/RecvUnchecked), because the CRCs
// protect them: each byte is then read once on each side by a CRC and once
// by the kernel's copy, and no more. The CRCs stop accidents only: with
// TransferHooks::seal_key each chunk's word also carries a tag (CopySeal), a
// chunk whose tag fails is fetched again as one whose CRC fails, and the
// table carries a tag of its own.
//
// A source whose state holds another step than the plan's (resume_step - 1)
// refuses: it sends its header (its step), waits for the receiver's done,
// and returns FAILED_PRECONDITION naming both steps. The receiver first
// reads every source's header. A corrupt header, another layout or group
// size is DATA_LOSS naming the source; a source of another step is dropped
// with a warning and told it is done at once, and DATA_LOSS names every
// source and its step when none holds the plan's. It then stripes the
// chunks over the remaining sources (chunk c from source c mod k; all
// sources at once, each request the whole list of its chunks, which the
// source streams back), each received straight into the live state (a chunk
// that spans two regions goes through a buffer) and checked, by the thread
// of the lane it came on as soon as it has landed (still in that core's
// cache), against the source's word on it. Then it reads every source's
// table: a word that is not the table's is DATA_LOSS naming the source. For
// each chunk it takes the CRC that a majority of the sources' tables give
// it (with no majority, two that disagree: the first source's, so that the
// copy is one replica's and not a mix) and logs once the chunks on which
// tables diverge and the sources in the minority. A chunk that failed its
// check, or whose source's table is not the majority's, is fetched again,
// over itself, from the next source that agrees with the majority, and the
// transfer fails with DATA_LOSS when every such source gave a bad copy. So a
// source whose memory holds other bytes than the others' (its table agreeing
// with them) cannot leave them in the receiver when three hold the step.
// Until the transfer has succeeded the receiver's state is of no step (the
// session reports kNoValidState meanwhile): a failed transfer may leave it
// half copied. The source sends from its live state without a copy. A
// source that lies (another chunk than asked, a word other than its table's,
// another size, garbage) fails the transfer with a message naming it; one
// that stalls, with DEADLINE_EXCEEDED after timeout_collective. A request
// that names a chunk twice, one the state lacks or one the transfer does not
// copy (a sharded chunk here, a replicated one in the shard exchange), or
// lanes the transport lacks, is DATA_LOSS at the source.
// A failure after the requests went out tells every source it is done
// (best effort) and aborts this worker's communicator. The sources' states
// must not change while they serve (they are recovering, not training): a
// source checksums each chunk as it sends it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "collective/data_plane.h"
#include "common/crypto.h"
#include "control/messages.h"
#include "nonstop/state.h"
#include "state/shard_layout.h"

namespace nonstop::worker {

struct TransferOutcome {
  bool received = false;  // this worker was a receiver
  bool served = false;    // this worker was a source
  uint64_t bytes_received = 0;
  int sources = 0;
  int streams_per_source = 0;  // the most lanes one source's chunks came over
  int refetched_chunks = 0;    // fetches again (a chunk fetched twice more counts twice)
};

struct TransferHooks {
  // Called once when this worker starts its part of a transfer (fault injection).
  std::function<void()> on_start;
  // As a source, corrupt the first chunk sent after checksumming it (fault injection).
  bool corrupt_first_chunk = false;
  // As a receiver, the streams (lanes) to copy each source's chunks over: 0 picks one per
  // 32 MiB asked of the source, n > 0 asks for n; both within the transport's lanes
  // (Communicator::p2p_lanes) and the number of chunks. Benchmarks compare the two.
  int streams_per_source = 0;
  // The sealed copy (NONSTOP_SEALED_STATE_COPY, worker/copy_seal.h): the key of the data
  // connections, from which each copy's own is derived; every chunk and table this worker sends
  // carries a tag, and a receiver takes only what verifies. None: unsealed, the CRCs alone. A
  // source and a receiver that differ on it fail the copy, naming the setting.
  std::optional<crypto::Key> seal_key;
  // As a source, hand the first chunk sent to this after checksumming and sealing it, to rewrite
  // as a party on the path could (one that keeps its CRC: the seal's test).
  std::function<void(std::span<std::byte>)> tamper_first_chunk;
  // As a source, hand the CRC table it sends (encoded, after sealing) to this, to rewrite as a
  // party on the path could: the table's seal's test.
  std::function<void(std::string&)> tamper_table;
};

// Checks a plan from the controller before anything acts on it: members with
// distinct non-negative worker ids and parseable addresses, this worker among
// them, every transfer's receiver and sources members of the plan (a source
// is never its own receiver), a resume step >= 0; every shard move's receiver
// a member that receives once, the shard its rank's (rank mod shard_group),
// its sources distinct members other than itself. INVALID_ARGUMENT names what
// is wrong; a worker answers a bad plan with a Status, never an abort.
Status ValidatePlan(const control::PlanMsg& plan, int my_worker_id);

// Runs this worker's side of `plan.transfers` (a plan ValidatePlan accepted).
// `held_step`: the step this worker's state holds now (what it says in its
// header as a source). A source whose `held_step` is not plan.resume_step - 1
// serves nothing and returns FAILED_PRECONDITION once the receiver is done
// with it; a receiver copies from the sources that hold that step.
Result<TransferOutcome> RunStateTransfers(collective::Communicator& comm,
                                          state::StateRegistry& registry,
                                          const control::PlanMsg& plan, int my_worker_id,
                                          int64_t held_step, const TransferHooks& hooks);

// After RunStateTransfers, with sharded state (StateRegistry::shard_group() >
// 0): every member of the generation calls it, with `held_step` the step its
// state holds now. It carries out `plan.shard_moves` (the controller decides
// them: controller::PlanShardMoves; this never plans): each receiver copies
// the shard of its rank from the plan's sources, striped over them in the
// plan's order and checksummed, into a staging buffer while it serves the
// shard it held to others, and commits it (the views move, the bytes go in)
// once every member has staged its own (a barrier).
//
// It trusts the plan only as far as it checks it: the members all-gather
// which shard of which step each holds, and every member checks the moves
// against those claims before anything is copied: the plan's group size is
// theirs, a receiver lacks the shard of its rank and receives exactly that
// one, a source holds what it serves, and every member the plan moves
// nothing to holds its rank's shard. Every member sees the same claims and
// the same plan, so every member gets the same verdict: FAILED_PRECONDITION
// naming the inconsistency, INVALID_ARGUMENT for a member of another group
// size, DATA_LOSS naming the shard when the plan says no member holds it.
// A failure leaves the state as it was: the shard held before, still valid.
Result<TransferOutcome> ExchangeShards(collective::Communicator& comm,
                                       state::StateRegistry& registry, const control::PlanMsg& plan,
                                       int64_t held_step, const TransferHooks& hooks);

// The DATA_LOSS of ExchangeShards when the holders of a shard disagree and no
// majority (or none of the plan's sources) can be trusted, and of
// RunStateTransfers when a replicated chunk's sources disagree with no
// majority: planning again would meet the same holders, so the job stops
// (exit 11, data corruption), as for replicas that disagree (docs/integrity.md).
inline constexpr std::string_view kShardDisagreement = "the holders of shard";
inline constexpr std::string_view kReplicaDisagreement =
    "disagree and no majority can tell which is right";
bool IsDisagreement(const Status& s);

}  // namespace nonstop::worker
