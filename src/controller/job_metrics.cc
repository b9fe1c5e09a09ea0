#include "controller/job_metrics.h"

#include <algorithm>
#include <cctype>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "common/time.h"

namespace nonstop::controller {
namespace {

// From a millisecond to ten minutes: steps of tiny models and of big ones,
// recoveries of 50 ms and checkpoint restarts of minutes.
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
          1,     2.5,    5,     10,   30,    60,   120, 300,  600};
}

// "control connection lost" → "control_connection_lost": label values that read well in PromQL.
std::string Snake(const std::string& s) {
  std::string out;
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    out += std::isalnum(u) ? static_cast<char>(std::tolower(u)) : '_';
  }
  return out.empty() ? "unknown" : out;
}

double Number(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

}  // namespace

JobMetrics::JobMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  auto& r = *registry_;
  step_seconds_ = &BuildHistogram()
                       .Name("nonstop_step_duration_seconds")
                       .Help(
                           "Wall time of each completed training step, as the first member to "
                           "report it measured it")
                       .Register(r)
                       .Add({}, SecondsBuckets());
  phase_seconds_ =
      &BuildHistogram()
           .Name("nonstop_recovery_phase_seconds")
           .Help(
               "Time from a fault (or its detection) to the end of each recovery phase: detected, "
               "aborted, plan_published, state_ready, first_step_completed")
           .Register(r);
  for (const char* phase :
       {"detected", "aborted", "plan_published", "state_ready", "first_step_completed"}) {
    phases_[phase] = &phase_seconds_->Add({{"phase", phase}}, SecondsBuckets());
  }
  time_lost_seconds_ =
      &BuildHistogram()
           .Name("nonstop_fault_time_lost_seconds")
           .Help(
               "Wall-clock time each fault cost the job: the step across it, from its start to "
               "the resumed step's completion, less what the job computes in that time at its "
               "normal pace (a normal step, and any completed step computed again)")
           .Register(r)
           .Add({}, SecondsBuckets());
  time_lost_total_ = &BuildCounter()
                          .Name("nonstop_time_lost_seconds_total")
                          .Help("Wall-clock time every fault and resize cost the job, summed")
                          .Register(r)
                          .Add({});
  last_time_lost_ =
      &BuildGauge()
           .Name("nonstop_last_fault_time_lost_seconds")
           .Help(
               "The last completed fault's time lost, split: in_flight (what the step had run "
               "at the fault), detect, abort, plan, state_copy, resumed_step_vs_normal (below "
               "zero when the step in flight was salvaged), redone_steps; and total")
           .Register(r);
  goodput_ = &BuildGauge()
                  .Name("nonstop_goodput_ratio")
                  .Help(
                      "1 - time lost / training wall time (from the first step's start to the "
                      "last step's end)")
                  .Register(r)
                  .Add({});
  downtime_seconds_ =
      &BuildHistogram()
           .Name("nonstop_recovery_downtime_seconds")
           .Help(
               "Downtime as defined before the time lost: from the fault until the resumed step "
               "completed, less a normal step (it reads 0 when the step is long; see "
               "nonstop_fault_time_lost_seconds)")
           .Register(r)
           .Add({}, SecondsBuckets());
  resize_pause_seconds_ =
      &BuildHistogram()
           .Name("nonstop_resize_pause_seconds")
           .Help("Training time a planned grow or shrink cost, less a normal step")
           .Register(r)
           .Add({}, SecondsBuckets());
  faults_ = &BuildCounter()
                 .Name("nonstop_faults_total")
                 .Help(
                     "Faults of members, by how they were detected (process_exit, "
                     "control_connection_lost, "
                     "heartbeat_timeout, process_stopped, hang, reported_failure, ...)")
                 .Register(r);
  recoveries_ = &BuildCounter()
                     .Name("nonstop_recoveries_total")
                     .Help(
                         "Recoveries and resizes that ended, by kind, outcome and how they were "
                         "handled (spare, "
                         "shrink, grow, same_members, checkpoint_restart)")
                     .Register(r);
  steps_ = &BuildCounter()
                .Name("nonstop_steps_completed_total")
                .Help("Training steps completed")
                .Register(r)
                .Add({});
  tokens_ =
      &BuildCounter()
           .Name("nonstop_tokens_total")
           .Help(
               "Tokens processed by completed steps (their tokens per second times their duration)")
           .Register(r)
           .Add({});
  lost_steps_ = &BuildCounter()
                     .Name("nonstop_lost_steps_total")
                     .Help("Completed steps that no survivor held, computed again after a recovery")
                     .Register(r)
                     .Add({});
  transfer_bytes_ =
      &BuildCounter()
           .Name("nonstop_state_transfer_bytes_total")
           .Help("Bytes of state copied from peers to newcomers in recoveries and grows")
           .Register(r)
           .Add({});
  transfer_seconds_ = &BuildCounter()
                           .Name("nonstop_state_transfer_seconds_total")
                           .Help("Seconds newcomers spent copying state from peers")
                           .Register(r)
                           .Add({});
  scale_refused_ = &BuildCounter()
                        .Name("nonstop_scale_requests_refused_total")
                        .Help("Scale requests refused (policy, timing or a malformed body)")
                        .Register(r)
                        .Add({});
  forgeries_ = &BuildCounter()
                    .Name("nonstop_etcd_forgeries_total")
                    .Help(
                        "Values found in etcd that do not verify with the job key (the leader "
                        "key overwritten, a journal value forged, moved or put back)")
                    .Register(r)
                    .Add({});
  auto gauge = [&](const char* name, const char* help) {
    return &BuildGauge().Name(name).Help(help).Register(r).Add({});
  };
  generation_ = gauge("nonstop_generation", "The current generation (membership version)");
  world_ = gauge("nonstop_world_size", "Members of the current generation");
  target_world_ = gauge("nonstop_target_world_size",
                        "The world size the job is heading for (policy, requests)");
  spares_ = gauge("nonstop_spares", "Pre-warmed spare workers waiting without a rank");
  hosts_ = gauge("nonstop_hosts", "Hosts (agents) that are part of the job");
  highest_step_ = gauge("nonstop_highest_step", "The highest step any member completed");
}

JobMetrics::~JobMetrics() = default;

void JobMetrics::Observe(const nlohmann::json& record) { Observe(record, MonotonicSeconds()); }

void JobMetrics::Observe(const nlohmann::json& record, double now_seconds) {
  if (!record.is_object()) return;
  const std::string event = record.value("event", "");
  if (event == "step") {
    steps_->Increment();
    double secs = std::max(0.0, Number(record, "step_seconds"));
    step_seconds_->Observe(secs);
    last_step_ended_ = now_seconds;
    if (first_step_began_ < 0) first_step_began_ = last_step_ended_ - secs;
    SetGoodput();
    tokens_->Increment(std::max(0.0, Number(record, "tokens_per_second") * secs));
  } else if (event == "fault") {
    std::string kind = record.contains("kind") && record["kind"].is_string()
                           ? record["kind"].get<std::string>()
                           : "";
    faults_->Add({{"kind", Snake(kind)}}).Increment();
  } else if (event == "scale_refused") {
    scale_refused_->Increment();
  } else if (event == "etcd_value_forged" || event == "leader_key_forged" ||
             event == "etcd_record_forged") {
    forgeries_->Increment();
  } else if (event == "recovery_end" && record.contains("recovery") &&
             record["recovery"].is_object()) {
    const nlohmann::json& rec = record["recovery"];
    const std::string kind = rec.value("kind", "recovery");
    std::string outcome = rec.value("outcome", "unknown");
    if (outcome.rfind("superseded", 0) == 0) outcome = "superseded";
    int old_world = static_cast<int>(Number(rec, "old_world")),
        new_world = static_cast<int>(Number(rec, "new_world"));
    std::string handled = rec.value("restarted_from_checkpoint", false) ? "checkpoint_restart"
                          : new_world < old_world                       ? "shrink"
                          : new_world > old_world                       ? "grow"
                          : rec.contains("replacements") && rec["replacements"].is_array() &&
                                  !rec["replacements"].empty()
                              ? "spare"
                              : "same_members";
    recoveries_->Add({{"kind", Snake(kind)}, {"outcome", Snake(outcome)}, {"handled", handled}})
        .Increment();
    lost_steps_->Increment(std::max(0.0, Number(rec, "lost_steps")));
    transfer_bytes_->Increment(std::max(0.0, Number(rec, "bytes_copied")));
    transfer_seconds_->Increment(std::max(0.0, Number(rec, "transfer_ms") / 1000));
    if (outcome == "completed") {
      // The phases of faults only: a planned resize has its own histogram (its pause).
      if (kind == "recovery" && rec.contains("ms_after_fault") &&
          rec["ms_after_fault"].is_object()) {
        for (const auto& [phase, histogram] : phases_) {
          const auto& at = rec["ms_after_fault"];
          if (at.contains(phase) && at[phase].is_number())
            histogram->Observe(std::max(0.0, at[phase].get<double>() / 1000));
        }
      }
      ObserveTimeLost(kind, rec);
      if (rec.contains("downtime_ms"))
        downtime_seconds_->Observe(std::max(0.0, Number(rec, "downtime_ms") / 1000));
      if (rec.contains("pause_ms"))
        resize_pause_seconds_->Observe(std::max(0.0, Number(rec, "pause_ms") / 1000));
    }
  }
}

void JobMetrics::ObserveTimeLost(const std::string& kind, const nlohmann::json& rec) {
  if (!rec.contains("time_lost") || !rec["time_lost"].is_object()) return;
  const nlohmann::json& t = rec["time_lost"];
  const double total = Number(t, "ms") / 1000;
  time_lost_total_->Increment(std::max(0.0, total));
  time_lost_seconds_total_ += std::max(0.0, total);
  SetGoodput();
  if (kind != "recovery") return;
  time_lost_seconds_->Observe(std::max(0.0, total));
  last_time_lost_->Add({{"part", "total"}}).Set(total);
  if (t.contains("split_ms") && t["split_ms"].is_object()) {
    for (const auto& [part, ms] : t["split_ms"].items()) {
      if (ms.is_number()) last_time_lost_->Add({{"part", part}}).Set(ms.get<double>() / 1000);
    }
  }
}

void JobMetrics::SetGoodput() {
  const double wall = last_step_ended_ - first_step_began_;
  if (first_step_began_ < 0 || wall <= 0) return;
  goodput_->Set(std::clamp(1 - time_lost_seconds_total_ / wall, 0.0, 1.0));
}

void JobMetrics::SetStatus(const nlohmann::json& st) {
  generation_->Set(Number(st, "generation"));
  world_->Set(Number(st, "world_size"));
  target_world_->Set(Number(st, "target_world_size"));
  spares_->Set(Number(st, "spares"));
  highest_step_->Set(Number(st, "highest_step"));
  hosts_->Set(st.contains("hosts") && st["hosts"].is_array()
                  ? static_cast<double>(st["hosts"].size())
                  : 0.0);
}

std::string JobMetrics::Text() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace nonstop::controller
