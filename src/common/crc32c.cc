#include "nonstop/crc32c.h"

#include <algorithm>
#include <climits>

#include <isa-l/crc.h>

namespace nonstop {

// ISA-L's crc32_iscsi is CRC-32C on the raw register: it takes the register
// (the complement of the CRC so far) and returns it, uncomplemented. It picks
// the fastest code the CPU runs at load time (carry-less multiply folding
// where there is PCLMULQDQ/VPCLMULQDQ, the crc32 instruction, a table).
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  // crc32_iscsi takes an int length and a non-const pointer it only reads.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  uint32_t reg = ~crc;
  constexpr size_t kMaxPiece = size_t{1} << 30;
  while (size > 0) {
    const size_t piece = std::min(size, kMaxPiece);
    reg = crc32_iscsi(p, static_cast<int>(piece), reg);
    p += piece;
    size -= piece;
  }
  return ~reg;
}

}  // namespace nonstop
