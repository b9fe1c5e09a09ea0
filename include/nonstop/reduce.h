// The element types and operations of a reduction: Session::AllReduce and
// ReduceScatter of any type, the data plane's sums (docs/data_plane.md).
//
// Each operation is element-wise and applied in a fixed order (the ring's,
// data_plane.h), so every rank ends with the same bytes and a world of the
// same size gives the same bits run to run. Integers wrap on overflow (two's
// complement, as torch's do); float16 and bfloat16 are combined in float32
// and rounded to nearest-even after each step, as torch's Gloo backend does;
// bool's SUM and MAX are OR, its PRODUCT and MIN are AND.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace nonstop {

enum class DType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kBool,
};

enum class ReduceOp : uint8_t { kSum, kProduct, kMin, kMax, kBand, kBor, kBxor };

constexpr size_t ElementBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
      return 2;
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

// "float32", "bfloat16", "int64", ...: torch's names, for messages and for the Python binding.
std::string_view DTypeName(DType dtype);
// "sum", "product", "min", "max", "band", "bor", "bxor".
std::string_view ReduceOpName(ReduceOp op);
// Whether `op` applies to `dtype`: the bitwise ones to integers and bool only.
bool Reduces(DType dtype, ReduceOp op);

}  // namespace nonstop
