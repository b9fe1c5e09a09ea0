// nonstop::Session: one worker's membership in an elastic data-parallel job.
//
// A training program joins with one call, learns its rank and world size,
// and then calls the Session once per step: reduce gradients, report the
// step. The Session owns the connection to the controller (with heartbeats on
// an internal I/O thread), the data-plane connections to peers and the
// collectives of the current generation.
//
//   auto session = nonstop::Session::Join(nonstop::SessionOptions::FromEnvironment().value());
//   for (int64_t step = session->resume_step(); step < steps; ++step) {
//     ... forward/backward on my micro-batches of `step` ...
//     NONSTOP_RETURN_IF_ERROR(session->AllReduce(grads));
//     ... optimizer ...
//     session->ReportStep({step, loss, seconds, tokens_per_second});
//   }
//   session->Finish(steps - 1, checksum);
//
// A spare (SessionOptions::spare) joins without a rank: Join() blocks until
// the controller gives it one, or returns CANCELLED if the job ends first.
//
// Thread-safety: a Session is driven by one training thread. No user callback
// ever runs on the internal I/O thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "nonstop/state.h"
#include "nonstop/status.h"

namespace nonstop {

struct SessionOptions {
  std::string controller_address;  // "host:port"; required (NONSTOP_CONTROLLER)
  std::string job_token;           // required (NONSTOP_JOB_TOKEN)
  int worker_id = -1;              // required, unique in the job (NONSTOP_WORKER_ID)
  bool spare = false;              // join without a rank (NONSTOP_SPARE=1)
  std::string data_host = "127.0.0.1";  // where peers reach this worker
  std::chrono::milliseconds join_timeout{600'000};
  // Interval of heartbeats to the controller; the controller's heartbeat
  // timeout should be several of these.
  std::chrono::milliseconds heartbeat_interval{200};
  // Bound on one collective. Faults are detected far sooner (connection
  // resets, the controller); this only guards against a silent network.
  std::chrono::milliseconds timeout_collective{300'000};

  // Reads the NONSTOP_* variables that `nonstop run` sets for each worker.
  static Result<SessionOptions> FromEnvironment();
};

struct StepReport {
  int64_t step = 0;
  double loss = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;
};

class SessionImpl;

class Session {
 public:
  static Result<std::unique_ptr<Session>> Join(SessionOptions options);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  int rank() const;
  int world_size() const;
  uint32_t generation() const;
  int64_t resume_step() const;  // the first step this generation runs
  int worker_id() const;

  // What must survive a fault; register before the first step.
  state::StateRegistry& state();

  // Sums `data` ([n] fp32) across the members, in place. Bitwise identical on
  // every rank and run to run at a fixed world size.
  Status AllReduce(std::span<float> data);
  Status Broadcast(std::span<std::byte> data, int root);
  Status Barrier();

  // Tells the controller that `report.step` completed. Cheap; never blocks on a peer.
  void ReportStep(const StepReport& report);
  // Tells the controller that training ended after `last_step` with these
  // final parameters, and waits until the controller ends the job.
  Status Finish(int64_t last_step, const std::string& checksum);
  // Tells the controller this worker hit a fault it cannot handle itself.
  void ReportFailure(const Status& status, int64_t step, int exit_code);

  // The exit code the controller asked for when it ended the job (0 if none yet).
  int shutdown_exit_code() const;

 private:
  explicit Session(std::unique_ptr<SessionImpl> impl);
  std::unique_ptr<SessionImpl> impl_;
};

}  // namespace nonstop
