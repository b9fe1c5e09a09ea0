// Test helper: certificates for a TLS etcd, made by the test with `openssl`
// (OpenSSL 3's command line, as Debian has it): a CA, etcd's server
// certificate (subjectAltName IP:127.0.0.1), a client certificate (CN
// "root", etcd's user when it maps certificates to users), the same client
// key with an expired certificate (`-days -1`: valid until a day before it
// starts), and a second CA that signed nothing etcd knows. EC P-256 keys: a
// few milliseconds each.
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

#include <fmt/format.h>

namespace nonstop::testing {

struct TestCerts {
  std::string ca;  // ca.crt
  std::string server_cert, server_key;
  std::string client_cert, client_key;
  std::string expired_cert;  // client_key's, expired
  std::string other_ca;      // a CA that signed neither etcd's nor the client's certificate
};

// Makes them in `dir`; false if openssl failed (its output is in dir/openssl.out).
inline bool MakeTestCerts(const std::string& dir, TestCerts* out) {
  const std::string log = dir + "/openssl.out";
  auto run = [&](const std::string& args) {
    return std::system(fmt::format("cd '{}' && openssl {} >>'{}' 2>&1", dir, args, log).c_str()) ==
           0;
  };
  auto ext = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
  };
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  ext("server.ext", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n");
  ext("client.ext", "extendedKeyUsage=clientAuth\n");
  bool ok =
      run("req -x509 " + ec + " -keyout ca.key -out ca.crt -days 2 -subj /CN=nonstop-test-ca") &&
      run("req -x509 " + ec + " -keyout other-ca.key -out other-ca.crt -days 2 -subj /CN=other") &&
      run("req " + ec + " -keyout server.key -out server.csr -subj /CN=etcd") &&
      run("x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt "
          "-days 2 -extfile server.ext") &&
      run("req " + ec + " -keyout client.key -out client.csr -subj /CN=root") &&
      run("x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out client.crt "
          "-days 2 -extfile client.ext") &&
      run("x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out expired.crt "
          "-days -1 -extfile client.ext") &&
      std::system(fmt::format("chmod 600 '{}'/*.key", dir).c_str()) == 0;
  *out = {dir + "/ca.crt",     dir + "/server.crt",  dir + "/server.key",  dir + "/client.crt",
          dir + "/client.key", dir + "/expired.crt", dir + "/other-ca.crt"};
  return ok;
}

}  // namespace nonstop::testing
