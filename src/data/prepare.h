// Text → token shards (`nonstop data prepare`), with the byte-level tokenizer
// (token = byte, vocabulary 256). Inputs are files or directories; in a
// directory every regular text file is read in name order (symlinks, *.dat
// index files and files holding NUL bytes are skipped and reported). The
// output directory receives shard_000000.bin, … and a manifest.json written
// last, so a directory with a manifest is complete.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace nonstop::data {

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string output_dir;
  uint64_t tokens_per_shard = 1 << 20;
  // Fortune files separate entries with lines holding only "%": drop those lines.
  bool strip_fortune_separators = false;
};

struct PrepareReport {
  uint64_t files_read = 0;
  std::vector<std::string> skipped;  // "path: reason"
  uint64_t tokens = 0;
  uint64_t shards = 0;
};

using PrepareProgress = std::function<void(const std::string& line)>;

Result<PrepareReport> PrepareShards(const PrepareOptions& options, const PrepareProgress& progress = nullptr);

// Prepares `options.output_dir` unless it already holds a complete set
// (manifest.json). Safe when several processes call it at once: they take an
// exclusive lock on the directory, and the first one does the work.
Result<bool> PrepareIfMissing(const PrepareOptions& options, const PrepareProgress& progress = nullptr);

}  // namespace nonstop::data
