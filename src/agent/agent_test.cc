// Agent tests with real processes and real sockets on loopback: a fake
// controller (a listener on an OS port, ServerHandshake of kind kAgent,
// blocking frame reads with deadlines) drives an Agent that runs on a thread;
// the CLI tests run the `nonstop agent` binary as a child process.
#include "agent/agent.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/lifeline.h"
#include "common/role_keys.h"
#include "common/temp_dir.h"
#include "control/messages.h"
#include "launcher/output_writer.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "tests/integration/process.h"

// A worker that holds its lifeline: this test program started again with
// NONSTOP_LIFELINE_TEST_CHILD=hold, which takes it on its main thread (as
// Session::Join does on the training thread), says "held" and waits to be killed.
namespace {
const bool kLifelineChild = [] {
  const char* mode = std::getenv("NONSTOP_LIFELINE_TEST_CHILD");
  if (mode == nullptr) return false;
  auto hold = nonstop::LifelineHold::TakeInherited();
  if (!hold.ok() || *hold == nullptr) std::_Exit(40);
  std::printf("held\n");
  std::fflush(stdout);
  while (true) ::pause();
}();
}  // namespace

namespace nonstop::agent {
namespace {

using namespace std::chrono_literals;

constexpr char kToken[] = "test-token-123";

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Polls `pred` every 10 ms until it holds or `timeout` passes.
template <typename Pred>
bool WaitFor(Pred pred, Millis timeout) {
  Deadline until = DeadlineAfter(timeout);
  while (Clock::now() < until) {
    if (pred()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return pred();
}

bool ProcessGone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

// The controller's side of one agent connection, in blocking style. A
// background thread pings every 150 ms while pinging is on (the real
// controller pings every 500 ms).
class FakeController {
 public:
  explicit FakeController(std::string token = kToken) : token_(std::move(token)) {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok()) << l.status().ToString();
    listener_ = std::move(*l);
    pinger_ = std::jthread([this](std::stop_token stop) {
      while (!stop.stop_requested()) {
        std::this_thread::sleep_for(150ms);
        std::lock_guard<std::mutex> lock(mu_);
        if (pinging_ && conn_.valid() && channel_.send) {
          (void)net::WriteSealedFrame(conn_.get(), *channel_.send, control::kMsgPing, ping_,
                                      DeadlineAfter(1s), nullptr);
        }
      }
    });
  }

  std::string address() const { return listener_.address.ToString(); }

  // Accepts the next connection and checks its hello (kind kAgent, our token).
  Result<net::Hello> Accept(Millis timeout = 5s) {
    Deadline deadline = DeadlineAfter(timeout);
    NONSTOP_RETURN_IF_ERROR(net::WaitFd(listener_.fd.get(), POLLIN, deadline, nullptr, "accept"));
    NONSTOP_ASSIGN_OR_RETURN(UniqueFd fd, net::Accept(listener_.fd.get()));
    auto accepted = net::ServerHandshake(fd.get(), net::JobRoles(crypto::JobKey(token_)),
                                         net::ConnectionKind::kAgent, deadline, nullptr);
    std::lock_guard<std::mutex> lock(mu_);
    conn_ = std::move(fd);
    if (!accepted.ok()) return accepted.status();
    channel_ = std::move(accepted->channel);
    return accepted->hello;
  }

  // Accepts the agent and reads its registration.
  Result<control::AgentRegisterMsg> AcceptAndRegister(Millis timeout = 5s) {
    NONSTOP_RETURN_IF_ERROR(Accept(timeout).status());
    NONSTOP_ASSIGN_OR_RETURN(net::Frame f, Next(control::kMsgAgentRegister, timeout));
    return control::DecodeAgentRegister(f.payload);
  }

  // The next frame of `type`; heartbeats before it are counted and skipped.
  Result<net::Frame> Next(uint16_t type, Millis timeout = 5s) {
    Deadline deadline = DeadlineAfter(timeout);
    while (true) {
      NONSTOP_ASSIGN_OR_RETURN(net::Frame f,
                               net::ReadSealedFrame(fd(), *channel_.recv, deadline, nullptr));
      if (f.type == type) return f;
      if (f.type == control::kMsgAgentHeartbeat) {
        auto hb = control::DecodeAgentHeartbeat(f.payload);
        if (!hb.ok()) return hb.status();
        ++heartbeats;
        last_running = hb->running;
        continue;
      }
      return InternalError(
          fmt::format("expected a frame of type {}, got type {}: {}", type, f.type, f.payload));
    }
  }

  // True when the agent closes the connection within `timeout` (heartbeats skipped).
  bool ClosedByAgent(Millis timeout) {
    Deadline deadline = DeadlineAfter(timeout);
    while (true) {
      auto f = net::ReadSealedFrame(fd(), *channel_.recv, deadline, nullptr);
      if (f.ok()) continue;
      return f.status().code() == StatusCode::kUnavailable;
    }
  }

  void Send(uint16_t type, const std::string& payload) {
    std::lock_guard<std::mutex> lock(mu_);
    Status s = net::WriteSealedFrame(conn_.get(), *channel_.send, type, payload, DeadlineAfter(2s),
                                     nullptr);
    NONSTOP_CHECK(s.ok()) << s.ToString();
  }

  void SetPinging(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    pinging_ = on;
  }

  // What the pings say from now on: this controller's epoch.
  void SetEpoch(int64_t epoch) {
    std::lock_guard<std::mutex> lock(mu_);
    ping_ = control::Encode(control::PingMsg{epoch});
  }

  void CloseConnection() {
    std::lock_guard<std::mutex> lock(mu_);
    conn_.Reset();
  }

  int heartbeats = 0;
  int last_running = -1;

 private:
  int fd() const { return conn_.get(); }  // the test thread is the only writer of conn_

  const std::string token_;
  net::Listener listener_;
  std::mutex mu_;
  UniqueFd conn_;         // guarded by mu_ for the pinger
  net::Channel channel_;  // conn_'s session keys: send guarded by mu_; recv the test thread's
  bool pinging_ = true;
  std::string ping_ = "{}";  // guarded by mu_
  std::jthread pinger_;      // last: stopped and joined first
};

// An Agent on a thread of the test, with the children's output in files.
class AgentRunner {
 public:
  explicit AgentRunner(AgentOptions options, const TempDir& dir)
      : out_fd_(::open((dir / "out.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)),
        err_fd_(::open((dir / "err.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)),
        out_(out_fd_.get()),
        err_(err_fd_.get()) {
    options.out = &out_;
    options.err = &err_;
    agent_ = std::make_unique<Agent>(std::move(options));
    auto task = std::packaged_task<int()>([this] { return agent_->Run(); });
    code_ = task.get_future();
    thread_ = std::thread(std::move(task));
  }
  ~AgentRunner() {
    agent_->Stop();
    thread_.join();
  }

  // The exit code, or -1 if Run() has not returned within `timeout`.
  int Wait(Millis timeout) {
    if (code_.wait_for(timeout) != std::future_status::ready) return -1;
    return code_.get();
  }
  const Agent& agent() const { return *agent_; }
  void Stop() { agent_->Stop(); }

 private:
  UniqueFd out_fd_, err_fd_;
  launcher::OutputWriter out_, err_;
  std::unique_ptr<Agent> agent_;
  std::future<int> code_;
  std::thread thread_;
};

class AgentTest : public ::testing::Test {
 protected:
  // Options for an agent of host "hostA" on `controller`, whose program
  // writes its environment to dir/env-<worker id>, says hello on stdout and
  // sleeps.
  AgentOptions Options(const FakeController& controller) {
    AgentOptions o;
    o.controller = controller.address();
    o.job_token = kToken;
    o.host_id = "hostA";
    o.nproc = 2;
    o.spares = 1;
    o.program = {
        "/bin/sh", "-c",
        fmt::format("echo \"$NONSTOP_WORKER_ID $NONSTOP_HOST_ID $NONSTOP_DATA_HOST\" > "
                    "{0}/env-$NONSTOP_WORKER_ID.tmp; "
                    // the token from the descriptor it inherited; none in its environment
                    "echo \"$NONSTOP_CONTROLLER $(cat /proc/self/fd/$NONSTOP_JOB_TOKEN_FD) "
                    "${{NONSTOP_JOB_TOKEN:-unset}} $NONSTOP_SPARE $NONSTOP_FOO\" >> "
                    "{0}/env-$NONSTOP_WORKER_ID.tmp; "
                    "mv {0}/env-$NONSTOP_WORKER_ID.tmp {0}/env-$NONSTOP_WORKER_ID; "
                    "echo hello from $NONSTOP_WORKER_ID; exec sleep 30",
                    dir_.path())};
    o.join_timeout = 10'000ms;
    o.controller_timeout = 2'000ms;
    return o;
  }

  // Sends a start order for `worker_id` and returns the pid the agent reports.
  pid_t StartWorker(FakeController& controller, int worker_id,
                    std::vector<std::pair<std::string, std::string>> env = {}) {
    control::AgentStartMsg start;
    start.worker_id = worker_id;
    start.env = env;
    controller.Send(control::kMsgAgentStart, control::Encode(start));
    auto f = controller.Next(control::kMsgAgentStarted);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) return -1;
    auto started = control::DecodeAgentStarted(f->payload);
    EXPECT_TRUE(started.ok()) << started.status().ToString();
    if (!started.ok()) return -1;
    EXPECT_EQ(started->worker_id, worker_id);
    EXPECT_EQ(started->error, "");
    EXPECT_GT(started->pid, 0);
    return static_cast<pid_t>(started->pid);
  }

  std::string EnvFile(int worker_id) { return dir_ / fmt::format("env-{}", worker_id); }

  TempDir dir_;
};

TEST_F(AgentTest, SaysHelloAsAnAgentAndRegistersItsHost) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  auto hello = controller.Accept();
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->kind, net::ConnectionKind::kAgent);
  EXPECT_EQ(hello->worker_id, 0);
  EXPECT_EQ(hello->generation, 0u);
  auto f = controller.Next(control::kMsgAgentRegister);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto reg = control::DecodeAgentRegister(f->payload);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_EQ(reg->host_id, "hostA");
  EXPECT_EQ(reg->nproc, 2);
  EXPECT_EQ(reg->spares, 1);
  EXPECT_EQ(reg->address, "127.0.0.1");  // the interface that reaches the controller
  EXPECT_EQ(reg->pid, ::getpid());       // the agent runs in this process here
  EXPECT_EQ(reg->running, 0);
  // Heartbeats every 200 ms.
  auto t0 = Clock::now();
  while (controller.heartbeats < 3) {
    ASSERT_LT(Clock::now() - t0, 3s) << "no heartbeats";
    // Nothing else is expected: Next(anything unused) just counts heartbeats until it times out.
    (void)controller.Next(control::kMsgAgentExited, 300ms);
  }
  EXPECT_EQ(controller.last_running, 0);
  agent.Stop();
  EXPECT_EQ(agent.Wait(5s), kExitInterrupted);
}

TEST_F(AgentTest, AdvertiseAddressIsRegisteredAndGivenToWorkers) {
  FakeController controller;
  AgentOptions o = Options(controller);
  o.advertise_address = "10.9.8.7";
  AgentRunner agent(o, dir_);
  auto reg = controller.AcceptAndRegister();
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_EQ(reg->address, "10.9.8.7");
  StartWorker(controller, 5);
  ASSERT_TRUE(WaitFor([&] { return !ReadText(EnvFile(5)).empty(); }, 10s));
  EXPECT_EQ(ReadText(EnvFile(5)).substr(0, ReadText(EnvFile(5)).find('\n')), "5 hostA 10.9.8.7");
}

TEST_F(AgentTest, StartOrderRunsTheProgramWithTheOrdersAndTheAgentsVariables) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  // The order tries to set two of the agent's own variables: the agent's values win.
  pid_t pid = StartWorker(controller, 3,
                          {{"NONSTOP_WORKER_ID", "3"},
                           {"NONSTOP_FOO", "bar"},
                           {"NONSTOP_HOST_ID", "evil"},
                           {"NONSTOP_DATA_HOST", "6.6.6.6"}});
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(WaitFor([&] { return !ReadText(EnvFile(3)).empty(); }, 10s))
      << "the program did not start";
  // Its own credential (role_keys.h), never the job token; the shell's $(cat) drops its newline.
  std::string credential = EncodeWorkerCredential(WorkerKeysOf(crypto::JobKey(kToken), 3));
  credential.pop_back();
  EXPECT_EQ(ReadText(EnvFile(3)), fmt::format("3 hostA 127.0.0.1\n{} {} unset 0 bar\n",
                                              controller.address(), credential));
  // Its output is forwarded with the host and worker prefix.
  EXPECT_TRUE(WaitFor(
      [&] {
        return ReadText(dir_ / "out.txt").find("[hostA w3] hello from 3\n") != std::string::npos;
      },
      5s))
      << ReadText(dir_ / "out.txt");
  // The heartbeat counts it.
  ASSERT_TRUE(WaitFor(
      [&] {
        (void)controller.Next(control::kMsgAgentExited, 250ms);
        return controller.last_running == 1;
      },
      3s));
}

// The controller's ranks label the workers' lines; an older generation's do not.
TEST_F(AgentTest, WorkersLinesCarryTheRanksTheControllerSent) {
  for (bool elastic : {false, true}) {
    SCOPED_TRACE(elastic ? "elastic (nonstop run)" : "a host of a cluster");
    TempDir dir;
    FakeController controller;
    AgentOptions o = Options(controller);
    o.elastic = elastic;
    AgentRunner agent(o, dir);
    auto reg = controller.AcceptAndRegister();
    ASSERT_TRUE(reg.ok()) << reg.status().ToString();
    EXPECT_EQ(reg->elastic, elastic);
    controller.Send(control::kMsgAgentRanks, control::Encode(control::AgentRanksMsg{4, {{3, 2}}}));
    controller.Send(control::kMsgAgentRanks,
                    control::Encode(control::AgentRanksMsg{3, {{3, 0}, {5, 1}}}));
    StartWorker(controller, 3);
    StartWorker(controller, 5);
    const std::string ranked =
        elastic ? "[rank 2] hello from 3\n" : "[hostA rank 2] hello from 3\n";
    const std::string unranked =
        elastic ? "[worker 5] hello from 5\n" : "[hostA w5] hello from 5\n";
    EXPECT_TRUE(WaitFor(
        [&] {
          std::string out = ReadText(dir / "out.txt");
          return out.find(ranked) != std::string::npos && out.find(unranked) != std::string::npos;
        },
        5s))
        << ReadText(dir / "out.txt");
  }
}

TEST_F(AgentTest, SignalOrderKillsTheWorkerAndExitedSaysSignal9) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 4);
  ASSERT_GT(pid, 0);
  controller.Send(control::kMsgAgentSignal, control::Encode(control::AgentSignalMsg{4, SIGKILL}));
  auto f = controller.Next(control::kMsgAgentExited);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto exited = control::DecodeAgentExited(f->payload);
  ASSERT_TRUE(exited.ok());
  EXPECT_EQ(exited->worker_id, 4);
  EXPECT_EQ(exited->pid, pid);
  EXPECT_EQ(exited->signal, SIGKILL);
  EXPECT_TRUE(ProcessGone(pid));
}

// A killed worker that held its lifeline is reported dying (AgentDying) first, at once, and then
// its exit (AgentExited), in that order.
TEST_F(AgentTest, KilledWorkerHoldingItsLifelineIsReportedDyingThenExited) {
  FakeController controller;
  AgentOptions o = Options(controller);
  o.program = {"/proc/self/exe"};
  AgentRunner agent(o, dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 4, {{"NONSTOP_LIFELINE_TEST_CHILD", "hold"}});
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(WaitFor(
      [&] { return ReadText(dir_ / "out.txt").find("] held\n") != std::string::npos; }, 10s))
      << "the worker did not take its lifeline: " << ReadText(dir_ / "out.txt")
      << ReadText(dir_ / "err.txt");
  controller.Send(control::kMsgAgentSignal, control::Encode(control::AgentSignalMsg{4, SIGKILL}));
  auto d = controller.Next(control::kMsgAgentDying);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto dying = control::DecodeAgentDying(d->payload);
  ASSERT_TRUE(dying.ok()) << dying.status().ToString();
  EXPECT_EQ(dying->worker_id, 4);
  EXPECT_EQ(dying->pid, pid);
  auto f = controller.Next(control::kMsgAgentExited);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto exited = control::DecodeAgentExited(f->payload);
  ASSERT_TRUE(exited.ok());
  EXPECT_EQ(exited->worker_id, 4);
  EXPECT_EQ(exited->signal, SIGKILL);
}

TEST_F(AgentTest, WorkerThatExitsOnItsOwnIsReportedWithItsCode) {
  FakeController controller;
  AgentOptions o = Options(controller);
  o.program = {"/bin/sh", "-c", "exit 7"};
  AgentRunner agent(o, dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 0);
  auto f = controller.Next(control::kMsgAgentExited);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto exited = control::DecodeAgentExited(f->payload);
  ASSERT_TRUE(exited.ok());
  EXPECT_EQ(exited->pid, pid);
  EXPECT_EQ(exited->exit_code, 7);
  EXPECT_EQ(exited->signal, 0);
}

TEST_F(AgentTest, SignalForAWorkerThatDoesNotRunHereIsIgnored) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  controller.Send(control::kMsgAgentSignal, control::Encode(control::AgentSignalMsg{99, SIGKILL}));
  controller.Send(control::kMsgAgentRenice, control::Encode(control::AgentReniceMsg{99, 5}));
  // Still connected and carrying out orders.
  EXPECT_GT(StartWorker(controller, 1), 0);
}

TEST_F(AgentTest, SecondStartOfARunningWorkerIsRefusedWithAnError) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 2);
  ASSERT_GT(pid, 0);
  controller.Send(control::kMsgAgentStart,
                  control::Encode(control::AgentStartMsg{2, false, 0, {}}));
  auto f = controller.Next(control::kMsgAgentStarted);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto started = control::DecodeAgentStarted(f->payload);
  ASSERT_TRUE(started.ok());
  EXPECT_EQ(started->pid, 0);
  EXPECT_NE(started->error.find("worker 2 already runs on host hostA"), std::string::npos)
      << started->error;
  EXPECT_FALSE(ProcessGone(pid));
}

TEST_F(AgentTest, StoppedWorkerIsReported) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 6);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);  // frozen from outside
  auto f = controller.Next(control::kMsgAgentStopped);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto stopped = control::DecodeAgentStopped(f->payload);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->worker_id, 6);
  EXPECT_EQ(stopped->pid, pid);
  EXPECT_EQ(stopped->signal, SIGSTOP);
}

TEST_F(AgentTest, StartOrderWithLdPreloadDropsTheConnectionAndStartsNothing) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  control::AgentStartMsg start;
  start.worker_id = 8;
  start.env = {{"NONSTOP_FOO", "bar"}, {"LD_PRELOAD", "/tmp/evil.so"}};
  controller.Send(control::kMsgAgentStart, control::Encode(start));
  EXPECT_TRUE(controller.ClosedByAgent(3s))
      << "the agent kept a connection that sent a malformed order";
  // It dials again and registers afresh, having started nothing.
  auto reg = controller.AcceptAndRegister(5s);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_EQ(reg->running, 0);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(ReadText(EnvFile(8)), "");
  EXPECT_EQ(ReadText(dir_ / "out.txt"), "");
}

// A controller that stops (it died; a standby or `nonstop controller
// --resume` takes over) costs the host nothing: its workers keep running,
// and the agent registers again listing them, for the new controller to adopt.
TEST_F(AgentTest, SilentControllerIsLeftAndTheAgentRegistersAgainListingItsRunningWorkers) {
  FakeController controller;
  AgentOptions o = Options(controller);
  o.controller_timeout = 600ms;
  AgentRunner agent(o, dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 1);
  ASSERT_GT(pid, 0);
  controller.SetPinging(false);
  EXPECT_TRUE(controller.ClosedByAgent(3s)) << "the silent controller is left";
  controller.SetPinging(true);
  auto reg = controller.AcceptAndRegister(5s);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_FALSE(ProcessGone(pid)) << "the worker was killed with its controller";
  EXPECT_EQ(reg->host_id, "hostA");
  EXPECT_EQ(reg->running, 1);
  ASSERT_EQ(reg->workers.size(), 1u);
  EXPECT_EQ(reg->workers[0].first, 1);
  EXPECT_EQ(reg->workers[0].second, pid);
  // And it carries out orders again, for the worker it kept too.
  EXPECT_GT(StartWorker(controller, 2), 0);
  control::AgentSignalMsg kill{1, SIGKILL};
  controller.Send(control::kMsgAgentSignal, control::Encode(kill));
  EXPECT_TRUE(WaitFor([&] { return ProcessGone(pid); }, 2s));
}

// Fencing at the agent: after a controller of epoch 5, one of epoch 3 (a
// deposed leader) is left at its first ping; its start order is not carried out.
TEST_F(AgentTest, AControllerOfAnOlderEpochIsLeftAndItsOrdersAreNotCarriedOut) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  controller.SetEpoch(5);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  // first, as a controller does
  controller.Send(control::kMsgPing, control::Encode(control::PingMsg{5}));
  pid_t pid = StartWorker(controller, 1);
  ASSERT_GT(pid, 0);
  controller.CloseConnection();
  controller.SetPinging(false);
  ASSERT_TRUE(controller.AcceptAndRegister(5s).ok());
  controller.Send(control::kMsgPing, control::Encode(control::PingMsg{3}));
  control::AgentStartMsg start{2, false, 0, {{"NONSTOP_WORKER_ID", "2"}}};
  controller.Send(control::kMsgAgentStart, control::Encode(start));
  EXPECT_TRUE(controller.ClosedByAgent(3s)) << "the agent followed a controller of an older epoch";
  controller.SetEpoch(6);
  controller.SetPinging(true);
  auto reg = controller.AcceptAndRegister(5s);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_EQ(reg->running, 1) << "the deposed leader's start order was carried out";
  EXPECT_FALSE(ProcessGone(pid));
}

TEST_F(AgentTest, BrokenConnectionKeepsTheWorkersAndTheAgentRegistersAgain) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 1);
  ASSERT_GT(pid, 0);
  controller.CloseConnection();
  auto reg = controller.AcceptAndRegister(5s);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString();
  EXPECT_EQ(reg->running, 1);
  EXPECT_FALSE(ProcessGone(pid));
}

// Fencing: an agent that no controller takes back within fence_after kills
// its workers (nobody will adopt them), and registers with nothing running.
TEST_F(AgentTest, AgentCutOffForFenceAfterKillsItsWorkersThenGivesUpAfterTheJoinTimeout) {
  auto controller = std::make_unique<FakeController>();
  AgentOptions o = Options(*controller);
  o.fence_after = 1'500ms;
  o.join_timeout = 1'000ms;
  AgentRunner agent(o, dir_);
  ASSERT_TRUE(controller->AcceptAndRegister().ok());
  pid_t pid = StartWorker(*controller, 1);
  ASSERT_GT(pid, 0);
  controller.reset();  // no controller answers any more
  auto cut_at = Clock::now();
  std::this_thread::sleep_for(700ms);
  EXPECT_FALSE(ProcessGone(pid)) << "fenced before fence_after";
  EXPECT_EQ(agent.Wait(0ms), -1) << "gave up while its worker still ran";
  EXPECT_TRUE(WaitFor([&] { return ProcessGone(pid); }, 3s))
      << "the worker of a fenced host still runs";
  EXPECT_GE(Clock::now() - cut_at, 1'400ms);
  EXPECT_EQ(agent.Wait(5s), kExitControllerLost);
  EXPECT_GE(Clock::now() - cut_at, 2'400ms) << "the join timeout counts from the fencing";
}

TEST_F(AgentTest, ControllerThatNeverComesBackEndsTheAgentAfterTheJoinTimeout) {
  AgentOptions o;
  std::unique_ptr<FakeController> controller = std::make_unique<FakeController>();
  o = Options(*controller);
  o.join_timeout = 1'000ms;
  AgentRunner agent(o, dir_);
  ASSERT_TRUE(controller->AcceptAndRegister().ok());
  controller.reset();  // the listener and the connection go away for good
  auto lost_at = Clock::now();
  EXPECT_EQ(agent.Wait(5s), kExitControllerLost);
  EXPECT_GE(Clock::now() - lost_at, 900ms);  // the join timeout restarts at the loss
  EXPECT_NE(agent.agent().exit_message().find(
                fmt::format("cannot reach the controller at {} within 1 s", o.controller)),
            std::string::npos)
      << agent.agent().exit_message();
}

// A controller that cannot prove the job key (this agent's token is another job's): the agent
// never sends it its proof, tries three times, and exits 2 naming the likely fix.
TEST_F(AgentTest, WrongTokenExits2AfterThreeTriesNamingTheTokenFile) {
  FakeController controller("another-jobs-token");
  AgentRunner agent(Options(controller), dir_);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(controller.Accept().ok()) << "try " << i;
  EXPECT_EQ(agent.Wait(5s), kExitRefused);
  const std::string& msg = agent.agent().exit_message();
  EXPECT_NE(msg.find("did not prove the job key"), std::string::npos) << msg;
  EXPECT_NE(msg.find("job token"), std::string::npos) << msg;
  // No fourth try.
  EXPECT_FALSE(controller.Accept(300ms).ok());
}

TEST_F(AgentTest, UnreachableControllerExits1WithinTheJoinTimeoutNamingAddressAndError) {
  std::string address;
  {
    auto l = net::Listen({"127.0.0.1", 0});  // a port nobody listens on once this closes
    ASSERT_TRUE(l.ok());
    address = l->address.ToString();
  }
  AgentOptions o;
  o.controller = address;
  o.job_token = kToken;
  o.host_id = "hostA";
  o.program = {"/bin/true"};
  o.join_timeout = 1'500ms;
  auto t0 = Clock::now();
  AgentRunner agent(o, dir_);
  EXPECT_EQ(agent.Wait(6s), kExitControllerLost);
  auto took = Clock::now() - t0;
  EXPECT_GE(took, 1'400ms);
  EXPECT_LT(took, 4'000ms);
  EXPECT_EQ(
      agent.agent().exit_message(),
      fmt::format("cannot reach the controller at {} within 1.5 s: connection refused", address));
}

TEST_F(AgentTest, PeerThatNeverAnswersTheHelloIsRetriedUntilTheJoinTimeout) {
  auto l = net::Listen({"127.0.0.1", 0});  // the kernel accepts; nobody ever answers
  ASSERT_TRUE(l.ok());
  AgentOptions o;
  o.controller = l->address.ToString();
  o.job_token = kToken;
  o.host_id = "hostA";
  o.program = {"/bin/true"};
  o.controller_timeout = 300ms;
  o.join_timeout = 1'000ms;
  AgentRunner agent(o, dir_);
  EXPECT_EQ(agent.Wait(5s), kExitControllerLost);
  EXPECT_EQ(agent.agent().exit_message(),
            fmt::format("cannot reach the controller at {} within 1 s: the controller did not "
                        "answer the hello in time",
                        o.controller));
}

TEST_F(AgentTest, ShutdownEndsTheAgentWithItsCodeAfterItsProcessesExit) {
  FakeController controller;
  AgentOptions o = Options(controller);
  o.stop_grace = 500ms;  // the sleeping worker does not exit on its own: SIGKILL after this
  AgentRunner agent(o, dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  pid_t pid = StartWorker(controller, 0);
  ASSERT_GT(pid, 0);
  auto t0 = Clock::now();
  controller.Send(control::kMsgShutdown,
                  control::Encode(control::ShutdownMsg{"the job finished", 7}));
  // Its worker's end is still reported on the open connection.
  auto f = controller.Next(control::kMsgAgentExited, 5s);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_GE(Clock::now() - t0, 400ms) << "the worker got no grace";
  EXPECT_EQ(agent.Wait(5s), 7);
  EXPECT_TRUE(ProcessGone(pid));
  EXPECT_NE(agent.agent().exit_message().find("the job finished"), std::string::npos);
}

TEST_F(AgentTest, RefusalAfterTheHelloComesAsAShutdownWithItsCode) {
  FakeController controller;
  AgentRunner agent(Options(controller), dir_);
  ASSERT_TRUE(controller.AcceptAndRegister().ok());
  controller.Send(control::kMsgShutdown,
                  control::Encode(control::ShutdownMsg{"host id hostA is already in the job", 2}));
  EXPECT_EQ(agent.Wait(5s), 2);
  EXPECT_NE(agent.agent().exit_message().find("host id hostA is already in the job"),
            std::string::npos);
}

TEST(AgentOptionsTest, BadOptionsAreRefusedWithTheReason) {
  AgentOptions o;
  o.controller = "127.0.0.1:4000";
  o.job_token = "t";
  o.host_id = "host-1.example";
  o.program = {"/bin/true"};
  EXPECT_TRUE(ValidateOptions(o).ok());
  AgentOptions bad = o;
  bad.host_id = "has space";
  EXPECT_NE(ValidateOptions(bad).message().find("host id 'has space'"), std::string::npos);
  bad = o;
  bad.controller = "nohostport";
  EXPECT_FALSE(ValidateOptions(bad).ok());
  bad = o;
  bad.program.clear();
  EXPECT_FALSE(ValidateOptions(bad).ok());
  bad = o;
  bad.job_token.clear();
  EXPECT_FALSE(ValidateOptions(bad).ok());
}

// ---- the CLI: `nonstop agent` as a child process ----

using nonstop::testing::ChildProcess;  // tests/integration/process.h

std::string NonstopBinary() { return std::string(NONSTOP_BIN_DIR) + "/nonstop"; }

class AgentCliTest : public AgentTest {
 protected:
  // `nonstop agent` (default --on-sigterm leave) registered with `controller`, running worker 3.
  void StartAgentWithAWorker(FakeController& controller, std::unique_ptr<ChildProcess>* agent,
                             pid_t* worker) {
    std::vector<std::string> argv = {NonstopBinary(),
                                     "agent",
                                     "--controller",
                                     controller.address(),
                                     "--job-token-file",
                                     TokenFile(kToken),
                                     "--host-id",
                                     "cli-host",
                                     "--"};
    for (const auto& a : Options(controller).program) argv.push_back(a);
    *agent = std::make_unique<ChildProcess>(argv, dir_ / "agent.log");
    ASSERT_TRUE(controller.AcceptAndRegister(10s).ok()) << ReadText(dir_ / "agent.log");
    *worker = StartWorker(controller, 3);
    ASSERT_GT(*worker, 0);
    ASSERT_TRUE(WaitFor([&] { return !ReadText(EnvFile(3)).empty(); }, 10s));
  }
  std::string TokenFile(const std::string& token) {
    std::string path = dir_ / "token";
    std::ofstream(path) << token << "\n";
    ::chmod(path.c_str(), 0600);
    return path;
  }
};

TEST_F(AgentCliTest, SigtermWithOnSigtermStopKillsTheWorkersAndExits130) {
  FakeController controller;
  std::vector<std::string> argv = {NonstopBinary(),
                                   "agent",
                                   "--controller",
                                   controller.address(),
                                   "--job-token-file",
                                   TokenFile(kToken),
                                   "--host-id",
                                   "cli-host",
                                   "--on-sigterm",
                                   "stop",
                                   "--"};
  for (const auto& a : Options(controller).program) argv.push_back(a);
  // Inherited values of the agent's variables must not shadow its own in the workers.
  ChildProcess agent(argv, dir_ / "agent.log",
                     {"NONSTOP_DATA_HOST=9.9.9.9", "NONSTOP_HOST_ID_UNRELATED=x"});
  auto reg = controller.AcceptAndRegister(10s);
  ASSERT_TRUE(reg.ok()) << reg.status().ToString() << "\n" << ReadText(dir_ / "agent.log");
  EXPECT_EQ(reg->host_id, "cli-host");
  EXPECT_EQ(reg->pid, agent.pid());
  EXPECT_EQ(reg->nproc, 1);
  EXPECT_EQ(reg->spares, 0);
  pid_t pid = StartWorker(controller, 3);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(WaitFor([&] { return !ReadText(EnvFile(3)).empty(); }, 10s));
  EXPECT_EQ(ReadText(EnvFile(3)).substr(0, ReadText(EnvFile(3)).find('\n')),
            "3 cli-host 127.0.0.1");
  // Its output is forwarded with the host and worker prefix.
  EXPECT_TRUE(WaitFor(
      [&] {
        return ReadText(dir_ / "agent.log").find("[cli-host w3] hello from 3\n") !=
               std::string::npos;
      },
      5s))
      << ReadText(dir_ / "agent.log");
  ASSERT_EQ(::kill(agent.pid(), SIGTERM), 0);
  EXPECT_EQ(agent.Wait(5s), kExitInterrupted) << ReadText(dir_ / "agent.log");
  EXPECT_TRUE(ProcessGone(pid));
  std::string log = ReadText(dir_ / "agent.log");
  // the configuration table
  EXPECT_NE(log.find("host id              cli-host"), std::string::npos) << log;
  EXPECT_NE(log.find("interrupted by SIGTERM"), std::string::npos) << log;
}

// A Slurm preemption: SIGUSR1 (sbatch --signal=USR1@N) and then SIGTERM reach
// the agent and every process of its step. The agent asks once to leave,
// its worker lives on (it ignores both), nothing new starts, and once the
// worker is gone (its release) the agent exits 0.
TEST_F(AgentCliTest, SigtermAsksTheControllerToReleaseTheHostAndExits0OnceTheWorkersAreGone) {
  FakeController controller;
  std::unique_ptr<ChildProcess> started;
  pid_t pid = -1;
  ASSERT_NO_FATAL_FAILURE(StartAgentWithAWorker(controller, &started, &pid));
  ChildProcess& agent = *started;
  ASSERT_EQ(::kill(agent.pid(), SIGUSR1), 0);
  ASSERT_EQ(::kill(pid, SIGUSR1), 0);
  auto leaving = controller.Next(control::kMsgAgentLeaving, 5s);
  ASSERT_TRUE(leaving.ok()) << leaving.status().ToString() << "\n" << ReadText(dir_ / "agent.log");
  auto m = control::DecodeAgentLeaving(leaving->payload);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->reason, "SIGUSR1");
  ASSERT_EQ(::kill(agent.pid(), SIGTERM), 0);  // the scheduler's own notice follows: the same leave
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(ProcessGone(pid)) << "the worker must wait for its release";
  EXPECT_EQ(agent.Wait(1ms), -1) << ReadText(dir_ / "agent.log");
  // Nothing new starts on a host that leaves.
  control::AgentStartMsg start;
  start.worker_id = 4;
  controller.Send(control::kMsgAgentStart, control::Encode(start));
  auto refused = controller.Next(control::kMsgAgentStarted);
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  auto r = control::DecodeAgentStarted(refused->payload);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->pid, 0);
  EXPECT_NE(r->error.find("is leaving the job"), std::string::npos) << r->error;
  EXPECT_FALSE(std::filesystem::exists(EnvFile(4)));
  // The release: the worker ends (a real one exits 0 on the controller's Shutdown).
  controller.Send(control::kMsgAgentSignal, control::Encode(control::AgentSignalMsg{3, SIGKILL}));
  ASSERT_TRUE(controller.Next(control::kMsgAgentExited, 5s).ok());
  EXPECT_EQ(agent.Wait(5s), 0) << ReadText(dir_ / "agent.log");
  EXPECT_NE(ReadText(dir_ / "agent.log").find("left the job (SIGTERM): its workers were released"),
            std::string::npos)
      << ReadText(dir_ / "agent.log");
}

TEST_F(AgentCliTest, SecondSigtermWhileLeavingKillsTheWorkersAndExits130) {
  FakeController controller;
  std::unique_ptr<ChildProcess> started;
  pid_t pid = -1;
  ASSERT_NO_FATAL_FAILURE(StartAgentWithAWorker(controller, &started, &pid));
  ChildProcess& agent = *started;
  ASSERT_EQ(::kill(agent.pid(), SIGTERM), 0);
  ASSERT_TRUE(controller.Next(control::kMsgAgentLeaving, 5s).ok()) << ReadText(dir_ / "agent.log");
  ASSERT_EQ(::kill(agent.pid(), SIGTERM), 0);
  EXPECT_EQ(agent.Wait(5s), kExitInterrupted) << ReadText(dir_ / "agent.log");
  EXPECT_TRUE(ProcessGone(pid));
  EXPECT_NE(ReadText(dir_ / "agent.log").find("interrupted by SIGTERM (after SIGTERM"),
            std::string::npos)
      << ReadText(dir_ / "agent.log");
}

TEST_F(AgentCliTest, RefusedHelloExits2AndSaysWhy) {
  FakeController controller("another-jobs-token");
  ChildProcess agent(
      {NonstopBinary(), "agent", "--controller", controller.address(), "--job-token-file",
       TokenFile(kToken), "--host-id", "cli-host", "--", "/bin/true"},
      dir_ / "agent.log");
  for (int i = 0; i < 3; ++i) (void)controller.Accept(10s);
  EXPECT_EQ(agent.Wait(10s), kExitRefused);
  EXPECT_NE(ReadText(dir_ / "agent.log").find("did not prove the job key"), std::string::npos)
      << ReadText(dir_ / "agent.log");
}

TEST_F(AgentCliTest, MissingTokenFileIsAUsageErrorNamingTheFile) {
  ChildProcess agent({NonstopBinary(), "agent", "--controller", "127.0.0.1:1", "--job-token-file",
                      dir_ / "no-such-token", "--host-id", "h", "--", "/bin/true"},
                     dir_ / "agent.log");
  EXPECT_EQ(agent.Wait(10s), 2);
  EXPECT_NE(ReadText(dir_ / "agent.log").find(dir_ / "no-such-token"), std::string::npos)
      << ReadText(dir_ / "agent.log");
}

TEST_F(AgentCliTest, MissingProgramIsAUsageError) {
  ChildProcess agent({NonstopBinary(), "agent", "--controller", "127.0.0.1:1", "--job-token-file",
                      TokenFile("t"), "--host-id", "h", "--", "no-such-program-xyz"},
                     dir_ / "agent.log");
  EXPECT_EQ(agent.Wait(10s), 2);
  EXPECT_NE(ReadText(dir_ / "agent.log")
                .find("program 'no-such-program-xyz' is not an executable file on the PATH"),
            std::string::npos)
      << ReadText(dir_ / "agent.log");
}

TEST_F(AgentCliTest, InvalidHostIdIsAUsageError) {
  ChildProcess agent({NonstopBinary(), "agent", "--controller", "127.0.0.1:1", "--job-token-file",
                      TokenFile("t"), "--host-id", "bad/host", "--", "/bin/true"},
                     dir_ / "agent.log");
  EXPECT_EQ(agent.Wait(10s), 2);
  EXPECT_NE(ReadText(dir_ / "agent.log").find("--host-id 'bad/host'"), std::string::npos)
      << ReadText(dir_ / "agent.log");
}

}  // namespace
}  // namespace nonstop::agent
