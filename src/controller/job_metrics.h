// JobMetrics: the job's Prometheus metrics (GET /metrics), derived from its
// journal records as they are written, plus the gauges of /status.
//
// Everything a metric says is in the journal already (steps, faults,
// recoveries with their phases, state transfers), so the runtime feeds each
// record it appends to Observe() and nothing else in the controller has to
// count. Names and units follow Prometheus' conventions: `_seconds`,
// `_bytes`, `_total` for counters (docs/dashboard.md lists them).
//
// Thread-safety: none; the controller's loop owns it and hands Text() to the
// HTTP thread.
#pragma once

#include <map>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace prometheus {
class Registry;
class Histogram;
class Counter;
class Gauge;
template <typename T>
class Family;
}  // namespace prometheus

namespace nonstop::controller {

class JobMetrics {
 public:
  JobMetrics();
  ~JobMetrics();
  JobMetrics(const JobMetrics&) = delete;
  JobMetrics& operator=(const JobMetrics&) = delete;

  // One journal record (docs/journal.md), appended at `now_seconds` on the
  // monotonic clock (goodput's wall time); records of other events are ignored.
  void Observe(const nlohmann::json& record, double now_seconds);
  void Observe(const nlohmann::json& record);  // appended now
  // The gauges, from Controller::Status(): generation, world size, target, spares, hosts, highest
  // step.
  void SetStatus(const nlohmann::json& status);
  // The exposition format, version 0.0.4.
  std::string Text() const;

 private:
  void ObserveTimeLost(const std::string& kind, const nlohmann::json& recovery);
  void SetGoodput();

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram* step_seconds_ = nullptr;
  prometheus::Family<prometheus::Histogram>* phase_seconds_ = nullptr;
  std::map<std::string, prometheus::Histogram*> phases_;
  prometheus::Histogram* time_lost_seconds_ = nullptr;
  prometheus::Counter* time_lost_total_ = nullptr;
  prometheus::Family<prometheus::Gauge>* last_time_lost_ = nullptr;
  prometheus::Gauge* goodput_ = nullptr;
  // The training's wall time, for goodput: from the first step's start to the last step's end
  // (monotonic seconds; negative until a step was seen).
  double first_step_began_ = -1, last_step_ended_ = -1;
  double time_lost_seconds_total_ = 0;
  prometheus::Histogram* downtime_seconds_ = nullptr;
  prometheus::Histogram* resize_pause_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* faults_ = nullptr;
  prometheus::Family<prometheus::Counter>* recoveries_ = nullptr;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Counter* lost_steps_ = nullptr;
  prometheus::Counter* transfer_bytes_ = nullptr;
  prometheus::Counter* transfer_seconds_ = nullptr;
  prometheus::Counter* scale_refused_ = nullptr;
  prometheus::Counter* forgeries_ = nullptr;
  prometheus::Gauge* generation_ = nullptr;
  prometheus::Gauge* world_ = nullptr;
  prometheus::Gauge* target_world_ = nullptr;
  prometheus::Gauge* spares_ = nullptr;
  prometheus::Gauge* hosts_ = nullptr;
  prometheus::Gauge* highest_step_ = nullptr;
};

}  // namespace nonstop::controller
