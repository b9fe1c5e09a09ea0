// PeerMesh: a worker's data-plane connections to other workers, keyed by
// worker id, living across generations (docs/architecture.md "The data plane").
//
// A mesh owns one listening socket and an accept thread. For any pair of
// workers the one with the lower worker id dials and the other accepts, so a
// connection is opened exactly once, by whichever side needs it first, with no
// store and no root. Connections survive membership changes: a Communicator of
// generation g+1 asks the mesh for the same peers and gets the same sockets.
//
// The data port is reachable by anyone, so the accept thread never waits on a
// single connection: it multiplexes the hellos of every connection still in
// handshake in one poll loop, each with its own deadline
// (timeout_handshake), and holds at most max_pending_handshakes of them (under
// a flood of idle connections the oldest is closed first). A silent, slow or
// garbage-sending connection therefore delays no other.
//
// Lanes: between two workers there may be up to net::kDataLanes connections,
// lane 0 (every collective's and Send/Recv's) and lanes 1.. (further streams
// of one point-to-point transfer, which threads drive at once: the state
// copy's, worker/state_transfer.h). Each lane is a connection of its own,
// opened like lane 0 (its hello names the lane), when first asked for, and
// every rule below holds per lane. Drop(peer) forgets all of a peer's lanes.
//
// Generations (the rule of the data port; docs/protocol.md links here): every
// connection remembers the generation it was opened in (the hello's for an
// accepted one, the caller's for a dialed one).
//   - An inbound hello must come from a worker id >= 0 and lower than ours
//     (the lower id dials); anything else is refused.
//   - An inbound connection never replaces a live one from the same worker
//     that was opened in a newer generation: a late hello of an older
//     generation is refused.
//   - Get(peer, g) hands out only a connection opened in generation <= g.
//     One opened in a newer generation means the peer already holds a plan
//     newer than g: generation g is over, Get fails with kAborted at once and
//     the connection stays for the caller's next generation.
// A connection opened in an older generation is handed out in a newer one:
// that is how connections survive membership changes. It is safe because the
// caller asks only for the members of its plan, worker ids are never reused
// within a job, and a worker fenced out of the job is never in a newer plan;
// a fenced worker that still dials in only fills its own slot, which no
// Communicator asks for, and the frames it may send carry its old generation
// and are dropped as stale (transfer.h).
//
// Thread-safety: all methods are safe from any thread. A Connection returned
// by Get() is used by one Communicator at a time (the training thread); the
// mesh owns it and keeps it alive until Drop() or destruction.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/crypto.h"
#include "common/mutex.h"
#include "common/time.h"
#include "common/unique_fd.h"
#include "net/abort_signal.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/status.h"

namespace nonstop::collective {

// One data-plane connection. Besides the socket it remembers where an
// aborted operation left the byte stream, so that the connection can be
// reused in the next generation (transfer.cc): a frame this side had started
// to send is completed with padding before anything else is sent, and a frame
// it had started to receive is read to its end and dropped.
struct Connection {
  UniqueFd fd;
  int peer_id = -1;
  int lane = 0;
  std::string peer_address;
  // the generation it was opened in (hello's, or the dialer's)
  uint32_t generation = 0;
  char send_header_tail[32] = {};  // the unsent end of an aborted frame's header
  size_t send_header_tail_left = 0;
  // payload bytes still owed to a frame whose sending was aborted
  size_t send_pad = 0;
  char recv_header[32] = {};  // a frame header partly read when a receive was aborted
  size_t recv_header_got = 0;
  size_t recv_skip = 0;  // payload bytes of an abandoned frame still to discard
};

// True when the socket reports that the peer closed or reset it.
bool ConnectionIsBroken(const Connection& c);

struct PeerMeshOptions {
  // The workers' data key (role_keys.h): what both ends of every data connection prove.
  crypto::Key data_key{};
  int worker_id = -1;
  // Where the data port listens: IPv4 or IPv6 ("::1", "::" for every
  // interface of both families).
  net::HostPort listen{"127.0.0.1", 0};
  // With a range (both ends included), the data port is its first free port
  // (listen.port is then ignored), so that a firewall can let only these
  // through (--data-ports, docs/ports.md); every port in use fails Create
  // with the range named. {0, 0}: listen.port (0: a port from the OS).
  net::PortRange ports{};
  // How long one incoming connection may take to present its hello.
  Millis timeout_handshake{5'000};
  // Incoming connections held in handshake at once; beyond it the oldest is
  // closed. Bounds memory and descriptors under a flood of idle connections.
  int max_pending_handshakes = 64;
};

class PeerMesh {
 public:
  // Listens as options.listen and options.ports say.
  static Result<std::unique_ptr<PeerMesh>> Create(PeerMeshOptions options);
  // Uses a socket that is already listening (a parent process bound it for a child).
  static std::unique_ptr<PeerMesh> Create(PeerMeshOptions options, net::Listener listener);
  ~PeerMesh();
  PeerMesh(const PeerMesh&) = delete;
  PeerMesh& operator=(const PeerMesh&) = delete;

  const net::HostPort& address() const { return address_; }
  int worker_id() const { return options_.worker_id; }

  // Returns the open connection to worker `peer_id` on `lane` (0 .. net::kDataLanes - 1) for
  // `generation`, dialing `peer_address` when this worker has the lower id, else waiting for
  // the peer to dial in. Waits end as soon as the connection arrives, `abort`
  // fires (kAborted) or `deadline` passes (kDeadlineExceeded). kAborted at
  // once when the peer's connection belongs to a newer generation (see above).
  Result<Connection*> Get(int peer_id, const std::string& peer_address, uint32_t generation,
                          Deadline deadline, const net::AbortSignal* abort, int lane = 0);

  // Forgets (and closes) the connections to `peer_id`, every lane: one failed, or the peer left.
  void Drop(int peer_id);

  // Number of connections established since creation (dialed + accepted), for
  // tests and reports that check that connections were reused.
  int connections_opened() const;
  // Connections open now (one per peer and lane this worker has used and not dropped).
  int connections_open() const;

  // Incoming connections closed without becoming a peer connection (refused
  // hello, handshake deadline, evicted by the cap, stale generation), for
  // tests and reports.
  int connections_refused() const;

 private:
  struct Pending;

  PeerMesh(PeerMeshOptions options, net::Listener listener);
  void AcceptLoop(std::stop_token stop);
  // Checks an incoming hello against the mesh's rules (see the header comment).
  Status CheckInbound(int peer_id, int lane, uint32_t generation) const;
  // Installs an accepted connection; false (and closes it) if it lost a race to a newer one.
  bool InstallInbound(UniqueFd fd, int peer_id, int lane, uint32_t generation);
  Result<Connection*> Dial(int peer_id, int lane, const std::string& peer_address,
                           uint32_t generation, Deadline deadline, const net::AbortSignal* abort);
  void WakeAcceptLoop();

  const PeerMeshOptions options_;
  UniqueFd listen_fd_;
  net::HostPort address_;
  net::AbortSignal stop_signal_;  // wakes the accept thread at shutdown
  UniqueFd wake_fd_;              // eventfd: a waiter registered a new abort signal to watch

  mutable Mutex mu_;
  CondVar cv_;  // a connection arrived, or a waiter's abort fired
  // The map is guarded; a Connection in it is not: its holder (one
  // Communicator at a time) uses it without the lock.
  using Link = std::pair<int, int>;  // (peer's worker id, lane)
  std::map<Link, std::unique_ptr<Connection>> connections_ NONSTOP_GUARDED_BY(mu_);
  // Connections replaced or dropped while a thread may still hold a pointer to
  // them: kept (open) until the mesh goes away. A handful per fault.
  std::vector<std::unique_ptr<Connection>> retired_ NONSTOP_GUARDED_BY(mu_);
  // Abort signals of threads waiting in Get(); the accept thread polls them and
  // wakes cv_ when one fires. Counted: two waiters may share one signal.
  std::map<const net::AbortSignal*, int> waiting_aborts_ NONSTOP_GUARDED_BY(mu_);
  int connections_opened_ NONSTOP_GUARDED_BY(mu_) = 0;
  int connections_refused_ NONSTOP_GUARDED_BY(mu_) = 0;

  std::jthread accept_thread_;  // last member: joins before the members it uses are destroyed
};

}  // namespace nonstop::collective
