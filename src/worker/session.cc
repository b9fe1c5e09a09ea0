#include "nonstop/session.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "collective/data_plane.h"
#include "collective/staged_communicator.h"
#include "collective/tcp_data_plane.h"
#include "common/crypto.h"
#include "common/lifeline.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/role_keys.h"
#include "control/controller_link.h"
#include "control/messages.h"
#include "net/abort_signal.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/exit_codes.h"
#include "nonstop/settings.h"
#include "worker/bucket_reducer.h"
#include "worker/fault_injector.h"
#include "worker/held_state.h"
#include "worker/replica_check.h"
#include "worker/session_testing.h"
#include "worker/state_transfer.h"
#include "worker/store_client.h"
#include "worker/user_groups.h"

namespace nonstop {

namespace testing {
std::function<void()> before_collective_hook;
std::function<void(uint16_t)> control_frame_hook;
std::function<void()> before_plan_decode_hook;
}  // namespace testing

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

// A worker's link (docs/controller-failover.md): its hello (kind control, its
// worker id); the list first, etcd after a loss; and its timing.
control::ControllerLinkOptions LinkOptions(const SessionOptions& o, const WorkerKeys& keys) {
  control::ControllerLinkOptions l;
  l.controllers = o.controller_address;
  l.etcd = o.etcd_endpoints;
  l.etcd_job = o.etcd_job;
  l.leader_file = o.leader_file;
  l.etcd_security = {o.etcd_cacert, o.etcd_cert, o.etcd_key, o.etcd_auth_file,
                     o.etcd_allow_plaintext};
  l.etcd_timeout = Millis(500);
  l.list_first = true;  // its launcher named the controller that leads now
  l.hello.kind = net::ConnectionKind::kControl;
  l.hello.worker_id = o.worker_id;
  l.key = keys.control;
  l.controller_public = keys.controller_public;
  // one try (connect, then hello): a paused leader holds it no longer
  l.try_timeout = Millis(1'000);
  l.silence_timeout = o.controller_timeout;
  l.reconnect_within = o.leaderless_timeout;
  l.backoff = {Millis(100), Millis(1'000), /*jitter=*/0.5};
  l.leader_poll = Millis(100);
  return l;
}

// This process's data plane (docs/data_plane.md): the one place that picks
// the transport. TCP over host memory is the one built; the session uses
// only the DataPlane and Communicator interfaces.
Result<std::unique_ptr<collective::DataPlane>> NewDataPlane(const SessionOptions& o,
                                                            const WorkerKeys& keys,
                                                            net::AbortSignal* abort) {
  collective::PeerMeshOptions mo;
  mo.data_key = keys.data;
  mo.worker_id = o.worker_id;
  mo.listen = {o.data_host, 0};
  mo.ports = {o.data_port_lo, o.data_port_hi};
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<collective::TcpDataPlane> tcp,
                           collective::TcpDataPlane::Create(std::move(mo), abort));
  if (o.device != nullptr && o.device_data_plane) return o.device_data_plane(std::move(tcp), abort);
  if (o.device != nullptr) {
    // device memory staged through host buffers over the TCP collectives (docs/gpu.md)
    return std::unique_ptr<collective::DataPlane>(std::make_unique<collective::StagedDataPlane>(
        std::move(tcp), std::make_shared<collective::MemoryCopier>(o.device)));
  }
  return std::unique_ptr<collective::DataPlane>(std::move(tcp));
}

// Every device a worker must trust with state or sums (issue 30, docs/gpu.md): the device of the
// sums, the program's checked devices and those of the registered state, each once.
std::vector<const state::DeviceMemory*> DevicesToCheck(const SessionOptions& o,
                                                       const state::StateRegistry& state) {
  std::vector<const state::DeviceMemory*> devices;
  auto add = [&](const state::DeviceMemory* d) {
    if (d != nullptr && std::find(devices.begin(), devices.end(), d) == devices.end())
      devices.push_back(d);
  };
  add(o.device.get());
  for (const auto& d : o.checked_devices) add(d.get());
  for (const state::Region& r : state.regions()) add(r.device.get());
  return devices;
}

// Their health checks (DeviceMemory::Check): FAILED_PRECONDITION "worker N: DEVICE failed its
// health check WHEN: why" for the first that fails.
Status CheckDevices(const std::vector<const state::DeviceMemory*>& devices, int worker_id,
                    std::string_view when) {
  for (const state::DeviceMemory* device : devices) {
    if (Status s = device->Check(); !s.ok()) {
      return FailedPreconditionError(fmt::format("worker {}: {} failed its health check{}: {}",
                                                 worker_id, device->name(), when, s.message()));
    }
  }
  return OkStatus();
}

}  // namespace

class SessionImpl {
 public:
  SessionImpl(SessionOptions o, state::StateRegistry* state)
      : options_(std::move(o)),
        state_(state),
        store_([this](uint16_t type, const std::string& payload) {
          return SendControl(type, payload);
        }),
        faults_({.send = [this](uint16_t type,
                                const std::string& payload) { (void)SendControl(type, payload); },
                 .refuse =
                     [this](const std::string& reason) {
                       control::FailureMsg m{last_change_.generation, state_step_.load(), reason,
                                             kExitUsage};
                       (void)SendControl(control::kMsgFailure, control::Encode(m));
                     },
                 .comm = [this] { return comm_.get(); },
                 .state = state}) {}
  ~SessionImpl() { Stop(); }

  // ---- control plane ----

  Status Start() {
    NONSTOP_ASSIGN_OR_RETURN(keys_, WorkerKeysFrom(options_.secret, options_.worker_id));
    NONSTOP_ASSIGN_OR_RETURN(link_, control::ControllerLink::Create(LinkOptions(options_, keys_)));
    Deadline now = Clock::now();
    link_->Start(now + options_.join_timeout, now);
    // One controller after another, until one accepts the hello (this thread drives the link until
    // the I/O thread does).
    if (Status s = link_->WaitAccepted(&stop_signal_); !s.ok()) {
      return s.WithContext("joining the controller at " + options_.controller_address);
    }
    NONSTOP_ASSIGN_OR_RETURN(data_plane_, NewDataPlane(options_, keys_, &abort_));
    data_address_ = AdvertisedDataAddress();  // from the first control connection's local address
    control::JoinMsg join{options_.worker_id, static_cast<int64_t>(::getpid()),
                          data_address_,      options_.spare,
                          state_step_.load(), options_.host_id};
    join.shard_group = state_->shard_group();
    join.sealed_copy = options_.sealed_state_copy;
    join.held_shard = held_shard_.load();
    {
      MutexLock lock(&write_mu_);
      NONSTOP_RETURN_IF_ERROR(link_->Open({{control::kMsgJoin, control::Encode(join)}}));
    }
    io_thread_ = std::jthread([this](std::stop_token st) { IoLoop(st); });
    join_complete_ = !options_.defer_state;
    // Wait for the first plan that includes this worker, then take part in it.
    NONSTOP_RETURN_IF_ERROR(Rejoin(/*after_generation=*/0, "start").status());
    if (last_change_.state_copied) HoldCopiedState();
    return OkStatus();
  }

  // SessionOptions::defer_state: the program has registered its state now; the parked plan's
  // transfers run (the peers of a recovery that promoted this worker wait for them), and a
  // failure there waits for the next plan, as Rejoin does.
  Status CompleteJoin() {
    if (join_complete_) {
      return FailedPreconditionError(
          "CompleteJoin: the join is complete already (only a session joined with "
          "SessionOptions::defer_state completes it, once)");
    }
    if (state_->shard_group() > 0) {
      return FailedPreconditionError(
          "CompleteJoin: sharded state needs its shards placed at the join; register it before "
          "Session::Join instead (without defer_state)");
    }
    join_complete_ = true;
    held_shard_.store(state_->held_shard());
    std::optional<Parked> parked = std::exchange(parked_, std::nullopt);
    if (!parked) return InternalError("CompleteJoin: no plan was adopted at the join");
    // The devices of the state registered now, checked before they are trusted with it (the
    // join had none to check).
    devices_ = DevicesToCheck(options_, *state_);
    if (Status healthy = CheckDevices(devices_, options_.worker_id,
                                      " as it registered its state, so it does not take part");
        !healthy.ok()) {
      return ReportDeviceFailure(healthy, parked->plan->generation);
    }
    if (!parked->plan->transfers.empty()) {
      NONSTOP_LOG_INFO(
          "the program registered its state {:.0f} ms after this worker took its place in "
          "generation {} (its setup, which the recovery waited for)",
          std::chrono::duration<double, std::milli>(Clock::now() - parked->t1).count(),
          parked->plan->generation);
    }
    // The connection's and the transfer's times without the setup between them.
    const Clock::time_point now = Clock::now();
    Result<int64_t> resumed = TakeState(*parked->plan, now - (parked->t1 - parked->t0), now);
    if (!resumed.ok()) {
      NONSTOP_LOG_WARNING("generation {} failed as this worker took its state: {}",
                          parked->plan->generation, resumed.status().ToString());
      copied_since_recover_ = copied_since_recover_ || last_change_.state_copied;
      NONSTOP_RETURN_IF_ERROR(
          Rejoin(parked->plan->generation, std::string(resumed.status().message())).status());
    }
    copied_since_recover_ = false;
    if (last_change_.state_copied) HoldCopiedState();
    return OkStatus();
  }

  // A worker that joined a running job holds the state it copied until its
  // first step begins (BeginTraining): the program's setup runs in between.
  void HoldCopiedState() {
    MutexLock lock(&held_mu_);
    held_state_ = worker::HeldState::Take(*state_);
    holding_.store(true, std::memory_order_release);
    NONSTOP_LOG_INFO(
        "holding the {:.2f} MB copied from the peers until the first step: the "
        "program's setup cannot change the state it trains from",
        held_state_->bytes() / 1e6);
  }

  // The first step begins (BeginTraining): the held copy is written back over
  // whatever the program's setup did to the registered state. With `restore`
  // false (the first step's collective came first: the program never called
  // BeginTraining, and what its setup did to the state after the join is its
  // own, as nonstop-train's adjustments to a new world are) the copy is only
  // let go.
  void ApplyHeldState(bool restore) {
    if (!holding_.load(std::memory_order_acquire)) return;
    MutexLock lock(&held_mu_);
    if (!held_state_) return;
    std::vector<std::string> changed;
    if (restore) changed = held_state_->Restore(state_);
    held_state_.reset();
    holding_.store(false, std::memory_order_release);
    if (changed.empty()) return;
    std::string names = fmt::format("{}", fmt::join(changed, ", "));
    if (names.size() > 300) names = names.substr(0, 300) + "...";
    NONSTOP_LOG_WARNING(
        "the program's setup changed {} of the registered regions ({}) after "
        "this worker copied them from its peers; their copy is restored, so "
        "this worker trains from the peers' state",
        changed.size(), names);
  }

  // Where peers reach this worker's data port (SessionOptions::advertise_address),
  // "host:port" or "[v6]:port".
  std::string AdvertisedDataAddress() const {
    std::string host = options_.advertise_address;
    if (host.empty() && !net::IsWildcardHost(options_.data_host)) host = options_.data_host;
    if (host.empty()) host = link_->local_address();
    const net::HostPort listening = data_plane_->address();
    if (host.empty()) return listening.ToString();
    return net::FormatHostPort(host, listening.port);
  }

  bool RestoreHeldState() {
    if (!holding_.load(std::memory_order_acquire)) return false;
    MutexLock lock(&held_mu_);
    if (!held_state_) return false;
    (void)held_state_->Restore(state_);
    return true;
  }

  // Without a controller (lost, not yet found again) messages are dropped:
  // what the next controller must know is in the join that reconnects.
  Status SendControl(uint16_t type, const std::string& payload) NONSTOP_LOCKS_EXCLUDED(write_mu_) {
    MutexLock lock(&write_mu_);
    return link_->Send(type, payload);
  }

  // The I/O thread: heartbeats, the controller's frames, and the link's
  // losses and reconnections. Training goes on meanwhile: when the
  // controller is lost the link dials the controllers (or etcd's leader)
  // until one accepts, and the join says where this worker stands.
  void IoLoop(std::stop_token st) {
    Deadline next_heartbeat = Clock::now();
    while (!st.stop_requested()) {
      if (Clock::now() >= next_heartbeat) {
        SendHeartbeat();
        next_heartbeat = DeadlineAfter(options_.heartbeat_interval);
      }
      pollfd fds[3] = {{link_->fd(), link_->events(), 0},
                       {link_->wake_fd(), POLLIN, 0},
                       {stop_signal_.fd(), POLLIN, 0}};
      int rc = ::poll(fds, 3, PollTimeoutMs(std::min(next_heartbeat, link_->wake_at())));
      if (st.stop_requested()) return;
      link_->Advance(rc > 0 ? fds[0].revents : 0, Clock::now());
      while (auto e = link_->Next()) {
        switch (e->kind) {
          case control::LinkEvent::Kind::kFrame: {
            Status s = OnControlFrame(e->frame);
            if (testing::control_frame_hook) testing::control_frame_hook(e->frame.type);
            if (!s.ok()) {
              // a malformed order: garbage, dialed again after a pause
              link_->Drop(s, Clock::now());
              Lost(s);
            }
            break;
          }
          case control::LinkEvent::Kind::kLost:
            Lost(e->status);
            break;
          case control::LinkEvent::Kind::kAccepted:
            if (SendRejoin().ok()) {
              NONSTOP_LOG_WARNING(
                  "joined the controller at {} again after {} ms", link_->controller(),
                  std::chrono::duration_cast<Millis>(Clock::now() - lost_at_).count());
            }
            next_heartbeat = Clock::now();
            break;
          case control::LinkEvent::Kind::kFailed:
            GiveUp(e->status);
            return;
        }
      }
    }
  }

  // The controller is gone (it died, or is cut off): training goes on.
  void Lost(const Status& why) {
    lost_at_ = Clock::now();
    lost_why_ = why.message();
    NONSTOP_LOG_WARNING(
        "lost the controller at {}: {}; training goes on, dialing {} again (membership changes "
        "wait "
        "for a controller; giving up in {} s)",
        link_->controller(), why.message(), options_.controller_address,
        std::chrono::duration_cast<std::chrono::seconds>(options_.leaderless_timeout).count());
  }

  // No controller will lead this worker again (the link gave up: the
  // leaderless timeout, a refused hello, or etcd says the job ended): the
  // training thread fails out of what it waits for or computes.
  void GiveUp(const Status& why) {
    std::string reason;
    if (why.code() == StatusCode::kAborted) {
      reason = why.message();
      NONSTOP_LOG_ERROR("{}: giving up", reason);
    } else if (why.code() == StatusCode::kFailedPrecondition) {
      reason =
          fmt::format("cannot join the controller at {}: {}", link_->controller(), why.message());
      NONSTOP_LOG_ERROR("{}: giving up", reason);
    } else {
      reason = "lost the controller: " + lost_why_;
      NONSTOP_LOG_ERROR("no controller for {} ms (last error: {}): giving up",
                        options_.leaderless_timeout.count(), why.ToString());
    }
    store_.Fail(UnavailableError("the job's store is out of reach: " + reason));
    MutexLock lock(&mu_);
    controller_lost_ = true;
    if (comm_) comm_->Abort(reason);
    cv_.NotifyAll();
  }

  // The join that tells a controller taking over where this worker stands:
  // the generation it is in, whether it left it and waits for a plan, the
  // step its state holds; then the Finished it may have sent the last one.
  Status SendRejoin() NONSTOP_LOCKS_EXCLUDED(write_mu_) {
    // write_mu_ first and until the connection is open: a Ready or a
    // Finished the training thread sends meanwhile either is in this join
    // (it set waiting_after_ / finished_ before sending) or goes out on the
    // new connection after it, never lost in between.
    MutexLock write_lock(&write_mu_);
    control::JoinMsg join{options_.worker_id, static_cast<int64_t>(::getpid()),
                          data_address_,      options_.spare,
                          state_step_.load(), options_.host_id};
    join.shard_group = state_->shard_group();
    join.sealed_copy = options_.sealed_state_copy;
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
    std::vector<std::pair<uint16_t, std::string>> first = {
        {control::kMsgJoin, control::Encode(join)}};
    if (finished) first.emplace_back(control::kMsgFinished, control::Encode(*finished));
    for (auto& call : store_.Unanswered(Clock::now())) first.push_back(std::move(call));
    return link_->Open(first);
  }

  void SendHeartbeat() NONSTOP_LOCKS_EXCLUDED(busy_mu_) {
    int64_t since = collective_since_ms_.load();
    control::HeartbeatMsg hb{state_step_.load(),
                             since < 0 ? -1 : std::max<int64_t>(0, NowMs() - since)};
    {
      MutexLock lock(&busy_mu_);
      if (!busy_label_.empty()) {
        hb.busy = busy_label_;
        hb.busy_ms = std::max<int64_t>(0, NowMs() - busy_since_ms_);
        hb.busy_bound_ms = busy_bound_ms_;
      }
    }
    (void)SendControl(control::kMsgHeartbeat, control::Encode(hb));
  }

  // A plan frame's PlanMsg, decoded without mu_: a plan of 100,000 members is megabytes of JSON,
  // and the training thread takes mu_ around every collective. A delta is decoded against the
  // plan held (docs/plan-wire.md: the one received last on this connection, the newest), shared
  // out from under the lock: plan_ is replaced, never changed in place.
  Result<control::PlanMsg> DecodePlanFrame(const net::Frame& f) NONSTOP_LOCKS_EXCLUDED(mu_) {
    std::shared_ptr<const control::PlanMsg> base;
    if (f.type == control::kMsgPlanDelta) {
      MutexLock lock(&mu_);
      base = plan_;
    }
    if (testing::before_plan_decode_hook) testing::before_plan_decode_hook();
    if (f.type == control::kMsgPlan) return control::DecodePlan(f.payload);
    return control::DecodePlanDelta(f.payload, base.get());
  }

  Status OnControlFrame(const net::Frame& f) {
    switch (f.type) {  // never a ping: the link checks their epochs
      case control::kMsgPlan:
      case control::kMsgPlanDelta: {
        NONSTOP_ASSIGN_OR_RETURN(control::PlanMsg plan, DecodePlanFrame(f));
        MutexLock lock(&mu_);
        // Only if newer than the plan held. plan_ is still the one a delta was decoded against:
        // its only writer is the I/O thread, which runs this.
        if (!plan_ || plan.generation > plan_->generation)
          plan_ = std::make_shared<const control::PlanMsg>(std::move(plan));
        cv_.NotifyAll();
        return OkStatus();
      }
      case control::kMsgAbort: {
        NONSTOP_ASSIGN_OR_RETURN(control::AbortMsg m, control::DecodeAbort(f.payload));
        MutexLock lock(&mu_);
        aborted_generation_ = std::max(aborted_generation_, m.generation);
        if (comm_ && comm_->generation() <= m.generation) {
          comm_->Abort(
              fmt::format("the controller ended generation {}: {}", m.generation, m.reason));
          store_.AbortWaits(AbortedError(
              fmt::format("the controller ended generation {} during a wait in the job's store: {}",
                          m.generation, m.reason)));
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
          comm_->Abort(fmt::format("generation {} ends at the step boundary after step {}: {}",
                                   m.generation, state_step_.load(), m.reason));
        }
        return OkStatus();
      }
      case control::kMsgStoreReply:
        return store_.OnReply(f.payload);
      case control::kMsgShutdown: {
        NONSTOP_ASSIGN_OR_RETURN(control::ShutdownMsg m, control::DecodeShutdown(f.payload));
        MutexLock lock(&mu_);
        shutdown_ = m;
        // Told to end: its exit is no death (the lifeline must not fire as it goes).
        if (lifeline_) lifeline_->MarkReleased();
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
    faults_.StopTimers();  // a timed fault not fired yet never fires
    store_.Fail(CancelledError("the session ended"));
    io_thread_.request_stop();
    stop_signal_.Fire();
    abort_.Fire();
    buckets_.Stop();
    if (io_thread_.joinable()) io_thread_.join();
  }

  // ---- generations ----

  // Waits for a plan newer than `after_generation` that includes this worker,
  // adopts it (connections, state transfer) and returns its resume step. A
  // failure inside a generation (a fault during recovery) reports Ready for
  // that generation and waits for the next.
  Result<int64_t> Rejoin(uint32_t after_generation, std::string why) {
    // A recovery before this worker's first step: it serves and keeps the peers' state, not
    // what its setup made of it, and holds it again afterwards.
    const bool held = RestoreHeldState();
    while (true) {
      if (after_generation > 0) {
        {
          MutexLock lock(&mu_);
          waiting_after_ = after_generation;  // a join after a controller loss says so
        }
        control::ReadyMsg ready{after_generation, state_step_.load(), why, held_shard_.load()};
        Status sent = SendControl(control::kMsgReady, control::Encode(ready));
        if (!sent.ok())
          NONSTOP_LOG_WARNING("ready for the next generation, but: {}", sent.ToString());
      }
      // A spare waiting for its first plan (it has never been a member).
      const bool spare = options_.spare && after_generation == 0;
      Result<std::shared_ptr<const control::PlanMsg>> waited = WaitForPlan(after_generation, spare);
      if (!waited.ok()) {
        if (spare && waited.status().code() == StatusCode::kFailedPrecondition)
          return ReportDeviceFailure(waited.status(), 0);  // its device failed while it waited
        return waited.status();
      }
      std::shared_ptr<const control::PlanMsg> plan = *std::move(waited);
      if (spare) {
        // Promoted: its devices were checked at the join and while it waited, and once more now,
        // before it takes state. A device that broke fails this worker, as any member's fault.
        if (Status healthy = CheckDevices(
                devices_, options_.worker_id,
                fmt::format(" as this spare was promoted (generation {}), so it does not take part",
                            plan->generation));
            !healthy.ok()) {
          return ReportDeviceFailure(healthy, plan->generation);
        }
      }
      Result<int64_t> resumed = Adopt(plan);
      // A try that copied the state in and then failed still leaves it copied (the trainer must
      // not salvage what it computed before), though the next plan copies nothing.
      copied_since_recover_ = copied_since_recover_ || last_change_.state_copied;
      last_change_.state_copied = copied_since_recover_;
      if (resumed.ok()) {
        copied_since_recover_ = false;
        if (held) HoldCopiedState();
        return resumed;
      }
      NONSTOP_LOG_WARNING("generation {} failed during recovery: {}", plan->generation,
                          resumed.status().ToString());
      after_generation = plan->generation;
      why = resumed.status().message();
    }
  }

  // Waits for a plan newer than `after_generation`: CANCELLED when the job ends first, UNAVAILABLE
  // when the controller is lost. As long as the controller lives (its pings keep controller_lost_
  // false) a spare may wait for days; with `spare`, its devices are checked every
  // spare_check_interval meanwhile, and FAILED_PRECONDITION says which one failed.
  Result<std::shared_ptr<const control::PlanMsg>> WaitForPlan(uint32_t after_generation,
                                                              bool spare) {
    MutexLock lock(&mu_);
    auto woken = [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return (plan_ && plan_->generation > after_generation) || shutdown_ || controller_lost_;
    };
    if (!spare || devices_.empty() || options_.spare_check_interval <= Millis(0)) {
      cv_.Wait(&mu_, woken);
    } else {
      while (!cv_.WaitFor(&mu_, options_.spare_check_interval, woken)) {
        lock.Unlock();  // a device's check may take a while: the I/O thread goes on meanwhile
        Status healthy = CheckDevices(devices_, options_.worker_id,
                                      " while this worker waited as a spare, so it leaves the "
                                      "job's spares");
        lock.Lock();
        // A plan, the job's end or the controller's loss that came meanwhile is answered first
        // (a promotion checks the devices again).
        if (!healthy.ok() && !woken()) return healthy;
      }
    }
    if (shutdown_) {
      return CancelledError(
          fmt::format("the job ended (exit code {}): {}", shutdown_->exit_code, shutdown_->reason));
    }
    if (controller_lost_) return UnavailableError("lost the controller");
    waiting_after_ = 0;
    return plan_;  // shared, not copied: the I/O thread replaces plan_, never changes it
  }

  // A spare's device failed its health check (`failed`): the controller is told why (it lets the
  // spare go, or recovers without it once promoted in `generation`), and so is the caller, whose
  // Join fails. Should the agent's report of this process's exit reach the controller first, the
  // spare is lost all the same, without the reason in the journal.
  Status ReportDeviceFailure(const Status& failed, uint32_t generation) {
    NONSTOP_LOG_ERROR("{}", failed.message());
    control::FailureMsg m{generation, state_step_.load(), std::string(failed.message())};
    (void)SendControl(control::kMsgFailure, control::Encode(m));
    return failed;
  }

  // Connects to the plan's members, then copies the state (TakeState), unless the program
  // registers its state after the join (SessionOptions::defer_state): the plan is parked until
  // CompleteJoin.
  Result<int64_t> Adopt(const std::shared_ptr<const control::PlanMsg>& adopted) {
    const control::PlanMsg& plan = *adopted;
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
      return InternalError(fmt::format("plan of generation {} does not include worker {}",
                                       plan.generation, options_.worker_id));
    }
    co.timeout_collective = options_.timeout_collective;
    co.checked = options_.checked_collectives;
    // A timed fault armed in the old generation never fires in this one (the plan lists it again
    // while the controller still waits for it). Before mu_: a timer firing takes write_mu_.
    faults_.StopTimers();
    {
      MutexLock lock(&mu_);
      // Swap communicators under the lock: an abort for the new generation
      // that arrives meanwhile is either recorded or applied, never lost.
      abort_.Reset();
      store_.ResumeWaits();
      comm_ = data_plane_->NewCommunicator(co);
      if (aborted_generation_ >= plan.generation) {
        comm_->Abort("the controller ended this generation");
        store_.AbortWaits(AbortedError("the controller ended this generation"));
      }
      if (shutdown_ && shutdown_->exit_code != 0) comm_->Abort("the controller ended the job");
      faults_.SetFaults(plan.faults);
      resume_step_ = plan.resume_step;
    }
    SetLogRole(fmt::format("rank {}", co.rank));
    user_groups_.NewGeneration();
    member_ids_.clear();
    member_hosts_.clear();
    for (const collective::Member& m : co.members) {
      member_ids_.push_back(m.worker_id);
      Result<net::HostPort> at = net::ParseHostPort(m.address);
      member_hosts_.push_back(at.ok() ? at->host : m.address);
    }
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
    if (!join_complete_) {
      parked_ = Parked{adopted, t0, t1};
      return plan.resume_step;
    }
    return TakeState(plan, t0, t1);
  }

  // The rest of Adopt: the state transfers and shard moves of `plan`, then Recovered.
  Result<int64_t> TakeState(const control::PlanMsg& plan, Clock::time_point t0,
                            Clock::time_point t1) {
    const int rank = comm_->rank();
    worker::TransferHooks hooks;
    std::optional<control::FaultSpec> at_transfer = faults_.Take(
        control::FaultPoint::kTransfer, plan.resume_step, rank, control::FaultKind::kKill);
    std::optional<control::FaultSpec> corrupt = faults_.Take(
        control::FaultPoint::kTransfer, plan.resume_step, rank, control::FaultKind::kCorrupt);
    if (at_transfer) hooks.on_start = [this, f = *at_transfer] { faults_.Fire(f); };
    hooks.corrupt_first_chunk = corrupt.has_value();
    if (options_.sealed_state_copy) hooks.seal_key = keys_.data;
    if (corrupt) faults_.Announce(*corrupt);
    bool receiving = false;
    for (const auto& t : plan.transfers) receiving = receiving || t.receiver == options_.worker_id;
    if (receiving) state_step_.store(control::kNoValidState);  // until every chunk is in
    // Holders that disagree with no majority: planning again would meet the same holders, so
    // the job stops (exit 11) naming what differs.
    auto stop_if_disagreement = [&](const Status& s) {
      if (!worker::IsDisagreement(s)) return;
      NONSTOP_LOG_ERROR("{}", s.message());
      control::FailureMsg m{plan.generation, state_step_.load(), std::string(s.message()),
                            kExitDataCorruption};
      (void)SendControl(control::kMsgFailure, control::Encode(m));
    };
    Result<worker::TransferOutcome> outcome = worker::RunStateTransfers(
        *comm_, *state_, plan, options_.worker_id, state_step_.load(), hooks);
    stop_if_disagreement(outcome.status());
    if (!outcome.ok()) return outcome.status();
    if (receiving) state_step_.store(plan.resume_step - 1);
    last_change_.state_copied = receiving;
    held_shard_.store(state_->held_shard());
    if (state_->shard_group() > 0) {
      // Sharded state: every member ends holding its rank's shard (a spare,
      // a rank that moved in a resize: re-sharded live, peer to peer), as the
      // plan's shard moves say; a plan that disagrees with the state fails.
      Result<worker::TransferOutcome> shards =
          worker::ExchangeShards(*comm_, *state_, plan, state_step_.load(), hooks);
      held_shard_.store(state_->held_shard());
      stop_if_disagreement(shards.status());
      if (!shards.ok()) return shards.status();
      outcome->received = outcome->received || shards->received;
      last_change_.state_copied = last_change_.state_copied || shards->received;
      outcome->bytes_received += shards->bytes_received;
      outcome->sources = std::max(outcome->sources, shards->sources);
      outcome->refetched_chunks += shards->refetched_chunks;
      if (shards->received) {
        NONSTOP_LOG_INFO(
            "re-sharded: copied shard {} of the optimizer state ({:.2f} MB) from {} holder(s)",
            state_->held_shard(), shards->bytes_received / 1e6, shards->sources);
      }
      NONSTOP_RETURN_IF_ERROR(BuildShardGroups(rank, static_cast<int>(plan.members.size())));
    }
    auto t2 = Clock::now();
    const collective::DataPlaneStats links = data_plane_->stats();
    control::RecoveredMsg rec{plan.generation,
                              std::chrono::duration<double>(t1 - t0).count(),
                              std::chrono::duration<double>(t2 - t1).count(),
                              outcome->bytes_received,
                              outcome->sources,
                              outcome->refetched_chunks,
                              links.connections_open,
                              links.connections_opened};
    (void)SendControl(control::kMsgRecovered, control::Encode(rec));
    if (outcome->received) {
      NONSTOP_LOG_INFO("copied the state of step {} ({:.2f} MB) from {} source(s) in {:.0f} ms{}",
                       plan.resume_step - 1, outcome->bytes_received / 1e6, outcome->sources,
                       rec.transfer_seconds * 1000,
                       options_.sealed_state_copy ? ", every chunk sealed" : "");
    }
    return plan.resume_step;
  }

  // The sub-group communicators of sharded state (docs/sharding.md): this
  // rank's shard group, and the replicas of its shard across the groups.
  Status BuildShardGroups(int rank, int world) {
    NONSTOP_ASSIGN_OR_RETURN(state::ShardLayout layout,
                             state::LayoutOf(world, state_->shard_group()));
    const int shard = layout.shard_of_rank[static_cast<size_t>(rank)];
    const int group = layout.group_of_rank[static_cast<size_t>(rank)];
    if (layout.groups() + layout.group_size > 126) {
      return InvalidArgumentError(
          fmt::format("{} groups of {}: the sub-groups need more than the 126 op spaces a "
                      "generation has; use a larger optimizer.shard_group",
                      layout.groups(), layout.group_size));
    }
    std::vector<int> in_group = layout.Group(group), replicas = layout.Replicas(shard);
    group_comm_ = comm_->SubGroup(in_group, static_cast<uint32_t>(1 + group), Millis(0));
    replica_comm_ =
        comm_->SubGroup(replicas, static_cast<uint32_t>(1 + layout.groups() + shard), Millis(0));
    return OkStatus();
  }

  // `data`: fp32 values in host memory or the device's (DeviceRegion); `what` names the call.
  Status ReduceShards(std::string_view what, collective::Region data) {
    const int g = state_->shard_group();
    NONSTOP_CHECK(g > 0 && data.bytes % (static_cast<size_t>(g) * sizeof(float)) == 0)
        << what << ": " << data.bytes / sizeof(float) << " floats are not " << g
        << " shards of one size";
    NONSTOP_RETURN_IF_ERROR(WaitAll());
    return RunCollective(
        [&]() -> Status {
          NONSTOP_RETURN_IF_ERROR(
              group_comm_->ReduceScatter(data, collective::DType::kFloat32, ReduceOp::kSum));
          if (replica_comm_->world_size() == 1) return OkStatus();
          auto [lo, hi] = collective::ChunkRange(data.bytes / sizeof(float),
                                                 group_comm_->world_size(), group_comm_->rank());
          collective::Region shard = data;
          shard.data += lo * sizeof(float);
          shard.bytes = (hi - lo) * sizeof(float);
          return replica_comm_->AllReduce(shard, collective::DType::kFloat32, ReduceOp::kSum);
        },
        /*at_step_boundary=*/true);
  }

  Status GatherShards(std::string_view what, collective::Region data, size_t element_bytes) {
    const auto g = static_cast<size_t>(state_->shard_group());
    NONSTOP_CHECK(g > 0 && element_bytes > 0 && data.bytes % (g * element_bytes) == 0)
        << what << ": " << data.bytes << " bytes are not " << g << " shards of elements of "
        << element_bytes;
    NONSTOP_RETURN_IF_ERROR(WaitAll());
    return RunCollective([&] { return group_comm_->AllGather(data, element_bytes); },
                         /*at_step_boundary=*/false);
  }

  // `bytes` of the memory of SessionOptions::device, as the data plane names them; `what` names
  // the call in the error without a device.
  Result<collective::Region> DeviceRegion(std::string_view what, std::span<std::byte> bytes) const {
    if (options_.device == nullptr) {
      return FailedPreconditionError(
          fmt::format("{}: this session has no device (set SessionOptions::device)", what));
    }
    return collective::Region{bytes.data(), bytes.size(), collective::Device::kCuda,
                              options_.device->index()};
  }

  // Replica agreement (worker/replica_check.h, docs/integrity.md): before the
  // first collective of every K-th step, while every member holds the state
  // of the step before it, the members all-gather the CRC of each region and
  // judge them alike. Agreement: the step goes on. A member in the minority
  // drops its state (it holds no valid step: the controller's next plan
  // copies the majority's into it) and the generation ends at this boundary
  // (ABORTED, nothing computed is lost but this step's); no majority: the job
  // cannot tell the right copy, so it stops with exit 11 naming what differs.
  Status CheckReplicas() {
    const int64_t held = state_step_.load();
    const int k = options_.replica_check_every;
    if (k <= 0 || held < 0 || (held + 1) % k != 0 || comm_->world_size() < 2) return OkStatus();
    // What the check cost, reported with the step (the journal's replica_check_ms, and of that
    // replica_crc_ms: the CRC pass, the rest is the all-gather and the wait for the others).
    const auto t0 = Clock::now();
    auto since_t0 = [&] {
      return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    };
    const size_t bytes = worker::ReplicaRecordBytes(*state_);
    const auto world = static_cast<size_t>(comm_->world_size());
    std::vector<std::byte> records(bytes * world);
    worker::EncodeReplicaRecord(
        worker::RecordOf(*state_, held),
        std::span(records).subspan(bytes * static_cast<size_t>(comm_->rank()), bytes));
    replica_crc_ms_.store(since_t0());
    NONSTOP_RETURN_IF_ERROR(comm_->AllGather(records, bytes));
    std::vector<worker::ReplicaRecord> all;
    for (size_t q = 0; q < world; ++q) {
      Result<worker::ReplicaRecord> r =
          worker::DecodeReplicaRecord(std::span(records).subspan(bytes * q, bytes), *state_);
      if (!r.ok()) {
        Status bad = DataLossError(fmt::format("the replica record of rank {} (worker {}): {}", q,
                                               member_ids_[q], r.status().message()));
        comm_->Abort(bad.message());
        return bad;
      }
      all.push_back(std::move(*r));
    }
    const worker::ReplicaVerdict v = worker::CompareReplicas(*state_, all, member_ids_);
    replica_check_ms_.store(since_t0());
    if (v.agree()) return OkStatus();
    if (v.no_majority) {
      Status bad = DataLossError(fmt::format(
          "the replicas of the state of step {} disagree and no majority can tell which is "
          "right: {}",
          held, v.what));
      NONSTOP_LOG_ERROR("{}", bad.message());
      control::FailureMsg m{comm_->generation(), held, bad.message(), kExitDataCorruption};
      (void)SendControl(control::kMsgFailure, control::Encode(m));
      comm_->Abort(bad.message());
      return bad;
    }
    const bool mine =
        std::find(v.diverged.begin(), v.diverged.end(), comm_->rank()) != v.diverged.end();
    std::string why = fmt::format("state_diverged at step {}: {}", held, v.what);
    if (mine) {
      // Nothing of it is trusted any more: the next plan copies every byte (and its shard) in.
      state_step_.store(control::kNoValidState);
      if (state_->shard_group() > 0) state_->set_held_shard(state::kNoShard);
      held_shard_.store(state_->held_shard());
      NONSTOP_LOG_ERROR("this member's state differs from the majority's; it copies theirs: {}",
                        why);
      diverged_why_ = why;
    } else {
      NONSTOP_LOG_WARNING("{}", why);
      why = fmt::format("the replica check at step {} found another member diverged: {}", held,
                        v.what);
    }
    comm_->Abort(why);
    return AbortedError(why);
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
    if (at_step_boundary) ApplyHeldState(/*restore=*/false);
    // a stall stops here, before it arrives
    if (at_step_boundary) faults_.BeforeCollective(state_step_.load() + 1, comm_->rank());
    {
      MutexLock lock(&mu_);
      if (drain_ && comm_->generation() == drain_->generation &&
          state_step_.load() >= drain_->after_step) {
        // A planned change: this generation ends at this step boundary.
        Status s =
            AbortedError(fmt::format("generation {} ends at the step boundary after step {}: {}",
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
    Status s = at_step_boundary && announce ? CheckReplicas() : OkStatus();
    if (s.ok() && at_step_boundary) {
      // After the replica check: the flip lands in this collective's pieces.
      if (auto f = faults_.Take(control::FaultPoint::kStep, state_step_.load() + 1, comm_->rank(),
                                control::FaultKind::kWireflip))
        faults_.Fire(*f);
    }
    if (s.ok()) s = op();
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

  // Session::Send and Recv: a direction of its own between two ranks, so that a send and a
  // receive between them may run at once on two threads: lane 1 carries what a lower rank sends
  // a higher one on channel 0, lane 2 the other way; channel 1 takes lanes 3 and 4 (lane 0 is
  // the collectives', net/handshake.h).
  Status PointToPoint(bool sending, int peer, collective::Region data, int channel) {
    collective::Communicator* comm = comm_.get();
    const int me = comm->rank();
    if (peer < 0 || peer >= comm->world_size() || peer == me || channel < 0 || channel > 1) {
      return InvalidArgumentError(
          fmt::format("{}: rank {} (channel {}) is not another rank of the world of {}",
                      sending ? "Send" : "Recv", peer, channel, comm->world_size()));
    }
    const int lane = 2 * channel + ((sending ? me < peer : peer < me) ? 1 : 2);
    return sending ? comm->SendOnLane(peer, lane, data, /*checked=*/true)
                   : comm->RecvOnLane(peer, lane, data, /*checked=*/true);
  }

  // The communicator of `group` (Session::NewGroup; 0: the world's).
  Result<collective::Communicator*> GroupComm(int group) {
    if (group == 0) return comm_.get();
    return user_groups_.Get(group, *comm_, member_ids_);
  }

  // Session::AllReduce and ReduceScatter of any type and operation (`what` names the call).
  Status Reduce(std::string_view what, std::span<std::byte> data, DType dtype, ReduceOp op,
                bool scatter, int group) {
    if (!Reduces(dtype, op) || data.size() % ElementBytes(dtype) != 0) {
      return InvalidArgumentError(fmt::format(
          "{}: {} bytes of {} reduced by {}: {}", what, data.size(), DTypeName(dtype),
          ReduceOpName(op),
          Reduces(dtype, op) ? "not a whole number of elements"
                             : "the operation does not apply to the type (HINT: the bitwise "
                               "operations take integers and bool)"));
    }
    NONSTOP_RETURN_IF_ERROR(WaitAll());
    NONSTOP_ASSIGN_OR_RETURN(collective::Communicator * comm, GroupComm(group));
    const collective::Region region = collective::HostRegion(data);
    return RunCollective(
        [&] {
          return scatter ? comm->ReduceScatter(region, dtype, op)
                         : comm->AllReduce(region, dtype, op);
        },
        /*at_step_boundary=*/false);
  }

  Status AllReduceOnDevice(std::span<float> device_data) {
    return ReduceOnDevice("AllReduceOnDevice", device_data, /*announce=*/true);
  }

  // The ring's sum of `device_data` in the device's memory (`what` names the call for errors);
  // `announce` as RunCollective's.
  Status ReduceOnDevice(std::string_view what, std::span<float> device_data, bool announce) {
    NONSTOP_ASSIGN_OR_RETURN(collective::Region region,
                             DeviceRegion(what, std::as_writable_bytes(device_data)));
    return RunCollective(
        [&] { return comm_->AllReduce(region, collective::DType::kFloat32, ReduceOp::kSum); },
        /*at_step_boundary=*/true, announce);
  }

  Status AllReduceTreeOnDevice(int m, std::span<const std::pair<int, int>> ranges,
                               std::span<const std::span<const float>> device_partials,
                               std::span<float> device_out) {
    NONSTOP_ASSIGN_OR_RETURN(
        const collective::Region out,
        DeviceRegion("AllReduceTreeOnDevice", std::as_writable_bytes(device_out)));
    NONSTOP_RETURN_IF_ERROR(WaitAll());
    if (ranges.size() != static_cast<size_t>(comm().world_size())) {
      return InvalidArgumentError(fmt::format("AllReduceTreeOnDevice: {} ranges for a world of {}",
                                              ranges.size(), comm().world_size()));
    }
    const std::vector<std::vector<collective::TreeNode>> nodes_of =
        collective::NodesOfRanges(m, ranges);
    const size_t mine = nodes_of[static_cast<size_t>(comm().rank())].size();
    if (device_partials.size() != mine) {
      return InvalidArgumentError(fmt::format(
          "AllReduceTreeOnDevice: {} partial sums for the {} tree node(s) of this rank's range",
          device_partials.size(), mine));
    }
    for (std::span<const float> p : device_partials) {
      if (p.size() != device_out.size()) {
        return InvalidArgumentError(
            fmt::format("AllReduceTreeOnDevice: a partial of {} floats for an output of {}",
                        p.size(), device_out.size()));
      }
    }
    std::vector<collective::ConstRegion> partials;
    for (std::span<const float> p : device_partials) {
      partials.push_back({reinterpret_cast<const std::byte*>(p.data()), p.size_bytes(), out.device,
                          out.device_index});
    }
    return RunCollective(
        [&] {
          return comm().AllReduceTree(
              m, std::span<const std::vector<collective::TreeNode>>(nodes_of), partials, out);
        },
        /*at_step_boundary=*/true);
  }

  // ---- overlapped reduction (Session::StartAllReduce / WaitAll) ----

  void StartAllReduce(std::span<float> data, std::function<void(const Status&)> done,
                      bool on_device) {
    ApplyHeldState(/*restore=*/false);
    buckets_.Start(data, std::move(done), on_device);
  }

  // One bucket, on the communication thread. Every bucket passes the drain check and marks the
  // member as waiting (a peer that hangs mid-backward is found like one that hangs before the
  // step); only the step's first announces the arrival.
  Status ReduceBucket(std::span<float> bucket, bool on_device, bool first) {
    if (on_device) return ReduceOnDevice("StartAllReduceOnDevice", bucket, /*announce=*/first);
    return RunCollective([&] { return comm_->AllReduce(bucket); }, /*at_step_boundary=*/true,
                         /*announce=*/first);
  }

  Status WaitAll() { return buckets_.WaitAll(); }

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
        return DeadlineExceededError(
            "the controller did not end the job within 10 minutes of this worker finishing");
      }
    }
    if (shutdown_) {
      if (shutdown_->exit_code != 0)
        return UnavailableError("the job ended with an error: " + shutdown_->reason);
      return OkStatus();
    }
    if (controller_lost_) return UnavailableError("lost the controller");
    return AbortedError(
        fmt::format("generation {} ended before the job did: a member failed", gen));
  }

  collective::Communicator& comm() {
    NONSTOP_CHECK(comm_ != nullptr) << "no plan adopted";
    return *comm_;
  }

  SessionOptions options_;
  WorkerKeys keys_;  // from options_.secret, as Start() begins (role_keys.h)
  // The devices Join checked (DevicesToCheck), checked again while a spare waits and as it is
  // promoted; set before Start, then read by the training thread only.
  std::vector<const state::DeviceMemory*> devices_;
  state::StateRegistry* const state_;  // owned by the training program; outlives the session
  // The connection to the controller (src/control/controller_link.h). Set in
  // Start, before the I/O thread exists; driven by Start, then by the I/O
  // thread alone. Every thread sends on it (Send is thread-safe), under
  // write_mu_ (SendControl), so that a rejoin's first frames come first.
  std::unique_ptr<control::ControllerLink> link_;
  worker::StoreClient store_;  // the job's store (Session::store), over link_
  // Before data_plane_: the process's abort signal, which the data plane's
  // communicators watch (TCP: its accept thread polls the signal of a thread
  // waiting for a peer to dial in), so it must outlive the data plane.
  net::AbortSignal abort_;        // fired to abort the collective in flight
  net::AbortSignal stop_signal_;  // wakes the I/O thread at shutdown
  // Made in Start, before the I/O thread exists; lives across generations
  // and makes each one's communicator (collective/data_plane.h).
  std::unique_ptr<collective::DataPlane> data_plane_;
  std::atomic<int64_t> state_step_{-1};  // the step the registered state holds
  // sharded state: the shard it holds (StateRegistry::held_shard)
  std::atomic<int> held_shard_{state::kEveryShard};
  std::atomic<int64_t> collective_since_ms_{-1};  // when the step collective in flight began
  // A section the script marked busy (Session::BeginBusy): set by the training thread, sent by
  // every heartbeat.
  Mutex busy_mu_;
  std::string busy_label_ NONSTOP_GUARDED_BY(busy_mu_);  // "" : none
  int64_t busy_since_ms_ NONSTOP_GUARDED_BY(busy_mu_) = 0;
  int64_t busy_bound_ms_ NONSTOP_GUARDED_BY(busy_mu_) = 0;
  // Lock order: write_mu_, then mu_ (SendRejoin), then a Communicator's; the link's own lock is
  // taken last.
  Mutex write_mu_;  // orders the frames sent against a rejoin's first ones

  Mutex mu_;
  CondVar cv_;
  bool in_collective_ NONSTOP_GUARDED_BY(mu_) = false;  // any collective is in flight
  // The newest plan received. Written by the I/O thread alone, and replaced, never changed: the
  // training thread adopts it and the I/O thread decodes a delta against it outside mu_.
  std::shared_ptr<const control::PlanMsg> plan_ NONSTOP_GUARDED_BY(mu_);
  std::optional<control::ShutdownMsg> shutdown_ NONSTOP_GUARDED_BY(mu_);
  std::optional<control::DrainMsg> drain_ NONSTOP_GUARDED_BY(mu_);
  MembershipChange last_change_;  // training thread only
  uint32_t aborted_generation_ NONSTOP_GUARDED_BY(mu_) = 0;
  bool controller_lost_ NONSTOP_GUARDED_BY(mu_) = false;  // gave up finding a controller
  uint32_t waiting_after_ NONSTOP_GUARDED_BY(mu_) = 0;    // left this generation, waits for a plan
  // sent when the training loop ended
  std::optional<control::FinishedMsg> finished_ NONSTOP_GUARDED_BY(mu_);
  Clock::time_point lost_at_{};  // when the controller was lost last; io thread
  std::string lost_why_;         // why; io thread
  std::string data_address_;     // what peers dial, fixed at the first join
  // Replaced under mu_ (Adopt), and the I/O thread uses it (Abort) only
  // under mu_. Not GUARDED_BY: the training thread, its only writer, drives
  // it without the lock, and so does the reducer's thread between StartAllReduce and
  // WaitAll (the training thread waits for it before the next replacement).
  std::unique_ptr<collective::Communicator> comm_;
  // Sharded state: sub-groups of comm_ (its connections and abort signal), training thread only.
  std::unique_ptr<collective::Communicator> group_comm_, replica_comm_;
  // Training thread only (Adopt writes it, Session::resume_step reads it).
  int64_t resume_step_ = 0;
  int comm_before_world_ = 0;
  int comm_before_rank_ = -1;
  // The worker id of each rank of comm_'s generation; written with comm_ (Adopt).
  std::vector<int> member_ids_;
  worker::UserGroups user_groups_;  // torch.distributed's subgroups; training thread only
  // Their data planes' hosts (TorchrunEnvironment); training thread only, like member_ids_.
  std::vector<std::string> member_hosts_;
  // Training thread only (Rejoin): some Adopt since the last successful one copied the state in.
  bool copied_since_recover_ = false;
  // SessionOptions::defer_state: false from the join until CompleteJoin, with the plan adopted
  // meanwhile parked before its state transfers.
  bool join_complete_ = true;
  struct Parked {
    std::shared_ptr<const control::PlanMsg> plan;
    Clock::time_point t0, t1;
  };
  std::optional<Parked> parked_;
  // The state copied as this worker joined a running job, until its first step (HoldCopiedState).
  Mutex held_mu_;
  std::optional<worker::HeldState> held_state_ NONSTOP_GUARDED_BY(held_mu_);
  std::atomic<bool> holding_{false};
  // Why the replica check dropped this member's state ("state_diverged at step …"), for the
  // Ready of its recovery; written by whichever thread ran the check, read by Recover after
  // WaitAll. Empty: it did not.
  std::string diverged_why_;
  // The last check's time and its CRC pass's, until a step reports them.
  std::atomic<double> replica_check_ms_{-1}, replica_crc_ms_{-1};
  // Overlapped reduction: buckets started by the training thread, reduced in order on the
  // reducer's thread. The training thread touches comm_ only after WaitAll (Recover, Finish and
  // the other collectives wait first).
  worker::BucketReducer buckets_{[this](std::span<float> data, bool on_device, bool first) {
    return ReduceBucket(data, on_device, first);
  }};
  // Held by the thread that called Session::Join (common/lifeline.h); null without one. Set
  // before the I/O thread starts, released (unlocked) by the thread that destroys the Session
  // or calls Finish, marked released by the I/O thread on a Shutdown.
  std::unique_ptr<LifelineHold> lifeline_;
  std::jthread io_thread_;  // stops before the members it uses go away
  // `--inject`'s faults; last: its timer threads stop first, before what they use goes away.
  worker::FaultInjector faults_;
};

Result<std::unique_ptr<Session>> Session::Join(SessionOptions options, state::StateRegistry* state,
                                               int64_t state_step) {
  NONSTOP_CHECK(state != nullptr);
  // Every device of the state and the sums, checked before it is trusted with state (a spare's, a
  // member's): issue 30, docs/gpu.md. A spare checks them again while it waits and as it is
  // promoted (Rejoin).
  std::vector<const state::DeviceMemory*> devices = DevicesToCheck(options, *state);
  NONSTOP_RETURN_IF_ERROR(
      CheckDevices(devices, options.worker_id, ", so this worker does not join"));
  auto impl = std::make_unique<SessionImpl>(std::move(options), state);
  impl->devices_ = std::move(devices);
  impl->state_step_.store(state_step);
  impl->held_shard_.store(state->held_shard());
  // The lifeline (NONSTOP_LIFELINE_FD, from the launcher): locked on THIS thread, which must live
  // as long as the process (the training thread): if this thread ended first, the kernel would
  // release it then and the launcher would report this worker dying. Taken before the join, so
  // that a death while joining or receiving the state is seen at once too.
  if (auto lifeline = LifelineHold::TakeInherited(); lifeline.ok()) {
    impl->lifeline_ = std::move(*lifeline);
  } else {
    NONSTOP_LOG_WARNING("no lifeline: {}; this worker's death is seen when its process has ended",
                        lifeline.status().ToString());
  }
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
Status Session::AllReduceOnDevice(std::span<float> device_data) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  return impl_->AllReduceOnDevice(device_data);
}
void Session::StartAllReduce(std::span<float> data, std::function<void(const Status&)> done) {
  impl_->StartAllReduce(data, std::move(done), /*on_device=*/false);
}
void Session::StartAllReduceOnDevice(std::span<float> device_data,
                                     std::function<void(const Status&)> done) {
  impl_->StartAllReduce(device_data, std::move(done), /*on_device=*/true);
}
Status Session::WaitAll() { return impl_->WaitAll(); }
void Session::BeginTraining() { impl_->ApplyHeldState(/*restore=*/true); }
Status Session::CompleteJoin() { return impl_->CompleteJoin(); }
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
      [&] {
        return impl_->comm().AllReduceTree(
            m, std::span<const std::vector<collective::TreeNode>>(nodes), partials, out);
      },
      /*at_step_boundary=*/true);
}
Status Session::AllReduceTreeOnDevice(int m, std::span<const std::pair<int, int>> ranges,
                                      std::span<const std::span<const float>> device_partials,
                                      std::span<float> device_out) {
  return impl_->AllReduceTreeOnDevice(m, ranges, device_partials, device_out);
}
Status Session::AllReduce(std::span<std::byte> data, DType dtype, ReduceOp op, int group) {
  return impl_->Reduce("AllReduce", data, dtype, op, /*scatter=*/false, group);
}
Status Session::ReduceScatter(std::span<std::byte> data, DType dtype, ReduceOp op, int group) {
  return impl_->Reduce("ReduceScatter", data, dtype, op, /*scatter=*/true, group);
}
Status Session::AllGather(std::span<std::byte> data, size_t record_bytes, int group) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  NONSTOP_ASSIGN_OR_RETURN(collective::Communicator * comm, impl_->GroupComm(group));
  if (record_bytes == 0 || data.size() != record_bytes * static_cast<size_t>(comm->world_size())) {
    return InvalidArgumentError(fmt::format("AllGather: {} bytes are not {} records of {}",
                                            data.size(), comm->world_size(), record_bytes));
  }
  return impl_->RunCollective([&] { return comm->AllGather(data, record_bytes); },
                              /*at_step_boundary=*/false);
}
Status Session::Broadcast(std::span<std::byte> data, int root, int group) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  NONSTOP_ASSIGN_OR_RETURN(collective::Communicator * comm, impl_->GroupComm(group));
  if (root < 0 || root >= comm->world_size()) {
    return InvalidArgumentError(
        fmt::format("Broadcast: root {} of a group of {}", root, comm->world_size()));
  }
  return impl_->RunCollective([&] { return comm->Broadcast(data, root); },
                              /*at_step_boundary=*/false);
}
Status Session::Barrier(int group) {
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  NONSTOP_ASSIGN_OR_RETURN(collective::Communicator * comm, impl_->GroupComm(group));
  return impl_->RunCollective([&] { return comm->Barrier(); }, /*at_step_boundary=*/false);
}
Status Session::Send(int to, std::span<const std::byte> data, int channel) {
  return impl_->PointToPoint(
      /*sending=*/true, to, collective::Region{const_cast<std::byte*>(data.data()), data.size()},
      channel);
}
Status Session::Recv(int from, std::span<std::byte> data, int channel) {
  return impl_->PointToPoint(/*sending=*/false, from, collective::HostRegion(data), channel);
}
Result<int> Session::RecvFromAny(std::span<const int> from, std::span<std::byte> data) {
  collective::Communicator& comm = impl_->comm();
  std::vector<std::pair<int, int>> lanes;
  for (int r : from) {
    if (r < 0 || r >= comm.world_size() || r == comm.rank()) {
      return InvalidArgumentError(
          fmt::format("Recv from any of ranks: {} is not another rank of "
                      "the world of {}",
                      r, comm.world_size()));
    }
    lanes.emplace_back(r, r < comm.rank() ? 1 : 2);  // PointToPoint's lanes
  }
  return comm.RecvOnAnyLane(lanes, collective::HostRegion(data), /*checked=*/true);
}
Result<int> Session::NewGroup(std::vector<int> ranks, std::chrono::milliseconds timeout) {
  return impl_->user_groups_.Add(std::move(ranks), impl_->member_ids_, rank(), timeout);
}

Store& Session::store() { return impl_->store_; }

int Session::shard_group() const { return impl_->state_->shard_group(); }
int Session::shard() const {
  const int g = shard_group();
  return g > 0 ? rank() % g : 0;
}
Status Session::ReduceShards(std::span<float> data) {
  return impl_->ReduceShards("ReduceShards", collective::HostRegion(data));
}
Status Session::GatherShards(std::span<std::byte> data, size_t element_bytes) {
  return impl_->GatherShards("GatherShards", collective::HostRegion(data), element_bytes);
}
Status Session::ReduceShardsOnDevice(std::span<float> device_data) {
  NONSTOP_ASSIGN_OR_RETURN(
      collective::Region region,
      impl_->DeviceRegion("ReduceShardsOnDevice", std::as_writable_bytes(device_data)));
  return impl_->ReduceShards("ReduceShardsOnDevice", region);
}
Status Session::GatherShardsOnDevice(std::span<std::byte> device_data, size_t element_bytes) {
  NONSTOP_ASSIGN_OR_RETURN(collective::Region region,
                           impl_->DeviceRegion("GatherShardsOnDevice", device_data));
  return impl_->GatherShards("GatherShardsOnDevice", region, element_bytes);
}

void Session::ReportStep(const StepReport& r) {
  impl_->state_step_.store(r.step);
  control::ProgressMsg m{r.step,       r.loss,       r.step_seconds, r.tokens_per_second,
                         world_size(), r.total_steps};
  m.replica_check_ms = impl_->replica_check_ms_.exchange(-1);
  m.replica_crc_ms = impl_->replica_crc_ms_.exchange(-1);
  Status s = impl_->SendControl(control::kMsgProgress, control::Encode(m));
  // Without a controller the step is not lost: the join to the next one says it.
  if (!s.ok()) NONSTOP_LOG_DEBUG("progress report not sent: {}", s.ToString());
  // After the report: a fault due as the next step starts (at=0) fires here, on this thread, and
  // the controller has heard of step r.step first, as with a fault timed from a thread of its own.
  impl_->faults_.ScheduleTimed(r.step + 1, rank(), r.step_seconds);
}

Result<int64_t> Session::Recover() {
  (void)impl_->WaitAll();  // the communication thread is idle before the communicator is replaced
  Status why = impl_->comm().error();
  std::string reason = why.ok() ? "recovering" : why.message();
  // Said as such, whatever aborted the communicator first (a peer's Ready can reach the
  // controller, and its abort this member, before this member's own abort).
  if (!impl_->diverged_why_.empty()) reason = std::exchange(impl_->diverged_why_, std::string());
  return impl_->Rejoin(impl_->comm().generation(), reason);
}

Status Session::Finish(int64_t last_step, const std::string& checksum) {
  if (impl_->lifeline_) impl_->lifeline_->Release();  // it ends now: its exit is no death
  NONSTOP_RETURN_IF_ERROR(impl_->WaitAll());
  impl_->state_step_.store(last_step);
  return impl_->Finish(last_step, checksum);
}

void Session::ReportFailure(const Status& status, int64_t step, int exit_code,
                            std::string_view traceback) {
  // A traceback too long keeps its end (the exception and the frame that raised it), cut on a
  // UTF-8 character's first byte.
  std::string kept(traceback);
  if (kept.size() > control::kMaxTraceback) {
    size_t from = kept.size() - (control::kMaxTraceback - 4);
    while (from < kept.size() && (static_cast<unsigned char>(kept[from]) & 0xC0) == 0x80) ++from;
    kept = "...\n" + kept.substr(from);
  }
  // A script's exception (it comes with its traceback) is said as the script raised it.
  control::FailureMsg m{generation(), step,
                        traceback.empty() ? status.ToString() : std::string(status.message()),
                        exit_code, std::move(kept)};
  (void)impl_->SendControl(control::kMsgFailure, control::Encode(m));
}

Status Session::BeginBusy(std::string_view label, std::chrono::milliseconds bound) {
  const bool printable = std::all_of(label.begin(), label.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7F;
  });
  if (label.empty() || label.size() > control::kMaxBusyLabel || !printable) {
    return InvalidArgumentError(
        fmt::format("Session::BeginBusy: the label must be 1 to {} printable ASCII characters, "
                    "got {} bytes{}",
                    control::kMaxBusyLabel, label.size(), printable ? "" : " with others"));
  }
  if (bound <= std::chrono::milliseconds(0)) {
    return InvalidArgumentError(
        fmt::format("Session::BeginBusy: the bound must be positive, got {} ms", bound.count()));
  }
  {
    MutexLock lock(&impl_->busy_mu_);
    impl_->busy_label_ = std::string(label);
    impl_->busy_since_ms_ = NowMs();
    impl_->busy_bound_ms_ = bound.count();
  }
  impl_->SendHeartbeat();  // the controller knows at once
  return OkStatus();
}

void Session::EndBusy() {
  {
    MutexLock lock(&impl_->busy_mu_);
    if (impl_->busy_label_.empty()) return;
    impl_->busy_label_.clear();
  }
  impl_->SendHeartbeat();
}

bool Session::InjectedExceptionAt(int64_t step) {
  auto f =
      impl_->faults_.Take(control::FaultPoint::kStep, step, rank(), control::FaultKind::kException);
  if (!f) return false;
  impl_->faults_.Announce(*f);
  return true;
}

MembershipChange Session::last_change() const { return impl_->last_change_; }

std::vector<std::pair<std::string, std::string>> Session::TorchrunEnvironment() const {
  const std::vector<std::string>& hosts = impl_->member_hosts_;
  const int rank = impl_->last_change_.new_rank;
  NONSTOP_CHECK(rank >= 0 && static_cast<size_t>(rank) < hosts.size()) << "no plan adopted";
  std::vector<std::string> groups;  // distinct hosts, in the order of their first rank
  int local_rank = 0, local_world = 0;
  for (size_t r = 0; r < hosts.size(); ++r) {
    if (std::find(groups.begin(), groups.end(), hosts[r]) == groups.end())
      groups.push_back(hosts[r]);
    if (hosts[r] != hosts[rank]) continue;
    ++local_world;
    if (static_cast<int>(r) < rank) ++local_rank;
  }
  const auto group_rank = std::find(groups.begin(), groups.end(), hosts[rank]) - groups.begin();
  const std::string world = std::to_string(hosts.size());
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", world},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
          {"GROUP_RANK", std::to_string(group_rank)},
          {"GROUP_WORLD_SIZE", std::to_string(groups.size())},
          {"ROLE_RANK", std::to_string(rank)},
          {"ROLE_WORLD_SIZE", world},
          {"MASTER_ADDR", hosts[0]},
          {"MASTER_PORT", std::to_string(impl_->options_.master_port)}};
}

bool Session::aborted() const { return impl_->abort_.fired(); }

int Session::shutdown_exit_code() const {
  MutexLock lock(&impl_->mu_);
  return impl_->shutdown_ ? impl_->shutdown_->exit_code : 0;
}

}  // namespace nonstop
