#include "data/token_shard.h"

#include <gtest/gtest.h>

#include <fstream>

#include "common/coding.h"
#include "common/temp_dir.h"
#include "nonstop/crc32c.h"
#include "nonstop/data.h"

namespace nonstop::data {
namespace {

void WriteRaw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(TokenShardTest, RoundTripsTokens) {
  TempDir dir;
  std::vector<uint16_t> tokens = {1, 2, 300, 65535, 0};
  ASSERT_TRUE(WriteShardFile(dir / "a.bin", tokens, 70000).ok());
  auto shard = TokenShard::Open(dir / "a.bin");
  ASSERT_TRUE(shard.ok()) << shard.status().ToString();
  EXPECT_EQ(std::vector<uint16_t>((*shard)->tokens().begin(), (*shard)->tokens().end()), tokens);
  EXPECT_EQ((*shard)->format(), ShardFormat::kNonstop);
}

TEST(TokenShardTest, TruncatedShardIsDataLossNamingTheFile) {
  TempDir dir;
  std::vector<uint16_t> tokens(100, 7);
  std::string bytes = EncodeShard(tokens, 256);
  WriteRaw(dir / "t.bin", bytes.substr(0, bytes.size() - 3));
  auto shard = TokenShard::Open(dir / "t.bin");
  ASSERT_FALSE(shard.ok());
  EXPECT_EQ(shard.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(shard.status().message().find("t.bin"), std::string::npos);
  EXPECT_NE(shard.status().message().find("truncated"), std::string::npos)
      << shard.status().ToString();
}

TEST(TokenShardTest, FlippedTokenByteFailsChecksum) {
  TempDir dir;
  std::vector<uint16_t> tokens(100, 7);
  std::string bytes = EncodeShard(tokens, 256);
  bytes[kShardHeaderBytes + 10] ^= 0x40;
  WriteRaw(dir / "c.bin", bytes);
  auto shard = TokenShard::Open(dir / "c.bin");
  ASSERT_FALSE(shard.ok());
  EXPECT_EQ(shard.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(shard.status().message().find("checksum"), std::string::npos);
}

TEST(TokenShardTest, ForeignFileIsRefused) {
  TempDir dir;
  WriteRaw(dir / "f.bin", "#!/bin/sh\necho not a shard\n");
  auto shard = TokenShard::Open(dir / "f.bin");
  ASSERT_FALSE(shard.ok());
  EXPECT_EQ(shard.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shard.status().message().find("not a token shard"), std::string::npos);
}

std::string LlmcShard(const std::vector<uint16_t>& tokens, int32_t version = 1) {
  std::string out(kLlmcHeaderBytes, '\0');
  EncodeFixed32(out.data(), static_cast<uint32_t>(kLlmcMagic));
  EncodeFixed32(out.data() + 4, static_cast<uint32_t>(version));
  EncodeFixed32(out.data() + 8, static_cast<uint32_t>(tokens.size()));
  for (uint16_t t : tokens) PutFixed16(&out, t);
  return out;
}

TEST(TokenShardTest, ReadsLlmcFormat) {
  TempDir dir;
  std::vector<uint16_t> tokens = {50256, 15496, 11, 995};
  WriteRaw(dir / "fineweb_train_000001.bin", LlmcShard(tokens));
  auto shard = TokenShard::Open(dir / "fineweb_train_000001.bin");
  ASSERT_TRUE(shard.ok()) << shard.status().ToString();
  EXPECT_EQ((*shard)->format(), ShardFormat::kLlmc);
  EXPECT_EQ(std::vector<uint16_t>((*shard)->tokens().begin(), (*shard)->tokens().end()), tokens);
}

TEST(TokenShardTest, LlmcWithWrongCountOrVersionIsRefused) {
  TempDir dir;
  std::string bytes = LlmcShard({1, 2, 3});
  WriteRaw(dir / "short.bin", bytes.substr(0, bytes.size() - 2));
  EXPECT_EQ(TokenShard::Open(dir / "short.bin").status().code(), StatusCode::kDataLoss);
  WriteRaw(dir / "v2.bin", LlmcShard({1, 2, 3}, 2));
  EXPECT_EQ(TokenShard::Open(dir / "v2.bin").status().code(), StatusCode::kInvalidArgument);
}

// A nonstop shard whose header fields are rewritten, with the header CRC made
// right again: only the field checks can refuse it.
std::string CraftedShard(std::vector<uint16_t> tokens, uint64_t count, uint32_t token_bytes = 2) {
  std::string bytes = EncodeShard(tokens, 256);
  EncodeFixed32(bytes.data() + 12, token_bytes);
  EncodeFixed64(bytes.data() + 16, count);
  EncodeFixed32(bytes.data() + 32, Crc32c(bytes.data(), 32));
  return bytes;
}

TEST(TokenShardTest, CountWhoseByteSizeOverflowsIsRefused) {
  // count·2 wraps around 2^64 to exactly the 100 token bytes the file holds:
  // an unchecked multiplication accepts a span of 2^63+50 tokens.
  TempDir dir;
  std::vector<uint16_t> tokens(50, 7);
  WriteRaw(dir / "wrap.bin", CraftedShard(tokens, (uint64_t{1} << 63) + 50));
  auto shard = TokenShard::Open(dir / "wrap.bin");
  ASSERT_FALSE(shard.ok()) << "accepted " << (*shard)->tokens().size()
                           << " tokens from a 164-byte file";
  EXPECT_EQ(shard.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(shard.status().message().find("wrap.bin"), std::string::npos)
      << shard.status().ToString();
  EXPECT_NE(shard.status().message().find("token count"), std::string::npos)
      << shard.status().ToString();
  EXPECT_NE(shard.status().message().find("164"), std::string::npos)
      << "names the file size: " << shard.status().ToString();
}

TEST(TokenShardTest, HugeCountIsRefusedNamingTheFieldAndSizes) {
  TempDir dir;
  std::vector<uint16_t> tokens(50, 7);
  WriteRaw(dir / "huge.bin", CraftedShard(tokens, uint64_t{1} << 40));
  auto shard = TokenShard::Open(dir / "huge.bin");
  ASSERT_FALSE(shard.ok());
  EXPECT_EQ(shard.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(shard.status().message().find("huge.bin"), std::string::npos)
      << shard.status().ToString();
  EXPECT_NE(shard.status().message().find("token count 1099511627776"), std::string::npos)
      << shard.status().ToString();
  EXPECT_NE(shard.status().message().find("164 bytes"), std::string::npos)
      << shard.status().ToString();
}

TEST(TokenShardTest, NonzeroReservedHeaderBytesAreRefused) {
  TempDir dir;
  std::string bytes = EncodeShard(std::vector<uint16_t>(10, 1), 256);
  bytes[40] = 1;  // in the zero padding, outside the header CRC
  WriteRaw(dir / "pad.bin", bytes);
  auto shard = TokenShard::Open(dir / "pad.bin");
  ASSERT_FALSE(shard.ok());
  EXPECT_EQ(shard.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(shard.status().message().find("reserved"), std::string::npos)
      << shard.status().ToString();
}

std::span<const std::byte> AsBytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

TEST(TokenShardTest, ParseHeaderRefusesEveryTruncationOfAValidShard) {
  std::vector<uint16_t> tokens = {1, 2, 3, 4, 5, 6, 7};
  for (const std::string& whole : {EncodeShard(tokens, 256), LlmcShard(tokens)}) {
    ASSERT_TRUE(ParseTokenShardHeader(AsBytes(whole)).ok());
    for (size_t n = 0; n < whole.size(); ++n) {
      // A copy of exactly n bytes, so that a read past the span is a read past the allocation
      // (ASan).
      std::string prefix = whole.substr(0, n);
      auto parsed = ParseTokenShardHeader(AsBytes(prefix));
      EXPECT_FALSE(parsed.ok()) << "accepted a " << n << "-byte prefix of a " << whole.size()
                                << "-byte shard";
    }
  }
}

TEST(TokenShardTest, ParseHeaderDescribesTheTokens) {
  std::vector<uint16_t> tokens = {9, 8, 7};
  std::string bytes = EncodeShard(tokens, 300);
  auto h = ParseTokenShardHeader(AsBytes(bytes));
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->format, ShardFormat::kNonstop);
  EXPECT_EQ(h->token_count, 3u);
  EXPECT_EQ(h->token_offset, kShardHeaderBytes);
  EXPECT_EQ(h->vocab_size, 300u);
  std::string llmc = LlmcShard(tokens);
  auto l = ParseTokenShardHeader(AsBytes(llmc));
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->format, ShardFormat::kLlmc);
  EXPECT_EQ(l->token_count, 3u);
  EXPECT_EQ(l->token_offset, kLlmcHeaderBytes);
}

TEST(TokenShardTest, WrongTokenWidthIsRefusedNamingTheField) {
  TempDir dir;
  WriteRaw(dir / "w.bin", CraftedShard(std::vector<uint16_t>(4, 1), 4, /*token_bytes=*/4));
  auto shard = TokenShard::Open(dir / "w.bin");
  ASSERT_FALSE(shard.ok());
  EXPECT_EQ(shard.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(shard.status().message().find("bytes per token"), std::string::npos)
      << shard.status().ToString();
}

TEST(PrepareTest, TextBecomesByteTokensAcrossShards) {
  TempDir dir;
  std::string in_dir = dir / "in";
  std::filesystem::create_directories(in_dir);
  WriteRaw(in_dir + "/a", "Hello\n%\nWorld\n");
  WriteRaw(in_dir + "/a.dat", std::string("\0\1\2", 3));
  WriteRaw(in_dir + "/b", std::string("bin\0ary", 7));
  PrepareOptions o{
      {in_dir}, dir / "out", /*tokens_per_shard=*/5, /*strip_fortune_separators=*/true};
  auto report = PrepareShards(o);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_EQ(report->files_read, 1u);
  EXPECT_EQ(report->skipped.size(), 2u);
  EXPECT_EQ(report->tokens, std::string("Hello\n\nWorld\n").size());
  EXPECT_EQ(report->shards, 3u);
  auto ds = Dataset::Open(dir / "out", 1);
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  EXPECT_EQ((*ds)->num_tokens(), report->tokens);
  std::string back;
  auto first = TokenShard::Open(dir / "out/shard_000000.bin");
  ASSERT_TRUE(first.ok());
  for (uint16_t t : (*first)->tokens()) back += static_cast<char>(t);
  EXPECT_EQ(back, "Hello");
  EXPECT_TRUE(std::filesystem::exists(dir / "out/manifest.json"));
}

TEST(DatasetTest, SamplesAreConsecutiveWindows) {
  TempDir dir;
  std::vector<uint16_t> a(21), b(10);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint16_t>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(100 + i);
  ASSERT_TRUE(WriteShardFile(dir / "s0.bin", a, 256).ok());
  ASSERT_TRUE(WriteShardFile(dir / "s1.bin", b, 256).ok());
  auto ds = Dataset::Open(dir.path(), 4);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ((*ds)->num_samples(), 5u + 2u);  // (21-1)/4 + (10-1)/4
  auto s1 = (*ds)->Sample(1);
  EXPECT_EQ(std::vector<uint16_t>(s1.begin(), s1.end()), (std::vector<uint16_t>{4, 5, 6, 7, 8}));
  auto s5 = (*ds)->Sample(5);
  EXPECT_EQ(s5[0], 100);
}

TEST(DatasetTest, SeqLenLongerThanTheDataIsRefusedNamingIt) {
  TempDir dir;
  ASSERT_TRUE(WriteShardFile(dir / "s0.bin", std::vector<uint16_t>(50, 1), 256).ok());
  for (size_t seq_len : {size_t{50}, SIZE_MAX}) {
    auto ds = Dataset::Open(dir.path(), seq_len);
    ASSERT_FALSE(ds.ok());
    EXPECT_EQ(ds.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(ds.status().message().find("seq_len " + std::to_string(seq_len) + " + 1"),
              std::string::npos)
        << ds.status().ToString();
  }
}

TEST(DatasetTest, CorruptShardInDirectoryFailsOpen) {
  TempDir dir;
  ASSERT_TRUE(WriteShardFile(dir / "s0.bin", std::vector<uint16_t>(50, 1), 256).ok());
  WriteRaw(dir / "s1.bin", "garbage garbage garbage");
  auto ds = Dataset::Open(dir.path(), 4);
  ASSERT_FALSE(ds.ok());
  EXPECT_NE(ds.status().message().find("s1.bin"), std::string::npos);
}

}  // namespace
}  // namespace nonstop::data
