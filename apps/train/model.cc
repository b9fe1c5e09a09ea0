#include "apps/train/model.h"

#include <cmath>

namespace nonstop::train {

namespace {

namespace nn = torch::nn;
using torch::Tensor;
using torch::indexing::Slice;

struct RMSNormImpl : nn::Module {
  RMSNormImpl(int64_t dim, double eps) : eps(eps) {
    weight = register_parameter("weight", torch::ones({dim}));
  }
  Tensor forward(const Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
  }
  double eps;
  Tensor weight;
};
TORCH_MODULE(RMSNorm);

// Rotary embeddings, "rotate half" form: pairs (x[i], x[i + d/2]).
struct Rotary {
  Tensor cos, sin;  // [seq, head_dim]
  Rotary(int64_t seq, int64_t head_dim, double theta) {
    auto inv = torch::pow(
        theta, -torch::arange(0, head_dim, 2, torch::kFloat64) / static_cast<double>(head_dim));
    auto t = torch::arange(seq, torch::kFloat64);
    auto freqs = torch::outer(t, inv);  // [seq, head_dim/2]
    auto emb = torch::cat({freqs, freqs}, -1);
    cos = emb.cos().to(torch::kFloat32);
    sin = emb.sin().to(torch::kFloat32);
  }
  // x: [batch, heads, seq, head_dim]
  Tensor Apply(const Tensor& x) const {
    int64_t seq = x.size(2);
    int64_t half = x.size(3) / 2;
    auto x1 = x.index({"...", Slice(0, half)});
    auto x2 = x.index({"...", Slice(half, torch::indexing::None)});
    auto rotated = torch::cat({-x2, x1}, -1);
    auto c = cos.index({Slice(0, seq)});
    auto s = sin.index({Slice(0, seq)});
    return x * c + rotated * s;
  }
};

struct AttentionImpl : nn::Module {
  AttentionImpl(const ModelConfig& c)
      : n_heads(c.n_heads),
        n_kv(c.n_kv_heads),
        head_dim(c.dim / c.n_heads),
        rope(c.seq_len, c.dim / c.n_heads, c.rope_theta) {
    wq =
        register_module("wq", nn::Linear(nn::LinearOptions(c.dim, n_heads * head_dim).bias(false)));
    wk = register_module("wk", nn::Linear(nn::LinearOptions(c.dim, n_kv * head_dim).bias(false)));
    wv = register_module("wv", nn::Linear(nn::LinearOptions(c.dim, n_kv * head_dim).bias(false)));
    wo =
        register_module("wo", nn::Linear(nn::LinearOptions(n_heads * head_dim, c.dim).bias(false)));
  }
  Tensor forward(const Tensor& x) {  // [b, s, dim]
    int64_t b = x.size(0), s = x.size(1);
    auto q = wq(x).view({b, s, n_heads, head_dim}).transpose(1, 2);
    auto k = wk(x).view({b, s, n_kv, head_dim}).transpose(1, 2);
    auto v = wv(x).view({b, s, n_kv, head_dim}).transpose(1, 2);
    q = rope.Apply(q);
    k = rope.Apply(k);
    // grouped-query attention: each kv head serves n_heads / n_kv query heads
    if (n_kv != n_heads) {
      k = k.repeat_interleave(n_heads / n_kv, /*dim=*/1);
      v = v.repeat_interleave(n_heads / n_kv, /*dim=*/1);
    }
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    auto mask = torch::ones({s, s}, torch::kBool).triu(1);
    scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
    auto out = torch::matmul(torch::softmax(scores, -1), v);  // [b, h, s, hd]
    return wo(out.transpose(1, 2).contiguous().view({b, s, n_heads * head_dim}));
  }
  int64_t n_heads, n_kv, head_dim;
  Rotary rope;
  nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
};
TORCH_MODULE(Attention);

struct SwiGLUImpl : nn::Module {
  SwiGLUImpl(int64_t dim, int64_t hidden) {
    w1 = register_module("w1", nn::Linear(nn::LinearOptions(dim, hidden).bias(false)));
    w3 = register_module("w3", nn::Linear(nn::LinearOptions(dim, hidden).bias(false)));
    w2 = register_module("w2", nn::Linear(nn::LinearOptions(hidden, dim).bias(false)));
  }
  Tensor forward(const Tensor& x) { return w2(torch::silu(w1(x)) * w3(x)); }
  nn::Linear w1{nullptr}, w3{nullptr}, w2{nullptr};
};
TORCH_MODULE(SwiGLU);

// Mixture of experts with top-k routing (GPT-OSS style: softmax over the
// selected logits). Tokens are gathered per expert, so an expert only
// computes the tokens routed to it.
struct MoEImpl : nn::Module {
  MoEImpl(const ModelConfig& c) : top_k(c.top_k) {
    router =
        register_module("router", nn::Linear(nn::LinearOptions(c.dim, c.n_experts).bias(false)));
    for (int64_t e = 0; e < c.n_experts; ++e) {
      experts.push_back(register_module("expert" + std::to_string(e), SwiGLU(c.dim, c.ffn_hidden)));
    }
  }
  Tensor forward(const Tensor& x) {  // [b, s, dim]
    auto shape = x.sizes().vec();
    auto flat = x.reshape({-1, x.size(-1)});                    // [tokens, dim]
    auto logits = router(flat);                                 // [tokens, experts]
    auto [top_vals, top_idx] = logits.topk(top_k, /*dim=*/-1);  // [tokens, k]
    auto weights = torch::softmax(top_vals, -1);                // [tokens, k]
    auto out = torch::zeros_like(flat);
    for (size_t e = 0; e < experts.size(); ++e) {
      auto hit = top_idx.eq(static_cast<int64_t>(e));  // [tokens, k]
      auto rows = hit.any(-1).nonzero().squeeze(-1);   // tokens routed to e
      if (rows.numel() == 0) continue;
      auto w = (weights * hit.to(weights.dtype())).sum(-1).index_select(0, rows).unsqueeze(-1);
      auto y = experts[e]->forward(flat.index_select(0, rows)) * w;
      out = out.index_add(0, rows, y);
    }
    return out.view(shape);
  }
  int64_t top_k;
  nn::Linear router{nullptr};
  std::vector<SwiGLU> experts;
};
TORCH_MODULE(MoE);

struct BlockImpl : nn::Module {
  BlockImpl(const ModelConfig& c) {
    attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.norm_eps));
    attn = register_module("attn", Attention(c));
    ffn_norm = register_module("ffn_norm", RMSNorm(c.dim, c.norm_eps));
    if (c.arch == "gpt-oss") {
      moe = register_module("moe", MoE(c));
    } else {
      ffn = register_module("ffn", SwiGLU(c.dim, c.ffn_hidden));
    }
  }
  Tensor forward(Tensor x, const std::function<void()>& between_layers) {
    if (between_layers) between_layers();
    x = x + attn(attn_norm(x));
    if (between_layers) between_layers();
    auto h = ffn_norm(x);
    return x + (moe ? moe(h) : ffn(h));
  }
  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  Attention attn{nullptr};
  SwiGLU ffn{nullptr};
  MoE moe{nullptr};
};
TORCH_MODULE(Block);

class Transformer : public DecoderModel {
 public:
  explicit Transformer(const ModelConfig& c) {
    embed = register_module("embed", nn::Embedding(c.vocab_size, c.dim));
    for (int64_t i = 0; i < c.n_layers; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), Block(c)));
    norm = register_module("norm", RMSNorm(c.dim, c.norm_eps));
    head = register_module("head", nn::Linear(nn::LinearOptions(c.dim, c.vocab_size).bias(false)));
    // GPT-2 style initialisation: N(0, 0.02), residual projections scaled by depth.
    torch::NoGradGuard no_grad;
    double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layers));
    for (auto& item : named_parameters()) {
      const std::string& name = item.key();
      torch::Tensor& p = item.value();
      if (p.dim() < 2) continue;
      bool residual = name.find("wo.weight") != std::string::npos ||
                      name.find("w2.weight") != std::string::npos;
      p.normal_(0.0, residual ? residual_std : 0.02);
    }
  }
  Tensor forward(const Tensor& tokens) override {
    auto x = embed(tokens);
    for (auto& b : blocks) x = b(x, between_layers_);
    if (between_layers_) between_layers_();
    return head(norm(x));
  }

 private:
  nn::Embedding embed{nullptr};
  std::vector<Block> blocks;
  RMSNorm norm{nullptr};
  nn::Linear head{nullptr};
};

}  // namespace

std::shared_ptr<DecoderModel> BuildModel(const ModelConfig& config, uint64_t seed) {
  torch::manual_seed(seed);
  return std::make_shared<Transformer>(config);
}

}  // namespace nonstop::train
