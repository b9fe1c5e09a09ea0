#include "controller/plan_wire.h"

#include <unordered_map>

namespace nonstop::controller {

void PlanWire::Start(const std::shared_ptr<const control::PlanMsg>& plan) {
  previous_ = std::move(current_);
  previous_serial_ = current_serial_;
  current_ = plan;
  ++current_serial_;
  // Computed from the plan itself, never from the cached member runs: a delta whose runs are not
  // this plan's is then refused at the worker instead of adopted.
  current_digest_ = control::MembersDigest(current_->members);
  // Only a worker sent the plan that is now the previous one can get a delta: forget the others
  // (workers that left the job, failed sends), so held_ stays within two plans' members.
  std::erase_if(held_, [&](const auto& h) { return h.second.plan != previous_serial_; });
  standalone_.clear();
  shared_delta_.clear();
  delta_members_.reset();
  transfers_of_.reset();
}

PlanWire::Frame PlanWire::For(int worker_id, uint64_t connection,
                              const std::shared_ptr<const control::PlanMsg>& plan) {
  if (plan != current_) Start(plan);
  auto it = held_.find(worker_id);
  const bool holds_previous = previous_ != nullptr && connection != 0 && it != held_.end() &&
                              it->second.connection == connection &&
                              it->second.plan == previous_serial_;
  if (!holds_previous) {
    if (standalone_.empty()) {
      standalone_ = control::EncodePlanDelta(*current_, control::DiffMembers(*current_, nullptr),
                                             current_->transfers, current_digest_);
    }
    return {control::kMsgPlanDelta, &standalone_, false};
  }
  if (!delta_members_) delta_members_ = control::DiffMembers(*current_, previous_.get());
  if (!transfers_of_) {
    transfers_of_.emplace();
    for (size_t i = 0; i < current_->transfers.size(); ++i) {
      const control::PlanTransfer& t = current_->transfers[i];
      (*transfers_of_)[t.receiver].push_back(i);
      for (int source : t.sources) {
        std::vector<size_t>& of = (*transfers_of_)[source];
        if (of.empty() || of.back() != i) of.push_back(i);
      }
    }
  }
  auto own = transfers_of_->find(worker_id);
  if (own == transfers_of_->end()) {
    if (shared_delta_.empty())
      shared_delta_ = control::EncodePlanDelta(*current_, *delta_members_, {}, current_digest_);
    return {control::kMsgPlanDelta, &shared_delta_, true};
  }
  std::vector<control::PlanTransfer> transfers;
  for (size_t i : own->second) transfers.push_back(current_->transfers[i]);
  own_delta_ = control::EncodePlanDelta(*current_, *delta_members_, transfers, current_digest_);
  return {control::kMsgPlanDelta, &own_delta_, true};
}

void PlanWire::Sent(int worker_id, uint64_t connection, bool ok) {
  if (ok && connection != 0) {
    held_[worker_id] = {connection, current_serial_};
  } else {
    held_.erase(worker_id);
  }
}

}  // namespace nonstop::controller
