// The reference models, in LibTorch (CPU):
//   llama    RMSNorm, rotary position embeddings, grouped-query attention,
//            SwiGLU feed-forward, untied output head.
//   gpt-oss  the same attention stack with a mixture-of-experts feed-forward:
//            a linear router, softmax over the top-k logits, small SwiGLU
//            experts; each token's output is the weighted sum of its k experts.
// Shapes are written [batch, seq, dim]. All randomness comes from the seed
// passed to BuildModel, so every rank builds identical parameters.
#pragma once

#include <torch/torch.h>

#include <functional>

#include "apps/train/recipe.h"

namespace nonstop::train {

class TransformerImpl;

// Returns logits [batch, seq, vocab] for tokens [batch, seq].
class DecoderModel : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& tokens) = 0;
  // Called between the layers of every forward (before each attention, each
  // feed-forward and the output head): the trainer's torchx::StepAbort::Check,
  // which throws there once the generation was aborted.
  void set_between_layers(std::function<void()> f) { between_layers_ = std::move(f); }

 protected:
  std::function<void()> between_layers_;  // empty: nothing is called
};

std::shared_ptr<DecoderModel> BuildModel(const ModelConfig& config, uint64_t seed);

}  // namespace nonstop::train
