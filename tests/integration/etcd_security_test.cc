// etcd over TLS and with users (docs/etcd-security.md), and the leader key
// authenticated with the job key (docs/leader-discovery.md, "A forged leader
// key"): the checks of the files at Create (no etcd needed), plain http to
// another host refused without the opt-in, a real etcd with TLS and
// client-certificate authentication (certificates made here with openssl),
// a real etcd with auth enabled (its users made through the v3 gateway), and
// forged leader values that no reader follows.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/crypto.h"
#include "common/role_keys.h"
#include "common/temp_dir.h"
#include "coord/etcd.h"
#include "coord/leader_watch.h"
#include "coord/leadership.h"
#include "tests/integration/etcd_server.h"
#include "tests/integration/test_certs.h"

namespace nonstop {
namespace {

const crypto::Key kJobKey = crypto::JobKey("journal test token");

using std::chrono::milliseconds;
using testing::TestCerts;

bool Has(const Status& s, const std::string& part) {
  return s.message().find(part) != std::string::npos;
}

etcd::ClientOptions WithSecurity(etcd::Security s) {
  return etcd::ClientOptions(milliseconds(2'000), std::move(s));
}

// ---- no etcd needed: what Create checks ----

TEST(EtcdPlaintextTest, PlainHttpToAnotherHostIsRefusedUnlessAskedForExplicitly) {
  for (const char* other : {"10.0.0.2:2379", "http://10.0.0.2:2379", "[fd00::2]:2379",
                            "etcd.example:2379", "127.0.0.1:2379,10.0.0.3:2379"}) {
    auto c = etcd::Client::Create(other);
    ASSERT_FALSE(c.ok()) << other;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Has(c.status(), "plain http to another host")) << c.status().message();
    EXPECT_TRUE(Has(c.status(), "--etcd-allow-plaintext")) << c.status().message();
    etcd::Security trusted;
    trusted.allow_plaintext = true;
    EXPECT_TRUE(etcd::Client::Create(other, WithSecurity(trusted)).ok()) << other;
  }
  // this host, and TLS to another one, need no opt-in
  for (const char* fine : {"127.0.0.1:2379", "127.0.0.2:2379", "[::1]:2379", "localhost:2379",
                           "https://10.0.0.2:2379"}) {
    auto c = etcd::Client::Create(fine);
    EXPECT_TRUE(c.ok()) << fine << ": " << c.status().ToString();
  }
  EXPECT_TRUE(Has(etcd::Client::Create("http://127.0.0.1:1,https://127.0.0.1:2").status(), "mix"));
}

class EtcdFilesTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(testing::MakeTestCerts(dir_.path(), &certs_)); }
  etcd::Security Good() const {
    return {certs_.ca, certs_.client_cert, certs_.client_key, "", false};
  }
  Status CreateWith(const etcd::Security& s) {
    return etcd::Client::Create("https://127.0.0.1:2379", WithSecurity(s)).status();
  }
  TempDir dir_;
  TestCerts certs_;
};

TEST_F(EtcdFilesTest, AMissingKeyAnExpiredCertificateOrAForeignKeyIsAnErrorNamingTheFile) {
  EXPECT_TRUE(CreateWith(Good()).ok()) << CreateWith(Good()).ToString();
  etcd::Security s = Good();
  s.key_file = dir_ / "nowhere.key";
  Status missing = CreateWith(s);
  EXPECT_TRUE(Has(missing, "--etcd-key " + s.key_file)) << missing.ToString();
  s.key_file.clear();
  EXPECT_TRUE(Has(CreateWith(s), "without --etcd-key")) << CreateWith(s).ToString();
  s = Good();
  s.cert_file = certs_.expired_cert;
  Status expired = CreateWith(s);
  EXPECT_TRUE(Has(expired, "--etcd-cert " + certs_.expired_cert)) << expired.ToString();
  EXPECT_TRUE(Has(expired, "expired")) << expired.ToString();
  s = Good();
  s.key_file = dir_ / "server.key";  // another certificate's key
  Status foreign = CreateWith(s);
  EXPECT_TRUE(Has(foreign, "is not the private key of --etcd-cert")) << foreign.ToString();
  s = Good();
  s.ca_file = dir_ / "server.csr";  // PEM, but no certificate
  EXPECT_TRUE(Has(CreateWith(s), "--etcd-cacert " + s.ca_file)) << CreateWith(s).ToString();
  EXPECT_TRUE(Has(CreateWith(s), "not a PEM certificate")) << CreateWith(s).ToString();
}

TEST_F(EtcdFilesTest, TheAuthFileIsOneLineUserColonPasswordReadableByItsOwnerAlone) {
  const std::string path = dir_ / "etcd-auth";
  std::ofstream(path) << "  nonstop:s3cret:with:colons \n";
  ::chmod(path.c_str(), 0640);
  auto open = etcd::ReadAuthFile(path);
  ASSERT_FALSE(open.ok());
  EXPECT_TRUE(Has(open.status(), "chmod 600 " + path)) << open.status().ToString();
  ::chmod(path.c_str(), 0600);
  auto creds = etcd::ReadAuthFile(path);
  ASSERT_TRUE(creds.ok()) << creds.status().ToString();
  EXPECT_EQ(creds->user, "nonstop");
  EXPECT_EQ(creds->password, "s3cret:with:colons");
  std::ofstream(path) << "no-colon\n";
  EXPECT_TRUE(Has(etcd::ReadAuthFile(path).status(), "not one line user:password"));
}

// ---- the leader key's signature ----

TEST(LeaderKeySignatureTest, OnlyAValueSignedByTheControllersForThisJobAndThisEpochVerifies) {
  const crypto::Key key = crypto::JobKey("the token");
  const std::string pub = ControllerPublicKey(key);
  const std::string genuine =
      coord::SignLeaderValue(key, "j", {{"controller", "127.0.0.1:7"}, {"epoch", 12}});
  EXPECT_TRUE(coord::VerifyLeaderValue(pub, "j", genuine, 12).ok());
  // another token, another job, a later key (the value replayed), a changed address, no signature
  EXPECT_TRUE(
      Has(coord::VerifyLeaderValue(ControllerPublicKey(crypto::JobKey("other")), "j", genuine, 12),
          "does not verify"));
  EXPECT_TRUE(Has(coord::VerifyLeaderValue(pub, "k", genuine, 12), "does not verify"));
  EXPECT_TRUE(Has(coord::VerifyLeaderValue(pub, "j", genuine, 13), "replay"));
  auto changed = nlohmann::json::parse(genuine);
  changed["controller"] = "127.0.0.1:8";
  EXPECT_TRUE(Has(coord::VerifyLeaderValue(pub, "j", changed.dump(), 12), "does not verify"));
  EXPECT_TRUE(Has(coord::VerifyLeaderValue(pub, "j", R"({"controller":"127.0.0.1:8"})", 12),
                  "no signature"));
  // A worker signs with every key it holds (role_keys.h), as if each were the controllers': none
  // verifies. What a worker verifies with cannot sign.
  const WorkerKeys worker = WorkerKeysOf(key, 5);
  for (const crypto::Key& held : {worker.control, worker.data}) {
    const std::string forged =
        coord::SignLeaderValue(held, "j", {{"controller", "127.0.0.1:9"}, {"epoch", 12}});
    EXPECT_TRUE(Has(coord::VerifyLeaderValue(worker.controller_public, "j", forged, 12),
                    "does not verify"));
  }
  // the readers: followed with the key, refused without a valid signature (NotFound: keep waiting)
  coord::LeaderKeys keys{"j", 20, genuine, 12, std::nullopt};
  EXPECT_EQ(*coord::InterpretLeaderKeys(keys, nullptr, &pub), "127.0.0.1:7");
  keys.leader = changed.dump();
  auto refused = coord::InterpretLeaderKeys(keys, nullptr, &pub);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Has(refused.status(), "not followed")) << refused.status().ToString();
}

// The end key (the job_end record): believed only with its own signature. Written without the job
// token, or a genuine leader value copied there, it ends nobody's search.
TEST(LeaderKeySignatureTest, AnEndKeyIsBelievedOnlyWithItsSignature) {
  const crypto::Key key = crypto::JobKey("the token");
  const std::string pub = ControllerPublicKey(key);
  const std::string record = R"({"event":"job_end","exit_code":3,"reason":"done"})";
  coord::LeaderKeys keys{"j", 20, std::nullopt, 0, coord::SignEndValue(key, "j", record)};
  int code = -1;
  auto ended = coord::InterpretLeaderKeys(keys, &code, &pub);
  ASSERT_FALSE(ended.ok());
  EXPECT_EQ(ended.status().code(), StatusCode::kAborted) << ended.status().ToString();
  EXPECT_EQ(code, 3);
  for (const std::string& forged :
       {record, coord::SignEndValue(crypto::JobKey("other"), "j", record),
        coord::SignEndValue(key, "k", record),
        coord::SignEndValue(WorkerKeysOf(key, 5).data, "j", record),
        coord::SignLeaderValue(key, "j", nlohmann::json::parse(record))}) {
    keys.end = forged;
    code = -1;
    auto r = coord::InterpretLeaderKeys(keys, &code, &pub);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << forged;
    EXPECT_TRUE(Has(r.status(), "not believed")) << r.status().ToString();
    EXPECT_EQ(code, -1) << "an exit code taken from a forged end key";
  }
}

// ---- a real etcd over TLS with client certificates ----

class EtcdTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(testing::MakeTestCerts(dir_.path(), &certs_)) << "openssl failed";
    etcd_ = std::make_unique<testing::RestartableEtcd>(
        dir_.path(), std::vector<std::string>{},
        testing::EtcdTlsFiles{certs_.ca, certs_.server_cert, certs_.server_key, certs_.client_cert,
                              certs_.client_key});
    ASSERT_TRUE(etcd_->Start()) << etcd_->Output();
  }
  etcd::Security Good() const {
    return {certs_.ca, certs_.client_cert, certs_.client_key, "", false};
  }
  TempDir dir_;
  TestCerts certs_;
  std::unique_ptr<testing::RestartableEtcd> etcd_;
};

TEST_F(EtcdTlsTest, AClientWithTheRightFilesReadsWritesAndWatchesTheLeaderKey) {
  auto c = etcd::Client::Create(etcd_->endpoint(), WithSecurity(Good()));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto put = (*c)->Put(coord::LeaderKey("t"), R"({"pid":1})");
  ASSERT_TRUE(put.ok()) << put.status().ToString();
  const crypto::Key key = crypto::JobKey("tok");
  const std::string pub = ControllerPublicKey(key);
  ASSERT_TRUE(
      (*c)->Put(coord::LeaderKey("t"),
                coord::SignLeaderValue(key, "t", {{"controller", "127.0.0.1:5"}, {"epoch", *put}}))
          .ok());
  EXPECT_EQ(*coord::LookUpLeader(**c, "t", nullptr, &pub), "127.0.0.1:5");
  // the watch's stream over TLS too, and its leader file verified by its reader
  const std::string path = dir_ / "leader.json";
  auto watch = coord::LeaderWatch::Start(etcd_->endpoint(), "t", path, {}, Good(), pub);
  ASSERT_TRUE(watch.ok()) << watch.status().ToString();
  coord::LeaderFileReader reader(path, "t", pub);
  Result<std::string> seen = NotFoundError("");
  for (int i = 0; i < 250 && !seen.ok(); ++i) {
    seen = reader.Read();
    if (!seen.ok()) std::this_thread::sleep_for(milliseconds(20));
  }
  ASSERT_TRUE(seen.ok()) << seen.status().ToString();
  EXPECT_EQ(*seen, "127.0.0.1:5");
  // A forged value (no signature of the controllers) in the key: neither reader follows it.
  ASSERT_TRUE(
      (*c)->Put(
              coord::LeaderKey("t"),
              R"({"controller":"127.0.0.1:6","epoch":1,"sig":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=="})")
          .ok());
  auto looked_up = coord::LookUpLeader(**c, "t", nullptr, &pub);
  EXPECT_TRUE(!looked_up.ok() && Has(looked_up.status(), "not followed"))
      << looked_up.status().ToString();
  for (int i = 0; i < 250 && seen.ok(); ++i) {
    seen = reader.Read();
    if (seen.ok()) std::this_thread::sleep_for(milliseconds(20));
  }
  ASSERT_FALSE(seen.ok()) << "the leader file's reader followed a forged value: " << *seen;
  EXPECT_EQ(seen.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Has(seen.status(), "does not verify")) << seen.status().ToString();
}

TEST_F(EtcdTlsTest, AWrongCaOrNoClientCertificateIsAnErrorThatSaysWhichFileToFix) {
  etcd::Security wrong_ca = Good();
  wrong_ca.ca_file = certs_.other_ca;
  auto c = etcd::Client::Create(etcd_->endpoint(), WithSecurity(wrong_ca));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto r = (*c)->Range("k");
  ASSERT_FALSE(r.ok());
  // final: retrying cannot make the certificate verify
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), "--etcd-cacert " + certs_.other_ca)) << r.status().ToString();
  etcd::Security no_cert = Good();
  no_cert.cert_file.clear();
  no_cert.key_file.clear();
  auto anonymous = etcd::Client::Create(etcd_->endpoint(), WithSecurity(no_cert));
  ASSERT_TRUE(anonymous.ok());
  r = (*anonymous)->Range("k");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(Has(r.status(), "--etcd-cert")) << r.status().ToString();
}

// ---- a real etcd with users (auth enabled through the v3 gateway) ----

class EtcdAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    etcd_ = std::make_unique<testing::RestartableEtcd>(dir_.path());
    ASSERT_TRUE(etcd_->Start()) << etcd_->Output();
    auto admin = etcd::Client::Create(etcd_->endpoint());
    ASSERT_TRUE(admin.ok());
    // root (auth needs it), and a user without any role
    for (const auto& [path, body] : std::vector<std::pair<std::string, nlohmann::json>>{
             {"auth/user/add", {{"name", "root"}, {"password", "rootpw"}}},
             {"auth/user/grant", {{"user", "root"}, {"role", "root"}}},
             {"auth/user/add", {{"name", "nobody"}, {"password", "nopw"}}},
             {"auth/enable", nlohmann::json::object()}}) {
      auto r = (*admin)->Call(path, body.dump());
      ASSERT_TRUE(r.ok()) << path << ": " << r.status().ToString();
    }
  }
  std::string AuthFile(const std::string& name, const std::string& line) {
    std::string path = dir_ / name;
    std::ofstream(path) << line << "\n";
    ::chmod(path.c_str(), 0600);
    return path;
  }
  etcd::ClientOptions As(const std::string& auth_file) {
    etcd::Security s;
    s.auth_file = auth_file;
    return etcd::ClientOptions(milliseconds(2'000), s);
  }
  TempDir dir_;
  std::unique_ptr<testing::RestartableEtcd> etcd_;
};

TEST_F(EtcdAuthTest, TheUserOfTheAuthFileLeadsAndAuthenticatesAgainAfterEtcdForgotItsToken) {
  coord::LeadershipOptions o;
  o.endpoints = etcd_->endpoint();
  o.security.auth_file = AuthFile("root.auth", "root:rootpw");
  o.job = "auth";
  o.ttl_seconds = 2;
  auto l = coord::Leadership::Connect(o);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  auto epoch = (*l)->Campaign([] { return false; }, [](const std::string&) {});
  ASSERT_TRUE(epoch.ok()) << epoch.status().ToString();
  ASSERT_TRUE((*l)->ReadJournal(kJobKey).ok());
  const crypto::Key key = crypto::JobKey("tok");
  ASSERT_TRUE((*l)->Publish({{"controller", "127.0.0.1:9"}}, key).ok());
  const std::string pub = ControllerPublicKey(key);
  auto reader = etcd::Client::Create(etcd_->endpoint(), As(o.security.auth_file));
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(*coord::LookUpLeader(**reader, "auth", nullptr, &pub), "127.0.0.1:9");
  l->reset();
  // etcd's simple tokens live in its memory: after a restart the old token is refused, and the
  // client authenticates once more on its own.
  etcd_->Kill();
  ASSERT_TRUE(etcd_->Start()) << etcd_->Output();
  auto again = (*reader)->Range(coord::LeaderKey("auth"));
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

TEST_F(EtcdAuthTest, AWrongPasswordOrAUserWithoutARoleIsFinalAndNamesTheFix) {
  const std::string wrong = AuthFile("wrong.auth", "root:not-the-password");
  auto c = etcd::Client::Create(etcd_->endpoint(), As(wrong));
  ASSERT_TRUE(c.ok());
  auto r = (*c)->Range(coord::LeaderKey("auth"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_FALSE(etcd::IsTransient(r.status()));
  EXPECT_TRUE(Has(r.status(), "--etcd-auth-file " + wrong)) << r.status().ToString();
  auto nobody = etcd::Client::Create(etcd_->endpoint(), As(AuthFile("nobody.auth", "nobody:nopw")));
  ASSERT_TRUE(nobody.ok());
  r = (*nobody)->Range(coord::LeaderKey("auth"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
  EXPECT_TRUE(Has(r.status(), "permission denied")) << r.status().ToString();
}

}  // namespace
}  // namespace nonstop
