#include "coord/own_records.h"

#include <utility>

#include <fmt/format.h>

#include "common/logging.h"

namespace nonstop::coord {

OwnRecords::OwnRecords(std::string begin, std::string end, std::string skip)
    : begin_(std::move(begin)), end_(std::move(end)), skip_(std::move(skip)) {}

void OwnRecords::Seed(const std::vector<etcd::KeyValue>& kvs) {
  MutexLock lock(&mu_);
  for (const auto& kv : kvs) {
    if (kv.key != skip_ && kv.key >= begin_ && kv.key < end_)
      own_[kv.key] = {kv.value, kv.mod_revision};
  }
  seeded_ = true;
}

void OwnRecords::BeginWrite() { mu_.Lock(); }

void OwnRecords::EndWrite(const std::vector<etcd::Op>& ops, int64_t landed_at) {
  if (landed_at == 0) {
    uncertain_ = ops;
    mu_.Unlock();
    return;
  }
  for (const etcd::Op& op : ops) {
    if (op.kind == etcd::Op::Kind::kPut) {
      own_[op.key] = {op.value, landed_at};
    } else if (op.kind == etcd::Op::Kind::kDelete && op.range_end.empty()) {
      own_.erase(op.key);
    } else if (op.kind == etcd::Op::Kind::kDelete) {
      own_.erase(own_.lower_bound(op.key), own_.lower_bound(op.range_end));
    }
  }
  uncertain_.clear();  // the same operations, sent again until they landed
  mu_.Unlock();
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

std::vector<RecordForgery> OwnRecords::Check(etcd::Client& client, const etcd::Compare& fence,
                                             size_t max_undos) {
  if (!mu_.TryLock()) return {};  // a write is in flight: the next check
  std::vector<RecordForgery> found = CheckHeld(client, fence, max_undos);
  mu_.Unlock();
  return found;
}

std::vector<RecordForgery> OwnRecords::CheckHeld(etcd::Client& client, const etcd::Compare& fence,
                                                 size_t max_undos) {
  if (!seeded_) return {};
  auto there = client.RangeFiltered(begin_, end_, {.keys_only = true});
  if (!there.ok()) return {};
  std::vector<RecordForgery> found;
  size_t undos = 0;
  std::set<std::string> present;
  for (const etcd::KeyValue& kv : there->kvs) {
    if (kv.key == skip_) continue;
    present.insert(kv.key);
    auto it = own_.find(kv.key);
    if (it != own_.end() && it->second.mod_revision == kv.mod_revision) continue;
    if (!uncertain_.empty()) {  // did a write whose answer was lost put it?
      auto value = client.Range(kv.key);
      if (!value.ok()) return found;
      if (!value->empty() && Uncertain(kv.key, &(*value)[0].value)) {
        own_[kv.key] = {(*value)[0].value, (*value)[0].mod_revision};
        continue;
      }
    }
    if (undos++ == max_undos) return found;
    Undo(client, fence, kv.key, kv.mod_revision, it == own_.end() ? nullptr : &it->second, &found);
  }
  for (auto it = own_.begin(); it != own_.end();) {
    if (present.contains(it->first)) {
      ++it;
    } else if (Uncertain(it->first, nullptr)) {
      it = own_.erase(it);
    } else {
      if (undos++ == max_undos) return found;
      Undo(client, fence, it->first, 0, &it->second, &found);
      ++it;
    }
  }
  return found;
}

void OwnRecords::Undo(etcd::Client& client, const etcd::Compare& fence, const std::string& key,
                      int64_t mod_revision, const Own* own, std::vector<RecordForgery>* found) {
  // Only if the key is still as found (a mod revision of 0: it is still missing).
  const etcd::Op undo = own == nullptr ? etcd::Op::Delete(key) : etcd::Op::Put(key, own->value);
  auto txn = client.Txn({fence, etcd::Compare::ModRevision(key, mod_revision)}, {undo});
  const bool restored = txn.ok() && txn->succeeded;
  if (restored && own != nullptr) own_[key].mod_revision = txn->revision;
  if (!restored && !failed_.insert({key, mod_revision}).second) return;  // reported once
  RecordForgery f{key, "", mod_revision, restored};
  if (own == nullptr) {
    f.why = fmt::format("etcd key {} (revision {}) was written, but not by this leader", key,
                        mod_revision);
  } else if (mod_revision == 0) {
    f.why = fmt::format("etcd key {}, written by this leader, was deleted", key);
  } else {
    f.why = fmt::format("etcd key {} (revision {}) holds a value this leader did not write", key,
                        mod_revision);
  }
  NONSTOP_LOG_WARNING("{}; {}", f.why,
                      !f.restored      ? "undoing it failed for now (the next check tries again)"
                      : own == nullptr ? "it is deleted"
                                       : "this leader's value is back");
  found->push_back(std::move(f));
}

}  // namespace nonstop::coord
