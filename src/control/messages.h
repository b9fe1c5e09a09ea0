// Controller ↔ worker messages (docs/protocol.md). Each is one control frame
// whose payload is a JSON object; the frame type says which message it is.
// Decoding never trusts the peer: a missing or ill-typed field is an
// INVALID_ARGUMENT that names the field, never an exception or a crash.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace nonstop::control {

enum MessageType : uint16_t {
  kMsgJoin = 10,       // worker → controller: who I am
  kMsgPlan = 11,       // controller → worker: generation, members, resume step
  kMsgHeartbeat = 12,  // worker → controller: alive, last completed step
  kMsgProgress = 13,   // worker → controller: a step completed, with metrics
  kMsgFinished = 14,   // worker → controller: training done, final checksum
  kMsgFailure = 15,    // worker → controller: I saw a fault
  kMsgShutdown = 16,   // controller → worker: the job is over, exit
};
static_assert(kMsgJoin == 10 && kMsgShutdown == 16, "wire numbers are pinned");

struct JoinMsg {
  int worker_id = -1;
  int64_t pid = 0;
  std::string data_address;
  bool spare = false;
};

struct PlanMember {
  int worker_id = -1;
  std::string address;
};

struct PlanMsg {
  uint32_t generation = 0;
  std::vector<PlanMember> members;  // index = rank
  int64_t resume_step = 0;          // the first step to run
};

struct HeartbeatMsg {
  int64_t step = -1;  // last completed step, -1 before the first
};

struct ProgressMsg {
  int64_t step = 0;
  double loss = 0;
  double step_seconds = 0;
  double tokens_per_second = 0;
  int world_size = 0;
};

struct FinishedMsg {
  int64_t step = 0;
  std::string checksum;
};

struct FailureMsg {
  uint32_t generation = 0;
  int64_t step = 0;
  std::string reason;
  int exit_code = 10;
};

struct ShutdownMsg {
  std::string reason;
  int exit_code = 0;
};

std::string Encode(const JoinMsg& m);
std::string Encode(const PlanMsg& m);
std::string Encode(const HeartbeatMsg& m);
std::string Encode(const ProgressMsg& m);
std::string Encode(const FinishedMsg& m);
std::string Encode(const FailureMsg& m);
std::string Encode(const ShutdownMsg& m);

Result<JoinMsg> DecodeJoin(std::string_view payload);
Result<PlanMsg> DecodePlan(std::string_view payload);
Result<HeartbeatMsg> DecodeHeartbeat(std::string_view payload);
Result<ProgressMsg> DecodeProgress(std::string_view payload);
Result<FinishedMsg> DecodeFinished(std::string_view payload);
Result<FailureMsg> DecodeFailure(std::string_view payload);
Result<ShutdownMsg> DecodeShutdown(std::string_view payload);

}  // namespace nonstop::control
