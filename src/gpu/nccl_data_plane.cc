#include "gpu/nccl_data_plane.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <optional>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "common/check.h"
#include "common/logging.h"
#include "gpu/cuda_copier.h"
#include "gpu/cuda_runtime.h"
#include "gpu/cuda_util.h"

namespace nonstop::gpu {
namespace {

using collective::ChunkRange;
using collective::Device;
using collective::DType;
using collective::Region;

ncclComm_t Comm(void* comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t Stream(void* stream) { return static_cast<cudaStream_t>(stream); }

Status NcclError(ncclResult_t r, const char* what, void* comm) {
  if (r == ncclSuccess) return OkStatus();
  const char* last = ncclGetLastError(Comm(comm));
  return InternalError(fmt::format("{}: {}{}{}", what, ncclGetErrorString(r),
                                   last != nullptr && *last != '\0' ? ": " : "",
                                   last != nullptr ? last : ""));
}

// An NCCL communicator of cuda:`device` this code owns until it hands it on;
// aborted (which frees it, work in flight or not) when it is dropped, with its
// device current: NCCL puts back the thread's device after an abort, which
// would make device 0's context on a thread that never chose one.
struct OwnedComm {
  void* comm = nullptr;
  int device;
  OwnedComm(void* c, int d) : comm(c), device(d) {}
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;
  ~OwnedComm() { Drop(); }
  void Drop() {
    if (comm != nullptr) {
      DeviceScope scope(device);
      ncclCommAbort(Comm(comm));
    }
    comm = nullptr;
  }
};

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::optional<std::vector<int>> ShrinkExclusions(std::span<const int> old_ids,
                                                 std::span<const int> new_ids) {
  std::vector<int> excluded;
  size_t kept = 0;
  for (size_t r = 0; r < old_ids.size(); ++r) {
    if (kept < new_ids.size() && old_ids[r] == new_ids[kept]) {
      ++kept;
    } else {
      excluded.push_back(static_cast<int>(r));
    }
  }
  if (kept != new_ids.size() || new_ids.empty() || excluded.empty()) return std::nullopt;
  return excluded;
}

NcclCommunicator::NcclCommunicator(NcclDataPlane* plane,
                                   std::unique_ptr<collective::Communicator> staged,
                                   collective::CommunicatorOptions options)
    : plane_(plane),
      staged_(std::move(staged)),
      options_(std::move(options)),
      device_index_(plane->device_index()) {}

NcclCommunicator::~NcclCommunicator() {
  void* idle = nullptr;
  {
    MutexLock lock(&mu_);
    idle = std::exchange(comm_, nullptr);
  }
  if (idle != nullptr) {
    // It never failed, and no call was in flight when it was aborted (if it was): the next
    // generation may shrink it.
    NcclDataPlane::Parent parent;
    parent.comm = idle;
    for (const collective::Member& m : options_.members) parent.members.push_back(m.worker_id);
    plane_->KeepParent(std::move(parent));
  }
  if (stream_ != nullptr) {
    DeviceScope scope(device_index_);
    Cuda().StreamDestroy(Stream(stream_));
  }
}

bool NcclCommunicator::OnNccl(Device device, int index) const {
  return device == Device::kCuda && index == device_index_;
}

Status NcclCommunicator::Sticky() const {
  {
    MutexLock lock(&mu_);
    if (!error_.ok()) return error_;
  }
  return staged_->error();
}

Status NcclCommunicator::error() const { return Sticky(); }

Status NcclCommunicator::Fail(Status status) {
  void* failed = nullptr;
  {
    MutexLock lock(&mu_);
    if (error_.ok()) error_ = std::move(status);
    failed = std::exchange(comm_, nullptr);
    status = error_;
  }
  OwnedComm aborted(failed, device_index_);       // stops its kernels (on this, the waiting thread)
  staged_->Abort(std::string(status.message()));  // the host calls and sub-groups stop too
  return status;
}

void NcclCommunicator::Abort(const std::string& reason) {
  {
    MutexLock lock(&mu_);
    if (error_.ok()) error_ = AbortedError(reason);  // before the signal: the reason is this one
  }
  // No NCCL call here: the session aborts from its I/O thread under its own lock, and
  // ncclCommAbort may take seconds when a peer is gone. A call in flight sees error_ at its next
  // poll (within 50 µs) and aborts the communicator itself; an idle one is kept whole, so that
  // the next generation may shrink it.
  staged_->Abort(reason);
}

collective::CommunicatorStats NcclCommunicator::stats() const {
  collective::CommunicatorStats stats = staged_->stats();
  MutexLock lock(&mu_);
  stats.ops += ops_;  // NCCL's bytes go over its own links: not counted as sent or received here
  return stats;
}

NcclSetup NcclCommunicator::setup() const {
  MutexLock lock(&mu_);
  return setup_;
}

Status NcclCommunicator::Connect() {
  NONSTOP_RETURN_IF_ERROR(Sticky());
  NONSTOP_RETURN_IF_ERROR(staged_->Connect());
  Status s = SetUp();
  if (!s.ok()) return Fail(InSetUp(std::move(s)));
  return OkStatus();
}

Status NcclCommunicator::InSetUp(Status s) const {
  return std::move(s).WithContext(fmt::format("the NCCL communicator of generation {} on cuda:{}",
                                              generation(), device_index_));
}

Status NcclCommunicator::SetUp() {
  const auto t0 = Clock::now();
  const auto deadline = t0 + options_.timeout_connect;
  NcclDataPlane::Parent held = plane_->TakeParent();
  OwnedComm parent(held.comm, device_index_);
  std::vector<int> ids;
  for (const collective::Member& m : options_.members) ids.push_back(m.worker_id);
  std::optional<std::vector<int>> excluded;
  if (parent.comm != nullptr) excluded = ShrinkExclusions(held.members, ids);
  // Every member takes the same path: a shrink only when every one of them can.
  std::vector<float> can_shrink{excluded.has_value() ? 1.0f : 0.0f};
  NONSTOP_RETURN_IF_ERROR(staged_->AllReduce(std::span<float>(can_shrink)));
  const bool shrink = can_shrink[0] == static_cast<float>(world_size());
  ncclUniqueId id{};
  if (!shrink) {
    parent.Drop();
    // Rank 0's id, after a byte that says whether it has one: the others fail at once, by name,
    // when it has none.
    std::vector<std::byte> message(1 + sizeof(id.internal));
    Status made;
    if (rank() == 0) {
      made = NcclError(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr);
      message[0] = std::byte{made.ok() ? uint8_t{1} : uint8_t{0}};
      std::memcpy(message.data() + 1, id.internal, sizeof(id.internal));
    }
    NONSTOP_RETURN_IF_ERROR(staged_->Broadcast(std::span(message), /*root=*/0));
    NONSTOP_RETURN_IF_ERROR(made);
    if (message[0] != std::byte{1})
      return UnavailableError("rank 0 could not make NCCL's unique id (its log says why)");
    std::memcpy(id.internal, message.data() + 1, sizeof(id.internal));
  }
  const double agree_ms = MsSince(t0);
  const auto t1 = Clock::now();
  DeviceScope scope(device_index_);
  NONSTOP_RETURN_IF_ERROR(scope.status());
  cudaStream_t stream = nullptr;
  NONSTOP_RETURN_IF_ERROR(
      CudaError(Cuda().StreamCreate(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  stream_ = stream;
  const std::string name = fmt::format("nonstop generation {}", generation());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = name.c_str();
  config.shrinkShare = 0;  // the child owns its resources: the parent is aborted once it is ready
  const char* op = shrink ? "ncclCommShrink" : "ncclCommInitRankConfig";
  Status started;
  {
    MutexLock lock(&mu_);
    NONSTOP_RETURN_IF_ERROR(error_);  // aborted meanwhile
    ncclComm_t comm = nullptr;
    // NCCL_SHRINK_ABORT: the parent's generation may have ended at a fault, with a member gone
    // and NCCL's own work for it pending; the flag ends that work before the shrink.
    const ncclResult_t r =
        shrink
            ? ncclCommShrink(Comm(parent.comm), excluded->data(),
                             static_cast<int>(excluded->size()), &comm, &config, NCCL_SHRINK_ABORT)
            : ncclCommInitRankConfig(&comm, world_size(), id, rank(), &config);
    comm_ = comm;
    if (r != ncclSuccess && r != ncclInProgress) started = NcclError(r, op, comm_);
  }
  // A child that failed is aborted (Fail) before its parent is (`parent` ends after).
  if (!started.ok()) return Fail(InSetUp(std::move(started)));
  NONSTOP_RETURN_IF_ERROR(Await(op, /*stream=*/false, deadline));
  parent.Drop();  // the child shares nothing with it (shrinkShare 0)
  MutexLock lock(&mu_);
  setup_ = {shrink, shrink ? static_cast<int>(excluded->size()) : 0, agree_ms, MsSince(t1)};
  NONSTOP_LOG_INFO(
      "generation {}: NCCL communicator of {} rank(s) on cuda:{} by {} in {:.1f} ms "
      "(the members agreed in {:.1f} ms)",
      generation(), world_size(), device_index_,
      shrink ? fmt::format("ncclCommShrink ({} left out)", setup_.excluded)
             : std::string("a fresh init"),
      setup_.nccl_ms, agree_ms);
  return OkStatus();
}

Status NcclCommunicator::Await(const char* op, bool stream, Clock::time_point deadline) {
  const auto where = [&](Status s) {
    return s.WithContext(fmt::format("{} (generation {}, rank {} of {}, cuda:{})", op, generation(),
                                     rank(), world_size(), device_index_));
  };
  // The stream is queried with the plane's device current: one scope for the whole wait.
  std::optional<DeviceScope> scope;
  if (stream) {
    scope.emplace(device_index_);
    if (!scope->status().ok()) return Fail(where(scope->status()));
  }
  for (int polls = 0;; ++polls) {
    Status failed;
    {
      MutexLock lock(&mu_);
      failed = error_;  // aborted: the work pending is ended below (Fail)
      if (failed.ok()) {
        NONSTOP_CHECK(comm_ != nullptr) << op << " without a communicator";
        ncclResult_t state = ncclSuccess;
        if (ncclResult_t r = ncclCommGetAsyncError(Comm(comm_), &state); r != ncclSuccess)
          state = r;
        if (state != ncclSuccess && state != ncclInProgress) {
          failed = where(NcclError(state, op, comm_));
        } else if (state == ncclSuccess) {
          const cudaError_t e = stream ? Cuda().StreamQuery(Stream(stream_)) : cudaSuccess;
          if (e == cudaSuccess) return OkStatus();
          if (e != cudaErrorNotReady) failed = where(CudaError(e, op));
        }
      }
    }
    // A failure of the host side (a sub-group aborted, a peer gone) ends the wait too.
    if (failed.ok()) failed = staged_->error();
    if (failed.ok() && plane_->abort_->fired())
      failed = AbortedError(fmt::format("{} aborted (generation {})", op, generation()));
    if (failed.ok() && Clock::now() >= deadline)
      failed = where(DeadlineExceededError("did not finish in time"));
    if (!failed.ok()) return Fail(std::move(failed));
    // A collective of a few microseconds is seen at once; a long one costs a poll each 50 µs.
    if (polls < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

template <typename Enqueue>
Status NcclCommunicator::Run(const char* op, Enqueue enqueue) {
  NONSTOP_RETURN_IF_ERROR(Sticky());
  const auto deadline = Clock::now() + options_.timeout_collective;
  Status failed;
  {
    MutexLock lock(&mu_);
    NONSTOP_RETURN_IF_ERROR(error_);
    NONSTOP_CHECK(comm_ != nullptr) << op << " before Connect";
    DeviceScope scope(device_index_);
    failed = scope.status();
    if (failed.ok()) {
      ++ops_;
      const ncclResult_t r = enqueue(Comm(comm_), Stream(stream_));
      if (r != ncclSuccess && r != ncclInProgress) failed = NcclError(r, op, comm_);
    }
  }
  Status s = failed.ok() ? Await(op, /*stream=*/true, deadline) : Fail(std::move(failed));
  if (!s.ok()) {
    // The communicator was aborted, which stops its kernels: wait for them to leave the region.
    DeviceScope scope(device_index_);
    Cuda().StreamSynchronize(Stream(stream_));
  }
  return s;
}

namespace {
// The elements of a sum's region (a whole number of them: data_plane.h).
size_t Elements(Region data, DType dtype) {
  const size_t count = data.bytes / ElementBytes(dtype);
  NONSTOP_CHECK(count * ElementBytes(dtype) == data.bytes) << data.bytes << " bytes";
  return count;
}
}  // namespace

Status NcclCommunicator::AllReduce(Region data, DType dtype, ReduceOp op) {
  // NCCL sums float32 here; any other reduction is staged through the host's ring.
  if (!OnNccl(data.device, data.device_index) || dtype != DType::kFloat32 || op != ReduceOp::kSum) {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->AllReduce(data, dtype, op);
  }
  const size_t count = Elements(data, dtype);
  if (count == 0) return Sticky();
  return Run("ncclAllReduce", [&](ncclComm_t comm, cudaStream_t s) {
    return ncclAllReduce(data.data, data.data, count, ncclFloat32, ncclSum, comm, s);
  });
}

Status NcclCommunicator::ReduceScatter(Region data, DType dtype, ReduceOp op) {
  if (!OnNccl(data.device, data.device_index) || dtype != DType::kFloat32 || op != ReduceOp::kSum) {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->ReduceScatter(data, dtype, op);
  }
  const size_t count = Elements(data, dtype);
  const auto w = static_cast<size_t>(world_size());
  // NCCL's chunks are equal: an uneven split sums everything (chunk r is right, the rest are
  // "unspecified" for a reduce-scatter, data_plane.h).
  if (count % w != 0) return AllReduce(data, dtype, op);
  if (count == 0) return Sticky();
  const size_t per_rank = count / w;
  std::byte* mine = data.data + static_cast<size_t>(rank()) * per_rank * ElementBytes(dtype);
  return Run("ncclReduceScatter", [&](ncclComm_t comm, cudaStream_t s) {
    return ncclReduceScatter(data.data, mine, per_rank, ncclFloat32, ncclSum, comm, s);
  });
}

Status NcclCommunicator::AllGather(Region data, size_t element_bytes) {
  if (!OnNccl(data.device, data.device_index)) {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->AllGather(data, element_bytes);
  }
  NONSTOP_CHECK(element_bytes > 0 && data.bytes % element_bytes == 0)
      << data.bytes << " bytes of " << element_bytes;
  const size_t records = data.bytes / element_bytes;
  const int w = world_size();
  if (records == 0) return Sticky();
  if (records % static_cast<size_t>(w) == 0) {
    const size_t chunk = data.bytes / static_cast<size_t>(w);
    const std::byte* mine = data.data + static_cast<size_t>(rank()) * chunk;
    return Run("ncclAllGather", [&](ncclComm_t comm, cudaStream_t s) {
      return ncclAllGather(mine, data.data, chunk, ncclInt8, comm, s);
    });
  }
  // Uneven chunks: each rank broadcasts its own, in one group.
  return Run("ncclBroadcast (an all-gather of uneven chunks)",
             [&](ncclComm_t comm, cudaStream_t s) {
               if (ncclResult_t r = ncclGroupStart(); r != ncclSuccess) return r;
               for (int c = 0; c < w; ++c) {
                 const auto [begin, end] = ChunkRange(records, w, c);
                 if (begin == end) continue;
                 std::byte* at = data.data + begin * element_bytes;
                 const ncclResult_t r =
                     ncclBroadcast(at, at, (end - begin) * element_bytes, ncclInt8, c, comm, s);
                 if (r != ncclSuccess && r != ncclInProgress) {
                   ncclGroupEnd();
                   return r;
                 }
               }
               return ncclGroupEnd();
             });
}

Status NcclCommunicator::Broadcast(Region data, int root) {
  if (!OnNccl(data.device, data.device_index)) {
    NONSTOP_RETURN_IF_ERROR(Sticky());
    return staged_->Broadcast(data, root);
  }
  NONSTOP_CHECK(root >= 0 && root < world_size()) << "root " << root;
  if (data.bytes == 0) return Sticky();
  return Run("ncclBroadcast", [&](ncclComm_t comm, cudaStream_t s) {
    return ncclBroadcast(data.data, data.data, data.bytes, ncclInt8, root, comm, s);
  });
}

NcclDataPlane::NcclDataPlane(std::unique_ptr<collective::DataPlane> host,
                             std::shared_ptr<collective::DeviceCopier> copier,
                             net::AbortSignal* abort)
    : staged_(std::move(host), copier), device_index_(copier->device_index()), abort_(abort) {}

NcclDataPlane::~NcclDataPlane() { OwnedComm dropped(TakeParent().comm, device_index_); }

std::unique_ptr<collective::Communicator> NcclDataPlane::NewCommunicator(
    collective::CommunicatorOptions options) {
  return std::make_unique<NcclCommunicator>(this, staged_.NewCommunicator(options),
                                            std::move(options));
}

NcclDataPlane::Parent NcclDataPlane::TakeParent() {
  MutexLock lock(&mu_);
  return std::exchange(parent_, Parent{});
}

void NcclDataPlane::KeepParent(Parent parent) {
  Parent older;
  {
    MutexLock lock(&mu_);
    older = std::exchange(parent_, std::move(parent));
  }
  OwnedComm dropped(older.comm, device_index_);  // never taken: aborted, outside the lock
}

std::function<Result<std::unique_ptr<collective::DataPlane>>(
    std::unique_ptr<collective::DataPlane> tcp, net::AbortSignal* abort)>
NcclDataPlaneMaker(int device_index) {
  return [device_index](std::unique_ptr<collective::DataPlane> tcp,
                        net::AbortSignal* abort) -> Result<std::unique_ptr<collective::DataPlane>> {
    int version = 0;
    NONSTOP_RETURN_IF_ERROR(NcclError(ncclGetVersion(&version), "ncclGetVersion", nullptr));
    if (version < NCCL_VERSION(2, 27, 0) || version / 10000 != NCCL_VERSION_CODE / 10000) {
      return FailedPreconditionError(fmt::format(
          "the NCCL library loaded is version code {}, but nonstop was built against nccl.h {} "
          "and needs 2.27 or later of the same major version (HINT: point LD_LIBRARY_PATH at the "
          "NCCL it was built with, or rebuild)",
          version, NCCL_VERSION_CODE));
    }
    if (version != NCCL_VERSION_CODE) {
      NONSTOP_LOG_WARNING(
          "the NCCL library loaded is version code {}, nonstop was built against {}", version,
          NCCL_VERSION_CODE);
    }
    NONSTOP_ASSIGN_OR_RETURN(std::shared_ptr<CudaCopier> copier, CudaCopier::Create(device_index));
    return std::unique_ptr<collective::DataPlane>(
        std::make_unique<NcclDataPlane>(std::move(tcp), std::move(copier), abort));
  };
}

}  // namespace nonstop::gpu
