// What the benchmarks that run whole jobs share: starting `nonstop run` (or
// any program) with its output in a log file, reading the job's journal
// (docs/journal.md) back into steps, injected faults, recoveries and the
// final parameter checksum, and simple statistics over the results.
//
// Benchmarks are single-threaded programs a person runs by hand; nothing here
// is thread-safe and nothing is meant for the library.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "nonstop/status.h"

namespace nonstop::bench {

// The directory of the running executable (where its sibling programs are).
std::string SelfDir();

// Starts argv (argv[0] a path) with stdout and stderr going to `log`, after
// echoing the command line on stdout. The child is ours to wait for.
Result<pid_t> StartCommand(const std::vector<std::string>& argv, const std::string& log);

// Waits for a child started by StartCommand: its exit code, or 128 + the signal that ended it.
int WaitCommand(pid_t pid);

// StartCommand + WaitCommand; 127 when the program cannot be started.
int RunCommand(const std::vector<std::string>& argv, const std::string& log);

struct StepEvent {
  int64_t step;
  double t;  // seconds since job_start
};

struct InjectedFault {
  std::string spec;   // as the worker announced it, e.g. "kill:rank=2,step=30"
  int64_t step = -1;  // the spec's step, -1 when it has none
  int worker_id = -1;
  double t = 0;  // seconds since job_start
};

// A journal read back (one job: `nonstop run` truncates its journal). Records
// before job_start are skipped.
struct JournalSummary {
  // every record from job_start on, each with "t" (seconds since job_start) added
  std::vector<nlohmann::json> records;
  double start_epoch_s = 0;             // wall clock of job_start, seconds since the epoch
  std::vector<StepEvent> steps;         // "step" records in journal order
  std::vector<InjectedFault> injected;  // "fault_injected" records
  // the "recovery" object of every recovery_end
  nlohmann::json recoveries = nlohmann::json::array();
  int64_t redone = 0;          // step records for a step already completed
  int64_t distinct = 0;        // distinct steps completed
  double wall = 0;             // seconds from job_start to job_end (0: no job_end)
  int journal_exit_code = -1;  // job_end's exit_code (-1: no job_end)
  // final parameter checksum: "finished" records, else job_end's reason
  std::string checksum;
  bool checksums_agree = true;  // every "finished" record had the same checksum
};

// Reads `path`; an error names the file and the malformed line, or says there is no job_start.
Result<JournalSummary> ReadJournalSummary(const std::string& path);

// The median time between consecutive step records (a normal step), 0 with fewer than two.
double MedianStepInterval(const std::vector<StepEvent>& steps);

// The p-th percentile (0..100, nearest rank) of the values; -1 when there are none.
double Percentile(std::vector<double> values, double p);

// The mean of the non-negative values (negative ones mean "not measured"); -1 when there are none.
double MeanOfMeasured(const std::vector<double>& values);

// The middle value (the upper of the two middle ones); 0 when there are none.
double Median(std::vector<double> values);

// `streams` loopback connections, each carrying its 1/streams of `src` into the same range of
// `dst`; the seconds from the first byte sent to the last received (raw TCP: the ceiling the
// benchmarks of copies over TCP are read against). With `checked_piece` > 0, each stream's bytes go
// in pieces of that size, each CRC-32C'd by the sender just before it goes out and by the
// receiver just after it has landed (each stream's running CRCs compared at the end): the least
// CPU a copy that checks every byte spends. `cpu_seconds`: the process's CPU time over the same
// interval (ProcessCpuSeconds), the connections' set-up and closing left out.
double RawTcp(std::span<const std::byte> src, std::span<std::byte> dst, int streams,
              size_t checked_piece = 0, double* cpu_seconds = nullptr);

// The CPU time (user + system) this process has used so far, every thread's, those that ended
// included. Work the kernel does for it in other contexts (ksoftirqd) is not counted.
double ProcessCpuSeconds();

}  // namespace nonstop::bench
