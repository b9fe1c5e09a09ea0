#include "common/crypto.h"

#include <set>

#include <gtest/gtest.h>

namespace nonstop::crypto {
namespace {

TEST(CryptoTest, MacKeyIsHmacSha256) {
  Key k;
  k.fill(0x0b);
  // Python: hmac.new(b'\x0b' * 32, b'Hi There', hashlib.sha256).hexdigest()
  EXPECT_EQ(Hex(MacKey(k).Mac({"Hi ", "There"})),
            "198a607eb44bfbc69903a0f1cf2bbdc5ba0aa3f3d9ae3c1c7a3b1696a0b68cf7");
}

TEST(CryptoTest, GmacIsAes256GcmOverAdditionalData) {
  // McGrew and Viega's GCM test case 13 (zero key and nonce, nothing to authenticate), and
  // Python: AESGCM(b'\x0b' * 32).encrypt(bytes(range(12)), b'', b'Hi There').hex()
  EXPECT_EQ(Hex(Gmac(Key{}, std::string(kGmacNonceBytes, '\0'), {})),
            "530f8afbc74536b9a963b4f1c4cb738b");
  Key k;
  k.fill(0x0b);
  std::string nonce;
  for (char c = 0; c < 12; ++c) nonce.push_back(c);
  EXPECT_EQ(Hex(Gmac(k, nonce, {"Hi ", "There"})), "8efcd741bc97780d756b66ab40b751ef");
  // Another nonce, another tag; a byte changed, another tag.
  nonce[11] = 12;
  EXPECT_NE(Hex(Gmac(k, nonce, {"Hi There"})), "8efcd741bc97780d756b66ab40b751ef");
  nonce[11] = 11;
  EXPECT_NE(Hex(Gmac(k, nonce, {"Hi there"})), "8efcd741bc97780d756b66ab40b751ef");
}

TEST(CryptoTest, FramedMacSeparatesLabelsAndPartBoundaries) {
  Key k = JobKey("token");
  const std::string m = Mac(k, "label", {"ab", "c"});
  EXPECT_EQ(m.size(), kMacBytes);
  EXPECT_EQ(m, Mac(k, "label", {"ab", "c"}));
  EXPECT_NE(m, Mac(k, "label", {"a", "bc"}));
  EXPECT_NE(m, Mac(k, "other", {"ab", "c"}));
  EXPECT_NE(m, Mac(JobKey("token2"), "label", {"ab", "c"}));
  EXPECT_NE(Mac(k, "", {"x"}), Mac(k, "x", {}));
}

TEST(CryptoTest, DerivedKeysDifferByPurposeAndContext) {
  Key k = JobKey("token");
  EXPECT_NE(DeriveKey(k, "a"), DeriveKey(k, "b"));
  EXPECT_NE(DeriveKey(k, "a", "1"), DeriveKey(k, "a", "2"));
  EXPECT_EQ(DeriveKey(k, "a", "1"), DeriveKey(k, "a", "1"));
  EXPECT_NE(JobKey("token"), JobKey("tokeN"));
}

TEST(CryptoTest, MacEqualsComparesWholeValues) {
  EXPECT_TRUE(MacEquals("abc", "abc"));
  EXPECT_FALSE(MacEquals("abc", "abd"));
  EXPECT_FALSE(MacEquals("abc", "ab"));
  EXPECT_TRUE(MacEquals("", ""));
}

TEST(CryptoTest, RandomBytesAreFresh) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    std::string r = RandomBytes(kNonceBytes);
    ASSERT_EQ(r.size(), kNonceBytes);
    EXPECT_TRUE(seen.insert(r).second);
  }
}

TEST(CryptoTest, Base64IsRfc4648) {
  // RFC 4648's test vectors, and bytes that are no text.
  const std::pair<std::string, std::string> kVectors[] = {{"", ""},
                                                          {"f", "Zg=="},
                                                          {"fo", "Zm8="},
                                                          {"foo", "Zm9v"},
                                                          {"foob", "Zm9vYg=="},
                                                          {"fooba", "Zm9vYmE="},
                                                          {"foobar", "Zm9vYmFy"},
                                                          {std::string("\0\xff\x80", 3), "AP+A"}};
  for (const auto& [bytes, text] : kVectors) {
    EXPECT_EQ(Base64Encode(bytes), text);
    EXPECT_EQ(Base64Decode(text), bytes) << text;
  }
}

TEST(CryptoTest, Base64RefusesWhatIsNotBase64) {
  for (const char* text :
       {"Zg=", "Zm9", "Z!==", " Zg=", "Zg== ", "Zm 9", "====", "Z===", "Zg==Zg=="})
    EXPECT_FALSE(Base64Decode(text).has_value()) << text;
}

}  // namespace
}  // namespace nonstop::crypto
