#include "controller/job_metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace nonstop::controller {
namespace {

// A strict reader of the Prometheus text exposition format (0.0.4): every
// sample belongs to a family declared by # TYPE before it, names and labels
// are well formed, values parse, counters end in _total, a histogram has
// cumulative buckets ending in le="+Inf" equal to its _count, and a _sum.
struct Exposition {
  std::map<std::string, std::string> types;  // family → counter, gauge, histogram
  std::map<std::string, std::string> help;   // family → help text
  std::map<std::string, double> samples;     // "name{labels}" → value
  // "family{other labels}" → (le, count)
  std::map<std::string, std::vector<std::pair<std::string, double>>> buckets;
  std::vector<std::string> errors;

  static Exposition Parse(const std::string& text) {
    Exposition e;
    std::istringstream in(text);
    std::string line;
    const std::regex name_re("[a-zA-Z_:][a-zA-Z0-9_:]*");
    const std::regex sample_re(R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+))");
    const std::regex label_re(R"re(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)")re");
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      std::smatch m;
      if (line.rfind("# HELP ", 0) == 0) {
        std::string rest = line.substr(7);
        e.help[rest.substr(0, rest.find(' '))] = rest.substr(rest.find(' ') + 1);
        continue;
      }
      if (line.rfind("# TYPE ", 0) == 0) {
        std::istringstream t(line.substr(7));
        std::string name, type;
        t >> name >> type;
        if (!std::regex_match(name, name_re)) e.errors.push_back("bad family name: " + line);
        if (type != "counter" && type != "gauge" && type != "histogram")
          e.errors.push_back("bad type: " + line);
        e.types[name] = type;
        continue;
      }
      if (line[0] == '#') continue;
      if (!std::regex_match(line, m, sample_re)) {
        e.errors.push_back("not a sample: " + line);
        continue;
      }
      std::string name = m[1], labels = m[3], value_text = m[4];
      char* end = nullptr;
      double value = std::strtod(value_text.c_str(), &end);
      if (value_text != "+Inf" && (end == nullptr || *end != '\0'))
        e.errors.push_back("bad value: " + line);
      std::string family = name;
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        std::string s = suffix;
        if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0 &&
            e.types.count(name.substr(0, name.size() - s.size())) &&
            e.types[name.substr(0, name.size() - s.size())] == "histogram") {
          family = name.substr(0, name.size() - s.size());
        }
      }
      if (!e.types.count(family)) e.errors.push_back("sample of an undeclared family: " + line);
      std::string le, other;
      for (auto it = std::sregex_iterator(labels.begin(), labels.end(), label_re);
           it != std::sregex_iterator(); ++it) {
        if ((*it)[1] == "le") {
          le = (*it)[2];
        } else {
          other += (other.empty() ? "" : ",") + (*it)[1].str() + "=" + (*it)[2].str();
        }
      }
      e.samples[name + (labels.empty() ? "" : "{" + labels + "}")] = value;
      if (name == family + "_bucket") e.buckets[family + "{" + other + "}"].push_back({le, value});
    }
    for (const auto& [family, type] : e.types) {
      if (type == "counter" &&
          (family.size() < 6 || family.compare(family.size() - 6, 6, "_total") != 0)) {
        e.errors.push_back("counter without _total: " + family);
      }
      if (!e.help.count(family) || e.help[family].empty()) e.errors.push_back("no help: " + family);
    }
    for (const auto& [series, bs] : e.buckets) {
      double last = 0;
      for (const auto& [le, count] : bs) {
        if (count < last) e.errors.push_back("buckets not cumulative: " + series);
        last = count;
      }
      if (bs.empty() || bs.back().first != "+Inf") e.errors.push_back("no +Inf bucket: " + series);
      std::string family = series.substr(0, series.find('{'));
      std::string other = series.substr(series.find('{') + 1, series.size() - series.find('{') - 2);
      std::string count_key = family + "_count";
      if (!other.empty()) {
        // The _count sample carries the same labels, quoted.
        std::string quoted;
        std::istringstream parts(other);
        std::string kv;
        while (std::getline(parts, kv, ',')) {
          quoted += (quoted.empty() ? "" : ",") + kv.substr(0, kv.find('=')) + "=\"" +
                    kv.substr(kv.find('=') + 1) + "\"";
        }
        count_key += "{" + quoted + "}";
      }
      if (!e.samples.count(count_key)) {
        e.errors.push_back("no _count for " + series + " (" + count_key + ")");
      } else if (e.samples[count_key] != last) {
        e.errors.push_back("+Inf bucket differs from _count: " + series);
      }
    }
    return e;
  }
};

nlohmann::json Step(int64_t step, double seconds, double tps) {
  return {{"event", "step"},
          {"step", step},
          {"loss", 2.5},
          {"step_seconds", seconds},
          {"tokens_per_second", tps}};
}

TEST(JobMetricsTest, JournalRecordsBecomeConventionalMetricsInTheExpositionFormat) {
  JobMetrics m;
  m.Observe(Step(0, 0.2, 1000));
  m.Observe(Step(1, 0.3, 1000));
  m.Observe(Step(2, 4.0, 500));
  m.Observe({{"event", "fault"}, {"kind", "process exit"}, {"worker_id", 2}});
  m.Observe({{"event", "fault"}, {"kind", "control connection lost"}, {"worker_id", 3}});
  m.Observe({{"event", "fault"}, {"kind", "process exit"}, {"worker_id", 5}});
  m.Observe({{"event", "scale_refused"}, {"reason", "too soon"}});
  m.Observe({{"event", "recovery_end"},
             {"recovery",
              {{"kind", "recovery"},
               {"outcome", "completed"},
               {"old_world", 4},
               {"new_world", 4},
               {"replacements", {"rank 2: worker 2 → spare worker 4"}},
               {"lost_steps", 0},
               {"bytes_copied", 9647664},
               {"transfer_ms", 14.0},
               {"downtime_ms", 115.0},
               {"ms_after_fault",
                {{"detected", 10.7},
                 {"aborted", 11.4},
                 {"plan_published", 11.4},
                 {"state_ready", 29.8},
                 {"first_step_completed", 1218.3}}}}}});
  m.Observe({{"event", "recovery_end"},
             {"recovery",
              {{"kind", "recovery"},
               {"outcome", "superseded by recovery 3"},
               {"old_world", 4},
               {"new_world", 3},
               {"lost_steps", 1},
               {"ms_after_fault", {{"detected", 5.0}}}}}});
  // A completed resize: counted, its pause timed, but not a fault's phases.
  m.Observe({{"event", "recovery_end"},
             {"recovery",
              {{"kind", "resize"},
               {"outcome", "completed"},
               {"old_world", 3},
               {"new_world", 4},
               {"pause_ms", 250.0},
               {"ms_after_fault", {{"detected", 0.0}, {"aborted", 200.0}}}}}});
  m.Observe({{"event", "join"}, {"worker_id", 1}});  // not a metric: ignored
  m.Observe("garbage");                              // not even an object: ignored
  m.SetStatus({{"generation", 3},
               {"world_size", 4},
               {"target_world_size", 4},
               {"spares", 1},
               {"highest_step", 2},
               {"hosts", nlohmann::json::array({{{"host_id", "h1"}}, {{"host_id", "h2"}}})}});

  const std::string text = m.Text();
  Exposition e = Exposition::Parse(text);
  EXPECT_TRUE(e.errors.empty()) << ::testing::PrintToString(e.errors) << "\n" << text;

  EXPECT_EQ(e.types["nonstop_step_duration_seconds"], "histogram");
  EXPECT_EQ(e.samples["nonstop_step_duration_seconds_count"], 3);
  EXPECT_NEAR(e.samples["nonstop_step_duration_seconds_sum"], 4.5, 1e-9);
  EXPECT_EQ(e.samples["nonstop_step_duration_seconds_bucket{le=\"0.25\"}"], 1);
  EXPECT_EQ(e.samples["nonstop_step_duration_seconds_bucket{le=\"5\"}"], 3);
  EXPECT_EQ(e.samples["nonstop_steps_completed_total"], 3);
  EXPECT_NEAR(e.samples["nonstop_tokens_total"], 200 + 300 + 2000, 1e-6);
  EXPECT_EQ(e.samples["nonstop_faults_total{kind=\"process_exit\"}"], 2);
  EXPECT_EQ(e.samples["nonstop_faults_total{kind=\"control_connection_lost\"}"], 1);
  EXPECT_EQ(
      e.samples
          ["nonstop_recoveries_total{handled=\"spare\",kind=\"recovery\",outcome=\"completed\"}"],
      1)
      << text;
  EXPECT_EQ(
      e.samples
          ["nonstop_recoveries_total{handled=\"shrink\",kind=\"recovery\",outcome=\"superseded\"}"],
      1)
      << text;
  EXPECT_EQ(e.samples["nonstop_lost_steps_total"], 1);
  EXPECT_EQ(e.samples["nonstop_state_transfer_bytes_total"], 9647664);
  EXPECT_NEAR(e.samples["nonstop_state_transfer_seconds_total"], 0.014, 1e-9);
  EXPECT_EQ(e.samples["nonstop_scale_requests_refused_total"], 1);
  // Phases of completed recoveries only: the superseded one's "detected" is not counted.
  EXPECT_EQ(e.samples["nonstop_recovery_phase_seconds_count{phase=\"detected\"}"], 1);
  EXPECT_NEAR(e.samples["nonstop_recovery_phase_seconds_sum{phase=\"first_step_completed\"}"],
              1.2183, 1e-9);
  EXPECT_EQ(e.samples["nonstop_recovery_phase_seconds_bucket{phase=\"state_ready\",le=\"0.05\"}"],
            1);
  EXPECT_EQ(e.samples["nonstop_recovery_phase_seconds_bucket{phase=\"state_ready\",le=\"0.025\"}"],
            0);
  EXPECT_NEAR(e.samples["nonstop_recovery_downtime_seconds_sum"], 0.115, 1e-9);
  EXPECT_EQ(
      e.samples["nonstop_recoveries_total{handled=\"grow\",kind=\"resize\",outcome=\"completed\"}"],
      1)
      << text;
  EXPECT_NEAR(e.samples["nonstop_resize_pause_seconds_sum"], 0.25, 1e-9);
  EXPECT_EQ(e.samples["nonstop_recovery_phase_seconds_count{phase=\"aborted\"}"], 1)
      << "a resize is not a fault";
  EXPECT_EQ(e.samples["nonstop_generation"], 3);
  EXPECT_EQ(e.samples["nonstop_world_size"], 4);
  EXPECT_EQ(e.samples["nonstop_spares"], 1);
  EXPECT_EQ(e.samples["nonstop_hosts"], 2);
  EXPECT_EQ(e.samples["nonstop_highest_step"], 2);
}

// The time a fault cost leads: its histogram, the last fault's split (a salvaged step's resumed
// step below a normal one is negative: a gauge), the running total and goodput over the training's
// wall time, at the times the records were appended.
TEST(JobMetricsTest, TimeLostPerFaultItsSplitAndGoodputFollowTheRecords) {
  JobMetrics m;
  m.Observe(Step(0, 2.0, 1000), 102.0);  // began at 100 s
  m.Observe(Step(1, 2.0, 1000), 104.0);
  nlohmann::json split = {{"in_flight", 1.4e3},
                          {"detect", 56.0},
                          {"abort", 169.0},
                          {"plan", 0.0},
                          {"state_copy", 27.0},
                          {"redone_steps", 0.0},
                          {"resumed_step_vs_normal", -352.0}};
  m.Observe({{"event", "recovery_end"},
             {"recovery",
              {{"kind", "recovery"},
               {"outcome", "completed"},
               {"time_lost", {{"ms", 1300.0}, {"split_ms", split}, {"normal_steps", 0.65}}},
               {"time_lost_ms", 1300.0}}}},
            107.3);
  // Superseded: its time is counted in the recovery that superseded it (it has none of its own).
  m.Observe({{"event", "recovery_end"},
             {"recovery", {{"kind", "recovery"}, {"outcome", "superseded by recovery 3"}}}},
            107.4);
  m.Observe(Step(2, 2.0, 1000), 107.3);
  m.Observe(Step(3, 2.0, 1000), 110.0);
  Exposition e = Exposition::Parse(m.Text());
  EXPECT_TRUE(e.errors.empty()) << ::testing::PrintToString(e.errors) << "\n" << m.Text();
  EXPECT_EQ(e.types["nonstop_fault_time_lost_seconds"], "histogram");
  EXPECT_EQ(e.samples["nonstop_fault_time_lost_seconds_count"], 1);
  EXPECT_NEAR(e.samples["nonstop_fault_time_lost_seconds_sum"], 1.3, 1e-9);
  EXPECT_NEAR(e.samples["nonstop_time_lost_seconds_total"], 1.3, 1e-9);
  EXPECT_NEAR(e.samples["nonstop_last_fault_time_lost_seconds{part=\"total\"}"], 1.3, 1e-9);
  EXPECT_NEAR(e.samples["nonstop_last_fault_time_lost_seconds{part=\"in_flight\"}"], 1.4, 1e-9);
  EXPECT_NEAR(e.samples["nonstop_last_fault_time_lost_seconds{part=\"resumed_step_vs_normal\"}"],
              -0.352, 1e-9);
  // 1.3 s lost in the 10 s from the first step's start (100 s) to the last step's end (110 s).
  EXPECT_NEAR(e.samples["nonstop_goodput_ratio"], 0.87, 1e-9);
}

// The reader itself must fail on what it checks, or the test above proves nothing.
TEST(JobMetricsTest, TheExpositionReaderCatchesBrokenText) {
  EXPECT_FALSE(
      Exposition::Parse("# HELP x_total h\n# TYPE x_total counter\nx_total abc\n").errors.empty());
  EXPECT_FALSE(Exposition::Parse("# HELP x h\n# TYPE x counter\nx 1\n").errors.empty())
      << "a counter without _total";
  EXPECT_FALSE(Exposition::Parse("y 1\n").errors.empty()) << "a sample without # TYPE";
  EXPECT_FALSE(Exposition::Parse(
                   "# HELP h h\n# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2\n"
                   "h_sum 1\nh_count 2\n")
                   .errors.empty())
      << "buckets that are not cumulative";
  EXPECT_FALSE(Exposition::Parse(
                   "# HELP h h\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
                   "h_sum 1\nh_count 3\n")
                   .errors.empty())
      << "+Inf differs from _count";
  EXPECT_TRUE(Exposition::Parse(
                  "# HELP h h\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\n"
                  "h_sum 1\nh_count 2\n")
                  .errors.empty());
}

}  // namespace
}  // namespace nonstop::controller
