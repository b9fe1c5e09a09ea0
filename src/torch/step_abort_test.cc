// StepAbort: the abort flag stops a forward between layers and a backward
// from inside, with StepAborted; autograd, the gradients and GradBuckets are
// exact again at the next backward.
#include "torch/step_abort.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "torch/flat_parameters.h"
#include "torch/grad_buckets.h"

namespace nonstop::torchx {
namespace {

namespace nn = torch::nn;

// Three layers; the forward checks between them as the trainer's model does.
struct NetImpl : nn::Module {
  NetImpl() {
    l1 = register_module("l1", nn::Linear(8, 16));
    l2 = register_module("l2", nn::Linear(16, 16));
    l3 = register_module("l3", nn::Linear(16, 4));
  }
  // `on_h2`: called with the gradient of l2's output when backward reaches it.
  torch::Tensor forward(const torch::Tensor& x, const StepAbort* abort = nullptr,
                        std::function<void()> on_h2 = nullptr) {
    auto check = [&] {
      if (abort) abort->Check();
    };
    check();
    auto h1 = torch::tanh(l1(x));
    check();
    auto h2 = torch::tanh(l2(h1));
    if (on_h2) {
      h2.register_hook([on_h2](const torch::Tensor& g) {
        on_h2();
        return g;
      });
    }
    check();
    return l3(h2);
  }
  nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
TORCH_MODULE(Net);

Net MakeNet() {
  torch::manual_seed(7);
  return Net();
}

torch::Tensor Input(int seed) {
  torch::manual_seed(seed);
  return torch::randn({5, 8});
}

// The gradients of a fresh net for input x: what an exact backward gives.
std::vector<torch::Tensor> ReferenceGrads(const torch::Tensor& x) {
  Net ref = MakeNet();
  ref->forward(x).pow(2).sum().backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : ref->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

void ExpectGradsEqual(Net& net, const std::vector<torch::Tensor>& expected) {
  auto params = net->parameters();
  ASSERT_EQ(params.size(), expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined()) << "parameter " << i;
    EXPECT_TRUE(torch::equal(params[i].grad(), expected[i])) << "parameter " << i;
  }
}

TEST(StepAbortTest, TheForwardCheckThrowsOnlyOnceAborted) {
  Net net = MakeNet();
  std::atomic<bool> aborted{false};
  StepAbort abort(*net, [&] { return aborted.load(); });
  EXPECT_NO_THROW(net->forward(Input(1), &abort));
  aborted = true;
  EXPECT_THROW(net->forward(Input(1), &abort), StepAborted);
}

TEST(StepAbortTest, AnAbortDuringBackwardThrowsFromInsideItAndTheNextBackwardIsExact) {
  Net net = MakeNet();
  std::atomic<bool> aborted{false};
  StepAbort abort(*net, [&] { return aborted.load(); });
  const auto x = Input(1);
  // The abort arrives while backward is between l3 and l2.
  auto loss = net->forward(x, &abort, [&] { aborted = true; }).pow(2).sum();
  EXPECT_THROW(loss.backward(), StepAborted);
  // Stopped inside: the first layer's gradients were never computed.
  EXPECT_FALSE(net->l1->weight.grad().defined()) << "the backward ran to its end";
  EXPECT_FALSE(net->l1->bias.grad().defined());

  // The next generation: the flag is clear again, the gradients zeroed.
  aborted = false;
  net->zero_grad();
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  net->forward(x, &abort).pow(2).sum().backward();
  ExpectGradsEqual(net, ReferenceGrads(x));
  // And again: nothing of the aborted graph lingers in autograd.
  net->zero_grad();
  net->forward(x, &abort).pow(2).sum().backward();
  ExpectGradsEqual(net, ReferenceGrads(x));
}

TEST(StepAbortTest, HooksOfADestroyedStepAbortDoNothing) {
  Net net = MakeNet();
  std::atomic<bool> aborted{true};
  {
    StepAbort abort(*net, [&] { return aborted.load(); });
  }
  const auto x = Input(2);
  EXPECT_NO_THROW(net->forward(x).pow(2).sum().backward());
  ExpectGradsEqual(net, ReferenceGrads(x));
}

// The trainer's overlapped reduction: an aborted last backward leaves some
// buckets unstarted; after Disarm, the next step's accumulating backwards
// start none, and its last one starts every bucket once, in order, with
// exact sums.
TEST(StepAbortTest, GradBucketsDisarmedAfterAnAbortedBackwardStartEveryBucketOnceNextStep) {
  Net net = MakeNet();
  FlatParameters flat(*net);
  std::atomic<bool> aborted{false};
  StepAbort abort(*net, [&] { return aborted.load(); });
  std::vector<size_t> started;  // bucket begin offsets, in the order started
  GradBuckets buckets(*net, flat, /*bucket_bytes=*/16 * 16 * sizeof(float),
                      [&](std::span<float> b) {
                        started.push_back(static_cast<size_t>(b.data() - flat.grads().data()));
                      });
  ASSERT_GT(buckets.num_buckets(), 1u);
  const auto x1 = Input(3), x2 = Input(4);

  flat.ZeroGrad();
  buckets.Arm();
  auto loss = net->forward(x1, &abort, [&] { aborted = true; }).pow(2).sum();
  EXPECT_THROW(loss.backward(), StepAborted);
  EXPECT_LT(started.size(), buckets.num_buckets()) << "the aborted backward started every bucket";
  buckets.Disarm();

  aborted = false;
  started.clear();
  flat.ZeroGrad();
  net->forward(x1, &abort).pow(2).sum().backward();  // an earlier micro-batch: accumulates only
  EXPECT_TRUE(started.empty()) << "a backward before Arm() started a bucket";
  buckets.Arm();
  net->forward(x2, &abort).pow(2).sum().backward();
  buckets.Finish();
  ASSERT_EQ(started.size(), buckets.num_buckets());
  for (size_t b = 0; b < started.size(); ++b) EXPECT_EQ(started[b], buckets.bucket(b).first);

  Net ref = MakeNet();
  ref->forward(x1).pow(2).sum().backward();
  ref->forward(x2).pow(2).sum().backward();
  auto params = net->parameters();
  auto expected = ref->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(params[i].grad(), expected[i].grad())) << "parameter " << i;
  }
}

}  // namespace
}  // namespace nonstop::torchx
