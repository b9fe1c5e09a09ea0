#include "apps/train/recipe.h"

#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "apps/train/default_recipe.h"

namespace nonstop::train {

namespace {

// The name of a mapping key. YAML allows any node as a key ("? [a, b]: 1",
// "{{}}"); a recipe's keys are names, and as<std::string>() on anything else
// throws.
Result<std::string> KeyName(const YAML::Node& key, const std::string& path) {
  if (!key.IsScalar()) {
    return InvalidArgumentError(fmt::format("{}: a key must be a name, got a {}",
                                            path.empty() ? "(top level)" : path,
                                            key.IsSequence() ? "sequence"
                                            : key.IsMap()    ? "mapping"
                                                             : "null"));
  }
  return key.Scalar();
}

// Reads the keys of one mapping, remembering which it used, so that whatever
// is left over can be reported as unknown.
class Section {
 public:
  Section(const YAML::Node& node, std::string path) : node_(node), path_(std::move(path)) {}

  template <typename T>
  Status Read(const char* key, T* out) {
    known_.insert(key);
    YAML::Node v = node_[key];
    if (!v) return OkStatus();  // keeps the default
    std::string where = path_.empty() ? key : path_ + "." + key;
    if (!v.IsScalar())
      return InvalidArgumentError(fmt::format("{}: expected a single value", where));
    try {
      *out = v.as<T>();
    } catch (const YAML::Exception&) {
      return InvalidArgumentError(
          fmt::format("{}: expected {}, got '{}'", where, TypeName<T>(), v.Scalar()));
    }
    return OkStatus();
  }

  Status CheckUnknown() const {
    for (const auto& kv : node_) {
      NONSTOP_ASSIGN_OR_RETURN(std::string key, KeyName(kv.first, path_));
      if (!known_.count(key)) {
        std::string names;
        for (const auto& k : known_) names += (names.empty() ? "" : ", ") + k;
        return InvalidArgumentError(fmt::format("{}{}: unknown key (known keys here: {})",
                                                path_.empty() ? "" : path_ + ".", key, names));
      }
    }
    return OkStatus();
  }

 private:
  template <typename T>
  static const char* TypeName() {
    if constexpr (std::is_same_v<T, bool>)
      return "true or false";
    else if constexpr (std::is_integral_v<T>)
      return "an integer";
    else if constexpr (std::is_floating_point_v<T>)
      return "a number";
    else
      return "a string";
  }
  YAML::Node node_;
  std::string path_;
  std::set<std::string> known_;
};

Status Require(bool ok, const std::string& message) {
  return ok ? OkStatus() : InvalidArgumentError(message);
}

Status Validate(const Recipe& r) {
  const auto& m = r.model;
  NONSTOP_RETURN_IF_ERROR(
      Require(m.arch == "llama" || m.arch == "gpt-oss",
              fmt::format("model.arch: must be 'llama' or 'gpt-oss', got '{}'", m.arch)));
  NONSTOP_RETURN_IF_ERROR(
      Require(m.vocab_size > 0 && m.vocab_size <= 65536, "model.vocab_size: must be in 1..65536"));
  NONSTOP_RETURN_IF_ERROR(Require(m.dim > 0 && m.n_layers > 0 && m.ffn_hidden > 0 && m.seq_len > 0,
                                  "model: dim, n_layers, ffn_hidden and seq_len must be positive"));
  NONSTOP_RETURN_IF_ERROR(
      Require(m.n_heads > 0 && m.dim % m.n_heads == 0,
              fmt::format("model.n_heads: must divide model.dim ({}), got {}", m.dim, m.n_heads)));
  NONSTOP_RETURN_IF_ERROR(
      Require((m.dim / m.n_heads) % 2 == 0,
              "model: the head size (dim / n_heads) must be even for rotary embeddings"));
  NONSTOP_RETURN_IF_ERROR(
      Require(m.n_kv_heads > 0 && m.n_heads % m.n_kv_heads == 0,
              fmt::format("model.n_kv_heads: must divide model.n_heads ({}), got {}", m.n_heads,
                          m.n_kv_heads)));
  if (m.arch == "gpt-oss") {
    NONSTOP_RETURN_IF_ERROR(
        Require(m.n_experts >= 2, "model.n_experts: gpt-oss needs at least 2 experts"));
    NONSTOP_RETURN_IF_ERROR(Require(
        m.top_k >= 1 && m.top_k <= m.n_experts,
        fmt::format("model.top_k: must be in 1..n_experts ({}), got {}", m.n_experts, m.top_k)));
  } else {
    NONSTOP_RETURN_IF_ERROR(
        Require(m.n_experts == 0 && m.top_k == 0, "model.n_experts/top_k: only for arch gpt-oss"));
  }
  const auto& t = r.train;
  NONSTOP_RETURN_IF_ERROR(Require(t.steps > 0, "train.steps: must be positive"));
  NONSTOP_RETURN_IF_ERROR(Require(
      t.micro_batch > 0 && t.global_batch > 0 && t.global_batch % t.micro_batch == 0,
      fmt::format("train.global_batch ({}) must be a positive multiple of train.micro_batch ({})",
                  t.global_batch, t.micro_batch)));
  NONSTOP_RETURN_IF_ERROR(Require(t.log_every > 0, "train.log_every: must be positive"));
  NONSTOP_RETURN_IF_ERROR(Require(
      t.batch == "fixed" || t.batch == "scale-with-world",
      fmt::format("train.batch: must be 'fixed' or 'scale-with-world', got '{}'", t.batch)));
  NONSTOP_RETURN_IF_ERROR(
      Require(t.determinism == "fast" || t.determinism == "world-invariant",
              fmt::format("train.determinism: must be 'fast' or 'world-invariant', got '{}'",
                          t.determinism)));
  NONSTOP_RETURN_IF_ERROR(
      Require(t.determinism != "world-invariant" || t.batch == "fixed",
              "train.determinism: 'world-invariant' needs train.batch 'fixed' (a batch that "
              "scales with the world has another sum at each size)"));
  NONSTOP_RETURN_IF_ERROR(
      Require(t.lr_scaling == "linear" || t.lr_scaling == "sqrt",
              fmt::format("train.lr_scaling: must be 'linear' or 'sqrt', got '{}'", t.lr_scaling)));
  NONSTOP_RETURN_IF_ERROR(
      Require(t.rescale_warmup_steps >= 0, "train.rescale_warmup_steps: must not be negative"));
  const auto& o = r.optimizer;
  NONSTOP_RETURN_IF_ERROR(Require(o.lr > 0 && o.min_lr >= 0 && o.min_lr <= o.lr,
                                  "optimizer: need 0 <= min_lr <= lr and lr > 0"));
  NONSTOP_RETURN_IF_ERROR(Require(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
                                  "optimizer: beta1 and beta2 must be in [0, 1)"));
  NONSTOP_RETURN_IF_ERROR(Require(
      o.eps > 0 && o.weight_decay >= 0 && o.grad_clip >= 0 && o.warmup_steps >= 0,
      "optimizer: eps must be positive; weight_decay, grad_clip and warmup_steps non-negative"));
  NONSTOP_RETURN_IF_ERROR(
      Require(o.shard_group >= 1 && o.shard_group <= 1024,
              fmt::format("optimizer.shard_group: must be 1 (no sharding) to 1024, got {}",
                          o.shard_group)));
  NONSTOP_RETURN_IF_ERROR(Require(!r.data.shards.empty(), "data.shards: required"));
  NONSTOP_RETURN_IF_ERROR(
      Require(r.checkpoint.every >= 0, "checkpoint.every: must be 0 (automatic) or positive"));
  NONSTOP_RETURN_IF_ERROR(Require(r.checkpoint.keep >= 1, "checkpoint.keep: must be at least 1"));
  return OkStatus();
}

}  // namespace

namespace {

// ParseRecipe without its safety net: yaml-cpp may throw (YAML::Exception)
// from any node access this function did not foresee.
Result<Recipe> ParseRecipeOrThrow(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return InvalidArgumentError(fmt::format("recipe {}: not valid YAML: {}", source, e.what()));
  }
  if (!root.IsMap())
    return InvalidArgumentError(
        fmt::format("recipe {}: expected a mapping at the top level", source));
  Recipe r;
  auto ctx = [&](Status s) { return s.WithContext("recipe " + source); };
  for (const auto& kv : root) {
    auto key_or = KeyName(kv.first, "");
    if (!key_or.ok()) return ctx(key_or.status());
    const std::string& key = *key_or;
    if (key != "name" && key != "model" && key != "train" && key != "optimizer" && key != "data" &&
        key != "checkpoint") {
      return InvalidArgumentError(
          fmt::format("recipe {}: {}: unknown key (known keys here: name, model, train, "
                      "optimizer, data, checkpoint)",
                      source, key));
    }
  }
  if (root["name"]) {
    if (!root["name"].IsScalar()) return ctx(InvalidArgumentError("name: expected a string"));
    r.name = root["name"].Scalar();
  }

  auto section = [&](const char* key, auto fill) -> Status {
    YAML::Node n = root[key];
    if (!n) return OkStatus();
    if (!n.IsMap()) return InvalidArgumentError(fmt::format("{}: expected a mapping", key));
    Section sec(n, key);
    NONSTOP_RETURN_IF_ERROR(fill(sec));
    return sec.CheckUnknown();
  };
  Status st = section("model", [&](Section& x) -> Status {
    auto& m = r.model;
    NONSTOP_RETURN_IF_ERROR(x.Read("arch", &m.arch));
    NONSTOP_RETURN_IF_ERROR(x.Read("vocab_size", &m.vocab_size));
    NONSTOP_RETURN_IF_ERROR(x.Read("dim", &m.dim));
    NONSTOP_RETURN_IF_ERROR(x.Read("n_layers", &m.n_layers));
    NONSTOP_RETURN_IF_ERROR(x.Read("n_heads", &m.n_heads));
    NONSTOP_RETURN_IF_ERROR(x.Read("n_kv_heads", &m.n_kv_heads));
    NONSTOP_RETURN_IF_ERROR(x.Read("ffn_hidden", &m.ffn_hidden));
    NONSTOP_RETURN_IF_ERROR(x.Read("n_experts", &m.n_experts));
    NONSTOP_RETURN_IF_ERROR(x.Read("top_k", &m.top_k));
    NONSTOP_RETURN_IF_ERROR(x.Read("seq_len", &m.seq_len));
    NONSTOP_RETURN_IF_ERROR(x.Read("rope_theta", &m.rope_theta));
    return x.Read("norm_eps", &m.norm_eps);
  });
  if (!st.ok()) return ctx(st);
  st = section("train", [&](Section& x) -> Status {
    auto& t = r.train;
    NONSTOP_RETURN_IF_ERROR(x.Read("steps", &t.steps));
    NONSTOP_RETURN_IF_ERROR(x.Read("global_batch", &t.global_batch));
    NONSTOP_RETURN_IF_ERROR(x.Read("micro_batch", &t.micro_batch));
    NONSTOP_RETURN_IF_ERROR(x.Read("seed", &t.seed));
    NONSTOP_RETURN_IF_ERROR(x.Read("batch", &t.batch));
    NONSTOP_RETURN_IF_ERROR(x.Read("lr_scaling", &t.lr_scaling));
    NONSTOP_RETURN_IF_ERROR(x.Read("rescale_warmup_steps", &t.rescale_warmup_steps));
    NONSTOP_RETURN_IF_ERROR(x.Read("determinism", &t.determinism));
    return x.Read("log_every", &t.log_every);
  });
  if (!st.ok()) return ctx(st);
  st = section("optimizer", [&](Section& x) -> Status {
    auto& o = r.optimizer;
    NONSTOP_RETURN_IF_ERROR(x.Read("lr", &o.lr));
    NONSTOP_RETURN_IF_ERROR(x.Read("min_lr", &o.min_lr));
    NONSTOP_RETURN_IF_ERROR(x.Read("warmup_steps", &o.warmup_steps));
    NONSTOP_RETURN_IF_ERROR(x.Read("weight_decay", &o.weight_decay));
    NONSTOP_RETURN_IF_ERROR(x.Read("beta1", &o.beta1));
    NONSTOP_RETURN_IF_ERROR(x.Read("beta2", &o.beta2));
    NONSTOP_RETURN_IF_ERROR(x.Read("eps", &o.eps));
    NONSTOP_RETURN_IF_ERROR(x.Read("shard_group", &o.shard_group));
    return x.Read("grad_clip", &o.grad_clip);
  });
  if (!st.ok()) return ctx(st);
  st = section("data", [&](Section& x) -> Status {
    auto& d = r.data;
    NONSTOP_RETURN_IF_ERROR(x.Read("shards", &d.shards));
    NONSTOP_RETURN_IF_ERROR(x.Read("prepare_from", &d.prepare_from));
    return x.Read("strip_fortune_separators", &d.strip_fortune_separators);
  });
  if (!st.ok()) return ctx(st);
  st = section("checkpoint", [&](Section& x) -> Status {
    auto& c = r.checkpoint;
    NONSTOP_RETURN_IF_ERROR(x.Read("dir", &c.dir));
    NONSTOP_RETURN_IF_ERROR(x.Read("every", &c.every));
    return x.Read("keep", &c.keep);
  });
  if (!st.ok()) return ctx(st);
  st = Validate(r);
  if (!st.ok()) return ctx(st);
  return r;
}

}  // namespace

Result<Recipe> ParseRecipe(const std::string& text, const std::string& source) {
  try {
    return ParseRecipeOrThrow(text, source);
  } catch (const YAML::Exception& e) {
    return InvalidArgumentError(fmt::format("recipe {}: {}", source, e.what()));
  }
}

Result<Recipe> LoadRecipe(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return NotFoundError(
        fmt::format("recipe {} cannot be read (HINT: see recipes/ for examples)", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseRecipe(ss.str(), path);
}

const std::string& DefaultRecipeText() {
  static const std::string text = kDefaultRecipeYaml;
  return text;
}

}  // namespace nonstop::train
