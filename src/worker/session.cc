#include "nonstop/session.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "collective/communicator.h"
#include "collective/peer_mesh.h"
#include "common/logging.h"
#include "control/messages.h"
#include "net/abort_signal.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"

namespace nonstop {

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
  if (!get("NONSTOP_DATA_HOST").empty()) o.data_host = get("NONSTOP_DATA_HOST");
  return o;
}

class SessionImpl {
 public:
  explicit SessionImpl(SessionOptions o) : options_(std::move(o)) {}
  ~SessionImpl() { Stop(); }

  Status Start() {
    NONSTOP_ASSIGN_OR_RETURN(net::HostPort where, net::ParseHostPort(options_.controller_address));
    Deadline deadline = DeadlineAfter(Millis(30'000));
    NONSTOP_ASSIGN_OR_RETURN(control_fd_, net::Dial(where, deadline));
    net::Hello hello;
    hello.kind = net::ConnectionKind::kControl;
    hello.worker_id = options_.worker_id;
    hello.job_token = options_.job_token;
    Status hs = net::ClientHandshake(control_fd_.get(), hello, deadline, nullptr);
    if (!hs.ok()) return hs.WithContext("joining the controller at " + options_.controller_address);
    collective::PeerMeshOptions mo;
    mo.job_token = options_.job_token;
    mo.worker_id = options_.worker_id;
    mo.listen = {options_.data_host, 0};
    NONSTOP_ASSIGN_OR_RETURN(mesh_, collective::PeerMesh::Create(mo));
    control::JoinMsg join{options_.worker_id, static_cast<int64_t>(::getpid()), mesh_->address().ToString(),
                          options_.spare};
    NONSTOP_RETURN_IF_ERROR(SendControl(control::kMsgJoin, control::Encode(join)));
    io_thread_ = std::jthread([this](std::stop_token st) { IoLoop(st); });
    return WaitForPlan();
  }

  Status WaitForPlan() {
    std::unique_lock<std::mutex> lock(mu_);
    Deadline deadline = DeadlineAfter(options_.join_timeout);
    while (!plan_ && !shutdown_ && !controller_lost_) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return DeadlineExceededError(fmt::format("worker {} waited {} s for a plan from the controller",
                                                 options_.worker_id, options_.join_timeout.count() / 1000));
      }
    }
    if (shutdown_) return CancelledError("the job ended before this worker was given a rank: " + shutdown_->reason);
    if (controller_lost_) return UnavailableError("lost the controller while waiting for a plan");
    control::PlanMsg plan = *plan_;
    lock.unlock();
    return Adopt(plan);
  }

  Status Adopt(const control::PlanMsg& plan) {
    collective::CommunicatorOptions co;
    co.generation = plan.generation;
    co.rank = -1;
    for (size_t r = 0; r < plan.members.size(); ++r) {
      co.members.push_back({plan.members[r].worker_id, plan.members[r].address});
      if (plan.members[r].worker_id == options_.worker_id) co.rank = static_cast<int>(r);
    }
    if (co.rank < 0) return InternalError(fmt::format("plan of generation {} does not include worker {}", plan.generation, options_.worker_id));
    co.timeout_collective = options_.timeout_collective;
    auto comm = std::make_unique<collective::Communicator>(mesh_.get(), &abort_, co);
    {
      std::lock_guard<std::mutex> lock(mu_);
      comm_ = std::move(comm);
      resume_step_ = plan.resume_step;
      if (shutdown_) comm_->Abort("the controller ended the job");
    }
    SetLogRole(fmt::format("rank {}", co.rank));
    return comm_->Connect();
  }

  Status SendControl(uint16_t type, const std::string& payload) {
    std::lock_guard<std::mutex> lock(write_mu_);
    return net::WriteFrame(control_fd_.get(), type, payload, DeadlineAfter(Millis(5'000)), &stop_signal_);
  }

  void IoLoop(std::stop_token st) {
    net::FrameDecoder decoder;
    Deadline next_heartbeat = Clock::now();
    while (!st.stop_requested()) {
      if (Clock::now() >= next_heartbeat) {
        (void)SendControl(control::kMsgHeartbeat, control::Encode(control::HeartbeatMsg{last_step_.load()}));
        next_heartbeat = DeadlineAfter(options_.heartbeat_interval);
      }
      pollfd fds[2] = {{control_fd_.get(), POLLIN, 0}, {stop_signal_.fd(), POLLIN, 0}};
      int rc = ::poll(fds, 2, PollTimeoutMs(next_heartbeat));
      if (rc <= 0 || !(fds[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[16 << 10];
      ssize_t n = ::recv(control_fd_.get(), buf, sizeof(buf), 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      Status s = n > 0 ? decoder.Feed(std::string_view(buf, static_cast<size_t>(n)))
                       : UnavailableError("controller closed the connection");
      while (s.ok()) {
        auto f = decoder.Next();
        if (!f) break;
        s = OnControlFrame(*f);
      }
      if (!s.ok()) {
        NONSTOP_LOG_ERROR("lost the controller: {}", s.ToString());
        std::lock_guard<std::mutex> lock(mu_);
        controller_lost_ = true;
        if (comm_) comm_->Abort("lost the controller: " + s.message());
        cv_.notify_all();
        return;
      }
    }
  }

  Status OnControlFrame(const net::Frame& f) {
    switch (f.type) {
      case control::kMsgPlan: {
        NONSTOP_ASSIGN_OR_RETURN(control::PlanMsg plan, control::DecodePlan(f.payload));
        std::lock_guard<std::mutex> lock(mu_);
        plan_ = plan;
        cv_.notify_all();
        return OkStatus();
      }
      case control::kMsgShutdown: {
        NONSTOP_ASSIGN_OR_RETURN(control::ShutdownMsg m, control::DecodeShutdown(f.payload));
        std::lock_guard<std::mutex> lock(mu_);
        shutdown_ = m;
        if (comm_ && m.exit_code != 0) comm_->Abort("the controller ended the job: " + m.reason);
        cv_.notify_all();
        return OkStatus();
      }
      default:
        return InvalidArgumentError(fmt::format("unexpected control message type {}", f.type));
    }
  }

  void Stop() {
    io_thread_.request_stop();
    stop_signal_.Fire();
    if (io_thread_.joinable()) io_thread_.join();
  }

  Status Finish(int64_t last_step, const std::string& checksum) {
    NONSTOP_RETURN_IF_ERROR(SendControl(control::kMsgFinished, control::Encode(control::FinishedMsg{last_step, checksum})));
    std::unique_lock<std::mutex> lock(mu_);
    Deadline deadline = DeadlineAfter(Millis(60'000));
    while (!shutdown_ && !controller_lost_) {
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return DeadlineExceededError("the controller did not end the job within 60 s of this worker finishing");
      }
    }
    if (shutdown_ && shutdown_->exit_code != 0) {
      return AbortedError("the job ended with an error: " + shutdown_->reason);
    }
    return OkStatus();
  }

  collective::Communicator& comm() {
    NONSTOP_CHECK(comm_ != nullptr) << "no plan adopted";
    return *comm_;
  }

  SessionOptions options_;
  UniqueFd control_fd_;
  std::unique_ptr<collective::PeerMesh> mesh_;
  net::AbortSignal abort_;        // fired to abort the collective in flight
  net::AbortSignal stop_signal_;  // wakes the I/O thread at shutdown
  state::StateRegistry state_;
  std::atomic<int64_t> last_step_{-1};
  std::mutex write_mu_;  // serialises frames on the control socket

  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<control::PlanMsg> plan_;          // guarded by mu_
  std::optional<control::ShutdownMsg> shutdown_;  // guarded by mu_
  bool controller_lost_ = false;                  // guarded by mu_
  std::unique_ptr<collective::Communicator> comm_;  // guarded by mu_ for Abort from the I/O thread
  int64_t resume_step_ = 0;
  std::jthread io_thread_;  // last: stops before the members it uses go away
};

Result<std::unique_ptr<Session>> Session::Join(SessionOptions options) {
  auto impl = std::make_unique<SessionImpl>(std::move(options));
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
state::StateRegistry& Session::state() { return impl_->state_; }

Status Session::AllReduce(std::span<float> data) { return impl_->comm().AllReduce(data); }
Status Session::Broadcast(std::span<std::byte> data, int root) { return impl_->comm().Broadcast(data, root); }
Status Session::Barrier() { return impl_->comm().Barrier(); }

void Session::ReportStep(const StepReport& r) {
  impl_->last_step_.store(r.step);
  control::ProgressMsg m{r.step, r.loss, r.step_seconds, r.tokens_per_second, world_size()};
  Status s = impl_->SendControl(control::kMsgProgress, control::Encode(m));
  if (!s.ok()) NONSTOP_LOG_WARNING("progress report failed: {}", s.ToString());
}

Status Session::Finish(int64_t last_step, const std::string& checksum) {
  impl_->last_step_.store(last_step);
  return impl_->Finish(last_step, checksum);
}

void Session::ReportFailure(const Status& status, int64_t step, int exit_code) {
  control::FailureMsg m{generation(), step, status.ToString(), exit_code};
  (void)impl_->SendControl(control::kMsgFailure, control::Encode(m));
}

int Session::shutdown_exit_code() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->shutdown_ ? impl_->shutdown_->exit_code : 0;
}

}  // namespace nonstop
