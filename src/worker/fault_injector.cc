#include "worker/fault_injector.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>

#include <fmt/format.h>

#include "common/logging.h"
#include "control/messages.h"

namespace nonstop::worker {

using control::FaultKind;
using control::FaultPoint;
using control::FaultSpec;

void FaultInjector::SetFaults(std::vector<FaultSpec> faults) {
  MutexLock lock(&mu_);
  faults_ = std::move(faults);
}

std::optional<FaultSpec> FaultInjector::Take(FaultPoint point, int64_t step, int rank,
                                             FaultKind kind, bool timed_only) {
  MutexLock lock(&mu_);
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    const bool step_matches = it->step == step || (point == FaultPoint::kTransfer && it->step < 0);
    if (timed_only && it->at < 0) continue;
    if (it->point == point && step_matches && it->rank == rank && it->kind == kind) {
      FaultSpec f = *it;
      faults_.erase(it);
      return f;
    }
  }
  return std::nullopt;
}

void FaultInjector::Announce(const FaultSpec& f) {
  control::InjectedMsg m{f.id, control::FormatFault(f)};
  env_.send(control::kMsgInjected, control::Encode(m));
}

void FaultInjector::Fire(const FaultSpec& f) {
  if (Status can = CanInject(f); !can.ok()) {
    // Not announced as fired: the job ends with exit 2, so a test built on it cannot pass untested.
    const std::string reason = fmt::format("{}{} cannot be carried out: {}", control::kCannotInject,
                                           control::FormatFault(f), can.message());
    NONSTOP_LOG_ERROR("{}", reason);
    env_.refuse(reason);
    return;
  }
  NONSTOP_LOG_WARNING("injecting fault {}", control::FormatFault(f));
  Announce(f);
  switch (f.kind) {
    case FaultKind::kKill:
      ::raise(SIGKILL);
      break;
    case FaultKind::kHang:
      ::raise(SIGSTOP);
      break;
    case FaultKind::kDrop:
      env_.comm()->InjectDropOfNextRingLink();
      break;
    case FaultKind::kStall:
      // The training thread stops for good; the I/O thread still sends heartbeats.
      while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
    case FaultKind::kSpin: {
      // The training thread spins on a core for good; the I/O thread still sends heartbeats.
      volatile uint64_t spins = 0;
      while (true) spins = spins + 1;
    }
    case FaultKind::kBitflip:
      FlipABit(*FlipRegion(f));  // CanInject found it
      break;
    case FaultKind::kWireflip:
      env_.comm()->InjectWireFlip(f.gather_phase);
      break;
    default:
      break;
  }
}

// bitflip: one bit of a registered region changes, as a faulty memory cell would change it: bit 1
// of byte 2 of the region's middle 4-byte word (in an fp32 value, mantissa bit 17: the value moves
// by about 1.6%, no NaN, nothing a loss check sees). A bit is a bit: the region is f.tensor, of any
// dtype, or else the first fp32 one, or else the largest replicated one.
Result<size_t> FaultInjector::FlipRegion(const FaultSpec& f) const {
  std::vector<std::string> names;
  std::optional<size_t> chosen, largest;
  const auto& regions = env_.state->regions();
  for (size_t i = 0; i < regions.size(); ++i) {
    const state::Region& r = regions[i];
    names.push_back(r.name);
    if (r.bytes.empty()) continue;
    if (f.tensor.empty() ? r.dtype == "F32" && !chosen : r.name == f.tensor) chosen = i;
    const bool replicated = !r.per_rank && r.shard_group == 0;
    if (replicated && (!largest || r.bytes.size() > regions[*largest].bytes.size())) largest = i;
  }
  if (!chosen && f.tensor.empty()) chosen = largest;
  if (chosen) return *chosen;
  return InvalidArgumentError(
      fmt::format("no region {} is registered to flip a bit in (the regions: {}{})",
                  f.tensor.empty() ? std::string("of bytes") : "'" + f.tensor + "'",
                  names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", ")),
                  f.tensor.empty() ? "" : "; HINT: name one of them with tensor=NAME"));
}

void FaultInjector::FlipABit(size_t index) {
  const state::Region& r = env_.state->regions()[index];
  // byte 2 (bits 16-23, little-endian) of the middle word; a region under 4 bytes: its last
  const size_t at = std::min(r.bytes.size() / 8 * 4 + 2, r.bytes.size() - 1);
  std::byte b[1];
  env_.state->ReadRegion(index, at, b);  // device memory too
  b[0] ^= std::byte{2};
  env_.state->WriteRegion(index, at, b);
  NONSTOP_LOG_WARNING("bitflip: flipped a bit of '{}' ({}) at byte {} of {}", r.name, r.dtype, at,
                      r.bytes.size());
}

Status FaultInjector::CanInject(const FaultSpec& f) const {
  switch (f.kind) {
    case FaultKind::kBitflip:
      return FlipRegion(f).status();
    case FaultKind::kDrop:
      if (env_.comm()->world_size() < 2)
        return FailedPreconditionError("a world of 1 has no ring link to drop");
      return OkStatus();
    case FaultKind::kWireflip:
      if (env_.comm()->world_size() < 2)
        return FailedPreconditionError("a world of 1 sends nothing on a wire");
      return OkStatus();
    default:
      return OkStatus();
  }
}

// A fault not scheduled so (the first step of a generation) fires before the step's collective,
// as an untimed one does.
void FaultInjector::ScheduleTimed(int64_t step, int rank, double last_step_seconds) {
  for (auto kind : {FaultKind::kKill, FaultKind::kHang}) {
    auto f = Take(FaultPoint::kStep, step, rank, kind, true);
    if (!f) continue;
    // A step time from the trainer that is not a sane number waits an hour at most.
    const double seconds =
        std::isfinite(last_step_seconds) ? std::clamp(f->at * last_step_seconds, 0.0, 3600.0) : 0.0;
    if (seconds <= 0) {
      // Due as the step starts: fired from this thread, now. A timer thread may start late on a
      // busy machine, after another member's fault has aborted the generation (a test saw two
      // kills at=0 of one step land a recovery apart, where both were meant at once).
      Fire(*f);
      return;
    }
    auto delay = std::chrono::duration<double>(seconds);
    std::erase_if(timers_, [](const Timer& t) { return t.fired->load(); });
    auto fired = std::make_shared<std::atomic<bool>>(false);
    timers_.push_back({fired, std::jthread([this, f = *f, delay, fired](std::stop_token st) {
                         std::mutex m;
                         std::condition_variable_any cv;
                         std::unique_lock lock(m);
                         cv.wait_for(lock, st, delay, [] { return false; });
                         if (!st.stop_requested()) Fire(f);
                         fired->store(true);
                       })});
    return;
  }
}

void FaultInjector::BeforeCollective(int64_t step, int rank) {
  for (auto kind : {FaultKind::kKill, FaultKind::kHang, FaultKind::kDrop, FaultKind::kStall,
                    FaultKind::kSpin, FaultKind::kBitflip}) {
    if (auto f = Take(FaultPoint::kStep, step, rank, kind)) Fire(*f);
  }
}

}  // namespace nonstop::worker
