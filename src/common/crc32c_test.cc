#include "nonstop/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace nonstop {
namespace {

// CRC-32C one bit at a time, straight from the definition (reflected
// Castagnoli polynomial): the reference the library's folding must match.
uint32_t BitwiseCrc32c(uint32_t crc, const unsigned char* p, size_t n) {
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720 B.4 test vectors.
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);
  std::string ones(32, '\xff');
  EXPECT_EQ(Crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(std::string("123456789")), 0xE3069283u);
}

TEST(Crc32cTest, ExtendEqualsWhole) {
  std::string data = "the quick brown fox jumps over the lazy dog, twice over";
  uint32_t whole = Crc32c(data);
  for (size_t split = 0; split <= data.size(); ++split) {
    uint32_t c = Crc32cExtend(0, data.data(), split);
    c = Crc32cExtend(c, data.data() + split, data.size() - split);
    EXPECT_EQ(c, whole) << "split at " << split;
  }
}

// The library folds 16 to 256 bytes at a time with carry-less multiplies and
// finishes the tail otherwise: every length and alignment around those
// blocks, from zero and from another CRC, agrees with the bitwise definition.
TEST(Crc32cTest, AgreesWithTheBitwiseDefinitionAtEveryLengthAndAlignment) {
  std::mt19937 rng(11);
  std::vector<unsigned char> buf(3 * 8192 + 777 + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 300; ++n) lengths.push_back(n);
  for (size_t n : {511ul, 512ul, 513ul, 1023ul, 1024ul, 1025ul, 4099ul, 3 * 8192ul + 777ul}) {
    lengths.push_back(n);
  }
  for (size_t offset : {0ul, 1ul, 5ul, 13ul}) {
    for (size_t n : lengths) {
      const unsigned char* p = buf.data() + offset;
      ASSERT_EQ(Crc32c(p, n), BitwiseCrc32c(0, p, n)) << "offset " << offset << ", " << n;
      ASSERT_EQ(Crc32cExtend(0x12345678u, p, n), BitwiseCrc32c(0x12345678u, p, n))
          << "extending, offset " << offset << ", " << n << " bytes";
    }
  }
}

}  // namespace
}  // namespace nonstop
