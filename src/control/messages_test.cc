#include "control/messages.h"

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
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

TEST(MessagesTest, PlanCarriesTheShardMoves) {
  PlanMsg p;
  p.generation = 4;
  p.members = {{0, "127.0.0.1:1"}, {1, "127.0.0.1:2"}, {2, "127.0.0.1:3"}, {9, "127.0.0.1:4"}};
  p.resume_step = 12;
  p.shard_group = 2;
  p.shard_moves = {{9, 1, {1}}, {2, 0, {}}};
  const std::string wire = Encode(p);
  auto back = DecodePlan(wire);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->shard_group, 2);
  ASSERT_EQ(back->shard_moves.size(), 2u);
  EXPECT_EQ(back->shard_moves[0].receiver, 9);
  EXPECT_EQ(back->shard_moves[0].shard, 1);
  EXPECT_EQ(back->shard_moves[0].sources, std::vector<int>{1});
  EXPECT_TRUE(back->shard_moves[1].sources.empty())
      << "no source: every copy is lost, the workers say so";
  EXPECT_EQ(Encode(*back), wire);
  // Unsharded: neither field is on the wire, and a plan without them has none.
  PlanMsg plain;
  plain.members = {{0, "127.0.0.1:1"}};
  EXPECT_EQ(Encode(plain).find("shard"), std::string::npos) << Encode(plain);
  back = DecodePlan(Encode(plain));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->shard_group, 0);
  EXPECT_TRUE(back->shard_moves.empty());
}

// A plan's shard moves are never trusted: every field is checked, every list
// bounded by the members.
// A plan's members as "id@address" strings, for comparing whole lists.
std::vector<std::string> Listed(const PlanMsg& p) {
  std::vector<std::string> out;
  for (const auto& m : p.members) out.push_back(std::to_string(m.worker_id) + "@" + m.address);
  return out;
}

PlanMsg Generation(uint32_t generation, std::vector<int> ids) {
  PlanMsg p;
  p.generation = generation;
  for (int id : ids) p.members.push_back({id, "10.0.0." + std::to_string(id) + ":4000"});
  return p;
}

// Every kind of change between two generations (a spare takes a rank, ranks close up after a
// shrink, a grow appends, members reorder, a worker's address changes): the delta rebuilds the
// plan that the full encoding decodes to, field for field, and is small where little changed.
// Against no base, it is the whole plan in half the bytes of the full one.
TEST(MessagesTest, PlanDeltaRebuildsTheFullPlan) {
  std::vector<int> ids(1000);
  for (int i = 0; i < 1000; ++i) ids[static_cast<size_t>(i)] = i;
  const PlanMsg base = Generation(4, ids);
  std::vector<std::vector<int>> nexts;
  std::vector<int> replaced = ids;
  replaced[3] = 5000;  // a spare takes rank 3
  replaced[700] = 5001;
  nexts.push_back(replaced);
  std::vector<int> shrunk = ids;
  shrunk.erase(shrunk.begin() + 10, shrunk.begin() + 18);  // a host of 8 lost, no spare
  nexts.push_back(shrunk);
  std::vector<int> grown = ids;
  grown.push_back(6000);
  nexts.push_back(grown);
  std::vector<int> reordered(ids.rbegin(), ids.rend());
  nexts.push_back(reordered);
  for (const auto& next : nexts) {
    PlanMsg plan = Generation(5, next);
    plan.resume_step = 77;
    plan.reason = "recovery";
    plan.transfers = {{next[3], {0, 1}}};
    plan.faults = *ParseFaults("kill:rank=1,step=80", 2);
    plan.shard_group = 2;
    plan.shard_moves = {{next[3], 1, {1}}};
    auto full = DecodePlan(Encode(plan));
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    const std::string delta = EncodePlanDelta(plan, DiffMembers(plan, &base), plan.transfers);
    auto rebuilt = DecodePlanDelta(delta, &base);
    ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
    EXPECT_EQ(Listed(*rebuilt), Listed(*full));
    EXPECT_EQ(Encode(*rebuilt), Encode(*full)) << "every other field too";
    if (next != reordered) {
      EXPECT_LT(delta.size(), 500u) << "a few changes cost a few entries: " << delta;
    }
    const std::string alone = EncodePlanDelta(plan, DiffMembers(plan, nullptr), plan.transfers);
    auto whole = DecodePlanDelta(alone, nullptr);
    ASSERT_TRUE(whole.ok()) << whole.status().ToString();
    EXPECT_EQ(Encode(*whole), Encode(*full));
    EXPECT_LT(alone.size() * 3, Encode(plan).size() * 2) << "compact entries";
    // A worker that holds some plan (the base) reads a delta against none all the same.
    EXPECT_TRUE(DecodePlanDelta(alone, &base).ok());
  }
  // A worker whose address changed travels as an entry, never as a copy of its old address.
  PlanMsg moved = base;
  moved.generation = 5;
  moved.members[9].address = "10.9.9.9:4000";
  auto rebuilt = DecodePlanDelta(EncodePlanDelta(moved, DiffMembers(moved, &base), {}), &base);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
  EXPECT_EQ(rebuilt->members[9].address, "10.9.9.9:4000");
  EXPECT_EQ(Listed(*rebuilt), Listed(moved));
}

// A delta is applied only to the plan it names, and nothing in it is trusted.
TEST(MessagesTest, PlanDeltaRefusesAnotherBaseAndMalformedRuns) {
  const PlanMsg base = Generation(4, {0, 1, 2, 3});
  const PlanMsg next = Generation(5, {0, 1, 9, 3});
  const std::string delta = EncodePlanDelta(next, DiffMembers(next, &base), {});
  auto expect_refused = [](Result<PlanMsg> r, const std::string& words) {
    ASSERT_FALSE(r.ok()) << "accepted";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(words), std::string::npos) << r.status().message();
  };
  expect_refused(DecodePlanDelta(delta, nullptr), "names the plan this worker holds, but it holds");
  expect_refused(DecodePlanDelta(delta, &next), "is not the plan this worker holds");
  PlanMsg other_members = Generation(4, {0, 1, 2, 8});
  expect_refused(DecodePlanDelta(delta, &other_members), "is not the plan this worker holds");
  const std::string digest = fmt::format("{:016x}", MembersDigest(base.members));
  // `rebuilt`: the digest the delta claims for its member list (by default that of ranks 1-3).
  const std::string ranks_1_to_3 =
      fmt::format("{:016x}", MembersDigest(Generation(4, {1, 2, 3}).members));
  auto wire = [&](const std::string& v, const std::string& members, int world,
                  const std::string& rebuilt) {
    return fmt::format(
        R"({{"v": {}, "generation": 5, "resume_step": 1, "base_generation": 4, )"
        R"("base_digest": "{}", "world": {}, "digest": "{}", "members": [{}], "transfers": [], )"
        R"("faults": [], "reason": "recovery"}})",
        v, digest, world, rebuilt, members);
  };
  auto wire2 = [&](const std::string& members, int world) {
    return wire("2", members, world, ranks_1_to_3);
  };
  auto good = DecodePlanDelta(wire2(R"([1, 3])", 3), &base);
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(Listed(*good), Listed(Generation(4, {1, 2, 3})));
  expect_refused(DecodePlanDelta(wire("1", R"([1, 3])", 3, ranks_1_to_3), &base),
                 "field 'v' 1 is not a version this worker reads (2)");
  expect_refused(DecodePlanDelta(wire2(R"([2, 3])", 3), &base),
                 "'members[0]' copies 3 ranks from rank 2 of a base of 4 members");
  expect_refused(DecodePlanDelta(wire2(R"([0, 0])", 0), &base),
                 "copies 0 ranks from rank 0 of a base of 4 members");
  // A count near 2^64 is named as it is, not as a wrapped [from, from + count).
  expect_refused(DecodePlanDelta(wire2(R"([1, 18446744073709551615])", 4), &base),
                 "copies 18446744073709551615 ranks from rank 1 of a base of 4 members");
  // Each base rank is copied at most once, whatever the total: [0, 2] twice adds up to the base's
  // 4 ranks but copies ranks 0 and 1 twice.
  expect_refused(DecodePlanDelta(wire2(R"([0, 2], [0, 2])", 4), &base),
                 "'members[1]' copies rank 0 of the base again");
  expect_refused(DecodePlanDelta(wire2(R"([2, 2], [3, 1])", 3), &base),
                 "'members[1]' copies rank 3 of the base again");
  expect_refused(DecodePlanDelta(wire2(R"([0, 4], [0, 4])", 4), &base),
                 "'members[1]' copies rank 0 of the base again");
  expect_refused(DecodePlanDelta(wire2(R"([0, 4])", 1000000), &base),
                 "field 'world' 1000000 members from a base of 4 and 1 entries");
  expect_refused(DecodePlanDelta(wire2(R"([0, 4])", 3), &base),
                 "rebuild 4 members, but the delta says 3");
  expect_refused(DecodePlanDelta(wire2(R"([-1, 4])", 4), &base),
                 "field 'members[0][0]' must be an integer from 0");
  expect_refused(DecodePlanDelta(wire2(R"([7])", 1), &base),
                 "'members[0]' must be [from, count] or [worker_id, \"address\"], got an array");
  expect_refused(DecodePlanDelta(wire2(R"({"worker_id": 7})", 1), &base), "got an object");
  expect_refused(DecodePlanDelta(wire2(R"([1.5, "10.0.0.1:1"])", 1), &base),
                 "field 'members[0][0]' must be an integer");
  expect_refused(DecodePlanDelta("[1]", &base), "plan delta message is not a JSON object");
}

// A delta carries the digest of the member list it rebuilds: a well-formed delta that rebuilds
// another list than the plan's (an encoder bug, runs cached for another plan) is refused, naming
// both digests, where ValidatePlan would have accepted it.
TEST(MessagesTest, PlanDeltaRefusesAMemberListThatIsNotThePlans) {
  const PlanMsg base = Generation(4, {0, 1, 2, 3, 4, 5});
  const PlanMsg next = Generation(5, {0, 1, 9, 3, 4, 5});
  auto expect_wrong_list = [](Result<PlanMsg> r) {
    ASSERT_FALSE(r.ok()) << "accepted a wrong member list";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("field 'digest'"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("is not that of the 6 members the delta rebuilds"),
              std::string::npos)
        << r.status().message();
  };
  const PlanMembersDelta right = DiffMembers(next, &base);
  ASSERT_TRUE(DecodePlanDelta(EncodePlanDelta(next, right, {}), &base).ok());
  // An encoder that writes the runs in the wrong order: the same members, other ranks.
  PlanMembersDelta swapped = right;
  ASSERT_EQ(swapped.runs.size(), 3u);  // [0, 2], [9, "…"], [3, 3]
  std::swap(swapped.runs[0], swapped.runs[2]);
  expect_wrong_list(DecodePlanDelta(EncodePlanDelta(next, swapped, {}), &base));
  // One that copies the wrong base ranks.
  PlanMembersDelta shifted = right;
  shifted.runs[2].copy_from = 2;
  expect_wrong_list(DecodePlanDelta(EncodePlanDelta(next, shifted, {}), &base));
  // Runs computed for another plan of the same size (a stale cache), written into this one.
  const PlanMsg other = Generation(5, {0, 1, 2, 3, 4, 8});
  expect_wrong_list(DecodePlanDelta(EncodePlanDelta(next, DiffMembers(other, &base), {}), &base));
  // Against no base too: an entry dropped and another added.
  PlanMembersDelta alone = DiffMembers(next, nullptr);
  alone.runs[5].member.worker_id = 6;
  expect_wrong_list(DecodePlanDelta(EncodePlanDelta(next, alone, {}), nullptr));
}

// Whether a delta has a base is said by its fields, not by a generation number: a base of
// generation 0 is a base like any other, and a delta that names half a base is refused.
TEST(MessagesTest, PlanDeltaSaysExplicitlyWhetherItHasABase) {
  const PlanMsg zero = Generation(0, {0, 1, 2});
  const PlanMsg next = Generation(1, {0, 1, 7});
  const PlanMembersDelta members = DiffMembers(next, &zero);
  EXPECT_TRUE(members.has_base);
  const std::string delta = EncodePlanDelta(next, members, {});
  EXPECT_NE(delta.find(R"("base_generation":0)"), std::string::npos) << delta;
  auto rebuilt = DecodePlanDelta(delta, &zero);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
  EXPECT_EQ(Listed(*rebuilt), Listed(next));
  auto held_none = DecodePlanDelta(delta, nullptr);
  ASSERT_FALSE(held_none.ok()) << "a delta against generation 0 read as one against no base";
  EXPECT_NE(held_none.status().message().find("names the plan this worker holds, but it holds"),
            std::string::npos)
      << held_none.status().message();
  const std::string alone = EncodePlanDelta(next, DiffMembers(next, nullptr), {});
  EXPECT_EQ(alone.find("base_"), std::string::npos) << alone;
  std::string half = alone;
  half.insert(1, R"("base_generation": 3, )");
  auto refused = DecodePlanDelta(half, &zero);
  ASSERT_FALSE(refused.ok()) << "a base named by generation alone";
  EXPECT_NE(refused.status().message().find("field 'base_digest' is missing"), std::string::npos)
      << refused.status().message();
}

TEST(MessagesTest, MalformedShardMovesAreRefusedNamingTheField) {
  auto plan = [](const std::string& shard_fields) {
    return DecodePlan(
               R"({"generation": 1, "resume_step": 5, "members": [{"worker_id": 0, "address": "a:1"},
                          {"worker_id": 1, "address": "a:2"}], "transfers": [], "faults": [], "reason": "x", )" +
               shard_fields + "}")
        .status();
  };
  EXPECT_TRUE(
      plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": 1, "sources": [0]}])")
          .ok());
  const std::pair<Status, std::string> cases[] = {
      {plan(R"("shard_group": -1)"), "'shard_group' -1 is not a group size (0 to 1024)"},
      {plan(R"("shard_group": 1025)"), "'shard_group' 1025 is not a group size"},
      {plan(R"("shard_group": "2")"), "'shard_group' must be an integer"},
      {plan(R"("shard_group": 2, "shard_moves": {})"), "'shard_moves' must be an array"},
      {plan(R"("shard_moves": [{"receiver": 1, "shard": 0, "sources": [0]}])"),
       "'shard_moves[0].shard' names a shard, but the plan has no shard_group"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": 2, "sources": [0]}])"),
       "'shard_moves[0].shard' 2 is not a shard of groups of 2"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": -1, "sources": [0]}])"),
       "'shard_moves[0].shard' -1 is not a shard"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": -3, "shard": 1, "sources": [0]}])"),
       "'shard_moves[0].receiver' -3 is not a worker id"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": 1, "sources": [-1]}])"),
       "'shard_moves[0].sources[0]' -1 is not a worker id"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": 1, "sources": [0, 5]}])"),
       "'shard_moves[0].sources' has 2 sources for 2 members"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": 1, "sources": [0.5]}])"),
       "'shard_moves[0].sources[0]' must be an integer"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": 1}])"),
       "'shard_moves[0].sources' is missing"},
      {plan(R"("shard_group": 2, "shard_moves": [{"receiver": 1, "shard": 1, "sources": []},
                {"receiver": 0, "shard": 0, "sources": []}, {"receiver": 0, "shard": 0, "sources": []}])"),
       "'shard_moves' has 3 moves for 2 members"},
  };
  for (const auto& [status, why] : cases) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << why << ": " << status.ToString();
    EXPECT_NE(status.message().find(why), std::string::npos) << why << ": " << status.ToString();
  }
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
  EXPECT_FALSE(
      DecodePlan(R"({"generation": 1, "resume_step": 0, "members": [{"worker_id": "x"}]})").ok());
  EXPECT_FALSE(DecodeShutdown("[1,2,3]").ok());
}

// Found by fuzz_control: nlohmann's get<int>() converts any JSON number, so a
// float out of an integer's range was undefined behaviour (a float-to-int
// cast), and a negative generation or a 2^32 worker id wrapped silently.
TEST(MessagesTest, IntegerFieldsRefuseFloatsBoolsAndOutOfRangeValues) {
  std::vector<std::pair<Status, std::string>> cases = {
      {DecodeHeartbeat(R"({"step": 1e300, "waiting_ms": -1})").status(), "step"},
      {DecodeHeartbeat(R"({"step": 1.5, "waiting_ms": -1})").status(), "step"},
      {DecodeHeartbeat(R"({"step": true, "waiting_ms": -1})").status(), "step"},
      {DecodeHeartbeat(R"({"step": 1, "waiting_ms": 9223372036854775808})").status(), "waiting_ms"},
      {DecodeAbort(R"({"generation": -1, "reason": "x"})").status(), "generation"},
      {DecodeAbort(R"({"generation": 4294967296, "reason": "x"})").status(), "generation"},
      {DecodeJoin(
           R"({"worker_id": 2147483648, "pid": 2, "data_address": "a", "spare": false, "state_step": -1})")
           .status(),
       "worker_id"},
      {DecodeJoin(
           R"({"worker_id": 1, "pid": 2, "data_address": "a", "spare": 0, "state_step": -1})")
           .status(),
       "spare"},
      {DecodeRecovered(
           R"({"generation": 1, "connect_seconds": 0, "transfer_seconds": 0, "bytes_received": -1,
                           "sources": 1, "refetched_chunks": 0})")
           .status(),
       "bytes_received"},
      {DecodePlan(R"({"generation": 1, "resume_step": 0, "members": [], "transfers": [],
                      "faults": [{"id": 1e300, "spec": "kill:rank=1,step=2"}], "reason": "x"})")
           .status(),
       "faults"},
      {DecodePlan(
           R"({"generation": 1, "resume_step": 0, "members": {"a": {"worker_id": 1, "address": "x"}},
                      "transfers": [], "faults": [], "reason": "x"})")
           .status(),
       "members"},
  };
  for (const auto& [status, field] : cases) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find(field), std::string::npos)
        << field << ": " << status.ToString();
  }
}

// A worker may report a NaN or infinite loss (a diverged run): JSON has no
// such numbers, and the controller used to refuse the message it got.
TEST(MessagesTest, NonFiniteNumbersRoundTrip) {
  ProgressMsg p{7, std::numeric_limits<double>::quiet_NaN(), 0.5,
                std::numeric_limits<double>::infinity(), 2};
  auto back = DecodeProgress(Encode(p));
  ASSERT_TRUE(back.ok()) << back.status().ToString() << " " << Encode(p);
  EXPECT_TRUE(std::isnan(back->loss));
  EXPECT_EQ(back->tokens_per_second, std::numeric_limits<double>::infinity());
  RecoveredMsg r{3, -std::numeric_limits<double>::infinity(), 1.25, 10, 1, 0, 2, 5};
  auto r2 = DecodeRecovered(Encode(r));
  ASSERT_TRUE(r2.ok()) << r2.status().ToString();
  EXPECT_EQ(r2->connect_seconds, -std::numeric_limits<double>::infinity());
  EXPECT_EQ(r2->transfer_seconds, 1.25);
  EXPECT_FALSE(
      DecodeProgress(R"({"step": 1, "loss": "lots", "step_seconds": 1, "tokens_per_second": 1,
                                  "world_size": 1})")
          .ok());
}

// A step that ran a replica check says how long it took; one that did not leaves the field out.
TEST(MessagesTest, AProgressReportCarriesItsReplicaCheckTimeWhenOneRan) {
  ProgressMsg p{7, 1.5, 0.5, 100, 4};
  EXPECT_EQ(Encode(p).find("replica_check_ms"), std::string::npos);
  auto none = DecodeProgress(Encode(p));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->replica_check_ms, -1);
  p.replica_check_ms = 2.25;
  p.replica_crc_ms = 0.5;
  auto back = DecodeProgress(Encode(p));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->replica_check_ms, 2.25);
  EXPECT_EQ(back->replica_crc_ms, 0.5);
  auto bad = DecodeProgress(R"({"step": 1, "loss": 1, "step_seconds": 1, "tokens_per_second": 1,
                                "world_size": 1, "replica_check_ms": 1e12})");
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("replica_check_ms"), std::string::npos);
}

// Strings with invalid UTF-8 (an exception's message, say) made Encode throw
// nlohmann's type_error 316, an uncaught exception in the sender.
TEST(MessagesTest, EncodingInvalidUtf8ReplacesItInsteadOfThrowing) {
  FailureMsg f{1, 2, "bad \xff byte", 10};
  std::string encoded;
  EXPECT_NO_THROW(encoded = Encode(f));
  auto back = DecodeFailure(encoded);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->reason, "bad \xEF\xBF\xBD byte");  // U+FFFD
}

}  // namespace
}  // namespace nonstop::control

namespace nonstop::control {
namespace {

// ---- controller ↔ agent ----

TEST(AgentMessagesTest, RoundTrip) {
  AgentRegisterMsg reg{"host-a.1", 2, 1, "10.0.0.2", 42, 0};
  auto r = DecodeAgentRegister(Encode(reg));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->host_id, "host-a.1");
  EXPECT_EQ(r->nproc, 2);
  EXPECT_EQ(r->spares, 1);
  EXPECT_EQ(r->address, "10.0.0.2");
  AgentStartMsg start{7, true, 10, {{"NONSTOP_WORKER_ID", "7"}, {"NONSTOP_SPARE", "1"}}};
  auto s = DecodeAgentStart(Encode(start));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->worker_id, 7);
  EXPECT_TRUE(s->spare);
  EXPECT_EQ(s->nice, 10);
  EXPECT_EQ(s->env, start.env);
  auto e = DecodeAgentExited(Encode(AgentExitedMsg{7, 99, 0, 9}));
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->signal, 9);
  auto dying = DecodeAgentDying(Encode(AgentDyingMsg{7, 99}));
  ASSERT_TRUE(dying.ok()) << dying.status().ToString();
  EXPECT_EQ(dying->worker_id, 7);
  EXPECT_EQ(dying->pid, 99);
  EXPECT_FALSE(DecodeAgentDying(R"({"worker_id": -1, "pid": 99})").ok());
  JoinMsg join{3, 4, "10.0.0.2:5000", false, -1, "host-a.1"};
  auto j = DecodeJoin(Encode(join));
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->host_id, "host-a.1");
  // A join without host_id (a worker not started by an agent) is still a join.
  auto plain = DecodeJoin(
      R"({"worker_id": 1, "pid": 2, "data_address": "a", "spare": false, "state_step": -1})");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->host_id, "");
}

// `nonstop run`'s agent says its capacity follows the job; the controller
// tells each agent the ranks of its workers, for their output's prefix.
TEST(AgentMessagesTest, ElasticRegistrationAndRanks) {
  AgentRegisterMsg reg{"local", 2, 1, "127.0.0.1", 42, 0};
  auto fixed = DecodeAgentRegister(Encode(reg));
  ASSERT_TRUE(fixed.ok());
  EXPECT_FALSE(fixed->elastic) << "absent: a host of fixed slots";
  reg.elastic = true;
  auto elastic = DecodeAgentRegister(Encode(reg));
  ASSERT_TRUE(elastic.ok()) << elastic.status().ToString();
  EXPECT_TRUE(elastic->elastic);

  auto ranks = DecodeAgentRanks(Encode(AgentRanksMsg{7, {{4, 0}, {9, 2}}}));
  ASSERT_TRUE(ranks.ok()) << ranks.status().ToString();
  EXPECT_EQ(ranks->generation, 7u);
  EXPECT_EQ(ranks->ranks, (std::vector<std::pair<int, int>>{{4, 0}, {9, 2}}));
  auto none = DecodeAgentRanks(R"({"generation": 3, "ranks": []})");
  ASSERT_TRUE(none.ok()) << "an agent none of whose workers is a member";
  // A worker listed twice, or a negative rank, is refused with the field named.
  auto twice = DecodeAgentRanks(
      R"({"generation":3,"ranks":[{"worker_id":1,"rank":0},{"worker_id":1,"rank":1}]})");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("listed twice"), std::string::npos)
      << twice.status().ToString();
  auto negative = DecodeAgentRanks(R"({"generation":3,"ranks":[{"worker_id":1,"rank":-1}]})");
  ASSERT_FALSE(negative.ok());
  EXPECT_NE(negative.status().message().find("rank"), std::string::npos)
      << negative.status().ToString();

  auto leaving = DecodeAgentLeaving(Encode(AgentLeavingMsg{"SIGTERM"}));
  ASSERT_TRUE(leaving.ok()) << leaving.status().ToString();
  EXPECT_EQ(leaving->reason, "SIGTERM");
  // The reason ends up in the controller's lines: short, printable ASCII only.
  for (
      const char* bad :
      {R"({"reason": "SIG\nTERM"})", R"({"reason": 15})", R"({})",
       R"({"reason": "0123456789012345678901234567890123456789012345678901234567890123456789"})"}) {
    auto refused = DecodeAgentLeaving(bad);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("'reason'"), std::string::npos)
        << refused.status().ToString();
  }
}

// A worker and an agent that outlived their controller say what they hold
// when they join the one that leads now (docs/controller-failover.md).
TEST(MessagesTest, RejoinAfterAControllerLossCarriesGenerationAndProcesses) {
  JoinMsg join{3, 77, "10.0.0.2:5000", false, 41, "h1"};
  join.generation = 5;
  join.waiting = true;
  auto j = DecodeJoin(Encode(join));
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(j->generation, 5u);
  EXPECT_TRUE(j->waiting);
  EXPECT_EQ(j->state_step, 41);
  auto fresh = DecodeJoin(Encode(JoinMsg{3, 77, "10.0.0.2:5000", true, -1, ""}));
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->generation, 0u) << "a first join names no generation";
  EXPECT_FALSE(fresh->waiting);

  AgentRegisterMsg reg{"h1", 2, 1, "10.0.0.2", 42, 2};
  reg.workers = {{3, 1001}, {4, 1002}};
  auto r = DecodeAgentRegister(Encode(reg));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->workers.size(), 2u);
  EXPECT_EQ(r->workers[1].first, 4);
  EXPECT_EQ(r->workers[1].second, 1002);
  // A list that disagrees with the count, or names a bad pid, is refused with the field named.
  auto lying = DecodeAgentRegister(
      R"({"host_id":"h1","nproc":2,"spares":1,"address":"a","pid":4,"running":3,"workers":[{"worker_id":1,"pid":9}]})");
  ASSERT_FALSE(lying.ok());
  EXPECT_NE(lying.status().message().find("workers"), std::string::npos)
      << lying.status().ToString();
  auto bad_pid = DecodeAgentRegister(
      R"({"host_id":"h1","nproc":2,"spares":1,"address":"a","pid":4,"running":1,"workers":[{"worker_id":1,"pid":0}]})");
  EXPECT_FALSE(bad_pid.ok());
}

// A start order may set only NONSTOP_ variables and torchrun's: a controller (or whoever
// speaks on its connection) can never make an agent preload a library.
TEST(AgentMessagesTest, StartOrderRefusesForeignVariables) {
  for (const char* name :
       {"LD_PRELOAD", "PATH", "NONSTOP", "NONSTOP_A=B", "MASTER_PORT", "RANK_"}) {
    AgentStartMsg start{1, false, 0, {{name, "/tmp/evil.so"}}};
    auto s = DecodeAgentStart(Encode(start));
    ASSERT_FALSE(s.ok()) << name;
    EXPECT_NE(s.status().message().find("env[0].name"), std::string::npos) << s.status().ToString();
  }
  // torchrun's rank and job variables are the order's to set (the agent adds its host's own).
  AgentStartMsg torchrun{1, false, 0, {{"RANK", "2"}, {"TORCHELASTIC_RUN_ID", "job"}}};
  EXPECT_TRUE(DecodeAgentStart(Encode(torchrun)).ok());
  EXPECT_FALSE(DecodeAgentStart(R"({"worker_id": 1, "spare": false, "nice": 25, "env": []})").ok());
  EXPECT_FALSE(DecodeAgentSignal(R"({"worker_id": 1, "signal": 0})").ok());
  EXPECT_FALSE(DecodeAgentSignal(R"({"worker_id": -1, "signal": 9})").ok());
}

TEST(AgentMessagesTest, HostIdsAreChecked) {
  EXPECT_TRUE(CheckHostId("node-01.cluster_a").ok());
  EXPECT_FALSE(CheckHostId("").ok());
  EXPECT_FALSE(CheckHostId(std::string(65, 'a')).ok());
  EXPECT_FALSE(CheckHostId("a b").ok());
  EXPECT_FALSE(CheckHostId("a\nb").ok());
  auto r = DecodeAgentRegister(
      R"({"host_id": "x/y", "nproc": 1, "spares": 0, "address": "a", "pid": 1, "running": 0})");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("host_id"), std::string::npos) << r.status().ToString();
  EXPECT_FALSE(
      DecodeAgentRegister(R"({"host_id": "x", "nproc": -1, "spares": 0, "address": "a", "pid": 1,
                                       "running": 0})")
          .ok());
  EXPECT_FALSE(
      DecodeJoin(
          R"({"worker_id": 1, "pid": 2, "data_address": "a", "spare": false, "state_step": -1,
                              "host_id": "bad host"})")
          .ok());
}

TEST(StoreMessagesTest, RequestsAndAnswersRoundTripWithTheirBytes) {
  StoreRequestMsg m;
  m.client = "0123abcd";
  m.seq = 7;
  m.op = StoreOp::kCompareSet;
  m.keys = {"default_pg/ключ"};
  m.expected = std::string("\0\xff", 2);
  m.value = "desired";
  auto back = DecodeStoreRequest(Encode(m));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->client, m.client);
  EXPECT_EQ(back->seq, 7);
  EXPECT_EQ(back->op, StoreOp::kCompareSet);
  EXPECT_EQ(back->keys, m.keys);
  EXPECT_EQ(back->expected, m.expected);
  EXPECT_EQ(back->value, m.value);
  StoreRequestMsg wait;
  wait.client = "c";
  wait.seq = 1;
  wait.op = StoreOp::kWait;
  wait.keys = {"a", "b"};
  wait.timeout_ms = 1500;
  auto w = DecodeStoreRequest(Encode(wait));
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->keys, wait.keys);
  EXPECT_EQ(w->timeout_ms, 1500);
  StoreReplyMsg r{9, "timeout: the wait waited 5 ms", "timeout", std::string("\x01\x00", 2), -3};
  auto rb = DecodeStoreReply(Encode(r));
  ASSERT_TRUE(rb.ok()) << rb.status().ToString();
  EXPECT_EQ(rb->seq, 9);
  EXPECT_EQ(rb->error, r.error);
  EXPECT_EQ(rb->code, "timeout");
  EXPECT_EQ(rb->value, r.value);
  EXPECT_EQ(rb->number, -3);
}

TEST(StoreMessagesTest, AMalformedRequestIsRefusedNamingTheField) {
  const std::string big(4 * ((kMaxStoreValueBytes + 3) / 3) + 4, 'A');
  const std::pair<std::string, std::string> kBad[] = {
      {R"({"client":"c","seq":1,"op":"explode","keys":["k"]})", "'op'"},
      {R"({"client":"","seq":1,"op":"get","keys":["k"],"timeout_ms":0})", "'client'"},
      {R"({"client":"c","seq":0,"op":"get","keys":["k"],"timeout_ms":0})", "'seq'"},
      {R"({"client":"c","seq":1,"op":"get","keys":[],"timeout_ms":0})", "'keys'"},
      {R"({"client":"c","seq":1,"op":"set","keys":["a","b"],"value":""})", "'keys'"},
      {R"({"client":"c","seq":1,"op":"num_keys","keys":["a"]})", "'keys'"},
      {R"({"client":"c","seq":1,"op":"get","keys":[3],"timeout_ms":0})", "'keys[0]'"},
      {R"({"client":"c","seq":1,"op":"get","keys":["k"],"timeout_ms":-1})", "'timeout_ms'"},
      {R"({"client":"c","seq":1,"op":"get","keys":["k"]})", "'timeout_ms'"},
      {R"({"client":"c","seq":1,"op":"get","keys":["k"],"timeout_ms":9000000000000})",
       "'timeout_ms'"},
      {R"({"client":"c","seq":1,"op":"set","keys":["k"],"value":"@@@@"})", "'value'"},
      {R"({"client":"c","seq":1,"op":"set","keys":["k"],"value":")" + big + R"("})", "'value'"},
      {R"({"client":"c","seq":1,"op":"set","keys":[")" + std::string(kMaxStoreKeyBytes + 1, 'k') +
           R"("],"value":""})",
       "'keys[0]'"},
  };
  std::string keys = R"({"client":"c","seq":1,"op":"wait","timeout_ms":0,"keys":[)";
  for (int i = 0; i < 17; ++i) keys += (i ? "," : "") + ("\"" + std::string(4000, 'a' + i) + "\"");
  keys += "]}";
  auto many = DecodeStoreRequest(keys);
  ASSERT_FALSE(many.ok()) << "17 keys of 4,000 bytes: over 64 KiB in one request";
  EXPECT_NE(many.status().message().find("'keys'"), std::string::npos) << many.status().ToString();
  for (const auto& [payload, field] : kBad) {
    auto m = DecodeStoreRequest(payload);
    ASSERT_FALSE(m.ok()) << payload.substr(0, 120);
    EXPECT_NE(m.status().message().find(field), std::string::npos)
        << payload.substr(0, 120) << ": " << m.status().ToString();
  }
}

}  // namespace
}  // namespace nonstop::control
