// Comparison of secrets (job tokens) in time that does not depend on where
// they differ, so that a peer probing a port cannot learn a token byte by
// byte from how fast it is refused.
//
// ConstantTimeEquals reads every byte of the longer input, whatever the
// contents; its running time depends only on the two lengths (the length of
// the presented string is the caller's own, and the length of a nonstop job
// token is not secret).
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <string_view>

namespace nonstop {

inline bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  // volatile: the compiler may not stop at the first differing byte.
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

}  // namespace nonstop
