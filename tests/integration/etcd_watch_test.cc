// Leader discovery by watch (docs/leader-discovery.md) against a real etcd
// (Debian's etcd-server): etcd::Watch sees puts and deletes as they land,
// rides out an etcd killed and restarted on its data (and resumes where it
// was, no change missed), reads the key again after a compaction or when
// etcd is replaced by one at a lower revision, keeps an idle stream open on
// etcd's progress notifications, and stops promptly (from any thread, its own
// included); coord::LeaderWatch keeps the leader file in step with the
// leader and end keys, and LeaderFileReader reads it as LookUpLeader reads
// etcd.
#include "coord/etcd_watch.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "common/file_util.h"
#include "common/mutex.h"
#include "common/temp_dir.h"
#include "coord/leader_watch.h"
#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"

namespace nonstop {
namespace {

using std::chrono::milliseconds;
using namespace std::chrono_literals;

// What a watch has shown so far: the latest snapshot and how many there were.
struct Seen {
  Mutex mu;
  CondVar cv;
  etcd::Snapshot last NONSTOP_GUARDED_BY(mu);
  int64_t revision NONSTOP_GUARDED_BY(mu) = 0;
  int calls NONSTOP_GUARDED_BY(mu) = 0;
  bool hold NONSTOP_GUARDED_BY(mu) = false;  // the callback waits while set (the test's gate)

  etcd::Watch::OnChange Callback() {
    return [this](const etcd::Snapshot& s, int64_t revision) {
      MutexLock lock(&mu);
      last = s;
      this->revision = revision;
      ++calls;
      cv.NotifyAll();
      cv.WaitFor(&mu, milliseconds(30'000),
                 [this]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !hold; });
    };
  }
  // Until the key holds `value` ("" for absent), within `timeout`.
  bool WaitFor(const std::string& key, const std::string& value, milliseconds timeout) {
    MutexLock lock(&mu);
    return cv.WaitFor(&mu, timeout, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      auto it = last.find(key);
      return calls > 0 &&
             (value.empty() ? it == last.end() : it != last.end() && it->second.value == value);
    });
  }
};

class EtcdWatchTest : public ::testing::Test {
 protected:
  virtual std::vector<std::string> EtcdFlags() { return {}; }
  void SetUp() override {
    etcd_ = std::make_unique<testing::RestartableEtcd>(dir_.path(), EtcdFlags());
    ASSERT_TRUE(etcd_->Start()) << "etcd did not start (scripts/setup.sh installs etcd-server)\n"
                                << etcd_->Output();
    auto c = etcd::Client::Create(etcd_->endpoint());
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    client_ = std::move(*c);
  }
  std::unique_ptr<etcd::Watch> StartWatch(const std::string& key, Seen* seen) {
    etcd::WatchOptions o;
    o.endpoints = etcd_->endpoint();
    o.key = key;
    o.backoff_max = milliseconds(300);
    auto w = etcd::Watch::Start(o, seen->Callback());
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    return w.ok() ? std::move(*w) : nullptr;
  }

  TempDir dir_;
  std::unique_ptr<testing::RestartableEtcd> etcd_;
  std::unique_ptr<etcd::Client> client_;
};

TEST_F(EtcdWatchTest, SeesAPutAndADeleteAsTheyLandOnOneStream) {
  ASSERT_TRUE(client_->Put("/w/k", "before").ok());
  Seen seen;
  auto w = StartWatch("/w/k", &seen);
  ASSERT_TRUE(w);
  ASSERT_TRUE(seen.WaitFor("/w/k", "before", milliseconds(5'000)));  // the first read
  ASSERT_TRUE(client_->Put("/w/k", "after").ok());
  EXPECT_TRUE(seen.WaitFor("/w/k", "after", milliseconds(5'000)));
  ASSERT_TRUE(client_->Txn({}, {etcd::Op::Delete("/w/k")}).ok());
  EXPECT_TRUE(seen.WaitFor("/w/k", "", milliseconds(5'000)));
  // a key beside it is not watched
  ASSERT_TRUE(client_->Put("/w/k2", "x").ok());
  std::this_thread::sleep_for(milliseconds(200));
  {
    MutexLock lock(&seen.mu);
    EXPECT_TRUE(seen.last.empty());
  }
  // one read and one stream: no request per change
  EXPECT_EQ(w->reads(), 1);
  EXPECT_EQ(w->streams(), 1);
  auto start = std::chrono::steady_clock::now();
  w->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1'000)) << "Stop() was slow";
}

TEST_F(EtcdWatchTest, AStreamSilentForTheIdleTimeoutIsOpenedAgainFromWhereItWas) {
  ASSERT_TRUE(client_->Put("/w/k", "1").ok());
  Seen seen;
  etcd::WatchOptions o;
  o.endpoints = etcd_->endpoint();
  o.key = "/w/k";
  o.idle_timeout = milliseconds(300);  // each stream's: 300–450 ms (idle_jitter 0.5)
  auto w = etcd::Watch::Start(o, seen.Callback());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE(seen.WaitFor("/w/k", "1", milliseconds(5'000)));
  std::this_thread::sleep_for(milliseconds(1'500));
  // about one stream per idle timeout, opened at once (no back-off), and no read again
  EXPECT_GE((*w)->streams(), 4);
  EXPECT_LE((*w)->streams(), 7);
  EXPECT_EQ((*w)->reads(), 1);
  ASSERT_TRUE(client_->Put("/w/k", "2").ok());
  EXPECT_TRUE(seen.WaitFor("/w/k", "2", milliseconds(5'000)));
}

TEST_F(EtcdWatchTest, RidesOutAnEtcdRestartAndResumesFromTheLastRevision) {
  ASSERT_TRUE(client_->Put("/w/k", "1").ok());
  Seen seen;
  auto w = StartWatch("/w/k", &seen);
  ASSERT_TRUE(w);
  ASSERT_TRUE(seen.WaitFor("/w/k", "1", milliseconds(5'000)));
  etcd_->Kill();
  std::this_thread::sleep_for(milliseconds(1'000));  // the watch retries meanwhile
  ASSERT_TRUE(etcd_->Start()) << etcd_->Output();
  // Two changes after the restart: both are seen, the last one last (resumed, not re-read).
  ASSERT_TRUE(client_->Put("/w/k", "2").ok());
  ASSERT_TRUE(client_->Put("/w/k", "3").ok());
  EXPECT_TRUE(seen.WaitFor("/w/k", "3", milliseconds(10'000)));
  EXPECT_GE(w->streams(), 2) << "the stream was not opened again";
  EXPECT_EQ(w->reads(), 1) << "resumed from its revision: no read again";
}

TEST_F(EtcdWatchTest, ReadsTheKeyAgainWhenTheRevisionToResumeFromWasCompacted) {
  ASSERT_TRUE(client_->Put("/w/k", "1").ok());
  Seen seen;
  auto w = StartWatch("/w/k", &seen);
  ASSERT_TRUE(w);
  ASSERT_TRUE(seen.WaitFor("/w/k", "1", milliseconds(5'000)));
  {
    MutexLock lock(&seen.mu);
    seen.hold = true;  // the watch's thread stops in its next callback
  }
  ASSERT_TRUE(client_->Put("/w/k", "2").ok());
  ASSERT_TRUE(seen.WaitFor("/w/k", "2", milliseconds(5'000)));
  // While it is held: etcd restarts, the key changes and is compacted past the watch's revision.
  etcd_->Kill();
  ASSERT_TRUE(etcd_->Start()) << etcd_->Output();
  int64_t rev = 0;
  for (int i = 3; i <= 5; ++i) {
    auto r = client_->Put("/w/k", std::to_string(i));
    ASSERT_TRUE(r.ok());
    rev = *r;
  }
  ASSERT_TRUE(client_->Call("kv/compaction", fmt::format("{{\"revision\":\"{}\"}}", rev)).ok());
  {
    MutexLock lock(&seen.mu);
    seen.hold = false;
    seen.cv.NotifyAll();
  }
  // Its stream is gone; the next one from the revision after "2" is refused (compacted): it reads
  // the key again.
  EXPECT_TRUE(seen.WaitFor("/w/k", "5", milliseconds(10'000)));
  EXPECT_EQ(w->reads(), 2) << "no read again after the compaction";
}

TEST_F(EtcdWatchTest, ReadsTheKeyAgainWhenEtcdIsReplacedByOneAtALowerRevision) {
  for (int i = 1; i <= 20; ++i) ASSERT_TRUE(client_->Put("/w/k", std::to_string(i)).ok());
  Seen seen;
  auto w = StartWatch("/w/k", &seen);
  ASSERT_TRUE(w);
  ASSERT_TRUE(seen.WaitFor("/w/k", "20", milliseconds(5'000)));
  // A fresh etcd on the same address (as one restored from an older snapshot): its revisions
  // start again below the watch's; resumed from the old revision, the watch would see nothing.
  etcd_->Kill();
  etcd_->Wipe();
  ASSERT_TRUE(etcd_->Start()) << etcd_->Output();
  ASSERT_TRUE(client_->Put("/w/k", "fresh").ok());
  EXPECT_TRUE(seen.WaitFor("/w/k", "fresh", milliseconds(10'000)));
  EXPECT_GE(w->reads(), 2) << "not read again";
  ASSERT_TRUE(client_->Put("/w/k", "after").ok());
  EXPECT_TRUE(seen.WaitFor("/w/k", "after", milliseconds(5'000)));
}

TEST_F(EtcdWatchTest, StopFromTheCallbackOrFromManyThreadsAtOnceReturns) {
  ASSERT_TRUE(client_->Put("/w/k", "1").ok());
  std::atomic<etcd::Watch*> self{nullptr};
  std::atomic<bool> returned{false};
  etcd::WatchOptions o;
  o.endpoints = etcd_->endpoint();
  o.key = "/w/k";
  auto w = etcd::Watch::Start(o, [&](const etcd::Snapshot&, int64_t) {
    for (int i = 0; i < 500 && self.load() == nullptr; ++i) std::this_thread::sleep_for(10ms);
    if (self.load() != nullptr) self.load()->Stop();  // the watch's own thread: only asks
    returned.store(true);
  });
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  self.store(w->get());
  for (int i = 0; i < 500 && !returned.load(); ++i) std::this_thread::sleep_for(10ms);
  if (!returned.load()) {
    (void)w->release();  // it would hang the destructor too
    FAIL() << "Stop() from on_change did not return";
  }
  // Several threads stop it at once (the thread is joined once; the others wait for it).
  std::vector<std::thread> stoppers;
  for (int i = 0; i < 4; ++i) stoppers.emplace_back([&] { (*w)->Stop(); });
  for (auto& t : stoppers) t.join();
  int64_t streams = (*w)->streams();
  ASSERT_TRUE(client_->Put("/w/k", "2").ok());
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ((*w)->streams(), streams) << "still running after Stop()";
}

// etcd sends progress notifications on the stream (progress_notify, every
// --experimental-watch-progress-notify-interval): a healthy idle stream is not silent, so it is not
// opened again however long nothing changes.
class EtcdWatchProgressTest : public EtcdWatchTest {
 protected:
  std::vector<std::string> EtcdFlags() override {
    return {"--experimental-watch-progress-notify-interval", "200ms"};
  }
};

TEST_F(EtcdWatchProgressTest, AnIdleStreamWithProgressNotificationsIsNotOpenedAgain) {
  EXPECT_GE(etcd::WatchOptions{}.idle_timeout, milliseconds(60'000))
      << "every idle stream would reopen often (docs/leader-discovery.md)";
  ASSERT_TRUE(client_->Put("/w/k", "1").ok());
  Seen seen;
  etcd::WatchOptions o;
  o.endpoints = etcd_->endpoint();
  o.key = "/w/k";
  o.idle_timeout = milliseconds(1'000);
  auto w = etcd::Watch::Start(o, seen.Callback());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE(seen.WaitFor("/w/k", "1", milliseconds(5'000)));
  std::this_thread::sleep_for(milliseconds(3'000));
  EXPECT_EQ((*w)->streams(), 1) << "an idle stream was opened again despite progress notices";
  ASSERT_TRUE(client_->Put("/w/k", "2").ok());
  EXPECT_TRUE(seen.WaitFor("/w/k", "2", milliseconds(5'000)));
  EXPECT_EQ((*w)->reads(), 1);
}

TEST_F(EtcdWatchTest, TheLeaderFileFollowsTheLeaderAndTheEnd) {
  std::string path = dir_ / "leader.json";
  std::atomic<int> changes{0};
  auto lw = coord::LeaderWatch::Start(etcd_->endpoint(), "t", path, [&] { changes++; });
  ASSERT_TRUE(lw.ok()) << lw.status().ToString();
  coord::LeaderFileReader reader(path, "t");
  auto wait_for = [&](const std::function<bool(const Result<std::string>&)>& ok) {
    for (int i = 0; i < 250; ++i) {
      if (ok(reader.Read())) return true;
      std::this_thread::sleep_for(milliseconds(20));
    }
    return false;
  };
  EXPECT_TRUE(wait_for([](const Result<std::string>& r) {
    return r.status().code() == StatusCode::kNotFound &&
           r.status().message().find("no controller") != std::string::npos;
  })) << reader.Read().status().ToString();
  ASSERT_TRUE(client_->Put(coord::LeaderKey("t"), R"({"controller":"127.0.0.1:1"})").ok());
  EXPECT_TRUE(wait_for([](const Result<std::string>& r) { return r.ok() && *r == "127.0.0.1:1"; }));
  // a leader change: the file names the new one, as LookUpLeader does
  ASSERT_TRUE(client_->Put(coord::LeaderKey("t"), R"({"controller":"127.0.0.1:2"})").ok());
  EXPECT_TRUE(wait_for([](const Result<std::string>& r) { return r.ok() && *r == "127.0.0.1:2"; }));
  EXPECT_EQ(*coord::LookUpLeader(*client_, "t"), "127.0.0.1:2");
  // the job ends: the end key, then the leader resigns
  ASSERT_TRUE(
      client_->Put(coord::JobPrefix("t") + "end", R"({"exit_code":3,"reason":"done"})").ok());
  ASSERT_TRUE(client_->Txn({}, {etcd::Op::Delete(coord::LeaderKey("t"))}).ok());
  EXPECT_TRUE(wait_for(
      [](const Result<std::string>& r) { return r.status().code() == StatusCode::kAborted; }));
  int code = 0;
  EXPECT_EQ(reader.Read(&code).status().code(), StatusCode::kAborted);
  EXPECT_EQ(code, 3);
  EXPECT_GE(changes.load(), 3);
  // two watches: two reads and two streams, however many changes there were
  EXPECT_EQ((*lw)->requests(), 4);
}

// An agent on an IPv6-only network: etcd's endpoint is [v6]:port, and the watch dials it as such
// (its host without the brackets).
TEST(LeaderWatchIpv6Test, AWatchOfAnEtcdOnIpv6LoopbackFollowsTheLeader) {
  TempDir dir;
  const int port = testing::FreeLoopbackPort();
  const int peer = testing::FreeLoopbackPort();
  const std::string endpoint = fmt::format("[::1]:{}", port);
  testing::ChildProcess etcd(testing::EtcdServer::Argv(dir.path() + "/data", "http://" + endpoint,
                                                       fmt::format("http://127.0.0.1:{}", peer)),
                             dir.path() + "/etcd.out");
  auto client = etcd::Client::Create(endpoint, {milliseconds(500)});
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  Status put;
  for (int i = 0; i < 100; ++i) {
    put = (*client)->Put(coord::LeaderKey("v6"), R"({"controller":"[fd00::1]:4000"})").status();
    if (put.ok()) break;
    std::this_thread::sleep_for(milliseconds(100));
  }
  ASSERT_TRUE(put.ok()) << put.ToString() << "\n" << etcd.Output();
  const std::string path = dir.path() + "/leader.json";
  auto lw = coord::LeaderWatch::Start(endpoint, "v6", path);
  ASSERT_TRUE(lw.ok()) << lw.status().ToString();
  coord::LeaderFileReader reader(path, "v6");
  Result<std::string> seen = NotFoundError("not read");
  for (int i = 0; i < 250 && !(seen.ok() && *seen == "[fd00::1]:4000"); ++i) {
    std::this_thread::sleep_for(milliseconds(20));
    seen = reader.Read();
  }
  ASSERT_TRUE(seen.ok()) << seen.status().ToString();
  EXPECT_EQ(*seen, "[fd00::1]:4000");
  // and a change reaches it on the stream
  ASSERT_TRUE((*client)->Put(coord::LeaderKey("v6"), R"({"controller":"[fd00::2]:4000"})").ok());
  for (int i = 0; i < 250 && !(seen.ok() && *seen == "[fd00::2]:4000"); ++i) {
    std::this_thread::sleep_for(milliseconds(20));
    seen = reader.Read();
  }
  EXPECT_TRUE(seen.ok() && *seen == "[fd00::2]:4000") << seen.status().ToString();
}

// The reader reads the file each time: an update that kept the inode, the size and the mtime (a
// rename-over can reuse the inode number; mtime can be coarse) is seen.
TEST(LeaderFileReaderTest, SeesAnUpdateThatKeptTheInodeSizeAndMtime) {
  TempDir dir;
  const std::string path = dir / "leader.json";
  coord::LeaderKeys keys;
  keys.job = "t";
  keys.leader = R"({"controller":"127.0.0.1:1"})";
  ASSERT_TRUE(WriteFileAtomically(path, coord::EncodeLeaderFile(keys)).ok());
  struct stat before {};
  ASSERT_EQ(::stat(path.c_str(), &before), 0);
  coord::LeaderFileReader reader(path, "t");
  ASSERT_EQ(*reader.Read(), "127.0.0.1:1");
  keys.leader = R"({"controller":"127.0.0.1:2"})";
  ASSERT_TRUE(WriteFileSynced(path, coord::EncodeLeaderFile(keys)).ok());  // in place
  timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  struct stat after {};
  ASSERT_EQ(::stat(path.c_str(), &after), 0);
  ASSERT_EQ(after.st_ino, before.st_ino);
  ASSERT_EQ(after.st_size, before.st_size);
  EXPECT_EQ(*reader.Read(), "127.0.0.1:2");
}

TEST(LeaderFileReaderTest, RefusesAnotherJobsFileNamingBothJobs) {
  TempDir dir;
  const std::string path = dir / "leader.json";
  coord::LeaderKeys keys;
  keys.job = "other";
  keys.leader = R"({"controller":"127.0.0.1:1"})";
  ASSERT_TRUE(WriteFileAtomically(path, coord::EncodeLeaderFile(keys)).ok());
  auto r = coord::LeaderFileReader(path, "mine").Read();
  ASSERT_FALSE(r.ok()) << "another job's leader was taken: " << *r;
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("'other'"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("'mine'"), std::string::npos) << r.status().message();
}

TEST(LeaderFileReaderTest, AnEndWhoseReasonIsNotAStringIsStillTheEnd) {
  coord::LeaderKeys keys;
  keys.job = "t";
  keys.end = R"({"exit_code":5,"reason":{"not":"a string"}})";
  int code = 0;
  auto r = coord::InterpretLeaderKeys(keys, &code);  // threw type_error before
  EXPECT_EQ(r.status().code(), StatusCode::kAborted) << r.status().ToString();
  EXPECT_EQ(code, 5);
}

}  // namespace
}  // namespace nonstop
