#include "tests/multihost/netns.h"

#include <dirent.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string_view>
#include <thread>

#include "common/check.h"
#include "common/logging.h"
#include "common/unique_fd.h"

namespace nonstop::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// every name the harness creates starts with it
constexpr std::string_view kPrefix = "nst";
constexpr std::string_view kNetnsDir = "/var/run/netns";  // where `ip netns add` mounts namespaces
constexpr std::string_view kSysNet = "/sys/class/net";
constexpr std::string_view kLockPath = "/var/run/nonstop-netns.lock";
// The bridge's alias: "nonstop-netns 10.a.b.0/24 creator PID START", START from ProcessStart.
constexpr std::string_view kAliasPrefix = "nonstop-netns ";
// Subnets 10.a.b.0/24 with a in [kFirstA, 254]: away from the 10.0.x.x and 10.1.x.x that other
// tools favour. 14080 candidates.
constexpr int kFirstA = 200;
constexpr int kSubnets = (255 - kFirstA) * 256;
constexpr milliseconds kIpTimeout{10'000};
constexpr milliseconds kLockTimeout{60'000};
constexpr milliseconds kReapTimeout{5'000};

constexpr int kCapNetAdmin = 12;
constexpr int kCapSysAdmin = 21;

std::string Join(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    if (!out.empty()) out += ' ';
    out += a;
  }
  return out;
}

std::string Trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::string NetnsPath(const std::string& name) { return fmt::format("{}/{}", kNetnsDir, name); }
std::string LinkPath(const std::string& name) { return fmt::format("{}/{}", kSysNet, name); }

// The start time of a running process (/proc/PID/stat field 22, clock ticks since boot), which with
// the pid identifies it even after pids wrap; nullopt when it is not running. A zombie (dead, not
// yet reaped: its parent may be an init that never reaps) is not running: it holds no namespace and
// cleans nothing up.
std::optional<unsigned long long> ProcessStart(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  size_t close = stat.rfind(')');  // "pid (comm) S ...": comm may hold spaces and parentheses
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  unsigned long long start = 0;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return std::nullopt;
    if (i == 22) start = std::strtoull(field.c_str(), nullptr, 10);
  }
  return start;
}

void SleepFor(milliseconds d) { std::this_thread::sleep_for(d); }

// Why a child could not exec, sent through a close-on-exec pipe: nothing arrives when exec
// succeeded.
struct ChildFailure {
  int stage;  // index into kStageNames
  int err;
};
constexpr const char* kStageNames[] = {"prctl(PR_SET_PDEATHSIG)", "setns", "redirect output",
                                       "exec"};

// Forks and execs argv. In the child: signals unblocked, PR_SET_PDEATHSIG(SIGKILL), setns(netns_fd)
// when netns_fd >= 0, stdin from /dev/null, stdout and stderr to out_fd, every other descriptor
// closed at exec, then execvp (or execvpe with envp). Everything the child touches is prepared
// here, before fork: after fork a multi-threaded parent's child may only call async-signal-safe
// functions.
Result<pid_t> ForkExec(const std::vector<std::string>& args, std::vector<std::string>* env,
                       int netns_fd, int out_fd) {
  if (args.empty()) return InvalidArgumentError("empty argv");
  std::vector<std::string> arg_copy = args;
  std::vector<char*> argv;
  for (auto& a : arg_copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;
  if (env != nullptr) {
    for (auto& e : *env) envp.push_back(e.data());
    envp.push_back(nullptr);
  }
  int fail_pipe[2];
  if (::pipe2(fail_pipe, O_CLOEXEC) != 0) return ErrnoStatus(StatusCode::kInternal, "pipe2", errno);
  UniqueFd fail_read(fail_pipe[0]);
  UniqueFd fail_write(fail_pipe[1]);
  UniqueFd dev_null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!dev_null.valid()) return ErrnoStatus(StatusCode::kInternal, "open /dev/null", errno);
  const pid_t parent = ::getpid();

  pid_t pid = ::fork();
  if (pid < 0) return ErrnoStatus(StatusCode::kInternal, "fork", errno);
  if (pid == 0) {
    auto fail = [&](int stage) {
      ChildFailure f{stage, errno};
      (void)!::write(fail_write.get(), &f, sizeof f);
      ::_exit(127);
    };
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) fail(0);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl: nobody to report to
    if (netns_fd >= 0 && ::setns(netns_fd, CLONE_NEWNET) != 0) fail(1);
    if (::dup2(dev_null.get(), STDIN_FILENO) < 0 || ::dup2(out_fd, STDOUT_FILENO) < 0 ||
        ::dup2(out_fd, STDERR_FILENO) < 0) {
      fail(2);
    }
    // Descriptors the test process holds without O_CLOEXEC (listening sockets, pipes) must not live
    // on in a spawned process; best effort (Linux 5.11+).
    (void)::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
    if (env != nullptr) {
      ::execvpe(argv[0], argv.data(), envp.data());
    } else {
      ::execvp(argv[0], argv.data());
    }
    fail(3);
  }
  fail_write.Reset();
  ChildFailure f{};
  ssize_t n;
  do {
    n = ::read(fail_read.get(), &f, sizeof f);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(sizeof f)) {
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    StatusCode code =
        f.stage == 3 && f.err == ENOENT ? StatusCode::kNotFound : StatusCode::kInternal;
    return Status(code, fmt::format("cannot start `{}`: {} failed: {}", Join(args),
                                    kStageNames[f.stage], std::strerror(f.err)));
  }
  return pid;
}

// Waits for pid until the deadline: its wait status, or nullopt (timeout, or not our child).
std::optional<int> WaitUntil(pid_t pid, Clock::time_point deadline, bool* not_child = nullptr) {
  milliseconds nap{1};
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0 && errno != EINTR) {
      if (not_child != nullptr) *not_child = true;
      return std::nullopt;
    }
    if (Clock::now() >= deadline) return std::nullopt;
    SleepFor(std::min(
        nap, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()) + milliseconds(1)));
    nap = std::min(nap * 2, milliseconds(20));
  }
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Runs argv (in the namespace behind netns_fd when >= 0) and collects its merged output.
Result<std::pair<int, std::string>> RunCommand(const std::vector<std::string>& argv, int netns_fd,
                                               milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int out_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) return ErrnoStatus(StatusCode::kInternal, "pipe2", errno);
  UniqueFd out_read(out_pipe[0]);
  UniqueFd out_write(out_pipe[1]);
  NONSTOP_ASSIGN_OR_RETURN(pid_t pid, ForkExec(argv, /*env=*/nullptr, netns_fd, out_write.get()));
  out_write.Reset();
  std::string output;
  bool timed_out = false;
  for (;;) {
    auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{out_read.get(), POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) continue;  // timeout: the loop's deadline check ends it
    char buf[4096];
    ssize_t n = ::read(out_read.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EOF: every writer closed the pipe
    output.append(buf, static_cast<size_t>(n));
  }
  std::optional<int> status;
  if (!timed_out) status = WaitUntil(pid, deadline);
  if (!status) {
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return DeadlineExceededError(
        fmt::format("`{}` did not finish within {} ms (killed); output so far: {}", Join(argv),
                    timeout.count(), Trim(output)));
  }
  return std::make_pair(ExitCode(*status), std::move(output));
}

// Runs `ip ARGS...` in the root namespace; kInternal with ip's output when it exits non-zero.
Status Ip(std::vector<std::string> args) {
  args.insert(args.begin(), "ip");
  auto r = RunCommand(args, /*netns_fd=*/-1, kIpTimeout);
  if (!r.ok()) {
    if (r.status().code() == StatusCode::kNotFound) {
      return FailedPreconditionError(
          "`ip` was not found on PATH (HINT: install iproute2: apt-get install iproute2, or run "
          "scripts/setup.sh)");
    }
    return r.status();
  }
  if (r->first != 0) {
    return InternalError(
        fmt::format("`{}` exited with {}: {}", Join(args), r->first, Trim(r->second)));
  }
  return OkStatus();
}

// The effective capability mask of this process (/proc/self/status CapEff).
uint64_t EffectiveCapabilities() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) return std::strtoull(line.c_str() + 7, nullptr, 16);
  }
  return 0;
}

Status CheckPrivileges() {
  uint64_t caps = EffectiveCapabilities();
  std::vector<std::string> missing;
  if ((caps & (uint64_t{1} << kCapNetAdmin)) == 0) missing.emplace_back("CAP_NET_ADMIN");
  if ((caps & (uint64_t{1} << kCapSysAdmin)) == 0) missing.emplace_back("CAP_SYS_ADMIN");
  if (missing.empty()) return OkStatus();
  return FailedPreconditionError(fmt::format(
      "network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN, and this process (uid {}) lacks {} "
      "(HINT: run the multihost tests as root: sudo ctest --test-dir build -L multihost)",
      ::geteuid(), Join(missing)));
}

// The namespace's identity: the nsfs inode behind /var/run/netns/NAME (or /proc/PID/ns/net).
struct NsId {
  dev_t dev;
  ino_t ino;
};
std::optional<NsId> NsIdOf(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return NsId{st.st_dev, st.st_ino};
}

// SIGKILLs every process whose network namespace is `ns`, rescanning until none is left (a process
// may fork while we scan) or the deadline passes. Returns how many distinct processes were killed.
// The live processes (not this one) whose network namespace is `ns`.
std::vector<pid_t> ProcessesIn(NsId ns) {
  std::vector<pid_t> out;
  const pid_t self = ::getpid();
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* e = ::readdir(proc)) {
    pid_t pid = 0;
    std::string_view d(e->d_name);
    auto [end, ec] = std::from_chars(d.data(), d.data() + d.size(), pid);
    if (ec != std::errc() || end != d.data() + d.size() || pid == self) continue;
    // fails for zombies: nothing left to signal
    auto id = NsIdOf(fmt::format("/proc/{}/ns/net", pid));
    if (id && id->dev == ns.dev && id->ino == ns.ino) out.push_back(pid);
  }
  ::closedir(proc);
  return out;
}

int KillNamespace(NsId ns) {
  std::set<pid_t> killed;
  const auto deadline = Clock::now() + milliseconds(5'000);
  for (;;) {
    std::vector<pid_t> found = ProcessesIn(ns);
    for (pid_t pid : found) {
      if (killed.insert(pid).second) ::kill(pid, SIGKILL);
    }
    if (found.empty() || Clock::now() >= deadline) break;
    SleepFor(milliseconds(2));  // the killed ones are still dying
  }
  return static_cast<int>(killed.size());
}

// Names the harness gives: "nst<pid><letter>" + "h<i>" (namespace), "br" (bridge), "v<i>" (veth).
// Returns the creating pid and what follows the tag, or nullopt for a name that is not ours.
std::optional<std::pair<pid_t, std::string_view>> ParseName(std::string_view name) {
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  pid_t pid = 0;
  auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), pid);
  if (ec != std::errc() || pid <= 0) return std::nullopt;
  std::string_view rest(end, static_cast<size_t>(name.data() + name.size() - end));
  if (rest.empty() || rest[0] < 'a' || rest[0] > 'z') return std::nullopt;
  rest.remove_prefix(1);
  auto digits = [](std::string_view s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
  };
  bool ours = rest == "br" ||
              (rest.size() > 1 && (rest[0] == 'h' || rest[0] == 'v') && digits(rest.substr(1)));
  if (!ours) return std::nullopt;
  return std::make_pair(pid, rest);
}

std::vector<std::string> ListDir(std::string_view dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(std::string(dir).c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    std::string_view n(e->d_name);
    if (n != "." && n != "..") out.emplace_back(n);
  }
  ::closedir(d);
  return out;
}

// Whether the creator of `name` (a namespace or link of ours, parsed by ParseName) still runs: its
// pid is running and, when the cluster's bridge says when its creator started, started then (pids
// wrap).
bool CreatorAlive(std::string_view name, std::pair<pid_t, std::string_view> parsed) {
  auto start = ProcessStart(parsed.first);
  if (!start) return false;
  std::string_view tag = name.substr(0, name.size() - parsed.second.size());
  std::ifstream in(fmt::format("{}/{}br/ifalias", kSysNet, tag));
  std::string alias;
  std::getline(in, alias);
  unsigned long long alias_pid = 0, alias_start = 0;
  if (size_t at = alias.find(" creator ");
      at != std::string::npos &&
      std::sscanf(alias.c_str() + at, " creator %llu %llu", &alias_pid, &alias_start) == 2) {
    return alias_start == *start;
  }
  return true;
}

// Removes the namespaces, veths and bridges of creators that are no longer alive. Which creators
// are dead is decided before anything is deleted (the bridge's alias is part of the evidence).
// Errors are ignored: another process may be removing the same leftovers.
void RemoveLeftovers() {
  std::vector<std::string> dead_netns, dead_links;
  std::map<std::string, bool, std::less<>> alive;  // by tag
  auto dead = [&alive](const std::string& name, std::pair<pid_t, std::string_view> parsed) {
    std::string tag = name.substr(0, name.size() - parsed.second.size());
    auto it = alive.find(tag);
    if (it == alive.end()) it = alive.emplace(tag, CreatorAlive(name, parsed)).first;
    return !it->second;
  };
  for (const auto& ns : ListDir(kNetnsDir)) {
    auto parsed = ParseName(ns);
    if (parsed && parsed->second[0] == 'h' && dead(ns, *parsed)) dead_netns.push_back(ns);
  }
  for (const auto& link : ListDir(kSysNet)) {
    auto parsed = ParseName(link);
    if (parsed && parsed->second[0] != 'h' && dead(link, *parsed)) dead_links.push_back(link);
  }
  for (const auto& ns : dead_netns) {
    NONSTOP_LOG_INFO("netns: removing namespace {}, left by a creator that is gone", ns);
    if (auto id = NsIdOf(NetnsPath(ns))) KillNamespace(*id);
    Ip({"netns", "delete", ns}).IgnoreError();
  }
  for (const auto& link : dead_links) {
    if (!Exists(LinkPath(link))) continue;  // a veth that went with its namespace
    NONSTOP_LOG_INFO("netns: removing link {}, left by a creator that is gone", link);
    Ip({"link", "delete", link}).IgnoreError();
  }
}

// Subnets already taken: those of the other clusters' bridges (their alias) and every IPv4 network
// of the root namespace. Returns whether 10.a.b.0/24 overlaps any of them.
class TakenSubnets {
 public:
  TakenSubnets() {
    for (const auto& link : ListDir(kSysNet)) {
      auto parsed = ParseName(link);
      if (!parsed || parsed->second != "br") continue;
      std::ifstream in(LinkPath(link) + "/ifalias");
      std::string alias;
      std::getline(in, alias);
      unsigned a = 0, b = 0;
      if (alias.rfind(kAliasPrefix, 0) == 0 &&
          std::sscanf(alias.c_str() + kAliasPrefix.size(), "10.%u.%u.0/24", &a, &b) == 2) {
        networks_.push_back({(10u << 24) | (a << 16) | (b << 8), 24});
      }
    }
    ifaddrs* ifs = nullptr;
    if (::getifaddrs(&ifs) == 0) {
      for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
        if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET ||
            i->ifa_netmask == nullptr)
          continue;
        uint32_t addr = ntohl(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr);
        uint32_t mask = ntohl(reinterpret_cast<sockaddr_in*>(i->ifa_netmask)->sin_addr.s_addr);
        networks_.push_back({addr, std::popcount(mask)});
      }
      ::freeifaddrs(ifs);
    }
  }

  bool Overlaps(int a, int b) const {
    uint32_t net = (10u << 24) | (static_cast<uint32_t>(a) << 16) | (static_cast<uint32_t>(b) << 8);
    for (const auto& [other, prefix] : networks_) {
      int p = std::min(prefix, 24);
      uint32_t mask = p == 0 ? 0 : ~uint32_t{0} << (32 - p);
      if ((net & mask) == (other & mask)) return true;
    }
    return false;
  }

 private:
  std::vector<std::pair<uint32_t, int>> networks_;  // (address, prefix length)
};

// Holds an exclusive flock on kLockPath: creators choose names and subnets, and remove leftovers,
// one at a time across processes.
class CreateLock {
 public:
  Status Acquire() {
    fd_.Reset(::open(std::string(kLockPath).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    if (!fd_.valid())
      return ErrnoStatus(StatusCode::kFailedPrecondition, fmt::format("open {}", kLockPath), errno);
    const auto deadline = Clock::now() + kLockTimeout;
    while (::flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) {
        return ErrnoStatus(StatusCode::kInternal, fmt::format("flock {}", kLockPath), errno);
      }
      if (Clock::now() >= deadline) {
        return DeadlineExceededError(
            fmt::format("{} stayed locked for {} s by another cluster's creator", kLockPath,
                        kLockTimeout.count() / 1000));
      }
      SleepFor(milliseconds(10));
    }
    return OkStatus();
  }

 private:
  UniqueFd fd_;  // closing it releases the lock
};

// Reclassifies a failure of the first namespace or link creation as the environment's fault, with a
// hint.
Status EnvironmentRefused(const Status& s, std::string_view what, std::string_view hint) {
  return FailedPreconditionError(
      fmt::format("{} was refused: {} (HINT: {})", what, s.message(), hint));
}

std::atomic<unsigned> next_cluster{0};

}  // namespace

Result<std::unique_ptr<NetnsCluster>> NetnsCluster::Create(int hosts, NetnsFamily family) {
  if (hosts < 1 || hosts > kMaxHosts) {
    return InvalidArgumentError(
        fmt::format("NetnsCluster::Create({}): hosts must be in [1, {}]", hosts, kMaxHosts));
  }
  NONSTOP_RETURN_IF_ERROR(CheckPrivileges());
  NONSTOP_RETURN_IF_ERROR(Ip({"-V"}));
  if (::mkdir(std::string(kNetnsDir).c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus(StatusCode::kFailedPrecondition, fmt::format("mkdir {}", kNetnsDir), errno);
  }
  CreateLock lock;
  NONSTOP_RETURN_IF_ERROR(lock.Acquire());
  RemoveLeftovers();

  std::unique_ptr<NetnsCluster> c(new NetnsCluster());
  // A tag no live cluster of this process uses: one letter per cluster, 26 at once.
  const pid_t pid = ::getpid();
  for (int tries = 0; tries < 26 && c->tag_.empty(); ++tries) {
    unsigned seq = next_cluster.fetch_add(1) % 26;
    std::string tag = fmt::format("{}{}{}", kPrefix, pid, static_cast<char>('a' + seq));
    if (!Exists(LinkPath(tag + "br")) && !Exists(NetnsPath(tag + "h0"))) c->tag_ = tag;
  }
  if (c->tag_.empty()) {
    return FailedPreconditionError("26 clusters already exist in this process: destroy some first");
  }
  c->bridge_ = c->tag_ + "br";

  // The subnet: a start derived from the tag (so that concurrent creators rarely even probe the
  // same candidates), then the first one that overlaps nothing taken.
  TakenSubnets taken;
  const unsigned start =
      (static_cast<unsigned>(pid) * 26 + static_cast<unsigned>(c->tag_.back() - 'a')) * 7919;
  int a = -1, b = -1;
  for (int i = 0; i < kSubnets; ++i) {
    int k = static_cast<int>((start + static_cast<unsigned>(i)) % kSubnets);
    if (!taken.Overlaps(kFirstA + k / 256, k % 256)) {
      a = kFirstA + k / 256;
      b = k % 256;
      break;
    }
  }
  if (a < 0)
    return FailedPreconditionError(fmt::format("every subnet 10.{}-254.x.0/24 is taken", kFirstA));
  // The bridge's alias records the IPv4 subnet either way: the IPv6 one is derived from it.
  c->family_ = family;
  c->ipv4_subnet_ = fmt::format("10.{}.{}.0/24", a, b);
  const bool v6 = family == NetnsFamily::kIPv6;
  c->subnet_ =
      v6 ? fmt::format("fd6e:7374:{:x}:{:x}::/64", a, b) : fmt::format("10.{}.{}.0/24", a, b);
  for (int i = 0; i < hosts; ++i) {
    c->hosts_.push_back(Host{.netns = fmt::format("{}h{}", c->tag_, i),
                             .bridge_port = fmt::format("{}v{}", c->tag_, i),
                             .address = v6 ? fmt::format("fd6e:7374:{:x}:{:x}::{:x}", a, b, i + 1)
                                           : fmt::format("10.{}.{}.{}", a, b, i + 1)});
    NONSTOP_CHECK_LE(c->hosts_.back().bridge_port.size(), 15u)
        << "Linux interface names are at most 15 chars";
  }

  Status s = c->Build();
  if (!s.ok()) {
    c->Destroy().IgnoreError();
    return s.WithContext(fmt::format("creating a {}-host network namespace cluster", hosts));
  }
  NONSTOP_LOG_INFO("netns: cluster {} up: {} hosts on {} (bridge {})", c->tag_, hosts, c->subnet_,
                   c->bridge_);
  return c;
}

Status NetnsCluster::Build() {
  Status s = Ip({"link", "add", bridge_, "type", "bridge"});
  if (!s.ok()) {
    return EnvironmentRefused(s, fmt::format("creating bridge {}", bridge_),
                              "the kernel needs the bridge and veth drivers: modprobe bridge veth");
  }
  auto start = ProcessStart(::getpid());
  NONSTOP_CHECK(start.has_value()) << "reading /proc/self/stat";
  NONSTOP_RETURN_IF_ERROR(
      Ip({"link", "set", "dev", bridge_, "alias",
          fmt::format("{}{} creator {} {}", kAliasPrefix, ipv4_subnet_, ::getpid(), *start)}));
  NONSTOP_RETURN_IF_ERROR(Ip({"link", "set", "dev", bridge_, "up"}));
  for (const Host& h : hosts_) {
    s = Ip({"netns", "add", h.netns});
    if (!s.ok()) {
      return EnvironmentRefused(s, fmt::format("creating network namespace {}", h.netns),
                                "an unprivileged container (docker without --privileged, or a "
                                "seccomp/AppArmor profile that "
                                "forbids unshare and mount) cannot create network namespaces: run "
                                "the multihost tests on a VM or "
                                "a host, or in a container started with --privileged");
    }
    NONSTOP_RETURN_IF_ERROR(Ip({"-n", h.netns, "link", "set", "dev", "lo", "up"}));
    // The namespace end is created inside the namespace as eth0: the root namespace only sees the
    // bridge end.
    NONSTOP_RETURN_IF_ERROR(Ip(
        {"link", "add", h.bridge_port, "type", "veth", "peer", "name", "eth0", "netns", h.netns}));
    NONSTOP_RETURN_IF_ERROR(Ip({"link", "set", "dev", h.bridge_port, "master", bridge_}));
    NONSTOP_RETURN_IF_ERROR(Ip({"link", "set", "dev", h.bridge_port, "up"}));
    if (family_ == NetnsFamily::kIPv6) {
      // nodad: duplicate address detection would keep the address "tentative" (unusable) for a
      // second or two; the harness's addresses are unique by construction.
      NONSTOP_RETURN_IF_ERROR(
          Ip({"-n", h.netns, "-6", "addr", "add", h.address + "/64", "dev", "eth0", "nodad"}));
    } else {
      NONSTOP_RETURN_IF_ERROR(Ip({"-n", h.netns, "addr", "add", h.address + "/24", "dev", "eth0"}));
    }
    NONSTOP_RETURN_IF_ERROR(Ip({"-n", h.netns, "link", "set", "dev", "eth0", "up"}));
  }
  return OkStatus();
}

NetnsCluster::~NetnsCluster() {
  try {
    Status s = Destroy();
    if (!s.ok()) NONSTOP_LOG_WARNING("netns: destroying cluster {}: {}", tag_, s.ToString());
  } catch (...) {  // NOLINT: a destructor never throws; what is left, the next Create removes
  }
}

Status NetnsCluster::Destroy() {
  if (destroyed_) return OkStatus();
  destroyed_ = true;
  Status first;
  auto keep = [&first](Status s) {
    if (first.ok() && !s.ok()) first = std::move(s);
  };
  for (const Host& h : hosts_) {
    if (auto id = NsIdOf(NetnsPath(h.netns))) KillNamespace(*id);
  }
  const auto deadline = Clock::now() + kReapTimeout;
  for (pid_t pid : children_) {
    bool not_child = false;
    if (!WaitUntil(pid, deadline, &not_child) && !not_child) {
      keep(DeadlineExceededError(fmt::format(
          "spawned process {} did not exit within {} ms of SIGKILL", pid, kReapTimeout.count())));
    }
  }
  children_.clear();
  // Deleting one end of a veth pair deletes both; then the bridge, then the (empty) namespaces.
  for (const Host& h : hosts_) {
    if (Exists(LinkPath(h.bridge_port))) keep(Ip({"link", "delete", h.bridge_port}));
  }
  if (!bridge_.empty() && Exists(LinkPath(bridge_))) keep(Ip({"link", "delete", bridge_}));
  for (const Host& h : hosts_) {
    if (Exists(NetnsPath(h.netns))) keep(Ip({"netns", "delete", h.netns}));
  }
  return first;
}

const NetnsCluster::Host& NetnsCluster::HostAt(int host) const {
  NONSTOP_CHECK(host >= 0 && host < hosts())
      << "host " << host << " of a " << hosts() << "-host cluster";
  return hosts_[static_cast<size_t>(host)];
}

const std::string& NetnsCluster::address(int host) const { return HostAt(host).address; }

std::string NetnsCluster::HostPort(int host, int port) const {
  return family_ == NetnsFamily::kIPv6 ? fmt::format("[{}]:{}", address(host), port)
                                       : fmt::format("{}:{}", address(host), port);
}
const std::string& NetnsCluster::name(int host) const { return HostAt(host).netns; }
const std::string& NetnsCluster::bridge_port(int host) const { return HostAt(host).bridge_port; }

Result<pid_t> NetnsCluster::Spawn(int host, const std::vector<std::string>& argv,
                                  const std::vector<std::pair<std::string, std::string>>& env,
                                  const std::string& log_path) {
  const Host& h = HostAt(host);
  NONSTOP_CHECK(!destroyed_) << "Spawn on a destroyed cluster";
  if (argv.empty()) return InvalidArgumentError("Spawn: empty argv");
  UniqueFd netns(::open(NetnsPath(h.netns).c_str(), O_RDONLY | O_CLOEXEC));
  if (!netns.valid())
    return ErrnoStatus(StatusCode::kInternal, fmt::format("open {}", NetnsPath(h.netns)), errno);
  UniqueFd log(::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!log.valid())
    return ErrnoStatus(StatusCode::kInvalidArgument, fmt::format("open {}", log_path), errno);
  // This process's environment, with `env` replacing or adding entries.
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) envs.emplace_back(*e);
  for (const auto& [k, v] : env) {
    std::string key = k + "=";
    std::erase_if(envs,
                  [&key](const std::string& e) { return e.compare(0, key.size(), key) == 0; });
    envs.push_back(key + v);
  }
  auto pid = ForkExec(argv, &envs, netns.get(), log.get());
  if (!pid.ok())
    return pid.status().WithContext(fmt::format("spawn in {} ({})", h.netns, h.address));
  children_.insert(*pid);
  return *pid;
}

std::optional<int> NetnsCluster::WaitForExit(pid_t pid, std::chrono::milliseconds timeout) {
  bool not_child = false;
  auto status = WaitUntil(pid, Clock::now() + timeout, &not_child);
  if (status || not_child) children_.erase(pid);
  return status;
}

int NetnsCluster::KillHost(int host) {
  const Host& h = HostAt(host);
  auto id = NsIdOf(NetnsPath(h.netns));
  if (!id) return 0;
  int n = KillNamespace(*id);
  NONSTOP_LOG_INFO("netns: host {} ({}) crashed: {} processes killed", host, h.netns, n);
  return n;
}

int NetnsCluster::SignalHost(int host, int signal) {
  const Host& h = HostAt(host);
  auto id = NsIdOf(NetnsPath(h.netns));
  if (!id) return 0;
  std::vector<pid_t> pids = ProcessesIn(*id);
  for (pid_t pid : pids) ::kill(pid, signal);
  NONSTOP_LOG_INFO("netns: host {} ({}): signal {} sent to {} processes", host, h.netns, signal,
                   pids.size());
  return static_cast<int>(pids.size());
}

Status NetnsCluster::LinkDown(int host) {
  return Ip({"link", "set", "dev", HostAt(host).bridge_port, "down"});
}

Status NetnsCluster::LinkUp(int host) {
  NONSTOP_RETURN_IF_ERROR(Ip({"link", "set", "dev", HostAt(host).bridge_port, "up"}));
  // An address resolution that failed during the partition, or is still failing (ARP probes sent
  // while the link was down), would fail the first connection after the heal with EHOSTUNREACH:
  // every host forgets its neighbours and resolves them afresh.
  for (const Host& h : hosts_)
    NONSTOP_RETURN_IF_ERROR(Ip({"-n", h.netns, "neigh", "flush", "dev", "eth0"}));
  return OkStatus();
}

Status NetnsCluster::RunIn(int host, const std::function<void()>& fn) {
  const Host& h = HostAt(host);
  UniqueFd netns(::open(NetnsPath(h.netns).c_str(), O_RDONLY | O_CLOEXEC));
  if (!netns.valid())
    return ErrnoStatus(StatusCode::kInternal, fmt::format("open {}", NetnsPath(h.netns)), errno);
  int err = 0;
  std::thread t([&] {
    if (::setns(netns.get(), CLONE_NEWNET) != 0) {
      err = errno;
      return;
    }
    fn();
  });
  t.join();
  if (err != 0) return ErrnoStatus(StatusCode::kInternal, fmt::format("setns {}", h.netns), err);
  return OkStatus();
}

Result<std::pair<int, std::string>> NetnsCluster::Exec(int host,
                                                       const std::vector<std::string>& argv,
                                                       std::chrono::milliseconds timeout) {
  const Host& h = HostAt(host);
  if (argv.empty()) return InvalidArgumentError("Exec: empty argv");
  UniqueFd netns(::open(NetnsPath(h.netns).c_str(), O_RDONLY | O_CLOEXEC));
  if (!netns.valid())
    return ErrnoStatus(StatusCode::kInternal, fmt::format("open {}", NetnsPath(h.netns)), errno);
  auto r = RunCommand(argv, netns.get(), timeout);
  if (!r.ok()) return r.status().WithContext(fmt::format("exec in {} ({})", h.netns, h.address));
  return r;
}

}  // namespace nonstop::testing
