// Fuzz target: the training recipe parser (apps/train/recipe.h), strict YAML
// through yaml-cpp. Built without LibTorch.
//
// Checked: no crash, leak, UB or uncaught exception (yaml-cpp throws); a
// refusal is INVALID_ARGUMENT with a message; an accepted recipe satisfies
// the invariants the trainer relies on.
#include <cstddef>
#include <cstdint>
#include <string>

#include "apps/train/recipe.h"
#include "common/check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto recipe = nonstop::train::ParseRecipe(std::string(reinterpret_cast<const char*>(data), size),
                                            "fuzz.yaml");
  if (!recipe.ok()) {
    NONSTOP_CHECK(recipe.status().code() == nonstop::StatusCode::kInvalidArgument)
        << recipe.status().ToString();
    NONSTOP_CHECK(!recipe.status().message().empty());
    return 0;
  }
  const auto& m = recipe->model;
  const auto& t = recipe->train;
  NONSTOP_CHECK(m.dim > 0 && m.n_heads > 0 && m.n_kv_heads > 0 && m.seq_len > 0 &&
                m.vocab_size > 0);
  NONSTOP_CHECK_EQ(m.dim % m.n_heads, 0);
  NONSTOP_CHECK_EQ(m.n_heads % m.n_kv_heads, 0);
  NONSTOP_CHECK(t.micro_batch > 0 && t.global_batch % t.micro_batch == 0);
  NONSTOP_CHECK(recipe->checkpoint.keep >= 1);
  return 0;
}
