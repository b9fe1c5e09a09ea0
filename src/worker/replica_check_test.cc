#include "worker/replica_check.h"

#include <gtest/gtest.h>

#include <vector>

namespace nonstop::worker {
namespace {

// Members of one job: each its own copy of the same registered state.
struct Replicas {
  explicit Replicas(int n, int group = 0) : params(n), moments(n), step(n, 7), regs(n) {
    for (int q = 0; q < n; ++q) {
      params[q].assign(16, 0.5f);
      moments[q].assign(group > 0 ? 16 / group : 16, 0.25f);
      auto& reg = regs[q];
      EXPECT_TRUE(reg.RegisterFloats("params", params[q]).ok());
      if (group > 0) {
        EXPECT_TRUE(reg.RegisterShard("adamw.exp_avg", moments[q], group).ok());
        reg.set_held_shard(q % group);
      } else {
        EXPECT_TRUE(reg.RegisterFloats("adamw.exp_avg", moments[q]).ok());
      }
      EXPECT_TRUE(reg.RegisterValue("step", &step[q]).ok());
    }
  }
  ReplicaVerdict Compare() {
    std::vector<ReplicaRecord> records;
    std::vector<int> ids;
    for (size_t q = 0; q < regs.size(); ++q) {
      // through the wire format, as the members exchange them
      ReplicaRecord r = RecordOf(regs[q], step[q]);
      std::vector<std::byte> wire(ReplicaRecordBytes(regs[q]));
      EncodeReplicaRecord(r, wire);
      auto back = DecodeReplicaRecord(wire, regs[0]);
      EXPECT_TRUE(back.ok()) << back.status().ToString();
      records.push_back(*back);
      ids.push_back(static_cast<int>(10 + q));
    }
    return CompareReplicas(regs[0], records, ids);
  }
  static void Flip(std::vector<float>& v, size_t i) {
    reinterpret_cast<uint8_t*>(v.data())[4 * i + 2] ^= 2;
  }

  std::vector<std::vector<float>> params, moments;
  std::vector<int64_t> step;
  std::vector<state::StateRegistry> regs;
};

TEST(ReplicaCheckTest, EqualReplicasAgree) {
  Replicas r(4);
  EXPECT_TRUE(r.Compare().agree());
}

TEST(ReplicaCheckTest, OneFlippedBitInFourIsTheMinorityNamedWithItsTensor) {
  Replicas r(4);
  Replicas::Flip(r.params[2], 5);
  ReplicaVerdict v = r.Compare();
  ASSERT_FALSE(v.agree());
  EXPECT_FALSE(v.no_majority);
  EXPECT_EQ(v.diverged, std::vector<int>{2});
  EXPECT_NE(v.what.find("'params' on rank 2 (worker 12)"), std::string::npos) << v.what;
  EXPECT_NE(v.what.find("(3 of 4)"), std::string::npos) << v.what;
  EXPECT_EQ(v.what.find("exp_avg"), std::string::npos) << v.what;
}

// A per-rank region (a sample counter, a module's running statistics) is each member's own: it is
// never compared, while the replicated state beside it still is.
TEST(ReplicaCheckTest, PerRankRegionsAreNeverComparedAndTheRestStillIs) {
  Replicas r(4);
  std::vector<int64_t> samples = {100, 101, 102, 103};
  for (int q = 0; q < 4; ++q) {
    ASSERT_TRUE(r.regs[q].RegisterValue("samples_seen", &samples[q]).ok());
    ASSERT_TRUE(r.regs[q].MarkPerRank("samples_seen").ok());
  }
  EXPECT_TRUE(r.Compare().agree()) << r.Compare().what;
  EXPECT_EQ(r.regs[0].Digest(), r.regs[3].Digest()) << "per-rank values are left out of the digest";
  Replicas::Flip(r.params[1], 3);
  ReplicaVerdict v = r.Compare();
  ASSERT_FALSE(v.agree());
  EXPECT_EQ(v.diverged, std::vector<int>{1});
  EXPECT_EQ(v.what.find("samples_seen"), std::string::npos) << v.what;
  EXPECT_NE(r.regs[0].Digest(), r.regs[1].Digest());
}

TEST(ReplicaCheckTest, OnlyARegisteredReplicatedRegionCanBeMarkedPerRank) {
  Replicas sharded(2, 2);
  EXPECT_EQ(sharded.regs[0].MarkPerRank("adamw.exp_avg").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sharded.regs[0].MarkPerRank("no_such_region").code(), StatusCode::kNotFound);
  EXPECT_TRUE(sharded.regs[0].MarkPerRank("params").ok());
}

TEST(ReplicaCheckTest, TwoReplicasThatDisagreeHaveNoMajority) {
  Replicas r(2);
  Replicas::Flip(r.moments[1], 0);
  ReplicaVerdict v = r.Compare();
  EXPECT_TRUE(v.no_majority);
  EXPECT_TRUE(v.diverged.empty());
  EXPECT_NE(v.what.find("'adamw.exp_avg': no majority among rank 0 (worker 10)"), std::string::npos)
      << v.what;
}

TEST(ReplicaCheckTest, ATieOfTwoAgainstTwoHasNoMajority) {
  Replicas r(4);
  Replicas::Flip(r.params[2], 1);
  Replicas::Flip(r.params[3], 1);
  ReplicaVerdict v = r.Compare();
  EXPECT_TRUE(v.no_majority);
  EXPECT_TRUE(v.diverged.empty());
}

// A shard is compared only with its own replicas: 6 members in groups of 2 hold shard 0 on ranks
// 0, 2, 4 and shard 1 on 1, 3, 5; their moments differ from shard to shard by right.
TEST(ReplicaCheckTest, ShardsAreComparedAcrossTheirReplicasOnly) {
  Replicas r(6, 2);
  for (int q = 0; q < 6; ++q) r.moments[q].assign(8, q % 2 == 0 ? 0.25f : 0.75f);
  EXPECT_TRUE(r.Compare().agree());
  Replicas::Flip(r.moments[3], 7);
  ReplicaVerdict v = r.Compare();
  EXPECT_EQ(v.diverged, std::vector<int>{3});
  EXPECT_NE(v.what.find("'adamw.exp_avg' (shard 1) on rank 3 (worker 13)"), std::string::npos)
      << v.what;
  EXPECT_NE(v.what.find("(2 of 3)"), std::string::npos) << v.what;
}

// Two replicas of a shard (4 members, groups of 2): a flipped moment has no majority.
TEST(ReplicaCheckTest, TwoReplicasOfAShardThatDisagreeHaveNoMajority) {
  Replicas r(4, 2);
  Replicas::Flip(r.moments[0], 3);
  ReplicaVerdict v = r.Compare();
  EXPECT_TRUE(v.no_majority);
  EXPECT_NE(v.what.find("(shard 0): no majority"), std::string::npos) << v.what;
}

TEST(ReplicaCheckTest, AMemberOfAnotherStepIsTheMinority) {
  Replicas r(3);
  r.step[1] = 6;
  ReplicaVerdict v = r.Compare();
  EXPECT_EQ(v.diverged, std::vector<int>{1});
  EXPECT_NE(v.what.find("is step 6, the majority's (2 of 3) step 7"), std::string::npos) << v.what;
}

TEST(ReplicaCheckTest, ARecordOfAnotherLayoutIsDataLoss) {
  Replicas r(1);
  state::StateRegistry other;
  std::vector<float> x(4);
  ASSERT_TRUE(other.RegisterFloats("x", x).ok());
  std::vector<std::byte> wire(ReplicaRecordBytes(other));
  EncodeReplicaRecord(RecordOf(other, 3), wire);
  auto decoded = DecodeReplicaRecord(wire, r.regs[0]);
  EXPECT_EQ(decoded.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(decoded.status().message().find("must register the same state"), std::string::npos);
}

TEST(ReplicaCheckTest, ARecordDamagedOnItsWayIsDataLoss) {
  Replicas r(1);
  std::vector<std::byte> wire(ReplicaRecordBytes(r.regs[0]));
  EncodeReplicaRecord(RecordOf(r.regs[0], 3), wire);
  ASSERT_TRUE(DecodeReplicaRecord(wire, r.regs[0]).ok());
  wire[17] ^= std::byte{0x40};  // a region's CRC
  auto decoded = DecodeReplicaRecord(wire, r.regs[0]);
  EXPECT_EQ(decoded.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(decoded.status().message().find("damaged on its way"), std::string::npos);
}

}  // namespace
}  // namespace nonstop::worker
