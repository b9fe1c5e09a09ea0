// The takeover's fold made serializable (src/controller/takeover.h): a
// snapshot of records 1..k followed by records k+1.. takes over exactly as
// the records 1.. do, wherever k falls (in the middle of a recovery, of a
// shrink's drain, of a takeover).
#include "controller/takeover.h"

#include <gtest/gtest.h>

#include "controller/takeover_test_records.h"

namespace nonstop::controller {
namespace {

using nlohmann::json;

// Every field but read_at_us (the time of the replay).
void ExpectSame(const JournalTakeover& a, const JournalTakeover& b, const std::string& where) {
  SCOPED_TRACE(where);
  const TakeoverState &x = a.state, &y = b.state;
  EXPECT_EQ(a.controller, b.controller);
  EXPECT_EQ(x.generation, y.generation);
  EXPECT_EQ(x.members, y.members);
  EXPECT_EQ(x.resume_step, y.resume_step);
  EXPECT_EQ(x.highest_step, y.highest_step);
  ASSERT_EQ(x.workers.size(), y.workers.size());
  for (size_t i = 0; i < x.workers.size(); ++i) {
    EXPECT_EQ(x.workers[i].worker_id, y.workers[i].worker_id);
    EXPECT_EQ(x.workers[i].pid, y.workers[i].pid);
    EXPECT_EQ(x.workers[i].address, y.workers[i].address);
    EXPECT_EQ(x.workers[i].spare, y.workers[i].spare);
    EXPECT_EQ(x.workers[i].host, y.workers[i].host);
  }
  ASSERT_EQ(x.hosts.size(), y.hosts.size());
  for (size_t i = 0; i < x.hosts.size(); ++i) {
    EXPECT_EQ(x.hosts[i].host_id, y.hosts[i].host_id);
    EXPECT_EQ(x.hosts[i].nproc, y.hosts[i].nproc);
    EXPECT_EQ(x.hosts[i].spares, y.hosts[i].spares);
    EXPECT_EQ(x.hosts[i].address, y.hosts[i].address);
    EXPECT_EQ(x.hosts[i].incarnation, y.hosts[i].incarnation);
    EXPECT_EQ(x.hosts[i].elastic, y.hosts[i].elastic);
  }
  EXPECT_EQ(x.next_worker_id, y.next_worker_id);
  EXPECT_EQ(x.target_world, y.target_world);
  EXPECT_EQ(x.withheld, y.withheld);
  EXPECT_EQ(x.recoveries, y.recoveries);
  EXPECT_EQ(x.takeovers, y.takeovers);
  EXPECT_EQ(x.store, y.store);
  ASSERT_EQ(x.open_recovery.has_value(), y.open_recovery.has_value());
  if (x.open_recovery) {
    const UnfinishedRecovery &o = *x.open_recovery, &p = *y.open_recovery;
    EXPECT_EQ(o.id, p.id);
    EXPECT_EQ(o.planned, p.planned);
    EXPECT_EQ(o.from_generation, p.from_generation);
    EXPECT_EQ(o.old_members, p.old_members);
    EXPECT_EQ(o.cause, p.cause);
    EXPECT_EQ(o.injected, p.injected);
    EXPECT_EQ(o.started_us, p.started_us);
    EXPECT_EQ(o.plan_generation, p.plan_generation);
    EXPECT_EQ(o.plan_us, p.plan_us);
  }
}

std::vector<json> Slice(const std::vector<json>& r, size_t from, size_t to) {
  return {r.begin() + static_cast<ptrdiff_t>(from), r.begin() + static_cast<ptrdiff_t>(to)};
}

std::vector<json> Journal(int recoveries) {
  testing::JournalMaker maker(6, 3);
  for (int i = 0; i < recoveries; ++i) maker.Recovery();
  return maker.records();
}

TEST(TakeoverSnapshotTest, ASnapshotAndItsTailTakeOverAsTheWholeJournalWhereverTheCutFalls) {
  const std::vector<json> all = Journal(24);  // every kind of recovery, four times over
  auto whole = TakeoverFromJournal(all);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_GT(whole->state.recoveries, 20);
  EXPECT_GT(whole->state.takeovers, 0);
  // The store as the members left it: the counter of every recovery, the last recovery's key.
  auto store = JobStore::Load(whole->state.store);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->keys(), 2u) << store->Save().dump();
  // The takeover from records 1..m, for every m.
  std::vector<Result<JournalTakeover>> upto;
  for (size_t m = 0; m <= all.size(); ++m) upto.push_back(TakeoverFromJournal(Slice(all, 0, m)));
  bool cut_in_a_recovery = false;
  for (size_t k = 1; k < all.size(); ++k) {
    auto snapshot = CompactJournal(Slice(all, 0, k));
    ASSERT_TRUE(snapshot.ok()) << k << ": " << snapshot.status().ToString();
    EXPECT_EQ((*snapshot)["event"], "snapshot");
    std::vector<json> resumed = {*snapshot};
    auto tail = Slice(all, k, all.size());
    resumed.insert(resumed.end(), tail.begin(), tail.end());
    auto t = TakeoverFromJournal(resumed);
    ASSERT_TRUE(t.ok()) << k << ": " << t.status().ToString();
    ExpectSame(*t, *whole, fmt::format("cut after record {} of {}", k, all.size()));
    if (HasFatalFailure() || HasNonfatalFailure()) return;
    // The snapshot and the next few records (what the fold remembers but has not applied yet,
    // e.g. a shrink asked for whose plan comes later, must survive the snapshot).
    for (size_t m = k + 1; m <= std::min(all.size(), k + 12); ++m) {
      std::vector<json> some = {*snapshot};
      auto next = Slice(all, k, m);
      some.insert(some.end(), next.begin(), next.end());
      auto s = TakeoverFromJournal(some);
      ASSERT_EQ(s.ok(), upto[m].ok()) << k << ".." << m;
      if (s.ok()) ExpectSame(*s, *upto[m], fmt::format("snapshot of 1..{}, then to {}", k, m));
      if (HasFatalFailure() || HasNonfatalFailure()) return;
    }
    // ... and the snapshot alone takes over as the records it stands for.
    const auto& prefix = upto[k];
    auto alone = TakeoverFromJournal({*snapshot});
    ASSERT_EQ(prefix.ok(), alone.ok()) << k;
    if (prefix.ok()) {
      ExpectSame(*alone, *prefix, fmt::format("the snapshot of records 1..{}", k));
      cut_in_a_recovery = cut_in_a_recovery || prefix->state.open_recovery.has_value();
    }
  }
  EXPECT_TRUE(cut_in_a_recovery) << "no cut fell inside a recovery: the journal is not realistic";
}

TEST(TakeoverSnapshotTest, SnapshotsOfSnapshotsStayTheSameSizeAsTheJobGoesOn) {
  const std::vector<json> all = Journal(600);
  auto whole = TakeoverFromJournal(all);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  // Compacted every 100 records, as etcd's writer does (a snapshot, then its tail).
  json snapshot;
  size_t largest = 0, first = 0;
  for (size_t k = 0; k < all.size(); k += 100) {
    std::vector<json> batch;
    if (!snapshot.is_null()) batch.push_back(snapshot);
    auto tail = Slice(all, k, std::min(all.size(), k + 100));
    batch.insert(batch.end(), tail.begin(), tail.end());
    auto s = CompactJournal(batch);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    snapshot = *s;
    if (first == 0) first = snapshot.dump().size();
    largest = std::max(largest, snapshot.dump().size());
  }
  auto t = TakeoverFromJournal({snapshot});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ExpectSame(*t, *whole, "600 recoveries, compacted every 100 records");
  size_t records_bytes = 0;
  for (const auto& r : all) records_bytes += r.dump().size();
  EXPECT_LT(largest, 3 * first) << "the snapshot grows with the job";
  EXPECT_LT(largest * 50, records_bytes) << "the snapshot is not compact";
}

TEST(TakeoverSnapshotTest, WhatTheTakeoverDoesNotReadCanBeLeftOut) {
  const std::vector<json> all = Journal(12);
  std::vector<json> read;
  for (const auto& r : all)
    if (TakeoverReads(r)) read.push_back(r);
  EXPECT_LT(read.size(), all.size()) << "the journal has ready records, which the takeover skips";
  EXPECT_FALSE(TakeoverReads({{"event", "ready"}}));
  EXPECT_TRUE(TakeoverReads({{"event", "plan"}}));
  auto a = TakeoverFromJournal(all), b = TakeoverFromJournal(read);
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectSame(*b, *a, "without the records it does not read");
}

TEST(TakeoverSnapshotTest, AnEndedJobIsNotCompactedAndAnUnknownSnapshotIsRefused) {
  std::vector<json> all = Journal(2);
  all.push_back({{"event", "job_end"}, {"exit_code", 0}, {"reason", "done"}});
  auto ended = CompactJournal(all);
  ASSERT_FALSE(ended.ok());
  EXPECT_NE(ended.status().message().find("already ended"), std::string::npos);
  auto s = CompactJournal(Journal(2));
  ASSERT_TRUE(s.ok());
  (*s)["format"] = 99;
  auto t = TakeoverFromJournal({*s});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("format 99"), std::string::npos) << t.status().ToString();
  // Format 1 (before the store) is still read, with an empty store.
  json old = *s;
  old["format"] = 1;
  old.erase("store");
  auto from_old = TakeoverFromJournal({old});
  ASSERT_TRUE(from_old.ok()) << from_old.status().ToString();
  EXPECT_EQ(JobStore::Load(from_old->state.store)->keys(), 0u);
  (*s)["format"] = 2;
  (*s)["state"].erase("members");
  EXPECT_FALSE(TakeoverFromJournal({*s}).ok()) << "a snapshot without its members";
}

}  // namespace
}  // namespace nonstop::controller
