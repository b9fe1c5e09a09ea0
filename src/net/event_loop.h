// EventLoop: a single-threaded poll(2) loop that dispatches readiness of
// registered descriptors to handlers. The controller runtime and the local
// launcher share one loop in `nonstop run`, so every socket, pipe and process
// descriptor is owned by one thread and no handler needs a lock.
//
// Thread-safety: none; everything runs on the loop's thread. A handler may
// Watch/Unwatch any descriptor, including its own.
#pragma once

#include <poll.h>

#include <cstdint>
#include <functional>
#include <map>

#include "common/time.h"

namespace nonstop::net {

class EventLoop {
 public:
  using Handler = std::function<void(short revents)>;

  void Watch(int fd, short events, Handler handler);
  void Unwatch(int fd);
  // Changes the events a watched descriptor waits for (e.g. adds POLLOUT
  // while an output queue is not empty); no-op if `fd` is not watched.
  void SetEvents(int fd, short events);
  bool watching(int fd) const { return handlers_.count(fd) > 0; }

  // Waits up to `max_wait` for readiness and runs the handlers of ready descriptors.
  void RunOnce(Millis max_wait);

 private:
  struct Entry {
    short events;
    uint64_t id;  // distinguishes a re-registered fd number from the old one
    Handler handler;
  };
  std::map<int, Entry> handlers_;
  uint64_t next_id_ = 0;
};

}  // namespace nonstop::net
