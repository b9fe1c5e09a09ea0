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
// fault destroys by definition). Time lost per fault = the interval of the
// step across the fault (from the step before it to its completion) minus a
// normal step: what the fault cost in all, the part of the step computed
// before it and thrown away included. Per run: steps redone, wall time
// against the fault-free run, goodput (distinct steps × normal step time /
// wall time). With --compare-salvage (the default ring mode or a
// world-invariant recipe, not a sharded one) the checkpointless run is
// repeated with NONSTOP_TRAIN_NO_SALVAGE=1: the step in flight computed again
// whole, against kept partial sums.
// Output: a table, a JSON file and report.html: the dashboard's page comparing
// the three runs (steps over wall time, loss, every recovery with its phases).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
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
  // per injected fault: the step across it minus a normal step (-1: not measured)
  std::vector<double> time_lost;
};

RunResult ReadRun(const std::string& name, const std::string& path, int exit_code) {
  RunResult r;
  auto summary = ReadJournalSummary(path);
  if (summary.ok())
    static_cast<JournalSummary&>(r) = std::move(*summary);
  else
    fmt::print(stderr, "  {}: {}\n", name, summary.status().ToString());
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
    double before = -1;  // the step before the fault's, completed before it
    for (const auto& s : r->steps) {
      if (s.step == f.step - 1 && s.t <= f.t) before = s.t;
    }
    r->time_lost.push_back(done < 0 || before < 0 ? -1
                                                  : std::max(0.0, done - before - normal_step));
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

// The table of runs (one line each, against the fault-free one) and their results.json records.
json PrintRuns(const std::vector<RunResult*>& all, const RunResult& clean, double normal) {
  fmt::print("{:<26} {:>5} {:>9} {:>12} {:>7} {:>8}  {:<24} {}\n", "run", "exit", "wall (s)",
             "vs no fault", "redone", "goodput", "time lost per fault (ms)",
             "downtime per fault (ms)");
  auto list = [](const std::vector<double>& v) {
    std::string text;
    for (double d : v)
      text += (text.empty() ? "" : ", ") +
              (d < 0 ? std::string("n/a") : fmt::format("{:.0f}", d * 1000));
    return text.empty() ? std::string("-") : text;
  };
  auto ms = [](const std::vector<double>& v, size_t i) {
    return v.size() > i && v[i] >= 0 ? json(v[i] * 1000) : json(nullptr);
  };
  auto mean_ms = [](const std::vector<double>& v) {
    return MeanOfMeasured(v) < 0 ? json(nullptr) : json(MeanOfMeasured(v) * 1000);
  };
  json runs = json::array();
  for (const RunResult* r : all) {
    double goodput = r->wall > 0 ? static_cast<double>(r->distinct) * normal / r->wall : 0;
    fmt::print("{:<26} {:>5} {:>9.1f} {:>+11.1f}% {:>7} {:>7.1f}%  {:<24} {}\n", r->name,
               r->exit_code, r->wall, clean.wall > 0 ? 100.0 * (r->wall / clean.wall - 1) : 0.0,
               r->redone, 100 * goodput, list(r->time_lost), list(r->downtimes));
    json faults_j = json::array();
    for (size_t i = 0; i < r->injected.size(); ++i) {
      faults_j.push_back({{"spec", r->injected[i].spec},
                          {"at_s", r->injected[i].t},
                          {"time_lost_ms", ms(r->time_lost, i)},
                          {"downtime_ms", ms(r->downtimes, i)}});
    }
    runs.push_back({{"name", r->name},
                    {"exit_code", r->exit_code},
                    {"wall_s", r->wall},
                    {"steps_completed_events", r->steps.size()},
                    {"distinct_steps", r->distinct},
                    {"steps_redone", r->redone},
                    {"goodput", goodput},
                    {"checksum", r->checksum},
                    {"mean_time_lost_ms", mean_ms(r->time_lost)},
                    {"mean_downtime_ms", mean_ms(r->downtimes)},
                    {"faults", faults_j},
                    {"recoveries", r->recoveries}});
  }
  return runs;
}

// The ratios under the table: time lost first (what the faults cost the job), then downtime, then
// salvage against computing the step again (`whole`: the --compare-salvage run, or null).
json Summarize(const RunResult& cpl, const RunResult& cpr, const RunResult* whole, double normal,
               double mtbf, const std::string& out) {
  json summary = {{"normal_step_s", normal}, {"mtbf_s", mtbf}};
  fmt::print("\n");
  double lost = MeanOfMeasured(cpl.time_lost), lost_cpr = MeanOfMeasured(cpr.time_lost);
  if (lost >= 0 && lost_cpr > 0) {
    fmt::print(
        "time lost per fault: checkpointless {:.0f} ms ({:.2f} of a step) vs checkpoint-restart "
        "{:.0f} ms ({:.2f}): ratio {:.4f}\n",
        lost * 1000, lost / normal, lost_cpr * 1000, lost_cpr / normal, lost / lost_cpr);
    summary["time_lost_ratio_checkpointless_over_checkpoint"] = lost / lost_cpr;
  }
  double a = MeanOfMeasured(cpl.downtimes), b = MeanOfMeasured(cpr.downtimes);
  if (a >= 0 && b > 0) {
    fmt::print(
        "downtime per fault (from the fault to the first step done, less a normal step): "
        "checkpointless {:.0f} ms vs checkpoint-restart {:.0f} ms: ratio {:.4f}, {:.1f}% less "
        "downtime\n",
        a * 1000, b * 1000, a / b, 100 * (1 - a / b));
    summary["downtime_ratio_checkpointless_over_checkpoint"] = a / b;
    summary["downtime_reduction_percent"] = 100 * (1 - a / b);
  }
  if (whole == nullptr) return summary;
  const double kept = lost, again = MeanOfMeasured(whole->time_lost);
  std::ifstream log(out + "/checkpointless.log");
  const bool salvaged =
      std::string(std::istreambuf_iterator<char>(log), {}).find("kept the sums of") !=
      std::string::npos;
  if (!salvaged) {
    fmt::print(
        "\nthe checkpointless run kept no sums of a step in flight (is the program "
        "nonstop-train, and its recipe not sharded?): the salvage comparison means nothing\n");
  } else if (kept >= 0 && again > 0) {
    fmt::print(
        "time lost per fault: {:.0f} ms keeping the step in flight's sums, {:.0f} ms computing "
        "it again: ratio "
        "{:.3f}; a normal step {:.0f} ms ({:.2f} of a step kept, {:.2f} again)\n",
        kept * 1000, again * 1000, kept / again, normal * 1000, kept / normal, again / normal);
    summary["time_lost_ms_salvage"] = kept * 1000;
    summary["time_lost_ms_no_salvage"] = again * 1000;
    summary["time_lost_ratio_salvage_over_no_salvage"] = kept / again;
    summary["time_lost_in_normal_steps_salvage"] = kept / normal;
    summary["time_lost_in_normal_steps_no_salvage"] = again / normal;
  }
  fmt::print("checkpointless without salvage: checksum {}\n", whole->checksum);
  summary["salvaged"] = salvaged;
  return summary;
}

int Main(int argc, char** argv) {
  auto [our_argc, program] = SplitAtDoubleDash(argc, argv);
  CLI::App app{
      "What a fault costs: checkpointless recovery against checkpoint-restart, same job, same "
      "machine"};
  int nproc = 4, spares = 1;
  int64_t steps = 60;
  std::string faults = "kill:rank=2,step=20;kill:rank=1,step=40";
  double mtbf = 0;
  std::string out = "bench-results/recovery";
  bool compare_salvage = false;
  app.add_option("--nproc", nproc, "Workers")->capture_default_str();
  app.add_option("--spares", spares, "Spares for the checkpointless run")->capture_default_str();
  app.add_option("--steps", steps, "Training steps (passed to the program as --steps)")
      ->capture_default_str();
  app.add_option("--faults", faults, "Fault schedule (nonstop run --inject syntax)")
      ->capture_default_str();
  app.add_option(
         "--mtbf", mtbf,
         "MTBF for the baseline's Young/Daly checkpoint interval (s); 0: the schedule's own "
         "(fault-free wall time / (faults + 1))")
      ->capture_default_str();
  app.add_option("--out", out, "Output directory (results.json, report.html, logs)")
      ->capture_default_str();
  app.add_flag(
      "--compare-salvage", compare_salvage,
      "Also run the checkpointless job with NONSTOP_TRAIN_NO_SALVAGE=1 (nonstop-train in the "
      "default ring mode or world-invariant, not sharded: the step in flight computed again "
      "whole, against kept partial sums)");
  app.footer(
      "After `--`: the training program (default: nonstop-train with its built-in llama-tiny "
      "recipe).");
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
    std::vector<std::string> argv = {bin + "/nonstop",      "run",       "--nproc",
                                     std::to_string(nproc), "--journal", journal};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--");
    argv.insert(argv.end(), program.begin(), program.end());
    int code = RunCommand(argv, out + "/" + name + ".log");
    RunResult r = ReadRun(name, journal, code);
    fmt::print("  {}: exit {}, {:.1f} s, {} steps ({} redone)\n", name, code, r.wall,
               r.steps.size(), r.redone);
    std::fflush(stdout);
    return r;
  };

  RunResult clean = run("fault-free", {"--spares", "0", "--inject", "none"});
  double normal = MedianStepInterval(clean.steps);
  if (mtbf <= 0) mtbf = clean.wall / (nfaults + 1);
  RunResult cpl = run("checkpointless", {"--spares", std::to_string(spares), "--inject", faults});
  RunResult whole;
  if (compare_salvage) {
    ::setenv("NONSTOP_TRAIN_NO_SALVAGE", "1", 1);  // the workers inherit it through nonstop run
    whole =
        run("checkpointless-no-salvage", {"--spares", std::to_string(spares), "--inject", faults});
    ::unsetenv("NONSTOP_TRAIN_NO_SALVAGE");
  }
  std::string ckpt_dir = out + "/checkpoints";
  fs::remove_all(ckpt_dir);
  RunResult cpr =
      run("checkpoint-restart", {"--spares", "0", "--recovery", "checkpoint", "--checkpoint-dir",
                                 ckpt_dir, "--mtbf", fmt::format("{}", mtbf), "--inject", faults});
  ComputeDowntimes(&cpl, normal);
  ComputeDowntimes(&cpr, normal);
  if (compare_salvage) ComputeDowntimes(&whole, normal);

  std::vector<RunResult*> all = {&clean, &cpl, &cpr};
  if (compare_salvage) all.insert(all.begin() + 2, &whole);
  fmt::print(
      "\nsame job, same machine: {} workers, {} steps, faults {}; a normal step {:.3f} s; baseline "
      "MTBF {:.1f} s\n\n",
      nproc, steps, faults, normal, mtbf);
  json runs = PrintRuns(all, clean, normal);
  json summary = Summarize(cpl, cpr, compare_salvage ? &whole : nullptr, normal, mtbf, out);
  fmt::print("final parameter checksums: fault-free {}, checkpointless {}, checkpoint-restart {}\n",
             clean.checksum, cpl.checksum, cpr.checksum);
  json doc = {{"benchmark", "recovery"}, {"nproc", nproc},     {"steps", steps}, {"faults", faults},
              {"program", program},      {"summary", summary}, {"runs", runs}};
  std::ofstream(out + "/results.json") << doc.dump(2) << "\n";
  std::vector<dashboard::Run> pages;
  for (RunResult* r : all)
    pages.push_back({r->name, JournalRecords(out + "/" + r->name + ".jsonl")});
  std::ofstream(out + "/report.html") << dashboard::ComparePage(
      pages,
      fmt::format("what a fault costs, {} workers: fault-free, checkpointless, checkpoint-restart",
                  nproc));
  fmt::print("wrote {0}/results.json and {0}/report.html (logs and journals beside them)\n", out);
  return (clean.exit_code | cpl.exit_code | cpr.exit_code |
          (compare_salvage ? whole.exit_code : 0)) == 0
             ? 0
             : 1;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
