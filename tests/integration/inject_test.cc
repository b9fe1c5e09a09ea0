// Injected faults that must fire or say why not (issue 52, point 4), and a state copy that never
// takes a chunk its sources disagree on (point 2): `nonstop run` end to end, real processes.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/temp_dir.h"
#include "tests/integration/process.h"
#include "tests/integration/test_worker_checksum.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using nonstop::testing::TestWorkerChecksum;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;
const auto& Events = nonstop::testing::JournalEvents;

struct Ended {
  int code = -1;
  std::string out;
  std::string journal;
};

Ended RunTestWorker(const TempDir& dir, int nproc, int spares, const std::string& inject,
                    int steps) {
  Ended e;
  e.journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", std::to_string(nproc), "--spares",
                    std::to_string(spares), "--journal", e.journal, "--inject", inject, "--",
                    kBin + "/nonstop-test-worker", "--steps", std::to_string(steps)},
                   dir / "out.txt");
  e.code = run.Wait(milliseconds(90'000));
  e.out = run.Output();
  return e;
}

// The test worker's state is its accumulator, registered as bytes, and its step: no fp32 region.
// The flip reaches the accumulator all the same, the replica check finds it, the majority repairs
// it, and the job ends on the fault-free checksum.
TEST(InjectIntegrationTest, ABitflipReachesARegionOfBytesAndIsRepairedBitwise) {
  TempDir dir;
  Ended e = RunTestWorker(dir, 3, 0, "bitflip:rank=1,step=50", 120);
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("bitflip: flipped a bit of 'acc' (U8)"), std::string::npos) << e.out;
  EXPECT_EQ(Events(e.journal, "fault_injected").size(), 1u) << e.out;
  bool diverged = false;
  for (const auto& f : Events(e.journal, "fault"))
    diverged = diverged || f.value("kind", "") == "state_diverged";
  EXPECT_TRUE(diverged) << "the replica check found the flip\n" << e.out;
  auto finished = Events(e.journal, "finished");
  ASSERT_EQ(finished.size(), 3u) << e.out;
  for (const auto& f : finished) EXPECT_EQ(f["checksum"], TestWorkerChecksum(120, 1000)) << e.out;
}

// An injection that cannot be carried out is never a pass: the job ends with exit 2 naming why.
TEST(InjectIntegrationTest, AnInjectionThatCannotBeCarriedOutEndsTheJobWithExitTwo) {
  struct Case {
    std::string inject;
    int nproc;
    std::string why;
  };
  const std::vector<Case> cases = {
      {"bitflip:rank=1,step=5,tensor=nope", 2,
       "no region 'nope' is registered to flip a bit in (the regions: acc, step"},
      {"kill:rank=1,step=500", 2, "the injected fault(s) kill:rank=1,step=500 never fired"},
      {"wireflip:rank=0,step=5", 1, "a world of 1 sends nothing on a wire"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    Ended e = RunTestWorker(dir, c.nproc, 0, c.inject, 30);
    EXPECT_EQ(e.code, 2) << c.inject << "\n" << e.out;
    EXPECT_NE(e.out.find(c.why), std::string::npos) << c.inject << "\n" << e.out;
    auto end = Events(e.journal, "job_end");
    ASSERT_EQ(end.size(), 1u) << c.inject << "\n" << e.out;
    EXPECT_EQ(end[0]["exit_code"], 2) << c.inject;
  }
}

// World 3 and a spare: a bit flipped in rank 0's state, then rank 2 killed before the next replica
// check. The spare's sources, ranks 0 and 1, disagree with no majority: it copies from neither
// (a copy of rank 0's would outvote rank 1, the last good replica, at the next check). The job
// either ends on the fault-free checksum or stops with exit 11; never on corrupt state.
TEST(InjectIntegrationTest, AFlipThenAKillNeverEndsOnCorruptState) {
  const int kSteps = 120;
  for (const auto& [flip, kill] : std::vector<std::pair<int, int>>{{52, 55}, {60, 61}, {70, 90}}) {
    TempDir dir;
    const std::string inject =
        fmt::format("bitflip:rank=0,step={};kill:rank=2,step={}", flip, kill);
    Ended e = RunTestWorker(dir, 3, 1, inject, kSteps);
    ASSERT_TRUE(e.code == 0 || e.code == 11) << inject << "\n" << e.out;
    if (e.code == 11) {
      EXPECT_NE(e.out.find("the sources of state chunk"), std::string::npos) << inject << "\n"
                                                                             << e.out;
      continue;
    }
    for (const auto& f : Events(e.journal, "finished"))
      EXPECT_EQ(f["checksum"], TestWorkerChecksum(kSteps, 1000)) << inject << "\n" << e.out;
  }
}

}  // namespace
}  // namespace nonstop
