#include "data/token_shard.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "common/coding.h"
#include "common/crc32c.h"
#include "common/file_util.h"
#include "common/unique_fd.h"

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

Status WriteShardFile(const std::string& path, std::span<const uint16_t> tokens, uint32_t vocab_size) {
  return WriteFileAtomically(path, EncodeShard(tokens, vocab_size));
}

Result<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> file, MappedFile::Open(path));
  auto bytes = file->bytes();
  const char* p = reinterpret_cast<const char*>(bytes.data());
  auto shard = std::unique_ptr<TokenShard>(new TokenShard());
  const std::string hint = " (HINT: recreate it with `nonstop data prepare`)";

  if (bytes.size() >= sizeof(kShardMagic) && std::memcmp(p, kShardMagic, sizeof(kShardMagic)) == 0) {
    if (bytes.size() < kShardHeaderBytes) {
      return DataLossError(fmt::format("shard {} is truncated: {} bytes, shorter than its {}-byte header{}", path,
                                       bytes.size(), kShardHeaderBytes, hint));
    }
    uint32_t version = DecodeFixed32(p + 8);
    uint32_t token_bytes = DecodeFixed32(p + 12);
    uint64_t count = DecodeFixed64(p + 16);
    uint32_t vocab = DecodeFixed32(p + 24);
    uint32_t data_crc = DecodeFixed32(p + 28);
    uint32_t header_crc = DecodeFixed32(p + 32);
    if (Crc32c(p, 32) != header_crc) return DataLossError(fmt::format("shard {} has a corrupt header (checksum mismatch){}", path, hint));
    if (version != kShardVersion) {
      return InvalidArgumentError(fmt::format("shard {} has format version {}; this build reads version {}", path,
                                              version, kShardVersion));
    }
    if (token_bytes != 2) return InvalidArgumentError(fmt::format("shard {} stores {}-byte tokens; only 2 is supported", path, token_bytes));
    uint64_t want = kShardHeaderBytes + count * 2;
    if (bytes.size() != want) {
      return DataLossError(fmt::format("shard {} is {} bytes but its header promises {} tokens ({} bytes): {}{}", path,
                                       bytes.size(), count, want, bytes.size() < want ? "truncated" : "trailing bytes", hint));
    }
    if (Crc32c(p + kShardHeaderBytes, count * 2) != data_crc) {
      return DataLossError(fmt::format("shard {}: tokens fail their checksum (the file is corrupt){}", path, hint));
    }
    shard->format_ = ShardFormat::kNonstop;
    shard->vocab_size_ = vocab;
    shard->tokens_ = {reinterpret_cast<const uint16_t*>(p + kShardHeaderBytes), static_cast<size_t>(count)};
  } else if (bytes.size() >= 4 && static_cast<int32_t>(DecodeFixed32(p)) == kLlmcMagic) {
    if (bytes.size() < kLlmcHeaderBytes) {
      return DataLossError(fmt::format("llm.c shard {} is truncated: {} bytes, shorter than its 1024-byte header", path, bytes.size()));
    }
    int32_t version = static_cast<int32_t>(DecodeFixed32(p + 4));
    int32_t count = static_cast<int32_t>(DecodeFixed32(p + 8));
    if (version != 1) return InvalidArgumentError(fmt::format("llm.c shard {} has version {}; only version 1 (uint16 tokens) is supported", path, version));
    if (count < 0) return DataLossError(fmt::format("llm.c shard {} has a negative token count {}", path, count));
    uint64_t want = kLlmcHeaderBytes + static_cast<uint64_t>(count) * 2;
    if (bytes.size() != want) {
      return DataLossError(fmt::format("llm.c shard {} is {} bytes but its header promises {} tokens ({} bytes)", path,
                                       bytes.size(), count, want));
    }
    shard->format_ = ShardFormat::kLlmc;
    shard->tokens_ = {reinterpret_cast<const uint16_t*>(p + kLlmcHeaderBytes), static_cast<size_t>(count)};
  } else {
    return InvalidArgumentError(fmt::format("{} is not a token shard: it starts with neither the nonstop magic "
                                            "\"NSTOKSHD\" nor the llm.c magic 20240520{}", path, hint));
  }
  static_assert(std::endian::native == std::endian::little, "tokens are mapped in place: little-endian hosts only");
  shard->file_ = std::move(file);
  return shard;
}

}  // namespace nonstop::data
