// The checksum nonstop-test-worker ends on, computed here on its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "nonstop/crc32c.h"

namespace nonstop::testing {

// After `steps` steps of `elements` (test_worker.cc's top comment): the same at any world size
// and after any recovery.
inline std::string TestWorkerChecksum(int64_t steps, size_t elements) {
  std::vector<float> acc(elements, 0.0f);
  for (int64_t s = 0; s < steps; ++s) {
    for (size_t i = 0; i < elements; ++i) {
      float sum = 0;
      for (uint64_t item = 0; item < 12; ++item)
        sum += static_cast<float>((static_cast<uint64_t>(s) * 31 + item * 7 + i) % 7);
      acc[i] += sum;
    }
  }
  return fmt::format("{:08x}", Crc32c(acc.data(), acc.size() * sizeof(float)));
}

}  // namespace nonstop::testing
