// Replica agreement (docs/architecture.md "Invariants", docs/integrity.md).
//
// Data-parallel replicas hold the same state; that redundancy is the
// cheapest detector of silent data corruption there is. Every K steps the
// members of a generation all-gather one record each, {the step their state
// holds, the shard it holds, a CRC-32C per registered region}, and every
// member compares the same records the same way, so every member reaches the
// same verdict without a further round:
//   - a replicated region is compared across every member, a sharded one
//     across the members that hold the same shard (its replicas);
//   - in each such set of holders, the value more than half of them hold is
//     the majority; a holder with another value has diverged;
//   - where there is no majority (two holders that disagree, a tie, three
//     different values) nobody can tell which copy is right.
// The session acts on the verdict (a diverged member drops its state and
// copies it from the majority; no majority ends the job with exit 11): this
// file only decides.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "nonstop/state.h"
#include "nonstop/status.h"

namespace nonstop::worker {

struct ReplicaRecord {
  int64_t step = -1;
  int held_shard = state::kEveryShard;
  std::vector<uint32_t> region_crcs;  // one per registered region, in registration order
};

// This member's record: the CRC-32C of every region's live bytes.
ReplicaRecord RecordOf(const state::StateRegistry& reg, int64_t step);

// The fixed size of a record of `reg` (every member's registry has the same regions).
size_t ReplicaRecordBytes(const state::StateRegistry& reg);
void EncodeReplicaRecord(const ReplicaRecord& r, std::span<std::byte> out);
// DATA_LOSS when the record does not fit `reg` (another layout: a bug or
// garbage) or fails its own CRC-32C (damaged on an unchecked all-gather: then
// the members could judge different records; the generation ends instead).
Result<ReplicaRecord> DecodeReplicaRecord(std::span<const std::byte> in,
                                          const state::StateRegistry& reg);

struct ReplicaVerdict {
  std::vector<int> diverged;  // ranks whose state differs from their holders' majority
  bool no_majority = false;   // some region's holders agree on no value
  // What differs, for the log and the controller: region names, ranks, CRCs.
  std::string what;

  bool agree() const { return diverged.empty() && !no_majority; }
};

// `records[rank]`: every member's. `worker_ids[rank]` names them in `what`.
ReplicaVerdict CompareReplicas(const state::StateRegistry& reg,
                               const std::vector<ReplicaRecord>& records,
                               const std::vector<int>& worker_ids);

}  // namespace nonstop::worker
