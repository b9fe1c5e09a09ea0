#include "nonstop/session.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <deque>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "collective/communicator.h"
#include "collective/peer_mesh.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "control/messages.h"
#include "coord/etcd.h"
#include "coord/leadership.h"
#include "net/abort_signal.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "worker/session_testing.h"
#include "worker/state_transfer.h"

namespace nonstop {

namespace testing {
std::function<void()> before_collective_hook;
std::function<void(uint16_t)> control_frame_hook;
}  // namespace testing

Result<SessionOptions> SessionOptions::FromEnvironment() {
  SessionOptions o;
  auto get = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v != nullptr ? v : "";
  };
  o.controller_address = get("NONSTOP_CONTROLLER");
  o.job_token = get("NONSTOP_JOB_TOKEN");
  std::string id = get("NONSTOP_WORKER_ID");
  if (o.controller_address.empty() || o.job_token.empty() || id.empty()) {
    return FailedPreconditionError(
        "NONSTOP_CONTROLLER, NONSTOP_JOB_TOKEN and NONSTOP_WORKER_ID are not set: start this program under "
        "`nonstop run` (HINT: nonstop run --nproc 4 -- <program> <args>)");
  }
  try {
    o.worker_id = std::stoi(id);
  } catch (...) {
    return InvalidArgumentError("NONSTOP_WORKER_ID='" + id + "' is not an integer");
  }
  o.spare = get("NONSTOP_SPARE") == "1";
  for (auto [name, field] : {std::pair{"NONSTOP_CONNECT_TIMEOUT_MS", &o.join_timeout},
                             std::pair{"NONSTOP_CONTROLLER_TIMEOUT_MS", &o.controller_timeout},
                             std::pair{"NONSTOP_LEADERLESS_TIMEOUT_MS", &o.leaderless_timeout}}) {
    std::string v = get(name);
    if (v.empty()) continue;
    try {
      size_t used = 0;
      long long ms = std::stoll(v, &used);
      if (used != v.size() || ms <= 0) throw std::invalid_argument(v);
      *field = std::chrono::milliseconds(ms);
    } catch (...) {
      return InvalidArgumentError(fmt::format("{}='{}' is not a positive number of milliseconds", name, v));
    }
  }
  if (!get("NONSTOP_DATA_HOST").empty()) o.data_host = get("NONSTOP_DATA_HOST");
  o.advertise_address = get("NONSTOP_ADVERTISE_ADDRESS");
  o.host_id = get("NONSTOP_HOST_ID");
  o.etcd_endpoints = get("NONSTOP_ETCD");
  if (!get("NONSTOP_ETCD_JOB").empty()) o.etcd_job = get("NONSTOP_ETCD_JOB");
  return o;
}

namespace {
int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}
}  // namespace

class SessionImpl {
 public:
  SessionImpl(SessionOptions o, state::StateRegistry* state) : options_(std::move(o)), state_(state) {}
  ~SessionImpl() { Stop(); }

  // ---- control plane ----

  Status Start() {
    size_t begin = 0;
    const std::string& list = options_.controller_address;
    while (begin <= list.size()) {
      size_t end = std::min(list.find(',', begin), list.size());
      std::string one = list.substr(begin, end - begin);
      NONSTOP_ASSIGN_OR_RETURN(net::HostPort where, net::ParseHostPort(one));
      controllers_.push_back(where);
      begin = end + 1;
    }
    Deadline deadline = DeadlineAfter(options_.join_timeout);
    Status last;
    for (size_t attempt = 0; !control_fd_.valid(); ++attempt) {
      // One controller after another: the first that accepts the hello leads.
      const net::HostPort& where = controllers_[attempt % controllers_.size()];
      Deadline one = controllers_.size() == 1 ? deadline : std::min(deadline, DeadlineAfter(Millis(2'000)));
      Result<UniqueFd> fd = DialController(where, one);
      if (fd.ok()) {
        control_fd_ = std::move(*fd);
        controller_ = where.ToString();
        break;
      }
      last = fd.status();
      if (controllers_.size() == 1 || Clock::now() >= deadline) {
        return last.WithContext("joining the controller at " + options_.controller_address);
      }
      if ((attempt + 1) % controllers_.size() == 0) std::this_thread::sleep_for(Millis(100));  // a round failed
    }
    collective::PeerMeshOptions mo;
    mo.job_token = options_.job_token;
    mo.worker_id = options_.worker_id;
    mo.listen = {options_.data_host, 0};
    NONSTOP_ASSIGN_OR_RETURN(mesh_, collective::PeerMesh::Create(mo));
    data_address_ = AdvertisedDataAddress();  // from the first control connection's local address
    control::JoinMsg join{options_.worker_id, static_cast<int64_t>(::getpid()), data_address_,
                          options_.spare, state_step_.load(), options_.host_id};
    join.shard_group = state_->shard_group();
    join.held_shard = held_shard_.load();
    NONSTOP_RETURN_IF_ERROR(SendControl(control::kMsgJoin, control::Encode(join)));
    io_thread_ = std::jthread([this](std::stop_token st) { IoLoop(st); });
    // Wait for the first plan that includes this worker, then take part in it.
    return Rejoin(/*after_generation=*/0, "start").status();
  }

  // Where peers reach this worker's data port (SessionOptions::advertise_address).
  std::string AdvertisedDataAddress() const {
    std::string host = options_.advertise_address;
    if (host.empty() && options_.data_host != "0.0.0.0" && options_.data_host != "::") host = options_.data_host;
    if (host.empty()) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      char text[INET6_ADDRSTRLEN] = {};
      if (::getsockname(control_fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len) == 0 && ss.ss_family == AF_INET) {
        ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, text, sizeof(text));
        host = text;
      }
    }
    if (host.empty()) return mesh_->address().ToString();
    return fmt::format("{}:{}", host, mesh_->address().port);
  }

  // Dials a controller and says hello; the controller's refusal (a wrong
  // token, a controller that does not lead) is an error.
  Result<UniqueFd> DialController(const net::HostPort& where, Deadline deadline) {
    NONSTOP_ASSIGN_OR_RETURN(UniqueFd fd, net::Dial(where, deadline));
    net::Hello hello;
    hello.kind = net::ConnectionKind::kControl;
    hello.worker_id = options_.worker_id;
    hello.job_token = options_.job_token;
    NONSTOP_RETURN_IF_ERROR(net::ClientHandshake(fd.get(), hello, deadline, &stop_signal_));
    return fd;
  }

  // Without a controller (lost, not yet found again) messages are dropped:
  // what the next controller must know is in the join that reconnects.
  Status SendControl(uint16_t type, const std::string& payload) NONSTOP_LOCKS_EXCLUDED(write_mu_) {
    MutexLock lock(&write_mu_);
    if (!control_fd_.valid()) return UnavailableError("no controller leads now");
    return net::WriteFrame(control_fd_.get(), type, payload, DeadlineAfter(Millis(5'000)), &stop_signal_);
  }

  void IoLoop(std::stop_token st) {
    net::FrameDecoder decoder;
    Deadline next_heartbeat = Clock::now();
    Clock::time_point heard_at = Clock::now();  // the last frame from the controller
    while (!st.stop_requested()) {
      if (Clock::now() >= next_heartbeat) {
        SendHeartbeat();
        next_heartbeat = DeadlineAfter(options_.heartbeat_interval);
      }
      pollfd fds[2] = {{control_fd_.get(), POLLIN, 0}, {stop_signal_.fd(), POLLIN, 0}};
      int rc = ::poll(fds, 2, PollTimeoutMs(std::min(next_heartbeat, heard_at + options_.controller_timeout)));
      Status s;
      if (rc > 0 && (fds[0].revents & (POLLIN | POLLHUP | POLLERR))) {
        char buf[16 << 10];
        ssize_t n = ::recv(control_fd_.get(), buf, sizeof(buf), 0);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        s = n > 0 ? decoder.Feed(std::string_view(buf, static_cast<size_t>(n)))
                  : UnavailableError("controller closed the connection");
        if (n > 0) heard_at = Clock::now();
        while (s.ok()) {
          auto f = decoder.Next();
          if (!f) break;
          s = OnControlFrame(*f);
          if (testing::control_frame_hook) testing::control_frame_hook(f->type);
        }
      } else if (Clock::now() - heard_at > options_.controller_timeout) {
        s = UnavailableError(fmt::format("heard nothing from the controller for {} ms",
                                         std::chrono::duration_cast<Millis>(Clock::now() - heard_at).count()));
      }
      if (!s.ok()) {
        if (!Reconnect(st, s)) return;
        decoder = net::FrameDecoder();
        heard_at = Clock::now();
        next_heartbeat = Clock::now();
      }
    }
  }

  // The controller is gone (it died, or is cut off): training goes on, and
  // this thread dials the controllers in turn until one leads and takes the
  // join that says where this worker stands. False when it gave up
  // (leaderless_timeout) or the session stops.
  bool Reconnect(std::stop_token st, const Status& why) {
    {
      MutexLock lock(&write_mu_);
      control_fd_.Reset();
    }
    auto lost_at = Clock::now();
    NONSTOP_LOG_WARNING("lost the controller at {}: {}; training goes on, dialing {} again (membership changes wait "
                        "for a controller; giving up in {} s)",
                        controller_, why.message(), options_.controller_address,
                        std::chrono::duration_cast<std::chrono::seconds>(options_.leaderless_timeout).count());
    Millis backoff{100};
    Status last = why;
    for (size_t attempt = 0; !st.stop_requested(); ++attempt) {
      if (Clock::now() - lost_at >= options_.leaderless_timeout) {
        NONSTOP_LOG_ERROR("no controller for {} ms (last error: {}): giving up",
                          options_.leaderless_timeout.count(), last.ToString());
        return GiveUp("lost the controller: " + why.message());
      }
      Result<net::HostPort> leader = NextController(attempt);
      if (!leader.ok() && leader.status().code() == StatusCode::kAborted) {
        // etcd says the job ended: no controller will come back for it.
        NONSTOP_LOG_ERROR("{}: giving up", leader.status().message());
        return GiveUp(leader.status().message());
      }
      if (!leader.ok()) {
        last = leader.status();
        pollfd p{stop_signal_.fd(), POLLIN, 0};
        (void)::poll(&p, 1, 100);  // etcd says nobody leads yet: look again soon
        continue;
      }
      const net::HostPort where = *leader;
      Result<UniqueFd> fd = DialController(where, DeadlineAfter(Millis(1'000)));
      if (fd.ok() && SendRejoin(std::move(*fd)).ok()) {
        controller_ = where.ToString();
        NONSTOP_LOG_WARNING("joined the controller at {} again after {} ms", controller_,
                            std::chrono::duration_cast<Millis>(Clock::now() - lost_at).count());
        return true;
      }
      if (!fd.ok()) last = fd.status();
      if (etcd_) {
        // etcd named a leader that did not answer (it is starting, or was just deposed): ask again soon.
        pollfd p{stop_signal_.fd(), POLLIN, 0};
        (void)::poll(&p, 1, 100);
      } else if (attempt % controllers_.size() + 1 == controllers_.size()) {
        // A round over every controller failed: back off (waking at once to stop).
        pollfd p{stop_signal_.fd(), POLLIN, 0};
        (void)::poll(&p, 1, static_cast<int>(backoff.count()));
        backoff = std::min(Millis(1'000), backoff * 2);
      }
    }
    return false;
  }

  // No controller will lead this worker again: the training thread fails
  // out of what it waits for or computes. Always false (Reconnect's answer).
  bool GiveUp(const std::string& why) {
    MutexLock lock(&mu_);
    controller_lost_ = true;
    if (comm_) comm_->Abort(why);
    cv_.NotifyAll();
    return false;
  }

  // The controller to dial on attempt n: the one etcd says leads, or the next of the list.
  Result<net::HostPort> NextController(size_t attempt) {
    if (!options_.etcd_endpoints.empty() && !etcd_) {
      auto c = etcd::Client::Create(options_.etcd_endpoints, {Millis(500)});
      if (!c.ok()) return c.status();
      etcd_ = std::move(*c);
    }
    if (etcd_) {
      NONSTOP_ASSIGN_OR_RETURN(std::string address, coord::LookUpLeader(*etcd_, options_.etcd_job));
      return net::ParseHostPort(address);
    }
    return controllers_[attempt % controllers_.size()];
  }

  // A controller's ping: its epoch. One older than an epoch this worker has
  // seen is a deposed leader's: its connection is left (an error here) and
  // the leader is looked for again, so none of its orders is acted on.
  Status OnPing(const net::Frame& f) {
    NONSTOP_ASSIGN_OR_RETURN(control::PingMsg ping, control::DecodePing(f.payload));
    if (ping.epoch < epoch_) {
      return FailedPreconditionError(fmt::format(
          "the controller at {} is of epoch {}, older than epoch {} that led already: a deposed leader, not followed",
          controller_, ping.epoch, epoch_));
    }
    epoch_ = ping.epoch;
    return OkStatus();
  }

  // The join that tells a controller taking over where this worker stands:
  // the generation it is in, whether it left it and waits for a plan, the
  // step its state holds; then the Finished it may have sent the last one.
  Status SendRejoin(UniqueFd fd) {
    // write_mu_ first and until the connection is installed: a Ready or a
    // Finished the training thread sends meanwhile either is in this join
    // (it set waiting_after_ / finished_ before sending) or goes out on the
    // new connection after it, never lost in between.
    MutexLock write_lock(&write_mu_);
    control::JoinMsg join{options_.worker_id, static_cast<int64_t>(::getpid()), data_address_,
                          options_.spare, state_step_.load(), options_.host_id};
    join.shard_group = state_->shard_group();
    join.held_shard = held_shard_.load();
    std::optional<control::FinishedMsg> finished;
    {
      MutexLock lock(&mu_);
      if (comm_) {
        join.spare = false;
        join.generation = comm_->generation();
      }
      if (waiting_after_ > 0) {
        join.generation = waiting_after_;
        join.waiting = true;
      }
      finished = finished_;
    }
    Deadline deadline = DeadlineAfter(Millis(2'000));
    NONSTOP_RETURN_IF_ERROR(
        net::WriteFrame(fd.get(), control::kMsgJoin, control::Encode(join), deadline, &stop_signal_));
    if (finished) {
      NONSTOP_RETURN_IF_ERROR(
          net::WriteFrame(fd.get(), control::kMsgFinished, control::Encode(*finished), deadline, &stop_signal_));
    }
    control_fd_ = std::move(fd);
    return OkStatus();
  }

  void SendHeartbeat() {
    int64_t since = collective_since_ms_.load();
    control::HeartbeatMsg hb{state_step_.load(), since < 0 ? -1 : std::max<int64_t>(0, NowMs() - since)};
    (void)SendControl(control::kMsgHeartbeat, control::Encode(hb));
  }

  Status OnControlFrame(const net::Frame& f) {
    switch (f.type) {
      case control::kMsgPing:
        return OnPing(f);
      case control::kMsgPlan: {
        NONSTOP_ASSIGN_OR_RETURN(control::PlanMsg plan, control::DecodePlan(f.payload));
        MutexLock lock(&mu_);
        if (!plan_ || plan.generation > plan_->generation) plan_ = std::move(plan);
        cv_.NotifyAll();
        return OkStatus();
      }
      case control::kMsgAbort: {
        NONSTOP_ASSIGN_OR_RETURN(control::AbortMsg m, control::DecodeAbort(f.payload));
        MutexLock lock(&mu_);
        aborted_generation_ = std::max(aborted_generation_, m.generation);
        if (comm_ && comm_->generation() <= m.generation) {
          comm_->Abort(fmt::format("the controller ended generation {}: {}", m.generation, m.reason));
        }
        cv_.NotifyAll();
        return OkStatus();
      }
      case control::kMsgDrain: {
        NONSTOP_ASSIGN_OR_RETURN(control::DrainMsg m, control::DecodeDrain(f.payload));
        MutexLock lock(&mu_);
        drain_ = m;
        // Already past the boundary and blocked in the next step's collective
        // (the others stopped at the boundary): leave it now.
        if (comm_ && comm_->generation() == m.generation && in_collective_ &&
            state_step_.load() >= m.after_step) {
          comm_->Abort(fmt::format("generation {} ends at the step boundary after step {}: {}", m.generation,
                                   state_step_.load(), m.reason));
        }
        return OkStatus();
      }
      case control::kMsgShutdown: {
        NONSTOP_ASSIGN_OR_RETURN(control::ShutdownMsg m, control::DecodeShutdown(f.payload));
        MutexLock lock(&mu_);
        shutdown_ = m;
        if (comm_ && m.exit_code != 0) comm_->Abort("the controller ended the job: " + m.reason);
        cv_.NotifyAll();
        return OkStatus();
      }
      default:
        return InvalidArgumentError(fmt::format("unexpected control message type {}", f.type));
    }
  }

  void Stop() {
    // A bucket in flight is cut short, and so is a control write it blocks
    // in (the arrival heartbeat): the Session is going away.
    io_thread_.request_stop();
    stop_signal_.Fire();
    if (comm_thread_.joinable()) {
      abort_.Fire();
      comm_thread_.request_stop();
      comm_thread_.join();
    }
    if (io_thread_.joinable()) io_thread_.join();
  }

  // ---- generations ----

  // Waits for a plan newer than `after_generation` that includes this worker,
  // adopts it (connections, state transfer) and returns its resume step. A
  // failure inside a generation (a fault during recovery) reports Ready for
  // that generation and waits for the next.
  Result<int64_t> Rejoin(uint32_t after_generation, std::string why) {
    while (true) {
      if (after_generation > 0) {
        {
          MutexLock lock(&mu_);
          waiting_after_ = after_generation;  // a join after a controller loss says so
        }
        control::ReadyMsg ready{after_generation, state_step_.load(), why, held_shard_.load()};
        Status sent = SendControl(control::kMsgReady, control::Encode(ready));
        if (!sent.ok()) NONSTOP_LOG_WARNING("ready for the next generation, but: {}", sent.ToString());
      }
      control::PlanMsg plan;
      {
        // As long as the controller lives (its pings keep controller_lost_
        // false): a spare may wait for days.
        MutexLock lock(&mu_);
        cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return (plan_ && plan_->generation > after_generation) || shutdown_ || controller_lost_;
        });
        if (shutdown_) {
          return CancelledError(fmt::format("the job ended (exit code {}): {}", shutdown_->exit_code, shutdown_->reason));
        }
        if (controller_lost_) return UnavailableError("lost the controller");
        plan = *plan_;
        waiting_after_ = 0;
      }
      Result<int64_t> resumed = Adopt(plan);
      if (resumed.ok()) return resumed;
      NONSTOP_LOG_WARNING("generation {} failed during recovery: {}", plan.generation, resumed.status().ToString());
      after_generation = plan.generation;
      why = resumed.status().message();
    }
  }

  Result<int64_t> Adopt(const control::PlanMsg& plan) {
    auto t0 = Clock::now();
    NONSTOP_RETURN_IF_ERROR(worker::ValidatePlan(plan, options_.worker_id));
    collective::CommunicatorOptions co;
    co.generation = plan.generation;
    co.rank = -1;
    for (size_t r = 0; r < plan.members.size(); ++r) {
      co.members.push_back({plan.members[r].worker_id, plan.members[r].address});
      if (plan.members[r].worker_id == options_.worker_id) co.rank = static_cast<int>(r);
    }
    if (co.rank < 0) {
      return InternalError(fmt::format("plan of generation {} does not include worker {}", plan.generation, options_.worker_id));
    }
    co.timeout_collective = options_.timeout_collective;
    {
      MutexLock lock(&mu_);
      // Swap communicators under the lock: an abort for the new generation
      // that arrives meanwhile is either recorded or applied, never lost.
      abort_.Reset();
      comm_ = std::make_unique<collective::Communicator>(mesh_.get(), &abort_, co);
      if (aborted_generation_ >= plan.generation) comm_->Abort("the controller ended this generation");
      if (shutdown_ && shutdown_->exit_code != 0) comm_->Abort("the controller ended the job");
      faults_ = plan.faults;
      resume_step_ = plan.resume_step;
    }
    SetLogRole(fmt::format("rank {}", co.rank));
    MembershipChange change;
    change.generation = plan.generation;
    change.old_world = comm_before_world_;
    change.old_rank = comm_before_rank_;
    change.new_world = static_cast<int>(plan.members.size());
    change.new_rank = co.rank;
    change.resume_step = plan.resume_step;
    change.reason = plan.reason;
    last_change_ = change;
    comm_before_world_ = change.new_world;
    comm_before_rank_ = change.new_rank;
    NONSTOP_RETURN_IF_ERROR(comm_->Connect());
    auto t1 = Clock::now();

    worker::TransferHooks hooks;
    std::optional<control::FaultSpec> at_transfer = TakeFault(control::FaultPoint::kTransfer, plan.resume_step, co.rank,
                                                              control::FaultKind::kKill);
    std::optional<control::FaultSpec> corrupt = TakeFault(control::FaultPoint::kTransfer, plan.resume_step, co.rank,
                                                          control::FaultKind::kCorrupt);
    if (at_transfer) hooks.on_start = [this, f = *at_transfer] { Fire(f); };
    hooks.corrupt_first_chunk = corrupt.has_value();
    if (corrupt) Announce(*corrupt);
    bool receiving = false;
    for (const auto& t : plan.transfers) receiving = receiving || t.receiver == options_.worker_id;
    if (receiving) state_step_.store(control::kNoValidState);  // until every chunk is in
    Result<worker::TransferOutcome> outcome =
        worker::RunStateTransfers(*comm_, *state_, plan, options_.worker_id, hooks);
    if (!outcome.ok()) return outcome.status();
    if (receiving) state_step_.store(plan.resume_step - 1);
    held_shard_.store(state_->held_shard());
    if (state_->shard_group() > 0) {
      // Sharded state: every member ends holding its rank's shard (a spare,
      // a rank that moved in a resize: re-sharded live, peer to peer), as the
      // plan's shard moves say; a plan that disagrees with the state fails.
      Result<worker::TransferOutcome> shards =
          worker::ExchangeShards(*comm_, *state_, plan, state_step_.load(), hooks);
      held_shard_.store(state_->held_shard());
      if (!shards.ok()) return shards.status();
      outcome->received = outcome->received || shards->received;
      outcome->bytes_received += shards->bytes_received;
      outcome->sources = std::max(outcome->sources, shards->sources);
      outcome->refetched_chunks += shards->refetched_chunks;
      if (shards->received) {
        NONSTOP_LOG_INFO("re-sharded: copied shard {} of the optimizer state ({:.2f} MB) from {} holder(s)",
                         state_->held_shard(), shards->bytes_received / 1e6, shards->sources);
      }
      NONSTOP_RETURN_IF_ERROR(BuildShardGroups(co.rank, static_cast<int>(plan.members.size())));
    }
    auto t2 = Clock::now();
    control::RecoveredMsg rec{plan.generation, std::chrono::duration<double>(t1 - t0).count(),
                              std::chrono::duration<double>(t2 - t1).count(), outcome->bytes_received,
                              outcome->sources, outcome->refetched_chunks, mesh_->connections_open(),
                              mesh_->connections_opened()};
    (void)SendControl(control::kMsgRecovered, control::Encode(rec));
    if (outcome->received) {
      NONSTOP_LOG_INFO("copied the state of step {} ({:.2f} MB) from {} source(s) in {:.0f} ms", plan.resume_step - 1,
                       outcome->bytes_received / 1e6, outcome->sources, rec.transfer_seconds * 1000);
    }
    return plan.resume_step;
  }

  // The sub-group communicators of sharded state (docs/sharding.md): this
  // rank's shard group, and the replicas of its shard across the groups.
  Status BuildShardGroups(int rank, int world) {
    NONSTOP_ASSIGN_OR_RETURN(state::ShardLayout layout, state::LayoutOf(world, state_->shard_group()));
    const int shard = layout.shard_of_rank[static_cast<size_t>(rank)];
    const int group = layout.group_of_rank[static_cast<size_t>(rank)];
    if (layout.groups() + layout.group_size > 126) {
      return InvalidArgumentError(fmt::format("{} groups of {}: the sub-groups need more than the 126 op spaces a "
                                              "generation has; use a larger optimizer.shard_group",
                                              layout.groups(), layout.group_size));
    }
    std::vector<int> in_group = layout.Group(group), replicas = layout.Replicas(shard);
    group_comm_ = comm_->SubGroup(in_group, static_cast<uint32_t>(1 + group));
    replica_comm_ = comm_->SubGroup(replicas, static_cast<uint32_t>(1 + layout.groups() + shard));
    return OkStatus();
  }

  Status ReduceShards(std::span<float> data) {
    return RunCollective(
        [&]() -> Status {
          NONSTOP_RETURN_IF_ERROR(group_comm_->ReduceScatter(data));
          auto [lo, hi] = collective::ChunkRange(data.size(), group_comm_->world_size(), group_comm_->rank());
          if (replica_comm_->world_size() == 1) return OkStatus();
          return replica_comm_->AllReduce(data.subspan(lo, hi - lo));
        },
        /*at_step_boundary=*/true);
  }

  Status GatherShards(std::span<std::byte> data, size_t element_bytes) {
    return RunCollective([&] { return group_comm_->AllGather(data, element_bytes); }, /*at_step_boundary=*/false);
  }

  // ---- fault injection ----

  std::optional<control::FaultSpec> TakeFault(control::FaultPoint point, int64_t step, int rank, control::FaultKind kind) {
    MutexLock lock(&mu_);
    for (auto it = faults_.begin(); it != faults_.end(); ++it) {
      bool step_matches = it->step == step || (point == control::FaultPoint::kTransfer && it->step < 0);
      if (it->point == point && step_matches && it->rank == rank && it->kind == kind) {
        control::FaultSpec f = *it;
        faults_.erase(it);
        return f;
      }
    }
    return std::nullopt;
  }

  void Announce(const control::FaultSpec& f) {
    control::InjectedMsg m{f.id, control::FormatFault(f)};
    (void)SendControl(control::kMsgInjected, control::Encode(m));
  }

  // Carries out an injected fault on this process.
  void Fire(const control::FaultSpec& f) {
    NONSTOP_LOG_WARNING("injecting fault {}", control::FormatFault(f));
    Announce(f);
    switch (f.kind) {
      case control::FaultKind::kKill:
        ::raise(SIGKILL);
        break;
      case control::FaultKind::kHang:
        ::raise(SIGSTOP);
        break;
      case control::FaultKind::kDrop:
        comm_->InjectDropOfNextRingLink();
        break;
      case control::FaultKind::kStall:
        // The training thread stops for good; the I/O thread still sends heartbeats.
        while (true) std::this_thread::sleep_for(std::chrono::seconds(1));
      default:
        break;
    }
  }

  void MaybeInjectBeforeCollective() {
    int rank = comm_->rank();
    int64_t step = state_step_.load() + 1;
    for (auto kind : {control::FaultKind::kKill, control::FaultKind::kHang, control::FaultKind::kDrop,
                      control::FaultKind::kStall}) {
      if (auto f = TakeFault(control::FaultPoint::kStep, step, rank, kind)) Fire(*f);
    }
  }

  // Every collective goes through here. The drain check and the mark that a
  // collective is in flight happen under mu_, in one critical section, and the
  // I/O thread's Drain handler reads the mark under mu_ too: so a Drain either
  // is seen here (the collective is not entered) or sees the mark (and aborts
  // the collective). Before, a Drain landing between the check and the mark
  // left this member blocked in a collective its peers had left.
  // `announce`: tell the controller at once that this member arrived (the
  // first collective of a step; a step's later gradient buckets do not).
  template <typename Op>
  Status RunCollective(Op op, bool at_step_boundary, bool announce = true) {
    if (at_step_boundary) MaybeInjectBeforeCollective();  // a stall stops here, before it arrives
    {
      MutexLock lock(&mu_);
      if (drain_ && comm_->generation() == drain_->generation && state_step_.load() >= drain_->after_step) {
        // A planned change: this generation ends at this step boundary.
        Status s = AbortedError(fmt::format("generation {} ends at the step boundary after step {}: {}",
                                            drain_->generation, state_step_.load(), drain_->reason));
        comm_->Abort(s.message());
        return s;
      }
      in_collective_ = true;
      // Only a step's collective counts as "waiting" for the controller's
      // watchdogs: a Barrier or Broadcast is no arrival at a step.
      if (at_step_boundary) collective_since_ms_.store(NowMs());
    }
    if (testing::before_collective_hook) testing::before_collective_hook();
    if (at_step_boundary && announce) {
      // Tell the controller at once that this member reached the step's
      // collective: the arrival spread is how hangs are found (docs/recovery.md).
      SendHeartbeat();
    }
    Status s = op();
    {
      MutexLock lock(&mu_);
      in_collective_ = false;
    }
    collective_since_ms_.store(-1);
    return s;
  }

  Status AllReduce(std::span<float> data) {
    return RunCollective([&] { return comm_->AllReduce(data); }, /*at_step_boundary=*/true);
  }

  // ---- overlapped reduction (Session::StartAllReduce / WaitAll) ----

  void StartAllReduce(std::span<float> data) {
    MutexLock lock(&bucket_mu_);
    if (!comm_thread_.joinable()) comm_thread_ = std::jthread([this](std::stop_token st) { BucketLoop(st); });
    buckets_.push_back(data);
    bucket_cv_.NotifyAll();
  }

  // The communication thread: reduces the started buckets one at a time, in
  // order. After the first error the rest of the step's buckets are skipped:
  // the step is dropped whole, so there is nothing to gain from them.
  void BucketLoop(std::stop_token st) {
    MutexLock lock(&bucket_mu_);
    while (true) {
      auto started = [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(bucket_mu_) { return !buckets_.empty(); };
      bucket_cv_.Wait(&bucket_mu_, st, started);
      if (st.stop_requested()) return;
      std::span<float> bucket = buckets_.front();
      bool skip = !bucket_status_.ok();
      bool first = first_bucket_;
      first_bucket_ = false;
      lock.Unlock();
      // Every bucket passes the drain check and marks the member as waiting
      // (a peer that hangs mid-backward is found like one that hangs before
      // the step); only the step's first announces the arrival.
      Status s = skip ? OkStatus()
                      : RunCollective([&] { return comm_->AllReduce(bucket); }, /*at_step_boundary=*/true,
                                      /*announce=*/first);
      lock.Lock();
      buckets_.pop_front();
      if (!s.ok() && bucket_status_.ok()) bucket_status_ = s;
      bucket_cv_.NotifyAll();
    }
  }

  Status WaitAll() {
    MutexLock lock(&bucket_mu_);
    bucket_cv_.Wait(&bucket_mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(bucket_mu_) { return buckets_.empty(); });
    Status s = bucket_status_;
    bucket_status_ = OkStatus();
    first_bucket_ = true;
    return s;
  }

  Status Finish(int64_t last_step, const std::string& checksum) {
    uint32_t gen = comm_->generation();
    control::FinishedMsg finished{last_step, checksum};
    {
      MutexLock lock(&mu_);
      finished_ = finished;  // sent again to a controller that takes over
    }
    Status sent = SendControl(control::kMsgFinished, control::Encode(finished));
    if (!sent.ok()) NONSTOP_LOG_WARNING("finished, but: {}", sent.ToString());
    MutexLock lock(&mu_);
    Deadline deadline = DeadlineAfter(Millis(600'000));
    while (!shutdown_ && !controller_lost_ && aborted_generation_ < gen) {
      if (cv_.WaitUntil(&mu_, deadline) == std::cv_status::timeout) {
        return DeadlineExceededError("the controller did not end the job within 10 minutes of this worker finishing");
      }
    }
    if (shutdown_) {
      if (shutdown_->exit_code != 0) return UnavailableError("the job ended with an error: " + shutdown_->reason);
      return OkStatus();
    }
    if (controller_lost_) return UnavailableError("lost the controller");
    return AbortedError(fmt::format("generation {} ended before the job did: a member failed", gen));
  }

  collective::Communicator& comm() {
    NONSTOP_CHECK(comm_ != nullptr) << "no plan adopted";
    return *comm_;
  }

  SessionOptions options_;
  state::StateRegistry* const state_;  // owned by the training program; outlives the session
  // Written under write_mu_ (the I/O thread replaces it after a controller
  // loss; Start sets it before that thread exists). Not GUARDED_BY: the I/O
  // thread, its only writer, also polls and reads it without the lock; the
  // other threads only write frames to it, under write_mu_ (SendControl).
  UniqueFd control_fd_;
  // Before mesh_: the mesh's accept thread polls the abort signal of a thread
  // waiting in Get(), so the signal must outlive the mesh.
  net::AbortSignal abort_;        // fired to abort the collective in flight
  net::AbortSignal stop_signal_;  // wakes the I/O thread at shutdown
  std::unique_ptr<collective::PeerMesh> mesh_;
  std::atomic<int64_t> state_step_{-1};          // the step the registered state holds
  std::atomic<int> held_shard_{state::kEveryShard};  // sharded state: the shard it holds (StateRegistry::held_shard)
  std::atomic<int64_t> collective_since_ms_{-1};  // when the step collective in flight began
  // Lock order: write_mu_, then mu_ (SendRejoin), then a Communicator's.
  Mutex write_mu_;  // serialises frames on the control socket

  Mutex mu_;
  CondVar cv_;
  bool in_collective_ NONSTOP_GUARDED_BY(mu_) = false;  // any collective is in flight
  std::optional<control::PlanMsg> plan_ NONSTOP_GUARDED_BY(mu_);  // the newest plan received
  std::optional<control::ShutdownMsg> shutdown_ NONSTOP_GUARDED_BY(mu_);
  std::optional<control::DrainMsg> drain_ NONSTOP_GUARDED_BY(mu_);
  MembershipChange last_change_;  // training thread only
  uint32_t aborted_generation_ NONSTOP_GUARDED_BY(mu_) = 0;
  bool controller_lost_ NONSTOP_GUARDED_BY(mu_) = false;  // gave up finding a controller
  uint32_t waiting_after_ NONSTOP_GUARDED_BY(mu_) = 0;  // left this generation, waits for a plan
  std::optional<control::FinishedMsg> finished_ NONSTOP_GUARDED_BY(mu_);  // sent when the training loop ended
  std::vector<net::HostPort> controllers_;        // NONSTOP_CONTROLLER, in the order they are tried
  std::unique_ptr<etcd::Client> etcd_;            // where the leader is looked up (NONSTOP_ETCD); io thread
  int64_t epoch_ = 0;                             // the newest controller epoch seen; io thread
  std::string controller_;                        // the one connected last (for logs; the I/O thread's)
  std::string data_address_;                      // what peers dial, fixed at the first join
  // Replaced under mu_ (Adopt), and the I/O thread uses it (Abort) only
  // under mu_. Not GUARDED_BY: the training thread, its only writer, drives
  // it without the lock, and so does comm_thread_ between StartAllReduce and
  // WaitAll (the training thread waits for it before the next replacement).
  std::unique_ptr<collective::Communicator> comm_;
  // Sharded state: sub-groups of comm_ (its connections and abort signal), training thread only.
  std::unique_ptr<collective::Communicator> group_comm_, replica_comm_;
  std::vector<control::FaultSpec> faults_ NONSTOP_GUARDED_BY(mu_);
  // Training thread only (Adopt writes it, Session::resume_step reads it).
  int64_t resume_step_ = 0;
  int comm_before_world_ = 0;
  int comm_before_rank_ = -1;
  // Overlapped reduction: buckets started by the training thread, reduced in
  // order by comm_thread_. The training thread touches comm_ only after
  // WaitAll (Recover, Finish and the other collectives wait first).
  Mutex bucket_mu_;
  CondVar bucket_cv_;
  // Started, not yet reduced (front: in flight).
  std::deque<std::span<float>> buckets_ NONSTOP_GUARDED_BY(bucket_mu_);
  Status bucket_status_ NONSTOP_GUARDED_BY(bucket_mu_);  // the first error since the last WaitAll
  bool first_bucket_ NONSTOP_GUARDED_BY(bucket_mu_) = true;  // the next bucket is its step's first
  // Training thread only: started with the first bucket (StartAllReduce),
  // joined in Stop().
  std::jthread comm_thread_;
  std::jthread io_thread_;  // last: stops before the members it uses go away
};

Result<std::unique_ptr<Session>> Session::Join(SessionOptions options, state::StateRegistry* state,
                                              int64_t state_step) {
  NONSTOP_CHECK(state != nullptr);
  auto impl = std::make_unique<SessionImpl>(std::move(options), state);
  impl->state_step_.store(state_step);
  impl->held_shard_.store(state->held_shard());
  NONSTOP_RETURN_IF_ERROR(impl->Start());
  return std::unique_ptr<Session>(new Session(std::move(impl)));
}

Session::Session(std::unique_ptr<SessionImpl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;

int Session::rank() const { return impl_->comm().rank(); }
int Session::world_size() const { return impl_->comm().world_size(); }
uint32_t Session::generation() const { return impl_->comm().generation(); }
int64_t Session::resume_step() const { return impl_->resume_step_; }
int Session::worker_id() const { return impl_->options_.worker_id; }

// The collectives the training thread calls directly wait for the started
// buckets first: the communicator has one driver at a time.
Status Session::AllReduce(std::span<float> data) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->AllReduce(data);
}
void Session::StartAllReduce(std::span<float> data) { impl_->StartAllReduce(data); }
Status Session::WaitAll() { return impl_->WaitAll(); }
Status Session::AllReduceTree(int m, std::span<const std::pair<int, int>> ranges,
                              std::span<const std::vector<float>> partials, std::span<float> out) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->RunCollective([&] { return impl_->comm().AllReduceTree(m, ranges, partials, out); },
                              /*at_step_boundary=*/true);
}
Status Session::AllReduceTree(int m, std::span<const std::vector<std::pair<int, int>>> nodes_of,
                              std::span<const std::vector<float>> partials, std::span<float> out) {
  std::vector<std::vector<collective::TreeNode>> nodes(nodes_of.size());
  for (size_t q = 0; q < nodes_of.size(); ++q) {
    for (auto [level, index] : nodes_of[q]) nodes[q].push_back({level, index});
  }
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->RunCollective(
      [&] { return impl_->comm().AllReduceTree(m, std::span<const std::vector<collective::TreeNode>>(nodes), partials,
                                               out); },
      /*at_step_boundary=*/true);
}
Status Session::AllGather(std::span<std::byte> data, size_t record_bytes) {
  NONSTOP_CHECK(record_bytes > 0 && data.size() == record_bytes * static_cast<size_t>(world_size()))
      << "AllGather: " << data.size() << " bytes are not " << world_size() << " records of " << record_bytes;
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->RunCollective([&] { return impl_->comm().AllGather(data, record_bytes); },
                              /*at_step_boundary=*/false);
}
Status Session::Broadcast(std::span<std::byte> data, int root) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->RunCollective([&] { return impl_->comm().Broadcast(data, root); }, /*at_step_boundary=*/false);
}
Status Session::Barrier() {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->RunCollective([&] { return impl_->comm().Barrier(); }, /*at_step_boundary=*/false);
}

int Session::shard_group() const { return impl_->state_->shard_group(); }
int Session::shard() const {
  const int g = shard_group();
  return g > 0 ? rank() % g : 0;
}
Status Session::ReduceShards(std::span<float> data) {
  NONSTOP_CHECK(shard_group() > 0 && data.size() % static_cast<size_t>(shard_group()) == 0)
      << "ReduceShards: " << data.size() << " floats are not " << shard_group() << " shards of one size";
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->ReduceShards(data);
}
Status Session::GatherShards(std::span<std::byte> data, size_t element_bytes) {
  const auto g = static_cast<size_t>(shard_group());
  NONSTOP_CHECK(g > 0 && element_bytes > 0 && data.size() % (g * element_bytes) == 0)
      << "GatherShards: " << data.size() << " bytes are not " << g << " shards of elements of " << element_bytes;
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->GatherShards(data, element_bytes);
}

void Session::ReportStep(const StepReport& r) {
  impl_->state_step_.store(r.step);
  control::ProgressMsg m{r.step, r.loss, r.step_seconds, r.tokens_per_second, world_size(), r.total_steps};
  Status s = impl_->SendControl(control::kMsgProgress, control::Encode(m));
  // Without a controller the step is not lost: the join to the next one says it.
  if (!s.ok()) NONSTOP_LOG_DEBUG("progress report not sent: {}", s.ToString());
}

Result<int64_t> Session::Recover() {
  (void)impl_->WaitAll();  // the communication thread is idle before the communicator is replaced
  Status why = impl_->comm().error();
  return impl_->Rejoin(impl_->comm().generation(), why.ok() ? "recovering" : why.message());
}

Status Session::Finish(int64_t last_step, const std::string& checksum) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  impl_->state_step_.store(last_step);
  return impl_->Finish(last_step, checksum);
}

void Session::ReportFailure(const Status& status, int64_t step, int exit_code) {
  control::FailureMsg m{generation(), step, status.ToString(), exit_code};
  (void)impl_->SendControl(control::kMsgFailure, control::Encode(m));
}

bool Session::InjectedExceptionAt(int64_t step) {
  auto f = impl_->TakeFault(control::FaultPoint::kStep, step, rank(), control::FaultKind::kException);
  if (!f) return false;
  impl_->Announce(*f);
  return true;
}

MembershipChange Session::last_change() const { return impl_->last_change_; }

bool Session::aborted() const { return impl_->abort_.fired(); }

int Session::shutdown_exit_code() const {
  MutexLock lock(&impl_->mu_);
  return impl_->shutdown_ ? impl_->shutdown_->exit_code : 0;
}

}  // namespace nonstop
