// A small client of etcd's v3 API through its JSON gateway (POST /v3/...),
// over cpp-httplib: the coordination service behind the controller's
// standbys (docs/controller-failover.md). Only what nonstop needs: ranges,
// transactions (compare, then puts/deletes/ranges), leases. Keys and values
// are bytes; the gateway wants them base64-encoded, which this class does.
//
// One Client is used by one thread at a time (each user thread makes its
// own). Endpoints are tried in turn: a request that fails for a transient
// reason at one moves to the next, so a cluster of etcd members survives the
// loss of any one. Every error says its class (ErrorClass, IsTransient):
// callers retry the transient ones (src/coord/retry.h) and report the rest.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "coord/etcd_security.h"
#include "nonstop/status.h"

namespace httplib {
class Client;
enum class Error;
}  // namespace httplib

namespace nonstop::etcd {

std::string Base64Encode(std::string_view bytes);
// Fails on a character outside the alphabet or a length that is not a multiple of 4.
Result<std::string> Base64Decode(std::string_view text);

// The smallest key greater than every key that starts with `prefix` (etcd's range_end for a
// prefix).
std::string PrefixEnd(std::string_view prefix);

// --etcd's endpoints: "host:port", "http://host:port[/]", "https://host:port[/]", "[v6addr]:port"
// or "http(s)://[v6addr]:port[/]", comma separated; each its host (an IPv6 address without
// brackets) and port. The error names the endpoint and what is wrong with it.
Result<std::vector<std::pair<std::string, int>>> ParseEndpoints(const std::string& endpoints);

// A 64-bit integer field of the gateway's JSON: it writes them as strings ("revision":"12") and
// leaves zeros out (0 then). Throws std::invalid_argument for a field of another type.
int64_t JsonInt(const nlohmann::json& j, const char* field);

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
  static Compare ModRevision(std::string key, int64_t revision) {
    return {Target::kMod, std::move(key), revision, ""};
  }
  static Compare Value(std::string key, std::string value) {
    return {Target::kValue, std::move(key), 0, std::move(value)};
  }
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

// One page of a range (Client::RangePage).
struct RangeResult {
  std::vector<KeyValue> kvs;
  bool more = false;     // keys in the range after the last one returned
  int64_t revision = 0;  // the store's revision the page was read at
};

struct TxnResult {
  bool succeeded = false;
  int64_t revision = 0;  // the store's revision after the transaction
  // what the kRange operations of the branch taken found, in order
  std::vector<KeyValue> range;
};

// What a failed request means to its caller (docs/controller-failover.md,
// "etcd trouble"). The first three are transient: retry with back-off, the
// same member or another. The last two are final: retrying cannot help, a
// person must change something (the message says what). The class of an
// answer comes from the gRPC code in the gateway's error body
// ({"error", "message", "code"}), else from the HTTP status.
enum class ErrorClass {
  // No member answered (refused, reset, timed out: a member down, paused or
  // partitioned), HTTP 5xx but 501 and 504, gRPC UNAVAILABLE (14: no raft
  // leader, leader changed, the request timed out inside etcd) and the codes
  // gRPC calls retryable (CANCELLED 1, UNKNOWN 2, ABORTED 10, INTERNAL 13,
  // DATA_LOSS 15). Status: kUnavailable.
  kUnavailable,
  // HTTP 429, gRPC RESOURCE_EXHAUSTED (8): "too many requests" (an apply
  // backlog), the space quota. Status: kUnavailable, the message says so.
  kResourceExhausted,
  // HTTP 504 or 408, gRPC DEADLINE_EXCEEDED (4). Status: kDeadlineExceeded.
  kDeadlineExceeded,
  // Final. HTTP 401/403, gRPC PERMISSION_DENIED (7), UNAUTHENTICATED (16):
  // etcd has auth on and this client has no user (--etcd-auth-file), or its
  // user's role lacks the job's keys; etcd refused the user's password; etcd's
  // TLS certificate does not verify (etcd_security.h). Status: kFailedPrecondition.
  kPermissionDenied,
  // Final. gRPC INVALID_ARGUMENT (3: too many operations, a request too
  // large, a malformed request) and the other codes (ALREADY_EXISTS 6,
  // FAILED_PRECONDITION 9, OUT_OF_RANGE 11, UNIMPLEMENTED 12), any other
  // HTTP status (404: no v3 gateway there). Status: kInvalidArgument. An
  // answer that is not what etcd sends (not JSON, a field of the wrong type)
  // is final too: kDataLoss.
  kInvalid,
  // gRPC NOT_FOUND (5): the lease does not exist (expired or revoked). An
  // answer, not a fault. Status: kNotFound.
  kNotFound,
};

// The class of a non-200 answer; grpc_code < 0: the body carried none.
ErrorClass Classify(int http_status, int grpc_code);
std::string_view ErrorClassName(ErrorClass c);  // "unavailable", "resource exhausted", …
StatusCode StatusCodeFor(ErrorClass c);
// The Status of a non-200 answer of member `where` to /v3/<path>: its class's code; the member,
// the request, the HTTP status, the gRPC code and etcd's message in the text.
Status AnswerStatus(const std::string& where, const std::string& path, int http_status,
                    const std::string& body);
// Whether a Status from the Client is worth a retry: kUnavailable (unavailable, overloaded) and
// kDeadlineExceeded. Everything else is final (or, kNotFound, an answer).
bool IsTransient(const Status& s);

struct ClientOptions {
  ClientOptions() = default;
  // NOLINTNEXTLINE(google-explicit-constructor): {timeout} and {timeout, security} read well
  ClientOptions(std::chrono::milliseconds t, Security s = {})
      : timeout(t), security(std::move(s)) {}
  std::chrono::milliseconds timeout{2'000};  // per request: connect, send, answer
  Security security;                         // TLS, the etcd user (etcd_security.h)
};

class Client {
 public:
  // endpoints: "host:port", "http://host:port" or "https://host:port", comma separated; an IPv6
  // address in brackets ("[::1]:2379", "https://[fd00::2]:2379"). Checks options.security (the
  // files it names; plain http to another host needs allow_plaintext) and reads the etcd user's
  // password: no request yet (the user authenticates at the first request). A TLS client makes
  // the process ignore SIGPIPE if it did not already (OpenSSL's writes would raise it).
  static Result<std::unique_ptr<Client>> Create(const std::string& endpoints,
                                                ClientOptions options = {});
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
  // At most `limit` keys of [key, range_end) (0: no limit), as of `revision` (0: the latest).
  // A revision etcd compacted away is an error (kInvalidArgument, "compacted" in the text).
  Result<RangeResult> RangePage(const std::string& key, const std::string& range_end, int64_t limit,
                                int64_t revision = 0);
  // Every key of [key, range_end), read `page` keys per request, all as of one revision (the
  // first page's; *revision, if given): a large range in requests that each stay small and fast,
  // and still one consistent view. If etcd compacts that revision away meanwhile, the read starts
  // again at the latest.
  Result<std::vector<KeyValue>> RangeAll(const std::string& key, const std::string& range_end,
                                         int64_t page, int64_t* revision = nullptr);
  // The keys of [key, range_end) last changed at `min_mod_revision` or later (0: all), with
  // their values, or only their names and revisions (keys_only): what changed since a revision,
  // and what is there. One request, no pages: for ranges that stay small.
  struct Filter {
    int64_t min_mod_revision = 0;
    bool keys_only = false;
  };
  Result<RangeResult> RangeFiltered(const std::string& key, const std::string& range_end,
                                    Filter filter);
  Result<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  Result<TxnResult> Txn(const std::vector<Compare>& compares, const std::vector<Op>& success,
                        const std::vector<Op>& failure = {});

  // A lease of ttl seconds (etcd may grant a longer one: its minimum); returns its id and granted
  // TTL.
  Result<std::pair<int64_t, int64_t>> LeaseGrant(int64_t ttl_seconds);
  // Renews a lease; returns its TTL in seconds (the full one: etcd renewed it). NotFound: the lease
  // expired or was revoked.
  Result<int64_t> LeaseKeepAlive(int64_t lease);
  Status LeaseRevoke(int64_t lease);

  // A request to /v3/<path> with a JSON body; the answer's body. Errors name the endpoint and
  // carry their class (ErrorClass). A transient failure moves on to the next endpoint; a final
  // answer is returned at once (another member would say the same).
  // With an etcd user (--etcd-auth-file), authenticates first if it has no token yet, and once
  // more if etcd says the token is no longer valid (expired, or etcd restarted).
  Result<std::string> Call(const std::string& path, const std::string& body);

  // For a stream of the caller's own (etcd::Watch): the endpoints, a new connection to one with
  // this client's TLS settings, the token its requests carry (authenticated first if need be;
  // empty without an etcd user), and what a failed request on such a connection means.
  size_t endpoint_count() const { return endpoints_.size(); }
  const std::string& endpoint_name(size_t i) const;
  std::unique_ptr<httplib::Client> NewConnection(size_t i) const;
  Result<std::string> AuthToken();
  void ForgetToken() { token_.clear(); }  // etcd refused it: the next AuthToken() asks anew
  Status TransportFailure(size_t i, const httplib::Client& http, httplib::Error error) const;

 private:
  struct Endpoint;
  Client() = default;
  // One try at each endpoint in turn, with the token if there is one.
  Result<std::string> Send(const std::string& path, const std::string& body);
  Status Authenticate();
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  size_t current_ = 0;
  std::string endpoints_text_;
  ClientOptions options_;
  bool tls_ = false;
  std::optional<Credentials> credentials_;  // the etcd user, if any
  std::string token_;                       // its token, once authenticated
  bool auth_disabled_said_ = false;
};

}  // namespace nonstop::etcd
