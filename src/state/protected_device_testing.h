// Test helper: a DeviceMemory whose "device" is host memory that this process
// cannot touch. Its allocations are mapped PROT_NONE, and its copies go
// through /proc/self/mem (which may read and write such pages), so code that
// dereferences a device region's bytes instead of copying them through the
// DeviceMemory crashes, as it would with a GPU's address. What a machine
// without a GPU tests device regions with (nonstop/state.h, docs/gpu.md).
// It needs a kernel that lets /proc/self/mem reach PROT_NONE pages (Linux's
// default; not with proc_mem.force_override=never): a copy fails otherwise,
// naming /proc/self/mem.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/unique_fd.h"
#include "nonstop/state.h"

namespace nonstop::state {

class ProtectedDevice final : public DeviceMemory {
 public:
  ProtectedDevice() : mem_(::open("/proc/self/mem", O_RDWR | O_CLOEXEC)) {
    NONSTOP_CHECK(mem_.valid()) << "/proc/self/mem: " << std::strerror(errno);
  }
  ~ProtectedDevice() override {
    for (auto [p, n] : maps_) ::munmap(p, n);
  }
  ProtectedDevice(const ProtectedDevice&) = delete;
  ProtectedDevice& operator=(const ProtectedDevice&) = delete;

  // `bytes` of "device" memory, zeros, freed with this object.
  std::span<std::byte> Allocate(size_t bytes) {
    const size_t mapped = std::max<size_t>(bytes, 1);  // mmap takes no empty mapping
    void* p = ::mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    NONSTOP_CHECK(p != MAP_FAILED) << "mmap: " << std::strerror(errno);
    maps_.emplace_back(p, mapped);
    return {static_cast<std::byte*>(p), bytes};
  }
  // The next copies fail (a device that broke) while this is set.
  void set_broken(bool broken) { broken_ = broken; }
  int copies() const { return copies_.load(); }

  std::string name() const override { return "stand-in:0"; }
  // A page of its memory written with a pattern, read back and compared.
  Status Check() const override {
    const size_t n = 4096;
    void* p = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return InternalError(std::string("mmap: ") + std::strerror(errno));
    std::vector<std::byte> pattern(n), back(n);
    for (size_t i = 0; i < n; ++i) pattern[i] = static_cast<std::byte>(i * 131 + 7);
    Status s = ToDevice(static_cast<std::byte*>(p), pattern.data(), n);
    if (s.ok()) s = ToHost(back.data(), static_cast<std::byte*>(p), n);
    if (s.ok() && back != pattern) s = DataLossError("stand-in:0 returned other bytes");
    ::munmap(p, n);
    return s;
  }
  Status ToHost(std::byte* host, const std::byte* device, size_t bytes) const override {
    return Move(/*write=*/false, host, device, bytes);
  }
  Status ToDevice(std::byte* device, const std::byte* host, size_t bytes) const override {
    return Move(/*write=*/true, const_cast<std::byte*>(host), device, bytes);
  }

 private:
  Status Move(bool write, std::byte* host, const std::byte* device, size_t bytes) const {
    ++copies_;
    if (broken_.load()) return InternalError("the stand-in device is broken (set_broken)");
    for (size_t done = 0; done < bytes;) {
      const auto at = static_cast<off_t>(reinterpret_cast<uintptr_t>(device + done));
      const ssize_t n = write ? ::pwrite(mem_.get(), host + done, bytes - done, at)
                              : ::pread(mem_.get(), host + done, bytes - done, at);
      if (n <= 0) return InternalError(std::string("/proc/self/mem: ") + std::strerror(errno));
      done += static_cast<size_t>(n);
    }
    return OkStatus();
  }

  UniqueFd mem_;
  std::vector<std::pair<void*, size_t>> maps_;
  std::atomic<bool> broken_{false};
  mutable std::atomic<int> copies_{0};
};

}  // namespace nonstop::state
