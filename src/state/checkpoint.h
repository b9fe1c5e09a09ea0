// The checkpoint format's parsers (docs/formats.md), shared by the loader
// (checkpoint.cc) and the fuzz targets: pure, bounded and exception-free
// whatever the bytes. The checkpoints themselves (CheckpointWriter,
// LoadNewestCheckpoint, …) are public: include/nonstop/checkpoint.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "nonstop/checkpoint.h"
#include "nonstop/status.h"

namespace nonstop::state {

// Parses manifest.json and checks the type and range of every field the
// loader or the trainer reads (format, version, step, generation, world_size,
// recipe, parameter_checksum, state_file, state_bytes, state_file_crc32c,
// tensors). Pure and exception-free whatever `json_text` holds (a fuzz
// target): DATA_LOSS naming the field, or INVALID_ARGUMENT for a version this
// build does not read.
Result<CheckpointManifest> ParseCheckpointManifest(std::string_view json_text);

// One tensor of a safetensors header; offsets are into the data section.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32", "I64", "U8", …
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};
struct SafetensorsHeader {
  uint64_t data_offset = 0;                // where the data section starts: 8 + the header's length
  std::vector<SafetensorsTensor> tensors;  // sorted by offset; they tile the data section exactly
};

// Parses the header of a whole safetensors file held in memory and checks it
// against the file's size: a known dtype, a shape whose size (dtype bytes ×
// elements, overflow-checked) is its data_offsets' span, offsets inside the
// data section, tensors that neither overlap nor leave gaps. Pure, bounded
// and exception-free whatever `file_bytes` hold (a fuzz target); DATA_LOSS
// naming the tensor and the field.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> file_bytes);

}  // namespace nonstop::state
