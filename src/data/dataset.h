// Dataset: a set of token shards cut into fixed-length samples.
//
// Sample i is seq_len+1 consecutive tokens (inputs and shifted targets) from
// one shard; shard k contributes floor((tokens_k - 1) / seq_len) samples,
// taken at offsets 0, seq_len, 2·seq_len, … The shards are ordered by path,
// so the sample numbering depends only on the data.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "data/token_shard.h"

namespace nonstop::data {

class Dataset {
 public:
  // `pattern` is a directory (every *.bin inside) or a single shard path.
  static Result<std::unique_ptr<Dataset>> Open(const std::string& pattern, size_t seq_len);

  size_t num_samples() const { return total_samples_; }
  size_t seq_len() const { return seq_len_; }
  size_t num_shards() const { return shards_.size(); }
  uint64_t num_tokens() const { return num_tokens_; }
  uint32_t max_token() const { return max_token_; }

  // The seq_len+1 tokens of sample `index`.
  std::span<const uint16_t> Sample(size_t index) const;

 private:
  std::vector<std::unique_ptr<TokenShard>> shards_;
  std::vector<size_t> first_sample_;  // first global sample index of each shard
  size_t total_samples_ = 0;
  size_t seq_len_ = 0;
  uint64_t num_tokens_ = 0;
  uint32_t max_token_ = 0;
};

// Lists the shard files named by `pattern` (a directory or one file), sorted.
Result<std::vector<std::string>> ListShards(const std::string& pattern);

}  // namespace nonstop::data
