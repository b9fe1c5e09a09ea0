#include "controller/resize_policy.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

namespace nonstop::controller {

using nlohmann::json;

namespace {

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

PlanPolicy SizePolicy(const ScalePolicy& p, int initial_world) {
  return PlanPolicy{p.min_world, p.max_world > 0 ? p.max_world : initial_world, p.allowed_sizes,
                    p.increment};
}

Millis EffectiveStablePeriod(const ScalePolicy& p, const ResizeHistory& history,
                             Clock::time_point now) {
  int recent = 0;
  for (auto t : history.change_times) recent += now - t < p.backoff_window ? 1 : 0;
  int extra = std::max(0, recent - p.backoff_changes);
  return p.stable_period * (1 << std::min(extra, 3));
}

json ScalePolicyJson(const ScalePolicy& p, int initial_world, Millis effective_stable_period) {
  return {{"min_world", p.min_world},
          {"max_world", p.max_world > 0 ? p.max_world : initial_world},
          {"allowed_sizes", p.allowed_sizes},
          {"increment", p.increment},
          {"stable_period_ms", p.stable_period.count()},
          {"effective_stable_period_ms", effective_stable_period.count()},
          {"backoff_changes", p.backoff_changes},
          {"backoff_window_ms", p.backoff_window.count()}};
}

ScaleDecision DecideScaleRequest(const json& b, const ScaleView& view, const ScalePolicy& policy,
                                 const ResizeHistory& history, Clock::time_point now) {
  auto refuse = [](int status, std::string why) {
    return ScaleDecision{status, std::move(why), -1};
  };
  const int world = view.world;
  int target = -1;
  // Sizes are bounded before any arithmetic: {"grow": 2147483647} must not overflow.
  constexpr int64_t kMaxWorld = 1 << 20;
  constexpr int kInvalid = -1000000;
  auto as_int = [&](const char* key) -> std::optional<int> {
    if (!b.is_object() || !b.contains(key)) return std::nullopt;
    if (!b[key].is_number_integer()) return kInvalid;
    int64_t v =
        b[key].is_number_unsigned() && b[key].get<uint64_t>() > static_cast<uint64_t>(kMaxWorld)
            ? kMaxWorld + 1
            : b[key].get<int64_t>();
    if (v <= 0 || v > kMaxWorld) return kInvalid;
    return static_cast<int>(v);
  };
  if (auto v = as_int("world_size"))
    target = *v;
  else if (auto r = as_int("release"))
    target = *r <= 0 ? kInvalid : world - *r;
  else if (auto g = as_int("grow"))
    target = *g <= 0 ? kInvalid : world + *g;
  else
    return refuse(400, R"(expected {"world_size": N}, {"release": N} or {"grow": N})");
  if (target == kInvalid || (b.size() != 1)) {
    return refuse(
        400,
        R"(expected exactly one of world_size, release or grow, with a positive integer up to 1048576)");
  }
  if (view.phase != JobPhase::kRunning) {
    return refuse(409,
                  fmt::format("a membership change is in progress (the job is {}); retry shortly",
                              view.phase == JobPhase::kForming ? "forming" : "recovering"));
  }
  if (view.finished > 0) return refuse(409, "the job is finishing");
  const Millis stable = EffectiveStablePeriod(policy, history, now);
  if (std::string why =
          CheckWorldSize(SizePolicy(policy, view.initial_world), view.shard_group, target);
      !why.empty()) {
    return refuse(422,
                  why + " (" + ScalePolicyJson(policy, view.initial_world, stable).dump() + ")");
  }
  if (history.last_change_at && now - *history.last_change_at < stable) {
    return refuse(
        429, fmt::format(
                 "too soon: the last change was {:.1f} s ago and the stable period is {:.1f} s{}",
                 Ms(now - *history.last_change_at) / 1000, stable.count() / 1000.0,
                 stable > policy.stable_period ? " (backed off: changes came too often)" : ""));
  }
  return ScaleDecision{202, "", target};
}

GrowDecision DecideGrow(const GrowView& v, const ScalePolicy& policy, const ResizeHistory& history,
                        Clock::time_point now) {
  GrowDecision d;
  d.gather_since = history.grow_waiting_since;
  if (v.adoption_pending) return d;  // a takeover: the inherited join first
  if (v.phase != JobPhase::kRunning || v.finished > 0) return d;
  if (v.target_world <= v.world || v.spares == 0) return d;
  if (history.last_change_at &&
      now - *history.last_change_at < EffectiveStablePeriod(policy, history, now)) {
    return d;  // a Tick retries
  }
  // Capacity often arrives a worker at a time: wait a little for all of it,
  // so that one change (one pause) takes the job to its target.
  if (v.world + v.spares < v.target_world) {
    if (!d.gather_since) d.gather_since = now;
    if (now - *d.gather_since < v.grow_gather) return d;
  }
  d.gather_since.reset();
  const PlanPolicy sizes = SizePolicy(policy, v.initial_world);
  int to = std::min(v.target_world, v.world + v.spares);
  // the largest allowed size we can reach now
  while (to > v.world && !CheckWorldSize(sizes, v.shard_group, to).empty()) --to;
  if (to <= v.world) return d;
  d.to = to;
  d.trigger = fmt::format("grow: {} spare worker(s) available", v.spares);
  return d;
}

int WorldWithoutLeaving(int world, int leaving, int spares, const PlanPolicy& policy,
                        int shard_group) {
  const int smaller = world - leaving;
  for (int size = std::max(1, smaller); size <= world; ++size) {
    if (size - smaller <= spares && CheckWorldSize(policy, shard_group, size).empty()) return size;
  }
  return -1;
}

}  // namespace nonstop::controller
