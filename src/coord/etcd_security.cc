#include "coord/etcd_security.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "common/file_util.h"

namespace nonstop::etcd {

namespace {

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

// OpenSSL's last error, for a message ("" if none), and its queue emptied.
std::string OpenSslError() {
  unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "";
  char text[256];
  ERR_error_string_n(e, text, sizeof(text));
  return text;
}

std::string TimeText(const ASN1_TIME* t) {
  BIO* bio = BIO_new(BIO_s_mem());
  if (bio == nullptr) return "?";
  ASN1_TIME_print(bio, t);
  char* data = nullptr;
  long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(std::max(0L, n)));
  BIO_free(bio);
  return out;
}

// Opens `path` (given as `flag`) for reading; the error names both.
Result<std::unique_ptr<std::FILE, FileCloser>> Open(const std::string& path, const char* flag) {
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "r"));
  if (f == nullptr) {
    return InvalidArgumentError(
        fmt::format("{} {}: cannot read it: {} (HINT: give the PEM file's "
                    "path; it must be readable by this user)",
                    flag, path, std::strerror(errno)));
  }
  return f;
}

// The first certificate of a PEM file.
Result<X509Ptr> ReadCertificate(const std::string& path, const char* flag, const char* what) {
  NONSTOP_ASSIGN_OR_RETURN(auto f, Open(path, flag));
  X509Ptr cert(PEM_read_X509(f.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) {
    return InvalidArgumentError(
        fmt::format("{} {}: not a PEM certificate ({}) (HINT: {} in PEM, \"-----BEGIN "
                    "CERTIFICATE-----\")",
                    flag, path, OpenSslError(), what));
  }
  return cert;
}

// Declines to prompt for a passphrase: an encrypted key is refused, not waited on.
int NoPassphrase(char*, int, int, void*) { return 0; }

}  // namespace

Result<Credentials> ReadAuthFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return InvalidArgumentError(
        fmt::format("--etcd-auth-file {}: {} (HINT: a file of one line "
                    "user:password, mode 600)",
                    path, std::strerror(errno)));
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return InvalidArgumentError(fmt::format(
        "--etcd-auth-file {} may be read by group or others (mode {:o}): it holds an etcd "
        "password (HINT: chmod 600 {})",
        path, st.st_mode & 0777, path));
  }
  NONSTOP_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!text.empty() && space(text.back())) text.pop_back();
  size_t start = 0;
  while (start < text.size() && space(text[start])) ++start;
  text.erase(0, start);
  const size_t colon = text.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size() ||
      text.find('\n') != std::string::npos) {
    return InvalidArgumentError(
        fmt::format("--etcd-auth-file {} is not one line user:password (both non-empty)", path));
  }
  return Credentials{text.substr(0, colon), text.substr(colon + 1)};
}

Status CheckTlsFiles(const Security& s) {
  if (!s.cert_file.empty() && s.key_file.empty()) {
    return InvalidArgumentError(fmt::format(
        "--etcd-cert {} without --etcd-key: a client certificate needs its private key (HINT: "
        "--etcd-key FILE, the key the certificate was made for)",
        s.cert_file));
  }
  if (s.cert_file.empty() && !s.key_file.empty()) {
    return InvalidArgumentError(
        fmt::format("--etcd-key {} without --etcd-cert: a private key needs its certificate (HINT: "
                    "--etcd-cert FILE)",
                    s.key_file));
  }
  if (!s.ca_file.empty()) {
    NONSTOP_ASSIGN_OR_RETURN(auto ca, ReadCertificate(s.ca_file, "--etcd-cacert",
                                                      "the CA certificate that signed etcd's"));
    (void)ca;
  }
  if (s.cert_file.empty()) return OkStatus();
  NONSTOP_ASSIGN_OR_RETURN(
      auto cert, ReadCertificate(s.cert_file, "--etcd-cert", "this client's certificate"));
  if (X509_cmp_current_time(X509_get0_notAfter(cert.get())) < 0) {
    return InvalidArgumentError(fmt::format(
        "--etcd-cert {}: the certificate expired on {}: etcd refuses it (HINT: renew it: a new "
        "certificate from the CA that etcd's --trusted-ca-file names)",
        s.cert_file, TimeText(X509_get0_notAfter(cert.get()))));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(cert.get())) > 0) {
    return InvalidArgumentError(fmt::format(
        "--etcd-cert {}: the certificate is not valid before {} (HINT: check this host's clock, "
        "or the certificate's start date)",
        s.cert_file, TimeText(X509_get0_notBefore(cert.get()))));
  }
  NONSTOP_ASSIGN_OR_RETURN(auto kf, Open(s.key_file, "--etcd-key"));
  std::unique_ptr<EVP_PKEY, KeyFree> key(
      PEM_read_PrivateKey(kf.get(), nullptr, NoPassphrase, nullptr));
  if (key == nullptr) {
    return InvalidArgumentError(
        fmt::format("--etcd-key {}: not a PEM private key, or an encrypted one ({}) (HINT: the "
                    "key in PEM, unencrypted: `openssl pkey -in KEY -out {}`, mode 600)",
                    s.key_file, OpenSslError(), s.key_file));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    OpenSslError();
    return InvalidArgumentError(fmt::format(
        "--etcd-key {} is not the private key of --etcd-cert {} (HINT: give the key the "
        "certificate was made for)",
        s.key_file, s.cert_file));
  }
  return OkStatus();
}

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4;
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    static const in6_addr kLoopback = IN6ADDR_LOOPBACK_INIT;
    return std::memcmp(&v6, &kLoopback, sizeof(v6)) == 0;
  }
  return false;
}

Result<bool> UsesTls(const std::string& endpoints,
                     const std::vector<std::pair<std::string, int>>& hosts, const Security& s) {
  const bool https = endpoints.find("https://") != std::string::npos;
  const bool http = endpoints.find("http://") != std::string::npos;
  if (https && http) {
    return InvalidArgumentError(fmt::format(
        "etcd endpoints '{}' mix http:// and https://: one etcd cluster speaks one of them (HINT: "
        "https:// for every member)",
        endpoints));
  }
  if (http && s.has_tls_files()) {
    return InvalidArgumentError(fmt::format(
        "etcd endpoints '{}' are http:// but TLS files are given (--etcd-cacert, --etcd-cert, "
        "--etcd-key) (HINT: https://, or leave the TLS flags out)",
        endpoints));
  }
  const bool tls = https || s.has_tls_files();
  if (tls || s.allow_plaintext) return tls;
  for (const auto& [host, port] : hosts) {
    if (IsLoopbackHost(host)) continue;
    return InvalidArgumentError(fmt::format(
        "etcd endpoint {}:{} is plain http to another host: the network would see the leader "
        "key, the job's journal and any etcd password (HINT: https:// with --etcd-cacert (and "
        "--etcd-cert/--etcd-key if etcd wants client certificates), or --etcd-allow-plaintext "
        "on a network you trust)",
        host.find(':') != std::string::npos ? "[" + host + "]" : host, port));
  }
  return false;
}

Status TlsFailure(const std::string& where, const Security& s, bool ssl_error, long verify_result) {
  const std::string ca = s.ca_file.empty()
                             ? std::string("the system's CAs (no --etcd-cacert given)")
                             : fmt::format("--etcd-cacert {}", s.ca_file);
  if (ssl_error) {
    std::string client =
        s.cert_file.empty()
            ? std::string(
                  "it wants a client certificate and none was given (HINT: --etcd-cert "
                  "and --etcd-key)")
            : fmt::format(
                  "it refused the client certificate --etcd-cert {} (not signed by a CA "
                  "in etcd's --trusted-ca-file?)",
                  s.cert_file);
    return UnavailableError(
        fmt::format("etcd {}: the TLS handshake failed: {}, or {} does not speak TLS (an "
                    "http:// etcd?)",
                    where, client, where));
  }
  const char* openssl = X509_verify_cert_error_string(verify_result);
  switch (verify_result) {
    case X509_V_OK:  // verified, but for another name
      return FailedPreconditionError(fmt::format(
          "etcd {}: its TLS certificate does not name this address (HINT: etcd's --cert-file "
          "needs a subjectAltName for the host or IP address in --etcd)",
          where));
    case X509_V_ERR_CERT_HAS_EXPIRED:
    case X509_V_ERR_CERT_NOT_YET_VALID:
      return FailedPreconditionError(fmt::format(
          "etcd {}: its TLS certificate is not valid now ({}) (HINT: renew etcd's --cert-file)",
          where, openssl));
    default:
      return FailedPreconditionError(fmt::format(
          "etcd {}: its TLS certificate does not verify against {} ({}) (HINT: --etcd-cacert must "
          "be the CA certificate that signed etcd's --cert-file)",
          where, ca, openssl));
  }
}

}  // namespace nonstop::etcd
