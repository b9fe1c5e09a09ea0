// The job token handled as a secret (docs/security.md), end to end: a real
// `nonstop run` job (its controller a process of its own, its agent starting
// the workers, a worker started by hand with `nonstop worker`) is searched
// for its token, and the token is found only in its token file: not in the
// run's output or logs, the journal, the job file, GET /status, /metrics or
// /events, any process's command line or title, nor the environment of the
// user's program or of a child it starts.
#include <dirent.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/job_token.h"
#include "common/temp_dir.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

namespace fs = std::filesystem;
using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The places under `root` (files, by path) whose contents hold `secret`.
std::vector<std::string> FilesHolding(const std::string& root, const std::string& secret,
                                      const std::string& except) {
  std::vector<std::string> found;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file() || e.path() == except) continue;
    if (ReadAll(e.path()).find(secret) != std::string::npos) found.push_back(e.path());
  }
  return found;
}

// Every process's command line, title (comm) and environment, on this machine: "pid/file" of those
// that hold `secret`, and how many processes were read.
std::vector<std::string> ProcessesHolding(const std::string& secret, int* read) {
  std::vector<std::string> found;
  *read = 0;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string pid = e.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    bool any = false;
    for (const char* file : {"cmdline", "comm", "environ"}) {
      std::string text = ReadAll(e.path() / file);
      any = any || !text.empty();
      if (text.find(secret) != std::string::npos) found.push_back(pid + "/" + file);
    }
    if (any) ++*read;
  }
  return found;
}

// GET with the HTTP token derived from the job token (raw: the job token itself, which the
// endpoint does not take).
std::string Get(const std::string& http, const std::string& path, const std::string& token,
                bool raw = false) {
  auto colon = http.rfind(':');
  httplib::Client c(http.substr(0, colon), std::stoi(http.substr(colon + 1)));
  c.set_bearer_token_auth(raw ? token : HttpCredential(token));
  auto res = c.Get(path);
  return res && res->status == 200 ? res->body : "";
}

TEST(SecretsTest, TheTokenIsNowhereButInItsFile) {
  TempDir dir;
  const std::string journal = dir / "journal.jsonl";
  const std::string dumps = dir / "env";
  ChildProcess run({kBin + "/nonstop", "run", "--nproc", "2", "--spares", "1", "--log-level",
                    "debug", "--journal", journal, "--", kBin + "/nonstop-test-worker", "--steps",
                    "250", "--sleep-ms", "20", "--dump-environ", dumps},
                   dir / "run.out");
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "step", 5, milliseconds(60'000)))
      << run.Output();

  // The token, from the file the job file names: the one place it is to be.
  auto job = nlohmann::json::parse(ReadAll(dir / "job.json"), nullptr, false);
  ASSERT_TRUE(job.is_object() && job.contains("token_file")) << job.dump();
  const std::string token_file = job["token_file"];
  auto token = ReadJobTokenFile(token_file);
  ASSERT_TRUE(token.ok()) << token.status().ToString();
  ASSERT_GE(token->size(), 16u);
  EXPECT_EQ(fs::status(token_file).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  // The search can fail: it finds the token where it is.
  ASSERT_EQ(FilesHolding(dir.path(), *token, ""), std::vector<std::string>{token_file});

  // A worker started by hand (a spare), and the job commands, while the job runs.
  ChildProcess hand({kBin + "/nonstop", "worker", "--job", dir / "job.json", "--",
                     kBin + "/nonstop-test-worker", "--steps", "250", "--dump-environ", dumps},
                    dir / "hand.out");
  ChildProcess status({kBin + "/nonstop", "status", "--job", dir / "job.json"}, dir / "status.out");
  EXPECT_EQ(status.Wait(milliseconds(20'000)), 0) << status.Output();
  const std::string http = job["http"];
  {
    std::ofstream(dir / "http-status.json") << Get(http, "/status", *token);
    std::ofstream(dir / "http-metrics.txt") << Get(http, "/metrics", *token);
    std::ofstream(dir / "http-events.jsonl") << Get(http, "/events", *token);
  }
  EXPECT_NE(ReadAll(dir / "http-status.json").find("\"generation\""), std::string::npos)
      << "GET /status answered nothing";
  EXPECT_EQ(Get(http, "/events", *token, /*raw=*/true), "")
      << "the endpoint takes the job token itself, which HTTP clients would then send";
  // The hand-started worker has dumped its environment once it is a spare.
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal, "join", 4, milliseconds(30'000)))
      << ReadAll(dir / "hand.out");
  int processes = 0;
  EXPECT_EQ(ProcessesHolding(*token, &processes), std::vector<std::string>{})
      << "a command line, title or environment holds the token";
  EXPECT_GT(processes, 5) << "/proc could not be read";

  ASSERT_EQ(run.Wait(milliseconds(90'000)), 0) << run.Output();
  hand.Wait(milliseconds(30'000));
  EXPECT_FALSE(nonstop::testing::JournalEvents(journal, "job_end").empty());

  // Everything the job left: output, logs, journal, job file, the HTTP answers, the dumps.
  EXPECT_EQ(FilesHolding(dir.path(), *token, token_file), std::vector<std::string>{})
      << run.Output();
  int selves = 0, children = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    const std::string name = e.path().filename();
    if (!name.starts_with("env-")) continue;
    const std::string text = ReadAll(e.path());
    if (name.ends_with(".fds")) {
      EXPECT_NE(text.find("->"), std::string::npos) << name << ": no descriptors listed";
      EXPECT_EQ(text.find("nonstop-job-token"), std::string::npos)
          << name << ": the program's child inherited the token's descriptor\n"
          << text;
      continue;
    }
    EXPECT_NE(text.find("NONSTOP_WORKER_ID="), std::string::npos) << name << ": not a job's";
    EXPECT_EQ(text.find("NONSTOP_JOB_TOKEN="), std::string::npos) << name;
    if (name.ends_with(".self")) {
      ++selves;
      EXPECT_NE(text.find("NONSTOP_JOB_TOKEN_FD="), std::string::npos)
          << name << ": how did it get its token?";
    } else {
      ++children;
      EXPECT_EQ(text.find("NONSTOP_JOB_TOKEN_FD="), std::string::npos)
          << name << ": the library leaves the variable to the program's children";
    }
  }
  EXPECT_GE(selves, 4) << "three workers of the agent and the one started by hand";
  EXPECT_EQ(children, selves);
}

}  // namespace
}  // namespace nonstop
