#include "dashboard/dashboard.h"

#include <string_view>

#include "dashboard/assets.h"

namespace nonstop::dashboard {
namespace {

// Replaces the one `marker` in `page` by `with`.
void Fill(std::string* page, std::string_view marker, std::string_view with) {
  size_t at = page->find(marker);
  if (at != std::string::npos) page->replace(at, marker.size(), with);
}

// JSON inside a <script> element: "</script" would end the element and
// "<!--" change how it is parsed, so no '<' is left as it is. '<' occurs only
// inside JSON strings, where "\u003c" means the same.
std::string ScriptSafe(const nlohmann::json& j) {
  std::string text =
      j.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == '<') {
      out += "\\u003c";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Page(const nlohmann::json& config) {
  std::string page(assets::kPageHtml);
  // The styles and scripts go in last to first, so that no marker is searched inside an asset.
  Fill(&page, "/*NONSTOP_PAGE_JS*/", assets::kPageJs);
  Fill(&page, "/*NONSTOP_CONFIG*/", "window.NONSTOP = " + ScriptSafe(config) + ";");
  Fill(&page, "/*NONSTOP_DYGRAPH_JS*/", assets::kDygraphJs);
  Fill(&page, "/*NONSTOP_PAGE_CSS*/", assets::kPageCss);
  Fill(&page, "/*NONSTOP_DYGRAPH_CSS*/", assets::kDygraphCss);
  return page;
}

}  // namespace

std::string LivePage() { return Page({{"mode", "live"}}); }

std::string ReportPage(const std::vector<nlohmann::json>& records, const std::string& title,
                       const std::string& note) {
  return Page({{"mode", "report"}, {"title", title}, {"note", note}, {"journal", records}});
}

std::string ComparePage(const std::vector<Run>& runs, const std::string& title) {
  nlohmann::json list = nlohmann::json::array();
  for (const Run& r : runs) list.push_back({{"name", r.name}, {"journal", r.records}});
  return Page({{"mode", "compare"}, {"title", title}, {"runs", std::move(list)}});
}

}  // namespace nonstop::dashboard
