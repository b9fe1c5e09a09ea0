// nonstop-bench-etcd-rate: what a controller failover costs etcd as the job
// grows (issue 25, docs/leader-discovery.md).
//
// One real etcd; a leader (coord::Leadership in a child process, so that it
// can be SIGKILLed: its lease then runs out as a dead controller's would) and
// a standby (in this process) that campaigns and publishes its address once
// it leads. Around them, a simulated job of N workers on hosts of 8, finding
// the new leader in one of two ways:
//
//  watch: the way nonstop does it: one coord::LeaderWatch per host (the
//    agent's), whose workers read the host's leader file, not etcd.
//  poll: the way it did before: every worker and every agent asks etcd for
//    the leader key every 100 ms (plus up to 50% at random) from the kill on,
//    until it sees the new leader. The pollers are simulated by a pool of
//    threads, each with one etcd client, that make the polls as they fall
//    due (as fast as etcd answers: the offered rate is 10·(N + hosts)/s).
//
// Measured for each mode and size: from the SIGKILL to when every host (or
// poller) knows the new leader (it includes the lease running out), the
// requests etcd handled meanwhile (its /metrics: grpc_server_handled_total,
// every method, plus the watch streams started), and their rate. Output: a
// table, and results.json in --out.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <queue>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "common/temp_dir.h"
#include "common/time.h"
#include "coord/etcd.h"
#include "coord/leader_watch.h"
#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"

namespace nonstop::bench {
namespace {

using json = nlohmann::json;
using SteadyClock = std::chrono::steady_clock;

constexpr char kJob[] = "bench";
constexpr char kOldLeader[] = "10.0.0.1:1111";
constexpr char kNewLeader[] = "10.0.0.2:2222";
constexpr int kWorkersPerHost = 8;

double MsSince(SteadyClock::time_point t) {
  return std::chrono::duration<double, std::milli>(SteadyClock::now() - t).count();
}

// The requests etcd has handled so far: every finished gRPC call (the JSON gateway's requests
// become gRPC calls inside etcd) and every stream started (a watch).
Result<double> EtcdRequests(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  httplib::Client http(endpoint.substr(0, colon), std::stoi(endpoint.substr(colon + 1)));
  http.set_read_timeout(10);
  auto res = http.Get("/metrics");
  if (!res || res->status != 200)
    return UnavailableError("etcd's /metrics at " + endpoint + " did not answer");
  std::istringstream in(res->body);
  double total = 0;
  for (std::string line; std::getline(in, line);) {
    const bool handled = line.rfind("grpc_server_handled_total{", 0) == 0;
    const bool watch = line.rfind("grpc_server_started_total{", 0) == 0 &&
                       line.find("grpc_type=\"bidi_stream\"") != std::string::npos;
    if (!handled && !watch) continue;
    total += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return total;
}

coord::LeadershipOptions Options(const std::string& endpoint, int ttl_s) {
  coord::LeadershipOptions o;
  o.endpoints = endpoint;
  o.job = kJob;
  o.ttl_seconds = ttl_s;
  return o;
}

// The leader, in a process of its own (this program with --leader): campaigns, publishes
// kOldLeader, writes one byte to stdout and waits to be killed.
int RunLeader(const std::string& endpoint, int ttl_s) {
  auto l = coord::Leadership::Connect(Options(endpoint, ttl_s));
  if (!l.ok()) return 2;
  auto epoch = (*l)->Campaign([] { return false; }, [](const std::string&) {});
  if (!epoch.ok() || !(*l)->ReadJournal(crypto::JobKey("bench")).ok() ||
      !(*l)->Publish({{"controller", kOldLeader}}, crypto::JobKey(kJob)).ok())
    return 3;
  char c = '1';
  if (::write(STDOUT_FILENO, &c, 1) != 1) return 4;
  while (true) ::pause();
}

// Starts the leader (fork, then exec: this process runs threads) and waits until it leads.
pid_t StartLeader(const std::string& endpoint, int ttl_s) {
  int ready[2];
  if (::pipe(ready) != 0) return -1;
  std::vector<std::string> args = {"nonstop-bench-etcd-rate", "--leader", endpoint, "--lease-ttl-s",
                                   std::to_string(ttl_s)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t child = ::fork();
  if (child == 0) {
    ::dup2(ready[1], STDOUT_FILENO);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  ::close(ready[1]);
  char c = 0;
  const bool ok = child > 0 && ::read(ready[0], &c, 1) == 1;
  ::close(ready[0]);
  if (!ok && child > 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    return -1;
  }
  return child;
}

// How many of `observers` know the new leader yet, by mode.
struct Observers {
  virtual ~Observers() = default;
  virtual size_t count() const = 0;
  virtual size_t knowing() const = 0;
};

// One LeaderWatch per host, each keeping a leader file.
class Watchers final : public Observers {
 public:
  static Result<std::unique_ptr<Watchers>> Start(const std::string& endpoint, int hosts,
                                                 const std::string& dir) {
    auto w = std::unique_ptr<Watchers>(new Watchers());
    for (int h = 0; h < hosts; ++h) {
      auto watch = coord::LeaderWatch::Start(endpoint, kJob, fmt::format("{}/leader-{}", dir, h));
      if (!watch.ok()) return watch.status();
      w->watches_.push_back(std::move(*watch));
    }
    return w;
  }
  size_t count() const override { return watches_.size(); }
  size_t knowing() const override { return Knowing(kNewLeader); }
  size_t Knowing(const std::string& leader) const {
    size_t n = 0;
    for (const auto& w : watches_) {
      auto keys = w->keys();
      n += keys.leader && keys.leader->find(leader) != std::string::npos ? 1 : 0;
    }
    return n;
  }

 private:
  Watchers() = default;
  std::vector<std::unique_ptr<coord::LeaderWatch>> watches_;
};

// `pollers` simulated pollers on `threads` threads: each asks every 100 ms (+ up to 50%) until
// it sees the new leader.
class Pollers final : public Observers {
 public:
  Pollers(const std::string& endpoint, int pollers, int threads) : count_(pollers) {
    for (int t = 0; t < threads; ++t) {
      const int mine = pollers / threads + (t < pollers % threads ? 1 : 0);
      threads_.emplace_back([this, endpoint, mine, t] { Run(endpoint, mine, t); });
    }
  }
  ~Pollers() override {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }
  size_t count() const override { return count_; }
  size_t knowing() const override { return knowing_.load(); }

 private:
  void Run(const std::string& endpoint, int mine, int seed) {
    auto client = etcd::Client::Create(endpoint, {std::chrono::milliseconds(2'000)});
    if (!client.ok()) return;
    std::mt19937 rng(static_cast<uint32_t>(seed));
    std::uniform_int_distribution<int> jitter(0, 50);
    using Due = std::pair<SteadyClock::time_point, int>;
    std::priority_queue<Due, std::vector<Due>, std::greater<>> due;
    for (int i = 0; i < mine; ++i) due.push({SteadyClock::now(), i});
    while (!stop_ && !due.empty()) {
      auto [at, i] = due.top();
      if (at > SteadyClock::now()) {
        std::this_thread::sleep_until(
            std::min(at, SteadyClock::now() + std::chrono::milliseconds(10)));
        continue;
      }
      due.pop();
      auto leader = coord::LookUpLeader(**client, kJob);
      if (leader.ok() && *leader == kNewLeader) {
        ++knowing_;
        continue;
      }
      due.push({SteadyClock::now() + std::chrono::milliseconds(100 + jitter(rng)), i});
    }
  }
  const size_t count_;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> knowing_{0};
  std::vector<std::thread> threads_;
};

struct Settings {
  std::vector<int> sizes = {1'000, 10'000};
  std::vector<std::string> modes = {"watch", "poll"};
  int ttl_s = 10;
  int poll_threads = 64;
  double timeout_s = 120;
  std::string out = "etcd-rate-results";
};

json RunOne(const std::string& mode, int workers, const Settings& o) {
  const int hosts = (workers + kWorkersPerHost - 1) / kWorkersPerHost;
  json r = {{"mode", mode}, {"workers", workers}, {"hosts", hosts}, {"ttl_s", o.ttl_s}};
  TempDir dir;
  nonstop::testing::EtcdServer etcd(dir.path());
  if (etcd.endpoint().empty()) {
    r["error"] = "etcd did not start: " + etcd.Output();
    return r;
  }
  const std::string endpoint = etcd.endpoint();
  pid_t leader = StartLeader(endpoint, o.ttl_s);
  if (leader < 0) {
    r["error"] = "the leader did not start";
    return r;
  }
  std::unique_ptr<Observers> observers;
  if (mode == "watch") {
    auto w = Watchers::Start(endpoint, hosts, dir.path());
    if (!w.ok()) {
      r["error"] = w.status().ToString();
      ::kill(leader, SIGKILL);
      ::waitpid(leader, nullptr, 0);
      return r;
    }
    // every host knows the first leader before the fault
    for (auto until = SteadyClock::now() + std::chrono::seconds(60);
         (*w)->Knowing(kOldLeader) < (*w)->count() && SteadyClock::now() < until;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    observers = std::move(*w);
  }
  // The standby campaigns from now on (it polls the leader key: part of the cost).
  auto standby = coord::Leadership::Connect(Options(endpoint, o.ttl_s));
  std::atomic<bool> stop_standby{false};
  SteadyClock::time_point published{};
  std::thread campaign([&] {
    auto epoch =
        (*standby)->Campaign([&] { return stop_standby.load(); }, [](const std::string&) {});
    if (epoch.ok() && (*standby)->ReadJournal(crypto::JobKey("bench")).ok() &&
        (*standby)->Publish({{"controller", kNewLeader}}, crypto::JobKey(kJob)).ok())
      published = SteadyClock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto before = EtcdRequests(endpoint);
  const auto killed = SteadyClock::now();
  ::kill(leader, SIGKILL);
  ::waitpid(leader, nullptr, 0);
  if (mode == "poll")
    observers = std::make_unique<Pollers>(endpoint, workers + hosts, o.poll_threads);
  const auto deadline = killed + std::chrono::duration<double>(o.timeout_s);
  while (observers->knowing() < observers->count() && SteadyClock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const double all_know_ms = MsSince(killed);
  auto after = EtcdRequests(endpoint);
  r["observers"] = observers->count();
  r["knowing"] = observers->knowing();
  r["all_know_ms"] = all_know_ms;
  if (published != SteadyClock::time_point{}) {
    r["published_ms"] = std::chrono::duration<double, std::milli>(published - killed).count();
  }
  if (before.ok() && after.ok()) {
    r["requests"] = *after - *before;
    r["requests_per_s"] = (*after - *before) / (all_know_ms / 1000.0);
  } else {
    r["error"] = "etcd's metrics could not be read";
  }
  observers.reset();
  stop_standby = true;
  campaign.join();
  if (standby.ok()) (*standby)->Resign();
  return r;
}

std::string Cell(const json& r, const char* key, const char* spec = "{:.0f}") {
  return r.contains(key) && r[key].is_number()
             ? fmt::format(fmt::runtime(spec), r[key].get<double>())
             : "-";
}

int Main(int argc, char** argv) {
  Settings o;
  CLI::App app{
      "etcd's request rate during a controller failover, by job size (docs/leader-discovery.md)"};
  app.add_option("--sizes", o.sizes, "Workers in the simulated job (hosts of 8)")->delimiter(',');
  app.add_option("--modes", o.modes, "watch (nonstop's), poll (every worker and agent asks)")
      ->delimiter(',');
  app.add_option("--lease-ttl-s", o.ttl_s, "The controllers' lease");
  app.add_option("--poll-threads", o.poll_threads, "Threads that make the simulated polls");
  app.add_option("--timeout-s", o.timeout_s, "Give up on a failover after this long");
  app.add_option("--out", o.out, "Where results.json goes");
  std::string leader;
  app.add_option("--leader", leader, "(internal) Be the leader on this etcd endpoint")->group("");
  CLI11_PARSE(app, argc, argv);
  if (!leader.empty()) return RunLeader(leader, o.ttl_s);
  // a watch per host holds two streams (and etcd as many): more than the usual 1,024 descriptors
  rlimit nofile{};
  if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0) {
    nofile.rlim_cur = nofile.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &nofile);
  }
  json results = json::array();
  fmt::print("{:>6} {:>7} {:>6} {:>10} {:>14} {:>14} {:>10} {:>12}\n", "mode", "workers", "hosts",
             "observers", "published ms", "all know ms", "requests", "requests/s");
  for (int n : o.sizes) {
    for (const std::string& mode : o.modes) {
      json r = RunOne(mode, n, o);
      fmt::print("{:>6} {:>7} {:>6} {:>10} {:>14} {:>14} {:>10} {:>12}{}\n", mode, n,
                 r["hosts"].get<int>(), r.value("observers", 0), Cell(r, "published_ms"),
                 Cell(r, "all_know_ms"), Cell(r, "requests"), Cell(r, "requests_per_s"),
                 r.contains("error") ? "  ERROR: " + r["error"].get<std::string>() : "");
      std::fflush(stdout);
      results.push_back(std::move(r));
    }
  }
  std::filesystem::create_directories(o.out);
  std::ofstream(o.out + "/results.json") << results.dump(2) << "\n";
  fmt::print("results: {}/results.json\n", o.out);
  for (const json& r : results) {
    if (r.contains("error") || r.value("knowing", 0) < r.value("observers", 1)) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
