#include "controller/control_server.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

#include <thread>

#include "control/messages.h"
#include "net/handshake.h"

namespace nonstop::controller {
namespace {

// A real server on loopback, driven by its event loop on a thread.
struct ServerFixture {
  net::EventLoop loop;
  std::vector<Event> events;
  std::unique_ptr<ControlServer> server;
  std::atomic<bool> stop{false};
  std::thread thread;
  ServerFixture() {
    auto s = ControlServer::Create(&loop, {"127.0.0.1", 0}, "tok", [this](Event e) { events.push_back(std::move(e)); });
    NONSTOP_CHECK(s.ok());
    server = std::move(*s);
  }
  void RunFor(Millis d) {
    auto until = Clock::now() + d;
    while (Clock::now() < until) loop.RunOnce(Millis(10));
  }
};

UniqueFd Dial(const net::HostPort& where) {
  auto fd = net::Dial(where, DeadlineAfter(Millis(2000)));
  NONSTOP_CHECK(fd.ok());
  return std::move(*fd);
}

TEST(ControlServerTest, GarbageAndWrongTokensAreClosedAndTheServerCarriesOn) {
  ServerFixture f;
  UniqueFd garbage = Dial(f.server->address());
  std::string http = "GET /status HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(garbage.get(), http.data(), http.size(), 0), static_cast<ssize_t>(http.size()));
  UniqueFd wrong = Dial(f.server->address());
  net::Hello h;
  h.kind = net::ConnectionKind::kControl;
  h.job_token = "not-the-token";
  std::string hello = net::EncodeFrame(net::kFrameHello, net::EncodeHello(h));
  ASSERT_GT(::send(wrong.get(), hello.data(), hello.size(), 0), 0);
  f.RunFor(Millis(200));
  EXPECT_EQ(f.server->refused_connections(), 1);
  EXPECT_TRUE(f.events.empty());

  // A proper worker still gets through.
  UniqueFd good = Dial(f.server->address());
  std::thread client([&] {
    net::Hello ok;
    ok.kind = net::ConnectionKind::kControl;
    ok.job_token = "tok";
    ok.worker_id = 7;
    ASSERT_TRUE(net::ClientHandshake(good.get(), ok, DeadlineAfter(Millis(3000)), nullptr).ok());
    control::JoinMsg j{7, 1234, "127.0.0.1:1", false, -1};
    ASSERT_TRUE(net::WriteFrame(good.get(), control::kMsgJoin, control::Encode(j), DeadlineAfter(Millis(1000)), nullptr).ok());
  });
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.events.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<WorkerJoined>(f.events[0]));
  EXPECT_EQ(std::get<WorkerJoined>(f.events[0]).msg.worker_id, 7);
}

TEST(ControlServerTest, MalformedMessageClosesOnlyThatWorker) {
  ServerFixture f;
  UniqueFd c = Dial(f.server->address());
  std::thread client([&] {
    net::Hello ok;
    ok.kind = net::ConnectionKind::kControl;
    ok.job_token = "tok";
    ASSERT_TRUE(net::ClientHandshake(c.get(), ok, DeadlineAfter(Millis(3000)), nullptr).ok());
    control::JoinMsg j{1, 1, "127.0.0.1:1", false, -1};
    ASSERT_TRUE(net::WriteFrame(c.get(), control::kMsgJoin, control::Encode(j), DeadlineAfter(Millis(1000)), nullptr).ok());
    ASSERT_TRUE(net::WriteFrame(c.get(), control::kMsgHeartbeat, "{\"step\": [1]}", DeadlineAfter(Millis(1000)), nullptr).ok());
  });
  f.RunFor(Millis(300));
  client.join();
  ASSERT_EQ(f.events.size(), 2u);
  ASSERT_TRUE(std::holds_alternative<ConnectionLost>(f.events[1]));
  EXPECT_NE(std::get<ConnectionLost>(f.events[1]).reason.find("step"), std::string::npos);
}

}  // namespace
}  // namespace nonstop::controller
