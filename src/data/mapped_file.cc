#include "data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "common/unique_fd.h"

namespace nonstop::data {

Result<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid())
    return ErrnoStatus(errno == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                       "open " + path, errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    return ErrnoStatus(StatusCode::kUnavailable, "stat " + path, errno);
  if (!S_ISREG(st.st_mode)) return InvalidArgumentError(path + " is not a regular file");
  auto size = static_cast<size_t>(st.st_size);
  if (size == 0) return std::unique_ptr<MappedFile>(new MappedFile(path, nullptr, 0));
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoStatus(StatusCode::kUnavailable, "mmap " + path, errno);
  ::madvise(p, size, MADV_WILLNEED);
  return std::unique_ptr<MappedFile>(new MappedFile(path, static_cast<const std::byte*>(p), size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace nonstop::data
