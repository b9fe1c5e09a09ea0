#include "nonstop/data.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "data/token_shard.h"

namespace nonstop::data {

Result<std::vector<std::string>> ListShards(const std::string& pattern) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> out;
  if (fs::is_directory(pattern, ec)) {
    for (const auto& e : fs::directory_iterator(pattern, ec)) {
      if (e.is_regular_file() && e.path().extension() == ".bin") out.push_back(e.path().string());
    }
    std::sort(out.begin(), out.end());
    if (out.empty())
      return NotFoundError(fmt::format(
          "no *.bin shards in directory {} (HINT: run `nonstop data prepare`)", pattern));
  } else if (fs::exists(pattern, ec)) {
    out.push_back(pattern);
  } else {
    return NotFoundError(
        fmt::format("data path {} does not exist (HINT: run `nonstop data prepare`)", pattern));
  }
  return out;
}

Dataset::~Dataset() = default;

Result<std::unique_ptr<Dataset>> Dataset::Open(const std::string& pattern, size_t seq_len) {
  if (seq_len == 0) return InvalidArgumentError("seq_len must be positive");
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> paths, ListShards(pattern));
  auto ds = std::unique_ptr<Dataset>(new Dataset());
  ds->seq_len_ = seq_len;
  for (const auto& path : paths) {
    NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard, TokenShard::Open(path));
    size_t n = shard->tokens().size();
    size_t samples = n > 0 ? (n - 1) / seq_len : 0;
    ds->first_sample_.push_back(ds->total_samples_);
    ds->total_samples_ += samples;
    ds->num_tokens_ += n;
    for (uint16_t t : shard->tokens()) ds->max_token_ = std::max<uint32_t>(ds->max_token_, t);
    ds->shards_.push_back(std::move(shard));
  }
  if (ds->total_samples_ == 0) {
    // seq_len + 1 tokens per sample, written so that no seq_len can wrap it around.
    return InvalidArgumentError(
        fmt::format("data {} has {} tokens: too few for one sample of seq_len {} + 1 tokens",
                    pattern, ds->num_tokens_, seq_len));
  }
  return ds;
}

std::span<const uint16_t> Dataset::Sample(size_t index) const {
  NONSTOP_CHECK_LT(index, total_samples_);
  auto it = std::upper_bound(first_sample_.begin(), first_sample_.end(), index);
  size_t shard = static_cast<size_t>(it - first_sample_.begin()) - 1;
  size_t local = index - first_sample_[shard];
  return shards_[shard]->tokens().subspan(local * seq_len_, seq_len_ + 1);
}

}  // namespace nonstop::data
