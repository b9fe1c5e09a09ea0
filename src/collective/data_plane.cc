#include "collective/data_plane.h"

#include <fmt/format.h>

#include "common/check.h"

namespace nonstop::collective {

std::string DeviceName(Device device, int device_index) {
  switch (device) {
    case Device::kHost:
      return "host";
    case Device::kCuda:
      return fmt::format("cuda:{}", device_index);
  }
  return fmt::format("device {}:{}", static_cast<int>(device), device_index);
}

std::pair<size_t, size_t> ChunkRange(size_t n, int parts, int c) {
  auto p = static_cast<size_t>(parts);
  // floor(n·i/p) without overflow: n = q·p + rem, so n·i/p = q·i + rem·i/p.
  auto split = [&](size_t i) { return (n / p) * i + (n % p) * i / p; };
  return {split(static_cast<size_t>(c)), split(static_cast<size_t>(c) + 1)};
}

std::vector<std::vector<TreeNode>> NodesOfRanges(int m,
                                                 std::span<const std::pair<int, int>> ranges) {
  std::vector<std::vector<TreeNode>> nodes_of(ranges.size());
  for (size_t q = 0; q < ranges.size(); ++q)
    nodes_of[q] = NodesOfRange(m, ranges[q].first, ranges[q].second);
  return nodes_of;
}

Status Communicator::SendOnLane(int to_rank, int lane, ConstRegion data, bool checked) {
  NONSTOP_CHECK(lane >= 0 && lane < p2p_lanes()) << "lane " << lane << " of " << p2p_lanes();
  return checked ? Send(to_rank, data) : SendUnchecked(to_rank, data);
}

Status Communicator::RecvOnLane(int from_rank, int lane, Region data, bool checked) {
  NONSTOP_CHECK(lane >= 0 && lane < p2p_lanes()) << "lane " << lane << " of " << p2p_lanes();
  return checked ? Recv(from_rank, data) : RecvUnchecked(from_rank, data);
}

Result<int> Communicator::RecvOnAnyLane(std::span<const std::pair<int, int>> /*from*/,
                                        Region /*data*/, bool /*checked*/) {
  return FailedPreconditionError("this data plane receives from a given rank only");
}

Status Communicator::AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                                   std::span<const std::vector<float>> partials,
                                   std::span<float> out) {
  std::vector<ConstRegion> regions;
  regions.reserve(partials.size());
  for (const auto& p : partials) regions.push_back(HostRegion(std::span<const float>(p)));
  return AllReduceTree(m, nodes_of, regions, HostRegion(out));
}

Status Communicator::AllReduceTree(int m, std::span<const std::pair<int, int>> ranges,
                                   std::span<const std::vector<float>> partials,
                                   std::span<float> out) {
  NONSTOP_CHECK_EQ(ranges.size(), static_cast<size_t>(world_size()));
  const std::vector<std::vector<TreeNode>> nodes_of = NodesOfRanges(m, ranges);
  return AllReduceTree(m, std::span<const std::vector<TreeNode>>(nodes_of), partials, out);
}

}  // namespace nonstop::collective
