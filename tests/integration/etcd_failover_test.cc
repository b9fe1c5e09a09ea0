// Controllers with standbys through a real etcd (docs/controller-failover.md):
// two `nonstop controller --etcd` processes, one `nonstop agent --etcd`, real
// worker processes on loopback. The leader is killed (alone, or with a worker
// a moment later) or paused past its lease; the standby takes over from
// etcd's journal, and the job ends bitwise equal to a run without a fault.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <thread>

#include "common/temp_dir.h"
#include "controller/journal.h"
#include "tests/integration/etcd_server.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;
const auto& Events = nonstop::testing::JournalEvents;
const auto& FinishedChecksum = nonstop::testing::FinishedChecksum;

constexpr int kSteps = 300;  // 6 s: the standby leads (~2 s after the fault) while they train

std::vector<std::string> Worker() {
  return {kBin + "/nonstop-test-worker", "--steps", std::to_string(kSteps), "--sleep-ms", "20"};
}

bool WaitForOutput(const ChildProcess& p, const std::string& text, milliseconds timeout) {
  auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (p.Output().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return false;
}

int64_t NowWallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The same job without any fault: the checksum every scenario must end with.
const std::string& Reference() {
  static std::string checksum = [] {
    TempDir dir;
    std::string journal = dir / "journal.jsonl";
    std::vector<std::string> argv = {kBin + "/nonstop", "run", "--nproc", "3", "--spares", "0", "--journal",
                                     journal, "--"};
    for (auto& a : Worker()) argv.push_back(a);
    ChildProcess ref(argv, dir / "ref.out");
    if (ref.Wait(milliseconds(60'000)) != 0) return std::string();
    return FinishedChecksum(journal);
  }();
  return checksum;
}

class EtcdFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(Reference().empty()) << "the reference run failed";
    etcd_ = std::make_unique<nonstop::testing::EtcdServer>(dir_.path());
    ASSERT_FALSE(etcd_->endpoint().empty()) << "etcd did not start (scripts/setup.sh installs etcd-server)\n"
                                            << etcd_->Output();
  }

  // The lease is the default (2 s) unless NONSTOP_TEST_LEASE_TTL_S says (to measure other TTLs).
  std::unique_ptr<ChildProcess> StartController(const std::string& name) {
    std::string journal = dir_ / (name + "/journal.jsonl");
    const char* ttl = std::getenv("NONSTOP_TEST_LEASE_TTL_S");
    return std::make_unique<ChildProcess>(
        std::vector<std::string>{kBin + "/nonstop", "controller", "--etcd", etcd_->endpoint(), "--job", "j",
                                 "--nnodes", "1", "--job-token-file", dir_ / "token", "--journal", journal,
                                 "--heartbeat-timeout-ms", "1000", "--lease-ttl-s", ttl != nullptr ? ttl : "2"},
        dir_ / (name + ".out"));
  }
  std::string JournalOf(const std::string& name) { return dir_ / (name + "/journal.jsonl"); }

  std::unique_ptr<ChildProcess> StartAgent() {
    std::vector<std::string> argv = {kBin + "/nonstop", "agent", "--etcd", etcd_->endpoint(), "--job", "j",
                                     "--job-token-file", dir_ / "token", "--host-id", "h1", "--nproc-per-host", "3",
                                     "--spares-per-host", "1", "--controller-timeout-ms", "1500", "--"};
    for (auto& a : Worker()) argv.push_back(a);
    // Workers notice a silent controller after 1.5 s (a paused one: killed ones close their connections).
    return std::make_unique<ChildProcess>(argv, dir_ / "agent.out",
                                          std::vector<std::string>{"NONSTOP_CONTROLLER_TIMEOUT_MS=1500"});
  }

  // Starts the leader "a", then the standby "b" and the agent; returns when 30 steps are done.
  void StartJob() {
    a_ = StartController("a");
    ASSERT_TRUE(WaitForOutput(*a_, "  journal ", milliseconds(20'000))) << a_->Output();  // token file written
    b_ = StartController("b");
    ASSERT_TRUE(WaitForOutput(*b_, "standing by", milliseconds(20'000))) << b_->Output();
    agent_ = StartAgent();
    ASSERT_TRUE(nonstop::testing::WaitForEvents(JournalOf("a"), "step", 30, milliseconds(60'000)))
        << a_->Output() << agent_->Output();
  }

  std::string Outputs() {
    return "--- controller a\n" + a_->Output() + "--- controller b\n" + b_->Output() + "--- agent\n" +
           agent_->Output();
  }

  // Milliseconds from `since_us` (wall clock) to b's takeover record, and to the last rejoin after it.
  double TakeoverMs(int64_t since_us) {
    auto t = Events(JournalOf("b"), "takeover");
    return t.empty() ? -1 : (t[0]["time_us"].get<int64_t>() - since_us) / 1000.0;
  }
  double AllRejoinedMs(int64_t since_us) {
    int64_t last = 0;
    for (const auto& r : Events(JournalOf("b"), "rejoin")) last = std::max(last, r["time_us"].get<int64_t>());
    return last == 0 ? -1 : (last - since_us) / 1000.0;
  }

  TempDir dir_;
  std::unique_ptr<nonstop::testing::EtcdServer> etcd_;
  std::unique_ptr<ChildProcess> a_, b_, agent_;
};

TEST_F(EtcdFailoverTest, KilledLeaderIsReplacedByTheStandbyWithoutARecoveryOrALostStep) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  int64_t killed_us = NowWallMicros();
  ASSERT_EQ(::kill(a_->pid(), SIGKILL), 0);
  ASSERT_EQ(a_->Wait(milliseconds(5'000)), 128 + SIGKILL);
  int64_t step_at_kill = Events(JournalOf("a"), "step").back()["step"].get<int64_t>();

  ASSERT_EQ(b_->Wait(milliseconds(90'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  std::string journal = JournalOf("b");
  auto takeovers = Events(journal, "takeover");
  ASSERT_EQ(takeovers.size(), 1u) << Outputs();
  EXPECT_EQ(takeovers[0]["generation"], 1);
  EXPECT_EQ(Events(journal, "rejoin").size(), 4u) << "three members and the spare rejoined\n" << Outputs();
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the takeover cost a recovery\n" << Outputs();
  EXPECT_TRUE(Events(journal, "fault").empty()) << Outputs();
  // Every member's state at its rejoin holds at least the step the job had reached at the kill.
  int64_t state_at_rejoin = INT64_MAX;
  for (const auto& r : Events(journal, "rejoin")) {
    if (r.value("role", "") == "spare") continue;
    state_at_rejoin = std::min(state_at_rejoin, r["state_step"].get<int64_t>());
  }
  EXPECT_GE(state_at_rejoin, step_at_kill) << "a step was lost\n" << Outputs();
  // b's journal is the whole job's: a's records (from etcd) and then its own, with a later epoch.
  auto starts = Events(journal, "job_start");
  auto controller_starts = Events(journal, "controller_start");
  ASSERT_EQ(starts.size(), 1u);
  ASSERT_EQ(controller_starts.size(), 1u);
  EXPECT_GT(controller_starts[0]["epoch"].get<int64_t>(), starts[0]["epoch"].get<int64_t>());
  EXPECT_EQ(FinishedChecksum(journal), Reference()) << "not bitwise equal to the run without the kill\n" << Outputs();
  std::printf("[ measured ] leader killed at step %lld: standby's takeover %.0f ms after the kill, all rejoined "
              "%.0f ms; the members' state at their rejoin: step %lld (none lost)\n",
              static_cast<long long>(step_at_kill), TakeoverMs(killed_us), AllRejoinedMs(killed_us),
              static_cast<long long>(state_at_rejoin));
}

TEST_F(EtcdFailoverTest, LeaderAndThenAWorkerKilledBeforeTheStandbyLeadsTheNewLeaderRunsTheRecovery) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  // A member's pid, from a's journal.
  pid_t victim = 0;
  for (const auto& j : Events(JournalOf("a"), "join")) {
    if (!j.value("spare", false)) victim = j["pid"].get<pid_t>();
  }
  ASSERT_GT(victim, 0);
  int64_t killed_us = NowWallMicros();
  ASSERT_EQ(::kill(a_->pid(), SIGKILL), 0);
  ASSERT_EQ(a_->Wait(milliseconds(5'000)), 128 + SIGKILL);
  std::this_thread::sleep_for(milliseconds(200));  // well within the lease: nobody leads
  ASSERT_EQ(::kill(victim, SIGKILL), 0);

  ASSERT_EQ(b_->Wait(milliseconds(90'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  std::string journal = JournalOf("b");
  ASSERT_EQ(Events(journal, "takeover").size(), 1u) << Outputs();
  EXPECT_GE(Events(journal, "recovery_start").size(), 1u) << "the new leader did not recover\n" << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference()) << "not bitwise equal to the run without a fault\n" << Outputs();
  auto ends = Events(journal, "recovery_end");
  if (!ends.empty()) {
    std::printf("[ measured ] leader killed, a worker 200 ms later: takeover %.0f ms after the leader's kill, the "
                "recovery ended %.0f ms after it, resuming at step %lld, lost steps %lld\n",
                TakeoverMs(killed_us), (ends[0]["time_us"].get<int64_t>() - killed_us) / 1000.0,
                static_cast<long long>(ends[0]["recovery"].value("resume_step", int64_t{-1})),
                static_cast<long long>(ends[0]["recovery"].value("lost_steps", int64_t{-1})));
  }
}

TEST_F(EtcdFailoverTest, APausedLeaderThatWakesAfterTheTakeoverStepsDownAndIsNotFollowed) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  ASSERT_EQ(::kill(a_->pid(), SIGSTOP), 0);
  int64_t stopped_us = NowWallMicros();
  ASSERT_TRUE(nonstop::testing::WaitForEvents(JournalOf("b"), "takeover", 1, milliseconds(30'000))) << Outputs();
  // b leads and the workers follow it: then a wakes up.
  ASSERT_TRUE(nonstop::testing::WaitForEvents(JournalOf("b"), "rejoin", 4, milliseconds(30'000))) << Outputs();
  ASSERT_EQ(::kill(a_->pid(), SIGCONT), 0);

  ASSERT_EQ(b_->Wait(milliseconds(90'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  // a saw that it no longer leads, said so in its journal, stood by, and left when the job ended.
  EXPECT_EQ(a_->Wait(milliseconds(20'000)), 0) << Outputs();
  auto deposed = Events(JournalOf("a"), "deposed");
  ASSERT_EQ(deposed.size(), 1u) << Outputs();
  int64_t b_epoch = Events(JournalOf("b"), "controller_start")[0]["epoch"].get<int64_t>();
  EXPECT_LT(deposed[0]["epoch"].get<int64_t>(), b_epoch);
  std::string journal = JournalOf("b");
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the takeover cost a recovery\n" << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference()) << Outputs();
  std::printf("[ measured ] leader paused: standby's takeover %.0f ms after the SIGSTOP, all rejoined %.0f ms; the old "
              "leader: %s\n",
              TakeoverMs(stopped_us), AllRejoinedMs(stopped_us), deposed[0].value("reason", "").c_str());
}

TEST_F(EtcdFailoverTest, SigtermHandsTheJobOverToTheStandbyAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  int64_t term_us = NowWallMicros();
  ASSERT_EQ(::kill(a_->pid(), SIGTERM), 0);
  EXPECT_EQ(a_->Wait(milliseconds(10'000)), 130) << Outputs();
  ASSERT_EQ(b_->Wait(milliseconds(90'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  EXPECT_EQ(Events(JournalOf("a"), "handover").size(), 1u) << Outputs();
  EXPECT_TRUE(Events(JournalOf("a"), "job_end").empty()) << "SIGTERM ended the job instead of handing it over";
  std::string journal = JournalOf("b");
  ASSERT_EQ(Events(journal, "takeover").size(), 1u) << Outputs();
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference()) << Outputs();
  std::printf("[ measured ] leader SIGTERMed: standby's takeover %.0f ms after the signal, all rejoined %.0f ms\n",
              TakeoverMs(term_us), AllRejoinedMs(term_us));
}

TEST_F(EtcdFailoverTest, AStandbyWithoutTheJobTokenRefusesToTakeOverInsteadOfLockingEveryoneOut) {
  a_ = StartController("a");
  ASSERT_TRUE(WaitForOutput(*a_, "  journal ", milliseconds(20'000))) << a_->Output();
  b_ = std::make_unique<ChildProcess>(
      std::vector<std::string>{kBin + "/nonstop", "controller", "--etcd", etcd_->endpoint(), "--job", "j",
                               "--nnodes", "1", "--job-token-file", dir_ / "elsewhere/token", "--journal",
                               JournalOf("b")},
      dir_ / "b.out");
  ASSERT_TRUE(WaitForOutput(*b_, "standing by", milliseconds(20'000))) << b_->Output();
  ASSERT_EQ(::kill(a_->pid(), SIGKILL), 0);
  EXPECT_EQ(b_->Wait(milliseconds(20'000)), 1) << b_->Output();
  EXPECT_NE(b_->Output().find("token file"), std::string::npos) << b_->Output();
}

TEST(EtcdControllerTest, AnUnreachableEtcdAtStartIsAClearErrorNamingTheEndpoints) {
  TempDir dir;
  int port = nonstop::testing::FreeLoopbackPort();
  std::string endpoint = fmt::format("127.0.0.1:{}", port);
  ChildProcess c({kBin + "/nonstop", "controller", "--etcd", endpoint, "--nnodes", "1", "--job-token-file",
                  dir / "token", "--journal", dir / "journal.jsonl"},
                 dir / "out.txt");
  EXPECT_EQ(c.Wait(milliseconds(20'000)), 1) << c.Output();
  EXPECT_NE(c.Output().find(endpoint), std::string::npos) << c.Output();
  EXPECT_NE(c.Output().find("etcd"), std::string::npos) << c.Output();
}

}  // namespace
}  // namespace nonstop
