#include "coord/sealed_value.h"

#include <charconv>

#include <fmt/format.h>

namespace nonstop::coord {

namespace {

constexpr std::string_view kMagic = "nonstop-sealed ";

std::string MacOf(const crypto::Key& key, std::string_view job, std::string_view etcd_key,
                  int64_t epoch, uint64_t counter, std::string_view value) {
  const std::string e = std::to_string(epoch), c = std::to_string(counter);
  return crypto::Hex(crypto::Mac(key, "etcd value", {job, etcd_key, e, c, value}));
}

template <typename T>
bool ParseNumber(std::string_view text, T* out) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size() && !text.empty();
}

}  // namespace

crypto::Key SealingKey(const crypto::Key& job_key, std::string_view job) {
  return crypto::DeriveKey(job_key, "etcd values", job);
}

std::string Seal(const crypto::Key& sealing_key, std::string_view job, std::string_view etcd_key,
                 int64_t epoch, uint64_t counter, std::string_view value) {
  return fmt::format("{}{} {} {}\n{}", kMagic, epoch, counter,
                     MacOf(sealing_key, job, etcd_key, epoch, counter, value), value);
}

Result<SealedValue> Unseal(const crypto::Key& sealing_key, std::string_view job,
                           std::string_view etcd_key, std::string_view text) {
  auto refuse = [&](std::string_view why) {
    return DataLossError(fmt::format("etcd key {}: {}", etcd_key, why));
  };
  if (text.substr(0, kMagic.size()) != kMagic)
    return refuse("not sealed with the job key (written by something else than this job's leader)");
  const size_t nl = text.find('\n');
  if (nl == std::string_view::npos) return refuse("a sealed value's header without its end");
  std::string_view header = text.substr(kMagic.size(), nl - kMagic.size());
  SealedValue v;
  const size_t a = header.find(' ');
  const size_t b = a == std::string_view::npos ? a : header.find(' ', a + 1);
  if (b == std::string_view::npos || !ParseNumber(header.substr(0, a), &v.epoch) ||
      !ParseNumber(header.substr(a + 1, b - a - 1), &v.counter) || v.epoch < 0) {
    return refuse("a sealed value's header that does not parse");
  }
  v.value = std::string(text.substr(nl + 1));
  const std::string mac = MacOf(sealing_key, job, etcd_key, v.epoch, v.counter, v.value);
  if (!crypto::MacEquals(header.substr(b + 1), mac)) {
    return refuse(
        "its MAC does not verify with the job key (a forgery, a value moved from another key or "
        "copied from another job)");
  }
  return v;
}

}  // namespace nonstop::coord
