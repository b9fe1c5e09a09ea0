#include "state/shard_layout.h"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "common/check.h"

namespace nonstop::state {

std::vector<int> ShardLayout::Replicas(int shard) const {
  std::vector<int> out(static_cast<size_t>(groups()), -1);
  for (int r = 0; r < world(); ++r) {
    if (shard_of_rank[static_cast<size_t>(r)] == shard)
      out[static_cast<size_t>(group_of_rank[static_cast<size_t>(r)])] = r;
  }
  return out;
}

std::vector<int> ShardLayout::Group(int group) const {
  std::vector<int> out(static_cast<size_t>(group_size), -1);
  for (int r = 0; r < world(); ++r) {
    if (group_of_rank[static_cast<size_t>(r)] == group)
      out[static_cast<size_t>(shard_of_rank[static_cast<size_t>(r)])] = r;
  }
  return out;
}

Result<ShardLayout> LayoutOf(int world, int group_size) {
  if (group_size < 1)
    return InvalidArgumentError(fmt::format("shard group size {} is not positive", group_size));
  if (world < 1 || world % group_size != 0) {
    return InvalidArgumentError(fmt::format(
        "a world of {} cannot be split into shard groups of {}: the world must be a multiple of "
        "optimizer.shard_group (allow only such sizes: nonstop run --allowed-sizes or "
        "--world-increment {})",
        world, group_size, group_size));
  }
  ShardLayout layout;
  layout.group_size = group_size;
  for (int r = 0; r < world; ++r) {
    layout.shard_of_rank.push_back(r % group_size);
    layout.group_of_rank.push_back(r / group_size);
  }
  return layout;
}

std::vector<int> ShardsOnOneHost(const ShardLayout& layout,
                                 std::span<const std::string> host_of_rank) {
  NONSTOP_CHECK_EQ(host_of_rank.size(), static_cast<size_t>(layout.world()));
  std::vector<int> out;
  for (int s = 0; s < layout.group_size; ++s) {
    std::set<std::string> hosts;
    for (int r : layout.Replicas(s)) hosts.insert(host_of_rank[static_cast<size_t>(r)]);
    if (hosts.size() < 2) out.push_back(s);
  }
  return out;
}

std::vector<int> SourcesOfShard(const ShardLayout& from, std::span<const bool> alive, int shard) {
  NONSTOP_CHECK_EQ(alive.size(), static_cast<size_t>(from.world()));
  std::vector<int> out;
  for (int r : from.Replicas(shard)) {
    if (r >= 0 && alive[static_cast<size_t>(r)]) out.push_back(r);
  }
  return out;
}

}  // namespace nonstop::state
