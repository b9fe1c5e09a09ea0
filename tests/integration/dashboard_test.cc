// The dashboard and the report in a real headless browser (Debian's
// chromium): a real job with an injected fault, its page loaded from the
// controller, and `nonstop report` of its journal opened from a file. The
// browser reaches nothing but loopback: every other address goes to a
// closed local proxy port and resolves to nothing.
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/job_token.h"
#include "common/temp_dir.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;
const auto& Events = nonstop::testing::JournalEvents;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// What the page's DOM is after its scripts ran (and its polls answered), and
// what the browser logged. `screenshot`: also a PNG of the page there.
struct Page {
  std::string dom, log;
};
Page Browse(const TempDir& dir, const std::string& url, const std::string& tag,
            const std::string& screenshot = "") {
  const char* chromium = "/usr/bin/chromium";
  EXPECT_TRUE(std::filesystem::exists(chromium))
      << "chromium is missing: scripts/setup.sh installs it";
  std::string flags =
      "--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
      "--no-default-browser-check "
      "--disable-background-networking --disable-component-update --disable-sync "
      "--disable-default-apps "
      "--disable-extensions --proxy-server=127.0.0.1:9 --host-resolver-rules='MAP * ~NOTFOUND , "
      "EXCLUDE 127.0.0.1' "
      "--user-data-dir=" +
      (dir / ("profile-" + tag)) +
      " --enable-logging=stderr --v=0 --virtual-time-budget=4000 "
      "--window-size=1400,1500 --hide-scrollbars";
  std::string cmd = fmt::format("{} {} --dump-dom '{}' > {} 2> {}", chromium, flags, url,
                                dir / (tag + ".dom"), dir / (tag + ".log"));
  ChildProcess run({"/bin/sh", "-c", cmd}, dir / (tag + ".out"));
  EXPECT_EQ(run.Wait(milliseconds(60'000)), 0) << run.Output() << ReadFile(dir / (tag + ".log"));
  if (!screenshot.empty()) {
    std::filesystem::create_directories(std::filesystem::path(screenshot).parent_path());
    std::string shot = fmt::format("{} {} --screenshot={} '{}' > /dev/null 2>&1", chromium, flags,
                                   screenshot, url);
    ChildProcess s({"/bin/sh", "-c", shot}, dir / (tag + "-shot.out"));
    EXPECT_EQ(s.Wait(milliseconds(60'000)), 0) << s.Output();
    EXPECT_TRUE(std::filesystem::exists(screenshot));
  }
  return {ReadFile(dir / (tag + ".dom")), ReadFile(dir / (tag + ".log"))};
}

int Points(const std::string& dom, const std::string& chart) {
  std::smatch m;
  std::regex re("<figure[^>]*data-points=\"(\\d+)\"[^>]*>\\s*<figcaption>" + chart);
  return std::regex_search(dom, m, re) ? std::stoi(m[1]) : -1;
}

void ExpectNoPageError(const Page& p) {
  EXPECT_NE(p.dom.find("<pre id=\"errors\" hidden=\"\"></pre>"), std::string::npos)
      << "the page caught an error, or did not load\n"
      << p.dom.substr(0, 4000) << "\nthe browser's log:\n"
      << p.log.substr(0, 4000);
  EXPECT_EQ(p.log.find("Uncaught"), std::string::npos) << p.log;
  EXPECT_EQ(p.log.find(":ERROR:CONSOLE"), std::string::npos) << p.log;
}

TEST(DashboardBrowserTest, TheLiveDashboardAndTheReportShowTheRunAndItsRecovery) {
  TempDir dir;
  const std::string journal = dir / "journal.jsonl";
  ChildProcess job({kBin + "/nonstop", "run", "--nproc", "3", "--spares", "1", "--inject",
                    "kill:rank=1,step=30", "--journal", journal, "--",
                    kBin + "/nonstop-test-worker", "--steps", "100000", "--sleep-ms", "15"},
                   dir / "job.out");
  auto until = std::chrono::steady_clock::now() + milliseconds(60'000);
  while (Events(journal, "recovery_end").empty() || Events(journal, "step").size() < 60) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << job.Output();
    std::this_thread::sleep_for(milliseconds(50));
  }
  auto job_file = nlohmann::json::parse(ReadFile(dir / "job.json"));
  const std::string http = job_file["http"];
  const std::string token = HttpCredential(ReadJobTokenFile(job_file["token_file"]).value());
  const std::string url = "http://" + http + "/#token=" + token;
  EXPECT_NE(job.Output().find("dashboard            http://" + http + "/ (add #token="),
            std::string::npos)
      << "nonstop run prints the dashboard's address, and not the token where it is not a "
         "terminal\n"
      << job.Output();
  EXPECT_EQ(job.Output().find(token), std::string::npos) << job.Output();

  Page first = Browse(dir, url, "live1");
  ExpectNoPageError(first);
  int before = Points(first.dom, "Loss");
  EXPECT_GT(before, 0) << first.dom.substr(0, 3000);
  // Within one load the page polls, and the chart gains the steps trained since its first drawing.
  std::smatch first_points;
  ASSERT_TRUE(
      std::regex_search(first.dom, first_points,
                        std::regex("data-first-points=\"(\\d+)\"[^>]*>\\s*<figcaption>Loss")))
      << first.dom.substr(0, 3000);
  EXPECT_GT(before, std::stoi(first_points[1])) << "the live page did not poll";
  // The fault on the time axis, with its phases.
  EXPECT_NE(first.dom.find("class=\"marker recovery\" data-recovery=\"1\""), std::string::npos)
      << first.dom;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(first.dom, m, std::regex("<tr data-recovery=\"1\">(.*?)</tr>")))
      << first.dom;
  std::string row = m[1];
  EXPECT_NE(row.find("kill:rank=1,step=30"), std::string::npos) << row;
  EXPECT_NE(row.find("spare (rank 1: worker 1 → spare worker 3)"), std::string::npos) << row;
  EXPECT_NE(row.find("completed"), std::string::npos) << row;
  // It leads with the time the fault cost the job, its split on hover (issue 27), and that as a
  // fraction of the job's normal step (the test worker reports each step's duration).
  EXPECT_TRUE(std::regex_search(
      row,
      std::regex("<td class=\"num time-lost\" title=\"in_flight -?[\\d.]+ ms, detect -?[\\d.]+ "
                 "ms, abort [^\"]*\">-?[\\d.]+ ms \\(-?[\\d.]+ of a step\\)</td>")))
      << row;
  EXPECT_NE(first.dom.find("<span>time lost to faults</span>"), std::string::npos);
  // The member table: the spare holds rank 1 now.
  EXPECT_TRUE(std::regex_search(
      first.dom, std::regex("<tr class=\"member\" data-worker=\"3\"><td class=\"num\">1</td>")))
      << first.dom;

  Page second = Browse(dir, url, "live2", std::string(NONSTOP_BIN_DIR) + "/../dashboard.png");
  ExpectNoPageError(second);

  // /metrics says the same.
  httplib::Client c(http);
  auto metrics = c.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(
      metrics->body.find(
          "nonstop_recoveries_total{handled=\"spare\",kind=\"recovery\",outcome=\"completed\"} 1"),
      std::string::npos)
      << metrics->body;
  EXPECT_NE(metrics->body.find("nonstop_world_size 3"), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("nonstop_fault_time_lost_seconds_count 1"), std::string::npos)
      << metrics->body;
  EXPECT_NE(metrics->body.find("nonstop_goodput_ratio "), std::string::npos) << metrics->body;
  // Without the token the page loads, but the journal does not.
  auto events = c.Get("/events");
  ASSERT_TRUE(events);
  EXPECT_EQ(events->status, 401);

  ASSERT_EQ(::kill(job.pid(), SIGINT), 0);
  job.Wait(milliseconds(30'000));

  // The report of that journal, from a file, with no server.
  ChildProcess report({kBin + "/nonstop", "report", journal, "--output", dir / "report.html"},
                      dir / "report.out");
  ASSERT_EQ(report.Wait(milliseconds(30'000)), 0) << report.Output();
  EXPECT_NE(report.Output().find("1 recoveries and resizes"), std::string::npos) << report.Output();
  Page rep = Browse(dir, "file://" + (dir / "report.html"), "report-view",
                    std::string(NONSTOP_BIN_DIR) + "/../report.png");
  ExpectNoPageError(rep);
  EXPECT_NE(rep.dom.find("nonstop report: " + journal), std::string::npos);
  EXPECT_TRUE(std::regex_search(
      rep.dom,
      std::regex("<tr data-recovery=\"1\">.*?kill:rank=1,step=30.*?completed.*?"
                 "class=\"num time-lost\"[^>]*>-?[\\d.]+ ms \\(-?[\\d.]+ of a step\\)</td>")))
      << rep.dom.substr(0, 4000);
  EXPECT_NE(rep.dom.find("<div class=\"card\"><b>1</b><span>recoveries</span></div>"),
            std::string::npos)
      << rep.dom.substr(0, 3000);
  EXPECT_GT(Points(rep.dom, "Loss"), 0);
}

// Off loopback (here the wildcard 0.0.0.0, browsed over 127.0.0.1) /status needs the token too:
// the page sends the fragment's token with every request, and without one it says so.
TEST(DashboardBrowserTest, OffLoopbackThePageSendsTheTokenWithEveryRequest) {
  TempDir dir;
  const std::string journal = dir / "journal.jsonl";
  ChildProcess job({kBin + "/nonstop", "run", "--nproc", "2", "--inject", "none", "--http-host",
                    "0.0.0.0", "--journal", journal, "--", kBin + "/nonstop-test-worker", "--steps",
                    "100000", "--sleep-ms", "15"},
                   dir / "job.out");
  auto until = std::chrono::steady_clock::now() + milliseconds(60'000);
  while (Events(journal, "step").size() < 20) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << job.Output();
    std::this_thread::sleep_for(milliseconds(50));
  }
  auto job_file = nlohmann::json::parse(ReadFile(dir / "job.json"));
  const std::string http = job_file["http"];
  const std::string token = HttpCredential(ReadJobTokenFile(job_file["token_file"]).value());
  const std::string port = http.substr(http.rfind(':') + 1);
  httplib::Client c("127.0.0.1", std::stoi(port));
  auto status = c.Get("/status");
  ASSERT_TRUE(status);
  EXPECT_EQ(status->status, 401) << "off loopback /status needs the token: " << status->body;

  Page with = Browse(dir, "http://127.0.0.1:" + port + "/#token=" + token, "wildcard");
  ExpectNoPageError(with);
  EXPECT_GT(Points(with.dom, "Loss"), 0) << with.dom.substr(0, 3000);
  // The member table is drawn from /status.
  EXPECT_NE(with.dom.find("<tr class=\"member\" data-worker=\"0\">"), std::string::npos)
      << "no /status: " << with.dom.substr(0, 4000);
  std::smatch note;
  ASSERT_TRUE(std::regex_search(with.dom, note, std::regex("<p id=\"note\">([^<]*)</p>")));
  EXPECT_EQ(note[1].str().find("needs the job token"), std::string::npos) << note[1];

  Page without = Browse(dir, "http://127.0.0.1:" + port + "/", "wildcard-no-token");
  ASSERT_TRUE(std::regex_search(without.dom, note, std::regex("<p id=\"note\">([^<]*)</p>")));
  EXPECT_NE(note[1].str().find("needs the job token"), std::string::npos)
      << "the page without a token does not say it needs one: '" << note[1] << "'";
  EXPECT_EQ(without.dom.find("<tr class=\"member\""), std::string::npos);

  ASSERT_EQ(::kill(job.pid(), SIGINT), 0);
  job.Wait(milliseconds(30'000));
}

}  // namespace
}  // namespace nonstop
