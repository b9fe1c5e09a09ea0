// nonstop-bench-recovery: what a fault costs, nonstop against checkpoint-restart.
//
// Runs the same job three times, back to back, on this machine:
//   1. fault-free (the reference for step time and total time),
//   2. --recovery checkpointless with the fault schedule (spares, peer state transfer),
//   3. --recovery checkpoint with the same faults (restart every worker, reload
//      the newest checkpoint, redo the lost steps; checkpoint interval at the
//      Young/Daly optimum for --mtbf),
// and reads their journals. Per fault: downtime = time from the fault until
// the step that was in flight completes, minus one normal step (the work a
// fault destroys by definition). Per run: steps redone, wall time against the
// fault-free run, goodput (distinct steps × normal step time / wall time).
// Output: a table, a JSON file and report.html: the dashboard's page comparing
// the three runs (steps over wall time, loss, every recovery with its phases).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench_util.h"
#include "common/args.h"
#include "dashboard/dashboard.h"

namespace nonstop::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct RunResult : JournalSummary {
  std::string name;
  int exit_code = -1;
  std::vector<double> downtimes;  // per injected fault, seconds (-1: the step never completed)
};

RunResult ReadRun(const std::string& name, const std::string& path, int exit_code) {
  RunResult r;
  auto summary = ReadJournalSummary(path);
  if (summary.ok()) static_cast<JournalSummary&>(r) = std::move(*summary);
  else fmt::print(stderr, "  {}: {}\n", name, summary.status().ToString());
  r.name = name;
  r.exit_code = exit_code;
  return r;
}

void ComputeDowntimes(RunResult* r, double normal_step) {
  for (const InjectedFault& f : r->injected) {
    double done = -1;
    for (const auto& s : r->steps) {
      if (s.step == f.step && s.t > f.t) {
        done = s.t;
        break;
      }
    }
    r->downtimes.push_back(done < 0 ? -1 : std::max(0.0, done - f.t - normal_step));
  }
}

// A journal's records for the comparison page; a line that is not JSON (a
// record cut short by a kill) is left out.
std::vector<json> JournalRecords(const std::string& path) {
  std::vector<json> records;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) records.push_back(std::move(j));
  }
  return records;
}

int Main(int argc, char** argv) {
  auto [our_argc, program] = SplitAtDoubleDash(argc, argv);
  CLI::App app{"What a fault costs: checkpointless recovery against checkpoint-restart, same job, same machine"};
  int nproc = 4, spares = 1;
  int64_t steps = 60;
  std::string faults = "kill:rank=2,step=20;kill:rank=1,step=40";
  double mtbf = 0;
  std::string out = "bench-results/recovery";
  app.add_option("--nproc", nproc, "Workers")->capture_default_str();
  app.add_option("--spares", spares, "Spares for the checkpointless run")->capture_default_str();
  app.add_option("--steps", steps, "Training steps (passed to the program as --steps)")->capture_default_str();
  app.add_option("--faults", faults, "Fault schedule (nonstop run --inject syntax)")->capture_default_str();
  app.add_option("--mtbf", mtbf, "MTBF for the baseline's Young/Daly checkpoint interval (s); 0: the schedule's own "
                 "(fault-free wall time / (faults + 1))")->capture_default_str();
  app.add_option("--out", out, "Output directory (results.json, report.html, logs)")->capture_default_str();
  app.footer("After `--`: the training program (default: nonstop-train with its built-in llama-tiny recipe).");
  try {
    app.parse(our_argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  const std::string bin = SelfDir();
  if (program.empty()) program = {bin + "/nonstop-train"};
  program.push_back("--steps");
  program.push_back(std::to_string(steps));
  fs::create_directories(out);
  int nfaults = static_cast<int>(std::count(faults.begin(), faults.end(), ';')) + 1;

  auto run = [&](const std::string& name, std::vector<std::string> flags) {
    std::string journal = out + "/" + name + ".jsonl";
    std::vector<std::string> argv = {bin + "/nonstop", "run", "--nproc", std::to_string(nproc), "--journal", journal};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--");
    argv.insert(argv.end(), program.begin(), program.end());
    int code = RunCommand(argv, out + "/" + name + ".log");
    RunResult r = ReadRun(name, journal, code);
    fmt::print("  {}: exit {}, {:.1f} s, {} steps ({} redone)\n", name, code, r.wall, r.steps.size(), r.redone);
    std::fflush(stdout);
    return r;
  };

  RunResult clean = run("fault-free", {"--spares", "0", "--inject", "none"});
  double normal = MedianStepInterval(clean.steps);
  if (mtbf <= 0) mtbf = clean.wall / (nfaults + 1);
  RunResult cpl = run("checkpointless", {"--spares", std::to_string(spares), "--inject", faults});
  std::string ckpt_dir = out + "/checkpoints";
  fs::remove_all(ckpt_dir);
  RunResult cpr = run("checkpoint-restart", {"--spares", "0", "--recovery", "checkpoint", "--checkpoint-dir", ckpt_dir,
                                             "--mtbf", fmt::format("{}", mtbf), "--inject", faults});
  ComputeDowntimes(&cpl, normal);
  ComputeDowntimes(&cpr, normal);

  std::vector<RunResult*> all = {&clean, &cpl, &cpr};
  fmt::print("\nsame job, same machine: {} workers, {} steps, faults {}; a normal step {:.3f} s; baseline MTBF {:.1f} s\n\n",
             nproc, steps, faults, normal, mtbf);
  fmt::print("{:<20} {:>8} {:>10} {:>12} {:>9} {:>9}  {}\n", "run", "exit", "wall (s)", "vs no fault", "redone",
             "goodput", "downtime per fault (ms)");
  json runs = json::array();
  for (RunResult* r : all) {
    double goodput = r->wall > 0 ? static_cast<double>(r->distinct) * normal / r->wall : 0;
    std::string dts;
    for (double d : r->downtimes) dts += (dts.empty() ? "" : ", ") + (d < 0 ? std::string("n/a") : fmt::format("{:.0f}", d * 1000));
    fmt::print("{:<20} {:>8} {:>10.1f} {:>+11.1f}% {:>9} {:>8.1f}%  {}\n", r->name, r->exit_code, r->wall,
               clean.wall > 0 ? 100.0 * (r->wall / clean.wall - 1) : 0.0, r->redone, 100 * goodput, dts.empty() ? "-" : dts);
    json faults_j = json::array();
    for (size_t i = 0; i < r->injected.size(); ++i) {
      faults_j.push_back({{"spec", r->injected[i].spec}, {"at_s", r->injected[i].t},
                          {"downtime_ms", r->downtimes.size() > i && r->downtimes[i] >= 0 ? json(r->downtimes[i] * 1000) : json(nullptr)}});
    }
    runs.push_back({{"name", r->name}, {"exit_code", r->exit_code}, {"wall_s", r->wall},
                    {"steps_completed_events", r->steps.size()}, {"distinct_steps", r->distinct},
                    {"steps_redone", r->redone}, {"goodput", goodput}, {"checksum", r->checksum},
                    {"mean_downtime_ms", MeanOfMeasured(r->downtimes) < 0 ? json(nullptr) : json(MeanOfMeasured(r->downtimes) * 1000)},
                    {"faults", faults_j}, {"recoveries", r->recoveries}});
  }
  double a = MeanOfMeasured(cpl.downtimes), b = MeanOfMeasured(cpr.downtimes);
  json summary = {{"normal_step_s", normal}, {"mtbf_s", mtbf}};
  if (a >= 0 && b > 0) {
    fmt::print("\ndowntime per fault: checkpointless {:.0f} ms vs checkpoint-restart {:.0f} ms: ratio {:.4f}, "
               "{:.1f}% less downtime\n", a * 1000, b * 1000, a / b, 100 * (1 - a / b));
    summary["downtime_ratio_checkpointless_over_checkpoint"] = a / b;
    summary["downtime_reduction_percent"] = 100 * (1 - a / b);
  }
  fmt::print("final parameter checksums: fault-free {}, checkpointless {}, checkpoint-restart {}\n", clean.checksum,
             cpl.checksum, cpr.checksum);
  json doc = {{"benchmark", "recovery"}, {"nproc", nproc}, {"steps", steps}, {"faults", faults},
              {"program", program}, {"summary", summary}, {"runs", runs}};
  std::ofstream(out + "/results.json") << doc.dump(2) << "\n";
  std::vector<dashboard::Run> pages;
  for (RunResult* r : all) pages.push_back({r->name, JournalRecords(out + "/" + r->name + ".jsonl")});
  std::ofstream(out + "/report.html") << dashboard::ComparePage(
      pages, fmt::format("what a fault costs, {} workers: fault-free, checkpointless, checkpoint-restart", nproc));
  fmt::print("wrote {0}/results.json and {0}/report.html (logs and journals beside them)\n", out);
  return (clean.exit_code | cpl.exit_code | cpr.exit_code) == 0 ? 0 : 1;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
