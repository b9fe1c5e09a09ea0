// The flags of etcd's TLS and user (docs/etcd-security.md), shared by the
// commands that talk to etcd (`nonstop controller --etcd`, `nonstop agent
// --etcd`): each with its NONSTOP_* fallback, into one etcd::Security.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

#include "coord/etcd_security.h"
#include "nonstop/settings.h"
#include "nonstop/settings_cli.h"

namespace nonstop::cli {

struct EtcdSecurityFlags {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  std::string auth_file;
  bool allow_plaintext = false;

  void Register(CLI::App* app) {
    AddSetting(app, settings::kEtcdCacert, ca_file);
    AddSetting(app, settings::kEtcdCert, cert_file);
    AddSetting(app, settings::kEtcdKey, key_file);
    AddSetting(app, settings::kEtcdAuthFile, auth_file);
    AddSetting(app, settings::kEtcdAllowPlaintext, allow_plaintext);
  }
  etcd::Security security() const {
    return {ca_file, cert_file, key_file, auth_file, allow_plaintext};
  }
};

}  // namespace nonstop::cli
