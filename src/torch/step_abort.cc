#include "torch/step_abort.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/check.h"

namespace nonstop::torchx {

const char* StepAborted::what() const noexcept {
  return "the generation was aborted (a member failed): the step in flight is lost";
}

StepAbort::StepAbort(torch::nn::Module& module, Aborted aborted)
    : aborted_(std::move(aborted)), alive_(std::make_shared<bool>(true)) {
  NONSTOP_CHECK(aborted_ != nullptr) << "StepAbort needs the abort flag to check";
  for (auto& item : module.named_parameters()) {
    if (!item.value().requires_grad()) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(item.value());
    NONSTOP_CHECK(accumulator != nullptr) << item.key() << " has no gradient accumulator";
    std::weak_ptr<bool> alive = alive_;
    // A post-hook: it runs once the gradient is accumulated, as each
    // parameter's gradient is produced, all through backward.
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, alive](const torch::autograd::variable_list& outputs,
                      const torch::autograd::variable_list&) {
          if (alive.lock()) Check();
          return outputs;
        }));
    accumulators_.push_back(std::move(accumulator));
  }
}

StepAbort::~StepAbort() { alive_.reset(); }

}  // namespace nonstop::torchx
