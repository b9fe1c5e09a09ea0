#include "coord/own_records.h"

#include <set>
#include <utility>

#include <fmt/format.h>

#include "common/logging.h"

namespace nonstop::coord {

OwnRecords::OwnRecords(std::string begin, std::string end, std::string skip)
    : begin_(std::move(begin)), end_(std::move(end)), skip_(std::move(skip)) {}

void OwnRecords::Seed(const std::vector<etcd::KeyValue>& kvs, int64_t revision) {
  MutexLock lock(&mu_);
  for (const auto& kv : kvs) {
    if (kv.key != skip_ && kv.key >= begin_ && kv.key < end_) own_[kv.key] = kv.value;
  }
  checked_ = revision;
  seeded_ = true;
}

void OwnRecords::BeginWrite() { mu_.Lock(); }

void OwnRecords::EndWrite(const std::vector<etcd::Op>& ops, bool landed) {
  if (landed) {
    Apply(ops);
    uncertain_.clear();  // the same operations, sent again until they landed
  } else {
    uncertain_ = ops;
  }
  mu_.Unlock();
}

void OwnRecords::Apply(const std::vector<etcd::Op>& ops) {
  for (const etcd::Op& op : ops) {
    if (op.kind == etcd::Op::Kind::kPut) {
      own_[op.key] = op.value;
    } else if (op.kind == etcd::Op::Kind::kDelete && op.range_end.empty()) {
      own_.erase(op.key);
    } else if (op.kind == etcd::Op::Kind::kDelete) {
      own_.erase(own_.lower_bound(op.key), own_.lower_bound(op.range_end));
    }
  }
}

// `value`: a put of the uncertain write (the key holds it); null: a delete of it (the key is
// gone).
bool OwnRecords::Uncertain(const std::string& key, const std::string* value) const {
  for (const etcd::Op& op : uncertain_) {
    if (value != nullptr && op.kind == etcd::Op::Kind::kPut && op.key == key && op.value == *value)
      return true;
    if (value == nullptr && op.kind == etcd::Op::Kind::kDelete &&
        (op.range_end.empty() ? key == op.key : key >= op.key && key < op.range_end))
      return true;
  }
  return false;
}

std::vector<RecordForgery> OwnRecords::Check(etcd::Client& client, const etcd::Compare& fence) {
  if (!mu_.TryLock()) return {};  // a write is in flight: the next check
  std::vector<RecordForgery> found = CheckHeld(client, fence);
  mu_.Unlock();
  return found;
}

std::vector<RecordForgery> OwnRecords::CheckHeld(etcd::Client& client, const etcd::Compare& fence) {
  if (!seeded_) return {};
  auto changed = client.RangeFiltered(begin_, end_, {.min_mod_revision = checked_ + 1});
  if (!changed.ok()) return {};
  auto there = client.RangeFiltered(begin_, end_, {.keys_only = true});
  if (!there.ok()) return {};
  std::vector<RecordForgery> found;
  for (const etcd::KeyValue& kv : changed->kvs) {
    if (kv.key == skip_) continue;
    auto it = own_.find(kv.key);
    if (it != own_.end() && it->second == kv.value) continue;
    if (Uncertain(kv.key, &kv.value)) {  // the lost answer's write landed
      own_[kv.key] = kv.value;
      continue;
    }
    found.push_back(
        Undo(client, fence, kv.key, kv.mod_revision, it == own_.end() ? nullptr : &it->second));
  }
  std::set<std::string> present;
  for (const etcd::KeyValue& kv : there->kvs) present.insert(kv.key);
  for (auto it = own_.begin(); it != own_.end();) {
    if (present.contains(it->first)) {
      ++it;
    } else if (Uncertain(it->first, nullptr)) {
      it = own_.erase(it);
    } else {
      found.push_back(Undo(client, fence, it->first, 0, &it->second));
      ++it;
    }
  }
  // A change made since the first read has a later revision: the next check sees it.
  checked_ = changed->revision;
  return found;
}

RecordForgery OwnRecords::Undo(etcd::Client& client, const etcd::Compare& fence,
                               const std::string& key, int64_t mod_revision,
                               const std::string* own) {
  RecordForgery f{key, "", mod_revision, false};
  if (own == nullptr) {
    f.why = fmt::format("etcd key {} (revision {}) was written, but not by this leader", key,
                        mod_revision);
  } else if (mod_revision == 0) {
    f.why = fmt::format("etcd key {}, written by this leader, was deleted", key);
  } else {
    f.why = fmt::format("etcd key {} (revision {}) holds a value this leader did not write", key,
                        mod_revision);
  }
  // Only if the key is still as found (a mod revision of 0: it is still missing).
  const etcd::Op undo = own == nullptr ? etcd::Op::Delete(key) : etcd::Op::Put(key, *own);
  auto txn = client.Txn({fence, etcd::Compare::ModRevision(key, mod_revision)}, {undo});
  f.restored = txn.ok() && txn->succeeded;
  NONSTOP_LOG_WARNING("{}; {}", f.why,
                      !f.restored      ? "undoing it failed for now (the next check looks)"
                      : own == nullptr ? "it is deleted"
                                       : "this leader's value is back");
  return f;
}

}  // namespace nonstop::coord
