#include "common/signals.h"

#include <pthread.h>

namespace nonstop {

sigset_t BlockTerminationSignals(std::initializer_list<int> also) {
  ::signal(SIGPIPE, SIG_IGN);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGTERM);
  for (int sig : also) sigaddset(&mask, sig);
  ::pthread_sigmask(SIG_BLOCK, &mask, nullptr);
  return mask;
}

}  // namespace nonstop
