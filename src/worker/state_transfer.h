// Peer-to-peer state transfer (DESIGN.md §6): how a member that lacks the
// state of step s* (a spare taking a rank, a member one step behind) copies it
// from the members that hold it, over the generation's Communicator.
//
// Protocol, per (receiver, source) pair, every message a checksummed
// point-to-point transfer (docs/protocol.md):
//   source → receiver  header {magic, step, total bytes, chunk bytes, chunks}
//   receiver → source  request {count, chunk indices…}   (count 0: done)
//   source → receiver  per chunk {index, crc32c} then the chunk's bytes
// The receiver checks the header against the plan (a source that claims
// another step or another layout is refused: DATA_LOSS), stripes the chunks
// over its sources (chunk c from source c mod k, all sources at once), writes
// each chunk into the live state only after its CRC matches, and fetches a
// chunk that fails its CRC again from another source.
#pragma once

#include <cstdint>
#include <functional>

#include "collective/communicator.h"
#include "control/messages.h"
#include "nonstop/state.h"

namespace nonstop::worker {

struct TransferOutcome {
  bool received = false;  // this worker was a receiver
  bool served = false;    // this worker was a source
  uint64_t bytes_received = 0;
  int sources = 0;
  int refetched_chunks = 0;
};

struct TransferHooks {
  // Called once when this worker starts its part of a transfer (fault injection).
  std::function<void()> on_start;
  // As a source, corrupt the first chunk sent after checksumming it (fault injection).
  bool corrupt_first_chunk = false;
};

// Checks a plan from the controller before anything acts on it: members with
// distinct non-negative worker ids and parseable addresses, this worker among
// them, every transfer's receiver and sources members of the plan (a source
// is never its own receiver), a resume step >= 0. INVALID_ARGUMENT names what
// is wrong; a worker answers a bad plan with a Status, never an abort.
Status ValidatePlan(const control::PlanMsg& plan, int my_worker_id);

// Runs this worker's side of `plan.transfers` (a plan ValidatePlan accepted). The state must hold step
// plan.resume_step - 1 if this worker is a source.
Result<TransferOutcome> RunStateTransfers(collective::Communicator& comm, state::StateRegistry& registry,
                                          const control::PlanMsg& plan, int my_worker_id, const TransferHooks& hooks);

}  // namespace nonstop::worker
