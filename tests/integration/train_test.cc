// nonstop-train under nonstop run, on a micro recipe and data the test makes:
// bitwise determinism at a fixed world size, world-size invariance of the
// loss at a fixed global batch, and clear errors for bad recipes and data.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/temp_dir.h"
#include "controller/journal.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;

// A micro model that trains in a second or two on two cores.
// train_extra: more lines of the train section ("  determinism: world-invariant\n").
// optimizer_extra: more lines of the optimizer section ("  shard_group: 2\n").
std::string MicroRecipe(const std::string& data_dir, const std::string& text_file,
                        const std::string& arch = "llama", const std::string& train_extra = "",
                        const std::string& optimizer_extra = "") {
  std::string moe = arch == "gpt-oss" ? "  n_experts: 3\n  top_k: 2\n" : "";
  return "name: micro\n"
         "model:\n  arch: " +
         arch +
         "\n  vocab_size: 256\n  dim: 32\n  n_layers: 2\n  n_heads: 4\n  n_kv_heads: 2\n"
         "  ffn_hidden: 48\n" +
         moe +
         "  seq_len: 16\n"
         "train:\n  steps: 21\n  global_batch: 16\n  micro_batch: 2\n  seed: 7\n  log_every: 5\n" +
         train_extra + "optimizer:\n  lr: 3.0e-3\n  min_lr: 3.0e-4\n  warmup_steps: 3\n" +
         optimizer_extra + "data:\n  shards: " + data_dir + "\n  prepare_from: " + text_file + "\n";
}

constexpr const char* kWorldInvariant = "  determinism: world-invariant\n";

class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ofstream text(dir_ / "corpus.txt");
    for (int i = 0; i < 400; ++i) {
      text << "The quick brown fox " << i
           << " jumps over the lazy dog; pack my box with five dozen liquor jugs.\n";
    }
  }
  void WriteRecipe(const std::string& arch = "llama") {
    std::ofstream(dir_ / "recipe.yaml") << MicroRecipe(dir_ / "data", dir_ / "corpus.txt", arch);
  }
  struct RunResult {
    int code;
    std::string output;
    std::map<int64_t, double> losses;  // step → loss, from the journal
    std::string checksum;
  };
  RunResult Run(int nproc, const std::string& tag, std::vector<std::string> extra = {},
                std::vector<std::string> run_flags = {"--spares", "0"}) {
    auto p = Start(nproc, tag, std::move(extra), std::move(run_flags));
    return Finish(*p, tag);
  }
  // Run in two halves, for a test that acts on the job while it runs (its journal is
  // dir_ / (tag + ".jsonl")).
  std::unique_ptr<ChildProcess> Start(int nproc, const std::string& tag,
                                      std::vector<std::string> extra,
                                      std::vector<std::string> run_flags) {
    std::vector<std::string> argv = {kBin + "/nonstop",     "run",       "--nproc",
                                     std::to_string(nproc), "--journal", dir_ / (tag + ".jsonl")};
    argv.insert(argv.end(), run_flags.begin(), run_flags.end());
    argv.insert(argv.end(), {"--", kBin + "/nonstop-train", dir_ / "recipe.yaml"});
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<ChildProcess>(argv, dir_ / (tag + ".out"));
  }
  RunResult Finish(ChildProcess& p, const std::string& tag) {
    RunResult r;
    r.code = p.Wait(milliseconds(200'000));
    r.output = p.Output();
    if (auto records = controller::Journal::Read(dir_ / (tag + ".jsonl")); records.ok()) {
      for (auto& j : *records) {
        if (j["event"] == "step") r.losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
        if (j["event"] == "finished") r.checksum = j["checksum"];
      }
    }
    return r;
  }
  TempDir dir_;
};

TEST_F(TrainTest, SameWorldSizeIsBitwiseDeterministic) {
  WriteRecipe();
  RunResult a = Run(2, "a");
  RunResult b = Run(2, "b");
  ASSERT_EQ(a.code, 0) << a.output;
  ASSERT_EQ(b.code, 0) << b.output;
  ASSERT_FALSE(a.checksum.empty());
  EXPECT_EQ(a.checksum, b.checksum);
  EXPECT_NE(a.output.find("parameter checksum " + a.checksum), std::string::npos) << a.output;
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_LT(a.losses[20], a.losses[0]) << "it learns";
}

TEST_F(TrainTest, LossDoesNotDependOnWorldSizeAtAFixedGlobalBatch) {
  WriteRecipe();
  RunResult w1 = Run(1, "w1");
  RunResult w2 = Run(2, "w2");
  RunResult w4 = Run(4, "w4");
  for (auto* r : {&w1, &w2, &w4}) ASSERT_EQ(r->code, 0) << r->output;
  ASSERT_EQ(w1.losses.size(), 21u);
  for (int64_t step : {0, 10, 20}) {
    double base = w1.losses[step];
    EXPECT_LT(std::abs(w2.losses[step] - base) / base, 1e-4) << "step " << step;
    EXPECT_LT(std::abs(w4.losses[step] - base) / base, 1e-4) << "step " << step;
  }
}

TEST_F(TrainTest, RecoveryFromEachFaultKindIsBitwiseIdenticalToTheFaultFreeRun) {
  WriteRecipe();
  RunResult clean = Run(3, "clean");
  ASSERT_EQ(clean.code, 0) << clean.output;
  for (const char* fault :
       {"kill:rank=1,step=8", "exception:rank=2,step=5", "hang:rank=0,step=11"}) {
    RunResult r = Run(3, std::string("fault-") + fault[0], {},
                      {"--spares", "1", "--heartbeat-timeout-ms", "1000", "--inject", fault});
    ASSERT_EQ(r.code, 0) << fault << "\n" << r.output;
    EXPECT_EQ(r.checksum, clean.checksum) << fault << "\n" << r.output;
    EXPECT_EQ(r.losses, clean.losses) << fault;
    // DESIGN invariant 4: a fault costs at most the step in flight. The faulty rank can complete
    // step s-1 a moment before its peers read their last chunks of it; the abort then cuts them,
    // and the report counts that step, which only the dead rank held, as lost (it is redone,
    // bitwise the same).
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        r.output, m,
        std::regex(R"(recovery report: 1 recovery, 0 resizes, (\d+) completed steps? lost)")))
        << r.output;
    const int lost = std::stoi(m[1]);
    EXPECT_LE(lost, 1) << fault << ": more than the step in flight was lost\n" << r.output;
    if (fault[0] == 'h') {
      EXPECT_EQ(lost, 0) << "a hung rank completes nothing its peers did not";
    }
    if (lost == 1) {
      // Only the dead rank held it: the step it completed is the one the survivors resume at.
      std::string journal = dir_ / (std::string("fault-") + fault[0] + ".jsonl");
      auto faults = nonstop::testing::JournalEvents(journal, "fault");
      auto plans = nonstop::testing::JournalEvents(journal, "plan");
      ASSERT_EQ(faults.size(), 1u);
      ASSERT_EQ(plans.size(), 2u);
      EXPECT_EQ(faults[0]["last_step"], plans[1]["resume_step"]) << r.output;
    }
  }
}

// determinism: world-invariant (docs/determinism.md): a fixed reduction tree
// over the micro-batches makes the sum, and so every parameter, independent of
// the world size: fixed runs at 1, 3 and 4 workers, an elastic run 4 → 3 (a
// kill, no spare) → 4 (a grow), and a run resumed from a checkpoint written at
// world 4 continued at world 2 end on the same bits, with every loss the same.
TEST_F(TrainTest, WorldInvariantModeGivesTheSameBitsAtEveryWorldSizeAcrossChangesAndResumes) {
  std::ofstream(dir_ / "recipe.yaml")
      << MicroRecipe(dir_ / "data", dir_ / "corpus.txt", "llama", kWorldInvariant)
      << "checkpoint:\n  keep: 10\n";
  const std::vector<std::string> steps = {"--steps", "40"};
  RunResult w4 = Run(4, "w4", steps);
  ASSERT_EQ(w4.code, 0) << w4.output;
  ASSERT_EQ(w4.losses.size(), 40u);
  EXPECT_NE(w4.output.find("determinism      world-invariant"), std::string::npos) << w4.output;
  for (int n : {1, 3}) {
    RunResult r = Run(n, "w" + std::to_string(n), steps);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.checksum, w4.checksum) << "world " << n;
    EXPECT_EQ(r.losses, w4.losses) << "world " << n << ": every loss bitwise the same";
  }

  // 4 → 3 by a kill with no spare, then 3 → 4 by a grow, while it trains. The grown worker must
  // build its model and join before the job's last step: each step is slowed to 200 ms, so that
  // the 34 steps after the kill leave it about 7 s (at 40 ms a CI machine under load ended the job
  // first, and the plans were 4, 3).
  std::string journal = dir_ / "elastic.jsonl";
  std::vector<std::string> argv = {kBin + "/nonstop",
                                   "run",
                                   "--nproc",
                                   "4",
                                   "--spares",
                                   "0",
                                   "--max-world",
                                   "4",
                                   "--journal",
                                   journal,
                                   "--inject",
                                   "kill:rank=3,step=6",
                                   "--",
                                   kBin + "/nonstop-train",
                                   dir_ / "recipe.yaml",
                                   "--steps",
                                   "40",
                                   "--throttle-ms",
                                   "200"};
  ChildProcess run(argv, dir_ / "elastic.out");
  auto plans = [&] { return nonstop::testing::JournalEvents(journal, "plan"); };
  auto until = std::chrono::steady_clock::now() + milliseconds(120'000);
  while (plans().size() < 2 || plans().back()["members"].size() != 3) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "the shrink to 3\n" << run.Output();
    std::this_thread::sleep_for(milliseconds(20));
  }
  ChildProcess grow({kBin + "/nonstop", "scale", "--job", dir_ / "job.json", "--world-size", "4"},
                    dir_ / "grow.out");
  EXPECT_EQ(grow.Wait(milliseconds(20'000)), 0) << grow.Output();
  ASSERT_EQ(run.Wait(milliseconds(120'000)), 0) << run.Output();
  std::vector<size_t> worlds;
  for (auto& p : plans()) worlds.push_back(p["members"].size());
  EXPECT_EQ(worlds, (std::vector<size_t>{4, 3, 4})) << run.Output();
  std::string elastic_checksum;
  std::map<int64_t, double> elastic_losses;
  for (auto& j : nonstop::testing::JournalEvents(journal, "finished"))
    elastic_checksum = j["checksum"];
  for (auto& j : nonstop::testing::JournalEvents(journal, "step"))
    elastic_losses[j["step"]] = j["loss"];
  EXPECT_EQ(elastic_checksum, w4.checksum) << run.Output();
  EXPECT_EQ(elastic_losses, w4.losses);

  // A checkpoint written at world 4, resumed at world 2.
  std::string ckpt = dir_ / "ckpt";
  RunResult saved =
      Run(4, "saved", {"--steps", "40", "--checkpoint-dir", ckpt, "--checkpoint-every", "10"});
  ASSERT_EQ(saved.code, 0) << saved.output;
  namespace fs = std::filesystem;
  for (const char* newer : {"step-000000029", "step-000000039"}) fs::remove_all(ckpt + "/" + newer);
  ASSERT_TRUE(fs::exists(ckpt + "/step-000000019")) << saved.output;
  RunResult resumed = Run(2, "resumed", {"--steps", "40", "--resume", ckpt});
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_EQ(resumed.losses.begin()->first, 20) << "it resumed at step 20";
  EXPECT_EQ(resumed.checksum, w4.checksum) << resumed.output;
}

// For the salvage tests' kills at the reduction: a pause after each micro-batch (the trainer's
// test-only flag), so that the lost rank, which dies past its last micro-batch, finds every
// survivor past its first one unless that survivor runs 200 ms behind it. Without it a micro-batch
// is a few milliseconds here, and on a loaded machine a survivor can be one behind, or still in the
// step before, and keep nothing (a CI run saw it so). The pause changes no bits.
const std::vector<std::string> kPaused = {"--pause-after-micro-batch-ms", "200"};

// Rank 0's "step S: kept the sums of K of 8 micro-batches from the step in flight": K, and S in
// *step; -1 when nothing was kept.
int KeptMicroBatches(const std::string& output, int64_t* step) {
  static const std::regex kept_line(
      R"(step (\d+): kept the sums of (\d+) of 8 micro-batches from the step in flight)");
  std::smatch m;
  if (!std::regex_search(output, m, kept_line)) return -1;
  *step = std::stoll(m[1]);
  return std::stoi(m[2]);
}

// Salvaging the step in flight (issue 13): a kill at the reduction of step 10
// leaves the survivors with their micro-batch sums of that step; the next
// generation keeps them and computes only the lost rank's micro-batches,
// spread over every member. The run ends bitwise as the fault-free one, with
// a spare, with a shrink after two kills, and with salvage turned off. The
// faulted runs pause after each micro-batch (kPaused), so that every survivor
// has sums to keep even on a loaded machine.
TEST_F(TrainTest, WorldInvariantRecoveryKeepsTheStepInFlightsSumsAndEndsBitwiseTheSame) {
  std::ofstream(dir_ / "recipe.yaml")
      << MicroRecipe(dir_ / "data", dir_ / "corpus.txt", "llama", kWorldInvariant);
  RunResult ref = Run(4, "ref");
  ASSERT_EQ(ref.code, 0) << ref.output;
  ASSERT_EQ(ref.losses.size(), 21u);
  struct Case {
    std::string tag;
    std::vector<std::string> run_flags;
    int64_t step;
    int most_kept;  // the lost ranks' micro-batches are never kept
  };
  for (const Case& c :
       {Case{"spare", {"--spares", "1", "--inject", "kill:rank=2,step=10"}, 10, 6},
        Case{"shrink",
             {"--spares", "0", "--inject", "kill:rank=1,step=12;kill:rank=3,step=12"},
             12,
             6}}) {
    RunResult r = Run(4, c.tag, kPaused, c.run_flags);
    ASSERT_EQ(r.code, 0) << r.output;
    int64_t at = -1;
    int n = KeptMicroBatches(r.output, &at);
    EXPECT_GE(n, 1) << c.tag << ": the survivors' sums were kept\n" << r.output;
    EXPECT_LE(n, c.most_kept) << c.tag;
    EXPECT_EQ(at, c.step) << c.tag;
    EXPECT_EQ(r.checksum, ref.checksum) << c.tag << "\n" << r.output;
    EXPECT_EQ(r.losses, ref.losses) << c.tag << ": every loss bitwise the same";
  }
  RunResult whole =
      Run(4, "whole", {"--no-salvage"}, {"--spares", "1", "--inject", "kill:rank=2,step=10"});
  ASSERT_EQ(whole.code, 0) << whole.output;
  int64_t at = -1;
  EXPECT_EQ(KeptMicroBatches(whole.output, &at), -1)
      << "--no-salvage computes the step again whole\n"
      << whole.output;
  EXPECT_EQ(whole.checksum, ref.checksum);
  EXPECT_EQ(whole.losses, ref.losses);
}

// Salvage in the default (ring) mode (docs/recovery.md "Salvage in the default
// mode"): after a fault the survivors keep the local sums of the micro-batches
// they completed of the step in flight. With a spare in the lost rank's place
// each survivor continues its own block and the spare computes the lost one:
// the run ends bitwise as the fault-free one, for a kill at the reduction and
// for a fault that cuts the step between micro-batches. With no spare (a
// shrink) the micro-batches nobody holds are dealt over the survivors: the
// loss curve stays within rounding of the fixed world. After a kill at the
// reduction the spare lends half the lost block to a survivor (nonstop/ring.h)
// and the run is still bitwise. --no-salvage keeps
// nothing and ends bitwise too.
TEST_F(TrainTest, RingRecoveryKeepsTheStepInFlightsSumsAndEndsBitwiseTheSame) {
  WriteRecipe();
  const std::vector<std::string> steps = {"--steps", "8"};
  RunResult ref = Run(4, "ref", steps);
  ASSERT_EQ(ref.code, 0) << ref.output;
  ASSERT_EQ(ref.losses.size(), 8u);
  EXPECT_EQ(ref.output.find("kept the sums of"), std::string::npos) << "no fault, nothing kept";
  RunResult ref_whole_buffer = Run(4, "ref-no-overlap", {"--steps", "8", "--no-overlap"});
  ASSERT_EQ(ref_whole_buffer.code, 0) << ref_whole_buffer.output;
  // Cut between micro-batches: every worker pauses a second after each micro-batch, and the
  // fault lands in the pause after the first: a kill a quarter into step 5 (half a second; a
  // step takes two), with a spare or without (a shrink). Each survivor keeps 1 of its 2, unless the
  // abort reaches it more than a second late (a loaded machine): the bound checked is the one that
  // holds whatever the timing, that no micro-batch of the lost rank is kept.
  const std::vector<std::string> paused = {"--steps", "8", "--pause-after-micro-batch-ms", "1000"};
  const std::vector<std::string> reduction = {"--steps", "8", kPaused[0], kPaused[1]};
  struct Case {
    std::string tag;
    std::vector<std::string> extra;
    std::vector<std::string> run_flags;
    bool bitwise;
    int most_kept;  // the lost rank's micro-batches are never kept
  };
  // Rank 0's plan line ends "…, L of them lent by the owner of their block": L.
  auto loans = [](const std::string& output) {
    static const std::regex lent(R"((\d+) of them lent by the owner of their block)");
    std::smatch m;
    return std::regex_search(output, m, lent) ? std::stoi(m[1]) : -1;
  };
  for (const Case& c : {
           Case{"spare-reduction",
                reduction,
                {"--spares", "1", "--inject", "kill:rank=2,step=5"},
                true,
                6},
           // Without overlap the kill fires after rank 2's last micro-batch and its pause: the
           // survivors are in theirs, their blocks whole, unless one is a second late.
           Case{"spare-reduction-loan",
                {"--steps", "8", "--no-overlap", "--pause-after-micro-batch-ms", "1000"},
                {"--spares", "1", "--inject", "kill:rank=2,step=5"},
                true,
                6},
           Case{"spare-mid-step",
                paused,
                {"--spares", "1", "--inject", "kill:rank=2,step=5,at=0.25"},
                true,
                6},
           Case{"shrink-reduction",
                reduction,
                {"--spares", "0", "--inject", "kill:rank=3,step=5"},
                false,
                6},
           Case{"shrink-mid-step",
                paused,
                {"--spares", "0", "--inject", "kill:rank=3,step=5,at=0.25"},
                false,
                6},
       }) {
    RunResult r = Run(4, c.tag, c.extra, c.run_flags);
    ASSERT_EQ(r.code, 0) << c.tag << "\n" << r.output;
    int64_t at = -1;
    int n = KeptMicroBatches(r.output, &at);
    EXPECT_GE(n, 1) << c.tag << ": the survivors' sums were kept\n" << r.output;
    EXPECT_LE(n, c.most_kept) << c.tag << "\n" << r.output;
    EXPECT_EQ(at, 5) << c.tag;
    // With a spare and 4 or more kept, at most 4 micro-batches are left over 4 ranks: the spare's
    // 2 are above the even load of 1, so it lends (and a survivor cut before its first may lend
    // too). With 3 or fewer kept the even load is 2: nobody lends. A shrink deals what is missing
    // evenly and lends nothing.
    const bool spare = c.tag.starts_with("spare");
    if (spare && n >= 4) {
      EXPECT_GE(loans(r.output), 1) << c.tag << "\n" << r.output;
    } else {
      EXPECT_EQ(loans(r.output), 0) << c.tag << "\n" << r.output;
    }
    if (c.tag == "spare-reduction-loan") {
      EXPECT_GE(n, 4) << "a loan was made\n" << r.output;
    }
    ASSERT_EQ(r.losses.size(), ref.losses.size()) << c.tag;
    if (c.bitwise) {
      // without overlap the ring reduces the buffer whole, not in buckets: other bits
      const RunResult& base = c.tag == "spare-reduction-loan" ? ref_whole_buffer : ref;
      EXPECT_EQ(r.checksum, base.checksum) << c.tag << "\n" << r.output;
      EXPECT_EQ(r.losses, base.losses) << c.tag << ": every loss bitwise the same";
    } else {
      EXPECT_NE(r.output.find("world 4 → 3"), std::string::npos) << c.tag << "\n" << r.output;
      for (const auto& [step, loss] : ref.losses) {
        EXPECT_LT(std::abs(r.losses[step] - loss) / loss, 1e-4) << c.tag << " step " << step;
      }
    }
  }
  RunResult whole = Run(4, "whole", {"--steps", "8", "--no-salvage"},
                        {"--spares", "1", "--inject", "kill:rank=2,step=5"});
  ASSERT_EQ(whole.code, 0) << whole.output;
  int64_t at = -1;
  EXPECT_EQ(KeptMicroBatches(whole.output, &at), -1)
      << "--no-salvage computes the step again whole\n"
      << whole.output;
  EXPECT_EQ(whole.checksum, ref.checksum);
  EXPECT_EQ(whole.losses, ref.losses);
}

// Loans with the overlapped reduction (nonstop/ring.h): 16 micro-batches, 4 a rank, a kill
// seven tenths into step 5 (the test-only pause after each micro-batch lets it land between
// micro-batches). The survivors keep what they completed and continue their blocks; the spare
// would compute the lost block's 4 alone, and lends its tail to the members with less. The
// borrowers' gradients are added by the owner in its block's order and the buckets start after
// them: the run ends bitwise as the fault-free one.
std::map<int64_t, std::vector<uint64_t>> SamplesByStep(const std::string& dir,
                                                       std::string* duplicates);

TEST_F(TrainTest, TheLostBlocksTailIsLentOutAndTheRunEndsBitwiseTheSame) {
  std::string recipe = MicroRecipe(dir_ / "data", dir_ / "corpus.txt");
  recipe.replace(recipe.find("micro_batch: 2"), 14, "micro_batch: 1");
  std::ofstream(dir_ / "recipe.yaml") << recipe;
  auto paused = [this](const std::string& samples) {
    return std::vector<std::string>{
        "--steps", "8", "--pause-after-micro-batch-ms", "500", "--log-samples", dir_ / samples};
  };
  RunResult ref = Run(4, "ref", paused("samples-ref"));
  ASSERT_EQ(ref.code, 0) << ref.output;
  RunResult r = Run(4, "lent", paused("samples-lent"),
                    {"--spares", "1", "--inject", "kill:rank=2,step=5,at=0.7"});
  ASSERT_EQ(r.code, 0) << r.output;
  // Every sample of every step logged once, by the owner of its micro-batch's block.
  std::string dup_ref, dup_lent;
  auto want = SamplesByStep(dir_ / "samples-ref", &dup_ref);
  EXPECT_EQ(SamplesByStep(dir_ / "samples-lent", &dup_lent), want);
  EXPECT_EQ(dup_lent, "") << "a sample logged twice";
  EXPECT_EQ(want.size(), 8u);
  static const std::regex plan(
      R"(step 5: kept the sums of (\d+) of 16 micro-batches .* (\d+) of them lent by the owner)");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, plan)) << r.output;
  EXPECT_GE(std::stoi(m[2]), 1) << "the spare lent part of the lost block\n" << r.output;
  EXPECT_EQ(r.checksum, ref.checksum) << r.output;
  EXPECT_EQ(r.losses, ref.losses) << "every loss bitwise the same";
}

TEST_F(TrainTest, WorldInvariantModeHoldsForTheMixtureOfExperts) {
  std::ofstream(dir_ / "recipe.yaml")
      << MicroRecipe(dir_ / "data", dir_ / "corpus.txt", "gpt-oss", kWorldInvariant);
  RunResult w1 = Run(1, "moe1");
  RunResult w3 = Run(3, "moe3");
  ASSERT_EQ(w1.code, 0) << w1.output;
  ASSERT_EQ(w3.code, 0) << w3.output;
  ASSERT_FALSE(w1.checksum.empty());
  EXPECT_EQ(w3.checksum, w1.checksum);
  EXPECT_EQ(w3.losses, w1.losses);
}

TEST_F(TrainTest, WorldInvariantModeNeedsAFixedBatch) {
  std::ofstream(dir_ / "recipe.yaml")
      << MicroRecipe(dir_ / "data", dir_ / "corpus.txt", "llama",
                     std::string(kWorldInvariant) + "  batch: scale-with-world\n");
  RunResult r = Run(1, "bad");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("'world-invariant' needs train.batch 'fixed'"), std::string::npos)
      << r.output;
}

TEST_F(TrainTest, ShrinkKeepsTheLossCurveOfTheFullWorld) {
  WriteRecipe();
  RunResult full = Run(4, "full");
  RunResult shrunk = Run(4, "shrunk", {}, {"--spares", "0", "--inject", "kill:rank=3,step=6"});
  ASSERT_EQ(full.code, 0) << full.output;
  ASSERT_EQ(shrunk.code, 0) << shrunk.output;
  EXPECT_NE(shrunk.output.find("world 4 → 3"), std::string::npos) << shrunk.output;
  ASSERT_EQ(shrunk.losses.size(), full.losses.size());
  for (const auto& [step, loss] : full.losses) {
    EXPECT_LT(std::abs(shrunk.losses[step] - loss) / loss, 1e-4) << "step " << step;
  }
}

TEST_F(TrainTest, ResumeFromADurableCheckpointMatchesTheUninterruptedRun) {
  std::ofstream(dir_ / "recipe.yaml")
      << MicroRecipe(dir_ / "data", dir_ / "corpus.txt") << "checkpoint:\n  keep: 10\n";
  std::string ckpt = dir_ / "ckpt";
  RunResult full =
      Run(2, "full", {"--checkpoint-dir", ckpt, "--checkpoint-every", "5"}, {"--spares", "0"});
  ASSERT_EQ(full.code, 0) << full.output;
  // Keep step 9 and step 4; make step 9 corrupt: the resume must skip it, say so, and use step 4.
  namespace fs = std::filesystem;
  for (const char* newer : {"step-000000014", "step-000000019", "step-000000020"})
    fs::remove_all(ckpt + "/" + newer);
  ASSERT_TRUE(fs::exists(ckpt + "/step-000000009")) << full.output;
  RunResult from9 = Run(2, "resume9", {"--resume", ckpt});
  ASSERT_EQ(from9.code, 0) << from9.output;
  EXPECT_NE(from9.output.find("resumed from " + ckpt + "/step-000000009"), std::string::npos)
      << from9.output;
  EXPECT_EQ(from9.checksum, full.checksum);
  EXPECT_EQ(from9.losses.begin()->first, 10) << "it resumed at step 10";
  {
    std::fstream f(ckpt + "/step-000000009/state.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1000);
    f.put('\x42');
  }
  RunResult from4 = Run(2, "resume4", {"--resume", ckpt});
  ASSERT_EQ(from4.code, 0) << from4.output;
  EXPECT_NE(from4.output.find("fails its checksum"), std::string::npos) << from4.output;
  EXPECT_NE(from4.output.find("resumed from " + ckpt + "/step-000000004"), std::string::npos)
      << from4.output;
  EXPECT_EQ(from4.checksum, full.checksum);
}

TEST_F(TrainTest, CheckpointRestartBaselineRedoesTheLostStepsAndEndsTheSame) {
  WriteRecipe();
  RunResult clean = Run(2, "clean");
  std::string ckpt = dir_ / "ckpt";
  RunResult r = Run(2, "baseline", {},
                    {"--spares", "0", "--recovery", "checkpoint", "--checkpoint-dir", ckpt,
                     "--checkpoint-every", "5", "--inject", "kill:rank=1,step=12"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.checksum, clean.checksum) << r.output;
  EXPECT_NE(r.output.find("restarting every worker from the newest durable checkpoint"),
            std::string::npos)
      << r.output;
  // It resumes after the newest checkpoint that was durable when rank 1 died: step 9's (2 steps
  // redone: 10, 11), or, when its asynchronous write had not finished by step 12 (a loaded
  // machine: the steps take tens of ms), step 4's, and the workers say they skipped the other.
  const bool nine_half_written =
      r.output.find("skipped checkpoint " + ckpt + "/step-000000009.tmp") != std::string::npos;
  EXPECT_NE(r.output.find(nine_half_written ? "resumed at step 5, 7 completed steps redone"
                                            : "resumed at step 10, 2 completed steps redone"),
            std::string::npos)
      << r.output;
}

// Both workers die as step 13 starts (timed kills: one at the reduction would come too late, the
// abort stops the other inside its forward first), so no worker holds the state.
TEST_F(TrainTest, WhenNoWorkerHoldsTheStateTheJobRestartsFromTheLastCheckpoint) {
  WriteRecipe();
  RunResult clean = Run(2, "clean");
  std::string ckpt = dir_ / "ckpt";
  RunResult r = Run(2, "lastrung", {},
                    {"--spares", "0", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                     "--inject", "kill:rank=0,step=13,at=0;kill:rank=1,step=13,at=0"});
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.checksum, clean.checksum) << r.output;
  EXPECT_NE(r.output.find("exists on no live worker"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restarting every worker"), std::string::npos) << r.output;
}

// Samples of every completed step, from the --log-samples files: step → sorted sample ids.
std::map<int64_t, std::vector<uint64_t>> SamplesByStep(const std::string& dir,
                                                       std::string* duplicates) {
  std::map<int64_t, std::vector<uint64_t>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path());
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      int64_t step;
      uint64_t mb, x;
      ls >> step >> mb;
      while (ls >> x) out[step].push_back(x);
    }
  }
  for (auto& [step, v] : out) {
    std::sort(v.begin(), v.end());
    if (std::adjacent_find(v.begin(), v.end()) != v.end())
      *duplicates += fmt::format(" step {}", step);
  }
  return out;
}

TEST_F(TrainTest, ElasticRunKeepsTheLossCurveAndTheSamplesOfAFixedWorld) {
  WriteRecipe();
  const std::vector<std::string> train = {"--steps", "200", "--throttle-ms", "25"};
  auto args = [&](const std::string& samples) {
    std::vector<std::string> a = train;
    a.push_back("--log-samples");
    a.push_back(samples);
    return a;
  };
  RunResult fixed = Run(4, "fixed4", args(dir_ / "samples-fixed"));
  ASSERT_EQ(fixed.code, 0) << fixed.output;

  std::string journal = dir_ / "elastic.jsonl";
  // 3 → 2 later: rank 1 is killed at step 101 (before its collective: a kill
  // from outside could land after the step's sum was complete and before the
  // victim logged its samples, and the log would miss its share of that step).
  std::vector<std::string> argv = {kBin + "/nonstop",
                                   "run",
                                   "--nproc",
                                   "2",
                                   "--spares",
                                   "0",
                                   "--max-world",
                                   "4",
                                   "--journal",
                                   journal,
                                   "--inject",
                                   "kill:rank=1,step=101",
                                   "--",
                                   kBin + "/nonstop-train",
                                   dir_ / "recipe.yaml"};
  for (const auto& a : args(dir_ / "samples-elastic")) argv.push_back(a);
  ChildProcess run(argv, dir_ / "elastic.out");
  auto events = [&](const std::string& kind) {
    return nonstop::testing::JournalEvents(journal, kind);
  };
  auto step = [&] {
    int64_t h = -1;
    for (auto& j : events("step")) h = std::max<int64_t>(h, j["step"]);
    return h;
  };
  auto world = [&] {
    auto p = events("plan");
    return p.empty() ? size_t{0} : p.back()["members"].size();
  };
  auto wait = [&](const std::function<bool()>& cond, const char* what) {
    auto until = std::chrono::steady_clock::now() + milliseconds(120'000);
    while (!cond()) {
      ASSERT_LT(std::chrono::steady_clock::now(), until) << what << "\n" << run.Output();
      std::this_thread::sleep_for(milliseconds(20));
    }
  };
  std::string job = dir_ / "job.json";
  // 2 → 4: two workers started by hand join the job.
  wait([&] { return step() >= 15; }, "step 15");
  std::vector<std::string> joiner = {
      kBin + "/nonstop",   "worker", "--job", job, "--", kBin + "/nonstop-train",
      dir_ / "recipe.yaml"};
  for (const auto& a : args(dir_ / "samples-elastic")) joiner.push_back(a);
  ChildProcess join_a(joiner, dir_ / "join-a.out");
  ChildProcess join_b(joiner, dir_ / "join-b.out");
  wait([&] { return world() == 4; }, "the world to grow to 4");
  // 4 → 3: give one back.
  wait([&] { return step() >= 60; }, "step 60");
  ChildProcess release({kBin + "/nonstop", "scale", "--job", job, "--release", "1"},
                       dir_ / "scale1.out");
  EXPECT_EQ(release.Wait(milliseconds(20'000)), 0) << release.Output();
  wait([&] { return world() == 3; }, "the world to shrink to 3");
  // 3 → 2: rank 1 is killed at step 101 and no spare is left.
  wait([&] { return world() == 2; }, "the shrink on the fault");
  // 2 → 4: capacity comes back on request.
  wait([&] { return step() >= 130; }, "step 130");
  ChildProcess grow({kBin + "/nonstop", "scale", "--job", job, "--world-size", "4"},
                    dir_ / "scale2.out");
  EXPECT_EQ(grow.Wait(milliseconds(20'000)), 0) << grow.Output();
  wait([&] { return world() == 4; }, "the grow back to 4");
  ASSERT_EQ(run.Wait(milliseconds(120'000)), 0) << run.Output();
  std::vector<size_t> worlds;
  for (auto& p : events("plan")) worlds.push_back(p["members"].size());
  EXPECT_EQ(worlds, (std::vector<size_t>{2, 4, 3, 2, 4})) << run.Output();

  std::map<int64_t, double> losses;
  for (auto& j : events("step")) losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
  ASSERT_EQ(losses.size(), fixed.losses.size());
  for (const auto& [s, loss] : fixed.losses) {
    ASSERT_TRUE(losses.count(s)) << "step " << s;
    EXPECT_LT(std::abs(losses[s] - loss) / loss, 1e-4) << "step " << s;
  }
  std::string dup_fixed, dup_elastic;
  auto want = SamplesByStep(dir_ / "samples-fixed", &dup_fixed);
  auto got = SamplesByStep(dir_ / "samples-elastic", &dup_elastic);
  EXPECT_TRUE(dup_elastic.empty()) << "samples repeated in" << dup_elastic;
  EXPECT_EQ(got.size(), 200u);
  std::string differ;
  for (const auto& [s, samples] : want) {
    if (got.count(s) && got[s] != samples && differ.size() < 2000) {
      differ += fmt::format("\n  step {}: fixed world [{}], elastic [{}]", s,
                            fmt::join(samples, " "), fmt::join(got[s], " "));
    }
  }
  EXPECT_TRUE(got == want) << "some step saw other samples than in the fixed world:" << differ;
}

TEST_F(TrainTest, ScaleWithWorldBatchGrowsTheBatchAndTheLearningRate) {
  std::ofstream(dir_ / "recipe.yaml") << std::regex_replace(
      MicroRecipe(dir_ / "data", dir_ / "corpus.txt"), std::regex("  log_every: 5\n"),
      "  log_every: 5\n  batch: scale-with-world\n  lr_scaling: sqrt\n  rescale_warmup_steps: 3\n");
  std::string journal = dir_ / "scaled.jsonl";
  ChildProcess run({kBin + "/nonstop",
                    "run",
                    "--nproc",
                    "2",
                    "--spares",
                    "2",
                    "--max-world",
                    "4",
                    "--journal",
                    journal,
                    "--inject",
                    "none",
                    "--",
                    kBin + "/nonstop-train",
                    dir_ / "recipe.yaml",
                    "--steps",
                    "60",
                    "--throttle-ms",
                    "20",
                    "--log-samples",
                    dir_ / "samples"},
                   dir_ / "scaled.out");
  ASSERT_EQ(run.Wait(milliseconds(120'000)), 0) << run.Output();
  std::string out = run.Output();
  EXPECT_NE(out.find("global batch 32 samples, learning-rate factor 1.000 → 1.414 over 3 steps"),
            std::string::npos)
      << out;
  std::string dup;
  auto samples = SamplesByStep(dir_ / "samples", &dup);
  ASSERT_EQ(samples.size(), 60u);
  std::set<uint64_t> all;
  size_t total = 0, small = 0, large = 0;
  for (const auto& [step, v] : samples) {
    EXPECT_TRUE(v.size() == 16 || v.size() == 32)
        << "step " << step << " has " << v.size() << " samples";
    (v.size() == 16 ? small : large)++;
    total += v.size();
    all.insert(v.begin(), v.end());
  }
  EXPECT_GT(small, 0u);
  EXPECT_GT(large, 0u) << "the batch grew with the world";
  EXPECT_EQ(all.size(), total) << "no sample is seen twice (the run stays within one epoch)";
}

TEST_F(TrainTest, MixtureOfExpertsModelTrains) {
  WriteRecipe("gpt-oss");
  RunResult r = Run(2, "moe");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(r.losses[20], r.losses[0]);
}

TEST_F(TrainTest, UnknownRecipeKeyFailsTheJobNamingTheKey) {
  std::ofstream(dir_ / "recipe.yaml")
      << MicroRecipe(dir_ / "data", dir_ / "corpus.txt") << "extra_section:\n  x: 1\n";
  RunResult r = Run(1, "bad");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("extra_section: unknown key"), std::string::npos) << r.output;
}

TEST_F(TrainTest, CorruptShardIsDataCorruption) {
  WriteRecipe();
  ASSERT_EQ(Run(1, "prepare", {"--steps", "1"}).code, 0);
  {
    std::fstream f(dir_ / "data/shard_000000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    f.put('\x7f');
  }
  RunResult r = Run(1, "corrupt");
  EXPECT_EQ(r.code, 11) << r.output;
  EXPECT_NE(r.output.find("shard_000000.bin"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("checksum"), std::string::npos) << r.output;
}

// ---- Sharded optimizer state (issue 12, docs/sharding.md) ----

// "optimizer state: N bytes per rank", as rank 0 prints it.
uint64_t OptimizerBytesPerRank(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex("optimizer state: (\\d+) bytes per rank"))) return 0;
  return std::stoull(m[1]);
}

class ShardedTrainTest : public TrainTest {
 protected:
  void WriteSharded(int group, bool world_invariant = true, const std::string& more = "") {
    std::ofstream(dir_ / "recipe.yaml")
        << MicroRecipe(dir_ / "data", dir_ / "corpus.txt", "llama",
                       world_invariant ? kWorldInvariant : "",
                       group > 1 ? fmt::format("  shard_group: {}\n", group) : "")
        << more;
  }
  // The bytes of the state's parameters and moments (unsharded: 3 × 4 × parameters).
  static uint64_t WholeStateBytes(uint64_t unsharded_optimizer_bytes) {
    return unsharded_optimizer_bytes / 2 * 3;
  }
  std::vector<size_t> Worlds(const std::string& tag) {
    std::vector<size_t> worlds;
    for (auto& p : nonstop::testing::JournalEvents(dir_ / (tag + ".jsonl"), "plan"))
      worlds.push_back(p["members"].size());
    return worlds;
  }
  // Runs 4 workers in groups of 2 and, once the journal holds 7 steps, SIGKILLs ranks 1 and 3,
  // the two holders of shard 1, back to back: both die within microseconds, whatever step each
  // was in. (An injected kill of each at the start of a step could land a recovery apart: a
  // holder that finished step S-1 can start step S while the other still reads its last pieces
  // of S-1, and then the first death only aborts the second.) kPaused makes a step last over
  // 400 ms, so the kill lands long before the job's last step.
  RunResult KillBothHoldersOfShard1(const std::string& tag, const std::vector<std::string>& flags) {
    auto p = Start(4, tag, kPaused, flags);
    const std::string journal = dir_ / (tag + ".jsonl");
    if (!nonstop::testing::WaitForEvents(journal, "step", 7, milliseconds(120'000))) {
      ADD_FAILURE() << tag << ": no 7 steps in the journal within 120 s";
      ::kill(p->pid(), SIGTERM);
      return Finish(*p, tag);
    }
    std::map<int64_t, pid_t> pid_of;  // worker id → pid
    for (auto& j : nonstop::testing::JournalEvents(journal, "join"))
      pid_of[j["worker_id"].get<int64_t>()] = j["pid"].get<pid_t>();
    const auto plans = nonstop::testing::JournalEvents(journal, "plan");
    std::vector<pid_t> holders;  // of ranks 1 and 3: the plan's members are worker ids by rank
    for (int rank : {1, 3}) {
      if (plans.size() != 1 || plans[0]["members"].size() != 4) break;
      auto it = pid_of.find(plans[0]["members"][rank].get<int64_t>());
      if (it != pid_of.end()) holders.push_back(it->second);
    }
    if (holders.size() != 2) {
      ADD_FAILURE() << tag << ": " << plans.size()
                    << " plan(s) before the kill (a fault came first?), or no join of a holder";
      ::kill(p->pid(), SIGTERM);
      return Finish(*p, tag);
    }
    for (pid_t pid : holders) EXPECT_EQ(::kill(pid, SIGKILL), 0) << pid;
    return Finish(*p, tag);
  }
};

TEST_F(ShardedTrainTest, ShardsTheMomentsAndKeepsTheUnshardedLossCurve) {
  for (bool invariant : {true, false}) {
    const std::string mode = invariant ? "invariant" : "fast";
    WriteSharded(1, invariant);
    RunResult whole = Run(4, mode + "-whole");
    ASSERT_EQ(whole.code, 0) << whole.output;
    const uint64_t whole_bytes = OptimizerBytesPerRank(whole.output);
    ASSERT_GT(whole_bytes, 0u) << whole.output;
    for (int group : {2, 4}) {
      if (!invariant && group == 4) continue;
      WriteSharded(group, invariant);
      RunResult r = Run(4, fmt::format("{}-g{}", mode, group));
      ASSERT_EQ(r.code, 0) << r.output;
      // The moments shrink by G: a shard is 1/G of the parameters and the loss slot, padded to a
      // multiple of G.
      const uint64_t bytes = OptimizerBytesPerRank(r.output);
      EXPECT_GE(bytes * static_cast<uint64_t>(group), whole_bytes) << mode << " G=" << group;
      EXPECT_LE(bytes * static_cast<uint64_t>(group),
                whole_bytes + 8u * static_cast<uint64_t>(group))
          << mode << " G=" << group << "\n"
          << r.output;
      ASSERT_EQ(r.losses.size(), whole.losses.size());
      if (invariant) {
        // The same sums, the same elementwise update: the same bits.
        EXPECT_EQ(r.checksum, whole.checksum) << "G=" << group;
        EXPECT_EQ(r.losses, whole.losses) << "G=" << group;
      } else {
        for (auto [step, loss] : whole.losses) {
          // another summation order
          EXPECT_LT(std::abs(r.losses[step] - loss) / loss, 1e-4) << "step " << step;
        }
      }
    }
  }
}

TEST_F(ShardedTrainTest, RecoveriesAndReshardingEndBitwiseAsTheFaultFreeRun) {
  WriteSharded(1);
  const uint64_t whole_bytes = OptimizerBytesPerRank(Run(1, "whole", {"--steps", "1"}).output);
  WriteSharded(2);
  RunResult ref = Run(4, "ref");  // world-invariant: the same bits at 6, 4 and 2 ranks
  ASSERT_EQ(ref.code, 0) << ref.output;
  const uint64_t shard_moments = OptimizerBytesPerRank(ref.output);
  const std::vector<std::string> fault = {"--heartbeat-timeout-ms", "1000", "--inject"};
  auto with_fault = [&](std::vector<std::string> flags, const std::string& spec) {
    flags.insert(flags.end(), fault.begin(), fault.end());
    flags.push_back(spec);
    return flags;
  };

  // A kill with a spare: the spare copies shard 1 from its replica, and the step counters from
  // anyone.
  RunResult spare = Run(4, "spare", {}, with_fault({"--spares", "1"}, "kill:rank=1,step=8"));
  ASSERT_EQ(spare.code, 0) << spare.output;
  EXPECT_EQ(spare.checksum, ref.checksum) << spare.output;
  EXPECT_NE(spare.output.find("re-sharded: copied shard 1 of the optimizer state"),
            std::string::npos)
      << spare.output;
  uint64_t copied = 0;
  for (auto& j : nonstop::testing::JournalEvents(dir_ / "spare.jsonl", "recovery_end")) {
    copied += j["recovery"].value("bytes_copied", uint64_t{0});
  }
  // One shard of the parameters and both moments (3/2 of a shard's moments), and six 8-byte
  // counters.
  EXPECT_EQ(copied, shard_moments / 2 * 3 + 6 * 8) << spare.output;
  EXPECT_LT(copied, WholeStateBytes(whole_bytes) / 2 + 64) << "not the whole state";

  // The same where every worker looked for a checkpoint to resume from and found none (a restarted
  // job before its first checkpoint): the spare's copied shard is what it trains on.
  RunResult none =
      Run(4, "none", {"--resume-from-checkpoint-dir", "--checkpoint-dir", dir_ / "no-checkpoints"},
          with_fault({"--spares", "1"}, "kill:rank=1,step=8"));
  ASSERT_EQ(none.code, 0) << none.output;
  EXPECT_NE(none.output.find("no checkpoint to resume from"), std::string::npos) << none.output;
  EXPECT_EQ(none.checksum, ref.checksum) << none.output;

  // Two kills in different groups in one step, two spares.
  RunResult two =
      Run(4, "two", {}, with_fault({"--spares", "2"}, "kill:rank=0,step=8;kill:rank=3,step=8"));
  ASSERT_EQ(two.code, 0) << two.output;
  EXPECT_EQ(two.checksum, ref.checksum) << two.output;

  // No spare: 6 → 4 (a member released to keep whole groups: every rank after the lost one
  // changes shard, re-sharded live), and a kill during that re-shard: → 2, re-sharded again.
  RunResult during =
      Run(6, "during", {},
          with_fault({"--spares", "0"}, "kill:rank=0,step=8;kill:rank=1,during=transfer"));
  ASSERT_EQ(during.code, 0) << during.output;
  EXPECT_EQ(during.checksum, ref.checksum) << during.output;
  EXPECT_EQ(Worlds("during"), (std::vector<size_t>{6, 4, 2})) << during.output;
  EXPECT_NE(during.output.find("re-sharded"), std::string::npos) << during.output;

  // A shrink (4 → 2 by a kill with no spare) and a grow back to 4, while it trains. The grown
  // workers must build their model and join before the job's last step: each step is slowed to
  // 400 ms, so that the 15 steps after the shrink leave them seconds even on a loaded machine.
  std::string journal = dir_ / "grow.jsonl";
  ChildProcess run(
      {kBin + "/nonstop", "run", "--nproc", "4", "--spares", "0", "--max-world", "4", "--journal",
       journal, "--heartbeat-timeout-ms", "1000", "--inject", "kill:rank=0,step=6", "--",
       kBin + "/nonstop-train", dir_ / "recipe.yaml", "--throttle-ms", "400"},
      dir_ / "grow.out");
  auto until = std::chrono::steady_clock::now() + milliseconds(120'000);
  while (Worlds("grow").size() < 2) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "the shrink\n" << run.Output();
    std::this_thread::sleep_for(milliseconds(20));
  }
  ChildProcess grow({kBin + "/nonstop", "scale", "--job", dir_ / "job.json", "--world-size", "4"},
                    dir_ / "scale.out");
  EXPECT_EQ(grow.Wait(milliseconds(20'000)), 0) << grow.Output();
  ASSERT_EQ(run.Wait(milliseconds(120'000)), 0) << run.Output();
  EXPECT_EQ(Worlds("grow"), (std::vector<size_t>{4, 2, 4})) << run.Output();
  std::string checksum;
  for (auto& j : nonstop::testing::JournalEvents(journal, "finished")) checksum = j["checksum"];
  EXPECT_EQ(checksum, ref.checksum) << run.Output();

  // Fast determinism, bitwise at a fixed world: a kill with a spare.
  WriteSharded(2, /*world_invariant=*/false);
  RunResult fast = Run(4, "fast");
  RunResult fast_spare =
      Run(4, "fast-spare", {}, with_fault({"--spares", "1"}, "kill:rank=2,step=9"));
  ASSERT_EQ(fast_spare.code, 0) << fast_spare.output;
  EXPECT_EQ(fast_spare.checksum, fast.checksum) << fast_spare.output;
  EXPECT_EQ(fast_spare.losses, fast.losses);
}

TEST_F(ShardedTrainTest, LosingEveryCopyOfAShardStopsTheJobNamingItOrFallsToTheCheckpoint) {
  WriteSharded(2);
  RunResult ref = Run(4, "ref");
  ASSERT_EQ(ref.code, 0) << ref.output;
  // Ranks 1 and 3 are both holders of shard 1: with spares for both, the state of shard 1 is
  // nowhere once both are dead.
  const std::vector<std::string> both = {"--spares", "2", "--heartbeat-timeout-ms", "1000"};
  RunResult lost = KillBothHoldersOfShard1("lost", both);
  EXPECT_EQ(lost.code, 10) << lost.output;
  EXPECT_TRUE(std::regex_search(
      lost.output,
      std::regex(R"(every copy of shard 1 of the optimizer state of step \d+ is lost)")))
      << lost.output;
  EXPECT_EQ(lost.output.find("the controller (pid"), std::string::npos)
      << "it ended the job; it did not die";
  std::vector<std::string> rung = both;
  rung.insert(rung.end(), {"--checkpoint-dir", dir_ / "ckpt", "--checkpoint-every", "5"});
  RunResult restarted = KillBothHoldersOfShard1("rung", rung);
  ASSERT_EQ(restarted.code, 0) << restarted.output;
  EXPECT_NE(restarted.output.find("restarting every worker"), std::string::npos)
      << restarted.output;
  EXPECT_EQ(restarted.checksum, ref.checksum) << restarted.output;
}

// Replica agreement (docs/integrity.md): a bit flipped in one member's parameters, as a faulty
// memory cell would flip it. Checked before every step (K = 1) it is found at the next step's
// reduction, before any gradient computed from it is summed: the member copies the majority's
// state, and the run ends on the fault-free run's bits. Checked every 5 steps it is found within
// 5: the gradients the member computed meanwhile are in the sum (no rollback), so only the
// replicas' agreement is asserted then.
TEST_F(TrainTest, ABitFlippedInOneOfFourReplicasIsFoundAndRepairedFromTheMajority) {
  WriteRecipe();
  RunResult clean = Run(4, "clean");
  ASSERT_EQ(clean.code, 0) << clean.output;
  const std::vector<std::string> flags = {"--spares", "0", "--inject", "bitflip:rank=2,step=9"};
  RunResult every = Run(4, "k1", {"--replica-check-every", "1"}, flags);
  ASSERT_EQ(every.code, 0) << every.output;
  EXPECT_EQ(every.checksum, clean.checksum) << every.output;
  EXPECT_EQ(every.losses, clean.losses);
  auto faults = nonstop::testing::JournalEvents(dir_ / "k1.jsonl", "fault");
  ASSERT_EQ(faults.size(), 1u) << every.output;
  EXPECT_EQ(faults[0]["kind"], "state_diverged");
  EXPECT_EQ(faults[0]["rank"], 2);
  EXPECT_NE(faults[0]["detail"].get<std::string>().find("state_diverged at step 8"),
            std::string::npos)
      << faults[0].dump();
  // Every step with a check before it says what the check took (bench/integrity_cost.sh).
  int timed = 0;
  for (const auto& st : nonstop::testing::JournalEvents(dir_ / "k1.jsonl", "step"))
    timed += st.contains("replica_check_ms") && st["replica_check_ms"].get<double>() >= 0;
  EXPECT_GE(timed, static_cast<int>(every.losses.size()) - 3) << every.output;
  auto plans = nonstop::testing::JournalEvents(dir_ / "k1.jsonl", "plan");
  // (Once in CI, under load, a third plan came with no second fault: the recoveries say why.)
  std::string recoveries;
  for (const auto& r : nonstop::testing::JournalEvents(dir_ / "k1.jsonl", "recovery_start"))
    recoveries += r.dump() + "\n";
  ASSERT_EQ(plans.size(), 2u) << recoveries << every.output;
  EXPECT_EQ(plans[1]["resume_step"], 9);
  EXPECT_EQ(plans[1]["members"].size(), 4u) << "repaired in place, nobody replaced";

  RunResult sparse = Run(4, "k5", {"--replica-check-every", "5"},
                         {"--spares", "0", "--inject", "bitflip:rank=1,step=7"});
  ASSERT_EQ(sparse.code, 0) << sparse.output;  // the members' final checksums agree
  faults = nonstop::testing::JournalEvents(dir_ / "k5.jsonl", "fault");
  ASSERT_EQ(faults.size(), 1u) << sparse.output;
  EXPECT_EQ(faults[0]["rank"], 1);
  EXPECT_NE(faults[0]["detail"].get<std::string>().find("state_diverged at step 9"),
            std::string::npos)
      << "found at the first check after the flip (before step 10)\n"
      << faults[0].dump();
}

// A bit flipped on the wire in the all-reduce's last gather step (wireflip, docs/integrity.md).
// Checked collectives fetch the damaged piece again: no fault at all, the fault-free run's bits.
// Unchecked, the flip reaches one member's gradient only (rank 2, rank 1's right neighbour, keeps
// the piece), and the replica check before the next step finds that member and repairs it from the
// majority, which holds the right state: the fault-free bits again, after a recovery.
TEST_F(TrainTest, AByteFlippedOnTheWireIsFetchedAgainWhenCheckedAndFoundByTheReplicaCheckWhenNot) {
  WriteRecipe();
  RunResult clean = Run(4, "clean");
  ASSERT_EQ(clean.code, 0) << clean.output;
  const std::vector<std::string> flags = {"--spares", "0", "--inject", "wireflip:rank=1,step=9"};
  RunResult checked =
      Run(4, "checked", {"--checked-collectives", "--replica-check-every", "1"}, flags);
  ASSERT_EQ(checked.code, 0) << checked.output;
  EXPECT_EQ(checked.checksum, clean.checksum) << checked.output;
  EXPECT_EQ(checked.losses, clean.losses);
  EXPECT_NE(checked.output.find("fails its checksum"), std::string::npos) << checked.output;
  EXPECT_TRUE(nonstop::testing::JournalEvents(dir_ / "checked.jsonl", "fault").empty())
      << checked.output;
  EXPECT_EQ(nonstop::testing::JournalEvents(dir_ / "checked.jsonl", "plan").size(), 1u)
      << "no recovery: one generation";

  RunResult unchecked = Run(4, "unchecked", {"--replica-check-every", "1"}, flags);
  ASSERT_EQ(unchecked.code, 0) << unchecked.output;
  EXPECT_EQ(unchecked.checksum, clean.checksum) << unchecked.output;
  auto faults = nonstop::testing::JournalEvents(dir_ / "unchecked.jsonl", "fault");
  ASSERT_EQ(faults.size(), 1u) << unchecked.output;
  EXPECT_EQ(faults[0]["kind"], "state_diverged");
  EXPECT_EQ(faults[0]["rank"], 2);
  EXPECT_NE(faults[0]["detail"].get<std::string>().find("state_diverged at step 9"),
            std::string::npos)
      << faults[0].dump();
}

// Two replicas that disagree: nobody can tell which is right, so the job stops with exit 11
// naming the tensor and the step.
TEST_F(TrainTest, TwoReplicasThatDisagreeStopTheJobNamingTheTensorAndStep) {
  WriteRecipe();
  RunResult r = Run(
      2, "two", {"--replica-check-every", "1"},
      {"--spares", "0", "--inject", "bitflip:rank=1,step=5,tensor=adamw.exp_avg_sq.head.weight"});
  EXPECT_EQ(r.code, 11) << r.output;
  EXPECT_NE(r.output.find("the replicas of the state of step 4 disagree"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("'adamw.exp_avg_sq.head.weight': no majority"), std::string::npos)
      << r.output;
}

// Sharded optimizer state: a shard is compared across its replicas. With three (6 members in
// groups of 2) the odd one copies the shard back from the other two, and the run ends on the
// fault-free bits; with two (4 members) the job stops naming the shard.
TEST_F(ShardedTrainTest, AFlippedMomentIsFoundAmongTheShardsReplicas) {
  WriteSharded(2);
  RunResult ref = Run(4, "ref");  // world-invariant: the same bits at 6 ranks
  ASSERT_EQ(ref.code, 0) << ref.output;
  const std::vector<std::string> check = {"--replica-check-every", "1"};
  RunResult six = Run(6, "six", check,
                      {"--spares", "0", "--inject", "bitflip:rank=3,step=9,tensor=adamw.exp_avg"});
  ASSERT_EQ(six.code, 0) << six.output;
  EXPECT_EQ(six.checksum, ref.checksum) << six.output;
  auto faults = nonstop::testing::JournalEvents(dir_ / "six.jsonl", "fault");
  ASSERT_EQ(faults.size(), 1u) << six.output;
  EXPECT_EQ(faults[0]["kind"], "state_diverged");
  EXPECT_EQ(faults[0]["rank"], 3);
  EXPECT_NE(faults[0]["detail"].get<std::string>().find("'adamw.exp_avg' (shard 1) on rank 3"),
            std::string::npos)
      << faults[0].dump();

  RunResult four = Run(4, "four", check,
                       {"--spares", "0", "--inject", "bitflip:rank=1,step=9,tensor=adamw.exp_avg"});
  EXPECT_EQ(four.code, 11) << four.output;
  EXPECT_NE(four.output.find("'adamw.exp_avg' (shard 1): no majority"), std::string::npos)
      << four.output;
}

TEST_F(ShardedTrainTest, CheckpointsLoadAtAnyWorldAndWithoutSharding) {
  WriteSharded(2);
  std::string ckpt = dir_ / "ckpt";
  RunResult saved = Run(4, "saved", {"--checkpoint-dir", ckpt, "--checkpoint-every", "10"});
  ASSERT_EQ(saved.code, 0) << saved.output;
  namespace fs = std::filesystem;
  for (const char* newer : {"step-000000019", "step-000000020"}) fs::remove_all(ckpt + "/" + newer);
  ASSERT_TRUE(fs::exists(ckpt + "/step-000000009")) << saved.output;
  RunResult two = Run(2, "two", {"--resume", ckpt});
  ASSERT_EQ(two.code, 0) << two.output;
  EXPECT_EQ(two.losses.begin()->first, 10) << "it resumed at step 10";
  EXPECT_EQ(two.checksum, saved.checksum) << two.output;
  WriteSharded(1);  // the same checkpoint, an unsharded run of one rank
  RunResult one = Run(1, "one", {"--resume", ckpt});
  ASSERT_EQ(one.code, 0) << one.output;
  EXPECT_EQ(one.checksum, saved.checksum) << one.output;
}

TEST_F(ShardedTrainTest, AWorldOfPartGroupsIsRefusedNamingTheGroupSize) {
  WriteSharded(2);
  RunResult r = Run(3, "three");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("not groups of optimizer.shard_group 2"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace nonstop
