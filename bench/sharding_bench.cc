// nonstop-bench-sharding: what sharding the optimizer state (ZeRO-1 in shard
// groups, docs/sharding.md) saves and costs, against the unsharded run of the
// same job in the same invocation.
//
// For every world W of --worlds and every group size G of --groups that
// divides it, runs the job fault-free (G = 1: the unsharded baseline) and
// reads: the optimizer-state bytes per rank (the trainer's "optimizer state:"
// line), the median step interval (the journal's steps), the final checksum.
// Where a shard has a replica (W / G >= 2) it runs the job again with a
// kill and a spare, and reads the bytes the recovery copied (the journal's
// recovery_end). Ratios are against G = 1 at the same W, measured in this run.
//
//   nonstop-bench-sharding --worlds 4,8 --groups 1,2,4 [-- nonstop-train recipes/gpt-oss-tiny.yaml]
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/bench_util.h"
#include "common/args.h"

namespace nonstop::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Measured {
  int world = 0, group = 0;
  int exit_code = -1, fault_exit_code = -1;
  uint64_t optimizer_bytes = 0;  // per rank
  double step_s = 0;             // median step interval, fault-free
  std::string checksum, fault_checksum;
  int64_t copied_bytes = -1;  // by the recovery from the kill (-1: not run)
};

uint64_t OptimizerBytes(const std::string& log_path) {
  std::ifstream in(log_path);
  std::string text(std::istreambuf_iterator<char>(in), {});
  std::smatch m;
  if (!std::regex_search(text, m, std::regex("optimizer state: (\\d+) bytes per rank"))) return 0;
  return std::stoull(m[1]);
}

int Main(int argc, char** argv) {
  auto [our_argc, program] = SplitAtDoubleDash(argc, argv);
  CLI::App app{
      "Sharded optimizer state against the unsharded run: bytes per rank, step time, bytes per "
      "recovery"};
  std::vector<int> worlds = {4, 8}, groups = {1, 2, 4};
  int64_t steps = 40;
  std::string out = "bench-results/sharding";
  app.add_option("--worlds", worlds, "World sizes")->delimiter(',')->capture_default_str();
  app.add_option("--groups", groups, "Shard group sizes (1: unsharded, the baseline; always run)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--steps", steps, "Training steps (passed to the program as --steps)")
      ->capture_default_str();
  app.add_option("--out", out, "Output directory (results.json, logs, journals)")
      ->capture_default_str();
  app.footer(
      "After `--`: the training program (default: nonstop-train with its built-in llama-tiny "
      "recipe); it "
      "must take --steps and --shard-group.");
  try {
    app.parse(our_argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (std::find(groups.begin(), groups.end(), 1) == groups.end()) groups.insert(groups.begin(), 1);
  const std::string bin = SelfDir();
  if (program.empty()) program = {bin + "/nonstop-train"};
  program.insert(program.end(), {"--steps", std::to_string(steps)});
  fs::create_directories(out);

  auto run = [&](const std::string& name, int world, int group, std::vector<std::string> flags) {
    std::string journal = out + "/" + name + ".jsonl";
    std::vector<std::string> argv = {bin + "/nonstop",      "run",       "--nproc",
                                     std::to_string(world), "--journal", journal};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("--");
    argv.insert(argv.end(), program.begin(), program.end());
    argv.insert(argv.end(), {"--shard-group", std::to_string(group)});
    int code = RunCommand(argv, out + "/" + name + ".log");
    auto summary = ReadJournalSummary(journal);
    if (!summary.ok()) fmt::print(stderr, "  {}: {}\n", name, summary.status().ToString());
    return std::make_pair(code, summary.ok() ? std::move(*summary) : JournalSummary{});
  };

  std::vector<Measured> results;
  for (int world : worlds) {
    for (int group : groups) {
      if (group < 1 || world % group != 0) continue;
      Measured m;
      m.world = world;
      m.group = group;
      std::string name = fmt::format("w{}-g{}", world, group);
      auto [code, clean] = run(name, world, group, {"--spares", "0", "--inject", "none"});
      m.exit_code = code;
      m.optimizer_bytes = OptimizerBytes(out + "/" + name + ".log");
      m.step_s = MedianStepInterval(clean.steps);
      m.checksum = clean.checksum;
      if (world / group >= 2) {
        auto [fcode, faulty] =
            run(name + "-kill", world, group,
                {"--spares", "1", "--inject", fmt::format("kill:rank=1,step={}", steps / 2)});
        m.fault_exit_code = fcode;
        m.fault_checksum = faulty.checksum;
        m.copied_bytes = 0;
        for (const auto& rec : faulty.recoveries)
          m.copied_bytes += rec.value("bytes_copied", int64_t{0});
      }
      fmt::print("  {}: exit {}, optimizer state {} bytes per rank, step {:.1f} ms{}\n", name,
                 m.exit_code, m.optimizer_bytes, m.step_s * 1000,
                 m.copied_bytes >= 0 ? fmt::format(", a recovery copied {} bytes (exit {})",
                                                   m.copied_bytes, m.fault_exit_code)
                                     : "");
      std::fflush(stdout);
      results.push_back(m);
    }
  }

  fmt::print("\n{:>5} {:>5} {:>14} {:>8} {:>10} {:>8} {:>16} {:>8}  {}\n", "world", "G",
             "opt bytes/rank", "vs G=1", "step (ms)", "vs G=1", "copied/recovery", "vs G=1",
             "checksum (fault-free / with the kill)");
  json rows = json::array();
  bool ok = true;
  for (const Measured& m : results) {
    const Measured* base = nullptr;
    for (const Measured& b : results) {
      if (b.world == m.world && b.group == 1) base = &b;
    }
    auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    double bytes_ratio =
        ratio(static_cast<double>(m.optimizer_bytes), static_cast<double>(base->optimizer_bytes));
    double step_ratio = ratio(m.step_s, base->step_s);
    double copied_ratio =
        m.copied_bytes >= 0 && base->copied_bytes > 0
            ? static_cast<double>(m.copied_bytes) / static_cast<double>(base->copied_bytes)
            : 0.0;
    fmt::print("{:>5} {:>5} {:>14} {:>8.3f} {:>10.1f} {:>8.3f} {:>16} {:>8}  {} / {}\n", m.world,
               m.group, m.optimizer_bytes, bytes_ratio, m.step_s * 1000, step_ratio,
               m.copied_bytes >= 0 ? std::to_string(m.copied_bytes) : "-",
               copied_ratio > 0 ? fmt::format("{:.3f}", copied_ratio) : "-", m.checksum,
               m.fault_checksum.empty() ? "-" : m.fault_checksum);
    ok = ok && m.exit_code == 0 && (m.copied_bytes < 0 || m.fault_exit_code == 0);
    rows.push_back({{"world", m.world},
                    {"shard_group", m.group},
                    {"exit_code", m.exit_code},
                    {"optimizer_bytes_per_rank", m.optimizer_bytes},
                    {"optimizer_bytes_ratio", bytes_ratio},
                    {"median_step_ms", m.step_s * 1000},
                    {"step_ratio", step_ratio},
                    {"checksum", m.checksum},
                    {"fault_exit_code", m.fault_exit_code},
                    {"fault_checksum", m.fault_checksum},
                    {"copied_bytes_per_recovery", m.copied_bytes},
                    {"copied_ratio", copied_ratio}});
  }
  json doc = {{"benchmark", "sharding"}, {"steps", steps}, {"program", program}, {"runs", rows}};
  std::ofstream(out + "/results.json") << doc.dump(2) << "\n";
  fmt::print("wrote {}/results.json (logs and journals beside it)\n", out);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
