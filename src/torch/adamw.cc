#include "torch/adamw.h"

#include <algorithm>
#include <cmath>

namespace nonstop::torchx {

AdamW::AdamW(size_t size, std::vector<ParamSegment> segments, AdamWOptions options)
    : segments_(std::move(segments)), options_(options), m_(size, 0.0f), v_(size, 0.0f) {}

void AdamW::Step(std::span<float> params, std::span<const float> grads, double lr, int64_t step,
                 size_t offset) {
  const auto b1 = static_cast<float>(options_.beta1);
  const auto b2 = static_cast<float>(options_.beta2);
  const auto eps = static_cast<float>(options_.eps);
  const auto c1 = static_cast<float>(1.0 - std::pow(options_.beta1, static_cast<double>(step)));
  const auto c2 = static_cast<float>(1.0 - std::pow(options_.beta2, static_cast<double>(step)));
  const auto lr_f = static_cast<float>(lr);
  const size_t end = offset + m_.size();
  for (const auto& seg : segments_) {
    // The part of the segment in [offset, end).
    const size_t lo = std::max(seg.offset, offset), hi = std::min(seg.offset + seg.size, end);
    if (lo >= hi) continue;
    const float decay = seg.decay ? static_cast<float>(1.0 - lr * options_.weight_decay) : 1.0f;
    float* __restrict p = params.data() + lo;
    const float* __restrict g = grads.data() + lo;
    float* __restrict m = m_.data() + (lo - offset);
    float* __restrict v = v_.data() + (lo - offset);
    for (size_t i = 0; i < hi - lo; ++i) {
      m[i] = b1 * m[i] + (1.0f - b1) * g[i];
      v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
      float mhat = m[i] / c1;
      float vhat = v[i] / c2;
      p[i] = p[i] * decay - lr_f * mhat / (std::sqrt(vhat) + eps);
    }
  }
}

double ClipGradNorm(std::span<float> grads, double max_norm) {
  double sq = 0;
  for (float g : grads) sq += static_cast<double>(g) * g;
  double norm = std::sqrt(sq);
  if (max_norm > 0 && norm > max_norm) {
    auto scale = static_cast<float>(max_norm / (norm + 1e-6));
    for (float& g : grads) g *= scale;
  }
  return norm;
}

double LrSchedule::At(int64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  double progress =
      std::min(1.0, static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps));
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace nonstop::torchx
