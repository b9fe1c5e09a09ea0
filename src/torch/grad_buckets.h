// GradBuckets: overlapped gradient reduction for a FlatParameters module
// (issue 11, docs/python.md "Gradient buckets" describes the same scheme).
//
// The gradient buffer is cut into buckets of contiguous ranges from its end
// to its start: backward produces the last layers' gradients first, and the
// loss slot (after the gradients) rides in bucket 0. A post-hook on each
// parameter's gradient accumulator counts the bucket's gradients; when a
// bucket is complete, and every bucket before it was started, `start` is
// called with it (nonstop::Session::StartAllReduce), while backward goes on.
// Finish() starts what is left (parameters the backward did not reach: an
// expert no token chose) so every rank starts every bucket, in bucket order.
//
// Thread-safety: the hooks run on the thread that runs backward (for CPU
// tensors, the caller's); Arm/Finish on the training thread between backwards.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "torch/flat_parameters.h"

namespace nonstop::torchx {

class GradBuckets {
 public:
  using Start = std::function<void(std::span<float>)>;

  // `flat` and `module` must outlive this; `module` is the one `flat` was built from.
  GradBuckets(torch::nn::Module& module, FlatParameters& flat, size_t bucket_bytes, Start start);
  ~GradBuckets();
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;

  // The next backward is the step's last: its hooks start the buckets.
  void Arm();
  // After that backward: starts every bucket not started yet, in order.
  void Finish();
  // That backward was cut short (torchx::StepAborted): its step is lost and
  // the buckets it did not start never will be. Until the next Arm(),
  // backwards only accumulate, as before it.
  void Disarm() { armed_ = false; }

  size_t num_buckets() const { return buckets_.size(); }
  // [begin, end) in floats of bucket b in the gradient buffer (with the loss slot).
  std::pair<size_t, size_t> bucket(size_t b) const { return buckets_[b]; }

 private:
  void OnReady(size_t param);
  void StartReady();

  FlatParameters& flat_;
  Start start_;
  std::vector<torch::Tensor> params_;
  // kept: the hooks live on them
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<std::pair<size_t, size_t>> buckets_;
  std::vector<size_t> bucket_of_;  // parameter → bucket
  std::vector<size_t> size_;       // parameters per bucket
  std::vector<size_t> pending_;
  std::vector<bool> ready_;
  size_t next_ = 0;
  bool armed_ = false;
  std::shared_ptr<bool> alive_;  // hooks that outlive this object (held by autograd) do nothing
};

}  // namespace nonstop::torchx
