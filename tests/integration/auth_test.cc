// Attacks on the control plane of a real job (docs/security.md): `nonstop
// controller` and `nonstop agent` with real workers on loopback.
//  - An impostor binds the controller's port after the controller died and
//    answers every hello; nobody proves anything to it, sends it a join or
//    the token, or obeys the orders it sends; `nonstop controller --resume`
//    then leads and the job ends bitwise.
//  - A proxy between the agent (and its workers) and the controller alters
//    a frame in each direction (its checksum made to match again), and the
//    test replays a recorded handshake and reflects a challenge's proof at
//    the controller: each is refused and its connection closed, and the job
//    ends bitwise.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/coding.h"
#include "common/crypto.h"
#include "common/temp_dir.h"
#include "controller/journal.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/crc32c.h"
#include "tests/integration/process.h"

namespace nonstop {
namespace {

using nonstop::testing::ChildProcess;
using std::chrono::milliseconds;

const std::string kBin = NONSTOP_BIN_DIR;
const auto& Events = nonstop::testing::JournalEvents;
const auto& FinishedChecksum = nonstop::testing::FinishedChecksum;

// 12 s of training: it outlasts the attacks and the resumed controller's start. The checksum does
// not depend on the pace.
constexpr int kSteps = 300;

std::vector<std::string> Worker() {
  return {kBin + "/nonstop-test-worker", "--steps", std::to_string(kSteps), "--sleep-ms", "40"};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

using nonstop::testing::ControllerAddress;

// One job: a controller, an agent of 3 workers and a spare dialing `dial` (the controller's own
// address when empty), and the reference checksum of the same job run without any attack.
class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::string> argv = {
        kBin + "/nonstop",          "run", "--nproc", "3", "--spares", "0", "--journal",
        dir_ / "ref/journal.jsonl", "--"};
    for (auto& a : Worker()) argv.push_back(a);
    ChildProcess ref(argv, dir_ / "ref.out");
    ASSERT_EQ(ref.Wait(milliseconds(60'000)), 0) << ref.Output();
    reference_ = FinishedChecksum(dir_ / "ref/journal.jsonl");
    ASSERT_FALSE(reference_.empty());
  }

  std::vector<std::string> ControllerArgv(bool resume) {
    std::vector<std::string> argv = {kBin + "/nonstop", "controller",
                                     resume ? "--resume" : "--journal", journal_};
    for (const char* a : {"--nnodes", "1", "--heartbeat-timeout-ms", "1000"}) argv.push_back(a);
    argv.push_back("--job-token-file");
    argv.push_back(token_file_);
    return argv;
  }

  void StartController() {
    controller_ = std::make_unique<ChildProcess>(ControllerArgv(false), dir_ / "controller1.out");
    address_ = ControllerAddress(dir_ / "job");
    ASSERT_FALSE(address_.empty()) << controller_->Output();
  }

  void StartAgent(const std::string& dial) {
    std::vector<std::string> argv = {kBin + "/nonstop",
                                     "agent",
                                     "--controller",
                                     dial,
                                     "--job-token-file",
                                     token_file_,
                                     "--host-id",
                                     "h1",
                                     "--nproc-per-host",
                                     "3",
                                     "--spares-per-host",
                                     "1",
                                     "--"};
    for (auto& a : Worker()) argv.push_back(a);
    agent_ = std::make_unique<ChildProcess>(argv, dir_ / "agent.out");
  }

  std::string Token() {
    std::string t = ReadFile(token_file_);
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ')) t.pop_back();
    return t;
  }

  TempDir dir_;
  std::string journal_ = dir_ / "job/journal.jsonl";
  std::string token_file_ = dir_ / "token";
  std::string reference_;
  std::string address_;
  std::unique_ptr<ChildProcess> controller_, agent_;
};

// A process that bound the controller's port: it accepts every connection, answers each hello
// with a challenge it makes up without the key, sends orders (a shutdown, an abort), and keeps
// what it received.
class Impostor {
 public:
  explicit Impostor(const net::HostPort& where) {
    auto l = net::Listen(where);
    NONSTOP_CHECK(l.ok()) << "the impostor could not bind " << where.ToString() << ": "
                          << l.status().ToString();
    listener_ = std::move(*l);
    thread_ = std::jthread([this](std::stop_token st) { Run(st); });
  }
  ~Impostor() { thread_.request_stop(); }
  // Leaves the port (and every connection) to the next process.
  void Stop() {
    thread_.request_stop();
    thread_.join();
    listener_.fd.Reset();
  }

  int connections = 0;
  std::map<uint16_t, int> frames;  // type -> how many, of every connection
  std::string received;            // every byte every peer sent

 private:
  struct Peer {
    UniqueFd fd;
    net::FrameDecoder decoder{net::kMaxHandshakeBytes};
  };

  void Run(std::stop_token st) {
    std::vector<std::unique_ptr<Peer>> peers;
    while (!st.stop_requested()) {
      std::vector<pollfd> fds = {{listener_.fd.get(), POLLIN, 0}};
      for (auto& p : peers) fds.push_back({p->fd.get(), POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 10) <= 0) continue;
      const size_t polled = peers.size();
      if (fds[0].revents & POLLIN) {
        auto fd = net::Accept(listener_.fd.get());
        if (fd.ok()) {
          ++connections;
          auto peer = std::make_unique<Peer>();
          peer->fd = std::move(*fd);
          peers.push_back(std::move(peer));
        }
      }
      for (size_t i = 0; i < polled; ++i) {
        if (!(fds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buf[4096];
        ssize_t n = ::recv(peers[i]->fd.get(), buf, sizeof(buf), 0);
        if (n <= 0) continue;
        received.append(buf, static_cast<size_t>(n));
        if (!peers[i]->decoder.Feed(std::string_view(buf, static_cast<size_t>(n))).ok()) continue;
        while (auto f = peers[i]->decoder.Next()) {
          ++frames[f->type];
          if (f->type == net::kFrameHello) Answer(peers[i]->fd.get());
        }
      }
      std::erase_if(peers, [](const std::unique_ptr<Peer>& p) {
        char b;
        return ::recv(p->fd.get(), &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
      });
    }
  }

  // A made-up challenge, then orders in every form it can try: plain, and as if sealed.
  static void Answer(int fd) {
    std::string out = net::EncodeFrame(
        net::kFrameChallenge, crypto::RandomBytes(crypto::kNonceBytes + crypto::kMacBytes));
    out += net::EncodeFrame(net::kFrameHelloAck, std::string(1, '\1'));
    for (uint16_t type : {uint16_t{21}, uint16_t{22}, uint16_t{23}}) {
      std::string order = R"({"reason":"impostor","exit_code":0,"generation":1})";
      out += net::EncodeFrame(type, order);
      out += net::EncodeFrame(type, order + std::string(net::kFrameTagBytes, 'm'));
    }
    (void)::send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }

  net::Listener listener_;
  std::jthread thread_;
};

TEST_F(AuthTest, AnImpostorOnTheDeadControllersPortGetsNothingUsableAndTheResumedControllerLeads) {
  ASSERT_NO_FATAL_FAILURE(StartController());
  StartAgent(address_);
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal_, "step", 30, milliseconds(60'000)))
      << controller_->Output() << agent_->Output();
  const std::string token = Token();
  ASSERT_FALSE(token.empty());
  ASSERT_EQ(::kill(controller_->pid(), SIGKILL), 0);
  ASSERT_EQ(controller_->Wait(milliseconds(5'000)), 128 + SIGKILL);
  auto where = net::ParseHostPort(address_);
  ASSERT_TRUE(where.ok());
  Impostor impostor(*where);
  std::this_thread::sleep_for(milliseconds(2'500));  // every worker and the agent dial it
  impostor.Stop();

  // Nothing usable reached it: hellos only (a nonce, no token, no proof, no join or register).
  EXPECT_GE(impostor.connections, 4) << "the test is vacuous: nobody dialed the impostor";
  EXPECT_GE(impostor.frames[net::kFrameHello], 4);
  for (const auto& [type, n] : impostor.frames) {
    EXPECT_EQ(type, net::kFrameHello) << n << " frame(s) of type " << type << " reached it";
  }
  EXPECT_EQ(impostor.received.find(token), std::string::npos) << "the token reached the impostor";

  ChildProcess resumed(ControllerArgv(true), dir_ / "controller2.out");
  const int code = resumed.Wait(milliseconds(90'000));
  const std::string outputs =
      "--- controller 2\n" + resumed.Output() + "--- agent\n" + agent_->Output();
  ASSERT_EQ(code, 0) << outputs;
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << outputs;
  EXPECT_EQ(Events(journal_, "takeover").size(), 1u) << outputs;
  EXPECT_GE(Events(journal_, "rejoin").size(), 3u) << "the members came back\n" << outputs;
  EXPECT_TRUE(Events(journal_, "recovery_start").empty()) << "nobody obeyed the impostor\n"
                                                          << outputs;
  EXPECT_EQ(FinishedChecksum(journal_), reference_) << outputs;
  EXPECT_NE(agent_->Output().find("did not prove the job key"), std::string::npos)
      << "the agent's log does not say why it left the impostor\n"
      << agent_->Output();
}

// A proxy in front of the controller. It forwards bytes both ways, frame by frame; asked to, it
// alters the next post-handshake frame of a direction on a worker's connection (any but the
// first, the agent's: a lost agent connection is a lost host), fixing its checksum as an attacker
// would. It records the first connection's handshake frames from the dialer (the agent's), to be
// replayed.
class TamperingProxy {
 public:
  explicit TamperingProxy(std::string upstream) : upstream_(std::move(upstream)) {
    auto l = net::Listen({"127.0.0.1", 0});
    NONSTOP_CHECK(l.ok());
    listener_ = std::move(*l);
    thread_ = std::jthread([this](std::stop_token st) { Run(st); });
  }
  std::string address() const { return listener_.address.ToString(); }
  void AlterNext(bool to_controller) { (to_controller ? alter_up_ : alter_down_) = true; }
  bool altered(bool to_controller) const {
    return !(to_controller ? alter_up_ : alter_down_).load();
  }
  std::string RecordedHandshake() {
    std::lock_guard<std::mutex> lock(mu_);
    return recorded_;
  }

 private:
  struct Pipe {
    UniqueFd down, up;  // the dialer's connection, ours to the controller
    std::string from_down, from_up;
    int frames_down = 0, frames_up = 0;
    bool first = false;
  };

  void Run(std::stop_token st) {
    std::vector<std::unique_ptr<Pipe>> pipes;
    while (!st.stop_requested()) {
      std::vector<pollfd> fds = {{listener_.fd.get(), POLLIN, 0}};
      for (auto& p : pipes) {
        fds.push_back({p->down.get(), POLLIN, 0});
        fds.push_back({p->up.get(), POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 10) <= 0) continue;
      const size_t polled = pipes.size();
      if (fds[0].revents & POLLIN) Accept(&pipes);
      for (size_t i = 0; i < polled; ++i) {
        Pipe& p = *pipes[i];
        if ((fds[1 + 2 * i].revents & (POLLIN | POLLHUP | POLLERR)) && !Pump(p, /*up=*/true))
          p.down.Reset();
        if ((fds[2 + 2 * i].revents & (POLLIN | POLLHUP | POLLERR)) && !Pump(p, /*up=*/false))
          p.down.Reset();
      }
      std::erase_if(pipes, [](const std::unique_ptr<Pipe>& p) { return !p->down.valid(); });
    }
  }

  void Accept(std::vector<std::unique_ptr<Pipe>>* pipes) {
    auto fd = net::Accept(listener_.fd.get());
    if (!fd.ok()) return;
    auto where = net::ParseHostPort(upstream_);
    auto up = net::Dial(*where, DeadlineAfter(milliseconds(2'000)));
    if (!up.ok()) return;
    auto p = std::make_unique<Pipe>();
    p->down = std::move(*fd);
    p->up = std::move(*up);
    p->first = ++accepted_ == 1;
    pipes->push_back(std::move(p));
  }

  // Moves whole frames from one side to the other; false when a side closed.
  bool Pump(Pipe& p, bool up) {
    int from = up ? p.down.get() : p.up.get();
    int to = up ? p.up.get() : p.down.get();
    std::string& buf = up ? p.from_down : p.from_up;
    char chunk[64 << 10];
    ssize_t n = ::recv(from, chunk, sizeof(chunk), 0);
    if (n <= 0) return false;
    buf.append(chunk, static_cast<size_t>(n));
    while (buf.size() >= net::kFrameHeaderBytes) {
      const size_t len = DecodeFixed32(buf.data());
      if (buf.size() < net::kFrameHeaderBytes + len) break;
      std::string frame = buf.substr(0, net::kFrameHeaderBytes + len);
      buf.erase(0, frame.size());
      int& count = up ? p.frames_down : p.frames_up;
      ++count;
      if (p.first && up && count <= 2) {
        std::lock_guard<std::mutex> lock(mu_);
        recorded_ += frame;  // the hello and the proof
      }
      std::atomic<bool>& alter = up ? alter_up_ : alter_down_;
      // Past the handshake (the dialer's hello and proof; the challenge and the ack), a payload
      // byte flipped and the checksum fixed.
      if (!p.first && count > 2 && len > net::kFrameTagBytes && alter.exchange(false)) {
        std::fprintf(stderr, "proxy: altering frame %d (type %u, %zu bytes) %s\n", count,
                     DecodeFixed16(frame.data() + 4), len, up ? "up" : "down");
        frame[net::kFrameHeaderBytes] ^= 0x01;
        std::string crc;
        PutFixed32(&crc, Crc32c(std::string_view(frame).substr(net::kFrameHeaderBytes)));
        frame.replace(8, 4, crc);
      }
      if (!net::SendAll(to, std::as_bytes(std::span(frame)), DeadlineAfter(milliseconds(2'000)),
                        nullptr, "proxy")
               .ok())
        return false;
    }
    return true;
  }

  const std::string upstream_;
  net::Listener listener_;
  std::atomic<bool> alter_up_{false}, alter_down_{false};
  std::mutex mu_;
  std::string recorded_;
  int accepted_ = 0;
  std::jthread thread_;
};

// The controller's log lines about refused connections and frames.
int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST_F(AuthTest, AlteredFramesAndReplayedOrReflectedHandshakesAreRefusedAndTheJobGoesOn) {
  ASSERT_NO_FATAL_FAILURE(StartController());
  TamperingProxy proxy(address_);
  StartAgent(proxy.address());
  ASSERT_TRUE(nonstop::testing::WaitForEvents(journal_, "step", 20, milliseconds(60'000)))
      << controller_->Output() << agent_->Output();

  // 1. A frame to a worker altered on the way: refused there. 2. One from a worker to the
  // controller: refused there. Each costs its connection, which is dialed again.
  for (bool to_controller : {false, true}) {
    proxy.AlterNext(to_controller);
    for (int i = 0; i < 500 && !proxy.altered(to_controller); ++i)
      std::this_thread::sleep_for(milliseconds(10));
    ASSERT_TRUE(proxy.altered(to_controller))
        << "no frame went " << (to_controller ? "up" : "down") << "\n"
        << controller_->Output() << agent_->Output();
    std::this_thread::sleep_for(milliseconds(300));
  }

  // 3. The agent's recorded handshake replayed straight to the controller.
  const std::string recorded = proxy.RecordedHandshake();
  ASSERT_FALSE(recorded.empty());
  auto where = net::ParseHostPort(address_);
  ASSERT_TRUE(where.ok());
  {
    auto fd = net::Dial(*where, DeadlineAfter(milliseconds(2'000)));
    ASSERT_TRUE(fd.ok());
    ASSERT_TRUE(net::SendAll(fd->get(), std::as_bytes(std::span(recorded)),
                             DeadlineAfter(milliseconds(2'000)), nullptr, "replay")
                    .ok());
    auto challenge = net::ReadFrame(fd->get(), DeadlineAfter(milliseconds(2'000)), nullptr);
    ASSERT_TRUE(challenge.ok()) << challenge.status().ToString();
    EXPECT_EQ(challenge->type, net::kFrameChallenge);
    // Refused without a word: the connection just closes.
    EXPECT_EQ(
        net::ReadFrame(fd->get(), DeadlineAfter(milliseconds(2'000)), nullptr).status().code(),
        StatusCode::kUnavailable);
  }
  // 4. The controller's own proof reflected back as the dialer's.
  {
    auto fd = net::Dial(*where, DeadlineAfter(milliseconds(2'000)));
    ASSERT_TRUE(fd.ok());
    net::Hello h;
    h.kind = net::ConnectionKind::kControl;
    h.worker_id = 1;
    h.nonce = crypto::RandomBytes(crypto::kNonceBytes);
    ASSERT_TRUE(net::WriteFrame(fd->get(), net::kFrameHello, net::EncodeHello(h),
                                DeadlineAfter(milliseconds(2'000)), nullptr)
                    .ok());
    auto challenge = net::ReadFrame(fd->get(), DeadlineAfter(milliseconds(2'000)), nullptr);
    ASSERT_TRUE(challenge.ok());
    ASSERT_EQ(challenge->payload.size(), crypto::kNonceBytes + crypto::kMacBytes);
    ASSERT_TRUE(net::WriteFrame(fd->get(), net::kFrameProof,
                                challenge->payload.substr(crypto::kNonceBytes),
                                DeadlineAfter(milliseconds(2'000)), nullptr)
                    .ok());
    EXPECT_EQ(
        net::ReadFrame(fd->get(), DeadlineAfter(milliseconds(2'000)), nullptr).status().code(),
        StatusCode::kUnavailable);
  }

  ASSERT_EQ(controller_->Wait(milliseconds(90'000)), 0)
      << controller_->Output() << agent_->Output();
  EXPECT_EQ(agent_->Wait(milliseconds(20'000)), 0) << agent_->Output();
  const std::string log = controller_->Output();
  EXPECT_GE(Count(log, "fails its MAC"), 1) << log;
  EXPECT_EQ(Count(log, "did not prove the job key"), 2) << "the replay and the reflection\n" << log;
  EXPECT_EQ(FinishedChecksum(journal_), reference_) << log << agent_->Output();
  // The worker that got the altered frame says so in its log (the agent's output holds it).
  EXPECT_GE(Count(agent_->Output(), "fails its MAC"), 1) << agent_->Output();
}

}  // namespace
}  // namespace nonstop
