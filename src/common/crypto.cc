#include "common/crypto.h"

#include <algorithm>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "common/check.h"

namespace nonstop::crypto {

namespace {

void PutLength(std::string* out, size_t n) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((n >> (8 * i)) & 0xff));
}

// One keyed HMAC-SHA256 context; the fetched algorithm is shared by the process.
EVP_MAC* HmacAlgorithm() {
  static EVP_MAC* mac = [] {
    EVP_MAC* m = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    NONSTOP_CHECK(m != nullptr) << "libcrypto has no HMAC";
    return m;
  }();
  return mac;
}

EVP_MAC_CTX* KeyedContext(const uint8_t* key, size_t key_len) {
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(HmacAlgorithm());
  NONSTOP_CHECK(ctx != nullptr) << "EVP_MAC_CTX_new";
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  NONSTOP_CHECK(EVP_MAC_init(ctx, key, key_len, params) == 1) << "HMAC-SHA256 init";
  return ctx;
}

std::string Finish(EVP_MAC_CTX* ctx) {
  std::string out(kMacBytes, '\0');
  size_t len = 0;
  NONSTOP_CHECK(
      EVP_MAC_final(ctx, reinterpret_cast<unsigned char*>(out.data()), &len, out.size()) == 1 &&
      len == kMacBytes)
      << "HMAC-SHA256 final";
  return out;
}

void Update(EVP_MAC_CTX* ctx, std::string_view bytes) {
  NONSTOP_CHECK(
      EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()) == 1)
      << "HMAC-SHA256 update";
}

Key ToKey(const std::string& mac) {
  Key k{};
  std::copy(mac.begin(), mac.begin() + kKeyBytes, k.begin());
  return k;
}

}  // namespace

Key JobKey(std::string_view job_token) {
  EVP_MAC_CTX* ctx =
      KeyedContext(reinterpret_cast<const uint8_t*>(job_token.data()), job_token.size());
  Update(ctx, "nonstop job key v1");
  Key k = ToKey(Finish(ctx));
  EVP_MAC_CTX_free(ctx);
  return k;
}

Key DeriveKey(const Key& key, std::string_view purpose, std::string_view context) {
  return ToKey(Mac(key, "derive", {purpose, context}));
}

std::string Mac(const Key& key, std::string_view label,
                std::initializer_list<std::string_view> parts) {
  EVP_MAC_CTX* ctx = KeyedContext(key.data(), key.size());
  std::string framed;
  PutLength(&framed, label.size());
  framed += label;
  for (std::string_view p : parts) {
    PutLength(&framed, p.size());
    Update(ctx, framed);
    framed.clear();
    Update(ctx, p);
  }
  if (!framed.empty()) Update(ctx, framed);
  std::string out = Finish(ctx);
  EVP_MAC_CTX_free(ctx);
  return out;
}

bool MacEquals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  NONSTOP_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) == 1)
      << "the random generator failed: no nonce can be made";
  return out;
}

std::string Gmac(const Key& key, std::string_view nonce,
                 std::initializer_list<std::string_view> parts) {
  NONSTOP_CHECK(nonce.size() == kGmacNonceBytes) << "a GMAC nonce of " << nonce.size() << " bytes";
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  NONSTOP_CHECK(ctx != nullptr) << "EVP_CIPHER_CTX_new";
  NONSTOP_CHECK(EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, key.data(),
                                   reinterpret_cast<const unsigned char*>(nonce.data())) == 1)
      << "AES-256-GCM init";
  int len = 0;
  for (std::string_view p : parts) {
    // EVP takes an int's worth at a time.
    for (size_t at = 0; at < p.size();) {
      const size_t n = std::min<size_t>(p.size() - at, size_t{1} << 30);
      NONSTOP_CHECK(EVP_EncryptUpdate(ctx, nullptr, &len,
                                      reinterpret_cast<const unsigned char*>(p.data() + at),
                                      static_cast<int>(n)) == 1)
          << "AES-256-GCM additional data";
      at += n;
    }
  }
  unsigned char none[16];
  NONSTOP_CHECK(EVP_EncryptFinal_ex(ctx, none, &len) == 1) << "AES-256-GCM final";
  std::string tag(kGmacTagBytes, '\0');
  NONSTOP_CHECK(EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kGmacTagBytes),
                                    tag.data()) == 1)
      << "AES-256-GCM tag";
  EVP_CIPHER_CTX_free(ctx);
  return tag;
}

namespace {

// An Ed25519 key of libcrypto from a seed (private) or a public key; null for a wrong length.
EVP_PKEY* Ed25519Key(std::string_view bytes, bool is_private) {
  const auto* raw = reinterpret_cast<const unsigned char*>(bytes.data());
  return is_private ? EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, raw, bytes.size())
                    : EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr, raw, bytes.size());
}

std::string_view SeedBytes(const Key& seed) {
  return {reinterpret_cast<const char*>(seed.data()), seed.size()};
}

}  // namespace

std::string Ed25519PublicKey(const Key& seed) {
  EVP_PKEY* key = Ed25519Key(SeedBytes(seed), true);
  NONSTOP_CHECK(key != nullptr) << "Ed25519 key from a seed";
  std::string out(kEd25519PublicBytes, '\0');
  size_t len = out.size();
  const bool ok =
      EVP_PKEY_get_raw_public_key(key, reinterpret_cast<unsigned char*>(out.data()), &len) == 1;
  EVP_PKEY_free(key);
  NONSTOP_CHECK(ok && len == kEd25519PublicBytes) << "Ed25519 public key";
  return out;
}

std::string Ed25519Sign(const Key& seed, std::string_view message) {
  EVP_PKEY* key = Ed25519Key(SeedBytes(seed), true);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  NONSTOP_CHECK(key != nullptr && ctx != nullptr) << "Ed25519 signing context";
  std::string out(kEd25519SignatureBytes, '\0');
  size_t len = out.size();
  const bool ok =
      EVP_DigestSignInit(ctx, nullptr, nullptr, nullptr, key) == 1 &&
      EVP_DigestSign(ctx, reinterpret_cast<unsigned char*>(out.data()), &len,
                     reinterpret_cast<const unsigned char*>(message.data()), message.size()) == 1;
  EVP_MD_CTX_free(ctx);
  EVP_PKEY_free(key);
  NONSTOP_CHECK(ok && len == kEd25519SignatureBytes) << "Ed25519 sign";
  return out;
}

bool Ed25519Verify(std::string_view public_key, std::string_view message,
                   std::string_view signature) {
  if (public_key.size() != kEd25519PublicBytes || signature.size() != kEd25519SignatureBytes) {
    return false;
  }
  EVP_PKEY* key = Ed25519Key(public_key, false);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  bool ok = key != nullptr && ctx != nullptr &&
            EVP_DigestVerifyInit(ctx, nullptr, nullptr, nullptr, key) == 1 &&
            EVP_DigestVerify(
                ctx, reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                reinterpret_cast<const unsigned char*>(message.data()), message.size()) == 1;
  EVP_MD_CTX_free(ctx);
  EVP_PKEY_free(key);
  return ok;
}

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 0xf]);
  }
  return out;
}

std::string Base64Encode(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()),
                                static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::optional<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out(3 * (text.size() / 4), '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0) return std::nullopt;
  // EVP_DecodeBlock keeps the padding's zero bytes, and is lenient (white space at the ends, '='
  // inside): only text that is the encoding of what it decoded to is base64 here.
  size_t padding = 0;
  if (!text.empty() && text.back() == '=') padding = text[text.size() - 2] == '=' ? 2 : 1;
  out.resize(static_cast<size_t>(n) - padding);
  if (Base64Encode(out) != text) return std::nullopt;
  return out;
}

struct MacKey::State {
  EVP_MAC_CTX* keyed = nullptr;
};

MacKey::MacKey(const Key& key) : state_(std::make_unique<State>()) {
  state_->keyed = KeyedContext(key.data(), key.size());
}

MacKey::~MacKey() { EVP_MAC_CTX_free(state_->keyed); }

std::string MacKey::Mac(std::initializer_list<std::string_view> parts) const {
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_dup(state_->keyed);
  NONSTOP_CHECK(ctx != nullptr) << "EVP_MAC_CTX_dup";
  for (std::string_view p : parts) Update(ctx, p);
  std::string out = Finish(ctx);
  EVP_MAC_CTX_free(ctx);
  return out;
}

}  // namespace nonstop::crypto
