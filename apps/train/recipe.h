// Recipe: everything that defines a training run, read from YAML
// (recipes/*.yaml, docs/recipes.md). Parsing is strict: an unknown key, a
// value of the wrong type or out of range is an INVALID_ARGUMENT that names
// the key ("model.n_heads: must divide model.dim (128), got 5").
#pragma once

#include <cstdint>
#include <string>

#include "nonstop/status.h"

namespace nonstop::train {

struct ModelConfig {
  std::string arch = "llama";  // "llama" or "gpt-oss"
  int64_t vocab_size = 256;
  int64_t dim = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 2;
  int64_t ffn_hidden = 352;
  int64_t n_experts = 0;  // gpt-oss only
  int64_t top_k = 0;      // gpt-oss only
  int64_t seq_len = 64;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
};

struct TrainConfig {
  int64_t steps = 300;
  int64_t global_batch = 32;
  int64_t micro_batch = 4;
  int64_t seed = 1234;
  int64_t log_every = 10;
  std::string batch = "fixed";        // "fixed" or "scale-with-world" (nonstop/elastic.h)
  std::string lr_scaling = "linear";  // with scale-with-world: "linear" or "sqrt"
  int64_t rescale_warmup_steps = 5;   // with scale-with-world: warm-up after each change
  // "fast": the ring all-reduce, bitwise equal run to run at a fixed world
  // size. "world-invariant": the fixed reduction tree over the global
  // micro-batches (docs/determinism.md), bitwise equal at every world size
  // and across grows, shrinks and restarts; one intra-op thread.
  std::string determinism = "fast";
};

struct OptimizerConfig {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;
  // Sharded optimizer state (ZeRO-1, docs/sharding.md): the world is groups of
  // shard_group ranks, each group holding the AdamW moments once, split over
  // its ranks; 1: every rank holds them whole.
  int64_t shard_group = 1;
};

struct DataConfig {
  std::string shards = "data/fortunes";
  std::string prepare_from;  // optional: text to prepare into `shards` when missing
  bool strip_fortune_separators = false;
};

struct CheckpointConfig {
  std::string dir;    // empty: no durable checkpoints
  int64_t every = 0;  // steps between checkpoints; 0: Young/Daly from the MTBF (or 50 without one)
  int64_t keep = 3;   // checkpoints retained
};

struct Recipe {
  std::string name;
  CheckpointConfig checkpoint;
  ModelConfig model;
  TrainConfig train;
  OptimizerConfig optimizer;
  DataConfig data;
};

Result<Recipe> ParseRecipe(const std::string& yaml_text, const std::string& source_name);
Result<Recipe> LoadRecipe(const std::string& path);
// The built-in default (recipes/llama-tiny.yaml, embedded at build time).
const std::string& DefaultRecipeText();

}  // namespace nonstop::train
