// The controller is no single point of failure (docs/controller-failover.md):
// a job run by `nonstop controller` and `nonstop agent` (real processes, real
// sockets on loopback) loses its controller to SIGKILL mid-run; the workers
// keep training, and `nonstop controller --resume` adopts them: no recovery,
// no step lost, the same result as a run without the kill.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include "common/temp_dir.h"
#include "controller/journal.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;
const auto& Events = nonstop::testing::JournalEvents;
const auto& FinishedChecksum = nonstop::testing::FinishedChecksum;

using nonstop::testing::ControllerAddress;

constexpr int kSteps = 200;

std::vector<std::string> Worker() {
  return {kBin + "/nonstop-test-worker", "--steps", std::to_string(kSteps), "--sleep-ms", "20"};
}

// The same job without the kill, by plain `nonstop run`: its final checksum.
std::string Reference(TempDir& dir) {
  std::string journal = dir / "ref/journal.jsonl";
  std::vector<std::string> argv = {kBin + "/nonstop", "run",   "--nproc", "3", "--spares", "0",
                                   "--journal",       journal, "--"};
  for (auto& a : Worker()) argv.push_back(a);
  ChildProcess ref(argv, dir / "ref.out");
  return ref.Wait(milliseconds(60'000)) == 0 ? FinishedChecksum(journal) : "";
}

TEST(ControllerFailoverTest,
     KilledControllerIsReplacedByResumeAndTheWorkersTrainOnWithoutARecovery) {
  TempDir dir;
  // The reference: the same job, nobody killed.
  std::string reference = Reference(dir);
  ASSERT_FALSE(reference.empty()) << "the reference run failed";

  std::string run_dir = dir / "job";
  std::string journal = run_dir + "/journal.jsonl";
  std::string token = dir / "token";
  std::vector<std::string> controller_flags = {
      "--nnodes", "1", "--job-token-file", token, "--heartbeat-timeout-ms", "1000"};
  std::vector<std::string> first_argv = {kBin + "/nonstop", "controller", "--journal", journal};
  for (auto& a : controller_flags) first_argv.push_back(a);
  auto first = std::make_unique<ChildProcess>(first_argv, dir / "controller1.out");
  std::string address = ControllerAddress(run_dir);
  ASSERT_FALSE(address.empty()) << first->Output();
  std::vector<std::string> agent_argv = {kBin + "/nonstop",
                                         "agent",
                                         "--controller",
                                         address,
                                         "--job-token-file",
                                         token,
                                         "--host-id",
                                         "h1",
                                         "--nproc-per-host",
                                         "3",
                                         "--spares-per-host",
                                         "1",
                                         "--"};
  for (auto& a : Worker()) agent_argv.push_back(a);
  ChildProcess agent(agent_argv, dir / "agent.out");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "step", 30, milliseconds(60'000)))
      << first->Output() << agent.Output();
  ASSERT_EQ(::kill(first->pid(), SIGKILL), 0);
  ASSERT_EQ(first->Wait(milliseconds(5'000)), 128 + SIGKILL);
  int64_t step_at_kill = Events(journal, "step").back()["step"].get<int64_t>();
  // The workers train on without a controller for a moment.
  std::this_thread::sleep_for(milliseconds(500));

  std::vector<std::string> second_argv = {kBin + "/nonstop", "controller", "--resume", journal};
  for (auto& a : controller_flags) second_argv.push_back(a);
  ChildProcess second(second_argv, dir / "controller2.out");
  int code = second.Wait(milliseconds(90'000));
  std::string outputs = "--- controller 2\n" + second.Output() + "--- agent\n" + agent.Output();
  ASSERT_EQ(code, 0) << outputs;
  EXPECT_EQ(agent.Wait(milliseconds(20'000)), 0) << outputs;

  auto takeovers = Events(journal, "takeover");
  ASSERT_EQ(takeovers.size(), 1u) << outputs;
  EXPECT_EQ(takeovers[0]["generation"], 1);
  EXPECT_EQ(Events(journal, "rejoin").size(), 4u) << "three members and the spare rejoined\n"
                                                  << outputs;
  EXPECT_EQ(Events(journal, "host_rejoin").size(), 1u) << outputs;
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the takeover cost a recovery\n"
                                                         << outputs;
  EXPECT_TRUE(Events(journal, "fault").empty()) << outputs;
  EXPECT_EQ(Events(journal, "plan").size(), 1u) << "generation 1 went on";
  // Training did not wait for the new controller: steps were completed in between.
  auto rejoins = Events(journal, "rejoin");
  int64_t state_at_rejoin = -1;
  for (const auto& r : rejoins)
    state_at_rejoin = std::max(state_at_rejoin, r["state_step"].get<int64_t>());
  EXPECT_GT(state_at_rejoin, step_at_kill) << outputs;
  auto ends = Events(journal, "job_end");
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0]["exit_code"], 0);
  EXPECT_EQ(FinishedChecksum(journal), reference)
      << "not bitwise equal to the run without the kill\n"
      << outputs;
}

// The pid of the controller that wrote the job file beside the journal in `dir` (-1: none yet).
pid_t JobFilePid(const std::string& dir) {
  std::ifstream in(dir + "/job.json");
  auto job = nlohmann::json::parse(in, nullptr, false);
  return job.is_object() && job.contains("pid") && job["pid"].is_number_integer()
             ? job["pid"].get<pid_t>()
             : -1;
}

// Waits (≤ 60 s) until the journal's last "step" record is at `step` or later.
bool WaitForStep(const std::string& journal, int64_t step) {
  for (int i = 0; i < 3'000; ++i) {
    auto steps = Events(journal, "step");
    if (!steps.empty() && steps.back().value("step", int64_t{-1}) >= step) return true;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return false;
}

// `nonstop run` (its default: the controller is a process of its own, the
// `nonstop run` process supervises the workers) whose controller is killed
// -9 three times: twice while it trains, once in the middle of a recovery
// (of rank 1, killed by an injected fault). Each time `nonstop run` starts the
// controller again with --resume from the journal, at once; nobody types a
// command, and the job ends with exit 0, bitwise equal to the run without
// any kill.
// The journal's records about recoveries and controllers, one a line: what a failure shows.
std::string RecoveryRecords(const std::string& journal) {
  std::string out;
  for (const char* e : {"controller_restart", "takeover", "fault", "recovery_start", "plan",
                        "recovery_end", "join_timeout", "exit"}) {
    for (const auto& r : Events(journal, e)) out += r.dump().substr(0, 400) + "\n";
  }
  return out;
}

TEST(ControllerFailoverTest, RunRestartsItsControllerKilledTwiceAndDuringARecoveryAndEndsBitwise) {
  TempDir dir;
  std::string reference = Reference(dir);
  ASSERT_FALSE(reference.empty()) << "the reference run failed";

  std::string run_dir = dir / "job";
  std::string journal = run_dir + "/journal.jsonl";
  std::vector<std::string> argv = {kBin + "/nonstop", "run",   "--nproc",  "3",
                                   "--spares",        "1",     "--inject", "kill:rank=1,step=150",
                                   "--journal",       journal, "--"};
  for (auto& a : Worker()) argv.push_back(a);
  argv.insert(argv.end(), {"--recovered-step-sleep-ms", "2000"});
  ChildProcess run(argv, dir / "run.out");
  pid_t killed = -1;
  // Kills the controller now running (it must be a process of its own, not one killed before).
  auto kill_controller = [&]() {
    pid_t pid = JobFilePid(run_dir);
    ASSERT_GT(pid, 0) << run.Output();
    ASSERT_NE(pid, run.pid()) << "the controller is not a process of its own";
    ASSERT_NE(pid, killed) << "the job file still names the controller killed before";
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    killed = pid;
  };
  for (int64_t step : {30, 80}) {
    ASSERT_TRUE(WaitForStep(journal, step)) << run.Output();
    ASSERT_NO_FATAL_FAILURE(kill_controller());
    // Restarted, and the new controller has taken the job over.
    size_t n = step == 30 ? 1 : 2;
    ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "takeover", n, milliseconds(30'000)))
        << run.Output();
    ASSERT_NE(JobFilePid(run_dir), killed) << run.Output();
  }
  // The injected fault (rank 1 at step 150): the controller dies as soon as the recovery has
  // started, which stays open for 2 s (the survivors' first step after it takes that much longer).
  auto deadline = std::chrono::steady_clock::now() + milliseconds(60'000);
  while (Events(journal, "recovery_start").empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(2));
  }
  ASSERT_FALSE(Events(journal, "recovery_start").empty()) << run.Output();
  ASSERT_NO_FATAL_FAILURE(kill_controller());
  const bool ended_before_kill = !Events(journal, "recovery_end").empty();
  const int64_t open_recovery = Events(journal, "recovery_start").back()["recovery"].get<int64_t>();

  int code = run.Wait(milliseconds(90'000));
  ASSERT_EQ(code, 0) << run.Output();
  EXPECT_FALSE(ended_before_kill) << "the recovery had ended before the kill\n" << run.Output();
  auto restarts = Events(journal, "controller_restart");
  ASSERT_EQ(restarts.size(), 3u) << run.Output();
  for (size_t i = 0; i < restarts.size(); ++i) {
    EXPECT_EQ(restarts[i]["restart"], static_cast<int>(i + 1));
    EXPECT_EQ(restarts[i]["previous_exit_code"], 128 + SIGKILL);
    EXPECT_EQ(restarts[i]["waited_ms"], 0) << "restarted at once";
  }
  EXPECT_EQ(Events(journal, "takeover").size(), 3u) << run.Output();
  EXPECT_EQ(Events(journal, "fault").size(), 1u) << "only the injected fault\n" << run.Output();
  int finished = 0;  // by the restarted controller, once
  // When the controller died after journaling the plan but before the members had it, they rejoin
  // the next one a generation behind the journal: it runs the recovery again under a new id, and
  // that one must complete.
  int64_t superseded_by = -1;
  for (const auto& e : Events(journal, "recovery_end")) {
    if (e["recovery"]["id"] != open_recovery) continue;
    ++finished;
    const std::string outcome = e["recovery"]["outcome"];
    if (outcome.rfind("superseded by recovery ", 0) == 0) {
      superseded_by = std::stoll(outcome.substr(std::string("superseded by recovery ").size()));
    }
    EXPECT_TRUE(outcome == "completed" || outcome.rfind("interrupted", 0) == 0 ||
                superseded_by > open_recovery)
        << outcome << "\n"
        << RecoveryRecords(journal) << run.Output();
  }
  if (superseded_by > 0) {
    bool completed = false;
    for (const auto& e : Events(journal, "recovery_end")) {
      completed |= e["recovery"]["id"] == superseded_by && e["recovery"]["outcome"] == "completed";
    }
    EXPECT_TRUE(completed) << "recovery " << superseded_by << " did not complete\n"
                           << RecoveryRecords(journal) << run.Output();
  }
  EXPECT_EQ(finished, 1) << "recovery " << open_recovery << " has no end, or two\n" << run.Output();
  std::set<int64_t> ids;  // a takeover does not reuse the id of the recovery it found open
  for (const auto& e : Events(journal, "recovery_start")) {
    EXPECT_TRUE(ids.insert(e["recovery"].get<int64_t>()).second)
        << "recovery id reused: " << e.dump();
  }
  auto ends = Events(journal, "job_end");
  ASSERT_EQ(ends.size(), 1u) << run.Output();
  EXPECT_EQ(ends[0]["exit_code"], 0);
  EXPECT_EQ(FinishedChecksum(journal), reference)
      << "not bitwise equal to the run without the kills\n"
      << run.Output();
}

TEST(ControllerFailoverTest, ResumingAJobThatEndedIsRefusedWithTheReason) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  {
    std::ofstream out(journal);
    out << R"({"event":"job_start","controller":"127.0.0.1:1"})"
        << "\n"
        << R"({"event":"job_end","exit_code":0,"reason":"finished"})"
        << "\n";
  }
  {
    std::ofstream out(dir / "token");
    out << "0123456789abcdef0123456789abcdef\n";
  }
  ::chmod((dir / "token").c_str(), 0600);
  ChildProcess resume({kBin + "/nonstop", "controller", "--resume", journal, "--nnodes", "1",
                       "--job-token-file", dir / "token"},
                      dir / "out.txt");
  EXPECT_EQ(resume.Wait(milliseconds(10'000)), 2) << resume.Output();
  EXPECT_NE(resume.Output().find("already ended"), std::string::npos) << resume.Output();
}

}  // namespace
}  // namespace nonstop
