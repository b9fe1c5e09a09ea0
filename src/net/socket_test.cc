#include "net/socket.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <thread>

#include "net/abort_signal.h"

namespace nonstop::net {
namespace {

TEST(SocketTest, ParseHostPortRejectsBadInput) {
  EXPECT_TRUE(ParseHostPort("127.0.0.1:80").ok());
  EXPECT_FALSE(ParseHostPort("127.0.0.1").ok());
  EXPECT_FALSE(ParseHostPort("host:99999").ok());
  EXPECT_FALSE(ParseHostPort("host:12ab").ok());
}

struct ConnectedPair {
  UniqueFd client, server;
};

ConnectedPair Connect() {
  auto l = Listen({"127.0.0.1", 0});
  NONSTOP_CHECK(l.ok()) << l.status().ToString();
  NONSTOP_CHECK_NE(l->address.port, 0);
  auto c = Dial(l->address, DeadlineAfter(Millis(2000)));
  NONSTOP_CHECK(c.ok()) << c.status().ToString();
  NONSTOP_CHECK(WaitFd(l->fd.get(), POLLIN, DeadlineAfter(Millis(2000)), nullptr, "accept").ok());
  auto s = Accept(l->fd.get());
  NONSTOP_CHECK(s.ok());
  return {std::move(*c), std::move(*s)};
}

TEST(SocketTest, AbortWakesBlockedRecvPromptly) {
  ConnectedPair p = Connect();
  AbortSignal abort;
  std::byte buf[16];
  auto start = Clock::now();
  std::thread t([&] {
    std::this_thread::sleep_for(Millis(50));
    abort.Fire();
  });
  Status s = RecvAll(p.server.get(), buf, DeadlineAfter(Millis(10'000)), &abort, "recv");
  auto elapsed = Clock::now() - start;
  t.join();
  EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
  EXPECT_LT(elapsed, Millis(5000));  // would be 10 s if the abort were not seen
}

TEST(SocketTest, PeerCloseIsUnavailable) {
  ConnectedPair p = Connect();
  p.client.Reset();
  std::byte buf[16];
  Status s = RecvAll(p.server.get(), buf, DeadlineAfter(Millis(5000)), nullptr, "recv from rank 1");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos);
}

TEST(SocketTest, DeadlineIsReported) {
  ConnectedPair p = Connect();
  std::byte buf[16];
  Status s = RecvAll(p.server.get(), buf, DeadlineAfter(Millis(50)), nullptr, "recv");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
}

}  // namespace
}  // namespace nonstop::net
