// Training data (docs/architecture.md "Data"): token shards prepared from text, a Dataset
// that cuts them into fixed-length samples, and a Sampler that says which
// samples form each step's global batch and which rank computes which
// micro-batches. Implemented by src/data/ (the shard format and its mmap
// stay there: docs/formats.md).
//
// The samples of a step depend only on (data, seed, step, global batch),
// never on the world size or on faults: a training loop that recovers or
// resizes asks the Sampler for the same step again and gets the same samples.
//
//   data::PrepareIfMissing({{"corpus.txt"}, "data/shards"});   // first use only
//   auto dataset = data::Dataset::Open("data/shards", seq_len).value();
//   auto sampler = data::Sampler::Create({dataset->num_samples(), seed, B, m}).value();
//   for (uint64_t mb = data::BlockBegin(M, world, rank); mb < data::BlockBegin(M, world, rank + 1);
//   ++mb)
//     ... sampler.MicroBatchSamples(step, mb) → dataset->Sample(i) ...
//
// Thread-safety: a Dataset is immutable once opened (any thread may read
// samples). A Sampler caches the current epoch's permutation: one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::data {

// ---------------------------------------------------------------- text → token shards

// `nonstop data prepare`, with the byte-level tokenizer (token = byte,
// vocabulary 256). Inputs are files or directories; in a directory every
// regular text file is read in name order (symlinks, *.dat index files and
// files holding NUL bytes are skipped and reported). The output directory
// receives shard_000000.bin, … and a manifest.json written last, so a
// directory with a manifest is complete.
struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string output_dir;
  uint64_t tokens_per_shard = 1 << 20;
  // Fortune files separate entries with lines holding only "%": drop those lines.
  bool strip_fortune_separators = false;
};

struct PrepareReport {
  uint64_t files_read = 0;
  std::vector<std::string> skipped;  // "path: reason"
  uint64_t tokens = 0;
  uint64_t shards = 0;
};

using PrepareProgress = std::function<void(const std::string& line)>;

Result<PrepareReport> PrepareShards(const PrepareOptions& options,
                                    const PrepareProgress& progress = nullptr);

// Prepares `options.output_dir` unless it already holds a complete set
// (manifest.json). Safe when several processes call it at once: they take an
// exclusive lock on the directory, and the first one does the work.
Result<bool> PrepareIfMissing(const PrepareOptions& options,
                              const PrepareProgress& progress = nullptr);

// ---------------------------------------------------------------- samples

class TokenShard;  // src/data/token_shard.h

// A set of token shards cut into fixed-length samples.
//
// Sample i is seq_len+1 consecutive tokens (inputs and shifted targets) from
// one shard; shard k contributes floor((tokens_k - 1) / seq_len) samples,
// taken at offsets 0, seq_len, 2·seq_len, … The shards are ordered by path,
// so the sample numbering depends only on the data. Every shard is validated
// when opened (DATA_LOSS or INVALID_ARGUMENT naming the file).
class Dataset {
 public:
  // `pattern` is a directory (every *.bin inside) or a single shard path.
  static Result<std::unique_ptr<Dataset>> Open(const std::string& pattern, size_t seq_len);
  ~Dataset();

  size_t num_samples() const { return total_samples_; }
  size_t seq_len() const { return seq_len_; }
  size_t num_shards() const { return shards_.size(); }
  uint64_t num_tokens() const { return num_tokens_; }
  uint32_t max_token() const { return max_token_; }

  // The seq_len+1 tokens of sample `index`.
  std::span<const uint16_t> Sample(size_t index) const;

 private:
  Dataset() = default;

  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::vector<size_t> first_sample_;  // first global sample index of each shard
  size_t total_samples_ = 0;
  size_t seq_len_ = 0;
  uint64_t num_tokens_ = 0;
  uint32_t max_token_ = 0;
};

// Lists the shard files named by `pattern` (a directory or one file), sorted.
Result<std::vector<std::string>> ListShards(const std::string& pattern);

// ---------------------------------------------------------------- batches

// The sample stream is an endless sequence of epochs; epoch e is a seeded
// permutation of all samples. Global batch s is positions [s·B, (s+1)·B) of
// that stream. Micro-batch i of step s is positions [s·B + i·m, s·B + (i+1)·m)
// (m = micro-batch size, M = B/m micro-batches per step). Micro-batches are
// dealt to ranks in contiguous blocks, as even as possible: rank r gets
// [BlockBegin(M, W, r), BlockBegin(M, W, r+1)).
//
// The permutation uses our own generator (SplitMix64 + Fisher-Yates),
// identical on every platform.
struct SamplerOptions {
  uint64_t num_samples = 0;
  uint64_t seed = 0;
  uint64_t global_batch = 0;  // samples per step (B)
  uint64_t micro_batch = 0;   // samples per micro-batch (m); B % m == 0
};

class Sampler {
 public:
  static Result<Sampler> Create(SamplerOptions options);

  uint64_t micro_batches_per_step() const { return options_.global_batch / options_.micro_batch; }

  // Micro-batch indices [begin, end) of step `step` that `rank` of `world_size` processes.
  std::pair<uint64_t, uint64_t> MicroBatchesFor(int rank, int world_size) const;

  // Sample indices of micro-batch `micro` of step `step`.
  std::vector<uint64_t> MicroBatchSamples(uint64_t step, uint64_t micro);

  // Sample index at position `pos` of the endless stream.
  uint64_t SampleAt(uint64_t pos);
  // `count` consecutive samples from position `pos`.
  std::vector<uint64_t> SamplesAt(uint64_t pos, uint64_t count);

  const SamplerOptions& options() const { return options_; }

 private:
  explicit Sampler(SamplerOptions options) : options_(options) {}
  void BuildEpoch(uint64_t epoch);

  SamplerOptions options_;
  uint64_t epoch_ = UINT64_MAX;
  std::vector<uint64_t> permutation_;
};

// Start of block `part` when `n` items are dealt over `parts` (sizes differ by at most one).
uint64_t BlockBegin(uint64_t n, int parts, int part);

}  // namespace nonstop::data
