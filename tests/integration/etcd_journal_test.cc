// etcd's copy of the controller's journal stays bounded (src/coord/leadership.h,
// "A bounded journal"): a snapshot and a short tail, records and snapshots
// split below etcd's request limit, read in pages at one revision; and the
// takeover from it equals the takeover from every record. Against a real etcd.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <thread>

#include <fmt/format.h>

#include "controller/takeover.h"
#include "controller/takeover_test_records.h"
#include "coord/etcd.h"
#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"

namespace nonstop::coord {
namespace {

const crypto::Key kJobKey = crypto::JobKey("journal test token");

using nlohmann::json;

TEST(EtcdEndpointsTest, AnIpv6AddressInBracketsIsAnEndpoint) {
  for (const char* good :
       {"[::1]:2379", "http://[::1]:2379", "http://[fd00::2]:2379/", "127.0.0.1:2379,[::1]:2380"}) {
    etcd::ClientOptions trusted;  // fd00::2 is another host: plain http to it needs the opt-in
    trusted.security.allow_plaintext = true;
    auto c = etcd::Client::Create(good, trusted);
    EXPECT_TRUE(c.ok()) << good << ": " << c.status().ToString();
  }
  for (const char* bad : {"[::1]", "[::1]2379", "[::1:2379", "::1:2379", "[]:2379", "[::1]:x"}) {
    auto c = etcd::Client::Create(bad);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_NE(c.status().message().find("etcd endpoint"), std::string::npos)
        << c.status().message();
  }
  EXPECT_NE(etcd::Client::Create("::1:2379").status().message().find("brackets"),
            std::string::npos);
}

TEST(EtcdEndpointsTest, AnEtcdOnIpv6LoopbackAnswers) {
  TempDir dir;
  int port = nonstop::testing::FreeLoopbackPort();
  int peer = nonstop::testing::FreeLoopbackPort();
  const std::string url = fmt::format("http://[::1]:{}", port);
  nonstop::testing::ChildProcess etcd(
      nonstop::testing::EtcdServer::Argv(dir.path() + "/data", url,
                                         fmt::format("http://127.0.0.1:{}", peer)),
      dir.path() + "/etcd.out");
  auto c = etcd::Client::Create(url + "/", {std::chrono::milliseconds(500)});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  Status last;
  for (int i = 0; i < 100; ++i) {
    last = (*c)->Put("/v6", "yes").status();
    if (last.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(last.ok()) << last.ToString() << "\n" << etcd.Output();
  auto kvs = (*c)->Range("/v6");
  ASSERT_TRUE(kvs.ok() && kvs->size() == 1) << kvs.status().ToString();
  EXPECT_EQ((*kvs)[0].value, "yes");
  // The endpoint's name in errors keeps its brackets.
  auto off = etcd::Client::Create(fmt::format("[::1]:{}", nonstop::testing::FreeLoopbackPort()),
                                  {std::chrono::milliseconds(300)});
  ASSERT_TRUE(off.ok());
  auto r = (*off)->Range("k");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("[::1]:"), std::string::npos) << r.status().message();
}

class EtcdJournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<nonstop::testing::EtcdServer>(dir_.path());
    ASSERT_FALSE(server_->endpoint().empty()) << server_->Output();
    auto c = etcd::Client::Create(server_->endpoint());
    ASSERT_TRUE(c.ok());
    client_ = std::move(*c);
  }
  std::unique_ptr<Leadership> Lead(LeadershipOptions o = {}) {
    o.endpoints = server_->endpoint();
    o.job = "t";
    o.ttl_seconds = 2;
    auto l = Leadership::Connect(o);
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    if (!l.ok()) return nullptr;
    auto epoch = (*l)->Campaign([] { return false; }, [](const std::string&) {});
    EXPECT_TRUE(epoch.ok()) << epoch.status().ToString();
    return std::move(*l);
  }
  static bool WaitFor(const std::function<bool()>& done) {
    for (int i = 0; i < 1000 && !done(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done();
  }
  // Appends, in batches as the runtime's loop turns would, and waits until etcd holds them.
  static void AppendAll(Leadership& l, const std::vector<json>& records) {
    for (size_t i = 0; i < records.size(); ++i) {
      l.Append(records[i]);
      if (i % 40 == 39 || i + 1 == records.size()) l.Flush();
    }
    ASSERT_TRUE(WaitFor([&] { return l.durable() == l.appended() || l.deposed(); }));
    ASSERT_FALSE(l.deposed()) << l.why_not_leading();
  }
  // Bytes (keys and values) etcd holds under the job's prefix.
  size_t BytesInEtcd(bool content_only = false) {
    auto kvs = client_->Prefix(JobPrefix("t"));
    EXPECT_TRUE(kvs.ok()) << kvs.status().ToString();
    size_t n = 0;
    for (const auto& kv : kvs.ok() ? *kvs : std::vector<etcd::KeyValue>{}) {
      size_t seal = 0;  // the seal's header line (sealed_value.h), with content_only
      if (content_only && kv.value.rfind("nonstop-sealed ", 0) == 0) seal = kv.value.find('\n') + 1;
      n += kv.key.size() + kv.value.size() - seal;
    }
    return n;
  }
  size_t KeysUnder(const std::string& what) {
    return client_->Prefix(JobPrefix("t") + what)->size();
  }
  TempDir dir_;
  std::unique_ptr<nonstop::testing::EtcdServer> server_;
  std::unique_ptr<etcd::Client> client_;
};

TEST_F(EtcdJournalTest, APaginatedReadReturnsEveryKeyAsOfOneRevision) {
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(client_->Put(fmt::format("/p/{:02d}", i), "old").ok());
  auto first = client_->RangePage("/p/", etcd::PrefixEnd("/p/"), 4);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->kvs.size(), 4u);
  EXPECT_TRUE(first->more);
  // Changed after the first page: a read at its revision does not see it.
  ASSERT_TRUE(client_->Put("/p/05", "new").ok());
  ASSERT_TRUE(client_->Put("/p/99", "new").ok());
  auto rest = client_->RangePage(first->kvs.back().key + std::string(1, '\0'),
                                 etcd::PrefixEnd("/p/"), 0, first->revision);
  ASSERT_TRUE(rest.ok()) << rest.status().ToString();
  ASSERT_EQ(rest->kvs.size(), 6u);
  EXPECT_FALSE(rest->more);
  for (const auto& kv : rest->kvs) EXPECT_EQ(kv.value, "old") << kv.key;
  int64_t revision = 0;
  auto all = client_->RangeAll("/p/", etcd::PrefixEnd("/p/"), 3, &revision);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->size(), 11u);
  for (size_t i = 1; i < all->size(); ++i) EXPECT_LT((*all)[i - 1].key, (*all)[i].key);
  EXPECT_EQ((*all)[5].value, "new");
  EXPECT_GT(revision, first->revision);
}

TEST_F(EtcdJournalTest, TheJournalStaysBoundedAndTheTakeoverFromItEqualsTheOneFromEveryRecord) {
  controller::testing::JournalMaker maker(8, 3);
  for (int i = 0; i < 150; ++i) maker.Recovery();
  std::vector<json> mirrored;  // what the runtime hands to etcd
  size_t all_bytes = 0, largest = 0;
  for (const auto& r : maker.records()) {
    all_bytes += r.dump().size();
    largest = std::max(largest, r.dump().size());
    if (controller::TakeoverReads(r)) mirrored.push_back(r);
  }
  LeadershipOptions o;
  o.compact = controller::CompactJournal;
  o.compact_records = 64;
  auto first = Lead(o);
  ASSERT_TRUE(first);
  ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
  const size_t half = mirrored.size() / 2;
  ASSERT_NO_FATAL_FAILURE(AppendAll(*first, {mirrored.begin(), mirrored.begin() + half}));
  const size_t bytes_half = BytesInEtcd();
  ASSERT_NO_FATAL_FAILURE(AppendAll(*first, {mirrored.begin() + half, mirrored.end()}));
  const size_t bytes_end = BytesInEtcd();
  // A snapshot (a few KiB) and at most one bound's worth of tail plus a batch.
  EXPECT_LT(bytes_end, size_t{64} << 10);
  // The records' content is compacted to under 1/20; each key's seal (its header line, ~100
  // bytes) is a cost per key, which the bound on the keys below holds.
  const size_t content_end = BytesInEtcd(/*content_only=*/true);
  EXPECT_LT(content_end * 20, all_bytes) << "etcd holds " << content_end << " of " << all_bytes;
  // It does not grow with the job: at the end it holds at most what it held at half plus one
  // bound's worth of tail records. (Half may be measured just after a compaction, its tail then
  // empty, or just before one: the writer's batches decide which, run to run. A bound of 2 × half
  // failed once in a few runs when half fell just after one: 2,409 bytes then, 23,348 at the end.)
  const size_t tail_bound = (o.compact_records + 100) * (largest + 256);  // + its key and seal
  EXPECT_LT(bytes_end, bytes_half + tail_bound)
      << "it grows with the job (half " << bytes_half << ", a tail's bound " << tail_bound << ")";
  EXPECT_LE(KeysUnder("journal/"), o.compact_records + 100);
  EXPECT_EQ(KeysUnder("snapshot/"), 1u) << "old snapshots are deleted";
  std::printf(
      "[ measured ] %zu records (%zu bytes, %zu mirrored, the largest %zu): %zu bytes in etcd at "
      "half, %zu at the end\n",
      maker.records().size(), all_bytes, mirrored.size(), largest, bytes_half, bytes_end);
  // Its compactions (range deletes, snapshot parts) are its own writes, never a forgery.
  const auto forged = first->TakeRecordForgeries();
  EXPECT_TRUE(forged.empty()) << forged[0].why;

  first->Resign();
  auto second = Lead(o);
  ASSERT_TRUE(second);
  auto read = second->ReadJournal(kJobKey);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->records[0]["event"], "snapshot");
  EXPECT_LT(read->records.size(), o.compact_records + 100);
  auto from_etcd = controller::TakeoverFromJournal(read->records);
  auto from_all = controller::TakeoverFromJournal(maker.records());
  ASSERT_TRUE(from_etcd.ok()) << from_etcd.status().ToString();
  ASSERT_TRUE(from_all.ok()) << from_all.status().ToString();
  const auto &a = from_etcd->state, &b = from_all->state;
  EXPECT_EQ(from_etcd->controller, from_all->controller);
  EXPECT_EQ(a.generation, b.generation);
  EXPECT_EQ(a.members, b.members);
  EXPECT_EQ(a.highest_step, b.highest_step);
  EXPECT_EQ(a.recoveries, b.recoveries);
  EXPECT_EQ(a.takeovers, b.takeovers);
  EXPECT_EQ(a.next_worker_id, b.next_worker_id);
  EXPECT_EQ(a.workers.size(), b.workers.size());
  EXPECT_EQ(a.hosts.size(), b.hosts.size());
  EXPECT_EQ(a.target_world, b.target_world);
  EXPECT_EQ(a.withheld, b.withheld);
  // The second's records go on after the first's, and are compacted in turn.
  // (steps are not journal records in etcd: the latest is its progress key)
  EXPECT_EQ(second->appended(), static_cast<uint64_t>(std::count_if(
                                    mirrored.begin(), mirrored.end(),
                                    [](const json& r) { return r["event"] != "step"; })));
  std::vector<json> more;
  for (int i = 0; i < 100; ++i) more.push_back({{"event", "exit"}, {"worker_id", 100000 + i}});
  ASSERT_NO_FATAL_FAILURE(AppendAll(*second, more));
  EXPECT_LE(KeysUnder("journal/"), o.compact_records + 100);
  const auto forged_later = second->TakeRecordForgeries();
  EXPECT_TRUE(forged_later.empty()) << forged_later[0].why;
  second->Resign();
}

std::string Blob(size_t n) {
  std::string s(n, 'x');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + (i * 7919) % 26);
  return s;
}

TEST_F(EtcdJournalTest, ARecordLargerThanEtcdsRequestLimitRoundTrips) {
  auto first = Lead();
  ASSERT_TRUE(first);
  ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
  const json big = {{"event", "plan"}, {"generation", 1}, {"blob", Blob(size_t{2} << 20)}};
  ASSERT_NO_FATAL_FAILURE(
      AppendAll(*first, {{{"event", "job_start"}}, big, {{"event", "fault"}, {"worker_id", 3}}}));
  EXPECT_EQ(first->durable(), 3u);
  EXPECT_GE(KeysUnder("journal/0000000000000002/"), 4u) << "2 MiB in parts of 512 KiB";
  first->Resign();
  auto second = Lead();
  ASSERT_TRUE(second);
  auto read = second->ReadJournal(kJobKey);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->records.size(), 3u);
  EXPECT_EQ(read->records[1], big);
  EXPECT_EQ(read->records[2]["worker_id"], 3);
  second->Resign();
}

TEST_F(EtcdJournalTest, ASnapshotLargerThanEtcdsRequestLimitRoundTripsAndReplacesTheTail) {
  LeadershipOptions o;
  // A compaction that keeps everything: its snapshot grows past 1.5 MiB.
  o.compact = [](const std::vector<json>& records) -> Result<json> {
    json s = {{"event", "snapshot"}, {"records", json::array()}};
    for (const auto& r : records) {
      if (r["event"] == "snapshot") {
        for (const auto& e : r["records"]) s["records"].push_back(e);
      } else {
        s["records"].push_back(r);
      }
    }
    return s;
  };
  o.compact_records = 2;
  auto first = Lead(o);
  ASSERT_TRUE(first);
  ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
  std::vector<json> records;
  for (int i = 0; i < 4; ++i)
    records.push_back({{"event", "x"}, {"i", i}, {"blob", Blob(500'000)}});
  ASSERT_NO_FATAL_FAILURE(AppendAll(*first, records));
  ASSERT_TRUE(WaitFor([&] { return KeysUnder("journal/") == 0; }))
      << KeysUnder("journal/") << " journal keys left";
  EXPECT_GE(KeysUnder("snapshot/"), 4u) << "a snapshot of 2 MB in parts";
  first->Resign();
  auto second = Lead(o);
  ASSERT_TRUE(second);
  auto read = second->ReadJournal(kJobKey);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->records.size(), 1u);
  ASSERT_EQ(read->records[0]["records"].size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(read->records[0]["records"][i], records[i]);
  EXPECT_EQ(second->appended(), 4u) << "the snapshot covers records 1..4";
  second->Resign();
}

TEST_F(EtcdJournalTest, PartsWithoutTheirHeaderAreLeftOutAndCleanedByTheNextLeader) {
  auto first = Lead();
  ASSERT_TRUE(first);
  ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
  ASSERT_NO_FATAL_FAILURE(AppendAll(*first, {{{"event", "job_start"}}}));
  first->Resign();
  // A leader deposed while it wrote a split record 2: its parts landed, its header did not.
  ASSERT_TRUE(client_->Put(JobPrefix("t") + "journal/0000000000000002/0000", "{\"ev").ok());
  ASSERT_TRUE(client_->Put(JobPrefix("t") + "journal/0000000000000002/0001", "ent\":1}").ok());
  auto second = Lead();
  ASSERT_TRUE(second);
  auto read = second->ReadJournal(kJobKey);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->records.size(), 1u);
  EXPECT_EQ(second->appended(), 1u);
  ASSERT_NO_FATAL_FAILURE(AppendAll(*second, {{{"event", "plan"}, {"generation", 1}}}));
  EXPECT_EQ(KeysUnder("journal/"), 2u) << "the orphaned parts are gone";
  second->Resign();
}

}  // namespace
}  // namespace nonstop::coord

namespace nonstop::coord {
namespace {

// Issue 52: whoever can write etcd but holds no job key cannot make a value a takeover acts on.
// A first leader writes a journal (with `compact`, a snapshot and a tail), a forger with plain
// etcd credentials changes one value, and the next leader reads: the forged value and everything
// after it in the journal are a gap, named in the forgeries; the records before it are read.
class EtcdJournalTrustTest : public EtcdJournalTest {
 protected:
  // The keys and values etcd holds under the job's prefix.
  std::map<std::string, std::string> Values() {
    std::map<std::string, std::string> out;
    auto kvs = client_->Prefix(JobPrefix("t"));
    EXPECT_TRUE(kvs.ok()) << kvs.status().ToString();
    for (const auto& kv : kvs.ok() ? *kvs : std::vector<etcd::KeyValue>{}) out[kv.key] = kv.value;
    return out;
  }
  void Put(const std::string& key, const std::string& value) {
    ASSERT_TRUE(client_->Put(JobPrefix("t") + key, value).ok());
  }
  static std::string Seq(int n) { return fmt::format("journal/{:016d}", n); }
  // The events of the records read, steps as "step N".
  static std::vector<std::string> EventsOf(const JournalRead& r) {
    std::vector<std::string> out;
    for (const auto& j : r.records) {
      out.push_back(j["event"] == "step" ? fmt::format("step {}", j["step"].get<int>())
                                         : j["event"].get<std::string>());
    }
    return out;
  }
};

const std::vector<json> kRecords = {{{"event", "job_start"}},
                                    {{"event", "plan"}, {"generation", 1}},
                                    {{"event", "join"}, {"worker_id", 4}},
                                    {{"event", "plan"}, {"generation", 2}}};

TEST_F(EtcdJournalTrustTest, EveryForgedMovedOrReplayedValueIsAGapTheNextLeaderNamesAndCutsAt) {
  struct Case {
    std::string what;
    // the forger's change, given etcd's values after the first leader's records 1-2 (with the
    // progress of step 1) and after its records 3-4 (progress of step 2)
    std::function<void(const std::map<std::string, std::string>&,
                       const std::map<std::string, std::string>&)>
        forge;
    // the events the next leader reads (after a cut, the latest plan's copy: P plan)
    std::vector<std::string> read;
    std::string forged_key;
    size_t kept = 0;  // the journal's records before the gap
  };
  const std::string p = JobPrefix("t");
  const std::vector<Case> cases = {
      {"a job_end over the newest record",
       [&](auto&, auto&) { Put(Seq(4), R"({"event":"job_end","exit_code":0})"); },
       {"job_start", "plan", "join", "plan", "step 2"},
       p + Seq(4),
       3},
      {"a plan appended after the newest",
       [&](auto&, auto&) { Put(Seq(5), R"({"event":"plan","generation":9})"); },
       {"job_start", "plan", "join", "plan", "step 2"},
       p + Seq(5),
       4},
      {"a join sealed for another key (moved)",
       [&](auto&, auto& after) { Put(Seq(2), after.at(p + Seq(3))); },
       {"job_start", "plan", "step 2"},
       p + Seq(2),
       1},
      {"the newest record put back with the header of a later epoch",
       [&](auto&, auto& after) {
         std::string v = after.at(p + Seq(4));
         Put(Seq(4), "nonstop-sealed 999999" + v.substr(v.find(' ', 15)));
       },
       {"job_start", "plan", "join", "plan", "step 2"},
       p + Seq(4),
       3},
      {"an old progress put back",
       [&](auto& before, auto&) { Put("progress", before.at(p + "progress")); },
       {"job_start", "plan", "join", "plan"},
       p + "progress",
       4},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ASSERT_TRUE(client_->Txn({}, {etcd::Op::Delete(p, etcd::PrefixEnd(p))}).ok());
    auto first = Lead();
    ASSERT_TRUE(first);
    ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
    ASSERT_NO_FATAL_FAILURE(
        AppendAll(*first, {kRecords[0], kRecords[1], {{"event", "step"}, {"step", 1}}}));
    const auto before = Values();
    ASSERT_NO_FATAL_FAILURE(
        AppendAll(*first, {kRecords[2], kRecords[3], {{"event", "step"}, {"step", 2}}}));
    ASSERT_TRUE(WaitFor([&] {
      return Values().count(p + "progress") &&
             Values().at(p + "progress").find("\"step\":2") != std::string::npos;
    }));
    const auto after = Values();
    first->Resign();
    c.forge(before, after);
    auto second = Lead();
    ASSERT_TRUE(second);
    auto read = second->ReadJournal(kJobKey);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    EXPECT_EQ(EventsOf(*read), c.read);
    ASSERT_FALSE(read->forgeries.empty());
    EXPECT_EQ(read->forgeries[0].key, c.forged_key) << read->forgeries[0].why;
    EXPECT_EQ(read->cut, c.forged_key != p + "progress");
    // The next leader's records go on from the prefix; what lay after it is deleted.
    const size_t prefix = c.kept;
    ASSERT_NO_FATAL_FAILURE(AppendAll(*second, {{{"event", "controller_start"}}}));
    EXPECT_EQ(KeysUnder("journal/"), prefix + 1);
    // Its cleanup of what it did not believe is its own write: no check takes it for a forgery.
    std::this_thread::sleep_for(std::chrono::milliseconds(900));  // two renewals or more
    const auto forged = second->TakeRecordForgeries();
    EXPECT_TRUE(forged.empty()) << forged[0].why;
    second->Resign();
    auto third = Lead();
    ASSERT_TRUE(third);
    auto again = third->ReadJournal(kJobKey);
    ASSERT_TRUE(again.ok());
    EXPECT_FALSE(again->cut) << "the second leader's journal verifies whole";
    EXPECT_TRUE(again->forgeries.empty())
        << "the second leader's first write removed them: " << again->forgeries[0].key;
    EXPECT_EQ(again->records.size(), prefix + 1 + (again->records.back()["event"] == "step"));
    third->Resign();
  }
}

// The same for a compacted journal: a forged snapshot pointer is passed over for the newest whole
// snapshot; a forged snapshot part leaves no verified prefix, and the next leader says so.
TEST_F(EtcdJournalTrustTest, AForgedSnapshotPointerIsPassedOverAndAForgedPartIsAGap) {
  LeadershipOptions o;
  o.compact = [](const std::vector<json>& records) -> Result<json> {
    json s = {{"event", "snapshot"}, {"records", json::array()}};
    for (const auto& r : records) {
      for (const auto& e : r["event"] == "snapshot" ? r["records"] : json::array({r}))
        s["records"].push_back(e);
    }
    return s;
  };
  o.compact_records = 4;
  const std::string p = JobPrefix("t");
  for (bool part : {false, true}) {
    SCOPED_TRACE(part ? "a part" : "the pointer");
    ASSERT_TRUE(client_->Txn({}, {etcd::Op::Delete(p, etcd::PrefixEnd(p))}).ok());
    auto first = Lead(o);
    ASSERT_TRUE(first);
    ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
    ASSERT_NO_FATAL_FAILURE(AppendAll(*first, kRecords));
    ASSERT_TRUE(WaitFor([&] { return KeysUnder("journal/") == 0; }));
    ASSERT_NO_FATAL_FAILURE(AppendAll(*first, {{{"event", "exit"}, {"worker_id", 4}}}));
    first->Resign();
    std::string forged_key = p + "snapshot";
    if (part) {
      auto parts = client_->Prefix(p + "snapshot/");
      ASSERT_TRUE(parts.ok() && !parts->empty());
      forged_key = parts->at(0).key;
    }
    ASSERT_TRUE(client_->Put(forged_key, R"({"upto":4,"epoch":1,"parts":1,"bytes":2})").ok());
    auto second = Lead(o);
    ASSERT_TRUE(second);
    auto read = second->ReadJournal(kJobKey);
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    ASSERT_FALSE(read->forgeries.empty());
    EXPECT_EQ(read->forgeries[0].key, forged_key);
    if (!part) {
      ASSERT_EQ(read->records.size(), 2u);
      EXPECT_EQ(read->records[0]["records"].size(), 4u) << "the snapshot, found without it";
      EXPECT_EQ(read->records[1]["event"], "exit");
      EXPECT_FALSE(read->cut) << "nothing of the journal is missing";
    } else {
      EXPECT_TRUE(read->records.empty());
      EXPECT_TRUE(read->cut);
      EXPECT_GT(read->keys, 0u) << "a job whose keys are there: not one to start anew";
    }
    second->Resign();
  }
}

// A controller that reads and gives up (here: another job key, as a standby without the token file
// would hold) changes nothing in etcd: the deletion of what lies after a gap waits for the first
// write. And the parts of a compaction whose switch never landed (no pointer names them) are no
// gap.
TEST_F(EtcdJournalTrustTest, AReaderThatGivesUpDeletesNothingAndAnUnswitchedCompactionIsNoGap) {
  const std::string p = JobPrefix("t");
  auto first = Lead();
  ASSERT_TRUE(first);
  ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
  ASSERT_NO_FATAL_FAILURE(AppendAll(*first, kRecords));
  first->Resign();
  const auto before = Values();
  auto wrong = Lead();
  ASSERT_TRUE(wrong);
  auto read = wrong->ReadJournal(crypto::JobKey("another token"));
  ASSERT_TRUE(read.ok());
  EXPECT_TRUE(read->records.empty());
  EXPECT_TRUE(read->cut);
  EXPECT_GT(read->keys, 0u);
  wrong->Resign();
  wrong.reset();
  auto after = Values();
  after.erase(p + "leader");
  auto expected = before;
  expected.erase(p + "leader");
  EXPECT_EQ(after, expected) << "a reader that wrote nothing deleted something";
  // A sealed snapshot part of a compaction that never switched, beside the whole journal.
  Put("snapshot/0000000000000004.0000000000000099/0000",
      "not even sealed: a reader must not mind parts no pointer names");
  auto second = Lead();
  ASSERT_TRUE(second);
  auto whole = second->ReadJournal(kJobKey);
  ASSERT_TRUE(whole.ok());
  EXPECT_FALSE(whole->cut);
  EXPECT_EQ(whole->records.size(), kRecords.size());
  second->Resign();
}

// An earlier leader's records, each genuine, put back over those its successor wrote after a cut:
// each record's seal names where its leader began, so the splice ends where the successor's records
// resume, and that is a gap like any other.
TEST_F(EtcdJournalTrustTest, AnEarlierLeadersRecordsPutBackOverItsSuccessorsAreAGap) {
  const std::string p = JobPrefix("t");
  auto first = Lead();
  ASSERT_TRUE(first);
  ASSERT_TRUE(first->ReadJournal(kJobKey).ok());
  ASSERT_NO_FATAL_FAILURE(AppendAll(*first, kRecords));  // 1-4
  first->Resign();
  const auto e1 = Values();
  Put(Seq(3), R"({"event":"job_end","exit_code":0})");  // the cut: E2 goes on from 3
  auto second = Lead();
  ASSERT_TRUE(second);
  auto read = second->ReadJournal(kJobKey);
  ASSERT_TRUE(read.ok() && read->cut);
  ASSERT_NO_FATAL_FAILURE(AppendAll(*second, {{{"event", "controller_start"}},
                                              {{"event", "exit"}, {"worker_id", 1}},
                                              {{"event", "exit"}, {"worker_id", 2}}}));  // 3-5
  second->Resign();
  Put(Seq(3), e1.at(p + Seq(3)));  // E1's 3 and 4 back over E2's
  Put(Seq(4), e1.at(p + Seq(4)));
  auto third = Lead();
  ASSERT_TRUE(third);
  auto spliced = third->ReadJournal(kJobKey);
  ASSERT_TRUE(spliced.ok());
  EXPECT_TRUE(spliced->cut);
  ASSERT_FALSE(spliced->forgeries.empty());
  EXPECT_EQ(spliced->forgeries[0].key, p + Seq(5)) << spliced->forgeries[0].why;
  EXPECT_NE(spliced->forgeries[0].why.find("began at record 3"), std::string::npos)
      << spliced->forgeries[0].why;
  third->Resign();
}

// Issue 52: the leader finds its own records changed behind its back while it leads (not only
// the next leader's read): a record overwritten, one deleted, a key it never wrote, an old
// progress put back. Each is undone within a few renewals and reported; the next leader then reads
// the whole journal, with no gap and no forgery.
TEST_F(EtcdJournalTrustTest, ALeaderPutsBackWhatWasChangedUnderItsRecordsAndSaysSo) {
  const std::string p = JobPrefix("t");
  auto leader = Lead();
  ASSERT_TRUE(leader);
  ASSERT_TRUE(leader->ReadJournal(kJobKey).ok());
  ASSERT_NO_FATAL_FAILURE(
      AppendAll(*leader, {kRecords[0], kRecords[1], {{"event", "step"}, {"step", 1}}}));
  const auto before = Values();
  ASSERT_NO_FATAL_FAILURE(
      AppendAll(*leader, {kRecords[2], kRecords[3], {{"event", "step"}, {"step", 2}}}));
  ASSERT_TRUE(
      WaitFor([&] { return Values().at(p + "progress").find("\"step\":2") != std::string::npos; }));
  const auto own = Values();
  Put(Seq(4), R"({"event":"job_end","exit_code":0})");
  ASSERT_TRUE(client_->Txn({}, {etcd::Op::Delete(p + Seq(2))}).ok());
  Put(Seq(9), R"({"event":"plan","generation":9})");
  Put("progress", before.at(p + "progress"));
  std::map<std::string, RecordForgery> found;
  ASSERT_TRUE(WaitFor([&] {
    for (auto& f : leader->TakeRecordForgeries()) found[f.key] = f;
    return found.size() >= 4 && Values() == own;
  })) << found.size()
      << " found";
  EXPECT_EQ(Values(), own) << "every record as the leader wrote it, the stranger's key gone";
  ASSERT_EQ(found.size(), 4u);
  for (const auto& [key, f] : found) EXPECT_TRUE(f.restored) << key << ": " << f.why;
  EXPECT_NE(found[p + Seq(4)].why.find("a value this leader did not write"), std::string::npos);
  EXPECT_NE(found[p + Seq(2)].why.find("was deleted"), std::string::npos);
  EXPECT_NE(found[p + Seq(9)].why.find("not by this leader"), std::string::npos);
  EXPECT_NE(found[p + "progress"].why.find("did not write"), std::string::npos);
  // The leader's own writes since are not taken for forgeries.
  ASSERT_NO_FATAL_FAILURE(AppendAll(*leader, {{{"event", "exit"}, {"worker_id", 1}}}));
  std::this_thread::sleep_for(std::chrono::milliseconds(1'500));  // a few renewals
  EXPECT_TRUE(leader->TakeRecordForgeries().empty());
  leader->Resign();
  auto next = Lead();
  ASSERT_TRUE(next);
  auto read = next->ReadJournal(kJobKey);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_FALSE(read->cut);
  EXPECT_TRUE(read->forgeries.empty()) << read->forgeries[0].why;
  EXPECT_EQ(EventsOf(*read),
            (std::vector<std::string>{"job_start", "plan", "join", "plan", "exit", "step 2"}));
  next->Resign();
}

}  // namespace
}  // namespace nonstop::coord
