// The signals a long-running nonstop process (nonstop run, controller, agent)
// handles in its event loop rather than in a handler.
#pragma once

#include <signal.h>

#include <initializer_list>

namespace nonstop {

// Blocks SIGINT and SIGTERM in the calling thread (threads it starts later
// inherit the mask), so that they wait for the loop, which reads them from a
// signalfd made with the returned mask; ignores SIGPIPE (a closed socket or
// stdout says EPIPE instead). `also`: more signals the loop reads (the
// agent's SIGUSR1). Call it before any thread starts.
sigset_t BlockTerminationSignals(std::initializer_list<int> also = {});

}  // namespace nonstop
