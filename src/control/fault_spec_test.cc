#include "control/fault_spec.h"

#include <gtest/gtest.h>

namespace nonstop::control {
namespace {

TEST(FaultSpecTest, ParsesEveryKindAndPoint) {
  auto f = ParseFaults(
      "kill:rank=2,step=30;hang:rank=1,time=5.5;kill:rank=1,step=30,during=transfer;corrupt:rank=0,"
      "step=9");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->size(), 4u);
  EXPECT_EQ((*f)[0].kind, FaultKind::kKill);
  EXPECT_EQ((*f)[0].rank, 2);
  EXPECT_EQ((*f)[0].step, 30);
  EXPECT_EQ((*f)[1].point, FaultPoint::kTime);
  EXPECT_DOUBLE_EQ((*f)[1].time_seconds, 5.5);
  EXPECT_EQ((*f)[2].point, FaultPoint::kTransfer);
  EXPECT_EQ((*f)[3].point, FaultPoint::kTransfer);
  EXPECT_EQ((*f)[3].id, 3);
  for (const auto& x : *f) {
    auto back = ParseFaults(FormatFault(x), x.id);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(FormatFault((*back)[0]), FormatFault(x));
  }
}

TEST(FaultSpecTest, BadSpecsSayWhatIsWrong) {
  EXPECT_NE(ParseFaults("explode:rank=1,step=2").status().message().find("unknown kind"),
            std::string::npos);
  EXPECT_NE(ParseFaults("kill:step=2").status().message().find("rank= is required"),
            std::string::npos);
  EXPECT_NE(ParseFaults("kill:rank=1").status().message().find("step= or time="),
            std::string::npos);
  EXPECT_NE(ParseFaults("kill:rank=x,step=1").status().message().find("bad value"),
            std::string::npos);
  EXPECT_NE(ParseFaults("exception:rank=1,time=3").status().message().find("kill and hang only"),
            std::string::npos);
  EXPECT_NE(ParseFaults("kill:rank=1,step=3,color=red").status().message().find("unknown key"),
            std::string::npos);
}

}  // namespace
}  // namespace nonstop::control
