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
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/job_token.h"
#include "common/logging.h"
#include "common/role_keys.h"
#include "common/temp_dir.h"
#include "coord/leader_watch.h"
#include "net/handshake.h"
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

// What a job's worker can reach (docs/security.md, "Keys by role" and "A user for the workers"):
// a probe run as the job's worker tries the token file, the launcher's environment, descriptors
// and memory (the launcher holds the job key), and hands back the credential it was given.
struct Probe {
  std::string report;  // the probe's lines: "read X" / "refused X", "uid N", "credential …"
  std::string token;   // the job's
  bool Has(const std::string& line) const { return report.find(line + "\n") != std::string::npos; }
  // A line that begins with `start` and holds `part`.
  bool HasLine(const std::string& start, const std::string& part) const {
    std::istringstream in(report);
    for (std::string line; std::getline(in, line);) {
      if (line.starts_with(start) && line.find(part) != std::string::npos) return true;
    }
    return false;
  }
};

Probe RunProbe(const TempDir& dir, const std::vector<std::string>& extra) {
  const std::string out = dir / "probe";
  fs::create_directories(out);
  fs::permissions(out, fs::perms::all);  // the worker's user writes its report there
  fs::permissions(dir.path(), fs::perms::owner_all | fs::perms::group_exec |
                                  fs::perms::others_exec);  // and passes through, no more
  const std::string token_file = dir / "job.token";
  // Two workers: each also tries the other's credential through /proc (its descriptor, which the
  // other keeps open while it sleeps), once the other has said where it is.
  const std::string script = fmt::format(
      "p={0}/w$NONSTOP_WORKER_ID; echo \"$$ $NONSTOP_JOB_TOKEN_FD\" > "
      "{0}/at$NONSTOP_WORKER_ID.tmp; "
      "mv {0}/at$NONSTOP_WORKER_ID.tmp {0}/at$NONSTOP_WORKER_ID; "
      "credential=$(cat <&\"$NONSTOP_JOB_TOKEN_FD\"); "
      "for i in $(seq 500); do [ -e {0}/at$((1 - NONSTOP_WORKER_ID)) ] && break; sleep 0.01; done; "
      "read sibling sibling_fd < {0}/at$((1 - NONSTOP_WORKER_ID)); "
      "{{ echo \"uid $(id -u)\"; "
      "for f in {1} /proc/$PPID/environ /proc/$sibling/fd/$sibling_fd; do "
      "if cat \"$f\" >/dev/null 2>&1; then echo \"read $f\"; else echo \"refused $f\"; fi; done; "
      "if ls /proc/$PPID/fd >/dev/null 2>&1; then echo 'read fd'; else echo 'refused fd'; fi; "
      "if (exec 3</proc/$PPID/mem) 2>/dev/null; then echo 'read mem'; else echo 'refused mem'; fi; "
      "echo \"credential $credential\"; }} > $p.tmp; mv $p.tmp $p; exec sleep 60",
      out, token_file);
  std::vector<std::string> argv = {kBin + "/nonstop", "run", "--nproc",   "2",
                                   "--spares",        "0",   "--journal", dir / "journal.jsonl"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {"--", "/bin/bash", "-c", script});
  ChildProcess run(argv, dir / "run.out");
  Probe probe;
  for (int i = 0; i < 3000 && !fs::exists(out + "/w0"); ++i) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  probe.report = ReadAll(out + "/w0");
  auto token = ReadJobTokenFile(token_file);
  probe.token = token.ok() ? *token : "";
  ::kill(run.pid(), SIGTERM);
  run.Wait(milliseconds(30'000));
  EXPECT_FALSE(probe.report.empty()) << run.Output();
  return probe;
}

// Runs one handshake of `hello` over a socket pair: the dialer proves `dialer_key`, the acceptor
// the keys of `acceptor_keys`. Whether both ends accepted.
bool Handshake(const crypto::Key& dialer_key, const net::KeyOf& acceptor_keys,
               const net::Hello& hello) {
  int fds[2];
  NONSTOP_CHECK_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fds), 0);
  UniqueFd a(fds[0]), b(fds[1]);
  Result<net::Channel> client = UnavailableError("not run");
  std::thread t([&] {
    client = net::ClientHandshake(a.get(), dialer_key, hello, DeadlineAfter(Millis(2000)), nullptr);
    if (!client.ok()) a.Reset();
  });
  auto server = net::ServerHandshake(b.get(), acceptor_keys, hello.kind,
                                     DeadlineAfter(Millis(2000)), nullptr);
  t.join();
  if (!client.ok() || !server.ok()) {
    NONSTOP_LOG_INFO("handshake: dialer {}, acceptor {}", client.status().ToString(),
                     server.status().ToString());
  }
  return client.ok() && server.ok();
}

// Whatever the user: the worker holds its credential, not the token: its own keys, which neither
// answer it or another worker as the controller, nor dial as another worker or as an agent, nor
// sign a leader value its readers follow.
TEST(SecretsTest, AJobsWorkerHoldsOnlyItsOwnCredential) {
  TempDir dir;
  const Probe p = RunProbe(dir, {});
  EXPECT_TRUE(p.Has("read " + dir / "job.token")) << "the launcher's own user: " << p.report;
  ASSERT_FALSE(p.token.empty());
  const size_t at = p.report.find("credential ");
  ASSERT_NE(at, std::string::npos) << p.report;
  const std::string credential = p.report.substr(at + 11, p.report.find('\n', at) - at - 11);
  EXPECT_TRUE(IsWorkerCredential(credential)) << credential;
  EXPECT_EQ(credential.find(p.token), std::string::npos) << "the worker holds the token";
  auto keys = WorkerKeysFrom(credential, 0);
  ASSERT_TRUE(keys.ok()) << keys.status().ToString() << ": " << credential;
  const crypto::Key job_key = crypto::JobKey(p.token);
  net::Hello control;
  control.kind = net::ConnectionKind::kControl;
  control.worker_id = 0;
  EXPECT_TRUE(Handshake(keys->control, net::JobRoles(job_key), control)) << "genuine";
  net::Hello other_worker = control, agent = control;
  other_worker.worker_id = 1;
  agent.kind = net::ConnectionKind::kAgent;
  for (const crypto::Key& held : {keys->control, keys->data}) {
    EXPECT_FALSE(Handshake(WorkerControlKey(job_key, 1), net::OneKey(held), other_worker))
        << "the worker answered worker 1 as the controller";
    EXPECT_FALSE(Handshake(held, net::JobRoles(job_key), other_worker))
        << "the worker dialed the controller as worker 1";
    EXPECT_FALSE(Handshake(held, net::JobRoles(job_key), agent))
        << "the worker registered as an agent";
  }
  const std::string genuine =
      coord::SignLeaderValue(job_key, "j", {{"controller", "127.0.0.1:1"}, {"epoch", 3}});
  EXPECT_TRUE(coord::VerifyLeaderValue(keys->controller_public, "j", genuine, 3).ok());
}

// As another user (--worker-user; the launcher is root), nothing of the launcher's. The same probe
// as the launcher's own user shows that it can tell.
TEST(SecretsTest, AsAnotherUserAWorkerReachesNeitherTheTokenFileNorTheLauncher) {
  if (::geteuid() != 0) GTEST_SKIP() << "--worker-user needs root, which this test does not have";
  struct passwd* nobody = ::getpwnam("nobody");
  ASSERT_NE(nobody, nullptr) << "no user nobody";
  TempDir same_dir;
  const Probe same = RunProbe(same_dir, {});
  EXPECT_TRUE(same.Has("uid 0")) << same.report;
  EXPECT_TRUE(same.Has("read " + same_dir / "job.token")) << same.report;
  EXPECT_TRUE(same.Has("read fd")) << same.report;
  TempDir dir;
  const Probe other = RunProbe(dir, {"--worker-user", "nobody"});
  EXPECT_TRUE(other.Has(fmt::format("uid {}", nobody->pw_uid))) << other.report;
  for (const std::string& refused :
       {"refused " + dir / "job.token", std::string("refused fd"), std::string("refused mem")}) {
    EXPECT_TRUE(other.Has(refused)) << refused << "\n" << other.report;
  }
  // Its sibling's credential neither (the launcher's descriptor, mode 400), where root's workers
  // read it.
  EXPECT_TRUE(other.HasLine("refused /proc/", "/fd/")) << other.report;
  EXPECT_FALSE(other.HasLine("refused /proc//", "")) << "no sibling found: " << other.report;
  EXPECT_TRUE(same.HasLine("read /proc/", "/fd/")) << same.report;
  EXPECT_EQ(other.report.find("read /proc/"), std::string::npos) << other.report;
  EXPECT_NE(other.report.find("credential nonstop-worker-credential 1 0 "), std::string::npos)
      << other.report;
}

}  // namespace
}  // namespace nonstop
