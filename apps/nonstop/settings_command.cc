// `nonstop settings`: see commands.h. docs/settings.md is prose around a
// generated table; the table sits between kBegin and kEnd, and a CTest runs
// `nonstop settings --check docs/settings.md` so that it cannot go stale.
#include <cstdio>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "apps/nonstop/commands.h"
#include "nonstop/settings.h"

namespace nonstop::cli {

namespace {

constexpr std::string_view kBegin = "<!-- BEGIN nonstop settings: generated, do not edit -->\n";
constexpr std::string_view kEnd = "<!-- END nonstop settings -->\n";

struct Split {
  std::string before, generated, after;
};

// The file's text around and between the markers; false when they are missing.
bool SplitAtMarkers(const std::string& text, Split* out) {
  size_t begin = text.find(kBegin);
  size_t end = begin == std::string::npos ? std::string::npos : text.find(kEnd, begin);
  if (end == std::string::npos) return false;
  out->before = text.substr(0, begin + kBegin.size());
  out->generated = text.substr(begin + kBegin.size(), end - begin - kBegin.size());
  out->after = text.substr(end);
  return true;
}

bool ReadAll(const std::string& path, std::string* text) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *text = ss.str();
  return true;
}

}  // namespace

void SettingsCommand::Register(CLI::App& app) {
  sub_ = app.add_subcommand(
      "settings", "Print every NONSTOP_* variable (flag, type, default, programs) as Markdown");
  auto* check = sub_->add_option(
      "--check", check_,
      "Exit 1 unless this file's generated part (docs/settings.md) is what is printed");
  sub_->add_option("--update", update_, "Rewrite this file's generated part (docs/settings.md)")
      ->excludes(check);
}

int SettingsCommand::Execute() {
  const std::string table = settings::Markdown();
  const std::string path = !check_.empty() ? check_ : update_;
  if (path.empty()) {
    fmt::print("{}", table);
    return 0;
  }
  std::string text;
  Split parts;
  if (!ReadAll(path, &text) || !SplitAtMarkers(text, &parts)) {
    fmt::print(stderr, "nonstop settings: {} is missing, or lacks the lines\n{}…\n{}", path, kBegin,
               kEnd);
    return 1;
  }
  if (!check_.empty()) {
    if (parts.generated == table) return 0;
    fmt::print(stderr,
               "nonstop settings: {} is stale: the settings registry (include/nonstop/settings.h) "
               "changed; "
               "HINT: nonstop settings --update {}\n",
               path, path);
    return 1;
  }
  std::ofstream out(path, std::ios::trunc);
  out << parts.before << table << parts.after;
  if (!out.flush()) {
    fmt::print(stderr, "nonstop settings: cannot write {}\n", path);
    return 1;
  }
  return 0;
}

}  // namespace nonstop::cli
