#include "common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace nonstop {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

const Tables& GetTables() {
  static const Tables tables;
  return tables;
}

uint32_t ExtendPortable(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = GetTables().t;
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = t[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

// Appending zero bytes to a message is a linear map on the CRC register:
// with it, CRCs of consecutive blocks computed independently combine into
// the CRC of their concatenation (zlib's crc32_combine, Mark Adler's crc32c
// for the tables). That lets the hardware path run three independent crc32
// chains at once: the instruction's latency is three cycles and its
// throughput one per cycle, so one chain uses a third of it.
uint32_t Gf2Times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  for (; vec != 0; vec >>= 1, ++mat) {
    if (vec & 1) sum ^= *mat;
  }
  return sum;
}

void Gf2Square(uint32_t* square, const uint32_t* mat) {
  for (int n = 0; n < 32; ++n) square[n] = Gf2Times(mat, mat[n]);
}

// The operator (a 32x32 GF(2) matrix) that appends `len` zero bytes, applied
// to the register a byte of it at a time through four tables.
struct ZerosTables {
  std::array<std::array<uint32_t, 256>, 4> t{};
  explicit ZerosTables(size_t len) {
    uint32_t even[32], odd[32];
    odd[0] = kPoly;  // one zero bit
    for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
    Gf2Square(even, odd);  // two zero bits
    Gf2Square(odd, even);  // four zero bits
    const uint32_t* op = nullptr;
    // Each square doubles the operator: the first gives one zero byte; `len` is a power of two.
    while (true) {
      Gf2Square(even, odd);
      len >>= 1;
      if (len == 0) {
        op = even;
        break;
      }
      Gf2Square(odd, even);
      len >>= 1;
      if (len == 0) {
        op = odd;
        break;
      }
    }
    for (uint32_t n = 0; n < 256; ++n) {
      for (int b = 0; b < 4; ++b) t[static_cast<size_t>(b)][n] = Gf2Times(op, n << (8 * b));
    }
  }
  uint32_t Shift(uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

#if defined(__x86_64__)
constexpr size_t kLongBlock = 8192;  // bytes per chain in the three-chain loops (powers of two)
constexpr size_t kShortBlock = 256;

const ZerosTables& LongZeros() {
  static const ZerosTables tables(kLongBlock);
  return tables;
}
const ZerosTables& ShortZeros() {
  static const ZerosTables tables(kShortBlock);
  return tables;
}

// Three chains over three consecutive blocks of `block` bytes, combined.
__attribute__((target("sse4.2"))) uint64_t ThreeChains(uint64_t c0, const unsigned char* p,
                                                       size_t block, const ZerosTables& zeros) {
  uint64_t c1 = 0, c2 = 0;
  for (size_t i = 0; i < block; i += 8) {
    uint64_t v0, v1, v2;
    std::memcpy(&v0, p + i, 8);
    std::memcpy(&v1, p + block + i, 8);
    std::memcpy(&v2, p + 2 * block + i, 8);
    c0 = _mm_crc32_u64(c0, v0);
    c1 = _mm_crc32_u64(c1, v1);
    c2 = _mm_crc32_u64(c2, v2);
  }
  c0 = zeros.Shift(static_cast<uint32_t>(c0)) ^ c1;
  return zeros.Shift(static_cast<uint32_t>(c0)) ^ c2;
}

__attribute__((target("sse4.2"))) uint32_t ExtendHardware(uint32_t crc, const unsigned char* p,
                                                          size_t n) {
  uint64_t c = ~crc & 0xFFFFFFFFu;
  if (n >= 3 * kShortBlock) {
    const ZerosTables& long_zeros = LongZeros();
    const ZerosTables& short_zeros = ShortZeros();
    for (; n >= 3 * kLongBlock; p += 3 * kLongBlock, n -= 3 * kLongBlock)
      c = ThreeChains(c, p, kLongBlock, long_zeros);
    for (; n >= 3 * kShortBlock; p += 3 * kShortBlock, n -= 3 * kShortBlock)
      c = ThreeChains(c, p, kShortBlock, short_zeros);
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

bool HasHardwareCrc() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (HasHardwareCrc()) return ExtendHardware(crc, p, size);
#endif
  return ExtendPortable(crc, p, size);
}

namespace internal {
uint32_t Crc32cExtendPortableForTest(uint32_t crc, const void* data, size_t size) {
  return ExtendPortable(crc, static_cast<const unsigned char*>(data), size);
}
}  // namespace internal

}  // namespace nonstop
