#include "controller/script_failures.h"

#include <gtest/gtest.h>

namespace nonstop::controller {
namespace {

const Clock::time_point kT0 = Clock::time_point() + std::chrono::hours(1);

FailureReport Raised(int rank, int64_t step, std::string reason, std::string frame,
                     Clock::time_point at = kT0) {
  std::string traceback =
      "Traceback (most recent call last):\n  File \"/job/train.py\", line 9, in "
      "<module>\n    main()\n  " +
      frame + "\n    raise\n" + reason + "\n";
  return {rank, rank, step, std::move(reason), frame.empty() ? "" : std::move(traceback), at};
}

// The same bug raised with a message that names the rank or the sample is the same failure when
// the script's own line raised it; a library's line (every error from loss.backward() ends in
// torch's autograd) says nothing, and the messages must then agree.
TEST(ScriptFailuresTest, TheSameLineOfTheScriptIsTheSameFailureALibrarysIsNot) {
  const std::string script = "File \"/job/train.py\", line 40, in load";
  const std::string library =
      "File \"/usr/lib/python3/dist-packages/torch/autograd/graph.py\", line 744, in _engine_run";
  EXPECT_TRUE(SameFailure(Raised(0, 5, "ValueError: sample 3 is malformed", script),
                          Raised(1, 5, "ValueError: sample 9 is malformed", script)));
  EXPECT_FALSE(SameFailure(Raised(0, 5, "ValueError: sample 3 is malformed", script),
                           Raised(1, 5, "KeyError: sample 9", script)))
      << "another type";
  EXPECT_FALSE(
      SameFailure(Raised(0, 5, "RuntimeError: CUDA error: an illegal memory access", library),
                  Raised(0, 9, "RuntimeError: NCCL error: unhandled system error", library)));
  EXPECT_TRUE(SameFailure(Raised(0, 5, "RuntimeError: CUDA error", library),
                          Raised(0, 9, "RuntimeError: CUDA error", library)));
  EXPECT_FALSE(SameFailure(Raised(0, 5, "ValueError: a", ""), Raised(0, 5, "ValueError: b", "")));
}

TEST(ScriptFailuresTest, ARepeatIsOnTheSameRankOrAtTheSameStepWithinTheMemory) {
  ScriptFailures f;
  const Millis memory(600'000);
  const std::string line = "File \"/job/train.py\", line 40, in load";
  EXPECT_EQ(f.Record(Raised(1, 5, "ValueError: x", line), memory), 0);
  EXPECT_EQ(f.Record(Raised(1, 7, "ValueError: x", line, kT0 + Millis(1000)), memory), 1)
      << "the same rank";
  EXPECT_EQ(f.Record(Raised(2, 5, "ValueError: x", line, kT0 + Millis(2000)), memory), 1)
      << "the same step only (rank 2 at step 5)";
  EXPECT_EQ(f.Record(Raised(3, 8, "ValueError: x", line, kT0 + Millis(3000)), memory), 0)
      << "another rank at another step";
  EXPECT_EQ(f.Record(Raised(1, 9, "ValueError: x", line, kT0 + Millis(700'000)), memory), 0)
      << "the earlier ones are past the memory";
}

TEST(ScriptFailuresTest, InjectedExceptionsAreNeverTheScripts) {
  ScriptFailures f;
  const Millis memory(600'000);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(f.Record(Raised(1, 5 + i, "InjectedFault: injected exception at step 5", ""), memory),
              0);
  }
  f.Hold(Raised(0, 5, "injected exception", ""), {0, 1}, Millis(300));
  f.Hold(Raised(1, 5, "injected exception", ""), {0, 1}, Millis(300));
  EXPECT_FALSE(f.EveryMemberRaised());
}

TEST(ScriptFailuresTest, EveryMemberRaisingTheSameAtOneStepAndAWorldOfOneIsNot) {
  ScriptFailures f;
  const std::string line = "File \"/job/train.py\", line 40, in load";
  f.Hold(Raised(0, 5, "ValueError: rank 0", line), {0, 1, 2}, Millis(300));
  f.Hold(Raised(1, 5, "ValueError: rank 1", line), {0, 1, 2}, Millis(300));
  EXPECT_FALSE(f.EveryMemberRaised());
  f.Hold(Raised(2, 6, "ValueError: rank 2", line), {0, 1, 2}, Millis(300));
  EXPECT_FALSE(f.EveryMemberRaised()) << "another step";
  f.Hold(Raised(2, 5, "ValueError: rank 2", line), {0, 1, 2}, Millis(300));
  EXPECT_TRUE(f.EveryMemberRaised());
  ScriptFailures one;
  one.Hold(Raised(0, 5, "ValueError: x", line), {0}, Millis(300));
  EXPECT_FALSE(one.EveryMemberRaised()) << "a world of one: a flaky node is replaced first";
}

}  // namespace
}  // namespace nonstop::controller
