// Controllers with standbys through a real etcd (docs/controller-failover.md):
// two `nonstop controller --etcd` processes, one `nonstop agent --etcd`, real
// worker processes on loopback. The leader is killed (alone, or with a worker
// a moment later) or paused past its lease; the standby takes over from
// etcd's journal, and the job ends bitwise equal to a run without a fault.
// etcd itself fails too: paused past the lease, killed and restarted on its
// data, absent at the start. No controller process exits for that.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "common/temp_dir.h"
#include "controller/journal.h"
#include "coord/etcd.h"
#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"
#include "tests/integration/process.h"
#include "tests/integration/test_certs.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;
const auto& Events = nonstop::testing::JournalEvents;
const auto& FinishedChecksum = nonstop::testing::FinishedChecksum;

constexpr int kSteps = 300;  // 6 s: the standby leads (~2 s after the fault) while they train

// The checksum does not depend on the steps' pace: slower jobs (to outlast an etcd outage) end
// equal.
std::vector<std::string> Worker(int sleep_ms = 20) {
  return {kBin + "/nonstop-test-worker", "--steps", std::to_string(kSteps), "--sleep-ms",
          std::to_string(sleep_ms)};
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
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The same job without any fault: the checksum every scenario must end with.
const std::string& Reference() {
  static std::string checksum = [] {
    TempDir dir;
    std::string journal = dir / "journal.jsonl";
    std::vector<std::string> argv = {kBin + "/nonstop", "run",   "--nproc", "3", "--spares", "0",
                                     "--journal",       journal, "--"};
    for (auto& a : Worker()) argv.push_back(a);
    ChildProcess ref(argv, dir / "ref.out");
    if (ref.Wait(milliseconds(60'000)) != 0) return std::string();
    return FinishedChecksum(journal);
  }();
  return checksum;
}

using nonstop::testing::RestartableEtcd;

// A listener on loopback that accepts and counts connections (an impostor's control port).
class CountingListener {
 public:
  CountingListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && ::listen(fd_, 16) == 0 &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port_ = ntohs(a.sin_port);
    }
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        int c = ::accept(fd_, nullptr, nullptr);
        if (c >= 0) {
          connections_.fetch_add(1);
          ::close(c);
        }
      }
    });
  }
  ~CountingListener() {
    stop_.store(true);
    thread_.join();
    ::close(fd_);
  }
  std::string address() const { return fmt::format("127.0.0.1:{}", port_); }
  int connections() const { return connections_.load(); }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::thread thread_;
};

class EtcdFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(Reference().empty()) << "the reference run failed";
    etcd_ = std::make_unique<nonstop::testing::EtcdServer>(dir_.path());
    ASSERT_FALSE(etcd_->endpoint().empty())
        << "etcd did not start (scripts/setup.sh installs etcd-server)\n"
        << etcd_->Output();
    endpoint_ = etcd_->endpoint();
  }
  void TearDown() override {
    // a test that failed while it was paused
    if (etcd_ && etcd_->pid() > 0) ::kill(etcd_->pid(), SIGCONT);
  }

  // The controllers' lease: 2 s (not the default 10 s, so that the tests stay short), unless
  // NONSTOP_TEST_LEASE_TTL_S says (to measure other TTLs: the default's, say).
  static int LeaseTtlS() {
    const char* ttl = std::getenv("NONSTOP_TEST_LEASE_TTL_S");
    return ttl != nullptr ? std::atoi(ttl) : 2;
  }

  std::unique_ptr<ChildProcess> StartController(const std::string& name) {
    std::string journal = dir_ / (name + "/journal.jsonl");
    return std::make_unique<ChildProcess>(
        WithEtcdFlags({kBin + "/nonstop", "controller", "--etcd", endpoint_, "--job", "j",
                       "--nnodes", "1", "--job-token-file", dir_ / "token", "--journal", journal,
                       "--heartbeat-timeout-ms", "1000", "--lease-ttl-s",
                       std::to_string(LeaseTtlS())}),
        dir_ / (name + ".out"));
  }
  std::string JournalOf(const std::string& name) { return dir_ / (name + "/journal.jsonl"); }
  // etcd_flags_ (TLS: --etcd-cacert, …) inserted after "--etcd ENDPOINTS" (and before a "--").
  std::vector<std::string> WithEtcdFlags(std::vector<std::string> argv) const {
    auto at = std::find(argv.begin(), argv.end(), "--etcd");
    if (at != argv.end()) argv.insert(at + 2, etcd_flags_.begin(), etcd_flags_.end());
    return argv;
  }

  // Workers and the agent notice a silent controller after `controller_timeout_ms` (a paused one:
  // killed ones close their connections).
  std::unique_ptr<ChildProcess> StartAgent(int controller_timeout_ms = 1500) {
    std::vector<std::string> argv = {kBin + "/nonstop",
                                     "agent",
                                     "--etcd",
                                     endpoint_,
                                     "--job",
                                     "j",
                                     "--job-token-file",
                                     dir_ / "token",
                                     "--host-id",
                                     "h1",
                                     "--nproc-per-host",
                                     "3",
                                     "--spares-per-host",
                                     "1",
                                     "--controller-timeout-ms",
                                     std::to_string(controller_timeout_ms),
                                     "--"};
    argv = WithEtcdFlags(argv);  // before the "--" that ends the agent's flags
    for (auto& a : Worker(step_sleep_ms_)) argv.push_back(a);
    return std::make_unique<ChildProcess>(
        argv, dir_ / "agent.out",
        std::vector<std::string>{"NONSTOP_CONTROLLER_TIMEOUT_MS=" +
                                 std::to_string(controller_timeout_ms)});
  }

  // Starts the leader "a", then the standby "b" and the agent; returns when `steps` steps are done.
  void StartJob(size_t steps = 30, int controller_timeout_ms = 1500) {
    a_ = StartController("a");
    // token file written
    ASSERT_TRUE(WaitForOutput(*a_, "  journal ", milliseconds(20'000))) << a_->Output();
    b_ = StartController("b");
    ASSERT_TRUE(WaitForOutput(*b_, "standing by", milliseconds(20'000))) << b_->Output();
    agent_ = StartAgent(controller_timeout_ms);
    ASSERT_TRUE(
        nonstop::testing::WaitForEvents(JournalOf("a"), "step", steps, milliseconds(60'000)))
        << a_->Output() << agent_->Output();
  }

  // Both controllers are still running (none exited: an etcd outage is no reason to).
  void ExpectBothControllersRun(const std::string& when) {
    EXPECT_EQ(a_->Wait(milliseconds(1)), -1) << "controller a exited " << when << "\n" << Outputs();
    EXPECT_EQ(b_->Wait(milliseconds(1)), -1) << "controller b exited " << when << "\n" << Outputs();
  }

  // The journal of the controller that ended the job (its job_end), among a's and b's; empty if
  // none.
  std::string FinalJournal() {
    std::string found;
    for (const char* name : {"a", "b"}) {
      if (!Events(JournalOf(name), "job_end").empty()) found = JournalOf(name);
    }
    return found;
  }

  // Milliseconds from `since_us` (wall clock) to the first takeover record in a's or b's journal.
  double FirstTakeoverMs(int64_t since_us) {
    int64_t first = INT64_MAX;
    for (const char* name : {"a", "b"}) {
      for (const auto& t : Events(JournalOf(name), "takeover"))
        first = std::min(first, t["time_us"].get<int64_t>());
    }
    return first == INT64_MAX ? -1 : (first - since_us) / 1000.0;
  }

  std::string Outputs() {
    return "--- controller a\n" + a_->Output() + "--- controller b\n" + b_->Output() +
           "--- agent\n" + agent_->Output();
  }

  // Milliseconds from `since_us` (wall clock) to b's takeover record, and to the last rejoin after
  // it.
  double TakeoverMs(int64_t since_us) {
    auto t = Events(JournalOf("b"), "takeover");
    return t.empty() ? -1 : (t[0]["time_us"].get<int64_t>() - since_us) / 1000.0;
  }
  double AllRejoinedMs(int64_t since_us) {
    int64_t last = 0;
    for (const auto& r : Events(JournalOf("b"), "rejoin"))
      last = std::max(last, r["time_us"].get<int64_t>());
    return last == 0 ? -1 : (last - since_us) / 1000.0;
  }

  // The leader SIGKILLed mid-job: the standby takes over without a recovery or a lost step, the
  // job ends bitwise equal to the run without the kill. `mode` names etcd's (the measured line).
  void KillTheLeaderAndExpectTheStandbyToTakeOver(const char* mode);

  TempDir dir_;
  std::unique_ptr<nonstop::testing::EtcdServer> etcd_;
  std::string endpoint_;
  std::vector<std::string> etcd_flags_;  // more flags for every --etcd (the TLS files)
  // 300 steps outlast two leases: the takeover is mid-job
  int step_sleep_ms_ = std::max(20, 7 * LeaseTtlS());
  std::unique_ptr<ChildProcess> a_, b_, agent_;
};

void EtcdFailoverTest::KillTheLeaderAndExpectTheStandbyToTakeOver(const char* mode) {
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
  EXPECT_EQ(Events(journal, "rejoin").size(), 4u) << "three members and the spare rejoined\n"
                                                  << Outputs();
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the takeover cost a recovery\n"
                                                         << Outputs();
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
  EXPECT_EQ(FinishedChecksum(journal), Reference())
      << "not bitwise equal to the run without the kill\n"
      << Outputs();
  std::printf(
      "[ measured ] etcd %s: leader killed at step %lld: standby's takeover %.0f ms after the "
      "kill, all rejoined %.0f ms; the members' state at their rejoin: step %lld (none lost)\n",
      mode, static_cast<long long>(step_at_kill), TakeoverMs(killed_us), AllRejoinedMs(killed_us),
      static_cast<long long>(state_at_rejoin));
}

TEST_F(EtcdFailoverTest, KilledLeaderIsReplacedByTheStandbyWithoutARecoveryOrALostStep) {
  KillTheLeaderAndExpectTheStandbyToTakeOver("plaintext");
}

// Someone who can write etcd but does not hold the job token points the leader key at a listener
// of the test's: nobody follows it. First while the leader lives (it journals the forgery and puts
// its own value back), then right after the leader was killed, on its lease (the workers and the
// agent look for a leader then): they wait for the standby, and the job ends bitwise.
TEST_F(EtcdFailoverTest, AForgedLeaderKeyIsFollowedByNobodyAndTheLeaderJournalsIt) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  CountingListener impostor;
  auto client = etcd::Client::Create(endpoint_, {milliseconds(2'000)});
  ASSERT_TRUE(client.ok());
  auto forge = [&] {
    auto kvs = (*client)->Range(coord::LeaderKey("j"));
    ASSERT_TRUE(kvs.ok() && !kvs->empty());
    nlohmann::json forged = {{"controller", impostor.address()},
                             {"epoch", (*kvs)[0].create_revision},
                             {"pid", 1},
                             {"sig", crypto::Base64Encode(std::string(64, '\0'))}};
    ASSERT_TRUE((*client)->Put(coord::LeaderKey("j"), forged.dump(), (*kvs)[0].lease).ok());
  };
  ASSERT_NO_FATAL_FAILURE(forge());
  ASSERT_TRUE(
      nonstop::testing::WaitForEvents(JournalOf("a"), "leader_key_forged", 1, milliseconds(10'000)))
      << Outputs();
  auto record = Events(JournalOf("a"), "leader_key_forged")[0];
  EXPECT_TRUE(record["restored"].get<bool>()) << record.dump();
  EXPECT_NE(record["why"].get<std::string>().find("does not verify"), std::string::npos)
      << record.dump();
  EXPECT_NE(record["value"].get<std::string>().find(impostor.address()), std::string::npos);
  auto back = (*client)->Range(coord::LeaderKey("j"));
  ASSERT_TRUE(back.ok() && !back->empty());
  EXPECT_EQ((*back)[0].value.find(impostor.address()), std::string::npos)
      << "the leader did not put its value back: " << (*back)[0].value;
  // The leader dies; the forgery lands before anyone looks (on its lease: gone with it).
  ASSERT_EQ(::kill(a_->pid(), SIGKILL), 0);
  ASSERT_NO_FATAL_FAILURE(forge());
  ASSERT_EQ(b_->Wait(milliseconds(90'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  EXPECT_EQ(impostor.connections(), 0) << "someone followed the forged leader key\n" << Outputs();
  EXPECT_EQ(Events(JournalOf("b"), "takeover").size(), 1u) << Outputs();
  EXPECT_NE(agent_->Output().find("not following the leader key"), std::string::npos) << Outputs();
  EXPECT_NE(b_->Output().find("NOT followed"), std::string::npos) << Outputs();
  EXPECT_EQ(FinishedChecksum(JournalOf("b")), Reference()) << Outputs();
}

// Issue 52's demonstration: someone who can write etcd but holds no job key puts a job_end over
// the newest journal record, and the leader dies. The standby believes none of it: it journals the
// forgery, takes over from the records before it and the members' reports, and the job ends bitwise
// (before the journal was sealed, every standby exited 0 "as the job had ended", and the job died).
TEST_F(EtcdFailoverTest, AForgedJobEndInEtcdsJournalIsAGapTheStandbyTakesOverAndJournals) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  auto client = etcd::Client::Create(endpoint_, {milliseconds(2'000)});
  ASSERT_TRUE(client.ok());
  auto journal = (*client)->Prefix(coord::JobPrefix("j") + "journal/");
  ASSERT_TRUE(journal.ok() && !journal->empty());
  const std::string newest = journal->back().key;
  ASSERT_TRUE((*client)
                  ->Put(newest, R"({"event":"job_end","exit_code":0,"reason":"forged by a )"
                                R"(writer without the job key"})")
                  .ok());
  ASSERT_EQ(::kill(a_->pid(), SIGKILL), 0);
  ASSERT_EQ(b_->Wait(milliseconds(90'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  EXPECT_EQ(b_->Output().find("the job already ended"), std::string::npos) << Outputs();
  auto forged = Events(JournalOf("b"), "etcd_value_forged");
  ASSERT_EQ(forged.size(), 1u) << Outputs();
  EXPECT_EQ(forged[0]["key"], newest);
  EXPECT_NE(forged[0]["why"].get<std::string>().find("not sealed with the job key"),
            std::string::npos)
      << forged[0].dump();
  EXPECT_EQ(Events(JournalOf("b"), "takeover").size(), 1u) << Outputs();
  EXPECT_EQ(FinishedChecksum(JournalOf("b")), Reference()) << Outputs();
}

TEST_F(EtcdFailoverTest,
       LeaderAndThenAWorkerKilledBeforeTheStandbyLeadsTheNewLeaderRunsTheRecovery) {
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
  EXPECT_GE(Events(journal, "recovery_start").size(), 1u) << "the new leader did not recover\n"
                                                          << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference())
      << "not bitwise equal to the run without a fault\n"
      << Outputs();
  auto ends = Events(journal, "recovery_end");
  if (!ends.empty()) {
    std::printf(
        "[ measured ] leader killed, a worker 200 ms later: takeover %.0f ms after the leader's "
        "kill, the "
        "recovery ended %.0f ms after it, resuming at step %lld, lost steps %lld\n",
        TakeoverMs(killed_us), (ends[0]["time_us"].get<int64_t>() - killed_us) / 1000.0,
        static_cast<long long>(ends[0]["recovery"].value("resume_step", int64_t{-1})),
        static_cast<long long>(ends[0]["recovery"].value("lost_steps", int64_t{-1})));
  }
}

TEST_F(EtcdFailoverTest, APausedLeaderThatWakesAfterTheTakeoverStepsDownAndIsNotFollowed) {
  ASSERT_NO_FATAL_FAILURE(StartJob());
  ASSERT_TRUE(nonstop::testing::StopProcess(a_->pid()));
  int64_t stopped_us = NowWallMicros();
  ASSERT_TRUE(nonstop::testing::WaitForEvents(JournalOf("b"), "takeover", 1, milliseconds(30'000)))
      << Outputs();
  // b leads and the workers follow it: then a wakes up.
  ASSERT_TRUE(nonstop::testing::WaitForEvents(JournalOf("b"), "rejoin", 4, milliseconds(30'000)))
      << Outputs();
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
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the takeover cost a recovery\n"
                                                         << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference()) << Outputs();
  std::printf(
      "[ measured ] leader paused: standby's takeover %.0f ms after the SIGSTOP, all rejoined %.0f "
      "ms; the old "
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
  EXPECT_TRUE(Events(JournalOf("a"), "job_end").empty())
      << "SIGTERM ended the job instead of handing it over";
  std::string journal = JournalOf("b");
  ASSERT_EQ(Events(journal, "takeover").size(), 1u) << Outputs();
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference()) << Outputs();
  std::printf(
      "[ measured ] leader SIGTERMed: standby's takeover %.0f ms after the signal, all rejoined "
      "%.0f ms\n",
      TakeoverMs(term_us), AllRejoinedMs(term_us));
}

TEST_F(EtcdFailoverTest, AStandbyWithoutTheJobTokenRefusesToTakeOverInsteadOfLockingEveryoneOut) {
  a_ = StartController("a");
  ASSERT_TRUE(WaitForOutput(*a_, "  journal ", milliseconds(20'000))) << a_->Output();
  b_ = std::make_unique<ChildProcess>(
      std::vector<std::string>{kBin + "/nonstop", "controller", "--etcd", etcd_->endpoint(),
                               "--job", "j", "--nnodes", "1", "--job-token-file",
                               dir_ / "elsewhere/token", "--journal", JournalOf("b")},
      dir_ / "b.out");
  ASSERT_TRUE(WaitForOutput(*b_, "standing by", milliseconds(20'000))) << b_->Output();
  ASSERT_EQ(::kill(a_->pid(), SIGKILL), 0);
  EXPECT_EQ(b_->Wait(milliseconds(20'000)), 1) << b_->Output();
  EXPECT_NE(b_->Output().find("token file"), std::string::npos) << b_->Output();
}

// etcd SIGSTOPped for three leases (the whole coordination service gone: its
// members partitioned, its disk stalled): the leader deposes itself, no
// controller process exits, and once etcd answers again one of them leads and
// the job goes on to its end, bitwise, without a recovery.
TEST_F(EtcdFailoverTest,
       AnEtcdPausePastTheLeaseDeposesTheLeaderButNoControllerExitsAndTheJobGoesOn) {
  step_sleep_ms_ = std::max(50, 12 * LeaseTtlS());  // 300 steps: more than the outage (3 leases)
  ASSERT_NO_FATAL_FAILURE(StartJob(40));
  const milliseconds outage(3 * 1000 * LeaseTtlS());
  int64_t step_at_pause = Events(JournalOf("a"), "step").back()["step"].get<int64_t>();
  ASSERT_TRUE(nonstop::testing::StopProcess(etcd_->pid()));
  int64_t stopped_us = NowWallMicros();
  bool deposed = false;
  for (auto until = std::chrono::steady_clock::now() + outage;
       std::chrono::steady_clock::now() < until;) {
    ExpectBothControllersRun("while etcd was paused");
    if (HasFailure()) break;
    deposed = deposed || !Events(JournalOf("a"), "deposed").empty();
    std::this_thread::sleep_for(milliseconds(100));
  }
  std::string reason;
  if (auto d = Events(JournalOf("a"), "deposed"); !d.empty()) reason = d[0].value("reason", "");
  ASSERT_EQ(::kill(etcd_->pid(), SIGCONT), 0);
  int64_t resumed_us = NowWallMicros();
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(deposed) << "the leader did not depose itself, cut off past its lease\n" << Outputs();

  // One of them leads again: a takeover in a's new journal or in b's.
  for (auto until = std::chrono::steady_clock::now() + milliseconds(60'000);
       FirstTakeoverMs(resumed_us) < 0 && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  double back_ms = FirstTakeoverMs(resumed_us);
  ASSERT_GE(back_ms, 0) << "nobody leads after etcd came back\n" << Outputs();
  ExpectBothControllersRun("after etcd came back");
  EXPECT_EQ(agent_->Wait(milliseconds(120'000)), 0) << Outputs();
  EXPECT_EQ(a_->Wait(milliseconds(30'000)), 0) << Outputs();
  EXPECT_EQ(b_->Wait(milliseconds(30'000)), 0) << Outputs();
  std::string journal = FinalJournal();
  ASSERT_FALSE(journal.empty()) << "no journal holds the job's end\n" << Outputs();
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "the outage cost a recovery\n"
                                                         << Outputs();
  EXPECT_TRUE(Events(journal, "fault").empty()) << Outputs();
  int64_t state_at_rejoin = INT64_MAX;
  for (const auto& r : Events(journal, "rejoin")) {
    if (r.value("role", "") != "spare")
      state_at_rejoin = std::min(state_at_rejoin, r["state_step"].get<int64_t>());
  }
  EXPECT_GE(state_at_rejoin, step_at_pause) << "a step was lost\n" << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference())
      << "not bitwise equal to the run without the outage\n"
      << Outputs();
  std::printf(
      "[ measured ] etcd paused %lld ms at step %lld: the leader deposed itself (%s); %s led again "
      "%.0f ms "
      "after etcd resumed (%.0f ms after the pause began); members' state at their rejoin: step "
      "%lld; no "
      "controller exited\n",
      static_cast<long long>(outage.count()), static_cast<long long>(step_at_pause), reason.c_str(),
      journal == JournalOf("a") ? "a (the old leader)" : "b (the standby)", back_ms,
      back_ms + (resumed_us - stopped_us) / 1000.0, static_cast<long long>(state_at_rejoin));
}

// Fencing under a pause (docs/controller-failover.md): a worker dies while etcd is paused, so the
// leader's orders for the recovery wait for its journal to reach etcd; then the leader is paused
// past its lease, etcd resumes and the standby takes over. The workers and the agent wait 8 s for
// a silent controller: when the old leader wakes they are still connected to it. It must act on
// none of its queued orders (its journal lists them as dropped): the standby runs the recovery.
TEST_F(EtcdFailoverTest, ALeaderPausedPastItsLeaseWithOrdersQueuedActsOnNoneOfThemWhenItWakes) {
  ASSERT_NO_FATAL_FAILURE(StartJob(30, /*controller_timeout_ms=*/8'000));
  pid_t victim = 0;
  for (const auto& j : Events(JournalOf("a"), "join")) {
    if (!j.value("spare", false)) victim = j["pid"].get<pid_t>();
  }
  ASSERT_GT(victim, 0);
  ASSERT_TRUE(nonstop::testing::StopProcess(etcd_->pid()));
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  // a decided the recovery (its local journal says so) and holds the orders back: etcd has not
  // taken the records that describe them.
  ASSERT_TRUE(
      nonstop::testing::WaitForEvents(JournalOf("a"), "recovery_start", 1, milliseconds(10'000)))
      << Outputs();
  std::this_thread::sleep_for(milliseconds(200));
  ASSERT_TRUE(nonstop::testing::StopProcess(a_->pid()));
  ASSERT_EQ(::kill(etcd_->pid(), SIGCONT), 0);
  ASSERT_TRUE(nonstop::testing::WaitForEvents(JournalOf("b"), "takeover", 1, milliseconds(30'000)))
      << Outputs();
  ASSERT_EQ(::kill(a_->pid(), SIGCONT), 0);

  ASSERT_EQ(b_->Wait(milliseconds(120'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  EXPECT_EQ(a_->Wait(milliseconds(20'000)), 0) << Outputs();
  auto deposed = Events(JournalOf("a"), "deposed");
  ASSERT_EQ(deposed.size(), 1u) << Outputs();
  ASSERT_TRUE(deposed[0]["dropped_orders"].is_array()) << deposed[0].dump();
  const auto& dropped = deposed[0]["dropped_orders"];
  EXPECT_GT(deposed[0]["orders_not_sent"].get<int>(), 0) << deposed[0].dump();
  // the recovery's orders: the survivors' aborts, the refill's spawn (printed lines are no orders)
  bool recovery_order = false;
  for (const auto& d : dropped) {
    const std::string kind = d.value("order", "");
    recovery_order = recovery_order || kind == "abort" || kind == "spawn" || kind == "plan";
  }
  EXPECT_TRUE(recovery_order) << deposed[0].dump();
  // What a decided after the kill and never sent: it spawned no refill (every worker the agent
  // started is one a journal that etcd holds, b's, asked for) and no plan of its reached a worker
  // (b's recovery formed the next generation from the members b found).
  std::string journal = JournalOf("b");
  size_t started = 0;
  for (size_t at = 0; (at = agent_->Output().find("started worker ", at)) != std::string::npos;
       ++at) {
    ++started;
  }
  EXPECT_EQ(started, Events(journal, "spawn").size())
      << "the agent started a worker that no durable journal asked for\n"
      << Outputs();
  ASSERT_GE(Events(journal, "recovery_start").size(), 1u) << "b did not run the recovery\n"
                                                          << Outputs();
  EXPECT_EQ(Events(journal, "recovery_end").size(), Events(journal, "recovery_start").size())
      << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference()) << Outputs();
  std::printf("[ measured ] the paused leader woke after the takeover and dropped %d orders (%s)\n",
              deposed[0]["orders_not_sent"].get<int>(), dropped.dump().c_str());
}

// etcd on ports and a data directory of its own, so that it can be killed and restarted on them.
class RestartedEtcdFailoverTest : public EtcdFailoverTest {
 protected:
  void SetUp() override {
    ASSERT_FALSE(Reference().empty()) << "the reference run failed";
    own_ = std::make_unique<RestartableEtcd>(dir_.path());
    ASSERT_TRUE(own_->Start()) << "etcd did not start (scripts/setup.sh installs etcd-server)\n"
                               << own_->Output();
    endpoint_ = own_->endpoint();
  }
  // The pid in the leader key once a leader has published its address; 0 if none did within
  // `timeout`.
  pid_t PublishedLeaderPid(milliseconds timeout) {
    auto client = etcd::Client::Create(endpoint_, {milliseconds(500)});
    if (!client.ok()) return 0;
    for (auto until = std::chrono::steady_clock::now() + timeout;
         std::chrono::steady_clock::now() < until;) {
      auto kvs = (*client)->Range(coord::LeaderKey("j"));
      if (kvs.ok() && !kvs->empty()) {
        auto v = nlohmann::json::parse((*kvs)[0].value, nullptr, false);
        if (v.is_object() && v.contains("controller") && v.contains("pid"))
          return v["pid"].get<pid_t>();
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    return 0;
  }
  std::unique_ptr<RestartableEtcd> own_;
};

// etcd killed and restarted on its data while the standby waits: the standby
// stays up through it, and when the leader then dies, it leads (or, if the
// old leader's lease ran out meanwhile, the other way round).
TEST_F(RestartedEtcdFailoverTest, AStandbyRidesOutAnEtcdRestartAndLeadsWhenTheLeaderDies) {
  step_sleep_ms_ = std::max(50, 12 * LeaseTtlS());
  ASSERT_NO_FATAL_FAILURE(StartJob(40));
  own_->Kill();
  for (auto until = std::chrono::steady_clock::now() + milliseconds(1000 * LeaseTtlS());
       std::chrono::steady_clock::now() < until;) {
    ExpectBothControllersRun("while etcd was down");
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_FALSE(HasFailure());
  ASSERT_TRUE(own_->Start()) << own_->Output();  // on its data: the job's keys and leases are back
  int64_t restarted_us = NowWallMicros();
  pid_t leader = PublishedLeaderPid(milliseconds(60'000));
  ASSERT_TRUE(leader == a_->pid() || leader == b_->pid()) << "leader pid " << leader << "\n"
                                                          << Outputs();
  double led_after_restart_ms = (NowWallMicros() - restarted_us) / 1000.0;
  ExpectBothControllersRun("after etcd's restart");
  ChildProcess& victim = leader == a_->pid() ? *a_ : *b_;
  ChildProcess& survivor = leader == a_->pid() ? *b_ : *a_;
  const std::string survivor_name = leader == a_->pid() ? "b" : "a";
  int64_t killed_us = NowWallMicros();
  ASSERT_EQ(::kill(leader, SIGKILL), 0);
  EXPECT_EQ(victim.Wait(milliseconds(5'000)), 128 + SIGKILL);

  EXPECT_EQ(survivor.Wait(milliseconds(120'000)), 0) << Outputs();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << Outputs();
  std::string journal = JournalOf(survivor_name);
  int64_t takeover_us = 0;
  for (const auto& t : Events(journal, "takeover")) {
    if (t["time_us"].get<int64_t>() > killed_us) takeover_us = t["time_us"].get<int64_t>();
  }
  ASSERT_GT(takeover_us, 0) << "the survivor did not take over after the kill\n" << Outputs();
  EXPECT_FALSE(Events(journal, "job_end").empty()) << Outputs();
  EXPECT_TRUE(Events(journal, "recovery_start").empty()) << "a recovery\n" << Outputs();
  EXPECT_EQ(FinishedChecksum(journal), Reference())
      << "not bitwise equal to the run without the faults\n"
      << Outputs();
  std::printf(
      "[ measured ] etcd killed for %d s and restarted on its data: a leader had published %.0f ms "
      "after the "
      "restart; the leader (%s) killed, %s took over %.0f ms later (lease %d s); no controller "
      "exited for "
      "etcd\n",
      LeaseTtlS(), led_after_restart_ms, survivor_name == "b" ? "a" : "b", survivor_name.c_str(),
      (takeover_us - killed_us) / 1000.0, LeaseTtlS());
}

// etcd over TLS with client-certificate authentication (certificates made here with openssl):
// every controller and the agent give --etcd-cacert, --etcd-cert and --etcd-key, the endpoint is
// https://. The failover runs as over plain http; the [ measured ] lines of the two compare them.
class TlsEtcdFailoverTest : public EtcdFailoverTest {
 protected:
  void SetUp() override {
    ASSERT_FALSE(Reference().empty()) << "the reference run failed";
    ASSERT_TRUE(nonstop::testing::MakeTestCerts(dir_.path(), &certs_)) << "openssl failed";
    own_ = std::make_unique<RestartableEtcd>(
        dir_.path(), std::vector<std::string>{},
        nonstop::testing::EtcdTlsFiles{certs_.ca, certs_.server_cert, certs_.server_key,
                                       certs_.client_cert, certs_.client_key});
    ASSERT_TRUE(own_->Start()) << "etcd did not start over TLS\n" << own_->Output();
    endpoint_ = own_->endpoint();
    etcd_flags_ = {"--etcd-cacert",    certs_.ca,    "--etcd-cert",
                   certs_.client_cert, "--etcd-key", certs_.client_key};
  }
  // A controller of the TLS etcd with these TLS flags instead: its exit code within 20 s.
  int ControllerWith(const std::vector<std::string>& flags, const std::string& name) {
    std::vector<std::string> argv = {
        kBin + "/nonstop",  "controller",   "--etcd",    endpoint_,      "--nnodes", "1",
        "--job-token-file", dir_ / "token", "--journal", JournalOf(name)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    a_ = std::make_unique<ChildProcess>(argv, dir_ / (name + ".out"));
    return a_->Wait(milliseconds(20'000));
  }
  nonstop::testing::TestCerts certs_;
  std::unique_ptr<RestartableEtcd> own_;
};

TEST_F(TlsEtcdFailoverTest, KilledLeaderIsReplacedByTheStandbyOverTlsWithClientCertificates) {
  KillTheLeaderAndExpectTheStandbyToTakeOver("TLS + client certificates");
}

TEST_F(TlsEtcdFailoverTest, AWrongCaAnExpiredCertificateOrAMissingKeyIsAClearErrorNamingTheFile) {
  const std::string missing_key = dir_ / "no-such.key";
  struct Case {
    std::vector<std::string> flags;
    std::string file;  // the file the error must name
    std::string what;
  };
  int n = 0;
  for (const Case& c : std::vector<Case>{{{"--etcd-cacert", certs_.other_ca, "--etcd-cert",
                                           certs_.client_cert, "--etcd-key", certs_.client_key},
                                          certs_.other_ca,
                                          "does not verify"},
                                         {{"--etcd-cacert", certs_.ca, "--etcd-cert",
                                           certs_.expired_cert, "--etcd-key", certs_.client_key},
                                          certs_.expired_cert,
                                          "expired"},
                                         {{"--etcd-cacert", certs_.ca, "--etcd-cert",
                                           certs_.client_cert, "--etcd-key", missing_key},
                                          missing_key,
                                          "cannot read it"}}) {
    const std::string name = "bad" + std::to_string(++n);
    int code = ControllerWith(c.flags, name);
    EXPECT_NE(code, -1) << "still running with " << c.file << "\n" << a_->Output();
    EXPECT_NE(code, 0) << a_->Output();
    ::kill(a_->pid(), SIGKILL);
    EXPECT_NE(a_->Output().find(c.file), std::string::npos) << c.file << " in:\n" << a_->Output();
    EXPECT_NE(a_->Output().find(c.what), std::string::npos) << c.what << " in:\n" << a_->Output();
  }
}

// No etcd at the start (it is late, or being restarted): the controller says
// so once, naming the endpoint, waits, and leads once etcd answers.
TEST(EtcdControllerTest, AnEtcdThatIsNotThereAtTheStartIsWaitedForAndLeadsOnceItAnswers) {
  TempDir dir;
  RestartableEtcd etcd(dir.path());  // not started: nobody listens on its port yet
  ChildProcess c(
      {kBin + "/nonstop", "controller", "--etcd", etcd.endpoint(), "--nnodes", "1",
       "--job-token-file", dir / "token", "--journal", dir / "journal.jsonl", "--lease-ttl-s", "2"},
      dir / "out.txt");
  EXPECT_TRUE(WaitForOutput(c, "one line per outage", milliseconds(20'000))) << c.Output();
  std::this_thread::sleep_for(milliseconds(1'500));
  ASSERT_EQ(c.Wait(milliseconds(1)), -1) << "the controller exited without etcd\n" << c.Output();
  std::string before = c.Output();
  EXPECT_NE(before.find(etcd.endpoint()), std::string::npos) << before;
  EXPECT_NE(before.find("campaign"), std::string::npos) << before;
  EXPECT_EQ(before.find("one line per outage"), before.rfind("one line per outage"))
      << "one line per outage:\n"
      << before;
  ASSERT_TRUE(etcd.Start()) << etcd.Output();
  EXPECT_TRUE(WaitForOutput(c, "leading job", milliseconds(20'000))) << c.Output();
  EXPECT_TRUE(WaitForOutput(c, "etcd answers again", milliseconds(5'000))) << c.Output();
  EXPECT_EQ(c.Wait(milliseconds(1)), -1) << c.Output();
  ASSERT_EQ(::kill(c.pid(), SIGTERM), 0);  // with etcd: hand the job over (to nobody) and leave
  EXPECT_EQ(c.Wait(milliseconds(20'000)), 130) << c.Output();
}

// Something that answers but is not etcd's v3 gateway: final, not retried; the
// error names the key and what to check.
TEST(EtcdControllerTest, AServiceThatIsNotEtcdIsAFinalErrorNamingTheKeyAndTheFix) {
  TempDir dir;
  httplib::Server not_etcd;
  not_etcd.Post(".*", [](const httplib::Request&, httplib::Response& res) {
    res.status = 404;
    res.set_content("404 page not found", "text/plain");
  });
  int port = not_etcd.bind_to_any_port("127.0.0.1");
  std::thread serve([&] { not_etcd.listen_after_bind(); });
  std::string endpoint = fmt::format("127.0.0.1:{}", port);
  ChildProcess c({kBin + "/nonstop", "controller", "--etcd", endpoint, "--nnodes", "1",
                  "--job-token-file", dir / "token", "--journal", dir / "journal.jsonl"},
                 dir / "out.txt");
  EXPECT_EQ(c.Wait(milliseconds(20'000)), 1) << c.Output();
  not_etcd.stop();
  serve.join();
  for (const std::string& part :
       {endpoint, std::string("/nonstop/default/leader"), std::string("HINT")}) {
    EXPECT_NE(c.Output().find(part), std::string::npos) << part << " in:\n" << c.Output();
  }
}

}  // namespace
}  // namespace nonstop
