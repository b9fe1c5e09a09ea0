#include "data/token_shard.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "common/coding.h"
#include "common/file_util.h"
#include "common/unique_fd.h"
#include "nonstop/crc32c.h"

namespace nonstop::data {

std::string EncodeShard(std::span<const uint16_t> tokens, uint32_t vocab_size) {
  std::string out;
  out.reserve(kShardHeaderBytes + tokens.size() * 2);
  out.append(kShardMagic, sizeof(kShardMagic));
  PutFixed32(&out, kShardVersion);
  PutFixed32(&out, 2);
  PutFixed64(&out, tokens.size());
  PutFixed32(&out, vocab_size);
  std::string body;
  body.reserve(tokens.size() * 2);
  for (uint16_t t : tokens) PutFixed16(&body, t);
  PutFixed32(&out, Crc32c(body));
  PutFixed32(&out, Crc32c(out.data(), 32));
  out.resize(kShardHeaderBytes, '\0');
  out += body;
  return out;
}

Status WriteShardFile(const std::string& path, std::span<const uint16_t> tokens,
                      uint32_t vocab_size) {
  return WriteFileAtomically(path, EncodeShard(tokens, vocab_size));
}

namespace {

constexpr char kHint[] = " (HINT: recreate it with `nonstop data prepare`)";

// The file size a header that promises `count` tokens of `token_bytes` bytes
// after `header_bytes` implies, or nullopt if that does not fit in 64 bits.
std::optional<uint64_t> ImpliedFileSize(uint64_t header_bytes, uint64_t count,
                                        uint64_t token_bytes) {
  if (count > (UINT64_MAX - header_bytes) / token_bytes) return std::nullopt;
  return header_bytes + count * token_bytes;
}

// The exact-size check shared by both formats.
Status CheckFileSize(std::string_view format, uint64_t file_size, uint64_t header_bytes,
                     uint64_t count) {
  std::optional<uint64_t> want = ImpliedFileSize(header_bytes, count, 2);
  if (!want) {
    return DataLossError(
        fmt::format("{} header has token count {}, which would need more than 2^64 bytes; the file "
                    "is {} bytes (at most {} tokens){}",
                    format, count, file_size,
                    file_size < header_bytes ? 0 : (file_size - header_bytes) / 2, kHint));
  }
  if (file_size != *want) {
    return DataLossError(fmt::format(
        "{} header has token count {} ({} bytes with the {}-byte header) but the file is "
        "{} bytes: {}{}",
        format, count, *want, header_bytes, file_size,
        file_size < *want ? "truncated" : "trailing bytes", kHint));
  }
  return OkStatus();
}

Result<TokenShardHeader> ParseNonstopHeader(std::span<const std::byte> bytes) {
  const char* p = reinterpret_cast<const char*>(bytes.data());
  if (bytes.size() < kShardHeaderBytes) {
    return DataLossError(fmt::format("truncated: {} bytes, shorter than its {}-byte header{}",
                                     bytes.size(), kShardHeaderBytes, kHint));
  }
  uint32_t version = DecodeFixed32(p + 8);
  uint32_t token_bytes = DecodeFixed32(p + 12);
  uint64_t count = DecodeFixed64(p + 16);
  uint32_t vocab = DecodeFixed32(p + 24);
  uint32_t data_crc = DecodeFixed32(p + 28);
  uint32_t header_crc = DecodeFixed32(p + 32);
  uint32_t got_header_crc = Crc32c(p, 32);
  if (got_header_crc != header_crc) {
    return DataLossError(
        fmt::format("corrupt header: bytes 0..31 have CRC-32C {:08x}, the header CRC field says "
                    "{:08x}{}",
                    got_header_crc, header_crc, kHint));
  }
  for (size_t i = 36; i < kShardHeaderBytes; ++i) {
    if (p[i] != 0) {
      return DataLossError(
          fmt::format("corrupt header: reserved header byte {} (of bytes 36..63, all zero) is {}{}",
                      i, static_cast<int>(static_cast<unsigned char>(p[i])), kHint));
    }
  }
  if (version != kShardVersion) {
    return InvalidArgumentError(
        fmt::format("format version {}; this build reads version {}", version, kShardVersion));
  }
  if (token_bytes != 2) {
    return InvalidArgumentError(fmt::format(
        "header field bytes per token is {}; only 2 (uint16 tokens) is supported", token_bytes));
  }
  NONSTOP_RETURN_IF_ERROR(CheckFileSize("nonstop", bytes.size(), kShardHeaderBytes, count));
  // count·2 == bytes.size() - 64 now, so the token bytes lie inside the span.
  size_t data_bytes = bytes.size() - kShardHeaderBytes;
  uint32_t got_data_crc = Crc32c(p + kShardHeaderBytes, data_bytes);
  if (got_data_crc != data_crc) {
    return DataLossError(
        fmt::format("tokens fail their checksum (CRC-32C {:08x} over {} bytes, the header says "
                    "{:08x}): the file is corrupt{}",
                    got_data_crc, data_bytes, data_crc, kHint));
  }
  return TokenShardHeader{ShardFormat::kNonstop, vocab, count, kShardHeaderBytes};
}

Result<TokenShardHeader> ParseLlmcHeader(std::span<const std::byte> bytes) {
  const char* p = reinterpret_cast<const char*>(bytes.data());
  if (bytes.size() < kLlmcHeaderBytes) {
    return DataLossError(
        fmt::format("llm.c shard truncated: {} bytes, shorter than its {}-byte header",
                    bytes.size(), kLlmcHeaderBytes));
  }
  auto version = static_cast<int32_t>(DecodeFixed32(p + 4));
  auto count = static_cast<int32_t>(DecodeFixed32(p + 8));
  if (version != 1) {
    return InvalidArgumentError(fmt::format(
        "llm.c shard version {}; only version 1 (uint16 tokens) is supported", version));
  }
  if (count < 0)
    return DataLossError(fmt::format("llm.c header has a negative token count {}", count));
  NONSTOP_RETURN_IF_ERROR(
      CheckFileSize("llm.c", bytes.size(), kLlmcHeaderBytes, static_cast<uint64_t>(count)));
  return TokenShardHeader{ShardFormat::kLlmc, 0, static_cast<uint64_t>(count), kLlmcHeaderBytes};
}

}  // namespace

Result<TokenShardHeader> ParseTokenShardHeader(std::span<const std::byte> file_bytes) {
  const char* p = reinterpret_cast<const char*>(file_bytes.data());
  if (file_bytes.size() >= sizeof(kShardMagic) &&
      std::memcmp(p, kShardMagic, sizeof(kShardMagic)) == 0) {
    return ParseNonstopHeader(file_bytes);
  }
  if (file_bytes.size() >= 4 && static_cast<int32_t>(DecodeFixed32(p)) == kLlmcMagic) {
    return ParseLlmcHeader(file_bytes);
  }
  return InvalidArgumentError(
      fmt::format("not a token shard: it starts with neither the nonstop magic \"NSTOKSHD\" "
                  "nor the llm.c magic 20240520{}",
                  kHint));
}

Result<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  auto parsed = ParseTokenShardHeader(file->bytes());
  if (!parsed.ok()) return parsed.status().WithContext("shard " + path);
  static_assert(std::endian::native == std::endian::little,
                "tokens are mapped in place: little-endian hosts only");
  auto shard = std::unique_ptr<TokenShard>(new TokenShard());
  shard->format_ = parsed->format;
  shard->vocab_size_ = parsed->vocab_size;
  // The parser proved token_offset + 2·token_count == the file's size.
  shard->tokens_ = {reinterpret_cast<const uint16_t*>(file->bytes().data() + parsed->token_offset),
                    static_cast<size_t>(parsed->token_count)};
  shard->file_ = std::move(file);
  return shard;
}

}  // namespace nonstop::data
