// A realistic journal for the tests and the benchmark of the takeover and of
// etcd's bounded journal: a job on a few hosts through many recoveries of
// every kind (a member's fault, a host lost and back, a shrink and a grow, a
// restart from a checkpoint, a takeover), with their ready records and steps, and the writes
// of the job's store the members make meanwhile (a counter, a key set and deleted).
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "controller/job_store.h"

namespace nonstop::controller::testing {

class JournalMaker {
 public:
  // `world` members and one spare per host over `hosts` hosts.
  JournalMaker(int world, int hosts) : world_(world), hosts_(hosts) {
    Add({{"event", "job_start"}, {"controller", "10.0.0.1:7000"}, {"epoch", 1}});
    for (int h = 0; h < hosts_; ++h) HostJoin(h);
    for (int i = 0; i < world_; ++i) members_.push_back(Spawn(i % hosts_, false));
    for (int h = 0; h < hosts_; ++h) spares_.push_back(Spawn(h, true));
    Plan(0, {});
  }

  // One recovery (or resize) of the kind its number picks, then a few steps.
  void Recovery() {
    const int id = ++recoveries_;
    switch (id % 6) {
      case 0:
        HostLoss(id);
        break;
      case 1:
      case 4:
        Fault(id);
        break;
      case 2:
        Shrink(id);
        break;
      case 3:
        Grow(id);
        break;
      case 5:
        if (id % 12 == 5) {
          Restart(id);
        } else {
          Takeover();
          Fault(id);
        }
        break;
    }
    for (int i = 0; i < 3; ++i) Add({{"event", "step"}, {"step", ++step_}, {"loss", 1.5}});
    StoreWrites(id);
  }

  const std::vector<nlohmann::json>& records() const { return records_; }

 private:
  void Add(nlohmann::json r) {
    r["time_us"] = int64_t{1'700'000'000'000'000} + static_cast<int64_t>(records_.size()) * 1000;
    records_.push_back(std::move(r));
  }
  std::string Host(int h) const { return fmt::format("node{:03d}", h); }
  void HostJoin(int h) {
    Add({{"event", "host_join"},
         {"host", Host(h)},
         {"nproc", (world_ + hosts_ - 1) / hosts_ + 1},
         {"spares", 1},
         {"address", fmt::format("10.0.1.{}:7100", h)},
         {"incarnation", ++incarnation_},
         {"elastic", h % 2 == 0}});
  }
  int Spawn(int h, bool spare) {
    int id = next_id_++;
    Add({{"event", "spawn"},
         {"worker_id", id},
         {"pid", 1000 + id},
         {"spare", spare},
         {"host", Host(h)}});
    Add({{"event", "join"},
         {"worker_id", id},
         {"pid", 1000 + id},
         {"address", fmt::format("10.0.1.{}:{}", h, 20000 + id)},
         {"spare", spare},
         {"host", Host(h)}});
    host_of_[id] = h;
    return id;
  }
  void Plan(int recovery, const std::vector<int>& released) {
    ++generation_;
    for (int id : members_)
      Add({{"event", "ready"}, {"worker_id", id}, {"generation", generation_}});
    nlohmann::json plan = {{"event", "plan"},
                           {"generation", generation_},
                           {"members", members_},
                           {"resume_step", step_},
                           {"recovery", recovery}};
    if (!released.empty()) plan["released"] = released;
    Add(plan);
  }
  void Start(int id, const char* event, const char* cause) {
    Add({{"event", event},
         {"recovery", id},
         {"generation", generation_},
         {"cause", cause},
         {"injected", id % 4 == 0 ? "kill" : ""}});
  }
  void End(int id) {
    Add({{"event", "recovery_end"}, {"recovery", {{"id", id}, {"outcome", "ok"}}}});
  }
  // A member faults; a spare takes its rank and a new spare is started on its host.
  void Fault(int id) {
    Start(id, "recovery_start", "heartbeat timeout");
    size_t rank = static_cast<size_t>(id) % members_.size();
    int victim = members_[rank];
    Add({{"event", "fault"}, {"worker_id", victim}, {"reason", "exit 137"}});
    int spare = spares_.front();
    spares_.erase(spares_.begin());
    members_[rank] = spare;
    spares_.push_back(Spawn(host_of_[victim], true));
    Plan(id, {});
    End(id);
  }
  // A host is lost with its workers; the members elsewhere go on, then the host comes back.
  void HostLoss(int id) {
    const int h = id % hosts_;
    Start(id, "recovery_start", "host lost");
    Add({{"event", "host_lost"}, {"host", Host(h)}});
    auto on_h = [&](int w) { return host_of_[w] == h; };
    int lost = static_cast<int>(std::count_if(members_.begin(), members_.end(), on_h));
    std::erase_if(members_, on_h);
    std::erase_if(spares_, on_h);
    for (int i = 0; i < lost && !spares_.empty(); ++i) {
      members_.push_back(spares_.front());
      spares_.erase(spares_.begin());
    }
    Plan(id, {});
    End(id);
    HostJoin(h);
    while (static_cast<int>(members_.size()) < world_) members_.push_back(Spawn(h, false));
    while (static_cast<int>(spares_.size()) < hosts_) spares_.push_back(Spawn(h, true));
    Start(++recoveries_, "resize_start", "grow");
    Plan(recoveries_, {});
    End(recoveries_);
  }
  void Shrink(int id) {
    const int from = static_cast<int>(members_.size());
    Add({{"event", "scale_request"}, {"from", from}, {"to", from - 1}});
    Start(id, "resize_start", "shrink");
    int released = members_.back();
    members_.pop_back();
    Plan(id, {released});
    End(id);
  }
  void Grow(int id) {
    const int from = static_cast<int>(members_.size());
    Add({{"event", "scale_request"}, {"from", from}, {"to", world_}});
    Start(id, "resize_start", "grow");
    while (static_cast<int>(members_.size()) < world_)
      members_.push_back(Spawn(id % hosts_, false));
    Plan(id, {});
    End(id);
  }
  void Restart(int id) {
    Start(id, "recovery_start", "nccl error");
    Add({{"event", "restart"}, {"checkpoint_step", step_}});
    const int world = static_cast<int>(members_.size());
    members_.clear();
    spares_.clear();
    for (int i = 0; i < world; ++i) members_.push_back(Spawn(i % hosts_, false));
    for (int h = 0; h < hosts_; ++h) spares_.push_back(Spawn(h, true));
    Plan(id, {});
    End(id);
  }
  void Takeover() {
    ++takeovers_;
    Add({{"event", "takeover"}, {"takeover", takeovers_}});
    Add({{"event", "controller_start"},
         {"controller", fmt::format("10.0.0.{}:7000", 1 + takeovers_ % 3)},
         {"epoch", 1 + takeovers_}});
    for (int id : members_) Add({{"event", "rejoin"}, {"worker_id", id}, {"pid", 1000 + id}});
    for (int h = 0; h < hosts_; ++h)
      Add({{"event", "host_rejoin"}, {"host", Host(h)}, {"incarnation", incarnation_}});
  }

  // A member counts in the store, sets a key of this recovery and deletes the previous one's.
  void StoreWrite(control::StoreOp op, std::string key, std::string value = "") {
    const int worker = members_[static_cast<size_t>(store_seq_) % members_.size()];
    control::StoreRequestMsg m;
    m.client = fmt::format("client-{}", worker);
    m.seq = ++store_seq_;
    m.op = op;
    m.keys = {std::move(key)};
    m.value = std::move(value);
    m.amount = 1;
    JobStore::Outcome o = store_.Handle(worker, m, Clock::now());
    if (o.record) Add(std::move(*o.record));
  }
  void StoreWrites(int id) {
    StoreWrite(control::StoreOp::kAdd, "count");
    StoreWrite(control::StoreOp::kSet, fmt::format("key/{}", id), std::string(16, 'a' + id % 26));
    if (!last_key_.empty()) StoreWrite(control::StoreOp::kDeleteKey, last_key_);
    last_key_ = fmt::format("key/{}", id);
  }

  int world_, hosts_;
  JobStore store_;
  int64_t store_seq_ = 0;
  std::string last_key_;
  std::vector<nlohmann::json> records_;
  std::vector<int> members_, spares_;
  std::map<int, int> host_of_;
  int next_id_ = 0, generation_ = 0, recoveries_ = 0, takeovers_ = 0, incarnation_ = 0;
  int64_t step_ = 0;
};

}  // namespace nonstop::controller::testing
