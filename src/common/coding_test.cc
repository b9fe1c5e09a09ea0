#include "common/coding.h"

#include <gtest/gtest.h>

namespace nonstop {
namespace {

TEST(CodingTest, RoundTripsLittleEndian) {
  std::string s;
  PutFixed16(&s, 0xBEEF);
  PutFixed32(&s, 0x01020304u);
  PutFixed64(&s, 0x1122334455667788ull);
  ASSERT_EQ(s.size(), 14u);
  EXPECT_EQ(static_cast<unsigned char>(s[2]), 0x04);  // little-endian: low byte first
  ByteReader r(s);
  uint16_t a;
  uint32_t b;
  uint64_t c;
  ASSERT_TRUE(r.ReadFixed16(&a));
  ASSERT_TRUE(r.ReadFixed32(&b));
  ASSERT_TRUE(r.ReadFixed64(&c));
  EXPECT_EQ(a, 0xBEEF);
  EXPECT_EQ(b, 0x01020304u);
  EXPECT_EQ(c, 0x1122334455667788ull);
}

TEST(CodingTest, ReaderRefusesToReadPastEnd) {
  std::string s(3, 'x');
  ByteReader r(s);
  uint32_t v;
  EXPECT_FALSE(r.ReadFixed32(&v));
  EXPECT_EQ(r.remaining(), 3u);
}

}  // namespace
}  // namespace nonstop
