// Fuzz target: the two parsers a durable checkpoint goes through before it
// is loaded (src/state/checkpoint.h): ParseCheckpointManifest (manifest.json)
// and ParseSafetensorsHeader (state.safetensors). Checkpoints come from disk
// and may be truncated, corrupt or from another model.
//
// Input: manifest.json, a NUL byte, then state.safetensors (JSON text holds
// no NUL); without a NUL the whole input is both. Checked: no crash, leak, UB
// or uncaught exception; a refusal is DATA_LOSS or INVALID_ARGUMENT with a
// message; an accepted safetensors header has tensors that tile its data
// section exactly, each inside the file.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "common/check.h"
#include "state/checkpoint.h"

namespace {

void CheckRefusal(const nonstop::Status& s) {
  NONSTOP_CHECK(s.code() == nonstop::StatusCode::kDataLoss ||
                s.code() == nonstop::StatusCode::kInvalidArgument)
      << s.ToString();
  NONSTOP_CHECK(!s.message().empty());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view manifest_text = input.substr(0, nul);
  const std::string_view state = nul == std::string_view::npos ? input : input.substr(nul + 1);

  auto manifest = nonstop::state::ParseCheckpointManifest(manifest_text);
  if (!manifest.ok()) {
    CheckRefusal(manifest.status());
  } else {
    NONSTOP_CHECK_GE(manifest->step, 0);
    NONSTOP_CHECK_GE(manifest->world_size, 0);
  }

  auto header =
      nonstop::state::ParseSafetensorsHeader(std::as_bytes(std::span(state.data(), state.size())));
  if (!header.ok()) {
    CheckRefusal(header.status());
    return 0;
  }
  NONSTOP_CHECK_LE(header->data_offset, state.size());
  uint64_t at = 0;
  for (const auto& t : header->tensors) {
    NONSTOP_CHECK_EQ(t.begin, at) << "tensor " << t.name << " leaves a gap or overlaps";
    NONSTOP_CHECK_LE(t.begin, t.end) << t.name;
    at = t.end;
  }
  NONSTOP_CHECK_EQ(header->data_offset + at, state.size())
      << "the tensors do not fill the data section";
  return 0;
}
