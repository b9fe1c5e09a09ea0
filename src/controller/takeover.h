// Takeover from the journal: what a controller that replaces a stopped one
// (`nonstop controller --resume JOURNAL`, or a standby through etcd) learns of
// the running job from the records its predecessor left
// (docs/controller-failover.md).
//
// The replay is a fold: each record changes a small state (the TakeoverState
// being built, and what the fold remembers besides: live workers and hosts, a
// shrink asked for). That state is serializable: CompactJournal writes it as
// one "snapshot" record, and a replay that meets a snapshot record loads it
// as its whole state. So [snapshot of records 1..n] + records n+1.. replays to
// the same takeover as records 1.. do: etcd keeps a snapshot and a bounded
// tail (src/coord/leadership.h), not the job's every record.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "controller/controller.h"
#include "nonstop/status.h"

namespace nonstop::controller {

struct JournalTakeover {
  TakeoverState state;
  std::string controller;  // the address the workers and agents dial (the job_start record's)
};

// Replays the journal's records. An error names why there is nothing to take
// over: no job_start, a job that already ended, no generation formed.
Result<JournalTakeover> TakeoverFromJournal(const std::vector<nlohmann::json>& records);

// One "snapshot" record that stands for `records` (which may begin with an
// earlier snapshot): a replay of it followed by later records equals the
// replay of `records` followed by them. An error if a record is malformed or
// the job ended (the job_end record stays a record of its own: readers look
// for it).
Result<nlohmann::json> CompactJournal(const std::vector<nlohmann::json>& records);

// Whether TakeoverFromJournal reads records of this record's event: those it
// ignores (ready, recovered, …) need not be kept for a takeover (etcd does
// not mirror them).
bool TakeoverReads(const nlohmann::json& record);

}  // namespace nonstop::controller
