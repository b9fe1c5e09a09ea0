// nonstop-bench-handshake: what the authenticated handshake and sealed frames cost (issue 26,
// docs/security.md), against the protocol-1 hello, in one invocation on loopback.
//
//  1. Connect-to-ready: a TCP connect on loopback and then the handshake, until both ends hold the
//     connection (the dialer's ack read, the acceptor's hello accepted), `--connections` times:
//      - baseline: protocol 1, as nonstop spoke it before issue 26: one hello frame carrying the
//        token, compared in constant time, and a one-byte ack (rebuilt here from the same frame
//        code, since the runtime no longer speaks it);
//      - protocol 3: net::ClientHandshake against net::ServerHandshake, the runtime's own code:
//        hello, challenge, proof, sealed ack (two round trips, four HMACs a side).
//  2. Frames: EncodeFrame + FrameDecoder against FrameMac::Seal + decode + FrameMac::Open, for
//     payloads of a heartbeat's, a plan's and a large plan's size (MB/s and µs per frame).
// Ratios are protocol 3 over the baseline, measured in this run; absolutes beside them.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "common/coding.h"
#include "common/constant_time.h"
#include "common/crypto.h"
#include "net/frame.h"
#include "net/handshake.h"
#include "net/socket.h"

namespace nonstop::bench {
namespace {

using Clock = std::chrono::steady_clock;
const std::string kToken = "0123456789abcdef0123456789abcdef";

double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// Protocol 1's hello: the token in the clear, then a one-byte ack.
std::string V1Hello() {
  std::string h;
  PutFixed32(&h, net::kHelloMagic);
  PutFixed16(&h, 1);  // major
  PutFixed16(&h, 0);  // minor
  PutFixed16(&h, static_cast<uint16_t>(net::ConnectionKind::kControl));
  PutFixed32(&h, 1);  // generation
  PutFixed32(&h, 0);  // worker id
  PutFixed16(&h, static_cast<uint16_t>(kToken.size()));
  return h + kToken;
}

// The acceptor of either protocol, on its own thread: accepts `n` connections, one at a time.
void Accept(const net::Listener& l, int n, bool v2) {
  const crypto::Key key = crypto::JobKey(kToken);
  for (int i = 0; i < n; ++i) {
    NONSTOP_CHECK(
        net::WaitFd(l.fd.get(), POLLIN, DeadlineAfter(Millis(10'000)), nullptr, "a").ok());
    auto fd = net::Accept(l.fd.get());
    NONSTOP_CHECK(fd.ok());
    Deadline d = DeadlineAfter(Millis(5'000));
    if (v2) {
      NONSTOP_CHECK(net::ServerHandshake(fd->get(), net::OneKey(key), net::ConnectionKind::kControl,
                                         d, nullptr)
                        .ok());
    } else {
      auto hello = net::ReadFrame(fd->get(), d, nullptr, net::kMaxHandshakeBytes);
      NONSTOP_CHECK(hello.ok());
      const std::string_view token = std::string_view(hello->payload).substr(20);
      NONSTOP_CHECK(ConstantTimeEquals(token, kToken));
      NONSTOP_CHECK(
          net::WriteFrame(fd->get(), net::kFrameHelloAck, std::string(1, '\1'), d, nullptr).ok());
    }
    char b;
    (void)::recv(fd->get(), &b, 1, 0);  // until the dialer closes: one connection at a time
  }
}

// Connect-to-ready times (µs) of `n` connections.
std::vector<double> ConnectToReady(int n, bool v2) {
  auto l = net::Listen({"127.0.0.1", 0});
  NONSTOP_CHECK(l.ok());
  std::thread acceptor([&] { Accept(*l, n, v2); });
  const crypto::Key key = crypto::JobKey(kToken);
  net::Hello hello;
  hello.kind = net::ConnectionKind::kControl;
  hello.worker_id = 0;
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    Deadline d = DeadlineAfter(Millis(5'000));
    auto fd = net::Dial(l->address, d);
    NONSTOP_CHECK(fd.ok());
    if (v2) {
      NONSTOP_CHECK(net::ClientHandshake(fd->get(), key, hello, d, nullptr).ok());
    } else {
      NONSTOP_CHECK(net::WriteFrame(fd->get(), net::kFrameHello, V1Hello(), d, nullptr).ok());
      auto ack = net::ReadFrame(fd->get(), d, nullptr, net::kMaxHandshakeBytes);
      NONSTOP_CHECK(ack.ok() && ack->payload == std::string(1, '\1'));
    }
    us.push_back(Micros(Clock::now() - t0));
  }
  acceptor.join();
  return us;
}

// µs per frame of `payload` bytes through encode + decode, sealed or not.
double FrameMicros(size_t payload, int frames, bool sealed) {
  const crypto::Key k = crypto::DeriveKey(crypto::JobKey(kToken), "bench");
  net::FrameMac send(k), recv(k);
  const std::string body(payload, 'p');
  net::FrameDecoder decoder(net::kMaxControlFrameBytes);
  auto t0 = Clock::now();
  for (int i = 0; i < frames; ++i) {
    std::string bytes = sealed ? send.Seal(20, body) : net::EncodeFrame(20, body);
    NONSTOP_CHECK(decoder.Feed(bytes).ok());
    net::Frame f = *decoder.Next();
    if (sealed) {
      NONSTOP_CHECK(recv.Open(&f).ok());
    }
    NONSTOP_CHECK(f.payload.size() == payload);
  }
  return Micros(Clock::now() - t0) / frames;
}

int Main(int argc, char** argv) {
  CLI::App app{"nonstop-bench-handshake: the authenticated handshake's and sealed frames' cost"};
  int connections = 2000;
  app.add_option("--connections", connections, "connections per protocol")
      ->check(CLI::Range(10, 1'000'000));
  CLI11_PARSE(app, argc, argv);
  // Interleaved halves, so that drift in the machine's load falls on both alike.
  std::vector<double> v1, v2;
  for (int round = 0; round < 2; ++round) {
    for (double us : ConnectToReady(connections / 2, false)) v1.push_back(us);
    for (double us : ConnectToReady(connections / 2, true)) v2.push_back(us);
  }
  fmt::print("connect-to-ready on loopback, {} connections each (µs):\n", v1.size());
  fmt::print("  {:<34} {:>8} {:>8} {:>8}\n", "", "p50", "p90", "p99");
  for (auto [name, v] : {std::pair{"protocol 1 (token in the hello)", &v1},
                         std::pair{"protocol 3 (mutual proof, sealed)", &v2}}) {
    fmt::print("  {:<34} {:>8.1f} {:>8.1f} {:>8.1f}\n", name, Quantile(*v, 0.5), Quantile(*v, 0.9),
               Quantile(*v, 0.99));
  }
  fmt::print("  ratio 2/1 at p50: {:.2f}x ({:+.1f} µs a connection)\n",
             Quantile(v2, 0.5) / Quantile(v1, 0.5), Quantile(v2, 0.5) - Quantile(v1, 0.5));
  fmt::print("\nframes: encode + decode, plain against sealed (µs a frame; MB/s):\n");
  for (size_t bytes : {size_t{200}, size_t{64} << 10, size_t{4} << 20}) {
    const int n = bytes > (1u << 20) ? 50 : 5'000;
    double plain = FrameMicros(bytes, n, false), sealed = FrameMicros(bytes, n, true);
    fmt::print(
        "  {:>9} B: plain {:>9.2f} µs ({:>7.0f} MB/s), sealed {:>9.2f} µs ({:>7.0f} MB/s), "
        "ratio {:.2f}x\n",
        bytes, plain, static_cast<double>(bytes) / plain, sealed,
        static_cast<double>(bytes) / sealed, sealed / plain);
  }
  return 0;
}

}  // namespace
}  // namespace nonstop::bench

int main(int argc, char** argv) { return nonstop::bench::Main(argc, argv); }
