// Multi-host jobs on real network namespaces (issue 9): `nonstop controller`
// in one namespace, one `nonstop agent` per other namespace, the LibTorch-free
// test worker (whose final checksum is exact at any world size and in any
// reduction order). Hosts fail for real: every process of a namespace is
// SIGKILLed (a host crash), or its link to the bridge goes down (a
// partition) and comes back.
#include <signal.h>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/temp_dir.h"
#include "controller/journal.h"
#include "tests/multihost/netns.h"

namespace nonstop::testing {
namespace {

using std::chrono::milliseconds;
using json = nlohmann::json;

const std::string kBin = NONSTOP_BIN_DIR;

std::vector<json> Events(const std::string& journal, const std::string& kind) {
  std::vector<json> out;
  auto all = controller::Journal::Read(journal);
  if (!all.ok()) return out;
  for (auto& j : *all) {
    if (j.value("event", "") == kind) out.push_back(j);
  }
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

class MultiHostTest : public ::testing::Test {
 protected:
  // Host 0 runs the controller; hosts 1.. run agents.
  void MakeCluster(int hosts) {
    auto c = NetnsCluster::Create(hosts);
    ASSERT_TRUE(c.ok()) << "the multi-host tests need network namespaces: "
                        << c.status().ToString();
    cluster_ = std::move(*c);
  }

  // Starts the controller in host 0 and waits for its job file.
  void StartController(int nnodes, std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {kBin + "/nonstop",
                                     "controller",
                                     "--listen",
                                     cluster_->address(0) + ":0",
                                     "--nnodes",
                                     std::to_string(nnodes),
                                     "--job-token-file",
                                     dir_ / "token",
                                     "--journal",
                                     journal_,
                                     "--heartbeat-timeout-ms",
                                     "1000"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto pid = cluster_->Spawn(0, argv, {}, dir_ / "controller.out");
    ASSERT_TRUE(pid.ok()) << pid.status().ToString();
    controller_pid_ = *pid;
    auto until = std::chrono::steady_clock::now() + milliseconds(20'000);
    while (controller_address_.empty()) {
      ASSERT_LT(std::chrono::steady_clock::now(), until) << ReadFile(dir_ / "controller.out");
      auto job = json::parse(ReadFile(dir_ / "job.json"), nullptr, false);
      if (!job.is_discarded() && job.contains("controller"))
        controller_address_ = job["controller"];
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  pid_t StartAgent(int host, const std::string& id, int nproc, int spares) {
    std::vector<std::string> argv = {kBin + "/nonstop",
                                     "agent",
                                     "--controller",
                                     controller_address_,
                                     "--job-token-file",
                                     dir_ / "token",
                                     "--host-id",
                                     id,
                                     "--nproc-per-host",
                                     std::to_string(nproc),
                                     "--spares-per-host",
                                     std::to_string(spares),
                                     "--join-timeout-ms",
                                     "30000",
                                     "--",
                                     kBin + "/nonstop-test-worker",
                                     "--steps",
                                     std::to_string(steps_),
                                     "--sleep-ms",
                                     std::to_string(sleep_ms_)};
    auto pid = cluster_->Spawn(host, argv, {}, dir_ / ("agent-" + id + ".out"));
    EXPECT_TRUE(pid.ok()) << pid.status().ToString();
    agents_[id] = pid.ok() ? *pid : -1;
    return agents_[id];
  }

  int64_t HighestStep() const {
    int64_t h = -1;
    for (const auto& s : Events(journal_, "step"))
      h = std::max<int64_t>(h, s["step"].get<int64_t>());
    return h;
  }

  void WaitFor(const std::function<bool()>& cond, const std::string& what, int ms = 60'000) {
    auto until = std::chrono::steady_clock::now() + milliseconds(ms);
    while (!cond()) {
      ASSERT_LT(std::chrono::steady_clock::now(), until) << "waiting for " << what << "\n"
                                                         << Outputs();
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  // The controller's exit code (-1: still running after the timeout).
  int WaitController(int ms = 90'000) {
    auto st = cluster_->WaitForExit(controller_pid_, milliseconds(ms));
    if (!st) return -1;
    return WIFEXITED(*st) ? WEXITSTATUS(*st) : 128 + WTERMSIG(*st);
  }

  std::string Outputs() const {
    std::string out = "--- controller:\n" + ReadFile(dir_ / "controller.out");
    for (const auto& [id, pid] : agents_)
      out += "--- agent " + id + ":\n" + ReadFile(dir_ / ("agent-" + id + ".out"));
    return out;
  }

  // The checksum every member finished with (they must agree).
  std::string FinalChecksum() const {
    std::set<std::string> sums;
    for (const auto& f : Events(journal_, "finished"))
      sums.insert(f["checksum"].get<std::string>());
    EXPECT_EQ(sums.size(), 1u) << "members disagree or none finished";
    return sums.empty() ? "" : *sums.begin();
  }

  // The fault-free run's checksum for the same steps (world size does not matter for the test
  // worker).
  std::string ReferenceChecksum() {
    std::string journal = dir_ / "reference.jsonl";
    std::string cmd = kBin + "/nonstop run --nproc 2 --spares 0 --inject none --journal " +
                      journal + " -- " + kBin + "/nonstop-test-worker --steps " +
                      std::to_string(steps_) + " > " + dir_ / "reference.out" + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << ReadFile(dir_ / "reference.out");
    std::set<std::string> sums;
    for (const auto& f : Events(journal, "finished")) sums.insert(f["checksum"].get<std::string>());
    return sums.size() == 1 ? *sums.begin() : "none";
  }

  // The layout of the host-fault tests: the controller on host 0, hosts h1-h3
  // with two workers each (namespaces 1-3), a host of two spares (namespace
  // 4); returns once the job has completed step 30.
  void StartThreeHostsAndASpareHost(int steps) {
    ASSERT_NO_FATAL_FAILURE(MakeCluster(5));
    steps_ = steps;
    ASSERT_NO_FATAL_FAILURE(StartController(4));
    StartAgent(1, "h1", 2, 0);
    StartAgent(2, "h2", 2, 0);
    StartAgent(3, "h3", 2, 0);
    StartAgent(4, "hs", 0, 2);
    WaitFor([&] { return HighestStep() >= 30; }, "step 30");
  }

  // worker id → host, from the join records.
  std::map<int, std::string> HostOfWorker() const {
    std::map<int, std::string> out;
    for (const auto& j : Events(journal_, "join"))
      out[j["worker_id"].get<int>()] = j.value("host", "");
    return out;
  }

  TempDir dir_;
  std::string journal_ = dir_ / "journal.jsonl";
  std::unique_ptr<NetnsCluster> cluster_;
  pid_t controller_pid_ = -1;
  std::string controller_address_;
  std::map<std::string, pid_t> agents_;
  int steps_ = 300;
  int sleep_ms_ = 20;
};

// (a) 3 hosts × 2 workers + 1 host of 2 spares; one host is killed mid-step
// (its agent and both its workers at once): ONE recovery, the spare host's
// spares take both ranks, and the result is bitwise the fault-free one.
TEST_F(MultiHostTest, HostCrashIsOneRecoveryAndSparesOfTheSpareHostTakeItsRanks) {
  ASSERT_NO_FATAL_FAILURE(StartThreeHostsAndASpareHost(300));
  auto plan = Events(journal_, "plan").back();
  auto host_of = HostOfWorker();
  std::set<int> h2_ranks;
  for (size_t r = 0; r < plan["members"].size(); ++r) {
    if (host_of[plan["members"][r].get<int>()] == "h2") h2_ranks.insert(static_cast<int>(r));
  }
  ASSERT_EQ(h2_ranks.size(), 2u) << plan.dump();
  EXPECT_GE(cluster_->KillHost(2), 1) << "the agent and its workers";
  ASSERT_EQ(WaitController(), 0) << Outputs();

  auto starts = Events(journal_, "recovery_start");
  ASSERT_EQ(starts.size(), 1u) << "one recovery for the whole host\n" << Outputs();
  // Whichever of h2's connections broke first started it; the host's loss is among its causes.
  auto ends = Events(journal_, "recovery_end");
  ASSERT_EQ(ends.size(), 1u);
  EXPECT_NE(ends[0]["recovery"]["causes"].dump().find("host h2 lost"), std::string::npos)
      << ends[0].dump();
  auto plans = Events(journal_, "plan");
  ASSERT_EQ(plans.size(), 2u);
  host_of = HostOfWorker();
  for (int r : h2_ranks) {
    int id = plans[1]["members"][static_cast<size_t>(r)].get<int>();
    EXPECT_EQ(host_of[id], "hs") << "rank " << r << " is taken by a spare of the spare host";
  }
  EXPECT_EQ(plans[1]["members"].size(), 6u);
  EXPECT_EQ(FinalChecksum(), ReferenceChecksum());
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "completed");
  EXPECT_EQ(ends[0]["recovery"]["lost_steps"], 0);
}

// (b) A partition: host h2's link goes down while its processes live on. It is
// declared lost (heartbeats), its workers are fenced, the job goes on bitwise;
// when the link heals the agent registers again and its slots come back as
// spares, never into the old generation.
TEST_F(MultiHostTest, PartitionedHostIsFencedAndComesBackAsSpares) {
  ASSERT_NO_FATAL_FAILURE(StartThreeHostsAndASpareHost(700));
  std::set<int> fenced;
  for (const auto& [id, host] : HostOfWorker()) {
    if (host == "h2") fenced.insert(id);
  }
  ASSERT_EQ(fenced.size(), 2u);
  ASSERT_TRUE(cluster_->LinkDown(2).ok());
  WaitFor([&] { return !Events(journal_, "host_lost").empty(); }, "h2 declared lost");
  auto lost = Events(journal_, "host_lost")[0];
  EXPECT_EQ(lost["host"], "h2");
  EXPECT_NE(lost["reason"].get<std::string>().find("heartbeat"), std::string::npos) << lost.dump();
  // The job goes on without h2.
  size_t plans_at_loss = 0;
  WaitFor([&] { return (plans_at_loss = Events(journal_, "plan").size()) >= 2; },
          "the plan without h2");
  int64_t step_at_plan = HighestStep();
  WaitFor([&] { return HighestStep() >= step_at_plan + 20; }, "progress without h2");
  ASSERT_TRUE(cluster_->LinkUp(2).ok());
  // The agent noticed the silence, killed its workers, and registers again.
  WaitFor(
      [&] {
        for (const auto& j : Events(journal_, "host_join")) {
          if (j["host"] == "h2" && j["incarnation"] == 2) return true;
        }
        return false;
      },
      "h2 to register again");
  ASSERT_EQ(WaitController(), 0) << Outputs();

  for (const auto& p : Events(journal_, "plan")) {
    if (p["generation"].get<int>() == 1) continue;
    for (const auto& m : p["members"]) {
      EXPECT_FALSE(fenced.count(m.get<int>()))
          << "fenced worker " << m << " in generation " << p["generation"];
    }
  }
  std::map<int, int> joins;
  for (const auto& j : Events(journal_, "join")) joins[j["worker_id"].get<int>()]++;
  for (int id : fenced) EXPECT_EQ(joins[id], 1) << "fenced worker " << id << " joined again";
  bool respawned_on_h2 = false;
  for (const auto& j : Events(journal_, "join")) {
    if (j.value("host", "") == "h2" && !fenced.count(j["worker_id"].get<int>()))
      respawned_on_h2 = true;
  }
  EXPECT_TRUE(respawned_on_h2) << "h2's slots came back as spares\n" << Outputs();
  EXPECT_EQ(Events(journal_, "recovery_start").size(), 1u) << Outputs();
  EXPECT_EQ(FinalChecksum(), ReferenceChecksum());
  std::string agent_out = ReadFile(dir_ / "agent-h2.out");
  EXPECT_NE(agent_out.find("fenc"), std::string::npos) << "the agent says it fenced its workers\n"
                                                       << agent_out;
}

// (c) A host that registers after the start grows the job (policy permitting).
TEST_F(MultiHostTest, LateHostGrowsTheJob) {
  ASSERT_NO_FATAL_FAILURE(MakeCluster(4));
  steps_ = 400;
  ASSERT_NO_FATAL_FAILURE(StartController(2, {"--max-world", "6"}));
  StartAgent(1, "h1", 2, 0);
  StartAgent(2, "h2", 2, 0);
  WaitFor([&] { return HighestStep() >= 20; }, "step 20");
  StartAgent(3, "h3", 2, 0);
  WaitFor(
      [&] {
        auto plans = Events(journal_, "plan");
        return !plans.empty() && plans.back()["members"].size() == 6;
      },
      "the job to grow to 6");
  ASSERT_EQ(WaitController(), 0) << Outputs();
  std::vector<size_t> worlds;
  for (const auto& p : Events(journal_, "plan")) worlds.push_back(p["members"].size());
  EXPECT_EQ(worlds, (std::vector<size_t>{4, 6})) << Outputs();
  EXPECT_EQ(FinalChecksum(), ReferenceChecksum());
}

// (d) A preemption (docs/slurm.md): every process of a late host gets SIGTERM,
// as Slurm signals a job step. The agent asks to leave, its workers ignore the
// signal and are released at the next step boundary: the world shrinks with no
// fault and no recovery, no step is lost, the agent exits 0 and the job ends
// bitwise as the fault-free run.
TEST_F(MultiHostTest, SigtermedHostLeavesAtAStepBoundaryWithoutAFault) {
  ASSERT_NO_FATAL_FAILURE(MakeCluster(4));
  steps_ = 500;
  ASSERT_NO_FATAL_FAILURE(StartController(2, {"--max-world", "6"}));
  StartAgent(1, "h1", 2, 0);
  StartAgent(2, "h2", 2, 0);
  WaitFor([&] { return HighestStep() >= 20; }, "step 20");
  pid_t late = StartAgent(3, "h3", 2, 0);
  WaitFor(
      [&] {
        auto plans = Events(journal_, "plan");
        return !plans.empty() && plans.back()["members"].size() == 6;
      },
      "the job to grow to 6");
  int64_t grown = HighestStep();
  WaitFor([&] { return HighestStep() >= grown + 10; }, "steps at world 6");
  EXPECT_EQ(cluster_->SignalHost(3, SIGTERM), 3) << "the agent and its two workers";
  auto st = cluster_->WaitForExit(late, milliseconds(30'000));
  ASSERT_TRUE(st.has_value()) << "the agent did not leave\n" << Outputs();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << Outputs();
  EXPECT_NE(
      ReadFile(dir_ / "agent-h3.out").find("left the job (SIGTERM): its workers were released"),
      std::string::npos)
      << Outputs();
  ASSERT_EQ(WaitController(), 0) << Outputs();
  std::vector<size_t> worlds;
  for (const auto& p : Events(journal_, "plan")) worlds.push_back(p["members"].size());
  EXPECT_EQ(worlds, (std::vector<size_t>{4, 6, 4})) << Outputs();
  EXPECT_TRUE(Events(journal_, "fault").empty()) << Outputs();
  EXPECT_TRUE(Events(journal_, "recovery_start").empty()) << Outputs();
  ASSERT_EQ(Events(journal_, "host_leaving").size(), 1u);
  EXPECT_EQ(Events(journal_, "host_leaving")[0]["reason"], "SIGTERM");
  ASSERT_EQ(Events(journal_, "host_left").size(), 1u) << Outputs();
  EXPECT_EQ(Events(journal_, "host_left")[0]["host"], "h3");
  auto ends = Events(journal_, "recovery_end");
  ASSERT_EQ(ends.size(), 2u);
  for (const auto& e : ends) {
    EXPECT_EQ(e["recovery"]["outcome"], "completed") << e.dump();
    EXPECT_EQ(e["recovery"]["lost_steps"], 0) << e.dump();
  }
  std::set<int64_t> steps;
  for (const auto& s : Events(journal_, "step")) steps.insert(s["step"].get<int64_t>());
  EXPECT_EQ(steps.size(), static_cast<size_t>(steps_)) << "every step once, none lost";
  EXPECT_EQ(FinalChecksum(), ReferenceChecksum());
}

// Bad input: a wrong token, and a host id already in the job.
TEST_F(MultiHostTest, AgentsWithAWrongTokenOrADuplicateHostIdAreRefusedWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(MakeCluster(3));
  ASSERT_NO_FATAL_FAILURE(StartController(5));  // never forms: we only probe the refusals
  StartAgent(1, "h1", 1, 0);
  WaitFor([&] { return !Events(journal_, "host_join").empty(); }, "h1 to register");
  auto dup = cluster_->Spawn(
      2,
      {kBin + "/nonstop", "agent", "--controller", controller_address_, "--job-token-file",
       dir_ / "token", "--host-id", "h1", "--", kBin + "/nonstop-test-worker"},
      {}, dir_ / "dup.out");
  ASSERT_TRUE(dup.ok());
  auto st = cluster_->WaitForExit(*dup, milliseconds(20'000));
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(WEXITSTATUS(*st), 2);
  EXPECT_NE(ReadFile(dir_ / "dup.out").find("already in the job"), std::string::npos)
      << ReadFile(dir_ / "dup.out");
  std::ofstream(dir_ / "bad-token") << "not-the-token\n";
  // Private, as a token file must be (docs/security.md): the controller, not the agent, refuses it.
  std::filesystem::permissions(
      dir_ / "bad-token", std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  auto bad = cluster_->Spawn(
      2,
      {kBin + "/nonstop", "agent", "--controller", controller_address_, "--job-token-file",
       dir_ / "bad-token", "--host-id", "h9", "--", kBin + "/nonstop-test-worker"},
      {}, dir_ / "bad.out");
  ASSERT_TRUE(bad.ok());
  st = cluster_->WaitForExit(*bad, milliseconds(20'000));
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(WEXITSTATUS(*st), 2);
  EXPECT_NE(ReadFile(dir_ / "bad.out").find("token"), std::string::npos)
      << ReadFile(dir_ / "bad.out");
}

}  // namespace
}  // namespace nonstop::testing
