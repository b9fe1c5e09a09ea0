#include "net/event_loop.h"

#include <cerrno>
#include <vector>

namespace nonstop::net {

void EventLoop::Watch(int fd, short events, Handler handler) {
  handlers_[fd] = Entry{events, next_id_++, std::move(handler)};
}

void EventLoop::Unwatch(int fd) { handlers_.erase(fd); }

void EventLoop::SetEvents(int fd, short events) {
  if (auto it = handlers_.find(fd); it != handlers_.end()) it->second.events = events;
}

void EventLoop::RunOnce(Millis max_wait) {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  for (const auto& [fd, e] : handlers_) {
    fds.push_back({fd, e.events, 0});
    ids.push_back(e.id);
  }
  int rc = ::poll(fds.data(), fds.size(), static_cast<int>(max_wait.count()));
  if (rc <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    auto it = handlers_.find(fds[i].fd);
    // unwatched by an earlier handler
    if (it == handlers_.end() || it->second.id != ids[i]) continue;
    Handler h = it->second.handler;  // a copy: the handler may unwatch itself
    h(fds[i].revents);
  }
}

}  // namespace nonstop::net
