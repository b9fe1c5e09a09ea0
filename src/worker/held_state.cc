#include "worker/held_state.h"

#include <algorithm>

namespace nonstop::worker {

HeldState HeldState::Take(const state::StateRegistry& state) {
  HeldState held;
  const auto& regions = state.regions();
  held.regions_.reserve(regions.size());
  for (size_t i = 0; i < regions.size(); ++i) {
    std::vector<std::byte> copy(regions[i].bytes.size());
    state.ReadRegion(i, 0, copy);
    held.bytes_ += copy.size();
    held.regions_.push_back(std::move(copy));
  }
  return held;
}

std::vector<std::string> HeldState::Restore(state::StateRegistry* state) const {
  std::vector<std::string> changed;
  const auto& regions = state->regions();
  std::vector<std::byte> live;
  for (size_t i = 0; i < regions.size() && i < regions_.size(); ++i) {
    live.resize(regions_[i].size());
    state->ReadRegion(i, 0, live);
    if (std::equal(live.begin(), live.end(), regions_[i].begin())) continue;
    state->WriteRegion(i, 0, regions_[i]);
    changed.push_back(regions[i].name);
  }
  return changed;
}

}  // namespace nonstop::worker
