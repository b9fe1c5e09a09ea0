// The job's store on the wire (messages.h, docs/store.md): a worker's request and the
// controller's answer. Values are base64 (JSON text holds no raw bytes); nothing in a request is
// trusted: its op, its keys (UTF-8, at most kMaxStoreKeyBytes each), their number for the op, the
// value's size and a timeout that is not negative are checked here, before the store sees it.
#include <array>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "control/message_fields.h"
#include "control/messages.h"

namespace nonstop::control {

using fields::Decode;
using fields::Dump;
using fields::FieldError;
using fields::Reader;
using nlohmann::json;

namespace {

constexpr std::array<std::pair<StoreOp, const char*>, 9> kOps = {{
    {StoreOp::kSet, "set"},
    {StoreOp::kGet, "get"},
    {StoreOp::kAdd, "add"},
    {StoreOp::kCompareSet, "compare_set"},
    {StoreOp::kAppend, "append"},
    {StoreOp::kWait, "wait"},
    {StoreOp::kCheck, "check"},
    {StoreOp::kDeleteKey, "delete_key"},
    {StoreOp::kNumKeys, "num_keys"},
}};

// The bytes of a base64 field, at most `limit` of them.
std::string Bytes(const Reader& r, const char* name, size_t limit) {
  std::string text;
  r(name, &text);
  if (text.size() > 4 * ((limit + 2) / 3)) {
    throw FieldError{r.Path(name), fmt::format("holds over {} bytes", limit)};
  }
  std::optional<std::string> bytes = crypto::Base64Decode(text);
  if (!bytes) throw FieldError{r.Path(name), "is not base64"};
  if (bytes->size() > limit) {
    throw FieldError{r.Path(name), fmt::format("holds {} bytes, over {}", bytes->size(), limit)};
  }
  return std::move(*bytes);
}

// How many keys an op names: [fewest, most].
std::pair<size_t, size_t> KeysOf(StoreOp op) {
  switch (op) {
    case StoreOp::kWait:
    case StoreOp::kCheck:
      return {1, kMaxStoreKeysPerRequest};
    case StoreOp::kNumKeys:
      return {0, 0};
    default:
      return {1, 1};
  }
}

}  // namespace

const char* StoreOpName(StoreOp op) {
  for (const auto& [o, name] : kOps)
    if (o == op) return name;
  return "?";
}

bool StoreOpWrites(StoreOp op) {
  return op == StoreOp::kSet || op == StoreOp::kAdd || op == StoreOp::kCompareSet ||
         op == StoreOp::kAppend || op == StoreOp::kDeleteKey;
}

std::string Encode(const StoreRequestMsg& m) {
  json j = {{"client", m.client}, {"seq", m.seq}, {"op", StoreOpName(m.op)}, {"keys", m.keys}};
  if (m.op == StoreOp::kSet || m.op == StoreOp::kAppend || m.op == StoreOp::kCompareSet)
    j["value"] = crypto::Base64Encode(m.value);
  if (m.op == StoreOp::kCompareSet) j["expected"] = crypto::Base64Encode(m.expected);
  if (m.op == StoreOp::kAdd) j["amount"] = m.amount;
  if (m.op == StoreOp::kGet || m.op == StoreOp::kWait) j["timeout_ms"] = m.timeout_ms;
  return Dump(j);
}

std::string Encode(const StoreReplyMsg& m) {
  json j = {{"seq", m.seq}};
  if (!m.error.empty()) {
    j["error"] = m.error;
    j["code"] = m.code;
  }
  if (!m.value.empty()) j["value"] = crypto::Base64Encode(m.value);
  if (m.number != 0) j["number"] = m.number;
  return Dump(j);
}

Result<StoreRequestMsg> DecodeStoreRequest(std::string_view p) {
  return Decode<StoreRequestMsg>("store", p, [](const Reader& r, StoreRequestMsg& m) {
    r("client", &m.client);
    if (m.client.empty() || m.client.size() > kMaxStoreClientId)
      throw FieldError{"client", fmt::format("must have 1 to {} characters", kMaxStoreClientId)};
    r("seq", &m.seq);
    if (m.seq < 1) throw FieldError{"seq", fmt::format("must be 1 or more, got {}", m.seq)};
    std::string op;
    r("op", &op);
    bool known = false;
    for (const auto& [o, name] : kOps) {
      if (op == name) {
        m.op = o;
        known = true;
      }
    }
    if (!known) throw FieldError{"op", fmt::format("'{}' is no store operation", op)};
    const json& keys = r.Array("keys");
    const auto [fewest, most] = KeysOf(m.op);
    if (keys.size() < fewest || keys.size() > most) {
      throw FieldError{
          "keys", fmt::format("{} takes {} to {} keys, got {}", op, fewest, most, keys.size())};
    }
    r("keys", &m.keys);
    size_t all = 0;
    for (size_t i = 0; i < m.keys.size(); ++i) {
      if (m.keys[i].size() > kMaxStoreKeyBytes) {
        throw FieldError{fmt::format("keys[{}]", i),
                         fmt::format("has {} bytes, over {}", m.keys[i].size(), kMaxStoreKeyBytes)};
      }
      all += m.keys[i].size();
    }
    if (all > kMaxStoreKeyBytesPerRequest) {
      throw FieldError{"keys",
                       fmt::format("hold {} bytes, over {}", all, kMaxStoreKeyBytesPerRequest)};
    }
    if (m.op == StoreOp::kSet || m.op == StoreOp::kAppend || m.op == StoreOp::kCompareSet)
      m.value = Bytes(r, "value", kMaxStoreValueBytes);
    if (m.op == StoreOp::kCompareSet) m.expected = Bytes(r, "expected", kMaxStoreValueBytes);
    if (m.op == StoreOp::kAdd) r("amount", &m.amount);
    if (m.op == StoreOp::kGet || m.op == StoreOp::kWait) {
      r("timeout_ms", &m.timeout_ms);
      if (m.timeout_ms < 0 || m.timeout_ms > kMaxStoreTimeoutMs) {
        throw FieldError{"timeout_ms",
                         fmt::format("must be 0 to {}, got {}", kMaxStoreTimeoutMs, m.timeout_ms)};
      }
    }
  });
}

Result<StoreReplyMsg> DecodeStoreReply(std::string_view p) {
  return Decode<StoreReplyMsg>("store reply", p, [](const Reader& r, StoreReplyMsg& m) {
    r("seq", &m.seq);
    r.Optional("error", &m.error);
    r.Optional("code", &m.code);
    if (r.Has("value")) m.value = Bytes(r, "value", kMaxStoreValueBytes);
    r.Optional("number", &m.number);
  });
}

}  // namespace nonstop::control
