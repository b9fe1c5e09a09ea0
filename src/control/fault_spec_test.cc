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

// A bit flipped in one member's state, in a region it names or in the default one.
TEST(FaultSpecTest, ABitflipNamesItsStepAndMaybeItsTensor) {
  auto f = ParseFaults("bitflip:rank=1,step=12,tensor=adamw.exp_avg;bitflip:rank=0,step=3");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->size(), 2u);
  EXPECT_EQ((*f)[0].kind, FaultKind::kBitflip);
  EXPECT_EQ((*f)[0].tensor, "adamw.exp_avg");
  EXPECT_EQ((*f)[0].point, FaultPoint::kStep);
  EXPECT_EQ((*f)[1].tensor, "");
  EXPECT_EQ(FormatFault((*f)[0]), "bitflip:rank=1,step=12,tensor=adamw.exp_avg");
  auto back = ParseFaults(FormatFault((*f)[0]));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ((*back)[0].tensor, "adamw.exp_avg");
  for (const char* bad :
       {"bitflip:rank=1,time=3", "bitflip:rank=1", "kill:rank=1,step=3,tensor=x",
        "bitflip:rank=1,step=3,tensor=", "bitflip:rank=1,step=3,during=transfer"}) {
    EXPECT_FALSE(ParseFaults(bad).ok()) << bad;
  }
  EXPECT_NE(ParseFaults("kill:rank=1,step=3,tensor=x").status().message().find("bitflip only"),
            std::string::npos);
}

// A bit flipped on the wire in one member's ring, in the last gather step (the default) or the
// last reduce step.
TEST(FaultSpecTest, AWireflipNamesItsStepAndItsRingPhase) {
  auto f = ParseFaults("wireflip:rank=1,step=12;wireflip:rank=0,step=3,phase=reduce");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->size(), 2u);
  EXPECT_EQ((*f)[0].kind, FaultKind::kWireflip);
  EXPECT_TRUE((*f)[0].gather_phase);
  EXPECT_FALSE((*f)[1].gather_phase);
  EXPECT_EQ(FormatFault((*f)[0]), "wireflip:rank=1,step=12");
  EXPECT_EQ(FormatFault((*f)[1]), "wireflip:rank=0,step=3,phase=reduce");
  auto back = ParseFaults(FormatFault((*f)[1]));
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE((*back)[0].gather_phase);
  for (const char* bad :
       {"wireflip:rank=1,time=3", "wireflip:rank=1", "wireflip:rank=1,step=3,phase=up",
        "kill:rank=1,step=3,phase=gather", "wireflip:rank=1,step=3,during=transfer"}) {
    EXPECT_FALSE(ParseFaults(bad).ok()) << bad;
  }
  EXPECT_NE(ParseFaults("kill:rank=1,step=3,phase=gather").status().message().find("wireflip only"),
            std::string::npos);
}

// A kill or hang part-way into a step (at=): as it starts, half-way, and its default (just before
// the step's reduction, at = -1).
TEST(FaultSpecTest, AKillOrHangCanLandAFractionOfTheWayIntoAStep) {
  auto f = ParseFaults("kill:rank=2,step=30,at=0;hang:rank=1,step=9,at=0.5;kill:rank=0,step=4");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  ASSERT_EQ(f->size(), 3u);
  EXPECT_DOUBLE_EQ((*f)[0].at, 0);
  EXPECT_DOUBLE_EQ((*f)[1].at, 0.5);
  EXPECT_DOUBLE_EQ((*f)[2].at, -1);
  EXPECT_EQ(FormatFault((*f)[1]), "hang:rank=1,step=9,at=0.5");
  EXPECT_EQ(FormatFault((*f)[2]), "kill:rank=0,step=4");
  auto back = ParseFaults(FormatFault((*f)[0]));
  ASSERT_TRUE(back.ok());
  EXPECT_DOUBLE_EQ((*back)[0].at, 0);
  for (const char* bad :
       {"kill:rank=1,step=3,at=1", "kill:rank=1,step=3,at=-0.1", "kill:rank=1,step=3,at=half"}) {
    EXPECT_NE(ParseFaults(bad).status().message().find("is not a fraction of the step"),
              std::string::npos)
        << bad;
  }
  for (const char* bad : {"exception:rank=1,step=3,at=0.5", "kill:rank=1,time=3,at=0.5",
                          "kill:rank=1,step=3,during=transfer,at=0.5"}) {
    EXPECT_NE(ParseFaults(bad).status().message().find("at= works with step= for kill and hang"),
              std::string::npos)
        << bad << ": " << ParseFaults(bad).status().message();
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
