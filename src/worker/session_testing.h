// Test-only seams of the Session (src/worker/session_test.cc). Not part of
// the public API; never set outside tests.
#pragma once

#include <cstdint>
#include <functional>

namespace nonstop::testing {

// Runs on the training thread inside every collective, after the drain check
// and before the operation starts.
extern std::function<void()> before_collective_hook;
// Runs on the Session's I/O thread after each control frame was handled.
extern std::function<void(uint16_t type)> control_frame_hook;
// Runs on the Session's I/O thread just before it decodes a plan frame (kMsgPlan or
// kMsgPlanDelta), where it holds none of the Session's locks.
extern std::function<void()> before_plan_decode_hook;

}  // namespace nonstop::testing
