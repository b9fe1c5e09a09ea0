// JobStore: the job's key-value store, kept by the controller (docs/store.md). torch code meets
// through a store (a rendezvous of a library, a counter, a flag): every worker of the job reaches
// this one over its control connection (control::kMsgStore), so a key one worker sets is one
// every other gets, through recoveries (the controller outlives workers) and through a takeover
// (every write is a journal record, and snapshots carry the whole store: takeover.h).
//
// Pure, like the Controller core that owns it: a request in, answers out, no socket or clock.
//  - A write (set, add, compare_set, append, delete_key) is applied once per client and
//    sequence number: the same request sent again after a lost connection gets the first answer
//    again, and a record for the journal is made only the first time. A client writes one
//    request at a time (control::StoreRequestMsg::seq).
//  - get and wait answer once their keys exist, or with a "timeout" error when the request's
//    timeout passes first (Expire); a worker whose connection is lost asks again, so its waits
//    are dropped (Forget).
//  - Bounded: at most kMaxBytes of keys and values, kMaxWaits waits in all (naming at most
//    kMaxWaitBytes of keys) and kMaxWaitsPerWorker each; a request beyond them is answered with a
//    "limit" error that says what to do, never held. A write that changes nothing (a set to the
//    value held, an add of 0 to a counter) is answered as a read: no record, nothing kept.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/time.h"
#include "control/messages.h"
#include "nonstop/status.h"

namespace nonstop::controller {

class JobStore {
 public:
  static constexpr size_t kMaxBytes = 16u << 20;
  static constexpr size_t kMaxWaits = 100'000;
  static constexpr size_t kMaxWaitsPerWorker = 256;
  static constexpr size_t kMaxWaitBytes = 64u << 20;  // the keys the waits name, in all

  struct Answer {
    int worker_id = -1;
    control::StoreReplyMsg reply;
  };
  struct Outcome {
    std::vector<Answer> answers;  // to the asker (unless it waits) and the waits it ended
    // A write that changed the store: the journal's record of it ({"event":"store", …}).
    std::optional<nlohmann::json> record;
  };

  Outcome Handle(int worker_id, const control::StoreRequestMsg& m, Clock::time_point now);
  // The waits whose timeout passed by `now`, answered with a "timeout" error.
  std::vector<Answer> Expire(Clock::time_point now);
  // The worker's connection is gone: its waits end unanswered (it sends them again).
  void Forget(int worker_id);
  // The worker's process is gone: its waits, and its last write (kept to answer it again).
  void Gone(int worker_id);

  // A journal record of Handle's, applied again (a takeover's replay). An error names what is
  // wrong with it.
  Status Replay(const nlohmann::json& record);
  // The store as JSON (a snapshot's part) and back.
  nlohmann::json Save() const;
  static Result<JobStore> Load(const nlohmann::json& saved);

  size_t keys() const { return data_.size(); }
  size_t bytes() const { return bytes_; }
  size_t waits() const { return waits_.size(); }

 private:
  struct Wait {
    int worker_id = -1;
    control::StoreRequestMsg request;  // get or wait
    Clock::time_point deadline{};
  };
  // A client's last write that changed the store, and its answer: the same write again gets it
  // again. A compare_set's answer is its desired value, which the request sent again carries:
  // kept as a flag, so that an entry is small whatever the value.
  struct LastWrite {
    std::string client;
    int64_t seq = 0;
    control::StoreReplyMsg reply;  // without its value
    bool value_is_desired = false;
  };

  // Applies a write; its answer. The store changed when `changed`.
  control::StoreReplyMsg Write(const control::StoreRequestMsg& m, bool* changed);
  control::StoreReplyMsg Read(const control::StoreRequestMsg& m) const;
  bool Has(const std::vector<std::string>& keys) const;
  // The waits on `key` whose keys all exist now, answered and removed.
  void Wake(const std::string& key, std::vector<Answer>* out);
  Status Put(const std::string& key, std::string value);
  // The answer a write sent again gets (`m`: it, as sent again).
  static control::StoreReplyMsg Again(const LastWrite& last, const control::StoreRequestMsg& m);
  void Remember(int worker_id, const control::StoreRequestMsg& m,
                const control::StoreReplyMsg& reply);
  // Removes a wait and what indexes it; the next wait.
  std::map<uint64_t, Wait>::iterator Drop(std::map<uint64_t, Wait>::iterator it);

  std::map<std::string, std::string> data_;
  size_t bytes_ = 0;                     // keys and values of data_
  std::map<int, LastWrite> last_write_;  // by worker id
  uint64_t next_wait_ = 1;
  std::map<uint64_t, Wait> waits_;                                // by id, in arrival order
  std::unordered_map<std::string, std::set<uint64_t>> waits_on_;  // key → the waits naming it
  std::map<int, size_t> waits_of_;                                // worker id → its waits
  size_t wait_bytes_ = 0;                                         // the keys waits_ names
  // No wait ends before this (Expire skips the scan until then); may be earlier than the truth.
  Clock::time_point earliest_deadline_ = Clock::time_point::max();
};

}  // namespace nonstop::controller
