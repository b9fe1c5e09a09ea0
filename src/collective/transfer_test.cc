// The transfer engine's checked mode (transfer.h, docs/protocol.md "Checked
// collectives") against a hand-written peer on the other end of a socket
// pair: the frames on the wire, byte for byte.
#include "collective/transfer.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "common/coding.h"
#include "net/abort_signal.h"
#include "net/socket.h"
#include "nonstop/crc32c.h"

namespace nonstop::collective {
namespace {

constexpr uint32_t kGen = 7;
constexpr uint32_t kOp = 3;

struct Frame {
  uint32_t length = 0;
  uint16_t type = kFrameData;
  uint16_t flags = 0;
  uint32_t generation = kGen;
  uint32_t op = kOp;
  uint32_t seq = 0;
  uint32_t crc = 0;
};

std::string Encode(const Frame& f, std::string_view payload = {}) {
  std::string out;
  PutFixed32(&out, f.length);
  PutFixed16(&out, f.type);
  PutFixed16(&out, f.flags);
  PutFixed32(&out, f.generation);
  PutFixed32(&out, f.op);
  PutFixed32(&out, f.seq);
  PutFixed32(&out, f.crc);
  out.append(payload);
  return out;
}

void WriteAll(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    ASSERT_GT(n, 0);
    off += static_cast<size_t>(n);
  }
}

std::string ReadExactly(int fd, size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, out.data() + got, n - got);
    if (r <= 0) return out.substr(0, got);
    got += static_cast<size_t>(r);
  }
  return out;
}

Frame ReadHeader(int fd) {
  std::string h = ReadExactly(fd, kDataHeaderBytes);
  Frame f;
  if (h.size() != kDataHeaderBytes) {
    f.type = 0;
    return f;
  }
  f.length = DecodeFixed32(h.data());
  f.type = DecodeFixed16(h.data() + 4);
  f.flags = DecodeFixed16(h.data() + 6);
  f.generation = DecodeFixed32(h.data() + 8);
  f.op = DecodeFixed32(h.data() + 12);
  f.seq = DecodeFixed32(h.data() + 16);
  f.crc = DecodeFixed32(h.data() + 20);
  return f;
}

// This side's Connection and the raw fd of the peer the test plays.
struct Pair {
  Connection conn;
  UniqueFd peer;
  Pair() {
    int fds[2];
    NONSTOP_CHECK_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    conn.fd.Reset(fds[0]);
    conn.peer_id = 5;
    peer.Reset(fds[1]);
    // The engine works on non-blocking sockets, as the mesh makes them.
    NONSTOP_CHECK(net::SetNonBlocking(conn.fd.get()).ok());
  }
};

TransferSpec CheckedSpec() {
  TransferSpec spec;
  spec.generation = kGen;
  spec.op = kOp;
  spec.checksum = true;
  spec.retry = true;
  spec.deadline = DeadlineAfter(Millis(10'000));
  return spec;
}

// A piece that arrives damaged every time is asked for again max_resends times, then the transfer
// fails with DATA_LOSS saying so; every request is a resend frame for that piece.
TEST(TransferTest, APieceDamagedEveryTimeIsAskedForEightTimesThenIsDataLoss) {
  Pair p;
  std::vector<std::byte> dst(16);
  TransferSpec spec = CheckedSpec();
  spec.recv_from = &p.conn;
  spec.recv_peer = "the test";
  spec.recvs.push_back({dst.data(), dst.size(), nullptr});
  TransferStats stats;
  auto result = std::async(std::launch::async, [&] { return RunTransfer(spec, &stats); });
  const std::string payload(16, 'x');
  Frame bad{.length = 16, .flags = kDataFlagChecksum | kDataFlagRetry, .crc = 12345};
  int requests = 0;
  for (int i = 0; i <= spec.max_resends; ++i) {
    WriteAll(p.peer.get(), Encode(bad, payload));
    if (i == spec.max_resends) break;
    Frame r = ReadHeader(p.peer.get());
    ASSERT_EQ(r.type, kFrameResend) << "request " << i;
    EXPECT_EQ(r.seq, 0u);
    EXPECT_EQ(r.length, 0u);
    EXPECT_EQ(r.generation, kGen);
    EXPECT_EQ(r.op, kOp);
    ++requests;
  }
  Status s = result.get();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find("after 8 resends"), std::string::npos) << s.message();
  EXPECT_EQ(requests, 8);
  EXPECT_EQ(stats.pieces_refetched, 8u);
}

// The sending side: the peer asks for piece 1 again after all three came; the engine sends 1 and 2
// again, whole, and its transfer ends only at the ack.
TEST(TransferTest, ASenderGoesBackToTheRequestedPieceAndEndsAtTheAck) {
  Pair p;
  std::vector<std::string> pieces = {"first piece", "second", "the third piece"};
  TransferSpec spec = CheckedSpec();
  spec.send_to = &p.conn;
  spec.send_peer = "the test";
  for (const auto& x : pieces)
    spec.sends.push_back({reinterpret_cast<const std::byte*>(x.data()), x.size(), -1});
  auto result = std::async(std::launch::async, [&] { return RunTransfer(spec); });
  auto read_piece = [&](uint32_t want_seq) {
    Frame f = ReadHeader(p.peer.get());
    EXPECT_EQ(f.type, kFrameData);
    EXPECT_EQ(f.seq, want_seq);
    EXPECT_EQ(f.flags, kDataFlagChecksum | kDataFlagRetry);
    std::string got = ReadExactly(p.peer.get(), f.length);
    EXPECT_EQ(got, pieces[want_seq]);
    EXPECT_EQ(f.crc, Crc32c(got));
  };
  for (uint32_t i = 0; i < 3; ++i) read_piece(i);
  EXPECT_EQ(result.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the sender must wait for the ack";
  WriteAll(p.peer.get(), Encode({.type = kFrameResend, .seq = 1}));
  read_piece(1);
  read_piece(2);
  WriteAll(p.peer.get(), Encode({.type = kFrameAck, .seq = 3}));
  Status s = result.get();
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// An abort ends a transfer only once nothing moves: pieces of a live peer that are here complete it
// (ranks would otherwise end a collective differently: one done, its peer aborted, though every
// byte was sent), and one that waits for a piece that has not come ends at once, not at its
// deadline.
TEST(TransferTest, AnAbortEndsATransferOnlyOnceNothingMoves) {
  for (const bool all_sent : {true, false}) {
    SCOPED_TRACE(all_sent ? "both pieces sent" : "one piece of two sent");
    Pair p;
    std::vector<std::byte> dst(16);
    TransferSpec spec = CheckedSpec();
    spec.checksum = false;
    spec.retry = false;
    spec.recv_from = &p.conn;
    spec.recv_peer = "the test";
    spec.recvs.push_back({dst.data(), 8, nullptr});
    spec.recvs.push_back({dst.data() + 8, 8, nullptr});
    net::AbortSignal abort;
    spec.abort = &abort;
    WriteAll(p.peer.get(), Encode({.length = 8, .seq = 0}, "abcdefgh"));
    if (all_sent) WriteAll(p.peer.get(), Encode({.length = 8, .seq = 1}, "ijklmnop"));
    abort.Fire();  // before the engine looks: the pieces wait in the socket
    Status s = RunTransfer(spec);
    const std::string got(reinterpret_cast<const char*>(dst.data()), all_sent ? 16 : 8);
    if (all_sent) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      EXPECT_EQ(got, "abcdefghijklmnop");
    } else {
      EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
      EXPECT_EQ(got, "abcdefgh") << "the piece that came was taken first";
    }
  }
  // A sender whose pieces fit the socket writes them all: its receiver completes, and so does it.
  Pair p;
  const std::string piece = "a piece that still goes";
  TransferSpec spec = CheckedSpec();
  spec.checksum = false;
  spec.retry = false;
  spec.send_to = &p.conn;
  spec.send_peer = "the test";
  spec.sends.push_back({reinterpret_cast<const std::byte*>(piece.data()), piece.size(), -1});
  net::AbortSignal abort;
  spec.abort = &abort;
  abort.Fire();
  Status s = RunTransfer(spec);
  EXPECT_TRUE(s.ok()) << s.ToString();
  Frame f = ReadHeader(p.peer.get());
  EXPECT_EQ(f.type, kFrameData);
  EXPECT_EQ(ReadExactly(p.peer.get(), f.length), piece);
}

// Control frames that answer nothing, or that lie, are protocol violations: INTERNAL, naming the
// frame, and the connection is reported broken (the mesh drops it: no frame boundary can be
// trusted after). A resend or ack of an older generation is a stale frame: dropped.
TEST(TransferTest, ControlFramesThatAnswerNothingAreRefusedAndStaleOnesDropped) {
  struct Case {
    const char* what;
    Frame frame;
    bool sender;  // this side sends one piece (else it receives one)
  };
  const Case cases[] = {
      {"an ack to a receiver", {.type = kFrameAck, .seq = 1}, false},
      {"an ack of another count", {.type = kFrameAck, .seq = 9}, true},
      {"a resend of a piece not sent", {.type = kFrameResend, .seq = 4}, true},
      {"a control frame with a payload", {.length = 5, .type = kFrameResend, .seq = 0}, true},
      {"a control frame of another op", {.type = kFrameAck, .op = kOp + 1, .seq = 1}, true},
  };
  for (const Case& c : cases) {
    Pair p;
    std::vector<std::byte> buf(8);
    TransferSpec spec = CheckedSpec();
    if (c.sender) {
      spec.send_to = &p.conn;
      spec.sends.push_back({buf.data(), buf.size(), -1});
    } else {
      spec.recv_from = &p.conn;
      spec.recvs.push_back({buf.data(), buf.size(), nullptr});
    }
    TransferStats stats;
    auto result = std::async(std::launch::async, [&] { return RunTransfer(spec, &stats); });
    if (c.sender) ReadExactly(p.peer.get(), kDataHeaderBytes + buf.size());
    WriteAll(p.peer.get(), Encode(c.frame, std::string(c.frame.length, 'z')));
    Status s = result.get();
    EXPECT_EQ(s.code(), StatusCode::kInternal) << c.what << ": " << s.ToString();
    EXPECT_EQ(stats.failed_peer, 5) << c.what;
    EXPECT_EQ(p.conn.recv_skip, 0u) << c.what << ": nothing to resume on a dropped connection";
  }

  Pair p;
  std::vector<std::byte> buf(8);
  TransferSpec spec = CheckedSpec();
  spec.recv_from = &p.conn;
  spec.recvs.push_back({buf.data(), buf.size(), nullptr});
  TransferStats stats;
  auto result = std::async(std::launch::async, [&] { return RunTransfer(spec, &stats); });
  const std::string payload(8, 'q');
  WriteAll(
      p.peer.get(),
      Encode({.type = kFrameAck, .generation = kGen - 1, .seq = 2}) +
          Encode({.length = 8, .flags = kDataFlagChecksum | kDataFlagRetry, .crc = Crc32c(payload)},
                 payload));
  Frame ack = ReadHeader(p.peer.get());
  EXPECT_EQ(ack.type, kFrameAck);
  EXPECT_EQ(ack.seq, 1u);
  Status s = result.get();
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(stats.stale_frames_dropped, 1u);
  EXPECT_EQ(std::memcmp(buf.data(), payload.data(), 8), 0);
}

}  // namespace
}  // namespace nonstop::collective
