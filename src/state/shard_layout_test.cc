// The layout of sharded optimizer state (issue 12): every group holds every
// shard once; with ranks numbered host by host (as the controller does) a
// host's ranks share groups and the replicas of a shard are spread over hosts.
#include "state/shard_layout.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace nonstop::state {
namespace {

std::vector<std::string> Hosts(const std::vector<std::pair<std::string, int>>& per_host) {
  std::vector<std::string> out;
  for (const auto& [host, n] : per_host) out.insert(out.end(), static_cast<size_t>(n), host);
  return out;
}

void ExpectEveryGroupHoldsEveryShardOnce(const ShardLayout& l) {
  std::set<std::pair<int, int>> seen;
  for (int r = 0; r < l.world(); ++r) {
    EXPECT_TRUE(seen.insert({l.group_of_rank[static_cast<size_t>(r)],
                             l.shard_of_rank[static_cast<size_t>(r)]})
                    .second)
        << "rank " << r;
  }
  EXPECT_EQ(seen.size(), static_cast<size_t>(l.world()));
  for (int g = 0; g < l.groups(); ++g) {
    for (int r : l.Group(g)) EXPECT_GE(r, 0) << "group " << g << " misses a shard";
  }
}

TEST(ShardLayoutTest, TwoHostsOfFourWithGroupsOfTwoKeepEachShardOnBothHosts) {
  auto hosts = Hosts({{"a", 4}, {"b", 4}});
  auto l = LayoutOf(8, 2);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  ExpectEveryGroupHoldsEveryShardOnce(*l);
  EXPECT_EQ(l->groups(), 4);
  EXPECT_TRUE(ShardsOnOneHost(*l, hosts).empty());
  for (int g = 0; g < l->groups(); ++g) {
    std::set<std::string> group_hosts;
    for (int r : l->Group(g)) group_hosts.insert(hosts[static_cast<size_t>(r)]);
    EXPECT_EQ(group_hosts.size(), 1u) << "group " << g << " stays on one host";
  }
}

// A spare on another host takes a rank: the layout does not change (nothing
// re-shards), and the check says when the replicas of a shard then share a host.
TEST(ShardLayoutTest, TheLayoutIsTheRanksSoAReplacementMovesNothing) {
  auto l = LayoutOf(4, 2);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->shard_of_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(l->group_of_rank, (std::vector<int>{0, 0, 1, 1}));
  std::vector<std::string> before = {"a", "a", "b", "b"};
  EXPECT_TRUE(ShardsOnOneHost(*l, before).empty());
  std::vector<std::string> after = {"a", "a", "b", "a"};  // rank 3's spare ran on host a
  EXPECT_EQ(ShardsOnOneHost(*l, after), (std::vector<int>{1}))
      << "both copies of shard 1 are on a now";
}

TEST(ShardLayoutTest, OneHostHoldingEveryReplicaIsReported) {
  auto one = Hosts({{"a", 4}});
  auto l = LayoutOf(4, 2);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(ShardsOnOneHost(*l, one), (std::vector<int>{0, 1}));
  // Three hosts of 2 with groups of 2: every shard has a replica on each host.
  auto three = Hosts({{"a", 2}, {"b", 2}, {"c", 2}});
  auto l3 = LayoutOf(6, 2);
  ASSERT_TRUE(l3.ok());
  for (int s = 0; s < 2; ++s) {
    std::set<std::string> where;
    for (int r : l3->Replicas(s)) where.insert(three[static_cast<size_t>(r)]);
    EXPECT_EQ(where.size(), 3u) << "shard " << s;
  }
}

TEST(ShardLayoutTest, AWorldThatIsNotAMultipleOfTheGroupIsRefusedWithTheFix) {
  auto l = LayoutOf(3, 2);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("a world of 3 cannot be split into shard groups of 2"),
            std::string::npos)
      << l.status().ToString();
  EXPECT_NE(l.status().message().find("--world-increment 2"), std::string::npos);
  EXPECT_FALSE(LayoutOf(2, 0).ok());
}

TEST(ShardLayoutTest, SourcesOfAShardAreItsLiveReplicasAndNoneWhenEveryCopyIsGone) {
  auto l = LayoutOf(4, 2);
  ASSERT_TRUE(l.ok());
  std::vector<int> replicas = l->Replicas(1);
  ASSERT_EQ(replicas.size(), 2u);
  bool flags[4] = {true, true, true, true};
  EXPECT_EQ(SourcesOfShard(*l, std::span<const bool>(flags, 4), 1), replicas);
  flags[replicas[0]] = false;
  EXPECT_EQ(SourcesOfShard(*l, std::span<const bool>(flags, 4), 1),
            (std::vector<int>{replicas[1]}));
  flags[replicas[1]] = false;
  EXPECT_TRUE(SourcesOfShard(*l, std::span<const bool>(flags, 4), 1).empty())
      << "both holders of shard 1 lost";
  EXPECT_EQ(SourcesOfShard(*l, std::span<const bool>(flags, 4), 0).size(), 2u)
      << "shard 0 is untouched";
}

}  // namespace
}  // namespace nonstop::state
