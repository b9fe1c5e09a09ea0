// Injected faults (`nonstop run --inject`, docs/faults.md) on a worker: the list of the plan it
// adopted, each fault taken as it comes due and carried out on this process. A user feature, so
// it is compiled into every build.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collective/data_plane.h"
#include "common/mutex.h"
#include "control/fault_spec.h"
#include "nonstop/state.h"
#include "nonstop/status.h"

namespace nonstop::worker {

class FaultInjector {
 public:
  // How a fault reaches the rest of the worker.
  struct Env {
    // Sends a control message: the announcement of a fault as it fires.
    std::function<void(uint16_t type, const std::string& payload)> send;
    // Reports a fault this worker cannot carry out (the job ends with exit 2, naming `reason`).
    std::function<void(const std::string& reason)> refuse;
    // The generation's communicator (drop, wireflip); called on the training thread.
    std::function<collective::Communicator*()> comm;
    state::StateRegistry* state = nullptr;  // bitflip
  };

  explicit FaultInjector(Env env) : env_(std::move(env)) {}
  ~FaultInjector() { StopTimers(); }
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // The list of a plan just adopted (the faults the controller has not heard fire).
  void SetFaults(std::vector<control::FaultSpec> faults) NONSTOP_LOCKS_EXCLUDED(mu_);
  // A timed fault armed and not fired never fires (a generation ends, the session stops).
  // Training thread, like ScheduleTimed.
  void StopTimers() { timers_.clear(); }

  // Takes the fault of `kind` at `point` due at `step` for `rank` off the list, if there is one.
  // `timed_only`: only one due part-way into the step (FaultSpec::at).
  std::optional<control::FaultSpec> Take(control::FaultPoint point, int64_t step, int rank,
                                         control::FaultKind kind, bool timed_only = false)
      NONSTOP_LOCKS_EXCLUDED(mu_);
  // Tells the controller `f` fires (before it is carried out: a kill may leave no time after).
  void Announce(const control::FaultSpec& f);
  // Announces and carries out `f` on this process (a kill or hang does not return), or refuses
  // it when this worker cannot (a bitflip with no region to flip, a drop in a world of 1).
  void Fire(const control::FaultSpec& f);

  // Step `step` begins, the one before it took `last_step_seconds`: a kill or hang due part-way
  // into it fires from a timer thread that far in, wherever the training thread is then
  // (forward, backward, the reduction); one due as the step starts fires now, on this thread.
  void ScheduleTimed(int64_t step, int rank, double last_step_seconds);
  // The step's first collective is about to begin: the faults due just before it fire.
  void BeforeCollective(int64_t step, int rank);

 private:
  // The region a bitflip changes, or why there is none.
  Result<size_t> FlipRegion(const control::FaultSpec& f) const;
  void FlipABit(size_t index);
  Status CanInject(const control::FaultSpec& f) const;

  const Env env_;
  Mutex mu_;
  std::vector<control::FaultSpec> faults_ NONSTOP_GUARDED_BY(mu_);
  // Timed faults armed, one thread each. Training thread only.
  struct Timer {
    std::shared_ptr<std::atomic<bool>> fired;  // done: its thread may be joined at no cost
    std::jthread thread;
  };
  std::vector<Timer> timers_;
};

}  // namespace nonstop::worker
