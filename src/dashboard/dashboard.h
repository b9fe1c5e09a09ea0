// The job's page: a live dashboard (GET / of the controller's HTTP endpoint)
// and a self-contained report of a job from its journal (`nonstop report`).
// One page and one script serve both (src/dashboard/assets): live, the script
// polls /status and /events; in a report, the journal is inlined and it draws
// once. Everything, the charting library included (dygraphs, from Debian's
// libjs-dygraphs), is embedded at build time: the page loads with no network.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace nonstop::dashboard {

// The live dashboard. It reads the job token from the URL's fragment
// (`/#token=…`, never sent to the server) for GET /events.
std::string LivePage();

// A report of the job whose journal records these are: the same charts and
// tables, the recovery table, goodput, and a summary line per fault. `note`
// (may be empty) is shown under the title, e.g. that the journal's last line
// was cut short.
std::string ReportPage(const std::vector<nlohmann::json>& records, const std::string& title,
                       const std::string& note);

// Several runs of one job side by side (the recovery benchmark: fault-free,
// checkpointless, checkpoint-restart): steps over wall time and loss per run,
// a row per run, and every run's recoveries.
struct Run {
  std::string name;
  std::vector<nlohmann::json> records;
};
std::string ComparePage(const std::vector<Run>& runs, const std::string& title);

}  // namespace nonstop::dashboard
