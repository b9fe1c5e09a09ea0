#include "nonstop/log.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace nonstop {
namespace {

TEST(LoggingTest, LinesGoToTheSinkWhileOneIsSetAndBackToStderrAfter) {
  std::vector<std::string> got;
  SetLogSink([&](std::string_view line) { got.emplace_back(line); });
  NONSTOP_LOG_WARNING("closing {}: {}", "127.0.0.1:4000", "garbage");
  SetLogSink(nullptr);
  NONSTOP_LOG_WARNING("this one goes to stderr");
  ASSERT_EQ(got.size(), 1u);
  EXPECT_NE(got[0].find("closing 127.0.0.1:4000: garbage"), std::string::npos) << got[0];
  EXPECT_EQ(got[0].back(), '\n');
}

}  // namespace
}  // namespace nonstop
