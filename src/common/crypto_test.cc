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

TEST(CryptoTest, Ed25519IsRfc8032AndAVerifierCannotBeFooled) {
  // RFC 8032, section 7.1, TEST 1 (an empty message).
  Key seed{};
  const std::string hex = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60";
  for (size_t i = 0; i < seed.size(); ++i) seed[i] = std::stoi(hex.substr(2 * i, 2), nullptr, 16);
  const std::string pub = Ed25519PublicKey(seed);
  EXPECT_EQ(Hex(pub), "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a");
  const std::string sig = Ed25519Sign(seed, "");
  EXPECT_EQ(Hex(sig),
            "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e"
            "39701cf9b46bd25bf5f0595bbe24655141438e7a100b");
  EXPECT_TRUE(Ed25519Verify(pub, "", sig));
  const std::string signed_text = Ed25519Sign(seed, "leader");
  EXPECT_TRUE(Ed25519Verify(pub, "leader", signed_text));
  EXPECT_FALSE(Ed25519Verify(pub, "leadeR", signed_text));  // another message
  std::string flipped = signed_text;
  flipped[10] ^= 1;
  EXPECT_FALSE(Ed25519Verify(pub, "leader", flipped));
  EXPECT_FALSE(Ed25519Verify(Ed25519PublicKey(JobKey("other")), "leader", signed_text));
  EXPECT_FALSE(Ed25519Verify(pub, "leader", signed_text.substr(1)));  // a wrong length
  EXPECT_FALSE(Ed25519Verify(pub.substr(1), "leader", signed_text));
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
