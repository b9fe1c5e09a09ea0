#include "controller/journal.h"

#include <cerrno>
#include <ctime>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "common/time.h"

namespace nonstop::controller {

Result<std::unique_ptr<Journal>> Journal::Open(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  std::string rotated;
  if (std::filesystem::exists(p, ec) && std::filesystem::file_size(p, ec) > 0) {
    std::time_t t = std::time(nullptr);
    std::tm tm{};
    ::gmtime_r(&t, &tm);
    char stamp[32];
    std::strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", &tm);
    std::filesystem::path base = p.parent_path() / (p.stem().string() + "-" + stamp);
    std::filesystem::path to = base;
    to += p.extension();
    for (int n = 2; std::filesystem::exists(to, ec); ++n) {
      to = base;
      to += fmt::format("-{}{}", n, p.extension().string());
    }
    std::filesystem::rename(p, to, ec);
    if (ec) {
      return UnavailableError(fmt::format("cannot keep the earlier journal {}: renaming it to {} failed: {}", path,
                                          to.string(), ec.message()));
    }
    rotated = to.string();
  } else {
    std::filesystem::remove(p, ec);  // an empty journal holds nothing to keep
  }
  // "x": never truncate a journal that appeared meanwhile (another job on the same path).
  std::FILE* f = std::fopen(path.c_str(), "wx");
  if (f == nullptr) return ErrnoStatus(StatusCode::kUnavailable, "open journal " + path, errno);
  auto j = std::unique_ptr<Journal>(new Journal(path, f));
  j->rotated_to_ = rotated;
  return j;
}

Journal::~Journal() {
  if (file_ != nullptr) std::fclose(file_);
}

void Journal::Append(nlohmann::json record) {
  record["time_us"] = WallMicros();
  record["mono_us"] = static_cast<int64_t>(MonotonicSeconds() * 1e6);
  std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
}

void Journal::Flush() { std::fflush(file_); }

Result<std::vector<nlohmann::json>> Journal::Read(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFoundError("cannot open journal " + path);
  std::vector<nlohmann::json> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded()) return DataLossError(fmt::format("journal {} line {} is not JSON", path, n));
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace nonstop::controller
