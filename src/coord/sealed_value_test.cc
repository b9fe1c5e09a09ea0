// Sealed etcd values (sealed_value.h): what verifies and what is refused.
#include "coord/sealed_value.h"

#include <gtest/gtest.h>

namespace nonstop::coord {
namespace {

const crypto::Key kKey = SealingKey(crypto::JobKey("token"), "job");

TEST(SealedValueTest, ASealedValueUnsealsUnderItsKeyWithItsEpochAndCounter) {
  const std::string text =
      Seal(kKey, "job", "/nonstop/job/journal/1", 7, 3, "{\"event\":\"plan\"}\n");
  EXPECT_EQ(text.rfind("nonstop-sealed 7 3 ", 0), 0u) << text;
  auto v = Unseal(kKey, "job", "/nonstop/job/journal/1", text);
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->epoch, 7);
  EXPECT_EQ(v->counter, 3u);
  EXPECT_EQ(v->value, "{\"event\":\"plan\"}\n") << "the value's own newlines are kept";
}

TEST(SealedValueTest, AValueChangedMovedCopiedFromAnotherJobOrUnsealedIsRefused) {
  const std::string text = Seal(kKey, "job", "/nonstop/job/journal/1", 7, 0, "{\"a\":1}");
  auto refused = [&](const crypto::Key& key, const std::string& job, const std::string& etcd_key,
                     const std::string& t) {
    auto v = Unseal(key, job, etcd_key, t);
    EXPECT_FALSE(v.ok()) << t;
    if (!v.ok()) {
      EXPECT_EQ(v.status().code(), StatusCode::kDataLoss);
      EXPECT_NE(v.status().message().find(etcd_key), std::string::npos) << v.status().message();
    }
  };
  std::string changed = text;
  changed.back() = '2';
  refused(kKey, "job", "/nonstop/job/journal/1", changed);
  refused(kKey, "job", "/nonstop/job/journal/2", text);  // moved
  // another job, even one with the same token
  refused(SealingKey(crypto::JobKey("token"), "other"), "other", "/nonstop/job/journal/1", text);
  refused(SealingKey(crypto::JobKey("other token"), "job"), "job", "/nonstop/job/journal/1", text);
  refused(kKey, "job", "/nonstop/job/journal/1", "{\"a\":1}");  // not sealed
  std::string other_epoch = text;
  other_epoch.replace(15, 1, "8");  // "nonstop-sealed 8 0 …": the MAC covers the epoch
  refused(kKey, "job", "/nonstop/job/journal/1", other_epoch);
  for (const char* bad : {"nonstop-sealed ", "nonstop-sealed 7 0", "nonstop-sealed x 0 00\n{}",
                          "nonstop-sealed -1 0 00\n{}", "nonstop-sealed 7 0 \n{}"}) {
    refused(kKey, "job", "/nonstop/job/journal/1", bad);
  }
}

}  // namespace
}  // namespace nonstop::coord
