// The Communicator contract (data_plane.h) over the TCP data plane.
#include "collective/data_plane.h"
#include "common/role_keys.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "collective/tcp_data_plane.h"
#include "nonstop/tree.h"

namespace nonstop::collective {
namespace {

constexpr char kToken[] = "test-token";

// One rank's world: its data plane, abort signal and communicator.
struct RankEnv {
  net::AbortSignal abort;  // first: outlives the data plane, whose accept thread may poll it
  std::unique_ptr<TcpDataPlane> plane;
  std::unique_ptr<Communicator> comm;
};

using Body = std::function<void(int rank, Communicator& comm)>;

std::vector<net::Listener> MakeListeners(int w) {
  std::vector<net::Listener> out;
  for (int i = 0; i < w; ++i) {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok()) << l.status().ToString();
    out.push_back(std::move(*l));
  }
  return out;
}

std::vector<Member> MembersOf(const std::vector<net::Listener>& ls) {
  std::vector<Member> m;
  for (size_t i = 0; i < ls.size(); ++i)
    m.push_back({static_cast<int>(i), ls[i].address.ToString()});
  return m;
}

std::unique_ptr<RankEnv> MakeRank(int rank, net::Listener listener,
                                  const std::vector<Member>& members, size_t piece_bytes = 64 << 10,
                                  bool checked = false) {
  auto env = std::make_unique<RankEnv>();
  env->plane = TcpDataPlane::Create({WorkerDataKey(crypto::JobKey(kToken)), rank},
                                    std::move(listener), &env->abort);
  CommunicatorOptions o;
  o.generation = 1;
  o.rank = rank;
  o.members = members;
  o.timeout_collective = Millis(30'000);
  o.piece_bytes = piece_bytes;
  o.checked = checked;
  env->comm = env->plane->NewCommunicator(o);
  return env;
}

// Runs `body` on W threads, one rank each (gloo BaseTest::spawn).
void RunThreads(int w, const Body& body, size_t piece_bytes = 64 << 10, bool checked = false) {
  auto listeners = MakeListeners(w);
  auto members = MembersOf(listeners);
  std::vector<std::unique_ptr<RankEnv>> envs;
  for (int r = 0; r < w; ++r)
    envs.push_back(
        MakeRank(r, std::move(listeners[static_cast<size_t>(r)]), members, piece_bytes, checked));
  std::vector<std::thread> threads;
  for (int r = 0; r < w; ++r) {
    threads.emplace_back([&, r] {
      Status s = envs[static_cast<size_t>(r)]->comm->Connect();
      ASSERT_TRUE(s.ok()) << s.ToString();
      body(r, *envs[static_cast<size_t>(r)]->comm);
    });
  }
  for (auto& t : threads) t.join();
}

// Connects and runs `body` on one thread per already-built rank.
void RunRanksOn(std::vector<std::unique_ptr<RankEnv>>& envs, const Body& body) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < envs.size(); ++r) {
    threads.emplace_back([&, r] {
      Status s = envs[r]->comm->Connect();
      ASSERT_TRUE(s.ok()) << s.ToString();
      body(static_cast<int>(r), *envs[r]->comm);
    });
  }
  for (auto& t : threads) t.join();
}

// Runs `body` in W forked processes; a failed expectation in a child makes it exit 1.
void RunProcesses(int w, const Body& body) {
  auto listeners = MakeListeners(w);
  auto members = MembersOf(listeners);
  std::vector<pid_t> pids;
  for (int r = 0; r < w; ++r) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (int o = 0; o < w; ++o)
        if (o != r) listeners[static_cast<size_t>(o)].fd.Reset();
      auto env = MakeRank(r, std::move(listeners[static_cast<size_t>(r)]), members);
      Status s = env->comm->Connect();
      if (!s.ok()) _exit(3);
      body(r, *env->comm);
      _exit(::testing::Test::HasFailure() ? 1 : 0);
    }
    pids.push_back(pid);
  }
  listeners.clear();
  for (int r = 0; r < w; ++r) {
    int status = 0;
    ASSERT_EQ(::waitpid(pids[static_cast<size_t>(r)], &status, 0), pids[static_cast<size_t>(r)]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << r << " status " << status;
  }
}

// Rank r's input: integer-valued floats, so every summation order gives the same exact sum.
std::vector<float> IntegerInput(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>((static_cast<int>(i % 1000) * (rank + 3)) % 17 - 8);
  return v;
}

std::vector<float> RandomInput(int rank, size_t n) {
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The naive reference: gather everything and sum in rank order.
std::vector<float> NaiveSum(int w, size_t n, std::vector<float> (*input)(int, size_t)) {
  std::vector<float> sum(n, 0.0f);
  for (int r = 0; r < w; ++r) {
    auto v = input(r, n);
    for (size_t i = 0; i < n; ++i) sum[i] += v[i];
  }
  return sum;
}

// {world size, elements, checked collectives}
class AllReduceTest : public ::testing::TestWithParam<std::tuple<int, size_t, bool>> {};

TEST_P(AllReduceTest, MatchesNaiveGatherSumWithThreads) {
  auto [w, n, checked] = GetParam();
  auto want = NaiveSum(w, n, IntegerInput);
  auto want_random = NaiveSum(w, n, RandomInput);
  std::vector<std::vector<float>> results(static_cast<size_t>(w)), again(static_cast<size_t>(w));
  RunThreads(
      w,
      [&](int rank, Communicator& comm) {
        auto data = IntegerInput(rank, n);
        ASSERT_TRUE(comm.AllReduce(data).ok());
        EXPECT_EQ(data, want) << "rank " << rank;
        // Random inputs: close to the naive sum, and bitwise identical across ranks and runs.
        auto r1 = RandomInput(rank, n);
        auto r2 = RandomInput(rank, n);
        ASSERT_TRUE(comm.AllReduce(r1).ok());
        ASSERT_TRUE(comm.AllReduce(r2).ok());
        for (size_t i = 0; i < n; ++i) ASSERT_NEAR(r1[i], want_random[i], 1e-5) << i;
        results[static_cast<size_t>(rank)] = r1;
        again[static_cast<size_t>(rank)] = r2;
        EXPECT_EQ(comm.stats().pieces_refetched, 0u) << "nothing was damaged";
      },
      64 << 10, checked);
  for (int r = 0; r < w && n > 0; ++r) {  // bitwise: memcmp, not float ==
    EXPECT_EQ(
        std::memcmp(results[static_cast<size_t>(r)].data(), results[0].data(), n * sizeof(float)),
        0)
        << "rank " << r << " differs from rank 0";
    EXPECT_EQ(
        std::memcmp(again[static_cast<size_t>(r)].data(), results[0].data(), n * sizeof(float)), 0)
        << "second run differs on rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndLengths, AllReduceTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 5, 8),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{7},
                                                              size_t{1001},
                                                              size_t{(3u << 20) / 4 + 3}),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "w" + std::to_string(std::get<0>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_checked" : "");
                         });

// A bit flipped on the wire (InjectWireFlip) in the last reduce step or the
// last gather step of rank 1's ring. {world size, gather}
class WireFlipTest : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  static constexpr size_t kN = 50'000;
  static constexpr size_t kPiece =
      4096;  // several pieces per chunk: frames in flight behind the bad one

  // Every rank's AllReduce of RandomInput, rank 1 flipping when `flip`; refetched: the ranks' sum.
  static std::vector<std::vector<float>> Run(int w, bool gather, bool flip, bool checked,
                                             uint64_t* refetched = nullptr) {
    std::vector<std::vector<float>> out(static_cast<size_t>(w));
    std::atomic<uint64_t> total{0};
    RunThreads(
        w,
        [&](int rank, Communicator& comm) {
          auto data = RandomInput(rank, kN);
          if (flip && rank == 1) comm.InjectWireFlip(gather);
          Status s = comm.AllReduce(data);
          ASSERT_TRUE(s.ok()) << s.ToString();
          out[static_cast<size_t>(rank)] = data;
          total += comm.stats().pieces_refetched;
        },
        kPiece, checked);
    if (refetched != nullptr) *refetched = total.load();
    return out;
  }

  static bool Same(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }
};

TEST_P(WireFlipTest, CheckedRingFetchesTheFlippedPieceAgainAndEveryRankGetsTheCleanBits) {
  auto [w, gather] = GetParam();
  auto clean = Run(w, gather, /*flip=*/false, /*checked=*/true);
  uint64_t refetched = 0;
  auto got = Run(w, gather, /*flip=*/true, /*checked=*/true, &refetched);
  EXPECT_EQ(refetched, 1u) << "one damaged piece, asked for once";
  for (int r = 0; r < w; ++r)
    EXPECT_TRUE(Same(got[static_cast<size_t>(r)], clean[0])) << "rank " << r << " has other bits";
}

TEST_P(WireFlipTest, UncheckedRingLetsTheFlippedBitIntoTheResult) {
  auto [w, gather] = GetParam();
  auto clean = Run(w, gather, /*flip=*/false, /*checked=*/false);
  auto got = Run(w, gather, /*flip=*/true, /*checked=*/false);
  std::vector<int> differ;
  for (int r = 0; r < w; ++r)
    if (!Same(got[static_cast<size_t>(r)], clean[0])) differ.push_back(r);
  if (gather) {
    // The last gather step's receiver keeps the piece: only rank 2 (1's right neighbour) is off.
    EXPECT_EQ(differ, std::vector<int>{2 % w});
  } else {
    // The last reduce step completes a chunk's sum, which every rank then gathers.
    EXPECT_EQ(differ.size(), static_cast<size_t>(w));
  }
}

INSTANTIATE_TEST_SUITE_P(WorldsAndPhases, WireFlipTest,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Bool()),
                         [](const auto& info) {
                           return "w" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_gather" : "_reduce");
                         });

TEST(CommunicatorTest, AllReduceWithProcesses) {
  const int w = 4;
  const size_t n = (5u << 20) / 4 + 11;  // 5 MiB, not divisible by the world size
  auto want = NaiveSum(w, n, IntegerInput);
  RunProcesses(w, [&](int rank, Communicator& comm) {
    auto data = IntegerInput(rank, n);
    ASSERT_TRUE(comm.AllReduce(data).ok());
    EXPECT_EQ(data, want);
  });
}

TEST(CommunicatorTest, SmallPiecesPipelineCorrectly) {
  // Many pieces per chunk (64-byte pieces) stress the piece dependencies.
  const int w = 3;
  const size_t n = 10'000;
  auto want = NaiveSum(w, n, IntegerInput);
  RunThreads(
      w,
      [&](int rank, Communicator& comm) {
        auto data = IntegerInput(rank, n);
        ASSERT_TRUE(comm.AllReduce(data).ok());
        EXPECT_EQ(data, want);
      },
      /*piece_bytes=*/64);
}

// The world-invariant all-reduce: the same m micro-batch gradients, split
// over 1 to 5 ranks (unevenly too), sum to the same bits on every rank and
// at every world size: the tree's sum.
TEST(CommunicatorTest, AllReduceTreeGivesTheSameBitsAtEveryWorldSizeCheckedOrNot) {
  const int m = 8;
  const size_t n = 1001;  // chunks of unequal sizes
  std::vector<std::vector<float>> g(m, std::vector<float>(n));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (int i = 0; i < m; ++i) {
    for (auto& x : g[static_cast<size_t>(i)])
      x = u(rng) * std::pow(10.0f, static_cast<float>(i % 5 - 2));
  }
  TreeFolder all(m, 0, m, n);
  for (const auto& v : g) all.Add(v);
  const std::vector<float> want = all.partials()[0];
  // Checked: with a bit flipped on the wire in rank 1's all-gather, fetched again.
  for (bool checked : {false, true}) {
    for (int w : {1, 2, 3, 4, 5}) {
      std::vector<std::pair<int, int>> ranges;
      for (int q = 0; q < w; ++q) ranges.push_back({q * m / w, (q + 1) * m / w});
      std::vector<std::vector<float>> got(static_cast<size_t>(w));
      std::atomic<uint64_t> refetched{0};
      RunThreads(
          w,
          [&](int rank, Communicator& comm) {
            auto [first, last] = ranges[static_cast<size_t>(rank)];
            TreeFolder f(m, first, last, n);
            for (int i = first; i < last; ++i) f.Add(g[static_cast<size_t>(i)]);
            std::vector<float> out(n);
            if (checked && rank == 1) comm.InjectWireFlip(/*gather=*/true);
            Status s = comm.AllReduceTree(m, ranges, f.partials(), out);
            ASSERT_TRUE(s.ok()) << s.ToString();
            got[static_cast<size_t>(rank)] = std::move(out);
            refetched += comm.stats().pieces_refetched;
          },
          /*piece_bytes=*/1024, checked);
      EXPECT_EQ(refetched.load(), checked && w > 1 ? 1u : 0u) << "world " << w;
      for (int q = 0; q < w; ++q) {
        ASSERT_EQ(got[static_cast<size_t>(q)].size(), n);
        EXPECT_EQ(std::memcmp(got[static_cast<size_t>(q)].data(), want.data(), n * sizeof(float)),
                  0)
            << "world " << w << " rank " << q << " differs from the tree's sum"
            << (checked ? " (checked, a bit flipped on the wire)" : "");
      }
    }
  }
}

// A salvaged step (PlanTreeStep): at world 4 rank 1 was lost mid-step and
// the others had folded prefixes of their ranges; the new ranks hold kept
// nodes beside the runs they computed again, not one range each. The sum
// still has the tree's bits on every rank.
TEST(CommunicatorTest, AllReduceTreeOverSalvagedNodeSetsGivesTheTreesBits) {
  const int m = 8;
  const size_t n = 777;
  std::vector<std::vector<float>> g(m, std::vector<float>(n));
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1, 1);
  for (int i = 0; i < m; ++i) {
    for (auto& x : g[static_cast<size_t>(i)])
      x = u(rng) * std::pow(10.0f, static_cast<float>(i % 4 - 2));
  }
  TreeFolder all(m, 0, m, n);
  for (const auto& v : g) all.Add(v);
  const std::vector<float> want = all.partials()[0];
  // Held after the fault: old rank 0 folded micro-batch 0 of [0, 2); old rank 2 all of [4, 6); old
  // rank 3 micro-batch 6 of [6, 8). The spare (new rank 1, in the lost rank's place) holds nothing.
  std::vector<std::vector<TreeNode>> offered = {{{0, 0}}, {}, {{1, 2}}, {{0, 6}}};
  auto shares = PlanTreeStep(m, offered);
  std::vector<std::vector<TreeNode>> nodes_of;
  int kept = 0;
  for (const auto& share : shares) {
    nodes_of.push_back(share.nodes);
    for (const auto& node : share.kept)
      kept += NodeRange(m, node).second - NodeRange(m, node).first;
  }
  ASSERT_EQ(kept, 4);
  std::vector<std::vector<float>> got(4);
  RunThreads(
      4,
      [&](int rank, Communicator& comm) {
        const TreeShare& mine = shares[static_cast<size_t>(rank)];
        std::vector<std::pair<TreeNode, std::vector<float>>> have;
        for (const auto& node : mine.kept) {  // as folded before the fault
          auto [first, last] = NodeRange(m, node);
          TreeFolder f(m, first, last, n);
          for (int i = first; i < last; ++i) f.Add(g[static_cast<size_t>(i)]);
          have.push_back({node, f.partials()[0]});
        }
        for (auto [first, last] : mine.compute) {
          TreeFolder f(m, first, last, n);
          for (int i = first; i < last; ++i) f.Add(g[static_cast<size_t>(i)]);
          for (size_t k = 0; k < f.nodes().size(); ++k)
            have.push_back({f.nodes()[k], f.partials()[k]});
        }
        std::sort(have.begin(), have.end(), [&](const auto& a, const auto& b) {
          return NodeRange(m, a.first).first < NodeRange(m, b.first).first;
        });
        std::vector<std::vector<float>> partials;
        for (auto& [node, sum] : have) partials.push_back(std::move(sum));
        std::vector<float> out(n);
        Status s =
            comm.AllReduceTree(m, std::span<const std::vector<TreeNode>>(nodes_of), partials, out);
        ASSERT_TRUE(s.ok()) << s.ToString();
        got[static_cast<size_t>(rank)] = std::move(out);
      },
      /*piece_bytes=*/1024);
  for (int q = 0; q < 4; ++q) {
    EXPECT_EQ(std::memcmp(got[static_cast<size_t>(q)].data(), want.data(), n * sizeof(float)), 0)
        << "rank " << q;
  }
}

// Sub-group communicators (issue 12's schedule for sharded optimizer state):
// 6 ranks in shard groups of 2 ({0,1}, {2,3}, {4,5}); a reduce-scatter in the
// group, an all-reduce across the replicas of each shard ({0,2,4}, {1,3,5})
// and an all-gather in the group give every rank the world's sum, with world
// collectives between them on the same connections.
TEST(CommunicatorTest, SubGroupsReduceInTheGroupAcrossTheReplicasAndGatherAsTheWorldDoes) {
  const int w = 6, g = 2;
  const size_t n = 1001;
  auto want = NaiveSum(w, n, IntegerInput);  // integers: exact in any order
  RunThreads(w, [&](int rank, Communicator& comm) {
    const int group = rank / g, shard = rank % g;
    std::vector<int> in_group, replicas;
    for (int q = 0; q < g; ++q) in_group.push_back(group * g + q);
    for (int q = shard; q < w; q += g) replicas.push_back(q);
    auto grp = comm.SubGroup(in_group, static_cast<uint32_t>(1 + group), Millis(0));
    auto rep = comm.SubGroup(replicas, static_cast<uint32_t>(1 + w / g + shard), Millis(0));
    EXPECT_EQ(grp->rank(), shard);
    EXPECT_EQ(grp->world_size(), g);
    EXPECT_EQ(rep->rank(), group);
    for (int round = 0; round < 2; ++round) {
      auto data = IntegerInput(rank, n);
      ASSERT_TRUE(comm.Barrier().ok());  // a world collective before, on the same connections
      ASSERT_TRUE(grp->ReduceScatter(data).ok());
      auto [lo, hi] = ChunkRange(n, g, shard);
      std::span<float> mine(data.data() + lo, hi - lo);
      Status s = rep->AllReduce(mine);
      ASSERT_TRUE(s.ok()) << s.ToString();
      for (size_t i = lo; i < hi; ++i)
        ASSERT_EQ(data[i], want[i]) << "rank " << rank << " element " << i;
      // The update stands in: each rank holds its shard; the group gathers the whole.
      std::vector<float> params(n, -1.0f);
      std::copy(data.begin() + static_cast<long>(lo), data.begin() + static_cast<long>(hi),
                params.begin() + static_cast<long>(lo));
      ASSERT_TRUE(
          grp->AllGather(std::as_writable_bytes(std::span<float>(params)), sizeof(float)).ok());
      ASSERT_EQ(params, want) << "rank " << rank;
      auto again = IntegerInput(rank, n);
      ASSERT_TRUE(comm.AllReduce(again).ok());  // and a world collective after
      ASSERT_EQ(again, want);
    }
  });
}

// An abort of the generation (its world communicator's Abort, from another
// thread, as the session does) wakes a sub-group's blocked call too.
TEST(CommunicatorTest, AbortOfTheGenerationWakesASubGroupsBlockedCall) {
  RunThreads(3, [&](int rank, Communicator& comm) {
    if (rank != 0) {  // rank 1 never enters the group's collective: rank 0 waits until the abort
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      return;
    }
    std::vector<int> pair = {0, 1};
    auto grp = comm.SubGroup(pair, 1, Millis(0));
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      comm.Abort("a member failed");
    });
    std::vector<float> data(1000, 1.0f);
    auto t0 = std::chrono::steady_clock::now();
    Status s = grp->AllReduce(data);
    aborter.join();
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
    EXPECT_EQ(grp->Barrier().code(), StatusCode::kAborted) << "sticky in the group too";
  });
}

TEST(CommunicatorTest, ReduceScatterLeavesChunkRankReduced) {
  for (int w : {2, 3, 5}) {
    const size_t n = 1003;
    auto want = NaiveSum(w, n, IntegerInput);
    RunThreads(w, [&](int rank, Communicator& comm) {
      auto data = IntegerInput(rank, n);
      ASSERT_TRUE(comm.ReduceScatter(data).ok());
      auto [lo, hi] = ChunkRange(n, w, rank);
      for (size_t i = lo; i < hi; ++i)
        ASSERT_EQ(data[i], want[i]) << "w=" << w << " rank " << rank << " i " << i;
    });
  }
}

TEST(CommunicatorTest, AllGatherCollectsEveryRanksChunk) {
  for (int w : {1, 2, 3, 8}) {
    const size_t n = 77;
    RunThreads(w, [&](int rank, Communicator& comm) {
      std::vector<int32_t> data(n, -1);
      auto [lo, hi] = ChunkRange(n, w, rank);
      for (size_t i = lo; i < hi; ++i)
        data[i] = static_cast<int32_t>(i * 10 + static_cast<size_t>(rank));
      ASSERT_TRUE(comm.AllGather(std::as_writable_bytes(std::span(data)), sizeof(int32_t)).ok());
      for (int c = 0; c < w; ++c) {
        auto [clo, chi] = ChunkRange(n, w, c);
        for (size_t i = clo; i < chi; ++i)
          ASSERT_EQ(data[i], static_cast<int32_t>(i * 10 + static_cast<size_t>(c)));
      }
    });
  }
}

TEST(CommunicatorTest, BroadcastFromEveryRoot) {
  const int w = 5;
  RunThreads(w, [&](int rank, Communicator& comm) {
    for (int root = 0; root < w; ++root) {
      std::vector<uint8_t> data(300'001, static_cast<uint8_t>(rank));
      if (rank == root)
        for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + root);
      ASSERT_TRUE(comm.Broadcast(std::as_writable_bytes(std::span(data)), root).ok());
      for (size_t i = 0; i < data.size(); ++i)
        ASSERT_EQ(data[i], static_cast<uint8_t>(i * 7 + root)) << root;
    }
  });
}

TEST(CommunicatorTest, PointToPointMovesLargeBuffersBetweenAnyRanks) {
  const int w = 4;
  const size_t bytes = (6u << 20) + 5;
  RunThreads(w, [&](int rank, Communicator& comm) {
    // 0 → 2 and 3 → 1, non-neighbours included.
    std::vector<uint8_t> buf(bytes);
    if (rank == 0 || rank == 3) {
      for (size_t i = 0; i < bytes; ++i)
        buf[i] = static_cast<uint8_t>(i * 31 + static_cast<size_t>(rank));
      ASSERT_TRUE(comm.Send(rank == 0 ? 2 : 1, std::as_bytes(std::span(buf))).ok());
    } else {
      int from = rank == 2 ? 0 : 3;
      ASSERT_TRUE(comm.Recv(from, std::as_writable_bytes(std::span(buf))).ok());
      for (size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(buf[i], static_cast<uint8_t>(i * 31 + static_cast<size_t>(from)));
    }
    ASSERT_TRUE(comm.Barrier().ok());
  });
}

// Lanes (state copies over several streams): a thread per lane at both ends, each lane's bytes
// on a connection of its own, checked frames and unchecked ones interleaved as the state
// transfer sends them; lane 0 is the same connection as Send/Recv.
TEST(CommunicatorTest, EveryLaneMovesItsOwnBytesAtOnce) {
  const size_t bytes = (1u << 20) + 3;
  RunThreads(2, [&](int rank, Communicator& comm) {
    ASSERT_EQ(comm.p2p_lanes(), net::kDataLanes);
    auto fill = [&](int lane, size_t i) { return static_cast<uint8_t>(i * 7 + 13 * lane); };
    std::vector<std::thread> lanes;
    std::vector<Status> results(static_cast<size_t>(comm.p2p_lanes()));
    for (int lane = 0; lane < comm.p2p_lanes(); ++lane) {
      lanes.emplace_back([&, lane] {
        std::vector<uint8_t> buf(bytes);
        std::string meta(8, '\0');
        Status& s = results[static_cast<size_t>(lane)];
        for (int round = 0; round < 3 && s.ok(); ++round) {
          if (rank == 0) {
            for (size_t i = 0; i < bytes; ++i) buf[i] = fill(lane, i + round);
            meta[0] = static_cast<char>(lane);
            s = comm.SendOnLane(1, lane, HostRegion(std::as_bytes(std::span(meta))), true);
            if (s.ok())
              s = comm.SendOnLane(1, lane, HostRegion(std::as_bytes(std::span(buf))),
                                  /*checked=*/false);
          } else {
            s = comm.RecvOnLane(0, lane, HostRegion(std::as_writable_bytes(std::span(meta))), true);
            if (s.ok())
              s = comm.RecvOnLane(0, lane, HostRegion(std::as_writable_bytes(std::span(buf))),
                                  false);
            if (s.ok() && meta[0] != static_cast<char>(lane)) s = DataLossError("wrong lane");
            for (size_t i = 0; i < bytes && s.ok(); ++i) {
              if (buf[i] != fill(lane, i + round)) s = DataLossError("bytes of another lane");
            }
          }
        }
      });
    }
    for (auto& t : lanes) t.join();
    for (size_t l = 0; l < results.size(); ++l)
      EXPECT_TRUE(results[l].ok()) << l << ": " << results[l].ToString();
    // Lane 0 is Send/Recv's connection: it goes on in step with them.
    std::vector<uint8_t> one(16, static_cast<uint8_t>(rank));
    if (rank == 0) {
      ASSERT_TRUE(comm.Send(1, std::as_bytes(std::span(one))).ok());
    } else {
      ASSERT_TRUE(comm.Recv(0, std::as_writable_bytes(std::span(one))).ok());
      EXPECT_EQ(one[0], 0);
    }
  });
}

TEST(CommunicatorTest, AbortWakesABlockedAllReduceAndIsSticky) {
  auto listeners = MakeListeners(2);
  auto members = MembersOf(listeners);
  auto r0 = MakeRank(0, std::move(listeners[0]), members);
  auto r1 = MakeRank(1, std::move(listeners[1]), members);
  std::thread connect1([&] { ASSERT_TRUE(r1->comm->Connect().ok()); });
  ASSERT_TRUE(r0->comm->Connect().ok());
  connect1.join();
  // Rank 1 never joins the collective; rank 0 blocks until aborted.
  std::thread aborter([&] {
    std::this_thread::sleep_for(Millis(100));
    r0->comm->Abort("controller ended generation 1");
  });
  std::vector<float> data(1 << 20, 1.0f);
  auto start = Clock::now();
  Status s = r0->comm->AllReduce(data);
  auto elapsed = Clock::now() - start;
  aborter.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_NE(s.message().find("controller ended generation 1"), std::string::npos) << s.ToString();
  EXPECT_LT(elapsed, Millis(10'000));  // far below the 30 s collective timeout
  EXPECT_EQ(r0->comm->Barrier().code(), StatusCode::kAborted) << "the first error is sticky";
}

TEST(CommunicatorTest, KilledPeerProcessFailsSurvivorsPromptly) {
  // Rank 2 of 3 is SIGKILLed while the others wait in an allreduce: they get
  // kUnavailable from the connection reset, not a timeout.
  const int w = 3;
  auto listeners = MakeListeners(w);
  auto members = MembersOf(listeners);
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  std::vector<pid_t> pids;
  for (int r = 0; r < w; ++r) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(pipefd[0]);
      for (int o = 0; o < w; ++o)
        if (o != r) listeners[static_cast<size_t>(o)].fd.Reset();
      auto env = MakeRank(r, std::move(listeners[static_cast<size_t>(r)]), members);
      if (!env->comm->Connect().ok()) _exit(3);
      if (r == 2) {
        char c = 'x';
        (void)::write(pipefd[1], &c, 1);  // tell the parent we are connected
        ::pause();                        // never calls the collective; the parent kills us
        _exit(4);
      }
      std::vector<float> data(1 << 16, 1.0f);
      auto start = Clock::now();
      Status s = env->comm->AllReduce(data);
      auto ms = std::chrono::duration_cast<Millis>(Clock::now() - start).count();
      if (s.code() != StatusCode::kUnavailable) _exit(5);
      if (ms > 10'000) _exit(6);  // the collective timeout is 30 s
      _exit(0);
    }
    pids.push_back(pid);
  }
  ::close(pipefd[1]);
  listeners.clear();
  char c;
  ASSERT_EQ(::read(pipefd[0], &c, 1), 1);
  std::this_thread::sleep_for(Millis(100));
  ::kill(pids[2], SIGKILL);
  for (int r = 0; r < w; ++r) {
    int status = 0;
    ::waitpid(pids[static_cast<size_t>(r)], &status, 0);
    if (r == 2) {
      EXPECT_TRUE(WIFSIGNALED(status));
    } else {
      EXPECT_TRUE(WIFEXITED(status)) << status;
      EXPECT_EQ(WEXITSTATUS(status), 0) << "rank " << r;
    }
  }
}

TEST(CommunicatorTest, NextGenerationReusesConnectionsAfterAnAbortMidTransfer) {
  // Rank 0 starts a large allreduce that rank 1 never joins: its first ring
  // step streams pieces until the socket buffers are full, then it is aborted
  // with frames in flight and, most likely, one cut in the middle. Generation
  // 2 from the same data planes must work on the same sockets: the owed bytes
  // are padded, and rank 1 drops the stale frames by their generation tag.
  auto listeners = MakeListeners(2);
  auto members = MembersOf(listeners);
  std::vector<std::unique_ptr<RankEnv>> envs;
  for (int r = 0; r < 2; ++r)
    envs.push_back(MakeRank(r, std::move(listeners[static_cast<size_t>(r)]), members));
  RunRanksOn(envs, [](int, Communicator&) {});  // connect
  std::vector<float> big(16 << 20, 1.0f);       // 64 MiB: far more than the socket buffers hold
  std::thread aborter([&] {
    std::this_thread::sleep_for(Millis(200));
    for (auto& e : envs) e->comm->Abort("test: generation 1 ends");
  });
  Status first = envs[0]->comm->AllReduce(big);
  aborter.join();
  EXPECT_EQ(first.code(), StatusCode::kAborted) << first.ToString();
  EXPECT_GT(envs[0]->comm->stats().bytes_sent, 0u);
  std::vector<std::thread> threads;

  const size_t n = 300'001;
  auto want = NaiveSum(2, n, IntegerInput);
  for (int r = 0; r < 2; ++r) {
    envs[static_cast<size_t>(r)]->abort.Reset();
    CommunicatorOptions o;
    o.generation = 2;
    o.rank = r;
    o.members = members;
    o.piece_bytes = 64 << 10;
    envs[static_cast<size_t>(r)]->comm = envs[static_cast<size_t>(r)]->plane->NewCommunicator(o);
  }
  std::vector<uint64_t> stale(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto& comm = *envs[static_cast<size_t>(r)]->comm;
      ASSERT_TRUE(comm.Connect().ok());
      for (int i = 0; i < 3; ++i) {
        auto data = IntegerInput(r, n);
        Status s = comm.AllReduce(data);
        ASSERT_TRUE(s.ok()) << s.ToString();
        ASSERT_EQ(data, want);
      }
      stale[static_cast<size_t>(r)] = comm.stats().stale_frames_dropped;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(envs[static_cast<size_t>(r)]->plane->stats().connections_opened, 1)
        << "rank " << r << " reconnected";
  }
  EXPECT_GT(stale[1], 0u) << "frames of the aborted allreduce were in flight and dropped";
}

TEST(CommunicatorTest, BrokenConnectionIsRedialedInTheNextGeneration) {
  auto listeners = MakeListeners(2);
  auto members = MembersOf(listeners);
  std::vector<std::unique_ptr<RankEnv>> envs;
  for (int r = 0; r < 2; ++r)
    envs.push_back(MakeRank(r, std::move(listeners[static_cast<size_t>(r)]), members));
  RunRanksOn(envs, [](int, Communicator& comm) { ASSERT_TRUE(comm.Barrier().ok()); });
  envs[1]->plane->mesh().Drop(0);  // like a dropped link: rank 1 closes its end
  for (int r = 0; r < 2; ++r) {
    CommunicatorOptions o;
    o.generation = 2;
    o.rank = r;
    o.members = members;
    envs[static_cast<size_t>(r)]->comm = envs[static_cast<size_t>(r)]->plane->NewCommunicator(o);
  }
  std::this_thread::sleep_for(Millis(20));  // let the close reach rank 0
  RunRanksOn(envs, [](int r, Communicator& comm) {
    std::vector<float> v(1000, static_cast<float>(r + 1));
    Status s = comm.AllReduce(v);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(v[999], 3.0f);
  });
  EXPECT_EQ(envs[0]->plane->stats().connections_opened, 2) << "rank 0 dialed again";
}

TEST(CommunicatorTest, ConnectionsAreOpenedOnlyToRingNeighbours) {
  const int w = 5;
  auto listeners = MakeListeners(w);
  auto members = MembersOf(listeners);
  std::vector<std::unique_ptr<RankEnv>> envs;
  for (int r = 0; r < w; ++r)
    envs.push_back(MakeRank(r, std::move(listeners[static_cast<size_t>(r)]), members));
  std::vector<std::thread> threads;
  for (int r = 0; r < w; ++r) {
    threads.emplace_back([&, r] {
      ASSERT_TRUE(envs[static_cast<size_t>(r)]->comm->Connect().ok());
      std::vector<float> data(1000, 1.0f);
      ASSERT_TRUE(envs[static_cast<size_t>(r)]->comm->AllReduce(data).ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < w; ++r)
    EXPECT_EQ(envs[static_cast<size_t>(r)]->plane->stats().connections_opened, 2) << r;
}

TEST(CommunicatorTest, MeshRefusesAStrangerWithTheWrongToken) {
  auto listeners = MakeListeners(2);
  auto members = MembersOf(listeners);
  auto r1 = MakeRank(1, std::move(listeners[1]), members);
  PeerMeshOptions opts{WorkerDataKey(crypto::JobKey("wrong-token")), 0};
  auto stranger = PeerMesh::Create(opts, std::move(listeners[0]));
  net::AbortSignal abort;
  Result<Connection*> c =
      stranger->Get(1, members[1].address, 1, DeadlineAfter(Millis(3000)), &abort);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("did not prove the job key"), std::string::npos)
      << c.status().ToString();
  EXPECT_EQ(r1->plane->stats().connections_opened, 0);
}

}  // namespace
}  // namespace nonstop::collective

namespace nonstop::collective {
namespace {

// Every type and operation of reduce.h through the ring, pieces small enough that each chunk
// is cut: integers exactly (wrapping), comparisons exactly, floats equal on every rank.
TEST(CommunicatorTest, EveryTypeAndOperationReducesOnTheRing) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = 1001;
  // Never zero: a float product's -0 would differ in bytes from the integer reference's 0.
  auto value = [](int rank, size_t i) {
    const int64_t v = static_cast<int64_t>((i * 37 + 11 * rank) % 23) - 9;
    return v == 0 ? 5 : v;
  };
  struct Case {
    DType dtype;
    ReduceOp op;
  };
  std::vector<Case> cases;
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt8,
                  DType::kUInt8, DType::kInt16, DType::kInt32, DType::kInt64, DType::kBool}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                        ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
      cases.push_back({d, op});
    }
  }
  // Element i of rank r's buffer, and of the expected result, as int64 (floats hold small integers:
  // every sum and product here is exact in float16's 11 bits except products, checked loosely).
  auto encode = [](DType d, int64_t v, std::byte* out) {
    switch (d) {
      case DType::kFloat32: {
        float f = static_cast<float>(v);
        std::memcpy(out, &f, 4);
        break;
      }
      case DType::kFloat64: {
        double f = static_cast<double>(v);
        std::memcpy(out, &f, 8);
        break;
      }
      case DType::kFloat16: {  // small integers: exact
        float f = static_cast<float>(v);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        uint16_t h = v == 0 ? 0
                            : static_cast<uint16_t>(((u >> 16) & 0x8000) |
                                                    ((((u >> 23) & 0xFF) - 112) << 10) |
                                                    ((u >> 13) & 0x3FF));
        std::memcpy(out, &h, 2);
        break;
      }
      case DType::kBFloat16: {
        float f = static_cast<float>(v);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        uint16_t b = static_cast<uint16_t>(u >> 16);
        std::memcpy(out, &b, 2);
        break;
      }
      case DType::kBool: {
        uint8_t b = v > 0 ? 1 : 0;
        std::memcpy(out, &b, 1);
        break;
      }
      default: {
        std::memcpy(out, &v, ElementBytes(d));
        break;
      }  // little-endian truncation
    }
  };
  auto expected = [&](DType d, ReduceOp op, size_t i) {
    auto as = [&](int64_t v) {  // the value as the type holds it
      std::byte b[8] = {};
      encode(d, v, b);
      if (d == DType::kUInt8) return v & 0xFF;
      return d == DType::kBool ? static_cast<int64_t>(b[0] != std::byte{0}) : v;
    };
    int64_t acc = as(value(0, i));
    for (int r = 1; r < kWorld; ++r) {
      int64_t x = as(value(r, i));
      switch (op) {
        case ReduceOp::kSum:
          acc = d == DType::kBool ? (acc | x) : acc + x;
          break;
        case ReduceOp::kProduct:
          acc = d == DType::kBool ? (acc & x) : acc * x;
          break;
        case ReduceOp::kMin:
          acc = std::min(acc, x);
          break;
        case ReduceOp::kMax:
          acc = std::max(acc, x);
          break;
        case ReduceOp::kBand:
          acc &= x;
          break;
        case ReduceOp::kBor:
          acc |= x;
          break;
        case ReduceOp::kBxor:
          acc ^= x;
          break;
      }
    }
    std::vector<std::byte> out(8);
    encode(d, acc, out.data());
    out.resize(ElementBytes(d));
    return out;
  };
  std::vector<std::vector<std::vector<std::byte>>> results(kWorld);
  RunThreads(
      kWorld,
      [&](int rank, Communicator& comm) {
        for (const Case& c : cases) {
          const size_t e = ElementBytes(c.dtype);
          std::vector<std::byte> buf(kCount * e);
          for (size_t i = 0; i < kCount; ++i) encode(c.dtype, value(rank, i), buf.data() + i * e);
          Status s = comm.AllReduce(HostRegion(std::span<std::byte>(buf)), c.dtype, c.op);
          if (!Reduces(c.dtype, c.op)) {
            EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << DTypeName(c.dtype);
            EXPECT_NE(s.message().find(ReduceOpName(c.op)), std::string::npos) << s.ToString();
            continue;
          }
          ASSERT_TRUE(s.ok()) << s.ToString();
          results[static_cast<size_t>(rank)].push_back(std::move(buf));
        }
      },
      /*piece_bytes=*/64);
  size_t k = 0;
  for (const Case& c : cases) {
    if (!Reduces(c.dtype, c.op)) continue;
    const size_t e = ElementBytes(c.dtype);
    const bool loose_float = c.op == ReduceOp::kProduct && c.dtype != DType::kFloat64 &&
                             c.dtype != DType::kFloat32 && c.dtype != DType::kBool &&
                             (c.dtype == DType::kFloat16 || c.dtype == DType::kBFloat16);
    for (size_t i = 0; i < kCount && !loose_float; ++i) {
      std::vector<std::byte> want = expected(c.dtype, c.op, i);
      ASSERT_EQ(std::memcmp(results[0][k].data() + i * e, want.data(), e), 0)
          << DTypeName(c.dtype) << " " << ReduceOpName(c.op) << " element " << i;
    }
    for (int r = 1; r < kWorld; ++r) {
      EXPECT_EQ(results[static_cast<size_t>(r)][k], results[0][k])
          << DTypeName(c.dtype) << " " << ReduceOpName(c.op) << ": rank " << r << " differs";
    }
    ++k;
  }
}

// Reduce-scatter of int64 maxima: each rank's chunk is the world's.
TEST(CommunicatorTest, ReduceScatterOfAnyTypeLeavesEachRankItsChunk) {
  constexpr int kWorld = 3;
  constexpr size_t kCount = 30;
  RunThreads(kWorld, [&](int rank, Communicator& comm) {
    std::vector<int64_t> v(kCount);
    for (size_t i = 0; i < kCount; ++i) v[i] = static_cast<int64_t>(i) * (rank + 1) - 40;
    ASSERT_TRUE(comm.ReduceScatter(HostRegion(std::as_writable_bytes(std::span<int64_t>(v))),
                                   DType::kInt64, ReduceOp::kMax)
                    .ok());
    auto [lo, hi] = ChunkRange(kCount, kWorld, rank);
    for (size_t i = lo; i < hi; ++i) EXPECT_EQ(v[i], static_cast<int64_t>(i) * kWorld - 40) << i;
  });
}

}  // namespace
}  // namespace nonstop::collective

namespace nonstop::collective {
namespace {

// A receive from any source takes whichever sender comes first, and says which. The receiver
// has the highest worker id: its peers open the lane with their first send, so it must not
// wait for a peer that has not sent.
TEST(CommunicatorTest, ARecvFromAnyRankTakesTheFirstSenderAndNamesIt) {
  std::atomic<bool> took_first{false};  // rank 1 sends only once rank 2 took rank 0's message
  RunThreads(3, [&](int rank, Communicator& comm) {
    if (rank == 2) {
      const std::vector<std::pair<int, int>> from = {{0, 1}, {1, 1}};
      std::vector<int> order;
      for (int i = 0; i < 2; ++i) {
        int32_t value = -1;
        Result<int> sender = comm.RecvOnAnyLane(
            from, HostRegion(std::as_writable_bytes(std::span<int32_t>(&value, 1))), true);
        took_first = true;  // rank 1 must not wait for ever, even after a failure
        if (!sender.ok()) {
          ADD_FAILURE() << sender.status().ToString();
          return;
        }
        EXPECT_EQ(value, (*sender + 1) * 100) << "the bytes are the sender's";
        order.push_back(*sender);
      }
      EXPECT_EQ(order, (std::vector<int>{0, 1})) << "rank 0 sent first";  // rank 1 waited for it
      return;
    }
    while (rank == 1 && !took_first) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    int32_t value = (rank + 1) * 100;
    ASSERT_TRUE(
        comm.SendOnLane(2, 1, HostRegion(std::as_bytes(std::span<int32_t>(&value, 1))), true).ok());
  });
}

}  // namespace
}  // namespace nonstop::collective
