#include "controller/placement.h"

#include <algorithm>

#include "state/shard_layout.h"

namespace nonstop::controller {

HostInfo* Placement::FindHost(const std::string& host_id) {
  auto it = hosts_.find(host_id);
  return it == hosts_.end() ? nullptr : &it->second;
}

const HostInfo* Placement::FindHost(const std::string& host_id) const {
  auto it = hosts_.find(host_id);
  return it == hosts_.end() ? nullptr : &it->second;
}

HostInfo& Placement::AddHost(const std::string& host_id) {
  HostInfo& h = hosts_[host_id];
  h.host_id = host_id;
  host_order_.push_back(host_id);
  host_list_.push_back(&h);
  return h;
}

bool Placement::HostResponsive(const std::string& host_id, Clock::time_point now,
                               Millis heartbeat_timeout) const {
  if (host_id.empty()) return true;
  auto it = hosts_.find(host_id);
  return it != hosts_.end() && it->second.alive && !it->second.inherited && !it->second.leaving &&
         now - it->second.last_heard <= heartbeat_timeout / 2;
}

int Placement::FreeSlots(const HostInfo& h) const {
  if (h.leaving) return 0;  // its capacity is being taken back
  auto it = live_on_host_.find(h.host_id);
  int used = it == live_on_host_.end() ? 0 : it->second;
  auto w = withheld_.find(h.host_id);
  used += w == withheld_.end() ? 0 : w->second;
  return std::max(0, h.nproc + h.spares - used);
}

void Placement::Started(int worker_id, const std::string& host_id) {
  if (!host_id.empty()) host_of_[worker_id] = host_id;
  MarkLive(worker_id);
}

void Placement::MarkLive(int worker_id) {
  if (!live_processes_.insert(worker_id).second) return;
  if (auto h = host_of_.find(worker_id); h != host_of_.end()) ++live_on_host_[h->second];
}

void Placement::MarkEnded(int worker_id) {
  if (live_processes_.erase(worker_id) == 0) return;
  if (auto h = host_of_.find(worker_id); h != host_of_.end()) --live_on_host_[h->second];
}

std::string Placement::HostOf(int worker_id) const {
  auto it = host_of_.find(worker_id);
  return it == host_of_.end() ? "" : it->second;
}

int Placement::PlacedWorld() const {
  int world = 0;
  for (const HostInfo* h : host_list_) world += h->alive && !h->leaving ? h->nproc : 0;
  return world;
}

std::vector<Placement::Slot> Placement::PlaceAll() const {
  // Each process started takes one free slot of its host (a new worker id is
  // never live), so a host takes as many as it has free, workers first.
  std::vector<Slot> slots;
  for (const HostInfo* h : host_list_) {
    if (!h->alive) continue;
    const int n = std::min(h->nproc + h->spares, FreeSlots(*h));
    for (int i = 0; i < n; ++i) slots.push_back({h->host_id, /*spare=*/i >= h->nproc});
  }
  return slots;
}

std::vector<std::string> Placement::TopUpTargets() const {
  std::vector<std::string> targets;
  for (const HostInfo* h : host_list_) {
    // an inherited agent takes orders once it has joined this controller
    if (!h->alive || h->inherited) continue;
    if (auto f = host_refill_failures_.find(h->host_id);
        f != host_refill_failures_.end() && f->second > 3)
      continue;
    if (auto f = spare_failures_.find(h->host_id); f != spare_failures_.end() && f->second > 3)
      continue;
    for (int free = FreeSlots(*h); free > 0; --free) targets.push_back(h->host_id);
  }
  return targets;
}

const HostInfo* Placement::FirstHostWithFreeSlot() const {
  for (const HostInfo* h : host_list_) {
    if (h->alive && FreeSlots(*h) > 0) return h;
  }
  return nullptr;
}

std::vector<int> ExposedShards(const std::vector<WorkerInfo*>& members, int shard_group) {
  if (shard_group <= 1) return {};
  auto layout = state::LayoutOf(static_cast<int>(members.size()), shard_group);
  if (!layout.ok()) return {};
  std::vector<std::string> host_of_rank;
  for (const WorkerInfo* w : members) host_of_rank.push_back(w->host);
  // one host holds all anyway
  if (std::set<std::string>(host_of_rank.begin(), host_of_rank.end()).size() < 2) return {};
  return state::ShardsOnOneHost(*layout, host_of_rank);
}

}  // namespace nonstop::controller
