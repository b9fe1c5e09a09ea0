#include "torch/grad_buckets.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/check.h"

namespace nonstop::torchx {

GradBuckets::GradBuckets(torch::nn::Module& module, FlatParameters& flat, size_t bucket_bytes,
                         Start start)
    : flat_(flat), start_(std::move(start)), alive_(std::make_shared<bool>(true)) {
  for (auto& item : module.named_parameters()) params_.push_back(item.value());
  const auto& segments = flat_.segments();
  NONSTOP_CHECK(segments.size() == params_.size())
      << "GradBuckets needs the module FlatParameters was built from";
  const size_t cap = std::max<size_t>(1, bucket_bytes / sizeof(float));
  // From the end of the buffer: the loss slot, then the parameters in reverse.
  bucket_of_.assign(params_.size(), 0);
  size_t end = flat_.size() + 1;  // the loss slot ends bucket 0
  size_t begin = flat_.size();
  size_t in_bucket = 0;  // parameters in [begin, end)
  for (size_t i = params_.size(); i-- > 0;) {
    const auto& seg = segments[i];
    if (in_bucket > 0 && end - seg.offset > cap) {
      buckets_.push_back({begin, end});
      end = begin;
      in_bucket = 0;
    }
    begin = seg.offset;
    bucket_of_[i] = buckets_.size();
    ++in_bucket;
  }
  buckets_.push_back({begin, end});
  size_.assign(buckets_.size(), 0);
  for (size_t b : bucket_of_) ++size_[b];
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    NONSTOP_CHECK(accumulator != nullptr) << segments[i].name << " has no gradient accumulator";
    std::weak_ptr<bool> alive = alive_;
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i, alive](const torch::autograd::variable_list& outputs,
                         const torch::autograd::variable_list&) {
          if (alive.lock()) OnReady(i);
          return outputs;
        }));
    accumulators_.push_back(std::move(accumulator));
  }
}

GradBuckets::~GradBuckets() { alive_.reset(); }

void GradBuckets::Arm() {
  pending_ = size_;
  ready_.assign(params_.size(), false);
  next_ = 0;
  armed_ = true;
}

void GradBuckets::OnReady(size_t param) {
  if (!armed_ || ready_[param]) return;
  flat_.GatherGrad(param);
  ready_[param] = true;
  --pending_[bucket_of_[param]];
  StartReady();
}

void GradBuckets::StartReady() {
  while (next_ < buckets_.size() && pending_[next_] == 0) {
    auto [begin, end] = buckets_[next_];
    start_(flat_.grads_and_loss().subspan(begin, end - begin));
    ++next_;
  }
}

void GradBuckets::Finish() {
  // no backward this step (no micro-batch for this rank): zeros, in every bucket
  if (!armed_) Arm();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    flat_.GatherGrad(i);
    ready_[i] = true;
    --pending_[bucket_of_[i]];
  }
  StartReady();
  armed_ = false;
}

}  // namespace nonstop::torchx
