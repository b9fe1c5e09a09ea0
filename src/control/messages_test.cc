#include "control/messages.h"

#include <gtest/gtest.h>

namespace nonstop::control {
namespace {

TEST(MessagesTest, PlanRoundTrips) {
  PlanMsg p;
  p.generation = 3;
  p.members = {{0, "127.0.0.1:1"}, {5, "127.0.0.1:2"}};
  p.resume_step = 31;
  p.transfers = {{5, {0}}};
  p.faults = *ParseFaults("kill:rank=1,step=40", 2);
  p.reason = "recovery";
  auto back = DecodePlan(Encode(p));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->generation, 3u);
  ASSERT_EQ(back->members.size(), 2u);
  EXPECT_EQ(back->members[1].worker_id, 5);
  EXPECT_EQ(back->resume_step, 31);
  ASSERT_EQ(back->transfers.size(), 1u);
  EXPECT_EQ(back->transfers[0].receiver, 5);
  EXPECT_EQ(back->transfers[0].sources, std::vector<int>{0});
  ASSERT_EQ(back->faults.size(), 1u);
  EXPECT_EQ(back->faults[0].id, 2);
  EXPECT_EQ(back->faults[0].step, 40);
  EXPECT_EQ(back->reason, "recovery");
}

TEST(MessagesTest, MissingFieldIsNamed) {
  auto r = DecodeJoin(R"({"worker_id": 1, "pid": 2, "spare": false, "state_step": -1})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("data_address"), std::string::npos) << r.status().ToString();
}

TEST(MessagesTest, IllTypedFieldAndGarbageAreErrorsNotCrashes) {
  EXPECT_FALSE(DecodeHeartbeat(R"({"step": "seven"})").ok());
  EXPECT_FALSE(DecodeHeartbeat("\x01\x02 not json").ok());
  EXPECT_FALSE(DecodePlan(R"({"generation": 1, "resume_step": 0, "members": [{"worker_id": "x"}]})").ok());
  EXPECT_FALSE(DecodeShutdown("[1,2,3]").ok());
}

}  // namespace
}  // namespace nonstop::control
