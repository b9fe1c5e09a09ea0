// Explicit little-endian encoding of fixed-width integers (leveldb util/coding.h).
// Every byte that crosses a socket or lands on disk goes through these.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace nonstop {

inline void EncodeFixed16(char* dst, uint16_t v) {
  dst[0] = static_cast<char>(v);
  dst[1] = static_cast<char>(v >> 8);
}
inline void EncodeFixed32(char* dst, uint32_t v) {
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<char>(v >> (8 * i));
}
inline void EncodeFixed64(char* dst, uint64_t v) {
  for (int i = 0; i < 8; ++i) dst[i] = static_cast<char>(v >> (8 * i));
}
inline uint16_t DecodeFixed16(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint16_t>(u[0] | (u[1] << 8));
}
inline uint32_t DecodeFixed32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | u[i];
  return v;
}
inline uint64_t DecodeFixed64(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | u[i];
  return v;
}

inline void PutFixed16(std::string* dst, uint16_t v) {
  char buf[2];
  EncodeFixed16(buf, v);
  dst->append(buf, 2);
}
inline void PutFixed32(std::string* dst, uint32_t v) {
  char buf[4];
  EncodeFixed32(buf, v);
  dst->append(buf, 4);
}
inline void PutFixed64(std::string* dst, uint64_t v) {
  char buf[8];
  EncodeFixed64(buf, v);
  dst->append(buf, 8);
}

// A cursor over bytes that refuses to read past the end: decoding untrusted
// input never reads out of bounds.
class ByteReader {
 public:
  explicit ByteReader(std::string_view data) : data_(data) {}
  bool ReadFixed16(uint16_t* v) {
    return Read(2, [&](const char* p) { *v = DecodeFixed16(p); });
  }
  bool ReadFixed32(uint32_t* v) {
    return Read(4, [&](const char* p) { *v = DecodeFixed32(p); });
  }
  bool ReadFixed64(uint64_t* v) {
    return Read(8, [&](const char* p) { *v = DecodeFixed64(p); });
  }
  bool ReadBytes(size_t n, std::string_view* out) {
    return Read(n, [&](const char* p) { *out = std::string_view(p, n); });
  }
  size_t remaining() const { return data_.size() - pos_; }

 private:
  template <typename F>
  bool Read(size_t n, F f) {
    if (remaining() < n) return false;
    f(data_.data() + pos_);
    pos_ += n;
    return true;
  }
  std::string_view data_;
  size_t pos_ = 0;
};

}  // namespace nonstop
