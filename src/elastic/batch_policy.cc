#include "nonstop/elastic.h"

#include <cmath>

namespace nonstop::elastic {

Result<BatchMode> ParseBatchMode(const std::string& text) {
  if (text == "fixed") return BatchMode::kFixed;
  if (text == "scale-with-world") return BatchMode::kScaleWithWorld;
  return InvalidArgumentError("train.batch: must be 'fixed' or 'scale-with-world', got '" + text +
                              "'");
}

Result<LrScaling> ParseLrScaling(const std::string& text) {
  if (text == "linear") return LrScaling::kLinear;
  if (text == "sqrt") return LrScaling::kSqrt;
  return InvalidArgumentError("train.lr_scaling: must be 'linear' or 'sqrt', got '" + text + "'");
}

uint64_t GlobalBatch(BatchMode mode, uint64_t base_batch, int base_world, int world) {
  if (mode == BatchMode::kFixed) return base_batch;
  return base_batch / static_cast<uint64_t>(base_world) * static_cast<uint64_t>(world);
}

double LrFactor(BatchMode mode, LrScaling scaling, int base_world, int world) {
  if (mode == BatchMode::kFixed) return 1.0;
  double ratio = static_cast<double>(world) / static_cast<double>(base_world);
  return scaling == LrScaling::kLinear ? ratio : std::sqrt(ratio);
}

double WarmedFactor(double from, double to, int64_t step, int64_t change_step,
                    int64_t warmup_steps) {
  if (warmup_steps <= 0 || step >= change_step + warmup_steps) return to;
  if (step < change_step) return from;
  double t = static_cast<double>(step - change_step + 1) / static_cast<double>(warmup_steps);
  return from + (to - from) * t;
}

}  // namespace nonstop::elastic
