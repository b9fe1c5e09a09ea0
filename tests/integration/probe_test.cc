// Every port of a real `nonstop run` probed with junk while the job trains:
// the workers' data ports, the controller's control port and the HTTP
// endpoint get garbage bytes, frame headers with huge lengths, hellos that stop
// halfway or carry the wrong token, many idle connections, and junk HTTP
// requests. The job must not notice: it finishes with rc 0 and the checksum of
// the same job run without probes, and every junk HTTP request gets a 4xx
// whose body names the reason.
#include <gtest/gtest.h>
#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>

#include <fstream>
#include <sstream>

#include "common/coding.h"
#include "common/crypto.h"
#include "common/job_token.h"
#include "common/temp_dir.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;
constexpr int kSteps = 150;

std::vector<std::string> JobArgs(const std::string& journal, const std::string& inject = "none") {
  return {kBin + "/nonstop",
          "run",
          "--nproc",
          "3",
          "--spares",
          "1",
          "--inject",
          inject,
          "--journal",
          journal,
          "--",
          kBin + "/nonstop-test-worker",
          "--steps",
          std::to_string(kSteps),
          "--elements",
          "100003",
          "--sleep-ms",
          "20"};
}

// The checksum every member reported when the job finished ("" if none).
std::string FinalChecksum(const std::string& journal) {
  auto finished = nonstop::testing::JournalEvents(journal, "finished");
  return finished.empty() ? "" : finished[0].value("checksum", "");
}

nlohmann::json ReadJobFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str(), nullptr, false);
}

// Opens connections to `address` and sends junk on them; keeps them open
// (idle ones included) until destroyed.
class Prober {
 public:
  explicit Prober(std::string address) : address_(std::move(address)) {
    auto where = net::ParseHostPort(address_);
    NONSTOP_CHECK(where.ok()) << where.status().ToString();
    where_ = *where;
  }

  int Open() {
    auto fd = net::Dial(where_, DeadlineAfter(milliseconds(5'000)));
    if (!fd.ok()) {
      ADD_FAILURE() << "cannot connect to " << address_ << ": " << fd.status().ToString();
      return -1;
    }
    conns_.push_back(std::move(*fd));
    return conns_.back().get();
  }
  void Send(std::string_view bytes) {
    int fd = Open();
    if (fd < 0) return;
    // Best effort: the other side may close as soon as it has seen enough.
    (void)net::SendAll(fd, std::as_bytes(std::span(bytes.data(), bytes.size())),
                       DeadlineAfter(milliseconds(2'000)), nullptr, "probe");
  }
  void Idle(int n) {
    for (int i = 0; i < n; ++i) Open();
  }
  // Everything a nonstop port must survive.
  void AllJunk(int idle) {
    Idle(idle);
    Send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    Send(std::string(64 << 10, '\xff'));
    std::string header;
    PutFixed32(&header, 0xFFFFFFF0u);  // a frame of almost 4 GiB
    PutFixed16(&header, net::kFrameHello);
    PutFixed16(&header, 0);
    PutFixed32(&header, 0);
    Send(header);
    // a hello that stops halfway
    Send(net::EncodeFrame(net::kFrameHello, std::string(60, 'x')).substr(0, 20));
    for (auto kind : {net::ConnectionKind::kData, net::ConnectionKind::kControl}) {
      net::Hello h;
      h.kind = kind;
      h.worker_id = 0;
      h.generation = 1;
      // A hello, then a proof made up without the key.
      h.nonce = crypto::RandomBytes(crypto::kNonceBytes);
      Send(net::EncodeFrame(net::kFrameHello, net::EncodeHello(h)) +
           net::EncodeFrame(net::kFrameProof, std::string(crypto::kMacBytes, 'p')));
      // A hello with a nonce of the wrong size, and a negative worker id.
      h.nonce = "short";
      h.worker_id = -7;
      Send(net::EncodeFrame(net::kFrameHello, net::EncodeHello(h)));
    }
    Idle(idle);
  }

 private:
  std::string address_;
  net::HostPort where_;
  std::vector<UniqueFd> conns_;
};

// Sends junk HTTP requests; every one must get a 4xx with a JSON reason.
void ProbeHttp(const std::string& address, const std::string& token) {
  auto colon = address.rfind(':');
  httplib::Client c(address.substr(0, colon), std::stoi(address.substr(colon + 1)));
  c.set_connection_timeout(5);
  c.set_read_timeout(20);
  httplib::Headers auth = {{"Authorization", "Bearer " + token}};
  std::vector<std::pair<std::string, httplib::Result>> answers;
  answers.emplace_back("GET /nowhere", c.Get("/nowhere"));
  answers.emplace_back("GET /scale", c.Get("/scale"));
  answers.emplace_back("PUT /status", c.Put("/status", "{}", "application/json"));
  answers.emplace_back("DELETE /scale", c.Delete("/scale"));
  answers.emplace_back("malformed JSON",
                       c.Post("/scale", auth, "{\"world_size\": ", "application/json"));
  answers.emplace_back("JSON array", c.Post("/scale", auth, "[3]", "application/json"));
  answers.emplace_back("wrong type",
                       c.Post("/scale", auth, R"({"world_size": "three"})", "application/json"));
  answers.emplace_back(
      "unknown key", c.Post("/scale", auth, R"({"shrink_everything": true})", "application/json"));
  answers.emplace_back("a form",
                       c.Post("/scale", auth, "world_size=3", "application/x-www-form-urlencoded"));
  answers.emplace_back("1 MiB body",
                       c.Post("/scale", auth, std::string(1 << 20, '{'), "application/json"));
  answers.emplace_back("junk without a token",
                       c.Post("/scale", "\x01\x02\x03", "application/octet-stream"));
  for (auto& [what, res] : answers) {
    ASSERT_TRUE(res) << what << ": no answer (" << httplib::to_string(res.error()) << ")";
    EXPECT_GE(res->status, 400) << what << ": " << res->body;
    EXPECT_LT(res->status, 500) << what << ": " << res->body;
    auto j = nlohmann::json::parse(res->body, nullptr, false);
    EXPECT_TRUE(j.is_object() && !j.value("error", "").empty())
        << what << ": no reason in '" << res->body << "'";
  }
}

class ProbeTest : public ::testing::Test {
 protected:
  // The same job without probes, once per test binary.
  static const std::string& Reference() {
    static const std::string checksum = [] {
      TempDir d;
      ChildProcess p(JobArgs(d / "journal.jsonl"), d / "out.txt");
      EXPECT_EQ(p.Wait(milliseconds(90'000)), 0) << p.Output();
      return FinalChecksum(d / "journal.jsonl");
    }();
    return checksum;
  }

  void StartJob(const std::string& inject = "none") {
    job_ = std::make_unique<ChildProcess>(JobArgs(journal_, inject), dir_ / "out.txt");
    ASSERT_TRUE(nonstop::testing::WaitForEvents(journal_, "step", 3, milliseconds(60'000)))
        << job_->Output();
    job_file_ = ReadJobFile(dir_ / "job.json");
    ASSERT_TRUE(job_file_.is_object()) << "no job file beside the journal";
  }
  // The job ends as if nobody had probed it (`recoveries`: the injected faults).
  void ExpectUndisturbed(size_t recoveries = 0) {
    int code = job_->Wait(milliseconds(90'000));
    std::string out = job_->Output();
    EXPECT_EQ(code, 0) << out;
    ASSERT_FALSE(Reference().empty());
    EXPECT_EQ(FinalChecksum(journal_), Reference()) << out;
    EXPECT_EQ(nonstop::testing::JournalEvents(journal_, "step").size(), static_cast<size_t>(kSteps))
        << out;
    EXPECT_EQ(nonstop::testing::JournalEvents(journal_, "recovery_end").size(), recoveries) << out;
  }

  TempDir dir_;
  std::string journal_ = dir_ / "journal.jsonl";
  std::unique_ptr<ChildProcess> job_;
  nlohmann::json job_file_;
};

// Rank 1 is killed after the probes are in place, so the spare takes its rank
// and the members must open new data connections into ports full of junk.
TEST_F(ProbeTest, JunkOnTheDataPortsAndTheHttpEndpointDoesNotDisturbTheJob) {
  ASSERT_FALSE(Reference().empty());
  StartJob("kill:rank=1,step=100");
  std::vector<std::unique_ptr<Prober>> probers;
  auto joins = nonstop::testing::JournalEvents(journal_, "join");
  ASSERT_GE(joins.size(), 3u);
  for (auto& j : joins) {
    probers.push_back(std::make_unique<Prober>(j["address"].get<std::string>()));
    probers.back()->AllJunk(/*idle=*/40);
  }
  std::string http = job_file_["http"];
  probers.push_back(std::make_unique<Prober>(http));
  probers.back()->Idle(150);
  ProbeHttp(http, HttpCredential(ReadJobTokenFile(job_file_["token_file"]).value()));
  EXPECT_LT(nonstop::testing::JournalEvents(journal_, "step").size(), 100u)
      << "probed too late to matter";
  ExpectUndisturbed(/*recoveries=*/1);
}

// The control port stays usable for a recovery while it is full of junk.
TEST_F(ProbeTest, JunkOnTheControlPortDoesNotDisturbTheJob) {
  ASSERT_FALSE(Reference().empty());
  StartJob("kill:rank=1,step=100");
  Prober control(job_file_["controller"].get<std::string>());
  control.AllJunk(/*idle=*/40);
  EXPECT_LT(nonstop::testing::JournalEvents(journal_, "step").size(), 100u)
      << "probed too late to matter";
  ExpectUndisturbed(/*recoveries=*/1);
}

TEST_F(ProbeTest, UnauthenticatedScaleIsRefusedDuringARealJob) {
  StartJob();
  std::string http = job_file_["http"];
  auto colon = http.rfind(':');
  httplib::Client c(http.substr(0, colon), std::stoi(http.substr(colon + 1)));
  c.set_read_timeout(20);
  for (const httplib::Headers& headers :
       {httplib::Headers{}, httplib::Headers{{"Authorization", "Bearer nope"}}}) {
    auto res = c.Post("/scale", headers, R"({"world_size": 2})", "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 401) << res->body;
  }
  auto events = c.Get("/events");
  ASSERT_TRUE(events);
  EXPECT_EQ(events->status, 401);
  // /status (open on loopback) tells the job, never its token.
  auto status = c.Get("/status");
  ASSERT_TRUE(status);
  EXPECT_EQ(status->status, 200);
  EXPECT_NE(status->body.find("\"phase\""), std::string::npos) << status->body;
  EXPECT_EQ(status->body.find(ReadJobTokenFile(job_file_["token_file"]).value()), std::string::npos)
      << "the job token is in /status: " << status->body;
  ExpectUndisturbed();
}

}  // namespace
}  // namespace nonstop
