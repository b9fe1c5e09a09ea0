// The leadership through a real etcd (Debian's etcd-server) that stops
// answering: SIGSTOPped for less than the lease, for more, or before a
// standby campaigns. Nothing here may end in a final error: every failure is
// transient, retried, and at worst costs the lead.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"

namespace nonstop::coord {
namespace {

using std::chrono::milliseconds;

class LeadershipOutageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<nonstop::testing::EtcdServer>(dir_.path());
    ASSERT_FALSE(server_->endpoint().empty())
        << "etcd did not start (scripts/setup.sh installs etcd-server)\n"
        << server_->Output();
  }
  void TearDown() override {
    if (server_ && server_->pid() > 0) ::kill(server_->pid(), SIGCONT);
  }
  std::unique_ptr<Leadership> Connect(int ttl_seconds) {
    LeadershipOptions o;
    o.endpoints = server_->endpoint();
    o.job = "t";
    o.ttl_seconds = ttl_seconds;
    // shorter than the pauses: the reads are retried, not waited out
    o.journal_timeout = milliseconds(300);
    o.request_timeout = milliseconds(300);
    auto l = Leadership::Connect(o);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return l.ok() ? std::move(*l) : nullptr;
  }
  // Stops etcd now (returning once it is stopped) and SIGCONTs it `after` from now, on a thread
  // of its own.
  std::thread PauseEtcd(milliseconds after) {
    EXPECT_TRUE(nonstop::testing::StopProcess(server_->pid())) << "etcd did not stop";
    return std::thread([this, after] {
      std::this_thread::sleep_for(after);
      ::kill(server_->pid(), SIGCONT);
    });
  }
  TempDir dir_;
  std::unique_ptr<nonstop::testing::EtcdServer> server_;
};

TEST_F(LeadershipOutageTest, ThePublishAndTheJournalReadRideOutAPauseShorterThanTheLease) {
  auto l = Connect(4);  // renewed every 1.3 s: at least 2.6 s of the lease are left when etcd stops
  ASSERT_TRUE(l);
  ASSERT_TRUE(l->Campaign([] { return false; }, [](const std::string&) {}).ok());
  std::thread resume = PauseEtcd(milliseconds(1'500));
  auto t0 = std::chrono::steady_clock::now();
  auto records = l->ReadJournal(crypto::JobKey("outage test"));
  resume.join();
  ASSERT_TRUE(records.ok()) << records.status().ToString();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, milliseconds(1'000))
      << "the read did not wait for etcd";
  ASSERT_TRUE(l->Publish({{"controller", "127.0.0.1:1"}}, crypto::JobKey("t")).ok());
  EXPECT_FALSE(l->deposed()) << l->why_not_leading();
  for (int i = 0; i < 100 && !l->Valid(); ++i) std::this_thread::sleep_for(milliseconds(20));
  EXPECT_TRUE(l->Valid()) << "the lease was renewed after the pause: " << l->why_not_leading();
}

TEST_F(LeadershipOutageTest, AReadCutOffPastTheLeaseEndsDeposedNotFinalAndTheNextCampaignWins) {
  auto l = Connect(1);
  ASSERT_TRUE(l);
  ASSERT_TRUE(l->Campaign([] { return false; }, [](const std::string&) {}).ok());
  // past 1.8 TTL: the keep-alive gives the lead up
  std::thread resume = PauseEtcd(milliseconds(3'500));
  auto records = l->ReadJournal(crypto::JobKey("outage test"));
  ASSERT_FALSE(records.ok());
  EXPECT_TRUE(l->deposed());
  EXPECT_TRUE(etcd::IsTransient(records.status())) << records.status().ToString();
  EXPECT_NE(records.status().message().find("lost the lead"), std::string::npos)
      << records.status().message();
  EXPECT_TRUE(l->final_error().ok()) << l->final_error().ToString();
  resume.join();
  l.reset();  // gives the lease back if etcd still holds it
  auto next = Connect(1);
  ASSERT_TRUE(next);
  auto epoch = next->Campaign([] { return false; }, [](const std::string&) {});
  ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
  EXPECT_TRUE(next->ReadJournal(crypto::JobKey("outage test")).ok());
}

TEST_F(LeadershipOutageTest, AStandbyCampaignsThroughAPauseAndLeadsWhenEtcdAnswers) {
  auto l = Connect(2);
  ASSERT_TRUE(l);
  std::thread resume = PauseEtcd(milliseconds(1'500));
  auto t0 = std::chrono::steady_clock::now();
  auto epoch = l->Campaign([] { return false; }, [](const std::string&) {});
  auto waited = std::chrono::steady_clock::now() - t0;
  resume.join();
  ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
  EXPECT_GE(waited, milliseconds(1'000));
  EXPECT_LT(waited, milliseconds(6'000))
      << "the campaign did not lead soon after etcd answered again";
}

TEST_F(LeadershipOutageTest, AStandbyToldToStopDuringAnOutageStopsPromptly) {
  auto l = Connect(2);
  ASSERT_TRUE(l);
  std::thread resume = PauseEtcd(milliseconds(3'000));
  auto t0 = std::chrono::steady_clock::now();
  auto epoch =
      l->Campaign([&] { return std::chrono::steady_clock::now() - t0 > milliseconds(500); },
                  [](const std::string&) {});
  auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(epoch.ok());
  EXPECT_EQ(epoch.status().code(), StatusCode::kCancelled) << epoch.status().ToString();
  EXPECT_LT(waited, milliseconds(1'500));
  resume.join();
}

// The gateway ends its error answers with HTTP trailers, which cpp-httplib 0.11 cannot read: the
// answers must be read and classed all the same, not taken for an unreachable etcd.
TEST_F(LeadershipOutageTest, TheRealGatewaysErrorAnswersAreReadAndClassed) {
  auto client = etcd::Client::Create(server_->endpoint());
  ASSERT_TRUE(client.ok());
  Status gone = (*client)->LeaseRevoke(12345);
  EXPECT_EQ(gone.code(), StatusCode::kNotFound) << gone.ToString();
  EXPECT_NE(gone.message().find("requested lease not found"), std::string::npos) << gone.message();
  std::vector<etcd::Op> ops;
  for (int i = 0; i < 200; ++i) ops.push_back(etcd::Op::Put("/k" + std::to_string(i), "v"));
  auto too_many = (*client)->Txn({}, ops);  // over etcd's --max-txn-ops (128)
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), StatusCode::kInvalidArgument) << too_many.status().ToString();
  EXPECT_FALSE(etcd::IsTransient(too_many.status()));
  EXPECT_NE(too_many.status().message().find("too many operations"), std::string::npos);
  EXPECT_TRUE((*client)->Range("/k1").ok())
      << "the client goes on after an answer it could not read to its end";
}

// A controller that stands by again passes its previous term's lease (etcd may still hold it, or
// have let it go): the campaign gives it back and leads at once, without waiting it out.
TEST_F(LeadershipOutageTest, ThePreviousTermsLeaseIsGivenBackWhetherEtcdStillHoldsItOrNot) {
  for (bool expired : {false, true}) {
    // The previous term's key on its lease, which nobody renews (etcd was away when it stood down).
    auto client = etcd::Client::Create(server_->endpoint());
    ASSERT_TRUE(client.ok());
    auto lease = (*client)->LeaseGrant(expired ? 1 : 10);
    ASSERT_TRUE(lease.ok()) << lease.status().ToString();
    ASSERT_TRUE((*client)->Put(LeaderKey("t"), R"({"pid":1})", lease->first).ok());
    int64_t previous = lease->first;
    if (expired) std::this_thread::sleep_for(milliseconds(2'500));
    LeadershipOptions o;
    o.endpoints = server_->endpoint();
    o.job = "t";
    o.ttl_seconds = 10;
    o.previous_lease = previous;
    auto next = Leadership::Connect(o);
    ASSERT_TRUE(next.ok());
    auto t0 = std::chrono::steady_clock::now();
    auto epoch = (*next)->Campaign([] { return false; }, [](const std::string&) {});
    ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(1'000)) << "expired " << expired;
    (*next)->Resign();
  }
}

}  // namespace
}  // namespace nonstop::coord
