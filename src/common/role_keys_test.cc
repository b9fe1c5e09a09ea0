#include "common/role_keys.h"

#include <gtest/gtest.h>

namespace nonstop {
namespace {

TEST(RoleKeysTest, EachWorkerHoldsItsOwnControlKeyAndTheSharedDataKey) {
  const crypto::Key k = crypto::JobKey("token");
  const WorkerKeys a = WorkerKeysOf(k, 3), b = WorkerKeysOf(k, 4);
  EXPECT_NE(a.control, b.control);
  EXPECT_EQ(a.data, b.data);
  EXPECT_EQ(a.controller_public, b.controller_public);
  // None of a worker's keys is the job key, nor another role's.
  for (const crypto::Key& held : {a.control, a.data}) {
    EXPECT_NE(held, k);
    EXPECT_NE(held, ControllerSigningSeed(k));
  }
  EXPECT_NE(WorkerKeysOf(crypto::JobKey("other"), 3).control, a.control);
}

TEST(RoleKeysTest, ACredentialCarriesTheKeysOfItsWorkerOnly) {
  const crypto::Key k = crypto::JobKey("token");
  const WorkerKeys keys = WorkerKeysOf(k, 7);
  const std::string credential = EncodeWorkerCredential(keys);
  EXPECT_TRUE(IsWorkerCredential(credential));
  EXPECT_EQ(credential.find("token"), std::string::npos);
  auto back = WorkerKeysFrom(credential, 7);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->control, keys.control);
  EXPECT_EQ(back->data, keys.data);
  EXPECT_EQ(back->controller_public, keys.controller_public);

  auto other = WorkerKeysFrom(credential, 8);
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(other.status().message().find("worker 7's, but it is worker 8"), std::string::npos)
      << other.status().message();

  std::string garbled = credential;
  garbled[credential.find(' ', 30) + 3] = '!';
  EXPECT_EQ(WorkerKeysFrom(garbled, 7).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(WorkerKeysFrom("nonstop-worker-credential 2 7 a b c", 7).status().code(),
            StatusCode::kInvalidArgument);

  // A job token (a worker started by hand): the same keys as its launcher would have given.
  auto from_token = WorkerKeysFrom("token", 7);
  ASSERT_TRUE(from_token.ok());
  EXPECT_EQ(from_token->control, keys.control);
}

}  // namespace
}  // namespace nonstop
