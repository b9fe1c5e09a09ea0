#include "common/job_token.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "common/temp_dir.h"
#include "nonstop/settings.h"

namespace nonstop {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Write(const std::string& path, const std::string& text, mode_t mode) {
  std::ofstream(path) << text;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0);
}

bool Contains(const Status& s, const std::string& part) {
  return s.message().find(part) != std::string::npos;
}

TEST(HttpCredentialTest, IsDerivedFromTheTokenAndGivesNoneOfItAway) {
  const std::string c = HttpCredential("0123456789abcdef");
  EXPECT_EQ(c.size(), 64u);
  EXPECT_EQ(c, HttpCredential("0123456789abcdef"));
  EXPECT_NE(c, HttpCredential("0123456789abcdeF"));
  EXPECT_EQ(c.find("0123456789abcdef"), std::string::npos);
}

TEST(JobTokenFileTest, TokenIsTrimmedAndBadFilesAreNamed) {
  TempDir dir;
  std::string path = dir / "token";
  Write(path, "  s3cret-token\n\n", 0600);
  auto token = ReadJobTokenFile(path);
  ASSERT_TRUE(token.ok()) << token.status().ToString();
  EXPECT_EQ(*token, "s3cret-token");

  auto missing = ReadJobTokenFile(dir / "nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(missing.status(), dir / "nope")) << missing.status().ToString();

  std::string empty = dir / "empty";
  Write(empty, " \n\t\n", 0600);
  auto e = ReadJobTokenFile(empty);
  ASSERT_FALSE(e.ok());
  EXPECT_TRUE(Contains(e.status(), empty + "' is empty")) << e.status().ToString();
}

TEST(JobTokenFileTest, AFileOthersMayReadIsRefusedWithTheFix) {
  TempDir dir;
  std::string path = dir / "token";
  for (mode_t mode : {0644, 0640, 0604, 0620, 0602}) {
    Write(path, "s3cret\n", mode);
    auto token = ReadJobTokenFile(path);
    ASSERT_FALSE(token.ok()) << "mode " << std::oct << mode;
    EXPECT_EQ(token.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(Contains(token.status(), "group or others")) << token.status().ToString();
    EXPECT_TRUE(Contains(token.status(), "HINT: chmod 600 " + path)) << token.status().ToString();
    EXPECT_FALSE(Contains(token.status(), "s3cret")) << "the message shows the token";
  }
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  EXPECT_TRUE(ReadJobTokenFile(path).ok()) << "the fix named works";
}

TEST(JobTokenFileTest, AFileOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "making a file of another user needs root";
  TempDir dir;
  std::string path = dir / "token";
  Write(path, "s3cret\n", 0600);
  ASSERT_TRUE(ReadJobTokenFile(path).ok());
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
  auto token = ReadJobTokenFile(path);
  ASSERT_FALSE(token.ok());
  EXPECT_EQ(token.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(token.status(), "belongs to user 65534")) << token.status().ToString();
  EXPECT_TRUE(Contains(token.status(), "HINT:")) << token.status().ToString();
}

TEST(JobTokenFileTest, ASymlinkIsRefusedNotReadThrough) {
  TempDir dir;
  std::string target = dir / "real";
  Write(target, "s3cret\n", 0600);
  std::string link = dir / "token";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  auto token = ReadJobTokenFile(link);
  ASSERT_FALSE(token.ok());
  EXPECT_EQ(token.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(token.status(), "symbolic link")) << token.status().ToString();
  // A dangling one is refused the same way (not taken for a missing file, and so replaced).
  std::string dangling = dir / "dangling";
  ASSERT_EQ(::symlink((dir / "nowhere").c_str(), dangling.c_str()), 0);
  EXPECT_EQ(ReadJobTokenFile(dangling).status().code(), StatusCode::kFailedPrecondition);
  // A FIFO is not a file: refused without blocking.
  std::string fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(ReadJobTokenFile(fifo).status().code(), StatusCode::kFailedPrecondition);
}

TEST(PrivateFileTest, WrittenMode0600WhateverTheUmask) {
  TempDir dir;
  std::string path = dir / "token";
  mode_t old = ::umask(0);
  Status s = WritePrivateFile(path, "s3cret\n");
  ::umask(old);
  ASSERT_TRUE(s.ok()) << s.ToString();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(Read(path), "s3cret\n");
  // Rewritten over a file others could read: the new one is private.
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  ASSERT_TRUE(WritePrivateFile(path, "t2\n").ok());
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(*ReadJobTokenFile(path), "t2");
  // Nothing is left beside it.
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1);
}

// Another user plants a symlink at the temporary name, pointing at a file of
// theirs (or of the victim's): the write is refused, and the link's target
// does not receive the secret.
TEST(PrivateFileTest, ASymlinkPlantedAtTheTemporaryNameIsRefused) {
  TempDir dir;
  std::string path = dir / "token";
  std::string tmp = dir / "token.tmp";
  std::string target = dir / "attacker-reads-this";
  Write(target, "", 0644);
  ASSERT_EQ(::symlink(target.c_str(), tmp.c_str()), 0);
  Status s = testing::WritePrivateFileVia(path, tmp, "s3cret\n");
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, tmp)) << s.ToString();
  EXPECT_TRUE(Contains(s, "exists")) << s.ToString();
  EXPECT_EQ(Read(target), "") << "written through the planted symlink";
  EXPECT_FALSE(std::filesystem::exists(path));
  // A plain file planted there is refused too (it could be another user's, open for reading).
  ASSERT_EQ(::unlink(tmp.c_str()), 0);
  Write(tmp, "", 0644);
  EXPECT_FALSE(testing::WritePrivateFileVia(path, tmp, "s3cret\n").ok());
  EXPECT_EQ(Read(tmp), "");
  // The name WritePrivateFile picks is not predictable: the old one (path.tmp.PID), planted, is
  // not used.
  std::string old_name = path + ".tmp." + std::to_string(::getpid());
  ASSERT_EQ(::symlink(target.c_str(), old_name.c_str()), 0);
  ASSERT_TRUE(WritePrivateFile(path, "s3cret\n").ok());
  EXPECT_EQ(Read(target), "");
  EXPECT_EQ(Read(path), "s3cret\n");
}

// A symlink planted at the final name is replaced (rename swaps the link itself), never written
// through.
TEST(PrivateFileTest, ASymlinkAtTheFileItselfIsReplacedNotWrittenThrough) {
  TempDir dir;
  std::string path = dir / "token";
  std::string target = dir / "elsewhere";
  Write(target, "theirs\n", 0644);
  ASSERT_EQ(::symlink(target.c_str(), path.c_str()), 0);
  ASSERT_TRUE(WritePrivateFile(path, "s3cret\n").ok());
  EXPECT_EQ(Read(target), "theirs\n");
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(*ReadJobTokenFile(path), "s3cret");
}

// ---- the descriptor a launcher passes ----

class InheritedTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv(settings::kJobToken.env.data());
    ::unsetenv(settings::kJobTokenFd.env.data());
  }
  void TearDown() override { SetUp(); }
  static void SetFd(const std::string& value) {
    ::setenv(settings::kJobTokenFd.env.data(), value.c_str(), 1);
  }
  static bool Open(int fd) { return ::fcntl(fd, F_GETFD) >= 0; }
};

TEST_F(InheritedTokenTest, TheMemfdIsReadClosedAndItsVariableRemoved) {
  auto fd = JobTokenMemfd("s3cret-token");
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  EXPECT_GE(fd->get(), 3);
  EXPECT_NE(::fcntl(fd->get(), F_GETFD) & FD_CLOEXEC, 0)
      << "close-on-exec until a launcher clears it";
  EXPECT_LT(::write(fd->get(), "x", 1), 0) << "sealed: nobody can change it";
  int raw = fd->Release();
  SetFd(std::to_string(raw));
  ::setenv(settings::kJobToken.env.data(), "other", 1);
  auto token = TakeInheritedJobToken();
  ASSERT_TRUE(token.ok()) << token.status().ToString();
  EXPECT_EQ(*token, "s3cret-token") << "the descriptor wins over the variable";
  EXPECT_FALSE(Open(raw)) << "closed: the program's children do not inherit it";
  EXPECT_EQ(std::getenv(settings::kJobTokenFd.env.data()), nullptr);
  EXPECT_EQ(std::getenv(settings::kJobToken.env.data()), nullptr);
}

TEST_F(InheritedTokenTest, TheVariableServesAHandStartedWorkerAndIsRemoved) {
  ::setenv(settings::kJobToken.env.data(), "by-hand", 1);
  auto token = TakeInheritedJobToken();
  ASSERT_TRUE(token.ok());
  EXPECT_EQ(*token, "by-hand");
  EXPECT_EQ(std::getenv(settings::kJobToken.env.data()), nullptr);
  auto none = TakeInheritedJobToken();
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, "");
}

TEST_F(InheritedTokenTest, ADescriptorThatIsNotTheTokensIsLeftAlone) {
  TempDir dir;
  Write(dir / "f", "not a token", 0600);
  int other = ::open((dir / "f").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(other, 3);
  SetFd(std::to_string(other));
  auto token = TakeInheritedJobToken();
  ASSERT_FALSE(token.ok());
  EXPECT_TRUE(Contains(token.status(), "is not the job token")) << token.status().ToString();
  EXPECT_TRUE(Open(other)) << "another file of the program's was closed";
  char c;
  EXPECT_EQ(::read(other, &c, 1), 1) << "and read from";
  ::close(other);

  SetFd(std::to_string(other));  // closed now
  token = TakeInheritedJobToken();
  ASSERT_FALSE(token.ok());
  EXPECT_TRUE(Contains(token.status(), "is not open")) << token.status().ToString();
  EXPECT_TRUE(Contains(token.status(), "pass_fds")) << token.status().ToString();

  for (const char* bad : {"x", "1", "-4", "5x"}) {
    SetFd(bad);
    EXPECT_FALSE(TakeInheritedJobToken().ok()) << bad;
  }
}

// What a process of the same user can read of another through /proc: bit 0 its memory
// (/proc/<pid>/mem, opened), bit 1 its descriptors (/proc/<pid>/fd, listed), bit 2 its environment
// (/proc/<pid>/environ, read). Both processes run as `nobody`, forked from this (root) one.
int WhatTheSameUserReads(bool shut_out) {
  int ready[2], done[2];
  if (::pipe(ready) != 0 || ::pipe(done) != 0) return -1;
  constexpr uid_t kNobody = 65534;
  auto become_nobody = [] {
    return ::setgroups(0, nullptr) == 0 && ::setgid(kNobody) == 0 && ::setuid(kNobody) == 0;
  };
  const pid_t target = ::fork();
  if (target == 0) {
    if (!become_nobody()) ::_exit(1);
    // The change of user made it undumpable (the kernel's rule): dumpable again, as a program of
    // that user started afresh would be.
    if (::prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0) ::_exit(1);
    if (shut_out && !ShutOutSameUserProcesses().ok()) ::_exit(1);
    char c = 1;
    (void)!::write(ready[1], &c, 1);
    (void)!::read(done[0], &c, 1);  // until the probe is through
    ::_exit(0);
  }
  // Only the target writes `ready`: one that failed to become nobody ends it (end of file).
  ::close(ready[1]);
  ::close(done[0]);
  char c = 0;
  if (::read(ready[0], &c, 1) != 1) {
    ::waitpid(target, nullptr, 0);
    ::close(ready[0]);
    ::close(done[1]);
    return -1;
  }
  const pid_t probe = ::fork();
  if (probe == 0) {
    if (!become_nobody()) ::_exit(255);
    const std::string proc = "/proc/" + std::to_string(target);
    int got = 0;
    if (int fd = ::open((proc + "/mem").c_str(), O_RDONLY); fd >= 0) {
      got |= 1;
      ::close(fd);
    }
    std::error_code ec;
    std::filesystem::directory_iterator fds(proc + "/fd", ec);
    if (!ec) got |= 2;
    if (int fd = ::open((proc + "/environ").c_str(), O_RDONLY); fd >= 0) {
      char b;
      if (::read(fd, &b, 1) == 1) got |= 4;
      ::close(fd);
    }
    ::_exit(got);
  }
  int status = 0;
  ::waitpid(probe, &status, 0);
  (void)!::write(done[1], &c, 1);
  ::waitpid(target, nullptr, 0);
  for (int fd : {ready[0], done[1]}) ::close(fd);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Issue 52, point 3: a worker's code runs as the user of the launcher and the controller, which
// hold the job token; once they shut out their user's other processes, it reads none of their
// memory, descriptors or environment. Without it, it reads all three (the control: the probe can
// read what it is not shut out of).
TEST(ShutOutSameUserProcessesTest,
     AProcessOfTheSameUserReadsNoneOfTheMemoryDescriptorsOrEnvironment) {
  if (::geteuid() != 0) GTEST_SKIP() << "runs its two processes as nobody: needs root (CI is)";
  std::ifstream yama("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  yama >> scope;  // no Yama: 0. With 1 or more, Yama alone keeps a non-ancestor from the memory.
  EXPECT_EQ(WhatTheSameUserReads(false), scope >= 1 ? 6 : 7);
  EXPECT_EQ(WhatTheSameUserReads(true), 0);
}

}  // namespace
}  // namespace nonstop
