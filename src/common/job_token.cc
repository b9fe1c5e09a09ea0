#include "common/job_token.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include <fmt/format.h>

#include "common/crypto.h"
#include "common/file_util.h"
#include "nonstop/settings.h"

namespace nonstop {

namespace {

// What a job token memfd is sealed with: nothing can change it, and nothing
// but the launcher's own can carry this name and these seals.
constexpr int kTokenSeals = F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;
constexpr char kMemfdName[] = "nonstop-job-token";

Status WriteAllTo(int fd, std::string_view text, const std::string& path) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return ErrnoStatus(StatusCode::kUnavailable, "write " + path, errno);
    done += static_cast<size_t>(w);
  }
  return OkStatus();
}

std::string Trimmed(std::string s) {
  auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && space(s.back())) s.pop_back();
  size_t start = 0;
  while (start < s.size() && space(s[start])) ++start;
  return s.substr(start);
}

}  // namespace

Status WritePrivateFile(const std::string& path, std::string_view contents) {
  std::random_device rd;
  // Unpredictable, and O_EXCL: whatever another user planted beside `path` makes this fail, never
  // receives the secret.
  return testing::WritePrivateFileVia(path, fmt::format("{}.tmp-{:08x}{:08x}", path, rd(), rd()),
                                      contents);
}

Status ShutOutSameUserProcesses() {
  if (::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    return InternalError(fmt::format("prctl(PR_SET_DUMPABLE, 0): {}", std::strerror(errno)));
  }
  return OkStatus();
}

namespace testing {

Status WritePrivateFileVia(const std::string& path, const std::string& tmp,
                           std::string_view contents) {
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoStatus(StatusCode::kUnavailable, "create " + tmp, errno);
  auto fail = [&](Status s) {
    ::unlink(tmp.c_str());
    return s;
  };
  // Mode 0600 whatever the umask left of it (a umask takes bits away only, but be exact).
  if (::fchmod(fd.get(), 0600) != 0)
    return fail(ErrnoStatus(StatusCode::kUnavailable, "chmod 600 " + tmp, errno));
  if (Status s = WriteAllTo(fd.get(), contents, tmp); !s.ok()) return fail(s);
  if (::fsync(fd.get()) != 0)
    return fail(ErrnoStatus(StatusCode::kUnavailable, "fsync " + tmp, errno));
  if (::close(fd.Release()) != 0)
    return fail(ErrnoStatus(StatusCode::kUnavailable, "close " + tmp, errno));
  if (::rename(tmp.c_str(), path.c_str()) != 0)
    return fail(ErrnoStatus(StatusCode::kUnavailable, "rename " + tmp + " to " + path, errno));
  std::filesystem::path p(path);
  return SyncDirectory(p.has_parent_path() ? p.parent_path().string() : ".");
}

}  // namespace testing

Result<std::string> ReadPrivateFile(const std::string& path, std::string_view what,
                                    size_t max_bytes) {
  // O_NOFOLLOW: a symlink is refused (ELOOP), not read through; O_NONBLOCK: a FIFO planted there
  // does not hang the open (it is refused below as not a regular file).
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd.valid()) {
    int err = errno;
    if (err == ELOOP) {
      return FailedPreconditionError(
          fmt::format("{} '{}' is a symbolic link: refused (a link can point anywhere another user "
                      "chose); HINT: name the file itself",
                      what, path));
    }
    return ErrnoStatus(err == ENOENT ? StatusCode::kNotFound : StatusCode::kInvalidArgument,
                       fmt::format("{} '{}'", what, path), err);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0)
    return ErrnoStatus(StatusCode::kInvalidArgument, fmt::format("{} '{}'", what, path), errno);
  if (!S_ISREG(st.st_mode)) {
    return FailedPreconditionError(fmt::format("{} '{}' is not a regular file", what, path));
  }
  if (st.st_uid != ::geteuid()) {
    return FailedPreconditionError(fmt::format(
        "{} '{}' belongs to user {}, not to this user ({}): refused (another user could have "
        "written it); HINT: write it as this user, or, if you wrote it yourself, `chown {} {}`",
        what, path, st.st_uid, ::geteuid(), ::geteuid(), path));
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return FailedPreconditionError(
        fmt::format("{} '{}' may be read or written by group or others (mode {:o}): refused; "
                    "HINT: chmod 600 {}",
                    what, path, st.st_mode & 0777, path));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return InvalidArgumentError(fmt::format("{} '{}' holds {} bytes: over the {} it may", what,
                                            path, st.st_size, max_bytes));
  }
  std::string out;
  char buf[4096];
  while (out.size() <= max_bytes) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return ErrnoStatus(StatusCode::kInvalidArgument, fmt::format("read {} '{}'", what, path),
                         errno);
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  if (out.size() > max_bytes) {
    return InvalidArgumentError(fmt::format("{} '{}' holds over {} bytes", what, path, max_bytes));
  }
  return out;
}

std::string HttpCredential(std::string_view job_token) {
  const crypto::Key k = crypto::DeriveKey(crypto::JobKey(job_token), "nonstop http bearer v1");
  return crypto::Hex(std::string_view(reinterpret_cast<const char*>(k.data()), k.size()));
}

Result<std::string> ReadJobTokenFile(const std::string& path) {
  NONSTOP_ASSIGN_OR_RETURN(std::string text,
                           ReadPrivateFile(path, "job token file", kMaxJobTokenBytes + 64));
  std::string token = Trimmed(std::move(text));
  if (token.empty()) return InvalidArgumentError(fmt::format("job token file '{}' is empty", path));
  if (token.size() > kMaxJobTokenBytes) {
    return InvalidArgumentError(
        fmt::format("job token file '{}' holds {} bytes: not a job token", path, token.size()));
  }
  return token;
}

Result<UniqueFd> JobTokenMemfd(std::string_view token) {
  int raw = ::memfd_create(kMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (raw < 0) return ErrnoStatus(StatusCode::kInternal, "memfd_create", errno);
  UniqueFd fd(raw);
  if (fd.get() < 3) {  // this process runs with a standard stream closed
    // The duplicate replaces `raw`, which Reset closes (once: `raw` is not closed again here).
    const int dup = ::fcntl(raw, F_DUPFD_CLOEXEC, 3);
    const int dup_errno = errno;
    fd.Reset(dup);
    if (!fd.valid()) return ErrnoStatus(StatusCode::kInternal, "dup of the token memfd", dup_errno);
  }
  NONSTOP_RETURN_IF_ERROR(WriteAllTo(fd.get(), token, "the job token memfd"));
  if (::fcntl(fd.get(), F_ADD_SEALS, kTokenSeals) != 0)
    return ErrnoStatus(StatusCode::kInternal, "sealing the job token memfd", errno);
  // Its reader reads the descriptor it inherits; nobody opens it again through /proc, and a
  // worker of another user (--worker-user) cannot open a sibling's at all.
  if (::fchmod(fd.get(), 0400) != 0)
    return ErrnoStatus(StatusCode::kInternal, "chmod of the job token memfd", errno);
  // A reader that read()s (a shell's `cat <&N`) starts at the token, not at its end.
  if (::lseek(fd.get(), 0, SEEK_SET) != 0)
    return ErrnoStatus(StatusCode::kInternal, "lseek of the job token memfd", errno);
  return fd;
}

Result<std::string> TakeInheritedJobToken() {
  namespace s = settings;
  const char* fd_text = std::getenv(s::kJobTokenFd.env.data());
  const char* env_token = std::getenv(s::kJobToken.env.data());
  std::string token = env_token != nullptr ? env_token : "";
  std::string fd_name = fd_text != nullptr ? fd_text : "";
  ::unsetenv(s::kJobToken.env.data());
  ::unsetenv(s::kJobTokenFd.env.data());
  if (fd_name.empty()) return token;
  int fd = -1;
  try {
    size_t used = 0;
    fd = std::stoi(fd_name, &used);
    if (used != fd_name.size() || fd < 3) fd = -1;
  } catch (...) {
  }
  const std::string where = fmt::format("{}={}", s::kJobTokenFd.env, fd_name);
  if (fd < 0) return InvalidArgumentError(where + ": not a file descriptor number (3 or above)");
  // Another descriptor under that number (the one the launcher passed was closed by a program in
  // between, and the number reused) is left alone: not read, not closed.
  int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 && errno == EBADF) {
    return FailedPreconditionError(fmt::format(
        "{}: descriptor {} is not open: a program between the launcher and this one closed it "
        "(HINT: let it pass the descriptor on, e.g. Python's subprocess pass_fds=({},), or start "
        "this program directly)",
        where, fd, fd));
  }
  char link[128] = {};
  ssize_t n = ::readlink(fmt::format("/proc/self/fd/{}", fd).c_str(), link, sizeof(link) - 1);
  // Without /proc the seals alone say it; with it, the name must be the launcher's too.
  const bool named = n < 0 || std::string_view(link, static_cast<size_t>(n))
                                  .starts_with(fmt::format("/memfd:{}", kMemfdName));
  if (seals != kTokenSeals || !named) {
    return FailedPreconditionError(fmt::format(
        "{}: descriptor {} is not the job token a nonstop launcher passed (a program in between "
        "closed it and opened another); left alone",
        where, fd));
  }
  std::string text(kMaxJobTokenBytes + 1, '\0');
  ssize_t got;
  do {
    got = ::pread(fd, text.data(), text.size(), 0);
  } while (got < 0 && errno == EINTR);
  int err = errno;
  struct stat st {};
  if (got >= 0 && ::fstat(fd, &st) == 0 && st.st_uid != ::geteuid()) {
    // A launcher of another user (root, --worker-user) started this worker: shut its memory and
    // descriptors to the other processes of its user, its sibling workers among them, which could
    // otherwise read its credential (docs/security.md, "A user for the workers"). The launcher's
    // user, root, can still debug it.
    (void)::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  }
  ::close(fd);  // the program's children inherit nothing
  if (got < 0) return ErrnoStatus(StatusCode::kInternal, "read " + where, err);
  text.resize(static_cast<size_t>(got));
  if (text.empty() || text.size() > kMaxJobTokenBytes) {
    return InvalidArgumentError(
        fmt::format("{}: holds {} bytes, not a job token", where, text.size()));
  }
  return text;
}

}  // namespace nonstop
