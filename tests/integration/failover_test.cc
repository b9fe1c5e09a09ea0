// The controller is no single point of failure (docs/controller-failover.md):
// a job run by `nonstop controller` and `nonstop agent` (real processes, real
// sockets on loopback) loses its controller to SIGKILL mid-run; the workers
// keep training, and `nonstop controller --resume` adopts them: no recovery,
// no step lost, the same result as a run without the kill.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
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

// The control address the controller wrote to the job file beside its journal.
std::string ControllerAddress(const std::string& dir) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream in(dir + "/job.json");
    if (in) {
      try {
        auto job = nlohmann::json::parse(in);
        return job.at("controller").get<std::string>();
      } catch (...) {
      }
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  return "";
}

constexpr int kSteps = 200;

std::vector<std::string> Worker() {
  return {kBin + "/nonstop-test-worker", "--steps", std::to_string(kSteps), "--sleep-ms", "20"};
}

// The same job without the kill, by plain `nonstop run`: its final checksum.
std::string Reference(TempDir& dir) {
  std::string journal = dir / "ref/journal.jsonl";
  std::vector<std::string> argv = {kBin + "/nonstop", "run", "--nproc", "3", "--spares", "0", "--journal", journal,
                                   "--"};
  for (auto& a : Worker()) argv.push_back(a);
  ChildProcess ref(argv, dir / "ref.out");
  return ref.Wait(milliseconds(60'000)) == 0 ? FinishedChecksum(journal) : "";
}

TEST(ControllerFailoverTest, KilledControllerIsReplacedByResumeAndTheWorkersTrainOnWithoutARecovery) {
  TempDir dir;
  // The reference: the same job, nobody killed.
  std::string reference = Reference(dir);
  ASSERT_FALSE(reference.empty()) << "the reference run failed";

  std::string run_dir = dir / "job";
  std::string journal = run_dir + "/journal.jsonl";
  std::string token = dir / "token";
  std::vector<std::string> controller_flags = {"--nnodes", "1", "--job-token-file", token,
                                               "--heartbeat-timeout-ms", "1000"};
  std::vector<std::string> first_argv = {kBin + "/nonstop", "controller", "--journal", journal};
  for (auto& a : controller_flags) first_argv.push_back(a);
  auto first = std::make_unique<ChildProcess>(first_argv, dir / "controller1.out");
  std::string address = ControllerAddress(run_dir);
  ASSERT_FALSE(address.empty()) << first->Output();
  std::vector<std::string> agent_argv = {kBin + "/nonstop", "agent", "--controller", address, "--job-token-file",
                                         token, "--host-id", "h1", "--nproc-per-host", "3", "--spares-per-host", "1",
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
  EXPECT_EQ(Events(journal, "rejoin").size(), 4u) << "three members and the spare rejoined\n" << outputs;
  EXPECT_EQ(Events(journal, "host_rejoin").size(), 1u) << outputs;
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the takeover cost a recovery\n" << outputs;
  EXPECT_TRUE(Events(journal, "fault").empty()) << outputs;
  EXPECT_EQ(Events(journal, "plan").size(), 1u) << "generation 1 went on";
  // Training did not wait for the new controller: steps were completed in between.
  auto rejoins = Events(journal, "rejoin");
  int64_t state_at_rejoin = -1;
  for (const auto& r : rejoins) state_at_rejoin = std::max(state_at_rejoin, r["state_step"].get<int64_t>());
  EXPECT_GT(state_at_rejoin, step_at_kill) << outputs;
  auto ends = Events(journal, "job_end");
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_EQ(ends[0]["exit_code"], 0);
  EXPECT_EQ(FinishedChecksum(journal), reference) << "not bitwise equal to the run without the kill\n" << outputs;
}

// `nonstop run --resumable`: the controller is a process of its own, the
// `nonstop run` process supervises the workers; kill -9 the controller, and
// `nonstop controller --resume` adopts the job, which ends as without the kill.
TEST(ControllerFailoverTest, ResumableRunSurvivesTheDeathOfItsControllerAndResumeAdoptsIt) {
  TempDir dir;
  std::string reference = Reference(dir);
  ASSERT_FALSE(reference.empty()) << "the reference run failed";

  std::string journal = dir / "job/journal.jsonl";
  std::vector<std::string> argv = {kBin + "/nonstop", "run", "--resumable", "--nproc", "3", "--spares", "1",
                                   "--journal", journal, "--"};
  for (auto& a : Worker()) argv.push_back(a);
  ChildProcess run(argv, dir / "run.out");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "step", 30, milliseconds(60'000))) << run.Output();
  pid_t controller = 0;
  {
    std::ifstream in(dir / "job/job.json");
    auto job = nlohmann::json::parse(in, nullptr, false);
    ASSERT_TRUE(job.is_object()) << run.Output();
    controller = job["pid"].get<pid_t>();
  }
  ASSERT_NE(controller, run.pid()) << "the controller is not a process of its own";
  ASSERT_EQ(::kill(controller, SIGKILL), 0);
  std::this_thread::sleep_for(milliseconds(300));
  ASSERT_EQ(run.Wait(milliseconds(1)), -1) << "`nonstop run` died with its controller\n" << run.Output();

  ChildProcess resume({kBin + "/nonstop", "controller", "--resume", journal, "--nnodes", "1", "--job-token-file",
                       dir / "job/job.token"},
                      dir / "resume.out");
  std::string outputs;
  int code = resume.Wait(milliseconds(90'000));
  outputs = "--- resume\n" + resume.Output() + "--- run\n" + run.Output();
  ASSERT_EQ(code, 0) << outputs;
  EXPECT_EQ(run.Wait(milliseconds(20'000)), 0) << outputs;
  EXPECT_EQ(Events(journal, "takeover").size(), 1u) << outputs;
  EXPECT_EQ(Events(journal, "host_rejoin").size(), 1u) << outputs;
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the takeover cost a recovery\n" << outputs;
  EXPECT_EQ(FinishedChecksum(journal), reference) << "not bitwise equal to the run without the kill\n" << outputs;
}

TEST(ControllerFailoverTest, ResumingAJobThatEndedIsRefusedWithTheReason) {
  TempDir dir;
  std::string journal = dir / "journal.jsonl";
  {
    std::ofstream out(journal);
    out << R"({"event":"job_start","controller":"127.0.0.1:1"})" << "\n"
        << R"({"event":"job_end","exit_code":0,"reason":"finished"})" << "\n";
  }
  {
    std::ofstream out(dir / "token");
    out << "0123456789abcdef0123456789abcdef\n";
  }
  ::chmod((dir / "token").c_str(), 0600);
  ChildProcess resume({kBin + "/nonstop", "controller", "--resume", journal, "--nnodes", "1", "--job-token-file",
                       dir / "token"},
                      dir / "out.txt");
  EXPECT_EQ(resume.Wait(milliseconds(10'000)), 2) << resume.Output();
  EXPECT_NE(resume.Output().find("already ended"), std::string::npos) << resume.Output();
}

}  // namespace
}  // namespace nonstop
