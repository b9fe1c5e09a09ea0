#include "dashboard/dashboard.h"

#include <gtest/gtest.h>

#include <string>

namespace nonstop::dashboard {
namespace {

TEST(DashboardTest, TheLivePageCarriesItsScriptsAndTheChartLibraryInline) {
  std::string page = LivePage();
  EXPECT_EQ(page.rfind("<!doctype html>", 0), 0u);
  EXPECT_NE(page.find("window.NONSTOP = {\"mode\":\"live\"}"), std::string::npos);
  EXPECT_NE(page.find("Dygraph"), std::string::npos) << "dygraphs is embedded";
  EXPECT_NE(page.find("function Model()"), std::string::npos) << "the page's script is embedded";
  EXPECT_EQ(page.find("/*NONSTOP_"), std::string::npos) << "every marker was filled";
  EXPECT_EQ(page.find("sourceMappingURL"), std::string::npos)
      << "no map is served, none is asked for";
  for (const char* remote : {"src=\"http", "href=\"http", "url(http", "fetch('http", "import "}) {
    EXPECT_EQ(page.find(remote), std::string::npos)
        << "nothing is fetched from elsewhere: " << remote;
  }
}

TEST(DashboardTest, AReportInlinesTheJournalSoThatNoRecordCanCloseTheScript) {
  std::vector<nlohmann::json> records = {
      {{"event", "job_start"}, {"time_us", 1}},
      {{"event", "fault"}, {"detail", "</script><script>alert(1)</script>"}, {"time_us", 2}},
      {{"event", "job_end"},
       {"reason", "/*NONSTOP_DYGRAPH_JS*/ done"},
       {"exit_code", 0},
       {"time_us", 3}},
  };
  std::string page = ReportPage(records, "run 7", "the last line was cut short");
  EXPECT_EQ(page.find("</script><script>alert"), std::string::npos)
      << "a record ended the script element";
  EXPECT_NE(page.find("\\u003c/script>\\u003cscript>alert(1)\\u003c/script>"), std::string::npos);
  EXPECT_NE(page.find("\"mode\":\"report\""), std::string::npos);
  EXPECT_NE(page.find("\"title\":\"run 7\""), std::string::npos);
  EXPECT_NE(page.find("the last line was cut short"), std::string::npos);
  // The chart library went where its marker was, not into the record that names the marker.
  EXPECT_NE(page.find("\"/*NONSTOP_DYGRAPH_JS*/ done\""), std::string::npos);
  EXPECT_LT(page.find("Dygraph"), page.find("window.NONSTOP ="));
  // Exactly the page's scripts: the library, the configuration with the journal, the page's code.
  size_t scripts = 0;
  for (size_t at = page.find("<script>"); at != std::string::npos;
       at = page.find("<script>", at + 1))
    ++scripts;
  EXPECT_EQ(scripts, 3u);
}

TEST(DashboardTest, AComparisonCarriesEveryRunByName) {
  std::vector<::nonstop::dashboard::Run> runs = {
      {"fault-free", {{{"event", "job_start"}, {"time_us", 1}}}},
      {"checkpointless",
       {{{"event", "job_start"}, {"time_us", 5}}, {{"event", "step"}, {"step", 0}}}}};
  std::string page = ComparePage(runs, "what a fault costs");
  EXPECT_NE(page.find("\"mode\":\"compare\""), std::string::npos);
  EXPECT_NE(
      page.find("{\"journal\":[{\"event\":\"job_start\",\"time_us\":1}],\"name\":\"fault-free\"}"),
      std::string::npos);
  EXPECT_NE(page.find("\"name\":\"checkpointless\""), std::string::npos);
  EXPECT_NE(page.find("\"title\":\"what a fault costs\""), std::string::npos);
}

}  // namespace
}  // namespace nonstop::dashboard
