#include "net/socket.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <thread>

#include <fmt/format.h>

#include "net/abort_signal.h"
#include "net/ipv6_testing.h"

namespace nonstop::net {
namespace {

TEST(SocketTest, ParseHostPortRejectsBadInput) {
  EXPECT_TRUE(ParseHostPort("127.0.0.1:80").ok());
  EXPECT_FALSE(ParseHostPort("127.0.0.1").ok());
  EXPECT_FALSE(ParseHostPort("host:99999").ok());
  EXPECT_FALSE(ParseHostPort("host:12ab").ok());
}  // the whole table: address_test.cc

struct ConnectedPair {
  UniqueFd client, server;
};

ConnectedPair Connect(const std::string& host = "127.0.0.1") {
  auto l = Listen({host, 0});
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

// Both ends of a connection over IPv6 loopback, as the data address is
// advertised from them (the local address of a connection).
TEST(SocketTest, ListensAndDialsOverIpv6Loopback) {
  if (std::string why = testing::NoIpv6Loopback(); !why.empty()) GTEST_SKIP() << why;
  auto l = Listen({"::1", 0});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->address.host, "::1");
  EXPECT_NE(l->address.port, 0);
  EXPECT_EQ(l->address.ToString(), "[::1]:" + std::to_string(l->address.port));
  // What it prints is what a dialer reads.
  auto where = ParseHostPort(l->address.ToString());
  ASSERT_TRUE(where.ok()) << where.status().ToString();
  auto c = Dial(*where, DeadlineAfter(Millis(2000)));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE(WaitFd(l->fd.get(), POLLIN, DeadlineAfter(Millis(2000)), nullptr, "accept").ok());
  auto s = Accept(l->fd.get());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  auto local = LocalAddressOf(c->get());
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ(local->host, "::1");
  auto peer = PeerAddressOf(s->get());
  ASSERT_TRUE(peer.ok()) << peer.status().ToString();
  EXPECT_EQ(peer->ToString(), local->ToString());
  // Bytes flow.
  const char hello[] = "hello over v6";
  ASSERT_TRUE(SendAll(c->get(), std::as_bytes(std::span(hello)), DeadlineAfter(Millis(2000)),
                      nullptr, "send")
                  .ok());
  char got[sizeof(hello)] = {};
  ASSERT_TRUE(RecvAll(s->get(), std::as_writable_bytes(std::span(got)), DeadlineAfter(Millis(2000)),
                      nullptr, "recv")
                  .ok());
  EXPECT_STREQ(got, hello);
  // A bracketed host is the same address.
  auto bracketed = Listen({"[::1]", 0});
  ASSERT_TRUE(bracketed.ok()) << bracketed.status().ToString();
  EXPECT_EQ(bracketed->address.host, "::1");
}

// "::" is every interface of both families: an IPv4 client reaches it and
// reads as IPv4 (not ::ffff:127.0.0.1) on the accepting side.
TEST(SocketTest, WildcardIpv6ListenerAcceptsBothFamilies) {
  if (std::string why = testing::NoIpv6Loopback(); !why.empty()) GTEST_SKIP() << why;
  auto l = Listen({"::", 0});
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->address.host, "::1") << "the wildcard reads as an address this host can dial";
  for (const std::string host : {"127.0.0.1", "::1"}) {
    SCOPED_TRACE(host);
    auto c = Dial({host, l->address.port}, DeadlineAfter(Millis(2000)));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    ASSERT_TRUE(WaitFd(l->fd.get(), POLLIN, DeadlineAfter(Millis(2000)), nullptr, "accept").ok());
    auto s = Accept(l->fd.get());
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    auto peer = PeerAddressOf(s->get());
    ASSERT_TRUE(peer.ok());
    EXPECT_EQ(peer->host, host);
  }
  auto v4 = Listen({"0.0.0.0", 0});
  ASSERT_TRUE(v4.ok()) << v4.status().ToString();
  EXPECT_EQ(v4->address.host, "127.0.0.1");
}

TEST(SocketTest, ErrorsNameTheAddress) {
  auto bad = Listen({"no-such-host.invalid", 0});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cannot resolve host 'no-such-host.invalid'"),
            std::string::npos)
      << bad.status().message();
  // A port that refuses, dialed with a short deadline: the message names it, bracketed.
  if (testing::NoIpv6Loopback().empty()) {
    auto l = Listen({"::1", 0});
    ASSERT_TRUE(l.ok());
    HostPort closed = l->address;
    l->fd.Reset();
    auto c = Dial(closed, DeadlineAfter(Millis(50)));
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("connect " + closed.ToString()), std::string::npos)
        << c.status().message();
    EXPECT_NE(c.status().message().find("[::1]:"), std::string::npos) << c.status().message();
  }
}

// The first free port of a range; every port taken: an error naming the range.
TEST(SocketTest, ListenInRangeTakesTheFirstFreePort) {
  // Two adjacent ports the OS says are free now (bound, then let go).
  uint16_t lo = 0;
  for (int attempt = 0; attempt < 50 && lo == 0; ++attempt) {
    auto a = Listen({"127.0.0.1", 0});
    ASSERT_TRUE(a.ok());
    uint16_t p = a->address.port;
    if (p >= 65535) continue;
    auto b = Listen({"127.0.0.1", static_cast<uint16_t>(p + 1)});
    if (b.ok()) lo = p;
  }
  ASSERT_NE(lo, 0) << "no two adjacent free ports";
  PortRange range{lo, static_cast<uint16_t>(lo + 1)};
  auto first = ListenInRange("127.0.0.1", range, 128, "data port");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->address.port, lo);
  auto second = ListenInRange("127.0.0.1", range, 128, "data port");
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->address.port, lo + 1);
  auto third = ListenInRange("127.0.0.1", range, 128, "data port");
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(third.status().message(),
            fmt::format("no free data port in {}-{} (2 ports, all in use)", lo, lo + 1));
  auto one = ListenInRange("127.0.0.1", PortRange{lo, lo}, 128, "data port");
  ASSERT_FALSE(one.ok());
  EXPECT_EQ(one.status().message(),
            fmt::format("no free data port in {} (1 port, it is in use)", lo));
  // An empty range: a port from the OS.
  auto any = ListenInRange("127.0.0.1", PortRange{}, 128, "data port");
  ASSERT_TRUE(any.ok()) << any.status().ToString();
  EXPECT_NE(any->address.port, 0);
  // A port freed is taken again.
  first->fd.Reset();
  auto again = ListenInRange("127.0.0.1", range, 128, "data port");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->address.port, lo);
}

}  // namespace
}  // namespace nonstop::net
