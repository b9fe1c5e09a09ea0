#include "coord/etcd.h"

#include <httplib.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace nonstop::etcd {

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int64_t Int(const nlohmann::json& j, const char* field) {
  // The gateway writes 64-bit integers as strings ("revision":"12") and leaves zeros out.
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) return std::stoll(it->get<std::string>());
  throw std::invalid_argument(fmt::format("'{}' is not an integer", field));
}

Result<KeyValue> DecodeKv(const nlohmann::json& j) {
  KeyValue kv;
  NONSTOP_ASSIGN_OR_RETURN(kv.key, Base64Decode(j.value("key", "")));
  NONSTOP_ASSIGN_OR_RETURN(kv.value, Base64Decode(j.value("value", "")));
  kv.create_revision = Int(j, "create_revision");
  kv.mod_revision = Int(j, "mod_revision");
  kv.version = Int(j, "version");
  kv.lease = Int(j, "lease");
  return kv;
}

Result<std::vector<KeyValue>> DecodeKvs(const nlohmann::json& j) {
  std::vector<KeyValue> out;
  if (auto it = j.find("kvs"); it != j.end()) {
    for (const auto& e : *it) {
      NONSTOP_ASSIGN_OR_RETURN(KeyValue kv, DecodeKv(e));
      out.push_back(std::move(kv));
    }
  }
  return out;
}

nlohmann::json EncodeOp(const Op& op) {
  switch (op.kind) {
    case Op::Kind::kPut: {
      nlohmann::json put = {{"key", Base64Encode(op.key)}, {"value", Base64Encode(op.value)}};
      if (op.lease != 0) put["lease"] = std::to_string(op.lease);
      return {{"request_put", put}};
    }
    case Op::Kind::kRange: {
      nlohmann::json range = {{"key", Base64Encode(op.key)}};
      if (!op.range_end.empty()) range["range_end"] = Base64Encode(op.range_end);
      return {{"request_range", range}};
    }
    case Op::Kind::kDelete: {
      nlohmann::json del = {{"key", Base64Encode(op.key)}};
      if (!op.range_end.empty()) del["range_end"] = Base64Encode(op.range_end);
      return {{"request_delete_range", del}};
    }
  }
  return {};
}

}  // namespace

std::string Base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kAlphabet[(v >> s) & 63]);
  }
  size_t rest = bytes.size() - i;
  if (rest > 0) {
    uint32_t v = uint8_t(bytes[i]) << 16;
    if (rest == 2) v |= uint8_t(bytes[i + 1]) << 8;
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(rest == 2 ? kAlphabet[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

Result<std::string> Base64Decode(std::string_view text) {
  if (text.size() % 4 != 0) {
    return InvalidArgumentError(fmt::format("base64 text of {} characters (not a multiple of 4)", text.size()));
  }
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    int pad = 0;  // "xx==" or "xxx=" end the text
    if (i + 4 == text.size() && text[i + 3] == '=') pad = text[i + 2] == '=' ? 2 : 1;
    uint32_t v = 0;
    for (size_t k = 0; k < 4; ++k) {
      if (k >= 4 - static_cast<size_t>(pad)) {
        v <<= 6;
        continue;
      }
      int d = value(text[i + k]);
      if (d < 0) return InvalidArgumentError(fmt::format("invalid base64 character at offset {}", i + k));
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out.push_back(static_cast<char>(v >> 16));
    if (pad < 2) out.push_back(static_cast<char>((v >> 8) & 0xff));
    if (pad < 1) out.push_back(static_cast<char>(v & 0xff));
  }
  return out;
}

std::string PrefixEnd(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<uint8_t>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<uint8_t>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

struct Client::Endpoint {
  std::string name;  // host:port
  httplib::Client http;
  Endpoint(const std::string& host, int port) : name(fmt::format("{}:{}", host, port)), http(host, port) {}
};

Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::Create(const std::string& endpoints, ClientOptions options) {
  auto c = std::unique_ptr<Client>(new Client());
  c->endpoints_text_ = endpoints;
  c->options_ = options;
  size_t begin = 0;
  while (begin <= endpoints.size()) {
    size_t end = std::min(endpoints.find(',', begin), endpoints.size());
    std::string one = endpoints.substr(begin, end - begin);
    begin = end + 1;
    if (one.rfind("http://", 0) == 0) one = one.substr(7);
    if (one.rfind("https://", 0) == 0) {
      return InvalidArgumentError(fmt::format("etcd endpoint '{}': https is not supported; use http:// on a "
                                              "trusted network or a local etcd proxy",
                                              one));
    }
    while (!one.empty() && one.back() == '/') one.pop_back();
    auto colon = one.rfind(':');
    int port = 0;
    if (colon != std::string::npos) {
      try {
        size_t used = 0;
        port = std::stoi(one.substr(colon + 1), &used);
        if (used != one.size() - colon - 1) port = 0;
      } catch (...) {
        port = 0;
      }
    }
    if (one.empty() || colon == std::string::npos || colon == 0 || port <= 0 || port > 65535) {
      return InvalidArgumentError(
          fmt::format("etcd endpoint '{}' in '{}' is not host:port (HINT: --etcd 127.0.0.1:2379,10.0.0.2:2379)", one,
                      endpoints));
    }
    auto e = std::make_unique<Endpoint>(one.substr(0, colon), port);
    auto secs = options.timeout.count() / 1000;
    auto usecs = (options.timeout.count() % 1000) * 1000;
    e->http.set_connection_timeout(secs, usecs);
    e->http.set_read_timeout(secs, usecs);
    e->http.set_write_timeout(secs, usecs);
    e->http.set_keep_alive(true);
    c->endpoints_.push_back(std::move(e));
  }
  return c;
}

Result<std::string> Client::Call(const std::string& path, const std::string& body) {
  std::string errors;
  for (size_t tried = 0; tried < endpoints_.size(); ++tried) {
    Endpoint& e = *endpoints_[current_];
    auto res = e.http.Post(("/v3/" + path).c_str(), body, "application/json");
    if (!res) {
      errors += fmt::format("{}{}: {}", errors.empty() ? "" : "; ", e.name, httplib::to_string(res.error()));
      current_ = (current_ + 1) % endpoints_.size();  // the next member
      continue;
    }
    if (res->status >= 500) {
      // This member cannot serve (no raft leader, shutting down): another may.
      errors += fmt::format("{}{}: HTTP {}: {}", errors.empty() ? "" : "; ", e.name, res->status, res->body);
      current_ = (current_ + 1) % endpoints_.size();
      continue;
    }
    if (res->status != 200) {
      // etcd answered: its error stands (another member would say the same).
      std::string message = res->body;
      auto j = nlohmann::json::parse(res->body, nullptr, false);
      if (j.is_object() && j.contains("message")) message = j["message"].get<std::string>();
      return FailedPreconditionError(fmt::format("etcd {} /v3/{}: HTTP {}: {}", e.name, path, res->status, message));
    }
    return std::move(res->body);
  }
  return UnavailableError(fmt::format("etcd unreachable at {} ({})", endpoints_text_, errors));
}

namespace {

// One request to /v3/<path>, its answer decoded by `decode`. An answer that
// is not a JSON object, or holds a field of the wrong type, is an error that
// names the request.
template <typename Decode>
auto Ask(Client& client, const std::string& path, const nlohmann::json& request, Decode decode)
    -> decltype(decode(std::declval<const nlohmann::json&>())) {
  NONSTOP_ASSIGN_OR_RETURN(std::string body, client.Call(path, request.dump()));
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_object()) return DataLossError(fmt::format("etcd's answer to /v3/{} is not a JSON object", path));
  try {
    return decode(j);
  } catch (const std::exception& e) {
    return DataLossError(fmt::format("etcd's answer to /v3/{}: {}", path, e.what()));
  }
}

int64_t Revision(const nlohmann::json& answer) { return Int(answer.value("header", nlohmann::json::object()), "revision"); }

}  // namespace

Result<std::vector<KeyValue>> Client::Range(const std::string& key, const std::string& range_end, int64_t* revision) {
  nlohmann::json req = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) req["range_end"] = Base64Encode(range_end);
  return Ask(*this, "kv/range", req, [&](const nlohmann::json& j) -> Result<std::vector<KeyValue>> {
    if (revision != nullptr) *revision = Revision(j);
    return DecodeKvs(j);
  });
}

Result<int64_t> Client::Put(const std::string& key, const std::string& value, int64_t lease) {
  nlohmann::json req = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  return Ask(*this, "kv/put", req, [](const nlohmann::json& j) -> Result<int64_t> { return Revision(j); });
}

Result<TxnResult> Client::Txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                              const std::vector<Op>& failure) {
  nlohmann::json req = {{"compare", nlohmann::json::array()},
                        {"success", nlohmann::json::array()},
                        {"failure", nlohmann::json::array()}};
  for (const auto& c : compares) {
    nlohmann::json cj = {{"key", Base64Encode(c.key)}, {"result", "EQUAL"}};
    switch (c.target) {
      case Compare::Target::kCreate:
        cj["target"] = "CREATE";
        cj["create_revision"] = std::to_string(c.revision);
        break;
      case Compare::Target::kMod:
        cj["target"] = "MOD";
        cj["mod_revision"] = std::to_string(c.revision);
        break;
      case Compare::Target::kValue:
        cj["target"] = "VALUE";
        cj["value"] = Base64Encode(c.value);
        break;
    }
    req["compare"].push_back(cj);
  }
  for (const auto& op : success) req["success"].push_back(EncodeOp(op));
  for (const auto& op : failure) req["failure"].push_back(EncodeOp(op));
  return Ask(*this, "kv/txn", req, [](const nlohmann::json& j) -> Result<TxnResult> {
    TxnResult r;
    r.succeeded = j.value("succeeded", false);
    r.revision = Revision(j);
    for (const auto& resp : j.value("responses", nlohmann::json::array())) {
      if (auto it = resp.find("response_range"); it != resp.end()) {
        NONSTOP_ASSIGN_OR_RETURN(auto kvs, DecodeKvs(*it));
        for (auto& kv : kvs) r.range.push_back(std::move(kv));
      }
    }
    return r;
  });
}

Result<std::pair<int64_t, int64_t>> Client::LeaseGrant(int64_t ttl_seconds) {
  return Ask(*this, "lease/grant", {{"TTL", ttl_seconds}},
             [](const nlohmann::json& j) -> Result<std::pair<int64_t, int64_t>> {
               int64_t id = Int(j, "ID");
               if (id == 0) return FailedPreconditionError("etcd granted no lease: " + j.dump());
               return std::pair{id, Int(j, "TTL")};
             });
}

Result<int64_t> Client::LeaseKeepAlive(int64_t lease) {
  return Ask(*this, "lease/keepalive", {{"ID", std::to_string(lease)}}, [&](const nlohmann::json& j) -> Result<int64_t> {
    // The gateway streams: the first (only) message is {"result": {...}}, or {"error": {...}}.
    if (j.contains("error")) return UnavailableError("etcd lease keepalive: " + j["error"].dump());
    const nlohmann::json& r = j.contains("result") ? j["result"] : j;
    int64_t ttl = Int(r, "TTL");
    if (ttl <= 0) return NotFoundError(fmt::format("etcd lease {:x} expired", lease));
    return ttl;
  });
}

Status Client::LeaseRevoke(int64_t lease) {
  return Call("lease/revoke", nlohmann::json({{"ID", std::to_string(lease)}}).dump()).status();
}

}  // namespace nonstop::etcd
