// NONSTOP_CHECK: aborts on a bug in our own code, printing both values of a
// comparison and the source location. Never used for input or network data:
// those are Statuses (see status.h).
#pragma once

#include <source_location>
#include <sstream>
#include <string>

namespace nonstop::internal {

class CheckFailure {
 public:
  CheckFailure(const char* condition, std::source_location where = std::source_location::current());
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;
  [[noreturn]] ~CheckFailure();

  template <typename T>
  CheckFailure& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }

 private:
  std::ostringstream stream_;
};

template <typename A, typename B>
std::string FormatOperands(const A& a, const B& b) {
  std::ostringstream s;
  s << "(" << a << " vs " << b << ") ";
  return s.str();
}

}  // namespace nonstop::internal

#define NONSTOP_CHECK(cond) \
  if (cond) {               \
  } else                    \
    ::nonstop::internal::CheckFailure(#cond)

#define NONSTOP_CHECK_OP(a, b, op)                       \
  if ((a)op(b)) {                                        \
  } else                                                 \
    ::nonstop::internal::CheckFailure(#a " " #op " " #b) \
        << ::nonstop::internal::FormatOperands((a), (b))

#define NONSTOP_CHECK_EQ(a, b) NONSTOP_CHECK_OP(a, b, ==)
#define NONSTOP_CHECK_NE(a, b) NONSTOP_CHECK_OP(a, b, !=)
#define NONSTOP_CHECK_LT(a, b) NONSTOP_CHECK_OP(a, b, <)
#define NONSTOP_CHECK_LE(a, b) NONSTOP_CHECK_OP(a, b, <=)
#define NONSTOP_CHECK_GT(a, b) NONSTOP_CHECK_OP(a, b, >)
#define NONSTOP_CHECK_GE(a, b) NONSTOP_CHECK_OP(a, b, >=)

#ifdef NDEBUG
#define NONSTOP_DCHECK(cond) \
  while (false) NONSTOP_CHECK(cond)
#else
#define NONSTOP_DCHECK(cond) NONSTOP_CHECK(cond)
#endif
