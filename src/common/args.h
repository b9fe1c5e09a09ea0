// Splitting a command line at the first `--`: what comes after it is another
// program and its arguments (`nonstop run … -- nonstop-train …`), which no
// option parser of ours should ever look at.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace nonstop {

struct SplitArgs {
  int argc = 0;                      // arguments before the `--` (argv[0] included)
  std::vector<std::string> program;  // everything after it; empty when there is none
};

inline SplitArgs SplitAtDoubleDash(int argc, char** argv) {
  SplitArgs out{argc, {}};
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--") {
      out.program.assign(argv + i + 1, argv + argc);
      out.argc = i;
      break;
    }
  }
  return out;
}

}  // namespace nonstop
