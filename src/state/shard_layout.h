// Sharded optimizer state (issue 12, docs/sharding.md): which rank holds which
// shard. The world is R replica groups of G ranks; each group holds every
// shard of the sharded state once, so each shard has R replicas, one per
// group. Shard s of an n-element buffer is elements ChunkRange(n, G, s): the
// ranges depend on G alone, not on the world, so a world that changes keeps
// every range and only moves which ranks hold it.
//
// The layout is a function of the rank alone: rank r holds shard r mod G in
// group r / G. A spare that takes rank r so holds what r held, and nothing
// else moves: a replacement never re-shards. Placement across failure
// domains comes from the ranks' order: the controller numbers ranks host by
// host, so a group's ranks share a host (its reduce-scatter and all-gather
// stay there) and the replicas of a shard, one per group, sit on different
// hosts wherever the hosts allow it; ShardsOnOneHost names the shards for
// which they do not.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::state {

struct ShardLayout {
  int group_size = 1;              // G
  std::vector<int> shard_of_rank;  // index = rank: the shard it holds
  std::vector<int> group_of_rank;  // index = rank: its replica group

  int world() const { return static_cast<int>(shard_of_rank.size()); }
  int groups() const { return world() / group_size; }
  // The ranks holding shard `shard`, by group.
  std::vector<int> Replicas(int shard) const;
  // The ranks of group `group`, by shard.
  std::vector<int> Group(int group) const;
};

// The layout of `world` ranks in groups of `group_size`. INVALID_ARGUMENT,
// saying what to change, when the world is not a multiple of the group size.
Result<ShardLayout> LayoutOf(int world, int group_size);

// Shards every replica of which is on one host (a loss of that host loses
// them), ascending; empty when every shard has copies on two hosts or more.
std::vector<int> ShardsOnOneHost(const ShardLayout& layout,
                                 std::span<const std::string> host_of_rank);

// Re-sharding, and a spare taking a rank: of the members of `from` (the
// layout whose state the survivors hold) for which `alive` is true, those
// that hold shard `shard`, by group. Empty: every copy of the shard is lost.
std::vector<int> SourcesOfShard(const ShardLayout& from, std::span<const bool> alive, int shard);

}  // namespace nonstop::state
