#include "nonstop/status.h"

#include <gtest/gtest.h>

namespace nonstop {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgumentError("odd");
  return x / 2;
}

Result<int> Quarter(int x) {
  NONSTOP_ASSIGN_OR_RETURN(int h, Half(x));
  NONSTOP_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusTest, OkByDefault) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, ToStringNamesCodeAndMessage) {
  EXPECT_EQ(AbortedError("generation 3 ended").ToString(), "ABORTED: generation 3 ended");
  EXPECT_EQ(DataLossError("bad").WithContext("shard a.bin").ToString(),
            "DATA_LOSS: shard a.bin: bad");
}

TEST(StatusTest, AssignOrReturnPropagatesFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  Result<int> r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(StatusDeathTest, ValueOfErrorAborts) {
  Result<int> r = InternalError("x");
  EXPECT_DEATH((void)r.value(), "check failed");
}

}  // namespace
}  // namespace nonstop
