#include "controller/plan_wire.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace nonstop::controller {
namespace {

std::shared_ptr<const control::PlanMsg> Plan(uint32_t generation, const std::vector<int>& ids) {
  auto p = std::make_shared<control::PlanMsg>();
  p->generation = generation;
  p->resume_step = generation * 10;
  p->reason = "recovery";
  for (int id : ids) p->members.push_back({id, "10.0.0.1:" + std::to_string(4000 + id)});
  return p;
}

std::vector<int> Range(int from, int to) {
  std::vector<int> out;
  for (int i = from; i < to; ++i) out.push_back(i);
  return out;
}

// What a worker does with a frame: it decodes it against the plan it holds.
control::PlanMsg Receive(const PlanWire::Frame& f, const control::PlanMsg* held) {
  EXPECT_EQ(f.type, control::kMsgPlanDelta);
  Result<control::PlanMsg> r = control::DecodePlanDelta(*f.payload, held);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : control::PlanMsg{};
}

// The base a frame was written against: 0 for none.
uint32_t BaseOf(const PlanWire::Frame& f) {
  const nlohmann::json j = nlohmann::json::parse(*f.payload);
  EXPECT_EQ(j.contains("base_generation"), j.contains("base_digest")) << "a base is named whole";
  return j.contains("base_generation") ? j.at("base_generation").get<uint32_t>() : 0;
}

// `plan` with only the transfers `worker_id` takes part in.
std::string OwnPart(control::PlanMsg plan, int worker_id) {
  std::vector<control::PlanTransfer> own;
  for (const auto& t : plan.transfers) {
    if (t.receiver == worker_id ||
        std::find(t.sources.begin(), t.sources.end(), worker_id) != t.sources.end()) {
      own.push_back(t);
    }
  }
  plan.transfers = own;
  return control::Encode(plan);
}

// The first plan goes out against no base; the next one against the first to every member that
// received the first on the connection it is still on, with only its own transfers, and against
// no base to the others: a spare that takes a rank, a worker that dialed again, one whose send
// failed. Every member ends holding the plan, with the transfers it takes part in.
TEST(PlanWireTest, MembersThatHoldThePreviousPlanGetADelta) {
  PlanWire wire;
  auto first = Plan(1, Range(0, 200));
  std::vector<control::PlanMsg> held(300);
  for (int id = 0; id < 200; ++id) {
    PlanWire::Frame f = wire.For(id, 1000 + id, first);
    EXPECT_EQ(BaseOf(f), 0u) << "nobody holds a plan yet";
    held[static_cast<size_t>(id)] = Receive(f, nullptr);
    wire.Sent(id, 1000 + id, /*ok=*/id != 7);  // worker 7's send failed
  }
  EXPECT_EQ(control::Encode(held[3]), control::Encode(*first));
  std::vector<int> next_ids = Range(0, 200);
  next_ids[50] = 250;  // a spare takes the rank of worker 50, copying from workers 1 and 2
  auto second_plan = std::make_shared<control::PlanMsg>(*Plan(2, next_ids));
  second_plan->transfers = {{250, {1, 2}}};
  std::shared_ptr<const control::PlanMsg> second = second_plan;
  const size_t full_bytes = control::Encode(*second).size();
  size_t delta_bytes = 0;
  for (int id : next_ids) {
    const uint64_t connection = id == 9 ? 5 : 1000 + id;  // worker 9 dialed again
    PlanWire::Frame f = wire.For(id, connection, second);
    const bool against_none = id == 250 || id == 7 || id == 9;
    EXPECT_EQ(BaseOf(f), against_none ? 0u : 1u) << "worker " << id;
    if (!against_none) delta_bytes = std::max(delta_bytes, f.payload->size());
    control::PlanMsg got = Receive(f, &held[static_cast<size_t>(id)]);
    EXPECT_EQ(control::Encode(got), against_none ? control::Encode(*second) : OwnPart(*second, id))
        << "worker " << id;
    held[static_cast<size_t>(id)] = got;
    wire.Sent(id, connection, true);
  }
  EXPECT_GT(delta_bytes, 0u);
  EXPECT_LT(delta_bytes * 10, full_bytes) << "one change costs a few entries, not the list";
  // A member that missed a plan (it was a spare in generation 2, or its frame was lost with its
  // connection) holds an older one: it gets the plan against none.
  auto third = Plan(3, Range(0, 200));
  EXPECT_EQ(BaseOf(wire.For(50, 1050, third)), 0u) << "50 left in generation 2";
  EXPECT_EQ(BaseOf(wire.For(1, 1001, third)), 2u);
  EXPECT_EQ(BaseOf(wire.For(1, 0, third)), 0u) << "no connection known";
}

// Every frame carries the digest of the plan's own member list, whichever payload it is (against
// none, the shared delta, a receiver's own), so a worker can check what it rebuilt.
TEST(PlanWireTest, EveryFrameCarriesTheDigestOfThePlansMembers) {
  PlanWire wire;
  auto first = Plan(1, Range(0, 20));
  for (int id = 0; id < 20; ++id) {
    wire.For(id, 100 + id, first);
    wire.Sent(id, 100 + id, true);
  }
  std::vector<int> next_ids = Range(0, 20);
  next_ids[5] = 30;
  auto second_plan = std::make_shared<control::PlanMsg>(*Plan(2, next_ids));
  second_plan->transfers = {{30, {1}}};
  std::shared_ptr<const control::PlanMsg> second = second_plan;
  const std::string want = fmt::format("{:016x}", control::MembersDigest(second->members));
  for (int id : {30, 1, 2}) {  // against none, a source's own delta, the shared delta
    PlanWire::Frame f = wire.For(id, 100 + id, second);
    EXPECT_EQ(nlohmann::json::parse(*f.payload).at("digest").get<std::string>(), want)
        << "worker " << id;
  }
}

// A worker that has gone (it left the job, or its send failed) is forgotten within two plans: the
// workers remembered are at most the members of the previous plan and the current one.
TEST(PlanWireTest, WorkersNoLongerInThePlansAreForgotten) {
  PlanWire wire;
  auto send_all = [&wire](const std::shared_ptr<const control::PlanMsg>& plan) {
    for (const auto& m : plan->members) {
      const uint64_t connection = 1000 + static_cast<uint64_t>(m.worker_id);
      wire.For(m.worker_id, connection, plan);
      wire.Sent(m.worker_id, connection, true);
    }
  };
  send_all(Plan(1, Range(0, 100)));
  EXPECT_EQ(wire.held_size(), 100u);
  send_all(Plan(2, Range(0, 50)));  // half the job left
  EXPECT_EQ(wire.held_size(), 100u) << "50 hold plan 2, 50 plan 1, the previous one";
  auto third = Plan(3, Range(0, 50));
  send_all(third);
  EXPECT_EQ(wire.held_size(), 50u) << "the workers that left are forgotten";
  // One of those that stayed still gets a delta; one that left and comes back, the whole plan.
  auto fourth = Plan(4, Range(0, 100));
  EXPECT_EQ(BaseOf(wire.For(3, 1003, fourth)), 3u);
  EXPECT_EQ(BaseOf(wire.For(70, 1070, fourth)), 0u);
}

}  // namespace
}  // namespace nonstop::controller
