#include "worker/state_transfer.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/coding.h"
#include "net/socket.h"
#include "common/crc32c.h"

namespace nonstop::worker {

namespace {

constexpr uint32_t kTransferMagic = 0x4658534E;  // "NSXF"
constexpr size_t kHeaderBytes = 32;

int RankOf(const control::PlanMsg& plan, int worker_id) {
  for (size_t r = 0; r < plan.members.size(); ++r) {
    if (plan.members[r].worker_id == worker_id) return static_cast<int>(r);
  }
  return -1;
}

std::string EncodeHeader(int64_t step, const state::StateRegistry& reg) {
  std::string h;
  PutFixed32(&h, kTransferMagic);
  PutFixed64(&h, static_cast<uint64_t>(step));
  PutFixed64(&h, reg.total_bytes());
  PutFixed32(&h, static_cast<uint32_t>(reg.chunk_bytes()));
  PutFixed32(&h, reg.num_chunks());
  PutFixed32(&h, Crc32c(h));
  h.resize(kHeaderBytes, '\0');
  return h;
}

Status CheckHeader(const std::string& h, int64_t want_step, const state::StateRegistry& reg, const std::string& source) {
  if (DecodeFixed32(h.data()) != kTransferMagic || Crc32c(h.data(), 28) != DecodeFixed32(h.data() + 28)) {
    return DataLossError(fmt::format("state header from {} is corrupt", source));
  }
  auto step = static_cast<int64_t>(DecodeFixed64(h.data() + 4));
  uint64_t total = DecodeFixed64(h.data() + 12);
  uint32_t chunk = DecodeFixed32(h.data() + 20);
  uint32_t chunks = DecodeFixed32(h.data() + 24);
  if (step != want_step) {
    return DataLossError(fmt::format("{} offers the state of step {}, but the plan resumes after step {}", source,
                                     step, want_step));
  }
  if (total != reg.total_bytes() || chunk != reg.chunk_bytes() || chunks != reg.num_chunks()) {
    return DataLossError(fmt::format("{} offers {} bytes in {} chunks of {}, this worker's state is {} bytes in {} "
                                     "chunks of {}: the model or optimizer differs",
                                     source, total, chunks, chunk, reg.total_bytes(), reg.num_chunks(),
                                     reg.chunk_bytes()));
  }
  return OkStatus();
}

Status SendU32s(collective::Communicator& comm, int rank, const std::vector<uint32_t>& values) {
  std::string buf;
  PutFixed32(&buf, static_cast<uint32_t>(values.size()));
  NONSTOP_RETURN_IF_ERROR(comm.Send(rank, std::as_bytes(std::span(buf))));
  if (values.empty()) return OkStatus();
  buf.clear();
  for (uint32_t v : values) PutFixed32(&buf, v);
  return comm.Send(rank, std::as_bytes(std::span(buf)));
}

Result<std::vector<uint32_t>> RecvU32s(collective::Communicator& comm, int rank, uint32_t limit) {
  std::string buf(4, '\0');
  NONSTOP_RETURN_IF_ERROR(comm.Recv(rank, std::as_writable_bytes(std::span(buf))));
  uint32_t n = DecodeFixed32(buf.data());
  if (n > limit) return DataLossError(fmt::format("chunk request of {} entries exceeds the {} chunks of the state", n, limit));
  std::vector<uint32_t> out(n);
  if (n == 0) return out;
  buf.assign(static_cast<size_t>(n) * 4, '\0');
  NONSTOP_RETURN_IF_ERROR(comm.Recv(rank, std::as_writable_bytes(std::span(buf))));
  for (uint32_t i = 0; i < n; ++i) out[i] = DecodeFixed32(buf.data() + 4 * i);
  return out;
}

// Source side: serve one receiver until it says it is done.
Status Serve(collective::Communicator& comm, state::StateRegistry& reg, int receiver, int64_t step,
             std::atomic<bool>* corrupt_next) {
  std::string header = EncodeHeader(step, reg);
  NONSTOP_RETURN_IF_ERROR(comm.Send(receiver, std::as_bytes(std::span(header))));
  std::vector<std::byte> buf(reg.chunk_bytes());
  while (true) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<uint32_t> request, RecvU32s(comm, receiver, reg.num_chunks()));
    if (request.empty()) return OkStatus();
    for (uint32_t index : request) {
      if (index >= reg.num_chunks()) return DataLossError(fmt::format("request for chunk {} of {}", index, reg.num_chunks()));
      uint64_t offset = static_cast<uint64_t>(index) * reg.chunk_bytes();
      size_t n = static_cast<size_t>(std::min<uint64_t>(reg.chunk_bytes(), reg.total_bytes() - offset));
      std::span<std::byte> chunk(buf.data(), n);
      reg.ReadChunk(index, chunk);
      std::string meta;
      PutFixed32(&meta, index);
      PutFixed32(&meta, Crc32c(chunk.data(), chunk.size()));
      if (corrupt_next != nullptr && corrupt_next->exchange(false) && n > 0) chunk[n / 2] ^= std::byte{0x5a};
      NONSTOP_RETURN_IF_ERROR(comm.Send(receiver, std::as_bytes(std::span(meta))));
      NONSTOP_RETURN_IF_ERROR(comm.Send(receiver, chunk));
    }
  }
}

// Receiver side: fetch `indices` from one source. Chunks that fail their CRC go to `failed`.
Status Fetch(collective::Communicator& comm, state::StateRegistry& reg, int source, const std::vector<uint32_t>& indices,
             std::vector<uint32_t>* failed, std::atomic<uint64_t>* bytes) {
  if (indices.empty()) return OkStatus();  // an empty request would mean "done"
  NONSTOP_RETURN_IF_ERROR(SendU32s(comm, source, indices));
  std::vector<std::byte> buf(reg.chunk_bytes());
  for (uint32_t want : indices) {
    std::string meta(8, '\0');
    NONSTOP_RETURN_IF_ERROR(comm.Recv(source, std::as_writable_bytes(std::span(meta))));
    uint32_t index = DecodeFixed32(meta.data());
    uint32_t crc = DecodeFixed32(meta.data() + 4);
    if (index != want) return DataLossError(fmt::format("rank {} sent chunk {} where chunk {} was asked for", source, index, want));
    uint64_t offset = static_cast<uint64_t>(index) * reg.chunk_bytes();
    size_t n = static_cast<size_t>(std::min<uint64_t>(reg.chunk_bytes(), reg.total_bytes() - offset));
    std::span<std::byte> chunk(buf.data(), n);
    NONSTOP_RETURN_IF_ERROR(comm.Recv(source, chunk));
    *bytes += n;
    Status s = reg.WriteChunk(index, chunk, crc);
    if (s.code() == StatusCode::kDataLoss) {
      failed->push_back(index);  // fetched again from another source
    } else {
      NONSTOP_RETURN_IF_ERROR(s);
    }
  }
  return OkStatus();
}

std::string SourceName(const control::PlanMsg& plan, int rank) {
  return fmt::format("rank {} (worker {})", rank, plan.members[static_cast<size_t>(rank)].worker_id);
}

}  // namespace

Status ValidatePlan(const control::PlanMsg& plan, int my_worker_id) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError(fmt::format("plan of generation {} is malformed: {}", plan.generation, what));
  };
  if (plan.members.empty()) return bad("it has no members");
  if (plan.resume_step < 0) return bad(fmt::format("resume step {} is negative", plan.resume_step));
  std::set<int> ids;
  for (const auto& m : plan.members) {
    if (m.worker_id < 0) return bad(fmt::format("member worker id {} is negative", m.worker_id));
    if (!ids.insert(m.worker_id).second) return bad(fmt::format("worker {} is a member twice", m.worker_id));
    if (!net::ParseHostPort(m.address).ok()) {
      return bad(fmt::format("worker {}'s address '{}' is not host:port", m.worker_id, m.address));
    }
  }
  if (!ids.count(my_worker_id)) return bad(fmt::format("it does not include this worker ({})", my_worker_id));
  std::set<int> receivers;
  for (const auto& t : plan.transfers) {
    if (!ids.count(t.receiver)) return bad(fmt::format("receiver worker {} is not a member", t.receiver));
    if (!receivers.insert(t.receiver).second) return bad(fmt::format("worker {} receives twice", t.receiver));
    if (t.sources.empty()) return bad(fmt::format("worker {} receives from no source", t.receiver));
    for (int src : t.sources) {
      if (!ids.count(src)) return bad(fmt::format("source worker {} of receiver {} is not a member", src, t.receiver));
      if (src == t.receiver) return bad(fmt::format("worker {} is its own source", src));
    }
  }
  return OkStatus();
}

Result<TransferOutcome> RunStateTransfers(collective::Communicator& comm, state::StateRegistry& reg,
                                          const control::PlanMsg& plan, int my_worker_id, const TransferHooks& hooks) {
  TransferOutcome outcome;
  const int64_t step = plan.resume_step - 1;
  std::vector<int> serve_to;           // receiver ranks
  std::vector<int> fetch_from;         // source ranks
  for (const auto& t : plan.transfers) {
    if (t.receiver == my_worker_id) {
      for (int s : t.sources) fetch_from.push_back(RankOf(plan, s));
    } else if (std::find(t.sources.begin(), t.sources.end(), my_worker_id) != t.sources.end()) {
      serve_to.push_back(RankOf(plan, t.receiver));
    }
  }
  if (serve_to.empty() && fetch_from.empty()) return outcome;
  if (hooks.on_start) hooks.on_start();

  if (!serve_to.empty()) {
    outcome.served = true;
    std::atomic<bool> corrupt(hooks.corrupt_first_chunk);
    std::vector<Status> results(serve_to.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < serve_to.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = Serve(comm, reg, serve_to[i], step, &corrupt); });
    }
    for (auto& t : threads) t.join();
    for (const Status& s : results) NONSTOP_RETURN_IF_ERROR(s);
    return outcome;
  }

  outcome.received = true;
  outcome.sources = static_cast<int>(fetch_from.size());
  const size_t k = fetch_from.size();
  std::vector<std::vector<uint32_t>> assigned(k);
  for (uint32_t c = 0; c < reg.num_chunks(); ++c) assigned[c % k].push_back(c);
  std::vector<Status> results(k);
  std::vector<std::vector<uint32_t>> failed(k);
  std::atomic<uint64_t> bytes{0};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < k; ++i) {
    threads.emplace_back([&, i] {
      std::string header(kHeaderBytes, '\0');
      Status s = comm.Recv(fetch_from[i], std::as_writable_bytes(std::span(header)));
      if (s.ok()) s = CheckHeader(header, step, reg, SourceName(plan, fetch_from[i]));
      if (s.ok()) s = Fetch(comm, reg, fetch_from[i], assigned[i], &failed[i], &bytes);
      results[i] = s;
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : results) NONSTOP_RETURN_IF_ERROR(s);
  // Chunks that failed their checksum: fetch each again from the next source.
  for (size_t i = 0; i < k; ++i) {
    for (uint32_t index : failed[i]) {
      bool done = false;
      for (size_t attempt = 1; attempt <= k && !done; ++attempt) {
        size_t from = (i + attempt) % k;
        std::vector<uint32_t> again;
        NONSTOP_RETURN_IF_ERROR(Fetch(comm, reg, fetch_from[from], {index}, &again, &bytes));
        done = again.empty();
        ++outcome.refetched_chunks;
      }
      if (!done) {
        return DataLossError(fmt::format("state chunk {} failed its checksum from every source", index));
      }
    }
  }
  for (int source : fetch_from) NONSTOP_RETURN_IF_ERROR(SendU32s(comm, source, {}));
  outcome.bytes_received = bytes.load();
  return outcome;
}

}  // namespace nonstop::worker
