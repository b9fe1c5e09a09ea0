// Membership: who is in the job, and in which role (docs/controller.md).
//
// What it decides: nothing; it keeps the books the Controller decides over,
// with their invariants in one place:
//   - the workers by id (WorkerInfo; an entry is never erased, so pointers
//     to it stay valid), and their roles: every change of a role goes through
//     SetRole, which keeps the pending workers and the spare count, so that
//     neither needs a scan of every worker;
//   - the members of the current generation by rank, with a pointer to each
//     one's entry (the loops over every member look nothing up);
//   - the step each worker's state held when it joined;
//   - workers started and not joined yet (with their join deadline's start),
//     and those killed at their join deadline (their join and exit are moot);
//   - after a takeover, the inherited workers that have not joined this
//     controller yet;
//   - the worker ids: a new one is never one used before.
// What it owns: the above; no clock (time is given), no socket, no action.
// Thread-safety: none; the Controller's thread drives it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "common/time.h"
#include "controller/core_types.h"

namespace nonstop::controller {

class Membership {
 public:
  // Every worker that joined (or was inherited), by id.
  const std::map<int, WorkerInfo>& workers() const { return workers_; }
  // Its entry, created (role kPending, counted nowhere) if there is none:
  // callers name workers they know.
  WorkerInfo& at(int worker_id) { return workers_[worker_id]; }
  WorkerInfo* Find(int worker_id);
  const WorkerInfo* Find(int worker_id) const;
  bool Has(int worker_id) const { return workers_.count(worker_id) > 0; }
  // Iteration that may change entries (roles only through SetRole).
  std::map<int, WorkerInfo>& mutable_workers() { return workers_; }

  void SetRole(WorkerInfo& w, WorkerRole role);
  const std::set<int>& pending() const { return pending_; }  // role kPending, ascending ids
  int spare_count() const { return spare_count_; }           // role kSpare

  // The members of the current generation: worker ids, index = rank.
  const std::vector<int>& members() const { return members_; }
  // &workers()[members()[r]], index = rank.
  const std::vector<WorkerInfo*>& member_info() const { return member_info_; }
  // Sets the members (and their entries: `info`, when the caller has them).
  void SetMembers(std::vector<int> ids, std::vector<WorkerInfo*> info = {});
  // The rank a worker holds now, or -1 (spare, gone, not yet placed).
  int RankOf(int worker_id) const;

  // The step each worker's state held when it joined.
  int64_t& joined_step(int worker_id) { return joined_step_[worker_id]; }

  // Started, not joined yet.
  std::map<int, AwaitedJoin>& awaiting() { return awaiting_join_; }
  const std::map<int, AwaitedJoin>& awaiting() const { return awaiting_join_; }
  // Killed at its join deadline (or let go before it joined): its join and exit are moot.
  std::set<int>& killed_before_join() { return killed_before_join_; }
  bool KilledBeforeJoin(int worker_id) const { return killed_before_join_.count(worker_id) > 0; }

  // A takeover: inherited workers that have not joined this controller yet.
  std::set<int>& unconfirmed() { return unconfirmed_; }
  const std::set<int>& unconfirmed() const { return unconfirmed_; }
  bool Unconfirmed(int worker_id) const { return unconfirmed_.count(worker_id) > 0; }
  // Inherited workers that may still join: membership changes wait for them.
  bool AdoptionPending() const;

  // Worker ids: the next new one, and ids seen elsewhere that a new one must not reuse.
  int NewWorkerId() { return next_worker_id_++; }
  void UseIdsBelow(int bound) { next_worker_id_ = std::max(next_worker_id_, bound); }
  int next_worker_id() const { return next_worker_id_; }

 private:
  std::map<int, WorkerInfo> workers_;
  std::set<int> pending_;
  int spare_count_ = 0;
  std::vector<int> members_;
  std::vector<WorkerInfo*> member_info_;
  std::map<int, int64_t> joined_step_;
  std::map<int, AwaitedJoin> awaiting_join_;
  std::set<int> killed_before_join_;
  std::set<int> unconfirmed_;
  int next_worker_id_ = 0;
};

// "rank 2 (worker 2, pid 1002 on host h1)", or "spare worker 5 (pid 1005)".
// The host is left out when it is `unnamed_host` (the one elastic host: this machine).
std::string Describe(const WorkerInfo& w, std::string_view unnamed_host);

}  // namespace nonstop::controller
