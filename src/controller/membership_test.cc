// Membership's books: roles through SetRole keep the pending workers and the
// spare count; the members by rank keep pointers to their entries.
#include "controller/membership.h"

#include <gtest/gtest.h>

namespace nonstop::controller {
namespace {

WorkerInfo& Add(Membership& m, int id, WorkerRole role) {
  WorkerInfo& w = m.at(id);
  w.worker_id = id;
  w.role = WorkerRole::kGone;  // counted nowhere yet
  m.SetRole(w, role);
  return w;
}

TEST(MembershipTest, SetRoleKeepsThePendingWorkersAndTheSpareCount) {
  Membership m;
  Add(m, 3, WorkerRole::kPending);
  Add(m, 1, WorkerRole::kPending);
  WorkerInfo& spare = Add(m, 2, WorkerRole::kSpare);
  EXPECT_EQ(m.pending(), (std::set<int>{1, 3}));
  EXPECT_EQ(m.spare_count(), 1);
  m.SetRole(spare, WorkerRole::kPending);  // a spare takes a forming worker's place
  EXPECT_EQ(m.pending(), (std::set<int>{1, 2, 3}));
  EXPECT_EQ(m.spare_count(), 0);
  m.SetRole(m.at(1), WorkerRole::kMember);
  m.SetRole(m.at(1), WorkerRole::kMember);
  m.SetRole(m.at(3), WorkerRole::kSpare);
  EXPECT_EQ(m.pending(), (std::set<int>{2}));
  EXPECT_EQ(m.spare_count(), 1);
}

TEST(MembershipTest, MembersByRankPointAtTheirEntries) {
  Membership m;
  for (int id : {4, 7, 9}) Add(m, id, WorkerRole::kMember).rank = id == 4 ? 1 : id == 9 ? 0 : 2;
  m.SetMembers({9, 4, 7});
  ASSERT_EQ(m.member_info().size(), 3u);
  EXPECT_EQ(m.member_info()[0], m.Find(9));
  EXPECT_EQ(m.member_info()[2], m.Find(7));
  EXPECT_EQ(m.RankOf(4), 1);
  m.SetRole(m.at(4), WorkerRole::kGone);
  EXPECT_EQ(m.RankOf(4), -1) << "gone: no rank";
  EXPECT_EQ(m.RankOf(12), -1);
  m.SetMembers({7}, {m.Find(7)});
  EXPECT_EQ(m.members(), (std::vector<int>{7}));
  EXPECT_EQ(m.member_info()[0], m.Find(7));
}

TEST(MembershipTest, AdoptionIsPendingWhileAnInheritedWorkerMayStillJoin) {
  Membership m;
  EXPECT_FALSE(m.AdoptionPending());
  Add(m, 1, WorkerRole::kMember);
  m.unconfirmed() = {1, 5};
  EXPECT_TRUE(m.AdoptionPending());
  m.unconfirmed().erase(5);  // 5 joined
  EXPECT_TRUE(m.AdoptionPending());
  m.SetRole(m.at(1), WorkerRole::kGone);  // lost at the adoption bound
  EXPECT_FALSE(m.AdoptionPending());
}

TEST(MembershipTest, WorkerIdsAreNeverReused) {
  Membership m;
  EXPECT_EQ(m.NewWorkerId(), 0);
  m.UseIdsBelow(8);
  EXPECT_EQ(m.NewWorkerId(), 8);
  m.UseIdsBelow(3);
  EXPECT_EQ(m.NewWorkerId(), 9);
}

TEST(MembershipTest, DescribeNamesRankOrSpareAndTheHost) {
  WorkerInfo w;
  w.worker_id = 5;
  w.pid = 1005;
  w.rank = 2;
  w.host = "h1";
  EXPECT_EQ(Describe(w, ""), "rank 2 (worker 5, pid 1005 on host h1)");
  EXPECT_EQ(Describe(w, "h1"), "rank 2 (worker 5, pid 1005)") << "the elastic host is this machine";
  w.rank = -1;
  w.host.clear();
  EXPECT_EQ(Describe(w, ""), "spare worker 5 (pid 1005)");
}

}  // namespace
}  // namespace nonstop::controller
