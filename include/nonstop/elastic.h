// How the batch and the learning rate follow the world size (docs/architecture.md "Elasticity").
//
// kFixed (the default): the global batch B and the micro-batch size stay
// fixed whatever the world size; only the number of micro-batches each rank
// processes changes (unevenly where it does not divide). The learning-rate
// schedule is untouched, and the samples of every step are the same as at
// any other world size.
//
// kScaleWithWorld: each rank keeps its own batch (B / base_world samples), so
// the global batch follows the world size; the learning rate is scaled by
// the world-size ratio (linear) or its square root (sqrt), with a short
// linear warm-up from the old factor to the new one after each change. The
// sample stream is then consumed by position, so that no sample is skipped or
// repeated across changes.
//
// Pure functions of their arguments (implemented by src/elastic/): the
// training program keeps the batch state (base world, samples consumed, the
// factor warmed from) in its StateRegistry, so that joiners and resumed jobs
// carry on exactly. Thread-safety: none needed.
#pragma once

#include <cstdint>
#include <string>

#include "nonstop/status.h"

namespace nonstop::elastic {

enum class BatchMode { kFixed, kScaleWithWorld };
enum class LrScaling { kLinear, kSqrt };

Result<BatchMode> ParseBatchMode(const std::string& text);
Result<LrScaling> ParseLrScaling(const std::string& text);

// Global batch at `world` ranks; base_batch is the recipe's global batch at base_world.
uint64_t GlobalBatch(BatchMode mode, uint64_t base_batch, int base_world, int world);

// The learning-rate multiplier at `world` ranks.
double LrFactor(BatchMode mode, LrScaling scaling, int base_world, int world);

// The multiplier in effect at `step` when the world changed at `change_step`
// (the first step of the new world) from factor `from` to `to`, warming up
// linearly over `warmup_steps` steps.
double WarmedFactor(double from, double to, int64_t step, int64_t change_step,
                    int64_t warmup_steps);

}  // namespace nonstop::elastic
