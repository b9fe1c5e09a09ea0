// `nonstop run` end to end: real processes, real sockets on loopback.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/temp_dir.h"
#include "controller/journal.h"
#include "net/ipv6_testing.h"
#include "net/socket.h"
#include "nonstop/settings.h"
#include "tests/integration/process.h"
#include "tests/integration/test_worker_checksum.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using nonstop::testing::TestWorkerChecksum;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;

const auto& Events = nonstop::testing::JournalEvents;

TEST(RunIntegrationTest, JobOfThreeWorkersAndASpareFinishes) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "3", "--spares", "1", "--journal", journal,
                    "--", kBin + "/nonstop-test-worker", "--steps", "25", "--elements", "100003"},
                   dir / "out.txt");
  int code = run.Wait(milliseconds(60'000));
  std::string out = run.Output();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("[rank 0] step 24 ok"), std::string::npos) << out;
  EXPECT_NE(out.find("job finished"), std::string::npos) << out;
  // The default: the controller is a process of its own, the workers this one's
  // (docs/controller-failover.md).
  EXPECT_NE(out.find("resumable: the controller runs as pid"), std::string::npos) << out;
  EXPECT_TRUE(std::filesystem::exists(dir / "job.token")) << "the token --resume needs";
  EXPECT_EQ(out.find("\x1b["), std::string::npos)
      << "no terminal escapes where stdout is not a terminal";
  auto plans = Events(journal, "plan");
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0]["members"].size(), 3u);
  EXPECT_EQ(Events(journal, "join").size(), 4u);
  auto finished = Events(journal, "finished");
  ASSERT_EQ(finished.size(), 3u);
  EXPECT_EQ(finished[0]["checksum"], finished[1]["checksum"]);
  EXPECT_EQ(Events(journal, "step").size(), 25u) << "one progress record per step from rank 0";
  auto end = Events(journal, "job_end");
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0]["exit_code"], 0);
}

// --single-process: the controller and the workers' supervisor in one
// process, as before the default changed; the same job, the same result.
TEST(RunIntegrationTest, SingleProcessModeRunsTheSameJobAndRecovers) {
  TempDir dir;
  auto run_job = [&](const std::vector<std::string>& mode, const std::string& name) {
    std::vector<std::string> argv = {kBin + "/nonstop", "run"};
    argv.insert(argv.end(), mode.begin(), mode.end());
    for (const char* a :
         {"--nproc", "3", "--spares", "1", "--inject", "kill:rank=1,step=10", "--journal"}) {
      argv.push_back(a);
    }
    argv.push_back(dir / (name + ".jsonl"));
    for (const std::string& a : std::vector<std::string>{"--", kBin + "/nonstop-test-worker",
                                                         "--steps", "25", "--elements", "100003"}) {
      argv.push_back(a);
    }
    ChildProcess run(argv, dir / (name + ".txt"));
    int code = run.Wait(milliseconds(60'000));
    return std::pair{code, run.Output()};
  };
  auto [single_code, single] = run_job({"--single-process"}, "single");
  ASSERT_EQ(single_code, 0) << single;
  EXPECT_EQ(single.find("resumable:"), std::string::npos)
      << "one process: no controller of its own\n"
      << single;
  EXPECT_NE(single.find("[rank 0] step 24 ok"), std::string::npos) << single;
  EXPECT_NE(single.find("recovery report: 1 recovery"), std::string::npos) << single;
  auto [default_code, two] = run_job({}, "default");
  ASSERT_EQ(default_code, 0) << two;
  EXPECT_NE(two.find("recovery report: 1 recovery"), std::string::npos) << two;
  auto checksum = [](const std::string& journal_path) {
    auto finished = Events(journal_path, "finished");
    return finished.empty() ? std::string("none") : finished[0]["checksum"].dump();
  };
  EXPECT_EQ(checksum(dir / "single.jsonl"), checksum(dir / "default.jsonl"));
  EXPECT_NE(checksum(dir / "single.jsonl"), "none");
}

// A kill part-way into a step (at=, docs/faults.md) fires from the worker's timer thread wherever
// its training thread is: at=0 as the step starts, here a second before the step's reduction (the
// worker sleeps 1 s in each step), and the job recovers from it like from any kill. Its record
// times the work in flight from that moment.
TEST(RunIntegrationTest, AKillAsAStepStartsFiresBeforeItsReductionAndIsRecovered) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "2", "--spares", "1", "--inject",
                    "kill:rank=1,step=4,at=0", "--journal", journal, "--",
                    kBin + "/nonstop-test-worker", "--steps", "8", "--sleep-ms", "1000"},
                   dir / "out.txt");
  ASSERT_EQ(run.Wait(milliseconds(90'000)), 0) << run.Output();
  auto injected = Events(journal, "fault_injected");
  ASSERT_EQ(injected.size(), 1u) << run.Output();
  EXPECT_EQ(injected[0]["fault"], "kill:rank=1,step=4,at=0");
  auto ends = Events(journal, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << run.Output();
  const auto& rec = ends[0]["recovery"];
  EXPECT_EQ(rec["outcome"], "completed") << rec.dump();
  ASSERT_TRUE(rec["time_lost"].is_object()) << rec.dump();
  // Before the reduction, which comes after the step's 1 s sleep (at the reduction, the default,
  // this would be a second or more).
  EXPECT_LT(rec["time_lost"]["split_ms"]["in_flight"].get<double>(), 1000) << rec.dump();
}

// Workers that join before they register their state (SessionOptions::defer_state and
// Session::CompleteJoin: a script that makes its process group before its model). The spare that
// takes the killed rank runs 500 ms of setup after it took the rank, filling its state with 7s,
// then copies the peers' state into what it registered: the job ends on the checksum of the run
// without the kill, every member's the same.
TEST(RunIntegrationTest, AWorkerThatRegistersItsStateAfterJoiningTakesThePeersStateAfterItsSetup) {
  auto finished = [](const std::string& inject, TempDir& dir) -> std::set<std::string> {
    std::string journal = dir / "journal.jsonl";
    ChildProcess run({kBin + "/nonstop", "run", "--nproc", "3", "--spares", "1", "--inject", inject,
                      "--journal", journal, "--", kBin + "/nonstop-test-worker", "--steps", "30",
                      "--sleep-ms", "20", "--register-after-join", "500"},
                     dir / "out.txt");
    EXPECT_EQ(run.Wait(milliseconds(90'000)), 0) << run.Output();
    EXPECT_EQ(Events(journal, "recovery_end").size(), inject == "none" ? 0u : 1u) << run.Output();
    if (inject != "none") {
      EXPECT_NE(run.Output().find("copied the state of step"), std::string::npos) << run.Output();
    }
    std::set<std::string> sums;
    for (const auto& f : Events(journal, "finished")) sums.insert(f["checksum"]);
    EXPECT_EQ(Events(journal, "finished").size(), 3u) << run.Output();
    return sums;
  };
  TempDir clean_dir, killed_dir;
  std::set<std::string> clean = finished("none", clean_dir);
  std::set<std::string> killed = finished("kill:rank=1,step=12", killed_dir);
  ASSERT_EQ(clean.size(), 1u);
  EXPECT_EQ(killed, clean) << "the spare trained on its setup's 7s, not on the peers' state";
}

// On a terminal (script(1) gives it one): one live progress line instead of
// every rank's log, which goes to runs/logs/worker-N.log.
TEST(RunIntegrationTest, OnATerminalOneProgressLineAndTheWorkersLogsInFiles) {
  TempDir dir;
  auto command = [&](const std::string& flags) {
    return fmt::format(
        "cd {} && {}/nonstop run {} --nproc 2 --spares 1 --inject kill:rank=1,step=40 -- "
        "{}/nonstop-test-worker --steps 120 --sleep-ms 5",
        dir.path(), kBin, flags, kBin);
  };
  ChildProcess run({"/usr/bin/script", "-qfec", command(""), "/dev/null"}, dir / "tty.txt");
  ASSERT_EQ(run.Wait(milliseconds(60'000)), 0) << run.Output();
  std::string out = run.Output();
  EXPECT_NE(out.find("step 120/120 (100%)"), std::string::npos) << out;
  EXPECT_NE(out.find("\r\x1b[K"), std::string::npos) << "the line is redrawn in place";
  EXPECT_NE(out.find("recovery report: 1 recovery"), std::string::npos) << out;
  EXPECT_EQ(out.find("] step 10 ok"), std::string::npos) << "no worker's log on the terminal\n"
                                                         << out;
  std::string log = dir / "runs/logs/worker-0.log";
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find("step 10 ok"), std::string::npos) << log << ":\n" << ss.str();
  // --verbose keeps every rank's lines on the terminal.
  ChildProcess verbose(
      {"/usr/bin/script", "-qfec", command("--verbose --journal v/journal.jsonl"), "/dev/null"},
      dir / "verbose.txt");
  ASSERT_EQ(verbose.Wait(milliseconds(60'000)), 0) << verbose.Output();
  EXPECT_NE(verbose.Output().find("[rank 0] step 10 ok"), std::string::npos) << verbose.Output();
  EXPECT_EQ(verbose.Output().find("\r\x1b[K"), std::string::npos)
      << "no progress line with --verbose";
}

TEST(RunIntegrationTest, KilledWorkerIsNamedAndReplacedWhileTheJobGoesOn) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  // A heartbeat timeout of 60 s: detection must come from the process exit, not from silence.
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "4", "--spares", "1",
                    "--heartbeat-timeout-ms", "60000", "--journal", journal, "--",
                    kBin + "/nonstop-test-worker", "--steps", "300", "--sleep-ms", "10"},
                   dir / "out.txt");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "step", 5, milliseconds(30'000)))
      << run.Output();
  int64_t victim = -1;
  for (auto& j : Events(journal, "join")) {
    if (j["worker_id"] == 2) victim = j["pid"];
  }
  ASSERT_GT(victim, 0);
  ASSERT_EQ(::kill(static_cast<pid_t>(victim), SIGKILL), 0);
  int code = run.Wait(milliseconds(60'000));
  std::string out = run.Output();
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("fault: rank 2 (worker 2, pid " + std::to_string(victim) + ")"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("was killed by signal 9"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 2: worker 2 → spare worker 4"), std::string::npos) << out;
  auto ends = Events(journal, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << out;
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "completed");
  EXPECT_EQ(ends[0]["recovery"]["lost_steps"], 0);
}

// The controller and the agent stalled together for twice the heartbeat timeout (as on a starved
// machine), the controller resumed first: it does not take its own stall for the agent's silence,
// so nothing is lost and the job ends as it would have. (3 s: under the agent's 3 s and the
// workers' 5 s controller timeouts, which they judge on what their sockets hold.)
TEST(RunIntegrationTest, AControllerAndAgentStalledTogetherLoseNothing) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "2", "--spares", "0",
                    "--heartbeat-timeout-ms", "1500", "--journal", journal, "--",
                    kBin + "/nonstop-test-worker", "--steps", "200", "--sleep-ms", "20"},
                   dir / "out.txt");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "step", 10, milliseconds(30'000)))
      << run.Output();
  const std::string out0 = run.Output();
  const std::string said = "the controller runs as pid ";
  const size_t at = out0.find(said);
  ASSERT_NE(at, std::string::npos) << out0;
  const pid_t controller = std::stoi(out0.substr(at + said.size()));
  ASSERT_TRUE(nonstop::testing::StopProcess(controller)) << out0;
  ASSERT_TRUE(nonstop::testing::StopProcess(run.pid())) << out0;  // the agent of `nonstop run`
  std::this_thread::sleep_for(milliseconds(3'000));
  ASSERT_EQ(::kill(controller, SIGCONT), 0);
  std::this_thread::sleep_for(milliseconds(300));  // its detectors run before the agent is back
  ASSERT_EQ(::kill(run.pid(), SIGCONT), 0);
  int code = run.Wait(milliseconds(60'000));
  std::string out = run.Output();
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Events(journal, "host_lost").empty()) << out;
  EXPECT_TRUE(Events(journal, "fault").empty()) << out;
  EXPECT_TRUE(Events(journal, "recovery_end").empty()) << out;
  EXPECT_EQ(Events(journal, "finished").size(), 2u) << out;
}

// Issue 30: the state on a device (the stand-in for a GPU that machines without one run), each
// step's sum reduced there (Session::AllReduceOnDevice, staged over the TCP collectives): a kill
// with a spare is recovered, the spare's state copied into its device memory, and the job ends on
// the checksum of a job without a fault.
TEST(RunIntegrationTest, StateOnADeviceIsRecoveredIntoTheSparesDeviceMemoryBitwise) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop",
                    "run",
                    "--nproc",
                    "4",
                    "--spares",
                    "1",
                    "--journal",
                    journal,
                    "--inject",
                    "kill:rank=2,step=12",
                    "--",
                    kBin + "/nonstop-test-worker",
                    "--steps",
                    "30",
                    "--elements",
                    "100003",
                    "--sleep-ms",
                    "10",
                    "--device",
                    "stand-in"},
                   dir / "out.txt");
  int code = run.Wait(milliseconds(90'000));
  std::string out = run.Output();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("built its state on stand-in:0"), std::string::npos) << out;
  auto ends = Events(journal, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << out;
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "completed") << ends[0].dump();
  // the spare took the state of step 11 into its device memory
  EXPECT_GE(ends[0]["recovery"]["bytes_copied"].get<int64_t>(), 100003 * 4) << ends[0].dump();
  auto finished = Events(journal, "finished");
  ASSERT_EQ(finished.size(), 4u) << out;
  for (const auto& f : finished) EXPECT_EQ(f["checksum"], TestWorkerChecksum(30, 100003)) << out;
}

// Issue 30: sharded state on a device. The test worker's accumulator is a shard view over groups
// of 2 (StateRegistry::RegisterShardView with the stand-in device), each step's sum is reduced
// with Session::ReduceShardsOnDevice and the whole gathered back with GatherShardsOnDevice. A kill
// with a spare is recovered, the spare copying only its shard, into its device memory, from the
// shard's other holder; the job ends on the checksum of an unsharded job without a fault, as the
// same sharded job in host memory does.
TEST(RunIntegrationTest, ShardedStateOnADeviceIsCopiedIntoTheSparesDeviceMemoryBitwise) {
  TempDir dir;
  const size_t elements = 10007;  // odd: the buffer is padded to 10008, 5004 values a shard
  for (const std::string device : {"stand-in", "host"}) {
    const std::string journal = dir / (device + ".jsonl");
    ChildProcess run({kBin + "/nonstop",
                      "run",
                      "--nproc",
                      "4",
                      "--spares",
                      "1",
                      "--journal",
                      journal,
                      "--inject",
                      "kill:rank=1,step=8",
                      "--",
                      kBin + "/nonstop-test-worker",
                      "--steps",
                      "20",
                      "--elements",
                      std::to_string(elements),
                      "--sleep-ms",
                      "10",
                      "--shard-group",
                      "2",
                      "--device",
                      device},
                     dir / (device + ".txt"));
    const int code = run.Wait(milliseconds(90'000));
    const std::string out = run.Output();
    ASSERT_EQ(code, 0) << device << "\n" << out;
    if (device != "host") {
      EXPECT_NE(out.find("built its state on stand-in:0"), std::string::npos) << out;
    }
    EXPECT_NE(out.find("re-sharded: copied shard 1 of the optimizer state"), std::string::npos)
        << device << "\n"
        << out;
    auto ends = Events(journal, "recovery_end");
    ASSERT_EQ(ends.size(), 1u) << device << "\n" << out;
    EXPECT_EQ(ends[0]["recovery"]["outcome"], "completed") << ends[0].dump();
    // shard 1 of step 7 (5004 floats) and the step counter, not the whole accumulator
    EXPECT_EQ(ends[0]["recovery"]["bytes_copied"].get<int64_t>(), 5004 * 4 + 8) << ends[0].dump();
    auto finished = Events(journal, "finished");
    ASSERT_EQ(finished.size(), 4u) << device << "\n" << out;
    for (const auto& f : finished) {
      EXPECT_EQ(f["checksum"], TestWorkerChecksum(20, elements)) << device << "\n" << out;
    }
  }
}

// Issue 30: a spare's device is health-checked before it is promoted. The spare's stand-in device
// breaks while it waits: with checks every 50 ms it leaves the job at once and the pool refills,
// so the kill is recovered by the next spare; with no check while it waits, the check as it is
// promoted fails it, and the job recovers again, with the next spare. Either way the job ends on
// the fault-free checksum.
TEST(RunIntegrationTest, ASpareWhoseDeviceFailsItsHealthCheckNeverTakesARank) {
  TempDir dir;
  for (const bool while_waiting : {true, false}) {
    const std::string name = while_waiting ? "waiting" : "promoted";
    const std::string journal = dir / (name + ".jsonl");
    ChildProcess run(
        {kBin + "/nonstop",
         "run",
         "--nproc",
         "2",
         "--spares",
         "1",
         "--journal",
         journal,
         "--inject",
         "kill:rank=1,step=25",
         "--",
         kBin + "/nonstop-test-worker",
         "--steps",
         "30",
         "--sleep-ms",
         "100",
         "--device",
         "stand-in",
         "--break-device-worker",
         "2",
         "--break-device-after-ms",
         while_waiting ? "300" : "800"},
        dir / (name + ".txt"),
        {fmt::format("{}={}", settings::kSpareCheckMs.env, while_waiting ? 50 : 3'600'000)});
    const int code = run.Wait(milliseconds(90'000));
    const std::string out = run.Output();
    ASSERT_EQ(code, 0) << name << "\n" << out;
    EXPECT_NE(out.find("the stand-in device breaks now"), std::string::npos) << out;
    EXPECT_NE(out.find(while_waiting ? "worker 2: stand-in:0 failed its health check while this "
                                       "worker waited as a spare, so it leaves the job's spares"
                                     : "worker 2: stand-in:0 failed its health check as this "
                                       "spare was promoted (generation 2), so it does not take "
                                       "part"),
              std::string::npos)
        << name << "\n"
        << out;
    // (The journal names the reason when the worker's report reaches the controller before the
    // agent's report of its exit, which this test does not wait for: ControllerTest checks it.)
    auto ends = Events(journal, "recovery_end");
    ASSERT_FALSE(ends.empty()) << name << "\n" << out;
    const auto& last = ends.back()["recovery"];
    EXPECT_EQ(last["outcome"], "completed") << last.dump();
    ASSERT_EQ(last["replacements"].size(), 1u) << last.dump();
    EXPECT_EQ(last["replacements"][0], while_waiting ? "rank 1: worker 1 → spare worker 3"
                                                     : "rank 1: worker 2 → spare worker 3")
        << last.dump();
    auto finished = Events(journal, "finished");
    ASSERT_EQ(finished.size(), 2u) << name << "\n" << out;
    for (const auto& f : finished)
      EXPECT_EQ(f["checksum"], TestWorkerChecksum(30, 1000)) << name << "\n" << out;
  }
}

// Issue 30: the world-invariant sum on a device. Every step's items are tenths folded into tree
// partials on the device and summed with Session::AllReduceTreeOnDevice; 4 workers and a spare
// with a kill end on the checksum of 3 workers in host memory without a fault. The bits depend on
// the order of the additions, so this holds only if the device's tree keeps the host tree's.
TEST(RunIntegrationTest, TheTreeOnADeviceEndsOnTheChecksumOfAnotherWorldInHostMemory) {
  TempDir dir;
  auto run = [&](const std::string& name, const std::vector<std::string>& options,
                 const std::string& device) {
    std::vector<std::string> argv{kBin + "/nonstop", "run", "--journal", dir / (name + ".jsonl")};
    argv.insert(argv.end(), options.begin(), options.end());
    for (const char* a : {"--", "WORKER", "--steps", "20", "--elements", "10007", "--sleep-ms",
                          "10", "--tree", "--device"})
      argv.push_back(a);
    argv[argv.size() - 9] = kBin + "/nonstop-test-worker";
    argv.push_back(device);
    ChildProcess job(argv, dir / (name + ".txt"));
    EXPECT_EQ(job.Wait(milliseconds(90'000)), 0) << job.Output();
    auto finished = Events(dir / (name + ".jsonl"), "finished");
    EXPECT_FALSE(finished.empty()) << job.Output();
    return finished.empty() ? std::string() : finished[0]["checksum"].get<std::string>();
  };
  const std::string host = run("host", {"--nproc", "3"}, "host");
  const std::string device = run(
      "device", {"--nproc", "4", "--spares", "1", "--inject", "kill:rank=1,step=8"}, "stand-in");
  auto ends = Events(dir / "device.jsonl", "recovery_end");
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "completed") << ends[0].dump();
  EXPECT_FALSE(host.empty());
  EXPECT_EQ(device, host);
  EXPECT_NE(host, TestWorkerChecksum(20, 10007)) << "the items are tenths, not the ring's integers";
}

TEST(RunIntegrationTest, LosingTheOnlyHolderOfTheStateEndsTheJobNonZeroWithAReason) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "1", "--spares", "1", "--journal", journal,
                    "--", kBin + "/nonstop-test-worker", "--steps", "100000", "--sleep-ms", "10"},
                   dir / "out.txt");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "step", 3, milliseconds(30'000)))
      << run.Output();
  int64_t victim = -1;
  for (auto& j : Events(journal, "join")) {
    if (j["worker_id"] == 0) victim = j["pid"];
  }
  ASSERT_GT(victim, 0) << run.Output();
  auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(static_cast<pid_t>(victim), SIGKILL), 0);
  int code = run.Wait(milliseconds(20'000));
  auto took = std::chrono::steady_clock::now() - killed_at;
  std::string out = run.Output();
  EXPECT_EQ(code, 10) << out;
  EXPECT_NE(out.find("exists on no live worker"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 0 (worker 0, pid " + std::to_string(victim) + ")"), std::string::npos)
      << out;
  EXPECT_LT(took, milliseconds(10'000)) << out;
}

// A world of one whose training thread stops (its I/O thread still sends
// heartbeats): no other member lags behind it, so only the stall watchdog
// (no step completed for a while) can end the wait. Before, the job hung.
TEST(RunIntegrationTest, AWorldOfOneThatStallsIsEndedByTheStallWatchdog) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop",
                    "run",
                    "--nproc",
                    "1",
                    "--spares",
                    "0",
                    "--stall-floor-ms",
                    "1500",
                    "--busy-timeout-ms",
                    "1500",
                    "--inject",
                    "stall:rank=0,step=8",
                    "--journal",
                    journal,
                    "--",
                    kBin + "/nonstop-test-worker",
                    "--steps",
                    "100000",
                    "--sleep-ms",
                    "10"},
                   dir / "out.txt");
  int code = run.Wait(milliseconds(30'000));
  std::string out = run.Output();
  EXPECT_EQ(code, 10) << out;
  EXPECT_NE(out.find("stall watchdog"), std::string::npos) << out;
  EXPECT_NE(out.find("did not abort in time"), std::string::npos) << out;
  EXPECT_NE(out.find("exists on no live worker"), std::string::npos) << out;
  auto faults = Events(journal, "fault");
  ASSERT_GE(faults.size(), 1u) << out;
  EXPECT_EQ(faults[0]["kind"], "stall watchdog") << faults[0].dump();
}

TEST(RunIntegrationTest, ProgramThatCannotStartFailsTheJobWithAReason) {
  TempDir dir;
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "2", "--spares", "0", "--journal",
                    dir / "j.jsonl", "--", dir / "no-such-program"},
                   dir / "out.txt");
  int code = run.Wait(milliseconds(20'000));
  std::string out = run.Output();
  EXPECT_EQ(code, 10) << out;
  EXPECT_NE(out.find("cannot start"), std::string::npos) << out;
  EXPECT_NE(out.find("before joining"), std::string::npos) << out;
}

// `n` adjacent ports free on [::1] now (bound, then let go): [lo, lo + n - 1].
net::PortRange FreeIpv6Ports(int n) {
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto first = net::Listen({"::1", 0});
    NONSTOP_CHECK(first.ok()) << first.status().ToString();
    const int lo = first->address.port;
    if (lo + n - 1 > 65535) continue;
    std::vector<net::Listener> held;
    for (int p = lo + 1; p < lo + n; ++p) {
      auto l = net::Listen({"::1", static_cast<uint16_t>(p)});
      if (!l.ok()) break;
      held.push_back(std::move(*l));
    }
    if (static_cast<int>(held.size()) == n - 1)
      return {static_cast<uint16_t>(lo), static_cast<uint16_t>(lo + n - 1)};
  }
  return {};
}

// A job on IPv6 loopback alone (docs/ports.md): the controller, the agent and
// the workers' data ports on ::1, every address printed and journaled as
// [::1]:port, the data ports from a range (NONSTOP_DATA_PORTS, what
// --data-ports sets); a worker killed mid-run is replaced and the job ends
// bitwise equal to the same job over IPv4 without a fault.
TEST(RunIntegrationTest, JobOnIpv6LoopbackWithADataPortRangeRecoversAndFinishes) {
  if (std::string why = net::testing::NoIpv6Loopback(); !why.empty()) GTEST_SKIP() << why;
  TempDir dir;
  // Two workers, a spare, the spare that refills the pool after the kill: four at once at most.
  // 200 steps of 5 ms or more: the refill starts and joins long before the end (with 40, the job
  // ended 250 ms after the kill, before a refill started on a loaded machine could join).
  net::PortRange ports = FreeIpv6Ports(6);
  ASSERT_FALSE(ports.empty()) << "no 6 adjacent free ports on [::1]";
  const std::vector<std::string> worker = {
      "--", kBin + "/nonstop-test-worker", "--steps", "200", "--elements", "100003", "--sleep-ms",
      "5"};
  std::string journal = dir / "v6.jsonl";
  std::vector<std::string> argv = {kBin + "/nonstop", "run",
                                   "--host",          "::1",
                                   "--nproc",         "2",
                                   "--spares",        "1",
                                   "--inject",        "kill:rank=1,step=15",
                                   "--journal",       journal};
  argv.insert(argv.end(), worker.begin(), worker.end());
  ChildProcess run(argv, dir / "v6.txt",
                   {fmt::format("{}={}", settings::kDataPorts.env, ports.ToString())});
  int code = run.Wait(milliseconds(60'000));
  std::string out = run.Output();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("recovery report: 1 recovery"), std::string::npos) << out;
  EXPECT_NE(out.find("[::1]:"), std::string::npos) << "the banner prints the controller bracketed\n"
                                                   << out;
  auto joins = Events(journal, "join");
  ASSERT_GE(joins.size(), 4u) << out;  // two workers, the spare, the refill
  for (const auto& j : joins) {
    std::string address = j["address"];
    auto where = net::ParseHostPort(address);
    ASSERT_TRUE(where.ok()) << address << ": " << where.status().ToString();
    EXPECT_EQ(where->host, "::1") << address;
    EXPECT_EQ(address.rfind("[::1]:", 0), 0u) << address;
    EXPECT_GE(where->port, ports.lo) << address << " outside " << ports.ToString();
    EXPECT_LE(where->port, ports.hi) << address << " outside " << ports.ToString();
  }
  auto ends = Events(journal, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << out;
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "completed");
  EXPECT_EQ(ends[0]["recovery"]["lost_steps"], 0);
  // The same job over IPv4, without the fault: the same bytes.
  std::vector<std::string> v4 = {kBin + "/nonstop", "run", "--nproc",   "2",
                                 "--spares",        "0",   "--journal", dir / "v4.jsonl"};
  v4.insert(v4.end(), worker.begin(), worker.end());
  ChildProcess plain(v4, dir / "v4.txt");
  ASSERT_EQ(plain.Wait(milliseconds(60'000)), 0) << plain.Output();
  auto checksum = [](const std::string& path) {
    auto finished = Events(path, "finished");
    return finished.empty() ? std::string("none") : finished[0]["checksum"].dump();
  };
  EXPECT_NE(checksum(journal), "none");
  EXPECT_EQ(checksum(journal), checksum(dir / "v4.jsonl"));
}

// A range too small for the job: the worker that finds every port taken says
// which range and what to do, and the job does not hang.
TEST(RunIntegrationTest, DataPortRangeTooSmallIsNamed) {
  TempDir dir;
  auto held = net::Listen({"127.0.0.1", 0});  // the range's one port, taken
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  const std::string range = std::to_string(held->address.port);
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "1", "--spares", "0", "--journal",
                    dir / "j.jsonl", "--", kBin + "/nonstop-test-worker", "--steps", "5"},
                   dir / "out.txt", {fmt::format("{}={}", settings::kDataPorts.env, range)});
  int code = run.Wait(milliseconds(30'000));
  std::string out = run.Output();
  EXPECT_NE(code, 0) << out;
  EXPECT_NE(code, -1) << "the job hung\n" << out;
  EXPECT_NE(
      out.find("no free data port in " + range + " (1 port, it is in use): widen --data-ports"),
      std::string::npos)
      << out;
}

// An ext4 file system on a loop device, mounted at `dir`/disk for the length of a test, that the
// test can freeze (fsfreeze(8): every write and sync on it blocks until it is thawed, as on a hung
// disk or a lost NFS mount). `why_not` says why there is none (not root, no loop device).
class FreezableDisk {
 public:
  explicit FreezableDisk(const std::filesystem::path& dir)
      : image_(dir / "disk.img"), mount_(dir / "disk") {
    if (::geteuid() != 0) {
      why_not_ = "mounting a loop device needs root";
      return;
    }
    std::filesystem::create_directories(mount_);
    { std::ofstream(image_.string()).close(); }
    std::filesystem::resize_file(image_, 32 << 20);
    if (Run("mkfs.ext4 -q -F " + image_.string()) != 0) {
      why_not_ = "mkfs.ext4 failed (e2fsprogs)";
    } else if (Run("mount -o loop " + image_.string() + " " + mount_.string()) != 0) {
      why_not_ = "mount -o loop failed (no loop device here?)";
    } else {
      mounted_ = true;
    }
  }
  ~FreezableDisk() {
    if (!mounted_) return;
    Thaw();
    // The processes that had files open on it may take a moment to exit once it is thawed.
    for (int i = 0; i < 25 && Run("umount " + mount_.string() + " 2>/dev/null") != 0; ++i)
      std::this_thread::sleep_for(milliseconds(200));
    Run("umount -l " + mount_.string() + " 2>/dev/null");
  }
  const std::string& why_not() const { return why_not_; }
  std::string path(const std::string& name) const { return (mount_ / name).string(); }
  bool Freeze() { return Run("fsfreeze -f " + mount_.string()) == 0; }
  void Thaw() { Run("fsfreeze -u " + mount_.string() + " 2>/dev/null"); }
  // Thaws the disk when it goes. Declared after the job's process, it thaws before that process is
  // killed and waited for: a process blocked on a frozen disk cannot exit, even on SIGKILL.
  struct ThawFirst {
    FreezableDisk* disk;
    ~ThawFirst() { disk->Thaw(); }
  };

 private:
  static int Run(const std::string& command) { return std::system((command + " >&2").c_str()); }
  std::filesystem::path image_, mount_;
  std::string why_not_;
  bool mounted_ = false;
};

// The controller's journal on a disk that hangs while a worker is killed: the orders of the
// recovery wait for the journal's sync no longer than 10 s, then go out without it (said), the
// survivors are not counted late for an abort that was held back, the recovery completes and the
// job ends on the checksum of a job without a fault once the disk is back (said too).
TEST(RunIntegrationTest, AJournalOnAHungDiskHoldsTheOrdersTenSecondsAndTheRecoveryCompletes) {
  TempDir dir;
  FreezableDisk disk(dir.path());
  if (!disk.why_not().empty()) GTEST_SKIP() << "NOT RUN: " << disk.why_not();
  const std::string journal = disk.path("journal.jsonl");
  ChildProcess run(
      {kBin + "/nonstop", "run", "--nproc", "2", "--spares", "1", "--journal", journal, "--",
       kBin + "/nonstop-test-worker", "--steps", "1000", "--elements", "1000", "--sleep-ms", "10"},
      dir / "out.txt");
  FreezableDisk::ThawFirst thaw_first{&disk};
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "step", 5, milliseconds(30'000)))
      << run.Output();
  int64_t victim = -1;
  for (auto& j : Events(journal, "join")) {
    if (j["worker_id"] == 1) victim = j["pid"];
  }
  ASSERT_GT(victim, 0);
  ASSERT_TRUE(disk.Freeze());
  ASSERT_EQ(::kill(static_cast<pid_t>(victim), SIGKILL), 0);
  // The plan of the recovery goes out while the disk still hangs.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(45);
  while (run.Output().find("generation 2:") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(100));
  }
  std::string out = run.Output();
  disk.Thaw();
  const size_t stalled = out.find("has not synced anything for 10 s (its disk hangs?)");
  ASSERT_NE(stalled, std::string::npos) << out;
  ASSERT_NE(out.find("generation 2:", stalled), std::string::npos) << out;
  ASSERT_EQ(run.Wait(milliseconds(60'000)), 0) << run.Output();
  out = run.Output();
  EXPECT_EQ(out.find("did not abort in time"), std::string::npos) << out;
  EXPECT_NE(out.find("is synced again"), std::string::npos) << out;
  auto ends = Events(journal, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << out;
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "completed") << ends[0].dump();
  auto finished = Events(journal, "finished");
  ASSERT_EQ(finished.size(), 2u) << out;
  for (const auto& f : finished) EXPECT_EQ(f["checksum"], TestWorkerChecksum(1000, 1000)) << out;
}

// The NONSTOP_ and torchrun variables of the environment a test worker dumped (--dump-environ
// PREFIX writes PREFIX-<pid>.self), of the one spare's dump under `prefix` (NONSTOP_SPARE=1).
std::map<std::string, std::string> DumpedEnvironment(const std::filesystem::path& prefix) {
  static const std::set<std::string> kTorchrun = {
      "RANK",       "WORLD_SIZE",       "LOCAL_RANK",  "LOCAL_WORLD_SIZE",
      "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",   "ROLE_WORLD_SIZE",
      "ROLE_NAME",  "MASTER_ADDR",      "MASTER_PORT", "OMP_NUM_THREADS"};
  std::map<std::string, std::string> spare;
  int spares = 0;
  for (const auto& entry : std::filesystem::directory_iterator(prefix.parent_path())) {
    const std::string name = entry.path().filename();
    if (name.rfind(prefix.filename().string() + "-", 0) != 0 || !name.ends_with(".self")) continue;
    std::map<std::string, std::string> env;
    std::ifstream in(entry.path(), std::ios::binary);
    for (std::string var; std::getline(in, var, '\0');) {
      const size_t eq = var.find('=');
      const std::string key = var.substr(0, eq);
      if (eq != std::string::npos && (key.rfind("NONSTOP_", 0) == 0 || kTorchrun.count(key) ||
                                      key.rfind("TORCHELASTIC_", 0) == 0))
        env[key] = var.substr(eq + 1);
    }
    if (env[std::string(settings::kSpare.env)] != "1") continue;
    ++spares;
    spare = std::move(env);
  }
  EXPECT_EQ(spares, 1) << prefix;
  return spare;
}

// Issue 53: a worker started by hand (`nonstop worker --job job.json`, a spare) is told what the
// job tells its own spare: the workers' settings given to `nonstop run` as flags, the checkpoint
// settings, the MTBF that sets their interval and torchrun's job variables come from one list,
// torchrun's rank, world and master from the controller's (RANK one past the members', never -1,
// which scripts take for "not distributed", LOCAL_RANK one of the host's slots; WORLD_SIZE: a
// script that reads them before it joins finds them); only what is the worker's own differs.
TEST(RunIntegrationTest, AWorkerStartedByHandIsToldWhatTheJobsOwnWorkersAre) {
  TempDir dir;
  const std::string journal = dir / "journal.jsonl";
  ChildProcess run({kBin + "/nonstop",
                    "run",
                    "--nproc",
                    "1",
                    "--spares",
                    "1",
                    "--journal",
                    journal,
                    "--checkpoint-dir",
                    dir / "ckpt",
                    "--checkpoint-every",
                    "0",
                    "--mtbf",
                    "3600",
                    "--replica-check-every",
                    "7",
                    "--sealed-state-copy",
                    "--master-port",
                    "29611",
                    "--",
                    kBin + "/nonstop-test-worker",
                    "--steps",
                    "400",
                    "--sleep-ms",
                    "10",
                    "--dump-environ",
                    dir / "own"},
                   dir / "run.out");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "join", 2, milliseconds(30'000)))
      << run.Output();
  ChildProcess by_hand(
      {kBin + "/nonstop", "worker", "--job", dir / "job.json", "--", kBin + "/nonstop-test-worker",
       "--steps", "400", "--dump-environ", dir / "hand"},
      dir / "hand.out");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "join", 3, milliseconds(30'000)))
      << by_hand.Output();
  ASSERT_EQ(run.Wait(milliseconds(60'000)), 0) << run.Output();
  by_hand.Wait(milliseconds(30'000));
  auto own = DumpedEnvironment(dir / "own");
  auto hand = DumpedEnvironment(dir / "hand");
  EXPECT_EQ(own[std::string(settings::kTrainMtbfSeconds.env)], "3600");
  EXPECT_EQ(own[std::string(settings::kTrainCheckpointEvery.env)], "0");
  EXPECT_EQ(hand["RANK"], "1");
  EXPECT_EQ(hand["LOCAL_RANK"], "0");
  EXPECT_EQ(hand["WORLD_SIZE"], "1");
  // The workers' settings given to `nonstop run` as flags reach both (torchrun's MASTER_PORT too).
  EXPECT_EQ(own[std::string(settings::kReplicaCheckEvery.env)], "7");
  EXPECT_EQ(own[std::string(settings::kSealedStateCopy.env)], "1");
  EXPECT_EQ(own[std::string(settings::kMasterPort.env)], "29611");
  EXPECT_EQ(own["MASTER_PORT"], "29611");
  // What is a worker's own: its id, whether it is a spare, its descriptors, its data address; and
  // what the agent that spawned it adds: its host, the spawn's error file and restart count.
  for (const auto& s : {settings::kWorkerId.env, settings::kSpare.env, settings::kJobTokenFd.env,
                        settings::kLifelineFd.env, settings::kDataHost.env, settings::kHostId.env,
                        std::string_view("TORCHELASTIC_ERROR_FILE"),
                        std::string_view("TORCHELASTIC_RESTART_COUNT")}) {
    own.erase(std::string(s));
    hand.erase(std::string(s));
  }
  EXPECT_EQ(hand, own) << "the job's worker and the one started by hand were told other things";
}

TEST(RunIntegrationTest, WorkerOutsideNonstopRunGetsAHint) {
  TempDir dir;
  ChildProcess w({kBin + "/nonstop-test-worker"}, dir / "out.txt");
  EXPECT_EQ(w.Wait(milliseconds(10'000)), 2);
  EXPECT_NE(w.Output().find("nonstop run"), std::string::npos) << w.Output();
}

}  // namespace
}  // namespace nonstop
