// ScriptFailures: what the failures a job's members report say about the
// script (docs/recovery.md, "A failure that repeats").
//
// A first exception on one rank may be a flaky node: the rank is replaced. The
// same exception (SameFailure: its type and message, or its type and the line
// that raised it) raised again on
// the replacement of that rank, or at the same step by whichever rank holds
// the failing data after a shrink, is the script's: after `repeats` such
// recurrences the job ends (kExitScriptFailure). So does a step at which every
// member raised the same exception. Each report is held for a short window
// before it is acted on, so that the other members' reports of the same step
// are seen with it.
//
// RecoveryBudget is the last guard against any other loop: more recoveries
// than the budget within a sliding window end the job.
//
// What it owns: the held reports and the history of failures (bounded).
// Thread-safety: none (the Controller's thread).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/time.h"

namespace nonstop::controller {

struct FailureReport {
  int worker_id = -1;
  int rank = -1;
  int64_t step = 0;
  std::string reason;     // "ValueError: bad sample 17"
  std::string traceback;  // the script's, if it sent one
  Clock::time_point at{};
};

// The same failure: the same reason (the exception's type and message), or
// the same type raised at the same line of the script (the traceback's last
// frame, when it is not a library's).
bool SameFailure(const FailureReport& a, const FailureReport& b);

class ScriptFailures {
 public:
  // A member of `members` (the generation's, by worker id) reported a
  // failure: held until `at + window`.
  void Hold(FailureReport report, const std::vector<int>& members, Millis window);
  bool Holding(int worker_id) const;
  // True when every member of the held batch's generation holds a report of
  // the same failure at the same step: the script's bug on every rank.
  bool EveryMemberRaised() const;
  // The held reports whose window has passed, oldest first; they leave the hold.
  std::vector<FailureReport> Due(Clock::time_point now);
  // Records a report that is acted on; returns how many earlier ones within
  // `memory` it repeats (the same failure on the same rank, or at the same
  // step). An injected exception (nonstop run --inject) repeats nothing.
  int Record(const FailureReport& report, Millis memory);
  const std::deque<FailureReport>& held() const { return held_; }
  // The first of the held batch (for the message of EveryMemberRaised).
  const FailureReport& first_held() const { return held_.front(); }

 private:
  std::deque<FailureReport> held_;
  std::set<int> batch_members_;        // the generation's members when the batch began
  std::deque<FailureReport> history_;  // acted on, the last 256
};

// The message a job that ends for a script failure prints (once), with the traceback.
std::string ScriptFailureMessage(const FailureReport& report, const std::string& why);

class RecoveryBudget {
 public:
  // A recovery started at `at`; true when that makes more than `budget`
  // within `window` (the job should end).
  bool Spend(Clock::time_point at, int budget, Millis window);

 private:
  std::deque<Clock::time_point> starts_;
};

}  // namespace nonstop::controller
