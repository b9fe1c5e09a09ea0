#include "collective/staged_communicator.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "common/check.h"

namespace nonstop::collective {

StagingPool::Lease& StagingPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (pool_ != nullptr) pool_->Give(buffer_);
    pool_ = std::exchange(other.pool_, nullptr);
    buffer_ = std::exchange(other.buffer_, {});
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

StagingPool::Lease::~Lease() {
  if (pool_ != nullptr) pool_->Give(buffer_);
}

Result<StagingPool::Lease> StagingPool::Take(size_t bytes) {
  Lease lease;
  if (bytes == 0) return lease;
  {
    MutexLock lock(&mu_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size() >= bytes && (best == free_.end() || it->size() < best->size())) best = it;
    }
    if (best != free_.end()) {
      lease.buffer_ = *best;
      free_.erase(best);
    }
  }
  if (lease.buffer_.empty()) {
    NONSTOP_ASSIGN_OR_RETURN(lease.buffer_, copier_->HostBuffer(bytes));
    MutexLock lock(&mu_);
    ++made_;
  }
  lease.pool_ = this;
  lease.bytes_ = bytes;
  return lease;
}

void StagingPool::Give(std::span<std::byte> buffer) {
  MutexLock lock(&mu_);
  free_.push_back(buffer);
}

size_t StagingPool::buffers() const {
  MutexLock lock(&mu_);
  return made_;
}

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> host,
                                       std::shared_ptr<DeviceCopier> copier, StagedOptions options,
                                       std::shared_ptr<StagingPool> pool)
    : host_(std::move(host)),
      copier_(std::move(copier)),
      options_(options),
      pool_(pool != nullptr ? std::move(pool) : std::make_shared<StagingPool>(copier_)) {
  NONSTOP_CHECK(host_ != nullptr && copier_ != nullptr);
  NONSTOP_CHECK(options_.piece_bytes >= 4 && options_.piece_bytes % 4 == 0)
      << "piece_bytes must be a positive multiple of 4";
}

std::unique_ptr<Communicator> StagedCommunicator::SubGroup(std::span<const int> ranks,
                                                           uint32_t op_space,
                                                           Millis timeout) const {
  return std::make_unique<StagedCommunicator>(host_->SubGroup(ranks, op_space, timeout), copier_,
                                              options_, pool_);
}

Status StagedCommunicator::CheckDevice(const char* op, Device device, int index) const {
  if (device == Device::kHost ||
      (device == copier_->device() && index == copier_->device_index())) {
    return OkStatus();
  }
  return InvalidArgumentError(fmt::format(
      "{}: this staged communicator moves host memory and {}; this region is on {}", op,
      DeviceName(copier_->device(), copier_->device_index()), DeviceName(device, index)));
}

// Piece k goes up on lane k % 2 into host buffer k % 2; the lane's copies run
// in order, so the copy up of piece k + 2 waits for the copy down of piece k,
// which read that buffer. While the network has piece k, piece k + 1 is
// already on its way up.
template <typename HostOp>
Status StagedCommunicator::Pipeline(Region data, bool to_host, bool to_device, HostOp host_op) {
  const size_t piece = options_.piece_bytes;
  const size_t pieces = (data.bytes + piece - 1) / piece;
  StagingPool::Lease leases[2];
  std::span<std::byte> buffers[2];
  for (size_t b = 0; b < 2 && b < pieces; ++b) {
    NONSTOP_ASSIGN_OR_RETURN(leases[b], pool_->Take(std::min(piece, data.bytes)));
    buffers[b] = leases[b].span();
  }
  auto range = [&](size_t k) {
    return std::make_pair(k * piece, std::min(piece, data.bytes - k * piece));
  };
  auto up = [&](size_t k) {
    auto [offset, bytes] = range(k);
    return to_host ? copier_->ToHost(static_cast<int>(k % 2), buffers[k % 2].data(),
                                     data.data + offset, bytes)
                   : OkStatus();
  };
  Status status = pieces > 0 ? up(0) : OkStatus();
  for (size_t k = 0; k < pieces && status.ok(); ++k) {
    const int lane = static_cast<int>(k % 2);
    status = copier_->Wait(lane);
    if (status.ok() && k + 1 < pieces) status = up(k + 1);
    auto [offset, bytes] = range(k);
    std::span<std::byte> host = buffers[k % 2].first(bytes);
    if (status.ok()) status = host_op(host);
    if (status.ok() && to_device)
      status = copier_->ToDevice(lane, data.data + offset, host.data(), bytes);
  }
  // Nothing in flight may outlive the call: its buffers go back to the pool.
  for (int lane = 0; lane < 2; ++lane) {
    Status waited = copier_->Wait(lane);
    if (status.ok()) status = waited;
  }
  return status;
}

template <typename HostOp>
Status StagedCommunicator::Whole(Region data, bool up, bool down, HostOp host_op) {
  NONSTOP_ASSIGN_OR_RETURN(StagingPool::Lease lease, pool_->Take(data.bytes));
  const std::span<std::byte> buffer = lease.span();
  Status status = up ? copier_->ToHost(0, buffer.data(), data.data, data.bytes) : OkStatus();
  if (up && status.ok()) status = copier_->Wait(0);
  if (status.ok()) status = host_op(buffer);
  if (status.ok() && down) status = copier_->ToDevice(0, data.data, buffer.data(), data.bytes);
  Status waited = copier_->Wait(0);
  return status.ok() ? waited : status;
}

Status StagedCommunicator::AllReduce(Region data, DType dtype, ReduceOp op) {
  NONSTOP_RETURN_IF_ERROR(CheckDevice("AllReduce", data.device, data.device_index));
  if (!OnDevice(data.device)) return host_->AllReduce(data, dtype, op);
  return Pipeline(data, true, true, [&](std::span<std::byte> piece) {
    return host_->AllReduce(HostRegion(piece), dtype, op);
  });
}

Status StagedCommunicator::Broadcast(Region data, int root) {
  NONSTOP_RETURN_IF_ERROR(CheckDevice("Broadcast", data.device, data.device_index));
  if (!OnDevice(data.device)) return host_->Broadcast(data, root);
  const bool is_root = rank() == root;
  return Pipeline(data, is_root, !is_root, [&](std::span<std::byte> piece) {
    return host_->Broadcast(HostRegion(piece), root);
  });
}

Status StagedCommunicator::ReduceScatter(Region data, DType dtype, ReduceOp op) {
  NONSTOP_RETURN_IF_ERROR(CheckDevice("ReduceScatter", data.device, data.device_index));
  if (!OnDevice(data.device)) return host_->ReduceScatter(data, dtype, op);
  return Whole(data, true, true, [&](std::span<std::byte> whole) {
    return host_->ReduceScatter(HostRegion(whole), dtype, op);
  });
}

Status StagedCommunicator::AllGather(Region data, size_t element_bytes) {
  NONSTOP_RETURN_IF_ERROR(CheckDevice("AllGather", data.device, data.device_index));
  if (!OnDevice(data.device)) return host_->AllGather(data, element_bytes);
  return Whole(data, true, true, [&](std::span<std::byte> whole) {
    return host_->AllGather(HostRegion(whole), element_bytes);
  });
}

Status StagedCommunicator::AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                                         std::span<const ConstRegion> partials, Region out) {
  for (const ConstRegion& p : partials)
    NONSTOP_RETURN_IF_ERROR(CheckDevice("AllReduceTree", p.device, p.device_index));
  NONSTOP_RETURN_IF_ERROR(CheckDevice("AllReduceTree", out.device, out.device_index));
  // The partials on the device come up into host vectors (the tree adds them
  // on the host, in its fixed order: the host run's bits).
  std::vector<std::vector<std::byte>> up;
  std::vector<ConstRegion> host_partials;
  for (const ConstRegion& p : partials) {
    if (!OnDevice(p.device)) {
      host_partials.push_back(p);
      continue;
    }
    up.emplace_back(p.bytes);
    NONSTOP_RETURN_IF_ERROR(copier_->ToHost(0, up.back().data(), p.data, p.bytes));
    host_partials.push_back(HostRegion(std::span<const std::byte>(up.back())));
  }
  NONSTOP_RETURN_IF_ERROR(copier_->Wait(0));
  if (!OnDevice(out.device)) return host_->AllReduceTree(m, nodes_of, host_partials, out);
  return Whole(out, false, true, [&](std::span<std::byte> whole) {
    return host_->AllReduceTree(m, nodes_of, host_partials, HostRegion(whole));
  });
}

Status StagedCommunicator::CheckLane(const char* op, int lane, Device device) const {
  if (lane == 0 || !OnDevice(device)) return OkStatus();
  return InvalidArgumentError(fmt::format(
      "{}: device memory goes over lane 0 only, not lane {} (stage it in host memory)", op, lane));
}

Status StagedCommunicator::SendVia(const char* op, int lane, ConstRegion data,
                                   const std::function<Status(ConstRegion)>& send) {
  NONSTOP_RETURN_IF_ERROR(CheckDevice(op, data.device, data.device_index));
  NONSTOP_RETURN_IF_ERROR(CheckLane(op, lane, data.device));
  if (!OnDevice(data.device)) return send(data);
  Region writable{const_cast<std::byte*>(data.data), data.bytes, data.device, data.device_index};
  return Whole(writable, true, false, [&](std::span<std::byte> whole) {
    return send(HostRegion(std::span<const std::byte>(whole)));
  });
}

Status StagedCommunicator::RecvVia(const char* op, int lane, Region data,
                                   const std::function<Status(Region)>& recv) {
  NONSTOP_RETURN_IF_ERROR(CheckDevice(op, data.device, data.device_index));
  NONSTOP_RETURN_IF_ERROR(CheckLane(op, lane, data.device));
  if (!OnDevice(data.device)) return recv(data);
  return Whole(data, false, true,
               [&](std::span<std::byte> whole) { return recv(HostRegion(whole)); });
}

Status StagedCommunicator::Send(int to_rank, ConstRegion data) {
  return SendVia("Send", 0, data, [&](ConstRegion d) { return host_->Send(to_rank, d); });
}
Status StagedCommunicator::Recv(int from_rank, Region data) {
  return RecvVia("Recv", 0, data, [&](Region d) { return host_->Recv(from_rank, d); });
}
Status StagedCommunicator::SendUnchecked(int to_rank, ConstRegion data) {
  return SendVia("SendUnchecked", 0, data,
                 [&](ConstRegion d) { return host_->SendUnchecked(to_rank, d); });
}
Status StagedCommunicator::RecvUnchecked(int from_rank, Region data) {
  return RecvVia("RecvUnchecked", 0, data,
                 [&](Region d) { return host_->RecvUnchecked(from_rank, d); });
}

Status StagedCommunicator::SendOnLane(int to_rank, int lane, ConstRegion data, bool checked) {
  return SendVia("SendOnLane", lane, data,
                 [&](ConstRegion d) { return host_->SendOnLane(to_rank, lane, d, checked); });
}
Status StagedCommunicator::RecvOnLane(int from_rank, int lane, Region data, bool checked) {
  return RecvVia("RecvOnLane", lane, data,
                 [&](Region d) { return host_->RecvOnLane(from_rank, lane, d, checked); });
}

Result<int> StagedCommunicator::RecvOnAnyLane(std::span<const std::pair<int, int>> from,
                                              Region data, bool checked) {
  return host_->RecvOnAnyLane(from, data, checked);
}

Result<std::span<std::byte>> MemoryCopier::HostBuffer(size_t bytes) {
  auto buffer = std::make_unique<std::byte[]>(bytes);
  std::span<std::byte> out(buffer.get(), bytes);
  MutexLock lock(&mu_);
  buffers_.push_back(std::move(buffer));
  return out;
}

Status MemoryCopier::ToHost(int /*lane*/, std::byte* host, const std::byte* device, size_t bytes) {
  return memory_->ToHost(host, device, bytes)
      .WithContext("a staged collective's copy from " + memory_->name());
}

Status MemoryCopier::ToDevice(int /*lane*/, std::byte* device, const std::byte* host,
                              size_t bytes) {
  return memory_->ToDevice(device, host, bytes)
      .WithContext("a staged collective's copy to " + memory_->name());
}

}  // namespace nonstop::collective
