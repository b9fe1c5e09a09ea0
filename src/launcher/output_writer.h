// OutputWriter: forwards text to a file descriptor (the launcher's stdout or
// stderr) from its own thread, through a bounded buffer, so that the event
// loop that produces the text never blocks on a slow or stuck reader (a
// terminal scrolled back, `nonstop run | less`, a full pipe).
//
// When the buffer is full, whole writes are dropped and counted; the next
// time the reader catches up, one line says how much was lost. At
// destruction what is buffered is written out, waiting at most
// `final_flush` for a reader that takes nothing.
//
// Thread-safety: Write() may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>

#include "common/mutex.h"
#include "common/time.h"

namespace nonstop::launcher {

class OutputWriter {
 public:
  explicit OutputWriter(int fd, size_t max_buffered = 4u << 20, Millis final_flush = Millis(2'000));
  ~OutputWriter();
  OutputWriter(const OutputWriter&) = delete;
  OutputWriter& operator=(const OutputWriter&) = delete;

  // Queues `text`; never blocks on the reader. Dropped whole if the buffer is full.
  void Write(std::string_view text);
  uint64_t dropped_bytes() const;

 private:
  void Run();
  // Writes all of `text`; once stopping, gives up (false) after final_flush_.
  bool WriteOut(std::string_view text);

  const int fd_;  // not owned
  const size_t max_buffered_;
  const Millis final_flush_;
  mutable Mutex mu_;
  CondVar cv_;
  std::string buffer_ NONSTOP_GUARDED_BY(mu_);
  uint64_t dropped_bytes_ NONSTOP_GUARDED_BY(mu_) = 0;
  uint64_t dropped_writes_ NONSTOP_GUARDED_BY(mu_) = 0;
  uint64_t reported_bytes_ NONSTOP_GUARDED_BY(mu_) = 0;  // drops already reported
  bool stopping_ NONSTOP_GUARDED_BY(mu_) = false;
  // stopping_, readable without the lock: WriteOut runs unlocked, so as not
  // to block Write() behind a slow reader, and still needs to see the stop.
  std::atomic<bool> stop_requested_{false};
  std::thread thread_;  // last: started after the members it uses
};

// A program's stdout and stderr behind OutputWriters, with the log lines
// going through `err` as long as it lives (the log sink is restored before
// the writers go away): an event loop that prints never blocks on a reader.
// `nonstop run`, `nonstop controller` and `nonstop agent` print through one.
class BoundedStdio {
 public:
  BoundedStdio();
  ~BoundedStdio();
  BoundedStdio(const BoundedStdio&) = delete;
  BoundedStdio& operator=(const BoundedStdio&) = delete;
  OutputWriter& out() { return out_; }
  OutputWriter& err() { return err_; }

 private:
  OutputWriter out_;
  OutputWriter err_;
};

}  // namespace nonstop::launcher
