#include "common/signals.h"

#include <pthread.h>

namespace nonstop {

sigset_t BlockTerminationSignals() {
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &mask, nullptr);
  return mask;
}

}  // namespace nonstop
