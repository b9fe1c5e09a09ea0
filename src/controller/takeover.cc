#include "controller/takeover.h"

#include <chrono>
#include <map>

#include <fmt/format.h>

namespace nonstop::controller {

using nlohmann::json;

Result<JournalTakeover> TakeoverFromJournal(const std::vector<json>& records) {
  JournalTakeover out;
  TakeoverState& s = out.state;
  std::map<int, TakeoverState::Worker> workers;
  std::map<std::string, TakeoverState::Host> hosts;
  bool started = false;
  int shrink_asked = 0;  // a shrink on request whose plan is not journaled yet
  auto id_of = [](const json& r) {
    return r.contains("worker_id") && r["worker_id"].is_number_integer() ? r["worker_id"].get<int>()
                                                                         : -1;
  };
  try {
    for (const json& r : records) {
      const std::string event = r.value("event", "");
      if (event == "job_start") {
        out = JournalTakeover{};
        workers.clear();
        hosts.clear();
        started = true;
        out.controller = r.value("controller", "");
      } else if (event == "controller_start") {
        out.controller = r.value("controller", out.controller);
      } else if (event == "job_end") {
        return FailedPreconditionError(fmt::format(
            "the job in this journal already ended (exit code {}: {}): there is nothing to take "
            "over",
            r.value("exit_code", -1), r.value("reason", std::string("no reason recorded"))));
      } else if (event == "takeover") {
        s.takeovers = std::max(s.takeovers, r.value("takeover", 0));
      } else if (event == "host_join" || event == "host_rejoin") {
        const std::string id = r.value("host", "");
        TakeoverState::Host& h = hosts[id];
        h.host_id = id;
        if (event == "host_join") {
          s.withheld.erase(id);  // a host that joins afresh brings its whole capacity
          h.nproc = r.value("nproc", 0);
          h.spares = r.value("spares", 0);
          h.address = r.value("address", "");
          h.elastic = r.value("elastic", false);
        }
        h.incarnation = r.value("incarnation", h.incarnation);
      } else if (event == "host_lost" || event == "host_left") {
        const std::string id = r.value("host", "");
        hosts.erase(id);
        s.withheld.erase(id);
        for (auto it = workers.begin(); it != workers.end();) {
          it = it->second.host == id ? workers.erase(it) : std::next(it);
        }
      } else if (event == "spawn") {
        int id = id_of(r);
        if (id < 0) continue;
        TakeoverState::Worker& w = workers[id];
        w.worker_id = id;
        w.pid = r.value("pid", int64_t{0});
        w.spare = r.value("spare", true);
        w.host = r.value("host", w.host);
        s.next_worker_id = std::max(s.next_worker_id, id + 1);
      } else if (event == "join" || event == "rejoin") {
        int id = id_of(r);
        if (id < 0) continue;
        TakeoverState::Worker& w = workers[id];
        w.worker_id = id;
        w.pid = r.value("pid", w.pid);
        if (event == "join") {
          w.address = r.value("address", "");
          w.spare = r.value("spare", false);
          w.host = r.value("host", w.host);
        }
        s.next_worker_id = std::max(s.next_worker_id, id + 1);
      } else if (event == "plan") {
        if (shrink_asked > 0) s.target_world = shrink_asked;
        shrink_asked = 0;
        s.generation = r.at("generation").get<uint32_t>();
        s.members = r.at("members").get<std::vector<int>>();
        s.resume_step = r.value("resume_step", int64_t{0});
        if (s.open_recovery && r.value("recovery", 0) == s.open_recovery->id) {
          s.open_recovery->plan_generation = s.generation;
          s.open_recovery->plan_us = r.value("time_us", int64_t{0});
        }
        if (r.contains("released") && r["released"].is_array()) {
          for (const json& id : r["released"]) {
            if (!id.is_number_integer()) continue;
            auto it = workers.find(id.get<int>());
            if (it == workers.end()) continue;
            // capacity given back by the shrink
            if (!it->second.host.empty()) ++s.withheld[it->second.host];
            workers.erase(it);  // shut down by a shrink
          }
        }
      } else if (event == "exit" || event == "fault" || event == "fence") {
        int id = id_of(r);
        if (id >= 0) workers.erase(id);
      } else if (event == "restart") {
        // every worker was restarted from a checkpoint, on the hosts' whole capacity
        workers.clear();
        s.withheld.clear();
        s.target_world = 0;
        shrink_asked = 0;
      } else if (event == "scale_request") {
        // The world asked for stands; a grow takes back every slot a shrink gave back. A shrink
        // counts once its plan is journaled: a takeover in the middle of its drain forms the
        // generation again from every member, and the world it asked for is not reached.
        int to = r.value("to", 0), from = r.value("from", 0);
        if (to < from) {
          shrink_asked = to;
        } else {
          s.target_world = to;
          s.withheld.clear();
        }
      } else if (event == "step") {
        s.highest_step = std::max(s.highest_step, r.value("step", int64_t{-1}));
      } else if (event == "recovery_start" || event == "resize_start") {
        UnfinishedRecovery& o = s.open_recovery.emplace();
        o.id = r.value("recovery", 0);
        o.planned = event == "resize_start";
        o.from_generation = r.value("generation", s.generation);
        o.old_members = s.members;
        o.cause = r.value("cause", "");
        o.injected = r.value("injected", "");
        o.started_us = r.value("time_us", int64_t{0});
        s.recoveries = std::max(s.recoveries, o.id);
      } else if (event == "recovery_end" && r.contains("recovery")) {
        const int id = r["recovery"].value("id", 0);
        s.recoveries = std::max(s.recoveries, id);
        if (s.open_recovery && s.open_recovery->id == id) s.open_recovery.reset();
      }
    }
  } catch (const json::exception& e) {
    return InvalidArgumentError(
        fmt::format("the journal has a record of the wrong shape: {}", e.what()));
  }
  if (!started)
    return InvalidArgumentError(
        "the journal has no job_start record: it is not a nonstop job's journal");
  if (s.generation == 0) {
    return FailedPreconditionError(
        "the job in this journal never formed (no plan): start it again instead");
  }
  s.read_at_us = std::chrono::duration_cast<std::chrono::microseconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  for (auto& [id, w] : workers) s.workers.push_back(w);
  for (auto& [id, h] : hosts) s.hosts.push_back(h);
  return out;
}

}  // namespace nonstop::controller
