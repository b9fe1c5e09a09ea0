// Fuzz target: token shard validation (src/data/token_shard.h), both formats
// (nonstop and llm.c), through the pure ParseTokenShardHeader that
// TokenShard::Open runs on the mapped file. Shards come from disk and may be
// truncated, foreign or corrupt.
//
// Checked: no crash, leak or UB; a refusal is DATA_LOSS or INVALID_ARGUMENT
// with a message; an accepted header describes tokens that fill the rest of
// the file exactly (what Open maps them from), and all of them are read.
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/check.h"
#include "common/coding.h"
#include "data/token_shard.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using nonstop::data::ShardFormat;
  const auto bytes = std::as_bytes(std::span(data, size));
  auto header = nonstop::data::ParseTokenShardHeader(bytes);
  if (!header.ok()) {
    auto code = header.status().code();
    NONSTOP_CHECK(code == nonstop::StatusCode::kDataLoss ||
                  code == nonstop::StatusCode::kInvalidArgument)
        << header.status().ToString();
    NONSTOP_CHECK(!header.status().message().empty());
    return 0;
  }
  const size_t want_offset = header->format == ShardFormat::kNonstop
                                 ? nonstop::data::kShardHeaderBytes
                                 : nonstop::data::kLlmcHeaderBytes;
  NONSTOP_CHECK_EQ(header->token_offset, want_offset);
  NONSTOP_CHECK_LE(header->token_offset, size);
  NONSTOP_CHECK_EQ(header->token_count, (size - header->token_offset) / 2)
      << "the tokens do not fill the file";
  NONSTOP_CHECK_EQ((size - header->token_offset) % 2, 0u) << "a trailing half token was accepted";
  if (header->format == ShardFormat::kLlmc) {
    NONSTOP_CHECK_EQ(header->vocab_size, 0u);
  }
  uint64_t sum = 0;
  const char* tokens = reinterpret_cast<const char*>(data) + header->token_offset;
  for (uint64_t i = 0; i < header->token_count; ++i) sum += nonstop::DecodeFixed16(tokens + 2 * i);
  NONSTOP_CHECK_LE(sum, uint64_t{65535} * header->token_count);
  return 0;
}
