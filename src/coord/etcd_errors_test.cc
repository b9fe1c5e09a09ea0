// The classification of etcd's errors and the retries it decides
// (src/coord/etcd.h, retry.h, leadership.cc), against a fake etcd: a
// cpp-httplib server whose answers each test scripts (429, 403, a lost
// answer), on a port from the OS.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/mutex.h"
#include "coord/etcd.h"
#include "coord/leadership.h"
#include "coord/retry.h"

namespace nonstop::etcd {
namespace {

using std::chrono::milliseconds;

// A fake etcd v3 gateway. handler(path, nth) answers the nth request (from
// 1) to /v3/<path> with (HTTP status, body); the default answers below stand
// for what the test leaves alone.
class FakeEtcd {
 public:
  using Answer = std::pair<int, std::string>;
  using Handler = std::function<std::optional<Answer>(const std::string& path, int nth)>;

  explicit FakeEtcd(Handler handler) : handler_(std::move(handler)) {
    server_.Post(R"(/v3/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      std::string path = req.matches[1];
      int nth = 0;
      {
        MutexLock lock(&mu_);
        nth = ++requests_[path];
      }
      Answer a = handler_(path, nth).value_or(Default(path));
      res.status = a.first;
      res.set_content(a.second, "application/json");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
  }
  ~FakeEtcd() {
    server_.stop();
    thread_.join();
  }

  std::string endpoint() const { return fmt::format("127.0.0.1:{}", port_); }
  int requests(const std::string& path) {
    MutexLock lock(&mu_);
    return requests_[path];
  }

  static Answer Default(const std::string& path) {
    if (path == "lease/grant") return {200, R"({"header":{"revision":"3"},"ID":"7","TTL":"10"})"};
    if (path == "lease/keepalive") return {200, R"({"result":{"header":{},"ID":"7","TTL":"10"}})"};
    if (path == "kv/txn") return {200, R"({"header":{"revision":"9"},"succeeded":true})"};
    return {200, R"({"header":{"revision":"3"}})"};  // kv/range: no key; lease/revoke
  }
  static Answer Grpc(int http, int code, const std::string& message) {
    return {http,
            nlohmann::json({{"error", message}, {"message", message}, {"code", code}}).dump()};
  }

 private:
  Handler handler_;
  httplib::Server server_;
  int port_ = -1;
  std::thread thread_;
  Mutex mu_;
  std::map<std::string, int> requests_ NONSTOP_GUARDED_BY(mu_);
};

coord::LeadershipOptions Options(const FakeEtcd& etcd, int ttl_seconds = 10) {
  coord::LeadershipOptions o;
  o.endpoints = etcd.endpoint();
  o.job = "t";
  o.ttl_seconds = ttl_seconds;
  o.request_timeout = milliseconds(300);
  o.retry_max = milliseconds(50);
  return o;
}

TEST(EtcdErrorClassTest, EveryAnswerHasTheClassItsCodeSays) {
  struct Case {
    int http, grpc;
    ErrorClass want;
  };
  const Case cases[] = {
      {503, 14, ErrorClass::kUnavailable},      {500, 2, ErrorClass::kUnavailable},
      {500, 13, ErrorClass::kUnavailable},      {409, 10, ErrorClass::kUnavailable},
      {429, 8, ErrorClass::kResourceExhausted}, {429, -1, ErrorClass::kResourceExhausted},
      {504, 4, ErrorClass::kDeadlineExceeded},  {504, -1, ErrorClass::kDeadlineExceeded},
      {403, 7, ErrorClass::kPermissionDenied},  {401, 16, ErrorClass::kPermissionDenied},
      {403, -1, ErrorClass::kPermissionDenied}, {400, 3, ErrorClass::kInvalid},
      {400, 9, ErrorClass::kInvalid},           {400, 11, ErrorClass::kInvalid},
      {501, 12, ErrorClass::kInvalid},          {404, -1, ErrorClass::kInvalid},
      {404, 5, ErrorClass::kNotFound},          {502, -1, ErrorClass::kUnavailable},
      {503, -1, ErrorClass::kUnavailable},      {501, -1, ErrorClass::kInvalid},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Classify(c.http, c.grpc), c.want) << "HTTP " << c.http << " gRPC " << c.grpc;
  }
  // Transient: unavailable, overloaded, timed out. Final: the rest.
  for (ErrorClass c :
       {ErrorClass::kUnavailable, ErrorClass::kResourceExhausted, ErrorClass::kDeadlineExceeded}) {
    EXPECT_TRUE(IsTransient(Status(StatusCodeFor(c), "x"))) << ErrorClassName(c);
  }
  for (ErrorClass c :
       {ErrorClass::kPermissionDenied, ErrorClass::kInvalid, ErrorClass::kNotFound}) {
    EXPECT_FALSE(IsTransient(Status(StatusCodeFor(c), "x"))) << ErrorClassName(c);
  }
  EXPECT_FALSE(IsTransient(DataLossError("not JSON")));
}

TEST(EtcdErrorClassTest, AnAnswersStatusNamesTheMemberTheRequestTheCodesAndEtcdsMessage) {
  Status s = AnswerStatus(
      "10.0.0.1:2379", "kv/txn", 429,
      R"({"error":"etcdserver: too many requests","message":"etcdserver: too many requests","code":8})");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  for (const char* part : {"10.0.0.1:2379", "/v3/kv/txn", "HTTP 429", "RESOURCE_EXHAUSTED 8",
                           "too many requests", "overloaded"}) {
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " in " << s.message();
  }
  Status text = AnswerStatus("h:1", "kv/range", 404, "Not Found\n");  // not etcd's v3 gateway
  EXPECT_EQ(text.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(text.message().find("HTTP 404: Not Found"), std::string::npos) << text.message();
}

TEST(EtcdBackoffTest, WaitsAreFullyJitteredUnderADoublingCap) {
  double u = 0.999;
  Backoff b(milliseconds(100), milliseconds(1'000), [&] { return u; });
  EXPECT_EQ(b.Next(), milliseconds(99));  // under 100
  EXPECT_EQ(b.Next(), milliseconds(199));
  EXPECT_EQ(b.Next(), milliseconds(399));
  EXPECT_EQ(b.Next(), milliseconds(799));
  EXPECT_EQ(b.Next(), milliseconds(999));  // capped
  for (int i = 0; i < 100; ++i) EXPECT_LE(b.Next(), milliseconds(1'000));
  u = 0.0;
  EXPECT_EQ(b.Next(), milliseconds(0));  // full jitter: anywhere from nothing
  b.Reset();
  u = 0.5;
  EXPECT_EQ(b.Next(), milliseconds(50));
  // The real generator stays under the cap.
  Backoff r(milliseconds(10), milliseconds(40));
  for (int i = 0; i < 1'000; ++i) {
    Millis d = r.Next();
    EXPECT_GE(d, milliseconds(0));
    EXPECT_LE(d, milliseconds(40));
  }
}

TEST(EtcdRetryTest, RetryTransientRetriesUntilSuccessAndStopsAtAFinalError) {
  Backoff b(milliseconds(1), milliseconds(2));
  OutageLog log("test", "retrying");
  int calls = 0;
  Status s = RetryTransient([&] { return ++calls < 4 ? UnavailableError("down") : OkStatus(); }, b,
                            log, [] { return false; });
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(calls, 4);
  EXPECT_FALSE(log.in_outage());
  calls = 0;
  s = RetryTransient(
      [&] { return ++calls < 3 ? DeadlineExceededError("slow") : InvalidArgumentError("bad"); }, b,
      log, [] { return false; });
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(calls, 3);
  calls = 0;
  s = RetryTransient([&] { return ++calls, UnavailableError("down"); }, b, log,
                     [&] { return calls >= 5; });
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << "give_up ends the retries with the last failure";
  EXPECT_EQ(calls, 5);
}

TEST(EtcdClientFakeTest, ResourceExhaustedIsTransientAndAnotherMemberIsTried) {
  FakeEtcd overloaded([](const std::string&, int) {
    return FakeEtcd::Grpc(429, 8, "etcdserver: too many requests");
  });
  FakeEtcd fine([](const std::string&, int) { return std::nullopt; });
  auto one = Client::Create(overloaded.endpoint(), {milliseconds(500)});
  ASSERT_TRUE(one.ok());
  auto r = (*one)->Range("k");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsTransient(r.status())) << r.status().ToString();
  EXPECT_NE(r.status().message().find("429"), std::string::npos) << r.status().message();
  auto both = Client::Create(overloaded.endpoint() + "," + fine.endpoint(), {milliseconds(500)});
  ASSERT_TRUE(both.ok());
  EXPECT_TRUE((*both)->Range("k").ok());
  EXPECT_EQ(fine.requests("kv/range"), 1);
}

TEST(LeadershipFakeTest, ACampaignRetriesA429AndWins) {
  FakeEtcd etcd([](const std::string& path, int nth) -> std::optional<FakeEtcd::Answer> {
    if (path == "kv/range" && nth <= 3)
      return FakeEtcd::Grpc(429, 8, "etcdserver: too many requests");
    // no gRPC code
    if (path == "kv/txn" && nth == 1) return FakeEtcd::Answer{429, "Too Many Requests"};
    return std::nullopt;
  });
  auto l = coord::Leadership::Connect(Options(etcd));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  auto epoch = (*l)->Campaign([] { return false; }, [](const std::string&) {});
  ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
  EXPECT_EQ(*epoch, 9);
  EXPECT_GE(etcd.requests("kv/range"), 4) << "the 429s were retried";
  EXPECT_EQ(etcd.requests("kv/txn"), 2) << "the refused transaction was tried again";
  EXPECT_TRUE((*l)->Valid());
}

TEST(LeadershipFakeTest, PermissionDeniedIsFinalAndTheErrorNamesTheKeyAndTheFix) {
  FakeEtcd etcd([](const std::string& path, int) -> std::optional<FakeEtcd::Answer> {
    if (path == "kv/range") return FakeEtcd::Grpc(403, 7, "etcdserver: permission denied");
    return std::nullopt;
  });
  auto l = coord::Leadership::Connect(Options(etcd));
  ASSERT_TRUE(l.ok());
  auto epoch = (*l)->Campaign([] { return false; }, [](const std::string&) {});
  ASSERT_FALSE(epoch.ok());
  EXPECT_NE(epoch.status().code(), StatusCode::kCancelled);
  EXPECT_FALSE(IsTransient(epoch.status()));
  const std::string& m = epoch.status().message();
  EXPECT_NE(m.find("/nonstop/t/leader"), std::string::npos) << m;
  EXPECT_NE(m.find("permission denied"), std::string::npos) << m;
  EXPECT_NE(m.find("HINT"), std::string::npos) << m;
  EXPECT_NE(m.find("auth"), std::string::npos) << m;
  EXPECT_EQ(etcd.requests("kv/range"), 1) << "a final error is not retried";
}

TEST(LeadershipFakeTest, AnInvalidRequestIsFinalToo) {
  FakeEtcd etcd([](const std::string& path, int) -> std::optional<FakeEtcd::Answer> {
    if (path == "kv/txn")
      return FakeEtcd::Grpc(400, 3, "etcdserver: too many operations in txn request");
    return std::nullopt;
  });
  auto l = coord::Leadership::Connect(Options(etcd));
  ASSERT_TRUE(l.ok());
  auto epoch = (*l)->Campaign([] { return false; }, [](const std::string&) {});
  ASSERT_FALSE(epoch.ok());
  EXPECT_EQ(epoch.status().code(), StatusCode::kInvalidArgument) << epoch.status().ToString();
  EXPECT_NE(epoch.status().message().find("/nonstop/t/leader"), std::string::npos)
      << epoch.status().message();
  EXPECT_EQ(etcd.requests("kv/txn"), 1);
  EXPECT_EQ(etcd.requests("lease/revoke"), 1)
      << "the lease granted for the refused key is given back";
}

TEST(LeadershipFakeTest, ATransactionWhoseAnswerWasLostButThatLandedMakesThisProcessTheLeader) {
  std::atomic<bool> landed{false};
  FakeEtcd etcd([&](const std::string& path, int) -> std::optional<FakeEtcd::Answer> {
    if (path == "kv/txn" && !landed) {
      landed = true;
      // past the client's 300 ms: the answer is lost
      std::this_thread::sleep_for(milliseconds(700));
      return std::nullopt;
    }
    if (path == "kv/range" && landed) {
      nlohmann::json kv = {{"key", Base64Encode("/nonstop/t/leader")},
                           {"value", Base64Encode(R"({"pid":1})")},
                           {"create_revision", "9"},
                           {"mod_revision", "9"},
                           {"lease", "7"}};
      return FakeEtcd::Answer{
          200, nlohmann::json({{"header", {{"revision", "9"}}}, {"kvs", {kv}}}).dump()};
    }
    return std::nullopt;
  });
  auto l = coord::Leadership::Connect(Options(etcd));
  ASSERT_TRUE(l.ok());
  std::string waited_on;
  auto epoch = (*l)->Campaign([] { return false; }, [&](const std::string& v) { waited_on = v; });
  ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
  EXPECT_EQ(*epoch, 9);
  EXPECT_TRUE(waited_on.empty()) << "its own key is not another leader: " << waited_on;
  EXPECT_EQ(etcd.requests("lease/revoke"), 0);
}

TEST(LeadershipFakeTest, ALeaderWhoseRenewalsAreAnswered429ForAWhileStaysTheLeader) {
  std::atomic<bool> overloaded{false};
  FakeEtcd etcd([&](const std::string& path, int) -> std::optional<FakeEtcd::Answer> {
    if (path == "lease/keepalive" && overloaded)
      return FakeEtcd::Grpc(429, 8, "etcdserver: too many requests");
    if (path == "lease/grant") return FakeEtcd::Answer{200, R"({"header":{},"ID":"7","TTL":"3"})"};
    return std::nullopt;
  });
  auto o = Options(etcd, 3);  // renewed every second, valid 2.4 s after each
  auto l = coord::Leadership::Connect(o);
  ASSERT_TRUE(l.ok());
  ASSERT_TRUE((*l)->Campaign([] { return false; }, [](const std::string&) {}).ok());
  std::this_thread::sleep_for(milliseconds(1'200));  // a renewal answered
  overloaded = true;
  for (int i = 0; i < 15; ++i) {  // 1.5 s of 429s: less than the validity left
    std::this_thread::sleep_for(milliseconds(100));
    ASSERT_FALSE((*l)->deposed()) << (*l)->why_not_leading();
  }
  int refused = etcd.requests("lease/keepalive");
  overloaded = false;
  std::this_thread::sleep_for(milliseconds(1'500));
  EXPECT_FALSE((*l)->deposed()) << (*l)->why_not_leading();
  EXPECT_TRUE((*l)->Valid()) << (*l)->why_not_leading();
  EXPECT_TRUE((*l)->final_error().ok());
  EXPECT_GE(refused, 3) << "the 429s were retried with back-off, not waited out";
}

TEST(LeadershipFakeTest,
     NoRenewalAnsweredByTheRenewDeadlineDeposesForGoodThoughEtcdStillHoldsTheLease) {
  std::atomic<bool> down{false};
  FakeEtcd etcd([&](const std::string& path, int) -> std::optional<FakeEtcd::Answer> {
    if (path == "lease/keepalive" && down) return FakeEtcd::Grpc(503, 14, "etcdserver: no leader");
    if (path == "lease/grant") return FakeEtcd::Answer{200, R"({"header":{},"ID":"7","TTL":"2"})"};
    if (path == "lease/keepalive")
      return FakeEtcd::Answer{200, R"({"result":{"ID":"7","TTL":"2"}})"};
    return std::nullopt;
  });
  // the renew deadline: 1.6 s after a renewal's send
  auto l = coord::Leadership::Connect(Options(etcd, 2));
  ASSERT_TRUE(l.ok());
  ASSERT_TRUE((*l)->Campaign([] { return false; }, [](const std::string&) {}).ok());
  down = true;
  auto t0 = std::chrono::steady_clock::now();
  while (!(*l)->deposed() && std::chrono::steady_clock::now() - t0 < milliseconds(5'000)) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE((*l)->deposed());
  EXPECT_LE(took, milliseconds(1'800)) << "deposed later than the renew deadline";
  EXPECT_FALSE((*l)->Valid());
  down = false;  // etcd answers again, and would renew the lease: too late
  std::this_thread::sleep_for(milliseconds(700));
  EXPECT_TRUE((*l)->deposed());
  EXPECT_FALSE((*l)->Valid());
  EXPECT_TRUE((*l)->final_error().ok()) << "an outage is not final";
  EXPECT_NE((*l)->why_not_leading().find("80%"), std::string::npos) << (*l)->why_not_leading();
}

TEST(LeadershipFakeTest, ThePreviousTermsLeaseIsGivenBackAtTheFirstContact) {
  std::atomic<bool> gone{false};
  FakeEtcd etcd([&](const std::string& path, int) -> std::optional<FakeEtcd::Answer> {
    if (path == "lease/revoke") gone = true;  // lease 99 and its key with it
    if (path == "kv/range" && !gone) {        // the key of the previous term, on its lease
      nlohmann::json kv = {{"key", Base64Encode("/nonstop/t/leader")},
                           {"value", Base64Encode(R"({"pid":1})")},
                           {"create_revision", "5"},
                           {"lease", "99"}};
      return FakeEtcd::Answer{
          200, nlohmann::json({{"header", {{"revision", "5"}}}, {"kvs", {kv}}}).dump()};
    }
    return std::nullopt;
  });
  auto o = Options(etcd);
  o.previous_lease = 99;
  auto l = coord::Leadership::Connect(o);
  ASSERT_TRUE(l.ok());
  std::string waited_on;
  auto epoch = (*l)->Campaign([] { return false; }, [&](const std::string& v) { waited_on = v; });
  ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
  EXPECT_EQ(etcd.requests("lease/revoke"), 1);
  EXPECT_EQ(etcd.requests("kv/range"), 1) << "the election waited out the previous term's lease";
  EXPECT_TRUE(waited_on.empty()) << waited_on;
}

TEST(LeadershipFakeTest, AStreamErrorOfTheKeepAliveIsClassedByItsGrpcCode) {
  std::atomic<int> code{14};
  FakeEtcd etcd([&](const std::string& path, int) -> std::optional<FakeEtcd::Answer> {
    if (path == "lease/keepalive") {
      return FakeEtcd::Answer{200, nlohmann::json({{"error",
                                                    {{"grpc_code", code.load()},
                                                     {"http_code", code == 14 ? 503 : 403},
                                                     {"message", "no"}}}})
                                       .dump()};
    }
    return std::nullopt;
  });
  auto c = Client::Create(etcd.endpoint());
  ASSERT_TRUE(c.ok());
  auto r = (*c)->LeaseKeepAlive(7);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsTransient(r.status())) << r.status().ToString();
  code = 7;
  r = (*c)->LeaseKeepAlive(7);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
}

}  // namespace
}  // namespace nonstop::etcd
