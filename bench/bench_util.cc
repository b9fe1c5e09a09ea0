#include "bench/bench_util.h"

#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>
#include <thread>

#include <fmt/format.h>

#include "controller/journal.h"
#include "net/socket.h"
#include "nonstop/crc32c.h"

namespace nonstop::bench {

namespace fs = std::filesystem;
using nlohmann::json;

std::string SelfDir() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "." : p.parent_path().string();
}

Result<pid_t> StartCommand(const std::vector<std::string>& argv, const std::string& log) {
  if (argv.empty()) return InvalidArgumentError("no program to start");
  fmt::print("$");
  for (const auto& a : argv) fmt::print(" {}", a);
  fmt::print("\n");
  std::fflush(stdout);
  pid_t pid = ::fork();
  if (pid < 0) return UnavailableError(fmt::format("cannot fork to start {}", argv[0]));
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    (void)f;
    ::dup2(STDOUT_FILENO, STDERR_FILENO);
    std::vector<char*> args;
    std::vector<std::string> copy = argv;
    for (auto& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

int WaitCommand(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int RunCommand(const std::vector<std::string>& argv, const std::string& log) {
  auto pid = StartCommand(argv, log);
  if (!pid.ok()) {
    fmt::print(stderr, "{}\n", pid.status().ToString());
    return 127;
  }
  return WaitCommand(*pid);
}

Result<JournalSummary> ReadJournalSummary(const std::string& path) {
  NONSTOP_ASSIGN_OR_RETURN(std::vector<json> records, controller::Journal::Read(path));
  JournalSummary r;
  double t0 = -1;
  std::map<int64_t, int> seen;
  std::string reason_checksum;
  for (auto& j : records) {
    double t = j.value("time_us", 0.0) / 1e6;
    std::string ev = j.value("event", "");
    if (ev == "job_start" && t0 < 0) {
      t0 = t;
      r.start_epoch_s = t;
    }
    if (t0 < 0) continue;
    j["t"] = t - t0;
    if (ev == "step") {
      int64_t s = j.value("step", int64_t{-1});
      r.steps.push_back({s, t - t0});
      if (seen[s]++ > 0) ++r.redone;
    } else if (ev == "fault_injected") {
      InjectedFault f;
      f.spec = j.value("fault", "");
      f.worker_id = j.value("worker_id", -1);
      std::smatch m;
      if (std::regex_search(f.spec, m, std::regex("step=(\\d+)"))) f.step = std::stoll(m[1]);
      f.t = t - t0;
      r.injected.push_back(f);
    } else if (ev == "finished") {
      std::string c = j.value("checksum", "");
      if (!r.checksum.empty() && c != r.checksum) r.checksums_agree = false;
      if (r.checksum.empty()) r.checksum = c;
    } else if (ev == "job_end") {
      r.wall = t - t0;
      r.journal_exit_code = j.value("exit_code", -1);
      std::smatch m;
      std::string reason = j.value("reason", "");
      if (std::regex_search(reason, m, std::regex("checksum ([0-9a-f]{8})")))
        reason_checksum = m[1];
    } else if (ev == "recovery_end" && j.contains("recovery")) {
      r.recoveries.push_back(j["recovery"]);
    }
    r.records.push_back(j);
  }
  if (t0 < 0)
    return NotFoundError(
        fmt::format("journal {} has no job_start record: did the job start?", path));
  if (r.checksum.empty()) r.checksum = reason_checksum;
  r.distinct = static_cast<int64_t>(seen.size());
  return r;
}

double MedianStepInterval(const std::vector<StepEvent>& steps) {
  std::vector<double> d;
  for (size_t i = 1; i < steps.size(); ++i) d.push_back(steps[i].t - steps[i - 1].t);
  if (d.empty()) return 0;
  std::sort(d.begin(), d.end());
  return d[d.size() / 2];
}

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return -1;
  std::sort(values.begin(), values.end());
  double rank = std::ceil(p / 100.0 * static_cast<double>(values.size()));
  size_t i = rank < 1 ? 0 : static_cast<size_t>(rank) - 1;
  return values[std::min(i, values.size() - 1)];
}

double MeanOfMeasured(const std::vector<double>& values) {
  double s = 0;
  int n = 0;
  for (double x : values) {
    if (x >= 0) {
      s += x;
      ++n;
    }
  }
  return n ? s / n : -1;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; };
  return secs(u.ru_utime) + secs(u.ru_stime);
}

double RawTcp(std::span<const std::byte> src, std::span<std::byte> dst, int streams,
              size_t checked_piece, double* cpu_seconds) {
  auto l = net::Listen({"127.0.0.1", 0});
  NONSTOP_CHECK(l.ok()) << l.status().ToString();
  std::vector<UniqueFd> out, in;
  for (int i = 0; i < streams; ++i) {
    auto fd = net::Dial(l->address, DeadlineAfter(Millis(5000)));
    NONSTOP_CHECK(fd.ok()) << fd.status().ToString();
    out.push_back(std::move(*fd));
    NONSTOP_CHECK(
        net::WaitFd(l->fd.get(), POLLIN, DeadlineAfter(Millis(5000)), nullptr, "accept").ok());
    auto c = net::Accept(l->fd.get());
    NONSTOP_CHECK(c.ok()) << c.status().ToString();
    in.push_back(std::move(*c));
  }
  const size_t per = (src.size() + static_cast<size_t>(streams) - 1) / static_cast<size_t>(streams);
  // The pieces of [lo, lo + n): all of it at once unchecked.
  auto pieces = [&](size_t lo, size_t n, auto&& each) {
    const size_t step = checked_piece > 0 ? checked_piece : std::max<size_t>(n, 1);
    for (size_t at = lo; at < lo + n; at += step) each(at, std::min(step, lo + n - at));
  };
  // Each stream's CRC over its pieces, as sent and as received (each entry one thread's).
  std::vector<uint32_t> sent(static_cast<size_t>(streams)), received(sent.size());
  std::vector<std::thread> threads;
  const double cpu0 = ProcessCpuSeconds();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < streams; ++i) {
    const size_t lo = std::min(src.size(), per * static_cast<size_t>(i));
    const size_t n = std::min(per, src.size() - lo);
    threads.emplace_back([&, i, lo, n] {
      pieces(lo, n, [&](size_t at, size_t len) {
        uint32_t& crc = sent[static_cast<size_t>(i)];
        if (checked_piece > 0) crc = Crc32cExtend(crc, src.data() + at, len);
        NONSTOP_CHECK(net::SendAll(out[static_cast<size_t>(i)].get(), src.subspan(at, len),
                                   kNoDeadline, nullptr, "raw")
                          .ok());
      });
    });
    threads.emplace_back([&, i, lo, n] {
      pieces(lo, n, [&](size_t at, size_t len) {
        NONSTOP_CHECK(net::RecvAll(in[static_cast<size_t>(i)].get(), dst.subspan(at, len),
                                   kNoDeadline, nullptr, "raw")
                          .ok());
        uint32_t& crc = received[static_cast<size_t>(i)];
        if (checked_piece > 0) crc = Crc32cExtend(crc, dst.data() + at, len);
      });
    });
  }
  for (auto& t : threads) t.join();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (cpu_seconds != nullptr) *cpu_seconds = ProcessCpuSeconds() - cpu0;
  NONSTOP_CHECK(sent == received) << "raw TCP: a stream's bytes arrived changed";
  return secs;
}

}  // namespace nonstop::bench
