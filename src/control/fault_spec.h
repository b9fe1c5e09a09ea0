// Fault injection specs, for tests, demos and benchmarks (`nonstop run --inject`).
//
//   kill:rank=2,step=30                 SIGKILL itself before the allreduce of step 30
//   hang:rank=1,step=50                 SIGSTOP itself there (a hung process)
//   stall:rank=1,step=50                its training thread stops there for good while
//                                       its I/O thread goes on (a deadlocked loop)
//   spin:rank=1,step=50                 its training thread spins there for good, on a
//                                       core, while its I/O thread goes on (a livelock)
//   exception:rank=0,step=12            throw from the training loop at step 12
//   drop:rank=3,step=7                  close its data connections at step 7
//   kill:rank=1,step=30,during=transfer die while taking part in the state
//                                       transfer of a recovery that resumes at step 30
//   kill:rank=1,during=transfer         … in the next state transfer, whatever its step
//   corrupt:rank=1,step=30              as a source in that transfer, corrupt the
//                                       first chunk it sends (after checksumming)
//   bitflip:rank=1,step=30              flip one bit of its registered state before the
//                                       reduction of step 30, as a faulty memory cell would
//   bitflip:rank=1,step=30,tensor=NAME  … in region NAME (default: the first fp32 region,
//                                       the parameters); the replica check finds it
//   kill:rank=2,time=5.5                the launcher kills rank 2 5.5 s after the job started
//   hang:rank=2,time=5.5                … or stops it
// Several faults are separated by ';' (or given as several --inject flags).
// Each fault fires once per job, on whichever worker holds `rank` then.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::control {

enum class FaultKind {
  kKill,
  kHang,
  kException,
  kDrop,
  kCorrupt,
  kStall,
  kSpin,
  kBitflip,
  kWireflip
};
enum class FaultPoint { kStep, kTransfer, kTime };

struct FaultSpec {
  int id = 0;  // position in the job's list; reported when the fault fires
  FaultKind kind = FaultKind::kKill;
  int rank = 0;
  int64_t step = -1;
  double time_seconds = -1;
  FaultPoint point = FaultPoint::kStep;
  // kill/hang at a step: fire this fraction of a step into it (0: as it starts; the step's length
  // taken as the last one's), instead of just before its reduction (-1).
  double at = -1;
  // bitflip: the registered region to flip a bit in, of any dtype (empty: the first fp32 one, else
  // the largest replicated one).
  std::string tensor;
  // wireflip: the ring phase whose last step's first piece this rank sends
  // with a bit flipped on the wire (phase=gather, the default, or reduce).
  bool gather_phase = true;
};

// How a worker's FailureMsg (exit code 2) that reports an injected fault it cannot carry out
// begins: the controller ends the job with exit 2 on it, naming why.
inline constexpr std::string_view kCannotInject = "the injected fault ";

Result<std::vector<FaultSpec>> ParseFaults(std::string_view text, int first_id = 0);
std::string FormatFault(const FaultSpec& f);
std::string_view FaultKindName(FaultKind k);

}  // namespace nonstop::control
