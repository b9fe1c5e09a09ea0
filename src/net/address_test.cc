// Addresses read and printed alike for IPv4, IPv6 and names (net/address.h).
#include "net/address.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>

namespace nonstop::net {
namespace {

struct ParseCase {
  std::string text;
  std::optional<uint16_t> default_port;  // nullopt: the port is required
  std::string host;                      // expected; empty: an error
  uint16_t port = 0;
  std::string printed;     // HostPort::ToString of the result
  std::string error = "";  // a part of the error's message
};

const ParseCase kParseCases[] = {
    // IPv4 and names, with a port.
    {"127.0.0.1:29500", std::nullopt, "127.0.0.1", 29500, "127.0.0.1:29500"},
    {"10.0.0.1:0", std::nullopt, "10.0.0.1", 0, "10.0.0.1:0"},
    {"localhost:80", std::nullopt, "localhost", 80, "localhost:80"},
    {"ctl-a.cluster_1.example:65535", std::nullopt, "ctl-a.cluster_1.example", 65535,
     "ctl-a.cluster_1.example:65535"},
    // IPv6 with a port: bracketed, printed bracketed.
    {"[::1]:4000", std::nullopt, "::1", 4000, "[::1]:4000"},
    {"[::]:0", std::nullopt, "::", 0, "[::]:0"},
    {"[fd00:1:2::3]:29400", std::nullopt, "fd00:1:2::3", 29400, "[fd00:1:2::3]:29400"},
    {"[fe80::1%eth0]:7", std::nullopt, "fe80::1%eth0", 7, "[fe80::1%eth0]:7"},
    {"[::ffff:10.0.0.1]:5", std::nullopt, "::ffff:10.0.0.1", 5, "[::ffff:10.0.0.1]:5"},
    // A host alone, where the port is optional.
    {"10.0.0.2", 29400, "10.0.0.2", 29400, "10.0.0.2:29400"},
    {"ctl-b", 29400, "ctl-b", 29400, "ctl-b:29400"},
    {"[fd00::2]", 29400, "fd00::2", 29400, "[fd00::2]:29400"},
    {"fd00::2", 29400, "fd00::2", 29400, "[fd00::2]:29400"},
    {"::1", 0, "::1", 0, "[::1]:0"},
    {"ctl-b:1", 29400, "ctl-b", 1, "ctl-b:1"},  // a port given wins
    {"[::1]:2", 29400, "::1", 2, "[::1]:2"},
    // Errors name the address and what is wrong.
    {"[::1:4000", std::nullopt, "", 0, "", "address '[::1:4000': missing ']'"},
    {"[::1]", std::nullopt, "", 0, "", "address '[::1]': no port (HINT: [::1]:PORT)"},
    {"[::1]4000", std::nullopt, "", 0, "", "unexpected '4000' after ']'"},
    {"[]:80", std::nullopt, "", 0, "", "nothing between '[' and ']'"},
    {"[ctl-a]:80", std::nullopt, "", 0, "", "'ctl-a' in brackets is not an IPv6 address"},
    {"[10.0.0.1]:80", std::nullopt, "", 0, "", "'10.0.0.1' in brackets is not an IPv6 address"},
    {"::1:4000", std::nullopt, "", 0, "",
     "an IPv6 address with a port needs brackets (HINT: [::1]:4000)"},
    {"fd00::2", std::nullopt, "", 0, "", "address 'fd00::2': no port (HINT: [fd00::2]:PORT)"},
    {"a:b:c", std::nullopt, "", 0, "", "not host:port, [IPv6]:port nor an IPv6 address"},
    {"a:b:c", 80, "", 0, "", "not host:port, [IPv6]:port nor an IPv6 address"},
    {"127.0.0.1", std::nullopt, "", 0, "", "address '127.0.0.1': no port"},
    {"host:99999", std::nullopt, "", 0, "", "bad port '99999' (a number from 0 to 65535)"},
    {"host:12ab", std::nullopt, "", 0, "", "bad port '12ab'"},
    {"host:", std::nullopt, "", 0, "", "bad port ''"},
    {"host:-1", std::nullopt, "", 0, "", "bad port '-1'"},
    {":80", std::nullopt, "", 0, "", "address ':80': no host before the port"},
    {"ho st:80", std::nullopt, "", 0, "", "' ' is not allowed in a host name"},
    {"http://ctl:80", std::nullopt, "", 0, "", "not host:port"},
    {"::1]:80", std::nullopt, "", 0, "", "']' without '['"},
    {"", std::nullopt, "", 0, "", "address '': empty"},
    {"", 80, "", 0, "", "address '': empty"},
};

TEST(HostPortTest, ParsesAndPrintsEveryForm) {
  for (const ParseCase& c : kParseCases) {
    SCOPED_TRACE("'" + c.text + "'" + (c.default_port ? " (port optional)" : ""));
    Result<HostPort> got = ParseHostPort(c.text, c.default_port);
    if (c.host.empty()) {
      ASSERT_FALSE(got.ok()) << got->ToString();
      EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument);
      EXPECT_NE(got.status().message().find(c.error), std::string::npos) << got.status().message();
      continue;
    }
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->host, c.host);
    EXPECT_EQ(got->port, c.port);
    EXPECT_EQ(got->ToString(), c.printed);
    // What is printed parses back to the same address.
    Result<HostPort> again = ParseHostPort(got->ToString());
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_EQ(again->host, c.host);
    EXPECT_EQ(again->port, c.port);
  }
}

TEST(HostPortTest, FormatsHostsOfEitherFamily) {
  EXPECT_EQ(FormatHostPort("::1", 4000), "[::1]:4000");
  EXPECT_EQ(FormatHostPort("[::1]", 4000), "[::1]:4000")
      << "a bracketed host is not bracketed twice";
  EXPECT_EQ(FormatHostPort("10.0.0.1", 1), "10.0.0.1:1");
  EXPECT_EQ(FormatHostPort("ctl-a", 2), "ctl-a:2");
  EXPECT_EQ(FormatHost("fd00::1"), "[fd00::1]");
  EXPECT_EQ(FormatHost("10.0.0.1"), "10.0.0.1");
  EXPECT_EQ(UnbracketHost("[fd00::1]"), "fd00::1");
  EXPECT_EQ(UnbracketHost("fd00::1"), "fd00::1");
  EXPECT_EQ((HostPort{"fd00::1", 9}.ToString()), "[fd00::1]:9");
}

TEST(HostPortTest, ParsesAHostAlone) {
  struct Case {
    std::string text, host, error;
  };
  const Case cases[] = {
      {"ctl-a", "ctl-a", ""},
      {"10.0.0.1", "10.0.0.1", ""},
      {"fd00::1", "fd00::1", ""},
      {"[fd00::1]", "fd00::1", ""},
      {"::", "::", ""},
      {"ctl-a:80", "", "a host alone, without a port"},
      {"[::1]:80", "", "a host alone, without a port"},
      {"[::1", "", "missing ']'"},
      {"", "", "empty"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    Result<std::string> got = ParseHost(c.text);
    if (c.host.empty()) {
      ASSERT_FALSE(got.ok()) << *got;
      EXPECT_NE(got.status().message().find(c.error), std::string::npos) << got.status().message();
    } else {
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(*got, c.host);
    }
  }
}

TEST(HostPortTest, ClassifiesHosts) {
  EXPECT_TRUE(IsIpv6Literal("::1"));
  EXPECT_TRUE(IsIpv6Literal("fe80::1%eth0"));
  EXPECT_FALSE(IsIpv6Literal("fe80::1%"));
  EXPECT_FALSE(IsIpv6Literal("[::1]"));
  EXPECT_FALSE(IsIpv6Literal("10.0.0.1"));
  EXPECT_TRUE(IsIpv4Literal("10.0.0.1"));
  EXPECT_FALSE(IsIpv4Literal("::1"));
  for (const char* w : {"0.0.0.0", "::", "[::]", "0:0::0", ""}) EXPECT_TRUE(IsWildcardHost(w)) << w;
  for (const char* h : {"127.0.0.1", "::1", "10.0.0.1", "ctl-a"})
    EXPECT_FALSE(IsWildcardHost(h)) << h;
  for (const char* l : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]", "0:0:0:0:0:0:0:1",
                        "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(IsLoopbackHost(l)) << l;
  }
  for (const char* h : {"0.0.0.0", "::", "10.0.0.1", "fd00::1", "::ffff:10.0.0.1", "example.org"}) {
    EXPECT_FALSE(IsLoopbackHost(h)) << h;
  }
}

TEST(PortRangeTest, ParsesRangesAndRefusesBadOnes) {
  auto r = ParsePortRange("40000-40003");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->lo, 40000);
  EXPECT_EQ(r->hi, 40003);
  EXPECT_EQ(r->size(), 4);
  EXPECT_EQ(r->ToString(), "40000-40003");
  auto one = ParsePortRange("29500");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->lo, 29500);
  EXPECT_EQ(one->hi, 29500);
  EXPECT_EQ(one->ToString(), "29500");
  auto none = ParsePortRange("");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(none->size(), 0);
  EXPECT_TRUE(ParsePortRange("1-65535").ok());
  for (const char* bad :
       {"0-10", "10-5", "1-65536", "a-b", "100-", "-100", "100-200-300", " 100-200", "70000"}) {
    auto b = ParsePortRange(bad);
    EXPECT_FALSE(b.ok()) << bad;
    if (!b.ok()) {
      EXPECT_NE(b.status().message().find(std::string("port range '") + bad + "'"),
                std::string::npos)
          << b.status().message();
    }
  }
}

}  // namespace
}  // namespace nonstop::net
