#include "worker/user_groups.h"

#include <algorithm>
#include <set>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace nonstop::worker {
namespace {

// Every member of a group must number its frames alike, whatever other groups each made: the
// op space is the ranks' own (1-127). Groups that share one still keep apart: a generation's
// collectives run one at a time, and a failed one ends the generation.
uint32_t OpSpaceOf(const std::vector<int>& ranks) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (int r : ranks) {
    h ^= static_cast<uint32_t>(r);
    h *= 16777619u;
  }
  return 1 + h % 127;
}

}  // namespace

Result<int> UserGroups::Add(std::vector<int> ranks, std::span<const int> members, int my_rank,
                            Millis timeout) {
  const std::set<int> distinct(ranks.begin(), ranks.end());
  if (ranks.empty() || distinct.size() != ranks.size() || *distinct.begin() < 0 ||
      *distinct.rbegin() >= static_cast<int>(members.size())) {
    return InvalidArgumentError(
        fmt::format("a group of ranks [{}]: they must be distinct ranks of the world of {}",
                    fmt::join(ranks, ", "), members.size()));
  }
  if (!distinct.contains(my_rank)) {
    return InvalidArgumentError(fmt::format(
        "a group of ranks [{}] made by rank {}, not one of them", fmt::join(ranks, ", "), my_rank));
  }
  Group g;
  for (int r : ranks) g.workers.push_back(members[static_cast<size_t>(r)]);
  g.op_space = OpSpaceOf(ranks);
  g.timeout = timeout;
  g.ranks = std::move(ranks);
  groups_.push_back(std::move(g));
  return static_cast<int>(groups_.size());
}

Result<collective::Communicator*> UserGroups::Get(int id, const collective::Communicator& world,
                                                  std::span<const int> members) {
  if (id < 1 || id > static_cast<int>(groups_.size())) {
    return NotFoundError(fmt::format("no group {} (this process made {})", id, groups_.size()));
  }
  Group& g = groups_[static_cast<size_t>(id - 1)];
  if (g.comm != nullptr) return g.comm.get();
  for (size_t i = 0; i < g.ranks.size(); ++i) {
    const auto r = static_cast<size_t>(g.ranks[i]);
    const int now = r < members.size() ? members[r] : -1;
    if (now != g.workers[i]) {
      return FailedPreconditionError(fmt::format(
          "the group of ranks [{}] was made when worker {} held rank {}; since the change of "
          "membership it is {} (HINT: make the group again with new_group after the change: "
          "nonstop.torch's on_membership_change, or at the step's start)",
          fmt::join(g.ranks, ", "), g.workers[i], r,
          now < 0 ? "no rank of the world" : fmt::format("worker {}", now)));
    }
  }
  g.comm = world.SubGroup(g.ranks, g.op_space, g.timeout);
  return g.comm.get();
}

void UserGroups::NewGeneration() {
  for (Group& g : groups_) g.comm.reset();
}

}  // namespace nonstop::worker
