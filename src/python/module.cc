// nonstop._core: the Python package's native half (issue 11, docs/python.md).
//
// It binds nonstop::Session, the state registry, the data loader and the
// sampler, and knows nothing of PyTorch: tensors arrive as (address, bytes)
// pairs that python/nonstop checks first (device, dtype, contiguity, no
// overlap), so one build works with whatever torch the user has. This module
// is private: its functions trust those checks.
//
// Every call that may block (joining, reductions, recovery, finishing)
// releases the GIL, so Python threads (a data loader, the autograd hooks that
// start buckets) keep running while a collective waits on peers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "nonstop/checkpoint.h"
#include "nonstop/crc32c.h"
#ifdef NONSTOP_WITH_CUDA
#include "nonstop/cuda.h"
#endif
#include "nonstop/data.h"
#include "nonstop/elastic.h"
#include "nonstop/log.h"
#include "nonstop/ring.h"
#include "nonstop/session.h"
#include "nonstop/settings.h"
#include "nonstop/state.h"
#include "nonstop/tree.h"

namespace py = pybind11;

namespace nonstop::python {
namespace {

// Raised for a fault or a planned change: the step in flight is lost; recover().
PyObject* g_aborted = nullptr;
// Raised when the job ended or this worker was released (Join or Recover).
PyObject* g_cancelled = nullptr;

[[noreturn]] void Throw(const Status& s) {
  switch (s.code()) {
    case StatusCode::kAborted:
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
      PyErr_SetString(g_aborted, s.ToString().c_str());
      throw py::error_already_set();
    case StatusCode::kCancelled:
      PyErr_SetString(g_cancelled, s.ToString().c_str());
      throw py::error_already_set();
    case StatusCode::kInvalidArgument:
      throw py::value_error(s.ToString());
    default:
      throw std::runtime_error(s.ToString());
  }
}

void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}

// Python 3.13 names it Py_IsFinalizing; earlier versions have only the underscored one.
bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

std::span<std::byte> Bytes(uintptr_t address, size_t nbytes) {
  return {reinterpret_cast<std::byte*>(address), nbytes};
}
std::span<float> Floats(uintptr_t address, size_t count) {
  return {reinterpret_cast<float*>(address), count};
}

// A reduction's type and operation by the names nonstop/reduce.h gives them (torch's).
DType DTypeNamed(const std::string& name) {
  for (int d = 0; d <= static_cast<int>(DType::kBool); ++d) {
    if (DTypeName(static_cast<DType>(d)) == name) return static_cast<DType>(d);
  }
  throw py::value_error(fmt::format("no reduction of {} elements", name));
}
ReduceOp ReduceOpNamed(const std::string& name) {
  for (int op = 0; op <= static_cast<int>(ReduceOp::kBxor); ++op) {
    if (ReduceOpName(static_cast<ReduceOp>(op)) == name) return static_cast<ReduceOp>(op);
  }
  throw py::value_error(fmt::format("no reduction named {}", name));
}

// One registered region as python/nonstop describes it: (name, address, bytes,
// kind, shape). Kinds: "F32" and "U8" (every member holds it whole), "SHARD"
// (this member's shard of sharded optimizer state, StateRegistry::RegisterShard)
// (a replicated kind followed by ":per_rank" marks the region per-rank: Region::per_rank)
// and "SHARD_VIEW" (a whole buffer, padded, of which a member's shard is its
// own: the parameters; RegisterShardView), the last two in groups of `shard_group`.
// The last field is where the memory is: -1 for host memory, N for cuda:N (a
// region of device memory, "F32" or "U8", read and written through CUDA).
using RegionSpec =
    std::tuple<std::string, uintptr_t, size_t, std::string, std::vector<int64_t>, int>;

// The DeviceMemory of cuda:`index`, made once per process; ValueError when this
// build has no CUDA, RuntimeError naming why when the device cannot be used.
std::shared_ptr<const state::DeviceMemory> CudaDevice(int index) {
#ifdef NONSTOP_WITH_CUDA
  static std::mutex mu;
  static std::map<int, std::shared_ptr<const state::DeviceMemory>> devices;
  std::lock_guard lock(mu);
  std::shared_ptr<const state::DeviceMemory>& device = devices[index];
  if (device == nullptr) {
    Result<std::shared_ptr<const state::DeviceMemory>> made = CudaDeviceMemory(index);
    if (!made.ok()) {
      throw std::runtime_error(
          fmt::format("cuda:{}, where a tensor given to nonstop lives, cannot be used: {}", index,
                      made.status().ToString()));
    }
    device = *made;
  }
  return device;
#else
  throw py::value_error(fmt::format(
      "a tensor on cuda:{} was given to nonstop, but this build of nonstop has no "
      "CUDA: build it where "
      "CMake finds the CUDA toolkit (docs/gpu.md), or keep the model and its state on the CPU",
      index));
#endif
}

// A Session and the registry it keeps current. The registry's regions are
// memory that the Python objects (tensors) own; the Python Session keeps
// them alive as long as this object.
class PySession {
 public:
  // With `resume_from`, the newest valid durable checkpoint there is loaded
  // into `checkpoint` (the checkpoint's layout: views of the registered memory,
  // or of whole buffers for sharded state) before joining (none: the job
  // starts afresh).
  // `required`: the layout's parameters and moments, which a checkpoint
  // nonstop-train wrote must have (LoadOptions); `on_loaded(info)` runs once
  // one was loaded, before joining (a joiner's state may then still come
  // from its peers, over what it loaded). `cuda_devices`: GPUs the program computes
  // on without registering their memory, health-checked at the join too
  // (SessionOptions::checked_devices).
  static std::unique_ptr<PySession> Join(const std::vector<RegionSpec>& regions, int64_t state_step,
                                         const std::string& resume_from, int shard_group,
                                         const std::vector<RegionSpec>& checkpoint,
                                         const std::vector<std::string>& required,
                                         const std::vector<std::string>& optional,
                                         const py::object& on_loaded,
                                         const std::vector<int>& cuda_devices, bool defer_state) {
    auto self = std::unique_ptr<PySession>(new PySession());
    RegisterSpecs(self->state_, regions, shard_group);
    std::vector<std::shared_ptr<const state::DeviceMemory>> checked;
    for (int index : cuda_devices) checked.push_back(CudaDevice(index));
    if (!resume_from.empty()) {
      state::StateRegistry layout;
      RegisterSpecs(layout, checkpoint, 0);
      Result<state::LoadedCheckpoint> loaded = state::LoadNewestCheckpoint(
          resume_from, layout,
          {.loader = state::kPythonWriter, .required = required, .optional = optional});
      if (loaded.ok()) {
        state_step = loaded->step;
        NONSTOP_LOG_INFO("resumed from {} (step {})", loaded->path, loaded->step);
        for (const std::string& why : loaded->skipped) NONSTOP_LOG_WARNING("skipped {}", why);
        self->resumed_ = py::dict(
            py::arg("path") = loaded->path, py::arg("step") = loaded->step,
            py::arg("by_name") = loaded->by_name, py::arg("kept") = loaded->kept,
            py::arg("ignored") = loaded->ignored,
            py::arg("writer") = loaded->manifest.value("writer", ""),
            py::arg("parameter_checksum") = loaded->manifest.value("parameter_checksum", ""));
        if (!on_loaded.is_none()) on_loaded(self->resumed_);
      } else if (loaded.status().code() == StatusCode::kNotFound) {
        NONSTOP_LOG_INFO("no checkpoint to resume from: {}", loaded.status().message());
      } else {
        Check(loaded.status());
      }
    }
    Result<SessionOptions> options = SessionOptions::FromEnvironment();
    Check(options.status());
    options->checked_devices = std::move(checked);
    options->defer_state = defer_state;
    Result<std::unique_ptr<Session>> session = InternalError("not joined");
    {
      py::gil_scoped_release release;
      session = Session::Join(*options, &self->state_, state_step);
    }
    if (!session.ok() && session.status().code() != StatusCode::kCancelled) {
      // Not a fault in a running job (Aborted): this worker never joined one.
      PyErr_SetString(session.status().code() == StatusCode::kUnavailable ||
                              session.status().code() == StatusCode::kDeadlineExceeded
                          ? PyExc_ConnectionError
                          : PyExc_RuntimeError,
                      session.status().ToString().c_str());
      throw py::error_already_set();
    }
    Check(session.status());
    self->session_ = std::move(*session);
    return self;
  }

  // Without the GIL: stopping the session joins its communication thread,
  // which may be waiting for the GIL to call a bucket's `done`.
  ~PySession() {
    py::gil_scoped_release release;
    session_.reset();
  }

  // A session joined with defer_state: registers `regions` and copies the peers' state into
  // them where this worker joined a running job (Session::CompleteJoin).
  void CompleteJoin(const std::vector<RegionSpec>& regions) {
    RegisterSpecs(state_, regions, 0);
    Status s;
    {
      py::gil_scoped_release release;
      s = session_->CompleteJoin();
    }
    Check(s);
  }

  Session& s() { return *session_; }
  const state::StateRegistry& state() const { return state_; }
  // A resumed sharded view's shard moved into the optimizer's memory (AdoptShard), right after
  // Join.
  state::StateRegistry& mutable_state() { return state_; }
  // What resume_from loaded (path, step, by_name, kept, ignored, recipe, parameter_checksum); None.
  py::object resumed() const { return resumed_; }

  // Registers regions as python/nonstop describes them (RegionSpec).
  static void RegisterSpecs(state::StateRegistry& reg, const std::vector<RegionSpec>& specs,
                            int shard_group) {
    for (const auto& [name, address, nbytes, kind, shape, device] : specs) {
      // "<dtype>:per_rank": each member's own values (Region::per_rank)
      const bool per_rank = kind.ends_with(":per_rank");
      const std::string dtype = per_rank ? kind.substr(0, kind.size() - 9) : kind;
      RegisterSpec(reg, name, address, nbytes, dtype, shape, device, shard_group);
      if (per_rank) Check(reg.MarkPerRank(name));
    }
  }
  static void RegisterSpec(state::StateRegistry& reg, const std::string& name, uintptr_t address,
                           size_t nbytes, const std::string& dtype,
                           const std::vector<int64_t>& shape, int device, int shard_group) {
    if (device >= 0) {
      if (dtype != "F32" && dtype != "U8") {
        throw py::value_error(fmt::format(
            "{} on cuda:{} is {}: state on a GPU is replicated float32 or bytes (sharded state "
            "stays in host memory)",
            name, device, dtype));
      }
      Check(reg.RegisterOnDevice(name, Bytes(address, nbytes), CudaDevice(device), dtype,
                                 dtype == "F32" ? shape : std::vector<int64_t>{}));
    } else if (dtype == "F32") {
      Check(reg.RegisterFloats(name, Floats(address, nbytes / sizeof(float)), shape));
    } else if (dtype == "SHARD") {
      Check(reg.RegisterShard(name, Floats(address, nbytes / sizeof(float)), shard_group));
    } else if (dtype == "SHARD_VIEW") {
      Check(reg.RegisterShardView(name, Floats(address, nbytes / sizeof(float)), shard_group));
    } else if (dtype == "I64" && nbytes == sizeof(int64_t)) {
      Check(reg.RegisterValue(name, reinterpret_cast<int64_t*>(address)));
    } else {
      Check(reg.Register(name, Bytes(address, nbytes)));
    }
  }

  // Copies `layout` (the checkpoint's regions, views of live memory) now and
  // writes it in the background (one write at a time: a checkpoint due while
  // one is in flight is skipped).
  std::string SaveCheckpoint(const std::string& dir, int keep, int64_t step,
                             const std::string& checksum, const std::vector<RegionSpec>& layout) {
    if (keep < 1) throw py::value_error(fmt::format("keep must be at least 1, got {}", keep));
    if (writer_ == nullptr || writer_dir_ != dir) {
      if (writer_ != nullptr) Check(writer_->Wait());
      writer_ = std::make_unique<state::CheckpointWriter>(dir, keep);
      writer_dir_ = dir;
    }
    state::CheckpointMeta meta{step, session_->generation(), session_->world_size(),
                               std::string(state::kPythonWriter), checksum};
    meta.writer = state::kPythonWriter;
    state::StateRegistry reg;
    RegisterSpecs(reg, layout, 0);
    state::CheckpointSaveResult r = writer_->TrySave(reg, meta);
    Check(r.earlier);
    return r.ToString();
  }
  void WaitCheckpoint() {
    if (writer_ == nullptr) return;
    py::gil_scoped_release release;
    Check(writer_->Wait());
  }

  // A bucket's tensor stays referenced until the reductions are waited for:
  // the communication thread writes into it meanwhile.
  // With `done` (a callable taking (ok, message)), the bucket is the
  // caller's to keep alive, and `done` is called on the communication thread,
  // with the GIL, once the bucket is reduced or skipped (torch.distributed's
  // futures, python/nonstop/torch.py).
  void Start(py::object tensor, uintptr_t address, size_t count, py::object done) {
    if (done.is_none()) {
      in_flight_.push_back(std::move(tensor));
      session_->StartAllReduce(Floats(address, count));
      return;
    }
    // Let go with the GIL, on whichever thread drops the last copy.
    std::shared_ptr<py::object> call(new py::object(std::move(done)), [](py::object* o) {
      if (Finalizing()) return;  // the interpreter is going: nothing to call or free
      py::gil_scoped_acquire gil;
      delete o;
    });
    session_->StartAllReduce(Floats(address, count), [call](const Status& s) {
      if (Finalizing()) return;
      py::gil_scoped_acquire gil;
      try {
        (*call)(s.ok(), s.ToString());
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("nonstop: a reduction's completion callback");
      }
    });
  }
  // Runs `wait` (which waits for the started buckets) without the GIL, then lets the buckets go.
  template <typename F>
  auto Drained(F wait) {
    auto result = [&] {
      py::gil_scoped_release release;
      return wait();
    }();
    in_flight_.clear();
    return result;
  }

 private:
  PySession() = default;
  state::StateRegistry state_;
  // Before session_: destroyed after it, once the communication thread is joined.
  std::vector<py::object> in_flight_;
  std::unique_ptr<state::CheckpointWriter> writer_;  // after state_: finishes its write first
  std::string writer_dir_;
  py::object resumed_ = py::none();
  std::unique_ptr<Session> session_;
};

// World-invariant steps for nonstop.torch.InvariantDataParallel (nonstop/tree.h,
// docs/determinism.md): which micro-batches this rank computes (after a fault,
// only those no member holds a sum of, dealt over every member), each one's
// gradient folded into the fixed tree as it comes, and the tree's sum across
// the members. A step a fault cut short keeps its folded sums for the next
// generation's plan. Belongs to the thread that trains.
class PyTreeStep {
 public:
  PyTreeStep(PySession* session, int m, size_t elements, bool salvage)
      : session_(session), m_(m), elements_(elements), salvage_(salvage), planner_(salvage) {
    if (m < 1) throw py::value_error(fmt::format("micro_batches must be at least 1, got {}", m));
  }

  // This rank's micro-batches of `step`, in the order to compute them.
  // `counts` (one per rank, summing to m): how many each rank computes,
  // instead of the even split; nothing is kept from a step in flight then.
  std::vector<int> Plan(int64_t step, const std::vector<int>& counts) {
    CheckCounts(counts);
    CollectUnreduced();  // a step cut short: what it folded is held for the offers
    auto planned =
        session_->Drained([&] { return planner_.Plan(session_->s(), m_, step, held_, counts); });
    Check(planned.status());
    shares_ = std::move(*planned);
    const collective::TreeShare& mine = shares_[static_cast<size_t>(session_->s().rank())];
    worker::KeepOnly(&held_, step, mine.kept);
    step_ = step;
    order_.clear();
    folders_.clear();
    for (auto [first, last] : mine.compute) {
      folders_.emplace_back(m_, first, last, elements_);
      for (int mb = first; mb < last; ++mb) order_.push_back({mb, folders_.size() - 1});
    }
    next_ = 0;
    std::vector<int> out;
    for (auto [mb, folder] : order_) out.push_back(mb);
    return out;
  }

  // The gradient of micro-batch `mb` (`elements` floats at `address`), the next planned one.
  void Add(int mb, uintptr_t address) {
    if (next_ >= order_.size() || order_[next_].first != mb) {
      throw py::value_error(fmt::format(
          "micro-batch {} is not the next one planned for step {} ({}): compute them in the order "
          "plan() returned, one backward each",
          mb, step_, next_ < order_.size() ? fmt::format("{}", order_[next_].first) : "none left"));
    }
    folders_[order_[next_].second].Add(
        std::span<const float>(reinterpret_cast<const float*>(address), elements_));
    ++next_;
  }

  // The sum of the step's micro-batch gradients, along the tree, into `address` (every rank the
  // same bits). A fault: the sums stay held for the retry, and Aborted is raised.
  void Reduce(uintptr_t address) {
    if (next_ != order_.size()) {
      throw py::value_error(fmt::format(
          "reduce() after {} of the {} micro-batches plan() returned for step {}: run one "
          "backward for each first",
          next_, order_.size(), step_));
    }
    worker::HeldSums have = worker::CollectSums(m_, step_, std::move(held_), &folders_);
    held_ = {};
    folders_.clear();
    order_.clear();
    Status s = session_->Drained([&] {
      return session_->s().AllReduceTree(m_, worker::NodeLists(shares_), have.partials,
                                         Floats(address, elements_));
    });
    if (!s.ok() && salvage_) held_ = std::move(have);
    Check(s);
  }

  int kept_micro_batches() const { return planner_.kept_micro_batches(); }
  int kept_by() const { return planner_.kept_by(); }

 private:
  void CheckCounts(const std::vector<int>& counts) const {
    if (counts.empty()) return;
    const int world = session_->s().world_size();
    long long sum = 0;
    for (int c : counts) sum += c;
    if (static_cast<int>(counts.size()) != world || sum != m_ ||
        std::any_of(counts.begin(), counts.end(), [](int c) { return c < 0; })) {
      throw py::value_error(fmt::format(
          "counts [{}] must give each of the {} ranks 0 or more micro-batches, {} in all",
          fmt::join(counts, ", "), world, m_));
    }
  }

  void CollectUnreduced() {
    if (folders_.empty()) return;
    worker::HeldSums have = worker::CollectSums(m_, step_, std::move(held_), &folders_);
    held_ = salvage_ ? std::move(have) : worker::HeldSums{};
    folders_.clear();
    order_.clear();
  }

  PySession* session_;
  int m_;
  size_t elements_;
  bool salvage_;
  worker::TreeStepPlanner planner_;
  worker::HeldSums held_;
  std::vector<collective::TreeShare> shares_;
  std::vector<collective::TreeFolder> folders_;
  std::vector<std::pair<int, size_t>> order_;  // (micro-batch, its folder), in compute order
  size_t next_ = 0;
  int64_t step_ = -1;
};

// The default (ring) mode's micro-batch plan for nonstop.torch.DataParallel with
// micro_batches (nonstop/ring.h, docs/python.md "Salvage"): on the first step of
// a generation the members offer the micro-batches they hold a sum of, and
// every member computes the same shares from them. The sums themselves stay in
// Python (DataParallel). Belongs to the thread that trains.
class PyRingStep {
 public:
  PyRingStep(PySession* session, int m, bool salvage, bool lend)
      : session_(session), m_(m), planner_(salvage, lend) {
    if (m < 1) throw py::value_error(fmt::format("micro_batches must be at least 1, got {}", m));
  }

  // This rank's share of `step` ("kept", "compute", "lent", "borrowed") and every loan of the
  // plan ("loans": (micro-batch, owner, borrower), in micro-batch order). `held`: the
  // micro-batches this member holds one sum of for `held_step` (-1: none).
  py::dict Plan(int64_t step, int64_t held_step, const std::vector<int>& held) {
    // State copied into this member at the last change: what it held is no sum of that state's.
    if (session_->s().last_change().state_copied) held_step = -1;
    auto planned = session_->Drained([&] {
      return planner_.Plan(session_->s(), m_, step, held_step,
                           held_step < 0 ? std::span<const int>() : std::span<const int>(held));
    });
    Check(planned.status());
    const worker::RingShare& mine = (*planned)[static_cast<size_t>(session_->s().rank())];
    py::list loans;
    for (const worker::Loan& l : worker::LoansOf(*planned))
      loans.append(py::make_tuple(l.micro_batch, l.owner, l.borrower));
    py::dict d;
    d["kept"] = mine.kept;
    d["compute"] = mine.compute;
    d["lent"] = mine.lent;
    d["borrowed"] = mine.borrowed;
    d["loans"] = loans;
    return d;
  }

  int kept_micro_batches() const { return planner_.kept_micro_batches(); }
  int kept_by() const { return planner_.kept_by(); }
  int computing() const { return planner_.computing(); }

 private:
  PySession* session_;
  int m_;
  worker::RingStepPlanner planner_;
};

py::dict ChangeDict(const MembershipChange& c) {
  py::dict d;
  d["generation"] = c.generation;
  d["old_world"] = c.old_world;
  d["new_world"] = c.new_world;
  d["old_rank"] = c.old_rank;
  d["new_rank"] = c.new_rank;
  d["resume_step"] = c.resume_step;
  d["reason"] = c.reason;
  return d;
}

// The module-level functions: the batch and learning-rate policy, the devices, the CRC.
void BindFunctions(py::module_& m) {
  // The batch and learning-rate policy of nonstop-train (nonstop/elastic.h), for
  // nonstop.data.DataLoader.
  m.def("global_batch",
        [](const std::string& mode, uint64_t base_batch, int base_world, int world) {
          Result<elastic::BatchMode> m = elastic::ParseBatchMode(mode);
          Check(m.status());
          return elastic::GlobalBatch(*m, base_batch, base_world, world);
        });
  m.def("lr_factor",
        [](const std::string& mode, const std::string& scaling, int base_world, int world) {
          Result<elastic::BatchMode> m = elastic::ParseBatchMode(mode);
          Check(m.status());
          Result<elastic::LrScaling> s = elastic::ParseLrScaling(scaling);
          Check(s.status());
          return elastic::LrFactor(*m, *s, base_world, world);
        });
  m.def("warmed_factor", &elastic::WarmedFactor, py::arg("from_factor"), py::arg("to_factor"),
        py::arg("step"), py::arg("change_step"), py::arg("warmup_steps"));

  m.def("powers_of_two_split", &collective::PowersOfTwoSplit, py::arg("micro_batches"),
        py::arg("world"));
  // The CUDA devices this process sees (0 in a build without CUDA): for the tests.
  m.def("cuda_devices", [] {
#ifdef NONSTOP_WITH_CUDA
    return CudaDeviceCount();
#else
    return 0;
#endif
  });
  m.def("crc32c", [](uintptr_t address, size_t nbytes) {
    return fmt::format("{:08x}", Crc32c(reinterpret_cast<const void*>(address), nbytes));
  });
}

// The job's store (nonstop/store.h): the native half of nonstop.distributed's torch Store.
// Values are bytes; every call takes its timeout in seconds (0: for ever) and runs without the
// GIL. A failure is a RuntimeError saying what, a bad key ValueError; a wait cut short by a
// member's failure is nonstop.Aborted (the step runs again); a timeout says "Socket Timeout"
// first, as torch's TCPStore does (code matches on it).
template <typename T>
T StoreResult(Result<T> r) {
  if (r.ok()) return std::move(*r);
  const Status& s = r.status();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      throw py::value_error(std::string(s.message()));
    case StatusCode::kAborted:
    case StatusCode::kCancelled:
      Throw(s);
    case StatusCode::kDeadlineExceeded:
      throw std::runtime_error("Socket Timeout: " + std::string(s.message()));
    default:
      throw std::runtime_error(std::string(s.message()));
  }
}

void BindStore(py::module_& m) {
  using Ms = std::chrono::milliseconds;
  auto ms = [](double seconds) {
    if (!(seconds >= 0)) throw py::value_error(fmt::format("a store timeout of {} s", seconds));
    if (seconds == 0) return Ms(0);  // for ever
    // At least 1 ms: a timeout rounded down to 0 would wait for ever.
    return Ms(std::max<int64_t>(1, static_cast<int64_t>(std::ceil(std::min(seconds, 1e9) * 1000))));
  };
  auto unlocked = [](auto call) {
    py::gil_scoped_release release;
    return call();
  };
  auto done = [](const Status& s) { return StoreResult<bool>(s.ok() ? Result<bool>(true) : s); };
  py::class_<Store>(m, "Store")
      .def("set",
           [=](Store& st, const std::string& key, const py::bytes& value, double timeout) {
             std::string v = value;
             done(unlocked([&] { return st.Set(key, v, ms(timeout)); }));
           })
      .def("get",
           [=](Store& st, const std::string& key, double timeout) {
             std::string v = StoreResult(unlocked([&] { return st.Get(key, ms(timeout)); }));
             return py::bytes(v);
           })
      .def("add",
           [=](Store& st, const std::string& key, int64_t amount, double timeout) {
             return StoreResult(unlocked([&] { return st.Add(key, amount, ms(timeout)); }));
           })
      .def("compare_set",
           [=](Store& st, const std::string& key, const py::bytes& expected,
               const py::bytes& desired, double timeout) {
             std::string e = expected, d = desired;
             std::string v =
                 StoreResult(unlocked([&] { return st.CompareSet(key, e, d, ms(timeout)); }));
             return py::bytes(v);
           })
      .def("append",
           [=](Store& st, const std::string& key, const py::bytes& value, double timeout) {
             std::string v = value;
             done(unlocked([&] { return st.Append(key, v, ms(timeout)); }));
           })
      .def("wait",
           [=](Store& st, const std::vector<std::string>& keys, double timeout) {
             done(unlocked([&] { return st.Wait(keys, ms(timeout)); }));
           })
      .def("check",
           [=](Store& st, const std::vector<std::string>& keys, double timeout) {
             return StoreResult(unlocked([&] { return st.Check(keys, ms(timeout)); }));
           })
      .def("delete_key",
           [=](Store& st, const std::string& key, double timeout) {
             return StoreResult(unlocked([&] { return st.DeleteKey(key, ms(timeout)); }));
           })
      .def("num_keys", [=](Store& st, double timeout) {
        return StoreResult(unlocked([&] { return st.NumKeys(ms(timeout)); }));
      });
}

// Session: the native half of nonstop.Session.
void BindSession(py::module_& m) {
  py::class_<PySession>(m, "Session")
      .def_static("join", &PySession::Join, py::arg("regions"), py::arg("state_step") = -1,
                  py::arg("resume_from") = "", py::arg("shard_group") = 0,
                  py::arg("checkpoint") = std::vector<RegionSpec>{},
                  py::arg("required") = std::vector<std::string>{},
                  py::arg("optional") = std::vector<std::string>{},
                  py::arg("on_loaded") = py::none(), py::arg("cuda_devices") = std::vector<int>{},
                  py::arg("defer_state") = false)
      .def("complete_join", &PySession::CompleteJoin, py::arg("regions"))
      .def("save_checkpoint", &PySession::SaveCheckpoint, py::arg("dir"), py::arg("keep"),
           py::arg("step"), py::arg("checksum"), py::arg("layout"))
      .def_property_readonly("resumed", &PySession::resumed)
      .def("adopt_shard",
           [](PySession& p, const std::string& name, uintptr_t address, size_t nbytes) {
             Check(p.mutable_state().AdoptShard(name, Floats(address, nbytes / sizeof(float))));
           })
      .def("wait_checkpoint", &PySession::WaitCheckpoint)
      .def_property_readonly(
          "store", [](PySession& p) -> Store& { return p.s().store(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly("rank", [](PySession& p) { return p.s().rank(); })
      .def_property_readonly("world_size", [](PySession& p) { return p.s().world_size(); })
      .def_property_readonly("generation", [](PySession& p) { return p.s().generation(); })
      .def_property_readonly("resume_step", [](PySession& p) { return p.s().resume_step(); })
      .def_property_readonly("worker_id", [](PySession& p) { return p.s().worker_id(); })
      .def_property_readonly("state_bytes", [](PySession& p) { return p.state().total_bytes(); })
      .def("state_digest", [](PySession& p) { return p.state().Digest(); })
      .def("allreduce",
           [](PySession& p, uintptr_t address, size_t count) {
             Check(p.Drained([&] { return p.s().AllReduce(Floats(address, count)); }));
           })
      .def(
          "reduce",
          [](PySession& p, uintptr_t address, size_t nbytes, const std::string& dtype,
             const std::string& op, bool scatter, int group) {
            const DType d = DTypeNamed(dtype);
            const ReduceOp o = ReduceOpNamed(op);
            Check(p.Drained([&] {
              return scatter ? p.s().ReduceScatter(Bytes(address, nbytes), d, o, group)
                             : p.s().AllReduce(Bytes(address, nbytes), d, o, group);
            }));
          },
          py::arg("address"), py::arg("nbytes"), py::arg("dtype"), py::arg("op"),
          py::arg("scatter") = false, py::arg("group") = 0)
      // Point-to-point, from any thread (not Drained: that lets go of the buckets' tensors).
      .def(
          "send",
          [](PySession& p, int to, uintptr_t address, size_t nbytes, int channel) {
            Status s = [&] {
              py::gil_scoped_release release;
              return p.s().Send(to, Bytes(address, nbytes), channel);
            }();
            Check(s);
          },
          py::arg("to"), py::arg("address"), py::arg("nbytes"), py::arg("channel") = 0)
      .def(
          "recv",
          [](PySession& p, int from, uintptr_t address, size_t nbytes, int channel) {
            Status s = [&] {
              py::gil_scoped_release release;
              return p.s().Recv(from, Bytes(address, nbytes), channel);
            }();
            Check(s);
          },
          py::arg("from"), py::arg("address"), py::arg("nbytes"), py::arg("channel") = 0)
      .def("recv_any",
           [](PySession& p, std::vector<int> ranks, uintptr_t address, size_t nbytes) {
             Result<int> from = [&] {
               py::gil_scoped_release release;
               return p.s().RecvFromAny(ranks, Bytes(address, nbytes));
             }();
             Check(from.status());
             return *from;
           })
      .def(
          "new_group",
          [](PySession& p, std::vector<int> ranks, int64_t timeout_ms) {
            Result<int> id =
                p.s().NewGroup(std::move(ranks), std::chrono::milliseconds(timeout_ms));
            Check(id.status());
            return *id;
          },
          py::arg("ranks"), py::arg("timeout_ms") = 0)
      .def("start_allreduce", &PySession::Start, py::arg("tensor"), py::arg("address"),
           py::arg("count"), py::arg("done") = py::none())
      .def(
          "broadcast",
          [](PySession& p, uintptr_t address, size_t nbytes, int root, int group) {
            Check(p.Drained([&] { return p.s().Broadcast(Bytes(address, nbytes), root, group); }));
          },
          py::arg("address"), py::arg("nbytes"), py::arg("root"), py::arg("group") = 0)
      // `records` of `record_bytes` at `address`: one a rank of the world or of `group`.
      .def(
          "allgather",
          [](PySession& p, uintptr_t address, size_t record_bytes, size_t records, int group) {
            Check(p.Drained([&] {
              return p.s().AllGather(Bytes(address, record_bytes * records), record_bytes, group);
            }));
          },
          py::arg("address"), py::arg("record_bytes"), py::arg("records"), py::arg("group") = 0)
      .def(
          "barrier",
          [](PySession& p, int group) { Check(p.Drained([&] { return p.s().Barrier(group); })); },
          py::arg("group") = 0)
      // Sharded optimizer state (nonstop.torch.ShardedOptimizer, docs/sharding.md).
      .def_property_readonly("shard", [](PySession& p) { return p.s().shard(); })
      .def_property_readonly("shard_group", [](PySession& p) { return p.s().shard_group(); })
      .def("reduce_shards",
           [](PySession& p, uintptr_t address, size_t count) {
             const auto g = static_cast<size_t>(p.s().shard_group());
             if (g == 0 || count % g != 0) {
               throw py::value_error(fmt::format(
                   "reduce_shards: {} floats are not a multiple of the shard group {}", count, g));
             }
             Check(p.Drained([&] { return p.s().ReduceShards(Floats(address, count)); }));
           })
      .def("gather_shards",
           [](PySession& p, uintptr_t address, size_t nbytes, size_t element_bytes) {
             const auto g = static_cast<size_t>(p.s().shard_group());
             if (g == 0 || element_bytes == 0 || nbytes % (g * element_bytes) != 0) {
               throw py::value_error(fmt::format(
                   "gather_shards: {} bytes are not a whole number of elements of {} bytes in each "
                   "of the shard group's {} shards",
                   nbytes, element_bytes, g));
             }
             Check(p.Drained(
                 [&] { return p.s().GatherShards(Bytes(address, nbytes), element_bytes); }));
           })
      .def("torchrun_environment", [](PySession& p) { return p.s().TorchrunEnvironment(); })
      .def("wait_all", [](PySession& p) { Check(p.Drained([&] { return p.s().WaitAll(); })); })
      .def("aborted", [](PySession& p) { return p.s().aborted(); })
      .def("begin_training",
           [](PySession& p) {
             py::gil_scoped_release release;
             p.s().BeginTraining();
           })
      // The control-plane sends below may wait on the socket: without the GIL.
      .def("report_step",
           [](PySession& p, int64_t step, double loss, double step_seconds,
              double tokens_per_second, int64_t total_steps) {
             py::gil_scoped_release release;
             p.s().ReportStep({step, loss, step_seconds, tokens_per_second, total_steps});
           })
      .def("recover",
           [](PySession& p) {
             Result<int64_t> next = p.Drained([&] { return p.s().Recover(); });
             Check(next.status());
             return *next;
           })
      .def("finish",
           [](PySession& p, int64_t last_step, const std::string& checksum) {
             Status s = p.Drained([&] { return p.s().Finish(last_step, checksum); });
             if (s.code() == StatusCode::kDeadlineExceeded) {
               // Not a fault to recover from: the controller never ended the job.
               PyErr_SetString(PyExc_TimeoutError, s.ToString().c_str());
               throw py::error_already_set();
             }
             Check(s);
           })
      .def("injected_exception_at",
           [](PySession& p, int64_t step) {
             py::gil_scoped_release release;
             return p.s().InjectedExceptionAt(step);
           })
      .def(
          "report_failure",
          [](PySession& p, const std::string& message, int64_t step, int exit_code,
             const std::string& traceback) {
            py::gil_scoped_release release;
            p.s().ReportFailure(InternalError(message), step, exit_code, traceback);
          },
          py::arg("message"), py::arg("step"), py::arg("exit_code"), py::arg("traceback") = "")
      .def("begin_busy",
           [](PySession& p, const std::string& label, double bound_seconds) {
             Status s;
             {
               py::gil_scoped_release release;
               s = p.s().BeginBusy(label, std::chrono::milliseconds(static_cast<int64_t>(
                                              std::min(bound_seconds, 1e9) * 1000)));
             }
             if (!s.ok()) throw py::value_error(s.message());
           })
      .def("end_busy",
           [](PySession& p) {
             py::gil_scoped_release release;
             p.s().EndBusy();
           })
      .def("last_change", [](PySession& p) { return ChangeDict(p.s().last_change()); })
      .def_property_readonly("shutdown_exit_code",
                             [](PySession& p) { return p.s().shutdown_exit_code(); });
}

// The salvaged steps' planners: TreeStep (world-invariant) and RingStep (the ring).
void BindSteps(py::module_& m) {
  py::class_<PyTreeStep>(m, "TreeStep")
      .def(py::init<PySession*, int, size_t, bool>(), py::arg("session"), py::arg("micro_batches"),
           py::arg("elements"), py::arg("salvage"), py::keep_alive<1, 2>())
      .def("plan", &PyTreeStep::Plan, py::arg("step"), py::arg("counts") = std::vector<int>{})
      .def("add", &PyTreeStep::Add, py::arg("micro_batch"), py::arg("address"))
      .def("reduce", &PyTreeStep::Reduce, py::arg("address"))
      .def_property_readonly("kept_micro_batches", &PyTreeStep::kept_micro_batches)
      .def_property_readonly("kept_by", &PyTreeStep::kept_by);

  py::class_<PyRingStep>(m, "RingStep")
      .def(py::init<PySession*, int, bool, bool>(), py::arg("session"), py::arg("micro_batches"),
           py::arg("salvage"), py::arg("lend"), py::keep_alive<1, 2>())
      .def("plan", &PyRingStep::Plan, py::arg("step"), py::arg("held_step"), py::arg("held"))
      .def_property_readonly("kept_micro_batches", &PyRingStep::kept_micro_batches)
      .def_property_readonly("kept_by", &PyRingStep::kept_by)
      .def_property_readonly("computing", &PyRingStep::computing);
}

// Dataset, Sampler and the data preparation, for nonstop.data.
void BindData(py::module_& m) {
  py::class_<data::Dataset>(m, "Dataset")
      .def_static("open",
                  [](const std::string& pattern, size_t seq_len) {
                    auto ds = data::Dataset::Open(pattern, seq_len);
                    Check(ds.status());
                    return std::move(*ds);
                  })
      .def_property_readonly("num_samples", &data::Dataset::num_samples)
      .def_property_readonly("seq_len", &data::Dataset::seq_len)
      .def_property_readonly("num_tokens", &data::Dataset::num_tokens)
      .def_property_readonly("max_token", &data::Dataset::max_token)
      // Writes the seq_len+1 tokens of each sample, as int64, to `address`
      // (len(samples) × (seq_len+1) values).
      .def("fill",
           [](const data::Dataset& ds, const std::vector<uint64_t>& samples, uintptr_t address) {
             for (uint64_t s : samples) {
               if (s >= ds.num_samples()) {
                 throw py::index_error(fmt::format("sample {} is past the dataset's {} samples", s,
                                                   ds.num_samples()));
               }
             }
             auto* out = reinterpret_cast<int64_t*>(address);
             py::gil_scoped_release release;
             for (uint64_t s : samples) {
               for (uint16_t t : ds.Sample(s)) *out++ = t;
             }
           });

  py::class_<data::Sampler>(m, "Sampler")
      .def(py::init([](uint64_t num_samples, uint64_t seed, uint64_t global_batch,
                       uint64_t micro_batch) {
             auto s = data::Sampler::Create({num_samples, seed, global_batch, micro_batch});
             Check(s.status());
             return std::move(*s);
           }),
           py::arg("num_samples"), py::arg("seed"), py::arg("global_batch"), py::arg("micro_batch"))
      .def_property_readonly("micro_batches_per_step", &data::Sampler::micro_batches_per_step)
      .def(
          "micro_batches_for",
          [](const data::Sampler& s, int rank, int world_size) {
            if (world_size < 1 || rank < 0 || rank >= world_size) {
              throw py::value_error(fmt::format(
                  "rank {} of world size {}: need 0 <= rank < world_size", rank, world_size));
            }
            return s.MicroBatchesFor(rank, world_size);
          },
          py::arg("rank"), py::arg("world_size"))
      .def("micro_batch_samples", &data::Sampler::MicroBatchSamples, py::arg("step"),
           py::arg("micro"));

  m.def(
      "prepare_if_missing",
      [](const std::vector<std::string>& inputs, const std::string& output_dir,
         bool strip_fortune_separators) {
        data::PrepareOptions o;
        o.inputs = inputs;
        o.output_dir = output_dir;
        o.strip_fortune_separators = strip_fortune_separators;
        Result<bool> done = false;
        {
          py::gil_scoped_release release;
          done = data::PrepareIfMissing(o);
        }
        Check(done.status());
        return *done;
      },
      py::arg("inputs"), py::arg("output_dir"), py::arg("strip_fortune_separators") = false);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "nonstop's native half; use the `nonstop` package, not this module";
  const char* worker_id = std::getenv(settings::kWorkerId.env.data());
  SetLogRole(fmt::format("worker {}", worker_id != nullptr ? worker_id : "?"));
  g_aborted = PyErr_NewExceptionWithDoc(
      "nonstop.Aborted",
      "A member failed or the membership changes: the step in flight is lost. Call "
      "session.recover() and carry "
      "on from the step it returns.",
      // not RuntimeError: a broad `except RuntimeError` (out of memory) must not swallow it
      PyExc_Exception, nullptr);
  g_cancelled = PyErr_NewException("nonstop._core.Cancelled", PyExc_RuntimeError, nullptr);
  m.attr("Aborted") = py::handle(g_aborted);
  m.attr("Cancelled") = py::handle(g_cancelled);

  BindFunctions(m);
  BindStore(m);
  BindSession(m);
  BindSteps(m);
  BindData(m);
}

}  // namespace nonstop::python
