// Checkpointless recovery with real processes and injected faults: every
// fault kind, a spare or a shrink, two faults at once, a fault during
// recovery, a corrupt chunk. The test worker's final checksum depends on every
// completed step being applied exactly once, so "equal to the fault-free
// run" is the proof that nothing was lost or applied twice.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "common/temp_dir.h"
#include "controller/journal.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;

struct Job {
  int code = -1;
  std::string output;
  std::vector<nlohmann::json> journal;
  std::string checksum;

  std::vector<nlohmann::json> Events(const std::string& kind) const {
    std::vector<nlohmann::json> out;
    for (const auto& j : journal) {
      if (j.value("event", "") == kind) out.push_back(j);
    }
    return out;
  }
};

Job RunJob(const TempDir& dir, const std::string& tag, int nproc, int spares,
           std::vector<std::string> inject, int steps = 40, std::vector<std::string> extra = {}) {
  std::string journal = dir / (tag + ".jsonl");
  std::vector<std::string> argv = {kBin + "/nonstop",     "run",      "--nproc",
                                   std::to_string(nproc), "--spares", std::to_string(spares),
                                   "--journal",           journal};
  argv.insert(argv.end(), extra.begin(), extra.end());
  for (const auto& f : inject) {
    argv.push_back("--inject");
    argv.push_back(f);
  }
  if (inject.empty()) argv.insert(argv.end(), {"--inject", "none"});
  argv.insert(argv.end(), {"--", kBin + "/nonstop-test-worker", "--steps", std::to_string(steps),
                           "--elements", "200000", "--sleep-ms", "5"});
  ChildProcess p(argv, dir / (tag + ".out"));
  Job job;
  job.code = p.Wait(milliseconds(100'000));
  job.output = p.Output();
  if (auto records = controller::Journal::Read(journal); records.ok()) job.journal = *records;
  for (const auto& j : job.Events("job_end")) {
    std::smatch m;
    std::string reason = j["reason"];
    if (std::regex_search(reason, m, std::regex("checksum ([0-9a-f]{8})"))) job.checksum = m[1];
  }
  return job;
}

class RecoveryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    TempDir dir;
    Job clean = RunJob(dir, "clean", 4, 0, {});
    ASSERT_EQ(clean.code, 0) << clean.output;
    ASSERT_FALSE(clean.checksum.empty());
    reference_ = new std::string(clean.checksum);
  }
  static void TearDownTestSuite() { delete reference_; }

  void ExpectRecovered(const Job& job, size_t recoveries) {
    ASSERT_EQ(job.code, 0) << job.output;
    EXPECT_EQ(job.checksum, *reference_)
        << "the run with faults must end with the fault-free state\n"
        << job.output;
    auto ends = job.Events("recovery_end");
    ASSERT_GE(ends.size(), recoveries) << job.output;
    EXPECT_EQ(ends.back()["recovery"]["outcome"], "completed") << ends.back().dump();
    for (const auto& e : ends) EXPECT_EQ(e["recovery"]["lost_steps"], 0) << e.dump();
    EXPECT_NE(job.output.find("recovery report:"), std::string::npos) << job.output;
  }

  // pid → how many times that process built its state.
  static std::map<std::string, int> Builds(const std::string& out) {
    std::map<std::string, int> n;
    std::regex re("worker pid (\\d+) built its state");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
         ++it) {
      ++n[(*it)[1]];
    }
    return n;
  }

  TempDir dir_;
  static std::string* reference_;
};
std::string* RecoveryTest::reference_ = nullptr;

TEST_F(RecoveryTest, KillIsReplacedBySpareAndHealthyWorkersAreNotRebuilt) {
  Job job = RunJob(dir_, "kill", 4, 1, {"kill:rank=2,step=20"});
  ExpectRecovered(job, 1);
  // Survivors: the same processes throughout, each built its state exactly once.
  auto joins = job.Events("join");
  std::map<int, int64_t> pid_of;
  for (const auto& j : joins) pid_of[j["worker_id"]] = j["pid"];
  auto plans = job.Events("plan");
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[1]["members"], nlohmann::json({0, 1, 4, 3}));
  for (const auto& [pid, count] : Builds(job.output))
    EXPECT_EQ(count, 1) << "pid " << pid << " rebuilt its state";
  for (int id : {0, 1, 3}) {
    EXPECT_NE(job.output.find("worker pid " + std::to_string(pid_of[id]) + " built"),
              std::string::npos);
    EXPECT_EQ(job.Events("exit").size() >= 1, true);
  }
  for (const auto& e : job.Events("exit")) {
    int id = e["worker_id"];
    EXPECT_TRUE(id == 2 || e["how"] == "exited with code 0")
        << "only the victim died: " << e.dump();
  }
  auto rec = job.Events("recovery_end")[0]["recovery"];
  EXPECT_EQ(rec["sources"], 3) << "the spare copies from all three survivors";
  EXPECT_GT(rec["bytes_copied"].get<uint64_t>(), 800'000u);
  EXPECT_EQ(job.Events("spawn").size(), 6u) << "4 workers, 1 spare, 1 new spare for the pool";
}

TEST_F(RecoveryTest, HungWorkerIsDetectedKilledAndReplaced) {
  Job job =
      RunJob(dir_, "hang", 4, 1, {"hang:rank=1,step=15"}, 40, {"--heartbeat-timeout-ms", "1000"});
  ExpectRecovered(job, 1);
  auto faults = job.Events("fault");
  ASSERT_GE(faults.size(), 1u);
  // The launcher sees the stop itself (waitid WSTOPPED) long before heartbeats are missed.
  EXPECT_EQ(faults[0]["kind"], "process stopped") << faults[0].dump();
  EXPECT_EQ(faults[0]["rank"], 1);
}

TEST_F(RecoveryTest, StalledTrainingThreadIsFoundByTheArrivalSpreadHangDetector) {
  // Its I/O thread keeps sending heartbeats: only the members' arrival at the
  // step's collective tells that rank 1 is stuck.
  Job job = RunJob(dir_, "stall", 4, 1, {"stall:rank=1,step=20"}, 40,
                   {"--heartbeat-timeout-ms", "1000", "--busy-timeout-ms", "1000"});
  ExpectRecovered(job, 1);
  auto faults = job.Events("fault");
  ASSERT_GE(faults.size(), 1u);
  EXPECT_EQ(faults[0]["kind"], "hang detector") << faults[0].dump();
  EXPECT_EQ(faults[0]["rank"], 1);
}

TEST_F(RecoveryTest, SpinningTrainingThreadIsFoundAtTheBusyTimeout) {
  // Its training thread spins on a core for good (a livelock) while its I/O
  // thread keeps sending heartbeats: busy, as far as anyone outside can tell,
  // so it is found once the others have waited the busy timeout (1 s here).
  Job job = RunJob(dir_, "spin", 4, 1, {"spin:rank=1,step=20"}, 40,
                   {"--heartbeat-timeout-ms", "1000", "--busy-timeout-ms", "1000"});
  ExpectRecovered(job, 1);
  auto faults = job.Events("fault");
  ASSERT_GE(faults.size(), 1u);
  EXPECT_EQ(faults[0]["kind"], "hang detector") << faults[0].dump();
  EXPECT_EQ(faults[0]["rank"], 1);
}

TEST_F(RecoveryTest, SpareWaitsLongerThanItsJoinTimeoutAndTakesARankLater) {
  // Before, a spare waited for its plan at most join_timeout and then exited;
  // now join_timeout bounds only reaching the controller, and a spare waits
  // for its plan as long as the controller pings it.
  ::setenv("NONSTOP_CONNECT_TIMEOUT_MS", "1000", 1);
  Job job = RunJob(dir_, "late-spare", 3, 1, {"kill:rank=1,time=3"}, 1000);
  ::unsetenv("NONSTOP_CONNECT_TIMEOUT_MS");
  ASSERT_EQ(job.code, 0) << job.output;
  ASSERT_EQ(job.Events("recovery_end").size(), 1u) << job.output;
  auto rec = job.Events("recovery_end")[0]["recovery"];
  ASSERT_EQ(rec["replacements"].size(), 1u) << rec.dump();
  EXPECT_NE(rec["replacements"][0].get<std::string>().find("spare worker 3"), std::string::npos)
      << "the original spare, still alive after 3 s: " << rec.dump();
  int exits_of_3 = 0;
  for (const auto& e : job.Events("exit"))
    exits_of_3 += e["worker_id"] == 3 && e["how"] != "exited with code 0" ? 1 : 0;
  EXPECT_EQ(exits_of_3, 0) << job.output;
}

TEST_F(RecoveryTest, ExceptionInTheTrainingLoopIsReplaced) {
  Job job = RunJob(dir_, "exception", 4, 1, {"exception:rank=3,step=12"});
  ExpectRecovered(job, 1);
  EXPECT_NE(job.output.find("injected exception"), std::string::npos);
}

TEST_F(RecoveryTest, DroppedConnectionRecoversWithTheSameProcesses) {
  Job job = RunJob(dir_, "drop", 4, 1, {"drop:rank=1,step=10"});
  ExpectRecovered(job, 1);
  EXPECT_TRUE(job.Events("fault").empty()) << "nobody died";
  auto plans = job.Events("plan");
  ASSERT_GE(plans.size(), 2u);
  EXPECT_EQ(plans.back()["members"], nlohmann::json({0, 1, 2, 3}));
}

TEST_F(RecoveryTest, WithoutSpareTheJobShrinksAndKeepsTheSameResult) {
  Job job = RunJob(dir_, "shrink", 4, 0, {"kill:rank=1,step=18"});
  ExpectRecovered(job, 1);
  auto plans = job.Events("plan");
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[1]["members"].size(), 3u);
}

TEST_F(RecoveryTest, TwoFaultsInTheSameStep) {
  Job job = RunJob(dir_, "two", 4, 2, {"kill:rank=1,step=14;kill:rank=3,step=14"});
  ExpectRecovered(job, 1);
  auto plans = job.Events("plan");
  EXPECT_EQ(plans.back()["members"].size(), 4u) << "both ranks replaced by the two spares";
}

TEST_F(RecoveryTest, FaultDuringRecoveryStartsANewRecovery) {
  // Rank 2 dies at step 20; while the spare copies the state, rank 1 (a source) dies too.
  Job job =
      RunJob(dir_, "nested", 4, 2, {"kill:rank=2,step=20", "kill:rank=1,step=20,during=transfer"});
  ExpectRecovered(job, 2);
  auto ends = job.Events("recovery_end");
  ASSERT_EQ(ends.size(), 2u) << job.output;
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "superseded by recovery 2");
}

TEST_F(RecoveryTest, CorruptChunkIsFetchedAgain) {
  Job job = RunJob(dir_, "corrupt", 4, 1, {"kill:rank=2,step=16", "corrupt:rank=0,step=16"});
  ExpectRecovered(job, 1);
  auto rec = job.Events("recovery_end")[0]["recovery"];
  EXPECT_GE(rec["refetched_chunks"].get<int>(), 1) << rec.dump();
}

TEST_F(RecoveryTest, TimedHangFromTheLauncher) {
  Job clean = RunJob(dir_, "timed-clean", 3, 0, {}, 150);
  Job job =
      RunJob(dir_, "timed", 3, 1, {"hang:rank=0,time=0.8"}, 150, {"--heartbeat-timeout-ms", "800"});
  ASSERT_EQ(job.code, 0) << job.output;
  EXPECT_EQ(job.checksum, clean.checksum) << job.output;
  ASSERT_EQ(job.Events("recovery_end").size(), 1u) << job.output;
  EXPECT_EQ(job.Events("fault")[0]["kind"], "process stopped");
}

// A refill spare warms up at a low priority only where it can be given normal
// priority back; run as an ordinary user (nobody, through setpriv, when the
// test runs as root), a refill that takes a rank must train at nice 0, not
// stay a straggler at nice 10.
TEST_F(RecoveryTest, PromotedRefillTrainsAtNormalPriorityForAnOrdinaryUser) {
  std::vector<std::string> prefix;
  std::vector<std::string> env;
  std::string bin = kBin;
  const std::string reports = dir_ / "sanitizer-reports";
  if (::geteuid() == 0) {
    ASSERT_EQ(::access("/usr/bin/setpriv", X_OK), 0)
        << "this test drops to user nobody with setpriv (util-linux)";
    prefix = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"};
    // nobody may not be able to reach the build tree: copy the two programs.
    bin = dir_ / "bin";
    std::filesystem::create_directories(bin);
    for (const char* name : {"nonstop", "nonstop-test-worker"}) {
      std::filesystem::copy_file(kBin + "/" + name, bin + "/" + name);
    }
    std::filesystem::permissions(dir_.path(), std::filesystem::perms::all);
    std::filesystem::permissions(bin, std::filesystem::perms::all);
    // Nor the sanitizers' report directory (scripts/test.sh): its processes report here instead,
    // and any report fails this test below.
    std::filesystem::create_directories(reports);
    std::filesystem::permissions(reports, std::filesystem::perms::all);
    for (const char* var : {"ASAN_OPTIONS", "UBSAN_OPTIONS", "TSAN_OPTIONS"}) {
      const char* value = std::getenv(var);
      if (value == nullptr) continue;
      std::string options = value;
      size_t at = options.find("log_path=");
      if (at == std::string::npos) continue;
      size_t end = options.find(':', at);
      std::string kind = std::string(var).substr(0, std::string(var).find('_'));
      options.replace(at, end == std::string::npos ? std::string::npos : end - at,
                      "log_path=" + reports + "/" + kind);
      env.push_back(std::string(var) + "=" + options);
    }
  }
  std::string journal = dir_ / "nice.jsonl";
  std::vector<std::string> argv = prefix;
  // The first kill takes the spare (worker 3) and starts refill 4 in the
  // background; the second, later, promotes refill 4.
  for (std::string a :
       {bin + "/nonstop", std::string("run"), std::string("--nproc"), std::string("3"),
        std::string("--spares"), std::string("1"), std::string("--journal"), journal,
        std::string("--inject"), std::string("kill:rank=1,step=10;kill:rank=2,step=250"),
        std::string("--"), bin + "/nonstop-test-worker", std::string("--steps"), std::string("300"),
        std::string("--elements"), std::string("20000"), std::string("--sleep-ms"),
        std::string("5")}) {
    argv.push_back(a);
  }
  ChildProcess p(argv, dir_ / "nice.out", env);
  int code = p.Wait(milliseconds(100'000));
  std::string out = p.Output();
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(reports, ec)) {
    std::ifstream in(f.path());
    std::stringstream text;
    text << in.rdbuf();
    ADD_FAILURE() << "sanitizer report " << f.path() << ":\n" << text.str();
  }
  ASSERT_EQ(code, 0) << out;
  auto records = controller::Journal::Read(journal);
  ASSERT_TRUE(records.ok()) << records.status().ToString();
  std::string promoted;
  for (const auto& j : *records) {
    if (j.value("event", "") != "recovery_end") continue;
    for (const auto& r : j["recovery"]["replacements"]) promoted += r.get<std::string>() + "; ";
  }
  ASSERT_NE(promoted.find("spare worker 4"), std::string::npos)
      << "the refill took a rank: " << promoted;
  EXPECT_NE(out.find("worker 4 finished at nice 0"), std::string::npos) << out;
  EXPECT_EQ(out.find("keeps its low priority"), std::string::npos) << out;
}

}  // namespace
}  // namespace nonstop
