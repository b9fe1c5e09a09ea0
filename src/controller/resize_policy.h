// Resize policy: when and to what size the world may change (docs/controller.md,
// docs/elastic.md).
//
// What it decides: the sizes the policy allows (the planner's CheckWorldSize
// over the resolved policy), the stable period between two changes with its
// back-off, what a scale request's body asks for and why it is refused, when
// spares that appeared grow the job (after the grow gather, to the largest
// allowed size within reach), and to what size the job shrinks when hosts
// leave. All pure functions of a view and `now`; the Controller starts the
// resize (StartResize) and keeps the history.
// What it owns: nothing but the ResizeHistory value the Controller keeps for it.
// Thread-safety: none; values and pure functions.
#pragma once

#include <deque>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "common/time.h"
#include "controller/core_types.h"
#include "controller/planner.h"

namespace nonstop::controller {

// The policy the planner checks sizes against; `initial_world` is the
// maximum when the policy names none.
PlanPolicy SizePolicy(const ScalePolicy& policy, int initial_world);

// When the world last changed size, and the grow gather in progress.
struct ResizeHistory {
  std::optional<Clock::time_point> last_change_at;
  // every change (the back-off counts recent ones)
  std::deque<Clock::time_point> change_times;
  std::optional<Clock::time_point> grow_waiting_since;  // capacity is gathering for a grow
  void Changed(Clock::time_point now) {
    last_change_at = now;
    change_times.push_back(now);
  }
};

// The stable period: more than backoff_changes changes within backoff_window
// double it for each extra change (up to 8×).
Millis EffectiveStablePeriod(const ScalePolicy& policy, const ResizeHistory& history,
                             Clock::time_point now);

// The policy as /status and a refusal show it.
nlohmann::json ScalePolicyJson(const ScalePolicy& policy, int initial_world,
                               Millis effective_stable_period);

// ---- scale requests ({"world_size": N}, {"release": N} or {"grow": N})

struct ScaleView {
  JobPhase phase = JobPhase::kRunning;
  int world = 0;     // the members now
  int finished = 0;  // members that finished training
  int shard_group = 0;
  int initial_world = 0;
};
struct ScaleDecision {
  int http_status = 202;  // 202: accepted; 400, 409, 422, 429: refused with `error`
  std::string error;
  int target = -1;  // accepted: the world size asked for
};
ScaleDecision DecideScaleRequest(const nlohmann::json& body, const ScaleView& view,
                                 const ScalePolicy& policy, const ResizeHistory& history,
                                 Clock::time_point now);

// ---- growing into spares

struct GrowView {
  bool adoption_pending = false;  // a takeover: the inherited join first
  JobPhase phase = JobPhase::kRunning;
  int finished = 0;
  int world = 0;   // the members now
  int spares = 0;  // joined spares
  int target_world = 0;
  int shard_group = 0;
  int initial_world = 0;
  Millis grow_gather{0};
};
struct GrowDecision {
  int to = 0;  // > 0: grow to this size now, for `trigger`
  std::string trigger;
  // The grow gather after the decision (history.grow_waiting_since).
  std::optional<Clock::time_point> gather_since;
};
// Capacity often arrives a worker at a time: a grow short of the target waits
// grow_gather for the rest, so that one change (one pause) takes the job there.
GrowDecision DecideGrow(const GrowView& view, const ScalePolicy& policy,
                        const ResizeHistory& history, Clock::time_point now);

// ---- hosts that leave

// The smallest world the policy allows from the `world - leaving` members
// that stay, with up to `spares` spares elsewhere taking released ranks where
// it must be larger; -1 when there is none up to `world`.
int WorldWithoutLeaving(int world, int leaving, int spares, const PlanPolicy& policy,
                        int shard_group);

}  // namespace nonstop::controller
