// Report: the records of the job as the journal, /status and the end-of-job
// report show them (docs/controller.md, docs/journal.md).
//
// What it decides: nothing; it renders. A recovery's record as JSON (its
// phases in ms after the fault, its downtime or a resize's pause), the
// recovery report printed when the job ends, the /status document, and the
// journal records written in more than one place.
// What it owns: nothing. Pure functions of their arguments.
// Thread-safety: none needed (pure functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/time.h"
#include "controller/core_types.h"
#include "controller/detectors.h"

namespace nonstop::controller {

// A recovery's record (the journal's "recovery_end").
nlohmann::json RecordJson(const RecoveryRecord& r);

// The recovery report's lines (none when there was no recovery or resize).
std::vector<std::string> ReportLines(const std::vector<RecoveryRecord>& recoveries);

// Journal records written in more than one place.
// A spare that went (every one is journaled: the spare counts drawn from the
// journal — dashboard, report — stay right).
nlohmann::json SpareLostRecord(const WorkerInfo& w, const std::string& kind,
                               const std::string& detail);
nlohmann::json JoinRefusedRecord(int worker_id, const std::string& why);

// What /status shows, by reference.
struct StatusView {
  JobPhase phase = JobPhase::kForming;
  uint32_t generation = 0;
  const std::vector<int>* members = nullptr;  // by rank
  int target_world = 0;
  int spares = 0;
  int64_t highest_step = -1;
  const std::map<int, WorkerInfo>* workers = nullptr;
  const std::vector<HostInfo*>* hosts = nullptr;  // in registration order
  size_t recoveries = 0;
  nlohmann::json policy;
  const std::optional<Lag>* waiting = nullptr;  // the member the others wait for
};
nlohmann::json StatusJson(const StatusView& view, Clock::time_point now);

}  // namespace nonstop::controller
