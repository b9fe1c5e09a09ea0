#include "controller/http_api.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/constant_time.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/time.h"
#include "dashboard/dashboard.h"
#include "net/address.h"

namespace nonstop::controller {

namespace {

constexpr size_t kMaxBodyBytes = 64 << 10;  // POST bodies; larger is 413
// request line + headers; larger goes to httplib, which refuses it
constexpr size_t kMaxHeadBytes = 16 << 10;
constexpr int kMaxWaitingConnections = 128;  // held by the gate; beyond it the oldest are closed
// complete requests queued for a worker; beyond it 503
constexpr size_t kMaxReadyConnections = 64;
constexpr int kWorkers = 4;
constexpr Millis kRequestDeadline{3'000};    // to send the whole request (head and body)
constexpr Millis kResponseDeadline{10'000};  // to read our response
// to drain what the client still sends after our response
constexpr Millis kLingerDeadline{200};
constexpr auto kScaleAnswerWait = std::chrono::seconds(10);

std::string ErrorJson(const std::string& reason) {
  return nlohmann::json{{"error", reason}}.dump();
}

void Reply(httplib::Response& res, int status, const std::string& reason) {
  res.status = status;
  res.set_content(ErrorJson(reason), "application/json");
}

// The canned answer of a connection the gate gives up on, sent without waiting.
void SendRawError(int fd, int status, const char* phrase, const std::string& reason) {
  std::string body = ErrorJson(reason);
  std::string msg = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: "
      "close\r\n\r\n{}",
      status, phrase, body.size(), body);
  (void)::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

bool WaitFor(int fd, short events, Deadline deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, PollTimeoutMs(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) return false;
  }
}

struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};
using SslPtr = std::unique_ptr<SSL, SslFree>;
struct SslCtxFree {
  void operator()(SSL_CTX* ctx) const { SSL_CTX_free(ctx); }
};
using SslCtxPtr = std::unique_ptr<SSL_CTX, SslCtxFree>;

// SSL_read or SSL_write on a non-blocking socket: waits, until `deadline`,
// for what TLS needs (a write may have to read, and a read write). The bytes
// done; 0 when the peer closed TLS; -1 on error or past the deadline.
ssize_t SslIo(SSL* ssl, int fd, bool writing, char* ptr, size_t size, Deadline deadline) {
  const int n_max = static_cast<int>(std::min<size_t>(size, 1 << 20));
  while (true) {
    ERR_clear_error();
    int n = writing ? SSL_write(ssl, ptr, n_max) : SSL_read(ssl, ptr, n_max);
    if (n > 0) return n;
    switch (SSL_get_error(ssl, n)) {
      case SSL_ERROR_WANT_READ:
        if (!WaitFor(fd, POLLIN, deadline)) return -1;
        break;
      case SSL_ERROR_WANT_WRITE:
        if (!WaitFor(fd, POLLOUT, deadline)) return -1;
        break;
      case SSL_ERROR_ZERO_RETURN:
        return 0;
      default:
        return -1;
    }
  }
}

// An httplib stream over a request the gate has already read (at least its
// head): it first replays those bytes, then reads the socket (through TLS
// when `ssl` is set), every read and write bounded by an absolute deadline,
// so a slow client cannot hold a worker longer than kRequestDeadline +
// kResponseDeadline.
class DeadlineStream : public httplib::Stream {
 public:
  DeadlineStream(int fd, SSL* ssl, std::string prefix)
      : fd_(fd),
        ssl_(ssl),
        prefix_(std::move(prefix)),
        read_deadline_(DeadlineAfter(kRequestDeadline)) {}

  bool is_readable() const override {
    return pos_ < prefix_.size() || (ssl_ != nullptr && SSL_pending(ssl_) > 0) ||
           WaitFor(fd_, POLLIN, read_deadline_);
  }
  bool is_writable() const override { return WaitFor(fd_, POLLOUT, WriteDeadline()); }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ < prefix_.size()) {
      size_t n = std::min(size, prefix_.size() - pos_);
      std::memcpy(ptr, prefix_.data() + pos_, n);
      pos_ += n;
      return static_cast<ssize_t>(n);
    }
    if (ssl_ != nullptr) return SslIo(ssl_, fd_, /*writing=*/false, ptr, size, read_deadline_);
    while (true) {
      ssize_t n = ::recv(fd_, ptr, size, 0);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
      if (!WaitFor(fd_, POLLIN, read_deadline_)) return -1;
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (ssl_ != nullptr) {
      return SslIo(ssl_, fd_, /*writing=*/true, const_cast<char*>(ptr), size, WriteDeadline());
    }
    while (true) {
      ssize_t n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
      if (!WaitFor(fd_, POLLOUT, WriteDeadline())) return -1;
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    Address(::getpeername, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    Address(::getsockname, ip, port);
  }
  socket_t socket() const override { return fd_; }

 private:
  // The response clock starts at the first write.
  Deadline WriteDeadline() const {
    if (write_deadline_ == Deadline{}) write_deadline_ = DeadlineAfter(kResponseDeadline);
    return write_deadline_;
  }
  template <typename F>
  void Address(F get, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    ip.clear();
    port = 0;
    if (get(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return;
    char text[INET6_ADDRSTRLEN] = {};
    if (addr.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&addr);
      ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
      port = ntohs(a->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&addr);
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
      port = ntohs(a->sin6_port);
    }
    ip = text;
  }

  const int fd_;
  SSL* const ssl_;  // nullptr: plain HTTP
  const std::string prefix_;
  size_t pos_ = 0;
  const Deadline read_deadline_;
  mutable Deadline write_deadline_{};
};

// How much of `buffer` a complete request takes: 0 while more bytes are
// needed. A request whose head or declared body is over the limits counts as
// complete once its head is in (or the head limit is reached): the worker
// refuses it at once, without reading the body.
size_t CompleteRequestBytes(const std::string& buffer) {
  size_t end = buffer.find("\r\n\r\n");
  if (end == std::string::npos) return buffer.size() >= kMaxHeadBytes ? buffer.size() : 0;
  size_t head = end + 4;
  std::string lower = buffer.substr(0, head);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // A client that asks to be told to go on before it sends the body gets that from the worker.
  if (lower.find("\r\nexpect:") != std::string::npos) return head;
  size_t at = lower.find("\r\ncontent-length:");
  // no body, or chunked: the worker reads it, with a deadline
  if (at == std::string::npos) return head;
  size_t p = at + 17;
  while (p < lower.size() && (lower[p] == ' ' || lower[p] == '\t')) ++p;
  size_t length = 0;
  size_t digits = 0;
  while (p < lower.size() && std::isdigit(static_cast<unsigned char>(lower[p])) && digits < 12) {
    length = length * 10 + static_cast<size_t>(lower[p] - '0');
    ++p;
    ++digits;
  }
  // malformed or too large: refused without the body
  if (digits == 0 || length > kMaxBodyBytes) return head;
  return buffer.size() >= head + length ? head + length : 0;
}

// OpenSSL's queued errors, as one line (the queue is emptied).
std::string SslErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char text[256];
    ERR_error_string_n(e, text, sizeof(text));
    out += (out.empty() ? "" : "; ") + std::string(text);
  }
  return out.empty() ? "no detail from OpenSSL" : out;
}

// A key with a passphrase is refused, not prompted for: a controller has no one to ask.
int NoPassphrase(char*, int, int, void*) { return 0; }

Result<std::string> ReadWhole(const std::string& path, const char* what, const char* flag) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return InvalidArgumentError(fmt::format(
        "cannot read the HTTPS {} {}: {} (HINT: {} takes a PEM file this user can read)", what,
        path, std::strerror(errno), flag));
  }
  std::string text;
  char chunk[4096];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof(chunk), f)) > 0) text.append(chunk, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return InvalidArgumentError(fmt::format("cannot read the HTTPS {} {}", what, path));
  return text;
}

// Checks the files one by one, so that the error names the file and what is wrong with it, and
// then builds the server's TLS context from them.
Result<SslCtxPtr> LoadTls(const HttpTls& tls) {
  if (tls.cert_path.empty() != tls.key_path.empty()) {
    return InvalidArgumentError(
        "HTTPS needs both --http-cert and --http-key (the certificate and its private key)");
  }
  struct stat st {};
  if (::stat(tls.key_path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    return InvalidArgumentError(fmt::format(
        "the HTTPS key {} can be read by group or others (mode 0{:03o}): whoever reads it can pose "
        "as this endpoint (HINT: chmod 600 {})",
        tls.key_path, st.st_mode & 0777, tls.key_path));
  }
  auto cert_text = ReadWhole(tls.cert_path, "certificate", "--http-cert");
  if (!cert_text.ok()) return cert_text.status();
  auto key_text = ReadWhole(tls.key_path, "key", "--http-key");
  if (!key_text.ok()) return key_text.status();
  {
    std::unique_ptr<BIO, decltype(&BIO_free)> bio(
        BIO_new_mem_buf(cert_text->data(), static_cast<int>(cert_text->size())), BIO_free);
    std::unique_ptr<X509, decltype(&X509_free)> cert(
        PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr), X509_free);
    if (!cert) {
      ERR_clear_error();
      return InvalidArgumentError(fmt::format(
          "the HTTPS certificate {} holds no PEM certificate (-----BEGIN CERTIFICATE-----) "
          "(HINT: --http-cert takes the certificate, PEM-encoded; `openssl x509 -in FILE -inform "
          "DER -out FILE.pem` converts a DER one)",
          tls.cert_path));
    }
  }
  {
    std::unique_ptr<BIO, decltype(&BIO_free)> bio(
        BIO_new_mem_buf(key_text->data(), static_cast<int>(key_text->size())), BIO_free);
    std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
        PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr), EVP_PKEY_free);
    if (!key) {
      ERR_clear_error();
      return InvalidArgumentError(fmt::format(
          "the HTTPS key {} holds no unencrypted PEM private key (HINT: --http-key takes the "
          "certificate's private key, PEM-encoded, without a passphrase: `openssl pkey -in FILE "
          "-out KEY` removes one)",
          tls.key_path));
    }
  }
  SslCtxPtr ctx(SSL_CTX_new(TLS_server_method()));
  if (!ctx) return InternalError("cannot create a TLS context: " + SslErrors());
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_options(ctx.get(), SSL_OP_NO_RENEGOTIATION);
  // No session tickets: clients make one request per connection, and they would be one more
  // write in the handshake.
  SSL_CTX_set_num_tickets(ctx.get(), 0);
  SSL_CTX_set_default_passwd_cb(ctx.get(), NoPassphrase);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert_path.c_str()) != 1) {
    return InvalidArgumentError(
        fmt::format("the HTTPS certificate {} cannot be used: {}", tls.cert_path, SslErrors()));
  }
  // (OpenSSL checks here already that the key is the certificate's.)
  const bool used =
      SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key_path.c_str(), SSL_FILETYPE_PEM) == 1;
  const int reason = used ? 0 : ERR_GET_REASON(ERR_peek_last_error());
  if (used ? SSL_CTX_check_private_key(ctx.get()) != 1
           : reason == X509_R_KEY_VALUES_MISMATCH || reason == X509_R_KEY_TYPE_MISMATCH) {
    ERR_clear_error();
    return InvalidArgumentError(fmt::format(
        "the HTTPS key {} is not the private key of the certificate {} (HINT: pass the key the "
        "certificate was made for)",
        tls.key_path, tls.cert_path));
  }
  if (!used) {
    return InvalidArgumentError(
        fmt::format("the HTTPS key {} cannot be used: {}", tls.key_path, SslErrors()));
  }
  return ctx;
}

// A connection the gate holds until its request is complete.
struct Waiting {
  UniqueFd fd;
  SslPtr ssl;               // HTTPS: the TLS session (after fd: freed first)
  bool handshaken = false;  // HTTPS: SSL_accept is done
  short events = POLLIN;    // what to poll for (TLS may need to write)
  std::string buffer;       // what the client has sent so far (decrypted)
  Deadline deadline;
};
// A complete request, for a worker.
struct Ready {
  UniqueFd fd;
  SslPtr ssl;
  std::string request;
};

}  // namespace

// httplib's Server with the gate in front of its request processing (see the
// header). httplib calls process_and_close_socket() for each accepted
// socket; this override hands the socket to the gate and returns at once.
class GatedHttpServer : public httplib::Server {
 public:
  // `tls`: HTTPS with this context; nullptr: plain HTTP.
  explicit GatedHttpServer(SslCtxPtr tls) : tls_(std::move(tls)) {
    // The listening thread's task is only the hand-off below: one thread is plenty.
    new_task_queue = [] { return new httplib::ThreadPool(1); };
    set_keep_alive_max_count(1);
    set_payload_max_length(kMaxBodyBytes);
    UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    wake_ = std::move(wake);
    gate_ = std::thread([this] { GateLoop(); });
    for (int i = 0; i < kWorkers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }
  ~GatedHttpServer() override { Shutdown(); }

  // httplib listens with a backlog of 5: a burst of connections (a flood, or
  // just many clients at once) would overflow it and legitimate clients would
  // wait for SYN retransmits (1 s, 3 s, …). listen() again widens it.
  void WidenBacklog() {
    socket_t fd = svr_sock_;
    if (fd != INVALID_SOCKET) (void)::listen(fd, 1024);
  }

  // Stops the gate and the workers (after the request each is serving) and
  // closes every connection they hold. Idempotent.
  void Shutdown() {
    {
      MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    Wake();
    ready_cv_.NotifyAll();
    if (gate_.joinable()) gate_.join();
    for (auto& w : workers_) w.join();
    MutexLock lock(&mu_);
    incoming_.clear();
    ready_.clear();
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    UniqueFd fd(sock);
    int flags = ::fcntl(fd.get(), F_GETFL, 0);
    if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) < 0) return false;
    {
      MutexLock lock(&mu_);
      if (stopping_) return false;
      incoming_.push_back(std::move(fd));
    }
    Wake();
    return true;
  }

  void Wake() {
    uint64_t one = 1;
    ssize_t n = ::write(wake_.get(), &one, sizeof(one));
    (void)n;
  }

  // The connections accepted since the last round join `waiting` (HTTPS: each with its TLS
  // session); beyond kMaxWaitingConnections the oldest are closed. False: stopping.
  bool Admit(std::deque<Waiting>& waiting, int& evicted) {
    {
      MutexLock lock(&mu_);
      if (stopping_) return false;
      for (auto& fd : incoming_) {
        Waiting w;
        w.fd = std::move(fd);
        w.deadline = DeadlineAfter(kRequestDeadline);
        if (tls_ != nullptr) {
          w.ssl.reset(SSL_new(tls_.get()));
          if (w.ssl == nullptr || SSL_set_fd(w.ssl.get(), w.fd.get()) != 1) {
            NONSTOP_LOG_ERROR("http: cannot start TLS on a connection: {}", SslErrors());
            continue;
          }
        }
        waiting.push_back(std::move(w));
      }
      incoming_.clear();
    }
    while (static_cast<int>(waiting.size()) > kMaxWaitingConnections) {
      if (evicted++ == 0) {
        NONSTOP_LOG_WARNING(
            "http: more than {} connections have not sent a request: closing the oldest first "
            "(a flood of idle connections?)",
            kMaxWaitingConnections);
      }
      waiting.pop_front();
    }
    if (waiting.empty() && evicted > 0) {
      NONSTOP_LOG_WARNING("http: the burst is over: {} idle connections were closed", evicted);
      evicted = 0;
    }
    return true;
  }

  // After a TLS call that returned `rc`: true (and what to poll for) when it only has to wait.
  static bool TlsWaits(Waiting& w, int rc) {
    switch (SSL_get_error(w.ssl.get(), rc)) {
      case SSL_ERROR_WANT_READ:
        w.events = POLLIN;
        return true;
      case SSL_ERROR_WANT_WRITE:
        w.events = POLLOUT;
        return true;
      default:
        return false;
    }
  }

  // Reads what the client has sent (HTTPS: first advancing the handshake), up
  // to the limits of a request we would accept. False: the connection is
  // closed or failed.
  static bool ReadSome(Waiting& w) {
    constexpr size_t kLimit = kMaxHeadBytes + kMaxBodyBytes;
    if (w.ssl != nullptr && !w.handshaken) {
      ERR_clear_error();
      int rc = SSL_accept(w.ssl.get());
      if (rc != 1) {
        if (TlsWaits(w, rc)) return true;
        // OpenSSL recognises a plain HTTP request (and sends no alert): answer it in plain text.
        if (ERR_GET_REASON(ERR_peek_error()) == SSL_R_HTTP_REQUEST) {
          SendRawError(w.fd.get(), 400, "Bad Request",
                       "this endpoint serves HTTPS: use https:// (HINT: `nonstop scale --http "
                       "https://HOST:PORT`)");
        }
        ERR_clear_error();
        return false;
      }
      w.handshaken = true;
      w.events = POLLIN;
    }
    char chunk[4096];
    while (w.buffer.size() < kLimit) {
      const size_t want = std::min(sizeof(chunk), kLimit - w.buffer.size());
      if (w.ssl != nullptr) {
        ERR_clear_error();
        int n = SSL_read(w.ssl.get(), chunk, static_cast<int>(want));
        if (n > 0) {
          w.buffer.append(chunk, static_cast<size_t>(n));
          continue;
        }
        const bool waits = TlsWaits(w, n);
        ERR_clear_error();
        return waits;
      }
      ssize_t n = ::recv(w.fd.get(), chunk, want, 0);
      if (n > 0) {
        w.buffer.append(chunk, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
    return true;
  }

  void GateLoop() {
    std::deque<Waiting> waiting;  // oldest first
    std::vector<pollfd> fds;
    int evicted = 0;
    while (Admit(waiting, evicted)) {
      fds.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      Deadline next = kNoDeadline;
      for (const auto& w : waiting) {
        fds.push_back({w.fd.get(), w.events, 0});
        next = std::min(next, w.deadline);
      }
      int rc = ::poll(fds.data(), fds.size(), PollTimeoutMs(next));
      if (rc < 0 && errno != EINTR) {
        NONSTOP_LOG_ERROR("http: poll failed: {}", std::strerror(errno));
        return;
      }
      if (rc > 0 && fds[0].revents != 0) {
        uint64_t v;
        while (::read(wake_.get(), &v, sizeof(v)) > 0) {
        }
      }
      Deadline now = Clock::now();
      std::deque<Waiting> still;
      for (size_t i = 0; i < waiting.size(); ++i) {
        Waiting& w = waiting[i];
        const bool closed = rc > 0 && fds[i + 1].revents != 0 && !ReadSome(w);
        if (size_t bytes = CompleteRequestBytes(w.buffer);
            bytes > 0 || w.buffer.size() >= kMaxHeadBytes + kMaxBodyBytes) {
          Dispatch(std::move(w));
          continue;
        }
        if (closed) continue;  // the client went away (or failed TLS) before sending a request
        if (now >= w.deadline) {
          // (A TLS client gets no plain-text answer in the middle of its session.)
          if (!w.buffer.empty() && w.ssl == nullptr) {
            SendRawError(
                w.fd.get(), 408, "Request Timeout",
                fmt::format("the request was not complete within {} ms", kRequestDeadline.count()));
          }
          continue;  // closes it
        }
        still.push_back(std::move(w));
      }
      waiting = std::move(still);
    }
  }

  void Dispatch(Waiting w) {
    MutexLock lock(&mu_);
    if (ready_.size() >= kMaxReadyConnections) {
      lock.Unlock();
      if (w.ssl == nullptr) {
        SendRawError(w.fd.get(), 503, "Service Unavailable",
                     "too many requests in progress: retry shortly");
      }
      return;
    }
    ready_.push_back({std::move(w.fd), std::move(w.ssl), std::move(w.buffer)});
    ready_cv_.NotifyOne();
  }

  void WorkerLoop() {
    while (true) {
      Ready r;
      {
        MutexLock lock(&mu_);
        ready_cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !ready_.empty();
        });
        if (stopping_) return;
        r = std::move(ready_.front());
        ready_.pop_front();
      }
      DeadlineStream stream(r.fd.get(), r.ssl.get(), std::move(r.request));
      bool connection_closed = false;
      try {
        (void)process_request(stream, /*close_connection=*/true, connection_closed, nullptr);
      } catch (const std::exception& e) {
        NONSTOP_LOG_ERROR("http: a request failed: {}", e.what());
      }
      if (r.ssl != nullptr) {
        // close_notify, once, without waiting for the client's
        ERR_clear_error();
        (void)SSL_shutdown(r.ssl.get());
        ERR_clear_error();
      }
      LingeringClose(r.fd.get());
    }
  }

  // What the client still sends (a body we refused) is drained for a moment,
  // so that closing does not reset the connection before the client has read
  // our answer.
  static void LingeringClose(int fd) {
    ::shutdown(fd, SHUT_WR);
    Deadline until = DeadlineAfter(kLingerDeadline);
    char sink[4096];
    size_t drained = 0;
    while (drained < (1u << 20) && WaitFor(fd, POLLIN, until)) {
      ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
      if (n <= 0) break;
      drained += static_cast<size_t>(n);
    }
  }

  const SslCtxPtr tls_;
  UniqueFd wake_;
  std::thread gate_;
  std::vector<std::thread> workers_;
  Mutex mu_;
  CondVar ready_cv_;
  bool stopping_ NONSTOP_GUARDED_BY(mu_) = false;
  std::vector<UniqueFd> incoming_ NONSTOP_GUARDED_BY(mu_);  // accepted, not yet seen by the gate
  std::deque<Ready> ready_ NONSTOP_GUARDED_BY(mu_);         // complete requests for the workers
};

bool IsLoopbackHost(const std::string& host) { return net::IsLoopbackHost(host); }

bool HttpApi::Authorized(const std::string& header) const {
  if (token_.empty()) return true;  // loopback only (Start refuses it elsewhere)
  constexpr std::string_view kScheme = "bearer ";
  if (header.size() < kScheme.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(header[i])) != kScheme[i]) return false;
  }
  std::string_view presented = std::string_view(header).substr(kScheme.size());
  while (!presented.empty() && presented.front() == ' ') presented.remove_prefix(1);
  while (!presented.empty() && (presented.back() == ' ' || presented.back() == '\t'))
    presented.remove_suffix(1);
  return ConstantTimeEquals(presented, token_);
}

namespace {

// A Content-Length over kMaxBodyBytes (or too long to be a number we would accept).
bool DeclaredBodyTooLarge(const std::string& value) {
  size_t length = 0;
  for (char c : value) {
    if (!std::isdigit(static_cast<unsigned char>(c))) break;
    length = length * 10 + static_cast<size_t>(c - '0');
    if (length > kMaxBodyBytes) return true;
  }
  return false;
}

enum class Guard {
  kOpen,         // anyone who reaches the endpoint
  kOffLoopback,  // the token when the endpoint is not on loopback
  kToken,        // always the token
};
struct Route {
  const char* path;
  const char* method;
  Guard guard;
};
constexpr Route kRoutes[] = {
    // the dashboard: a page without data (what it shows, it asks for with the token)
    {"/", "GET", Guard::kOpen},
    {"/status", "GET", Guard::kOffLoopback},
    {"/metrics", "GET", Guard::kOffLoopback},
    {"/events", "GET", Guard::kToken},
    {"/scale", "POST", Guard::kToken},
};

using Handled = httplib::Server::HandlerResponse;

// The answer to a request that lacks the token. It names what to send and
// never repeats what was presented.
void RefuseUnauthorized(const Route& route, bool loopback, httplib::Response& res) {
  res.set_header("WWW-Authenticate", "Bearer realm=\"nonstop\"");
  Reply(res, 401,
        fmt::format("{} {} needs the job's HTTP token as 'Authorization: Bearer <token>'{} (in "
                    "the file the job file's \"http_token_file\" names, runs/job.http-token; "
                    "`nonstop scale` sends it)",
                    route.method, route.path,
                    loopback || route.guard == Guard::kToken
                        ? ""
                        : ", as every endpoint does on an address other than loopback"));
}

// POST bodies: within the limit, and JSON. False: refused (res says why).
bool BodyAcceptable(const httplib::Request& req, httplib::Response& res) {
  if (DeclaredBodyTooLarge(req.get_header_value("Content-Length"))) {
    Reply(res, 413, fmt::format("the body is over the limit of {} bytes", kMaxBodyBytes));
    return false;
  }
  std::string type = req.get_header_value("Content-Type");
  if (type.substr(0, type.find(';')) != "application/json") {
    Reply(res, 415,
          fmt::format("the body must be JSON (Content-Type: application/json), not '{}'",
                      type.substr(0, 100)));
    return false;
  }
  return true;
}

// What httplib refuses by itself (a malformed request line, a body over the
// limit, …) also gets a reason.
void ExplainError(const httplib::Request&, httplib::Response& res) {
  if (!res.body.empty()) return;
  std::string reason;
  switch (res.status) {
    case 400:
      reason = "malformed HTTP request";
      break;
    case 413:
      reason = fmt::format("the body is over the limit of {} bytes", kMaxBodyBytes);
      break;
    case 414:
      reason = "the request line is too long";
      break;
    default:
      reason = fmt::format("HTTP {}", res.status);
  }
  res.set_content(ErrorJson(reason), "application/json");
}

}  // namespace

// Before any handler and before the body is read: path, method, token, size, type.
void HttpApi::InstallGate() {
  server_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    const Route* route = nullptr;
    for (const Route& r : kRoutes) {
      if (req.path == r.path) route = &r;
    }
    if (route == nullptr) {
      Reply(res, 404,
            fmt::format(
                "no endpoint '{}': the API is GET / (the dashboard), GET /status, GET /metrics, "
                "GET /events and POST /scale",
                req.path.substr(0, 200)));
      return Handled::Handled;
    }
    const bool method_ok = req.method == route->method ||
                           (req.method == "HEAD" && std::string(route->method) == "GET");
    if (!method_ok) {
      res.set_header("Allow", route->method);
      Reply(res, 405, fmt::format("{} takes {}, not {}", route->path, route->method, req.method));
      return Handled::Handled;
    }
    const bool needs_token =
        route->guard == Guard::kToken || (route->guard == Guard::kOffLoopback && !loopback_);
    if (needs_token && !Authorized(req.get_header_value("Authorization"))) {
      unauthorized_.fetch_add(1, std::memory_order_relaxed);
      RefuseUnauthorized(*route, loopback_, res);
      return Handled::Handled;
    }
    if (req.method == "POST" && !BodyAcceptable(req, res)) return Handled::Handled;
    return Handled::Unhandled;
  });
  server_->set_error_handler(ExplainError);
}

void HttpApi::InstallRoutes() {
  auto& srv = *server_;
  srv.Get("/status", [this](const httplib::Request&, httplib::Response& res) {
    MutexLock lock(&mu_);
    res.set_content(status_, "application/json");
  });
  srv.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    std::string text;
    {
      MutexLock lock(&mu_);
      text = metrics_;
    }
    text += fmt::format(
        "# HELP nonstop_http_unauthorized_total HTTP requests refused for want of the job token\n"
        "# TYPE nonstop_http_unauthorized_total counter\n"
        "nonstop_http_unauthorized_total {}\n",
        unauthorized_.load(std::memory_order_relaxed));
    res.set_content(text, "text/plain; version=0.0.4");
  });
  srv.Get("/", [page = dashboard::LivePage()](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(page, "text/html; charset=utf-8");
  });
  srv.Get("/events",
          [this](const httplib::Request& req, httplib::Response& res) { ServeEvents(req, res); });
  srv.Post("/scale",
           [this](const httplib::Request& req, httplib::Response& res) { ServeScale(req, res); });
}

// ?offset=B: the journal from byte B, whole lines only; X-Next-Offset says where to go on.
void HttpApi::ServeEvents(const httplib::Request& req, httplib::Response& res) {
  uint64_t offset = 0;
  if (req.has_param("offset")) {
    const std::string v = req.get_param_value("offset");
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), offset);
    if (ec != std::errc() || end != v.data() + v.size()) {
      Reply(res, 400,
            fmt::format("offset must be a byte offset (a non-negative integer), not '{}'",
                        v.substr(0, 40)));
      return;
    }
  }
  std::ifstream in(journal_path_, std::ios::binary);
  in.seekg(0, std::ios::end);
  const uint64_t size = in ? static_cast<uint64_t>(in.tellg()) : 0;
  // a journal rotated under the reader: it reads on from the end
  if (offset > size) offset = size;
  // At most 4 MiB at once, whole lines: a page reading a long job's journal asks again
  // (X-Journal-Size).
  constexpr uint64_t kMaxChunk = 4u << 20;
  std::string text(std::min<uint64_t>(size - offset, kMaxChunk), '\0');
  in.seekg(static_cast<std::streamoff>(offset));
  if (!text.empty()) in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(in ? text.size() : static_cast<size_t>(in.gcount()));
  size_t whole = text.rfind('\n');  // a line being written stays for the next read
  text.resize(whole == std::string::npos ? 0 : whole + 1);
  if (text.empty() && size - offset >= kMaxChunk) {
    Reply(res, 500,
          fmt::format("the journal line at byte {} is longer than {} bytes", offset, kMaxChunk));
    return;
  }
  res.set_header("X-Next-Offset", std::to_string(offset + text.size()));
  res.set_header("X-Journal-Size", std::to_string(size));
  res.set_content(text, "application/x-ndjson");
}

void HttpApi::ServeScale(const httplib::Request& req, httplib::Response& res) {
  auto body = nlohmann::json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) {
    res.status = 400;
    res.set_content(
        nlohmann::json{
            {"accepted", false},
            {"error",
             R"(the body is not a JSON object: expected {"world_size": N}, {"release": N} or {"grow": N})"}}
            .dump(),
        "application/json");
    return;
  }
  auto call = std::make_unique<ScaleCall>();
  call->body = body;
  call->source = "POST /scale from " + req.remote_addr;
  auto answer = call->reply.get_future();
  {
    MutexLock lock(&mu_);
    call->id = next_id_++;
    calls_.push_back(std::move(call));
  }
  uint64_t one = 1;
  ssize_t w = ::write(wake_.get(), &one, sizeof(one));
  (void)w;
  if (answer.wait_for(kScaleAnswerWait) != std::future_status::ready) {
    res.status = 503;
    res.set_content(R"({"accepted": false, "error": "the controller did not answer in 10 s"})",
                    "application/json");
    return;
  }
  try {
    auto [status, reply] = answer.get();
    res.status = status;
    res.set_content(reply.dump(), "application/json");
  } catch (const std::future_error&) {
    res.status = 503;
    res.set_content(R"({"accepted": false, "error": "the job has ended"})", "application/json");
  }
}

Result<std::unique_ptr<HttpApi>> HttpApi::Start(const std::string& http_host, int port,
                                                std::string journal_path, std::string token,
                                                const HttpTls& tls) {
  const std::string host(net::UnbracketHost(http_host));  // "::1" or "[::1]" alike
  if (port < 0 || port > 65535)
    return InvalidArgumentError(fmt::format("HTTP port {} is not in [0, 65535]", port));
  if (token.empty() && !IsLoopbackHost(host)) {
    return InvalidArgumentError(
        fmt::format("refusing to serve HTTP on {} without a job token: anyone who can reach it "
                    "could resize the job and read "
                    "its journal (HINT: bind --http-host to 127.0.0.1, or pass the job token)",
                    net::FormatHostPort(host, static_cast<uint16_t>(port))));
  }
  SslCtxPtr tls_ctx;
  if (!tls.cert_path.empty() || !tls.key_path.empty()) {
    auto ctx = LoadTls(tls);
    if (!ctx.ok()) return ctx.status();
    tls_ctx = std::move(*ctx);
  }
  auto api = std::unique_ptr<HttpApi>(new HttpApi());
  api->journal_path_ = std::move(journal_path);
  api->host_ = host;
  api->token_ = std::move(token);
  api->loopback_ = IsLoopbackHost(host);
  api->tls_ = tls_ctx != nullptr;
  api->wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  api->server_ = std::make_unique<GatedHttpServer>(std::move(tls_ctx));
  api->InstallGate();
  api->InstallRoutes();
  HttpApi* self = api.get();
  auto& srv = *api->server_;
  int bound = port == 0 ? srv.bind_to_any_port(host) : (srv.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return UnavailableError(fmt::format("cannot listen for HTTP on {}",
                                        net::FormatHostPort(host, static_cast<uint16_t>(port))));
  }
  api->port_ = bound;
  api->server_->WidenBacklog();
  api->thread_ = std::thread([self] { self->server_->listen_after_bind(); });
  // httplib's stop() does nothing before its loop runs: wait for it, so that
  // destroying the api right away cannot leave the loop running forever.
  for (Deadline until = DeadlineAfter(Millis(10'000)); !srv.is_running();) {
    if (Clock::now() >= until)
      return InternalError("the HTTP server thread did not start within 10 s");
    std::this_thread::sleep_for(Millis(1));
  }
  return api;
}

HttpApi::~HttpApi() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
  {
    MutexLock lock(&mu_);
    for (auto& c : calls_)
      c->reply.set_value({503, {{"accepted", false}, {"error", "the job has ended"}}});
    calls_.clear();
  }
  // Workers may be in a handler that uses this object: stop them first.
  if (server_) server_->Shutdown();
}

std::string HttpApi::address() const {
  return net::FormatHostPort(host_, static_cast<uint16_t>(port_));
}

std::vector<std::unique_ptr<ScaleCall>> HttpApi::TakeCalls() {
  uint64_t v;
  while (::read(wake_.get(), &v, sizeof(v)) > 0) {
  }
  MutexLock lock(&mu_);
  return std::move(calls_);
}

void HttpApi::Publish(nlohmann::json status, std::string metrics) {
  MutexLock lock(&mu_);
  status_ = status.dump(2);
  metrics_ = std::move(metrics);
}

}  // namespace nonstop::controller
