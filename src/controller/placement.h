// Placement: the job's hosts and where its processes run (docs/controller.md,
// docs/multihost.md).
//
// What it decides: which host each new worker and spare goes to — at the
// placement (every live host's nproc workers and spares, as slots allow), when
// slots are topped up with spares (every free slot of every live host that
// has joined this controller and whose spares do not keep dying), and where
// the replacement of a worker lost while the job forms goes (the first live
// host, in registration order, with a free slot); whether a host is
// responsive enough for its spares to be promoted; which shards a generation
// would hold on one host only.
// What it owns: the hosts in registration order (HostInfo; never erased),
// how many are alive, whether the job is placed, the slots a shrink gave back
// (withheld, per host), the spares that died while starting in a row (per
// host, and for the elastic host's pool), the host of every process started
// on one, the live processes (started, exit not seen: each holds a slot) and
// their count per host; and the capacity mode: hosts of fixed slots, or one
// elastic host whose spare pool is kept at a size.
// Thread-safety: none; the Controller's thread drives it.
#pragma once

#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/time.h"
#include "controller/core_types.h"

namespace nonstop::controller {

class Placement {
 public:
  // Capacity is the hosts' fixed slots (nproc + spares each). Not so for a job
  // whose one host is elastic: the workers and spares the job needs start
  // there, and its spare pool is kept at a size.
  bool slotted() const { return elastic_host_.empty(); }
  // The job's one elastic host ("" : none), and the size of its spare pool, kept full.
  const std::string& elastic_host() const { return elastic_host_; }
  int pool_size() const { return pool_size_; }
  void SetElasticHost(const std::string& host_id, int spares) {
    elastic_host_ = host_id;
    pool_size_ = spares;
  }

  // ---- hosts
  const std::map<std::string, HostInfo>& hosts() const { return hosts_; }
  HostInfo* FindHost(const std::string& host_id);
  const HostInfo* FindHost(const std::string& host_id) const;
  // A host named by the planner or the books (it exists).
  HostInfo& host(const std::string& host_id) { return hosts_[host_id]; }
  // A host not seen before, in registration order (placement follows it).
  HostInfo& AddHost(const std::string& host_id);
  const std::vector<std::string>& host_order() const { return host_order_; }
  const std::vector<HostInfo*>& host_list() const { return host_list_; }  // in registration order
  void MarkAlive(HostInfo& h) {
    h.alive = true;
    ++alive_hosts_;
  }
  void MarkDown(HostInfo& h) {
    h.alive = false;
    --alive_hosts_;
  }
  int alive_hosts() const { return alive_hosts_; }
  bool placed() const { return placed_; }
  void SetPlaced() { placed_ = true; }
  // Heard from lately (half the heartbeat timeout), joined, not leaving: its
  // spares may be promoted. "" (joined by hand) always is.
  bool HostResponsive(const std::string& host_id, Clock::time_point now,
                      Millis heartbeat_timeout) const;

  // ---- slots
  int FreeSlots(const HostInfo& h) const;
  // Slots given back by a shrink on request, not refilled until a grow.
  void Withhold(const std::string& host_id) { ++withheld_[host_id]; }
  void ReleaseWithheld(const std::string& host_id) { withheld_.erase(host_id); }
  void ClearWithheld() { withheld_.clear(); }
  void SetWithheld(std::map<std::string, int> withheld) { withheld_ = std::move(withheld); }
  // Spares that died while starting, in a row: on a host (its slots are not
  // refilled after 3 until it registers again), and for the elastic host's pool.
  int HostRefillFailed(const std::string& host_id) { return ++host_refill_failures_[host_id]; }
  void HostRefillsResume(const std::string& host_id) { host_refill_failures_.erase(host_id); }
  int PoolRefillFailed() { return ++refill_failures_; }
  void PoolRefillJoined() { refill_failures_ = 0; }
  int pool_refill_failures() const { return refill_failures_; }
  // Spares that joined and then reported a failure while they waited (a device that failed its
  // health check), on a host (the elastic one's: its pool): counted until the host registers
  // again, joins or not. A 4th is not replaced (TopUpTargets skips the host; the pool is not
  // refilled): a flaky GPU that passes the join's check and fails later would otherwise start a
  // spare every few seconds for ever.
  int SpareFailedWhileWaiting(const std::string& host_id) { return ++spare_failures_[host_id]; }
  void HostRegistered(const std::string& host_id) { spare_failures_.erase(host_id); }

  // ---- processes
  // A process started on `host_id`: it holds a slot of its host until its exit is seen.
  void Started(int worker_id, const std::string& host_id);
  void SetHostOf(int worker_id, const std::string& host_id) { host_of_[worker_id] = host_id; }
  void MarkLive(int worker_id);
  void MarkEnded(int worker_id);
  bool IsLive(int worker_id) const { return live_processes_.count(worker_id) > 0; }
  // The host a worker was started on ("" : unknown, or joined by hand).
  std::string HostOf(int worker_id) const;
  bool StartedOnHost(int worker_id) const { return host_of_.count(worker_id) > 0; }
  // every worker started on a host
  const std::map<int, std::string>& host_of() const { return host_of_; }

  // ---- decisions
  // The world the live hosts that stay bring (the sum of their nproc).
  int PlacedWorld() const;
  struct Slot {
    std::string host_id;
    bool spare = false;
  };
  // The placement: on every live host, its nproc workers then its spares, as
  // far as its free slots go; in registration order.
  std::vector<Slot> PlaceAll() const;
  // A spare for every free slot of every live host that has joined this
  // controller and whose spares do not keep dying, in registration order.
  std::vector<std::string> TopUpTargets() const;
  // Where a worker lost while the job forms is replaced: the first live host with a free slot, or
  // none.
  const HostInfo* FirstHostWithFreeSlot() const;

 private:
  int pool_size_ = 0;
  std::string elastic_host_;
  std::map<std::string, HostInfo> hosts_;
  int alive_hosts_ = 0;                  // hosts_ with alive set
  std::vector<std::string> host_order_;  // registration order (placement follows it)
  std::vector<HostInfo*> host_list_;     // &hosts_[host_order_[i]] (hosts_ never erases)
  bool placed_ = false;
  std::map<std::string, int> withheld_;
  std::map<std::string, int> host_refill_failures_;
  int refill_failures_ = 0;
  std::map<std::string, int> spare_failures_;
  std::map<int, std::string> host_of_;
  std::set<int> live_processes_;
  // host → how many of live_processes_ run there
  std::unordered_map<std::string, int> live_on_host_;
};

// Sharded state over hosts: the shards every copy of which a generation of
// `members` (index = rank) holds on one host, whose loss would lose them
// (empty: nothing sharded, a world that is not whole groups, or one host).
std::vector<int> ExposedShards(const std::vector<WorkerInfo*>& members, int shard_group);

}  // namespace nonstop::controller
