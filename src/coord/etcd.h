// A small client of etcd's v3 API through its JSON gateway (POST /v3/...),
// over cpp-httplib: the coordination service behind the controller's
// standbys (docs/controller-failover.md). Only what nonstop needs: ranges,
// transactions (compare, then puts/deletes/ranges), leases. Keys and values
// are bytes; the gateway wants them base64-encoded, which this class does.
//
// One Client is used by one thread at a time (each user thread makes its
// own). Endpoints are tried in turn: a request that cannot reach one moves
// to the next, so a cluster of etcd members survives the loss of any one.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace nonstop::etcd {

std::string Base64Encode(std::string_view bytes);
// Fails on a character outside the alphabet or a length that is not a multiple of 4.
Result<std::string> Base64Decode(std::string_view text);

// The smallest key greater than every key that starts with `prefix` (etcd's range_end for a prefix).
std::string PrefixEnd(std::string_view prefix);

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  int64_t lease = 0;
};

// One comparison of a transaction: key's create revision / mod revision / value.
struct Compare {
  enum class Target { kCreate, kMod, kValue };
  Target target = Target::kCreate;
  std::string key;
  int64_t revision = 0;  // kCreate, kMod: equal to this
  std::string value;     // kValue: equal to this
  static Compare CreateRevision(std::string key, int64_t revision) {
    return {Target::kCreate, std::move(key), revision, ""};
  }
  static Compare ModRevision(std::string key, int64_t revision) { return {Target::kMod, std::move(key), revision, ""}; }
  static Compare Value(std::string key, std::string value) { return {Target::kValue, std::move(key), 0, std::move(value)}; }
};

// One operation of a transaction.
struct Op {
  enum class Kind { kPut, kRange, kDelete };
  Kind kind = Kind::kPut;
  std::string key;
  std::string value;      // kPut
  int64_t lease = 0;      // kPut
  std::string range_end;  // kRange, kDelete: empty = the key alone
  static Op Put(std::string key, std::string value, int64_t lease = 0) {
    return {Kind::kPut, std::move(key), std::move(value), lease, ""};
  }
  static Op Get(std::string key) { return {Kind::kRange, std::move(key), "", 0, ""}; }
  static Op Delete(std::string key, std::string range_end = "") {
    return {Kind::kDelete, std::move(key), "", 0, std::move(range_end)};
  }
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;               // the store's revision after the transaction
  std::vector<KeyValue> range;        // what the kRange operations of the branch taken found, in order
};

struct ClientOptions {
  std::chrono::milliseconds timeout{2'000};  // per request: connect, send, answer
};

class Client {
 public:
  // endpoints: "host:port" or "http://host:port", comma separated.
  static Result<std::unique_ptr<Client>> Create(const std::string& endpoints, ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& endpoints() const { return endpoints_text_; }

  // Keys in [key, range_end) (range_end empty: the key alone), in key order;
  // *revision (if given) is the store's revision the answer was read at.
  Result<std::vector<KeyValue>> Range(const std::string& key, const std::string& range_end = "",
                                      int64_t* revision = nullptr);
  Result<std::vector<KeyValue>> Prefix(const std::string& prefix, int64_t* revision = nullptr) {
    return Range(prefix, PrefixEnd(prefix), revision);
  }
  Result<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  Result<TxnResult> Txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                        const std::vector<Op>& failure = {});

  // A lease of ttl seconds (etcd may grant a longer one: its minimum); returns its id and granted TTL.
  Result<std::pair<int64_t, int64_t>> LeaseGrant(int64_t ttl_seconds);
  // Renews a lease; returns its remaining TTL in seconds. NotFound: the lease expired or was revoked.
  Result<int64_t> LeaseKeepAlive(int64_t lease);
  Status LeaseRevoke(int64_t lease);

  // A request to /v3/<path> with a JSON body; the parsed answer. Errors name the endpoint.
  Result<std::string> Call(const std::string& path, const std::string& body);

 private:
  struct Endpoint;
  Client() = default;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  size_t current_ = 0;
  std::string endpoints_text_;
  ClientOptions options_;
};

}  // namespace nonstop::etcd
