// Clocks and deadlines. Every network wait in nonstop has a Deadline.
#pragma once

#include <chrono>
#include <cstdint>

namespace nonstop {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
using Millis = std::chrono::milliseconds;

inline Deadline DeadlineAfter(Clock::duration d) { return Clock::now() + d; }
inline constexpr Deadline kNoDeadline = Deadline::max();

// Milliseconds left until `deadline`, clamped to [0, INT32_MAX], for poll(2).
int PollTimeoutMs(Deadline deadline);

// Wall-clock time in microseconds since the Unix epoch, for journals.
int64_t WallMicros();

// Monotonic seconds as a double, for rates and reports.
double MonotonicSeconds();

}  // namespace nonstop
