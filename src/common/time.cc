#include "common/time.h"

#include <climits>

namespace nonstop {

int PollTimeoutMs(Deadline deadline) {
  if (deadline == kNoDeadline) return -1;
  auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  if (left > INT_MAX) return INT_MAX;
  // Round up so that a wait never returns just before its deadline.
  return static_cast<int>(left) + 1;
}

int64_t WallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double MonotonicSeconds() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

}  // namespace nonstop
