#include "worker/copy_seal.h"

#include "common/coding.h"

namespace nonstop::worker {

namespace {

constexpr uint32_t kChunkKind = 1;
constexpr uint32_t kTableKind = 2;

std::string Nonce(uint32_t kind, uint32_t request, uint32_t index) {
  std::string n;
  PutFixed32(&n, kind);
  PutFixed32(&n, request);
  PutFixed32(&n, index);
  return n;
}

std::string_view View(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

}  // namespace

CopySeal::CopySeal(const crypto::Key& key, std::string_view phase, uint64_t generation,
                   int source_rank, int receiver_rank, std::string_view header) {
  std::string context;
  PutFixed64(&context, generation);
  PutFixed32(&context, static_cast<uint32_t>(source_rank));
  PutFixed32(&context, static_cast<uint32_t>(receiver_rank));
  context += header;
  key_ = crypto::DeriveKey(key, std::string("state copy ") + std::string(phase), context);
}

std::string CopySeal::ChunkTag(uint32_t request, uint32_t index, uint32_t crc,
                               std::span<const std::byte> bytes) const {
  std::string word;
  PutFixed32(&word, index);
  PutFixed32(&word, crc);
  return crypto::Gmac(key_, Nonce(kChunkKind, request, index), {word, View(bytes)});
}

bool CopySeal::ChunkVerifies(uint32_t request, uint32_t index, uint32_t crc,
                             std::span<const std::byte> bytes, std::string_view tag) const {
  return crypto::MacEquals(ChunkTag(request, index, crc, bytes), tag);
}

std::string CopySeal::TableTag(std::string_view table) const {
  return crypto::Gmac(key_, Nonce(kTableKind, 0, 0), {table});
}

bool CopySeal::TableVerifies(std::string_view table, std::string_view tag) const {
  return crypto::MacEquals(TableTag(table), tag);
}

}  // namespace nonstop::worker
