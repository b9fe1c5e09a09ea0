#include "controller/report.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <fmt/format.h>

namespace nonstop::controller {

using nlohmann::json;

namespace {

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

json RecordJson(const RecoveryRecord& r) {
  auto since = [&](const std::optional<Clock::time_point>& t) -> json {
    if (!t) return nullptr;
    return Ms(*t - r.fault_at.value_or(r.detected_at));
  };
  json j = {{"id", r.id},
            {"kind", r.kind},
            {"from_generation", r.from_generation},
            {"to_generation", r.to_generation},
            {"causes", r.causes},
            {"injected", r.injected},
            {"outcome", r.outcome},
            {"resume_step", r.resume_step},
            {"lost_steps", r.lost_steps},
            {"old_world", r.old_world},
            {"new_world", r.new_world},
            {"replacements", r.replacements},
            {"spawned_spares", r.spawned_spares},
            {"bytes_copied", r.bytes_copied},
            {"sources", r.sources},
            {"refetched_chunks", r.refetched_chunks},
            {"connect_ms", r.connect_seconds * 1000},
            {"transfer_ms", r.transfer_seconds * 1000},
            {"normal_step_ms", r.normal_step_seconds * 1000},
            {"fault_time_known", r.fault_at.has_value()},
            {"restarted_from_checkpoint", r.restarted},
            {"redone_steps", r.redone_steps},
            {"ms_after_fault",
             {{"detected", since(r.detected_at)},
              {"aborted", since(r.aborted_at)},
              {"plan_published", since(r.plan_at)},
              {"state_ready", since(r.state_ready_at)},
              {"first_step_completed", since(r.first_step_at)}}}};
  if (r.first_step_at && r.kind == "resize" && r.aborted_at) {
    // From the step boundary until the next step completes, less a normal step.
    j["pause_ms"] =
        std::max(0.0, Ms(*r.first_step_at - *r.aborted_at) - r.normal_step_seconds * 1000);
  } else if (r.first_step_at) {
    double total = Ms(*r.first_step_at - r.fault_at.value_or(r.detected_at));
    j["downtime_ms"] = std::max(0.0, total - r.normal_step_seconds * 1000);
  }
  return j;
}

std::vector<std::string> ReportLines(const std::vector<RecoveryRecord>& recoveries_) {
  std::vector<std::string> out;
  if (recoveries_.empty()) return out;
  int64_t lost = 0;
  for (const auto& r : recoveries_) lost += r.lost_steps;
  int resizes = 0;
  for (const auto& r : recoveries_) resizes += r.kind == "resize" ? 1 : 0;
  int recoveries = static_cast<int>(recoveries_.size()) - resizes;
  out.push_back(fmt::format("recovery report: {} recover{}, {} resize{}, {} completed step{} lost",
                            recoveries, recoveries == 1 ? "y" : "ies", resizes,
                            resizes == 1 ? "" : "s", lost, lost == 1 ? "" : "s"));
  for (const auto& r : recoveries_) {
    json j = RecordJson(r);
    out.push_back(fmt::format("  #{} {}{}{}", r.id, r.kind == "resize" ? "resize, " : "",
                              r.injected.empty() ? "" : "injected " + r.injected + ": ",
                              r.causes.empty() ? "" : r.causes.front()));
    for (size_t i = 1; i < r.causes.size(); ++i) out.push_back("     and " + r.causes[i]);
    std::string handled = r.replacements.empty() ? "no member lost" : "";
    for (const auto& s : r.replacements) handled += (handled.empty() ? "" : "; ") + s;
    out.push_back(fmt::format(
        "     handled: {}; generation {} → {}, world {} → {}, resumed at step {}{} ({})", handled,
        r.from_generation, r.to_generation, r.old_world, r.new_world, r.resume_step,
        r.restarted ? fmt::format(", {} completed steps redone", r.redone_steps) : "", r.outcome));
    const json& p = j["ms_after_fault"];
    auto f = [](const json& v) {
      return v.is_null() ? std::string("-") : fmt::format("{:.0f}", v.get<double>());
    };
    double mb = static_cast<double>(r.bytes_copied) / 1e6;
    std::string copied =
        r.bytes_copied == 0
            ? "no state copied"
            : fmt::format("copied {:.2f} MB from {} source(s) in {:.0f} ms ({:.0f} MB/s){}", mb,
                          r.sources, r.transfer_seconds * 1000,
                          r.transfer_seconds > 0 ? mb / r.transfer_seconds : 0.0,
                          r.refetched_chunks > 0
                              ? fmt::format(", {} chunk(s) refetched after a checksum failure",
                                            r.refetched_chunks)
                              : "");
    if (r.kind == "resize") {
      out.push_back(fmt::format(
          "     ms after the request: boundary reached {}, plan {}, state ready {}, first step "
          "done {}",
          f(p["aborted"]), f(p["plan_published"]), f(p["state_ready"]),
          f(p["first_step_completed"])));
      out.push_back(fmt::format(
          "     {}; pause {} ms (a normal step {:.0f} ms)", copied,
          j.contains("pause_ms") ? fmt::format("{:.0f}", j["pause_ms"].get<double>()) : "-",
          r.normal_step_seconds * 1000));
      continue;
    }
    out.push_back(
        fmt::format("     ms after the fault{}: detected {}, aborted {}, plan {}, state ready {}, "
                    "first step done {}",
                    r.fault_at ? "" : " (its detection; the fault time is unknown)",
                    f(p["detected"]), f(p["aborted"]), f(p["plan_published"]), f(p["state_ready"]),
                    f(p["first_step_completed"])));
    out.push_back(fmt::format(
        "     {}; downtime {} ms (a normal step {:.0f} ms)", copied,
        j.contains("downtime_ms") ? fmt::format("{:.0f}", j["downtime_ms"].get<double>()) : "-",
        r.normal_step_seconds * 1000));
  }
  return out;
}

json SpareLostRecord(const WorkerInfo& w, const std::string& kind, const std::string& detail) {
  return {{"event", "spare_lost"},
          {"worker_id", w.worker_id},
          {"pid", w.pid},
          {"kind", kind},
          {"detail", detail}};
}

json JoinRefusedRecord(int worker_id, const std::string& why) {
  return {{"event", "join_refused"}, {"worker_id", worker_id}, {"reason", why}};
}

json StatusJson(const StatusView& v, Clock::time_point now) {
  static const char* kPhase[] = {"forming", "running", "recovering", "ended"};
  static const char* kRole[] = {"pending", "member", "spare", "finished", "gone"};
  // One entry per worker, built field by field (three times faster than an
  // initializer list: this runs for every worker at every publication).
  json workers = json::array();
  workers.get_ptr<json::array_t*>()->reserve(v.workers->size());
  for (const auto& [id, w] : *v.workers) {
    json entry(json::value_t::object);
    entry["worker_id"] = id;
    entry["pid"] = w.pid;
    entry["role"] = kRole[static_cast<int>(w.role)];
    entry["rank"] = w.rank;
    entry["last_step"] = w.last_step;
    entry["host"] = w.host;
    entry["heartbeat_age_ms"] = std::llround(Ms(now - w.last_heard));
    workers.push_back(std::move(entry));
  }
  json hosts = json::array();
  for (const HostInfo* hp : *v.hosts) {
    const HostInfo& h = *hp;
    hosts.push_back({{"host_id", h.host_id},
                     {"alive", h.alive},
                     {"nproc", h.nproc},
                     {"spares", h.spares},
                     {"address", h.address},
                     {"incarnation", h.incarnation},
                     {"lost_reason", h.lost_reason}});
  }
  json members = json::array();
  for (int id : *v.members) members.push_back(id);
  return {{"phase", kPhase[static_cast<int>(v.phase)]},
          {"generation", v.generation},
          {"world_size", v.members->size()},
          {"target_world_size", v.target_world},
          {"members", std::move(members)},
          {"spares", v.spares},
          {"highest_step", v.highest_step},
          {"workers", std::move(workers)},
          {"recoveries", v.recoveries},
          {"policy", v.policy},
          {"hosts", std::move(hosts)}};
}

}  // namespace nonstop::controller
