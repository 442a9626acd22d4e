// The one-shot device communicator with ranks as processes (CreateOneShotIpcRank,
// device_communicator.h says who owns what and why). The kernels are device_reduce.h's, unchanged:
// they take pointers only, and this file fills the same OneShotView with pointers opened from CUDA IPC
// handles.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/device_communicator.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include "comm/device_reduce.h"
#include "cuda/buffer.h"
#include "cuda/check.h"
#include "cuda/memory.h"
#endif

namespace dl::comm {

#if defined(DECODELAB_HAVE_CUDA)

namespace {

constexpr uint32_t kIpcMagic = 0x4950'4c44;  // "DLPI"
constexpr size_t kShmBytes = 4096;           // one page: the group's abort word at offset 0

// Round 1: what every rank says about itself (rank 0 allocates on each rank's device and checks that
// the ranks agree on the group).
struct RankRecord {
  uint32_t magic = kIpcMagic;
  int32_t rank = 0, size = 0, device = 0, blocks = 0;
  uint64_t slot_bytes = 0;
  int32_t pid = 0;
  uint64_t two_shot_min_bytes = 0;  // every rank must take the same kernel for a size
};
// Round 2: rank 0's handles (the other ranks send zeros of the same size).
struct HandleRecord {
  uint32_t magic = kIpcMagic;
  char shm_path[64] = {};
  cudaIpcMemHandle_t slots[kMaxOneShotRanks] = {}, flags[kMaxOneShotRanks] = {};
};
// Round 3: every rank opened everything (rank 0 may then unlink the shared page's name), or why not.
struct OpenedRecord {
  uint32_t magic = kIpcMagic;
  int32_t ok = 0;
};

template <typename T>
std::vector<std::byte> AsBytes(const T& t) {
  std::vector<std::byte> b(sizeof(T));
  std::memcpy(b.data(), &t, sizeof(T));
  return b;
}

template <typename T>
Result<std::vector<T>> ExchangeRecords(const ExchangeBytes& exchange, const T& mine, int size, const char* what) {
  DL_ASSIGN_OR_RETURN(std::vector<std::byte> all, exchange(AsBytes(mine)));
  if (all.size() != sizeof(T) * static_cast<size_t>(size)) {
    return DataLoss("one-shot IPC exchange ({}): {} bytes back, {} expected", what, all.size(),
                    sizeof(T) * static_cast<size_t>(size));
  }
  std::vector<T> out(static_cast<size_t>(size));
  std::memcpy(out.data(), all.data(), all.size());
  for (int q = 0; q < size; ++q) {
    if (out[q].magic != kIpcMagic) return DataLoss("one-shot IPC exchange ({}): rank {}'s record is not one", what, q);
  }
  return out;
}

class IpcOneShotRank final : public DeviceCommunicator {
 public:
  IpcOneShotRank(int rank, int size, int device, double timeout_s)
      : rank_(rank), size_(size), device_(device), timeout_s_(timeout_s) {}
  ~IpcOneShotRank() override {
    // Whatever is still enqueued on this device reads these buffers.
    if (cudaSetDevice(device_) == cudaSuccess) (void)cudaDeviceSynchronize();
    for (void* p : opened_) (void)cudaIpcCloseMemHandle(p);
    if (registered_) (void)cudaHostUnregister(shm_);
    if (shm_ != nullptr) ::munmap(shm_, kShmBytes);
    if (!unlink_path_.empty()) ::unlink(unlink_path_.c_str());
    (void)cudaGetLastError();
  }

  Status Init(const DeviceGroup::OneShotOptions& o, const ExchangeBytes& exchange) {
    DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    DL_RETURN_IF_ERROR(PreloadOneShotKernels());
    const size_t slot = std::max<size_t>(16, (o.capacity_bytes + 15) / 16 * 16);
    capacity_ = o.capacity_bytes;
    DL_ASSIGN_OR_RETURN(epochs_, cuda::DeviceBuffer::Create(sizeof(uint64_t) * kMaxOneShotBlocks));
    DL_RETURN_IF_ERROR(epochs_.Fill(0));
    DL_ASSIGN_OR_RETURN(error_word_, cuda::PinnedBuffer::Allocate(sizeof(uint32_t)));
    *error_word_.as<uint32_t>() = 0;

    RankRecord me{.rank = rank_, .size = size_, .device = device_, .blocks = o.blocks, .slot_bytes = slot,
                  .pid = static_cast<int32_t>(::getpid()), .two_shot_min_bytes = o.two_shot_min_bytes};
    DL_ASSIGN_OR_RETURN(std::vector<RankRecord> ranks, ExchangeRecords(exchange, me, size_, "ranks"));
    for (int q = 0; q < size_; ++q) {
      const RankRecord& r = ranks[q];
      if (r.rank != q || r.size != size_ || r.blocks != o.blocks || r.slot_bytes != slot ||
          r.two_shot_min_bytes != o.two_shot_min_bytes) {
        return FailedPrecondition(
            "one-shot IPC group: rank {} says rank {} of {}, {} blocks, {}-byte slots, two-shot from {} bytes; rank {} "
            "has rank {} of {}, {} blocks, {}-byte slots, two-shot from {} bytes",
            q, r.rank, r.size, r.blocks, r.slot_bytes, r.two_shot_min_bytes, rank_, rank_, size_, o.blocks, slot,
            o.two_shot_min_bytes);
      }
    }

    HandleRecord handles;
    if (rank_ == 0) DL_RETURN_IF_ERROR(AllocateForEveryRank(ranks, slot, &handles));
    DL_ASSIGN_OR_RETURN(std::vector<HandleRecord> all, ExchangeRecords(exchange, handles, size_, "handles"));
    const HandleRecord& h = all[0];
    Status opened = rank_ == 0 ? Status::Ok() : OpenRankZeros(h);
    if (opened.ok()) opened = MapAbortWord(h.shm_path);
    OpenedRecord done{.ok = opened.ok() ? 1 : 0};
    DL_ASSIGN_OR_RETURN(std::vector<OpenedRecord> dones, ExchangeRecords(exchange, done, size_, "opened"));
    DL_RETURN_IF_ERROR(opened);
    // Every rank has mapped the page: its name is no longer needed (the mappings stay).
    if (rank_ == 0 && !unlink_path_.empty()) {
      ::unlink(unlink_path_.c_str());
      unlink_path_.clear();
    }
    for (int q = 0; q < size_; ++q) {
      if (dones[q].ok != 1) return Unavailable("one-shot IPC group: rank {} could not open the shared buffers", q);
    }

    view_.rank = rank_;
    view_.size = size_;
    view_.blocks = o.blocks;
    view_.capacity = slot;
    view_.two_shot_min_bytes = o.two_shot_min_bytes;
    view_.epochs = epochs_.as<uint64_t>();
    view_.error = error_word_.as<uint32_t>();
    view_.timeout_ns = static_cast<uint64_t>(std::min(timeout_s_, 1e9) * 1e9);
    return Status::Ok();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return device_; }
  std::string transport() const override { return "device-oneshot-ipc"; }
  bool capturable() const override { return true; }
  std::string all_reduce_rule() const override { return TwoShotRule(view_); }

  Status AllReduceSum(void* data, int64_t count, DeviceElem elem, CUstream_st* stream) override {
    DL_RETURN_IF_ERROR(Begin("all-reduce", static_cast<size_t>(count) * DeviceElemBytes(elem)));
    return LaunchOneShotAllReduce(view_, data, count, elem, stream);
  }
  Status AllGather(const void* local, size_t bytes, void* out, CUstream_st* stream) override {
    DL_RETURN_IF_ERROR(Begin("all-gather", bytes));
    return LaunchOneShotAllGather(view_, local, bytes, out, stream);
  }
  void Abort(const Status& reason) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abort_reason_.ok()) return;
      abort_reason_ = reason.ok() ? Status(StatusCode::kCancelled, "aborted") : reason;
    }
    // Every rank's kernels read this word: they leave their waits at once.
    if (shm_ != nullptr) std::atomic_ref<uint32_t>(*static_cast<uint32_t*>(shm_)).store(1, std::memory_order_seq_cst);
    if (local_abort_.bytes() != 0) {
      std::atomic_ref<uint32_t>(*local_abort_.as<uint32_t>()).store(1, std::memory_order_seq_cst);
    }
  }
  Status DeviceError() const override {
    switch (*static_cast<volatile uint32_t*>(error_word_.as<uint32_t>())) {
      case 0: return Status::Ok();
      case 1:
        return Status(StatusCode::kCancelled,
                      fmt::format("rank {}'s one-shot collective left its wait because the group was aborted (by "
                                  "this rank or a peer process)",
                                  rank_));
      default:
        return Status(StatusCode::kDeadlineExceeded,
                      fmt::format("rank {} waited more than {} s in a one-shot collective for a peer process that "
                                  "never came",
                                  rank_, timeout_s_));
    }
  }

 private:
  // The host part of every call: count it, refuse after an abort, check the capacity (no host
  // meeting to fall back on).
  Status Begin(const char* what, size_t bytes) {
    ++collectives_issued_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!abort_reason_.ok()) return abort_reason_;
    }
    if (bytes > capacity_) {
      Status st = InvalidArgument("device {} of {} bytes exceeds the one-shot capacity of {} bytes (ranks as "
                                  "processes have no host-meeting path: create the group with a larger capacity)",
                                  what, bytes, capacity_);
      Abort(st);  // the peers would otherwise wait for this rank's kernel
      return st;
    }
    DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return Status::Ok();
  }

  // Rank 0: every rank's slots and flags on its device, exported; the shared abort page.
  Status AllocateForEveryRank(const std::vector<RankRecord>& ranks, size_t slot, HandleRecord* h) {
    std::set<int> devices;
    for (const RankRecord& r : ranks) devices.insert(r.device);
    // Rank 0's kernels read and write other GPUs' buffers directly.
    for (int d : devices) {
      if (d == device_) continue;
      int can = 0;
      DL_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, device_, d));
      if (!can) return Unavailable("device {} cannot access device {}'s memory (no peer access)", device_, d);
      DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
      const cudaError_t e = cudaDeviceEnablePeerAccess(d, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
        return Internal("cudaDeviceEnablePeerAccess({} -> {}): {}", device_, d, cudaGetErrorString(e));
      }
      (void)cudaGetLastError();
    }
    for (int q = 0; q < size_; ++q) {
      DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(ranks[q].device));
      DL_ASSIGN_OR_RETURN(cuda::DeviceBuffer s, cuda::DeviceBuffer::Create(2 * slot));
      DL_ASSIGN_OR_RETURN(cuda::DeviceBuffer f, cuda::DeviceBuffer::Create(sizeof(uint64_t) * kMaxOneShotBlocks *
                                                                           kMaxOneShotRanks));
      DL_RETURN_IF_ERROR(f.Fill(0));
      DL_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h->slots[q], s.data()));
      DL_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h->flags[q], f.data()));
      view_.slots[q] = s.data();
      view_.flags[q] = f.as<uint64_t>();
      owned_.push_back(std::move(s));
      owned_.push_back(std::move(f));
    }
    DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // The zeroed flags must be in place before any peer's kernel stores into them.
    DL_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    // A file every rank maps: tmpfs (/dev/shm) where there is one, else /tmp. Its name lives only
    // until every rank has mapped it.
    static std::atomic<int> serial{0};
    const int n = serial++;
    std::string path, tried;
    int fd = -1;
    for (const char* dir : {"/dev/shm", "/tmp"}) {
      path = fmt::format("{}/decodelab-oneshot-{}-{}-{}", dir, ::getpid(), n,
                         std::chrono::steady_clock::now().time_since_epoch().count() % 1000000000);
      fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd >= 0) break;
      tried += fmt::format("{}{}: {}", tried.empty() ? "" : "; ", path, std::strerror(errno));
    }
    if (fd < 0) return Unavailable("creating the one-shot group's shared abort word: {}", tried);
    if (path.size() >= sizeof(h->shm_path)) {
      ::close(fd);
      ::unlink(path.c_str());
      return Internal("shared page path too long: {}", path);
    }
    unlink_path_ = path;
    const int rc = ::ftruncate(fd, kShmBytes);
    ::close(fd);
    if (rc != 0) return Unavailable("sizing {}: {}", path, std::strerror(errno));
    std::memcpy(h->shm_path, path.c_str(), path.size() + 1);
    return Status::Ok();
  }

  // Ranks 1..: rank 0's exports of every rank's slots and flags.
  Status OpenRankZeros(const HandleRecord& h) {
    DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    for (int q = 0; q < size_; ++q) {
      for (bool flags : {false, true}) {
        void* p = nullptr;
        const cudaError_t e =
            cudaIpcOpenMemHandle(&p, flags ? h.flags[q] : h.slots[q], cudaIpcMemLazyEnablePeerAccess);
        if (e != cudaSuccess) {
          (void)cudaGetLastError();
          return Unavailable("rank {} on device {}: opening rank 0's IPC handle of rank {}'s {}: {}", rank_, device_, q,
                             flags ? "flags" : "slots", cudaGetErrorString(e));
        }
        opened_.push_back(p);
        if (flags) {
          view_.flags[q] = static_cast<uint64_t*>(p);
        } else {
          view_.slots[q] = p;
        }
      }
    }
    return Status::Ok();
  }

  // Maps the shared page and registers it with CUDA, so the kernels read the abort word.
  Status MapAbortWord(const char* path) {
    const int fd = ::open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return Unavailable("rank {}: opening {} (the group's abort word): {}", rank_, path, std::strerror(errno));
    void* p = ::mmap(nullptr, kShmBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return Unavailable("rank {}: mapping {}: {}", rank_, path, std::strerror(errno));
    shm_ = p;
    const cudaError_t e = cudaHostRegister(shm_, kShmBytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e == cudaSuccess) {
      registered_ = true;
      void* device_ptr = nullptr;
      DL_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&device_ptr, shm_, 0));
      view_.abort = static_cast<const volatile uint32_t*>(device_ptr);
      return Status::Ok();
    }
    // Some environments cannot register a shared file mapping with CUDA (a sandboxed driver, say).
    // Then the kernels read a word of this process only: an abort still ends this rank's own
    // spinning kernels at once, and its peers learn on the host (rank 0's supervision aborts its
    // own word when a child fails or dies; a child whose rank 0 failed spins until the timeout and
    // is killed by rank 0 after a short grace).
    (void)cudaGetLastError();
    spdlog::warn("one-shot IPC rank {}: cudaHostRegister of the shared abort word failed ({}); each process "
                 "aborts only its own kernels",
                 rank_, cudaGetErrorString(e));
    DL_ASSIGN_OR_RETURN(local_abort_, cuda::PinnedBuffer::Allocate(sizeof(uint32_t)));
    *local_abort_.as<uint32_t>() = 0;
    view_.abort = local_abort_.as<uint32_t>();
    return Status::Ok();
  }

  const int rank_, size_, device_;
  const double timeout_s_;
  size_t capacity_ = 0;
  std::vector<cuda::DeviceBuffer> owned_;  // rank 0: every rank's slots and flags
  std::vector<void*> opened_;              // ranks 1..: IPC mappings to close
  cuda::DeviceBuffer epochs_;
  cuda::PinnedBuffer error_word_;
  cuda::PinnedBuffer local_abort_;  // only where the shared page could not be registered
  void* shm_ = nullptr;
  bool registered_ = false;
  std::string unlink_path_;
  OneShotView view_;
  mutable std::mutex mu_;
  Status abort_reason_;
};

}  // namespace

Result<std::unique_ptr<DeviceCommunicator>> CreateOneShotIpcRank(int rank, int size, int device,
                                                                 const DeviceGroup::OneShotOptions& oneshot,
                                                                 double timeout_s, const ExchangeBytes& exchange) {
  if (size < 1 || size > kMaxOneShotRanks) {
    return InvalidArgument("a one-shot device group of {} ranks: 1 to {}", size, kMaxOneShotRanks);
  }
  if (rank < 0 || rank >= size) return InvalidArgument("rank {} of a group of {}", rank, size);
  if (oneshot.blocks < 1 || oneshot.blocks > kMaxOneShotBlocks) {
    return InvalidArgument("one-shot blocks {}: 1 to {}", oneshot.blocks, kMaxOneShotBlocks);
  }
  auto r = std::make_unique<IpcOneShotRank>(rank, size, device, timeout_s);
  DL_RETURN_IF_ERROR(r->Init(oneshot, exchange).WithContext(fmt::format("one-shot IPC rank {} on device {}", rank, device)));
  return std::unique_ptr<DeviceCommunicator>(std::move(r));
}

#else

Result<std::unique_ptr<DeviceCommunicator>> CreateOneShotIpcRank(int, int, int, const DeviceGroup::OneShotOptions&,
                                                                 double, const ExchangeBytes&) {
  return Unavailable("device communicators need a CUDA build of decodelab");
}

#endif

}  // namespace dl::comm
