// Controller: the job's brain, as a pure state machine (DESIGN.md §9).
//
// Handle(event, now) → actions. It owns no socket, clock or process: the
// runtime around it (run_loop.cc) turns socket traffic, process exits and
// timer ticks into Events, and carries out the Actions it returns (send a
// plan, kill a worker, append to the journal, end the job). That makes every
// membership decision testable without threads (controller_test.cc).
//
// Generations: a generation is one membership (who is in, in which rank
// order, from which step). Generation 1 forms when `world_size` non-spare
// workers have joined; ranks follow worker ids. Spares join and wait.
//
// Faults (this version): a member that dies, disconnects, stops sending
// heartbeats or reports a failure ends the job with exit code 10 and a reason
// that names the rank, the worker, its pid and the last step it completed.
//
// Thread-safety: none; one thread drives it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/time.h"
#include "control/messages.h"

namespace nonstop::controller {

// Exit codes of `nonstop run`, meaningful to a supervisor (docs/cli.md).
inline constexpr int kExitOk = 0;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitPeerFailure = 10;  // a worker failed; restartable
inline constexpr int kExitDataCorruption = 11;

struct ControllerOptions {
  int world_size = 1;
  int spares = 0;
  Millis heartbeat_timeout{5'000};
  // A lost control connection usually means the process died; its exit
  // (seen by the launcher at about the same moment) names the cause more
  // precisely, so the fault waits this long for it before being declared.
  Millis connection_loss_grace{100};
};

// ---- events ----
struct WorkerJoined { control::JoinMsg msg; };
struct HeartbeatReceived { int worker_id; control::HeartbeatMsg msg; };
struct ProgressReceived { int worker_id; control::ProgressMsg msg; };
struct FinishedReceived { int worker_id; control::FinishedMsg msg; };
struct FailureReported { int worker_id; control::FailureMsg msg; };
struct ConnectionLost { int worker_id; std::string reason; };
struct ProcessExited { int worker_id; int64_t pid; int exit_code; int signal; };  // signal 0: exited normally
struct Tick {};
using Event = std::variant<WorkerJoined, HeartbeatReceived, ProgressReceived, FinishedReceived, FailureReported,
                           ConnectionLost, ProcessExited, Tick>;

// ---- actions ----
struct SendPlan { int worker_id; control::PlanMsg plan; };
struct SendShutdown { int worker_id; control::ShutdownMsg msg; };
struct KillWorker { int worker_id; };
struct AppendJournal { nlohmann::json record; };
struct PrintLine { std::string line; };
struct EndJob { int exit_code; std::string reason; };
using Action = std::variant<SendPlan, SendShutdown, KillWorker, AppendJournal, PrintLine, EndJob>;

enum class JobPhase { kForming, kRunning, kEnded };
enum class WorkerRole { kPending, kMember, kSpare, kFinished, kGone };

struct WorkerInfo {
  int worker_id = -1;
  int64_t pid = 0;
  std::string address;
  WorkerRole role = WorkerRole::kPending;
  int rank = -1;
  int64_t last_step = -1;
  Clock::time_point last_heard{};
  std::optional<Clock::time_point> connection_lost_at;
  std::string connection_lost_reason;
};

class Controller {
 public:
  explicit Controller(ControllerOptions options) : options_(options) {}

  std::vector<Action> Handle(const Event& event, Clock::time_point now);

  JobPhase phase() const { return phase_; }
  uint32_t generation() const { return generation_; }
  const std::map<int, WorkerInfo>& workers() const { return workers_; }
  // A snapshot for /status and `nonstop status`.
  nlohmann::json Status() const;
  // The rank a worker holds now, or -1 (spare, gone, not yet placed).
  int RankOf(int worker_id) const;

 private:
  void On(const WorkerJoined& e, Clock::time_point now, std::vector<Action>* out);
  void On(const HeartbeatReceived& e, Clock::time_point now, std::vector<Action>* out);
  void On(const ProgressReceived& e, Clock::time_point now, std::vector<Action>* out);
  void On(const FinishedReceived& e, Clock::time_point now, std::vector<Action>* out);
  void On(const FailureReported& e, Clock::time_point now, std::vector<Action>* out);
  void On(const ConnectionLost& e, Clock::time_point now, std::vector<Action>* out);
  void On(const ProcessExited& e, Clock::time_point now, std::vector<Action>* out);
  void On(const Tick& e, Clock::time_point now, std::vector<Action>* out);

  void MaybeFormFirstGeneration(std::vector<Action>* out);
  // A member is lost: end the job (in-process recovery comes in a later version).
  void MemberFault(const WorkerInfo& w, const std::string& kind, const std::string& detail, int exit_code,
                   std::vector<Action>* out);
  void End(int exit_code, const std::string& reason, std::vector<Action>* out);
  std::string Describe(const WorkerInfo& w) const;

  const ControllerOptions options_;
  JobPhase phase_ = JobPhase::kForming;
  uint32_t generation_ = 0;
  std::vector<int> members_;  // worker ids, index = rank
  std::map<int, WorkerInfo> workers_;
  int64_t completed_step_ = -1;  // highest step every member has completed
  int finished_ = 0;
  std::optional<std::string> checksum_;
};

}  // namespace nonstop::controller
