// `nonstop report`: the job's page from its journal, as one HTML file that
// opens anywhere with no network (docs/dashboard.md).
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "apps/nonstop/commands.h"
#include "controller/journal.h"
#include "dashboard/dashboard.h"

namespace nonstop::cli {

void ReportCommand::Register(CLI::App& app) {
  sub_ =
      app.add_subcommand("report", "Write a self-contained HTML report of a job from its journal");
  sub_->add_option("journal", journal_, "The job's journal (runs/journal.jsonl)")->required();
  sub_->add_option("--output,-o", output_,
                   "The HTML file to write (default: report.html beside the journal)");
}

int ReportCommand::Execute() {
  bool torn = false;
  auto records = controller::Journal::Read(journal_, &torn);
  if (!records.ok()) {
    fmt::print(stderr, "nonstop report: {}\n", records.status().message());
    return 1;
  }
  if (records->empty()) {
    fmt::print(stderr, "nonstop report: {} holds no record: is it a nonstop journal?\n", journal_);
    return 1;
  }
  std::filesystem::path journal(journal_);
  std::string output = output_.empty() ? (journal.parent_path() / "report.html").string() : output_;
  int recoveries = 0;
  bool ended = false;
  for (const auto& r : *records) {
    recoveries += r.value("event", "") == "recovery_end";
    ended = ended || r.value("event", "") == "job_end";
  }
  std::string note;
  if (torn)
    note = "The journal's last line was cut short (its writer stopped mid-line); it is left out.";
  if (!ended)
    note += std::string(note.empty() ? "" : " ") +
            "The journal has no job_end: the job was still running or its controller died.";
  std::string page = dashboard::ReportPage(*records, journal.string(), note);
  std::string tmp = output + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << page;
    out.flush();
    if (!out) {
      fmt::print(stderr, "nonstop report: cannot write {}: {}\n", tmp, std::strerror(errno));
      return 1;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, output, ec);
  if (ec) {
    fmt::print(stderr, "nonstop report: cannot write {}: {}\n", output, ec.message());
    return 1;
  }
  fmt::print("nonstop report: wrote {} ({} records, {} recoveries and resizes{})\n", output,
             records->size(), recoveries, torn ? "; the last, torn line left out" : "");
  return 0;
}

}  // namespace nonstop::cli
