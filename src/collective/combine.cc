#include "collective/combine.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "collective/transfer.h"

namespace nonstop {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kProduct:
      return "product";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
  }
  return "?";
}

bool Reduces(DType dtype, ReduceOp op) { return collective::CombineOf(dtype, op) != nullptr; }

namespace collective {
namespace {

float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man x 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign != 0 ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7F800000u | (man << 13));  // inf, NaN
  return BitsToFloat(sign | ((exp + 112) << 23) | (man << 13));
}

// Round to nearest, ties to even; overflow to infinity.
uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatToBits(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return sign | (abs > 0x7F800000u ? 0x7E00 : 0x7C00);
  if (abs >= 0x477FF000u) return sign | 0x7C00;  // >= 65520: infinity
  if (abs < 0x38800000u) {                       // below 2^-14: a subnormal (exact x 2^24)
    return sign | static_cast<uint16_t>(std::nearbyint(BitsToFloat(abs) * 16777216.0f));
  }
  const uint32_t rounded = abs + 0xFFFu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

float BFloat16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatToBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Sum {
  template <typename T>
  T operator()(T a, T b) const {
    return a + b;
  }
};
struct Product {
  template <typename T>
  T operator()(T a, T b) const {
    return a * b;
  }
};
struct Min {
  template <typename T>
  T operator()(T a, T b) const {
    return b < a ? b : a;
  }
};
struct Max {
  template <typename T>
  T operator()(T a, T b) const {
    return a < b ? b : a;
  }
};
struct Band {
  template <typename T>
  T operator()(T a, T b) const {
    return a & b;
  }
};
struct Bor {
  template <typename T>
  T operator()(T a, T b) const {
    return a | b;
  }
};
struct Bxor {
  template <typename T>
  T operator()(T a, T b) const {
    return a ^ b;
  }
};

// Floating point and the comparisons of integers: the operation on the type itself.
template <typename T, typename Op>
void Apply(std::byte* dst, const std::byte* src, size_t bytes) {
  T* __restrict d = reinterpret_cast<T*>(dst);
  const T* __restrict s = reinterpret_cast<const T*>(src);
  const size_t n = bytes / sizeof(T);
  for (size_t i = 0; i < n; ++i) d[i] = Op{}(d[i], s[i]);
}

// An integer's sum and product wrap: computed in uint64_t, truncated to T.
template <typename T, typename Op>
void ApplyWrapping(std::byte* dst, const std::byte* src, size_t bytes) {
  T* __restrict d = reinterpret_cast<T*>(dst);
  const T* __restrict s = reinterpret_cast<const T*>(src);
  const size_t n = bytes / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    d[i] = static_cast<T>(Op{}(static_cast<uint64_t>(d[i]), static_cast<uint64_t>(s[i])));
  }
}

// float16 and bfloat16: combined in float32, rounded back after each step.
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float), typename Op>
void ApplyNarrow(std::byte* dst, const std::byte* src, size_t bytes) {
  uint16_t* __restrict d = reinterpret_cast<uint16_t*>(dst);
  const uint16_t* __restrict s = reinterpret_cast<const uint16_t*>(src);
  const size_t n = bytes / sizeof(uint16_t);
  for (size_t i = 0; i < n; ++i) d[i] = Narrow(Op{}(Widen(d[i]), Widen(s[i])));
}

void AddFloat32Bytes(std::byte* dst, const std::byte* src, size_t bytes) {
  AddFloat32(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src),
             bytes / sizeof(float));
}

template <typename T>
Combine FloatCombine(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return &Apply<T, Sum>;
    case ReduceOp::kProduct:
      return &Apply<T, Product>;
    case ReduceOp::kMin:
      return &Apply<T, Min>;
    case ReduceOp::kMax:
      return &Apply<T, Max>;
    default:
      return nullptr;
  }
}

template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
Combine NarrowCombine(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return &ApplyNarrow<Widen, Narrow, Sum>;
    case ReduceOp::kProduct:
      return &ApplyNarrow<Widen, Narrow, Product>;
    case ReduceOp::kMin:
      return &ApplyNarrow<Widen, Narrow, Min>;
    case ReduceOp::kMax:
      return &ApplyNarrow<Widen, Narrow, Max>;
    default:
      return nullptr;
  }
}

template <typename T>
Combine IntegerCombine(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return &ApplyWrapping<T, Sum>;
    case ReduceOp::kProduct:
      return &ApplyWrapping<T, Product>;
    case ReduceOp::kMin:
      return &Apply<T, Min>;
    case ReduceOp::kMax:
      return &Apply<T, Max>;
    case ReduceOp::kBand:
      return &Apply<T, Band>;
    case ReduceOp::kBor:
      return &Apply<T, Bor>;
    case ReduceOp::kBxor:
      return &Apply<T, Bxor>;
  }
  return nullptr;
}

// bool (one byte, 0 or 1): SUM and MAX are OR, PRODUCT and MIN are AND.
Combine BoolCombine(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      return &Apply<uint8_t, Bor>;
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return &Apply<uint8_t, Band>;
    case ReduceOp::kBxor:
      return &Apply<uint8_t, Bxor>;
  }
  return nullptr;
}

}  // namespace

Combine CombineOf(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::kFloat32:
      return op == ReduceOp::kSum ? &AddFloat32Bytes : FloatCombine<float>(op);
    case DType::kFloat64:
      return FloatCombine<double>(op);
    case DType::kFloat16:
      return NarrowCombine<&HalfToFloat, &FloatToHalf>(op);
    case DType::kBFloat16:
      return NarrowCombine<&BFloat16ToFloat, &FloatToBFloat16>(op);
    case DType::kInt8:
      return IntegerCombine<int8_t>(op);
    case DType::kUInt8:
      return IntegerCombine<uint8_t>(op);
    case DType::kInt16:
      return IntegerCombine<int16_t>(op);
    case DType::kInt32:
      return IntegerCombine<int32_t>(op);
    case DType::kInt64:
      return IntegerCombine<int64_t>(op);
    case DType::kBool:
      return BoolCombine(op);
  }
  return nullptr;
}

}  // namespace collective
}  // namespace nonstop
