// The etcd client (src/coord/etcd.cc) against a real etcd: what the
// controller's election and its replicated journal rely on.
#include "coord/etcd.h"
#include "coord/leadership.h"

#include <gtest/gtest.h>

#include <thread>

#include "tests/integration/etcd_server.h"

namespace nonstop::etcd {
namespace {

const crypto::Key kJobKey = crypto::JobKey("journal test token");

TEST(Base64Test, RoundTripsEveryLengthAndByte) {
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  for (size_t n = 0; n <= all.size(); n += 1) {
    std::string in = all.substr(0, n);
    auto out = Base64Decode(Base64Encode(in));
    ASSERT_TRUE(out.ok()) << n;
    EXPECT_EQ(*out, in) << n;
  }
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_EQ(Base64Encode("f"), "Zg==");
}

TEST(Base64Test, RejectsTextThatIsNotBase64) {
  EXPECT_FALSE(Base64Decode("Zm9").ok());
  EXPECT_FALSE(Base64Decode("Zm*v").ok());
  EXPECT_FALSE(Base64Decode("Z=9v").ok());
  EXPECT_FALSE(Base64Decode("====").ok());
}

TEST(EtcdEndpointsTest, MalformedEndpointsAreRefusedWithTheirName) {
  for (const char* bad :
       {"", "localhost", "127.0.0.1:x", "127.0.0.1:99999", ":2379", "https://a"}) {
    auto c = Client::Create(bad);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_NE(c.status().message().find("etcd endpoint"), std::string::npos)
        << c.status().message();
  }
  // plain http to another host needs the opt-in (etcd_security_test.cc tests the refusal)
  ClientOptions trusted;
  trusted.security.allow_plaintext = true;
  EXPECT_TRUE(Client::Create("127.0.0.1:2379,http://10.0.0.2:2379/", trusted).ok());
}

TEST(EtcdClientTest, AnUnreachableEtcdIsAnErrorNamingTheEndpoints) {
  int port = nonstop::testing::FreeLoopbackPort();  // nobody listens there
  auto c = Client::Create(fmt::format("127.0.0.1:{}", port), {std::chrono::milliseconds(300)});
  ASSERT_TRUE(c.ok());
  auto r = (*c)->Range("k");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find(fmt::format("127.0.0.1:{}", port)), std::string::npos)
      << r.status().message();
}

class EtcdClientRealTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<nonstop::testing::EtcdServer>(dir_.path());
    ASSERT_FALSE(server_->endpoint().empty())
        << "etcd did not start (scripts/setup.sh installs etcd-server)\n"
        << server_->Output();
    auto c = Client::Create(server_->endpoint());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(*c);
  }
  TempDir dir_;
  std::unique_ptr<nonstop::testing::EtcdServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(EtcdClientRealTest, PutsAndRangesBinaryKeysAndValuesInKeyOrder) {
  std::string binary("v\0\xff\x01", 4);
  ASSERT_TRUE(client_->Put("/job/b", binary).ok());
  ASSERT_TRUE(client_->Put("/job/a", "1").ok());
  ASSERT_TRUE(client_->Put("/joc", "outside").ok());
  int64_t revision = 0;
  auto kvs = client_->Prefix("/job/", &revision);
  ASSERT_TRUE(kvs.ok()) << kvs.status().ToString();
  ASSERT_EQ(kvs->size(), 2u);
  EXPECT_EQ((*kvs)[0].key, "/job/a");
  EXPECT_EQ((*kvs)[1].key, "/job/b");
  EXPECT_EQ((*kvs)[1].value, binary);
  EXPECT_GE(revision, (*kvs)[0].mod_revision);
  auto none = client_->Range("/missing");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

TEST_F(EtcdClientRealTest, ATransactionTakesTheBranchItsComparisonsChoose) {
  // Create-if-absent: the first wins, the second finds the first's value.
  auto first = client_->Txn({Compare::CreateRevision("/leader", 0)}, {Op::Put("/leader", "one")},
                            {Op::Get("/leader")});
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_TRUE(first->succeeded);
  auto second = client_->Txn({Compare::CreateRevision("/leader", 0)}, {Op::Put("/leader", "two")},
                             {Op::Get("/leader")});
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(second->succeeded);
  ASSERT_EQ(second->range.size(), 1u);
  EXPECT_EQ(second->range[0].value, "one");
  EXPECT_EQ(second->range[0].create_revision, first->revision);
  // Guarded writes: with the right create revision they land; with a stale one nothing does.
  auto guarded = client_->Txn({Compare::CreateRevision("/leader", first->revision)},
                              {Op::Put("/log/1", "a"), Op::Put("/log/2", "b")});
  ASSERT_TRUE(guarded.ok());
  EXPECT_TRUE(guarded->succeeded);
  auto stale = client_->Txn({Compare::CreateRevision("/leader", first->revision - 1)},
                            {Op::Put("/log/3", "c")});
  ASSERT_TRUE(stale.ok());
  EXPECT_FALSE(stale->succeeded);
  EXPECT_EQ(client_->Prefix("/log/")->size(), 2u);
  ASSERT_TRUE(client_->Txn({}, {Op::Delete("/log/", PrefixEnd("/log/"))}).ok());
  EXPECT_TRUE(client_->Prefix("/log/")->empty());
}

TEST_F(EtcdClientRealTest, AKeyOnALeaseLivesWhileItIsKeptAliveAndGoesWhenItExpires) {
  auto lease = client_->LeaseGrant(1);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  EXPECT_GE(lease->second, 1);
  ASSERT_TRUE(client_->Put("/held", "x", lease->first).ok());
  for (int i = 0; i < 6; ++i) {  // 1.5 s: past the TTL, kept alive
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    auto ttl = client_->LeaseKeepAlive(lease->first);
    ASSERT_TRUE(ttl.ok()) << ttl.status().ToString();
  }
  auto held = client_->Range("/held");
  ASSERT_TRUE(held.ok());
  ASSERT_EQ(held->size(), 1u);
  EXPECT_EQ((*held)[0].lease, lease->first);
  // Not kept alive: the key goes with the lease, and a renewal is refused.
  bool gone = false;
  for (int i = 0; i < 60 && !gone; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    gone = client_->Range("/held")->empty();
  }
  EXPECT_TRUE(gone);
  auto late = client_->LeaseKeepAlive(lease->first);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), StatusCode::kNotFound);
  // A revoked lease takes its keys at once.
  auto other = client_->LeaseGrant(30);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(client_->Put("/held2", "y", other->first).ok());
  ASSERT_TRUE(client_->LeaseRevoke(other->first).ok());
  EXPECT_TRUE(client_->Range("/held2")->empty());
}

TEST_F(EtcdClientRealTest, TheNextEndpointIsTriedWhenOneIsDown) {
  int dead = nonstop::testing::FreeLoopbackPort();
  auto c = Client::Create(fmt::format("127.0.0.1:{},{}", dead, server_->endpoint()));
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Put("/k", "v").ok());
  EXPECT_EQ((*(*c)->Range("/k"))[0].value, "v");
}

}  // namespace
}  // namespace nonstop::etcd

namespace nonstop::coord {
namespace {

class LeadershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<nonstop::testing::EtcdServer>(dir_.path());
    ASSERT_FALSE(server_->endpoint().empty()) << server_->Output();
  }
  std::unique_ptr<Leadership> Connect() {
    LeadershipOptions o;
    o.endpoints = server_->endpoint();
    o.job = "t";
    o.ttl_seconds = 1;
    auto l = Leadership::Connect(o);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    return l.ok() ? std::move(*l) : nullptr;
  }
  static bool WaitFor(const std::function<bool()>& done) {
    for (int i = 0; i < 500 && !done(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done();
  }
  TempDir dir_;
  std::unique_ptr<nonstop::testing::EtcdServer> server_;
};

TEST_F(LeadershipTest, OneLeadsTheOtherWaitsAndTakesOverTheJournalWhenTheFirstResigns) {
  auto first = Connect();
  auto second = Connect();
  ASSERT_TRUE(first && second);
  auto epoch1 = first->Campaign([] { return false; }, [](const std::string&) {});
  ASSERT_TRUE(epoch1.ok()) << epoch1.status().ToString();
  ASSERT_TRUE(first->ReadJournal(etcd::kJobKey)->records.empty());
  ASSERT_TRUE(first->Publish({{"controller", "127.0.0.1:1"}}, crypto::JobKey("t")).ok());
  auto client = etcd::Client::Create(server_->endpoint());
  EXPECT_EQ(*LookUpLeader(**client, "t"), "127.0.0.1:1");

  first->Append({{"event", "job_start"}});
  first->Append({{"event", "step"}, {"step", 1}});
  first->Append({{"event", "plan"}, {"generation", 1}});
  first->Append({{"event", "step"}, {"step", 2}});
  EXPECT_EQ(first->appended(), 2u) << "steps are not journal entries in etcd";
  first->Flush();
  ASSERT_TRUE(WaitFor([&] { return first->durable() == 2; }));
  EXPECT_TRUE(first->Valid());

  std::atomic<bool> waiting{false};
  std::thread resign([&] {
    while (!waiting) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    first->Resign();
  });
  auto epoch2 = second->Campaign([] { return false; },
                                 [&](const std::string& leader) {
                                   EXPECT_NE(leader.find("127.0.0.1:1"), std::string::npos)
                                       << leader;
                                   waiting = true;
                                 });
  resign.join();
  ASSERT_TRUE(epoch2.ok());
  EXPECT_GT(*epoch2, *epoch1);
  EXPECT_FALSE(first->Valid());
  auto records = second->ReadJournal(etcd::kJobKey);
  ASSERT_TRUE(records.ok()) << records.status().ToString();
  ASSERT_EQ(records->records.size(), 3u);
  EXPECT_EQ(records->records[0]["event"], "job_start");
  EXPECT_EQ(records->records[1]["event"], "plan");
  EXPECT_EQ(records->records[2]["step"], 2) << "the latest step comes last";
  // The second's records go on from the first's.
  second->Append({{"event", "job_end"}, {"exit_code", 0}, {"reason", "done"}});
  EXPECT_EQ(second->appended(), 3u);
  second->Flush();
  ASSERT_TRUE(WaitFor([&] { return second->durable() == 3; }));
  second->Resign();
  int code = -1;
  auto ended = LookUpLeader(**client, "t", &code);
  ASSERT_FALSE(ended.ok());
  EXPECT_EQ(ended.status().code(), StatusCode::kAborted) << ended.status().ToString();
  EXPECT_EQ(code, 0);
}

TEST_F(LeadershipTest, ALeaderWhoseKeyIsGoneIsDeposedAndItsWritesNeverLand) {
  auto leader = Connect();
  ASSERT_TRUE(leader);
  ASSERT_TRUE(leader->Campaign([] { return false; }, [](const std::string&) {}).ok());
  ASSERT_TRUE(leader->ReadJournal(etcd::kJobKey).ok());
  // Another controller's view: the key is gone (its lease expired) and someone else holds it now.
  auto client = etcd::Client::Create(server_->endpoint());
  ASSERT_TRUE((*client)->Txn({}, {etcd::Op::Delete(LeaderKey("t"))}).ok());
  ASSERT_TRUE((*client)->Put(LeaderKey("t"), R"({"controller":"127.0.0.1:2"})").ok());
  leader->Append({{"event", "plan"}, {"generation", 7}});
  leader->Flush();
  ASSERT_TRUE(WaitFor([&] { return leader->deposed(); }));
  EXPECT_FALSE(leader->Valid());
  EXPECT_EQ(leader->durable(), 0u);
  EXPECT_NE(leader->why_not_leading().find("refused"), std::string::npos)
      << leader->why_not_leading();
  EXPECT_TRUE((*client)->Prefix(JobPrefix("t") + "journal/")->empty())
      << "a deposed leader's record landed";
}

TEST_F(LeadershipTest, AStandbyThatIsToldToStopLeavesTheCampaign) {
  auto leader = Connect();
  auto standby = Connect();
  ASSERT_TRUE(leader->Campaign([] { return false; }, [](const std::string&) {}).ok());
  int asked = 0;
  auto r = standby->Campaign([&] { return ++asked > 3; }, [](const std::string&) {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCancelled);
}

}  // namespace
}  // namespace nonstop::coord
