// OwnRecords: what a leader wrote under its job's keys in etcd, so that a value changed, a key
// deleted or a key added behind its back (by a writer of etcd without the job key,
// docs/security.md) is found while it leads, not only by the next leader's read: its own value
// is put back (a stranger's key deleted), each under the leader's fence, and reported.
//
// Each check reads the keys changed since the last one (etcd's min_mod_revision) and the names
// of the keys there (keys_only): two small reads, whatever the journal's length. A check never
// runs while a write of the leader's is in flight (one lock is held across either), so what etcd
// holds and what the leader wrote agree but for what others did.
#pragma once

#include <cstdint>
#include <map>
#include <string>
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

  // The keys as the takeover read them at `revision`: they are this leader's from now on (what
  // did not verify, its first write deletes). Checks begin after it.
  void Seed(const std::vector<etcd::KeyValue>& kvs, int64_t revision) NONSTOP_LOCKS_EXCLUDED(mu_);

  // Around each transaction of the leader's under its keys. `landed`: it succeeded; otherwise
  // its effect is unknown (an answer lost), and a value it puts, or a key it deletes, is taken as
  // the leader's when a check finds it so, until one lands.
  void BeginWrite() NONSTOP_ACQUIRE(mu_);
  void EndWrite(const std::vector<etcd::Op>& ops, bool landed) NONSTOP_RELEASE(mu_);

  // Finds what changed behind the leader's back since the last check and undoes it, each
  // transaction under `fence`. Nothing while a write is in flight or before Seed, or when etcd
  // does not answer (the next call looks again).
  std::vector<RecordForgery> Check(etcd::Client& client, const etcd::Compare& fence)
      NONSTOP_LOCKS_EXCLUDED(mu_);

 private:
  std::vector<RecordForgery> CheckHeld(etcd::Client& client, const etcd::Compare& fence)
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Apply(const std::vector<etcd::Op>& ops) NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Uncertain(const std::string& key, const std::string* value) const
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RecordForgery Undo(etcd::Client& client, const etcd::Compare& fence, const std::string& key,
                     int64_t mod_revision, const std::string* own)
      NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string begin_, end_, skip_;
  Mutex mu_;  // held across a write of the leader's, and across a check
  std::map<std::string, std::string> own_ NONSTOP_GUARDED_BY(mu_);  // key → value
  std::vector<etcd::Op> uncertain_ NONSTOP_GUARDED_BY(mu_);         // a write whose answer was lost
  int64_t checked_ NONSTOP_GUARDED_BY(mu_) = 0;  // changes up to this revision are judged
  bool seeded_ NONSTOP_GUARDED_BY(mu_) = false;
};

}  // namespace nonstop::coord
