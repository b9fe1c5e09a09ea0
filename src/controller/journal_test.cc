#include "controller/journal.h"

#include <gtest/gtest.h>

#include <poll.h>
#include <sys/resource.h>

#include <csignal>

#include <filesystem>
#include <fstream>

#include "common/temp_dir.h"

namespace nonstop::controller {
namespace {

TEST(JournalTest, AnEarlierJobsJournalIsKeptNotTruncated) {
  TempDir dir;
  std::string path = dir / "runs/journal.jsonl";
  {
    auto first = Journal::Open(path);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    (*first)->Append({{"event", "job_start"}, {"job", 1}});
    EXPECT_TRUE((*first)->rotated_to().empty());
  }
  std::vector<std::string> kept;
  for (int job = 2; job <= 3; ++job) {
    auto next = Journal::Open(path);
    ASSERT_TRUE(next.ok()) << next.status().ToString();
    (*next)->Append({{"event", "job_start"}, {"job", job}});
    ASSERT_FALSE((*next)->rotated_to().empty());
    kept.push_back((*next)->rotated_to());
  }
  // Two rotations within the same second get distinct names.
  ASSERT_NE(kept[0], kept[1]);
  auto job1 = Journal::Read(kept[0]);
  auto job2 = Journal::Read(kept[1]);
  auto job3 = Journal::Read(path);
  ASSERT_TRUE(job1.ok() && job2.ok() && job3.ok());
  ASSERT_EQ(job1->size(), 1u);
  EXPECT_EQ((*job1)[0]["job"], 1);
  EXPECT_EQ((*job2)[0]["job"], 2);
  EXPECT_EQ((*job3)[0]["job"], 3);
  EXPECT_NE(kept[0].find("journal-"), std::string::npos) << kept[0];
  EXPECT_EQ(std::filesystem::path(kept[0]).extension(), ".jsonl");
}

// A controller that takes over (or leads again) starts its journal with its predecessors'
// records: the path names the earlier journal until the new one holds all of them, so a reader
// never finds an empty or half-copied journal in between.
TEST(JournalTest, ANewJournalHoldsItsHistoryTheMomentItIsThere) {
  TempDir dir;
  std::string path = dir / "journal.jsonl";
  {
    auto first = Journal::Open(path);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    (*first)->Append({{"event", "job_start"}, {"term", 1}});
  }
  std::vector<nlohmann::json> history;
  for (int i = 0; i < 500; ++i) history.push_back({{"event", "spawn"}, {"worker", i}});
  auto next = Journal::Open(path, history);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  // Nothing flushed yet: the history was written before the file took the path.
  auto read = Journal::Read(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->size(), 500u);
  EXPECT_EQ((*read)[499]["worker"], 499);
  EXPECT_FALSE((*read)[0].contains("time_us")) << "a copied record is written as it is";
  auto kept = Journal::Read((*next)->rotated_to());
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  ASSERT_EQ(kept->size(), 1u);
  EXPECT_EQ((*kept)[0]["term"], 1);
  (*next)->Append({{"event", "takeover"}});
  (*next)->Sync();
  next->reset();
  read = Journal::Read(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->size(), 501u);
  EXPECT_EQ(read->back()["event"], "takeover");
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) files += e.exists();
  EXPECT_EQ(files, 2u) << "a temporary file was left beside the journal";
}

// The loop never waits on the disk: Sync asks the writer thread, which says through wake_fd when
// durable() has reached the records (the cue for the orders that waited for them).
TEST(JournalTest, SyncMakesTheRecordsDurableAndWakesTheLoop) {
  TempDir dir;
  auto j = Journal::Open(dir / "journal.jsonl");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  for (int i = 0; i < 3; ++i) (*j)->Append({{"event", "tick"}, {"i", i}});
  EXPECT_EQ((*j)->appended(), 3u);
  (*j)->Flush();
  EXPECT_EQ((*j)->durable(), 0u) << "a Flush hands records over; only a Sync makes them durable";
  (*j)->Sync();
  pollfd p{(*j)->wake_fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 10'000), 1) << "the writer never said the sync was done";
  EXPECT_EQ((*j)->durable(), 3u);
  auto read = Journal::Read(dir / "journal.jsonl");
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->size(), 3u);
  EXPECT_EQ((*read)[2]["i"], 2);
  EXPECT_TRUE((*read)[0].contains("time_us"));
}

// Waits (≤ 10 s) until the journal's writer says `n` records are durable.
void WaitDurable(Journal& j, uint64_t n) {
  for (int i = 0; i < 100 && j.durable() < n; ++i) {
    pollfd p{j.wake_fd(), POLLIN, 0};
    if (::poll(&p, 1, 100) == 1) {
      uint64_t count;
      ASSERT_EQ(::read(j.wake_fd(), &count, sizeof(count)), static_cast<ssize_t>(sizeof(count)));
    }
  }
  ASSERT_GE(j.durable(), n) << "the writer never synced them";
}

TEST(JournalTest, AWriteThatFailsPartWayLeavesWholeLinesAndTheNextRecordsReadable) {
  TempDir dir;
  std::string path = dir / "journal.jsonl";
  auto j = Journal::Open(path);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  (*j)->Append({{"event", "tick"}, {"i", 0}});
  (*j)->Sync();
  WaitDurable(**j, 1);
  // The disk fills 10 bytes into the next record: the kernel writes those 10, then refuses.
  rlimit was{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &was), 0);
  const auto full_at = std::filesystem::file_size(path) + 10;
  ASSERT_LT(full_at, was.rlim_cur) << "cannot lower the file-size limit here";
  auto* was_handler = std::signal(SIGXFSZ, SIG_IGN);
  {
    // The limit and the signal are the whole process's: put back however this block ends.
    struct Restore {
      rlimit limit;
      void (*handler)(int);
      ~Restore() {
        ::setrlimit(RLIMIT_FSIZE, &limit);
        std::signal(SIGXFSZ, handler);
      }
    } restore{was, was_handler};
    rlimit full = was;
    full.rlim_cur = full_at;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &full), 0);
    (*j)->Append({{"event", "lost_to_a_full_disk"}, {"padding", std::string(200, 'x')}});
    (*j)->Sync();
    WaitDurable(**j, 2);
  }
  EXPECT_EQ(std::filesystem::file_size(path), full_at - 10) << "the torn batch was not cut back";
  (*j)->Append({{"event", "tick"}, {"i", 2}});
  (*j)->Sync();
  WaitDurable(**j, 3);
  auto read = Journal::Read(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0]["i"], 0);
  EXPECT_EQ((*read)[1]["i"], 2);
}

TEST(JournalTest, EverythingAppendedIsOnDiskOnceTheJournalIsGone) {
  TempDir dir;
  std::string path = dir / "journal.jsonl";
  {
    auto j = Journal::Open(path);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    for (int i = 0; i < 1000; ++i) {
      (*j)->Append({{"event", "tick"}, {"i", i}});
      if (i % 97 == 0) (*j)->Flush();
      if (i % 301 == 0) (*j)->Sync();
    }
  }  // no Flush after the last ones
  auto read = Journal::Read(path);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ASSERT_EQ(read->size(), 1000u);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ((*read)[i]["i"], i) << "records out of order";
}

TEST(JournalTest, GoingOnCutsATornLastLineAndRefusesASecondWriter) {
  TempDir dir;
  std::string path = dir / "journal.jsonl";
  {
    std::ofstream out(path);
    out << R"({"event":"job_start"})"
        << "\n"
        << R"({"event":"torn_by_a_ki)";
  }
  {
    auto j = Journal::OpenForAppend(path);
    ASSERT_TRUE(j.ok()) << j.status().ToString();
    auto second = Journal::OpenForAppend(path);
    EXPECT_FALSE(second.ok()) << "two controllers writing one journal";
    (*j)->Append({{"event", "takeover"}});
  }
  bool torn = false;
  auto read = Journal::Read(path, &torn);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_FALSE(torn);
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0]["event"], "job_start");
  EXPECT_EQ((*read)[1]["event"], "takeover");
}

}  // namespace
}  // namespace nonstop::controller
