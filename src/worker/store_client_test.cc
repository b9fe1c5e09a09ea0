// A worker's end of the job's store (worker/store_client.h), against a controller played by the
// test: the requests it sends, the answers it waits for, what it sends again on a new connection.
#include "worker/store_client.h"

#include <future>
#include <thread>

#include <gtest/gtest.h>

namespace nonstop::worker {
namespace {

using control::StoreOp;
using control::StoreReplyMsg;
using control::StoreRequestMsg;

// The controller's side: the requests sent, and a switch for "not connected".
class Sent {
 public:
  StoreClient::SendFn Fn() {
    return [this](uint16_t type, const std::string& payload) -> Status {
      EXPECT_EQ(type, control::kMsgStore);
      MutexLock lock(&mu_);
      if (!connected_) return UnavailableError("not connected");
      auto m = control::DecodeStoreRequest(payload);
      EXPECT_TRUE(m.ok()) << m.status().ToString();
      if (m.ok()) requests_.push_back(*m);
      cv_.NotifyAll();
      return OkStatus();
    };
  }
  // The n-th request (from 1), once it was sent.
  StoreRequestMsg Nth(size_t n) {
    MutexLock lock(&mu_);
    EXPECT_TRUE(
        cv_.WaitFor(&mu_, std::chrono::seconds(10),
                    [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return requests_.size() >= n; }));
    return requests_.size() >= n ? requests_[n - 1] : StoreRequestMsg{};
  }
  size_t count() {
    MutexLock lock(&mu_);
    return requests_.size();
  }
  void set_connected(bool c) {
    MutexLock lock(&mu_);
    connected_ = c;
  }

 private:
  Mutex mu_;
  CondVar cv_;
  bool connected_ NONSTOP_GUARDED_BY(mu_) = true;
  std::vector<StoreRequestMsg> requests_ NONSTOP_GUARDED_BY(mu_);
};

Status Reply(StoreClient& c, StoreReplyMsg r) { return c.OnReply(control::Encode(r)); }

TEST(StoreClientTest, ACallSendsItsRequestAndReturnsTheAnswer) {
  Sent sent;
  StoreClient client(sent.Fn());
  auto got = std::async(std::launch::async, [&] { return client.Get("k", Millis(10'000)); });
  StoreRequestMsg m = sent.Nth(1);
  EXPECT_EQ(m.op, StoreOp::kGet);
  EXPECT_EQ(m.keys, std::vector<std::string>{"k"});
  EXPECT_EQ(m.timeout_ms, 10'000);
  EXPECT_EQ(m.seq, 1);
  // An answer to no call waiting is dropped; a malformed one is an error.
  EXPECT_TRUE(Reply(client, {99, "", "", "other", 0}).ok());
  EXPECT_FALSE(client.OnReply("{}").ok());
  ASSERT_TRUE(Reply(client, {m.seq, "", "", std::string("v\0", 2), 0}).ok());
  auto value = got.get();
  ASSERT_TRUE(value.ok()) << value.status().ToString();
  EXPECT_EQ(*value, std::string("v\0", 2));
  // The controller's errors come back by their class.
  auto wait = std::async(std::launch::async, [&] {
    std::vector<std::string> keys = {"a"};
    return client.Wait(keys, Millis(50));
  });
  ASSERT_TRUE(Reply(client, {sent.Nth(2).seq, "timeout: no 'a'", "timeout", "", 0}).ok());
  EXPECT_EQ(wait.get().code(), StatusCode::kDeadlineExceeded);
  auto full = std::async(std::launch::async, [&] { return client.Set("a", "b", Millis(1'000)); });
  ASSERT_TRUE(Reply(client, {sent.Nth(3).seq, "the store is full", "limit", "", 0}).ok());
  EXPECT_EQ(full.get().code(), StatusCode::kFailedPrecondition);
}

TEST(StoreClientTest, WhatIsNotAnsweredIsSentAgainOnANewConnectionWithTheTimeItHasLeft) {
  Sent sent;
  sent.set_connected(false);
  StoreClient client(sent.Fn());
  auto wait = std::async(std::launch::async, [&] {
    std::vector<std::string> keys = {"a", "b"};
    return client.Wait(keys, Millis(60'000));
  });
  auto add = std::async(std::launch::async, [&] { return client.Add("n", 2, Millis(60'000)); });
  std::vector<std::pair<uint16_t, std::string>> again;
  for (int i = 0; i < 1000 && again.size() < 2; ++i) {
    std::this_thread::sleep_for(Millis(5));
    again = client.Unanswered(Clock::now() + Millis(10'000));
  }
  ASSERT_EQ(again.size(), 2u);
  std::map<StoreOp, StoreRequestMsg> by_op;
  for (const auto& [type, payload] : again) {
    EXPECT_EQ(type, control::kMsgStore);
    auto m = control::DecodeStoreRequest(payload);
    ASSERT_TRUE(m.ok());
    by_op[m->op] = *m;
  }
  // The wait with what is left of its 60 s (10 s have "passed"); the write as it was.
  EXPECT_GT(by_op[StoreOp::kWait].timeout_ms, 45'000);
  EXPECT_LE(by_op[StoreOp::kWait].timeout_ms, 50'000);
  EXPECT_EQ(by_op[StoreOp::kAdd].amount, 2);
  EXPECT_EQ(by_op[StoreOp::kAdd].client, by_op[StoreOp::kWait].client);
  ASSERT_TRUE(Reply(client, {by_op[StoreOp::kAdd].seq, "", "", "", 5}).ok());
  ASSERT_TRUE(Reply(client, {by_op[StoreOp::kWait].seq, "", "", "", 0}).ok());
  EXPECT_EQ(add.get().value(), 5);
  EXPECT_TRUE(wait.get().ok());
  EXPECT_TRUE(client.Unanswered(Clock::now()).empty());
}

TEST(StoreClientTest, WritesGoOneAtATime) {
  Sent sent;
  StoreClient client(sent.Fn());
  auto first = std::async(std::launch::async, [&] { return client.Set("a", "1", Millis(10'000)); });
  const StoreRequestMsg one = sent.Nth(1);
  auto second =
      std::async(std::launch::async, [&] { return client.Set("a", "2", Millis(10'000)); });
  auto read = std::async(std::launch::async, [&] { return client.NumKeys(Millis(10'000)); });
  const StoreRequestMsg two = sent.Nth(2);
  EXPECT_EQ(two.op, StoreOp::kNumKeys) << "a read does not wait for a write";
  std::this_thread::sleep_for(Millis(50));
  EXPECT_EQ(sent.count(), 2u) << "the second write waits for the first's answer";
  ASSERT_TRUE(Reply(client, {one.seq, "", "", "", 0}).ok());
  const StoreRequestMsg three = sent.Nth(3);
  EXPECT_EQ(three.value, "2");
  ASSERT_TRUE(Reply(client, {three.seq, "", "", "", 0}).ok());
  ASSERT_TRUE(Reply(client, {two.seq, "", "", "", 4}).ok());
  EXPECT_TRUE(first.get().ok());
  EXPECT_TRUE(second.get().ok());
  EXPECT_EQ(read.get().value(), 4);
}

TEST(StoreClientTest, NoAnswerTimesOutAndAFailureEndsEveryCall) {
  Sent sent;
  StoreClient client(sent.Fn());
  Status set = client.Set("k", "v", Millis(100));
  EXPECT_EQ(set.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(set.message().find("timeout"), std::string::npos) << set.ToString();
  auto get =
      std::async(std::launch::async, [&] { return client.Get("k", Millis(0)); });  // for ever
  sent.Nth(2);
  client.Fail(UnavailableError("no controller"));
  EXPECT_EQ(get.get().status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(client.Set("k", "v", Millis(100)).code(), StatusCode::kUnavailable);
}

TEST(StoreClientTest, WhatTheWireCannotTakeIsRefusedBeforeSending) {
  Sent sent;
  StoreClient client(sent.Fn());
  EXPECT_EQ(client.Set(std::string("\xff\xfe", 2), "v", Millis(100)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(client.Set(std::string(control::kMaxStoreKeyBytes + 1, 'k'), "v", Millis(100)).code(),
            StatusCode::kInvalidArgument);
  Status big = client.Set("k", std::string(control::kMaxStoreValueBytes + 1, 'v'), Millis(100));
  EXPECT_EQ(big.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(big.message().find("1 MiB"), std::string::npos) << big.ToString();
  std::vector<std::string> many(control::kMaxStoreKeysPerRequest + 1, "k");
  EXPECT_EQ(client.Wait(many, Millis(100)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(sent.count(), 0u);
}

TEST(StoreClientTest, AnAbortEndsTheWaitsOfItsGenerationAndNothingElse) {
  Sent sent;
  StoreClient client(sent.Fn());
  auto get = std::async(std::launch::async, [&] { return client.Get("k", Millis(0)); });
  auto add = std::async(std::launch::async, [&] { return client.Add("n", 1, Millis(10'000)); });
  sent.Nth(2);
  client.AbortWaits(AbortedError("generation 3 ended"));
  EXPECT_EQ(get.get().status().code(), StatusCode::kAborted);
  // The write goes on: its answer still counts.
  const StoreRequestMsg a = sent.Nth(1).op == StoreOp::kAdd ? sent.Nth(1) : sent.Nth(2);
  ASSERT_TRUE(Reply(client, {a.seq, "", "", "", 1}).ok());
  EXPECT_EQ(add.get().value(), 1);
  // A wait that begins after the abort ends so too, unsent (its key may come only once this
  // member has recovered), and a write still goes: until the next generation.
  EXPECT_EQ(client.Get("k", Millis(10'000)).status().code(), StatusCode::kAborted);
  const std::vector<std::string> keys = {"k"};
  EXPECT_EQ(client.Wait(keys, Millis(10'000)).code(), StatusCode::kAborted);
  EXPECT_EQ(sent.count(), 2u);
  auto set = std::async(std::launch::async, [&] { return client.Set("s", "v", Millis(10'000)); });
  const StoreRequestMsg w = sent.Nth(3);
  ASSERT_TRUE(Reply(client, {w.seq, "", "", "", 0}).ok());
  EXPECT_TRUE(set.get().ok());
  // The next generation: a wait waits as usual.
  client.ResumeWaits();
  auto later = std::async(std::launch::async, [&] { return client.Get("k", Millis(10'000)); });
  const StoreRequestMsg g = sent.Nth(4);
  ASSERT_TRUE(Reply(client, {g.seq, "", "", "v", 0}).ok());
  EXPECT_EQ(later.get().value(), "v");
}

}  // namespace
}  // namespace nonstop::worker
