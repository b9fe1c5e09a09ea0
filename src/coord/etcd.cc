#include "coord/etcd.h"

#include <httplib.h>

#include <csignal>
#include <iterator>
#include <mutex>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/logging.h"
#include "common/time.h"

namespace nonstop::etcd {

int64_t JsonInt(const nlohmann::json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) return std::stoll(it->get<std::string>());
  throw std::invalid_argument(fmt::format("'{}' is not an integer", field));
}

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

Result<KeyValue> DecodeKv(const nlohmann::json& j) {
  KeyValue kv;
  NONSTOP_ASSIGN_OR_RETURN(kv.key, Base64Decode(j.value("key", "")));
  NONSTOP_ASSIGN_OR_RETURN(kv.value, Base64Decode(j.value("value", "")));
  kv.create_revision = JsonInt(j, "create_revision");
  kv.mod_revision = JsonInt(j, "mod_revision");
  kv.version = JsonInt(j, "version");
  kv.lease = JsonInt(j, "lease");
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

// The gateway's error body: {"error": "...", "message": "...", "code": 14}.
int GrpcCode(const nlohmann::json& j) {
  if (!j.is_object()) return -1;
  for (const char* field : {"code", "grpc_code"}) {
    if (auto it = j.find(field); it != j.end() && it->is_number_integer()) return it->get<int>();
  }
  return -1;
}

std::string_view GrpcCodeName(int code) {
  static constexpr std::string_view kNames[] = {"OK",
                                                "CANCELLED",
                                                "UNKNOWN",
                                                "INVALID_ARGUMENT",
                                                "DEADLINE_EXCEEDED",
                                                "NOT_FOUND",
                                                "ALREADY_EXISTS",
                                                "PERMISSION_DENIED",
                                                "RESOURCE_EXHAUSTED",
                                                "FAILED_PRECONDITION",
                                                "ABORTED",
                                                "OUT_OF_RANGE",
                                                "UNIMPLEMENTED",
                                                "INTERNAL",
                                                "UNAVAILABLE",
                                                "DATA_LOSS",
                                                "UNAUTHENTICATED"};
  return code >= 0 && code < static_cast<int>(std::size(kNames)) ? kNames[code] : "";
}

// The Status of a non-200 answer (or an error in a 200's body): its class in the code, the member,
// the request and etcd's message in the text.
Status ClassifiedStatus(const std::string& where, const std::string& path, int http_status,
                        int grpc_code, const std::string& message) {
  ErrorClass c = Classify(http_status, grpc_code);
  std::string code_text =
      grpc_code >= 0 ? fmt::format(" ({} {})", GrpcCodeName(grpc_code), grpc_code) : "";
  std::string text =
      fmt::format("etcd {} /v3/{}: HTTP {}{}: {}", where, path, http_status, code_text, message);
  if (c == ErrorClass::kResourceExhausted) {
    text += message.find("space exceeded") != std::string::npos
                ? " (etcd's space quota is full: until an operator compacts and defragments it and "
                  "runs `etcdctl "
                  "alarm disarm`, it refuses writes)"
                : " (etcd is overloaded)";
  }
  return Status(StatusCodeFor(c), std::move(text));
}

// A request that got no answer: kUnavailable, whatever the cause (the member is down, paused,
// partitioned, or the connection was reset).
Status TransportStatus(const std::string& where, httplib::Error error, Millis timeout) {
  switch (error) {
    case httplib::Error::Connection:
      return UnavailableError(fmt::format("{}: cannot connect (refused, or no route)", where));
    case httplib::Error::ConnectionTimeout:
      return UnavailableError(
          fmt::format("{}: no connection within {} ms", where, timeout.count()));
    case httplib::Error::Read:
      return UnavailableError(fmt::format(
          "{}: no answer within {} ms (or the connection was reset)", where, timeout.count()));
    case httplib::Error::Write:
      return UnavailableError(
          fmt::format("{}: the connection was closed while the request was sent", where));
    default:
      return UnavailableError(fmt::format("{}: {}", where, httplib::to_string(error)));
  }
}

// One POST and what came back. The gateway ends every error answer (any gRPC
// status but OK) with HTTP trailers ("Grpc-Trailer-Content-Type"), which
// cpp-httplib 0.11 cannot read: it reports Error::Read after the body. So the
// status and body are taken as they arrive, and an error answer whose body
// is a whole JSON object stands, trailers or not. A 200 cut short stays a
// transport failure.
struct Answer {
  httplib::Error error = httplib::Error::Success;
  int status = 0;
  std::string body;
};

Answer Post(httplib::Client& http, const std::string& path, const std::string& body,
            const std::string& token) {
  Answer a;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.set_header("Content-Type", "application/json");
  // etcd's gateway takes the token of /v3/auth/authenticate as it is, no "Bearer".
  if (!token.empty()) req.set_header("Authorization", token);
  req.body = body;
  req.response_handler = [&a](const httplib::Response& r) {
    a.status = r.status;
    return true;
  };
  req.content_receiver = [&a](const char* data, size_t n, uint64_t, uint64_t) {
    a.body.append(data, n);
    return true;
  };
  auto res = http.send(req);
  if (res) return a;
  a.error = res.error();
  if (a.error == httplib::Error::Read && a.status != 0 && a.status != 200 &&
      nlohmann::json::parse(a.body, nullptr, false).is_object()) {
    a.error = httplib::Error::Success;  // the answer was whole; only its trailers were not read
  }
  return a;
}

}  // namespace

Status AnswerStatus(const std::string& where, const std::string& path, int http_status,
                    const std::string& body) {
  std::string message = body;
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("message") && j["message"].is_string())
    message = j["message"].get<std::string>();
  while (!message.empty() && (message.back() == '\n' || message.back() == ' ')) message.pop_back();
  if (message.size() > 300) message = message.substr(0, 300) + "…";
  return ClassifiedStatus(where, path, http_status, GrpcCode(j), message);
}

ErrorClass Classify(int http_status, int grpc_code) {
  switch (grpc_code) {
    case 14:
    case 1:
    case 2:
    case 10:
    case 13:
    case 15:
      return ErrorClass::kUnavailable;
    case 8:
      return ErrorClass::kResourceExhausted;
    case 4:
      return ErrorClass::kDeadlineExceeded;
    case 7:
    case 16:
      return ErrorClass::kPermissionDenied;
    case 5:
      return ErrorClass::kNotFound;
    case 3:
    case 6:
    case 9:
    case 11:
    case 12:
      return ErrorClass::kInvalid;
    default:
      break;  // none, or one gRPC does not define: the HTTP status says
  }
  if (http_status == 429) return ErrorClass::kResourceExhausted;
  if (http_status == 504 || http_status == 408) return ErrorClass::kDeadlineExceeded;
  if (http_status == 401 || http_status == 403) return ErrorClass::kPermissionDenied;
  if (http_status >= 500 && http_status != 501) return ErrorClass::kUnavailable;
  return ErrorClass::kInvalid;
}

std::string_view ErrorClassName(ErrorClass c) {
  switch (c) {
    case ErrorClass::kUnavailable:
      return "unavailable";
    case ErrorClass::kResourceExhausted:
      return "resource exhausted";
    case ErrorClass::kDeadlineExceeded:
      return "deadline exceeded";
    case ErrorClass::kPermissionDenied:
      return "permission denied";
    case ErrorClass::kInvalid:
      return "invalid";
    case ErrorClass::kNotFound:
      return "not found";
  }
  return "?";
}

StatusCode StatusCodeFor(ErrorClass c) {
  switch (c) {
    case ErrorClass::kUnavailable:
    case ErrorClass::kResourceExhausted:
      return StatusCode::kUnavailable;
    case ErrorClass::kDeadlineExceeded:
      return StatusCode::kDeadlineExceeded;
    case ErrorClass::kPermissionDenied:
      return StatusCode::kFailedPrecondition;
    case ErrorClass::kInvalid:
      return StatusCode::kInvalidArgument;
    case ErrorClass::kNotFound:
      return StatusCode::kNotFound;
  }
  return StatusCode::kInvalidArgument;
}

bool IsTransient(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded;
}

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
    return InvalidArgumentError(
        fmt::format("base64 text of {} characters (not a multiple of 4)", text.size()));
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
      if (d < 0)
        return InvalidArgumentError(fmt::format("invalid base64 character at offset {}", i + k));
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
  std::string host;  // a name, an IPv4 address or an IPv6 one (without its brackets)
  int port = 0;
  std::unique_ptr<httplib::Client> http;
};

namespace {

// OpenSSL writes a TLS connection with write(2), without MSG_NOSIGNAL: a write to a connection etcd
// closed (a kept-alive one, a watch stopped) would kill the process with SIGPIPE. A process that
// left SIGPIPE at its default gets EPIPE instead from its first TLS client on (nonstop's own
// programs ignore it already: common/signals.h).
void IgnoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction now {};
    if (::sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_DFL)
      ::signal(SIGPIPE, SIG_IGN);
  });
}

// A connection to host:port, over TLS if `tls` (etcd's certificate checked against the CA file,
// or the system's CAs; the client certificate presented if given).
std::unique_ptr<httplib::Client> MakeHttp(const std::string& host, int port, bool tls,
                                          const Security& s, Millis timeout) {
  const bool v6 = host.find(':') != std::string::npos;
  const std::string host_port =
      v6 ? fmt::format("[{}]:{}", host, port) : fmt::format("{}:{}", host, port);
  std::unique_ptr<httplib::Client> http;
  if (tls) {
    http = std::make_unique<httplib::Client>("https://" + host_port, s.cert_file, s.key_file);
    if (!s.ca_file.empty()) http->set_ca_cert_path(s.ca_file.c_str());
    http->enable_server_certificate_verification(true);
  } else {
    http = std::make_unique<httplib::Client>(host, port);
  }
  // cpp-httplib would send "Host: ::1:2379"; an IPv6 address goes in brackets there too.
  if (v6) http->set_default_headers({{"Host", host_port}});
  auto secs = timeout.count() / 1000;
  auto usecs = (timeout.count() % 1000) * 1000;
  http->set_connection_timeout(secs, usecs);
  http->set_read_timeout(secs, usecs);
  http->set_write_timeout(secs, usecs);
  return http;
}

}  // namespace

namespace {

// One endpoint of --etcd: "host:port", "http://host:port[/]", "[v6addr]:port", or
// "http://[v6addr]:port[/]": its host (an IPv6 address without brackets) and port.
Result<std::pair<std::string, int>> ParseEndpoint(std::string one, const std::string& all) {
  const std::string given = one;
  auto bad = [&](std::string_view why) {
    return InvalidArgumentError(
        fmt::format("etcd endpoint '{}' in '{}' is not host:port ({}) (HINT: --etcd "
                    "127.0.0.1:2379,10.0.0.2:2379, or [fd00::2]:2379 for an IPv6 address)",
                    given, all, why));
  };
  if (one.rfind("http://", 0) == 0) one = one.substr(7);
  if (one.rfind("https://", 0) == 0) one = one.substr(8);
  while (!one.empty() && one.back() == '/') one.pop_back();
  std::string host, port_text;
  if (!one.empty() && one.front() == '[') {
    auto close = one.find(']');
    if (close == std::string::npos) return bad("an IPv6 address without its closing ']'");
    host = one.substr(1, close - 1);
    if (close + 1 >= one.size() || one[close + 1] != ':') return bad("no port after the ']'");
    port_text = one.substr(close + 2);
    if (host.empty()) return bad("an empty IPv6 address");
  } else {
    auto colon = one.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    host = one.substr(0, colon);
    port_text = one.substr(colon + 1);
    if (host.empty()) return bad("no host");
    if (host.find(':') != std::string::npos) return bad("an IPv6 address goes in brackets");
  }
  int port = 0;
  try {
    size_t used = 0;
    port = std::stoi(port_text, &used);
    if (used != port_text.size()) port = 0;
  } catch (...) {
    port = 0;
  }
  if (port <= 0 || port > 65535) return bad("the port is not a number in 1-65535");
  return std::pair{host, port};
}

}  // namespace

Result<std::vector<std::pair<std::string, int>>> ParseEndpoints(const std::string& endpoints) {
  std::vector<std::pair<std::string, int>> out;
  size_t begin = 0;
  while (begin <= endpoints.size()) {
    size_t end = std::min(endpoints.find(',', begin), endpoints.size());
    std::string one = endpoints.substr(begin, end - begin);
    begin = end + 1;
    NONSTOP_ASSIGN_OR_RETURN(auto host_port, ParseEndpoint(one, endpoints));
    out.push_back(std::move(host_port));
  }
  return out;
}

Client::~Client() = default;

Result<std::unique_ptr<Client>> Client::Create(const std::string& endpoints,
                                               ClientOptions options) {
  auto c = std::unique_ptr<Client>(new Client());
  c->endpoints_text_ = endpoints;
  c->options_ = options;
  NONSTOP_ASSIGN_OR_RETURN(auto parsed, ParseEndpoints(endpoints));
  NONSTOP_ASSIGN_OR_RETURN(c->tls_, UsesTls(endpoints, parsed, options.security));
  if (c->tls_) IgnoreSigpipe();
  NONSTOP_RETURN_IF_ERROR(CheckTlsFiles(options.security));
  if (!options.security.auth_file.empty()) {
    NONSTOP_ASSIGN_OR_RETURN(c->credentials_, ReadAuthFile(options.security.auth_file));
  }
  for (const auto& [host, port] : parsed) {
    auto e = std::make_unique<Endpoint>();
    e->host = host;
    e->port = port;
    e->name = host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port)
                                                  : fmt::format("{}:{}", host, port);
    e->http = MakeHttp(host, port, c->tls_, options.security, options.timeout);
    e->http->set_keep_alive(true);
    // A request's header and body go out in two writes: with Nagle's algorithm the body waits for
    // the ACK of the header, which etcd delays by up to 40 ms, on every request of a kept-alive
    // connection.
    e->http->set_tcp_nodelay(true);
    c->endpoints_.push_back(std::move(e));
  }
  return c;
}

const std::string& Client::endpoint_name(size_t i) const { return endpoints_[i]->name; }

std::unique_ptr<httplib::Client> Client::NewConnection(size_t i) const {
  const Endpoint& e = *endpoints_[i];
  return MakeHttp(e.host, e.port, tls_, options_.security, options_.timeout);
}

Status Client::TransportFailure(size_t i, const httplib::Client& http, httplib::Error error) const {
  const std::string& where = endpoints_[i]->name;
  if (error == httplib::Error::SSLServerVerification) {
    return TlsFailure(where, options_.security, false, http.get_openssl_verify_result());
  }
  if (error == httplib::Error::SSLConnection) return TlsFailure(where, options_.security, true, 0);
  if (error == httplib::Error::SSLLoadingCerts) {
    return FailedPreconditionError(fmt::format(
        "etcd {}: OpenSSL cannot load the CA certificates of --etcd-cacert {} (HINT: a PEM file "
        "of the CA that signed etcd's --cert-file)",
        where, options_.security.ca_file));
  }
  Status s = TransportStatus(where, error, options_.timeout);
  if (tls_ && (error == httplib::Error::Read || error == httplib::Error::Write)) {
    // Over TLS 1.3 etcd checks the client's certificate after the handshake: a refusal is a
    // connection closed under the first request (its write or its read).
    return UnavailableError(fmt::format(
        "{} (over TLS: etcd may have refused the client certificate {}: not signed by a CA in "
        "etcd's --trusted-ca-file?)",
        s.message(),
        options_.security.cert_file.empty() ? std::string("(none given: --etcd-cert/--etcd-key)")
                                            : "--etcd-cert " + options_.security.cert_file));
  }
  return s;
}

Result<std::string> Client::Send(const std::string& path, const std::string& body) {
  std::string errors;
  bool all_deadlines = true;
  for (size_t tried = 0; tried < endpoints_.size(); ++tried) {
    Endpoint& e = *endpoints_[current_];
    Answer answer = Post(*e.http, "/v3/" + path, body, token_);
    if (answer.error == httplib::Error::Success && answer.status == 200)
      return std::move(answer.body);
    Status failure = answer.error != httplib::Error::Success
                         ? TransportFailure(current_, *e.http, answer.error)
                         : AnswerStatus(e.name, path, answer.status, answer.body);
    // etcd answered: its error stands (another member would say the same)
    if (!IsTransient(failure)) return failure;
    // This member cannot serve now (down, paused, no raft leader, overloaded): another may.
    all_deadlines = all_deadlines && failure.code() == StatusCode::kDeadlineExceeded;
    errors += (errors.empty() ? "" : "; ") + failure.message();
    current_ = (current_ + 1) % endpoints_.size();
  }
  std::string message =
      fmt::format("no etcd member at {} served /v3/{} ({})", endpoints_text_, path, errors);
  return all_deadlines ? DeadlineExceededError(std::move(message))
                       : UnavailableError(std::move(message));
}

namespace {

// etcd no longer takes the token (it expired: --auth-token-ttl, or etcd restarted and forgot its
// simple tokens; or the auth store changed): authenticating again may help, once.
bool TokenRefused(const Status& s) {
  const std::string& m = s.message();
  return m.find("invalid auth token") != std::string::npos ||
         m.find("auth store is old") != std::string::npos ||
         m.find("UNAUTHENTICATED") != std::string::npos;
}

}  // namespace

Status Client::Authenticate() {
  token_.clear();
  nlohmann::json req = {{"name", credentials_->user}, {"password", credentials_->password}};
  auto body = Send("auth/authenticate", req.dump());
  if (!body.ok()) {
    if (IsTransient(body.status())) return body.status();
    if (body.status().message().find("authentication is not enabled") != std::string::npos) {
      // A user given for an etcd without auth: requests go without a token (it may be turned on
      // later: the next refused request authenticates again).
      if (!std::exchange(auth_disabled_said_, true)) {
        NONSTOP_LOG_WARNING(
            "etcd {} has authentication off: the user of --etcd-auth-file {} is not needed "
            "(requests go without a token)",
            endpoints_text_, options_.security.auth_file);
      }
      return OkStatus();
    }
    return FailedPreconditionError(fmt::format(
        "etcd refused the user '{}' of --etcd-auth-file {}: {} (HINT: check the user:password in "
        "that file, and that the user exists in etcd: `etcdctl user get {}`)",
        credentials_->user, options_.security.auth_file, body.status().message(),
        credentials_->user));
  }
  auto j = nlohmann::json::parse(*body, nullptr, false);
  if (!j.is_object() || !j.contains("token") || !j["token"].is_string() ||
      j["token"].get<std::string>().empty()) {
    return DataLossError(
        fmt::format("etcd {} answered /v3/auth/authenticate without a token", endpoints_text_));
  }
  token_ = j["token"].get<std::string>();
  return OkStatus();
}

Result<std::string> Client::AuthToken() {
  if (credentials_ && token_.empty()) NONSTOP_RETURN_IF_ERROR(Authenticate());
  return token_;
}

Result<std::string> Client::Call(const std::string& path, const std::string& body) {
  if (!credentials_) return Send(path, body);
  const bool fresh = token_.empty();
  NONSTOP_RETURN_IF_ERROR(AuthToken().status());
  auto answer = Send(path, body);
  if (answer.ok() || fresh || !TokenRefused(answer.status())) return answer;
  NONSTOP_RETURN_IF_ERROR(Authenticate());
  return Send(path, body);
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
  if (!j.is_object())
    return DataLossError(fmt::format("etcd's answer to /v3/{} is not a JSON object", path));
  try {
    return decode(j);
  } catch (const std::exception& e) {
    return DataLossError(fmt::format("etcd's answer to /v3/{}: {}", path, e.what()));
  }
}

int64_t Revision(const nlohmann::json& answer) {
  return JsonInt(answer.value("header", nlohmann::json::object()), "revision");
}

}  // namespace

Result<std::vector<KeyValue>> Client::Range(const std::string& key, const std::string& range_end,
                                            int64_t* revision) {
  nlohmann::json req = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) req["range_end"] = Base64Encode(range_end);
  return Ask(*this, "kv/range", req, [&](const nlohmann::json& j) -> Result<std::vector<KeyValue>> {
    if (revision != nullptr) *revision = Revision(j);
    return DecodeKvs(j);
  });
}

namespace {

nlohmann::json RangeRequest(const std::string& key, const std::string& range_end) {
  nlohmann::json req = {{"key", Base64Encode(key)}};
  if (!range_end.empty()) req["range_end"] = Base64Encode(range_end);
  return req;
}

Result<RangeResult> AskRange(Client& client, const nlohmann::json& req) {
  return Ask(client, "kv/range", req, [&](const nlohmann::json& j) -> Result<RangeResult> {
    RangeResult r;
    r.revision = Revision(j);
    r.more = j.value("more", false);
    NONSTOP_ASSIGN_OR_RETURN(r.kvs, DecodeKvs(j));
    return r;
  });
}

}  // namespace

Result<RangeResult> Client::RangePage(const std::string& key, const std::string& range_end,
                                      int64_t limit, int64_t revision) {
  nlohmann::json req = RangeRequest(key, range_end);
  if (limit > 0) req["limit"] = std::to_string(limit);
  if (revision > 0) req["revision"] = std::to_string(revision);
  return AskRange(*this, req);
}

Result<RangeResult> Client::RangeFiltered(const std::string& key, const std::string& range_end,
                                          Filter filter) {
  nlohmann::json req = RangeRequest(key, range_end);
  if (filter.min_mod_revision > 0)
    req["min_mod_revision"] = std::to_string(filter.min_mod_revision);
  if (filter.keys_only) req["keys_only"] = true;
  return AskRange(*this, req);
}

Result<std::vector<KeyValue>> Client::RangeAll(const std::string& key, const std::string& range_end,
                                               int64_t page, int64_t* revision) {
  // A few fresh starts at most: each is one revision compacted away under the read.
  for (int attempt = 0;; ++attempt) {
    std::vector<KeyValue> out;
    int64_t at = 0;
    std::string from = key;
    Status failed;
    while (true) {
      auto r = RangePage(from, range_end, page, at);
      if (!r.ok()) {
        failed = r.status();
        break;
      }
      if (at == 0) at = r->revision;
      const bool more = r->more && !r->kvs.empty();
      // the next page starts just after the last key read
      if (more) from = r->kvs.back().key + std::string(1, '\0');
      for (auto& kv : r->kvs) out.push_back(std::move(kv));
      if (!more || range_end.empty()) break;
    }
    if (failed.ok()) {
      if (revision != nullptr) *revision = at;
      return out;
    }
    if (failed.message().find("compacted") == std::string::npos || at == 0 || attempt >= 3)
      return failed;
  }
}

Result<int64_t> Client::Put(const std::string& key, const std::string& value, int64_t lease) {
  nlohmann::json req = {{"key", Base64Encode(key)}, {"value", Base64Encode(value)}};
  if (lease != 0) req["lease"] = std::to_string(lease);
  return Ask(*this, "kv/put", req,
             [](const nlohmann::json& j) -> Result<int64_t> { return Revision(j); });
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
               int64_t id = JsonInt(j, "ID");
               if (id == 0) return FailedPreconditionError("etcd granted no lease: " + j.dump());
               return std::pair{id, JsonInt(j, "TTL")};
             });
}

Result<int64_t> Client::LeaseKeepAlive(int64_t lease) {
  return Ask(
      *this, "lease/keepalive", {{"ID", std::to_string(lease)}},
      [&](const nlohmann::json& j) -> Result<int64_t> {
        // The gateway streams: the first (only) message is {"result": {...}}, or {"error": {...}}.
        if (auto e = j.find("error"); e != j.end()) {
          // A stream's error: {"grpc_code", "http_code", "message", "http_status"}.
          int http =
              e->is_object() && e->contains("http_code") && (*e)["http_code"].is_number_integer()
                  ? (*e)["http_code"].get<int>()
                  : 500;
          std::string message = e->is_object() ? e->value("message", e->dump()) : e->dump();
          return ClassifiedStatus(endpoints(), "lease/keepalive", http, GrpcCode(*e), message);
        }
        const nlohmann::json& r = j.contains("result") ? j["result"] : j;
        int64_t ttl = JsonInt(r, "TTL");
        if (ttl <= 0) return NotFoundError(fmt::format("etcd lease {:x} expired", lease));
        return ttl;
      });
}

Status Client::LeaseRevoke(int64_t lease) {
  return Call("lease/revoke", nlohmann::json({{"ID", std::to_string(lease)}}).dump()).status();
}

}  // namespace nonstop::etcd
