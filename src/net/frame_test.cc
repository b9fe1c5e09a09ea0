#include "net/frame.h"

#include <gtest/gtest.h>

#include "common/coding.h"

namespace nonstop::net {
namespace {

TEST(FramingTest, DecodesFramesSplitAtEveryByte) {
  std::string stream =
      EncodeFrame(7, "hello") + EncodeFrame(9, "") + EncodeFrame(3, std::string(1000, 'x'));
  FrameDecoder dec;
  for (char c : stream) ASSERT_TRUE(dec.Feed(std::string_view(&c, 1)).ok());
  auto a = dec.Next();
  auto b = dec.Next();
  auto c = dec.Next();
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(a->type, 7);
  EXPECT_EQ(a->payload, "hello");
  EXPECT_EQ(b->type, 9);
  EXPECT_EQ(b->payload, "");
  EXPECT_EQ(c->payload.size(), 1000u);
  EXPECT_FALSE(dec.Next());
}

TEST(FramingTest, ChecksumMismatchIsDataLoss) {
  std::string bytes = EncodeFrame(7, "payload");
  bytes.back() ^= 1;
  FrameDecoder dec;
  Status s = dec.Feed(bytes);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("checksum"), std::string::npos) << s.ToString();
}

TEST(FramingTest, OversizedLengthIsRejectedBeforeBuffering) {
  std::string garbage = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  FrameDecoder dec;
  Status s = dec.Feed(garbage);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("exceeds the limit"), std::string::npos) << s.ToString();
}

// A decoder that failed keeps failing, and delivers no frame twice: it used
// to keep the bytes of the frames it had already delivered when a later
// frame in the same Feed failed, and decoded them again on the next Feed.
TEST(FramingTest, FeedAfterAnErrorKeepsFailingWithoutRedeliveringFrames) {
  std::string bad = EncodeFrame(8, "second");
  bad.back() ^= 1;
  FrameDecoder dec;
  Status first = dec.Feed(EncodeFrame(7, "first") + bad);
  EXPECT_EQ(first.code(), StatusCode::kDataLoss);
  Status again = dec.Feed(EncodeFrame(9, "third"));
  EXPECT_EQ(again.code(), StatusCode::kDataLoss) << again.ToString();
  EXPECT_EQ(again.message(), first.message());
  auto f = dec.Next();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->payload, "first");
  EXPECT_FALSE(dec.Next()) << "a frame was delivered twice";
}

}  // namespace
}  // namespace nonstop::net
