// Live elasticity with real processes: grow on request and through joins,
// shrink on request (released workers exit cleanly), shrink on a fault and
// grow back, a fault during a change, and refused requests. The test worker's
// result does not depend on the world size, so every run must end with the
// fault-free checksum; the trainer test checks the loss curve and the samples.
#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "common/job_token.h"
#include "common/temp_dir.h"
#include "controller/journal.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;

class ElasticTest : public ::testing::Test {
 protected:
  TempDir dir_;  // first: journal_ is made from it
  std::string journal_ = dir_ / "journal.jsonl";

  std::unique_ptr<ChildProcess> Start(int nproc, std::vector<std::string> flags,
                                      std::vector<std::string> program) {
    std::vector<std::string> argv = {kBin + "/nonstop", "run",    "--nproc",  std::to_string(nproc),
                                     "--journal",       journal_, "--inject", "none"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--");
    argv.insert(argv.end(), program.begin(), program.end());
    return std::make_unique<ChildProcess>(argv, dir_ / "out.txt");
  }
  std::vector<std::string> TestWorker(int steps, int sleep_ms = 15) {
    return {kBin + "/nonstop-test-worker",
            "--steps",
            std::to_string(steps),
            "--elements",
            "100000",
            "--sleep-ms",
            std::to_string(sleep_ms)};
  }
  std::vector<nlohmann::json> Events(const std::string& kind) {
    return nonstop::testing::JournalEvents(journal_, kind);
  }
  int64_t HighestStep() {
    int64_t h = -1;
    for (auto& j : Events("step")) h = std::max<int64_t>(h, j["step"]);
    return h;
  }
  void WaitFor(const std::function<bool()>& cond, const std::string& what,
               milliseconds limit = milliseconds(60'000)) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (!cond()) {
      ASSERT_LT(std::chrono::steady_clock::now(), until) << "timed out waiting for " << what;
      std::this_thread::sleep_for(milliseconds(20));
    }
  }
  std::pair<int, nlohmann::json> Scale(nlohmann::json body) {
    std::string http;
    WaitFor([&] { return !Events("job_start").empty(); }, "the job to start");
    http = Events("job_start")[0]["http"];
    auto colon = http.rfind(':');
    httplib::Client c(http.substr(0, colon), std::stoi(http.substr(colon + 1)));
    // POST /scale needs the job token, from the file the job file beside the journal names.
    std::ifstream job_file(dir_ / "job.json");
    auto job = nlohmann::json::parse(job_file, nullptr, false);
    if (job.is_discarded() || !job.contains("token_file")) return {-2, nullptr};
    auto token = ReadJobTokenFile(job["token_file"].get<std::string>());
    if (!token.ok()) return {-2, nullptr};
    c.set_bearer_token_auth(HttpCredential(*token));
    auto res = c.Post("/scale", body.dump(), "application/json");
    if (!res) return {-1, nullptr};
    return {res->status, nlohmann::json::parse(res->body, nullptr, false)};
  }
  size_t WorldOfLastPlan() {
    auto plans = Events("plan");
    return plans.empty() ? 0 : plans.back()["members"].size();
  }
  static std::string Checksum(const std::string& out) {
    std::smatch m;
    return std::regex_search(out, m, std::regex("parameter checksum ([0-9a-f]{8})"))
               ? std::string(m[1])
               : "";
  }
  std::string Reference(int steps) {
    TempDir d;
    ChildProcess p({kBin + "/nonstop", "run", "--nproc", "2", "--spares", "0", "--inject", "none",
                    "--journal", d / "j.jsonl", "--", kBin + "/nonstop-test-worker", "--steps",
                    std::to_string(steps), "--elements", "100000"},
                   d / "out.txt");
    EXPECT_EQ(p.Wait(milliseconds(60'000)), 0) << p.Output();
    return Checksum(p.Output());
  }
};

TEST_F(ElasticTest, GrowOnRequestStartsWorkersThatJoinLive) {
  auto job = Start(2, {"--spares", "0", "--max-world", "4"}, TestWorker(250));
  WaitFor([&] { return HighestStep() >= 10; }, "step 10");
  auto [status, body] = Scale({{"world_size", 4}});
  EXPECT_EQ(status, 202) << body.dump();
  WaitFor([&] { return WorldOfLastPlan() == 4; }, "the world to reach 4");
  EXPECT_EQ(job->Wait(milliseconds(90'000)), 0) << job->Output();
  EXPECT_EQ(Checksum(job->Output()), Reference(250)) << job->Output();
  auto ends = Events("recovery_end");
  ASSERT_EQ(ends.size(), 1u) << "one change took the job from 2 to 4\n" << job->Output();
  EXPECT_EQ(ends[0]["recovery"]["kind"], "resize");
  EXPECT_EQ(ends[0]["recovery"]["new_world"], 4);
  EXPECT_TRUE(ends[0]["recovery"].contains("pause_ms"));
  EXPECT_GT(ends[0]["recovery"]["bytes_copied"].get<uint64_t>(), 0u)
      << "joiners copied the state from members";
}

TEST_F(ElasticTest, ShrinkOnRequestReleasesWorkersWhoExitCleanly) {
  auto job = Start(4, {"--spares", "0"}, TestWorker(250));
  WaitFor([&] { return HighestStep() >= 10; }, "step 10");
  auto [status, body] = Scale({{"release", 1}});
  EXPECT_EQ(status, 202) << body.dump();
  EXPECT_EQ(job->Wait(milliseconds(90'000)), 0) << job->Output();
  EXPECT_EQ(WorldOfLastPlan(), 3u);
  EXPECT_NE(job->Output().find("worker 3 released"), std::string::npos) << job->Output();
  bool clean_exit = false;
  for (auto& e : Events("exit"))
    clean_exit |= e["worker_id"] == 3 && e["how"] == "exited with code 0";
  EXPECT_TRUE(clean_exit) << "the released worker's process exited with 0";
  EXPECT_TRUE(Events("fault").empty()) << "a release is not a fault";
  EXPECT_EQ(Checksum(job->Output()), Reference(250));
}

TEST_F(ElasticTest, ShrinkOnFaultThenGrowBackWhenCapacityReturns) {
  auto job = Start(3, {"--spares", "0", "--inject", "kill:rank=1,step=8"}, TestWorker(300));
  WaitFor([&] { return WorldOfLastPlan() == 2 && HighestStep() >= 12; }, "the shrink to 2");
  auto [status, body] = Scale({{"world_size", 3}});
  EXPECT_EQ(status, 202) << body.dump();
  WaitFor([&] { return WorldOfLastPlan() == 3; }, "the grow back to 3");
  EXPECT_EQ(job->Wait(milliseconds(90'000)), 0) << job->Output();
  EXPECT_EQ(Checksum(job->Output()), Reference(300));
}

TEST_F(ElasticTest, FaultDuringAChangeStartsARecovery) {
  // A member dies while the joiners copy the state from it.
  auto job =
      Start(2, {"--spares", "0", "--max-world", "4", "--inject", "kill:rank=0,during=transfer"},
            TestWorker(250));
  WaitFor([&] { return HighestStep() >= 10; }, "step 10");
  auto [status, body] = Scale({{"world_size", 4}});
  EXPECT_EQ(status, 202) << body.dump();
  EXPECT_EQ(job->Wait(milliseconds(90'000)), 0) << job->Output();
  auto ends = Events("recovery_end");
  ASSERT_GE(ends.size(), 2u) << job->Output();
  EXPECT_EQ(ends[0]["recovery"]["outcome"], "superseded by recovery 2");
  EXPECT_EQ(Checksum(job->Output()), Reference(250));
}

TEST_F(ElasticTest, RequestsOutsideThePolicyAreRefusedWithAReason) {
  auto job = Start(3,
                   {"--spares", "1", "--min-world", "2", "--max-world", "5", "--allowed-sizes",
                    "2,3,5", "--stable-period-ms", "60000"},
                   TestWorker(100000, 5));
  WaitFor([&] { return HighestStep() >= 3; }, "step 3");
  auto expect = [&](nlohmann::json body, int want, const std::string& text) {
    auto [status, reply] = Scale(body);
    EXPECT_EQ(status, want) << body.dump() << " → " << reply.dump();
    EXPECT_NE(reply.value("error", "").find(text), std::string::npos) << reply.dump();
  };
  expect({{"world_size", 1}}, 422, "below the minimum 2");
  expect({{"world_size", 6}}, 422, "above the maximum 5");
  expect({{"world_size", 4}}, 422, "not an allowed size");
  expect({{"size", 4}}, 400, "expected");
  expect({{"world_size", "four"}}, 400, "positive integer");
  auto [status, reply] = Scale({{"world_size", 2}});
  EXPECT_EQ(status, 202) << reply.dump();
  WaitFor([&] { return WorldOfLastPlan() == 2; }, "the shrink to 2");
  expect({{"world_size", 3}}, 429, "too soon");
  EXPECT_GE(Events("scale_refused").size(), 6u);
  ::kill(job->pid(), SIGINT);
  EXPECT_EQ(job->Wait(milliseconds(20'000)), 130) << job->Output();
}

}  // namespace
}  // namespace nonstop
