// The job's store (controller/job_store.h): torch's store semantics, writes applied once, waits
// answered when their keys appear or their timeout passes, its bounds, and the journal's replay.
#include "controller/job_store.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace nonstop::controller {
namespace {

using control::StoreOp;
using control::StoreReplyMsg;
using control::StoreRequestMsg;
using nlohmann::json;

const Clock::time_point kT0{};

class JobStoreTest : public ::testing::Test {
 protected:
  // One request of worker `w` (its client "c<w>", numbered in turn).
  JobStore::Outcome Ask(int w, StoreOp op, std::vector<std::string> keys, std::string value = "",
                        std::string expected = "", int64_t amount = 0, int64_t timeout_ms = 0,
                        Clock::time_point now = kT0) {
    StoreRequestMsg m;
    m.client = "c" + std::to_string(w);
    m.seq = ++seq_[w];
    m.op = op;
    m.keys = std::move(keys);
    m.value = std::move(value);
    m.expected = std::move(expected);
    m.amount = amount;
    m.timeout_ms = timeout_ms;
    last_ = m;
    JobStore::Outcome o = store_.Handle(w, m, now);
    if (o.record) records_.push_back(*o.record);
    return o;
  }
  // The one answer to worker `w` a request got at once.
  StoreReplyMsg Answer(const JobStore::Outcome& o, int w = 0) {
    EXPECT_EQ(o.answers.size(), 1u);
    if (o.answers.empty()) return {};
    EXPECT_EQ(o.answers[0].worker_id, w);
    return o.answers[0].reply;
  }

  JobStore store_;
  std::map<int, int64_t> seq_;
  StoreRequestMsg last_;
  std::vector<json> records_;
};

TEST_F(JobStoreTest, AnswersAsTorchsStores) {
  EXPECT_TRUE(Answer(Ask(0, StoreOp::kSet, {"k"}, "v")).error.empty());
  EXPECT_EQ(Answer(Ask(1, StoreOp::kGet, {"k"}), 1).value, "v");
  EXPECT_EQ(Answer(Ask(0, StoreOp::kAdd, {"n"}, "", "", 5)).number, 5);
  EXPECT_EQ(Answer(Ask(1, StoreOp::kAdd, {"n"}, "", "", -7), 1).number, -2);
  EXPECT_EQ(Answer(Ask(0, StoreOp::kGet, {"n"})).value, "-2") << "a counter is decimal text";
  // compare_set: a missing key is set only when the expected value is empty.
  EXPECT_EQ(Answer(Ask(0, StoreOp::kCompareSet, {"cs"}, "new", "old")).value, "old");
  EXPECT_EQ(Answer(Ask(0, StoreOp::kCheck, {"cs"})).number, 0);
  EXPECT_EQ(Answer(Ask(0, StoreOp::kCompareSet, {"cs"}, "first", "")).value, "first");
  EXPECT_EQ(Answer(Ask(0, StoreOp::kCompareSet, {"cs"}, "second", "wrong")).value, "first");
  EXPECT_EQ(Answer(Ask(0, StoreOp::kCompareSet, {"cs"}, "second", "first")).value, "second");
  EXPECT_TRUE(Answer(Ask(0, StoreOp::kAppend, {"cs"}, "+more")).error.empty());
  EXPECT_EQ(Answer(Ask(0, StoreOp::kGet, {"cs"})).value, "second+more");
  EXPECT_EQ(Answer(Ask(0, StoreOp::kCheck, {"k", "n", "cs"})).number, 1);
  EXPECT_EQ(Answer(Ask(0, StoreOp::kNumKeys, {})).number, 3);
  EXPECT_EQ(Answer(Ask(0, StoreOp::kDeleteKey, {"k"})).number, 1);
  EXPECT_EQ(Answer(Ask(0, StoreOp::kDeleteKey, {"k"})).number, 0);
  EXPECT_EQ(Answer(Ask(0, StoreOp::kNumKeys, {})).number, 2);
  EXPECT_EQ(store_.bytes(), std::string("n-2cssecond+more").size());
  // Bytes are bytes: a value with zeros and high bytes comes back as it went.
  const std::string binary("\0\xff\x80z", 4);
  Answer(Ask(0, StoreOp::kSet, {"bin"}, binary));
  EXPECT_EQ(Answer(Ask(1, StoreOp::kGet, {"bin"}), 1).value, binary);
}

TEST_F(JobStoreTest, AddRefusesAValueThatIsNoCounterAndAnOverflow) {
  Answer(Ask(0, StoreOp::kSet, {"text"}, "12a"));
  StoreReplyMsg r = Answer(Ask(0, StoreOp::kAdd, {"text"}, "", "", 1));
  EXPECT_EQ(r.code, "invalid");
  EXPECT_NE(r.error.find("no integer"), std::string::npos) << r.error;
  Answer(Ask(0, StoreOp::kAdd, {"big"}, "", "", INT64_MAX));
  EXPECT_EQ(Answer(Ask(0, StoreOp::kAdd, {"big"}, "", "", 1)).code, "invalid");
  EXPECT_EQ(Answer(Ask(0, StoreOp::kGet, {"big"})).value, std::to_string(INT64_MAX));
}

TEST_F(JobStoreTest, AWriteSentAgainIsAppliedOnceAndAnsweredAsTheFirstTime) {
  Answer(Ask(0, StoreOp::kAdd, {"n"}, "", "", 1));
  const StoreRequestMsg add = last_;
  // The same request again (its connection was lost before the answer came): the first answer.
  JobStore::Outcome again = store_.Handle(0, add, kT0);
  EXPECT_FALSE(again.record.has_value());
  EXPECT_EQ(Answer(again).number, 1);
  EXPECT_EQ(Answer(again).seq, add.seq);
  EXPECT_EQ(Answer(Ask(0, StoreOp::kAdd, {"n"}, "", "", 1)).number, 2);
  // An older one, sent again late: no answer and no change.
  EXPECT_TRUE(store_.Handle(0, add, kT0).answers.empty());
  // Another process with the same worker id (a restart) numbers from 1 again: applied.
  StoreRequestMsg restarted = add;
  restarted.client = "a new process";
  EXPECT_EQ(Answer(store_.Handle(0, restarted, kT0)).number, 3);
  EXPECT_EQ(records_.size(), 2u) << "the journal records each write once";
}

TEST_F(JobStoreTest, GetAndWaitAnswerOnceTheirKeysAreSet) {
  EXPECT_TRUE(Ask(1, StoreOp::kGet, {"a"}, "", "", 0, 10'000).answers.empty());
  const int64_t get_seq = last_.seq;
  EXPECT_TRUE(Ask(2, StoreOp::kWait, {"a", "b"}, "", "", 0, 10'000).answers.empty());
  const int64_t wait_seq = last_.seq;
  EXPECT_EQ(store_.waits(), 2u);
  // "a" ends the get; the wait needs "b" too.
  JobStore::Outcome set_a = Ask(0, StoreOp::kSet, {"a"}, "A");
  ASSERT_EQ(set_a.answers.size(), 2u);
  EXPECT_EQ(set_a.answers[0].worker_id, 0);  // the setter first
  EXPECT_EQ(set_a.answers[1].worker_id, 1);
  EXPECT_EQ(set_a.answers[1].reply.seq, get_seq);
  EXPECT_EQ(set_a.answers[1].reply.value, "A");
  // "a" deleted before "b" comes: the wait goes on until both are there.
  Answer(Ask(0, StoreOp::kDeleteKey, {"a"}));
  EXPECT_EQ(Ask(0, StoreOp::kSet, {"b"}, "B").answers.size(), 1u);
  JobStore::Outcome set_a_again = Ask(0, StoreOp::kAdd, {"a"}, "", "", 1);
  ASSERT_EQ(set_a_again.answers.size(), 2u);
  EXPECT_EQ(set_a_again.answers[1].worker_id, 2);
  EXPECT_EQ(set_a_again.answers[1].reply.seq, wait_seq);
  EXPECT_TRUE(set_a_again.answers[1].reply.error.empty());
  EXPECT_EQ(store_.waits(), 0u);
  // Keys already there: answered at once.
  EXPECT_EQ(Answer(Ask(3, StoreOp::kWait, {"a", "b"}, "", "", 0, 5), 3).error, "");
}

TEST_F(JobStoreTest, AWaitEndsAtItsTimeoutNamingTheMissingKeysAndZeroWaitsForEver) {
  Ask(1, StoreOp::kWait, {"here", "missing"}, "", "", 0, 500, kT0);
  Ask(2, StoreOp::kGet, {"missing"}, "", "", 0, /*timeout_ms=*/0, kT0);  // for ever
  Answer(Ask(0, StoreOp::kSet, {"here"}, "x"));
  EXPECT_TRUE(store_.Expire(kT0 + Millis(499)).empty());
  std::vector<JobStore::Answer> expired = store_.Expire(kT0 + Millis(500));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].worker_id, 1);
  EXPECT_EQ(expired[0].reply.code, "timeout");
  EXPECT_NE(expired[0].reply.error.find("timeout"), std::string::npos);
  EXPECT_NE(expired[0].reply.error.find("'missing'"), std::string::npos) << expired[0].reply.error;
  EXPECT_EQ(expired[0].reply.error.find("'here'"), std::string::npos) << expired[0].reply.error;
  EXPECT_TRUE(store_.Expire(kT0 + std::chrono::hours(24 * 365)).empty());
  JobStore::Outcome set = Ask(0, StoreOp::kSet, {"missing"}, "m");
  ASSERT_EQ(set.answers.size(), 2u) << "the wait with no timeout is still there";
  EXPECT_EQ(set.answers[1].worker_id, 2);
  EXPECT_EQ(set.answers[1].reply.value, "m");
}

TEST_F(JobStoreTest, AForgottenWorkersWaitsAreNeverAnswered) {
  Ask(1, StoreOp::kGet, {"k"}, "", "", 0, 1'000);
  Ask(2, StoreOp::kGet, {"k"}, "", "", 0, 1'000);
  store_.Forget(1);  // its connection was lost: it asks again once back
  JobStore::Outcome set = Ask(0, StoreOp::kSet, {"k"}, "v");
  ASSERT_EQ(set.answers.size(), 2u);
  EXPECT_EQ(set.answers[1].worker_id, 2);
  EXPECT_TRUE(store_.Expire(kT0 + Millis(5'000)).empty());
  EXPECT_EQ(store_.waits(), 0u);
}

TEST_F(JobStoreTest, TheStoreIsBoundedAndSaysWhatToDo) {
  const std::string value(control::kMaxStoreValueBytes, 'x');
  size_t stored = 0;
  for (int i = 0; stored + value.size() + 8 <= JobStore::kMaxBytes; ++i) {
    ASSERT_EQ(Answer(Ask(0, StoreOp::kSet, {fmt::format("k{:06}", i)}, value)).error, "");
    stored += value.size() + 7;
  }
  StoreReplyMsg full = Answer(Ask(0, StoreOp::kSet, {"one more"}, value));
  EXPECT_EQ(full.code, "limit");
  EXPECT_NE(full.error.find("delete"), std::string::npos) << full.error;
  EXPECT_EQ(store_.bytes(), stored) << "a refused write changes nothing";
  EXPECT_TRUE(records_.size() == stored / (value.size() + 7)) << "and is not journaled";
  // A key's value grows by append no further than the most one key holds.
  Answer(Ask(0, StoreOp::kDeleteKey, {"k000000"}));
  Answer(Ask(0, StoreOp::kSet, {"grows"}, "ab"));
  EXPECT_EQ(Answer(Ask(0, StoreOp::kAppend, {"grows"}, value)).code, "limit");
  // Waits: at most kMaxWaitsPerWorker for one worker.
  for (size_t i = 0; i < JobStore::kMaxWaitsPerWorker; ++i)
    EXPECT_TRUE(Ask(5, StoreOp::kGet, {"absent"}, "", "", 0, 1'000).answers.empty());
  StoreReplyMsg many = Answer(Ask(5, StoreOp::kGet, {"absent"}, "", "", 0, 1'000), 5);
  EXPECT_EQ(many.code, "limit");
  EXPECT_EQ(Ask(6, StoreOp::kGet, {"absent"}, "", "", 0, 1'000).answers.size(), 0u)
      << "another worker may still wait";
}

TEST_F(JobStoreTest, ItsRecordsReplayedAndItsSnapshotLoadedGiveTheSameStore) {
  Answer(Ask(0, StoreOp::kSet, {"a"}, std::string("\0bin", 4)));
  Answer(Ask(1, StoreOp::kAdd, {"n"}, "", "", 3), 1);
  const StoreRequestMsg add = last_;
  Answer(Ask(2, StoreOp::kCompareSet, {"cs"}, "w", "no"), 2);  // no change: no record
  Answer(Ask(2, StoreOp::kCompareSet, {"cs"}, "v", ""), 2);
  Answer(Ask(0, StoreOp::kAppend, {"a"}, "+"));
  Answer(Ask(1, StoreOp::kDeleteKey, {"gone"}), 1);  // nothing deleted: no record
  Answer(Ask(1, StoreOp::kSet, {"gone"}, "soon"), 1);
  Answer(Ask(1, StoreOp::kDeleteKey, {"gone"}), 1);
  EXPECT_EQ(records_.size(), 6u);
  JobStore replayed;
  for (const json& r : records_) ASSERT_TRUE(replayed.Replay(r).ok()) << r.dump();
  EXPECT_EQ(replayed.Save(), store_.Save());
  auto loaded = JobStore::Load(json::parse(store_.Save().dump()));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->Save(), store_.Save());
  // What the old controller answered, the new one answers again: worker 1's delete_key was its
  // last write; its add, older, is stale.
  StoreRequestMsg last_delete = last_;
  EXPECT_EQ(Answer(replayed.Handle(1, last_delete, kT0), 1).number, 1);
  EXPECT_TRUE(loaded->Handle(1, add, kT0).answers.empty());
  // A record that is not a write, or not a record, is refused.
  json read = records_[0];
  read["request"]["op"] = "get";
  read["request"]["timeout_ms"] = 0;
  EXPECT_FALSE(JobStore().Replay(read).ok());
  EXPECT_FALSE(JobStore().Replay({{"event", "store"}}).ok());
  EXPECT_FALSE(JobStore::Load({{"data", json::array({json::array({"k", "not base64!"})})},
                               {"last_write", json::array()}})
                   .ok());
  EXPECT_FALSE(JobStore::Load({{"data", 3}}).ok());
}

TEST_F(JobStoreTest, AWaitForAKeyThatWasThereAndIsDeletedIsWokenWhenItComesBack) {
  Answer(Ask(0, StoreOp::kSet, {"a"}, "A"));
  EXPECT_TRUE(Ask(1, StoreOp::kWait, {"a", "b"}, "", "", 0, 10'000).answers.empty());
  Answer(Ask(0, StoreOp::kDeleteKey, {"a"}));
  EXPECT_EQ(Ask(0, StoreOp::kSet, {"b"}, "B").answers.size(), 1u) << "a is missing now";
  JobStore::Outcome back = Ask(0, StoreOp::kSet, {"a"}, "A again");
  ASSERT_EQ(back.answers.size(), 2u);
  EXPECT_EQ(back.answers[1].worker_id, 1);
  EXPECT_EQ(store_.waits(), 0u);
}

TEST_F(JobStoreTest, AWriteThatChangesNothingIsAnsweredAsAReadAndNotJournaled) {
  Answer(Ask(0, StoreOp::kAdd, {"n"}, "", "", 2));
  Answer(Ask(0, StoreOp::kSet, {"k"}, "v"));
  const size_t records = records_.size();
  // torch's own barrier polls with add(key, 0): a read of the counter.
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(Answer(Ask(1, StoreOp::kAdd, {"n"}, "", "", 0), 1).number, 2);
  Answer(Ask(1, StoreOp::kSet, {"k"}, "v"), 1);
  EXPECT_EQ(Answer(Ask(1, StoreOp::kCompareSet, {"k"}, "v", "v"), 1).value, "v");
  EXPECT_EQ(records_.size(), records);
  // add(key, 0) of a missing key creates it, as torch's stores do: a write.
  EXPECT_EQ(Answer(Ask(1, StoreOp::kAdd, {"zero"}, "", "", 0), 1).number, 0);
  EXPECT_EQ(records_.size(), records + 1);
}

TEST_F(JobStoreTest, AWriteAppliedByAControllerThatDiedIsAnsweredAgainByTheNextOneNotAppliedTwice) {
  // Controller A applies worker 1's add and journals it; the answer is lost with A.
  Answer(Ask(1, StoreOp::kAdd, {"n"}, "", "", 5), 1);
  Answer(Ask(2, StoreOp::kCompareSet, {"cs"}, std::string(300, 'd'), ""), 2);
  const StoreRequestMsg compare_set = last_;
  Answer(Ask(1, StoreOp::kAdd, {"n"}, "", "", 7), 1);
  const StoreRequestMsg add = last_;
  // Controller B: the records replayed (as a takeover does, through a snapshot).
  JobStore replayed;
  for (const json& r : records_) ASSERT_TRUE(replayed.Replay(r).ok());
  auto b = JobStore::Load(json::parse(replayed.Save().dump()));
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  // Both requests sent again on the new connection: the answers A gave, nothing applied again.
  StoreReplyMsg again = Answer(b->Handle(1, add, kT0), 1);
  EXPECT_EQ(again.number, 12);
  EXPECT_EQ(again.seq, add.seq);
  StoreReplyMsg cs = Answer(b->Handle(2, compare_set, kT0), 2);
  EXPECT_EQ(cs.value, std::string(300, 'd')) << "a compare_set's answer is its desired value";
  EXPECT_FALSE(b->Handle(1, add, kT0).record.has_value());
  EXPECT_EQ(b->Save(), store_.Save());
  EXPECT_LT(b->Save()["last_write"].dump().size(), 300u) << "the kept answer holds no value";
}

}  // namespace
}  // namespace nonstop::controller
