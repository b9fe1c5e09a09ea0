#include "worker/store_client.h"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/crypto.h"

namespace nonstop::worker {

using control::StoreOp;
using control::StoreReplyMsg;
using control::StoreRequestMsg;

namespace {

// What the wire takes (control::DecodeStoreRequest refuses the rest): said here, before sending.
Status CheckKeys(std::span<const std::string> keys) {
  if (keys.size() > control::kMaxStoreKeysPerRequest) {
    return InvalidArgumentError(
        fmt::format("the job's store takes at most {} keys in one call, got {}",
                    control::kMaxStoreKeysPerRequest, keys.size()));
  }
  for (const std::string& key : keys) {
    if (key.size() > control::kMaxStoreKeyBytes) {
      return InvalidArgumentError(
          fmt::format("a key of the job's store has at most {} bytes, "
                      "this one {}",
                      control::kMaxStoreKeyBytes, key.size()));
    }
    try {
      (void)nlohmann::json(key).dump();  // throws on what is not UTF-8
    } catch (const nlohmann::json::exception&) {
      return InvalidArgumentError("a key of the job's store is UTF-8 text: this one is not");
    }
  }
  return OkStatus();
}

Status CheckValue(std::string_view value) {
  if (value.size() <= control::kMaxStoreValueBytes) return OkStatus();
  return FailedPreconditionError(fmt::format(
      "a value of the job's store has at most {} bytes (1 MiB), this one {}: keep large data "
      "elsewhere (a file, a collective) and its name in the store",
      control::kMaxStoreValueBytes, value.size()));
}

Status FromReply(const StoreReplyMsg& r) {
  if (r.error.empty()) return OkStatus();
  if (r.code == "timeout") return DeadlineExceededError(r.error);
  if (r.code == "limit") return FailedPreconditionError(r.error);
  if (r.code == "invalid") return InvalidArgumentError(r.error);
  return InternalError(r.error);
}

StoreRequestMsg Request(StoreOp op, std::vector<std::string> keys) {
  StoreRequestMsg m;
  m.op = op;
  m.keys = std::move(keys);
  return m;
}

}  // namespace

StoreClient::StoreClient(SendFn send)
    : client_(crypto::Hex(crypto::RandomBytes(8))), send_(std::move(send)) {}

Status StoreClient::Set(std::string_view key, std::string_view value, Millis timeout) {
  NONSTOP_RETURN_IF_ERROR(CheckValue(value));
  StoreRequestMsg m = Request(StoreOp::kSet, {std::string(key)});
  m.value = value;
  return Ask(std::move(m), timeout).status();
}

Result<std::string> StoreClient::Get(std::string_view key, Millis timeout) {
  NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg r,
                           Ask(Request(StoreOp::kGet, {std::string(key)}), timeout));
  return std::move(r.value);
}

Result<int64_t> StoreClient::Add(std::string_view key, int64_t amount, Millis timeout) {
  StoreRequestMsg m = Request(StoreOp::kAdd, {std::string(key)});
  m.amount = amount;
  NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg r, Ask(std::move(m), timeout));
  return r.number;
}

Result<std::string> StoreClient::CompareSet(std::string_view key, std::string_view expected,
                                            std::string_view desired, Millis timeout) {
  NONSTOP_RETURN_IF_ERROR(CheckValue(expected));
  NONSTOP_RETURN_IF_ERROR(CheckValue(desired));
  StoreRequestMsg m = Request(StoreOp::kCompareSet, {std::string(key)});
  m.expected = expected;
  m.value = desired;
  NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg r, Ask(std::move(m), timeout));
  return std::move(r.value);
}

Status StoreClient::Append(std::string_view key, std::string_view value, Millis timeout) {
  NONSTOP_RETURN_IF_ERROR(CheckValue(value));
  StoreRequestMsg m = Request(StoreOp::kAppend, {std::string(key)});
  m.value = value;
  return Ask(std::move(m), timeout).status();
}

Status StoreClient::Wait(std::span<const std::string> keys, Millis timeout) {
  if (keys.empty()) return OkStatus();
  return Ask(Request(StoreOp::kWait, {keys.begin(), keys.end()}), timeout).status();
}

Result<bool> StoreClient::Check(std::span<const std::string> keys, Millis timeout) {
  if (keys.empty()) return true;
  NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg r,
                           Ask(Request(StoreOp::kCheck, {keys.begin(), keys.end()}), timeout));
  return r.number != 0;
}

Result<bool> StoreClient::DeleteKey(std::string_view key, Millis timeout) {
  NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg r,
                           Ask(Request(StoreOp::kDeleteKey, {std::string(key)}), timeout));
  return r.number != 0;
}

Result<int64_t> StoreClient::NumKeys(Millis timeout) {
  NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg r, Ask(Request(StoreOp::kNumKeys, {}), timeout));
  return r.number;
}

Result<StoreReplyMsg> StoreClient::Ask(StoreRequestMsg m, Millis timeout) {
  NONSTOP_RETURN_IF_ERROR(CheckKeys(m.keys));
  if (timeout < Millis(0)) {
    return InvalidArgumentError(fmt::format("a store timeout of {} ms", timeout.count()));
  }
  // Past what the wire takes: for ever, as 0.
  if (timeout.count() > control::kMaxStoreTimeoutMs) timeout = Millis(0);
  const bool waits = m.op == StoreOp::kGet || m.op == StoreOp::kWait;
  const bool writes = control::StoreOpWrites(m.op);
  const Deadline now = Clock::now();
  const Deadline keys_by = timeout == Millis(0) ? kNoDeadline : now + timeout;
  // The call's own limit: a get or wait leaves the controller time to say which keys are missing.
  const Deadline give_up =
      keys_by == kNoDeadline ? kNoDeadline : keys_by + (waits ? kAnswerGrace : Millis(0));
  m.client = client_;
  m.timeout_ms = timeout.count();
  int64_t seq = 0;
  {
    MutexLock lock(&mu_);
    // A turn: at most kMaxInFlight calls at once (their answers fit the connection's queue), and
    // one write at a time (the controller applies a write once by its number).
    auto turn = [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !failed_.ok() || (calls_.size() < kMaxInFlight && !(writes && writing_));
    };
    const bool got =
        give_up == kNoDeadline ? (cv_.Wait(&mu_, turn), true) : cv_.WaitUntil(&mu_, give_up, turn);
    NONSTOP_RETURN_IF_ERROR(failed_);
    // A get or wait begun after the generation's abort ends as one in progress did.
    if (waits) NONSTOP_RETURN_IF_ERROR(aborted_);
    if (!got) {
      return DeadlineExceededError(fmt::format(
          "timeout: the job's store had no turn for a {} within {} ms (other calls of this "
          "process wait for the controller)",
          control::StoreOpName(m.op), timeout.count()));
    }
    seq = next_seq_++;
    m.seq = seq;
    calls_[seq] = Call{m, waits ? keys_by : kNoDeadline, std::nullopt, OkStatus()};
    if (writes) writing_ = true;
  }
  // Not connected: sent again with the join that reconnects (Unanswered).
  (void)send_(control::kMsgStore, control::Encode(m));
  MutexLock lock(&mu_);
  auto answered = [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Call& call = calls_.at(seq);
    return call.reply.has_value() || !call.ended.ok() || !failed_.ok();
  };
  if (give_up == kNoDeadline) {
    cv_.Wait(&mu_, answered);
  } else {
    cv_.WaitUntil(&mu_, give_up, answered);
  }
  std::optional<StoreReplyMsg> reply = std::move(calls_.at(seq).reply);
  const Status ended = calls_.at(seq).ended;
  calls_.erase(seq);
  if (writes) writing_ = false;
  cv_.NotifyAll();  // a turn is free
  if (!reply) {
    NONSTOP_RETURN_IF_ERROR(ended);
    NONSTOP_RETURN_IF_ERROR(failed_);
    return DeadlineExceededError(fmt::format(
        "timeout: the job's store did not answer a {} of {} within {} ms (no controller "
        "meanwhile?){}",
        control::StoreOpName(m.op),
        m.keys.empty() ? std::string("the keys") : fmt::format("'{}'", m.keys.front()),
        std::chrono::duration_cast<Millis>(give_up - now).count(),
        writes ? ": it may have been applied (a read says)" : ""));
  }
  NONSTOP_RETURN_IF_ERROR(FromReply(*reply));
  return std::move(*reply);
}

Status StoreClient::OnReply(std::string_view payload) {
  NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg r, control::DecodeStoreReply(payload));
  MutexLock lock(&mu_);
  auto it = calls_.find(r.seq);
  if (it == calls_.end() || it->second.reply) return OkStatus();
  it->second.reply = std::move(r);
  cv_.NotifyAll();
  return OkStatus();
}

std::vector<std::pair<uint16_t, std::string>> StoreClient::Unanswered(Deadline now) {
  std::vector<std::pair<uint16_t, std::string>> out;
  MutexLock lock(&mu_);
  for (const auto& [seq, call] : calls_) {
    if (call.reply) continue;
    StoreRequestMsg m = call.request;
    if (call.keys_by != kNoDeadline) {  // the time it has left (at least 1 ms: 0 is for ever)
      m.timeout_ms =
          std::max<int64_t>(1, std::chrono::duration_cast<Millis>(call.keys_by - now).count());
    }
    out.emplace_back(control::kMsgStore, control::Encode(m));
  }
  return out;
}

void StoreClient::AbortWaits(const Status& why) {
  MutexLock lock(&mu_);
  if (aborted_.ok()) aborted_ = why;
  for (auto& [seq, call] : calls_) {
    const bool waits = call.request.op == StoreOp::kGet || call.request.op == StoreOp::kWait;
    if (waits && !call.reply && call.ended.ok()) call.ended = why;
  }
  cv_.NotifyAll();
}

void StoreClient::ResumeWaits() {
  MutexLock lock(&mu_);
  aborted_ = OkStatus();
}

void StoreClient::Fail(const Status& why) {
  MutexLock lock(&mu_);
  if (failed_.ok()) failed_ = why;
  cv_.NotifyAll();
}

}  // namespace nonstop::worker
