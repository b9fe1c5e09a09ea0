// TcpDataPlane: the data plane built today (data_plane.h, docs/data_plane.md):
// host memory over TCP. It owns the process's PeerMesh (its data port and
// its connections to peers, kept across generations) and makes each
// generation's TcpCommunicator over it.
#pragma once

#include <memory>

#include "collective/data_plane.h"
#include "collective/peer_mesh.h"
#include "net/abort_signal.h"
#include "net/socket.h"
#include "nonstop/status.h"

namespace nonstop::collective {

class TcpDataPlane final : public DataPlane {
 public:
  // Listens on options.listen. `abort` is the process's abort signal (see
  // DataPlane); it must outlive the data plane, whose accept thread may poll
  // it while a communicator waits for a peer to dial in.
  static Result<std::unique_ptr<TcpDataPlane>> Create(PeerMeshOptions options,
                                                      net::AbortSignal* abort);
  // Uses a socket that is already listening (a parent process bound it for a child; tests).
  static std::unique_ptr<TcpDataPlane> Create(PeerMeshOptions options, net::Listener listener,
                                              net::AbortSignal* abort);

  net::HostPort address() const override { return mesh_->address(); }
  bool Supports(Device device) const override { return device == Device::kHost; }
  DataPlaneStats stats() const override;
  std::unique_ptr<Communicator> NewCommunicator(CommunicatorOptions options) override;

  // The connections themselves, for tests that break one (PeerMesh::Drop).
  PeerMesh& mesh() { return *mesh_; }

 private:
  TcpDataPlane(std::unique_ptr<PeerMesh> mesh, net::AbortSignal* abort)
      : mesh_(std::move(mesh)), abort_(abort) {}

  const std::unique_ptr<PeerMesh> mesh_;
  net::AbortSignal* const abort_;  // owned by the worker session; outlives this (see Create)
};

}  // namespace nonstop::collective
