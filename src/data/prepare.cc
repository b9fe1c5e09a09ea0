#include "nonstop/data.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/file_util.h"
#include "common/unique_fd.h"
#include "data/token_shard.h"

namespace nonstop::data {

namespace fs = std::filesystem;

namespace {

Result<std::vector<std::string>> ExpandInputs(const std::vector<std::string>& inputs,
                                              PrepareReport* report) {
  std::vector<std::string> files;
  for (const auto& input : inputs) {
    std::error_code ec;
    if (fs::is_directory(input, ec)) {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(input, ec)) {
        if (e.is_symlink()) {
          report->skipped.push_back(e.path().string() + ": symbolic link");
        } else if (!e.is_regular_file()) {
          continue;
        } else if (e.path().extension() == ".dat") {
          report->skipped.push_back(e.path().string() + ": .dat index file");
        } else {
          found.push_back(e.path().string());
        }
      }
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::is_regular_file(input, ec)) {
      files.push_back(input);
    } else {
      return NotFoundError(fmt::format("input {} is neither a file nor a directory", input));
    }
  }
  return files;
}

std::string StripFortuneSeparators(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line == "%") {
      out += '\n';
      continue;
    }
    out += line;
    out += '\n';
  }
  return out;
}

}  // namespace

Result<PrepareReport> PrepareShards(const PrepareOptions& options,
                                    const PrepareProgress& progress) {
  if (options.output_dir.empty())
    return InvalidArgumentError("prepare: an output directory is required");
  if (options.inputs.empty())
    return InvalidArgumentError("prepare: at least one input file or directory is required");
  if (options.tokens_per_shard == 0)
    return InvalidArgumentError("prepare: tokens_per_shard must be positive");
  PrepareReport report;
  NONSTOP_ASSIGN_OR_RETURN(std::vector<std::string> files, ExpandInputs(options.inputs, &report));
  std::error_code ec;
  fs::create_directories(options.output_dir, ec);
  if (ec)
    return UnavailableError(fmt::format("cannot create {}: {}", options.output_dir, ec.message()));

  std::vector<uint16_t> pending;
  auto flush = [&](bool final) -> Status {
    while (pending.size() >= options.tokens_per_shard || (final && !pending.empty())) {
      size_t n = std::min<size_t>(pending.size(), options.tokens_per_shard);
      std::string path = fmt::format("{}/shard_{:06}.bin", options.output_dir, report.shards);
      NONSTOP_RETURN_IF_ERROR(WriteShardFile(path, std::span(pending.data(), n), 256));
      pending.erase(pending.begin(), pending.begin() + static_cast<ptrdiff_t>(n));
      ++report.shards;
      if (progress) progress(fmt::format("wrote {} ({} tokens)", path, n));
    }
    return OkStatus();
  };

  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      report.skipped.push_back(file + ": cannot be read");
      continue;
    }
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.find('\0') != std::string::npos) {
      report.skipped.push_back(file + ": binary (holds NUL bytes)");
      continue;
    }
    if (options.strip_fortune_separators) text = StripFortuneSeparators(text);
    for (unsigned char c : text) pending.push_back(c);
    report.tokens += text.size();
    ++report.files_read;
    NONSTOP_RETURN_IF_ERROR(flush(false));
  }
  NONSTOP_RETURN_IF_ERROR(flush(true));
  if (report.tokens == 0) return InvalidArgumentError("prepare: the inputs hold no text");

  nlohmann::json manifest = {
      {"format", "nonstop-token-shards"},
      {"version", 1},
      {"tokenizer", "byte"},
      {"vocab_size", 256},
      {"shards", report.shards},
      {"tokens", report.tokens},
      {"files", report.files_read},
      {"inputs", options.inputs},
  };
  NONSTOP_RETURN_IF_ERROR(
      WriteFileAtomically(options.output_dir + "/manifest.json", manifest.dump(2) + "\n"));
  return report;
}

Result<bool> PrepareIfMissing(const PrepareOptions& options, const PrepareProgress& progress) {
  std::error_code ec;
  fs::create_directories(options.output_dir, ec);
  if (ec)
    return UnavailableError(fmt::format("cannot create {}: {}", options.output_dir, ec.message()));
  std::string lock_path = options.output_dir + "/.lock";
  UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!lock.valid()) return ErrnoStatus(StatusCode::kUnavailable, "open " + lock_path, errno);
  if (::flock(lock.get(), LOCK_EX) != 0)
    return ErrnoStatus(StatusCode::kUnavailable, "flock " + lock_path, errno);
  if (fs::exists(options.output_dir + "/manifest.json")) return false;
  NONSTOP_ASSIGN_OR_RETURN(PrepareReport report, PrepareShards(options, progress));
  if (progress) {
    progress(fmt::format("prepared {} tokens from {} files into {} shards in {}", report.tokens,
                         report.files_read, report.shards, options.output_dir));
  }
  return true;
}

}  // namespace nonstop::data
