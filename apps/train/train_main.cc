// nonstop-train: the reference trainer. Reads a recipe, prepares the data on
// first use, builds the model, joins the job through nonstop::Session and
// trains with data-parallel gradient allreduce over nonstop's collectives.
//
//   nonstop run --nproc 4 -- nonstop-train recipes/llama-tiny.yaml
#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "apps/train/model.h"
#include "apps/train/recipe.h"
#include "collective/tree_reduce.h"
#include "common/logging.h"
#include "data/dataset.h"
#include "data/prepare.h"
#include "data/sampler.h"
#include "elastic/batch_policy.h"
#include "nonstop/session.h"
#include "state/checkpoint.h"
#include "torch/adamw.h"
#include "torch/flat_parameters.h"
#include "torch/grad_buckets.h"
#include "worker/tree_step.h"

namespace nonstop::train {
namespace {

constexpr int kExitFailure = 10;
constexpr int kExitDataCorruption = 11;

int Fail(const Status& s, const char* what) {
  fmt::print(stderr, "nonstop-train: {}: {}\n", what, s.ToString());
  return s.code() == StatusCode::kDataLoss ? kExitDataCorruption
                                           : s.code() == StatusCode::kInvalidArgument ? 2 : kExitFailure;
}

void PrintConfig(const Recipe& r, const Session& s, size_t params, const data::Dataset& ds) {
  fmt::print("nonstop-train: recipe {}\n", r.name);
  auto row = [](const char* k, const std::string& v) { fmt::print("  {:<16} {}\n", k, v); };
  row("model", fmt::format("{} dim={} layers={} heads={} kv_heads={} ffn={}{}", r.model.arch, r.model.dim,
                           r.model.n_layers, r.model.n_heads, r.model.n_kv_heads, r.model.ffn_hidden,
                           r.model.arch == "gpt-oss" ? fmt::format(" experts={} top_k={}", r.model.n_experts, r.model.top_k) : ""));
  row("parameters", fmt::format("{} ({:.2f} MiB fp32)", params, params * 4.0 / (1 << 20)));
  row("data", fmt::format("{}: {} shards, {} tokens, {} samples of {}", r.data.shards, ds.num_shards(), ds.num_tokens(),
                          ds.num_samples(), r.model.seq_len + 1));
  row("batch", fmt::format("global {} = {} micro-batches of {} (tokens/step {})", r.train.global_batch,
                           r.train.global_batch / r.train.micro_batch, r.train.micro_batch,
                           r.train.global_batch * r.model.seq_len));
  row("world", fmt::format("{} ranks, generation {}", s.world_size(), s.generation()));
  row("determinism", r.train.determinism == "world-invariant"
                         ? "world-invariant (a fixed reduction tree over the micro-batches; 1 intra-op thread)"
                         : "fast (ring all-reduce; bitwise at a fixed world size)");
  row("steps", fmt::format("{} (lr {} → {}, warm-up {})", r.train.steps, r.optimizer.lr, r.optimizer.min_lr,
                           r.optimizer.warmup_steps));
  std::fflush(stdout);
}

// Sharded, fast: the sum of squares of this rank's shard of the reduced
// gradient, and the loss if the shard holds its slot (0 otherwise).
std::pair<double, double> ShardNormAndLoss(torchx::FlatParameters& flat, int shard, size_t shard_len) {
  const size_t lo = static_cast<size_t>(shard) * shard_len, hi = lo + shard_len;
  const std::span<const float> grads = flat.padded_grads();
  double sq = 0;
  for (size_t i = lo; i < std::min(hi, flat.size()); ++i) sq += static_cast<double>(grads[i]) * grads[i];
  double loss = lo <= flat.size() && flat.size() < hi ? static_cast<double>(grads[flat.size()]) : 0.0;
  return {sq, loss};
}

// Clipping by the global norm, on this rank's shard alone; returns the norm.
double ScaleShard(torchx::FlatParameters& flat, int shard, size_t shard_len, double norm, double max_norm) {
  if (max_norm > 0 && norm > max_norm) {
    const size_t lo = static_cast<size_t>(shard) * shard_len;
    const size_t hi = std::min(lo + shard_len, flat.size());
    auto scale = static_cast<float>(max_norm / (norm + 1e-6));
    std::span<float> grads = flat.padded_grads();
    for (size_t i = lo; i < hi; ++i) grads[i] *= scale;
  }
  return norm;
}

int Main(int argc, char** argv) {
  CLI::App app{"nonstop-train: reference trainer (Llama-style and GPT-OSS-style models)"};
  std::string recipe_path;
  int64_t steps_override = 0;
  bool print_recipe = false;
  int threads = 1;
  std::string checkpoint_dir, resume_dir;
  int64_t checkpoint_every = -1;
  double mtbf_seconds = 0;
  bool resume_env = false;
  app.add_option("recipe", recipe_path, "Recipe YAML (default: the built-in llama-tiny)");
  app.add_option("--checkpoint-dir", checkpoint_dir, "Write durable checkpoints here (overrides checkpoint.dir)")
      ->envname("NONSTOP_CHECKPOINT_DIR");
  app.add_option("--checkpoint-every", checkpoint_every, "Steps between checkpoints (0: Young/Daly from --mtbf)")
      ->envname("NONSTOP_CHECKPOINT_EVERY");
  app.add_option("--mtbf", mtbf_seconds, "Mean time between failures, for the automatic checkpoint interval (s)")
      ->envname("NONSTOP_MTBF_SECONDS");
  app.add_option("--resume", resume_dir, "Resume from the newest valid checkpoint in this directory");
  std::string log_samples;
  int throttle_ms = 0;
  app.add_option("--throttle-ms", throttle_ms, "Sleep this long in every step (tests and demos that act during a run)");
  app.add_option("--log-samples", log_samples,
                 "Append the sample indices of every completed step to DIR/worker-<id>.txt (tests check that no "
                 "sample is skipped or repeated)");
  app.add_flag("--resume-from-checkpoint-dir", resume_env,
               "Resume from the newest checkpoint in the checkpoint directory, if there is one (set by nonstop run "
               "when it restarts workers)")
      ->envname("NONSTOP_RESUME");
  app.add_option("--steps", steps_override, "Override train.steps")->envname("NONSTOP_TRAIN_STEPS");
  int64_t shard_group_override = 0;
  app.add_option("--shard-group", shard_group_override, "Override optimizer.shard_group (1: no sharding)")
      ->envname("NONSTOP_SHARD_GROUP")->check(CLI::Range(1, 1024));
  app.add_option("--torch-threads", threads, "Intra-op threads per worker")->capture_default_str()
      ->envname("NONSTOP_TORCH_THREADS");
  app.add_flag("--print-recipe", print_recipe, "Print the built-in default recipe and exit");
  bool no_overlap = false;
  double bucket_mb = 1.0;
  app.add_flag("--no-overlap", no_overlap,
               "Reduce the gradient in one all-reduce after backward, instead of in buckets while it runs")
      ->envname("NONSTOP_TRAIN_NO_OVERLAP");
  app.add_option("--bucket-mb", bucket_mb, "Gradient bucket size for the overlapped reduction (MB)")
      ->capture_default_str()->check(CLI::Range(0.001, 1024.0));
  bool no_salvage = false;
  app.add_flag("--no-salvage", no_salvage,
               "determinism: world-invariant: after a fault compute the whole step in flight again, instead of "
               "keeping the micro-batch sums the members already hold")
      ->envname("NONSTOP_TRAIN_NO_SALVAGE");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (print_recipe) {
    fmt::print("{}", DefaultRecipeText());
    return 0;
  }
  Result<Recipe> recipe = recipe_path.empty() ? ParseRecipe(DefaultRecipeText(), "llama-tiny (built-in)")
                                              : LoadRecipe(recipe_path);
  if (!recipe.ok()) return Fail(recipe.status(), "bad recipe");
  Recipe& r = *recipe;
  if (steps_override > 0) r.train.steps = steps_override;
  if (shard_group_override > 0) r.optimizer.shard_group = shard_group_override;
  if (!checkpoint_dir.empty()) r.checkpoint.dir = checkpoint_dir;
  if (checkpoint_every >= 0) r.checkpoint.every = checkpoint_every;
  if (resume_env && resume_dir.empty()) resume_dir = r.checkpoint.dir;
  const bool world_invariant = r.train.determinism == "world-invariant";
  if (world_invariant && threads != 1) {
    // Kernels split over threads sum in another order: a micro-batch's gradient must not depend on them.
    NONSTOP_LOG_WARNING("determinism: world-invariant runs one intra-op thread (--torch-threads {} ignored)", threads);
    threads = 1;
  }
  torch::set_num_threads(threads);

  // Data first: a spare is warm only once its data is mapped.
  if (!r.data.prepare_from.empty()) {
    data::PrepareOptions po{{r.data.prepare_from}, r.data.shards, 1 << 20, r.data.strip_fortune_separators};
    auto prepared = data::PrepareIfMissing(po, [](const std::string& line) { NONSTOP_LOG_INFO("{}", line); });
    if (!prepared.ok()) return Fail(prepared.status(), "preparing data");
  }
  auto dataset = data::Dataset::Open(r.data.shards, static_cast<size_t>(r.model.seq_len));
  if (!dataset.ok()) return Fail(dataset.status(), "opening data");
  if ((*dataset)->max_token() >= r.model.vocab_size) {
    return Fail(InvalidArgumentError(fmt::format("data holds token {} but model.vocab_size is {}", (*dataset)->max_token(),
                                                 r.model.vocab_size)), "bad recipe");
  }
  auto sampler = data::Sampler::Create({(*dataset)->num_samples(), static_cast<uint64_t>(r.train.seed),
                                        static_cast<uint64_t>(r.train.global_batch), static_cast<uint64_t>(r.train.micro_batch)});
  if (!sampler.ok()) return Fail(sampler.status(), "bad recipe");

  auto model = BuildModel(r.model, static_cast<uint64_t>(r.train.seed));
  // Sharded optimizer state (docs/sharding.md): groups of G ranks, each rank
  // holding 1/G of the moments. The buffers are padded to a multiple of G, so
  // that every shard has the same size.
  const int G = static_cast<int>(r.optimizer.shard_group);
  const bool sharded = G > 1;
  torchx::FlatParameters flat(*model, static_cast<size_t>(G));
  const size_t shard_len = flat.padded_size() / static_cast<size_t>(G);
  torchx::AdamW adamw(sharded ? shard_len : flat.size(), flat.segments(),
                      {r.optimizer.beta1, r.optimizer.beta2, r.optimizer.eps, r.optimizer.weight_decay});
  torchx::LrSchedule schedule{r.optimizer.lr, r.optimizer.min_lr, r.optimizer.warmup_steps, r.train.steps};
  int64_t completed = -1;  // last completed step: part of the state
  auto batch_mode = elastic::ParseBatchMode(r.train.batch);
  auto lr_scaling = elastic::ParseLrScaling(r.train.lr_scaling);
  if (!batch_mode.ok()) return Fail(batch_mode.status(), "bad recipe");
  if (!lr_scaling.ok()) return Fail(lr_scaling.status(), "bad recipe");
  // Elastic batch state (src/elastic/batch_policy.h), kept with the model so
  // that joiners and resumed jobs carry on exactly: the world size the batch
  // was defined at, the samples consumed so far, and the learning-rate warm-up
  // after the last world change (the factor stored in millionths).
  int64_t base_world = 0, samples_consumed = 0, lr_world = 0, lr_change_step = 0, lr_from_millionths = 1'000'000;

  const int64_t T = r.model.seq_len;
  const double tokens_per_step = static_cast<double>(r.train.global_batch * T);
  const float norm = 1.0f / static_cast<float>(tokens_per_step);
  auto batch_tensors = [&](const std::vector<uint64_t>& samples) {
    auto t = torch::empty({static_cast<int64_t>(samples.size()), T + 1}, torch::kLong);
    auto acc = t.accessor<int64_t, 2>();
    for (size_t i = 0; i < samples.size(); ++i) {
      auto tokens = (*dataset)->Sample(samples[i]);
      for (int64_t j = 0; j <= T; ++j) acc[static_cast<int64_t>(i)][j] = tokens[static_cast<size_t>(j)];
    }
    using torch::indexing::Slice;
    return std::make_pair(t.index({Slice(), Slice(0, T)}), t.index({Slice(), Slice(1, T + 1)}).contiguous());
  };

  // What must survive a fault: parameters, optimizer moments, the step. The
  // data position follows from the step; the model has no other randomness.
  const std::vector<std::pair<const char*, int64_t*>> scalars = {
      {"step", &completed}, {"elastic.base_world", &base_world}, {"elastic.samples_consumed", &samples_consumed},
      {"elastic.lr_world", &lr_world}, {"elastic.lr_change_step", &lr_change_step},
      {"elastic.lr_from_millionths", &lr_from_millionths}};
  auto register_scalars = [&](state::StateRegistry& reg) -> Status {
    for (auto [name, value] : scalars) NONSTOP_RETURN_IF_ERROR(reg.RegisterValue(name, value));
    return OkStatus();
  };
  // The whole state, one region per tensor with its shape, so that a durable
  // checkpoint is a safetensors file any tool can read tensor by tensor. It
  // is the state itself when nothing is sharded, and what a sharded run's
  // checkpoints hold (the moments gathered whole): any world and any G load them.
  std::vector<std::vector<int64_t>> shapes;
  for (auto& item : model->named_parameters()) shapes.push_back(item.value().sizes().vec());
  auto register_whole = [&](state::StateRegistry& reg, std::span<float> m, std::span<float> v) -> Status {
    std::vector<std::pair<std::string, std::span<float>>> groups = {
        {"", flat.params()}, {"adamw.exp_avg.", m}, {"adamw.exp_avg_sq.", v}};
    for (const auto& [prefix, buffer] : groups) {
      for (size_t i = 0; i < flat.segments().size(); ++i) {
        const auto& seg = flat.segments()[i];
        NONSTOP_RETURN_IF_ERROR(reg.RegisterFloats(prefix + seg.name, buffer.subspan(seg.offset, seg.size), shapes[i]));
      }
    }
    return register_scalars(reg);
  };
  // Sharded: the whole moments, padded, while a resumed checkpoint's are
  // loaded (until this rank knows its shard) and while a checkpoint is gathered.
  std::vector<float> whole_m, whole_v;
  auto whole_registry = [&]() -> Result<std::unique_ptr<state::StateRegistry>> {
    whole_m.assign(flat.padded_size(), 0.0f);
    whole_v.assign(flat.padded_size(), 0.0f);
    auto reg = std::make_unique<state::StateRegistry>();
    NONSTOP_RETURN_IF_ERROR(register_whole(*reg, std::span(whole_m).first(flat.size()),
                                           std::span(whole_v).first(flat.size())));
    return reg;
  };
  std::unique_ptr<state::StateRegistry> loading;  // sharded: the whole layout a checkpoint loads into
  if (sharded && !resume_dir.empty()) {
    auto reg = whole_registry();
    if (!reg.ok()) return Fail(reg.status(), "registering state");
    loading = std::move(*reg);
  }
  state::StateRegistry state;
  if (!sharded) {
    if (Status s = register_whole(state, adamw.exp_avg(), adamw.exp_avg_sq()); !s.ok()) return Fail(s, "registering state");
  }
  if (!resume_dir.empty()) {
    auto loaded = state::LoadNewestCheckpoint(resume_dir, loading ? *loading : state);
    if (loaded.ok()) {
      for (const auto& skipped : loaded->skipped) NONSTOP_LOG_WARNING("skipped checkpoint {}", skipped);
      fmt::print("resumed from {} (step {}, parameter checksum {})\n", loaded->path, loaded->step,
                 loaded->manifest.value("parameter_checksum", ""));
      if (flat.Checksum() != loaded->manifest.value("parameter_checksum", "")) {
        return Fail(DataLossError(fmt::format("checkpoint {}: the parameters do not match the manifest's checksum",
                                              loaded->path)), "resuming");
      }
    } else if (loaded.status().code() == StatusCode::kNotFound && resume_env) {
      fmt::print("no checkpoint to resume from in {}: starting from scratch ({})\n", resume_dir,
                 loaded.status().message());
      loading.reset();  // the moments are the optimizer's own (zeros), not views of whole ones
      std::vector<float>().swap(whole_m);
      std::vector<float>().swap(whole_v);
    } else {
      return Fail(loaded.status(), "resuming");
    }
  }
  const bool resumed_whole = sharded && loading != nullptr;  // the moments are views of whole_m, whole_v
  if (sharded) {
    // The parameters whole on every rank, the held shard of them part of the
    // state; the moments of the shard alone: views of the whole moments a
    // checkpoint loaded (every shard is there) until this rank knows its shard.
    Status s = state.RegisterShardView("params", flat.padded_params(), G);
    if (s.ok() && loading) s = state.RegisterShardView("adamw.exp_avg", whole_m, G);
    if (s.ok() && loading) s = state.RegisterShardView("adamw.exp_avg_sq", whole_v, G);
    if (s.ok() && !loading) s = state.RegisterShard("adamw.exp_avg", adamw.exp_avg(), G);
    if (s.ok() && !loading) s = state.RegisterShard("adamw.exp_avg_sq", adamw.exp_avg_sq(), G);
    if (s.ok()) s = register_scalars(state);
    if (!s.ok()) return Fail(s, "registering state");
    loading.reset();
  }
  fmt::print("worker pid {} built its model ({} parameters) and mapped its data\n", ::getpid(), flat.size());
  std::fflush(stdout);

  // Warm-up: one forward/backward on micro-batch 0 of step 0, so that the
  // allocator, the kernels and the data pages are hot before this worker is
  // needed (a spare's first real step is then as fast as anyone's). The
  // gradients are discarded; parameters and optimizer state are untouched.
  {
    auto [inputs, targets] = batch_tensors(sampler->MicroBatchSamples(0, 0));
    auto logits = model->forward(inputs);
    torch::nn::functional::cross_entropy(logits.view({-1, r.model.vocab_size}), targets.view({-1})).backward();
    flat.GatherGrads();
    flat.ZeroGrad();
  }

  auto options = SessionOptions::FromEnvironment();
  if (!options.ok()) return Fail(options.status(), "not under nonstop run");
  auto joined = Session::Join(*options, &state, completed);
  if (!joined.ok()) {
    if (joined.status().code() == StatusCode::kCancelled) return 0;  // a spare that was not needed
    return Fail(joined.status(), "joining the job");
  }
  Session& session = **joined;
  if (resumed_whole) {
    // This rank knows its shard now: it keeps that shard of the moments a
    // checkpoint loaded, in the optimizer's own memory, and frees the rest.
    NONSTOP_CHECK_GE(state.held_shard(), 0) << "the session binds the shard of the rank";
    const auto at = static_cast<std::ptrdiff_t>(static_cast<size_t>(state.held_shard()) * shard_len);
    std::copy_n(whole_m.begin() + at, shard_len, adamw.exp_avg().begin());
    std::copy_n(whole_v.begin() + at, shard_len, adamw.exp_avg_sq().begin());
    Status s = state.RebindShard("adamw.exp_avg", adamw.exp_avg());
    if (s.ok()) s = state.RebindShard("adamw.exp_avg_sq", adamw.exp_avg_sq());
    if (!s.ok()) return Fail(s, "resuming");
    std::vector<float>().swap(whole_m);
    std::vector<float>().swap(whole_v);
  }
  if (session.rank() == 0) PrintConfig(r, session, flat.size(), **dataset);
  if (session.rank() == 0) {
    const double moments = 2.0 * static_cast<double>(adamw.exp_avg().size()) * sizeof(float);
    fmt::print("optimizer state: {} bytes per rank ({:.2f} MiB: AdamW moments{})\n", static_cast<uint64_t>(moments),
               moments / (1 << 20),
               sharded ? fmt::format(" of 1 shard in {}, over groups of {}; whole: {} bytes", G, G,
                                     2 * flat.size() * sizeof(float))
                       : ", whole");
    std::fflush(stdout);
  }
  if (base_world == 0) base_world = session.world_size();  // the first generation defines it, on every member
  if (lr_world == 0) lr_world = base_world;
  const bool scale_with_world = *batch_mode == elastic::BatchMode::kScaleWithWorld;
  if (scale_with_world && r.train.global_batch % (base_world * r.train.micro_batch) != 0) {
    return Fail(InvalidArgumentError(fmt::format("train.batch scale-with-world: global_batch {} must be a multiple of "
                                                 "micro_batch {} × the initial world size {}",
                                                 r.train.global_batch, r.train.micro_batch, base_world)), "bad recipe");
  }
  // The learning-rate multiplier in effect at `step` under the stored warm-up.
  auto lr_factor = [&](int64_t at) {
    double to = elastic::LrFactor(*batch_mode, *lr_scaling, static_cast<int>(base_world), static_cast<int>(lr_world));
    return elastic::WarmedFactor(static_cast<double>(lr_from_millionths) / 1e6, to, at, lr_change_step,
                                 r.train.rescale_warmup_steps);
  };

  // Durable checkpoints: whichever worker holds rank 0 writes them, in the
  // background. With no fixed interval, the first one is timed and the
  // interval set to the Young/Daly optimum sqrt(2 · cost · MTBF).
  std::unique_ptr<state::CheckpointWriter> writer;
  if (!r.checkpoint.dir.empty()) writer = std::make_unique<state::CheckpointWriter>(r.checkpoint.dir, static_cast<int>(r.checkpoint.keep));
  int64_t every = r.checkpoint.every > 0 ? r.checkpoint.every : (mtbf_seconds > 0 ? 0 : 50);
  if (sharded && every == 0) {
    // The ranks of group 0 gather each checkpoint together: they must agree on when, which rank 0's timing cannot say.
    NONSTOP_LOG_WARNING("optimizer.shard_group {}: the automatic checkpoint interval is not supported yet; "
                        "checkpointing every 50 steps (set checkpoint.every)", G);
    every = 50;
  }
  bool timing_in_flight = false;  // every == 0: the first checkpoint is being written and timed
  // Rank 0 hands the state of `step` (`reg`: the whole layout) to the writer.
  auto save = [&](const state::StateRegistry& reg, int64_t step, bool last) {
    state::CheckpointMeta meta{step, session.generation(), session.world_size(), r.name, flat.Checksum(), {}};
    state::CheckpointSaveResult saved = writer->TrySave(reg, meta);
    if (saved.skipped && last) {
      // The final state must reach the disk: the job is ending, waiting is free.
      (void)writer->Wait();
      saved = writer->TrySave(reg, meta);
    }
    if (!saved.earlier.ok()) NONSTOP_LOG_WARNING("an earlier checkpoint failed: {}", saved.earlier.ToString());
    return saved;
  };
  auto maybe_checkpoint = [&](int64_t step, double step_seconds) {
    if (!writer) return;
    bool last = step + 1 == r.train.steps;
    if (sharded) {
      // Gathered to the writer: group 0 holds every shard once. Its ranks
      // gather the parameters and the moments whole, and rank 0 writes them
      // in the layout of an unsharded run.
      if (session.rank() >= G || !(every > 0 && ((step + 1) % every == 0 || last))) return;
      auto whole = whole_registry();
      const auto at = static_cast<std::ptrdiff_t>(static_cast<size_t>(session.shard()) * shard_len);
      std::copy_n(adamw.exp_avg().begin(), shard_len, whole_m.begin() + at);
      std::copy_n(adamw.exp_avg_sq().begin(), shard_len, whole_v.begin() + at);
      Status s = whole.status();
      if (s.ok()) s = session.GatherShards(std::as_writable_bytes(flat.padded_params()), sizeof(float));
      if (s.ok()) s = session.GatherShards(std::as_writable_bytes(std::span(whole_m)), sizeof(float));
      if (s.ok()) s = session.GatherShards(std::as_writable_bytes(std::span(whole_v)), sizeof(float));
      if (s.ok() && session.rank() == 0) save(**whole, step, last);
      if (!s.ok()) NONSTOP_LOG_WARNING("checkpoint of step {} not gathered: {}", step, s.ToString());
      std::vector<float>().swap(whole_m);
      std::vector<float>().swap(whole_v);
      return;
    }
    if (session.rank() != 0) return;
    if (every == 0 && timing_in_flight) {
      // The timing checkpoint is written in the background: rank 0 never
      // waits for the disk while the others wait in the next collective.
      auto st = writer->last_written();
      if (!st && writer->in_flight() && !last) return;  // still being written
      if (!st && last) (void)writer->Wait();
      st = writer->last_written();
      if (!st) {
        NONSTOP_LOG_WARNING("the timing checkpoint failed; checkpointing every 50 steps instead");
        every = 50;
        timing_in_flight = false;
      }
      double cost = st ? st->snapshot_seconds + st->write_seconds : 0;
      double optimum = std::sqrt(2.0 * cost * mtbf_seconds);
      if (st) every = std::max<int64_t>(1, static_cast<int64_t>(std::llround(optimum / std::max(step_seconds, 1e-6))));
      if (st) fmt::print("checkpoint interval: {} steps (Young/Daly: sqrt(2 × cost {:.3f} s × MTBF {:.1f} s) = {:.2f} s; "
                 "a step takes {:.3f} s)\n", every, cost, mtbf_seconds, optimum, step_seconds);
      std::fflush(stdout);
    }
    bool due = every == 0 || (step + 1) % every == 0 || last;
    if (!due) return;
    if (!save(state, step, last).skipped && every == 0) timing_in_flight = true;
  };

  // A collective that fails means a fault somewhere: take part in the
  // recovery and carry on from the step it names. Nothing here is rebuilt.
  constexpr int kReleased = -1;
  auto recover = [&](int64_t* step) -> int {
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
                 c.reason.rfind("resize", 0) == 0 ? "resized" : "recovered", c.generation, c.old_world, c.new_world,
                 *step);
      std::fflush(stdout);
    }
    return 0;
  };

  std::FILE* samples_log = nullptr;
  if (!log_samples.empty()) {
    std::filesystem::create_directories(log_samples);
    samples_log = std::fopen(fmt::format("{}/worker-{}.txt", log_samples, session.worker_id()).c_str(), "a");
  }
  auto run_start = std::chrono::steady_clock::now();
  int64_t step = session.resume_step();
  // World-invariant: the plan of each step (who computes which micro-batches),
  // and the partial sums of a step a fault cut short, kept for its retry.
  worker::TreeStepPlanner planner(/*salvage=*/!no_salvage);
  worker::HeldSums held;
  std::map<int, std::string> held_samples;  // micro-batch → its samples-log lines, for the held sums
  // Overlapped reduction: the last micro-batch's backward hands each gradient
  // bucket to the session's communication thread as soon as it is complete.
  std::unique_ptr<torchx::GradBuckets> buckets;
  if (!no_overlap && !world_invariant && !sharded) {
    buckets = std::make_unique<torchx::GradBuckets>(*model, flat, static_cast<size_t>(bucket_mb * (1 << 20)),
                                                    [&session](std::span<float> b) { session.StartAllReduce(b); });
  }
  while (true) {
    while (step < r.train.steps) {
      auto t0 = std::chrono::steady_clock::now();
      // Stands for more compute: before the step, so the reduction is followed by the update at once.
      if (throttle_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(throttle_ms));
      if (sharded) {
        // Every rank updated its shard of the parameters last step: the group gathers them whole.
        Status g = session.GatherShards(std::as_writable_bytes(flat.padded_params()), sizeof(float));
        if (!g.ok()) {
          NONSTOP_LOG_WARNING("step {}: {}", step, g.ToString());
          if (int code = recover(&step); code != 0) return code == kReleased ? 0 : code;
          if (held.step != step) {  // the sums kept of a step the job does not resume at are no use
            held = {};
            held_samples.clear();
          }
          continue;
        }
      }
      double local_loss = 0;
      bool computed = false;  // every micro-batch of this rank's share is in
      float step_norm = norm;
      double step_tokens = tokens_per_step;
      std::string step_samples;  // "step micro sample…" lines, logged once the step completed
      Status tree_status;                           // world-invariant: planning the step failed (a fault)
      std::vector<collective::TreeShare> shares;    // ... every rank's part of this step
      std::vector<collective::TreeFolder> folders;  // ... this rank's runs of micro-batches, folded
      std::map<int, std::string> mb_samples;        // ... micro-batch → its samples-log lines
      try {
        if (session.InjectedExceptionAt(step)) throw std::runtime_error(fmt::format("injected exception at step {}", step));
        flat.ZeroGrad();
        const int world = session.world_size();
        if (scale_with_world && world != lr_world) {
          // The world changed: warm the learning rate from where it is to the new factor.
          double from = lr_factor(step);
          lr_from_millionths = std::llround(from * 1e6);
          lr_change_step = step;
          lr_world = world;
          if (session.rank() == 0) {
            fmt::print("batch follows the world: global batch {} samples, learning-rate factor {:.3f} → {:.3f} over {} steps\n",
                       elastic::GlobalBatch(*batch_mode, static_cast<uint64_t>(r.train.global_batch), static_cast<int>(base_world), world),
                       from, lr_factor(step + r.train.rescale_warmup_steps), r.train.rescale_warmup_steps);
            std::fflush(stdout);
          }
        }
        const uint64_t global = elastic::GlobalBatch(*batch_mode, static_cast<uint64_t>(r.train.global_batch),
                                                     static_cast<int>(base_world), world);
        const uint64_t micro = static_cast<uint64_t>(r.train.micro_batch);
        const uint64_t micro_batches = global / micro;
        step_norm = 1.0f / static_cast<float>(global * static_cast<uint64_t>(T));
        step_tokens = static_cast<double>(global * static_cast<uint64_t>(T));
        // This rank's micro-batches: its block of the global batch; world-invariant, the runs its share
        // names (after a fault, the micro-batches nobody holds any more), each folded into the tree.
        std::vector<std::pair<uint64_t, size_t>> work;  // (micro-batch, its run)
        if (world_invariant) {
          const int m = static_cast<int>(micro_batches);
          auto planned = planner.Plan(session, m, step, held);
          if (!planned.ok()) {
            tree_status = planned.status();
          } else {
            shares = std::move(*planned);
            const collective::TreeShare& mine = shares[static_cast<size_t>(session.rank())];
            worker::KeepOnly(&held, step, mine.kept);  // the sums it does not keep go before computing
            for (auto [first, last] : mine.compute) {
              folders.emplace_back(m, first, last, flat.size() + 1);
              for (int mb = first; mb < last; ++mb) work.push_back({static_cast<uint64_t>(mb), folders.size() - 1});
            }
            if (planner.kept_micro_batches() > 0 && session.rank() == 0) {
              fmt::print("step {}: kept the sums of {} of {} micro-batches from the step in flight ({} member(s)); "
                         "{} computed again by {} member(s)\n",
                         step, planner.kept_micro_batches(), m, planner.kept_by(), m - planner.kept_micro_batches(),
                         world);
              std::fflush(stdout);
            }
          }
        } else {
          for (uint64_t mb = data::BlockBegin(micro_batches, world, session.rank());
               mb < data::BlockBegin(micro_batches, world, session.rank() + 1); ++mb) {
            work.push_back({mb, 0});
          }
        }
        for (size_t k = 0; k < work.size(); ++k) {
          const uint64_t mb = work[k].first;
          const bool last_one = k + 1 == work.size();
          // Fixed batch: the samples are a function of the step. Scaled batch: of the position in the stream.
          std::vector<uint64_t> samples =
              scale_with_world ? sampler->SamplesAt(static_cast<uint64_t>(samples_consumed) + mb * micro, micro)
                               : sampler->MicroBatchSamples(static_cast<uint64_t>(step), mb);
          if (samples_log) {
            std::string line = fmt::format("{} {}", step, mb);
            for (uint64_t x : samples) line += fmt::format(" {}", x);
            line += '\n';
            if (world_invariant) {
              mb_samples[static_cast<int>(mb)] = line;
            } else {
              step_samples += line;
            }
          }
          auto [inputs, targets] = batch_tensors(samples);
          auto logits = model->forward(inputs);
          // Normalised by the token count of the whole global batch: the summed
          // gradient is the same however micro-batches are dealt.
          auto loss = torch::nn::functional::cross_entropy(
                          logits.view({-1, r.model.vocab_size}), targets.view({-1}),
                          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) * step_norm;
          if (world_invariant) flat.ZeroGrad();
          if (!world_invariant) local_loss += loss.item<double>();
          if (buckets && last_one) {
            flat.loss_slot() = static_cast<float>(local_loss);  // rides in bucket 0
            buckets->Arm();
          }
          loss.backward();
          if (world_invariant) {
            flat.GatherGrads();
            flat.loss_slot() = loss.item<float>();
            folders[work[k].second].Add(flat.grads_and_loss());
          }
          computed = last_one;
          if (session.aborted()) break;  // a member failed: this step is lost (its sums may be kept)
        }
        if (work.empty()) computed = true;  // more ranks than micro-batches: zeros, summed with the rest
      } catch (const std::exception& e) {
        // The process may be in any state: report, and let a spare take over.
        Status s = InternalError(fmt::format("exception in the training loop at step {}: {}", step, e.what()));
        session.ReportFailure(s, step, kExitFailure);
        return Fail(s, "training");
      }
      Status s;
      if (world_invariant) {
        if (!tree_status.ok()) {
          s = tree_status;
        } else {
          const int m = static_cast<int>(r.train.global_batch / r.train.micro_batch);
          const collective::TreeShare& mine = shares[static_cast<size_t>(session.rank())];
          // KeepOnly left in `held` exactly the sums the plan keeps; their samples-log lines come with them.
          NONSTOP_CHECK(held.nodes == mine.kept) << "kept a sum it does not hold";
          for (const auto& node : held.nodes) {
            auto [first, last] = collective::NodeRange(m, node);
            for (int mb = first; mb < last; ++mb) {
              if (auto l = held_samples.find(mb); l != held_samples.end()) mb_samples[mb] = l->second;
            }
          }
          worker::HeldSums have = worker::CollectSums(m, step, std::move(held), &folders);
          held = {};
          held_samples.clear();
          if (computed) {
            NONSTOP_CHECK(have.nodes == mine.nodes) << "the step's sums are not the plan's";
            s = session.AllReduceTree(m, worker::NodeLists(shares), have.partials, flat.grads_and_loss());
          } else {
            s = AbortedError(fmt::format("step {} was cut short: a member failed", step));
          }
          if (s.ok()) {
            for (const auto& [mb, line] : mb_samples) step_samples += line;
          } else if (!no_salvage) {
            // Kept for the step's retry in the next generation (TreeStepPlanner offers them).
            held = std::move(have);
            held_samples = std::move(mb_samples);
          }
        }
      } else if (buckets) {
        if (computed) {
          buckets->Finish();
          s = session.WaitAll();
        } else {
          (void)session.WaitAll();  // the buckets already started; the step is lost
          s = AbortedError(fmt::format("step {} was cut short: a member failed", step));
        }
      } else if (sharded) {
        flat.GatherGrads();
        flat.loss_slot() = static_cast<float>(local_loss);
        s = computed ? session.ReduceShards(flat.padded_grads())
                     : AbortedError(fmt::format("step {} was cut short: a member failed", step));
      } else {
        flat.GatherGrads();
        flat.loss_slot() = static_cast<float>(local_loss);
        s = session.AllReduce(flat.grads_and_loss());
      }
      // Sharded, fast: the world's gradient is in this rank's shard alone. The
      // group shares each shard's sum of squares (the norm, summed in shard
      // order) and the loss, which rides in the shard holding its slot.
      double shard_norm = -1;
      if (s.ok() && sharded && !world_invariant) {
        auto [sq, loss_part] = ShardNormAndLoss(flat, session.shard(), shard_len);
        std::vector<double> records(2 * static_cast<size_t>(G));
        records[2 * static_cast<size_t>(session.shard())] = sq;
        records[2 * static_cast<size_t>(session.shard()) + 1] = loss_part;
        s = session.GatherShards(std::as_writable_bytes(std::span(records)), 2 * sizeof(double));
        if (s.ok()) {
          double total = 0, world_loss = 0;
          for (int q = 0; q < G; ++q) {
            total += records[2 * static_cast<size_t>(q)];
            world_loss += records[2 * static_cast<size_t>(q) + 1];
          }
          shard_norm = std::sqrt(total);
          flat.loss_slot() = static_cast<float>(world_loss);
        }
      }
      if (!s.ok()) {
        NONSTOP_LOG_WARNING("step {}: {}", step, s.ToString());
        if (int code = recover(&step); code != 0) return code == kReleased ? 0 : code;
        if (held.step != step) {  // the job resumes elsewhere: the sums kept of that step are no use
          held = {};
          held_samples.clear();
        }
        continue;
      }
      double loss = flat.loss_slot();
      if (!std::isfinite(loss)) {
        Status bad = DataLossError(fmt::format("loss is {} at step {}", loss, step));
        session.ReportFailure(bad, step, kExitDataCorruption);
        return Fail(bad, "training diverged");
      }
      double grad_norm = shard_norm >= 0 ? ScaleShard(flat, session.shard(), shard_len, shard_norm, r.optimizer.grad_clip)
                                         : torchx::ClipGradNorm(flat.grads(), r.optimizer.grad_clip);
      double lr = schedule.At(step) * lr_factor(step);
      if (sharded) {
        // The shard's update: the same arithmetic, element by element, as the whole update has there.
        NONSTOP_CHECK_EQ(state.held_shard(), session.shard()) << "the state holds the shard of another rank";
        adamw.Step(flat.padded_params(), flat.padded_grads(), lr, step + 1,
                   static_cast<size_t>(session.shard()) * shard_len);
      } else {
        adamw.Step(flat.params(), flat.grads(), lr, step + 1);
      }
      completed = step;
      if (scale_with_world) samples_consumed += static_cast<int64_t>(step_tokens) / T;
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      session.ReportStep({step, loss, secs, step_tokens / secs, r.train.steps});
      maybe_checkpoint(step, secs);
      if (samples_log) {
        std::fputs(step_samples.c_str(), samples_log);
        std::fflush(samples_log);
      }
      if (session.rank() == 0 && (step % r.train.log_every == 0 || step + 1 == r.train.steps)) {
        fmt::print("step {:>5}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | {:>6.0f} tok/s | {:.3f} s/step | world {}\n",
                   step, r.train.steps, loss, lr, grad_norm, step_tokens / secs, secs, session.world_size());
        std::fflush(stdout);
      }
      ++step;
    }
    if (sharded) {
      // The last update is in each rank's shard: the parameters whole again, for the checksum.
      Status g = session.GatherShards(std::as_writable_bytes(flat.padded_params()), sizeof(float));
      if (!g.ok()) {
        if (int code = recover(&step); code != 0) return code == kReleased ? 0 : code;
        continue;
      }
    }
    std::string checksum = flat.Checksum();
    if (writer) {
      Status w = writer->Wait();
      if (!w.ok()) NONSTOP_LOG_WARNING("the last checkpoint failed: {}", w.ToString());
    }
    Status fin = session.Finish(r.train.steps - 1, checksum);
    if (fin.code() == StatusCode::kAborted) {  // a member failed at the very end
      if (int code = recover(&step); code != 0) return code == kReleased ? 0 : code;
      continue;
    }
    if (!fin.ok()) return Fail(fin, "finishing");
    if (session.rank() == 0) {
      double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      fmt::print("done: {} steps in {:.1f} s; parameter checksum {}\n", r.train.steps, total, checksum);
      std::fflush(stdout);
    }
    return 0;
  }
}

}  // namespace
}  // namespace nonstop::train

int main(int argc, char** argv) { return nonstop::train::Main(argc, argv); }
