// nonstop-bench-soak: a long run of the reference recipe under random faults.
//
// Runs nonstop-train (built-in llama-tiny recipe) under `nonstop run` with
// --nproc workers and --spares spares for about --minutes, while faults of
// every kind arrive at random (seeded) every --min-gap..--max-gap seconds:
//   from outside the job: SIGKILL and SIGSTOP sent by this program to a
//     member's process (its pid from GET /status on the job's HTTP address);
//   by injection: `nonstop run --inject kill|exception|drop:rank=R,step=S`.
// The first --quiet-start seconds (model build) and the last --quiet-end
// seconds are fault-free, so that the world is whole at the end. The step
// count is chosen so the job lasts the duration (a short calibration run
// measures the step time, or --steps). Then the same job runs without
// faults (or --reference-checksum) and the final parameter checksums are
// compared: checkpointless recovery must be bitwise exact.
//
// From the journal it reports: faults by kind and which were survived,
// recoveries by cause, time lost and downtime per fault (median, p95, max), completed steps
// lost, spares used and refilled, false alarms (recoveries no fault
// explains), the final world and spare pool, the exit code and the checksum.
// Output: a table on stdout and results.json (docs/soak.md). Exit 0 only if
// nothing was lost, the job exited 0 and the checksums are equal.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <httplib.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/bench_util.h"
#include "common/args.h"

namespace nonstop::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const std::vector<std::string> kAllKinds = {"sigkill", "sigstop", "kill", "exception", "drop"};

bool IsOutside(const std::string& kind) { return kind == "sigkill" || kind == "sigstop"; }

std::string KindLabel(const std::string& kind) {
  if (kind == "sigkill") return "SIGKILL (outside)";
  if (kind == "sigstop") return "SIGSTOP (outside)";
  return "inject " + kind;
}

double NowEpoch() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string MinSec(double seconds) {
  auto s = static_cast<int64_t>(std::max(0.0, seconds));
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

struct SoakOptions {
  double minutes = 30;
  uint64_t seed = 1;
  int nproc = 4;
  int spares = 2;
  double min_gap = 10, max_gap = 30;
  double quiet_start = 20, quiet_end = 60;
  int64_t steps = 0;
  int64_t calibration_steps = 20;
  double fault_cost = 3;
  double alarm_window = 10;
  double progress_every = 30;
  std::string reference_checksum;
  std::vector<std::string> kinds = kAllKinds;
  std::vector<std::string> run_args;
  std::string bin;
  std::string out = "bench-results/soak";
};

// One fault of the schedule, and what became of it.
struct Fault {
  int index = 0;
  std::string kind;  // sigkill, sigstop (sent by the soak), kill, exception, drop (injected)
  double at_s = 0;   // when it is due, seconds since the job started (outside faults)
  int rank = 0;
  int64_t step = -1;  // injected faults: the step
  std::string spec;   // injected faults: the --inject spec
  // What happened.
  std::string status = "pending";  // sent / skipped: why / fired / did not fire
  double t = -1;                   // when it happened, seconds since job_start (journal clock)
  double sent_epoch_s = 0;
  double postponed_s = 0;
  int worker_id = -1;
  int pid = -1;
  std::string detected_as;  // the journal's fault kind
  int recovery = -1;        // the recovery that handled it
  int final_recovery = -1;  // the end of its chain of superseding recoveries
  std::string outcome;
  bool survived = false;
  std::optional<double> time_lost_ms;  // the final recovery's (journal: the job's own figure)
  double downtime_ms = -1;             // the final recovery's downtime_ms (journal)
  // from the fault to the resumed step's completion, less a normal step
  double downtime_from_fault_ms = -1;
};

bool Happened(const Fault& f) { return f.status == "sent" || f.status == "fired"; }

// Steps the job is expected to take in its last --quiet-end seconds, when
// `steps` fill the duration after `startup_s` of model build.
int64_t QuietEndSteps(const SoakOptions& o, int64_t steps, double startup_s) {
  double seconds_per_step =
      std::max(1e-3, (o.minutes * 60 - startup_s) / static_cast<double>(steps));
  return static_cast<int64_t>(o.quiet_end / seconds_per_step);
}

// Plans the faults: the first after --quiet-start, then one every
// min_gap..max_gap seconds, none in the last --quiet-end seconds. Injected
// faults get the step the job is expected to be at by then.
std::vector<Fault> PlanFaults(const SoakOptions& o, int64_t steps, double startup_s) {
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> first(0, o.min_gap), gap(o.min_gap, o.max_gap);
  std::uniform_int_distribution<size_t> kind(0, o.kinds.size() - 1);
  std::uniform_int_distribution<int> rank(0, o.nproc - 1);
  const double duration = o.minutes * 60;
  const double seconds_per_step =
      std::max(1e-3, (duration - startup_s) / static_cast<double>(steps));
  const int64_t last_step = steps - 1 - QuietEndSteps(o, steps, startup_s);
  std::vector<Fault> faults;
  std::set<int64_t> used_steps;
  for (double t = o.quiet_start + first(rng); t <= duration - o.quiet_end; t += gap(rng)) {
    Fault f;
    f.index = static_cast<int>(faults.size()) + 1;
    f.kind = o.kinds[kind(rng)];
    f.at_s = t;
    f.rank = rank(rng);
    if (!IsOutside(f.kind)) {
      int64_t s = std::max<int64_t>(1, static_cast<int64_t>((t - startup_s) / seconds_per_step));
      while (used_steps.count(s)) ++s;
      if (s > last_step) continue;  // the job is expected to be in its fault-free end by then
      used_steps.insert(s);
      f.step = s;
      f.spec = fmt::format("{}:rank={},step={}", f.kind, f.rank, s);
    }
    faults.push_back(f);
  }
  return faults;
}

int ParentOf(int pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(text.substr(close + 1));
  std::string state;
  int ppid = -1;
  rest >> state >> ppid;
  return ppid;
}

// The running job as the soak sees it: its HTTP /status, polled.
class JobWatch {
 public:
  explicit JobWatch(std::string job_file) : job_file_(std::move(job_file)) {}

  // Polls GET /status; false while the job file or the endpoint is not there.
  bool Poll() {
    if (!client_) {
      std::ifstream in(job_file_);
      if (!in) return false;
      auto job = json::parse(in, nullptr, false);
      if (job.is_discarded() || !job.contains("http")) return false;
      std::string address = job["http"];
      size_t colon = address.rfind(':');
      if (colon == std::string::npos) return false;
      client_ = std::make_unique<httplib::Client>(address.substr(0, colon),
                                                  std::stoi(address.substr(colon + 1)));
      client_->set_connection_timeout(1);
      client_->set_read_timeout(2);
    }
    auto res = client_->Get("/status");
    if (!res || res->status != 200) return false;
    auto j = json::parse(res->body, nullptr, false);
    if (j.is_discarded()) return false;
    status_ = std::move(j);
    return true;
  }

  const json& status() const { return status_; }
  bool seen() const { return !status_.is_null(); }
  std::string phase() const { return status_.value("phase", "?"); }
  int spares() const { return status_.value("spares", 0); }
  int world_size() const { return status_.value("world_size", 0); }
  int64_t highest_step() const { return status_.value("highest_step", int64_t{-1}); }

  // The member holding `rank`, or any member when no worker holds it: (worker id, pid).
  std::optional<std::pair<int, int>> Member(int rank) const {
    std::optional<std::pair<int, int>> any;
    for (const auto& w : status_.value("workers", json::array())) {
      if (w.value("role", "") != "member") continue;
      std::pair<int, int> m{w.value("worker_id", -1), w.value("pid", -1)};
      if (w.value("rank", -1) == rank) return m;
      if (!any) any = m;
    }
    return any;
  }

 private:
  std::string job_file_;
  std::unique_ptr<httplib::Client> client_;
  json status_;
};

int CountInjected(const std::string& journal) {
  std::ifstream in(journal);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) n += line.find("\"fault_injected\"") != std::string::npos ? 1 : 0;
  return n;
}

// Sends an outside fault to the member holding f->rank, if that process is a child of `job_pid`.
void Send(Fault* f, const JobWatch& watch, pid_t job_pid) {
  auto member = watch.Member(f->rank);
  if (!member) {
    f->status = "skipped: no member in /status";
    return;
  }
  auto [worker_id, pid] = *member;
  if (pid <= 0 || ParentOf(pid) != job_pid) {
    f->status = fmt::format("skipped: pid {} is not a worker process of this job", pid);
    return;
  }
  f->worker_id = worker_id;
  f->pid = pid;
  f->sent_epoch_s = NowEpoch();
  if (::kill(pid, f->kind == "sigkill" ? SIGKILL : SIGSTOP) != 0) {
    f->status = fmt::format("skipped: kill({}) failed", pid);
    return;
  }
  f->status = "sent";
}

// The soak job: starts it, sends the outside faults on time, prints progress; returns its exit
// code. A job that runs past 2 × the duration + 10 minutes is stopped (SIGTERM, then SIGKILL 30 s
// later).
int RunSoakJob(const SoakOptions& o, const std::vector<std::string>& argv,
               const std::string& journal, int64_t steps, int64_t quiet_steps,
               std::vector<Fault>* faults, json* last_status) {
  fs::remove(fs::path(journal).parent_path() / "job.json");
  auto started = StartCommand(argv, o.out + "/soak.log");
  if (!started.ok()) {
    fmt::print(stderr, "nonstop-bench-soak: {}\n", started.status().ToString());
    return 127;
  }
  const pid_t job_pid = *started;
  const double start = NowEpoch();
  JobWatch watch((fs::path(journal).parent_path() / "job.json").string());
  const double give_up = 2 * o.minutes * 60 + 600;
  double next_poll = 0, next_progress = o.progress_every, kill_at = -1;
  size_t next = 0;  // the next fault to consider
  while (true) {
    int status = 0;
    pid_t done = ::waitpid(job_pid, &status, WNOHANG);
    if (done == job_pid) {
      *last_status = watch.status();
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    double now = NowEpoch() - start;
    if (now >= give_up && kill_at < 0) {
      fmt::print(
          "[soak] {} elapsed: the job is still running at 2 × the duration + 10 min: stopping it "
          "(SIGTERM)\n",
          MinSec(now));
      std::fflush(stdout);
      ::kill(job_pid, SIGTERM);
      kill_at = now + 30;
    } else if (kill_at >= 0 && now >= kill_at) {
      ::kill(job_pid, SIGKILL);
      kill_at = now + 1e9;
    }
    if (now >= next_poll) {
      watch.Poll();
      next_poll = now + 1;
    }
    while (next < faults->size() && !IsOutside((*faults)[next].kind)) ++next;
    if (next < faults->size() && watch.seen()) {
      Fault& f = (*faults)[next];
      double due = f.at_s + f.postponed_s;
      if (now >= due) {
        if (watch.highest_step() >= steps - 1 - quiet_steps) {
          f.status = "skipped: the job is in its fault-free end";
          ++next;
        } else if (watch.phase() != "running" || watch.spares() < 1) {
          // A fault with no spare left would shrink the world (and the checksum
          // would then differ by float rounding): wait for the pool to refill.
          f.postponed_s += 1;
          if (f.postponed_s > o.max_gap) {
            f.status = fmt::format("skipped: no spare and a running job for {:.0f} s", o.max_gap);
            ++next;
          }
        } else {
          Send(&f, watch, job_pid);
          ++next;
          next_poll = 0;
        }
      }
    }
    if (now >= next_progress) {
      next_progress += o.progress_every;
      int sent = 0;
      for (const Fault& f : *faults) sent += f.status == "sent" ? 1 : 0;
      fmt::print(
          "[soak] {} elapsed: step {}/{}, faults sent {}, injected fired {}, phase {}, world {}, "
          "spares {}, "
          "recoveries {}\n",
          MinSec(now), watch.highest_step(), steps, sent, CountInjected(journal), watch.phase(),
          watch.world_size(), watch.spares(), watch.status().value("recoveries", 0));
      std::fflush(stdout);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// What the journal says about the soak job, beyond JournalSummary.
struct Analysis {
  std::map<int, json> recovery_by_id;      // recovery_end's "recovery" by id
  std::map<int, double> recovery_end_t;    // and when it was journaled
  std::map<int, double> recovery_start_t;  // recovery_start (not resize_start) times by id
  std::map<int, int> pid_of_worker;        // from spawn records
  std::set<int> spare_ids, used_spares;
  int spares_refilled = 0;
  int final_world = 0;
  int64_t lost_steps = 0;
  std::map<std::string, std::map<std::string, int>> by_cause;  // cause → outcome → count
  json false_alarms = json::array();
  int resizes = 0;
  int shrinks = 0;  // recoveries that left a smaller world (no spare was ready)
};

std::string CauseOf(const json& rec) {
  if (rec.value("kind", "") == "resize") return "resize";
  auto causes = rec.value("causes", json::array());
  if (causes.empty()) return "unknown";
  std::string c = causes[0];
  std::smatch m;
  if (std::regex_search(c, m, std::regex("\\(([^()]*)\\); its last completed step"))) return m[1];
  if (c.find(" reported: ") != std::string::npos) return "reported by a peer";
  return "other";
}

std::string OutcomeClass(const std::string& outcome) {
  if (outcome.rfind("superseded", 0) == 0) return "superseded";
  return outcome.empty() ? "open" : outcome;
}

Analysis Analyze(const SoakOptions& o, const JournalSummary& j) {
  Analysis a;
  for (const json& r : j.records) {
    std::string ev = r.value("event", "");
    double t = r.value("t", 0.0);
    if (ev == "spawn") {
      a.pid_of_worker[r.value("worker_id", -1)] = r.value("pid", -1);
    } else if (ev == "join" &&
               r.value("spare", false)) {  // a worker says at its join it is a spare
      int id = r.value("worker_id", -1);
      if (a.spare_ids.insert(id).second && id >= o.nproc + o.spares) ++a.spares_refilled;
    } else if (ev == "plan") {
      auto members = r.value("members", json::array());
      a.final_world = static_cast<int>(members.size());
      for (int id : members) {
        if (a.spare_ids.count(id)) a.used_spares.insert(id);
      }
    } else if (ev == "recovery_start") {
      a.recovery_start_t[r.value("recovery", -1)] = t;
    } else if (ev == "recovery_end" && r.contains("recovery")) {
      int id = r["recovery"].value("id", -1);
      a.recovery_by_id[id] = r["recovery"];
      a.recovery_end_t[id] = t;
      a.lost_steps += r["recovery"].value("lost_steps", int64_t{0});
      if (r["recovery"].value("kind", "") == "resize")
        ++a.resizes;
      else if (r["recovery"].value("outcome", "") == "completed" &&
               r["recovery"].value("new_world", 0) < r["recovery"].value("old_world", 0))
        ++a.shrinks;
      auto& outcomes = a.by_cause[CauseOf(r["recovery"])];
      for (const char* c : {"completed", "superseded", "failed", "open"}) outcomes[c] += 0;
      outcomes[OutcomeClass(r["recovery"].value("outcome", ""))]++;
    }
  }
  return a;
}

// Follows "superseded by recovery N" to the recovery that finally handled it.
int FinalRecovery(const Analysis& a, int id) {
  for (int hops = 0; hops < 1000; ++hops) {
    auto it = a.recovery_by_id.find(id);
    if (it == a.recovery_by_id.end()) return id;
    std::smatch m;
    std::string outcome = it->second.value("outcome", "");
    if (!std::regex_search(outcome, m, std::regex("^superseded by recovery (\\d+)"))) return id;
    id = std::stoi(m[1]);
  }
  return id;
}

// The recovery whose causes name process `pid`, or -1.
int RecoveryNamingPid(const Analysis& a, int pid) {
  if (pid <= 0) return -1;
  std::string needle = fmt::format("pid {})", pid);
  for (const auto& [id, rec] : a.recovery_by_id) {
    for (const auto& c : rec.value("causes", json::array())) {
      if (c.get<std::string>().find(needle) != std::string::npos) return id;
    }
  }
  return -1;
}

// The journal's kind of the fault record for f's process (worker) shortly after f, or "" (a dropped
// connection kills nobody: no fault record).
std::string FaultKindOf(const SoakOptions& o, const JournalSummary& j, const Fault& f) {
  for (const json& r : j.records) {
    double t = r.value("t", 0.0);
    if (r.value("event", "") != "fault" || t < f.t - 0.5 || t > f.t + o.alarm_window) continue;
    if (r.value("pid", -1) == f.pid || r.value("worker_id", -2) == f.worker_id)
      return r.value("kind", "");
  }
  return "";
}

// Ties every fault that happened to the journal: when, how it was detected, which recovery handled
// it.
void Attribute(const SoakOptions& o, const JournalSummary& j, const Analysis& a,
               double normal_step_s, std::vector<Fault>* faults) {
  for (Fault& f : *faults) {
    if (IsOutside(f.kind)) {
      if (f.status != "sent") continue;
      f.t = f.sent_epoch_s - j.start_epoch_s;
      f.detected_as = FaultKindOf(o, j, f);
      f.recovery = RecoveryNamingPid(a, f.pid);
    } else {
      auto it = std::find_if(j.injected.begin(), j.injected.end(),
                             [&](const InjectedFault& x) { return x.spec == f.spec; });
      if (it == j.injected.end()) {
        f.status = "did not fire";
        continue;
      }
      f.status = "fired";
      f.t = it->t;
      f.worker_id = it->worker_id;
      f.pid = a.pid_of_worker.count(f.worker_id) ? a.pid_of_worker.at(f.worker_id) : -1;
      f.detected_as = FaultKindOf(o, j, f);
      for (const auto& [id, rec] : a.recovery_by_id) {
        if (rec.value("injected", "") == f.spec) f.recovery = id;
      }
      if (f.recovery < 0) f.recovery = RecoveryNamingPid(a, f.pid);
      if (f.recovery < 0) {  // a dropped connection kills nobody: the next recovery to start
        for (const auto& [id, t] : a.recovery_start_t) {
          if (t >= f.t - 0.5 && t <= f.t + o.alarm_window) {
            f.recovery = id;
            break;
          }
        }
      }
    }
    if (f.recovery < 0) {
      f.outcome = "no recovery";
      continue;
    }
    if (f.detected_as.empty()) f.detected_as = CauseOf(a.recovery_by_id.at(f.recovery));
    f.final_recovery = FinalRecovery(a, f.recovery);
    auto rec = a.recovery_by_id.find(f.final_recovery);
    f.outcome =
        rec == a.recovery_by_id.end() ? "open at the end" : rec->second.value("outcome", "");
    f.survived = f.outcome == "completed";
    if (f.survived) {
      const json lost = rec->second.value("time_lost", json());
      if (lost.is_object() && lost.value("ms", json()).is_number()) {
        // Null normal_steps: the job knew no normal step at the fault, so it counted the whole step
        // across it; set it against the soak's median step, as the job's end does.
        const bool whole = lost.value("normal_steps", json()).is_null();
        f.time_lost_ms = lost["ms"].get<double>() - (whole ? normal_step_s * 1000 : 0);
      }
      if (rec->second.contains("downtime_ms"))
        f.downtime_ms = rec->second["downtime_ms"].get<double>();
      f.downtime_from_fault_ms =
          std::max(0.0, (a.recovery_end_t.at(f.final_recovery) - f.t - normal_step_s) * 1000);
    }
  }
}

// Recoveries that no fault sent or injected explains: neither tied to one nor starting within the
// window after one.
json FalseAlarms(const SoakOptions& o, const Analysis& a, const std::vector<Fault>& faults) {
  std::set<int> explained;
  for (const Fault& f : faults) {
    if (f.recovery >= 0) explained.insert(f.recovery);
  }
  json out = json::array();
  for (const auto& [id, t] : a.recovery_start_t) {
    if (explained.count(id)) continue;
    bool near = std::any_of(faults.begin(), faults.end(), [&](const Fault& f) {
      return Happened(f) && t >= f.t - 0.5 && t <= f.t + o.alarm_window;
    });
    if (near) continue;
    auto rec = a.recovery_by_id.find(id);
    out.push_back(
        {{"recovery", id},
         {"at_s", t},
         {"cause",
          rec == a.recovery_by_id.end() ? json("?") : rec->second.value("causes", json::array())}});
  }
  return out;
}

// Members the controller removed (journal "fault" records) that no fault targeted: a healthy worker
// killed as collateral, e.g. one that did not abort in time during another fault's recovery.
json Collateral(const SoakOptions& o, const JournalSummary& j, const std::vector<Fault>& faults) {
  json out = json::array();
  for (const json& r : j.records) {
    if (r.value("event", "") != "fault") continue;
    double t = r.value("t", 0.0);
    bool targeted = std::any_of(faults.begin(), faults.end(), [&](const Fault& f) {
      return Happened(f) && t >= f.t - 0.5 && t <= f.t + o.alarm_window &&
             (r.value("worker_id", -2) == f.worker_id || r.value("pid", -2) == f.pid);
    });
    if (targeted) continue;
    out.push_back({{"at_s", t},
                   {"kind", r.value("kind", "")},
                   {"worker_id", r.value("worker_id", -1)},
                   {"rank", r.value("rank", -1)},
                   {"detail", r.value("detail", "")}});
  }
  return out;
}

json Stats(const std::vector<double>& v) {
  if (v.empty()) return {{"n", 0}};
  return {{"n", v.size()},
          {"median", Percentile(v, 50)},
          {"p95", Percentile(v, 95)},
          {"max", *std::max_element(v.begin(), v.end())}};
}

std::string StatsText(const json& s) {
  if (s.value("n", 0) == 0) return "-";
  return fmt::format("{:>8.0f} {:>8.0f} {:>8.0f}   (n={})", s["median"].get<double>(),
                     s["p95"].get<double>(), s["max"].get<double>(), s["n"].get<int>());
}

// The command line into `o` and `program` (after `--`); an exit code when the bench should end
// (help, or flags that are wrong, named on stderr).
std::optional<int> ParseCommandLine(int argc, char** argv, SoakOptions* o,
                                    std::vector<std::string>* program) {
  auto [our_argc, after_dashes] = SplitAtDoubleDash(argc, argv);
  *program = after_dashes;
  CLI::App app{
      "Soak: the reference recipe under random faults of every kind for a long time; nothing may "
      "be lost"};
  app.add_option("--minutes", o->minutes, "How long the faulted job should run")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 100000.0));
  app.add_option("--seed", o->seed, "Seed of the fault schedule")->capture_default_str();
  app.add_option("--nproc", o->nproc, "Workers")->capture_default_str()->check(CLI::Range(2, 1024));
  app.add_option("--spares", o->spares, "Spares")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--min-gap", o->min_gap, "Least time between two faults (s)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  app.add_option("--max-gap", o->max_gap, "Most time between two faults (s)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  app.add_option("--quiet-start", o->quiet_start,
                 "No fault in the first this many seconds (model build)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--quiet-end", o->quiet_end,
                 "No fault in the last this many seconds (the world is whole at the end)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--steps", o->steps,
                 "Training steps (0: calibrate so that the job lasts --minutes)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{100'000'000}));
  app.add_option("--calibration-steps", o->calibration_steps, "Steps of the calibration run")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{5}, int64_t{100'000}));
  app.add_option("--fault-cost", o->fault_cost,
                 "Seconds each fault is expected to cost, when choosing the step count")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--alarm-window", o->alarm_window,
                 "A recovery starting this long after a fault is explained by it; later ones are "
                 "false alarms (s)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--progress-every", o->progress_every, "Seconds between progress lines")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  app.add_option("--reference-checksum", o->reference_checksum,
                 "The fault-free run's final checksum for these steps (skips the fault-free run)");
  app.add_option("--kinds", o->kinds, "Fault kinds to draw from")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember(kAllKinds));
  app.add_option("--run-arg", o->run_args,
                 "An extra argument for every `nonstop run` (repeatable), e.g. "
                 "--run-arg=--heartbeat-timeout-ms=2000")
      ->allow_extra_args(false);
  app.add_option("--bin", o->bin,
                 "Directory holding nonstop and nonstop-train (default: this program's)");
  app.add_option("--out", o->out, "Output directory (results.json, journals, logs)")
      ->capture_default_str();
  app.footer(
      "After `--`: the training program (default: BIN/nonstop-train with its built-in llama-tiny "
      "recipe); "
      "the soak appends --steps N.");
  try {
    app.parse(our_argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return std::nullopt;
}

// What the options ask is possible, the programs are there and --out is made; else an exit code
// (the reason on stderr). Fills in the default --bin and program.
std::optional<int> Prepare(SoakOptions* o, std::vector<std::string>* program) {
  if (o->max_gap < o->min_gap) {
    fmt::print(stderr, "nonstop-bench-soak: --max-gap {} is below --min-gap {}\n", o->max_gap,
               o->min_gap);
    return 2;
  }
  if (o->quiet_start + o->quiet_end >= o->minutes * 60) {
    fmt::print(stderr,
               "nonstop-bench-soak: --quiet-start {} + --quiet-end {} leave no time for faults in "
               "{} minutes "
               "(HINT: more --minutes or shorter quiet periods)\n",
               o->quiet_start, o->quiet_end, o->minutes);
    return 2;
  }
  if (o->bin.empty()) o->bin = SelfDir();
  if (program->empty()) *program = {o->bin + "/nonstop-train"};
  for (const std::string& p : {o->bin + "/nonstop", (*program)[0]}) {
    if (::access(p.c_str(), X_OK) != 0) {
      fmt::print(
          stderr,
          "nonstop-bench-soak: {} is not an executable (HINT: --bin DIR names where nonstop and "
          "nonstop-train are, e.g. build/bin)\n",
          p);
      return 2;
    }
  }
  std::error_code ec;
  fs::create_directories(o->out, ec);
  if (ec) {
    fmt::print(stderr, "nonstop-bench-soak: cannot create --out {}: {}\n", o->out, ec.message());
    return 2;
  }
  return std::nullopt;
}

// `nonstop run` of `program` for `steps`, journaled to OUT/NAME.jsonl.
using JobArgv = std::function<std::vector<std::string>(const std::string& name, int spares,
                                                       const std::string& inject, int64_t steps)>;

// How many steps fill --minutes: a short fault-free run measures the step time (--steps skips
// it). Null on failure (said on stderr).
struct Calibration {
  int64_t steps = 0;
  double startup_s = 0;  // from the start to the first step's start
  json doc = nullptr;    // results.json's "calibration" (null with --steps)
};

std::optional<Calibration> Calibrate(const SoakOptions& o, const JobArgv& job_argv) {
  Calibration c{o.steps, o.quiet_start};
  if (c.steps != 0) return c;
  fmt::print("calibration: {} steps without faults, to measure the step time\n",
             o.calibration_steps);
  int code = RunCommand(job_argv("calibration", o.spares, "none", o.calibration_steps),
                        o.out + "/calibration.log");
  auto cal = ReadJournalSummary(o.out + "/calibration.jsonl");
  if (code != 0 || !cal.ok() || cal->steps.size() < 2) {
    fmt::print(
        stderr,
        "nonstop-bench-soak: the calibration run failed (exit {}{}); see {}/calibration.log\n",
        code, cal.ok() ? "" : ", " + cal.status().ToString(), o.out);
    return std::nullopt;
  }
  const double step_s = MedianStepInterval(cal->steps);
  const double duration = o.minutes * 60;
  c.startup_s = std::max(0.0, cal->steps.front().t - step_s);
  double expected_faults = (duration - o.quiet_start - o.quiet_end) / ((o.min_gap + o.max_gap) / 2);
  c.steps = std::max<int64_t>(
      10, static_cast<int64_t>((duration - c.startup_s - expected_faults * o.fault_cost) /
                               std::max(step_s, 1e-3)));
  c.doc = {{"steps", o.calibration_steps},
           {"step_s", step_s},
           {"startup_s", c.startup_s},
           {"expected_faults", expected_faults},
           {"chosen_steps", c.steps}};
  fmt::print(
      "calibration: a step takes {:.3f} s, the first step completes {:.1f} s after the start: {} "
      "steps\n",
      step_s, c.startup_s + step_s, c.steps);
  return c;
}

// One fault's record in results.json.
json FaultJson(const Fault& f) {
  auto opt = [](double v) { return v >= 0 ? json(v) : json(nullptr); };
  return {{"index", f.index},
          {"kind", f.kind},
          {"planned_at_s", f.at_s},
          {"rank", f.rank},
          {"step", f.step >= 0 ? json(f.step) : json(nullptr)},
          {"spec", f.spec},
          {"status", f.status},
          {"at_s", opt(f.t)},
          {"postponed_s", f.postponed_s},
          {"worker_id", f.worker_id},
          {"pid", f.pid},
          {"detected_as", f.detected_as},
          {"recovery", f.recovery},
          {"final_recovery", f.final_recovery},
          {"outcome", f.outcome},
          {"survived", f.survived},
          {"time_lost_ms", f.time_lost_ms ? json(*f.time_lost_ms) : json(nullptr)},
          {"downtime_ms", opt(f.downtime_ms)},
          {"downtime_from_fault_ms", opt(f.downtime_from_fault_ms)}};
}

// The soak's figures, from the faults and the journal.
struct Tally {
  std::map<std::string, std::map<std::string, int>> by_kind;  // kind → planned/happened/...
  json time_lost, downtime, from_fault;                       // Stats of each, ms
  int happened = 0, survived = 0;
};

Tally Count(const std::vector<Fault>& faults) {
  Tally t;
  std::vector<double> time_lost, downtime, from_fault;
  for (const Fault& f : faults) {
    auto& k = t.by_kind[f.kind];
    for (const char* c : {"planned", "happened", "skipped", "survived"}) k[c] += 0;  // in the JSON
    k["planned"]++;
    k[Happened(f) ? "happened" : "skipped"]++;
    if (f.survived) k["survived"]++;
    t.happened += Happened(f) ? 1 : 0;
    t.survived += f.survived ? 1 : 0;
    if (f.time_lost_ms) time_lost.push_back(*f.time_lost_ms);  // below zero too: salvage
    if (f.downtime_ms >= 0) downtime.push_back(f.downtime_ms);
    if (f.downtime_from_fault_ms >= 0) from_fault.push_back(f.downtime_from_fault_ms);
  }
  t.time_lost = Stats(time_lost);
  t.downtime = Stats(downtime);
  t.from_fault = Stats(from_fault);
  return t;
}

// What the soak found, besides the faults.
struct Verdict {
  int rc = 0;
  double wall_s = 0, normal_step_s = 0;
  int64_t steps = 0, missing = 0;
  std::string reference;
  int reference_rc = -1;
  bool same = false, pass = false;
};

void PrintReport(const SoakOptions& o, const JournalSummary& j, const Analysis& a,
                 const std::vector<Fault>& faults, const Tally& t, const json& alarms,
                 const json& collateral, const json& last_status, const Verdict& v) {
  fmt::print("\nsoak: {} workers + {} spares, {} steps, seed {}, a normal step {:.3f} s\n\n",
             o.nproc, o.spares, v.steps, o.seed, v.normal_step_s);
  fmt::print("{:<28} {} (job {}, start to job_end)\n", "duration", MinSec(v.wall_s),
             MinSec(j.wall));
  fmt::print("{:<28} {}\n", "nonstop run exit code", v.rc);
  const std::string row = "{:<28} {:<20} {:>8} {:>8} {:>8} {:>8}\n";
  fmt::print(fmt::runtime(row), "faults", "kind", "planned", "sent", "skipped", "survived");
  for (const auto& kind : kAllKinds) {
    auto k = t.by_kind.find(kind);
    if (k == t.by_kind.end()) continue;
    auto n = [&](const char* what) { return k->second.count(what) ? k->second.at(what) : 0; };
    fmt::print(fmt::runtime(row), "", KindLabel(kind), n("planned"), n("happened"), n("skipped"),
               n("survived"));
  }
  fmt::print(fmt::runtime(row), "", "all", faults.size(), t.happened,
             static_cast<int>(faults.size()) - t.happened, t.survived);
  fmt::print("{:<28} {:<30} {:>9} {:>10} {:>7} {:>6}\n", "recoveries (journal)", "cause",
             "completed", "superseded", "failed", "open");
  for (const auto& [cause, outcomes] : a.by_cause) {
    auto n = [&](const char* what) { return outcomes.count(what) ? outcomes.at(what) : 0; };
    fmt::print("{:<28} {:<30} {:>9} {:>10} {:>7} {:>6}\n", "", cause, n("completed"),
               n("superseded"), n("failed"), n("open"));
  }
  fmt::print("{:<28} {:<30} {:>8} {:>8} {:>8}\n", "per fault (ms)", "", "median", "p95", "max");
  fmt::print("{:<28} {:<30} {}\n", "", "time lost (the job's report)", StatsText(t.time_lost));
  fmt::print("{:<28} {:<30} {}\n", "", "journal downtime_ms", StatsText(t.downtime));
  fmt::print("{:<28} {:<30} {}\n", "", "from the fault (soak clock)", StatsText(t.from_fault));
  fmt::print(
      "{:<28} {} (recovery_end lost_steps); {} of {} steps completed, {} missing, {} redone\n",
      "completed steps lost", a.lost_steps, j.distinct, v.steps, v.missing, j.redone);
  fmt::print(
      "{:<28} {} used, {} refilled; the world shrank {} time(s) for want of a spare, {} "
      "resize(s)\n",
      "spares", a.used_spares.size(), a.spares_refilled, a.shrinks, a.resizes);
  fmt::print("{:<28} {}{}\n", "false alarms", alarms.size(),
             alarms.empty() ? "" : ": " + alarms.dump());
  fmt::print("{:<28} {}", "collateral member losses", collateral.size());
  for (const auto& c : collateral) {
    fmt::print("; {:.0f} s rank {} (worker {}): {}", c["at_s"].get<double>(), c["rank"].get<int>(),
               c["worker_id"].get<int>(), c["kind"].get<std::string>());
  }
  fmt::print("\n");
  fmt::print("{:<28} {} (last plan); spare pool {} (last /status)\n", "final world size",
             a.final_world, last_status.value("spares", -1));
  fmt::print("{:<28} {} vs fault-free {}: {}\n", "final checksum",
             j.checksum.empty() ? "none" : j.checksum, v.reference.empty() ? "none" : v.reference,
             v.same ? "identical" : (j.checksums_agree ? "DIFFERENT" : "members disagree"));
  fmt::print("{:<28} {}\n", "verdict", v.pass ? "PASS" : "FAIL");
}

json ResultsJson(const SoakOptions& o, const std::vector<std::string>& program,
                 const json& calibration, const JournalSummary& j, const Analysis& a,
                 const std::vector<Fault>& faults, const Tally& t, const json& alarms,
                 const json& collateral, const json& last_status, const Verdict& v) {
  json by_kind = json::object();
  for (const auto& [kind, counts] : t.by_kind) by_kind[kind] = counts;
  json by_cause = json::object();
  for (const auto& [cause, outcomes] : a.by_cause) by_cause[cause] = outcomes;
  json faults_j = json::array();
  for (const Fault& f : faults) faults_j.push_back(FaultJson(f));
  return {{"benchmark", "soak"},
          {"nproc", o.nproc},
          {"spares", o.spares},
          {"seed", o.seed},
          {"minutes", o.minutes},
          {"min_gap_s", o.min_gap},
          {"max_gap_s", o.max_gap},
          {"quiet_start_s", o.quiet_start},
          {"quiet_end_s", o.quiet_end},
          {"kinds", o.kinds},
          {"steps", v.steps},
          {"program", program},
          {"calibration", calibration},
          {"duration_s", v.wall_s},
          {"job_wall_s", j.wall},
          {"normal_step_s", v.normal_step_s},
          {"exit_code", v.rc},
          {"faults_by_kind", by_kind},
          {"faults_happened", t.happened},
          {"faults_survived", t.survived},
          {"recoveries_by_cause", by_cause},
          {"recoveries", j.recoveries},
          {"resizes", a.resizes},
          {"shrinks", a.shrinks},
          {"time_lost_ms", t.time_lost},
          {"downtime_ms", t.downtime},
          {"downtime_from_fault_ms", t.from_fault},
          {"lost_steps", a.lost_steps},
          {"steps_completed", j.distinct},
          {"steps_missing", v.missing},
          {"steps_redone", j.redone},
          {"spares_used", a.used_spares.size()},
          {"spares_refilled", a.spares_refilled},
          {"false_alarms", alarms},
          {"collateral", collateral},
          {"final_world_size", a.final_world},
          {"final_spares", last_status.value("spares", -1)},
          {"checksum", j.checksum},
          {"members_agree", j.checksums_agree},
          {"reference_checksum", v.reference},
          {"reference_exit_code", v.reference_rc},
          {"checksums_equal", v.same},
          {"pass", v.pass},
          {"faults", faults_j}};
}

int Main(int argc, char** argv) {
  SoakOptions o;
  std::vector<std::string> program;
  if (auto code = ParseCommandLine(argc, argv, &o, &program)) return *code;
  if (auto code = Prepare(&o, &program)) return *code;
  const std::string nonstop = o.bin + "/nonstop";
  const double duration = o.minutes * 60;
  JobArgv job_argv = [&](const std::string& name, int spares, const std::string& inject,
                         int64_t steps) {
    std::vector<std::string> v = {nonstop,     "run",
                                  "--nproc",   std::to_string(o.nproc),
                                  "--spares",  std::to_string(spares),
                                  "--journal", o.out + "/" + name + ".jsonl",
                                  "--inject",  inject};
    v.insert(v.end(), o.run_args.begin(), o.run_args.end());
    v.push_back("--");
    v.insert(v.end(), program.begin(), program.end());
    v.push_back("--steps");
    v.push_back(std::to_string(steps));
    return v;
  };

  // 1. How many steps fill the duration.
  std::optional<Calibration> cal = Calibrate(o, job_argv);
  if (!cal) return 1;
  const int64_t steps = cal->steps;

  // 2. The fault schedule.
  std::vector<Fault> faults = PlanFaults(o, steps, cal->startup_s);
  std::string inject;
  for (const Fault& f : faults) {
    if (!f.spec.empty()) inject += (inject.empty() ? "" : ";") + f.spec;
  }
  fmt::print(
      "soak: {} workers + {} spares, {} steps, ~{:.0f} min, seed {}, {} faults planned every "
      "{:.0f}-{:.0f} s "
      "between {:.0f} s and {:.0f} s\n",
      o.nproc, o.spares, steps, o.minutes, o.seed, faults.size(), o.min_gap, o.max_gap,
      o.quiet_start, duration - o.quiet_end);
  for (const Fault& f : faults) {
    fmt::print("  #{:<3} {:>7.1f} s  {:<20} rank {}{}\n", f.index, f.at_s, KindLabel(f.kind),
               f.rank, f.step >= 0 ? fmt::format(", step {}", f.step) : "");
  }
  std::fflush(stdout);

  // 3. The soak.
  const std::string journal = o.out + "/soak.jsonl";
  json last_status;
  Verdict v;
  v.steps = steps;
  const double soak_start = NowEpoch();
  v.rc = RunSoakJob(o, job_argv("soak", o.spares, inject.empty() ? "none" : inject, steps), journal,
                    steps, QuietEndSteps(o, steps, cal->startup_s), &faults, &last_status);
  v.wall_s = NowEpoch() - soak_start;
  fmt::print("soak job: exit {}, {} wall\n", v.rc, MinSec(v.wall_s));
  auto read = ReadJournalSummary(journal);
  if (!read.ok()) {
    fmt::print(stderr, "nonstop-bench-soak: {}\n", read.status().ToString());
    return 1;
  }
  const JournalSummary& j = *read;
  v.normal_step_s = MedianStepInterval(j.steps);
  Analysis a = Analyze(o, j);
  Attribute(o, j, a, v.normal_step_s, &faults);
  json alarms = FalseAlarms(o, a, faults);
  json collateral = Collateral(o, j, faults);

  // 4. The fault-free reference.
  v.reference = o.reference_checksum;
  if (v.reference.empty()) {
    fmt::print("reference: the same {} steps without faults\n", steps);
    v.reference_rc = RunCommand(job_argv("reference", 0, "none", steps), o.out + "/reference.log");
    auto ref = ReadJournalSummary(o.out + "/reference.jsonl");
    if (ref.ok()) v.reference = ref->checksum;
    fmt::print("reference: exit {}, checksum {}\n", v.reference_rc,
               v.reference.empty() ? "none" : v.reference);
  }

  // 5. Report.
  const Tally t = Count(faults);
  v.missing = v.rc == 0 ? std::max<int64_t>(0, steps - j.distinct) : 0;
  v.same = !v.reference.empty() && v.reference == j.checksum && j.checksums_agree;
  v.pass = v.rc == 0 && a.lost_steps == 0 && v.missing == 0 && v.same;
  PrintReport(o, j, a, faults, t, alarms, collateral, last_status, v);
  std::ofstream(o.out + "/results.json")
      << ResultsJson(o, program, cal->doc, j, a, faults, t, alarms, collateral, last_status, v)
             .dump(2)
      << "\n";
  fmt::print("wrote {0}/results.json (journals and logs beside it)\n", o.out);
  return v.pass ? 0 : 1;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
