#include "coord/retry.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "common/logging.h"

namespace nonstop::etcd {

Backoff::Backoff(Millis initial, Millis max, std::function<double()> random)
    : initial_(std::max(initial, Millis(1))),
      max_(std::max(max, initial_)),
      random_(std::move(random)) {
  if (!random_) {
    generator_.seed(std::random_device{}());
    random_ = [this] { return std::uniform_real_distribution<double>(0.0, 1.0)(generator_); };
  }
}

Millis Backoff::Ceiling() const {
  // initial·2^failures, without overflow: past 2^20 it is past any max worth having.
  double d = static_cast<double>(initial_.count()) * std::ldexp(1.0, std::min(failures_, 20));
  return Millis(static_cast<int64_t>(std::min(d, static_cast<double>(max_.count()))));
}

Millis Backoff::Next() {
  Millis ceiling = Ceiling();
  ++failures_;
  double u = std::clamp(random_(), 0.0, 1.0);
  return Millis(static_cast<int64_t>(u * static_cast<double>(ceiling.count())));
}

OutageLog::OutageLog(std::string what, std::string meanwhile)
    : what_(std::move(what)), meanwhile_(std::move(meanwhile)) {}

void OutageLog::Failed(const Status& s) {
  ++failures_;
  if (since_ >= 0) return;
  since_ = MonotonicSeconds();
  NONSTOP_LOG_WARNING("{}: {}; {} (one line per outage)", what_, s.ToString(), meanwhile_);
}

void OutageLog::Succeeded() {
  if (since_ < 0) return;
  NONSTOP_LOG_WARNING("{}: etcd answers again after {:.1f} s ({} failed tries)", what_,
                      MonotonicSeconds() - since_, failures_);
  since_ = -1;
  failures_ = 0;
}

bool SleepUnless(Millis d, const std::function<bool()>& stop) {
  Deadline until = DeadlineAfter(d);
  while (true) {
    if (stop && stop()) return false;
    auto left = until - Clock::now();
    if (left <= Clock::duration::zero()) return true;
    std::this_thread::sleep_for(std::min<Clock::duration>(left, Millis(50)));
  }
}

}  // namespace nonstop::etcd
