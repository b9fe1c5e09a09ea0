#include "nonstop/data.h"

#include <fmt/format.h>

namespace nonstop::data {

namespace {

__extension__ typedef unsigned __int128 Uint128;

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, bound) without modulo bias (Lemire's method with rejection).
uint64_t Below(uint64_t* state, uint64_t bound) {
  uint64_t threshold = (0 - bound) % bound;
  while (true) {
    uint64_t r = SplitMix64(state);
    auto m = static_cast<Uint128>(r) * bound;
    if (static_cast<uint64_t>(m) >= threshold) return static_cast<uint64_t>(m >> 64);
  }
}

}  // namespace

uint64_t BlockBegin(uint64_t n, int parts, int part) {
  auto p = static_cast<uint64_t>(parts);
  auto i = static_cast<uint64_t>(part);
  return (n / p) * i + (n % p) * i / p;
}

Result<Sampler> Sampler::Create(SamplerOptions o) {
  if (o.num_samples == 0) return InvalidArgumentError("sampler: the dataset has no samples");
  if (o.global_batch == 0 || o.micro_batch == 0) {
    return InvalidArgumentError("sampler: global_batch and micro_batch must be positive");
  }
  if (o.global_batch % o.micro_batch != 0) {
    return InvalidArgumentError(
        fmt::format("sampler: global_batch {} is not a multiple of micro_batch {}", o.global_batch,
                    o.micro_batch));
  }
  return Sampler(o);
}

std::pair<uint64_t, uint64_t> Sampler::MicroBatchesFor(int rank, int world_size) const {
  uint64_t m = micro_batches_per_step();
  return {BlockBegin(m, world_size, rank), BlockBegin(m, world_size, rank + 1)};
}

void Sampler::BuildEpoch(uint64_t epoch) {
  permutation_.resize(options_.num_samples);
  for (uint64_t i = 0; i < options_.num_samples; ++i) permutation_[i] = i;
  uint64_t state = options_.seed * 0x9E3779B97F4A7C15ull ^ (epoch + 1) * 0xD1B54A32D192ED03ull;
  for (uint64_t i = options_.num_samples - 1; i > 0; --i) {
    uint64_t j = Below(&state, i + 1);
    std::swap(permutation_[i], permutation_[j]);
  }
  epoch_ = epoch;
}

uint64_t Sampler::SampleAt(uint64_t pos) {
  uint64_t epoch = pos / options_.num_samples;
  if (epoch != epoch_) BuildEpoch(epoch);
  return permutation_[pos % options_.num_samples];
}

std::vector<uint64_t> Sampler::SamplesAt(uint64_t pos, uint64_t count) {
  std::vector<uint64_t> out;
  out.reserve(count);
  for (uint64_t k = 0; k < count; ++k) out.push_back(SampleAt(pos + k));
  return out;
}

std::vector<uint64_t> Sampler::MicroBatchSamples(uint64_t step, uint64_t micro) {
  NONSTOP_CHECK_LT(micro, micro_batches_per_step());
  std::vector<uint64_t> out;
  out.reserve(options_.micro_batch);
  uint64_t base = step * options_.global_batch + micro * options_.micro_batch;
  for (uint64_t k = 0; k < options_.micro_batch; ++k) out.push_back(SampleAt(base + k));
  return out;
}

}  // namespace nonstop::data
