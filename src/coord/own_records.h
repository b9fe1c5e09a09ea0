// OwnRecords: what a leader wrote under its job's keys in etcd, so that a value changed, a key
// deleted or a key added behind its back (by a writer of etcd without the job key,
// docs/security.md) is found while it leads, not only by the next leader's read: its own value
// is put back (a stranger's key deleted), each under the leader's fence, and reported.
//
// It keeps each key's mod revision as its own transaction left it (a landed transaction's
// revision is that of every key it put). A check lists the keys there with their revisions
// (keys_only: no values cross the wire): a key missing was deleted, one unknown was added, one
// at another revision was changed. A check never runs while a write of the leader's is in
// flight (one lock is held across either), so what etcd holds and what the leader wrote agree
// but for what others did.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "coord/etcd.h"

namespace nonstop::coord {

struct RecordForgery {
  std::string key;
  std::string why;           // what was found
  int64_t mod_revision = 0;  // the found value's (0: the key was deleted)
  bool restored = false;     // the leader's value is back, or the stranger's key is gone
};

class OwnRecords {
 public:
  // The keys of [begin, end) are the leader's, but `skip` (checked elsewhere: the leader key).
  OwnRecords(std::string begin, std::string end, std::string skip);

  // The keys as the takeover read them: they are this leader's from now on (what did not
  // verify, its first write deletes). Checks begin after it.
  void Seed(const std::vector<etcd::KeyValue>& kvs) NONSTOP_LOCKS_EXCLUDED(mu_);

  // Around each transaction of the leader's under its keys. `landed_at`: the revision it landed
  // at, or 0 when its effect is unknown (an answer lost, or refused): a value it puts, or a key
  // it deletes, is then taken as the leader's when a check finds it so, until one lands.
  void BeginWrite() NONSTOP_ACQUIRE(mu_);
  void EndWrite(const std::vector<etcd::Op>& ops, int64_t landed_at) NONSTOP_RELEASE(mu_);

  // Finds what changed behind the leader's back and undoes it, each transaction under `fence`,
  // at most `max_undos` of them (the rest at the next check). What it could not undo it reports
  // once and tries again at the next check. Nothing while a write is in flight, before Seed, or
  // when etcd does not answer.
  std::vector<RecordForgery> Check(etcd::Client& client, const etcd::Compare& fence,
                                   size_t max_undos = 64) NONSTOP_LOCKS_EXCLUDED(mu_);

 private:
  struct Own {
    std::string value;
    int64_t mod_revision = 0;
  };
  std::vector<RecordForgery> CheckHeld(etcd::Client& client, const etcd::Compare& fence,
                                       size_t max_undos) NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Uncertain(const std::string& key, const std::string* value) const
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A key found at `mod_revision` (0: gone) that the leader holds as `own` (null: never wrote):
  // undone; reported if undone, or the first time it could not be.
  void Undo(etcd::Client& client, const etcd::Compare& fence, const std::string& key,
            int64_t mod_revision, const Own* own, std::vector<RecordForgery>* found)
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string begin_, end_, skip_;
  Mutex mu_;  // held across a write of the leader's, and across a check
  std::map<std::string, Own> own_ NONSTOP_GUARDED_BY(mu_);
  std::vector<etcd::Op> uncertain_ NONSTOP_GUARDED_BY(mu_);  // a write whose effect is unknown
  std::set<std::pair<std::string, int64_t>> failed_
      NONSTOP_GUARDED_BY(mu_);  // reported, not undone
  bool seeded_ NONSTOP_GUARDED_BY(mu_) = false;
};

}  // namespace nonstop::coord
