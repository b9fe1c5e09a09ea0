// StoreClient: a worker's end of the job's store (nonstop/store.h, docs/store.md). Each call is
// one control::StoreRequestMsg on the worker's control connection, numbered, and waits for the
// controller's answer (control::kMsgStoreReply, handed in by the Session's I/O thread). The
// requests not answered when the connection is lost are sent again with the join that reconnects
// (Unanswered): a get or a wait with the time it has left, a write as it was (the controller
// applies it once: its client id and number). Writes go one at a time, and at most
// kMaxInFlight calls wait for their answers at once; a call that gets no turn within its timeout
// fails as one that gets no answer.
//
// Thread-safety: the Store calls from any thread; OnReply, Unanswered, Fail and AbortWaits from
// the I/O thread (or any).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/time.h"
#include "control/messages.h"
#include "nonstop/store.h"

namespace nonstop::worker {

class StoreClient final : public Store {
 public:
  // Sends one frame to the controller; an error (not connected) leaves the request to be sent
  // again by Unanswered.
  using SendFn = std::function<Status(uint16_t type, const std::string& payload)>;
  // The time a get or wait is given past its timeout for the controller's answer (which says
  // which keys are missing) before the call gives up itself.
  static constexpr Millis kAnswerGrace{2'000};
  // Calls of one process waiting for their answers at once (the others wait for a turn): fewer
  // than the controller's waits per worker (JobStore::kMaxWaitsPerWorker), so that a process's
  // threads never meet that limit.
  static constexpr size_t kMaxInFlight = 64;

  explicit StoreClient(SendFn send);

  Status Set(std::string_view key, std::string_view value, Millis timeout) override;
  Result<std::string> Get(std::string_view key, Millis timeout) override;
  Result<int64_t> Add(std::string_view key, int64_t amount, Millis timeout) override;
  Result<std::string> CompareSet(std::string_view key, std::string_view expected,
                                 std::string_view desired, Millis timeout) override;
  Status Append(std::string_view key, std::string_view value, Millis timeout) override;
  Status Wait(std::span<const std::string> keys, Millis timeout) override;
  Result<bool> Check(std::span<const std::string> keys, Millis timeout) override;
  Result<bool> DeleteKey(std::string_view key, Millis timeout) override;
  Result<int64_t> NumKeys(Millis timeout) override;

  // An answer from the controller; INVALID_ARGUMENT if it is malformed. One for no call waiting
  // (answered already, or given up) is dropped.
  Status OnReply(std::string_view payload) NONSTOP_LOCKS_EXCLUDED(mu_);
  // The frames of the calls not answered yet, for a new connection.
  std::vector<std::pair<uint16_t, std::string>> Unanswered(Deadline now)
      NONSTOP_LOCKS_EXCLUDED(mu_);
  // No controller will answer again (or the session ends): every call fails with `why`.
  void Fail(const Status& why) NONSTOP_LOCKS_EXCLUDED(mu_);
  // The generation ended (a member failed): the gets and waits in progress end with `why`
  // (ABORTED: the step runs again), as the collectives do, and so do those begun later, until
  // ResumeWaits (the next generation); the controller drops them too.
  void AbortWaits(const Status& why) NONSTOP_LOCKS_EXCLUDED(mu_);
  void ResumeWaits() NONSTOP_LOCKS_EXCLUDED(mu_);

 private:
  struct Call {
    control::StoreRequestMsg request;
    Deadline keys_by = kNoDeadline;  // get, wait: when their keys are no longer waited for
    std::optional<control::StoreReplyMsg> reply;
    Status ended;  // AbortWaits
  };
  Result<control::StoreReplyMsg> Ask(control::StoreRequestMsg m, Millis timeout)
      NONSTOP_LOCKS_EXCLUDED(mu_);

  const std::string client_;  // random: this process's calls, told from an earlier one's
  const SendFn send_;
  Mutex mu_;
  CondVar cv_;
  int64_t next_seq_ NONSTOP_GUARDED_BY(mu_) = 1;
  std::map<int64_t, Call> calls_ NONSTOP_GUARDED_BY(mu_);  // by seq
  Status failed_ NONSTOP_GUARDED_BY(mu_);
  Status aborted_ NONSTOP_GUARDED_BY(mu_);        // AbortWaits, until ResumeWaits
  bool writing_ NONSTOP_GUARDED_BY(mu_) = false;  // a write waits for its answer
};

}  // namespace nonstop::worker
