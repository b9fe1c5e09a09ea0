#include "torch/flat_parameters.h"

#include <fmt/format.h>

#include "common/check.h"
#include "nonstop/crc32c.h"

namespace nonstop::torchx {

FlatParameters::FlatParameters(torch::nn::Module& module, size_t pad_to) {
  NONSTOP_CHECK(pad_to >= 1);
  for (auto& item : module.named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    NONSTOP_CHECK(p.scalar_type() == torch::kFloat32) << name << " is not fp32";
    segments_.push_back({name, total_, static_cast<size_t>(p.numel()), p.dim() >= 2});
    tensors_.push_back(p);
    total_ += static_cast<size_t>(p.numel());
  }
  padded_ = (total_ + 1 + pad_to - 1) / pad_to * pad_to;
  flat_params_ = torch::zeros({static_cast<int64_t>(padded_)}, torch::kFloat32);
  flat_grads_ = torch::zeros({static_cast<int64_t>(padded_)}, torch::kFloat32);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    auto& p = tensors_[i];
    const auto& seg = segments_[i];
    auto off = static_cast<int64_t>(seg.offset), n = static_cast<int64_t>(seg.size);
    auto pview = flat_params_.narrow(0, off, n).view(p.sizes());
    pview.copy_(p);
    p.set_data(pview);
    p.mutable_grad() = flat_grads_.narrow(0, off, n).view(p.sizes());
  }
}

void FlatParameters::ZeroGrad() { flat_grads_.zero_(); }

void FlatParameters::GatherGrads() {
  for (size_t i = 0; i < tensors_.size(); ++i) GatherGrad(i);
}

void FlatParameters::GatherGrad(size_t i) {
  torch::NoGradGuard no_grad;
  auto& p = tensors_[i];
  const auto& seg = segments_[i];
  auto view = [&] {
    return flat_grads_.narrow(0, static_cast<int64_t>(seg.offset), static_cast<int64_t>(seg.size))
        .view(p.sizes());
  };
  const auto& g = p.grad();
  if (!g.defined()) {
    p.mutable_grad() = view();
    return;  // unused this step (an expert no token chose): its gradient is zero
  }
  if (g.data_ptr<float>() == flat_grads_.data_ptr<float>() + seg.offset) return;
  auto v = view();
  v.copy_(g);
  p.mutable_grad() = v;
}

std::string FlatParameters::Checksum() const {
  return fmt::format("{:08x}", Crc32c(flat_params_.data_ptr<float>(), total_ * sizeof(float)));
}

}  // namespace nonstop::torchx
