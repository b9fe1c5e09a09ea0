#include "controller/journal.h"

#include <gtest/gtest.h>

#include <filesystem>

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

}  // namespace
}  // namespace nonstop::controller
