#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace nonstop {
namespace internal {
uint32_t Crc32cExtendPortableForTest(uint32_t crc, const void* data, size_t size);
}
namespace {

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

TEST(Crc32cTest, HardwareAndPortableAgree) {
  std::mt19937 rng(7);
  std::vector<unsigned char> buf(4099);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t n : {0ul, 1ul, 7ul, 8ul, 9ul, 63ul, 4099ul}) {
    EXPECT_EQ(Crc32c(buf.data(), n), internal::Crc32cExtendPortableForTest(0, buf.data(), n)) << n;
  }
}

// The hardware path runs three chains over blocks of 8 KiB and of 256 bytes
// and combines them: every length and alignment around those blocks agrees
// with the one-byte-at-a-time table.
TEST(Crc32cTest, HardwareAndPortableAgreeAcrossTheInterleavedBlocks) {
  std::mt19937 rng(11);
  std::vector<unsigned char> buf(4 * 3 * 8192 + 64);  // room for the longest length below
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t offset : {0ul, 1ul, 5ul}) {
    for (size_t n : {767ul, 768ul, 769ul, 1000ul, 24575ul, 24576ul, 24577ul, 3 * 24576ul + 777ul}) {
      const unsigned char* p = buf.data() + offset;
      EXPECT_EQ(Crc32c(p, n), internal::Crc32cExtendPortableForTest(0, p, n))
          << "offset " << offset << ", " << n << " bytes";
      EXPECT_EQ(Crc32cExtend(0x12345678u, p, n),
                internal::Crc32cExtendPortableForTest(0x12345678u, p, n))
          << "extending, offset " << offset << ", " << n << " bytes";
    }
  }
}

}  // namespace
}  // namespace nonstop
