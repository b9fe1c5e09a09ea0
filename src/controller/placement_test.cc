// Placement's books and decisions: slots, where new workers and spares go,
// which hosts are responsive, which shards sit on one host.
#include "controller/placement.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "nonstop/state.h"

namespace nonstop::controller {
namespace {

const Clock::time_point kT0 = Clock::time_point() + std::chrono::hours(1);

// Hosts h1 (2 workers), h2 (0 workers, 2 spares), h3 (1 worker, 1 spare), alive, registered in that
// order.
Placement ThreeHosts() {
  Placement p;
  for (auto [id, nproc, spares] : {std::tuple{"h1", 2, 0}, {"h2", 0, 2}, {"h3", 1, 1}}) {
    HostInfo& h = p.AddHost(id);
    h.nproc = nproc;
    h.spares = spares;
    h.last_heard = kT0;
    p.MarkAlive(h);
  }
  p.SetPlaced();
  return p;
}

using Slots = std::vector<std::pair<std::string, bool>>;
Slots Of(const std::vector<Placement::Slot>& slots) {
  Slots out;
  for (const auto& s : slots) out.emplace_back(s.host_id, s.spare);
  return out;
}

TEST(PlacementTest, HostsKeepTheirRegistrationOrder) {
  Placement p = ThreeHosts();
  EXPECT_EQ(p.host_order(), (std::vector<std::string>{"h1", "h2", "h3"}));
  ASSERT_EQ(p.host_list().size(), 3u);
  EXPECT_EQ(p.host_list()[2]->host_id, "h3");
  EXPECT_EQ(p.alive_hosts(), 3);
  p.MarkDown(p.host("h2"));
  EXPECT_EQ(p.alive_hosts(), 2);
  EXPECT_FALSE(p.hosts().at("h2").alive);
  EXPECT_TRUE(p.slotted());
  EXPECT_EQ(p.pool_size(), 0);
  p.SetElasticHost("h1", 2);
  EXPECT_FALSE(p.slotted()) << "a job whose one host is elastic starts what it needs there";
  EXPECT_EQ(p.elastic_host(), "h1");
  EXPECT_EQ(p.pool_size(), 2) << "the elastic host's spares: the pool kept full";
}

TEST(PlacementTest, ThePlacementStartsWorkersThenSparesWhereSlotsAreFree) {
  Placement p = ThreeHosts();
  EXPECT_EQ(p.PlacedWorld(), 3);
  EXPECT_EQ(
      Of(p.PlaceAll()),
      (Slots{
          {"h1", false}, {"h1", false}, {"h2", true}, {"h2", true}, {"h3", false}, {"h3", true}}));
  p.Started(10, "h1");  // a process still running there from before
  p.MarkDown(p.host("h2"));
  p.host("h3").leaving = true;  // its capacity is taken back: no slot, and out of the world
  EXPECT_EQ(p.PlacedWorld(), 2);
  EXPECT_EQ(Of(p.PlaceAll()), (Slots{{"h1", false}}));
}

TEST(PlacementTest, FreeSlotsCountLiveProcessesAndWithheldSlots) {
  Placement p = ThreeHosts();
  const HostInfo& h3 = p.hosts().at("h3");
  EXPECT_EQ(p.FreeSlots(h3), 2);
  p.Started(1, "h3");
  EXPECT_TRUE(p.IsLive(1));
  EXPECT_EQ(p.HostOf(1), "h3");
  EXPECT_EQ(p.FreeSlots(h3), 1);
  p.MarkLive(1);  // once only
  EXPECT_EQ(p.FreeSlots(h3), 1);
  p.Withhold("h3");
  EXPECT_EQ(p.FreeSlots(h3), 0);
  p.Withhold("h3");
  EXPECT_EQ(p.FreeSlots(h3), 0) << "never negative";
  p.ClearWithheld();
  p.MarkEnded(1);
  p.MarkEnded(1);
  EXPECT_EQ(p.FreeSlots(h3), 2);
  EXPECT_FALSE(p.IsLive(1));
  EXPECT_EQ(p.HostOf(1), "h3") << "where it ran stays known";
  EXPECT_EQ(p.HostOf(2), "");
}

TEST(PlacementTest, TopUpFillsTheFreeSlotsOfJoinedHostsWhoseSparesDoNotKeepDying) {
  Placement p = ThreeHosts();
  for (int id = 0; id < 6; ++id) p.Started(id, id < 2 ? "h1" : id < 4 ? "h2" : "h3");
  EXPECT_TRUE(p.TopUpTargets().empty()) << "every slot is taken";
  p.MarkEnded(0);
  p.MarkEnded(2);
  p.MarkEnded(3);
  p.MarkEnded(5);
  EXPECT_EQ(p.TopUpTargets(), (std::vector<std::string>{"h1", "h2", "h2", "h3"}));
  p.host("h2").inherited = true;  // takes orders once its agent has joined this controller
  for (int i = 0; i < 4; ++i) p.HostRefillFailed("h3");
  EXPECT_EQ(p.TopUpTargets(), (std::vector<std::string>{"h1"}));
  p.HostRefillsResume("h3");
  p.MarkDown(p.host("h1"));
  EXPECT_EQ(p.TopUpTargets(), (std::vector<std::string>{"h3"}));
  // Spares that joined and then failed while they waited (a device's health check): a join
  // does not clear them, only the host's registering again does.
  for (int i = 0; i < 3; ++i) p.SpareFailedWhileWaiting("h3");
  p.HostRefillsResume("h3");
  EXPECT_EQ(p.TopUpTargets(), (std::vector<std::string>{"h3"})) << "3 are tolerated";
  p.SpareFailedWhileWaiting("h3");
  p.HostRefillsResume("h3");  // a spare joined there meanwhile
  EXPECT_TRUE(p.TopUpTargets().empty()) << "the fourth stops its refills";
  p.HostRegistered("h3");
  EXPECT_EQ(p.TopUpTargets(), (std::vector<std::string>{"h3"}));
}

TEST(PlacementTest, AReplacementGoesToTheFirstLiveHostWithAFreeSlot) {
  Placement p = ThreeHosts();
  for (int id = 0; id < 2; ++id) p.Started(id, "h1");
  ASSERT_NE(p.FirstHostWithFreeSlot(), nullptr);
  EXPECT_EQ(p.FirstHostWithFreeSlot()->host_id, "h2");
  p.MarkDown(p.host("h2"));
  EXPECT_EQ(p.FirstHostWithFreeSlot()->host_id, "h3");
  p.host("h3").leaving = true;
  EXPECT_EQ(p.FirstHostWithFreeSlot(), nullptr);
}

TEST(PlacementTest, AResponsiveHostWasHeardFromWithinHalfTheHeartbeatTimeout) {
  Placement p = ThreeHosts();
  const Millis timeout(1'000);
  EXPECT_TRUE(p.HostResponsive("", kT0 + Millis(99'000), timeout)) << "joined by hand";
  EXPECT_TRUE(p.HostResponsive("h1", kT0 + Millis(500), timeout));
  EXPECT_FALSE(p.HostResponsive("h1", kT0 + Millis(501), timeout));
  EXPECT_FALSE(p.HostResponsive("hX", kT0, timeout));
  p.host("h2").inherited = true;
  p.host("h3").leaving = true;
  EXPECT_FALSE(p.HostResponsive("h2", kT0, timeout));
  EXPECT_FALSE(p.HostResponsive("h3", kT0, timeout));
  p.MarkDown(p.host("h1"));
  EXPECT_FALSE(p.HostResponsive("h1", kT0, timeout));
}

TEST(PlacementTest, ExposedShardsAreThoseWhoseEveryCopyIsOnOneHost) {
  struct Case {
    std::string name;
    std::vector<std::string> host_of_rank;
    int shard_group;
    std::vector<int> want;
  };
  const Case kCases[] = {
      {"NothingSharded", {"a", "b"}, 0, {}},
      {"OneHostHoldsAllAnyway", {"a", "a", "a", "a"}, 2, {}},
      // Groups of 2 over 4 ranks: shard 0 on ranks 0 and 2, shard 1 on ranks 1 and 3.
      {"ReplicasOnTwoHosts", {"a", "a", "b", "b"}, 2, {}},
      {"ReplicasOnOneHost", {"a", "b", "a", "b"}, 2, {0, 1}},
      {"OneExposed", {"a", "b", "a", "c"}, 2, {0}},
      {"NotWholeGroups", {"a", "b", "a"}, 2, {}},
  };
  for (const Case& c : kCases) {
    std::vector<WorkerInfo> ws(c.host_of_rank.size());
    std::vector<WorkerInfo*> members;
    for (size_t r = 0; r < ws.size(); ++r) {
      ws[r].host = c.host_of_rank[r];
      members.push_back(&ws[r]);
    }
    EXPECT_EQ(ExposedShards(members, c.shard_group), c.want) << c.name;
  }
}

}  // namespace
}  // namespace nonstop::controller
