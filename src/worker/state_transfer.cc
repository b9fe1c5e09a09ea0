#include "worker/state_transfer.h"

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
constexpr size_t kHeaderBytes = 60;
constexpr uint32_t kHeaderSealed = 1;  // the header's flags
// A source's share of the copy gets one stream (lane) per this many bytes (StreamsFor).
constexpr uint64_t kBytesPerStream = uint64_t{32} << 20;

int RankOf(const control::PlanMsg& plan, int worker_id) {
  for (size_t r = 0; r < plan.members.size(); ++r) {
    if (plan.members[r].worker_id == worker_id) return static_cast<int>(r);
  }
  return -1;
}

// Whether a copy is sealed and, if so, with what: the key of the data connections and the
// generation each copy's key is bound to (CopySeal).
struct SealSpec {
  const crypto::Key* key = nullptr;  // none: unsealed
  uint64_t generation = 0;
};

SealSpec SealOf(const TransferHooks& hooks, uint64_t generation) {
  return {hooks.seal_key ? &*hooks.seal_key : nullptr, generation};
}

// The seal of one request's chunks: the copy's (none: unsealed) and the request's number.
struct RequestSeal {
  const CopySeal* seal = nullptr;
  uint32_t request = 0;
};

// The faults a source injects (TransferHooks), each into one chunk across all its receivers.
struct SourceFaults {
  explicit SourceFaults(const TransferHooks& hooks)
      : corrupt(hooks.corrupt_first_chunk),
        tamper_pending(hooks.tamper_first_chunk != nullptr),
        tamper(hooks.tamper_first_chunk),
        tamper_table(hooks.tamper_table) {}
  std::atomic<bool> corrupt;
  std::atomic<bool> tamper_pending;
  const std::function<void(std::span<std::byte>)>& tamper;
  const std::function<void(std::string&)>& tamper_table;  // every table sent
};

// What a source's header says beyond the layout: the step it holds, and, sealed, the header's
// bytes that the seal's key is bound to (empty: unsealed).
struct Header {
  int64_t step = 0;
  std::string sealed;
};

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

// Checks a source's header against this worker's state (magic, checksum,
// group size, layout, the seal this worker's setting asks for: `sealed`; with `want_shard` >= 0,
// the receiver copies the sharded chunks, which must be of that shard) and returns the step it
// names, which is the caller's to judge, and the seal's nonce.
Result<Header> ParseHeader(const std::string& h, const state::StateRegistry& reg,
                           const std::string& source, bool sealed, int want_shard = -1) {
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

// ParseHeader, and the step must be `want_step` (the shard exchange, whose
// sources' steps ExchangeShards checked against what they all-gathered).
Result<Header> CheckHeader(const std::string& h, int64_t want_step, const state::StateRegistry& reg,
                           const std::string& source, bool sealed, int want_shard = -1) {
  NONSTOP_ASSIGN_OR_RETURN(Header header, ParseHeader(h, reg, source, sealed, want_shard));
  if (header.step != want_step) {
    return DataLossError(
        fmt::format("{} offers the state of step {}, but the plan resumes after step {}", source,
                    header.step, want_step));
  }
  return header;
}

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

std::vector<uint32_t> CrcTable(const state::StateRegistry& reg, bool sharded, int shard = -1,
                               const std::vector<char>* skip = nullptr, unsigned busy = 0) {
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

// A source's CRC table, which follows its first request's chunks (of this worker's layout: its
// header said so). DATA_LOSS when `seal` and the table fails it.
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

// Tells each of `sources` that this receiver is done with it (the empty request), every one of them
// even after a send failed: the first failure.
Status TellDone(collective::Communicator& comm, const std::vector<int>& sources) {
  Status first;
  for (int source : sources) {
    Status s = SendU32s(comm, source, {});
    if (first.ok()) first = s;
  }
  return first;
}

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

// The streams (lanes) for copying `chunks` from one source: `asked` (> 0: the caller's), else
// one per kBytesPerStream of them, within the transport's lanes and the number of chunks.
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

// Of the results of work run at once, where a failure aborts the rest: the cause (the first error
// that is no abort), else the first error, else OK.
Status CauseOf(std::span<const Status> results) {
  for (const Status& s : results) {
    if (!s.ok() && s.code() != StatusCode::kAborted) return s;
  }
  for (const Status& s : results) NONSTOP_RETURN_IF_ERROR(s);
  return OkStatus();
}

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

// Source side: serve one receiver until it says it is done. It sends its header (`step`: the step
// its state holds) and waits for a request; it streams the chunks asked for over the lanes the
// request names (SendRequest), the bytes unchecked by the transport
// (Communicator::SendUnchecked), then, after the first request's chunks, its CRC table, against
// which the receiver judges them (with the tables of all its sources); later requests (chunks
// fetched again) come after the table. `known`: the table, computed before (the shard exchange:
// its digest was all-gathered; the state transfer to several receivers); without it the chunks
// asked are checksummed by SendChunks as they go out, and the others by a thread of their own
// meanwhile, so no pass over the state stands between the receiver's request and its first byte
// (docs/recovery.md). `sharded`: the shard exchange (its chunks are the sharded ones). `shard` >=
// 0: the receiver's shard, read from a registry that holds every shard. With `spec` sealed, a
// fresh nonce in the header and a tag on every chunk and on the table (CopySeal).
Status Serve(collective::Communicator& comm, state::StateRegistry& reg, int receiver, int64_t step,
             const std::vector<uint32_t>* known, bool sharded, SourceFaults* faults, SealSpec spec,
             int shard = -1) {
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

// A source whose state holds another step than the plan says (`refusal`
// names both): it still sends its header, naming the step it holds, so that
// the receiver learns at once that it serves nothing; then it waits for the
// receiver's done and returns `refusal`.
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

// Where a fetched chunk goes: the live state (WriteChunk), or a staging buffer.
// DATA_LOSS: the chunk failed its checksum (fetched again).
using ChunkSink =
    std::function<Status(uint32_t index, std::span<const std::byte> data, uint32_t crc)>;

// What a source said of the chunks it sent (`claims`: the CRC in each {index, crc}) against its
// table, which came after them: DATA_LOSS naming the first chunk where they differ.
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

// Receiver side: fetch `indices` from one source, on lane 0, into a buffer, each chunk handed to
// `sink` with the CRC the source sent ahead of it (the sink checks it). Chunks that fail go to
// `failed`; what the source said of each goes to `claims`. The request goes even for no chunk:
// the first one is what the source sends its table after.
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

// Receiver side of RunStateTransfers: fetch `indices` from one source
// straight into the live state, over `lanes` streams at once (a chunk that spans regions goes
// through a buffer and WriteChunk, which checks it at once). Until the transfer has succeeded
// the state holds no step (the session says so while it runs), and a chunk that fails its check,
// or that the majority of the sources' tables gives another CRC, is fetched again over it. The
// request goes even for no chunk (the first one is what the source sends its table after).
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

// The shape of the plan's shard moves (ValidatePlan): whether their sources
// hold the shards is ExchangeShards's to check, against what they say.
Status ValidateShardMoves(const control::PlanMsg& plan, const std::set<int>& ids,
                          const std::function<Status(const std::string&)>& bad) {
  if (!plan.shard_moves.empty() && plan.shard_group <= 0)
    return bad("it moves shards but names no shard_group");
  std::set<int> receivers;
  for (const auto& m : plan.shard_moves) {
    const int rank = RankOf(plan, m.receiver);
    if (rank < 0) return bad(fmt::format("shard receiver worker {} is not a member", m.receiver));
    if (!receivers.insert(m.receiver).second)
      return bad(fmt::format("worker {} receives a shard twice", m.receiver));
    // state::LayoutOf: rank r holds shard r mod G, whatever the world.
    if (m.shard != rank % plan.shard_group) {
      return bad(fmt::format(
          "worker {} is to receive shard {}, but its rank {} holds shard {} of groups of {}",
          m.receiver, m.shard, rank, rank % plan.shard_group, plan.shard_group));
    }
    std::set<int> seen;
    for (int src : m.sources) {
      if (!ids.count(src)) {
        return bad(fmt::format("source worker {} of shard {} for worker {} is not a member", src,
                               m.shard, m.receiver));
      }
      if (src == m.receiver)
        return bad(fmt::format("worker {} is its own source of shard {}", src, m.shard));
      if (!seen.insert(src).second) {
        return bad(fmt::format("worker {} is a source of shard {} for worker {} twice", src,
                               m.shard, m.receiver));
      }
    }
  }
  return OkStatus();
}

// What a source of the state transfer offers: its header's step, and its CRC table once its
// first request's chunks have come.
struct Offer {
  int rank = -1;
  int64_t step = 0;
  std::vector<uint32_t> table;
  std::optional<CopySeal> seal;  // sealed copies
  uint32_t requests = 0;         // sent to it so far (the seal's request numbers)
};

// Receiver side: every source's header, checked (a corrupt header, another
// layout or group size: DATA_LOSS). Sources that hold another step than
// `step` are dropped with a warning and told at once that the receiver is
// done with them; the others are returned. DATA_LOSS naming each source and
// its step when none holds `step`. On a failure, every source is told
// "done" (best effort), so none waits for a request that will not come.
Result<std::vector<Offer>> GatherOffers(collective::Communicator& comm,
                                        const state::StateRegistry& reg,
                                        const control::PlanMsg& plan, int64_t step,
                                        const std::vector<int>& sources, SealSpec spec) {
  std::vector<Offer> offers;
  // Every source sent its header at once and waits for a request: all of them, read or not, are
  // told "done", so that none waits for a request that will not come.
  auto end_all = [&](const Status& s) {
    (void)TellDone(comm, sources);
    return s;
  };
  for (int source : sources) {
    std::string header(kHeaderBytes, '\0');
    Status s = comm.Recv(source, std::as_writable_bytes(std::span(header)));
    if (!s.ok()) return end_all(s);
    Result<Header> held = ParseHeader(header, reg, SourceName(plan, source), spec.key != nullptr);
    if (!held.ok()) return end_all(held.status());
    Offer& o = offers.emplace_back(Offer{source, held->step, {}, std::nullopt, 0});
    if (spec.key != nullptr) {
      o.seal.emplace(*spec.key, "replicated", spec.generation, source, comm.rank(), held->sealed);
    }
  }
  std::vector<Offer> valid;
  std::vector<std::string> others;
  for (Offer& o : offers) {
    if (o.step == step) {
      valid.push_back(std::move(o));
      continue;
    }
    others.push_back(fmt::format("{} holds step {}", SourceName(plan, o.rank), o.step));
    NONSTOP_LOG_WARNING(
        "state transfer of generation {}: {} holds the state of step {}, not step {} that the "
        "plan resumes after: dropped, its chunks are copied from the other sources",
        plan.generation, SourceName(plan, o.rank), o.step, step);
    (void)SendU32s(comm, o.rank, {});  // done: it serves nothing
  }
  if (valid.empty()) {
    return DataLossError(fmt::format(
        "no source holds the state of step {} that the plan of generation {} resumes after: {}",
        step, plan.generation, fmt::join(others, ", ")));
  }
  return valid;
}

std::string ListChunks(const std::vector<uint32_t>& chunks) {
  constexpr size_t kShown = 16;
  if (chunks.size() <= kShown) return fmt::format("{}", fmt::join(chunks, ", "));
  return fmt::format("{} and {} more", fmt::join(chunks.begin(), chunks.begin() + kShown, ", "),
                     chunks.size() - kShown);
}

// Which sources' copies of each wanted chunk the receiver keeps: those whose
// table gives it the CRC a majority of the sources' tables give it. A chunk
// of per-rank regions is the first source's, unvoted: the members' copies
// differ by design, and each such region then comes from one source.
// `agrees[i][c]`: source i's table gives chunk c that CRC. Replicas that
// disagree are logged once, naming the chunks and the sources in the minority.
struct Expected {
  std::vector<std::vector<char>> agrees;  // [source][chunk]
};

// A chunk whose sources disagree with no majority (two sources, one of them
// silently corrupt) is kept from none of them: which copy is right cannot be
// told, and keeping one would hand the next replica check a false majority.
// The plan names every holder as a source up to kMaxSourcesPerReceiver (8),
// so no other holder can break the tie (beyond 8, a tie needs 4 sources
// corrupt alike): the copy fails as data loss, and what the first round
// wrote is left as a state that holds no valid step.
Status NoMajority(const state::StateRegistry& reg, const std::vector<Offer>& offers,
                  const std::vector<uint32_t>& undecided, const control::PlanMsg& plan) {
  const uint32_t c = undecided.front();
  std::vector<std::string> crcs;
  for (const Offer& o : offers)
    crcs.push_back(fmt::format("{} {:08x}", SourceName(plan, o.rank), o.table[c]));
  return DataLossError(fmt::format(
      "the sources of state chunk {} (bytes {}+{} of the state, in {}) of step {} {} ({}){}: it "
      "is not copied",
      c, reg.chunk_offset(c), reg.chunk_size(c), fmt::join(reg.RegionsOfChunk(c), ", "),
      plan.resume_step - 1, kReplicaDisagreement, fmt::join(crcs, ", "),
      undecided.size() > 1 ? fmt::format(", and of {} more chunk(s)", undecided.size() - 1) : ""));
}

Result<Expected> MajorityOf(const state::StateRegistry& reg, const std::vector<Offer>& offers,
                            const std::vector<uint32_t>& wanted, const control::PlanMsg& plan) {
  const size_t k = offers.size();
  Expected e;
  for (const Offer& o : offers) e.agrees.emplace_back(o.table.size(), 1);
  std::map<int, std::vector<uint32_t>> minority;  // source rank → chunks
  std::vector<uint32_t> undecided;                // chunks without a majority
  for (uint32_t c : wanted) {
    if (reg.chunk_per_rank(c)) {
      for (size_t i = 1; i < k; ++i) e.agrees[i][c] = offers[i].table[c] == offers[0].table[c];
      continue;
    }
    std::map<uint32_t, size_t> votes;
    for (const Offer& o : offers) ++votes[o.table[c]];
    if (votes.size() == 1) continue;  // every table agrees
    auto best = std::max_element(votes.begin(), votes.end(),
                                 [](const auto& x, const auto& y) { return x.second < y.second; });
    if (2 * best->second <= k) {
      undecided.push_back(c);
      continue;
    }
    for (size_t i = 0; i < k; ++i) {
      if (offers[i].table[c] == best->first) continue;
      e.agrees[i][c] = 0;
      minority[offers[i].rank].push_back(c);
    }
  }
  if (!undecided.empty()) return NoMajority(reg, offers, undecided, plan);
  if (!minority.empty()) {
    std::vector<std::string> parts;
    for (const auto& [rank, chunks] : minority) {
      parts.push_back(
          fmt::format("{} differs from the majority on chunk(s) {} (copied from the "
                      "others)",
                      SourceName(plan, rank), ListChunks(chunks)));
    }
    NONSTOP_LOG_WARNING("state transfer of generation {}: the sources' states diverge: {}",
                        plan.generation, fmt::join(parts, "; "));
  }
  return e;
}

// One round of the receiver's fetches, from every source at once, each over the lanes StreamsFor
// gives its list: the chunks lists[i] from source i (in the first round every source gets its
// request, even for no chunk, and answers it with its table too, read here; later rounds skip
// sources with nothing to fetch). Chunks that fail their check go to failed[i]; each source's word
// on its chunks goes to claims[i] and is checked against its table. Returns the first error, its
// cause rather than the abort it made of the other sources' copies (FetchInPlace).
Status FetchRound(collective::Communicator& comm, state::StateRegistry& reg,
                  std::vector<Offer>& offers, const std::vector<std::vector<uint32_t>>& lists,
                  bool first, int streams_per_source, std::vector<std::vector<uint32_t>>* claims,
                  std::vector<std::vector<uint32_t>>* failed, std::atomic<uint64_t>* bytes,
                  int* most_streams) {
  const size_t k = offers.size();
  std::vector<Status> results(k);
  std::vector<int> streams(k, 0);
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < k; ++i) {
      if (!first && lists[i].empty()) continue;
      threads.emplace_back([&, i] {
        streams[i] = StreamsFor(comm, reg, lists[i], streams_per_source);
        Offer& o = offers[i];
        const CopySeal* seal = o.seal ? &*o.seal : nullptr;
        Status s = FetchInPlace(comm, reg, o.rank, lists[i], streams[i], &(*claims)[i],
                                &(*failed)[i], bytes, RequestSeal{seal, o.requests++});
        if (s.ok() && first) {
          Result<std::vector<uint32_t>> table = RecvTable(comm, reg, o.rank, seal);
          if (table.ok()) offers[i].table = std::move(*table);
          s = table.status();
        }
        if (s.ok()) s = CheckClaims(offers[i].rank, lists[i], (*claims)[i], offers[i].table);
        results[i] = s;
      });
    }
  }
  *most_streams = std::max(*most_streams, *std::max_element(streams.begin(), streams.end()));
  return CauseOf(results);
}

}  // namespace

Status ValidatePlan(const control::PlanMsg& plan, int my_worker_id) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError(
        fmt::format("plan of generation {} is malformed: {}", plan.generation, what));
  };
  if (plan.members.empty()) return bad("it has no members");
  if (plan.resume_step < 0) return bad(fmt::format("resume step {} is negative", plan.resume_step));
  std::set<int> ids;
  for (const auto& m : plan.members) {
    if (m.worker_id < 0) return bad(fmt::format("member worker id {} is negative", m.worker_id));
    if (!ids.insert(m.worker_id).second)
      return bad(fmt::format("worker {} is a member twice", m.worker_id));
    if (!net::ParseHostPort(m.address).ok()) {
      return bad(fmt::format("worker {}'s address '{}' is not host:port", m.worker_id, m.address));
    }
  }
  if (!ids.count(my_worker_id))
    return bad(fmt::format("it does not include this worker ({})", my_worker_id));
  std::set<int> receivers;
  for (const auto& t : plan.transfers) {
    if (!ids.count(t.receiver))
      return bad(fmt::format("receiver worker {} is not a member", t.receiver));
    if (!receivers.insert(t.receiver).second)
      return bad(fmt::format("worker {} receives twice", t.receiver));
    if (t.sources.empty()) return bad(fmt::format("worker {} receives from no source", t.receiver));
    for (int src : t.sources) {
      if (!ids.count(src))
        return bad(fmt::format("source worker {} of receiver {} is not a member", src, t.receiver));
      if (src == t.receiver) return bad(fmt::format("worker {} is its own source", src));
    }
  }
  return ValidateShardMoves(plan, ids, bad);
}

Result<TransferOutcome> RunStateTransfers(collective::Communicator& comm, state::StateRegistry& reg,
                                          const control::PlanMsg& plan, int my_worker_id,
                                          int64_t held_step, const TransferHooks& hooks) {
  TransferOutcome outcome;
  const int64_t step = plan.resume_step - 1;
  std::vector<int> serve_to;    // receiver ranks
  std::vector<int> fetch_from;  // source ranks
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
    const Status refusal = held_step == step
                               ? OkStatus()
                               : FailedPreconditionError(fmt::format(
                                     "the plan of generation {} asks worker {} to serve the state "
                                     "of step {}, but its state holds step {}: refused",
                                     plan.generation, my_worker_id, step, held_step));
    SourceFaults faults(hooks);
    const SealSpec spec = SealOf(hooks, plan.generation);
    // One receiver: its chunks are checksummed as they go out, the rest meanwhile (Serve).
    // Several (two spares at once): one table for all, computed first, not a pass per receiver.
    const bool shared = refusal.ok() && serve_to.size() > 1;
    const std::vector<uint32_t> table =
        shared ? CrcTable(reg, /*sharded=*/false) : std::vector<uint32_t>{};
    std::vector<Status> results(serve_to.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < serve_to.size(); ++i) {
      threads.emplace_back([&, i] {
        results[i] = refusal.ok()
                         ? Serve(comm, reg, serve_to[i], held_step, shared ? &table : nullptr,
                                 /*sharded=*/false, &faults, spec)
                         : ServeRefusal(comm, reg, serve_to[i], held_step, refusal, spec);
      });
    }
    for (auto& t : threads) t.join();
    for (const Status& s : results) NONSTOP_RETURN_IF_ERROR(s);
    return outcome;
  }

  outcome.received = true;
  // Sharded chunks are this receiver's shard, which ExchangeShards copies
  // from its holders; the plan's sources may hold other shards.
  std::vector<uint32_t> wanted;
  for (uint32_t c = 0; c < reg.num_chunks(); ++c) {
    if (!reg.chunk_sharded(c)) wanted.push_back(c);
  }
  NONSTOP_ASSIGN_OR_RETURN(
      std::vector<Offer> offers,
      GatherOffers(comm, reg, plan, step, fetch_from, SealOf(hooks, plan.generation)));
  const size_t k = offers.size();
  outcome.sources = static_cast<int>(k);
  // Striped: chunk i from source i mod k, all at once; each source's table follows its chunks.
  std::vector<std::vector<uint32_t>> assigned(k);
  // Per-rank chunks from the first source alone (MajorityOf): each such region is one source's.
  for (size_t i = 0; i < wanted.size(); ++i)
    assigned[reg.chunk_per_rank(wanted[i]) ? 0 : i % k].push_back(wanted[i]);
  std::vector<std::vector<uint32_t>> failed(k);
  std::vector<std::vector<uint32_t>> claims(k, std::vector<uint32_t>(reg.num_chunks(), 0));
  std::atomic<uint64_t> bytes{0};
  // Every source has a request from here on. On a failure each is told it is done (best effort:
  // one that has sent all it was asked returns at once) and this worker's communicator is
  // aborted, which stops what of the copy still runs here.
  std::vector<int> from;  // the sources' ranks
  for (const Offer& o : offers) from.push_back(o.rank);
  auto fail = [&](const Status& s) {
    // What landed is a mix of sources: the state holds no valid step (the session's mark), nor
    // a valid shard.
    if (reg.shard_group() > 0) reg.set_held_shard(state::kNoShard);
    (void)TellDone(comm, from);
    comm.Abort(
        fmt::format("the state copy of generation {} failed: {}", plan.generation, s.message()));
    return s;
  };
  if (Status s = FetchRound(comm, reg, offers, assigned, /*first=*/true, hooks.streams_per_source,
                            &claims, &failed, &bytes, &outcome.streams_per_source);
      !s.ok()) {
    return fail(s);
  }
  const Result<Expected> majority = MajorityOf(reg, offers, wanted, plan);
  if (!majority.ok()) return fail(majority.status());
  const Expected& expected = *majority;
  // Fetched again, from the next source whose table agrees with the majority (a round per
  // attempt, each source's share in one request): the chunks that failed their check, and those
  // whose source's table is not the majority's (their bytes are that source's, outvoted).
  std::map<uint32_t, size_t> pending;  // chunk → the source it came from first
  for (size_t i = 0; i < k; ++i) {
    for (uint32_t c : assigned[i]) {
      if (!expected.agrees[i][c]) pending[c] = i;
    }
    for (uint32_t c : failed[i]) pending[c] = i;
  }
  for (size_t attempt = 1; attempt <= k && !pending.empty(); ++attempt) {
    std::vector<std::vector<uint32_t>> lists(k), again(k);
    for (const auto& [c, from] : pending) {
      const size_t to = (from + attempt) % k;
      if (expected.agrees[to][c]) lists[to].push_back(c);
    }
    if (Status s = FetchRound(comm, reg, offers, lists, /*first=*/false, hooks.streams_per_source,
                              &claims, &again, &bytes, &outcome.streams_per_source);
        !s.ok()) {
      return fail(s);
    }
    for (size_t to = 0; to < k; ++to) {
      outcome.refetched_chunks += static_cast<int>(lists[to].size());
      const std::set<uint32_t> bad(again[to].begin(), again[to].end());
      for (uint32_t c : lists[to]) {
        if (!bad.count(c)) pending.erase(c);
      }
    }
  }
  if (!pending.empty()) {
    return fail(DataLossError(fmt::format("state chunk {} failed its checksum from every source",
                                          pending.begin()->first)));
  }
  NONSTOP_RETURN_IF_ERROR(TellDone(comm, from));
  outcome.bytes_received = bytes.load();
  // The rest of the state is of the newer step now, the shards it holds are not.
  if (reg.shard_group() > 0) reg.set_held_shard(state::kNoShard);
  return outcome;
}

namespace {

// What one member tells the others before re-sharding (24 bytes): the
// digest is ShardDigest of the one shard it holds (0 for none or every).
struct ShardRecord {
  int group = 0;
  int held = state::kNoShard;
  int64_t step = control::kNoValidState;
  uint32_t digest = 0;
};
constexpr size_t kShardRecordBytes = 24;

std::string EncodeShardRecord(const ShardRecord& r) {
  std::string out;
  PutFixed32(&out, static_cast<uint32_t>(r.group));
  PutFixed32(&out, static_cast<uint32_t>(r.held));
  PutFixed64(&out, static_cast<uint64_t>(r.step));
  PutFixed32(&out, r.digest);
  PutFixed32(&out, 0);
  return out;
}

ShardRecord DecodeShardRecord(const std::byte* p) {
  const char* c = reinterpret_cast<const char*>(p);
  return {static_cast<int>(static_cast<int32_t>(DecodeFixed32(c))),
          static_cast<int32_t>(DecodeFixed32(c + 4)), static_cast<int64_t>(DecodeFixed64(c + 8)),
          DecodeFixed32(c + 16)};
}

// A shard's digest: the CRC-32C of its chunks' CRCs, in chunk order (a
// CrcTable of the shard's chunks, 0 elsewhere). A holder computes it from
// the table it serves from; a receiver from the checked CRCs of what it staged.
uint32_t ShardDigest(std::span<const uint32_t> table) {
  std::string bytes;
  for (uint32_t crc : table) PutFixed32(&bytes, crc);  // the wire's byte order, not the host's
  return Crc32c(bytes);
}

// What every member says its sharded state holds, by rank.
struct Holdings {
  std::vector<int> held;          // a shard, kEveryShard or kNoShard
  std::vector<int64_t> steps;     // of which step
  std::vector<uint32_t> digests;  // ShardDigest of the one shard held

  bool Holds(int q, int shard, int64_t step) const {
    const int h = held[static_cast<size_t>(q)];
    return steps[static_cast<size_t>(q)] == step && (h == shard || h == state::kEveryShard);
  }
  std::string Describe(int q) const {
    const int h = held[static_cast<size_t>(q)];
    const int64_t s = steps[static_cast<size_t>(q)];
    if (h == state::kNoShard) return fmt::format("no shard (its state is of step {})", s);
    if (h == state::kEveryShard) return fmt::format("every shard of step {}", s);
    return fmt::format("shard {} of step {}", h, s);
  }
};

// All-gathers (group size, held shard, step, digest of the held shard) of every member. Not to
// plan: to check the plan's moves against what each member says it holds, the same claims on every
// member.
Result<Holdings> GatherHoldings(collective::Communicator& comm, int group, int held,
                                int64_t held_step, uint32_t digest) {
  constexpr size_t kRecord = kShardRecordBytes;
  std::vector<std::byte> records(kRecord * static_cast<size_t>(comm.world_size()));
  std::string mine = EncodeShardRecord({group, held, held_step, digest});
  std::memcpy(records.data() + kRecord * static_cast<size_t>(comm.rank()), mine.data(), kRecord);
  NONSTOP_RETURN_IF_ERROR(comm.AllGather(records, kRecord));
  Holdings out;
  out.held.resize(static_cast<size_t>(comm.world_size()));
  out.steps.resize(out.held.size());
  out.digests.resize(out.held.size());
  for (size_t q = 0; q < out.held.size(); ++q) {
    ShardRecord r = DecodeShardRecord(records.data() + kRecord * q);
    if (r.group != group) {
      return InvalidArgumentError(
          fmt::format("rank {} shards its optimizer state over groups of {}, this worker over "
                      "groups of {}: every worker must run the same optimizer.shard_group",
                      q, r.group, group));
    }
    if (r.held < state::kNoShard || r.held >= group) {
      return DataLossError(
          fmt::format("rank {} claims to hold shard {} of groups of {}", q, r.held, group));
    }
    out.held[q] = r.held;
    out.steps[q] = r.step;
    out.digests[q] = r.digest;
  }
  return out;
}

// The plan's shard moves, by rank.
struct RankedMoves {
  std::vector<int> receivers;  // ranks, in the plan's order
  // index = rank: the ranks of its sources, in the plan's order
  std::vector<std::vector<int>> sources;
};

// Checks the plan's shard moves against every member's claims and returns
// them by rank. The plan is the controller's decision, made from the joins
// and Readies; the claims are what the members hold now. Where they differ,
// copying would put wrong state live, so the generation fails instead.
Result<RankedMoves> CheckShardMoves(const control::PlanMsg& plan, const state::ShardLayout& layout,
                                    const Holdings& holdings, int64_t step) {
  auto disagree = [&](const std::string& what) {
    return FailedPreconditionError(fmt::format(
        "the shard moves of the plan of generation {} disagree with what the members hold: {}",
        plan.generation, what));
  };
  const int group = layout.group_size;
  if (plan.shard_group != group) {
    return InvalidArgumentError(
        fmt::format("the plan of generation {} shards the optimizer state over groups of {}, "
                    "this worker over groups of {}: every worker must run the same "
                    "optimizer.shard_group",
                    plan.generation, plan.shard_group, group));
  }
  if (plan.members.size() != static_cast<size_t>(layout.world())) {
    return InternalError(
        fmt::format("plan of {} members for a world of {}", plan.members.size(), layout.world()));
  }
  RankedMoves out;
  out.sources.resize(plan.members.size());
  std::vector<char> moved(plan.members.size(), 0);
  std::vector<int> lost;
  for (const control::PlanShardMove& m : plan.shard_moves) {
    const int r = RankOf(plan, m.receiver);
    if (r < 0 || moved[static_cast<size_t>(r)]) {
      return disagree(fmt::format("worker {} is no member, or receives twice", m.receiver));
    }
    const int need = layout.shard_of_rank[static_cast<size_t>(r)];
    if (m.shard != need) {
      return disagree(
          fmt::format("{} is to receive shard {}, but its rank holds shard {} (rank mod {})",
                      SourceName(plan, r), m.shard, need, group));
    }
    if (holdings.Holds(r, need, step)) {
      return disagree(fmt::format("{} is to receive shard {} of step {}, which it holds already",
                                  SourceName(plan, r), need, step));
    }
    moved[static_cast<size_t>(r)] = 1;
    out.receivers.push_back(r);
    for (int id : m.sources) {
      const int q = RankOf(plan, id);
      if (q < 0 || q == r)
        return disagree(fmt::format("worker {} is no source for {}", id, SourceName(plan, r)));
      if (!holdings.Holds(q, need, step)) {
        return disagree(fmt::format("{} is to serve shard {} of step {} to {}, but it holds {}",
                                    SourceName(plan, q), need, step, SourceName(plan, r),
                                    holdings.Describe(q)));
      }
      out.sources[static_cast<size_t>(r)].push_back(q);
    }
    if (m.sources.empty()) lost.push_back(need);
  }
  for (int r = 0; r < layout.world(); ++r) {
    const int need = layout.shard_of_rank[static_cast<size_t>(r)];
    if (!moved[static_cast<size_t>(r)] && !holdings.Holds(r, need, step)) {
      return disagree(fmt::format(
          "{} holds {}, not shard {} of step {} (its rank's), and the plan moves nothing to "
          "it",
          SourceName(plan, r), holdings.Describe(r), need, step));
    }
  }
  // the controller planned it so (a shard its releases left nobody): every member says it
  if (!lost.empty()) {
    std::sort(lost.begin(), lost.end());
    lost.erase(std::unique(lost.begin(), lost.end()), lost.end());
    return DataLossError(
        fmt::format("every copy of shard {} of the optimizer state of step {} is lost: no member "
                    "holds it",
                    fmt::join(lost, ", "), step));
  }
  return out;
}

// One member's part of the moves: with each peer, serve it, fetch from it,
// or both (two members swapping shards).
struct PeerWork {
  bool serve = false;  // it is a receiver, and this member one of its sources
  // it is one of this member's sources: header, request, the chunks (maybe none), table, done
  bool fetch = false;
  std::vector<uint32_t> chunks;  // what this member fetches from it
};

std::map<int, PeerWork> PeersOf(const RankedMoves& moves, int me,
                                const std::vector<uint32_t>& sharded) {
  std::map<int, PeerWork> peers;  // rank → the work with it
  const std::vector<int>& mine = moves.sources[static_cast<size_t>(me)];
  if (!mine.empty()) {  // a receiver (CheckShardMoves refused one without sources)
    // Striped: chunk i from the i-th source modulo their count, in the plan's order.
    for (int q : mine) peers[q].fetch = true;
    for (size_t i = 0; i < sharded.size(); ++i)
      peers[mine[i % mine.size()]].chunks.push_back(sharded[i]);
  }
  for (int r : moves.receivers) {
    const auto& src = moves.sources[static_cast<size_t>(r)];
    if (std::find(src.begin(), src.end(), me) != src.end()) peers[r].serve = true;
  }
  return peers;
}

// The digest of each shard moved that its holders' majority has.
using ShardDigests = std::map<int, uint32_t>;

// The holders of a shard are its witnesses, as the replicas are for the
// replicated state: for each shard moved, the digest more than half of its
// holders of `step` have is the shard's, a holder with another one serves
// nobody (it is taken off every receiver's sources: every member drops the
// same ones, from the same claims), and a shard whose holders have no
// majority (two that differ) is not copied at all. Returns the shard → its
// majority digest, for the receivers' check of what they staged. A member
// holding every shard (the initial state) is no witness and stays a source.
Result<ShardDigests> TrustTheMajority(const Holdings& holdings, int64_t step,
                                      const state::ShardLayout& layout, int me,
                                      RankedMoves* moves) {
  ShardDigests majority;
  for (int receiver : moves->receivers) {
    const int shard = layout.shard_of_rank[static_cast<size_t>(receiver)];
    if (majority.count(shard)) continue;
    std::map<uint32_t, int> votes;
    int holders = 0;
    for (size_t q = 0; q < holdings.held.size(); ++q) {
      if (holdings.held[q] != shard || holdings.steps[q] != step) continue;
      ++votes[holdings.digests[q]];
      ++holders;
    }
    if (holders == 0) continue;  // served by members holding every shard
    auto best = std::max_element(votes.begin(), votes.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    if (2 * best->second <= holders) {
      std::string who;
      for (size_t q = 0; q < holdings.held.size(); ++q) {
        if (holdings.held[q] == shard && holdings.steps[q] == step)
          who += fmt::format("{}rank {} {:08x}", who.empty() ? "" : ", ", q, holdings.digests[q]);
      }
      return DataLossError(fmt::format(
          "{} {} of step {} disagree and no majority can tell which is right ({}): it is not "
          "copied",
          kShardDisagreement, shard, step, who));
    }
    majority[shard] = best->first;
  }
  for (int receiver : moves->receivers) {
    const int shard = layout.shard_of_rank[static_cast<size_t>(receiver)];
    auto it = majority.find(shard);
    if (it == majority.end()) continue;
    std::vector<int>& sources = moves->sources[static_cast<size_t>(receiver)];
    std::vector<int> trusted;
    for (int q : sources) {
      // With witnesses to check against, a member holding every shard (unchecked) serves nobody.
      if (holdings.held[static_cast<size_t>(q)] != shard) continue;
      if (holdings.digests[static_cast<size_t>(q)] != it->second) {
        if (me == receiver)
          NONSTOP_LOG_WARNING(
              "rank {}'s shard {} of step {} (digest {:08x}) differs from the majority of its "
              "holders ({:08x}): rank {} copies it from the others",
              q, shard, step, holdings.digests[static_cast<size_t>(q)], it->second, receiver);
        continue;
      }
      trusted.push_back(q);
    }
    if (trusted.empty()) {
      return DataLossError(fmt::format(
          "{} {} of step {} that the plan names as rank {}'s sources all differ from the "
          "majority of its holders: it is not copied",
          kShardDisagreement, shard, step, receiver));
    }
    sources = std::move(trusted);
  }
  return majority;
}

// Fetched shard chunks, held back until the commit: a member keeps serving
// the shard it holds while it fetches the one it will hold.
struct Staging {
  std::map<uint32_t, std::pair<size_t, uint32_t>> where;  // chunk → (offset in bytes, crc)
  std::vector<std::byte> bytes;

  Staging(const state::StateRegistry& reg, const std::vector<uint32_t>& chunks) {
    size_t size = 0;
    for (uint32_t c : chunks) {
      where[c] = {size, 0};
      size += reg.chunk_size(c);
    }
    bytes.resize(size);
  }
  Status Put(uint32_t index, std::span<const std::byte> data, uint32_t crc) {
    if (Crc32c(data.data(), data.size()) != crc)
      return DataLossError(fmt::format("state chunk {} fails its checksum", index));
    auto& [offset, kept_crc] = where.at(index);  // every index was asked for: it is there
    std::memcpy(bytes.data() + offset, data.data(), data.size());
    kept_crc = crc;
    return OkStatus();
  }
};

// A receiver's last word before anything is committed: what it staged has
// the digest the majority of the shard's holders have.
Status CheckStaged(const Staging& staging, const state::StateRegistry& reg, int shard, int64_t step,
                   const ShardDigests& majority) {
  auto it = majority.find(shard);
  if (it == majority.end()) return OkStatus();  // from members holding every shard
  std::vector<uint32_t> table(reg.num_chunks(), 0);
  for (const auto& [index, where] : staging.where) table[index] = where.second;
  const uint32_t staged = ShardDigest(table);
  if (staged == it->second) return OkStatus();
  return DataLossError(fmt::format(
      "shard {} of step {} as copied (digest {:08x}) differs from its holders' majority ({:08x})",
      shard, step, staged, it->second));
}

// This member's side of the moves with every peer at once, one thread each.
Status MoveWithPeers(collective::Communicator& comm, state::StateRegistry& reg,
                     const state::ShardLayout& layout, const std::map<int, PeerWork>& peers,
                     int64_t step, int64_t held_step, bool every,
                     const std::vector<uint32_t>& held_table, const TransferHooks& hooks,
                     SealSpec spec, Staging* staging, TransferOutcome* outcome) {
  const int me = comm.rank();
  const int need = layout.shard_of_rank[static_cast<size_t>(me)];
  const ChunkSink into_staging = [staging](uint32_t index, std::span<const std::byte> data,
                                           uint32_t crc) { return staging->Put(index, data, crc); };
  SourceFaults faults(hooks);
  std::atomic<uint64_t> bytes{0};
  std::atomic<int> refetched{0};
  // The CRC tables it serves, each computed once: of its held shard, or of
  // each receiver's shard when it holds every shard.
  std::map<int, std::vector<uint32_t>> tables;  // shard served (-1: the held one) → table
  for (const auto& [peer, work] : peers) {
    if (!work.serve) continue;
    const int shard = every ? layout.shard_of_rank[static_cast<size_t>(peer)] : -1;
    if (tables.count(shard)) continue;
    tables[shard] =
        shard == -1 && !held_table.empty() ? held_table : CrcTable(reg, /*sharded=*/true, shard);
  }
  std::vector<int> order;  // the peers, a thread each
  for (const auto& [peer, work] : peers) order.push_back(peer);
  std::vector<Status> results(order.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] {
      const int peer = order[i];
      const PeerWork& work = peers.at(peer);
      auto do_serve = [&]() -> Status {
        if (!work.serve) return OkStatus();
        const int shard = every ? layout.shard_of_rank[static_cast<size_t>(peer)] : -1;
        return Serve(comm, reg, peer, held_step, &tables.at(shard), /*sharded=*/true, &faults, spec,
                     shard);
      };
      auto do_fetch = [&]() -> Status {
        if (!work.fetch) return OkStatus();
        std::string header(kHeaderBytes, '\0');
        NONSTOP_RETURN_IF_ERROR(comm.Recv(peer, std::as_writable_bytes(std::span(header))));
        // The existing check stays: a source's header must name this group size and the shard asked
        // for.
        NONSTOP_ASSIGN_OR_RETURN(const Header h,
                                 CheckHeader(header, step, reg, fmt::format("rank {}", peer),
                                             spec.key != nullptr, need));
        std::optional<CopySeal> sealed;
        if (spec.key != nullptr)
          sealed.emplace(*spec.key, "shard", spec.generation, peer, me, h.sealed);
        const CopySeal* seal = sealed ? &*sealed : nullptr;
        std::vector<uint32_t> claims(reg.num_chunks(), 0);
        std::vector<uint32_t> failed;
        NONSTOP_RETURN_IF_ERROR(Fetch(comm, reg, peer, work.chunks, &claims, &failed, &bytes,
                                      into_staging, RequestSeal{seal, 0}));
        NONSTOP_ASSIGN_OR_RETURN(std::vector<uint32_t> table, RecvTable(comm, reg, peer, seal));
        NONSTOP_RETURN_IF_ERROR(CheckClaims(peer, work.chunks, claims, table));
        if (!failed.empty()) {  // once more from the same holder: a chunk damaged on the way
          refetched += static_cast<int>(failed.size());
          std::vector<uint32_t> again;
          NONSTOP_RETURN_IF_ERROR(Fetch(comm, reg, peer, failed, &claims, &again, &bytes,
                                        into_staging, RequestSeal{seal, 1}));
          NONSTOP_RETURN_IF_ERROR(CheckClaims(peer, failed, claims, table));
          if (!again.empty()) {
            return DataLossError(
                fmt::format("state chunk {} of shard {} failed its checksum twice from rank {}",
                            again.front(), need, peer));
          }
        }
        return SendU32s(comm, peer, {});
      };
      // The lower rank serves first, the higher fetches first: two members
      // that swap shards never both wait for a request.
      Status s = me < peer ? do_serve() : do_fetch();
      if (s.ok()) s = me < peer ? do_fetch() : do_serve();
      // A failure ends this member's exchanges with every peer at once (its other threads stop
      // instead of serving or fetching what no one will commit).
      if (!s.ok() && s.code() != StatusCode::kAborted) {
        comm.Abort(fmt::format("the shard exchange with rank {} failed: {}", peer, s.message()));
      }
      results[i] = s;
    });
  }
  for (auto& t : threads) t.join();
  // The cause, not the abort it made of the exchanges with the other peers.
  NONSTOP_RETURN_IF_ERROR(CauseOf(results));
  outcome->served =
      std::any_of(peers.begin(), peers.end(), [](const auto& p) { return p.second.serve; });
  outcome->bytes_received = bytes.load();
  outcome->refetched_chunks = refetched.load();
  return OkStatus();
}

}  // namespace

bool IsDisagreement(const Status& s) {
  return s.code() == StatusCode::kDataLoss &&
         (s.message().find(kShardDisagreement) != std::string_view::npos ||
          s.message().find(kReplicaDisagreement) != std::string_view::npos);
}

Result<TransferOutcome> ExchangeShards(collective::Communicator& comm, state::StateRegistry& reg,
                                       const control::PlanMsg& plan, int64_t held_step,
                                       const TransferHooks& hooks) {
  TransferOutcome outcome;
  const int group = reg.shard_group();
  if (group == 0) {
    if (plan.shard_group == 0 && plan.shard_moves.empty()) return outcome;
    return InvalidArgumentError(
        fmt::format("the plan of generation {} shards the optimizer state over groups of {}, "
                    "this worker's state is not sharded",
                    plan.generation, plan.shard_group));
  }
  const int64_t step = plan.resume_step - 1;
  NONSTOP_ASSIGN_OR_RETURN(state::ShardLayout layout, state::LayoutOf(comm.world_size(), group));
  const int me = comm.rank();
  const int need = layout.shard_of_rank[static_cast<size_t>(me)];
  // A state of another step holds no shard of this one. A member holding
  // every shard (the initial state, or whole buffers behind every view) says
  // so, serves each receiver its shard, and binds its own at the end.
  if (held_step != step && reg.held_shard() != state::kNoShard) reg.set_held_shard(state::kNoShard);
  // The initial state (no step done: zero moments, the seeded parameters
  // whole) is every shard's, whichever one the views were bound to since.
  if (held_step == -1 && step == -1) reg.set_held_shard(state::kEveryShard);
  const bool every = reg.held_shard() == state::kEveryShard;

  // The table it serves its shard from, computed once: its digest is its word on what it holds.
  // Only a shard that moves is compared: the others cost no CRC pass.
  std::vector<uint32_t> held_table;
  const bool single = reg.held_shard() >= 0 && held_step == step &&
                      std::any_of(plan.shard_moves.begin(), plan.shard_moves.end(),
                                  [&](const auto& m) { return m.shard == reg.held_shard(); });
  if (single) held_table = CrcTable(reg, /*sharded=*/true);
  NONSTOP_ASSIGN_OR_RETURN(Holdings holdings,
                           GatherHoldings(comm, group, reg.held_shard(), held_step,
                                          single ? ShardDigest(held_table) : 0));
  NONSTOP_ASSIGN_OR_RETURN(RankedMoves moves, CheckShardMoves(plan, layout, holdings, step));
  NONSTOP_ASSIGN_OR_RETURN(ShardDigests majority,
                           TrustTheMajority(holdings, step, layout, me, &moves));
  if (moves.receivers.empty()) {
    if (every) NONSTOP_RETURN_IF_ERROR(reg.BindShard(need));
    return outcome;
  }

  std::vector<uint32_t> sharded;
  for (uint32_t c = 0; c < reg.num_chunks(); ++c) {
    if (reg.chunk_sharded(c)) sharded.push_back(c);
  }
  const std::map<int, PeerWork> peers = PeersOf(moves, me, sharded);
  const bool receiving =
      std::find(moves.receivers.begin(), moves.receivers.end(), me) != moves.receivers.end();
  if (!peers.empty() && hooks.on_start) hooks.on_start();
  Staging staging(reg, receiving ? sharded : std::vector<uint32_t>{});
  NONSTOP_RETURN_IF_ERROR(MoveWithPeers(comm, reg, layout, peers, step, held_step, every,
                                        held_table, hooks, SealOf(hooks, plan.generation), &staging,
                                        &outcome));
  if (receiving) NONSTOP_RETURN_IF_ERROR(CheckStaged(staging, reg, need, step, majority));
  // Nobody commits before everybody has staged: a receiver's commit
  // overwrites the shard it held, which may be the last copy of it if a
  // holder that serves it dies now. After the barrier every member has its
  // new shard staged. (Two faults inside the barrier's own round trip can
  // still leave a mix of committed and uncommitted members: docs/sharding.md.)
  NONSTOP_RETURN_IF_ERROR(comm.Barrier());
  // it served every receiver from its whole buffers
  if (every) NONSTOP_RETURN_IF_ERROR(reg.BindShard(need));
  if (!receiving) return outcome;
  // Commit: the views move to the new shard, then the checked bytes go in.
  NONSTOP_RETURN_IF_ERROR(reg.BindShard(need));
  for (const auto& [index, where] : staging.where) {
    NONSTOP_RETURN_IF_ERROR(reg.WriteChunk(
        index, std::span(staging.bytes).subspan(where.first, reg.chunk_size(index)), where.second));
  }
  outcome.received = true;
  outcome.sources = static_cast<int>(moves.sources[static_cast<size_t>(me)].size());
  return outcome;
}

}  // namespace nonstop::worker
