#include "launcher/output_writer.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <optional>

#include <fmt/format.h>

#include "common/logging.h"

namespace nonstop::launcher {

OutputWriter::OutputWriter(int fd, size_t max_buffered, Millis final_flush)
    : fd_(fd), max_buffered_(max_buffered), final_flush_(final_flush), thread_([this] { Run(); }) {}

OutputWriter::~OutputWriter() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  stop_requested_.store(true);
  cv_.NotifyAll();
  thread_.join();
}

void OutputWriter::Write(std::string_view text) {
  if (text.empty()) return;
  {
    MutexLock lock(&mu_);
    if (buffer_.size() + text.size() > max_buffered_) {
      dropped_bytes_ += text.size();
      ++dropped_writes_;
      return;
    }
    buffer_.append(text);
  }
  cv_.NotifyOne();
}

uint64_t OutputWriter::dropped_bytes() const {
  MutexLock lock(&mu_);
  return dropped_bytes_;
}

bool OutputWriter::WriteOut(std::string_view text) {
  std::optional<Deadline> deadline;  // set once stopping: a stuck reader then gets final_flush_
  while (!text.empty()) {
    if (!deadline && stop_requested_.load()) deadline = DeadlineAfter(final_flush_);
    if (deadline && Clock::now() >= *deadline) return false;
    // Wait for room first, and write at most a page after POLLOUT, so that
    // even a blocking descriptor (a pipe) never blocks us past the deadline.
    pollfd p{fd_, POLLOUT, 0};
    int rc = ::poll(&p, 1, 100);
    if (rc == 0 || (rc < 0 && errno == EINTR)) continue;
    if (rc < 0) return false;
    if (p.revents & (POLLERR | POLLNVAL)) return false;
    ssize_t n = ::write(fd_, text.data(), std::min<size_t>(text.size(), 4096));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    text.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

void OutputWriter::Run() {
  MutexLock lock(&mu_);
  while (true) {
    cv_.Wait(&mu_, [&]() NONSTOP_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stopping_ || !buffer_.empty() || dropped_bytes_ != reported_bytes_;
    });
    bool last = stopping_;
    std::string out;
    out.swap(buffer_);
    if (dropped_bytes_ != reported_bytes_) {
      out += fmt::format(
          "[nonstop] {} bytes of output ({} writes) were dropped: the reader of this stream is not "
          "keeping up (the workers' full output is in their own logs only if they write them)\n",
          dropped_bytes_ - reported_bytes_, dropped_writes_);
      reported_bytes_ = dropped_bytes_;
      dropped_writes_ = 0;
    }
    lock.Unlock();
    // While running, wait as long as the reader needs (we only hold our own
    // thread); at the end, give a stuck reader `final_flush` and go.
    bool ok = WriteOut(out);
    lock.Lock();
    if (last && (buffer_.empty() || !ok)) return;
  }
}

BoundedStdio::BoundedStdio() : out_(STDOUT_FILENO), err_(STDERR_FILENO) {
  SetLogSink([this](std::string_view line) { err_.Write(line); });
}

BoundedStdio::~BoundedStdio() { SetLogSink(nullptr); }

}  // namespace nonstop::launcher
