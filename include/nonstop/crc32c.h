// CRC-32C (Castagnoli), the checksum on every state chunk, shard header and
// control frame. Computed by ISA-L (libisal), which folds with carry-less
// multiplies where the CPU has them: about twice what three interleaved crc32
// instruction chains reach (docs/recovery.md, "State copy at the link's speed").
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace nonstop {

// Extends `crc` (the value returned for the preceding bytes; 0 to start) over `data`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }
inline uint32_t Crc32c(std::string_view data) { return Crc32c(data.data(), data.size()); }

}  // namespace nonstop
