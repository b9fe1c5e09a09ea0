// Takeover from the journal: what a controller that replaces a stopped one
// (`nonstop controller --resume JOURNAL`) learns of the running job from the
// records its predecessor left (docs/controller-failover.md).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "controller/controller.h"

namespace nonstop::controller {

struct JournalTakeover {
  TakeoverState state;
  std::string controller;  // the address the workers and agents dial (the job_start record's)
};

// Replays the journal's records. An error names why there is nothing to take
// over: no job_start, a job that already ended, no generation formed.
Result<JournalTakeover> TakeoverFromJournal(const std::vector<nlohmann::json>& records);

}  // namespace nonstop::controller
