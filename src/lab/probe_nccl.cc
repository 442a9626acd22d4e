// The probe's NCCL transport: one GPU per rank, rank 0's unique id handed over through the TCP
// rendezvous, and polling waits on the stream (cudaStreamQuery + ncclCommGetAsyncError against a
// deadline, as nccl-tests' -T does) so a rank times out by itself.
//
// The communicator is a blocking one: a non-blocking communicator returns ncclInProgress from every
// ncclAllReduce and finishes the enqueue on a background thread, which measured 65-70 us per op for
// 4 KiB to 1 MiB on two H200s (host-bound, nothing like nccl-tests' numbers). A call that blocks
// inside NCCL (init or the first collective's lazy connection to a peer that never comes) is
// bounded by the rank's stage watchdog (probe_rank.cc), which exits 124, and by the supervisor's
// SIGKILL of the process group. A failing rank never calls ncclCommAbort (it may hang): it exits
// and lets the driver reclaim everything.
#include <chrono>
#include <thread>

#include "comm/nccl_api.h"
#include "comm/tcp_group.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "lab/probe_transport.h"

namespace dl::lab {

#if defined(DECODELAB_HAVE_CUDA) && defined(DECODELAB_HAVE_NCCL_H)

namespace {

Status Timeout(std::string what) {
  return Status(StatusCode::kDeadlineExceeded, std::move(what));
}

bool Expired(comm::Deadline deadline) {
  return std::chrono::steady_clock::now() >= deadline;
}

// Busy-polls for the first 2 ms of a wait, then sleeps 50 us between polls (a short wait should not
// pay a scheduler tick; a long one should not burn a core).
class Poller {
 public:
  void Pause() {
    if (std::chrono::steady_clock::now() - start_ < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

class NcclTransport : public ProbeTransport {
 public:
  explicit NcclTransport(const RankOptions& o) : o_(o) {}

  // Only reached when the rank finishes or fails without exiting through _exit: release what can be
  // released without blocking. A live communicator is left to process exit (no ncclCommAbort).
  ~NcclTransport() override {
    if (comm_ == nullptr) {
      if (start_) cudaEventDestroy(start_);
      if (stop_) cudaEventDestroy(stop_);
      if (send_) cudaFree(send_);
      if (recv_) cudaFree(recv_);
      if (stream_) cudaStreamDestroy(stream_);
    }
  }

  Result<nlohmann::json> SetDevice(comm::Deadline) override {
    std::string why;
    int n = cuda::DeviceCount(&why);
    if (n == 0) return Unavailable("rank {}: no usable CUDA device: {}", o_.rank, why);
    if (o_.local_rank >= n) {
      return Unavailable("rank {}: local rank {} needs CUDA device {}, but only {} are visible",
                         o_.rank, o_.local_rank, o_.local_rank, n);
    }
    device_ = o_.local_rank;
    DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    DL_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));  // create the context now, inside this stage
    nlohmann::json d = {{"device", device_},
                        {"visible_devices", n},
                        {"driver", cuda::DriverVersionString()},
                        {"runtime", cuda::RuntimeVersionString()}};
    if (Result<cuda::DeviceInfo> info = cuda::GetDeviceInfo(device_); info.ok()) {
      d["name"] = info->name;
      d["pci_bus_id"] = info->pci_bus_id;
    }
    return d;
  }

  Result<nlohmann::json> InitComm(comm::Deadline deadline) override {
    // A missing libnccl fails here, before comm-initialised: INIT_STAGE_FAILURE.
    Result<const comm::NcclApi*> api = comm::LoadNccl();
    if (!api.ok()) return api.status().WithContext(fmt::format("rank {}", o_.rank));
    nccl_ = *api;
    DL_ASSIGN_OR_RETURN(
        std::unique_ptr<comm::TcpGroup> group,
        comm::TcpGroup::Create(o_.rank, o_.world_size, o_.rdzv_fd, o_.rdzv, deadline));
    ncclUniqueId id{};
    if (o_.rank == 0) {
      ncclResult_t r = nccl_->GetUniqueId(&id);
      if (r != ncclSuccess) {
        return Unavailable("rank 0: ncclGetUniqueId failed: {}", nccl_->Describe(r, nullptr));
      }
    }
    DL_RETURN_IF_ERROR(group->Broadcast(&id, sizeof(id), deadline));
    group.reset();  // the rendezvous is done; NCCL bootstraps its own sockets from the id

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;  // see the file comment: the watchdog bounds blocking calls
    ncclResult_t r = nccl_->CommInitRankConfig(&comm_, o_.world_size, id, o_.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return Unavailable("rank {}: ncclCommInitRankConfig failed: {}", o_.rank,
                         nccl_->Describe(r, comm_));
    }
    DL_RETURN_IF_ERROR(WaitComm("ncclCommInitRankConfig", deadline));
    return nlohmann::json{{"transport", "nccl"},
                          {"nccl_version", nccl_->version},
                          {"nccl_library", nccl_->library_path},
                          {"rendezvous", o_.rdzv.ToString()},
                          {"world_size", o_.world_size}};
  }

  Status Allocate(std::span<const float> send, comm::Deadline deadline) override {
    count_ = send.size();
    DL_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    DL_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start_));
    DL_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop_));
    // send_, recv_: [count] float32 on this rank's device.
    DL_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&send_), send.size_bytes()));
    DL_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&recv_), send.size_bytes()));
    host_.assign(send.begin(), send.end());  // must outlive the async copy
    DL_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(send_, host_.data(), send.size_bytes(), cudaMemcpyHostToDevice, stream_));
    DL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(recv_, 0, send.size_bytes(), stream_));
    return WaitStream("uploading the send buffer", deadline);
  }

  Result<CollectiveTiming> AllReduce(int warmup, int iters, comm::Deadline deadline) override {
    for (int i = 0; i < warmup; ++i) DL_RETURN_IF_ERROR(LaunchAllReduce(deadline));
    DL_RETURN_IF_ERROR(WaitStream("warm-up all-reduce", deadline));
    DL_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, stream_));
    for (int i = 0; i < iters; ++i) DL_RETURN_IF_ERROR(LaunchAllReduce(deadline));
    DL_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop_, stream_));
    DL_RETURN_IF_ERROR(WaitStream(fmt::format("{} timed all-reduces", iters), deadline));
    float ms = 0;
    DL_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start_, stop_));
    return CollectiveTiming{
        ms * 1000.0 / iters, warmup, iters, {{"enqueues_in_progress", in_progress_enqueues_}}};
  }

  Result<std::vector<float>> ReadResult(comm::Deadline deadline) override {
    std::vector<float> out(count_);
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out.data(), recv_, count_ * sizeof(float),
                                            cudaMemcpyDeviceToHost, stream_));
    DL_RETURN_IF_ERROR(WaitStream("copying the result to the host", deadline));
    return out;
  }

  Status Teardown(comm::Deadline deadline) override {
    DL_RETURN_IF_ERROR(WaitStream("draining the stream before teardown", deadline));
    ncclResult_t r = nccl_->CommFinalize(comm_);
    if (r != ncclSuccess && r != ncclInProgress) {
      return Unavailable("rank {}: ncclCommFinalize failed: {}", o_.rank,
                         nccl_->Describe(r, comm_));
    }
    DL_RETURN_IF_ERROR(WaitComm("ncclCommFinalize", deadline));
    r = nccl_->CommDestroy(comm_);
    if (r != ncclSuccess && r != ncclInProgress) {
      return Unavailable("rank {}: ncclCommDestroy failed: {}", o_.rank,
                         nccl_->Describe(r, nullptr));
    }
    comm_ = nullptr;
    DL_CUDA_RETURN_IF_ERROR(cudaEventDestroy(start_));
    DL_CUDA_RETURN_IF_ERROR(cudaEventDestroy(stop_));
    DL_CUDA_RETURN_IF_ERROR(cudaFree(send_));
    DL_CUDA_RETURN_IF_ERROR(cudaFree(recv_));
    DL_CUDA_RETURN_IF_ERROR(cudaStreamDestroy(stream_));
    start_ = stop_ = nullptr;
    send_ = recv_ = nullptr;
    stream_ = nullptr;
    return Status::Ok();
  }

 private:
  // Polls the communicator's state until it leaves ncclInProgress.
  Status WaitComm(const char* what, comm::Deadline deadline) {
    Poller poller;
    for (;;) {
      ncclResult_t state = ncclInProgress;
      ncclResult_t r = nccl_->CommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) {
        return Unavailable("rank {}: ncclCommGetAsyncError after {} failed: {}", o_.rank, what,
                           nccl_->Describe(r, comm_));
      }
      if (state == ncclSuccess) return Status::Ok();
      if (state != ncclInProgress) {
        return Unavailable("rank {}: {} failed: {}", o_.rank, what, nccl_->Describe(state, comm_));
      }
      if (Expired(deadline)) {
        return Timeout(
            fmt::format("rank {}: {} did not complete within {} s", o_.rank, what, o_.timeout_s));
      }
      poller.Pause();
    }
  }

  // Out-of-place sum of send_ into recv_ on stream_ (the send buffer stays intact, so every
  // iteration produces the same, checkable result).
  Status LaunchAllReduce(comm::Deadline deadline) {
    ncclResult_t r = nccl_->AllReduce(send_, recv_, count_, ncclFloat32, ncclSum, comm_, stream_);
    if (r == ncclInProgress) {
      ++in_progress_enqueues_;
      return WaitComm("ncclAllReduce (enqueue)", deadline);
    }
    if (r != ncclSuccess) {
      return Unavailable("rank {}: ncclAllReduce failed: {}", o_.rank, nccl_->Describe(r, comm_));
    }
    return Status::Ok();
  }

  // Waits for the stream with the communicator's async error checked on every poll.
  Status WaitStream(const std::string& what, comm::Deadline deadline) {
    Poller poller;
    for (;;) {
      cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady) {
        return Internal("rank {}: {}: CUDA error {}", o_.rank, what, cudaGetErrorString(q));
      }
      if (comm_ != nullptr) {
        ncclResult_t state = ncclSuccess;
        if (nccl_->CommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
            state != ncclInProgress) {
          return Unavailable("rank {}: {}: NCCL async error: {}", o_.rank, what,
                             nccl_->Describe(state, comm_));
        }
      }
      if (Expired(deadline)) {
        return Timeout(
            fmt::format("rank {}: {} did not finish within {} s (all-reduce of {} "
                        "float32 across {} ranks)",
                        o_.rank, what, o_.timeout_s, count_, o_.world_size));
      }
      poller.Pause();
    }
  }

  RankOptions o_;
  const comm::NcclApi* nccl_ = nullptr;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  float* send_ = nullptr;
  float* recv_ = nullptr;
  size_t count_ = 0;
  int in_progress_enqueues_ = 0;  // ncclAllReduce calls that returned ncclInProgress
  std::vector<float> host_;
};

}  // namespace

std::unique_ptr<ProbeTransport> MakeNcclTransport(const RankOptions& options) {
  return std::make_unique<NcclTransport>(options);
}

#else  // no CUDA runtime or no nccl.h in this build

namespace {

class UnavailableNccl : public ProbeTransport {
 public:
  explicit UnavailableNccl(const RankOptions& o) : o_(o) {}
  Result<nlohmann::json> SetDevice(comm::Deadline) override {
    std::string why;
    if (cuda::DeviceCount(&why) == 0) {
      return Unavailable("rank {}: the nccl transport needs a CUDA device: {}", o_.rank, why);
    }
    return nlohmann::json{{"device", o_.local_rank}};
  }
  Result<nlohmann::json> InitComm(comm::Deadline) override {
    return Unavailable(
        "rank {}: this build of decodelab has no NCCL support (nccl.h was not found at configure "
        "time); use --transport sim to test the supervisor only",
        o_.rank);
  }
  Status Allocate(std::span<const float>, comm::Deadline) override { return Unsupported(); }
  Result<CollectiveTiming> AllReduce(int, int, comm::Deadline) override { return Unsupported(); }
  Result<std::vector<float>> ReadResult(comm::Deadline) override { return Unsupported(); }
  Status Teardown(comm::Deadline) override { return Unsupported(); }

 private:
  Status Unsupported() { return Unavailable("rank {}: no NCCL support in this build", o_.rank); }
  RankOptions o_;
};

}  // namespace

std::unique_ptr<ProbeTransport> MakeNcclTransport(const RankOptions& options) {
  return std::make_unique<UnavailableNccl>(options);
}

#endif

}  // namespace dl::lab
