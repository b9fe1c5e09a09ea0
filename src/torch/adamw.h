// AdamW over flat fp32 buffers, gradient clipping by global norm, and the
// learning-rate schedule (linear warm-up, cosine decay to min_lr). Plain
// loops in index order: deterministic, and with no LibTorch dependency.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "torch/flat_parameters.h"

namespace nonstop::torchx {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

class AdamW {
 public:
  // Moments for `size` parameters: all of them, or one shard (sharded state).
  AdamW(size_t size, std::vector<ParamSegment> segments, AdamWOptions options);

  // One update; `step` counts updates from 1 (bias correction). The moments
  // are those of parameters [offset, offset + size): only those are updated
  // (a shard of the whole `params` and `grads`; the padding after the last
  // segment is left alone). Element by element the same arithmetic, so a
  // shard's update has the same bits as the whole update has there.
  void Step(std::span<float> params, std::span<const float> grads, double lr, int64_t step,
            size_t offset = 0);

  std::span<float> exp_avg() { return m_; }
  std::span<float> exp_avg_sq() { return v_; }

 private:
  std::vector<ParamSegment> segments_;
  AdamWOptions options_;
  std::vector<float> m_, v_;
};

// Scales `grads` so that their L2 norm is at most `max_norm` (0: no clipping).
// Returns the norm before clipping.
double ClipGradNorm(std::span<float> grads, double max_norm);

struct LrSchedule {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double At(int64_t step) const;  // step counts from 0
};

}  // namespace nonstop::torchx
