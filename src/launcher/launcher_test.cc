#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/lifeline.h"
#include "launcher/local_launcher.h"
#include "launcher/output_writer.h"

namespace nonstop::launcher {
namespace {

std::string ReadAvailable(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::string all;
  char buf[65536];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) all.append(buf, static_cast<size_t>(n));
  return all;
}

TEST(OutputWriterTest, ReaderThatTakesNothingNeverBlocksTheWriterAndLossIsReported) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  uint64_t dropped = 0;
  {
    OutputWriter w(p[1], /*max_buffered=*/1 << 20, /*final_flush=*/Millis(200));
    std::string line(1000, 'x');
    line += '\n';
    for (int i = 0; i < 10'000; ++i) w.Write(line);  // 10 MB into a 64 KiB pipe nobody reads
    dropped = w.dropped_bytes();
    EXPECT_GT(dropped, 0u);
    // The reader wakes up: what was kept comes out, then a line says what was lost.
    std::string got;
    for (int i = 0; i < 200 && got.find("were dropped") == std::string::npos; ++i) {
      got += ReadAvailable(p[0]);
      ::usleep(10'000);
    }
    EXPECT_NE(got.find("were dropped: the reader of this stream is not keeping up"),
              std::string::npos);
  }
  ::close(p[0]);
  ::close(p[1]);
}

TEST(LocalLauncherTest, ChildExitIsSeenWhileTheOutputReaderIsStuck) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  net::EventLoop loop;
  OutputWriter out(p[1], 1 << 20, Millis(100));
  OutputWriter err(p[1], 1 << 20, Millis(100));
  int exit_code = -100;
  LocalLauncher launcher(
      &loop, [](int) { return std::string("[w] "); },
      [&](int, pid_t, int code, int) { exit_code = code; }, nullptr, &out, &err);
  ChildSpec spec;
  spec.worker_id = 1;
  // ~8 MB of lines, far more than the pipe and the writer's buffer hold.
  spec.argv = {"/bin/sh", "-c",
               "yes 0123456789012345678901234567890123456789 | head -c 8000000; exit 3"};
  ASSERT_TRUE(launcher.Spawn(spec).ok());
  Deadline until = DeadlineAfter(Millis(30'000));
  while (exit_code == -100 && Clock::now() < until) loop.RunOnce(Millis(20));
  EXPECT_EQ(exit_code, 3);
  EXPECT_GT(out.dropped_bytes(), 0u);
  ::close(p[0]);  // the writers give up on the closed pipe at destruction
}

TEST(LocalLauncherTest, StoppedChildIsReportedOncePerStop) {
  net::EventLoop loop;
  std::vector<int> stops;
  bool exited = false;
  LocalLauncher launcher(
      &loop, [](int) { return std::string(); }, [&](int, pid_t, int, int) { exited = true; },
      [&](int id, pid_t, int sig) { stops.push_back(sig); });
  ChildSpec spec;
  spec.worker_id = 4;
  spec.argv = {"/bin/sleep", "30"};
  auto pid = launcher.Spawn(spec);
  ASSERT_TRUE(pid.ok());
  auto poll_for = [&](Millis d) {
    Deadline until = DeadlineAfter(d);
    while (Clock::now() < until) {
      loop.RunOnce(Millis(10));
      launcher.PollStopped();
    }
  };
  poll_for(Millis(100));
  EXPECT_TRUE(stops.empty());
  ::kill(*pid, SIGSTOP);
  poll_for(Millis(300));
  ASSERT_EQ(stops.size(), 1u);
  EXPECT_EQ(stops[0], SIGSTOP);
  ::kill(*pid, SIGCONT);
  poll_for(Millis(200));
  ::kill(*pid, SIGSTOP);
  poll_for(Millis(300));
  EXPECT_EQ(stops.size(), 2u);
  launcher.Signal(4, SIGKILL);
  Deadline until = DeadlineAfter(Millis(5000));
  while (!exited && Clock::now() < until) loop.RunOnce(Millis(10));
  EXPECT_TRUE(exited);
}

}  // namespace
}  // namespace nonstop::launcher

namespace nonstop::launcher {
namespace {

int OpenDescriptors() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// The spec's variables win over inherited ones of the same name: getenv
// returns the first match, so an inherited NONSTOP_WORKER_ID used to win.
TEST(LocalLauncherTest, SpecVariablesReplaceInheritedOnes) {
  ::setenv("NONSTOP_LAUNCHER_TEST_VAR", "inherited", 1);
  ::setenv("NONSTOP_LAUNCHER_TEST_GONE", "inherited", 1);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  net::EventLoop loop;
  OutputWriter out(p[1], 1 << 20, Millis(100));
  bool exited = false;
  LocalLauncher launcher(
      &loop, [](int) { return std::string(); }, [&](int, pid_t, int, int) { exited = true; },
      nullptr, &out, &out);
  ChildSpec spec;
  spec.worker_id = 1;
  spec.argv = {"/usr/bin/env"};  // prints the raw environment, duplicates included
  spec.env = {{"NONSTOP_LAUNCHER_TEST_VAR", "from-spec"}};
  spec.unset = {"NONSTOP_LAUNCHER_TEST_GONE"};
  ASSERT_TRUE(launcher.Spawn(spec).ok());
  for (int i = 0; i < 500 && !exited; ++i) loop.RunOnce(Millis(10));
  ASSERT_TRUE(exited);
  std::string got;
  for (int i = 0; i < 100 && got.find("NONSTOP_LAUNCHER_TEST_VAR=from-spec") == std::string::npos;
       ++i) {
    got += ReadAvailable(p[0]);
    ::usleep(10'000);
  }
  EXPECT_NE(got.find("NONSTOP_LAUNCHER_TEST_VAR=from-spec\n"), std::string::npos) << got;
  EXPECT_EQ(got.find("NONSTOP_LAUNCHER_TEST_VAR=inherited"), std::string::npos) << got;
  EXPECT_EQ(got.find("NONSTOP_LAUNCHER_TEST_GONE"), std::string::npos) << got;
  ::unsetenv("NONSTOP_LAUNCHER_TEST_VAR");
  ::unsetenv("NONSTOP_LAUNCHER_TEST_GONE");
  ::close(p[0]);
  ::close(p[1]);
}

// The token reaches the child in the descriptor NONSTOP_JOB_TOKEN_FD names,
// never in its environment (docs/security.md): not even one inherited or one
// the spec's variables carry. Nothing else the launcher holds is inherited.
TEST(LocalLauncherTest, TheJobTokenComesInADescriptorNotTheEnvironment) {
  ::setenv("NONSTOP_JOB_TOKEN", "inherited-token", 1);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  net::EventLoop loop;
  OutputWriter out(p[1], 1 << 20, Millis(100));
  bool exited = false;
  LocalLauncher launcher(
      &loop, [](int) { return std::string(); }, [&](int, pid_t, int, int) { exited = true; },
      nullptr, &out, &out);
  ChildSpec spec;
  spec.worker_id = 1;
  spec.argv = {
      "/bin/sh", "-c",
      "env; echo \"read=$(cat /proc/self/fd/$NONSTOP_JOB_TOKEN_FD)\"; ls -l /proc/$$/fd/ | grep -c "
      "nonstop-job-token; echo end"};
  spec.env = {{"NONSTOP_JOB_TOKEN", "spec-token"}};
  spec.secret = "s3cret-token";
  int before = OpenDescriptors();
  ASSERT_TRUE(launcher.Spawn(spec).ok());
  EXPECT_EQ(OpenDescriptors(), before + 3) << "the launcher keeps only the pidfd and two pipes";
  for (int i = 0; i < 500 && !exited; ++i) loop.RunOnce(Millis(10));
  ASSERT_TRUE(exited);
  std::string got;
  for (int i = 0; i < 100 && got.find("end\n") == std::string::npos; ++i) {
    got += ReadAvailable(p[0]);
    ::usleep(10'000);
  }
  EXPECT_NE(got.find("read=s3cret-token\n"), std::string::npos) << got;
  EXPECT_NE(got.find("\n1\nend\n"), std::string::npos) << "one token descriptor:\n" << got;
  EXPECT_NE(got.find("NONSTOP_JOB_TOKEN_FD="), std::string::npos) << got;
  EXPECT_EQ(got.find("NONSTOP_JOB_TOKEN="), std::string::npos) << got;
  size_t copies = 0;
  for (size_t at = got.find("s3cret-token"); at != std::string::npos;
       at = got.find("s3cret-token", at + 1))
    ++copies;
  EXPECT_EQ(copies, 1u) << "the token is only where the child read it:\n" << got;
  ::unsetenv("NONSTOP_JOB_TOKEN");
  ::close(p[0]);
  ::close(p[1]);
}

// Each exited child gives back its pidfd and pipes: a job that starts
// thousands of processes (refills over days) does not run out of descriptors.
TEST(LocalLauncherTest, ExitedChildrenHoldNoDescriptors) {
  net::EventLoop loop;
  int exits = 0;
  LocalLauncher launcher(
      &loop, [](int) { return std::string(); }, [&](int, pid_t, int, int) { ++exits; });
  int before = OpenDescriptors();
  for (int id = 0; id < 20; ++id) {
    ChildSpec spec;
    spec.worker_id = id;
    spec.argv = {"/bin/true"};
    ASSERT_TRUE(launcher.Spawn(spec).ok());
  }
  for (int i = 0; i < 1000 && exits < 20; ++i) loop.RunOnce(Millis(10));
  ASSERT_EQ(exits, 20);
  EXPECT_LE(OpenDescriptors(), before + 2) << "20 children left descriptors open";
}

}  // namespace
}  // namespace nonstop::launcher

// ---------------------------------------------------------------- lifelines
//
// The children are this test program itself, started again with
// NONSTOP_LIFELINE_TEST_CHILD set: a static initializer acts as the worker
// before gtest's main runs (on the main thread, which lives as long as the
// process, as the lifeline requires).

namespace {

const bool kLifelineChild = [] {
  const char* mode = std::getenv("NONSTOP_LIFELINE_TEST_CHILD");
  if (mode == nullptr) return false;
  const std::string m = mode;
  if (m == "never") {  // a program that never takes its lifeline
    ::usleep(100'000);
    std::_Exit(0);
  }
  auto hold = nonstop::LifelineHold::TakeInherited();
  if (!hold.ok() || *hold == nullptr) {
    std::fprintf(stderr, "no lifeline: %s\n",
                 hold.ok() ? "none passed" : hold.status().ToString().c_str());
    std::_Exit(40);
  }
  if (m == "release") {  // a clean end
    (*hold)->Release();
    std::_Exit(0);
  }
  std::printf("held\n");
  std::fflush(stdout);
  if (m == "exit") std::_Exit(3);  // ends holding it: the kernel releases it
  while (true) ::pause();          // "hold": until killed
}();

}  // namespace

namespace nonstop::launcher {
namespace {

struct LifelineRun {
  std::vector<std::string> events;  // "dying", then "exit code/signal"
  int dying = 0;
  bool exited = false;
  int code = 0, sig = 0;
};

// Starts this program as a lifeline child in `mode`; runs the loop until it exits.
// `kill_when_held`: SIGKILL it once it says it holds its lifeline.
LifelineRun RunLifelineChild(const std::string& mode, bool kill_when_held) {
  net::EventLoop loop;
  LifelineRun run;
  const std::string log = (std::filesystem::temp_directory_path() /
                           ("lifeline_" + mode + "_" + std::to_string(::getpid()) + ".log"))
                              .string();
  std::filesystem::remove(log);
  {
    LocalLauncher launcher(
        &loop, [](int) { return std::string(); },
        [&](int, pid_t, int code, int sig) {
          run.exited = true;
          run.code = code;
          run.sig = sig;
          run.events.push_back("exit");
        });
    EXPECT_TRUE(launcher
                    .EnableLifelines([&](int id, pid_t) {
                      EXPECT_EQ(id, 6);
                      ++run.dying;
                      run.events.push_back("dying");
                    })
                    .ok());
    ChildSpec spec;
    spec.worker_id = 6;
    spec.argv = {"/proc/self/exe"};
    spec.env = {{"NONSTOP_LIFELINE_TEST_CHILD", mode}};
    spec.log_file = log;
    auto pid = launcher.Spawn(spec);
    EXPECT_TRUE(pid.ok()) << pid.status().ToString();
    if (!pid.ok()) return run;
    bool killed = false;
    Deadline until = DeadlineAfter(Millis(20'000));
    while (!run.exited && Clock::now() < until) {
      loop.RunOnce(Millis(5));
      if (kill_when_held && !killed) {
        std::ifstream f(log);
        std::stringstream text;
        text << f.rdbuf();
        if (text.str().find("held") != std::string::npos) {
          EXPECT_EQ(run.dying, 0) << "reported dying while it lives";
          launcher.Signal(6, SIGKILL);
          killed = true;
        }
      }
    }
  }  // the launcher goes: every watcher thread is joined
  std::filesystem::remove(log);
  return run;
}

TEST(LifelineTest, KilledHolderIsReportedDyingOnceBeforeItsExit) {
  LifelineRun run = RunLifelineChild("hold", /*kill_when_held=*/true);
  ASSERT_TRUE(run.exited);
  EXPECT_EQ(run.sig, SIGKILL);
  EXPECT_EQ(run.dying, 1);
  EXPECT_EQ(run.events, (std::vector<std::string>{"dying", "exit"}));
}

TEST(LifelineTest, HolderEndingWithoutReleasingIsReportedDying) {
  LifelineRun run = RunLifelineChild("exit", /*kill_when_held=*/false);
  ASSERT_TRUE(run.exited);
  EXPECT_EQ(run.code, 3);
  EXPECT_EQ(run.events, (std::vector<std::string>{"dying", "exit"}));
}

TEST(LifelineTest, CleanReleaseReportsNoDeath) {
  LifelineRun run = RunLifelineChild("release", /*kill_when_held=*/false);
  ASSERT_TRUE(run.exited);
  EXPECT_EQ(run.code, 0) << "the child did not find its lifeline (exit 40) or failed";
  EXPECT_EQ(run.dying, 0);
}

TEST(LifelineTest, ChildThatNeverTakesItReportsNoDeathAndShutsDown) {
  LifelineRun run = RunLifelineChild("never", /*kill_when_held=*/false);
  ASSERT_TRUE(run.exited);
  EXPECT_EQ(run.code, 0);
  EXPECT_EQ(run.dying, 0);
}

// The launcher going away first, while a child holds its lifeline: the child is killed, its
// watcher joined, and no report is made from a launcher being destroyed.
TEST(LifelineTest, LauncherGoingFirstJoinsItsWatchers) {
  net::EventLoop loop;
  int dying = 0;
  {
    LocalLauncher launcher(
        &loop, [](int) { return std::string(); }, [](int, pid_t, int, int) {});
    ASSERT_TRUE(launcher.EnableLifelines([&](int, pid_t) { ++dying; }).ok());
    ChildSpec spec;
    spec.worker_id = 2;
    spec.argv = {"/proc/self/exe"};
    spec.env = {{"NONSTOP_LIFELINE_TEST_CHILD", "hold"}};
    ASSERT_TRUE(launcher.Spawn(spec).ok());
    for (int i = 0; i < 20; ++i) loop.RunOnce(Millis(10));
  }
  EXPECT_EQ(dying, 0);
}

// Without lifelines enabled, a child gets none (no variable, no descriptor).
TEST(LifelineTest, NoLifelineUnlessEnabled) {
  LifelineRun run;
  net::EventLoop loop;
  LocalLauncher launcher(
      &loop, [](int) { return std::string(); },
      [&](int, pid_t, int code, int) {
        run.exited = true;
        run.code = code;
      });
  ChildSpec spec;
  spec.worker_id = 1;
  spec.argv = {"/proc/self/exe"};
  spec.env = {{"NONSTOP_LIFELINE_TEST_CHILD", "hold"}};
  ASSERT_TRUE(launcher.Spawn(spec).ok());
  Deadline until = DeadlineAfter(Millis(20'000));
  while (!run.exited && Clock::now() < until) loop.RunOnce(Millis(10));
  ASSERT_TRUE(run.exited);
  EXPECT_EQ(run.code, 40);  // "no lifeline: none passed"
}

}  // namespace
}  // namespace nonstop::launcher

namespace nonstop {
namespace {

// A watcher never blocks its owner's shutdown: destroyed while a live thread holds the lifeline,
// it returns (within its wait slice), and reports nothing.
TEST(LifelineTest, WatcherStopsWhileTheLifelineIsHeld) {
  std::atomic<bool> fired{false};
  auto watcher = LifelineWatcher::Create([&] { fired = true; });
  ASSERT_TRUE(watcher.ok()) << watcher.status().ToString();
  std::atomic<int> phase{0};
  std::thread holder([&, fd = (*watcher)->fd()] {
    auto hold = LifelineHold::Take(fd);
    ASSERT_TRUE(hold.ok()) << hold.status().ToString();
    phase = 1;
    while (phase.load() != 2) ::usleep(1000);
    (*hold)->Release();
  });
  while (phase.load() == 0) ::usleep(1000);
  ::usleep(100'000);  // the watcher waits on the held mutex
  watcher->reset();   // joins its thread
  EXPECT_FALSE(fired.load());
  phase = 2;
  holder.join();
}

// The robust list is per thread: a holding thread that ends while its process lives on releases
// the lifeline, and the watcher reports it as a death. Why Session::Join's caller (the training
// thread, which lives as long as the process) must be the one that holds it.
TEST(LifelineTest, HoldingThreadThatEndsFiresTheLifeline) {
  std::atomic<bool> fired{false};
  auto watcher = LifelineWatcher::Create([&] { fired = true; });
  ASSERT_TRUE(watcher.ok()) << watcher.status().ToString();
  std::thread holder([fd = (*watcher)->fd()] {
    auto hold = LifelineHold::Take(fd);
    ASSERT_TRUE(hold.ok()) << hold.status().ToString();
    // Ends holding it, on purpose: the hold is never destroyed (reachable from a static, so that
    // LeakSanitizer does not count it).
    static std::atomic<LifelineHold*> kept_on_purpose;
    kept_on_purpose = hold->release();
  });
  holder.join();
  for (int i = 0; i < 2000 && !fired.load(); ++i) ::usleep(1000);
  EXPECT_TRUE(fired.load());
  EXPECT_TRUE((*watcher)->fired());
}

// A descriptor that is not a lifeline is refused, not locked.
TEST(LifelineTest, OtherDescriptorIsRefused) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  auto hold = LifelineHold::Take(p[0]);
  EXPECT_FALSE(hold.ok());
  EXPECT_NE(hold.status().message().find("not a lifeline"), std::string::npos)
      << hold.status().ToString();
  ::close(p[0]);
  ::close(p[1]);
}

// --worker-user: who may be named, and what is refused with its fix.
TEST(RunAsTest, AnOrdinaryUserIsFoundByNameOrUidAndRootOrNobodyKnownIsRefused) {
  if (::geteuid() != 0) {
    auto r = launcher::LookUpRunAs("nobody");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("only a launcher running as root"), std::string::npos);
    return;
  }
  auto nobody = launcher::LookUpRunAs("nobody");
  ASSERT_TRUE(nobody.ok()) << nobody.status().ToString();
  EXPECT_NE(nobody->uid, 0u);
  EXPECT_EQ(nobody->name, "nobody");
  auto by_uid = launcher::LookUpRunAs(std::to_string(nobody->uid));
  ASSERT_TRUE(by_uid.ok()) << by_uid.status().ToString();
  EXPECT_EQ(by_uid->name, "nobody");
  for (const char* root : {"root", "0"}) {
    auto r = launcher::LookUpRunAs(root);
    ASSERT_FALSE(r.ok()) << root;
    EXPECT_NE(r.status().message().find("that is root"), std::string::npos)
        << r.status().ToString();
  }
  // No such user; a uid past uid_t's range does not wrap around to another user's.
  for (const char* unknown : {"no-such-user-here", "4294967297", "", "-2"}) {
    auto r = launcher::LookUpRunAs(unknown);
    ASSERT_FALSE(r.ok()) << unknown;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << unknown;
    EXPECT_NE(r.status().message().find("no such user"), std::string::npos)
        << r.status().ToString();
  }
}

}  // namespace
}  // namespace nonstop
