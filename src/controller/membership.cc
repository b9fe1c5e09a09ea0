#include "controller/membership.h"

#include <fmt/format.h>

namespace nonstop::controller {

WorkerInfo* Membership::Find(int worker_id) {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

const WorkerInfo* Membership::Find(int worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

void Membership::SetRole(WorkerInfo& w, WorkerRole role) {
  if (w.role == role) return;
  if (w.role == WorkerRole::kPending) pending_.erase(w.worker_id);
  if (w.role == WorkerRole::kSpare) --spare_count_;
  w.role = role;
  if (role == WorkerRole::kPending) pending_.insert(w.worker_id);
  if (role == WorkerRole::kSpare) ++spare_count_;
}

void Membership::SetMembers(std::vector<int> ids, std::vector<WorkerInfo*> info) {
  members_ = std::move(ids);
  member_info_ = std::move(info);
  if (member_info_.size() == members_.size()) return;
  member_info_.clear();
  member_info_.reserve(members_.size());
  for (int id : members_) member_info_.push_back(&workers_[id]);
}

int Membership::RankOf(int worker_id) const {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || !IsLiveMember(it->second)) return -1;
  return it->second.rank;
}

bool Membership::AdoptionPending() const {
  for (int id : unconfirmed_) {
    auto it = workers_.find(id);
    if (it == workers_.end() || it->second.role != WorkerRole::kGone) return true;
  }
  return false;
}

std::string Describe(const WorkerInfo& w, std::string_view unnamed_host) {
  std::string on = w.host.empty() || w.host == unnamed_host ? "" : " on host " + w.host;
  if (w.rank >= 0)
    return fmt::format("rank {} (worker {}, pid {}{})", w.rank, w.worker_id, w.pid, on);
  return fmt::format("spare worker {} (pid {}{})", w.worker_id, w.pid, on);
}

}  // namespace nonstop::controller
