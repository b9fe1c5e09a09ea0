#include "common/check.h"

#include <cstdio>
#include <cstdlib>

namespace nonstop::internal {

CheckFailure::CheckFailure(const char* condition, std::source_location where) {
  stream_ << where.file_name() << ":" << where.line() << " in " << where.function_name()
          << ": check failed: " << condition << " ";
}

CheckFailure::~CheckFailure() {
  std::string text = stream_.str();
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace nonstop::internal
