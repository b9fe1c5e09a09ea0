#include "controller/job_store.h"

#include <algorithm>
#include <charconv>
#include <utility>

#include <fmt/format.h>

#include "common/crypto.h"

namespace nonstop::controller {

using control::StoreOp;
using control::StoreReplyMsg;
using control::StoreRequestMsg;
using nlohmann::json;

namespace {

StoreReplyMsg Error(std::string code, std::string message) {
  StoreReplyMsg r;
  r.code = std::move(code);
  r.error = std::move(message);
  return r;
}

// A counter's value as add keeps it: decimal text, as torch's stores write it.
std::optional<int64_t> ParseCounter(const std::string& text) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

std::string Quoted(const std::string& key) { return fmt::format("'{}'", key); }

}  // namespace

JobStore::Outcome JobStore::Handle(int worker_id, const StoreRequestMsg& m, Clock::time_point now) {
  Outcome out;
  if (control::StoreOpWrites(m.op)) {
    auto last = last_write_.find(worker_id);
    if (last != last_write_.end() && last->second.client == m.client && m.seq <= last->second.seq) {
      // Sent again after a lost connection: the first answer again (an older one is stale).
      if (m.seq == last->second.seq) out.answers.push_back({worker_id, Again(last->second, m)});
      return out;
    }
    bool changed = false;
    StoreReplyMsg reply = Write(m, &changed);
    reply.seq = m.seq;
    // A write that changed nothing is not kept: sent again, it is answered afresh.
    if (changed) Remember(worker_id, m, reply);
    out.answers.push_back({worker_id, std::move(reply)});
    if (changed) {
      out.record = json{{"event", "store"},
                        {"worker", worker_id},
                        {"op", control::StoreOpName(m.op)},
                        {"key", m.keys.front()},
                        {"request", json::parse(control::Encode(m))}};
      if (m.op != StoreOp::kDeleteKey) Wake(m.keys.front(), &out.answers);
    }
    return out;
  }
  const bool waits = m.op == StoreOp::kGet || m.op == StoreOp::kWait;
  if (!waits || Has(m.keys)) {
    StoreReplyMsg reply = Read(m);
    reply.seq = m.seq;
    out.answers.push_back({worker_id, std::move(reply)});
    return out;
  }
  size_t key_bytes = 0;
  for (const std::string& key : m.keys) key_bytes += key.size();
  size_t& mine = waits_of_[worker_id];
  if (waits_.size() >= kMaxWaits || wait_bytes_ + key_bytes > kMaxWaitBytes ||
      mine >= kMaxWaitsPerWorker) {
    if (mine == 0) waits_of_.erase(worker_id);
    StoreReplyMsg reply = Error(
        "limit", mine < kMaxWaitsPerWorker
                     ? fmt::format("the job's store holds {} waits for keys ({} bytes of keys), "
                                   "its most: set the keys waited for, or wait with a shorter "
                                   "timeout",
                                   waits_.size(), wait_bytes_)
                     : fmt::format("this worker waits for keys {} times at once, the store's most "
                                   "for one worker: wait for several keys in one call",
                                   kMaxWaitsPerWorker));
    reply.seq = m.seq;
    out.answers.push_back({worker_id, std::move(reply)});
    return out;
  }
  ++mine;
  const uint64_t id = next_wait_++;
  // A timeout of 0 waits for ever, as torch's kNoTimeout.
  const Clock::time_point deadline =
      m.timeout_ms == 0 ? Clock::time_point::max() : now + Millis(m.timeout_ms);
  waits_.emplace(id, Wait{worker_id, m, deadline});
  wait_bytes_ += key_bytes;
  earliest_deadline_ = std::min(earliest_deadline_, deadline);
  // Every key, those set now too: one may be deleted before the others come.
  for (const std::string& key : m.keys) waits_on_[key].insert(id);
  return out;
}

std::vector<JobStore::Answer> JobStore::Expire(Clock::time_point now) {
  std::vector<Answer> out;
  if (now < earliest_deadline_) return out;
  earliest_deadline_ = Clock::time_point::max();
  for (auto it = waits_.begin(); it != waits_.end();) {
    const Wait& w = it->second;
    if (w.deadline > now) {
      earliest_deadline_ = std::min(earliest_deadline_, w.deadline);
      ++it;
      continue;
    }
    std::vector<std::string> missing;
    size_t more = 0;
    for (const std::string& key : w.request.keys) {
      if (data_.contains(key)) continue;
      if (missing.size() < 5) {
        missing.push_back(Quoted(key.size() > 200 ? key.substr(0, 200) + "..." : key));
      } else {
        ++more;
      }
    }
    if (more > 0) missing.push_back(fmt::format("{} more", more));
    StoreReplyMsg reply =
        Error("timeout", fmt::format("timeout: the {} waited {} ms, and the job's store has no {}",
                                     control::StoreOpName(w.request.op), w.request.timeout_ms,
                                     fmt::join(missing, ", ")));
    reply.seq = w.request.seq;
    out.push_back({w.worker_id, std::move(reply)});
    it = Drop(it);
  }
  return out;
}

void JobStore::Forget(int worker_id) {
  for (auto it = waits_.begin(); it != waits_.end();)
    it = it->second.worker_id == worker_id ? Drop(it) : std::next(it);
}

void JobStore::Gone(int worker_id) {
  Forget(worker_id);
  last_write_.erase(worker_id);
}

std::map<uint64_t, JobStore::Wait>::iterator JobStore::Drop(std::map<uint64_t, Wait>::iterator it) {
  for (const std::string& key : it->second.request.keys) {
    wait_bytes_ -= key.size();
    auto on = waits_on_.find(key);
    if (on == waits_on_.end()) continue;
    on->second.erase(it->first);
    if (on->second.empty()) waits_on_.erase(on);
  }
  if (--waits_of_[it->second.worker_id] == 0) waits_of_.erase(it->second.worker_id);
  return waits_.erase(it);
}

StoreReplyMsg JobStore::Again(const LastWrite& last, const StoreRequestMsg& m) {
  StoreReplyMsg reply = last.reply;
  if (last.value_is_desired) reply.value = m.value;
  return reply;
}

void JobStore::Remember(int worker_id, const StoreRequestMsg& m, const StoreReplyMsg& reply) {
  LastWrite& last = last_write_[worker_id];
  last = {m.client, m.seq, reply, false};
  if (m.op == StoreOp::kCompareSet) {
    last.value_is_desired = true;  // a compare_set that changed the store answers its desired value
    last.reply.value.clear();
  }
}

StoreReplyMsg JobStore::Write(const StoreRequestMsg& m, bool* changed) {
  *changed = false;
  const std::string& key = m.keys.front();
  auto it = data_.find(key);
  StoreReplyMsg reply;
  Status put;
  switch (m.op) {
    case StoreOp::kSet:
      if (it != data_.end() && it->second == m.value) return reply;  // nothing changes
      put = Put(key, m.value);
      break;
    case StoreOp::kAdd: {
      int64_t value = 0;
      if (it != data_.end()) {
        std::optional<int64_t> was = ParseCounter(it->second);
        if (!was) {
          return Error("invalid",
                       fmt::format("add to {}: it holds {} bytes that are no integer (add "
                                   "keeps a counter as decimal text)",
                                   Quoted(key), it->second.size()));
        }
        value = *was;
      }
      if (__builtin_add_overflow(value, m.amount, &value)) {
        return Error("invalid", fmt::format("add of {} to {} overflows a 64-bit integer", m.amount,
                                            Quoted(key)));
      }
      reply.number = value;
      if (it != data_.end() && m.amount == 0) return reply;  // a read of the counter
      put = Put(key, std::to_string(value));
      break;
    }
    case StoreOp::kCompareSet:
      // As torch's stores: a missing key is set only when the expected value is empty; the
      // answer is the value the key holds afterwards (the expected one when it stays missing).
      if (it == data_.end() ? m.expected.empty() : it->second == m.expected) {
        reply.value = m.value;
        if (it != data_.end() && it->second == m.value) return reply;  // nothing changes
        put = Put(key, m.value);
      } else {
        reply.value = it == data_.end() ? m.expected : it->second;
        return reply;
      }
      break;
    case StoreOp::kAppend: {
      std::string value = it == data_.end() ? "" : it->second;
      if (value.size() + m.value.size() > control::kMaxStoreValueBytes) {
        return Error("limit", fmt::format("append to {} makes a value of {} bytes, over the most "
                                          "one key holds ({})",
                                          Quoted(key), value.size() + m.value.size(),
                                          control::kMaxStoreValueBytes));
      }
      put = Put(key, value + m.value);
      break;
    }
    case StoreOp::kDeleteKey:
      reply.number = it != data_.end() ? 1 : 0;
      if (it != data_.end()) {
        bytes_ -= it->first.size() + it->second.size();
        data_.erase(it);
        *changed = true;
      }
      return reply;
    default:
      return Error("invalid", fmt::format("{} is no write", control::StoreOpName(m.op)));
  }
  if (!put.ok()) return Error("limit", std::string(put.message()));
  *changed = true;
  return reply;
}

StoreReplyMsg JobStore::Read(const StoreRequestMsg& m) const {
  StoreReplyMsg reply;
  switch (m.op) {
    case StoreOp::kGet:
      reply.value = data_.at(m.keys.front());
      break;
    case StoreOp::kCheck:
      reply.number = Has(m.keys) ? 1 : 0;
      break;
    case StoreOp::kNumKeys:
      reply.number = static_cast<int64_t>(data_.size());
      break;
    default:  // kWait: the keys exist
      break;
  }
  return reply;
}

bool JobStore::Has(const std::vector<std::string>& keys) const {
  for (const std::string& key : keys)
    if (!data_.contains(key)) return false;
  return true;
}

void JobStore::Wake(const std::string& key, std::vector<Answer>* out) {
  auto on = waits_on_.find(key);
  if (on == waits_on_.end()) return;
  const std::vector<uint64_t> ids(on->second.begin(), on->second.end());
  for (uint64_t id : ids) {
    auto w = waits_.find(id);
    if (w == waits_.end() || !Has(w->second.request.keys)) continue;  // another key is missing
    StoreReplyMsg reply = Read(w->second.request);
    reply.seq = w->second.request.seq;
    out->push_back({w->second.worker_id, std::move(reply)});
    Drop(w);
  }
}

Status JobStore::Put(const std::string& key, std::string value) {
  auto it = data_.find(key);
  const size_t was = it == data_.end() ? 0 : it->first.size() + it->second.size();
  const size_t will = bytes_ - was + key.size() + value.size();
  if (will > kMaxBytes) {
    return FailedPreconditionError(fmt::format(
        "the job's store would hold {} bytes of keys and values, over its most ({} MiB): delete "
        "the keys no longer needed (delete_key)",
        will, kMaxBytes >> 20));
  }
  bytes_ = will;
  data_[key] = std::move(value);
  return OkStatus();
}

Status JobStore::Replay(const json& record) {
  if (!record.contains("request") || !record["request"].is_object() || !record.contains("worker") ||
      !record["worker"].is_number_integer()) {
    return InvalidArgumentError("a store record without its worker and request");
  }
  NONSTOP_ASSIGN_OR_RETURN(StoreRequestMsg m,
                           control::DecodeStoreRequest(record["request"].dump()));
  if (!control::StoreOpWrites(m.op)) {
    return InvalidArgumentError(
        fmt::format("a store record of a {}, which is no write", control::StoreOpName(m.op)));
  }
  bool changed = false;
  StoreReplyMsg reply = Write(m, &changed);
  reply.seq = m.seq;
  if (changed) Remember(record["worker"].get<int>(), m, reply);
  return OkStatus();
}

json JobStore::Save() const {
  json data = json::array(), last = json::array();
  for (const auto& [key, value] : data_) data.push_back({key, crypto::Base64Encode(value)});
  for (const auto& [worker, w] : last_write_) {
    last.push_back({{"worker", worker},
                    {"client", w.client},
                    {"seq", w.seq},
                    {"reply", json::parse(control::Encode(w.reply))},
                    {"value_is_desired", w.value_is_desired}});
  }
  return {{"data", std::move(data)}, {"last_write", std::move(last)}};
}

Result<JobStore> JobStore::Load(const json& saved) {
  JobStore store;
  try {
    for (const json& entry : saved.at("data")) {
      std::optional<std::string> value = crypto::Base64Decode(entry.at(1).get<std::string>());
      if (!value) return InvalidArgumentError("a store value in a snapshot is not base64");
      NONSTOP_RETURN_IF_ERROR(store.Put(entry.at(0).get<std::string>(), std::move(*value)));
    }
    for (const json& w : saved.at("last_write")) {
      NONSTOP_ASSIGN_OR_RETURN(StoreReplyMsg reply,
                               control::DecodeStoreReply(w.at("reply").dump()));
      store.last_write_[w.at("worker").get<int>()] = {w.at("client").get<std::string>(),
                                                      w.at("seq").get<int64_t>(), std::move(reply),
                                                      w.value("value_is_desired", false)};
    }
  } catch (const json::exception& e) {
    return InvalidArgumentError(fmt::format("a snapshot's store of the wrong shape: {}", e.what()));
  }
  return store;
}

}  // namespace nonstop::controller
