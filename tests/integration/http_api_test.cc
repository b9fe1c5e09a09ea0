// The controller's HTTP endpoint in-process: authentication, answers to junk,
// and idle or slow connections that must not starve a real request.
#include "controller/http_api.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>

#include <fmt/format.h>

#include "common/temp_dir.h"
#include "net/socket.h"

namespace nonstop::controller {
namespace {

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

// Stands in for the controller's event loop: answers every scale call with 202.
class FakeLoop {
 public:
  explicit FakeLoop(HttpApi* api) : api_(api), thread_([this] { Run(); }) {}
  ~FakeLoop() {
    stop_ = true;
    thread_.join();
  }
  int answered() const { return answered_; }

 private:
  void Run() {
    while (!stop_) {
      pollfd p{api_->wake_fd(), POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      for (auto& call : api_->TakeCalls()) {
        ++answered_;  // before the answer: the client may look as soon as it has it
        call->reply.set_value({202, {{"accepted", true}, {"echo", call->body}}});
      }
    }
  }
  HttpApi* api_;
  std::atomic<bool> stop_{false};
  std::atomic<int> answered_{0};
  std::thread thread_;
};

class HttpApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream(dir_ / "journal.jsonl") << R"({"event":"start"})"
                                          << "\n";
    auto api = HttpApi::Start("127.0.0.1", 0, dir_ / "journal.jsonl", kToken);
    ASSERT_TRUE(api.ok()) << api.status().ToString();
    api_ = std::move(*api);
    loop_ = std::make_unique<FakeLoop>(api_.get());
  }
  void TearDown() override {
    loop_.reset();
    api_.reset();
  }

  httplib::Client Client() {
    httplib::Client c("127.0.0.1", api_->port());
    c.set_connection_timeout(5);
    c.set_read_timeout(20);
    return c;
  }
  static httplib::Headers Bearer(const std::string& token) {
    return {{"Authorization", "Bearer " + token}};
  }

  // A 4xx whose body is JSON with a non-empty "error".
  static void ExpectRefusal(const httplib::Result& res, int status, const std::string& what) {
    ASSERT_TRUE(res) << what << ": no answer (" << httplib::to_string(res.error()) << ")";
    EXPECT_EQ(res->status, status) << what << ": " << res->body;
    auto j = nlohmann::json::parse(res->body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << what << ": body is not JSON: '" << res->body << "'";
    EXPECT_FALSE(j.value("error", "").empty()) << what << ": " << res->body;
  }

  TempDir dir_;
  std::unique_ptr<HttpApi> api_;
  std::unique_ptr<FakeLoop> loop_;
};

TEST(HttpApiStartTest, NonLoopbackHostWithoutATokenIsRefused) {
  TempDir dir;
  auto api = HttpApi::Start("0.0.0.0", 0, dir / "j.jsonl", "");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(api.status().message().find("without a job token"), std::string::npos)
      << api.status().ToString();
  // With a token it serves, and loopback without one stays possible.
  EXPECT_TRUE(HttpApi::Start("0.0.0.0", 0, dir / "j.jsonl", kToken).ok());
  EXPECT_TRUE(HttpApi::Start("127.0.0.1", 0, dir / "j.jsonl", "").ok());
}

TEST(HttpApiStartTest, LoopbackHosts) {
  EXPECT_TRUE(IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(IsLoopbackHost("127.1.2.3"));
  EXPECT_TRUE(IsLoopbackHost("localhost"));
  EXPECT_TRUE(IsLoopbackHost("::1"));
  EXPECT_FALSE(IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(IsLoopbackHost("10.0.0.1"));
  EXPECT_FALSE(IsLoopbackHost("example.org"));
}

TEST_F(HttpApiTest, ScaleAndEventsNeedTheJobToken) {
  auto c = Client();
  ExpectRefusal(c.Post("/scale", R"({"grow": 1})", "application/json"), 401, "no token");
  ExpectRefusal(c.Post("/scale", Bearer("wrong"), R"({"grow": 1})", "application/json"), 401,
                "wrong token");
  ExpectRefusal(
      c.Post("/scale", Bearer(std::string(kToken) + "x"), R"({"grow": 1})", "application/json"),
      401, "token with a suffix");
  ExpectRefusal(c.Post("/scale", {{"Authorization", kToken}}, R"({"grow": 1})", "application/json"),
                401, "token without the Bearer scheme");
  ExpectRefusal(c.Get("/events"), 401, "events without a token");
  EXPECT_EQ(loop_->answered(), 0) << "a refused request reached the controller";

  auto scale = c.Post("/scale", Bearer(kToken), R"({"grow": 1})", "application/json");
  ASSERT_TRUE(scale);
  EXPECT_EQ(scale->status, 202) << scale->body;
  EXPECT_EQ(loop_->answered(), 1);
  auto events = c.Get("/events", Bearer(kToken));
  ASSERT_TRUE(events);
  EXPECT_EQ(events->status, 200);
  EXPECT_NE(events->body.find("start"), std::string::npos);
  auto unauthorized = c.Get("/events");
  ASSERT_TRUE(unauthorized);
  EXPECT_EQ(unauthorized->get_header_value("WWW-Authenticate"), "Bearer realm=\"nonstop\"");
}

TEST_F(HttpApiTest, StatusAndMetricsStayOpen) {
  api_->Publish({{"phase", "running"}}, "nonstop_world_size 3\n");
  auto c = Client();
  auto status = c.Get("/status");
  ASSERT_TRUE(status);
  EXPECT_EQ(status->status, 200);
  EXPECT_NE(status->body.find("running"), std::string::npos);
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  EXPECT_EQ(metrics->body.substr(0, metrics->body.find('#')), "nonstop_world_size 3\n");
  EXPECT_NE(metrics->body.find("nonstop_http_unauthorized_total 0\n"), std::string::npos)
      << metrics->body;
}

TEST_F(HttpApiTest, JunkRequestsGetA4xxWithAReason) {
  auto c = Client();
  auto auth = Bearer(kToken);
  ExpectRefusal(c.Get("/nowhere"), 404, "unknown path");
  ExpectRefusal(c.Get("/scale"), 405, "GET /scale");
  ExpectRefusal(c.Post("/status", "{}", "application/json"), 405, "POST /status");
  ExpectRefusal(c.Delete("/scale", auth), 405, "DELETE /scale");
  ExpectRefusal(c.Post("/scale", auth, "{not json", "application/json"), 400, "malformed JSON");
  ExpectRefusal(c.Post("/scale", auth, "[1, 2]", "application/json"), 400, "a JSON array");
  ExpectRefusal(c.Post("/scale", auth, "", "application/json"), 400, "an empty body");
  ExpectRefusal(c.Post("/scale", auth, "world_size=3", "application/x-www-form-urlencoded"), 415,
                "a form");
  ExpectRefusal(c.Post("/scale", auth, std::string(100 << 10, ' ') + "{}", "application/json"), 413,
                "100 KiB body");
  auto head = c.Get("/scale");
  ASSERT_TRUE(head);
  EXPECT_EQ(head->get_header_value("Allow"), "POST");
  EXPECT_EQ(loop_->answered(), 0) << "junk reached the controller";
}

std::string RawExchange(int port, const std::string& bytes) {
  auto fd = net::Dial({"127.0.0.1", static_cast<uint16_t>(port)}, DeadlineAfter(Millis(5'000)));
  NONSTOP_CHECK(fd.ok()) << fd.status().ToString();
  NONSTOP_CHECK(net::SendAll(fd->get(), std::as_bytes(std::span(bytes.data(), bytes.size())),
                             DeadlineAfter(Millis(5'000)), nullptr, "raw")
                    .ok());
  std::string answer;
  char buf[4096];
  Deadline until = DeadlineAfter(Millis(15'000));
  while (net::WaitFd(fd->get(), POLLIN, until, nullptr, "raw").ok()) {
    ssize_t n = ::recv(fd->get(), buf, sizeof(buf), 0);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  return answer;
}

TEST_F(HttpApiTest, MalformedRequestLinesGetA4xxWithAReason) {
  for (const std::string& junk :
       {std::string("NONSENSE\r\n\r\n"), std::string("GET\r\n\r\n"),
        std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 15),
        "GET /" + std::string(20'000, 'a') + " HTTP/1.1\r\n\r\n"}) {
    std::string answer = RawExchange(api_->port(), junk);
    ASSERT_GE(answer.size(), 12u) << "no answer to " << junk.substr(0, 40);
    EXPECT_EQ(answer[9], '4') << answer;
    EXPECT_NE(answer.find("\"error\""), std::string::npos) << answer;
  }
}

TEST_F(HttpApiTest, ClientThatWaitsFor100ContinueIsServed) {
  std::string body = R"({"grow": 1})";
  std::string head = fmt::format(
      "POST /scale HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n"
      "Content-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
      kToken, body.size());
  auto fd =
      net::Dial({"127.0.0.1", static_cast<uint16_t>(api_->port())}, DeadlineAfter(Millis(5'000)));
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(net::SendAll(fd->get(), std::as_bytes(std::span(head.data(), head.size())),
                           DeadlineAfter(Millis(5'000)), nullptr, "head")
                  .ok());
  char buf[4096];
  ASSERT_TRUE(net::WaitFd(fd->get(), POLLIN, DeadlineAfter(Millis(10'000)), nullptr, "100").ok());
  ssize_t n = ::recv(fd->get(), buf, sizeof(buf), 0);
  ASSERT_GT(n, 0);
  EXPECT_NE(std::string(buf, static_cast<size_t>(n)).find("100 Continue"), std::string::npos);
  ASSERT_TRUE(net::SendAll(fd->get(), std::as_bytes(std::span(body.data(), body.size())),
                           DeadlineAfter(Millis(5'000)), nullptr, "body")
                  .ok());
  std::string answer;
  while (net::WaitFd(fd->get(), POLLIN, DeadlineAfter(Millis(10'000)), nullptr, "answer").ok()) {
    n = ::recv(fd->get(), buf, sizeof(buf), 0);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  EXPECT_NE(answer.find("202"), std::string::npos) << answer;
}

TEST_F(HttpApiTest, RequestNotSentInTimeGets408) {
  // never finished
  std::string answer = RawExchange(api_->port(), "POST /scale HTTP/1.1\r\nHost: x\r\n");
  EXPECT_NE(answer.find("408"), std::string::npos) << answer;
  EXPECT_NE(answer.find("\"error\""), std::string::npos) << answer;
}

// Regression: each connection held one of httplib's 8 pool threads for as long
// as it stayed open, so idle connections starved a real POST /scale.
TEST_F(HttpApiTest, IdleAndSlowConnectionsDoNotStarveARealRequest) {
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 200; ++i) {
    auto fd =
        net::Dial({"127.0.0.1", static_cast<uint16_t>(api_->port())}, DeadlineAfter(Millis(5'000)));
    ASSERT_TRUE(fd.ok()) << fd.status().ToString();
    if (i % 10 == 0) {
      // a slow client: head never finished
      std::string partial = "POST /scale HTTP/1.1\r\nHost: x\r\n";
      ASSERT_TRUE(net::SendAll(fd->get(), std::as_bytes(std::span(partial.data(), partial.size())),
                               DeadlineAfter(Millis(5'000)), nullptr, "slow")
                      .ok());
    }
    idle.push_back(std::move(*fd));
  }
  auto c = Client();
  c.set_read_timeout(8);  // a correctness bound: with the pool starved it would wait minutes
  auto res = c.Post("/scale", Bearer(kToken), R"({"world_size": 3})", "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 202) << res->body;
}

}  // namespace
}  // namespace nonstop::controller
