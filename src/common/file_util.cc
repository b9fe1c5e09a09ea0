#include "common/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "common/unique_fd.h"

namespace nonstop {

Status WriteFileSynced(const std::string& path, std::string_view contents) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoStatus(StatusCode::kUnavailable, "create " + path, errno);
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return ErrnoStatus(StatusCode::kUnavailable, "write " + path, errno);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return ErrnoStatus(StatusCode::kUnavailable, "fsync " + path, errno);
  return OkStatus();
}

Status SyncDirectory(const std::string& dir) {
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(StatusCode::kUnavailable, "open directory " + dir, errno);
  if (::fsync(fd.get()) != 0)
    return ErrnoStatus(StatusCode::kUnavailable, "fsync directory " + dir, errno);
  return OkStatus();
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  std::filesystem::path target(path);
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  Status s = WriteFileSynced(tmp, contents);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(StatusCode::kUnavailable, "rename " + tmp + " to " + path, err);
  }
  return SyncDirectory(target.has_parent_path() ? target.parent_path().string() : ".");
}

Result<std::string> ReadFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    return ErrnoStatus(errno == ENOENT ? StatusCode::kNotFound : StatusCode::kUnavailable,
                       "open " + path, errno);
  }
  std::string out;
  char buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(StatusCode::kUnavailable, "read " + path, errno);
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

}  // namespace nonstop
