// torch.distributed's subgroups: made over some ranks, kept while their workers hold them.
#include "worker/user_groups.h"
#include "common/role_keys.h"

#include <gtest/gtest.h>

#include "collective/tcp_data_plane.h"

namespace nonstop::worker {
namespace {

// A world of three ranks (workers 10, 11, 12) seen from rank 0: its communicator is never
// connected.
struct World {
  net::AbortSignal abort;
  std::unique_ptr<collective::TcpDataPlane> plane;
  std::unique_ptr<collective::Communicator> comm;

  World() {
    auto listener = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(listener.ok());
    const std::string at = listener->address.ToString();
    plane = collective::TcpDataPlane::Create({WorkerDataKey(crypto::JobKey("token")), 10},
                                             std::move(*listener), &abort);
    collective::CommunicatorOptions o;
    o.rank = 0;
    o.members = {{10, at}, {11, at}, {12, at}};
    comm = plane->NewCommunicator(o);
  }
};

TEST(UserGroupsTest, AGroupWorksOnWhileItsWorkersHoldItsRanks) {
  World world;
  UserGroups groups;
  const std::vector<int> members = {10, 11, 12};
  Result<int> id = groups.Add({0, 2}, members, 0);
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  Result<collective::Communicator*> comm = groups.Get(*id, *world.comm, members);
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  EXPECT_EQ((*comm)->world_size(), 2);
  EXPECT_EQ((*comm)->rank(), 0);
  // Rank 1 was replaced: the group of ranks 0 and 2 is untouched.
  groups.NewGeneration();
  const std::vector<int> after_a_kill = {10, 13, 12};
  EXPECT_TRUE(groups.Get(*id, *world.comm, after_a_kill).ok());
  // A shrink that moved worker 12 to rank 1: the group's rank 2 is gone.
  groups.NewGeneration();
  const std::vector<int> shrunk = {10, 12};
  Result<collective::Communicator*> gone = groups.Get(*id, *world.comm, shrunk);
  ASSERT_EQ(gone.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(gone.status().message().find("worker 12 held rank 2"), std::string::npos)
      << gone.status().ToString();
  EXPECT_NE(gone.status().message().find("new_group"), std::string::npos);
}

TEST(UserGroupsTest, ABadGroupIsRefusedNamingWhy) {
  UserGroups groups;
  const std::vector<int> members = {10, 11, 12};
  EXPECT_EQ(groups.Add({0, 0}, members, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(groups.Add({0, 3}, members, 0).status().code(), StatusCode::kInvalidArgument);
  Result<int> outside = groups.Add({1, 2}, members, 0);
  ASSERT_EQ(outside.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("not one of them"), std::string::npos);
  World world;
  EXPECT_EQ(groups.Get(1, *world.comm, members).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace nonstop::worker
