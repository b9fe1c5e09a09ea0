#include "controller/script_failures.h"

#include <algorithm>

#include <fmt/format.h>

namespace nonstop::controller {

void ScriptFailures::Hold(FailureReport report, const std::vector<int>& members, Millis window) {
  if (held_.empty()) batch_members_ = std::set<int>(members.begin(), members.end());
  report.at += window;  // held until then
  held_.push_back(std::move(report));
}

bool ScriptFailures::Holding(int worker_id) const {
  return std::any_of(held_.begin(), held_.end(),
                     [&](const FailureReport& r) { return r.worker_id == worker_id; });
}

// The exception's type and the line that raised it (the traceback's last
// frame), when a traceback came: the same bug raised with a message that
// names the rank or the sample is the same failure.
// Only a frame of the script's own: a library's (every error from loss.backward() ends in
// torch's autograd) says nothing of which bug raised it.
static std::string Site(const FailureReport& r) {
  const size_t frame = r.traceback.rfind("File \"");
  if (frame == std::string::npos) return "";
  const size_t end = r.traceback.find('\n', frame);
  const std::string line = r.traceback.substr(frame, end - frame);
  for (const char* library : {"site-packages", "dist-packages", "/lib/python", "<frozen"}) {
    if (line.find(library) != std::string::npos) return "";
  }
  const size_t colon = r.reason.find(':');
  return r.reason.substr(0, colon) + " at " + line;
}

bool Injected(const FailureReport& r) {
  return r.reason.find("injected exception") != std::string::npos;
}

bool SameFailure(const FailureReport& a, const FailureReport& b) {
  if (a.reason == b.reason) return true;
  const std::string site = Site(a);
  return !site.empty() && site == Site(b);
}

bool ScriptFailures::EveryMemberRaised() const {
  // A world of one raising once may be a flaky node: its repeats tell.
  if (held_.empty() || batch_members_.size() < 2 || Injected(held_.front())) return false;
  const FailureReport& first = held_.front();
  std::set<int> raised;
  for (const FailureReport& r : held_) {
    if (SameFailure(r, first) && r.step == first.step) raised.insert(r.worker_id);
  }
  return std::includes(raised.begin(), raised.end(), batch_members_.begin(), batch_members_.end());
}

std::vector<FailureReport> ScriptFailures::Due(Clock::time_point now) {
  std::vector<FailureReport> due;
  while (!held_.empty() && held_.front().at <= now) {
    due.push_back(std::move(held_.front()));
    held_.pop_front();
  }
  return due;
}

int ScriptFailures::Record(const FailureReport& report, Millis memory) {
  if (Injected(report)) return 0;  // nonstop run --inject: a fault of the test's, every time
  while (!history_.empty() && report.at - history_.front().at > memory) history_.pop_front();
  int repeats = 0;
  for (const FailureReport& r : history_) {
    if (SameFailure(r, report) && (r.rank == report.rank || r.step == report.step)) ++repeats;
  }
  history_.push_back(report);
  if (history_.size() > 256) history_.pop_front();
  return repeats;
}

std::string ScriptFailureMessage(const FailureReport& r, const std::string& why) {
  std::string text = fmt::format(
      "{}: a bug in the script, not a fault of the machines: do not restart it unchanged. "
      "Rank {} raised at step {}: {}",
      why, r.rank, r.step, r.reason);
  if (!r.traceback.empty()) {
    text += "\n" + r.traceback;
    if (text.back() == '\n') text.pop_back();
  }
  return text;
}

bool RecoveryBudget::Spend(Clock::time_point at, int budget, Millis window) {
  starts_.push_back(at);
  while (!starts_.empty() && at - starts_.front() > window) starts_.pop_front();
  return static_cast<int>(starts_.size()) > budget;
}

}  // namespace nonstop::controller
