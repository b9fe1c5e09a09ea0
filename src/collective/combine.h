// The element-wise step of a reduction (nonstop/reduce.h): dst[i] = dst[i] op
// src[i] over `bytes` bytes of whole elements, in index order. The ring's
// reducing receives apply one (transfer.h), so any type and operation of
// reduce.h travels the same pipelined ring as float32 sums.
#pragma once

#include <cstddef>

#include "nonstop/reduce.h"

namespace nonstop::collective {

using Combine = void (*)(std::byte* dst, const std::byte* src, size_t bytes);

// The step of `op` on `dtype`; null where Reduces(dtype, op) is false.
Combine CombineOf(DType dtype, ReduceOp op);

}  // namespace nonstop::collective
