// Sampler: which samples form each global batch and which rank gets which
// micro-batches (DESIGN.md §7).
//
// The sample stream is an endless sequence of epochs; epoch e is a seeded
// permutation of all samples. Global batch s is positions [s·B, (s+1)·B) of
// that stream. Micro-batch i of step s is positions [s·B + i·m, s·B + (i+1)·m)
// (m = micro-batch size, M = B/m micro-batches per step). Micro-batches are
// dealt to ranks in contiguous blocks, as even as possible: rank r gets
// [ChunkBegin(M, W, r), ChunkBegin(M, W, r+1)).
//
// So the samples of step s depend only on (dataset size, seed, s, B), never on
// the world size or on faults, and the permutation uses our own generator
// (SplitMix64 + Fisher-Yates), identical on every platform.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/status.h"

namespace nonstop::data {

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
