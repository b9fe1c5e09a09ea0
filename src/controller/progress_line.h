// ProgressLine: the one live line `nonstop run` keeps at the bottom of a
// terminal instead of every rank's log (docs/dashboard.md):
//
//   step 120/200 (60%) | loss 2.4130 | 1960 tok/s | ETA 1m28s | world 4 | spares 1
//
// Fed the journal's records as they are written, like JobMetrics; during a
// recovery or resize it says so. Thread-safety: none (the controller's loop).
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include <nlohmann/json.hpp>

namespace nonstop::controller {

class ProgressLine {
 public:
  void Observe(const nlohmann::json& record);
  // Whether anything worth showing happened since the last Text().
  bool changed() const { return changed_; }
  std::string Text();

 private:
  int64_t step_ = -1, total_ = 0;
  double loss_ = 0, tokens_per_second_ = 0;
  std::deque<double> recent_seconds_;  // the last steps' durations, for the ETA
  int world_ = 0, spares_ = -1;
  bool changing_ = false;  // a recovery or resize is open
  std::string waiting_;    // "waiting for rank 0 (busy in 'evaluation')" ("" : none)
  bool ended_ = false;
  bool changed_ = false;
};

// "1h02m", "3m05s", "42s": a duration for a terminal.
std::string ShortDuration(double seconds);

}  // namespace nonstop::controller
