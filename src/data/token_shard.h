// Token shards: memory-mapped files of uint16 tokens, validated when opened.
// Two formats (docs/formats.md):
//   nonstop  64-byte header: magic "NSTOKSHD", u32 version (1), u32 token
//            bytes (2), u64 token count, u32 vocab size, u32 CRC-32C of the
//            tokens, u32 CRC-32C of the header's first 32 bytes, zero padding;
//            then the tokens, little-endian uint16.
//   llm.c    256 int32 header: magic 20240520, version 1, token count; then
//            uint16 tokens.
// A truncated, padded, foreign or corrupt file is refused with a DATA_LOSS or
// INVALID_ARGUMENT status that names the file, the header field that was
// wrong and the sizes involved. Shards are untrusted input: every size is
// checked against the file's size with arithmetic that cannot overflow.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "data/mapped_file.h"
#include "nonstop/status.h"

namespace nonstop::data {

inline constexpr char kShardMagic[8] = {'N', 'S', 'T', 'O', 'K', 'S', 'H', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;
inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

enum class ShardFormat { kNonstop, kLlmc };

// What a validated shard header says about the bytes that follow it.
struct TokenShardHeader {
  ShardFormat format = ShardFormat::kNonstop;
  uint32_t vocab_size = 0;   // 0 when the format does not say (llm.c)
  uint64_t token_count = 0;  // tokens in the file
  size_t token_offset = 0;   // bytes before the first token (the header's size)
};

// Validates a whole shard file held in memory: the magic, every header field,
// the file size against the token count (exactly: no truncation, no trailing
// bytes) and, for the nonstop format, the header and token CRC-32Cs. Pure and
// bounded: it reads nothing outside `file_bytes`, whatever they hold (a fuzz
// target). Messages name the field and the sizes but not the file; callers
// add that (TokenShard::Open does).
Result<TokenShardHeader> ParseTokenShardHeader(std::span<const std::byte> file_bytes);

class TokenShard {
 public:
  static Result<std::unique_ptr<TokenShard>> Open(const std::string& path);

  std::span<const uint16_t> tokens() const { return tokens_; }
  ShardFormat format() const { return format_; }
  uint32_t vocab_size() const { return vocab_size_; }  // 0 when the format does not say (llm.c)
  const std::string& path() const { return file_->path(); }

 private:
  std::unique_ptr<MappedFile> file_;
  std::span<const uint16_t> tokens_;
  ShardFormat format_ = ShardFormat::kNonstop;
  uint32_t vocab_size_ = 0;
};

// Encodes a nonstop-format shard (header + tokens) in memory.
std::string EncodeShard(std::span<const uint16_t> tokens, uint32_t vocab_size);

// Writes a shard atomically: a temporary file, fsync, rename, fsync of the directory.
Status WriteShardFile(const std::string& path, std::span<const uint16_t> tokens,
                      uint32_t vocab_size);

}  // namespace nonstop::data
