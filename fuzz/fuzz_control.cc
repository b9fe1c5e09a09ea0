// Fuzz target: every controller <-> worker message decoder of
// src/control/messages.h, and the fault specs that plans carry
// (src/control/fault_spec.h).
//
// Input: byte 0 picks the decoder (modulo 16: the 13 messages, then
// ParseFaults, then the compact plan of type 23 against no base and against
// a base plan); the rest is the payload. Checked: no crash, leak, UB or
// uncaught exception; a refusal is INVALID_ARGUMENT with a message; an
// accepted message survives Encode -> Decode -> Encode unchanged (what one
// side accepts, the other side can send back; a compact plan: re-encoded
// against the same base, it rebuilds the same plan).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/check.h"
#include "control/fault_spec.h"
#include "control/messages.h"

namespace {

using namespace nonstop::control;  // NOLINT: the message types and their decoders

template <typename Msg>
void RoundTrip(nonstop::Result<Msg> (*decode)(std::string_view), std::string_view payload) {
  auto first = decode(payload);
  if (!first.ok()) {
    NONSTOP_CHECK(first.status().code() == nonstop::StatusCode::kInvalidArgument)
        << first.status().ToString();
    NONSTOP_CHECK(!first.status().message().empty());
    return;
  }
  const std::string encoded = Encode(*first);
  auto second = decode(encoded);
  NONSTOP_CHECK(second.ok()) << "an accepted message does not decode once re-encoded: "
                             << second.status().ToString() << "\n  re-encoded: " << encoded;
  NONSTOP_CHECK_EQ(Encode(*second), encoded);
}

void FaultsRoundTrip(std::string_view text) {
  auto faults = ParseFaults(text, /*first_id=*/7);
  if (!faults.ok()) {
    NONSTOP_CHECK(faults.status().code() == nonstop::StatusCode::kInvalidArgument)
        << faults.status().ToString();
    NONSTOP_CHECK(!faults.status().message().empty());
    return;
  }
  for (const FaultSpec& f : *faults) {
    const std::string formatted = FormatFault(f);
    auto again = ParseFaults(formatted, f.id);
    NONSTOP_CHECK(again.ok()) << "FormatFault gives a spec ParseFaults refuses: '" << formatted
                              << "': " << again.status().ToString();
    NONSTOP_CHECK_EQ(again->size(), 1u) << formatted;
    NONSTOP_CHECK_EQ(FormatFault((*again)[0]), formatted);
  }
}

// A compact plan (kMsgPlanDelta) decoded against `base` (nullptr: none); an accepted one, written
// again against the same base, rebuilds the same plan, and holds no more members than the base
// has plus one per byte of payload (what ReadMemberRuns bounds).
void PlanDeltaRoundTrip(std::string_view payload, const PlanMsg* base) {
  auto first = DecodePlanDelta(payload, base);
  if (!first.ok()) {
    NONSTOP_CHECK(first.status().code() == nonstop::StatusCode::kInvalidArgument)
        << first.status().ToString();
    NONSTOP_CHECK(!first.status().message().empty());
    return;
  }
  NONSTOP_CHECK_LE(first->members.size(), (base ? base->members.size() : 0) + payload.size());
  const std::string full = Encode(*first);
  const std::string encoded = EncodePlanDelta(*first, DiffMembers(*first, base), first->transfers);
  auto second = DecodePlanDelta(encoded, base);
  NONSTOP_CHECK(second.ok()) << "an accepted plan delta does not decode once re-encoded: "
                             << second.status().ToString() << "\n  re-encoded: " << encoded;
  NONSTOP_CHECK_EQ(Encode(*second), full);
}

// The plan a worker holds for the deltas written against one (generation 2, four members).
const PlanMsg& HeldPlan() {
  static const PlanMsg* held = [] {
    auto* p = new PlanMsg;
    p->generation = 2;
    p->members = {{0, "127.0.0.1:1"}, {4, "127.0.0.1:2"}, {5, "127.0.0.1:3"}, {7, "127.0.0.1:4"}};
    p->reason = "start";
    return p;
  }();
  return *held;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view payload(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 16) {
    case 0:
      RoundTrip(&DecodeJoin, payload);
      break;
    case 1:
      RoundTrip(&DecodePlan, payload);
      break;
    case 2:
      RoundTrip(&DecodeHeartbeat, payload);
      break;
    case 3:
      RoundTrip(&DecodeProgress, payload);
      break;
    case 4:
      RoundTrip(&DecodeFinished, payload);
      break;
    case 5:
      RoundTrip(&DecodeFailure, payload);
      break;
    case 6:
      RoundTrip(&DecodeShutdown, payload);
      break;
    case 7:
      RoundTrip(&DecodeAbort, payload);
      break;
    case 8:
      RoundTrip(&DecodeDrain, payload);
      break;
    case 9:
      RoundTrip(&DecodeReady, payload);
      break;
    case 10:
      RoundTrip(&DecodeRecovered, payload);
      break;
    case 11:
      RoundTrip(&DecodeInjected, payload);
      break;
    case 12:
      RoundTrip(&DecodeAgentLeaving, payload);
      break;
    case 13:
      RoundTrip(&DecodeAgentDying, payload);
      break;
    case 14:
      PlanDeltaRoundTrip(payload, nullptr);
      break;
    case 15:
      PlanDeltaRoundTrip(payload, &HeldPlan());
      break;
    default:
      FaultsRoundTrip(payload);
      break;
  }
  return 0;
}
