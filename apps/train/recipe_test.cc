#include "apps/train/recipe.h"

#include <gtest/gtest.h>

namespace nonstop::train {
namespace {

TEST(RecipeTest, ShippedRecipesParse) {
  for (const char* name : {"llama-tiny", "gpt-oss-tiny"}) {
    auto r = LoadRecipe(std::string(NONSTOP_SOURCE_DIR) + "/recipes/" + name + ".yaml");
    ASSERT_TRUE(r.ok()) << name << ": " << r.status().ToString();
    EXPECT_EQ(r->name, name);
  }
  auto def = ParseRecipe(DefaultRecipeText(), "built-in");
  ASSERT_TRUE(def.ok()) << def.status().ToString();
  EXPECT_EQ(def->name, "llama-tiny");
}

TEST(RecipeTest, UnknownKeyIsNamedWithItsPath) {
  auto r = ParseRecipe("model:\n  dimm: 64\n", "x.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("model.dimm: unknown key"), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("x.yaml"), std::string::npos);
  auto top = ParseRecipe("trian:\n  steps: 3\n", "x.yaml");
  ASSERT_FALSE(top.ok());
  EXPECT_NE(top.status().message().find("trian: unknown key"), std::string::npos)
      << top.status().ToString();
}

TEST(RecipeTest, IllTypedValueIsNamed) {
  auto r = ParseRecipe("train:\n  steps: many\n", "x.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("train.steps: expected an integer, got 'many'"),
            std::string::npos)
      << r.status().ToString();
  auto m = ParseRecipe("model:\n  dim: [1, 2]\n", "x.yaml");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("model.dim"), std::string::npos) << m.status().ToString();
}

TEST(RecipeTest, InconsistentShapesAreRejected) {
  auto r = ParseRecipe("model:\n  n_heads: 5\n", "x.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model.n_heads: must divide model.dim"), std::string::npos)
      << r.status().ToString();
  auto b = ParseRecipe("train:\n  global_batch: 30\n  micro_batch: 4\n", "x.yaml");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("multiple"), std::string::npos);
  auto moe = ParseRecipe("model:\n  arch: gpt-oss\n  n_experts: 4\n  top_k: 5\n", "x.yaml");
  ASSERT_FALSE(moe.ok());
  EXPECT_NE(moe.status().message().find("model.top_k"), std::string::npos);
}

TEST(RecipeTest, DeterminismIsFastOrWorldInvariantWithAFixedBatch) {
  auto fast = ParseRecipe("name: x\n", "x.yaml");
  ASSERT_TRUE(fast.ok()) << fast.status().ToString();
  EXPECT_EQ(fast->train.determinism, "fast") << "the default stays the ring";
  auto inv = ParseRecipe("train:\n  determinism: world-invariant\n", "x.yaml");
  ASSERT_TRUE(inv.ok()) << inv.status().ToString();
  EXPECT_EQ(inv->train.determinism, "world-invariant");
  auto typo = ParseRecipe("train:\n  determinism: invariant\n", "x.yaml");
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find(
                "train.determinism: must be 'fast' or 'world-invariant', got 'invariant'"),
            std::string::npos)
      << typo.status().ToString();
  auto scaled =
      ParseRecipe("train:\n  determinism: world-invariant\n  batch: scale-with-world\n", "x.yaml");
  ASSERT_FALSE(scaled.ok());
  EXPECT_NE(scaled.status().message().find("needs train.batch 'fixed'"), std::string::npos)
      << scaled.status().ToString();
}

TEST(RecipeTest, MalformedYamlIsAnError) {
  auto r = ParseRecipe("model: [unclosed\n", "x.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("not valid YAML"), std::string::npos);
}

// Found by fuzz_recipe ("{{}}"): a key that is a mapping or a sequence made
// yaml-cpp throw from as<std::string>(), an uncaught exception.
TEST(RecipeTest, KeyThatIsNotANameIsAnErrorNotACrash) {
  for (const char* text :
       {"{{}}", "? [a, b]\n: 1\n", "model:\n  ? {dim: 1}\n  : 2\n", "train: {[steps]: 3}\n"}) {
    Result<Recipe> r = InvalidArgumentError("unset");
    EXPECT_NO_THROW(r = ParseRecipe(text, "x.yaml")) << text;
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    EXPECT_NE(r.status().message().find("key"), std::string::npos) << r.status().ToString();
  }
}

}  // namespace
}  // namespace nonstop::train
