// nonstop-train: the reference trainer. Reads a recipe, prepares the data on
// first use, builds the model, joins the job through nonstop::Session and
// trains with data-parallel gradient allreduce over nonstop's collectives.
//
//   nonstop run --nproc 4 -- nonstop-train recipes/llama-tiny.yaml
//
// A Trainer reads like the job it runs: its set-up (recipe, data, model,
// state, resume, warm-up, join), then each step (compute this rank's
// micro-batches, reduce, update, checkpoint), and the recovery a failed
// collective leads to. Every set-up step returns the exit code that ends the
// program, or nothing to go on.
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "apps/train/model.h"
#include "apps/train/recipe.h"
#include "nonstop/check.h"
#include "nonstop/checkpoint.h"
#include "nonstop/data.h"
#include "nonstop/elastic.h"
#include "nonstop/exit_codes.h"
#include "nonstop/log.h"
#include "nonstop/ring.h"
#include "nonstop/session.h"
#include "nonstop/settings_cli.h"
#include "nonstop/state.h"
#include "nonstop/status.h"
#include "nonstop/tree.h"
#include "torch/adamw.h"
#include "torch/flat_parameters.h"
#include "torch/grad_buckets.h"
#include "torch/step_abort.h"

namespace nonstop::train {
namespace {

constexpr int kExitFailure = 10;

int Fail(const Status& s, const char* what) {
  fmt::print(stderr, "nonstop-train: {}: {}\n", what, s.ToString());
  return s.code() == StatusCode::kDataLoss          ? kExitDataCorruption
         : s.code() == StatusCode::kInvalidArgument ? 2
                                                    : kExitFailure;
}

void PrintConfig(const Recipe& r, const Session& s, size_t params, const data::Dataset& ds) {
  fmt::print("nonstop-train: recipe {}\n", r.name);
  auto row = [](const char* k, const std::string& v) { fmt::print("  {:<16} {}\n", k, v); };
  row("model",
      fmt::format("{} dim={} layers={} heads={} kv_heads={} ffn={}{}", r.model.arch, r.model.dim,
                  r.model.n_layers, r.model.n_heads, r.model.n_kv_heads, r.model.ffn_hidden,
                  r.model.arch == "gpt-oss"
                      ? fmt::format(" experts={} top_k={}", r.model.n_experts, r.model.top_k)
                      : ""));
  row("parameters", fmt::format("{} ({:.2f} MiB fp32)", params, params * 4.0 / (1 << 20)));
  row("data", fmt::format("{}: {} shards, {} tokens, {} samples of {}", r.data.shards,
                          ds.num_shards(), ds.num_tokens(), ds.num_samples(), r.model.seq_len + 1));
  row("batch", fmt::format("global {} = {} micro-batches of {} (tokens/step {})",
                           r.train.global_batch, r.train.global_batch / r.train.micro_batch,
                           r.train.micro_batch, r.train.global_batch * r.model.seq_len));
  row("world", fmt::format("{} ranks, generation {}", s.world_size(), s.generation()));
  row("determinism",
      r.train.determinism == "world-invariant"
          ? "world-invariant (a fixed reduction tree over the micro-batches; 1 intra-op thread)"
          : "fast (ring all-reduce; bitwise at a fixed world size)");
  row("steps", fmt::format("{} (lr {} → {}, warm-up {})", r.train.steps, r.optimizer.lr,
                           r.optimizer.min_lr, r.optimizer.warmup_steps));
  std::fflush(stdout);
}

// Sharded, fast: the sum of squares of this rank's shard of the reduced
// gradient, and the loss if the shard holds its slot (0 otherwise).
std::pair<double, double> ShardNormAndLoss(torchx::FlatParameters& flat, int shard,
                                           size_t shard_len) {
  const size_t lo = static_cast<size_t>(shard) * shard_len, hi = lo + shard_len;
  const std::span<const float> grads = flat.padded_grads();
  double sq = 0;
  for (size_t i = lo; i < std::min(hi, flat.size()); ++i)
    sq += static_cast<double>(grads[i]) * grads[i];
  double loss =
      lo <= flat.size() && flat.size() < hi ? static_cast<double>(grads[flat.size()]) : 0.0;
  return {sq, loss};
}

// Clipping by the global norm, on this rank's shard alone; returns the norm.
double ScaleShard(torchx::FlatParameters& flat, int shard, size_t shard_len, double norm,
                  double max_norm) {
  if (max_norm > 0 && norm > max_norm) {
    const size_t lo = static_cast<size_t>(shard) * shard_len;
    const size_t hi = std::min(lo + shard_len, flat.size());
    auto scale = static_cast<float>(max_norm / (norm + 1e-6));
    std::span<float> grads = flat.padded_grads();
    for (size_t i = lo; i < hi; ++i) grads[i] *= scale;
  }
  return norm;
}

// The command line (recipe overrides, checkpoints, and the test-only knobs).
// The flags with a NONSTOP_* fallback take their defaults from the settings
// registry (ParseFlags sets them from it).
struct TrainerFlags {
  std::string recipe_path;
  int64_t steps_override = settings::kTrainSteps.default_value;
  int64_t shard_group_override = settings::kShardGroup.default_value;
  bool print_recipe = false;
  int threads = settings::kTorchThreads.default_value;
  std::string checkpoint_dir, resume_dir;
  int64_t checkpoint_every = settings::kTrainCheckpointEvery.default_value;
  double mtbf_seconds = settings::kTrainMtbfSeconds.default_value;
  bool resume_env = settings::kResume.default_value;
  bool no_overlap = settings::kTrainNoOverlap.default_value;
  double bucket_mb = 1.0;
  bool no_salvage = settings::kTrainNoSalvage.default_value;
  bool no_loans = settings::kTrainNoLoans.default_value;
  int replica_check_every = settings::kReplicaCheckEvery.default_value;
  bool checked_collectives = settings::kCheckedCollectives.default_value;
  std::string log_samples;       // test-only
  int throttle_ms = 0;           // test-only
  int micro_batch_pause_ms = 0;  // test-only
};

// Parses the command line; an exit code when the program is done (--help, a usage error).
std::optional<int> ParseFlags(int argc, char** argv, TrainerFlags* f) {
  CLI::App app{"nonstop-train: reference trainer (Llama-style and GPT-OSS-style models)"};
  app.add_option("recipe", f->recipe_path, "Recipe YAML (default: the built-in llama-tiny)");
  using cli::AddSetting;
  AddSetting(&app, settings::kTrainCheckpointDir, f->checkpoint_dir);
  AddSetting(&app, settings::kTrainCheckpointEvery, f->checkpoint_every);
  AddSetting(&app, settings::kTrainMtbfSeconds, f->mtbf_seconds);
  app.add_option("--resume", f->resume_dir,
                 "Resume from the newest valid checkpoint in this directory");
  // Test-only knobs: accepted, but not in --help (a user's trainer has no use for them).
  app.add_option("--throttle-ms", f->throttle_ms,
                 "Sleep this long in every step (tests and demos that act during a run)")
      ->group("");
  app.add_option("--pause-after-micro-batch-ms", f->micro_batch_pause_ms,
                 "Sleep this long after every micro-batch (tests that cut a step between its "
                 "micro-batches)")
      ->group("");
  app.add_option("--log-samples", f->log_samples,
                 "Append the sample indices of every completed step to DIR/worker-<id>.txt (tests "
                 "check that no "
                 "sample is skipped or repeated)")
      ->group("");
  AddSetting(&app, settings::kResume, f->resume_env);
  AddSetting(&app, settings::kTrainSteps, f->steps_override);
  AddSetting(&app, settings::kShardGroup, f->shard_group_override);
  AddSetting(&app, settings::kTorchThreads, f->threads);
  app.add_flag("--print-recipe", f->print_recipe, "Print the built-in default recipe and exit");
  AddSetting(&app, settings::kTrainNoOverlap, f->no_overlap);
  app.add_option("--bucket-mb", f->bucket_mb,
                 "Gradient bucket size for the overlapped reduction (MB)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 1024.0));
  AddSetting(&app, settings::kTrainNoSalvage, f->no_salvage);
  AddSetting(&app, settings::kTrainNoLoans, f->no_loans);
  AddSetting(&app, settings::kReplicaCheckEvery, f->replica_check_every);
  AddSetting(&app, settings::kCheckedCollectives, f->checked_collectives);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (f->print_recipe) {
    fmt::print("{}", DefaultRecipeText());
    return 0;
  }
  return std::nullopt;
}

// One step's work on this rank, from computing its micro-batches to the reduction.
struct StepWork {
  double local_loss = 0;
  bool computed = false;  // every micro-batch of this rank's share is in
  float norm = 0;         // 1 / the tokens of the global batch
  double tokens = 0;      // of the global batch
  std::string samples;    // "step micro sample…" lines, logged once the step completed
  // planning the step failed (a fault in the exchange of the first step of a generation)
  Status plan_status;
  std::vector<collective::TreeShare> shares;    // ... every rank's part of this step
  std::vector<collective::TreeFolder> folders;  // ... this rank's runs of micro-batches, folded
  std::map<int, std::string> mb_samples;        // ... micro-batch → its samples-log lines
  // ring, the first step of a generation: micro-batches lent by their block's owner
  std::vector<worker::Loan> loans;                  // ... every member's (empty: none)
  std::vector<int> borrowed;                        // ... those this rank computes
  std::map<int, std::vector<std::byte>> for_owner;  // ... their gradients and losses, to send
};

class Trainer {
 public:
  explicit Trainer(TrainerFlags flags)
      : f_(std::move(flags)),
        planner_(/*salvage=*/!f_.no_salvage),
        ring_planner_(/*salvage=*/!f_.no_salvage, /*lend=*/!f_.no_loans) {}
  Trainer(const Trainer&) = delete;  // the state registry points into it
  Trainer& operator=(const Trainer&) = delete;

  int Run();

 private:
  // ---- set-up, in order
  std::optional<int> LoadRecipe();
  std::optional<int> OpenData();  // data first: a spare is warm only once its data is mapped
  std::optional<int> BuildModelAndOptimizer();
  std::optional<int> RegisterState();
  std::optional<int> ResumeFromCheckpoint();
  std::optional<int> RegisterShardedState();
  void WarmUp();
  std::optional<int> Join();
  std::optional<int> KeepResumedShard();
  std::optional<int> StartTraining();

  // ---- the steps
  int Train();
  // One step; ends the program (an exit code) or moves `step` on (done, or recovered).
  std::optional<int> Step(int64_t* step);
  // Plans this rank's micro-batches of `step` and computes them (forward, backward).
  std::optional<int> Compute(int64_t step, StepWork* w);
  std::vector<std::pair<uint64_t, size_t>> PlanWork(int64_t step, uint64_t micro_batches,
                                                    StepWork* w);
  // ---- salvage in the ring mode (docs/recovery.md "Salvage in the default mode")
  std::vector<std::pair<uint64_t, size_t>> PlanRingWork(int64_t step, int m, StepWork* w);
  // Picks up the sum this rank keeps of `step` (its share's `kept`), or starts a new one.
  void RestoreKeptSum(int64_t step, int m, const std::vector<int>& kept, StepWork* w);
  // Micro-batch `mb`'s backward completed: the sum holds it now (`staged`: its
  // buckets are being copied as the ring takes them).
  void KeepCompletedMicroBatch(int mb, bool staged, const StepWork& w);
  // The micro-batches this rank computes for their owners, each alone (RingShare::borrowed).
  void ComputeBorrowed(int64_t step, StepWork* w);
  // A step with loans: their gradients back to their owners, added in order, then the ring.
  Status ReduceWithLoans(int64_t step, StepWork* w);
  // Overlap: a bucket of the last micro-batch's sum, copied before the ring reduces it in place.
  void StageBucket(std::span<const float> bucket);
  Status Reduce(int64_t step, StepWork* w);
  Status ReduceRing(int64_t step, StepWork* w);
  Status ReduceTree(int64_t step, StepWork* w);
  // Sharded, fast: the group shares each shard's sum of squares and the loss; the norm (or -1).
  Status ShareShardNorm(double* shard_norm);
  // t0: when the step began (its time is taken once the update is done).
  std::optional<int> Update(int64_t step, const StepWork& w, double shard_norm,
                            std::chrono::steady_clock::time_point t0);
  void LogSamples(const std::string& lines);

  // ---- around the steps
  void RescaleForWorld(int64_t step);
  // the learning-rate multiplier in effect at `at` under the stored warm-up
  double LrFactor(int64_t at) const;
  std::pair<torch::Tensor, torch::Tensor> BatchTensors(const std::vector<uint64_t>& samples) const;
  // Micro-batch `mb` of `step`: its samples, its samples-log line, its loss (forward only).
  std::vector<uint64_t> SamplesOf(int64_t step, uint64_t mb);
  static std::string SamplesLine(int64_t step, uint64_t mb, const std::vector<uint64_t>& samples);
  torch::Tensor MicroBatchLoss(const std::vector<uint64_t>& samples, float norm);
  Status RegisterScalars(state::StateRegistry& reg);
  Status RegisterWhole(state::StateRegistry& reg, std::span<float> m, std::span<float> v);
  Result<std::unique_ptr<state::StateRegistry>> WholeRegistry();
  state::CheckpointSaveResult Save(const state::StateRegistry& reg, int64_t step, bool last);
  void MaybeCheckpoint(int64_t step, double step_seconds);
  void CheckpointGathered(int64_t step, bool last);
  // False while the timing checkpoint is still being written (nothing to do this step).
  bool TimeTheFirstCheckpoint(int64_t step, double step_seconds, bool last);
  // A collective failed: take part in the recovery and carry on from the step it names.
  // 0, kReleased (this worker leaves cleanly) or an exit code.
  static constexpr int kReleased = -1;
  int Recover(int64_t* step);
  // Recover, then drop the sums kept of a step the job does not resume at.
  std::optional<int> RecoverFromFault(int64_t* step);

  TrainerFlags f_;
  Recipe r_;
  bool world_invariant_ = false;
  std::unique_ptr<data::Dataset> dataset_;
  std::optional<data::Sampler> sampler_;
  std::shared_ptr<DecoderModel> model_;
  // Sharded optimizer state (docs/sharding.md): groups of G ranks, each rank
  // holding 1/G of the moments. The buffers are padded to a multiple of G, so
  // that every shard has the same size.
  int G_ = 1;
  bool sharded_ = false;
  std::optional<torchx::FlatParameters> flat_;
  size_t shard_len_ = 0;
  std::optional<torchx::AdamW> adamw_;
  torchx::LrSchedule schedule_;
  elastic::BatchMode batch_mode_{};
  elastic::LrScaling lr_scaling_{};
  bool scale_with_world_ = false;
  int64_t T_ = 0;  // tokens per sample (model.seq_len)
  double tokens_per_step_ = 0;
  float norm_ = 0;
  // What must survive a fault: parameters, optimizer moments, the step. The
  // data position follows from the step; the model has no other randomness.
  int64_t completed_ = -1;  // last completed step: part of the state
  // Elastic batch state (nonstop/elastic.h), kept with the model so
  // that joiners and resumed jobs carry on exactly: the world size the batch
  // was defined at, the samples consumed so far, and the learning-rate warm-up
  // after the last world change (the factor stored in millionths).
  int64_t base_world_ = 0, samples_consumed_ = 0, lr_world_ = 0, lr_change_step_ = 0,
          lr_from_millionths_ = 1'000'000;
  std::vector<std::vector<int64_t>> shapes_;  // of every parameter, for the checkpoints' tensors
  // Sharded: the whole moments, padded, while a resumed checkpoint's are
  // loaded (until this rank knows its shard) and while a checkpoint is gathered.
  std::vector<float> whole_m_, whole_v_;
  // sharded: the whole layout a checkpoint loads into
  std::unique_ptr<state::StateRegistry> loading_;
  bool resumed_whole_ = false;  // the moments are views of whole_m_, whole_v_
  state::StateRegistry state_;
  std::unique_ptr<Session> session_;
  // Durable checkpoints: whichever worker holds rank 0 writes them, in the
  // background. With no fixed interval, the first one is timed and the
  // interval set to the Young/Daly optimum sqrt(2 · cost · MTBF).
  std::unique_ptr<state::CheckpointWriter> writer_;
  int64_t every_ = 0;
  bool timing_in_flight_ = false;  // every_ == 0: the first checkpoint is being written and timed
  std::FILE* samples_log_ = nullptr;
  std::chrono::steady_clock::time_point run_start_;
  // World-invariant: the plan of each step (who computes which micro-batches),
  // and the partial sums of a step a fault cut short, kept for its retry.
  worker::TreeStepPlanner planner_;
  worker::HeldSums held_;
  // micro-batch → its samples-log lines, for the held sums
  std::map<int, std::string> held_samples_;
  // Overlapped reduction: the last micro-batch's backward hands each gradient
  // bucket to the session's communication thread as soon as it is complete.
  std::unique_ptr<torchx::GradBuckets> buckets_;
  // An abort stops the step inside forward (between layers) and backward (as
  // each gradient is accumulated), not only between micro-batches.
  std::unique_ptr<torchx::StepAbort> step_abort_;
  // Ring mode, not sharded: this rank's local sum of the micro-batches it
  // completed of the step in flight, kept apart from the gradient buffer (which
  // the next backward adds into, and the ring reduces in place), so that a
  // fault does not throw it away; offered to the next generation.
  struct KeptSum {
    int64_t step = -1;               // -1: none
    int m = 0;                       // the micro-batches of that step's global batch
    std::vector<int> micro_batches;  // in the sum, in the order summed
    double loss = 0;                 // their local loss
    std::string samples;             // their samples-log lines
    std::vector<float> sum;          // gradients and loss slot (FlatParameters::grads_and_loss)
  };
  KeptSum kept_;
  // Overlap: the sum with the step's last micro-batch, copied bucket by bucket
  // as the ring takes them; it becomes kept_ once every bucket is copied.
  KeptSum staged_;
  size_t staged_floats_ = 0;
  worker::RingStepPlanner ring_planner_;
};

// ---------------------------------------------------------------- set-up

int Trainer::Run() {
  for (auto step :
       {&Trainer::LoadRecipe, &Trainer::OpenData, &Trainer::BuildModelAndOptimizer,
        &Trainer::RegisterState, &Trainer::ResumeFromCheckpoint, &Trainer::RegisterShardedState}) {
    if (auto code = (this->*step)()) return *code;
  }
  fmt::print("worker pid {} built its model ({} parameters) and mapped its data\n", ::getpid(),
             flat_->size());
  std::fflush(stdout);
  WarmUp();
  for (auto step : {&Trainer::Join, &Trainer::KeepResumedShard, &Trainer::StartTraining}) {
    if (auto code = (this->*step)()) return *code;
  }
  return Train();
}

std::optional<int> Trainer::LoadRecipe() {
  Result<Recipe> recipe = f_.recipe_path.empty()
                              ? ParseRecipe(DefaultRecipeText(), "llama-tiny (built-in)")
                              : train::LoadRecipe(f_.recipe_path);
  if (!recipe.ok()) return Fail(recipe.status(), "bad recipe");
  r_ = std::move(*recipe);
  if (f_.steps_override > 0) r_.train.steps = f_.steps_override;
  if (f_.shard_group_override > 0) r_.optimizer.shard_group = f_.shard_group_override;
  if (!f_.checkpoint_dir.empty()) r_.checkpoint.dir = f_.checkpoint_dir;
  if (f_.checkpoint_every >= 0) r_.checkpoint.every = f_.checkpoint_every;
  if (f_.resume_env && f_.resume_dir.empty()) f_.resume_dir = r_.checkpoint.dir;
  world_invariant_ = r_.train.determinism == "world-invariant";
  if (world_invariant_ && f_.threads != 1) {
    // Kernels split over threads sum in another order: a micro-batch's gradient must not depend on
    // them.
    NONSTOP_LOG_WARNING(
        "determinism: world-invariant runs one intra-op thread (--torch-threads {} ignored)",
        f_.threads);
    f_.threads = 1;
  }
  torch::set_num_threads(f_.threads);
  return std::nullopt;
}

std::optional<int> Trainer::OpenData() {
  if (!r_.data.prepare_from.empty()) {
    data::PrepareOptions po{
        {r_.data.prepare_from}, r_.data.shards, 1 << 20, r_.data.strip_fortune_separators};
    auto prepared =
        data::PrepareIfMissing(po, [](const std::string& line) { NONSTOP_LOG_INFO("{}", line); });
    if (!prepared.ok()) return Fail(prepared.status(), "preparing data");
  }
  auto dataset = data::Dataset::Open(r_.data.shards, static_cast<size_t>(r_.model.seq_len));
  if (!dataset.ok()) return Fail(dataset.status(), "opening data");
  dataset_ = std::move(*dataset);
  if (dataset_->max_token() >= r_.model.vocab_size) {
    return Fail(InvalidArgumentError(fmt::format("data holds token {} but model.vocab_size is {}",
                                                 dataset_->max_token(), r_.model.vocab_size)),
                "bad recipe");
  }
  auto sampler = data::Sampler::Create(
      {dataset_->num_samples(), static_cast<uint64_t>(r_.train.seed),
       static_cast<uint64_t>(r_.train.global_batch), static_cast<uint64_t>(r_.train.micro_batch)});
  if (!sampler.ok()) return Fail(sampler.status(), "bad recipe");
  sampler_.emplace(std::move(*sampler));
  return std::nullopt;
}

std::optional<int> Trainer::BuildModelAndOptimizer() {
  model_ = BuildModel(r_.model, static_cast<uint64_t>(r_.train.seed));
  G_ = static_cast<int>(r_.optimizer.shard_group);
  sharded_ = G_ > 1;
  flat_.emplace(*model_, static_cast<size_t>(G_));
  shard_len_ = flat_->padded_size() / static_cast<size_t>(G_);
  adamw_.emplace(sharded_ ? shard_len_ : flat_->size(), flat_->segments(),
                 torchx::AdamWOptions{r_.optimizer.beta1, r_.optimizer.beta2, r_.optimizer.eps,
                                      r_.optimizer.weight_decay});
  schedule_ = {r_.optimizer.lr, r_.optimizer.min_lr, r_.optimizer.warmup_steps, r_.train.steps};
  auto batch_mode = elastic::ParseBatchMode(r_.train.batch);
  auto lr_scaling = elastic::ParseLrScaling(r_.train.lr_scaling);
  if (!batch_mode.ok()) return Fail(batch_mode.status(), "bad recipe");
  if (!lr_scaling.ok()) return Fail(lr_scaling.status(), "bad recipe");
  batch_mode_ = *batch_mode;
  lr_scaling_ = *lr_scaling;
  scale_with_world_ = batch_mode_ == elastic::BatchMode::kScaleWithWorld;
  T_ = r_.model.seq_len;
  tokens_per_step_ = static_cast<double>(r_.train.global_batch * T_);
  norm_ = 1.0f / static_cast<float>(tokens_per_step_);
  for (auto& item : model_->named_parameters()) shapes_.push_back(item.value().sizes().vec());
  return std::nullopt;
}

std::optional<int> Trainer::RegisterState() {
  if (sharded_ && !f_.resume_dir.empty()) {
    auto reg = WholeRegistry();
    if (!reg.ok()) return Fail(reg.status(), "registering state");
    loading_ = std::move(*reg);
  }
  if (!sharded_) {
    if (Status s = RegisterWhole(state_, adamw_->exp_avg(), adamw_->exp_avg_sq()); !s.ok()) {
      return Fail(s, "registering state");
    }
  }
  return std::nullopt;
}

std::optional<int> Trainer::ResumeFromCheckpoint() {
  if (f_.resume_dir.empty()) return std::nullopt;
  auto loaded = state::LoadNewestCheckpoint(f_.resume_dir, loading_ ? *loading_ : state_,
                                            {.loader = state::kTrainWriter});
  if (loaded.ok()) {
    for (const auto& skipped : loaded->skipped)
      NONSTOP_LOG_WARNING("skipped checkpoint {}", skipped);
    fmt::print("resumed from {} (step {}, parameter checksum {})\n", loaded->path, loaded->step,
               loaded->manifest.value("parameter_checksum", ""));
    if (loaded->by_name && scale_with_world_) {
      return Fail(FailedPreconditionError(fmt::format(
                      "{} was written by {}, which keeps no elastic.samples_consumed: a "
                      "scale-with-world run would read its data from the start again; resume it "
                      "with batch_mode fixed",
                      loaded->path, loaded->manifest.value("writer", ""))),
                  "resuming");
    }
    if (loaded->by_name) {
      // The Python package wrote it: its parameters may be in another order, so
      // each tensor's own CRC (checked) stands for the whole's checksum.
      fmt::print(
          "written by {}: loaded by name (parameters and AdamW moments), parameter checksum "
          "here {} (the writer's {}); kept this trainer's own {}; not loaded: {}\n",
          loaded->manifest.value("writer", ""), flat_->Checksum(),
          loaded->manifest.value("parameter_checksum", ""),
          loaded->kept.empty() ? "nothing" : fmt::format("{}", fmt::join(loaded->kept, ", ")),
          loaded->ignored.empty() ? "nothing"
                                  : fmt::format("{}", fmt::join(loaded->ignored, ", ")));
    } else if (flat_->Checksum() != loaded->manifest.value("parameter_checksum", "")) {
      return Fail(
          DataLossError(fmt::format(
              "checkpoint {}: the parameters do not match the manifest's checksum", loaded->path)),
          "resuming");
    }
  } else if (loaded.status().code() == StatusCode::kNotFound && f_.resume_env) {
    fmt::print("no checkpoint to resume from in {}: starting from scratch ({})\n", f_.resume_dir,
               loaded.status().message());
    loading_.reset();  // the moments are the optimizer's own (zeros), not views of whole ones
    std::vector<float>().swap(whole_m_);
    std::vector<float>().swap(whole_v_);
  } else {
    return Fail(loaded.status(), "resuming");
  }
  return std::nullopt;
}

// The parameters whole on every rank, the held shard of them part of the
// state; the moments of the shard alone: views of the whole moments a
// checkpoint loaded (every shard is there) until this rank knows its shard.
std::optional<int> Trainer::RegisterShardedState() {
  resumed_whole_ = sharded_ && loading_ != nullptr;
  if (!sharded_) return std::nullopt;
  Status s = state_.RegisterShardView("params", flat_->padded_params(), G_);
  if (s.ok() && loading_) s = state_.RegisterShardView("adamw.exp_avg", whole_m_, G_);
  if (s.ok() && loading_) s = state_.RegisterShardView("adamw.exp_avg_sq", whole_v_, G_);
  if (s.ok() && !loading_) s = state_.RegisterShard("adamw.exp_avg", adamw_->exp_avg(), G_);
  if (s.ok() && !loading_) s = state_.RegisterShard("adamw.exp_avg_sq", adamw_->exp_avg_sq(), G_);
  if (s.ok()) s = RegisterScalars(state_);
  if (!s.ok()) return Fail(s, "registering state");
  loading_.reset();
  return std::nullopt;
}

// One forward/backward on micro-batch 0 of step 0, so that the allocator, the
// kernels and the data pages are hot before this worker is needed (a spare's
// first real step is then as fast as anyone's). The gradients are discarded;
// parameters and optimizer state are untouched.
void Trainer::WarmUp() {
  auto [inputs, targets] = BatchTensors(sampler_->MicroBatchSamples(0, 0));
  auto logits = model_->forward(inputs);
  torch::nn::functional::cross_entropy(logits.view({-1, r_.model.vocab_size}), targets.view({-1}))
      .backward();
  flat_->GatherGrads();
  flat_->ZeroGrad();
}

std::optional<int> Trainer::Join() {
  auto options = SessionOptions::FromEnvironment();
  if (!options.ok()) return Fail(options.status(), "not under nonstop run");
  options->replica_check_every = f_.replica_check_every;
  options->checked_collectives = f_.checked_collectives;
  auto joined = Session::Join(*options, &state_, completed_);
  if (!joined.ok()) {
    if (joined.status().code() == StatusCode::kCancelled) return 0;  // a spare that was not needed
    return Fail(joined.status(), "joining the job");
  }
  session_ = std::move(*joined);
  return std::nullopt;
}

// This rank knows its shard now (the session bound it): it keeps that shard
// of the moments a checkpoint loaded, in the optimizer's own memory, and
// frees the rest.
std::optional<int> Trainer::KeepResumedShard() {
  if (!resumed_whole_) return std::nullopt;
  Status s = state_.AdoptShard("adamw.exp_avg", adamw_->exp_avg());
  if (s.ok()) s = state_.AdoptShard("adamw.exp_avg_sq", adamw_->exp_avg_sq());
  if (!s.ok()) return Fail(s, "resuming");
  std::vector<float>().swap(whole_m_);
  std::vector<float>().swap(whole_v_);
  return std::nullopt;
}

std::optional<int> Trainer::StartTraining() {
  Session& session = *session_;
  if (session.rank() == 0) {
    PrintConfig(r_, session, flat_->size(), *dataset_);
    const double moments = 2.0 * static_cast<double>(adamw_->exp_avg().size()) * sizeof(float);
    fmt::print("optimizer state: {} bytes per rank ({:.2f} MiB: AdamW moments{})\n",
               static_cast<uint64_t>(moments), moments / (1 << 20),
               sharded_ ? fmt::format(" of 1 shard in {}, over groups of {}; whole: {} bytes", G_,
                                      G_, 2 * flat_->size() * sizeof(float))
                        : ", whole");
    std::fflush(stdout);
  }
  // the first generation defines it, on every member
  if (base_world_ == 0) base_world_ = session.world_size();
  if (lr_world_ == 0) lr_world_ = base_world_;
  if (scale_with_world_ && r_.train.global_batch % (base_world_ * r_.train.micro_batch) != 0) {
    return Fail(InvalidArgumentError(fmt::format(
                    "train.batch scale-with-world: global_batch {} must be a multiple of "
                    "micro_batch {} × the initial world size {}",
                    r_.train.global_batch, r_.train.micro_batch, base_world_)),
                "bad recipe");
  }
  if (!r_.checkpoint.dir.empty()) {
    writer_ = std::make_unique<state::CheckpointWriter>(r_.checkpoint.dir,
                                                        static_cast<int>(r_.checkpoint.keep));
  }
  every_ = r_.checkpoint.every > 0 ? r_.checkpoint.every : (f_.mtbf_seconds > 0 ? 0 : 50);
  if (sharded_ && every_ == 0) {
    // The ranks of group 0 gather each checkpoint together: they must agree on when, which rank 0's
    // timing cannot say.
    NONSTOP_LOG_WARNING(
        "optimizer.shard_group {}: the automatic checkpoint interval is not supported yet; "
        "checkpointing every 50 steps (set checkpoint.every)",
        G_);
    every_ = 50;
  }
  if (!f_.log_samples.empty()) {
    std::filesystem::create_directories(f_.log_samples);
    samples_log_ = std::fopen(
        fmt::format("{}/worker-{}.txt", f_.log_samples, session.worker_id()).c_str(), "a");
  }
  run_start_ = std::chrono::steady_clock::now();
  if (!f_.no_overlap && !world_invariant_ && !sharded_) {
    buckets_ = std::make_unique<torchx::GradBuckets>(
        *model_, *flat_, static_cast<size_t>(f_.bucket_mb * (1 << 20)),
        [this, &session](std::span<float> b) {
          StageBucket(b);  // the local sum, before the ring reduces it in place
          session.StartAllReduce(b);
        });
  }
  step_abort_ =
      std::make_unique<torchx::StepAbort>(*model_, [&session] { return session.aborted(); });
  model_->set_between_layers([this] { step_abort_->Check(); });
  return std::nullopt;
}

// ---------------------------------------------------------------- the steps

int Trainer::Train() {
  Session& session = *session_;
  int64_t step = session.resume_step();
  while (true) {
    while (step < r_.train.steps) {
      if (auto code = Step(&step)) return *code;
    }
    if (sharded_) {
      // The last update is in each rank's shard: the parameters whole again, for the checksum.
      Status g =
          session.GatherShards(std::as_writable_bytes(flat_->padded_params()), sizeof(float));
      if (!g.ok()) {
        if (int code = Recover(&step); code != 0) return code == kReleased ? 0 : code;
        continue;
      }
    }
    std::string checksum = flat_->Checksum();
    if (writer_) {
      Status w = writer_->Wait();
      if (!w.ok()) NONSTOP_LOG_WARNING("the last checkpoint failed: {}", w.ToString());
    }
    Status fin = session.Finish(r_.train.steps - 1, checksum);
    if (fin.code() == StatusCode::kAborted) {  // a member failed at the very end
      if (int code = Recover(&step); code != 0) return code == kReleased ? 0 : code;
      continue;
    }
    if (!fin.ok()) return Fail(fin, "finishing");
    if (session.rank() == 0) {
      double total =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start_).count();
      fmt::print("done: {} steps in {:.1f} s; parameter checksum {}\n", r_.train.steps, total,
                 checksum);
      std::fflush(stdout);
    }
    return 0;
  }
}

std::optional<int> Trainer::Step(int64_t* step) {
  Session& session = *session_;
  auto t0 = std::chrono::steady_clock::now();
  // Stands for more compute: before the step, so the reduction is followed by the update at once.
  if (f_.throttle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(f_.throttle_ms));
  if (sharded_) {
    // Every rank updated its shard of the parameters last step: the group gathers them whole.
    Status g = session.GatherShards(std::as_writable_bytes(flat_->padded_params()), sizeof(float));
    if (!g.ok()) {
      NONSTOP_LOG_WARNING("step {}: {}", *step, g.ToString());
      return RecoverFromFault(step);
    }
  }
  StepWork w;
  w.norm = norm_;
  w.tokens = tokens_per_step_;
  if (auto code = Compute(*step, &w)) return code;
  Status s = Reduce(*step, &w);
  double shard_norm = -1;
  if (s.ok() && sharded_ && !world_invariant_) s = ShareShardNorm(&shard_norm);
  if (!s.ok()) {
    NONSTOP_LOG_WARNING("step {}: {}", *step, s.ToString());
    return RecoverFromFault(step);
  }
  if (auto code = Update(*step, w, shard_norm, t0)) return code;
  ++*step;
  return std::nullopt;
}

std::optional<int> Trainer::Compute(int64_t step, StepWork* w) {
  Session& session = *session_;
  try {
    if (session.InjectedExceptionAt(step))
      throw std::runtime_error(fmt::format("injected exception at step {}", step));
    flat_->ZeroGrad();
    RescaleForWorld(step);
    const int world = session.world_size();
    const uint64_t global =
        elastic::GlobalBatch(batch_mode_, static_cast<uint64_t>(r_.train.global_batch),
                             static_cast<int>(base_world_), world);
    const uint64_t micro = static_cast<uint64_t>(r_.train.micro_batch);
    w->norm = 1.0f / static_cast<float>(global * static_cast<uint64_t>(T_));
    w->tokens = static_cast<double>(global * static_cast<uint64_t>(T_));
    // (micro-batch, its run)
    std::vector<std::pair<uint64_t, size_t>> work = PlanWork(step, global / micro, w);
    // With loans, the sum is complete only once they are back: the buckets start after them.
    const bool overlap = buckets_ && w->loans.empty();
    for (size_t k = 0; k < work.size(); ++k) {
      const uint64_t mb = work[k].first;
      const bool last_one = k + 1 == work.size();
      std::vector<uint64_t> samples = SamplesOf(step, mb);
      if (samples_log_) {
        std::string line = SamplesLine(step, mb, samples);
        if (world_invariant_) {
          w->mb_samples[static_cast<int>(mb)] = line;
        } else {
          w->samples += line;
        }
      }
      torch::Tensor loss = MicroBatchLoss(samples, w->norm);
      if (world_invariant_) flat_->ZeroGrad();
      if (!world_invariant_) w->local_loss += loss.item<double>();
      if (overlap && last_one) {
        flat_->loss_slot() = static_cast<float>(w->local_loss);  // rides in bucket 0
        buckets_->Arm();
      }
      loss.backward();
      if (world_invariant_) {
        flat_->GatherGrads();
        flat_->loss_slot() = loss.item<float>();
        w->folders[work[k].second].Add(flat_->grads_and_loss());
      }
      KeepCompletedMicroBatch(static_cast<int>(mb), overlap && last_one, *w);
      w->computed = last_one;
      if (f_.micro_batch_pause_ms > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(f_.micro_batch_pause_ms));
      if (session.aborted()) break;  // a member failed: this step is lost (its sums may be kept)
    }
    // more ranks than micro-batches: zeros, summed with the rest
    if (work.empty()) w->computed = true;
    if (w->computed && !w->borrowed.empty()) ComputeBorrowed(step, w);
  } catch (const torchx::StepAborted&) {
    // The abort, seen inside a forward or backward (torchx::StepAbort): as the
    // break above, the step is cut short (w->computed is false); the buckets
    // the cut backward did not start never will be.
    if (buckets_) buckets_->Disarm();
    NONSTOP_LOG_INFO("step {}: stopped inside a forward or backward by the abort", step);
  } catch (const std::exception& e) {
    // The process may be in any state: report, and let a spare take over.
    Status s =
        InternalError(fmt::format("exception in the training loop at step {}: {}", step, e.what()));
    session.ReportFailure(s, step, kExitFailure);
    return Fail(s, "training");
  }
  return std::nullopt;
}

// This rank's micro-batches: its block of the global batch; world-invariant,
// the runs its share names (after a fault, the micro-batches nobody holds any
// more), each folded into the tree.
std::vector<std::pair<uint64_t, size_t>> Trainer::PlanWork(int64_t step, uint64_t micro_batches,
                                                           StepWork* w) {
  Session& session = *session_;
  const int world = session.world_size();
  std::vector<std::pair<uint64_t, size_t>> work;
  if (!world_invariant_ && !sharded_) return PlanRingWork(step, static_cast<int>(micro_batches), w);
  if (!world_invariant_) {  // sharded: no salvage (docs/recovery.md)
    for (uint64_t mb = data::BlockBegin(micro_batches, world, session.rank());
         mb < data::BlockBegin(micro_batches, world, session.rank() + 1); ++mb) {
      work.push_back({mb, 0});
    }
    return work;
  }
  const int m = static_cast<int>(micro_batches);
  auto planned = planner_.Plan(session, m, step, held_);
  if (!planned.ok()) {
    w->plan_status = planned.status();
    return work;
  }
  w->shares = std::move(*planned);
  const collective::TreeShare& mine = w->shares[static_cast<size_t>(session.rank())];
  worker::KeepOnly(&held_, step, mine.kept);  // the sums it does not keep go before computing
  for (auto [first, last] : mine.compute) {
    w->folders.emplace_back(m, first, last, flat_->size() + 1);
    for (int mb = first; mb < last; ++mb)
      work.push_back({static_cast<uint64_t>(mb), w->folders.size() - 1});
  }
  if (planner_.kept_micro_batches() > 0 && session.rank() == 0) {
    fmt::print(
        "step {}: kept the sums of {} of {} micro-batches from the step in flight ({} member(s)); "
        "{} computed again by {} member(s)\n",
        step, planner_.kept_micro_batches(), m, planner_.kept_by(),
        m - planner_.kept_micro_batches(), world);
    std::fflush(stdout);
  }
  return work;
}

std::vector<std::pair<uint64_t, size_t>> Trainer::PlanRingWork(int64_t step, int m, StepWork* w) {
  Session& session = *session_;
  std::vector<std::pair<uint64_t, size_t>> work;
  auto planned =
      ring_planner_.Plan(session, m, step, kept_.m == m ? kept_.step : -1, kept_.micro_batches);
  if (!planned.ok()) {
    w->plan_status = planned.status();
    return work;
  }
  const worker::RingShare& mine = (*planned)[static_cast<size_t>(session.rank())];
  RestoreKeptSum(step, m, mine.kept, w);
  for (int mb : mine.compute) work.push_back({static_cast<uint64_t>(mb), 0});
  w->borrowed = mine.borrowed;
  w->loans = worker::LoansOf(*planned);
  if (ring_planner_.kept_micro_batches() > 0 && session.rank() == 0) {
    fmt::print(
        "step {}: kept the sums of {} of {} micro-batches from the step in flight ({} member(s)); "
        "{} computed again by {} member(s), {} of them lent by the owner of their block\n",
        step, ring_planner_.kept_micro_batches(), m, ring_planner_.kept_by(),
        m - ring_planner_.kept_micro_batches(), ring_planner_.computing(), w->loans.size());
    std::fflush(stdout);
  }
  return work;
}

void Trainer::RestoreKeptSum(int64_t step, int m, const std::vector<int>& kept, StepWork* w) {
  staged_.step = -1;
  staged_floats_ = 0;
  if (kept.empty()) {
    kept_.step = f_.no_salvage ? -1 : step;  // salvage off: nothing is kept
    kept_.m = m;
    kept_.micro_batches.clear();
    kept_.loss = 0;
    kept_.samples.clear();
    return;
  }
  std::vector<int> held = kept_.micro_batches;
  std::sort(held.begin(), held.end());
  NONSTOP_CHECK(kept_.step == step && held == kept) << "kept a sum it does not hold";
  // Every gradient a view of the buffer, which then holds exactly what it held when the sum was
  // kept: the next backward adds into it as it would have, and the ring sums the same bits.
  flat_->GatherGrads();
  std::copy(kept_.sum.begin(), kept_.sum.end(), flat_->grads_and_loss().begin());
  w->local_loss = kept_.loss;
  w->samples = kept_.samples;
  flat_->loss_slot() = static_cast<float>(kept_.loss);  // sent as is if nothing is left to compute
}

void Trainer::KeepCompletedMicroBatch(int mb, bool staged, const StepWork& w) {
  if (kept_.step < 0) return;  // salvage off (or sharded, world-invariant: not this sum)
  KeptSum& into = staged ? staged_ : kept_;
  if (&into == &staged_) {  // its buckets were copied as the ring took them (StageBucket)
    staged_.step = kept_.step;
    staged_.m = kept_.m;
    staged_.micro_batches = kept_.micro_batches;
  } else {
    flat_->GatherGrads();
    std::span<const float> sum = flat_->grads_and_loss();
    into.sum.assign(sum.begin(), sum.end());
  }
  into.micro_batches.push_back(mb);
  into.loss = w.local_loss;
  into.samples = w.samples;
}

void Trainer::StageBucket(std::span<const float> bucket) {
  if (kept_.step < 0) return;
  std::span<float> all = flat_->grads_and_loss();
  staged_.sum.resize(all.size());
  std::copy(bucket.begin(), bucket.end(),
            staged_.sum.begin() + (bucket.data() - static_cast<const float*>(all.data())));
  staged_floats_ += bucket.size();
}

Status Trainer::Reduce(int64_t step, StepWork* w) {
  if (world_invariant_) return ReduceTree(step, w);
  if (!w->plan_status.ok()) return w->plan_status;
  Status s = ReduceRing(step, w);
  if (s.ok()) kept_.step = -1;  // the step is done: its sum is no use any more
  return s;
}

// Computed as the owner would, on the same parameters and samples, but from
// zero gradients: what its backward would have added to its sum.
void Trainer::ComputeBorrowed(int64_t step, StepWork* w) {
  w->computed = false;
  if (session_->aborted()) return;  // the step is lost: nothing to lend back
  flat_->GatherGrads();
  std::vector<float> own(flat_->grads_and_loss().begin(), flat_->grads_and_loss().end());
  const size_t bytes = flat_->grads().size_bytes();
  for (int mb : w->borrowed) {
    // From -0, not +0: -0 + g is g for every g (+0 + -0 would be +0), so the owner adds exactly
    // what its own backward would have accumulated. (The gradients are views of the buffer: the
    // GatherGrads above and at the end of each turn.)
    std::fill(flat_->grads().begin(), flat_->grads().end(), -0.0f);
    torch::Tensor loss = MicroBatchLoss(SamplesOf(step, static_cast<uint64_t>(mb)), w->norm);
    const double value = loss.item<double>();
    loss.backward();
    flat_->GatherGrads();
    std::vector<std::byte>& out = w->for_owner[mb];
    out.resize(bytes + sizeof value);
    std::memcpy(out.data(), flat_->grads().data(), bytes);
    std::memcpy(out.data() + bytes, &value, sizeof value);
    if (session_->aborted()) return;  // the step is lost
  }
  std::copy(own.begin(), own.end(), flat_->grads_and_loss().begin());
  w->computed = true;
}

Status Trainer::ReduceWithLoans(int64_t step, StepWork* w) {
  Session& session = *session_;
  if (!w->computed)
    return AbortedError(fmt::format("step {} was cut short: a member failed", step));
  flat_->GatherGrads();  // a gradient replaced since the last micro-batch: back into the buffer
  std::span<float> sum = flat_->grads();
  const size_t piece_bytes = sum.size_bytes() + sizeof(double);
  std::vector<std::byte> piece(piece_bytes);
  for (const worker::Loan& loan : w->loans) {  // in micro-batch order: each owner's in its order
    if (loan.borrower == session.rank()) {
      auto mine = w->for_owner.find(loan.micro_batch);
      NONSTOP_CHECK(mine != w->for_owner.end() && mine->second.size() == piece_bytes)
          << "micro-batch " << loan.micro_batch << " was lent to this rank but not computed";
      piece = std::move(mine->second);
    }
    Status s = session.Broadcast(piece, loan.borrower);
    if (!s.ok()) return s;
    if (loan.owner != session.rank()) continue;
    // As the owner's backward would have accumulated it: added to the sum, element by element.
    const auto* g = reinterpret_cast<const float*>(piece.data());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
    double loss = 0;
    std::memcpy(&loss, piece.data() + sum.size_bytes(), sizeof loss);
    w->local_loss += loss;
    const auto mb = static_cast<uint64_t>(loan.micro_batch);
    if (samples_log_) w->samples += SamplesLine(step, mb, SamplesOf(step, mb));
    KeepCompletedMicroBatch(loan.micro_batch, /*staged=*/false, *w);
  }
  flat_->loss_slot() = static_cast<float>(w->local_loss);
  if (!buckets_) return session.AllReduce(flat_->grads_and_loss());
  // Every bucket started in order, as after a step with no backward: the same pieces of the ring
  // as the overlapped backward's, the same bits. (Its copy for the kept sum goes unused: kept_
  // already holds the sum.)
  buckets_->Finish();
  return session.WaitAll();
}

Status Trainer::ReduceRing(int64_t step, StepWork* w) {
  Session& session = *session_;
  if (!w->loans.empty()) return ReduceWithLoans(step, w);
  if (buckets_) {
    if (w->computed) {
      buckets_->Finish();
      // every bucket was copied: the sum with the last micro-batch is the one kept now
      if (staged_.step == step && staged_floats_ == flat_->grads_and_loss().size())
        std::swap(kept_, staged_);
      return session.WaitAll();
    }
    (void)session.WaitAll();  // the buckets already started; the step is lost
    return AbortedError(fmt::format("step {} was cut short: a member failed", step));
  }
  flat_->GatherGrads();
  flat_->loss_slot() = static_cast<float>(w->local_loss);
  if (sharded_) {
    return w->computed ? session.ReduceShards(flat_->padded_grads())
                       : AbortedError(fmt::format("step {} was cut short: a member failed", step));
  }
  return session.AllReduce(flat_->grads_and_loss());
}

Status Trainer::ReduceTree(int64_t step, StepWork* w) {
  if (!w->plan_status.ok()) return w->plan_status;
  Session& session = *session_;
  const int m = static_cast<int>(r_.train.global_batch / r_.train.micro_batch);
  const collective::TreeShare& mine = w->shares[static_cast<size_t>(session.rank())];
  // KeepOnly left in `held_` exactly the sums the plan keeps; their samples-log lines come with
  // them.
  NONSTOP_CHECK(held_.nodes == mine.kept) << "kept a sum it does not hold";
  for (const auto& node : held_.nodes) {
    auto [first, last] = collective::NodeRange(m, node);
    for (int mb = first; mb < last; ++mb) {
      if (auto l = held_samples_.find(mb); l != held_samples_.end()) w->mb_samples[mb] = l->second;
    }
  }
  worker::HeldSums have = worker::CollectSums(m, step, std::move(held_), &w->folders);
  held_ = {};
  held_samples_.clear();
  Status s;
  if (w->computed) {
    NONSTOP_CHECK(have.nodes == mine.nodes) << "the step's sums are not the plan's";
    s = session.AllReduceTree(m, worker::NodeLists(w->shares), have.partials,
                              flat_->grads_and_loss());
  } else {
    s = AbortedError(fmt::format("step {} was cut short: a member failed", step));
  }
  if (s.ok()) {
    for (const auto& [mb, line] : w->mb_samples) w->samples += line;
  } else if (!f_.no_salvage) {
    // Kept for the step's retry in the next generation (TreeStepPlanner offers them).
    held_ = std::move(have);
    held_samples_ = std::move(w->mb_samples);
  }
  return s;
}

// Sharded, fast: the world's gradient is in this rank's shard alone. The group
// shares each shard's sum of squares (the norm, summed in shard order) and the
// loss, which rides in the shard holding its slot.
Status Trainer::ShareShardNorm(double* shard_norm) {
  Session& session = *session_;
  auto [sq, loss_part] = ShardNormAndLoss(*flat_, session.shard(), shard_len_);
  std::vector<double> records(2 * static_cast<size_t>(G_));
  records[2 * static_cast<size_t>(session.shard())] = sq;
  records[2 * static_cast<size_t>(session.shard()) + 1] = loss_part;
  Status s = session.GatherShards(std::as_writable_bytes(std::span(records)), 2 * sizeof(double));
  if (!s.ok()) return s;
  double total = 0, world_loss = 0;
  for (int q = 0; q < G_; ++q) {
    total += records[2 * static_cast<size_t>(q)];
    world_loss += records[2 * static_cast<size_t>(q) + 1];
  }
  *shard_norm = std::sqrt(total);
  flat_->loss_slot() = static_cast<float>(world_loss);
  return OkStatus();
}

std::optional<int> Trainer::Update(int64_t step, const StepWork& w, double shard_norm,
                                   std::chrono::steady_clock::time_point t0) {
  Session& session = *session_;
  double loss = flat_->loss_slot();
  if (!std::isfinite(loss)) {
    Status bad = DataLossError(fmt::format("loss is {} at step {}", loss, step));
    session.ReportFailure(bad, step, kExitDataCorruption);
    return Fail(bad, "training diverged");
  }
  double grad_norm = shard_norm >= 0 ? ScaleShard(*flat_, session.shard(), shard_len_, shard_norm,
                                                  r_.optimizer.grad_clip)
                                     : torchx::ClipGradNorm(flat_->grads(), r_.optimizer.grad_clip);
  double lr = schedule_.At(step) * LrFactor(step);
  if (sharded_) {
    // The shard's update: the same arithmetic, element by element, as the whole update has there.
    NONSTOP_CHECK_EQ(state_.held_shard(), session.shard())
        << "the state holds the shard of another rank";
    adamw_->Step(flat_->padded_params(), flat_->padded_grads(), lr, step + 1,
                 static_cast<size_t>(session.shard()) * shard_len_);
  } else {
    adamw_->Step(flat_->params(), flat_->grads(), lr, step + 1);
  }
  completed_ = step;
  if (scale_with_world_) samples_consumed_ += static_cast<int64_t>(w.tokens) / T_;
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  session.ReportStep({step, loss, secs, w.tokens / secs, r_.train.steps});
  MaybeCheckpoint(step, secs);
  LogSamples(w.samples);
  if (session.rank() == 0 && (step % r_.train.log_every == 0 || step + 1 == r_.train.steps)) {
    fmt::print(
        "step {:>5}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:>6.0f} tok/s | {:.3f} "
        "s/step | world {}\n",
        step, r_.train.steps, loss, lr, grad_norm, w.tokens / secs, secs, session.world_size());
    std::fflush(stdout);
  }
  return std::nullopt;
}

void Trainer::LogSamples(const std::string& lines) {
  if (!samples_log_) return;
  std::fputs(lines.c_str(), samples_log_);
  std::fflush(samples_log_);
}

// ---------------------------------------------------------------- around the steps

// The world changed with a batch that follows it: warm the learning rate from
// where it is to the new factor.
void Trainer::RescaleForWorld(int64_t step) {
  const int world = session_->world_size();
  if (!scale_with_world_ || world == lr_world_) return;
  double from = LrFactor(step);
  lr_from_millionths_ = std::llround(from * 1e6);
  lr_change_step_ = step;
  lr_world_ = world;
  if (session_->rank() == 0) {
    fmt::print(
        "batch follows the world: global batch {} samples, learning-rate factor {:.3f} → {:.3f} "
        "over {} steps\n",
        elastic::GlobalBatch(batch_mode_, static_cast<uint64_t>(r_.train.global_batch),
                             static_cast<int>(base_world_), world),
        from, LrFactor(step + r_.train.rescale_warmup_steps), r_.train.rescale_warmup_steps);
    std::fflush(stdout);
  }
}

double Trainer::LrFactor(int64_t at) const {
  double to = elastic::LrFactor(batch_mode_, lr_scaling_, static_cast<int>(base_world_),
                                static_cast<int>(lr_world_));
  return elastic::WarmedFactor(static_cast<double>(lr_from_millionths_) / 1e6, to, at,
                               lr_change_step_, r_.train.rescale_warmup_steps);
}

// Fixed batch: the samples are a function of the step. Scaled batch: of the position in the
// stream.
std::vector<uint64_t> Trainer::SamplesOf(int64_t step, uint64_t mb) {
  const auto micro = static_cast<uint64_t>(r_.train.micro_batch);
  return scale_with_world_
             ? sampler_->SamplesAt(static_cast<uint64_t>(samples_consumed_) + mb * micro, micro)
             : sampler_->MicroBatchSamples(static_cast<uint64_t>(step), mb);
}

std::string Trainer::SamplesLine(int64_t step, uint64_t mb, const std::vector<uint64_t>& samples) {
  std::string line = fmt::format("{} {}", step, mb);
  for (uint64_t x : samples) line += fmt::format(" {}", x);
  return line + '\n';
}

torch::Tensor Trainer::MicroBatchLoss(const std::vector<uint64_t>& samples, float norm) {
  auto [inputs, targets] = BatchTensors(samples);
  auto logits = model_->forward(inputs);
  // Normalised by the token count of the whole global batch: the summed
  // gradient is the same however micro-batches are dealt.
  return torch::nn::functional::cross_entropy(
             logits.view({-1, r_.model.vocab_size}), targets.view({-1}),
             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) *
         norm;
}

std::pair<torch::Tensor, torch::Tensor> Trainer::BatchTensors(
    const std::vector<uint64_t>& samples) const {
  auto t = torch::empty({static_cast<int64_t>(samples.size()), T_ + 1}, torch::kLong);
  auto acc = t.accessor<int64_t, 2>();
  for (size_t i = 0; i < samples.size(); ++i) {
    auto tokens = dataset_->Sample(samples[i]);
    for (int64_t j = 0; j <= T_; ++j)
      acc[static_cast<int64_t>(i)][j] = tokens[static_cast<size_t>(j)];
  }
  using torch::indexing::Slice;
  return std::make_pair(t.index({Slice(), Slice(0, T_)}),
                        t.index({Slice(), Slice(1, T_ + 1)}).contiguous());
}

Status Trainer::RegisterScalars(state::StateRegistry& reg) {
  const std::vector<std::pair<const char*, int64_t*>> scalars = {
      {"step", &completed_},
      {"elastic.base_world", &base_world_},
      {"elastic.samples_consumed", &samples_consumed_},
      {"elastic.lr_world", &lr_world_},
      {"elastic.lr_change_step", &lr_change_step_},
      {"elastic.lr_from_millionths", &lr_from_millionths_}};
  for (auto [name, value] : scalars) NONSTOP_RETURN_IF_ERROR(reg.RegisterValue(name, value));
  return OkStatus();
}

// The whole state, one region per tensor with its shape, so that a durable
// checkpoint is a safetensors file any tool can read tensor by tensor. It is
// the state itself when nothing is sharded, and what a sharded run's
// checkpoints hold (the moments gathered whole): any world and any G load them.
Status Trainer::RegisterWhole(state::StateRegistry& reg, std::span<float> m, std::span<float> v) {
  std::vector<std::pair<std::string, std::span<float>>> groups = {
      {"", flat_->params()}, {"adamw.exp_avg.", m}, {"adamw.exp_avg_sq.", v}};
  for (const auto& [prefix, buffer] : groups) {
    for (size_t i = 0; i < flat_->segments().size(); ++i) {
      const auto& seg = flat_->segments()[i];
      NONSTOP_RETURN_IF_ERROR(
          reg.RegisterFloats(prefix + seg.name, buffer.subspan(seg.offset, seg.size), shapes_[i]));
    }
  }
  return RegisterScalars(reg);
}

Result<std::unique_ptr<state::StateRegistry>> Trainer::WholeRegistry() {
  whole_m_.assign(flat_->padded_size(), 0.0f);
  whole_v_.assign(flat_->padded_size(), 0.0f);
  auto reg = std::make_unique<state::StateRegistry>();
  NONSTOP_RETURN_IF_ERROR(RegisterWhole(*reg, std::span(whole_m_).first(flat_->size()),
                                        std::span(whole_v_).first(flat_->size())));
  return reg;
}

// Rank 0 hands the state of `step` (`reg`: the whole layout) to the writer.
state::CheckpointSaveResult Trainer::Save(const state::StateRegistry& reg, int64_t step,
                                          bool last) {
  state::CheckpointMeta meta{step,    session_->generation(), session_->world_size(),
                             r_.name, flat_->Checksum(),      {}};
  state::CheckpointSaveResult saved = writer_->TrySave(reg, meta);
  if (saved.skipped && last) {
    // The final state must reach the disk: the job is ending, waiting is free.
    (void)writer_->Wait();
    saved = writer_->TrySave(reg, meta);
  }
  if (!saved.earlier.ok())
    NONSTOP_LOG_WARNING("an earlier checkpoint failed: {}", saved.earlier.ToString());
  return saved;
}

void Trainer::MaybeCheckpoint(int64_t step, double step_seconds) {
  if (!writer_) return;
  bool last = step + 1 == r_.train.steps;
  if (sharded_) {
    CheckpointGathered(step, last);
    return;
  }
  if (session_->rank() != 0) return;
  if (every_ == 0 && timing_in_flight_ && !TimeTheFirstCheckpoint(step, step_seconds, last)) return;
  bool due = every_ == 0 || (step + 1) % every_ == 0 || last;
  if (!due) return;
  if (!Save(state_, step, last).skipped && every_ == 0) timing_in_flight_ = true;
}

// Sharded: gathered to the writer. Group 0 holds every shard once; its ranks
// gather the parameters and the moments whole, and rank 0 writes them in the
// layout of an unsharded run.
void Trainer::CheckpointGathered(int64_t step, bool last) {
  if (session_->rank() >= G_ || !(every_ > 0 && ((step + 1) % every_ == 0 || last))) return;
  auto whole = WholeRegistry();
  const auto at = static_cast<std::ptrdiff_t>(static_cast<size_t>(session_->shard()) * shard_len_);
  std::copy_n(adamw_->exp_avg().begin(), shard_len_, whole_m_.begin() + at);
  std::copy_n(adamw_->exp_avg_sq().begin(), shard_len_, whole_v_.begin() + at);
  Status s = whole.status();
  if (s.ok())
    s = session_->GatherShards(std::as_writable_bytes(flat_->padded_params()), sizeof(float));
  if (s.ok())
    s = session_->GatherShards(std::as_writable_bytes(std::span(whole_m_)), sizeof(float));
  if (s.ok())
    s = session_->GatherShards(std::as_writable_bytes(std::span(whole_v_)), sizeof(float));
  if (s.ok() && session_->rank() == 0) Save(**whole, step, last);
  if (!s.ok()) NONSTOP_LOG_WARNING("checkpoint of step {} not gathered: {}", step, s.ToString());
  std::vector<float>().swap(whole_m_);
  std::vector<float>().swap(whole_v_);
}

// The timing checkpoint is written in the background: rank 0 never waits for
// the disk while the others wait in the next collective. Once it is written,
// the interval is set from its cost.
bool Trainer::TimeTheFirstCheckpoint(int64_t step, double step_seconds, bool last) {
  auto st = writer_->last_written();
  if (!st && writer_->in_flight() && !last) return false;  // still being written
  if (!st && last) (void)writer_->Wait();
  st = writer_->last_written();
  if (!st) {
    NONSTOP_LOG_WARNING("the timing checkpoint failed; checkpointing every 50 steps instead");
    every_ = 50;
    timing_in_flight_ = false;
  }
  double cost = st ? st->snapshot_seconds + st->write_seconds : 0;
  double optimum = std::sqrt(2.0 * cost * f_.mtbf_seconds);
  if (st) {
    every_ = std::max<int64_t>(
        1, static_cast<int64_t>(std::llround(optimum / std::max(step_seconds, 1e-6))));
    fmt::print(
        "checkpoint interval: {} steps (Young/Daly: sqrt(2 × cost {:.3f} s × MTBF {:.1f} s) = "
        "{:.2f} s; "
        "a step takes {:.3f} s)\n",
        every_, cost, f_.mtbf_seconds, optimum, step_seconds);
  }
  std::fflush(stdout);
  return true;
}

int Trainer::Recover(int64_t* step) {
  Session& session = *session_;
  auto next = session.Recover();
  if (!next.ok()) {
    if (session.shutdown_exit_code() != 0) return session.shutdown_exit_code();
    if (next.status().code() == StatusCode::kCancelled) {
      fmt::print("worker {} released: {}\n", session.worker_id(), next.status().message());
      std::fflush(stdout);
      return kReleased;  // the world shrank without this worker: a clean exit
    }
    Fail(next.status(), "recovery");
    return kExitFailure;
  }
  *step = *next;
  MembershipChange c = session.last_change();
  if (session.rank() == 0) {
    fmt::print("{}: generation {}, world {} → {}, resuming at step {}\n",
               c.reason.rfind("resize", 0) == 0 ? "resized" : "recovered", c.generation,
               c.old_world, c.new_world, *step);
    std::fflush(stdout);
  }
  return 0;
}

std::optional<int> Trainer::RecoverFromFault(int64_t* step) {
  if (int code = Recover(step); code != 0) return code == kReleased ? 0 : code;
  // The job resumes elsewhere, or this member's state was copied in (it diverged, or was behind):
  // the sums it kept of that step are no use, or were computed from another state.
  if (held_.step != *step || session_->last_change().state_copied) {
    held_ = {};
    held_samples_.clear();
  }
  // the same for the ring mode's kept sum
  if (kept_.step != *step || session_->last_change().state_copied) kept_.step = -1;
  return std::nullopt;
}

int Main(int argc, char** argv) {
  TrainerFlags flags;
  if (auto code = ParseFlags(argc, argv, &flags)) return *code;
  Trainer trainer(std::move(flags));
  return trainer.Run();
}

}  // namespace
}  // namespace nonstop::train

int main(int argc, char** argv) { return nonstop::train::Main(argc, argv); }
