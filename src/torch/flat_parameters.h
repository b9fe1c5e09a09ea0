// FlatParameters: a LibTorch module's parameters and gradients re-homed into
// two contiguous fp32 buffers (docs/design-notes.md "Gradients live in one flat buffer").
//
// Every parameter becomes a view into `params` and every gradient a view into
// `grads`, so one allreduce covers all gradients with no packing copy, the
// optimizer runs over flat spans, and the state registry registers three
// buffers instead of hundreds of tensors. The gradient buffer has one extra
// float after the gradients, the loss slot, so the step's loss is reduced by
// the same allreduce as the gradients.
//
// Thread-safety: none; the training thread owns it.
#pragma once

#include <torch/torch.h>

#include <span>
#include <string>
#include <vector>

namespace nonstop::torchx {

struct ParamSegment {
  std::string name;
  size_t offset = 0;  // in floats
  size_t size = 0;
  bool decay = false;  // weight decay applies (matrices; not norms)
};

class FlatParameters {
 public:
  // `pad_to`: both buffers are padded with zeros to a multiple of it
  // (padded_size(): the gradients, the loss slot and the padding), so that
  // sharded state (docs/sharding.md) cuts them into equal shards.
  explicit FlatParameters(torch::nn::Module& module, size_t pad_to = 1);
  FlatParameters(const FlatParameters&) = delete;
  FlatParameters& operator=(const FlatParameters&) = delete;

  size_t size() const { return segments_.empty() ? 0 : total_; }
  std::span<float> params() { return {flat_params_.data_ptr<float>(), total_}; }
  std::span<float> grads() { return {flat_grads_.data_ptr<float>(), total_}; }
  std::span<float> grads_and_loss() { return {flat_grads_.data_ptr<float>(), total_ + 1}; }
  size_t padded_size() const { return padded_; }
  std::span<float> padded_params() { return {flat_params_.data_ptr<float>(), padded_}; }
  std::span<float> padded_grads() { return {flat_grads_.data_ptr<float>(), padded_}; }
  float& loss_slot() { return flat_grads_.data_ptr<float>()[total_]; }
  const std::vector<ParamSegment>& segments() const { return segments_; }

  void ZeroGrad();
  // Autograd accumulates into the views in place; if a gradient was ever
  // replaced by a new tensor, this copies it back into the flat buffer.
  void GatherGrads();
  // The same for parameter i (in named_parameters() order) alone.
  void GatherGrad(size_t i);
  // CRC-32C of the parameter bytes, as 8 hex digits.
  std::string Checksum() const;

 private:
  std::vector<torch::Tensor> tensors_;
  std::vector<ParamSegment> segments_;
  size_t total_ = 0;
  size_t padded_ = 1;          // total + 1, rounded up to a multiple of pad_to
  torch::Tensor flat_params_;  // [padded]: parameters, then zeros
  torch::Tensor flat_grads_;   // [padded]: gradients, the loss slot, then zeros
};

}  // namespace nonstop::torchx
