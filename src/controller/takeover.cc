#include "controller/takeover.h"

#include <chrono>
#include <map>
#include <set>

#include <fmt/format.h>

namespace nonstop::controller {

using nlohmann::json;

namespace {

// The snapshot's format: a replay refuses a snapshot of a format it does not know. 2 added the
// job's store (format 1, which has none, is still read).
constexpr int kSnapshotFormat = 2;

json WorkerToJson(const TakeoverState::Worker& w) {
  return {{"worker_id", w.worker_id},
          {"pid", w.pid},
          {"address", w.address},
          {"spare", w.spare},
          {"host", w.host}};
}
TakeoverState::Worker WorkerFromJson(const json& j) {
  TakeoverState::Worker w;
  w.worker_id = j.at("worker_id").get<int>();
  w.pid = j.at("pid").get<int64_t>();
  w.address = j.at("address").get<std::string>();
  w.spare = j.at("spare").get<bool>();
  w.host = j.at("host").get<std::string>();
  return w;
}
json HostToJson(const TakeoverState::Host& h) {
  return {{"host", h.host_id},
          {"nproc", h.nproc},
          {"spares", h.spares},
          {"address", h.address},
          {"incarnation", h.incarnation},
          {"elastic", h.elastic}};
}
TakeoverState::Host HostFromJson(const json& j) {
  TakeoverState::Host h;
  h.host_id = j.at("host").get<std::string>();
  h.nproc = j.at("nproc").get<int>();
  h.spares = j.at("spares").get<int>();
  h.address = j.at("address").get<std::string>();
  h.incarnation = j.at("incarnation").get<int>();
  h.elastic = j.at("elastic").get<bool>();
  return h;
}
json RecoveryToJson(const UnfinishedRecovery& o) {
  return {{"id", o.id},
          {"planned", o.planned},
          {"from_generation", o.from_generation},
          {"old_members", o.old_members},
          {"cause", o.cause},
          {"injected", o.injected},
          {"started_us", o.started_us},
          {"plan_generation", o.plan_generation},
          {"plan_us", o.plan_us}};
}
UnfinishedRecovery RecoveryFromJson(const json& j) {
  UnfinishedRecovery o;
  o.id = j.at("id").get<int>();
  o.planned = j.at("planned").get<bool>();
  o.from_generation = j.at("from_generation").get<uint32_t>();
  o.old_members = j.at("old_members").get<std::vector<int>>();
  o.cause = j.at("cause").get<std::string>();
  o.injected = j.at("injected").get<std::string>();
  o.started_us = j.at("started_us").get<int64_t>();
  o.plan_generation = j.at("plan_generation").get<uint32_t>();
  o.plan_us = j.at("plan_us").get<int64_t>();
  return o;
}

// The replay's state: the takeover being built and what the fold remembers besides (the state's
// worker and host lists are filled from the maps once the replay ends).
class Fold {
 public:
  // One record; an error if the job ended (nothing to take over).
  Status Apply(const json& r);
  json Save() const;
  void Load(const json& snapshot);  // throws json::exception on a malformed snapshot
  Result<JournalTakeover> Finish();

 private:
  void Plan(const json& r);
  void RecoveryStart(const json& r, const std::string& event);

  JournalTakeover out_;
  std::map<int, TakeoverState::Worker> workers_;
  std::map<std::string, TakeoverState::Host> hosts_;
  bool started_ = false;
  int shrink_asked_ = 0;  // a shrink on request whose plan is not journaled yet
  JobStore store_;        // the job's store: its writes ("store" records) replayed
};

int IdOf(const json& r) {
  return r.contains("worker_id") && r["worker_id"].is_number_integer() ? r["worker_id"].get<int>()
                                                                       : -1;
}

void Fold::Plan(const json& r) {
  TakeoverState& s = out_.state;
  if (shrink_asked_ > 0) s.target_world = shrink_asked_;
  shrink_asked_ = 0;
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
      auto it = workers_.find(id.get<int>());
      if (it == workers_.end()) continue;
      // capacity given back by the shrink
      if (!it->second.host.empty()) ++s.withheld[it->second.host];
      store_.Gone(it->first);
      workers_.erase(it);  // shut down by a shrink
    }
  }
}

void Fold::RecoveryStart(const json& r, const std::string& event) {
  TakeoverState& s = out_.state;
  UnfinishedRecovery& o = s.open_recovery.emplace();
  o.id = r.value("recovery", 0);
  o.planned = event == "resize_start";
  o.from_generation = r.value("generation", s.generation);
  o.old_members = s.members;
  o.cause = r.value("cause", "");
  o.injected = r.value("injected", "");
  o.started_us = r.value("time_us", int64_t{0});
  s.recoveries = std::max(s.recoveries, o.id);
}

Status Fold::Apply(const json& r) {
  TakeoverState& s = out_.state;
  const std::string event = r.value("event", "");
  if (event == "snapshot") {
    Load(r);
  } else if (event == "job_start") {
    out_ = JournalTakeover{};
    workers_.clear();
    hosts_.clear();
    store_ = JobStore();
    started_ = true;
    out_.controller = r.value("controller", "");
  } else if (event == "controller_start") {
    out_.controller = r.value("controller", out_.controller);
  } else if (event == "job_end") {
    return FailedPreconditionError(fmt::format(
        "the job in this journal already ended (exit code {}: {}): there is nothing to take "
        "over",
        r.value("exit_code", -1), r.value("reason", std::string("no reason recorded"))));
  } else if (event == "takeover") {
    s.takeovers = std::max(s.takeovers, r.value("takeover", 0));
  } else if (event == "host_join" || event == "host_rejoin") {
    const std::string id = r.value("host", "");
    TakeoverState::Host& h = hosts_[id];
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
    hosts_.erase(id);
    s.withheld.erase(id);
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (it->second.host != id) {
        ++it;
        continue;
      }
      store_.Gone(it->first);
      it = workers_.erase(it);
    }
  } else if (event == "spawn") {
    int id = IdOf(r);
    if (id < 0) return OkStatus();
    TakeoverState::Worker& w = workers_[id];
    w.worker_id = id;
    w.pid = r.value("pid", int64_t{0});
    w.spare = r.value("spare", true);
    w.host = r.value("host", w.host);
    s.next_worker_id = std::max(s.next_worker_id, id + 1);
  } else if (event == "join" || event == "rejoin") {
    int id = IdOf(r);
    if (id < 0) return OkStatus();
    TakeoverState::Worker& w = workers_[id];
    w.worker_id = id;
    w.pid = r.value("pid", w.pid);
    if (event == "join") {
      w.address = r.value("address", "");
      w.spare = r.value("spare", false);
      w.host = r.value("host", w.host);
    }
    s.next_worker_id = std::max(s.next_worker_id, id + 1);
  } else if (event == "plan") {
    Plan(r);
  } else if (event == "exit" || event == "fault" || event == "fence") {
    int id = IdOf(r);
    if (id >= 0) workers_.erase(id);
    if (id >= 0) store_.Gone(id);
  } else if (event == "restart") {
    // every worker was restarted from a checkpoint, on the hosts' whole capacity
    for (const auto& [id, w] : workers_) store_.Gone(id);
    workers_.clear();
    s.withheld.clear();
    s.target_world = 0;
    shrink_asked_ = 0;
  } else if (event == "scale_request") {
    // The world asked for stands; a grow takes back every slot a shrink gave back. A shrink
    // counts once its plan is journaled: a takeover in the middle of its drain forms the
    // generation again from every member, and the world it asked for is not reached.
    int to = r.value("to", 0), from = r.value("from", 0);
    if (to < from) {
      shrink_asked_ = to;
    } else {
      s.target_world = to;
      s.withheld.clear();
    }
  } else if (event == "store") {
    return store_.Replay(r);
  } else if (event == "step") {
    s.highest_step = std::max(s.highest_step, r.value("step", int64_t{-1}));
  } else if (event == "recovery_start" || event == "resize_start") {
    RecoveryStart(r, event);
  } else if (event == "recovery_end" && r.contains("recovery")) {
    const int id = r["recovery"].value("id", 0);
    s.recoveries = std::max(s.recoveries, id);
    if (s.open_recovery && s.open_recovery->id == id) s.open_recovery.reset();
  }
  return OkStatus();
}

json Fold::Save() const {
  const TakeoverState& s = out_.state;
  json state = {{"generation", s.generation},
                {"members", s.members},
                {"resume_step", s.resume_step},
                {"highest_step", s.highest_step},
                {"next_worker_id", s.next_worker_id},
                {"target_world", s.target_world},
                {"withheld", s.withheld},
                {"recoveries", s.recoveries},
                {"takeovers", s.takeovers},
                {"workers", json::array()},
                {"hosts", json::array()}};
  if (s.open_recovery) state["open_recovery"] = RecoveryToJson(*s.open_recovery);
  for (const auto& [id, w] : workers_) state["workers"].push_back(WorkerToJson(w));
  for (const auto& [id, h] : hosts_) state["hosts"].push_back(HostToJson(h));
  return {{"event", "snapshot"},           {"format", kSnapshotFormat},
          {"started", started_},           {"controller", out_.controller},
          {"shrink_asked", shrink_asked_}, {"state", std::move(state)},
          {"store", store_.Save()}};
}

void Fold::Load(const json& snapshot) {
  const int format = snapshot.at("format").get<int>();
  if (format != kSnapshotFormat && format != 1) {
    throw std::invalid_argument(fmt::format(
        "a snapshot of format {} (this nonstop reads formats 1 to {}: take over with the nonstop "
        "that wrote it)",
        snapshot.at("format").dump(), kSnapshotFormat));
  }
  Fold f;
  const json& state = snapshot.at("state");
  TakeoverState& s = f.out_.state;
  s.generation = state.at("generation").get<uint32_t>();
  s.members = state.at("members").get<std::vector<int>>();
  s.resume_step = state.at("resume_step").get<int64_t>();
  s.highest_step = state.at("highest_step").get<int64_t>();
  s.next_worker_id = state.at("next_worker_id").get<int>();
  s.target_world = state.at("target_world").get<int>();
  s.withheld = state.at("withheld").get<std::map<std::string, int>>();
  s.recoveries = state.at("recoveries").get<int>();
  s.takeovers = state.at("takeovers").get<int>();
  if (state.contains("open_recovery")) s.open_recovery = RecoveryFromJson(state["open_recovery"]);
  for (const json& w : state.at("workers")) {
    TakeoverState::Worker worker = WorkerFromJson(w);
    f.workers_[worker.worker_id] = std::move(worker);
  }
  for (const json& h : state.at("hosts")) {
    TakeoverState::Host host = HostFromJson(h);
    f.hosts_[host.host_id] = std::move(host);
  }
  f.started_ = snapshot.at("started").get<bool>();
  f.out_.controller = snapshot.at("controller").get<std::string>();
  f.shrink_asked_ = snapshot.at("shrink_asked").get<int>();
  if (format >= 2) {
    Result<JobStore> store = JobStore::Load(snapshot.at("store"));
    if (!store.ok()) throw std::invalid_argument(std::string(store.status().message()));
    f.store_ = std::move(*store);
  }
  *this = std::move(f);
}

Result<JournalTakeover> Fold::Finish() {
  TakeoverState& s = out_.state;
  if (!started_)
    return InvalidArgumentError(
        "the journal has no job_start record: it is not a nonstop job's journal");
  if (s.generation == 0) {
    return FailedPreconditionError(
        "the job in this journal never formed (no plan): start it again instead");
  }
  s.read_at_us = std::chrono::duration_cast<std::chrono::microseconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  for (auto& [id, w] : workers_) s.workers.push_back(w);
  for (auto& [id, h] : hosts_) s.hosts.push_back(h);
  s.store = store_.Save();
  return out_;
}

// Replays `records` into `fold`; a malformed record (or snapshot) is an error naming it.
Status Replay(Fold& fold, const std::vector<json>& records) {
  try {
    for (const json& r : records) NONSTOP_RETURN_IF_ERROR(fold.Apply(r));
  } catch (const std::exception& e) {
    return InvalidArgumentError(
        fmt::format("the journal has a record of the wrong shape: {}", e.what()));
  }
  return OkStatus();
}

}  // namespace

Result<JournalTakeover> TakeoverFromJournal(const std::vector<json>& records) {
  Fold fold;
  NONSTOP_RETURN_IF_ERROR(Replay(fold, records));
  return fold.Finish();
}

Result<json> CompactJournal(const std::vector<json>& records) {
  Fold fold;
  NONSTOP_RETURN_IF_ERROR(Replay(fold, records));
  return fold.Save();
}

bool TakeoverReads(const json& record) {
  static const std::set<std::string, std::less<>> kRead = {
      "snapshot",     "job_start",      "controller_start",
      "job_end",      "takeover",       "host_join",
      "host_rejoin",  "host_lost",      "host_left",
      "spawn",        "join",           "rejoin",
      "plan",         "exit",           "fault",
      "fence",        "restart",        "scale_request",
      "step",         "recovery_start", "resize_start",
      "recovery_end", "store"};
  auto it = record.find("event");
  return it == record.end() || !it->is_string() || kRead.contains(it->get<std::string>());
}

}  // namespace nonstop::controller
