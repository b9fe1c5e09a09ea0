#include "collective/tcp_data_plane.h"

#include "collective/tcp_communicator.h"

namespace nonstop::collective {

Result<std::unique_ptr<TcpDataPlane>> TcpDataPlane::Create(PeerMeshOptions options,
                                                           net::AbortSignal* abort) {
  NONSTOP_ASSIGN_OR_RETURN(std::unique_ptr<PeerMesh> mesh, PeerMesh::Create(std::move(options)));
  return std::unique_ptr<TcpDataPlane>(new TcpDataPlane(std::move(mesh), abort));
}

std::unique_ptr<TcpDataPlane> TcpDataPlane::Create(PeerMeshOptions options, net::Listener listener,
                                                   net::AbortSignal* abort) {
  std::unique_ptr<PeerMesh> mesh = PeerMesh::Create(std::move(options), std::move(listener));
  return std::unique_ptr<TcpDataPlane>(new TcpDataPlane(std::move(mesh), abort));
}

DataPlaneStats TcpDataPlane::stats() const {
  DataPlaneStats s;
  s.connections_opened = mesh_->connections_opened();
  s.connections_open = mesh_->connections_open();
  s.connections_refused = mesh_->connections_refused();
  return s;
}

std::unique_ptr<Communicator> TcpDataPlane::NewCommunicator(CommunicatorOptions options) {
  return std::make_unique<TcpCommunicator>(mesh_.get(), abort_, std::move(options));
}

}  // namespace nonstop::collective
