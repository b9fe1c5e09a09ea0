#include "controller/progress_line.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

namespace nonstop::controller {

std::string ShortDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(std::llround(seconds));
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

void ProgressLine::Observe(const nlohmann::json& r) {
  if (!r.is_object()) return;
  const std::string event = r.value("event", "");
  auto number = [&](const char* key, double fallback) {
    auto it = r.find(key);
    return it != r.end() && it->is_number() ? it->get<double>() : fallback;
  };
  if (event == "step") {
    step_ = static_cast<int64_t>(number("step", static_cast<double>(step_)));
    total_ = static_cast<int64_t>(number("total_steps", static_cast<double>(total_)));
    // a NaN loss is journaled as null
    loss_ = number("loss", std::numeric_limits<double>::quiet_NaN());
    tokens_per_second_ = number("tokens_per_second", tokens_per_second_);
    double secs = number("step_seconds", 0);
    if (secs > 0) {
      recent_seconds_.push_back(secs);
      if (recent_seconds_.size() > 20) recent_seconds_.pop_front();
    }
    world_ = static_cast<int>(number("world_size", world_));
  } else if (event == "plan") {
    if (r.contains("members") && r["members"].is_array())
      world_ = static_cast<int>(r["members"].size());
    spares_ = static_cast<int>(number("spares", spares_));
  } else if (event == "join") {
    if (r.value("spare", false) && spares_ >= 0) ++spares_;
  } else if (event == "spare_lost") {
    if (spares_ > 0) --spares_;
  } else if (event == "waiting") {
    waiting_ = fmt::format("waiting for rank {}", static_cast<int>(number("rank", -1)));
    const std::string section = r.value("section", "");
    if (!section.empty()) waiting_ += fmt::format(" (busy in '{}')", section);
  } else if (event == "waiting_end") {
    waiting_.clear();
  } else if (event == "recovery_start" || event == "resize_start") {
    changing_ = true;
  } else if (event == "recovery_end") {
    changing_ = false;
  } else if (event == "job_end") {
    ended_ = true;
  } else {
    return;
  }
  changed_ = true;
}

std::string ProgressLine::Text() {
  changed_ = false;
  if (step_ < 0) return "starting…";
  std::string text = total_ > 0 ? fmt::format("step {}/{} ({:.0f}%)", step_ + 1, total_,
                                              100.0 * (step_ + 1) / total_)
                                : fmt::format("step {}", step_ + 1);
  text += fmt::format(" | loss {:.4f}", loss_);
  if (tokens_per_second_ > 0) text += fmt::format(" | {:.0f} tok/s", tokens_per_second_);
  if (total_ > 0 && !recent_seconds_.empty() && !ended_) {
    std::vector<double> v(recent_seconds_.begin(), recent_seconds_.end());
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    text +=
        " | ETA " + ShortDuration(static_cast<double>(std::max<int64_t>(0, total_ - step_ - 1)) *
                                  v[v.size() / 2]);
  }
  text += fmt::format(" | world {}", world_);
  if (spares_ >= 0) text += fmt::format(" | spares {}", spares_);
  if (changing_) text += " | membership changing…";
  if (!waiting_.empty() && !ended_) text += " | " + waiting_;
  return text;
}

}  // namespace nonstop::controller
