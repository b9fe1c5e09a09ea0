#include "worker/copy_wire.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/coding.h"
#include "common/mutex.h"
#include "net/handshake.h"
#include "net/socket.h"
#include "nonstop/crc32c.h"
#include "nonstop/log.h"
#include "nonstop/settings.h"
#include "state/shard_layout.h"
#include "worker/copy_seal.h"

namespace nonstop::worker {

namespace {

constexpr uint32_t kTransferMagic = 0x3658534E;  // "NSX6" (5: no seal in the header)
constexpr uint32_t kHeaderSealed = 1;            // the header's flags
// A source's share of the copy gets one stream (lane) per this many bytes (StreamsFor).
constexpr uint64_t kBytesPerStream = uint64_t{32} << 20;

}  // namespace

int RankOf(const control::PlanMsg& plan, int worker_id) {
  for (size_t r = 0; r < plan.members.size(); ++r) {
    if (plan.members[r].worker_id == worker_id) return static_cast<int>(r);
  }
  return -1;
}

namespace {

// The part of a header the seal binds: all of it but its CRC (the nonce is in it).
constexpr size_t kSealedHeaderBytes = kHeaderBytes - 4;

// `step`: the step the source's state holds. `shard`: the shard whose
// chunks follow (its held one, unless it holds every shard). `nonce`: the seal's (empty: none).
std::string EncodeHeader(int64_t step, const state::StateRegistry& reg, int shard,
                         const std::string& nonce) {
  std::string h;
  PutFixed32(&h, kTransferMagic);
  PutFixed64(&h, static_cast<uint64_t>(step));
  PutFixed64(&h, reg.total_bytes());
  PutFixed32(&h, static_cast<uint32_t>(reg.chunk_bytes()));
  PutFixed32(&h, reg.num_chunks());
  PutFixed32(&h, static_cast<uint32_t>(reg.shard_group()));
  PutFixed32(&h, static_cast<uint32_t>(shard));
  PutFixed32(&h, nonce.empty() ? 0 : kHeaderSealed);
  h += nonce.empty() ? std::string(CopySeal::kNonceBytes, '\0') : nonce;
  PutFixed32(&h, Crc32c(h));
  return h;
}

}  // namespace

Result<Header> ParseHeader(const std::string& h, const state::StateRegistry& reg,
                           const std::string& source, bool sealed, int want_shard) {
  constexpr size_t kCrcAt = kHeaderBytes - 4;
  if (DecodeFixed32(h.data()) != kTransferMagic ||
      Crc32c(h.data(), kCrcAt) != DecodeFixed32(h.data() + kCrcAt)) {
    return DataLossError(fmt::format("state header from {} is corrupt", source));
  }
  const bool source_sealed = (DecodeFixed32(h.data() + 36) & kHeaderSealed) != 0;
  if (source_sealed != sealed) {
    return FailedPreconditionError(fmt::format(
        "{} {} its state copy and this worker {}: every worker of a job must have the same {}",
        source, source_sealed ? "seals" : "does not seal", sealed ? "does" : "does not",
        settings::kSealedStateCopy.env));
  }
  const auto step = static_cast<int64_t>(DecodeFixed64(h.data() + 4));
  uint64_t total = DecodeFixed64(h.data() + 12);
  uint32_t chunk = DecodeFixed32(h.data() + 20);
  uint32_t chunks = DecodeFixed32(h.data() + 24);
  auto group = static_cast<int>(DecodeFixed32(h.data() + 28));
  auto held = static_cast<int32_t>(DecodeFixed32(h.data() + 32));
  if (group != reg.shard_group()) {
    return DataLossError(
        fmt::format("{} shards its state over groups of {}, this worker over groups of {}: the "
                    "optimizer differs",
                    source, group, reg.shard_group()));
  }
  if (want_shard >= 0 && held != want_shard) {
    return DataLossError(fmt::format("{} offers shard {} of the state where shard {} was asked for",
                                     source, held, want_shard));
  }
  if (total != reg.total_bytes() || chunk != reg.chunk_bytes() || chunks != reg.num_chunks()) {
    return DataLossError(fmt::format(
        "{} offers {} bytes in {} chunks of {}, this worker's state is {} bytes in {} "
        "chunks of {}: the model or optimizer differs",
        source, total, chunks, chunk, reg.total_bytes(), reg.num_chunks(), reg.chunk_bytes()));
  }
  return Header{step, sealed ? h.substr(0, kSealedHeaderBytes) : std::string()};
}

Result<Header> CheckHeader(const std::string& h, int64_t want_step, const state::StateRegistry& reg,
                           const std::string& source, bool sealed, int want_shard) {
  NONSTOP_ASSIGN_OR_RETURN(Header header, ParseHeader(h, reg, source, sealed, want_shard));
  if (header.step != want_step) {
    return DataLossError(
        fmt::format("{} offers the state of step {}, but the plan resumes after step {}", source,
                    header.step, want_step));
  }
  return header;
}

namespace {

// The CRC-32C table a source sends: entry c is the CRC of chunk c as this
// source serves it, for the chunks the transfer copies (replicated ones: the
// state transfer; sharded ones: the shard exchange, of shard `shard` when >=
// 0, read from a registry that holds every shard), 0 for the others and for
// those `skip` marks (the state transfer's source checksums the chunks it
// sends as they go out: Serve). Spread over up to kTableThreads threads (and
// no more than the cores that the `busy` threads sending meanwhile leave, at
// least one: on this project's 2-core machines, a second thread only takes
// the core a stream needs),
// each taking an interleaved share of the chunks (contiguous ranges would
// leave the regions' copied chunks to one thread). The registry is only read.
constexpr unsigned kTableThreads = 8;
constexpr size_t kBytesPerTableThread = size_t{16} << 20;  // smaller tables: fewer threads

}  // namespace

std::vector<uint32_t> CrcTable(const state::StateRegistry& reg, bool sharded, int shard,
                               const std::vector<char>* skip, unsigned busy) {
  std::vector<uint32_t> table(reg.num_chunks(), 0);
  auto fill = [&](uint32_t first, uint32_t stride) {
    std::vector<std::byte> buf;
    for (uint32_t c = first; c < reg.num_chunks(); c += stride) {
      if (reg.chunk_sharded(c) != sharded || (skip != nullptr && (*skip)[c])) continue;
      std::span<const std::byte> bytes;
      if (!(sharded && shard >= 0)) bytes = reg.ContiguousChunk(c);
      if (bytes.empty() && reg.chunk_size(c) > 0) {
        buf.resize(reg.chunk_size(c));
        if (sharded && shard >= 0) {
          reg.ReadChunkOfShard(c, shard, buf);
        } else {
          reg.ReadChunk(c, buf);
        }
        bytes = buf;
      }
      table[c] = Crc32c(bytes.data(), bytes.size());  // each entry written by one thread
    }
  };
  const size_t by_size = reg.total_bytes() / kBytesPerTableThread;
  const unsigned cores = std::thread::hardware_concurrency();
  const auto threads = static_cast<uint32_t>(
      std::max<size_t>(1, std::min<size_t>({std::max(1u, cores - std::min(busy, cores)),
                                            kTableThreads, by_size, reg.num_chunks()})));
  std::vector<std::thread> helpers;
  uint32_t started = 1;  // share 0 is this thread's
  try {
    for (; started < threads; ++started) helpers.emplace_back(fill, started, threads);
  } catch (const std::system_error&) {
    // no thread to be had (a limit on processes): this thread takes the shares left
  }
  fill(0, threads);
  for (uint32_t t = started; t < threads; ++t) fill(t, threads);
  for (auto& h : helpers) h.join();
  return table;
}

namespace {

std::string EncodeTable(const std::vector<uint32_t>& table) {
  std::string out;
  out.reserve(table.size() * 4);
  for (uint32_t crc : table) PutFixed32(&out, crc);
  return out;
}

// A source's CRC table (one message, checksummed by the transport, its seal's tag after it when
// `seal`; none for a state of no chunks).
Status SendTable(collective::Communicator& comm, int receiver, const std::vector<uint32_t>& table,
                 const CopySeal* seal, const SourceFaults& faults) {
  if (table.empty()) return OkStatus();
  std::string bytes = EncodeTable(table);
  if (seal != nullptr) bytes += seal->TableTag(bytes);
  if (faults.tamper_table) faults.tamper_table(bytes);
  return comm.Send(receiver, std::as_bytes(std::span(bytes)));
}

}  // namespace

Result<std::vector<uint32_t>> RecvTable(collective::Communicator& comm,
                                        const state::StateRegistry& reg, int source,
                                        const CopySeal* seal) {
  std::vector<uint32_t> table(reg.num_chunks());
  if (table.empty()) return table;
  const size_t n = table.size() * 4;
  std::string buf(n + (seal != nullptr ? CopySeal::kTagBytes : 0), '\0');
  NONSTOP_RETURN_IF_ERROR(comm.Recv(source, std::as_writable_bytes(std::span(buf))));
  if (seal != nullptr &&
      !seal->TableVerifies(std::string_view(buf).substr(0, n), std::string_view(buf).substr(n))) {
    return DataLossError(fmt::format(
        "the CRC table from rank {} fails its seal: altered on the way, or not that rank's",
        source));
  }
  for (size_t c = 0; c < table.size(); ++c) table[c] = DecodeFixed32(buf.data() + 4 * c);
  return table;
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

Status TellDone(collective::Communicator& comm, const std::vector<int>& sources) {
  Status first;
  for (int source : sources) {
    Status s = SendU32s(comm, source, {});
    if (first.ok()) first = s;
  }
  return first;
}

namespace {

Result<std::vector<uint32_t>> RecvU32s(collective::Communicator& comm, int rank, uint32_t limit) {
  std::string buf(4, '\0');
  NONSTOP_RETURN_IF_ERROR(comm.Recv(rank, std::as_writable_bytes(std::span(buf))));
  uint32_t n = DecodeFixed32(buf.data());
  if (n > limit)
    return DataLossError(
        fmt::format("chunk request of {} entries exceeds the {} chunks of the state", n, limit));
  std::vector<uint32_t> out(n);
  if (n == 0) return out;
  buf.assign(static_cast<size_t>(n) * 4, '\0');
  NONSTOP_RETURN_IF_ERROR(comm.Recv(rank, std::as_writable_bytes(std::span(buf))));
  for (uint32_t i = 0; i < n; ++i) out[i] = DecodeFixed32(buf.data() + 4 * i);
  return out;
}

// A request for chunks: {lanes, index, ...}, sent by the receiver over lane 0 (the empty request
// says it is done). The source streams the chunk at position p of the list over lane p mod
// lanes: the lanes run at once, each on a thread of its own at both ends.
Status SendRequest(collective::Communicator& comm, int source, int lanes,
                   const std::vector<uint32_t>& indices) {
  std::vector<uint32_t> values;
  values.reserve(indices.size() + 1);
  values.push_back(static_cast<uint32_t>(lanes));
  values.insert(values.end(), indices.begin(), indices.end());
  return SendU32s(comm, source, values);
}

}  // namespace

int StreamsFor(const collective::Communicator& comm, const state::StateRegistry& reg,
               const std::vector<uint32_t>& chunks, int asked) {
  uint64_t bytes = 0;
  for (uint32_t c : chunks) bytes += reg.chunk_size(c);
  const uint64_t by_size = std::max<uint64_t>(1, bytes / kBytesPerStream);
  const uint64_t want = asked > 0 ? static_cast<uint64_t>(asked) : by_size;
  return static_cast<int>(std::max<uint64_t>(
      1, std::min({want, static_cast<uint64_t>(std::min(comm.p2p_lanes(), net::kStateCopyLanes)),
                   uint64_t{chunks.size()}})));
}

Status CauseOf(std::span<const Status> results) {
  for (const Status& s : results) {
    if (!s.ok() && s.code() != StatusCode::kAborted) return s;
  }
  for (const Status& s : results) NONSTOP_RETURN_IF_ERROR(s);
  return OkStatus();
}

namespace {

// Runs lane(l) for l in [0, lanes) at once, lane 0 on this thread: the first error to happen.
// With `stop_others`, that error calls it with the error, so that the other lanes stop now instead
// of finishing their share (or waiting out the collective's deadline for a peer that lied on one).
Status OnLanes(int lanes, const std::function<Status(int lane)>& lane,
               const std::function<void(const Status&)>& stop_others = nullptr) {
  Mutex mu;
  Status first;
  auto run = [&](int l) {
    Status s = lane(l);
    if (s.ok()) return;
    {
      MutexLock lock(&mu);
      if (!first.ok()) return;
      first = s;
    }
    if (stop_others) stop_others(s);
  };
  {
    std::vector<std::jthread> threads;
    for (int l = 1; l < lanes; ++l) threads.emplace_back(run, l);
    run(0);
  }
  return first;
}

// Source side, one lane of a request: the chunks at positions lane, lane + lanes, ... of
// `request`, each preceded by {index, its CRC} and, when `seal`, the chunk's tag. A chunk goes out
// from the live state itself when it lies in one region (no copy). With `checksum_here` the CRC is
// computed here, from the bytes about to go out (in this core's cache then, so the kernel's copy
// reads them from there too), and written into (*table)[index] (every index of a request is
// distinct: Serve checks); else it is the table's.
Status SendChunks(collective::Communicator& comm, const state::StateRegistry& reg, int receiver,
                  std::span<const uint32_t> request, int lane, int lanes,
                  std::vector<uint32_t>* table, bool checksum_here, SourceFaults* faults, int shard,
                  RequestSeal seal) {
  std::vector<std::byte> buf;  // a chunk that must be copied: across regions, of a shard, corrupted
  for (size_t p = static_cast<size_t>(lane); p < request.size(); p += static_cast<size_t>(lanes)) {
    const uint32_t index = request[p];
    const size_t n = reg.chunk_size(index);
    const bool corrupt = faults->corrupt.exchange(false) && n > 0;
    const bool tamper = !corrupt && faults->tamper_pending.exchange(false) && n > 0;
    const bool of_shard = shard >= 0 && reg.chunk_sharded(index);
    std::span<const std::byte> chunk;
    if (!of_shard && !corrupt && !tamper) chunk = reg.ContiguousChunk(index);
    if (chunk.empty()) {
      if (buf.size() < n) buf.resize(reg.chunk_bytes());
      std::span<std::byte> copy(buf.data(), n);
      if (of_shard) {
        reg.ReadChunkOfShard(index, shard, copy);
      } else {
        reg.ReadChunk(index, copy);
      }
      chunk = copy;
    }
    if (checksum_here) (*table)[index] = Crc32c(chunk.data(), chunk.size());
    const std::string tag = seal.seal != nullptr
                                ? seal.seal->ChunkTag(seal.request, index, (*table)[index], chunk)
                                : std::string();
    if (corrupt) buf[n / 2] ^= std::byte{0x5a};            // after the checksum: damaged on the way
    if (tamper) faults->tamper(std::span(buf.data(), n));  // after the seal: rewritten on the way
    std::string meta;
    PutFixed32(&meta, index);
    PutFixed32(&meta, (*table)[index]);
    meta += tag;
    NONSTOP_RETURN_IF_ERROR(comm.SendOnLane(
        receiver, lane, collective::HostRegion(std::as_bytes(std::span(meta))), true));
    NONSTOP_RETURN_IF_ERROR(
        comm.SendOnLane(receiver, lane, collective::HostRegion(chunk), /*checked=*/false));
  }
  return OkStatus();
}

// The receiver's request, checked: {lanes, index…} with lanes within the state copy's, every index
// a chunk of the state that this transfer copies (`sharded`: the shard exchange's, else the
// replicated ones) and none twice (a lane of SendChunks writes its chunks' table entries).
// Returns which chunks it asks for (1 at their index).
Result<std::vector<char>> CheckRequest(const collective::Communicator& comm,
                                       const state::StateRegistry& reg,
                                       const std::vector<uint32_t>& request, bool sharded) {
  const uint32_t lanes = request[0];
  const int most = std::min(comm.p2p_lanes(), net::kStateCopyLanes);
  if (lanes < 1 || lanes > static_cast<uint32_t>(most)) {
    return DataLossError(fmt::format("a request for {} chunks over {} lanes (1 to {} can be)",
                                     request.size() - 1, lanes, most));
  }
  std::vector<char> asked(reg.num_chunks(), 0);
  for (size_t i = 1; i < request.size(); ++i) {
    const uint32_t index = request[i];
    if (index >= reg.num_chunks())
      return DataLossError(fmt::format("request for chunk {} of {}", index, reg.num_chunks()));
    if (asked[index]) return DataLossError(fmt::format("request for chunk {} twice", index));
    if (reg.chunk_sharded(index) != sharded) {
      return DataLossError(fmt::format("request for chunk {}, {} chunk, in the {}", index,
                                       sharded ? "a replicated" : "a sharded",
                                       sharded ? "shard exchange" : "state transfer"));
    }
    asked[index] = 1;
  }
  return asked;
}

// Sends a source's header (`step`: the step its state holds; `shard`: the shard whose chunks
// follow; sealed by `spec`: a fresh nonce in it) and returns it.
Result<std::string> SendHeader(collective::Communicator& comm, int receiver, int64_t step,
                               const state::StateRegistry& reg, int shard, SealSpec spec) {
  const std::string nonce =
      spec.key != nullptr ? crypto::RandomBytes(CopySeal::kNonceBytes) : std::string();
  std::string header = EncodeHeader(step, reg, shard, nonce);
  NONSTOP_RETURN_IF_ERROR(comm.Send(receiver, std::as_bytes(std::span(header))));
  return header;
}

}  // namespace

Status Serve(collective::Communicator& comm, state::StateRegistry& reg, int receiver, int64_t step,
             const std::vector<uint32_t>* known, bool sharded, SourceFaults* faults, SealSpec spec,
             int shard) {
  NONSTOP_ASSIGN_OR_RETURN(
      const std::string header,
      SendHeader(comm, receiver, step, reg, shard >= 0 ? shard : reg.held_shard(), spec));
  std::optional<CopySeal> seal;
  if (spec.key != nullptr) {
    seal.emplace(*spec.key, sharded ? "shard" : "replicated", spec.generation, comm.rank(),
                 receiver, std::string_view(header).substr(0, kSealedHeaderBytes));
  }
  std::vector<uint32_t> table = known != nullptr ? *known : std::vector<uint32_t>{};
  bool table_sent = false;
  for (uint32_t request_no = 0;; ++request_no) {
    NONSTOP_ASSIGN_OR_RETURN(std::vector<uint32_t> request,
                             RecvU32s(comm, receiver, reg.num_chunks() + 1));
    if (request.empty()) return OkStatus();
    NONSTOP_ASSIGN_OR_RETURN(const std::vector<char> asked,
                             CheckRequest(comm, reg, request, sharded));
    const auto lanes = static_cast<int>(request[0]);
    std::span<const uint32_t> chunks(request.begin() + 1, request.end());
    const bool checksum_here = known == nullptr && !table_sent;
    std::vector<uint32_t> rest;  // the CRCs of the chunks not asked for, computed meanwhile
    std::jthread rest_thread;    // last: joined before what it uses goes
    if (checksum_here) {
      table.assign(reg.num_chunks(), 0);
      auto compute = [&] { rest = CrcTable(reg, sharded, shard, &asked, lanes); };
      try {
        rest_thread = std::jthread(compute);
      } catch (const std::system_error&) {
        compute();  // no thread to be had: first, then the chunks
      }
    }
    Status sent = OnLanes(lanes, [&](int lane) {
      return SendChunks(comm, reg, receiver, chunks, lane, lanes, &table, checksum_here, faults,
                        shard, RequestSeal{seal ? &*seal : nullptr, request_no});
    });
    if (rest_thread.joinable()) rest_thread.join();
    NONSTOP_RETURN_IF_ERROR(sent);
    if (checksum_here) {
      for (size_t c = 0; c < table.size(); ++c) {
        if (!asked[c]) table[c] = rest[c];
      }
    }
    if (!table_sent) {
      NONSTOP_RETURN_IF_ERROR(SendTable(comm, receiver, table, seal ? &*seal : nullptr, *faults));
    }
    table_sent = true;
  }
}

Status ServeRefusal(collective::Communicator& comm, const state::StateRegistry& reg, int receiver,
                    int64_t held_step, const Status& refusal, SealSpec spec) {
  NONSTOP_RETURN_IF_ERROR(
      SendHeader(comm, receiver, held_step, reg, reg.held_shard(), spec).status());
  NONSTOP_ASSIGN_OR_RETURN(std::vector<uint32_t> request,
                           RecvU32s(comm, receiver, reg.num_chunks() + 1));
  if (!request.empty()) {
    return FailedPreconditionError(fmt::format("{}; rank {} asked it for {} chunks all the same",
                                               refusal.message(), receiver, request.size() - 1));
  }
  return refusal;
}

Status CheckClaims(int source, const std::vector<uint32_t>& indices,
                   const std::vector<uint32_t>& claims, const std::vector<uint32_t>& table) {
  for (uint32_t c : indices) {
    if (claims[c] != table[c]) {
      return DataLossError(
          fmt::format("rank {} sent chunk {} with CRC {:08x}, but its table says {:08x}", source, c,
                      claims[c], table[c]));
    }
  }
  return OkStatus();
}

namespace {

// A source's word on a chunk it sends: its CRC and, sealed, its tag.
struct ChunkWord {
  uint32_t crc = 0;
  std::string tag;
};

// The {index, crc[, tag]} a source sends ahead of each chunk, on `lane`: the word, once the index
// is the one asked for (else DATA_LOSS), its CRC recorded in `claims` for CheckClaims.
Result<ChunkWord> RecvChunkMeta(collective::Communicator& comm, int source, int lane, uint32_t want,
                                std::vector<uint32_t>* claims, RequestSeal seal) {
  std::string meta(8 + (seal.seal != nullptr ? CopySeal::kTagBytes : 0), '\0');
  NONSTOP_RETURN_IF_ERROR(comm.RecvOnLane(
      source, lane, collective::HostRegion(std::as_writable_bytes(std::span(meta))), true));
  const uint32_t index = DecodeFixed32(meta.data());
  if (index != want)
    return DataLossError(
        fmt::format("rank {} sent chunk {} where chunk {} was asked for", source, index, want));
  (*claims)[index] = DecodeFixed32(meta.data() + 4);
  return ChunkWord{(*claims)[index], meta.substr(8)};
}

// Whether a chunk that landed carries its source's seal (true when unsealed); one that does not
// is fetched again like a chunk that fails its CRC. One that fails its seal but matches its CRC
// was altered on the way keeping its CRC, and that is logged (one that fails its CRC too is an
// accident, most likely: its CRC's check says so).
bool SealHolds(RequestSeal seal, int source, uint32_t index, const ChunkWord& word,
               std::span<const std::byte> bytes) {
  if (seal.seal == nullptr ||
      seal.seal->ChunkVerifies(seal.request, index, word.crc, bytes, word.tag)) {
    return true;
  }
  if (Crc32c(bytes.data(), bytes.size()) != word.crc) return false;
  NONSTOP_LOG_WARNING(
      "state chunk {} from rank {} fails its seal but matches its CRC: altered on the way by "
      "someone without the job key (a CRC is no seal), or not that rank's; fetched again",
      index, source);
  return false;
}

}  // namespace

Status Fetch(collective::Communicator& comm, const state::StateRegistry& reg, int source,
             const std::vector<uint32_t>& indices, std::vector<uint32_t>* claims,
             std::vector<uint32_t>* failed, std::atomic<uint64_t>* bytes, const ChunkSink& sink,
             RequestSeal seal) {
  NONSTOP_RETURN_IF_ERROR(SendRequest(comm, source, 1, indices));
  std::vector<std::byte> buf(reg.chunk_bytes());
  for (uint32_t want : indices) {
    NONSTOP_ASSIGN_OR_RETURN(ChunkWord word, RecvChunkMeta(comm, source, 0, want, claims, seal));
    std::span<std::byte> chunk(buf.data(), reg.chunk_size(want));
    NONSTOP_RETURN_IF_ERROR(comm.RecvUnchecked(source, chunk));  // the sink checks the CRC
    *bytes += chunk.size();
    if (!SealHolds(seal, source, want, word, chunk)) {
      failed->push_back(want);
      continue;
    }
    Status s = sink(want, chunk, word.crc);
    if (s.code() == StatusCode::kDataLoss) {
      failed->push_back(want);  // fetched again
    } else {
      NONSTOP_RETURN_IF_ERROR(s);
    }
  }
  return OkStatus();
}

namespace {

// Receiver side of RunStateTransfers, one lane: the chunks at positions lane, lane + lanes, ...
// of `indices` (the request FetchInPlace sent), straight into the live state, each checked
// against the CRC its source sent ahead of it, on this lane's thread as soon as it has landed: its
// bytes are still in this core's cache from the kernel's copy, so the check reads them at cache
// speed (about twice the speed of a pass over memory, docs/recovery.md), while the kernel goes on
// receiving the next chunk into the socket's buffer. A chunk that fails goes to `failed`; what the
// source said of each, to `claims` (each entry written by one lane: the request names a chunk
// once).
Status ReceiveInPlace(collective::Communicator& comm, state::StateRegistry& reg, int source,
                      const std::vector<uint32_t>& indices, int lane, int lanes,
                      std::vector<uint32_t>* claims, std::vector<uint32_t>* failed,
                      std::atomic<uint64_t>* bytes, RequestSeal seal) {
  std::vector<std::byte> buf;  // for chunks that span regions
  for (size_t p = static_cast<size_t>(lane); p < indices.size(); p += static_cast<size_t>(lanes)) {
    const uint32_t index = indices[p];
    NONSTOP_ASSIGN_OR_RETURN(ChunkWord word,
                             RecvChunkMeta(comm, source, lane, index, claims, seal));
    const size_t n = reg.chunk_size(index);
    std::span<std::byte> live = reg.ContiguousChunk(index);
    if (!live.empty()) {
      NONSTOP_RETURN_IF_ERROR(
          comm.RecvOnLane(source, lane, collective::HostRegion(live), /*checked=*/false));
      *bytes += n;
      if (Crc32c(live.data(), live.size()) != word.crc ||
          !SealHolds(seal, source, index, word, live)) {
        failed->push_back(index);
      }
      continue;
    }
    if (buf.size() < n) buf.resize(reg.chunk_bytes());
    std::span<std::byte> chunk(buf.data(), n);
    NONSTOP_RETURN_IF_ERROR(
        comm.RecvOnLane(source, lane, collective::HostRegion(chunk), /*checked=*/false));
    *bytes += n;
    if (!SealHolds(seal, source, index, word, chunk)) {
      failed->push_back(index);
      continue;
    }
    Status s = reg.WriteChunk(index, chunk, word.crc);
    if (s.code() == StatusCode::kDataLoss) {
      failed->push_back(index);
    } else {
      NONSTOP_RETURN_IF_ERROR(s);
    }
  }
  return OkStatus();
}

}  // namespace

Status FetchInPlace(collective::Communicator& comm, state::StateRegistry& reg, int source,
                    const std::vector<uint32_t>& indices, int lanes, std::vector<uint32_t>* claims,
                    std::vector<uint32_t>* failed, std::atomic<uint64_t>* bytes, RequestSeal seal) {
  NONSTOP_RETURN_IF_ERROR(SendRequest(comm, source, lanes, indices));
  std::vector<std::vector<uint32_t>> failed_on(static_cast<size_t>(lanes));
  // A failed lane fails the whole copy (RunStateTransfers returns the error, the controller
  // plans again): the communicator is aborted at once, which stops this source's other lanes and
  // the other sources' copies, instead of letting them finish what no one will use.
  Status s = OnLanes(
      lanes,
      [&](int lane) {
        return ReceiveInPlace(comm, reg, source, indices, lane, lanes, claims,
                              &failed_on[static_cast<size_t>(lane)], bytes, seal);
      },
      [&](const Status& failed_lane) {
        comm.Abort(fmt::format("the state copy from rank {} failed on one of its {} streams: {}",
                               source, lanes, failed_lane.message()));
      });
  for (const auto& f : failed_on) failed->insert(failed->end(), f.begin(), f.end());
  return s;
}

std::string SourceName(const control::PlanMsg& plan, int rank) {
  return fmt::format("rank {} (worker {})", rank,
                     plan.members[static_cast<size_t>(rank)].worker_id);
}

}  // namespace nonstop::worker
