#include "controller/journal.h"

#include <cerrno>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "common/time.h"

namespace nonstop::controller {

Result<std::unique_ptr<Journal>> Journal::Open(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return ErrnoStatus(StatusCode::kUnavailable, "open journal " + path, errno);
  return std::unique_ptr<Journal>(new Journal(path, f));
}

Journal::~Journal() {
  if (file_ != nullptr) std::fclose(file_);
}

void Journal::Append(nlohmann::json record) {
  record["time_us"] = WallMicros();
  record["mono_us"] = static_cast<int64_t>(MonotonicSeconds() * 1e6);
  std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

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
