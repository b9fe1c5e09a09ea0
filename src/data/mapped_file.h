// MappedFile: a read-only, shared memory mapping of a whole file. All workers
// on a host that map the same shard share one page-cache copy, so a worker
// that restarts or recovers finds the data already in memory.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "nonstop/status.h"

namespace nonstop::data {

class MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const std::byte* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const std::byte* data_;
  size_t size_;
};

}  // namespace nonstop::data
