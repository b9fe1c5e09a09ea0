// How nonstop talks to etcd safely (docs/etcd-security.md): TLS with the
// server's certificate checked against a CA file, a client certificate, an
// etcd user whose password is read from a file, and the refusal of plain
// http to an etcd that is not on this host unless asked for explicitly.
//
// One Security is shared by every etcd user of a process (the controller's
// campaign, lease and journal clients, the agent's leader watch, a worker's
// ControllerLink): the flags --etcd-cacert, --etcd-cert, --etcd-key,
// --etcd-auth-file and --etcd-allow-plaintext fill it (their NONSTOP_ETCD_*
// variables for a worker: paths only, never a secret, in the environment).
//
// Everything that can be checked without etcd is checked when a client is
// made (etcd::Client::Create): each error names the file (or the endpoint)
// and what to do about it. What only a connection can tell (etcd's
// certificate signed by another CA, expired, or naming another host) is
// reported by the request that found it, naming --etcd-cacert's file.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "nonstop/status.h"

namespace nonstop::etcd {

struct Security {
  std::string ca_file;    // --etcd-cacert: the CA that signed etcd's certificate (PEM)
  std::string cert_file;  // --etcd-cert: this client's certificate (PEM), with key_file
  std::string key_file;   // --etcd-key: its private key (PEM, not encrypted)
  // --etcd-auth-file: one line "user:password" (mode 600): the etcd user this client
  // authenticates as (POST /v3/auth/authenticate); its token goes with every request.
  std::string auth_file;
  // --etcd-allow-plaintext: plain http to an etcd that is not on a loopback address (the
  // network then sees the leader key, the journal and any etcd password).
  bool allow_plaintext = false;

  // TLS files were given (a bare host:port endpoint then means https).
  bool has_tls_files() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// An etcd user and password, as --etcd-auth-file holds them.
struct Credentials {
  std::string user;
  std::string password;
};

// Reads "user:password" (surrounding whitespace ignored) from `path`; refuses a file that group
// or others may read, an empty user or password. Errors name the file and the fix.
Result<Credentials> ReadAuthFile(const std::string& path);

// The TLS files of `s`: each readable and PEM, the client certificate valid now (not expired, not
// yet valid), the key the certificate's, a certificate with no key or a key with no certificate
// refused. OK when no TLS file is given.
Status CheckTlsFiles(const Security& s);

// Whether `host` (a name or an address without brackets) is this host: 127.0.0.0/8, ::1,
// "localhost".
bool IsLoopbackHost(const std::string& host);

// Whether the endpoints ("http://", "https://" or bare, see ParseEndpoints) speak TLS: https://
// or TLS files given. Refuses a mix of http:// and https://, http:// with TLS files, and plain
// http to a non-loopback host without s.allow_plaintext; the error names the endpoint and the fix.
Result<bool> UsesTls(const std::string& endpoints,
                     const std::vector<std::pair<std::string, int>>& hosts, const Security& s);

// The error of a connection whose TLS handshake or check failed at etcd member `where`:
// `verify_result` is OpenSSL's verification result of etcd's certificate (X509_V_OK = 0 if it
// verified, or was not checked). ssl_error: the handshake itself failed (etcd refused this
// client's certificate, or is not TLS); else etcd's certificate did not verify. The text names
// the file to fix (--etcd-cacert, --etcd-cert). A certificate that does not verify is final
// (kFailedPrecondition: retrying cannot help); a failed handshake is kUnavailable (it may also be
// a connection cut mid-handshake), its text says what it most likely is.
Status TlsFailure(const std::string& where, const Security& s, bool ssl_error, long verify_result);

}  // namespace nonstop::etcd
