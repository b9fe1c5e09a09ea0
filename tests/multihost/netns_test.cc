// Tests of the multi-host harness itself: real namespaces, real processes, real sockets. They need
// root; without it they fail with the harness's message (never skip), so a CI that lost its
// privileges shows.
#include "tests/multihost/netns.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/temp_dir.h"

namespace nonstop::testing {
namespace {

using std::chrono::milliseconds;

const std::string kEcho = NETNS_ECHO_PATH;  // the netns_echo binary

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Everything a cluster creates in the root namespace's view, by path.
std::vector<std::string> PathsOf(const NetnsCluster& c) {
  std::vector<std::string> paths = {"/sys/class/net/" + c.bridge()};
  for (int h = 0; h < c.hosts(); ++h) {
    paths.push_back("/var/run/netns/" + c.name(h));
    paths.push_back("/sys/class/net/" + c.bridge_port(h));
  }
  return paths;
}

class NetnsClusterTest : public ::testing::Test {
 protected:
  // Starts `netns_echo listen addr` in host's namespace and returns its port.
  Result<int> StartEcho(NetnsCluster& c, int host, const std::string& addr) {
    std::string port_file = dir_ / fmt::format("port-{}", next_file_++);
    std::string log = dir_ / "echo.log";
    NONSTOP_ASSIGN_OR_RETURN(pid_t pid, c.Spawn(host, {kEcho, "listen", addr, port_file}, {}, log));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!Exists(port_file)) {
      if (auto status = c.WaitForExit(pid, milliseconds(0))) {
        return InternalError(
            fmt::format("echo listener on {} exited ({}): {}", addr, *status, ReadAll(log)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return DeadlineExceededError(
            fmt::format("echo listener on {} wrote no port: {}", addr, ReadAll(log)));
      }
      std::this_thread::sleep_for(milliseconds(5));
    }
    return std::stoi(ReadAll(port_file));
  }

  // Whether `netns_echo dial` from host `from` gets its line echoed by addr:port within timeout_ms.
  ::testing::AssertionResult Reaches(NetnsCluster& c, int from, const std::string& addr, int port,
                                     int timeout_ms = 5000) {
    auto r = c.Exec(from, {kEcho, "dial", addr, std::to_string(port), std::to_string(timeout_ms)},
                    milliseconds(timeout_ms + 5000));
    if (!r.ok()) return ::testing::AssertionFailure() << r.status().ToString();
    auto what = fmt::format("host {} -> {}:{}: exit {}: {}", from, addr, port, r->first, r->second);
    if (r->first == 0) return ::testing::AssertionSuccess() << what;
    return ::testing::AssertionFailure() << what;
  }

  TempDir dir_;
  int next_file_ = 0;
};

TEST_F(NetnsClusterTest, EachHostHasItsAddressLoopbackAndNoDefaultRoute) {
  auto created = NetnsCluster::Create(3);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NetnsCluster& c = **created;
  ASSERT_EQ(c.hosts(), 3);
  for (const auto& path : PathsOf(c)) EXPECT_TRUE(Exists(path)) << path;
  for (int h = 0; h < 3; ++h) {
    EXPECT_LE(c.bridge_port(h).size(), 15u);
    EXPECT_EQ(c.address(h).substr(c.address(h).rfind('.')), fmt::format(".{}", h + 1));
    auto addr = c.Exec(h, {"ip", "-4", "-o", "addr", "show", "dev", "eth0"});
    ASSERT_TRUE(addr.ok()) << addr.status().ToString();
    EXPECT_EQ(addr->first, 0);
    EXPECT_NE(addr->second.find(c.address(h) + "/24"), std::string::npos) << addr->second;
    auto lo = c.Exec(h, {"ip", "-o", "link", "show", "dev", "lo"});
    ASSERT_TRUE(lo.ok()) << lo.status().ToString();
    EXPECT_NE(lo->second.find(",UP"), std::string::npos) << lo->second;
    auto routes = c.Exec(h, {"ip", "-4", "route", "show", "default"});
    ASSERT_TRUE(routes.ok()) << routes.status().ToString();
    EXPECT_EQ(routes->second, "") << "no default route leads out of the cluster";
  }
  auto missing = c.Exec(0, {"ip", "link", "show", "dev", "nonexistent0"});
  ASSERT_TRUE(missing.ok()) << missing.status().ToString();
  EXPECT_NE(missing->first, 0) << "Exec reports the command's exit code";
}

TEST_F(NetnsClusterTest, ListenerOnOneHostIsReachableFromTheOthersButLoopbackIsPerHost) {
  auto created = NetnsCluster::Create(3);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NetnsCluster& c = **created;
  auto port = StartEcho(c, 0, c.address(0));
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  EXPECT_TRUE(Reaches(c, 1, c.address(0), *port));
  EXPECT_TRUE(Reaches(c, 2, c.address(0), *port));
  EXPECT_TRUE(Reaches(c, 0, c.address(0), *port));

  auto local_port = StartEcho(c, 0, "127.0.0.1");
  ASSERT_TRUE(local_port.ok()) << local_port.status().ToString();
  EXPECT_TRUE(Reaches(c, 0, "127.0.0.1", *local_port));
  EXPECT_FALSE(Reaches(c, 1, "127.0.0.1", *local_port, /*timeout_ms=*/1000))
      << "loopback is per namespace";
  EXPECT_FALSE(Reaches(c, 2, "127.0.0.1", *local_port, /*timeout_ms=*/1000));
}

TEST_F(NetnsClusterTest, LinkDownPartitionsOneHostAndLinkUpHealsIt) {
  auto created = NetnsCluster::Create(3);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NetnsCluster& c = **created;
  auto port = StartEcho(c, 0, c.address(0));
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  ASSERT_TRUE(Reaches(c, 1, c.address(0), *port));

  ASSERT_TRUE(c.LinkDown(1).ok());
  EXPECT_FALSE(Reaches(c, 1, c.address(0), *port, /*timeout_ms=*/1000)) << "host 1 is partitioned";
  EXPECT_TRUE(Reaches(c, 2, c.address(0), *port)) << "the rest of the cluster is not";
  auto port1 = StartEcho(c, 1, c.address(1));
  ASSERT_TRUE(port1.ok()) << port1.status().ToString();
  EXPECT_FALSE(Reaches(c, 2, c.address(1), *port1, /*timeout_ms=*/1000))
      << "nor is host 1 reachable";

  ASSERT_TRUE(c.LinkUp(1).ok());
  EXPECT_TRUE(Reaches(c, 1, c.address(0), *port)) << "healed";
  EXPECT_TRUE(Reaches(c, 2, c.address(1), *port1));
}

TEST_F(NetnsClusterTest, KillHostKillsThatHostsProcessesAndNothingElse) {
  auto created = NetnsCluster::Create(3);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NetnsCluster& c = **created;
  auto port = StartEcho(c, 0, c.address(0));
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  auto victim = c.Spawn(2, {"sleep", "600"}, {}, dir_ / "victim.log");
  ASSERT_TRUE(victim.ok()) << victim.status().ToString();
  auto bystander = c.Spawn(1, {"sleep", "600"}, {}, dir_ / "bystander.log");
  ASSERT_TRUE(bystander.ok()) << bystander.status().ToString();

  EXPECT_EQ(c.KillHost(2), 1);
  auto status = c.WaitForExit(*victim, std::chrono::seconds(5));
  ASSERT_TRUE(status.has_value()) << "the victim did not die";
  EXPECT_TRUE(WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL) << *status;

  EXPECT_FALSE(c.WaitForExit(*bystander, milliseconds(100)).has_value())
      << "host 1's process lives on";
  EXPECT_TRUE(Reaches(c, 1, c.address(0), *port)) << "host 0's listener lives on";
  EXPECT_EQ(c.KillHost(2), 0) << "nothing is left on host 2";
}

TEST_F(NetnsClusterTest, KillHostAlsoKillsProcessesForkedOnThatHost) {
  auto created = NetnsCluster::Create(1);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NetnsCluster& c = **created;
  std::string started = dir_ / "started";
  // The marker is written by the shell itself (`: >`), not by touch(1): once it exists the host
  // runs exactly the shell and its sleep, never a touch that has not exited yet (which made the
  // count 3 now and then under load).
  auto shell =
      c.Spawn(0, {"sh", "-c", "sleep 600 & : > \"$1\"; wait", "sh", started}, {}, dir_ / "sh.log");
  ASSERT_TRUE(shell.ok()) << shell.status().ToString();
  for (int i = 0; i < 1000 && !Exists(started); ++i) std::this_thread::sleep_for(milliseconds(5));
  ASSERT_TRUE(Exists(started));
  EXPECT_EQ(c.KillHost(0), 2) << "the shell and its background sleep";
  EXPECT_TRUE(c.WaitForExit(*shell, std::chrono::seconds(5)).has_value());
}

TEST_F(NetnsClusterTest, SpawnPassesTheEnvironmentAppendsToTheLogAndRefusesMissingPrograms) {
  auto created = NetnsCluster::Create(2);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  NetnsCluster& c = **created;
  std::string log = dir_ / "spawn.log";
  for (int round = 0; round < 2; ++round) {
    auto pid = c.Spawn(
        1, {"sh", "-c", "echo \"round $NETNS_TEST_ROUND\"; ip -4 -o addr show dev eth0 >&2"},
        {{"NETNS_TEST_ROUND", "x"}, {"NETNS_TEST_ROUND", std::to_string(round)}}, log);
    ASSERT_TRUE(pid.ok()) << pid.status().ToString();
    auto status = c.WaitForExit(*pid, std::chrono::seconds(10));
    ASSERT_TRUE(status.has_value());
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
  }
  std::string text = ReadAll(log);
  EXPECT_NE(text.find("round 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("round 1\n"), std::string::npos)
      << "appended, later entries of env win: " << text;
  EXPECT_NE(text.find(c.address(1) + "/24"), std::string::npos)
      << "stderr too, in host 1's namespace: " << text;

  auto missing = c.Spawn(0, {"/nonexistent/netns-test-program"}, {}, log);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();

  auto sleeper = c.Spawn(0, {"sleep", "600"}, {}, log);
  ASSERT_TRUE(sleeper.ok()) << sleeper.status().ToString();
  EXPECT_FALSE(c.WaitForExit(*sleeper, milliseconds(50)).has_value())
      << "timeout: nullopt, still running";
}

TEST_F(NetnsClusterTest, DestructorRemovesNamespacesVethsBridgeAndProcesses) {
  std::vector<std::string> paths;
  pid_t sleeper = 0;
  {
    auto created = NetnsCluster::Create(2);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    NetnsCluster& c = **created;
    paths = PathsOf(c);
    auto pid = c.Spawn(1, {"sleep", "600"}, {}, dir_ / "sleep.log");
    ASSERT_TRUE(pid.ok()) << pid.status().ToString();
    sleeper = *pid;
    EXPECT_TRUE(c.Destroy().ok());
    EXPECT_TRUE(c.Destroy().ok()) << "idempotent";
  }
  for (const auto& path : paths) EXPECT_FALSE(Exists(path)) << path;
  bool gone = ::kill(sleeper, 0) != 0 && errno == ESRCH;
  EXPECT_TRUE(gone) << "the spawned process is killed and reaped";
}

// EXPECT_FATAL_FAILURE's statement cannot use locals.
std::vector<std::string> failed_body_paths;
pid_t failed_body_sleeper = 0;

TEST_F(NetnsClusterTest, DestructorCleansUpWhenTheTestBodyFails) {
  EXPECT_FATAL_FAILURE(
      {
        auto created = NetnsCluster::Create(2);
        ASSERT_TRUE(created.ok()) << created.status().ToString();
        failed_body_paths = PathsOf(**created);
        auto pid = (*created)->Spawn(0, {"sleep", "600"}, {}, "/dev/null");
        ASSERT_TRUE(pid.ok()) << pid.status().ToString();
        failed_body_sleeper = *pid;
        FAIL() << "a deliberate failure with the cluster alive";
      },
      "a deliberate failure");
  ASSERT_FALSE(failed_body_paths.empty());
  for (const auto& path : failed_body_paths) EXPECT_FALSE(Exists(path)) << path;
  bool gone = ::kill(failed_body_sleeper, 0) != 0 && errno == ESRCH;
  EXPECT_TRUE(gone) << "the spawned process is killed and reaped";
}

TEST_F(NetnsClusterTest, TwoClustersAtOnceHaveDistinctNamesAndSubnetsAndDoNotTouch) {
  auto a = NetnsCluster::Create(2);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  auto b = NetnsCluster::Create(2);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE((*a)->subnet(), (*b)->subnet());
  EXPECT_NE((*a)->bridge(), (*b)->bridge());
  for (int h = 0; h < 2; ++h) {
    EXPECT_NE((*a)->name(h), (*b)->name(h));
    EXPECT_NE((*a)->bridge_port(h), (*b)->bridge_port(h));
    EXPECT_NE((*a)->address(h), (*b)->address(h));
  }
  auto port = StartEcho(**a, 0, (*a)->address(0));
  ASSERT_TRUE(port.ok()) << port.status().ToString();
  EXPECT_TRUE(Reaches(**a, 1, (*a)->address(0), *port));
  EXPECT_FALSE(Reaches(**b, 1, (*a)->address(0), *port, /*timeout_ms=*/1000))
      << "separate networks";
}

// Runs `body` in a forked child of this test process and returns what it wrote to the pipe it is
// given. The child ends with _exit (no destructors, no gtest teardown).
template <typename Body>
std::string InChild(Body body) {
  int p[2];
  if (::pipe(p) != 0) return "pipe failed";
  pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[0]);
    std::string out = body();
    (void)!::write(p[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(p[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(p[0]);
  ::waitpid(pid, nullptr, 0);
  return out;
}

TEST_F(NetnsClusterTest, LeftoversOfACrashedCreatorAreRemovedByTheNextCreate) {
  // The child creates a cluster, reports its paths, waits for the go and SIGKILLs itself: no
  // destructor.
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(p[0]);
    ::close(go[1]);
    auto created = NetnsCluster::Create(2);
    std::string out;
    if (created.ok()) {
      for (const auto& path : PathsOf(**created)) out += path + "\n";
    } else {
      out = "ERROR " + created.status().ToString();
    }
    (void)!::write(p[1], out.data(), out.size());
    ::close(p[1]);
    char c;
    (void)!::read(go[0], &c, 1);
    ::raise(SIGKILL);
  }
  ::close(p[1]);
  ::close(go[0]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(p[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(p[0]);
  std::vector<std::string> paths;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) paths.push_back(line);
  bool child_ok = out.rfind("ERROR", 0) != 0 && !paths.empty();
  EXPECT_TRUE(child_ok) << out;
  for (const auto& path : paths) EXPECT_TRUE(child_ok && Exists(path)) << path;
  ::close(go[1]);  // go: the child dies
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << status;

  auto created = NetnsCluster::Create(1);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  for (const auto& path : paths)
    EXPECT_FALSE(Exists(path)) << "left by the crashed creator: " << path;
}

// Runs a command in this (the root) namespace: its exit code.
int Run(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// Start time (/proc/PID/stat field 22) of a process.
std::string StartTime(pid_t pid) {
  std::string stat = ReadAll(fmt::format("/proc/{}/stat", pid));
  std::istringstream fields(stat.substr(stat.rfind(')') + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) fields >> field;
  return field;
}

// A cluster's bridge and first namespace made by hand, as if pid 1 (always running) had created
// them and started at `start`; removed in the destructor.
class FakeLeftover {
 public:
  FakeLeftover(char letter, const std::string& start) : tag_(fmt::format("nst1{}", letter)) {
    Run({"ip", "link", "add", tag_ + "br", "type", "bridge"});
    Run({"ip", "link", "set", "dev", tag_ + "br", "alias",
         "nonstop-netns 10.199.0.0/24 creator 1 " + start});
    Run({"ip", "netns", "add", tag_ + "h0"});
  }
  ~FakeLeftover() {
    if (Exists("/var/run/netns/" + tag_ + "h0")) Run({"ip", "netns", "delete", tag_ + "h0"});
    if (Exists("/sys/class/net/" + tag_ + "br")) Run({"ip", "link", "delete", tag_ + "br"});
  }
  FakeLeftover(const FakeLeftover&) = delete;
  FakeLeftover& operator=(const FakeLeftover&) = delete;
  bool exists() const {
    return Exists("/var/run/netns/" + tag_ + "h0") && Exists("/sys/class/net/" + tag_ + "br");
  }

 private:
  std::string tag_;
};

TEST_F(NetnsClusterTest, LeftoversOfAReusedPidAreRemovedAndThoseOfALiveCreatorStay) {
  FakeLeftover live('x', StartTime(1));
  // pid 1 runs, but it is not the process that created these
  FakeLeftover reused('y', "999999999999");
  ASSERT_TRUE(live.exists());
  ASSERT_TRUE(reused.exists());
  auto created = NetnsCluster::Create(1);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  EXPECT_TRUE(live.exists()) << "its creator still runs";
  EXPECT_FALSE(reused.exists()) << "its creator is gone, whoever holds its pid now";
}

TEST_F(NetnsClusterTest, WithoutPrivilegesCreateFailsAndSaysHowToFixIt) {
  std::string message = InChild([] {
    if (::geteuid() == 0 && ::setuid(65534) != 0) return std::string("setuid(65534) failed");
    auto created = NetnsCluster::Create(1);
    return created.ok() ? std::string("created") : created.status().ToString();
  });
  EXPECT_NE(message.find("FAILED_PRECONDITION"), std::string::npos) << message;
  EXPECT_NE(message.find("CAP_NET_ADMIN"), std::string::npos) << message;
  EXPECT_NE(message.find("as root"), std::string::npos) << message;
}

TEST_F(NetnsClusterTest, WithoutIpCreateFailsAndSaysInstallIproute2) {
  std::string message = InChild([] {
    ::setenv("PATH", "/nonexistent", 1);
    auto created = NetnsCluster::Create(1);
    return created.ok() ? std::string("created") : created.status().ToString();
  });
  EXPECT_NE(message.find("FAILED_PRECONDITION"), std::string::npos) << message;
  EXPECT_NE(message.find("install iproute2"), std::string::npos) << message;
}

}  // namespace
}  // namespace nonstop::testing
