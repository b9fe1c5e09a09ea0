// The project's cryptography, in one place and over one well-kept library
// (OpenSSL's libcrypto, from Debian): HMAC-SHA256 keyed by the job key, keys
// derived from it for one purpose each, random nonces, and the comparison of
// MACs in constant time. Nothing here is hand-written crypto: these are thin
// calls into libcrypto with the project's framing of the inputs.
//
// Inputs are framed unambiguously: Mac(key, label, {a, b}) authenticates the
// label and each part with its length in front, so ("ab","c") and ("a","bc")
// never share a MAC, and a MAC made for one purpose (its label) is never
// valid for another.
//
// Thread-safety: every function is safe to call from any thread; a MacKey is
// immutable after construction and may be shared.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace nonstop::crypto {

inline constexpr size_t kKeyBytes = 32;    // HMAC-SHA256 keys
inline constexpr size_t kMacBytes = 32;    // an HMAC-SHA256 tag
inline constexpr size_t kNonceBytes = 32;  // handshake nonces

using Key = std::array<uint8_t, kKeyBytes>;

// The job key: what both ends of every connection prove they hold, derived
// from the job token (the secret users keep in the token file). The token
// itself is never sent anywhere.
Key JobKey(std::string_view job_token);

// A key for one purpose, derived from `key` (HMAC(key, "derive" + purpose + context)).
Key DeriveKey(const Key& key, std::string_view purpose, std::string_view context = "");

// HMAC-SHA256 over the label and the parts, each length-prefixed: kMacBytes bytes.
std::string Mac(const Key& key, std::string_view label,
                std::initializer_list<std::string_view> parts);

// Whether two MACs are equal, in time that depends only on their lengths.
bool MacEquals(std::string_view a, std::string_view b);

// `n` bytes from the operating system's random generator (OpenSSL's RAND_bytes, seeded from
// getrandom). Aborts the process if none can be had: a predictable nonce is worse than a crash.
std::string RandomBytes(size_t n);

// AES-256-GMAC (AES-GCM over no plaintext, the parts as its additional data, through libcrypto's
// EVP): a kGmacTagBytes tag of the parts' concatenation (no framing: the caller's record has a
// fixed layout), fast where the CPU has AES and carry-less multiply instructions. `nonce` is
// kGmacNonceBytes long and must never repeat under one key (GCM's rule: a repeat gives the key's
// authenticator away); callers make keys of their own for each use and number what they tag.
inline constexpr size_t kGmacTagBytes = 16;
inline constexpr size_t kGmacNonceBytes = 12;
std::string Gmac(const Key& key, std::string_view nonce,
                 std::initializer_list<std::string_view> parts);

// Ed25519 (RFC 8032, through libcrypto's EVP): signatures a verifier cannot make. The private
// key is a kKeyBytes seed (the callers derive it from the job key); the public key and a
// signature are kEd25519PublicBytes and kEd25519SignatureBytes long. Signing is deterministic.
inline constexpr size_t kEd25519PublicBytes = 32;
inline constexpr size_t kEd25519SignatureBytes = 64;
std::string Ed25519PublicKey(const Key& seed);
std::string Ed25519Sign(const Key& seed, std::string_view message);
// Whether `signature` is the signature of `message` under `public_key` (false for a key or a
// signature of the wrong length).
bool Ed25519Verify(std::string_view public_key, std::string_view message,
                   std::string_view signature);

// Lower-case hex of bytes (for log lines that name a digest, never a key).
std::string Hex(std::string_view bytes);

// Base64 (RFC 4648, with padding) through OpenSSL's EVP_EncodeBlock: bytes in JSON text.
std::string Base64Encode(std::string_view bytes);
// The bytes of `text`; nothing if it is not base64 (a wrong character or length, bad padding).
std::optional<std::string> Base64Decode(std::string_view text);

// A MAC key prepared once (libcrypto's context made and keyed at construction), for the
// per-frame MACs of a connection: Mac() copies the keyed context instead of keying anew.
class MacKey {
 public:
  explicit MacKey(const Key& key);
  ~MacKey();
  MacKey(const MacKey&) = delete;
  MacKey& operator=(const MacKey&) = delete;

  // HMAC-SHA256 of the concatenation of the parts (no framing: the caller's record has a fixed
  // layout), kMacBytes bytes.
  std::string Mac(std::initializer_list<std::string_view> parts) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace nonstop::crypto
