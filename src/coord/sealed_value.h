// Values nonstop writes to etcd, sealed with the job key (docs/security.md, "What nonstop keeps in
// etcd"): whoever can write etcd but holds no job key cannot make one a reader acts on.
//
//   nonstop-sealed <epoch> <counter> <mac>\n<value>
//
// The MAC (HMAC-SHA256, hex, under a key derived from the job key for this purpose alone) covers
// the job's name, the etcd key the value is stored under, the writing leader's epoch, the counter
// and the value: a value moved to another key, copied from another job, or changed is refused.
// The counter is what the key's reader checks against the rest of what it read: for a journal
// record, the sequence number of its leader's first record (the records of one leader agree, a new
// leader begins at its own), the number of parts for the parts of a split record or
// snapshot, the snapshot's last record for the snapshot pointer, and the journal's last record
// for `progress`. The header is text, so `etcdctl get` still shows the value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/crypto.h"
#include "nonstop/status.h"

namespace nonstop::coord {

struct SealedValue {
  int64_t epoch = 0;
  uint64_t counter = 0;
  std::string value;
};

// The key values of `job` are sealed under (derived once per leader, not per value).
crypto::Key SealingKey(const crypto::Key& job_key, std::string_view job);

std::string Seal(const crypto::Key& sealing_key, std::string_view job, std::string_view etcd_key,
                 int64_t epoch, uint64_t counter, std::string_view value);

// The value stored under `etcd_key`, or DATA_LOSS saying why it cannot be believed: not sealed,
// a header that does not parse, a MAC that does not verify (a forgery, a value moved from another
// key or copied from another job).
Result<SealedValue> Unseal(const crypto::Key& sealing_key, std::string_view job,
                           std::string_view etcd_key, std::string_view text);

}  // namespace nonstop::coord
