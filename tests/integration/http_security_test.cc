// The HTTP endpoint's guard in-process (issue 26): off loopback every
// endpoint but the dashboard's page needs the job token; HTTPS with a
// certificate made here by `openssl req -x509`; certificate and key files
// that cannot serve are refused with an error naming the file.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include "common/temp_dir.h"
#include "controller/http_api.h"
#include "net/socket.h"

namespace nonstop::controller {
namespace {

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";
// What a client wrongly presents: a refusal must never repeat it.
constexpr char kWrongToken[] = "wrong-token-that-must-not-be-echoed";

// Stands in for the controller's event loop: answers every scale call with 202.
class FakeLoop {
 public:
  explicit FakeLoop(HttpApi* api) : api_(api), thread_([this] { Run(); }) {}
  ~FakeLoop() {
    stop_ = true;
    thread_.join();
  }

 private:
  void Run() {
    while (!stop_) {
      pollfd p{api_->wake_fd(), POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      for (auto& call : api_->TakeCalls()) call->reply.set_value({202, {{"accepted", true}}});
    }
  }
  HttpApi* api_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// An IPv4 address of this machine other than loopback ("" if it has none).
std::string NonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* i = list; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text,
                sizeof(text));
    found = text;
  }
  ::freeifaddrs(list);
  return found;
}

httplib::Headers Bearer(const std::string& token) { return {{"Authorization", "Bearer " + token}}; }

// Every endpoint the dashboard and the tools use, refused without the token
// (and with a wrong one, which the reason does not repeat), served with it.
void ExpectEveryEndpointGuarded(httplib::Client& c) {
  for (const char* path : {"/status", "/metrics", "/events"}) {
    for (const httplib::Headers& h : {httplib::Headers{}, Bearer(kWrongToken)}) {
      auto res = c.Get(path, h);
      ASSERT_TRUE(res) << path << ": " << httplib::to_string(res.error());
      EXPECT_EQ(res->status, 401) << path << ": " << res->body;
      EXPECT_EQ(res->get_header_value("WWW-Authenticate"), "Bearer realm=\"nonstop\"");
      EXPECT_NE(res->body.find("\"error\""), std::string::npos) << res->body;
      EXPECT_EQ(res->body.find(kWrongToken), std::string::npos)
          << "the token echoed: " << res->body;
    }
    auto ok = c.Get(path, Bearer(kToken));
    ASSERT_TRUE(ok) << path;
    EXPECT_EQ(ok->status, 200) << path << ": " << ok->body;
  }
  auto refused = c.Post("/scale", R"({"grow": 1})", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401) << refused->body;
  auto scale = c.Post("/scale", Bearer(kToken), R"({"grow": 1})", "application/json");
  ASSERT_TRUE(scale);
  EXPECT_EQ(scale->status, 202) << scale->body;
  // The page itself holds no data: it loads, and asks for the data with the token.
  auto page = c.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  // 3 paths x 2 refusals + 1 POST: counted.
  auto metrics = c.Get("/metrics", Bearer(kToken));
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("nonstop_http_unauthorized_total 7\n"), std::string::npos)
      << metrics->body;
}

class HttpGuardTest : public ::testing::Test {
 protected:
  void Serve(const std::string& host, const HttpTls& tls = {}) {
    std::ofstream(dir_ / "journal.jsonl") << R"({"event":"start"})"
                                          << "\n";
    auto api = HttpApi::Start(host, 0, dir_ / "journal.jsonl", kToken, tls);
    ASSERT_TRUE(api.ok()) << api.status().ToString();
    api_ = std::move(*api);
    api_->Publish({{"phase", "running"}}, "nonstop_world_size 3\n");
    loop_ = std::make_unique<FakeLoop>(api_.get());
  }
  void TearDown() override {
    loop_.reset();
    api_.reset();
  }
  template <typename C>
  static void Timeouts(C& c) {
    c.set_connection_timeout(5);
    c.set_read_timeout(20);
  }

  TempDir dir_;
  std::unique_ptr<HttpApi> api_;
  std::unique_ptr<FakeLoop> loop_;
};

TEST_F(HttpGuardTest, OffLoopbackEveryEndpointNeedsTheToken) {
  const std::string ip = NonLoopbackAddress();
  if (ip.empty()) {
    std::fprintf(stderr, "this machine has no IPv4 address but loopback: skipped\n");
    GTEST_SKIP() << "no non-loopback IPv4 address on this machine (getifaddrs)";
  }
  ASSERT_NO_FATAL_FAILURE(Serve(ip));
  httplib::Client c(ip, api_->port());
  Timeouts(c);
  ExpectEveryEndpointGuarded(c);
}

// A wildcard address is off loopback too, even for a client that comes over loopback.
TEST_F(HttpGuardTest, WildcardAddressNeedsTheTokenEvenFromLoopback) {
  ASSERT_NO_FATAL_FAILURE(Serve("0.0.0.0"));
  httplib::Client c("127.0.0.1", api_->port());
  Timeouts(c);
  ExpectEveryEndpointGuarded(c);
}

TEST_F(HttpGuardTest, OnLoopbackStatusAndMetricsStayOpen) {
  ASSERT_NO_FATAL_FAILURE(Serve("127.0.0.1"));
  httplib::Client c("127.0.0.1", api_->port());
  Timeouts(c);
  for (const char* path : {"/status", "/metrics"}) {
    auto res = c.Get(path);
    ASSERT_TRUE(res) << path;
    EXPECT_EQ(res->status, 200) << path << ": " << res->body;
  }
  auto events = c.Get("/events");
  ASSERT_TRUE(events);
  EXPECT_EQ(events->status, 401) << "the journal stays behind the token on loopback";
}

// A certificate and key made by openssl for 127.0.0.1, the key mode 0600. False: no openssl.
bool MakeCertificate(const std::string& cert, const std::string& key) {
  std::string cmd = fmt::format(
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 "
      "-subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 -keyout '{}' -out '{}' "
      ">/dev/null 2>&1",
      key, cert);
  if (std::system(cmd.c_str()) != 0) return false;
  return ::chmod(key.c_str(), 0600) == 0;
}

TEST_F(HttpGuardTest, HttpsAnswersOverTlsAndRefusesPlainHttp) {
  const std::string cert = dir_ / "cert.pem", key = dir_ / "key.pem";
  ASSERT_TRUE(MakeCertificate(cert, key)) << "openssl req -x509 failed (is openssl installed?)";
  ASSERT_NO_FATAL_FAILURE(Serve("127.0.0.1", {cert, key}));
  EXPECT_STREQ(api_->scheme(), "https");

  // Idle TCP connections and stalled TLS handshakes hold no thread: a real client is served
  // meanwhile.
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 50; ++i) {
    auto fd =
        net::Dial({"127.0.0.1", static_cast<uint16_t>(api_->port())}, DeadlineAfter(Millis(5'000)));
    ASSERT_TRUE(fd.ok()) << fd.status().ToString();
    if (i % 10 == 0) {
      // a TLS record header that never goes on: the handshake waits in the gate, not in a thread
      const std::string partial("\x16\x03\x01\x00", 4);
      ASSERT_TRUE(net::SendAll(fd->get(), std::as_bytes(std::span(partial.data(), partial.size())),
                               DeadlineAfter(Millis(5'000)), nullptr, "partial hello")
                      .ok());
    }
    idle.push_back(std::move(*fd));
  }
  httplib::SSLClient tls("127.0.0.1", api_->port());
  // A correctness bound under the gate's 3 s request deadline: were handshakes run in the workers,
  // the stalled ones would hold all 4 for 3 s.
  tls.set_connection_timeout(2);
  tls.set_read_timeout(2);
  tls.set_ca_cert_path(cert);
  auto status = tls.Get("/status");
  ASSERT_TRUE(status) << httplib::to_string(status.error());
  EXPECT_EQ(status->status, 200);
  EXPECT_NE(status->body.find("running"), std::string::npos) << status->body;
  auto events = tls.Get("/events", Bearer(kToken));
  ASSERT_TRUE(events) << httplib::to_string(events.error());
  EXPECT_EQ(events->status, 200);
  EXPECT_NE(events->body.find("start"), std::string::npos);
  auto scale = tls.Post("/scale", Bearer(kToken), R"({"grow": 1})", "application/json");
  ASSERT_TRUE(scale) << httplib::to_string(scale.error());
  EXPECT_EQ(scale->status, 202) << scale->body;
  auto refused = tls.Post("/scale", R"({"grow": 1})", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);

  // A client that does not trust the certificate gets no answer.
  httplib::SSLClient untrusting("127.0.0.1", api_->port());
  Timeouts(untrusting);
  auto unverified = untrusting.Get("/status");
  EXPECT_FALSE(unverified) << "a self-signed certificate verified without its CA";

  httplib::Client plain("127.0.0.1", api_->port());
  Timeouts(plain);
  auto res = plain.Get("/status");
  ASSERT_TRUE(res) << "plain HTTP got no answer: " << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 400) << res->body;
  EXPECT_NE(res->body.find("serves HTTPS"), std::string::npos) << res->body;
}

// Start's error for these files: it must name `names` (each) and contain `hint`.
void ExpectRefused(const HttpTls& tls, std::vector<std::string> names, const std::string& hint) {
  TempDir dir;
  auto api = HttpApi::Start("127.0.0.1", 0, dir / "j.jsonl", kToken, tls);
  ASSERT_FALSE(api.ok()) << "served with " << tls.cert_path << " and " << tls.key_path;
  EXPECT_EQ(api.status().code(), StatusCode::kInvalidArgument) << api.status().ToString();
  for (const auto& name : names) {
    EXPECT_NE(api.status().message().find(name), std::string::npos) << api.status().ToString();
  }
  EXPECT_NE(api.status().message().find(hint), std::string::npos) << api.status().ToString();
}

TEST(HttpTlsFilesTest, BadCertificateOrKeyFilesAreRefusedNamingTheFile) {
  TempDir dir;
  const std::string cert = dir / "cert.pem", key = dir / "key.pem";
  ASSERT_TRUE(MakeCertificate(cert, key)) << "openssl req -x509 failed (is openssl installed?)";
  const std::string other_cert = dir / "other-cert.pem", other_key = dir / "other-key.pem";
  ASSERT_TRUE(MakeCertificate(other_cert, other_key));
  const std::string junk = dir / "junk.pem";
  std::ofstream(junk) << "not a certificate\n";
  ::chmod(junk.c_str(), 0600);
  const std::string missing = dir / "missing.pem";

  ExpectRefused({missing, key}, {missing}, "No such file");
  ExpectRefused({cert, missing}, {missing}, "No such file");
  ExpectRefused({junk, key}, {junk}, "no PEM certificate");
  ExpectRefused({cert, junk}, {junk}, "no unencrypted PEM private key");
  ExpectRefused({cert, other_key}, {other_key, cert}, "not the private key");
  ExpectRefused({cert, ""}, {}, "both --http-cert and --http-key");
  ASSERT_EQ(::chmod(key.c_str(), 0644), 0);
  ExpectRefused({cert, key}, {key}, "chmod 600");
  ASSERT_EQ(::chmod(key.c_str(), 0600), 0);
  // The pair itself serves.
  EXPECT_TRUE(HttpApi::Start("127.0.0.1", 0, dir / "j.jsonl", kToken, {cert, key}).ok());
  if (::geteuid() != 0) {  // root reads any file
    ASSERT_EQ(::chmod(cert.c_str(), 0), 0);
    ExpectRefused({cert, key}, {cert}, "Permission denied");
  }
}

}  // namespace
}  // namespace nonstop::controller
