// StepAbort: a forward or backward that stops within a layer of the
// controller's abort (issue 27, docs/recovery.md "Abort").
//
// A survivor learns of a fault on its session's I/O thread (the controller's
// Abort, or a peer's connection reset), which fires the session's abort flag
// (Session::aborted(), one atomic load). Checked only between micro-batches,
// a survivor in the middle of a long forward and backward finished them
// before it answered, and the recovery waits for every survivor. StepAbort
// checks the flag inside them too:
//   forward   the model calls Check() between its layers;
//   backward  a post-hook on every parameter's gradient accumulator checks it
//             as each gradient is accumulated (the hooks GradBuckets uses).
// When the flag is set, they throw StepAborted. Out of backward, LibTorch's
// engine carries it to the caller of backward() as it is (it stores the
// exception and rethrows it), and autograd stays usable: the graph of the
// aborted micro-batch is freed, and the next backward runs as usual
// (step_abort_test.cc). The trainer catches it as the abort seen between
// micro-batches: the step is cut short, nothing failed.
//
// Gradients: an aborted backward has accumulated some parameters' gradients
// of the micro-batch it was in and not others; whoever keeps the sums of a
// cut step must not count that micro-batch.
//
// Thread-safety: the check is safe from any thread (`aborted` must be); the
// hooks run on the thread that runs backward. Construct and destroy on the
// training thread, between backwards.
#pragma once

#include <torch/torch.h>

#include <exception>
#include <functional>
#include <memory>
#include <vector>

namespace nonstop::torchx {

// Thrown out of forward or backward when the generation was aborted: the
// step in flight is lost. Not a failure of this process.
class StepAborted : public std::exception {
 public:
  const char* what() const noexcept override;
};

class StepAbort {
 public:
  using Aborted = std::function<bool()>;

  // `module` must outlive this; `aborted` is called at every check (cheap:
  // Session::aborted() is an atomic load).
  StepAbort(torch::nn::Module& module, Aborted aborted);
  ~StepAbort();
  StepAbort(const StepAbort&) = delete;
  StepAbort& operator=(const StepAbort&) = delete;

  // Throws StepAborted if the generation was aborted (forward, between layers).
  void Check() const {
    if (aborted_()) throw StepAborted();
  }

 private:
  Aborted aborted_;
  // kept: the hooks live on them
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::shared_ptr<bool> alive_;  // hooks that outlive this object (held by autograd) do nothing
};

}  // namespace nonstop::torchx
