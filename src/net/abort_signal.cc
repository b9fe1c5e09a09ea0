#include "net/abort_signal.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>

#include "common/check.h"

namespace nonstop::net {

AbortSignal::AbortSignal() : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  NONSTOP_CHECK(fd_.valid()) << "eventfd failed";
}

void AbortSignal::Fire() {
  if (fired_.exchange(true, std::memory_order_acq_rel)) return;
  uint64_t one = 1;
  ssize_t n = ::write(fd_.get(), &one, sizeof(one));
  (void)n;  // a full counter is still readable: the wake-up is not lost
}

void AbortSignal::Reset() {
  uint64_t value;
  while (::read(fd_.get(), &value, sizeof(value)) > 0) {
  }
  fired_.store(false, std::memory_order_release);
}

}  // namespace nonstop::net
