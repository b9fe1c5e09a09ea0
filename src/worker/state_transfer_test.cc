// State transfer over real communicators on loopback, one thread per rank:
// RunStateTransfers (a newcomer copies the whole state from its sources,
// docs/recovery.md), with honest sources and with sources that lie, and the
// sharded ExchangeShards (docs/sharding.md).
#include "worker/state_transfer.h"
#include "common/role_keys.h"

#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <span>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "collective/tcp_data_plane.h"
#include "common/coding.h"
#include "common/crypto.h"
#include "net/socket.h"
#include "nonstop/crc32c.h"
#include "state/protected_device_testing.h"

namespace nonstop::worker {
namespace {

// A source's header, as state_transfer.cc sends it.
constexpr size_t kHeaderBytes = 60;

constexpr char kToken[] = "test-token";
constexpr size_t kShard = 1000;  // floats per shard: several chunks of 1 KiB

// One rank: its sharded state (parameters whole, moments of its shard) and its communicator.
struct Rank {
  // `whole`: the moments are whole buffers behind views (a checkpoint just loaded).
  Rank(int group, size_t chunk_bytes, bool whole = false)
      : group(group),
        whole(whole),
        params(kShard * static_cast<size_t>(group)),
        m(whole ? params.size() : kShard),
        v(m.size()),
        reg(chunk_bytes) {}
  int group;
  bool whole;
  std::vector<float> params, m, v;
  int64_t step = 0;
  std::string address;  // its data port (the plan's member address)
  state::StateRegistry reg;
  net::AbortSignal abort;  // before the data plane: outlives it
  std::unique_ptr<collective::DataPlane> plane;
  std::unique_ptr<collective::Communicator> comm;

  void Register() {
    ASSERT_TRUE(reg.RegisterValue("step", &step).ok());
    ASSERT_TRUE(reg.RegisterShardView("params", params, group).ok());
    if (whole) {
      ASSERT_TRUE(reg.RegisterShardView("m", m, group).ok());
      ASSERT_TRUE(reg.RegisterShardView("v", v, group).ok());
    } else {
      ASSERT_TRUE(reg.RegisterShard("m", m, group).ok());
      ASSERT_TRUE(reg.RegisterShard("v", v, group).ok());
    }
  }
  // Every shard's state at `at`, whole (a `whole` rank: what a checkpoint loads).
  void HoldEvery(int64_t at) {
    step = at;
    for (int s = 0; s < group; ++s) {
      for (size_t i = 0; i < kShard; ++i) {
        const size_t k = static_cast<size_t>(s) * kShard + i;
        params[k] = Value(0, s, at, i);
        m[k] = Value(1, s, at, i);
        v[k] = Value(2, s, at, i);
      }
    }
  }
  // The state of shard `s` at `at`: values no other shard or step has.
  void Hold(int s, int64_t at) {
    step = at;
    ASSERT_TRUE(reg.BindShard(s).ok());
    for (size_t i = 0; i < kShard; ++i) {
      params[static_cast<size_t>(s) * kShard + i] = Value(0, s, at, i);
      m[i] = Value(1, s, at, i);
      v[i] = Value(2, s, at, i);
    }
  }
  static float Value(int buffer, int s, int64_t at, size_t i) {
    return static_cast<float>(buffer * 1'000'000 + s * 10'000 + at * 100) +
           static_cast<float>(i) / 1024.0f;
  }
  // The registry's sharded regions (params, m, v: regions 1-3) hold shard `s` of step `at`.
  bool HoldsShard(int s, int64_t at) const {
    for (int b = 0; b < 3; ++b) {
      auto values = std::span(
          reinterpret_cast<const float*>(reg.regions()[static_cast<size_t>(b) + 1].bytes.data()),
          kShard);
      for (size_t i = 0; i < kShard; ++i) {
        if (values[i] != Value(b, s, at, i)) return false;
      }
    }
    return reg.held_shard() == s;
  }
};

// W ranks on loopback, with group sizes `groups` (one per rank).
std::vector<std::unique_ptr<Rank>> MakeRanks(const std::vector<int>& groups,
                                             size_t chunk_bytes = 1024, int whole_rank = -1) {
  std::vector<net::Listener> listeners;
  std::vector<collective::Member> members;
  for (size_t r = 0; r < groups.size(); ++r) {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok()) << l.status().ToString();
    members.push_back({static_cast<int>(r), l->address.ToString()});
    listeners.push_back(std::move(*l));
  }
  std::vector<std::unique_ptr<Rank>> ranks;
  for (size_t r = 0; r < groups.size(); ++r) {
    auto rank = std::make_unique<Rank>(groups[r], chunk_bytes, static_cast<int>(r) == whole_rank);
    rank->Register();
    rank->address = members[r].address;
    rank->plane = collective::TcpDataPlane::Create(
        {WorkerDataKey(crypto::JobKey(kToken)), static_cast<int>(r)}, std::move(listeners[r]),
        &rank->abort);
    collective::CommunicatorOptions o;
    o.rank = static_cast<int>(r);
    o.members = members;
    o.timeout_collective = Millis(30'000);
    rank->comm = rank->plane->NewCommunicator(o);
    ranks.push_back(std::move(rank));
  }
  return ranks;
}

using Moves = std::vector<control::PlanShardMove>;

// The plan of a generation of `ranks` (worker id = rank) that resumes after
// `step`, in groups of `group` (rank 0's, when 0), with these shard moves:
// what the controller's planner would send (controller::PlanShardMoves).
control::PlanMsg PlanOf(const std::vector<std::unique_ptr<Rank>>& ranks, int64_t step, Moves moves,
                        int group = 0) {
  control::PlanMsg plan;
  plan.generation = 5;
  plan.resume_step = step + 1;
  for (size_t r = 0; r < ranks.size(); ++r)
    plan.members.push_back({static_cast<int>(r), ranks[r]->address});
  plan.shard_group = group > 0 ? group : ranks[0]->group;
  plan.shard_moves = std::move(moves);
  return plan;
}

// A member played by the test: it joins ExchangeShards' all-gather of what every member holds
// with its own record (group size, held shard, step, digest 0: the 24 bytes of state_transfer.cc's
// ShardRecord), so that the real members go on to their moves with it.
Status JoinHoldings(collective::Communicator& comm, int group, int held, int64_t step) {
  constexpr size_t kRecord = 24;
  std::string mine;
  PutFixed32(&mine, static_cast<uint32_t>(group));
  PutFixed32(&mine, static_cast<uint32_t>(held));
  PutFixed64(&mine, static_cast<uint64_t>(step));
  PutFixed32(&mine, 0);
  PutFixed32(&mine, 0);
  std::vector<std::byte> records(kRecord * static_cast<size_t>(comm.world_size()));
  std::memcpy(records.data() + kRecord * static_cast<size_t>(comm.rank()), mine.data(), kRecord);
  NONSTOP_RETURN_IF_ERROR(comm.Connect());
  return comm.AllGather(records, kRecord);
}

// Every rank but `played` (the test's; -1: none) runs ExchangeShards for `plan` on a thread of its
// own, its result into (*out)[rank].
std::vector<std::jthread> StartExchanges(std::vector<std::unique_ptr<Rank>>& ranks,
                                         const control::PlanMsg& plan, int played,
                                         std::function<TransferHooks(int)> hooks,
                                         std::vector<Result<TransferOutcome>>* out) {
  out->assign(ranks.size(), InternalError("not run"));
  std::vector<std::jthread> threads(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (static_cast<int>(r) == played) continue;
    threads[r] = std::jthread([&ranks, &plan, hooks, out, r] {
      Rank& k = *ranks[r];
      Status c = k.comm->Connect();
      (*out)[r] = c.ok() ? ExchangeShards(*k.comm, k.reg, plan, k.step,
                                          hooks ? hooks(static_cast<int>(r)) : TransferHooks{})
                         : Result<TransferOutcome>(c);
    });
  }
  return threads;
}

// Every rank runs ExchangeShards for `plan`.
std::vector<Result<TransferOutcome>> ExchangeAll(
    std::vector<std::unique_ptr<Rank>>& ranks, const control::PlanMsg& plan,
    std::function<TransferHooks(int)> hooks = nullptr) {
  std::vector<Result<TransferOutcome>> out;
  { std::vector<std::jthread> threads = StartExchanges(ranks, plan, -1, std::move(hooks), &out); }
  return out;
}

// Every rank refuses the plan: `code`, the message naming `what`.
void ExpectEveryRankRefuses(const std::vector<Result<TransferOutcome>>& out, StatusCode code,
                            const std::string& what) {
  for (size_t r = 0; r < out.size(); ++r) {
    ASSERT_FALSE(out[r].ok()) << "rank " << r;
    EXPECT_EQ(out[r].status().code(), code) << "rank " << r << ": " << out[r].status().ToString();
    EXPECT_NE(out[r].status().message().find(what), std::string::npos)
        << out[r].status().ToString();
  }
}

// One rank of an unsharded state: a step counter, a few small buffers and a
// large one, so that with 1 KiB chunks some chunks span regions (copied
// through a buffer) and most lie in one (received in place).
// With `device`, "large" lives on that stand-in device (issue 30) and `large`
// is only where Fill builds its values.
struct PlainRank {
  explicit PlainRank(uint32_t seed, std::shared_ptr<state::ProtectedDevice> on = nullptr,
                     size_t large_values = 20'000, size_t chunk_bytes = 1024)
      : small(600), large(large_values), reg(chunk_bytes), device(std::move(on)) {
    NONSTOP_CHECK(reg.RegisterValue("step", &step).ok());
    NONSTOP_CHECK(reg.RegisterFloats("small", small).ok());
    if (device) {
      large_on_device = device->Allocate(large.size() * sizeof(float));
      NONSTOP_CHECK(reg.RegisterOnDevice("large", large_on_device, device, "F32").ok());
    } else {
      NONSTOP_CHECK(reg.RegisterFloats("large", large).ok());
    }
    Fill(seed);
  }
  void Fill(uint32_t seed) {
    step = seed;
    for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<float>(seed * 7 + i);
    for (size_t i = 0; i < large.size(); ++i) large[i] = static_cast<float>(seed) + 0.5f * i;
    if (device) reg.WriteRegion(2, 0, std::as_bytes(std::span(large)));
  }
  // "large" as the state holds it, wherever it lives
  std::vector<float> Large() const {
    std::vector<float> out(large.size());
    reg.ReadRegion(2, 0, std::as_writable_bytes(std::span(out)));
    return out;
  }
  int64_t step = 0;
  std::vector<float> small, large;
  state::StateRegistry reg;
  std::shared_ptr<state::ProtectedDevice> device;
  std::span<std::byte> large_on_device;
  std::string address;
  net::AbortSignal abort;
  std::unique_ptr<collective::DataPlane> plane;
  std::unique_ptr<collective::Communicator> comm;
};

// `on_device[r]`: rank r's "large" on a stand-in device.
// `large_values`, `chunk_bytes`: the size of "large" and of the chunks.
std::vector<std::unique_ptr<PlainRank>> MakePlainRanks(int n, Millis timeout = Millis(30'000),
                                                       std::vector<bool> on_device = {},
                                                       size_t large_values = 20'000,
                                                       size_t chunk_bytes = 1024) {
  std::vector<net::Listener> listeners;
  std::vector<collective::Member> members;
  for (int r = 0; r < n; ++r) {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok()) << l.status().ToString();
    members.push_back({r, l->address.ToString()});
    listeners.push_back(std::move(*l));
  }
  std::vector<std::unique_ptr<PlainRank>> ranks;
  for (int r = 0; r < n; ++r) {
    // rank 0 (the receiver) starts with other values than the sources
    const bool device =
        static_cast<size_t>(r) < on_device.size() && on_device[static_cast<size_t>(r)];
    auto rank = std::make_unique<PlainRank>(
        r == 0 ? 1 : 9, device ? std::make_shared<state::ProtectedDevice>() : nullptr, large_values,
        chunk_bytes);
    rank->address = members[static_cast<size_t>(r)].address;
    rank->plane = collective::TcpDataPlane::Create({WorkerDataKey(crypto::JobKey(kToken)), r},
                                                   std::move(listeners[static_cast<size_t>(r)]),
                                                   &rank->abort);
    collective::CommunicatorOptions o;
    o.rank = r;
    o.members = members;
    o.timeout_collective = timeout;
    rank->comm = rank->plane->NewCommunicator(o);
    ranks.push_back(std::move(rank));
  }
  return ranks;
}

// Worker 0 copies the state of step 9 from every other rank.
control::PlanMsg CopyPlan(const std::vector<std::unique_ptr<PlainRank>>& ranks) {
  control::PlanMsg plan;
  plan.generation = 1;
  plan.resume_step = 10;
  control::PlanTransfer t;
  t.receiver = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    plan.members.push_back({static_cast<int>(r), ranks[r]->address});
    if (r > 0) t.sources.push_back(static_cast<int>(r));
  }
  plan.transfers = {t};
  return plan;
}

// Every rank runs RunStateTransfers; `hooks(rank)` for each.
std::vector<Result<TransferOutcome>> CopyAll(std::vector<std::unique_ptr<PlainRank>>& ranks,
                                             std::function<TransferHooks(int)> hooks = nullptr) {
  const control::PlanMsg plan = CopyPlan(ranks);
  std::vector<Result<TransferOutcome>> out(ranks.size(), InternalError("not run"));
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      PlainRank& k = *ranks[r];
      out[r] = RunStateTransfers(*k.comm, k.reg, plan, static_cast<int>(r), k.step,
                                 hooks ? hooks(static_cast<int>(r)) : TransferHooks{});
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Workers 0 and 1 (1 refilled like 0: neither holds step 9) copy the state of step 9 from workers
// 2 and 3 at once, every rank running RunStateTransfers.
std::vector<Result<TransferOutcome>> CopyIntoTheFirstTwo(
    std::vector<std::unique_ptr<PlainRank>>& ranks) {
  ranks[1]->Fill(1);
  control::PlanMsg plan = CopyPlan(ranks);
  plan.transfers = {{0, {2, 3}}, {1, {2, 3}}};
  std::vector<Result<TransferOutcome>> out(ranks.size(), InternalError("not run"));
  std::vector<std::jthread> threads;
  for (size_t r = 0; r < ranks.size(); ++r) {
    threads.emplace_back([&, r] {
      out[r] = RunStateTransfers(*ranks[r]->comm, ranks[r]->reg, plan, static_cast<int>(r),
                                 r < 2 ? control::kNoValidState : ranks[r]->step, {});
    });
  }
  threads.clear();  // joined
  return out;
}

TEST(RunStateTransfersTest, ACopyFromOneOrThreeSourcesIsTheSourcesStateBitForBit) {
  for (int sources : {1, 3}) {
    auto ranks = MakePlainRanks(1 + sources);
    ASSERT_NE(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
    // some chunks span regions (through a buffer), most lie in one (in place)
    int spanning = 0;
    for (uint32_t c = 0; c < ranks[0]->reg.num_chunks(); ++c)
      spanning += ranks[0]->reg.ContiguousChunk(c).empty() ? 1 : 0;
    ASSERT_GE(spanning, 2);
    ASSERT_GE(ranks[0]->reg.num_chunks(), static_cast<uint32_t>(spanning + 10));
    auto out = CopyAll(ranks);
    for (size_t r = 0; r < out.size(); ++r)
      ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
    EXPECT_TRUE(out[0]->received);
    EXPECT_EQ(out[0]->sources, sources);
    EXPECT_EQ(out[0]->bytes_received, ranks[0]->reg.total_bytes());
    EXPECT_EQ(out[0]->refetched_chunks, 0);
    EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest()) << sources << " source(s)";
    EXPECT_EQ(ranks[0]->step, 9);
    EXPECT_EQ(ranks[0]->large, ranks[1]->large);
  }
}

// What a party on the path can do to a chunk whose CRC-32C travels beside it: flip a byte, then
// rewrite the last four so that the CRC stays what it was (a CRC is linear over GF(2), and its
// last 32 bits map one to one onto it). Checked: the CRC is unchanged, the bytes are not.
void TamperKeepingCrc(std::span<std::byte> bytes) {
  const size_t n = bytes.size();
  ASSERT_GT(n, 8u);  // the flipped byte is not among the last four
  const uint32_t want = Crc32c(bytes.data(), n);
  bytes[n / 2] ^= std::byte{0x5a};
  const uint32_t now = Crc32c(bytes.data(), n);
  auto flip = [&](int bit) { bytes[n - 4 + bit / 8] ^= std::byte(1u << (bit % 8)); };
  uint32_t basis[32] = {}, combo[32] = {};  // basis[i]: leading bit i; combo[i]: the bits making it
  for (int b = 0; b < 32; ++b) {
    flip(b);
    uint32_t v = Crc32c(bytes.data(), n) ^ now, c = 1u << b;
    flip(b);
    for (int i = 31; i >= 0 && v != 0; --i) {
      if (!(v >> i & 1)) continue;
      if (basis[i] == 0) {
        basis[i] = v;
        combo[i] = c;
        break;
      }
      v ^= basis[i];
      c ^= combo[i];
    }
  }
  uint32_t target = want ^ now, bits = 0;
  for (int i = 31; i >= 0; --i) {
    if (!(target >> i & 1)) continue;
    ASSERT_NE(basis[i], 0u);
    target ^= basis[i];
    bits ^= combo[i];
  }
  for (int b = 0; b < 32; ++b) {
    if (bits >> b & 1) flip(b);
  }
  ASSERT_EQ(Crc32c(bytes.data(), n), want);
}

// Whether two registries hold the same bytes (their digests are CRCs: a rewrite that keeps every
// CRC keeps them too).
bool SameBytes(const state::StateRegistry& a, const state::StateRegistry& b) {
  if (a.regions().size() != b.regions().size()) return false;
  for (size_t i = 0; i < a.regions().size(); ++i) {
    const auto& x = a.regions()[i].bytes;
    const auto& y = b.regions()[i].bytes;
    if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size()) != 0) return false;
  }
  return true;
}

// Issue 52, point 5: the CRCs stop accidents, not a party on the path. A chunk it rewrites
// keeping its CRC (TamperKeepingCrc) is taken by an unsealed copy, and the receiver trains on
// bytes of that party's choosing. A sealed copy finds the chunk's tag wrong, fetches it again, and
// ends with the source's state bit for bit, from one source or from three over four streams each.
TEST(RunStateTransfersTest, ASealedCopyRefusesAChunkRewrittenKeepingItsCrcThatAnUnsealedOneTakes) {
  auto unsealed = MakePlainRanks(2);
  auto out = CopyAll(unsealed, [](int r) {
    TransferHooks h;
    if (r == 1) h.tamper_first_chunk = TamperKeepingCrc;
    return h;
  });
  ASSERT_TRUE(out[0].ok()) << out[0].status().ToString();
  EXPECT_EQ(out[0]->refetched_chunks, 0) << "the rewritten chunk passes every CRC";
  EXPECT_EQ(unsealed[0]->reg.Digest(), unsealed[1]->reg.Digest()) << "the same CRCs";
  EXPECT_FALSE(SameBytes(unsealed[0]->reg, unsealed[1]->reg)) << "and other bytes, taken";
  for (int sources : {1, 3}) {
    auto ranks = MakePlainRanks(1 + sources);
    out = CopyAll(ranks, [&](int r) {
      TransferHooks h;
      h.seal_key = crypto::JobKey(kToken);
      if (r >= 1) h.tamper_first_chunk = TamperKeepingCrc;
      h.streams_per_source = sources == 3 ? 4 : 0;
      return h;
    });
    for (size_t r = 0; r < out.size(); ++r)
      ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
    EXPECT_EQ(out[0]->refetched_chunks, sources) << "each source's rewritten chunk, again";
    EXPECT_TRUE(SameBytes(ranks[0]->reg, ranks[1]->reg)) << sources << " source(s)";
    EXPECT_EQ(ranks[0]->large, ranks[1]->large);
  }
}

// A party on the path that rewrites one source's table (here chunk 1's CRC, a chunk rank 2
// serves) makes two sources disagree with no majority: unsealed, the copy fails as a
// disagreement, which stops the job (exit 11, data corruption) though no state is corrupt. Sealed,
// the table fails its tag: the copy fails as an ordinary one (the controller plans again).
TEST(RunStateTransfersTest, ATableRewrittenOnTheWayIsADisagreementUnsealedAndRefusedSealed) {
  for (bool sealed : {false, true}) {
    auto ranks = MakePlainRanks(3);
    auto out = CopyAll(ranks, [&](int r) {
      TransferHooks h;
      if (sealed) h.seal_key = crypto::JobKey(kToken);
      if (r == 1) h.tamper_table = [](std::string& table) { table[4] ^= 1; };
      return h;
    });
    ASSERT_FALSE(out[0].ok()) << (sealed ? "sealed" : "unsealed");
    EXPECT_EQ(out[0].status().code(), StatusCode::kDataLoss) << out[0].status().ToString();
    EXPECT_EQ(IsDisagreement(out[0].status()), !sealed) << out[0].status().ToString();
    if (sealed) {
      EXPECT_NE(out[0].status().message().find("the CRC table from rank 1 fails its seal"),
                std::string::npos)
          << out[0].status().ToString();
    }
  }
}

// A source and a receiver that differ on the seal fail the copy naming the setting, whichever way
// round (a receiver that seals never takes an unsealed chunk).
TEST(RunStateTransfersTest, ASourceAndAReceiverThatDifferOnTheSealFailNamingTheSetting) {
  for (int sealed_rank : {0, 1}) {
    auto ranks = MakePlainRanks(2);
    auto out = CopyAll(ranks, [&](int r) {
      TransferHooks h;
      if (r == sealed_rank) h.seal_key = crypto::JobKey(kToken);
      return h;
    });
    ASSERT_FALSE(out[0].ok()) << "rank " << sealed_rank << " seals";
    EXPECT_EQ(out[0].status().code(), StatusCode::kFailedPrecondition)
        << out[0].status().ToString();
    EXPECT_NE(out[0].status().message().find("NONSTOP_SEALED_STATE_COPY"), std::string::npos)
        << out[0].status().ToString();
    EXPECT_NE(ranks[0]->reg.Digest(), ranks[1]->reg.Digest()) << "nothing copied";
  }
}

// Two ends that seal under different keys (another job's token) copy nothing: every chunk fails
// its tag, from the first fetch and the next.
TEST(RunStateTransfersTest, ASealUnderAnotherKeyFailsEveryChunk) {
  auto ranks = MakePlainRanks(2);
  auto out = CopyAll(ranks, [&](int r) {
    TransferHooks h;
    h.seal_key = crypto::JobKey(r == 0 ? kToken : "another job's token");
    return h;
  });
  ASSERT_FALSE(out[0].ok());
  EXPECT_EQ(out[0].status().code(), StatusCode::kDataLoss) << out[0].status().ToString();
}

// Issue 30: a member with its state on a device copies it from members whose state is in host
// memory or on a device, and serves it to them, bit for bit (the chunks are staged).
TEST(RunStateTransfersTest, StateOnADeviceIsCopiedFromAndToHostStateBitForBit) {
  for (std::vector<bool> on_device :
       {std::vector<bool>{true, false, true}, {false, true, true}, {true, true, false}}) {
    auto ranks = MakePlainRanks(3, Millis(30'000), on_device);
    ASSERT_NE(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
    std::vector<int> copies_before;
    for (const auto& rank : ranks)
      copies_before.push_back(rank->device ? rank->device->copies() : 0);
    auto out = CopyAll(ranks);
    for (size_t r = 0; r < out.size(); ++r)
      ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
    EXPECT_EQ(out[0]->bytes_received, ranks[0]->reg.total_bytes());
    EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
    EXPECT_EQ(ranks[0]->step, 9);
    EXPECT_EQ(ranks[0]->Large(), ranks[1]->Large());
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (ranks[r]->device) {
        EXPECT_GT(ranks[r]->device->copies(), copies_before[r]) << "rank " << r;
      }
    }
  }
}

// A state of 48 MiB copied into two receivers: each source computes its table for both first,
// on several threads (one per 16 MiB, as many as the cores allow: two on a 2-core machine), one
// source's state on a device; both copies are the sources' state bit for bit.
TEST(RunStateTransfersTest, ALargeStateWhoseTablesTakeSeveralThreadsIsCopiedBitForBit) {
  auto ranks =
      MakePlainRanks(4, Millis(60'000), {false, false, false, true}, size_t{12} << 20, 1 << 20);
  ASSERT_GE(ranks[0]->reg.total_bytes(), uint64_t{48} << 20);
  auto out = CopyIntoTheFirstTwo(ranks);
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  for (size_t r : {0, 1}) {
    EXPECT_EQ(out[r]->refetched_chunks, 0) << r;
    EXPECT_EQ(ranks[r]->reg.Digest(), ranks[2]->reg.Digest()) << r;
    EXPECT_EQ(ranks[r]->Large(), ranks[3]->Large()) << r;
  }
}

// Several streams per source (issue 27): the receiver asks each source for its chunks over
// several lanes, a thread per lane at both ends; the copy is the sources' state bit for bit, a
// chunk corrupted on one lane is fetched again, and a state of 32 MiB or less a source takes
// one stream unless asked.
TEST(RunStateTransfersTest, EachSourceStreamsItsChunksOverSeveralLanesBitForBit) {
  for (int sources : {1, 2}) {
    auto ranks = MakePlainRanks(1 + sources);
    auto out = CopyAll(ranks, [](int r) {
      TransferHooks h;
      h.streams_per_source = 4;
      h.corrupt_first_chunk = r == 1;
      return h;
    });
    for (size_t r = 0; r < out.size(); ++r)
      ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
    EXPECT_EQ(out[0]->streams_per_source, 4);
    EXPECT_EQ(out[0]->refetched_chunks, 1);
    EXPECT_GE(out[0]->bytes_received, ranks[0]->reg.total_bytes());
    // each lane is a connection of its own to each source
    EXPECT_EQ(ranks[0]->plane->stats().connections_opened, 4 * sources);
    EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest()) << sources << " source(s)";
    EXPECT_EQ(ranks[0]->Large(), ranks[1]->Large());
  }
  auto ranks = MakePlainRanks(2);
  auto out = CopyAll(ranks);
  ASSERT_TRUE(out[0].ok()) << out[0].status().ToString();
  EXPECT_EQ(out[0]->streams_per_source, 1) << "a small state takes one stream";
}

TEST(RunStateTransfersTest, ChunksCorruptedOnTheWayAreFetchedAgainInPlaceOrThroughABuffer) {
  auto ranks = MakePlainRanks(3);
  // Rank 1 serves chunk 0 first (the step and the start of `small`: through
  // a buffer), rank 2 chunk 1 (inside `small`: in place, checked on the
  // lane's thread). Each corrupts the first chunk it sends.
  ASSERT_TRUE(ranks[0]->reg.ContiguousChunk(0).empty());
  ASSERT_FALSE(ranks[0]->reg.ContiguousChunk(1).empty());
  auto out = CopyAll(ranks, [](int r) {
    TransferHooks h;
    h.corrupt_first_chunk = r > 0;
    return h;
  });
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_EQ(out[0]->refetched_chunks, 2);
  EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
}

// A source written by hand (rank 1 of `ranks`): `script` speaks the
// protocol, or lies in it, while rank 0 runs RunStateTransfers. Once the
// receiver returns, rank 1's calls are aborted (a liar may still wait for a
// request) and the receiver's result is returned.
Result<TransferOutcome> CopyFromLiar(std::vector<std::unique_ptr<PlainRank>>& ranks,
                                     std::function<void(collective::Communicator&)> script) {
  const control::PlanMsg plan = CopyPlan(ranks);
  std::thread liar([&] { script(*ranks[1]->comm); });
  Result<TransferOutcome> out =
      RunStateTransfers(*ranks[0]->comm, ranks[0]->reg, plan, 0, control::kNoValidState, {});
  ranks[1]->comm->Abort("the test is over");
  liar.join();
  return out;
}

// The transfer header (state_transfer.cc) as `reg` would send it for `step`.
std::string Header(const state::StateRegistry& reg, int64_t step, uint64_t total) {
  std::string h;
  PutFixed32(&h, 0x3658534E);  // "NSX6"
  PutFixed64(&h, static_cast<uint64_t>(step));
  PutFixed64(&h, total);
  PutFixed32(&h, static_cast<uint32_t>(reg.chunk_bytes()));
  PutFixed32(&h, reg.num_chunks());
  PutFixed32(&h, 0);
  PutFixed32(&h, static_cast<uint32_t>(state::kEveryShard));
  PutFixed32(&h, 0);           // unsealed
  h += std::string(16, '\0');  // no seal's nonce
  PutFixed32(&h, Crc32c(h));
  return h;
}

Status SendString(collective::Communicator& comm, const std::string& s) {
  return comm.Send(0, std::as_bytes(std::span(s)));
}

// The CRC table a source sends after its first request's chunks: every chunk's CRC-32C.
std::string Table(const state::StateRegistry& reg) {
  std::string t;
  for (const state::ChunkInfo& c : reg.Chunks()) PutFixed32(&t, c.crc);
  return t;
}

// Reads the receiver's request, {count} then {lanes, the chunk indices}: the indices (a hand-made
// source serves on lane 0 only, which the receiver asks of a small state), none for "done" or a
// failure.
std::optional<std::vector<uint32_t>> ReadRequest(collective::Communicator& comm) {
  std::string n(4, '\0');
  if (!comm.Recv(0, std::as_writable_bytes(std::span(n))).ok()) return std::nullopt;
  std::string body(4 * static_cast<size_t>(DecodeFixed32(n.data())), '\0');
  if (body.empty() || !comm.Recv(0, std::as_writable_bytes(std::span(body))).ok()) {
    return std::nullopt;
  }
  EXPECT_EQ(DecodeFixed32(body.data()), 1u) << "a small state's chunks come over one lane";
  std::vector<uint32_t> out;
  for (size_t i = 4; i < body.size(); i += 4) out.push_back(DecodeFixed32(body.data() + i));
  return out;
}

// Serves `reg`'s chunks as asked, each through `lie(index, meta, bytes)`
// first, and its table after the first request's chunks, until the receiver
// stops asking or the test aborts it.
void ServeLying(collective::Communicator& comm, const state::StateRegistry& reg,
                const std::function<void(uint32_t, std::string*, std::vector<std::byte>*)>& lie) {
  if (!SendString(comm, Header(reg, 9, reg.total_bytes())).ok()) return;
  for (bool first = true;; first = false) {
    std::optional<std::vector<uint32_t>> request = ReadRequest(comm);
    if (!request) return;
    for (uint32_t index : *request) {
      std::vector<std::byte> bytes(reg.chunk_size(index));
      reg.ReadChunk(index, bytes);
      std::string meta;
      PutFixed32(&meta, index);
      PutFixed32(&meta, Crc32c(bytes.data(), bytes.size()));
      lie(index, &meta, &bytes);
      if (!SendString(comm, meta).ok() || !comm.SendUnchecked(0, bytes).ok()) return;
    }
    if (first && !SendString(comm, Table(reg)).ok()) return;
  }
}

TEST(RunStateTransfersTest, ASourceWhoseChunksNeverMatchTheirChecksumsIsDataLoss) {
  auto ranks = MakePlainRanks(2);
  auto out = CopyFromLiar(ranks, [&](collective::Communicator& comm) {
    ServeLying(comm, ranks[1]->reg, [](uint32_t index, std::string*, std::vector<std::byte>* b) {
      if (index == 5) (*b)[3] ^= std::byte{1};  // chunk 5, every time it is sent
    });
  });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kDataLoss) << out.status().ToString();
  EXPECT_NE(out.status().message().find("state chunk 5 failed its checksum from every source"),
            std::string::npos)
      << out.status().ToString();
}

TEST(RunStateTransfersTest, ASourceThatSendsAnotherChunkThanAskedIsDataLoss) {
  auto ranks = MakePlainRanks(2);
  auto out = CopyFromLiar(ranks, [&](collective::Communicator& comm) {
    ServeLying(comm, ranks[1]->reg, [](uint32_t index, std::string* meta, std::vector<std::byte>*) {
      if (index == 2) EncodeFixed32(meta->data(), 3);
    });
  });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kDataLoss) << out.status().ToString();
  EXPECT_NE(out.status().message().find("sent chunk 3 where chunk 2 was asked for"),
            std::string::npos)
      << out.status().ToString();
}

// The CRC a source sends ahead of a chunk is its word on that chunk; its table, which comes after
// the chunks, must say the same. A source that sends other bytes under a CRC that matches them,
// but not its table, fails the copy, naming it (the bytes pass the check against its word: only
// the table gives it away).
TEST(RunStateTransfersTest, ASourceWhoseWordOnAChunkIsNotItsTablesIsDataLoss) {
  auto ranks = MakePlainRanks(2);
  auto out = CopyFromLiar(ranks, [&](collective::Communicator& comm) {
    ServeLying(comm, ranks[1]->reg,
               [](uint32_t index, std::string* meta, std::vector<std::byte>* b) {
                 if (index != 2) return;
                 (*b)[7] ^= std::byte{1};
                 EncodeFixed32(meta->data() + 4, Crc32c(b->data(), b->size()));
               });
  });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kDataLoss) << out.status().ToString();
  EXPECT_NE(out.status().message().find("rank 1 sent chunk 2 with CRC"), std::string::npos)
      << out.status().ToString();
  EXPECT_NE(out.status().message().find("but its table says"), std::string::npos)
      << out.status().ToString();
  // The receiver told its source it is done and aborted its own communicator with the reason.
  const Status stopped = ranks[0]->comm->error();
  EXPECT_EQ(stopped.code(), StatusCode::kAborted) << stopped.ToString();
  EXPECT_NE(stopped.message().find("but its table says"), std::string::npos) << stopped.ToString();
}

// A source checks a request before it serves a byte of it: lanes the transport lacks, a chunk the
// state lacks, a chunk asked for twice (whose table entry two lanes would write) are refused,
// naming what is wrong. (A source that served them instead would wait for the next request and
// end in the 2 s deadline.)
TEST(RunStateTransfersTest, ARequestTheSourceCannotServeIsRefusedNamingWhy) {
  const std::pair<std::vector<uint32_t>, std::string> cases[] = {
      {{0, 2}, "over 0 lanes (1 to 4 can be)"},
      {{9, 2}, "over 9 lanes (1 to 4 can be)"},
      {{1, 5000}, "request for chunk 5000 of"},
      {{2, 2, 3, 2}, "request for chunk 2 twice"},
  };
  for (const auto& [request, why] : cases) {
    auto ranks = MakePlainRanks(2, /*timeout=*/Millis(2000));
    const control::PlanMsg plan = CopyPlan(ranks);
    Result<TransferOutcome> served = InternalError("not run");
    std::thread source([&] {
      served = RunStateTransfers(*ranks[1]->comm, ranks[1]->reg, plan, 1, ranks[1]->step, {});
    });
    collective::Communicator& receiver = *ranks[0]->comm;
    std::string header(kHeaderBytes, '\0');
    EXPECT_TRUE(receiver.Recv(1, std::as_writable_bytes(std::span(header))).ok());
    std::string count, body;
    PutFixed32(&count, static_cast<uint32_t>(request.size()));
    for (uint32_t v : request) PutFixed32(&body, v);  // {lanes, index…}
    EXPECT_TRUE(receiver.Send(1, std::as_bytes(std::span(count))).ok());
    EXPECT_TRUE(receiver.Send(1, std::as_bytes(std::span(body))).ok());
    source.join();
    receiver.Abort("the test is over");
    ASSERT_FALSE(served.ok()) << why;
    EXPECT_EQ(served.status().code(), StatusCode::kDataLoss) << served.status().ToString();
    EXPECT_NE(served.status().message().find(why), std::string::npos) << served.status().ToString();
  }
}

// Two receivers at once (two spares): each source computes one table for both and serves each
// its stripe; both end with the sources' state bit for bit.
TEST(RunStateTransfersTest, TwoReceiversCopyFromTheSameSourcesAtOnce) {
  auto ranks = MakePlainRanks(4);
  auto out = CopyIntoTheFirstTwo(ranks);
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  for (int r : {0, 1}) {
    EXPECT_EQ(ranks[static_cast<size_t>(r)]->reg.Digest(), ranks[2]->reg.Digest()) << r;
    EXPECT_EQ(out[static_cast<size_t>(r)]->sources, 2) << r;
    EXPECT_EQ(out[static_cast<size_t>(r)]->refetched_chunks, 0) << r;
  }
  EXPECT_TRUE(out[2]->served);
  EXPECT_TRUE(out[3]->served);
}

// The state transfer copies the replicated chunks only (the shard exchange moves the sharded
// ones): a source refuses a request for a sharded chunk, naming it.
TEST(RunStateTransfersTest, ARequestForAShardedChunkIsRefusedByTheSource) {
  auto ranks = MakeRanks({2, 2});
  ranks[1]->Hold(1, 9);
  control::PlanMsg plan = PlanOf(ranks, 9, {});
  plan.transfers = {{0, {1}}};
  uint32_t sharded = 0;
  while (sharded < ranks[1]->reg.num_chunks() && !ranks[1]->reg.chunk_sharded(sharded)) ++sharded;
  ASSERT_LT(sharded, ranks[1]->reg.num_chunks());
  Result<TransferOutcome> served = InternalError("not run");
  std::thread source(
      [&] { served = RunStateTransfers(*ranks[1]->comm, ranks[1]->reg, plan, 1, 9, {}); });
  collective::Communicator& receiver = *ranks[0]->comm;
  std::string header(kHeaderBytes, '\0');
  EXPECT_TRUE(receiver.Recv(1, std::as_writable_bytes(std::span(header))).ok());
  std::string count, body;
  PutFixed32(&count, 2);
  PutFixed32(&body, 1);  // one lane
  PutFixed32(&body, sharded);
  EXPECT_TRUE(receiver.Send(1, std::as_bytes(std::span(count))).ok());
  EXPECT_TRUE(receiver.Send(1, std::as_bytes(std::span(body))).ok());
  source.join();
  receiver.Abort("the test is over");
  ASSERT_FALSE(served.ok());
  EXPECT_EQ(served.status().code(), StatusCode::kDataLoss) << served.status().ToString();
  EXPECT_NE(served.status().message().find(fmt::format(
                "request for chunk {}, a sharded chunk, in the state transfer", sharded)),
            std::string::npos)
      << served.status().ToString();
}

// More sources than chunks: the sources with no chunk still get a request (the first one is what
// a source sends its table after, and the majority needs every table) and the copy completes.
TEST(RunStateTransfersTest, SourcesWithNoChunkToSendStillSendTheirTables) {
  auto ranks = MakePlainRanks(4, Millis(30'000), {}, /*large_values=*/1, /*chunk_bytes=*/4096);
  ASSERT_EQ(ranks[0]->reg.num_chunks(), 1u);
  auto out = CopyAll(ranks);
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_EQ(out[0]->sources, 3);
  EXPECT_EQ(out[0]->refetched_chunks, 0);
  EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
}

// A source that lies on one of its streams and says nothing on the other: the lie ends the copy at
// once, naming it, instead of the silent stream's deadline (30 s here) ending it later as a
// timeout.
TEST(RunStateTransfersTest, ALieOnOneStreamStopsTheOtherStreamsAndIsTheErrorSaid) {
  auto ranks = MakePlainRanks(2);
  const control::PlanMsg plan = CopyPlan(ranks);
  collective::Communicator& liar_comm = *ranks[1]->comm;
  const state::StateRegistry& liar_reg = ranks[1]->reg;
  std::thread liar([&] {
    if (!SendString(liar_comm, Header(liar_reg, 9, liar_reg.total_bytes())).ok()) return;
    std::string n(4, '\0');
    if (!liar_comm.Recv(0, std::as_writable_bytes(std::span(n))).ok()) return;
    std::string body(4 * static_cast<size_t>(DecodeFixed32(n.data())), '\0');
    if (!liar_comm.Recv(0, std::as_writable_bytes(std::span(body))).ok()) return;
    EXPECT_EQ(DecodeFixed32(body.data()), 2u) << "the receiver was to ask for two streams";
    const uint32_t second = DecodeFixed32(body.data() + 8);  // lane 1's first chunk
    std::string meta;
    PutFixed32(&meta, second + 1);
    PutFixed32(&meta, 0);
    (void)liar_comm.SendOnLane(0, 1, collective::HostRegion(std::as_bytes(std::span(meta))), true);
    while (liar_comm.error().ok()) std::this_thread::sleep_for(Millis(5));  // lane 0: silence
  });
  TransferHooks two_streams;
  two_streams.streams_per_source = 2;
  Result<TransferOutcome> out = RunStateTransfers(*ranks[0]->comm, ranks[0]->reg, plan, 0,
                                                  control::kNoValidState, two_streams);
  ranks[1]->comm->Abort("the test is over");
  liar.join();
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kDataLoss) << out.status().ToString();
  EXPECT_NE(out.status().message().find("where chunk"), std::string::npos)
      << out.status().ToString();
  // The silent stream was stopped by the receiver, not by its deadline.
  const Status stopped = ranks[0]->comm->error();
  EXPECT_EQ(stopped.code(), StatusCode::kAborted) << stopped.ToString();
  EXPECT_NE(stopped.message().find("failed on one of its 2 streams"), std::string::npos)
      << stopped.ToString();
}

TEST(RunStateTransfersTest, ASourceThatSendsAChunkOfTheWrongSizeFailsClearly) {
  auto ranks = MakePlainRanks(2);
  auto out = CopyFromLiar(ranks, [&](collective::Communicator& comm) {
    ServeLying(comm, ranks[1]->reg, [](uint32_t index, std::string*, std::vector<std::byte>* b) {
      if (index == 4) b->resize(b->size() - 100);
    });
  });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kInternal) << out.status().ToString();
  EXPECT_NE(out.status().message().find("bytes) where"), std::string::npos)
      << out.status().ToString();
}

TEST(RunStateTransfersTest, AHeaderOfAnotherStepOrLayoutOrGarbageIsRefused) {
  const std::pair<std::function<std::string(const state::StateRegistry&)>, std::string> cases[] = {
      // its only source holds another step: nothing to copy from
      {[](const state::StateRegistry& reg) { return Header(reg, 8, reg.total_bytes()); },
       "no source holds the state of step 9 that the plan of generation 1 resumes after: rank 1 "
       "(worker 1) holds step 8"},
      {[](const state::StateRegistry& reg) { return Header(reg, 9, reg.total_bytes() + 4); },
       "the model or optimizer differs"},
      {[](const state::StateRegistry&) { return std::string(kHeaderBytes, 'x'); }, "is corrupt"},
  };
  for (const auto& [header, why] : cases) {
    auto ranks = MakePlainRanks(2);
    auto out = CopyFromLiar(ranks, [&](collective::Communicator& comm) {
      (void)SendString(comm, header(ranks[1]->reg));
    });
    ASSERT_FALSE(out.ok()) << why;
    EXPECT_EQ(out.status().code(), StatusCode::kDataLoss) << out.status().ToString();
    EXPECT_NE(out.status().message().find(why), std::string::npos) << out.status().ToString();
  }
}

TEST(RunStateTransfersTest, ASourceThatStallsMidTransferEndsInTheCollectiveTimeout) {
  auto ranks = MakePlainRanks(2, /*timeout=*/Millis(300));
  auto out = CopyFromLiar(ranks, [&](collective::Communicator& comm) {
    // The header and the first chunks, then silence (the test aborts it).
    ServeLying(comm, ranks[1]->reg, [&](uint32_t index, std::string*, std::vector<std::byte>*) {
      if (index == 3) {
        while (comm.error().ok()) std::this_thread::sleep_for(Millis(5));
      }
    });
  });
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kDeadlineExceeded) << out.status().ToString();
}

TEST(RunStateTransfersTest,
     ASourceThatHoldsAnotherStepThanThePlanSaysIsRefusedAndTheReceiverCopiesFromTheOthers) {
  auto ranks = MakePlainRanks(4);
  ranks[2]->Fill(7);  // the plan resumes after step 9; rank 2's state holds step 7
  auto out = CopyAll(ranks);
  ASSERT_TRUE(out[0].ok()) << out[0].status().ToString();
  EXPECT_EQ(out[0]->sources, 2) << "rank 2 is dropped";
  EXPECT_EQ(out[0]->refetched_chunks, 0);
  EXPECT_EQ(out[0]->bytes_received, ranks[0]->reg.total_bytes());
  EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
  EXPECT_EQ(ranks[0]->step, 9);
  for (int r : {1, 3}) {
    EXPECT_TRUE(out[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << out[static_cast<size_t>(r)].status().ToString();
  }
  ASSERT_FALSE(out[2].ok());
  EXPECT_EQ(out[2].status().code(), StatusCode::kFailedPrecondition) << out[2].status().ToString();
  EXPECT_NE(out[2].status().message().find("the plan of generation 1 asks worker 2 to serve the "
                                           "state of step 9, but its state holds step 7: refused"),
            std::string::npos)
      << out[2].status().ToString();
}

TEST(RunStateTransfersTest, WhenNoSourceHoldsThePlansStepTheTransferIsDataLossNamingThem) {
  auto ranks = MakePlainRanks(3);
  const std::string before = ranks[0]->reg.Digest();
  ranks[1]->Fill(7);
  ranks[2]->Fill(8);
  auto out = CopyAll(ranks);
  ASSERT_FALSE(out[0].ok());
  EXPECT_EQ(out[0].status().code(), StatusCode::kDataLoss) << out[0].status().ToString();
  EXPECT_NE(out[0].status().message().find(
                "no source holds the state of step 9 that the plan of generation 1 resumes "
                "after: rank 1 (worker 1) holds step 7, rank 2 (worker 2) holds step 8"),
            std::string::npos)
      << out[0].status().ToString();
  EXPECT_EQ(ranks[0]->reg.Digest(), before) << "nothing was copied";
  for (int r : {1, 2}) {  // each was told it is done: none waits out the timeout
    EXPECT_EQ(out[static_cast<size_t>(r)].status().code(), StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << out[static_cast<size_t>(r)].status().ToString();
  }
}

TEST(RunStateTransfersTest,
     ASourceWhoseMemoryDiffersFromTheMajorityCannotLeaveItsBytesInTheReceiver) {
  auto ranks = MakePlainRanks(4);
  // Rank 3 holds step 9 too, but a bit of every value flipped in its memory:
  // its table agrees with its bytes, and every chunk differs from the others'.
  for (float& f : ranks[3]->small) f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) ^ 1u);
  for (float& f : ranks[3]->large) f = std::bit_cast<float>(std::bit_cast<uint32_t>(f) ^ 1u);
  const auto good = ranks[1]->reg.Chunks();
  const auto bad = ranks[3]->reg.Chunks();
  for (size_t c = 0; c < good.size(); ++c) {
    ASSERT_NE(good[c].crc, bad[c].crc) << "chunk " << c << ": striped, a third goes to rank 3";
  }
  auto out = CopyAll(ranks);
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_EQ(out[0]->sources, 3);
  // Striped, chunk c from source c mod 3: rank 3 (the third source) sent every third chunk, each
  // outvoted by the others' tables once they came and fetched again from the majority.
  EXPECT_EQ(out[0]->refetched_chunks, static_cast<int>(ranks[0]->reg.num_chunks() / 3));
  EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
  EXPECT_EQ(ranks[0]->large, ranks[2]->large);
  EXPECT_NE(ranks[0]->reg.Digest(), ranks[3]->reg.Digest());
}

TEST(RunStateTransfersTest, OneDivergentChunkComesFromTheMajorityTheRestAsStriped) {
  // Rank 2 (the second source) differs in chunk 1 only, which striping gives
  // it: that chunk is fetched again from a source of the majority once the
  // tables are in, the rest of rank 2's stripe comes from rank 2.
  auto ranks = MakePlainRanks(4);
  ASSERT_FALSE(ranks[0]->reg.ContiguousChunk(1).empty());
  ranks[2]->small[300] += 1.0f;  // in chunk 1 (the step's 8 bytes, then `small`)
  ASSERT_NE(ranks[2]->reg.Chunks()[1].crc, ranks[1]->reg.Chunks()[1].crc);
  ASSERT_EQ(ranks[2]->reg.Chunks()[4].crc, ranks[1]->reg.Chunks()[4].crc);
  auto out = CopyAll(ranks);
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_EQ(out[0]->refetched_chunks, 1) << "chunk 1, once";
  EXPECT_EQ(ranks[0]->reg.Digest(), ranks[1]->reg.Digest());
}

// Two sources, one silently corrupt in chunk 1: no majority can tell which copy is right, so the
// receiver keeps neither (a copy of the wrong one would make it the majority at the next replica
// check) and the transfer is data loss naming the chunk, its tensor and both sources (the session
// then stops the job with exit 11; the receiver's state holds no valid step). The sources are
// not kept waiting: 5 s of timeout, and they end well within it.
TEST(RunStateTransfersTest, TwoSourcesThatDisagreeOnAChunkFailTheCopyAsDataLoss) {
  auto ranks = MakePlainRanks(3, Millis(5'000));
  ranks[1]->small[300] += 1.0f;  // in chunk 1 (the step's 8 bytes, then `small`)
  auto out = CopyAll(ranks);
  ASSERT_FALSE(out[0].ok());
  EXPECT_TRUE(IsDisagreement(out[0].status())) << out[0].status().ToString();
  const std::string why(out[0].status().message());
  for (const std::string& part :
       {std::string("state chunk 1 "), std::string("in small)"), std::string("of step 9"),
        std::string("rank 1 (worker 1) "), std::string("rank 2 (worker 2) "),
        std::string("it is not copied")}) {
    EXPECT_NE(why.find(part), std::string::npos) << "'" << part << "' in: " << why;
  }
  for (int r : {1, 2}) {  // each served its share and was told it is done
    EXPECT_TRUE(out[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << out[static_cast<size_t>(r)].status().ToString();
  }
}

// A per-rank region (each member's own values) spanning three chunks comes whole from the first
// source, unvoted and unfetched again; the replicated state beside it is striped as ever.
TEST(RunStateTransfersTest, APerRankRegionComesWholeFromTheFirstSource) {
  auto ranks = MakePlainRanks(4);
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (float& f : ranks[r]->small) f += static_cast<float>(r);  // differs by rank
    ASSERT_TRUE(ranks[r]->reg.MarkPerRank("small").ok());
  }
  ASSERT_GT(ranks[0]->small.size() * sizeof(float), 2 * ranks[0]->reg.chunk_bytes());
  auto out = CopyAll(ranks);
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_EQ(out[0]->sources, 3);
  EXPECT_EQ(out[0]->refetched_chunks, 0) << "no per-rank chunk was outvoted";
  EXPECT_EQ(ranks[0]->small, ranks[1]->small) << "the first source's, every chunk of it";
  EXPECT_EQ(ranks[0]->large, ranks[2]->large);
  EXPECT_EQ(ranks[0]->reg.Digest(), ranks[3]->reg.Digest()) << "the digest leaves per-rank out";
}

TEST(ExchangeShardsTest, ASpareCopiesOnlyItsShardFromTheShardsHolders) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r : {0, 1, 2}) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[3]->step = 7;  // RunStateTransfers copied the step; the shard it holds is none
  ranks[3]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{3, 1, {1}}}));
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_TRUE(out[3]->received);
  EXPECT_EQ(out[3]->sources, 1) << "rank 1 is the only other holder of shard 1";
  EXPECT_EQ(out[3]->bytes_received, 3 * kShard * sizeof(float))
      << "one shard of three buffers, nothing else";
  EXPECT_TRUE(out[1]->served);
  EXPECT_FALSE(out[0]->served) << "shard 0's holders serve nobody";
  EXPECT_TRUE(ranks[3]->HoldsShard(1, 7));
  for (int r : {0, 1, 2})
    EXPECT_TRUE(ranks[static_cast<size_t>(r)]->HoldsShard(r % 2, 7)) << "rank " << r;
}

TEST(ExchangeShardsTest, ResizeReshardsLiveWithMembersSwappingShards) {
  // A shrink moved every rank by one: each holds the shard of its neighbour's rank.
  auto ranks = MakeRanks({2, 2, 2, 2, 2, 2});
  for (int r = 0; r < 6; ++r) ranks[static_cast<size_t>(r)]->Hold((r + 1) % 2, 12);
  // And a corrupted chunk on the way is fetched again.
  // Each rank's shard from its three holders, striped over them.
  const Moves moves = {{0, 0, {1, 3, 5}}, {1, 1, {0, 2, 4}}, {2, 0, {1, 3, 5}},
                       {3, 1, {0, 2, 4}}, {4, 0, {1, 3, 5}}, {5, 1, {0, 2, 4}}};
  auto out = ExchangeAll(ranks, PlanOf(ranks, 12, moves), [](int r) {
    TransferHooks h;
    h.corrupt_first_chunk = r == 2;
    return h;
  });
  int refetched = 0;
  for (int r = 0; r < 6; ++r) {
    ASSERT_TRUE(out[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << out[static_cast<size_t>(r)].status().ToString();
    EXPECT_TRUE(out[static_cast<size_t>(r)]->received && out[static_cast<size_t>(r)]->served)
        << "rank " << r;
    EXPECT_EQ(out[static_cast<size_t>(r)]->sources, 3) << "striped over the shard's three holders";
    refetched += out[static_cast<size_t>(r)]->refetched_chunks;
    EXPECT_TRUE(ranks[static_cast<size_t>(r)]->HoldsShard(r % 2, 12)) << "rank " << r;
  }
  EXPECT_EQ(refetched, 1);
}

// The shard exchange seals its chunks too: a holder's chunk rewritten on the way keeping its CRC
// is not staged; it is fetched again from the same holder (its second request: nonces of its own),
// and the shard lands whole.
TEST(ExchangeShardsTest, ASealedExchangeFetchesAChunkRewrittenKeepingItsCrcAgain) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r : {0, 1, 2}) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[3]->step = 7;
  ranks[3]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{3, 1, {1}}}), [](int r) {
    TransferHooks h;
    h.seal_key = crypto::JobKey(kToken);
    if (r == 1) h.tamper_first_chunk = TamperKeepingCrc;
    return h;
  });
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_EQ(out[3]->refetched_chunks, 1);
  EXPECT_TRUE(ranks[3]->HoldsShard(1, 7));
}

TEST(ExchangeShardsTest, AHolderThatServesNoChunkStillEndsItsPartOfTheProtocol) {
  // The whole shard is one chunk: of a receiver's three holders, two send
  // no chunk (a header, then a table for an empty request); they must not
  // wait for a request forever.
  auto ranks = MakeRanks({2, 2, 2, 2, 2, 2}, 1 << 20);
  for (int r = 0; r < 6; ++r) ranks[static_cast<size_t>(r)]->Hold((r + 1) % 2, 4);
  const Moves moves = {{0, 0, {1, 3, 5}}, {1, 1, {0, 2, 4}}, {2, 0, {1, 3, 5}},
                       {3, 1, {0, 2, 4}}, {4, 0, {1, 3, 5}}, {5, 1, {0, 2, 4}}};
  auto out = ExchangeAll(ranks, PlanOf(ranks, 4, moves));
  for (int r = 0; r < 6; ++r) {
    ASSERT_TRUE(out[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << out[static_cast<size_t>(r)].status().ToString();
    EXPECT_TRUE(ranks[static_cast<size_t>(r)]->HoldsShard(r % 2, 4)) << "rank " << r;
  }
}

TEST(ExchangeShardsTest, AMemberHoldingEveryShardServesEachReceiverItsOwn) {
  // Only rank 3 loaded the newest checkpoint (whole moments behind its views); the others copied
  // its step counters and hold no shard of that step.
  auto ranks = MakeRanks({2, 2, 2, 2}, 1024, /*whole_rank=*/3);
  ranks[3]->HoldEvery(7);
  for (int r : {0, 1, 2}) {
    ranks[static_cast<size_t>(r)]->step = 7;
    ranks[static_cast<size_t>(r)]->reg.set_held_shard(state::kNoShard);
  }
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{0, 0, {3}}, {1, 1, {3}}, {2, 0, {3}}}));
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(out[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << out[static_cast<size_t>(r)].status().ToString();
    EXPECT_TRUE(ranks[static_cast<size_t>(r)]->HoldsShard(r % 2, 7)) << "rank " << r;
  }
  EXPECT_TRUE(out[3]->served);
  EXPECT_FALSE(out[3]->received) << "it had its own shard already";
}

TEST(ExchangeShardsTest, TheInitialStateIsEveryShardAndMovesNothing) {
  auto ranks = MakeRanks({2, 2});
  for (auto& r : ranks) r->step = -1;
  auto out = ExchangeAll(ranks, PlanOf(ranks, -1, {}));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(out[static_cast<size_t>(r)].ok())
        << out[static_cast<size_t>(r)].status().ToString();
    EXPECT_FALSE(out[static_cast<size_t>(r)]->received);
    EXPECT_EQ(ranks[static_cast<size_t>(r)]->reg.held_shard(), r) << "bound to its rank's shard";
  }
}

TEST(ExchangeShardsTest, BeforeTheFirstStepEveryMemberHoldsEveryShard) {
  // World 4 lost ranks 1 and 3 (both holders of shard 1) before step 0 completed: the survivors,
  // bound to shard 0, still hold the initial state, which is every shard's.
  auto ranks = MakeRanks({2, 2});
  for (auto& r : ranks) {
    r->step = -1;
    ASSERT_TRUE(r->reg.BindShard(0).ok());
  }
  auto out = ExchangeAll(ranks, PlanOf(ranks, -1, {}));
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(out[static_cast<size_t>(r)].ok())
        << "rank " << r << ": " << out[static_cast<size_t>(r)].status().ToString();
    EXPECT_EQ(ranks[static_cast<size_t>(r)]->reg.held_shard(), r);
  }
}

TEST(ExchangeShardsTest, EveryCopyOfAShardLostIsDataLossNamingItOnEveryMember) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r : {0, 2}) ranks[static_cast<size_t>(r)]->Hold(0, 30);
  for (int r : {1, 3}) {  // both holders of shard 1 were replaced by spares
    ranks[static_cast<size_t>(r)]->step = 30;
    ranks[static_cast<size_t>(r)]->reg.set_held_shard(state::kNoShard);
  }
  // The planner's moves name no source for shard 1 (a release that had to take its last holder).
  auto out = ExchangeAll(ranks, PlanOf(ranks, 30, {{1, 1, {}}, {3, 1, {}}}));
  ExpectEveryRankRefuses(out, StatusCode::kDataLoss, "shard 1 of the optimizer state of step 30");
  EXPECT_TRUE(ranks[0]->HoldsShard(0, 30)) << "nothing is changed";
}

TEST(ExchangeShardsTest, AHolderWhoseShardDiffersFromTheOtherHoldersServesNobody) {
  // Groups of 2 over 8 ranks: shard 1's holders are ranks 1, 3 and 5; rank 7 is a spare. Rank 1's
  // copy of shard 1 had a value changed in memory (its CRCs agree with its bytes: only the other
  // holders can tell).
  auto ranks = MakeRanks({2, 2, 2, 2, 2, 2, 2, 2});
  for (int r = 0; r < 7; ++r) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[1]->m[3] += 1.0f;
  ranks[7]->step = 7;
  ranks[7]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{7, 1, {1, 3, 5}}}));
  for (size_t r = 0; r < out.size(); ++r)
    ASSERT_TRUE(out[r].ok()) << "rank " << r << ": " << out[r].status().ToString();
  EXPECT_EQ(out[7]->sources, 2) << "ranks 3 and 5, the majority";
  EXPECT_FALSE(out[1]->served);
  EXPECT_TRUE(ranks[7]->HoldsShard(1, 7)) << "the majority's bytes, none of rank 1's";
}

TEST(ExchangeShardsTest, TwoHoldersThatDisagreeAreNotCopiedFrom) {
  auto ranks = MakeRanks({2, 2, 2, 2, 2, 2});
  for (int r = 0; r < 5; ++r) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[1]->m[3] += 1.0f;
  ranks[5]->step = 7;
  ranks[5]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{5, 1, {1, 3}}}));
  ExpectEveryRankRefuses(out, StatusCode::kDataLoss, "no majority");
  for (const auto& r : out) EXPECT_TRUE(IsDisagreement(r.status())) << "the job stops: exit 11";
  EXPECT_TRUE(ranks[3]->HoldsShard(1, 7)) << "nothing is changed";
}

TEST(ExchangeShardsTest, AMemberOfAnotherGroupSizeIsRefusedByEveryone) {
  auto ranks = MakeRanks({2, 2, 2, 4});
  for (int r = 0; r < 4; ++r) ranks[static_cast<size_t>(r)]->step = 3;
  auto out = ExchangeAll(ranks, PlanOf(ranks, 3, {}));
  ExpectEveryRankRefuses(out, StatusCode::kInvalidArgument, "optimizer.shard_group");
}

TEST(ExchangeShardsTest, APlanOfAnotherGroupSizeIsRefusedByEveryone) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r = 0; r < 4; ++r) ranks[static_cast<size_t>(r)]->Hold(r % 2, 3);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 3, {}, /*group=*/4));
  ExpectEveryRankRefuses(
      out, StatusCode::kInvalidArgument,
      "the plan of generation 5 shards the optimizer state over groups of 4, this worker over "
      "groups of 2");
}

TEST(ExchangeShardsTest, AWorldThatIsNotAMultipleOfTheGroupIsRefused) {
  auto ranks = MakeRanks({2, 2, 2});
  auto out = ExchangeAll(ranks, PlanOf(ranks, -1, {}));
  for (const auto& o : out)
    EXPECT_EQ(o.status().code(), StatusCode::kInvalidArgument) << o.status().ToString();
}

// The worker carries out the controller's moves and plans none itself: a plan
// that disagrees with what the members hold fails on every member, naming
// the disagreement, before a byte is copied.
TEST(ExchangeShardsTest, APlanThatMovesNothingToAMemberLackingItsShardIsRefused) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r : {0, 1, 2}) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[3]->step = 7;  // a spare: no shard
  ranks[3]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {}));
  ExpectEveryRankRefuses(
      out, StatusCode::kFailedPrecondition,
      "rank 3 (worker 3) holds no shard (its state is of step 7), not shard 1 of step 7 (its "
      "rank's), and the plan moves nothing to it");
  EXPECT_EQ(ranks[3]->reg.held_shard(), state::kNoShard);
}

TEST(ExchangeShardsTest, ASourceThatDoesNotHoldTheShardItIsToServeIsRefused) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r : {0, 1, 2}) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[3]->step = 7;
  ranks[3]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{3, 1, {1, 2}}}));  // rank 2 holds shard 0
  ExpectEveryRankRefuses(
      out, StatusCode::kFailedPrecondition,
      "rank 2 (worker 2) is to serve shard 1 of step 7 to rank 3 (worker 3), but it holds shard 0 "
      "of step 7");
  EXPECT_TRUE(ranks[2]->HoldsShard(0, 7));
}

TEST(ExchangeShardsTest, AStaleCopyIsNoSource) {
  // Rank 1 holds shard 1 of step 6 (one step behind), rank 3 is a spare; only rank 5 holds shard 1
  // of step 7.
  auto ranks = MakeRanks({2, 2, 2, 2, 2, 2});
  for (int r : {0, 2, 4, 5}) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[1]->Hold(1, 6);
  ranks[3]->step = 7;
  ranks[3]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{1, 1, {5}}, {3, 1, {1, 5}}}));
  ExpectEveryRankRefuses(
      out, StatusCode::kFailedPrecondition,
      "rank 1 (worker 1) is to serve shard 1 of step 7 to rank 3 (worker 3), but it holds no shard "
      "(its state is of step 6)");
}

TEST(ExchangeShardsTest, AMoveToAMemberThatHoldsItsShardOrOfAnotherShardIsRefused) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r : {0, 1, 2}) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ranks[3]->step = 7;
  ranks[3]->reg.set_held_shard(state::kNoShard);
  auto out = ExchangeAll(ranks, PlanOf(ranks, 7, {{3, 0, {0, 2}}}));
  ExpectEveryRankRefuses(
      out, StatusCode::kFailedPrecondition,
      "rank 3 (worker 3) is to receive shard 0, but its rank holds shard 1 (rank mod 2)");
  out = ExchangeAll(ranks, PlanOf(ranks, 7, {{1, 1, {3}}, {3, 1, {1}}}));
  ExpectEveryRankRefuses(
      out, StatusCode::kFailedPrecondition,
      "rank 1 (worker 1) is to receive shard 1 of step 7, which it holds already");
  EXPECT_TRUE(ranks[1]->HoldsShard(1, 7));
}

// The shard exchange copies the sharded chunks only (the state transfer, the replicated ones): a
// holder refuses a request for a replicated chunk, naming it. Rank 3, a spare receiving shard 1
// from rank 1, is played by the test and asks for chunk 0 (the step counter).
TEST(ExchangeShardsTest, ARequestForAReplicatedChunkIsRefusedByTheHolder) {
  auto ranks = MakeRanks({2, 2, 2, 2});
  for (int r : {0, 1, 2}) ranks[static_cast<size_t>(r)]->Hold(r % 2, 7);
  ASSERT_FALSE(ranks[1]->reg.chunk_sharded(0));
  const control::PlanMsg plan = PlanOf(ranks, 7, {{3, 1, {1}}});
  std::vector<Result<TransferOutcome>> out;
  std::vector<std::jthread> members = StartExchanges(ranks, plan, 3, nullptr, &out);
  collective::Communicator& spare = *ranks[3]->comm;
  EXPECT_TRUE(JoinHoldings(spare, 2, state::kNoShard, 7).ok());
  std::string header(kHeaderBytes, '\0');
  EXPECT_TRUE(spare.Recv(1, std::as_writable_bytes(std::span(header))).ok());
  std::string count, body;
  PutFixed32(&count, 2);
  PutFixed32(&body, 1);  // one lane
  PutFixed32(&body, 0);  // chunk 0
  EXPECT_TRUE(spare.Send(1, std::as_bytes(std::span(count))).ok());
  EXPECT_TRUE(spare.Send(1, std::as_bytes(std::span(body))).ok());
  members[1].join();
  for (auto& r : ranks) r->comm->Abort("the test is over");  // ranks 0 and 2 wait in the barrier
  members.clear();                                           // joined
  ASSERT_FALSE(out[1].ok());
  EXPECT_EQ(out[1].status().code(), StatusCode::kDataLoss) << out[1].status().ToString();
  EXPECT_NE(out[1].status().message().find(
                "request for chunk 0, a replicated chunk, in the shard exchange"),
            std::string::npos)
      << out[1].status().ToString();
  EXPECT_TRUE(ranks[1]->HoldsShard(1, 7));
}

// A move that fails ends the member's other moves at once (its communicator is aborted with the
// cause; no peer waits out the collective's 30 s deadline) and commits nothing. Rank 3, a spare,
// copies shard 1 striped from ranks 1 and 2, which claim every shard: rank 1 (played by the test)
// sends a corrupt header, rank 2 has not started to serve.
TEST(ExchangeShardsTest, AFailedMoveEndsTheMembersOtherMovesAtOnceAndCommitsNothing) {
  auto ranks = MakeRanks({2, 2, 2, 2}, 1024, /*whole_rank=*/2);
  ranks[0]->Hold(0, 7);
  ranks[2]->HoldEvery(7);
  ranks[3]->step = 7;
  ranks[3]->reg.set_held_shard(state::kNoShard);
  const control::PlanMsg plan = PlanOf(ranks, 7, {{3, 1, {1, 2}}});
  std::promise<void> go;
  std::shared_future<void> started = go.get_future().share();
  std::vector<Result<TransferOutcome>> out;
  std::vector<std::jthread> members = StartExchanges(
      ranks, plan, 1,
      [started](int r) {
        TransferHooks h;
        if (r == 2) h.on_start = [started] { started.wait(); };  // rank 2 serves once let go
        return h;
      },
      &out);
  struct LetGo {  // rank 2 is let go however the test leaves, before its thread is joined
    std::promise<void>* go;
    ~LetGo() {
      try {
        go->set_value();
      } catch (const std::future_error&) {  // let go already
      }
    }
  } let_go{&go};
  collective::Communicator& holder = *ranks[1]->comm;
  EXPECT_TRUE(JoinHoldings(holder, 2, state::kEveryShard, 7).ok());
  std::string garbage(kHeaderBytes, 'x');
  EXPECT_TRUE(holder.Send(3, std::as_bytes(std::span(garbage))).ok());
  members[3].join();  // without the abort, its wait for rank 2's header lasts 30 s
  for (auto& r : ranks) r->comm->Abort("the test is over");
  go.set_value();
  members.clear();  // joined
  ASSERT_FALSE(out[3].ok());
  EXPECT_EQ(out[3].status().code(), StatusCode::kDataLoss) << out[3].status().ToString();
  EXPECT_NE(out[3].status().message().find("state header from rank 1 is corrupt"),
            std::string::npos)
      << out[3].status().ToString();
  const Status aborted = ranks[3]->comm->error();
  EXPECT_EQ(aborted.code(), StatusCode::kAborted) << aborted.ToString();
  EXPECT_NE(aborted.message().find("the shard exchange with rank 1 failed: state header from "
                                   "rank 1 is corrupt"),
            std::string::npos)
      << aborted.ToString();
  EXPECT_EQ(ranks[3]->reg.held_shard(), state::kNoShard) << "nothing committed";
}

// ValidatePlan, before anything acts on a plan: the shape of its shard moves.
TEST(ValidatePlanTest, RefusesShardMovesOfNonMembersWrongShardsOrBadSources) {
  control::PlanMsg plan;
  plan.generation = 3;
  plan.resume_step = 8;
  for (int id : {10, 11, 12, 13})
    plan.members.push_back({id, fmt::format("127.0.0.1:{}", 4000 + id)});
  plan.shard_group = 2;
  plan.shard_moves = {{13, 1, {11}}};
  ASSERT_TRUE(ValidatePlan(plan, 10).ok()) << ValidatePlan(plan, 10).ToString();
  const std::pair<control::PlanShardMove, std::string> bad[] = {
      {{14, 0, {10}}, "shard receiver worker 14 is not a member"},
      {{13, 0, {10}},
       "worker 13 is to receive shard 0, but its rank 3 holds shard 1 of groups of 2"},
      {{13, 1, {15}}, "source worker 15 of shard 1 for worker 13 is not a member"},
      {{13, 1, {13}}, "worker 13 is its own source of shard 1"},
      {{13, 1, {11, 11}}, "worker 11 is a source of shard 1 for worker 13 twice"},
  };
  for (const auto& [move, why] : bad) {
    control::PlanMsg p = plan;
    p.shard_moves = {move};
    Status s = ValidatePlan(p, 10);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << why;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.ToString();
  }
  control::PlanMsg twice = plan;
  twice.shard_moves.push_back({13, 1, {11}});
  EXPECT_NE(ValidatePlan(twice, 10).message().find("worker 13 receives a shard twice"),
            std::string::npos);
  control::PlanMsg ungrouped = plan;
  ungrouped.shard_group = 0;
  EXPECT_NE(ValidatePlan(ungrouped, 10).message().find("moves shards but names no shard_group"),
            std::string::npos);
}

}  // namespace
}  // namespace nonstop::worker
