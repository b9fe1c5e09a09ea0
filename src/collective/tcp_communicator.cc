#include "collective/tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>

#include <fmt/format.h>

#include "nonstop/tree.h"

namespace nonstop::collective {

TcpCommunicator::TcpCommunicator(PeerMesh* mesh, net::AbortSignal* abort,
                                 CommunicatorOptions options)
    : mesh_(mesh), abort_(abort), options_(std::move(options)) {
  NONSTOP_CHECK(!options_.members.empty());
  NONSTOP_CHECK(options_.rank >= 0 && options_.rank < world_size());
  NONSTOP_CHECK_EQ(options_.piece_bytes % sizeof(float), 0u);
  p2p_ops_.assign(options_.members.size() * net::kDataLanes, 0);
  scratch_.resize(options_.piece_bytes);
}

std::unique_ptr<Communicator> TcpCommunicator::SubGroup(std::span<const int> ranks,
                                                        uint32_t op_space, Millis timeout) const {
  NONSTOP_CHECK(op_space >= 1 && op_space <= 127) << "op_space " << op_space;
  CommunicatorOptions o = options_;
  o.op_space = op_space;
  if (timeout > Millis(0)) o.timeout_collective = timeout;
  o.members.clear();
  o.rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    NONSTOP_CHECK(ranks[i] >= 0 && ranks[i] < world_size())
        << "rank " << ranks[i] << " of " << world_size();
    for (size_t j = 0; j < i; ++j) NONSTOP_CHECK_NE(ranks[j], ranks[i]) << "rank listed twice";
    if (ranks[i] == rank()) o.rank = static_cast<int>(i);
    o.members.push_back(options_.members[static_cast<size_t>(ranks[i])]);
  }
  NONSTOP_CHECK_GE(o.rank, 0) << "rank " << rank() << " is not in the group";
  return std::make_unique<TcpCommunicator>(mesh_, abort_, std::move(o));
}

std::string TcpCommunicator::PeerName(int rank) const {
  const Member& m = options_.members[static_cast<size_t>(rank)];
  return fmt::format("rank {} (worker {}, {})", rank, m.worker_id, m.address);
}

Result<Connection*> TcpCommunicator::Peer(int rank, int lane) {
  const Member& m = options_.members[static_cast<size_t>(rank)];
  return mesh_->Get(m.worker_id, m.address, options_.generation,
                    DeadlineAfter(options_.timeout_connect), abort_, lane);
}

Status TcpCommunicator::Connect() {
  NONSTOP_RETURN_IF_ERROR(MayStart());
  int w = world_size();
  if (w == 1) return OkStatus();
  int right = (rank() + 1) % w;
  int left = (rank() + w - 1) % w;
  // Both neighbours at once: the dial to one overlaps the wait for the other.
  auto right_conn = std::async(std::launch::async, [&] { return Peer(right); });
  Result<Connection*> left_conn = left == right ? Result<Connection*>(nullptr) : Peer(left);
  Result<Connection*> r = right_conn.get();
  if (!r.ok()) return Fail(r.status().WithContext("connecting to " + PeerName(right)));
  if (!left_conn.ok())
    return Fail(left_conn.status().WithContext("connecting to " + PeerName(left)));
  return OkStatus();
}

void TcpCommunicator::Abort(const std::string& reason) {
  {
    MutexLock lock(&mu_);
    if (error_.ok())
      error_ = AbortedError(fmt::format("{} (generation {})", reason, options_.generation));
  }
  abort_->Fire();
}

void TcpCommunicator::CountOp() {
  MutexLock lock(&mu_);
  ++stats_.ops;
}

CommunicatorStats TcpCommunicator::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

Status TcpCommunicator::error() const {
  MutexLock lock(&mu_);
  return error_;
}

Status TcpCommunicator::MayStart() const {
  NONSTOP_RETURN_IF_ERROR(error());
  // A fired signal (the generation's Abort, through any communicator of it) refuses new calls;
  // a call under way ends once nothing moves (transfer.h).
  if (abort_ != nullptr && abort_->fired())
    return AbortedError(
        fmt::format("the generation was aborted (generation {})", options_.generation));
  return OkStatus();
}

Status TcpCommunicator::Fail(Status status) {
  MutexLock lock(&mu_);
  if (error_.ok()) error_ = std::move(status);
  return error_;
}

Status TcpCommunicator::Run(TransferSpec spec) {
  TransferStats t;
  Status s = RunTransfer(spec, &t);
  {
    MutexLock lock(&mu_);
    stats_.bytes_sent += t.bytes_sent;
    stats_.bytes_received += t.bytes_received;
    stats_.stale_frames_dropped += t.stale_frames_dropped;
    stats_.pieces_refetched += t.pieces_refetched;
  }
  if (t.failed_peer >= 0) mesh_->Drop(t.failed_peer);  // broken: the next generation dials anew
  if (!s.ok()) {
    // An abort reports the reason given to Abort(), not the engine's wording.
    Status sticky = error();
    return Fail(!sticky.ok() ? sticky : s);
  }
  return OkStatus();
}

// Ring schedule. There are 2(W-1) global steps; steps t < W-1 reduce, the
// rest gather. At reduce step t rank r sends chunk (r-1-t) and receives chunk
// (r-2-t), adding it into its own; after W-1 steps rank r holds chunk r fully
// reduced. At gather step t' = t-(W-1) rank r sends chunk (r-t') and receives
// chunk (r-1-t'), overwriting. The chunk a rank sends at step t is the one it
// received at step t-1, so piece p of step t depends on piece p of step t-1:
// that is the pipelining. Each chunk is cut into pieces of piece_bytes, and an
// empty chunk still travels as one empty piece, so every step synchronises.
Status TcpCommunicator::RingPass(std::byte* data, size_t count, size_t element_bytes, int t_begin,
                                 int t_end, Combine combine) {
  const int w = world_size();
  const int r = rank();
  auto mod = [w](int x) { return ((x % w) + w) % w; };
  NONSTOP_ASSIGN_OR_RETURN(Connection * right, Peer(mod(r + 1)));
  NONSTOP_ASSIGN_OR_RETURN(Connection * left, Peer(mod(r - 1)));
  if (inject_drop_) {
    inject_drop_ = false;
    ::shutdown(right->fd.get(), SHUT_RDWR);
  }

  const size_t piece_elems = std::max<size_t>(1, options_.piece_bytes / element_bytes);
  auto pieces_of = [&](int chunk, auto&& emit) {
    auto [lo, hi] = ChunkRange(count, w, chunk);
    size_t pos = lo;
    do {
      size_t end = std::min(hi, pos + piece_elems);
      emit(data + pos * element_bytes, (end - pos) * element_bytes);
      pos = end;
    } while (pos < hi);
  };

  TransferSpec spec;
  spec.send_to = right;
  spec.send_peer = PeerName(mod(r + 1));
  spec.recv_from = left;
  spec.recv_peer = PeerName(mod(r - 1));
  std::vector<size_t> recv_step_begin;  // index of the first receive item of each step
  // The injected wire flip's step: the last of the reduce-scatter or of the all-gather.
  const int flip_step = inject_flip_ < 0 ? -1 : inject_flip_ == 0 ? w - 2 : 2 * (w - 1) - 1;
  for (int t = t_begin; t < t_end; ++t) {
    bool reducing = t < w - 1;
    int send_chunk = reducing ? mod(r - 1 - t) : mod(r - (t - (w - 1)));
    int recv_chunk = reducing ? mod(r - 2 - t) : mod(r - 1 - (t - (w - 1)));
    size_t p = 0;
    pieces_of(send_chunk, [&](std::byte* ptr, size_t bytes) {
      int32_t dep = t > t_begin ? static_cast<int32_t>(recv_step_begin.back() + p) : -1;
      if (t == flip_step && bytes > 0 && inject_flip_ >= 0) {
        spec.flip_send_item = static_cast<int32_t>(spec.sends.size());  // the step's first bytes
        inject_flip_ = -1;
      }
      spec.sends.push_back({ptr, bytes, dep});
      ++p;
    });
    recv_step_begin.push_back(spec.recvs.size());
    pieces_of(recv_chunk, [&](std::byte* ptr, size_t bytes) {
      spec.recvs.push_back({ptr, bytes, reducing ? combine : nullptr});
    });
  }
  spec.generation = options_.generation;
  spec.op = FramedOp();
  spec.checksum = spec.retry = options_.checked;
  spec.scratch = scratch_;
  spec.deadline = OpDeadline();
  spec.abort = abort_;
  return Run(std::move(spec));
}

Status TcpCommunicator::CheckHost(const ConstRegion& region, std::string_view op) const {
  if (region.device == Device::kHost) return OkStatus();
  return InvalidArgumentError(
      fmt::format("{}: the TCP data plane reads and writes host memory only; this region is on {} "
                  "(generation {}, rank {}) "
                  "(HINT: copy it to host memory first; docs/data_plane.md)",
                  op, DeviceName(region.device, region.device_index), options_.generation, rank()));
}

Status TcpCommunicator::AllReduce(Region data, DType dtype, ReduceOp op) {
  return Reduce("AllReduce", data, dtype, op, 2 * (world_size() - 1));
}

Status TcpCommunicator::ReduceScatter(Region data, DType dtype, ReduceOp op) {
  return Reduce("ReduceScatter", data, dtype, op, world_size() - 1);
}

// The ring's reduce-scatter steps and, for an all-reduce, its all-gather steps up to `t_end`.
Status TcpCommunicator::Reduce(std::string_view what, Region data, DType dtype, ReduceOp op,
                               int t_end) {
  const size_t element = ElementBytes(dtype);
  NONSTOP_CHECK_EQ(data.bytes % element, 0u) << what << ": not a whole number of elements";
  const Combine combine = CombineOf(dtype, op);
  if (combine == nullptr) {
    return InvalidArgumentError(
        fmt::format("{}: {} does not apply to {} elements (HINT: the bitwise "
                    "operations take integers and bool)",
                    what, ReduceOpName(op), DTypeName(dtype)));
  }
  NONSTOP_RETURN_IF_ERROR(MayStart());
  NONSTOP_RETURN_IF_ERROR(CheckHost(data, what));
  ++op_;
  CountOp();
  if (world_size() == 1) return OkStatus();
  return RingPass(data.data, data.bytes / element, element, 0, t_end, combine);
}

Status TcpCommunicator::AllGather(Region data, size_t element_bytes) {
  NONSTOP_CHECK_EQ(data.bytes % element_bytes, 0u);
  NONSTOP_RETURN_IF_ERROR(MayStart());
  NONSTOP_RETURN_IF_ERROR(CheckHost(data, "AllGather"));
  ++op_;
  CountOp();
  if (world_size() == 1) return OkStatus();
  int w = world_size();
  return RingPass(data.data, data.bytes / element_bytes, element_bytes, w - 1, 2 * (w - 1),
                  nullptr);
}

Status TcpCommunicator::Barrier() {
  NONSTOP_RETURN_IF_ERROR(MayStart());
  ++op_;
  CountOp();
  if (world_size() == 1) return OkStatus();
  int w = world_size();
  return RingPass(nullptr, 0, sizeof(float), 0, 2 * (w - 1), nullptr);
}

// Broadcast: a chain root → root+1 → … → root-1 along the ring, pipelined in
// pieces: each rank forwards piece p as soon as it has it.
Status TcpCommunicator::Broadcast(Region data, int root) {
  NONSTOP_CHECK(root >= 0 && root < world_size());
  NONSTOP_RETURN_IF_ERROR(MayStart());
  NONSTOP_RETURN_IF_ERROR(CheckHost(data, "Broadcast"));
  ++op_;
  CountOp();
  const int w = world_size();
  if (w == 1) return OkStatus();
  const int pos = (rank() - root + w) % w;
  TransferSpec spec;
  std::vector<std::pair<std::byte*, size_t>> pieces;
  size_t offset = 0;
  do {
    size_t n = std::min(options_.piece_bytes, data.bytes - offset);
    pieces.emplace_back(data.data + offset, n);
    offset += n;
  } while (offset < data.bytes);
  if (pos != w - 1) {
    int right = (rank() + 1) % w;
    NONSTOP_ASSIGN_OR_RETURN(spec.send_to, Peer(right));
    spec.send_peer = PeerName(right);
    for (size_t i = 0; i < pieces.size(); ++i) {
      spec.sends.push_back(
          {pieces[i].first, pieces[i].second, pos == 0 ? -1 : static_cast<int32_t>(i)});
    }
  }
  if (pos != 0) {
    int left = (rank() + w - 1) % w;
    NONSTOP_ASSIGN_OR_RETURN(spec.recv_from, Peer(left));
    spec.recv_peer = PeerName(left);
    for (auto& [ptr, n] : pieces) spec.recvs.push_back({ptr, n, nullptr});
  }
  spec.generation = options_.generation;
  spec.op = FramedOp();
  spec.checksum = spec.retry = options_.checked;
  spec.deadline = OpDeadline();
  spec.abort = abort_;
  return Run(std::move(spec));
}

namespace {
constexpr uint32_t kP2POpBit = 0x80000000u;  // p2p sequence numbers never collide with collectives'
}

Status TcpCommunicator::AllReduceTree(int m, std::span<const std::vector<TreeNode>> nodes_of,
                                      std::span<const ConstRegion> partials, Region out) {
  const int w = world_size();
  const int r = rank();
  NONSTOP_CHECK_EQ(nodes_of.size(), static_cast<size_t>(w));
  const std::vector<TreeNode>& mine = nodes_of[static_cast<size_t>(r)];
  NONSTOP_CHECK_EQ(partials.size(), mine.size()) << "one partial sum per node of this rank's range";
  NONSTOP_CHECK_EQ(out.bytes % sizeof(float), 0u)
      << "AllReduceTree: not a whole number of float32 elements";
  for (const auto& p : partials) NONSTOP_CHECK_EQ(p.bytes, out.bytes);
  NONSTOP_RETURN_IF_ERROR(MayStart());
  NONSTOP_RETURN_IF_ERROR(CheckHost(out, "AllReduceTree"));
  for (const auto& p : partials) NONSTOP_RETURN_IF_ERROR(CheckHost(p, "AllReduceTree"));
  ++op_;
  CountOp();
  const size_t n = out.bytes / sizeof(float);
  auto partial = [&](size_t k) { return reinterpret_cast<const float*>(partials[k].data); };
  auto [lo, hi] = ChunkRange(n, w, r);
  // Rank q's partial sums of chunk r, node after node.
  std::vector<std::vector<float>> received(static_cast<size_t>(w));
  for (int s = 1; s < w; ++s) {
    // Shift s: chunk (r+s) of our partials goes to rank r+s while rank r-s's chunk r comes in;
    // every rank sends to one and receives from one, both at once (no cycle of blocked sends).
    const int to = (r + s) % w;
    const int from = (r - s + w) % w;
    TransferSpec spec;
    NONSTOP_ASSIGN_OR_RETURN(spec.send_to, Peer(to));
    spec.send_peer = PeerName(to);
    NONSTOP_ASSIGN_OR_RETURN(spec.recv_from, Peer(from));
    spec.recv_peer = PeerName(from);
    auto [to_lo, to_hi] = ChunkRange(n, w, to);
    const size_t piece = std::max<size_t>(1, options_.piece_bytes / sizeof(float));
    // pieces of a run; an empty run travels as one empty piece
    auto cut = [&](size_t count, auto&& emit) {
      size_t pos = 0;
      do {
        size_t end = std::min(count, pos + piece);
        emit(pos, end - pos);
        pos = end;
      } while (pos < count);
    };
    for (const auto& p : partials) {
      cut(to_hi - to_lo, [&](size_t at, size_t len) {
        spec.sends.push_back({p.data + (to_lo + at) * sizeof(float), len * sizeof(float), -1});
      });
    }
    std::vector<float>& in = received[static_cast<size_t>(from)];
    const size_t their = nodes_of[static_cast<size_t>(from)].size();
    in.assign(their * (hi - lo), 0.0f);
    for (size_t k = 0; k < their; ++k) {
      cut(hi - lo, [&](size_t at, size_t len) {
        spec.recvs.push_back({reinterpret_cast<std::byte*>(in.data() + k * (hi - lo) + at),
                              len * sizeof(float), nullptr});
      });
    }
    spec.generation = options_.generation;
    spec.op = FramedOp();
    spec.checksum = spec.retry = options_.checked;
    spec.deadline = OpDeadline();
    spec.abort = abort_;
    NONSTOP_RETURN_IF_ERROR(Run(std::move(spec)));
  }
  // Chunk r: every rank's partial sums, combined along the tree.
  std::vector<TreeNode> nodes;
  std::vector<const float*> values;
  for (int q = 0; q < w; ++q) {
    const auto& theirs = nodes_of[static_cast<size_t>(q)];
    for (size_t k = 0; k < theirs.size(); ++k) {
      nodes.push_back(theirs[k]);
      values.push_back(q == r ? partial(k) + lo
                              : received[static_cast<size_t>(q)].data() + k * (hi - lo));
    }
  }
  CombineInTreeOrder(m, nodes, values, hi - lo, reinterpret_cast<float*>(out.data) + lo);
  if (w == 1) return OkStatus();
  return AllGather(out, sizeof(float));
}

Status TcpCommunicator::Send(int to_rank, ConstRegion data) {
  return SendTo(to_rank, 0, data, /*checksum=*/true, "Send");
}

Status TcpCommunicator::Recv(int from_rank, Region data) {
  return RecvFrom(from_rank, 0, data, /*checksum=*/true, "Recv");
}

Status TcpCommunicator::SendUnchecked(int to_rank, ConstRegion data) {
  return SendTo(to_rank, 0, data, /*checksum=*/false, "SendUnchecked");
}

Status TcpCommunicator::RecvUnchecked(int from_rank, Region data) {
  return RecvFrom(from_rank, 0, data, /*checksum=*/false, "RecvUnchecked");
}

Status TcpCommunicator::SendOnLane(int to_rank, int lane, ConstRegion data, bool checked) {
  NONSTOP_CHECK(lane >= 0 && lane < net::kDataLanes) << "lane " << lane;
  return SendTo(to_rank, lane, data, checked, checked ? "Send" : "SendUnchecked");
}

Status TcpCommunicator::RecvOnLane(int from_rank, int lane, Region data, bool checked) {
  NONSTOP_CHECK(lane >= 0 && lane < net::kDataLanes) << "lane " << lane;
  return RecvFrom(from_rank, lane, data, checked, checked ? "Recv" : "RecvUnchecked");
}

Status TcpCommunicator::SendTo(int to_rank, int lane, ConstRegion data, bool checksum,
                               std::string_view op) {
  NONSTOP_CHECK(to_rank >= 0 && to_rank < world_size() && to_rank != rank());
  NONSTOP_RETURN_IF_ERROR(MayStart());
  NONSTOP_RETURN_IF_ERROR(CheckHost(data, op));
  TransferSpec spec;
  NONSTOP_ASSIGN_OR_RETURN(spec.send_to, Peer(to_rank, lane));
  spec.send_peer =
      lane == 0 ? PeerName(to_rank) : fmt::format("{} lane {}", PeerName(to_rank), lane);
  size_t offset = 0;
  do {
    size_t n = std::min(options_.piece_bytes, data.bytes - offset);
    spec.sends.push_back({data.data + offset, n, -1});
    offset += n;
  } while (offset < data.bytes);
  spec.generation = options_.generation;
  spec.op = kP2POpBit | ++p2p_ops_[static_cast<size_t>(to_rank * net::kDataLanes + lane)];
  spec.checksum = checksum;
  spec.deadline = OpDeadline();
  spec.abort = abort_;
  return Run(std::move(spec));
}

// Unchecked (checksum false): frames that carry a CRC are still verified
// (transfer.cc), so either sender is understood; only their order must match.
Status TcpCommunicator::RecvFrom(int from_rank, int lane, Region data, bool checksum,
                                 std::string_view op) {
  NONSTOP_CHECK(from_rank >= 0 && from_rank < world_size() && from_rank != rank());
  NONSTOP_RETURN_IF_ERROR(MayStart());
  NONSTOP_RETURN_IF_ERROR(CheckHost(data, op));
  TransferSpec spec;
  NONSTOP_ASSIGN_OR_RETURN(spec.recv_from, Peer(from_rank, lane));
  spec.recv_peer =
      lane == 0 ? PeerName(from_rank) : fmt::format("{} lane {}", PeerName(from_rank), lane);
  size_t offset = 0;
  do {
    size_t n = std::min(options_.piece_bytes, data.bytes - offset);
    spec.recvs.push_back({data.data + offset, n, nullptr});
    offset += n;
  } while (offset < data.bytes);
  spec.generation = options_.generation;
  spec.op = kP2POpBit | ++p2p_ops_[static_cast<size_t>(from_rank * net::kDataLanes + lane)];
  spec.checksum = checksum;
  spec.deadline = OpDeadline();
  spec.abort = abort_;
  return Run(std::move(spec));
}

// The first of `from` whose connection is readable (or broke: the receive then says why), then
// RecvOnLane from it. A peer that dials this worker (the lower worker id) opens the lane with its
// first send: until then there is nothing to read from it, and it is looked for again at each
// turn, never waited for.
Result<int> TcpCommunicator::RecvOnAnyLane(std::span<const std::pair<int, int>> from, Region data,
                                           bool checked) {
  NONSTOP_RETURN_IF_ERROR(MayStart());
  NONSTOP_RETURN_IF_ERROR(CheckHost(data, "Recv"));
  if (from.empty()) return InvalidArgumentError("Recv from any of no rank");
  std::vector<Connection*> conns(from.size(), nullptr);
  const Deadline deadline = OpDeadline();
  while (true) {
    if (abort_->fired()) return Fail(AbortedError("Recv from any rank: aborted"));
    NONSTOP_RETURN_IF_ERROR(error());
    std::vector<pollfd> fds;
    std::vector<size_t> index;  // fds[k] is from[index[k]]
    for (size_t i = 0; i < from.size(); ++i) {
      const auto [rank, lane] = from[i];
      NONSTOP_CHECK(rank >= 0 && rank < world_size() && rank != this->rank());
      if (conns[i] == nullptr) {
        const Member& m = options_.members[static_cast<size_t>(rank)];
        const bool dials_us = m.worker_id < mesh_->worker_id();
        Result<Connection*> c = mesh_->Get(
            m.worker_id, m.address, options_.generation,
            dials_us ? Clock::now() : DeadlineAfter(options_.timeout_connect), abort_, lane);
        if (!c.ok() && !(dials_us && c.status().code() == StatusCode::kDeadlineExceeded)) {
          return Fail(c.status());
        }
        if (c.ok()) conns[i] = *c;
      }
      if (conns[i] != nullptr) {
        fds.push_back({conns[i]->fd.get(), POLLIN, 0});
        index.push_back(i);
      }
    }
    fds.push_back({abort_->fd(), POLLIN, 0});
    const int timeout = std::min(PollTimeoutMs(deadline), 50);
    if (timeout == 0 && Clock::now() >= deadline) {
      return Fail(
          DeadlineExceededError("Timed out receiving from any rank: past the call's timeout"));
    }
    if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) {
      return Fail(InternalError(fmt::format("poll: {}", std::strerror(errno))));
    }
    for (size_t k = 0; k + 1 < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const auto [rank, lane] = from[index[k]];
      NONSTOP_RETURN_IF_ERROR(RecvOnLane(rank, lane, data, checked));
      return rank;
    }
  }
}

}  // namespace nonstop::collective
