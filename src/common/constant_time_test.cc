#include "common/constant_time.h"

#include <gtest/gtest.h>

#include <string>

namespace nonstop {
namespace {

TEST(ConstantTimeTest, EqualStringsAreEqual) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("3f9a0c", "3f9a0c"));
  std::string with_nul("a\0b", 3);
  EXPECT_TRUE(ConstantTimeEquals(with_nul, std::string("a\0b", 3)));
}

TEST(ConstantTimeTest, AnyDifferingByteMakesThemDifferent) {
  const std::string token = "0123456789abcdef";
  for (size_t i = 0; i < token.size(); ++i) {
    std::string other = token;
    other[i] = static_cast<char>(other[i] ^ 0x01);
    EXPECT_FALSE(ConstantTimeEquals(token, other)) << "byte " << i;
  }
}

TEST(ConstantTimeTest, DifferentLengthsAreDifferentEvenAsPrefixes) {
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret-and-more"));
  EXPECT_FALSE(ConstantTimeEquals("secret-and-more", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_FALSE(ConstantTimeEquals("x", ""));
  // Padding with NULs must not make a shorter string equal to a longer one.
  EXPECT_FALSE(ConstantTimeEquals("ab", std::string("ab\0", 3)));
}

}  // namespace
}  // namespace nonstop
