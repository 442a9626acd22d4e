#include "comm/device_communicator.h"

#include <algorithm>
#include <functional>
#include <set>

#include <fmt/format.h>

#include "base/dtype.h"
#include "comm/communicator.h"
#include "comm/nccl_api.h"
#include "comm/rank_barrier.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include "comm/device_reduce.h"
#include "cuda/buffer.h"
#include "cuda/check.h"
#include "cuda/memory.h"
#endif

namespace dl::comm {

size_t DeviceElemBytes(DeviceElem e) { return e == DeviceElem::kF32 ? 4 : 2; }
const char* DeviceElemName(DeviceElem e) { return e == DeviceElem::kF32 ? "f32" : "bf16"; }

ExchangeBytes ExchangeOver(Communicator& comm) {
  return [&comm](const std::vector<std::byte>& mine) -> Result<std::vector<std::byte>> {
    const std::vector<size_t> sizes(static_cast<size_t>(comm.size()), mine.size());
    std::vector<std::byte> all(mine.size() * sizes.size());
    DL_RETURN_IF_ERROR(comm.AllGather(mine, sizes, all));
    return all;
  };
}

float RankOrderSum(const std::vector<float>& per_rank, DeviceElem elem) {
  float acc = per_rank.empty() ? 0.0f : per_rank[0];
  for (size_t r = 1; r < per_rank.size(); ++r) acc += per_rank[r];
  return elem == DeviceElem::kBF16 ? RoundBf16(acc) : acc;
}

#if defined(DECODELAB_HAVE_CUDA)

namespace {

class InProcessDeviceGroup;

// How a collective runs (rank r, the k-th collective of the group, slot = k % 2):
//
//   1. r's stream: copy the input into r's staging[slot]; record ready[slot].
//   2. host: the ranks meet (every rank has enqueued step 1, so every ready[slot] event it will wait
//      on is recorded), checking that they agree on the size.
//   3. r's stream: wait for every other rank's ready[slot]; read every rank's staging[slot] (peer
//      memory when on another GPU): the sum in rank order into the output (all-reduce), or the
//      copies into place (all-gather).
//
// Two slots make step 1 of collective k + 2 safe without a second meeting: r overwrites
// staging[slot] only after its stream passed collective k + 1's wait for every rank q's ready, which
// q recorded after its collective-k reads of r's staging[slot]. Likewise r re-records ready[slot] only
// after the ranks met at k + 1, when every rank has already enqueued its collective-k waits on it.
//
// The meeting is on the host, at enqueue time: no thread waits for the GPU (the device-side order is
// all events), but the ranks' threads must enqueue their forwards concurrently. It is also why this
// path is not capturable: an event wait inside one rank's graph could not name another rank's
// record of the same step.
//
// A one-shot rank ("device-oneshot") takes that path outside stream capture; inside a capture each
// collective is the one-shot kernel of comm/device_reduce.h over the rank's own slots, flags and
// epochs, the ranks meeting on the host only while recording (the size check).
class InProcessDeviceRank final : public DeviceCommunicator {
 public:
  InProcessDeviceRank(InProcessDeviceGroup* group, int rank, int device, bool oneshot)
      : group_(group), rank_(rank), device_(device), oneshot_(oneshot) {}
  ~InProcessDeviceRank() override {
    for (auto* e : ready_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  Status Init(size_t capacity) {
    DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    for (int s = 0; s < 2; ++s) {
      DL_ASSIGN_OR_RETURN(staging_[s], cuda::DeviceBuffer::Create(std::max<size_t>(capacity, 16)));
      DL_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ready_[s], cudaEventDisableTiming));
    }
    capacity_ = capacity;
    return Status::Ok();
  }
  // The one-shot buffers on this rank's device: two slots of `capacity` (rounded up to 16 bytes),
  // zeroed flags and epochs. The view's peer pointers are filled in by the group once every rank has
  // its buffers.
  Status InitOneShot(size_t capacity, int blocks, size_t two_shot_min_bytes) {
    DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const size_t slot = std::max<size_t>(16, (capacity + 15) / 16 * 16);
    DL_ASSIGN_OR_RETURN(os_slots_, cuda::DeviceBuffer::Create(2 * slot));
    DL_ASSIGN_OR_RETURN(os_flags_,
                        cuda::DeviceBuffer::Create(sizeof(uint64_t) * kMaxOneShotBlocks * kMaxOneShotRanks));
    DL_ASSIGN_OR_RETURN(os_epochs_, cuda::DeviceBuffer::Create(sizeof(uint64_t) * kMaxOneShotBlocks));
    DL_RETURN_IF_ERROR(os_flags_.Fill(0));
    DL_RETURN_IF_ERROR(os_epochs_.Fill(0));
    os_capacity_ = capacity;
    view_.rank = rank_;
    view_.blocks = blocks;
    view_.capacity = slot;
    view_.two_shot_min_bytes = two_shot_min_bytes;
    view_.epochs = os_epochs_.as<uint64_t>();
    return Status::Ok();
  }
  OneShotView& view() { return view_; }
  void* oneshot_slots() const { return os_slots_.data(); }
  uint64_t* oneshot_flags() const { return os_flags_.as<uint64_t>(); }

  int rank() const override { return rank_; }
  int size() const override;
  int device() const override { return device_; }
  std::string transport() const override { return oneshot_ ? "device-oneshot" : "device-in-process"; }
  bool capturable() const override { return oneshot_; }
  std::string all_reduce_rule() const override { return oneshot_ ? TwoShotRule(view_) : ""; }
  Status AllReduceSum(void* data, int64_t count, DeviceElem elem, CUstream_st* stream) override;
  Status AllGather(const void* local, size_t bytes, void* out, CUstream_st* stream) override;
  void Abort(const Status& reason) override;
  Status DeviceError() const override;

  const void* staging(int slot) const { return staging_[slot].data(); }
  cudaEvent_t ready(int slot) const { return ready_[slot]; }

 private:
  // Whether this call records a one-shot kernel: a one-shot rank whose stream is being captured.
  Result<bool> RecordsOneShot(cudaStream_t stream) const;
  // The one-shot call's host part while recording: count it, check the capacity, meet the others
  // (agreeing on the size), then `launch`.
  Status RecordOneShot(const char* what, size_t bytes, const std::function<Status()>& launch);

  // Steps 1 and 2 of a collective of `bytes` input bytes: returns the slot.
  Result<int> Post(const void* input, size_t bytes, const char* what, cudaStream_t stream);
  // Step 3's waits.
  Status WaitForOthers(int slot, cudaStream_t stream);

  InProcessDeviceGroup* group_;
  int rank_, device_;
  size_t capacity_ = 0;
  cuda::DeviceBuffer staging_[2];
  cudaEvent_t ready_[2] = {nullptr, nullptr};
  uint64_t issued_ = 0;  // this rank's eager collectives so far (the same on every rank between meetings)
  // One-shot (oneshot_ only).
  const bool oneshot_;
  size_t os_capacity_ = 0;
  cuda::DeviceBuffer os_slots_, os_flags_, os_epochs_;
  OneShotView view_;
};

class InProcessDeviceGroup final : public DeviceGroup {
 public:
  InProcessDeviceGroup(int size, double timeout_s)
      : size_(size), timeout_s_(timeout_s), barrier_(size, timeout_s, "tensor-parallel device group"), bytes_(size, 0) {}
  // `oneshot`: null for the device-in-process group.
  Status Init(const std::vector<int>& devices, size_t capacity, const OneShotOptions* oneshot) {
    for (int r = 0; r < size_; ++r) {
      ranks_.push_back(std::make_unique<InProcessDeviceRank>(this, r, devices[r], oneshot != nullptr));
      const std::string where = fmt::format("rank {} on device {}", r, devices[r]);
      DL_RETURN_IF_ERROR(ranks_.back()->Init(capacity).WithContext(where));
      if (oneshot != nullptr) {
        DL_RETURN_IF_ERROR(ranks_.back()->InitOneShot(oneshot->capacity_bytes, oneshot->blocks, oneshot->two_shot_min_bytes).WithContext(where));
      }
    }
    if (oneshot == nullptr) return Status::Ok();
    // [0]: the group's abort word; [1 + r]: rank r's error word. Pinned host memory is mapped into
    // every device at the same address (unified addressing).
    DL_ASSIGN_OR_RETURN(words_, cuda::PinnedBuffer::Allocate(sizeof(uint32_t) * (1 + size_)));
    for (int i = 0; i <= size_; ++i) words_.as<uint32_t>()[i] = 0;
    for (int r = 0; r < size_; ++r) {
      OneShotView& v = ranks_[r]->view();
      v.size = size_;
      for (int q = 0; q < size_; ++q) {
        v.slots[q] = ranks_[q]->oneshot_slots();
        v.flags[q] = ranks_[q]->oneshot_flags();
      }
      v.abort = words_.as<uint32_t>();
      v.error = words_.as<uint32_t>() + 1 + r;
      v.timeout_ns = static_cast<uint64_t>(std::min(timeout_s_, 1e9) * 1e9);
    }
    return Status::Ok();
  }
  // The device-side outcome of rank r's one-shot waits (0 none, 1 aborted, 2 timed out).
  uint32_t device_error(int r) const { return words_.bytes() == 0 ? 0u : *(volatile uint32_t*)(words_.as<uint32_t>() + 1 + r); }
  double timeout_s() const { return timeout_s_; }
  DeviceCommunicator& rank(int r) override { return *ranks_[r]; }
  InProcessDeviceRank& device_rank(int r) { return *ranks_[r]; }
  int size() const override { return size_; }

  // Every rank arrives with the bytes it posts; all must agree.
  Status Meet(int r, size_t bytes, const char* what) {
    bytes_[r] = bytes;  // this rank's slot, read by the last arrival under the barrier's lock
    return barrier_.Arrive(r, what, [&]() -> Status {
      for (int q = 1; q < size_; ++q) {
        if (bytes_[q] != bytes_[0]) {
          return InvalidArgument("device {}: rank 0 gives {} bytes, rank {} gives {}", what, bytes_[0], q, bytes_[q]);
        }
      }
      return Status::Ok();
    });
  }

  void Abort(int r, const Status& reason) {
    // Spinning one-shot kernels (already launched graphs) leave at their next look at the word.
    if (words_.bytes() > 0) *(volatile uint32_t*)words_.as<uint32_t>() = 1;
    barrier_.Abort(r, reason);
  }

 private:
  const int size_;
  const double timeout_s_;
  cuda::PinnedBuffer words_;
  std::vector<std::unique_ptr<InProcessDeviceRank>> ranks_;
  RankBarrier barrier_;
  std::vector<size_t> bytes_;
};

int InProcessDeviceRank::size() const { return group_->size(); }

Result<int> InProcessDeviceRank::Post(const void* input, size_t bytes, const char* what, cudaStream_t stream) {
  ++collectives_issued_;
  if (bytes > capacity_) {
    Status st = InvalidArgument("device {} of {} bytes exceeds the group's staging capacity of {}", what, bytes,
                                capacity_);
    Abort(st);  // the other ranks would otherwise wait for this one
    return st;
  }
  const int slot = static_cast<int>(issued_++ & 1);
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (bytes > 0) {
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staging_[slot].data(), input, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  DL_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_[slot], stream));
  DL_RETURN_IF_ERROR(group_->Meet(rank_, bytes, what));
  return slot;
}

Status InProcessDeviceRank::WaitForOthers(int slot, cudaStream_t stream) {
  for (int q = 0; q < group_->size(); ++q) {
    if (q == rank_) continue;
    DL_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, group_->device_rank(q).ready(slot), 0));
  }
  return Status::Ok();
}

Result<bool> InProcessDeviceRank::RecordsOneShot(cudaStream_t stream) const {
  if (!oneshot_) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  DL_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

Status InProcessDeviceRank::RecordOneShot(const char* what, size_t bytes, const std::function<Status()>& launch) {
  ++collectives_issued_;
  if (bytes > os_capacity_) {
    Status st = InvalidArgument(
        "device {} of {} bytes inside a CUDA graph capture exceeds the one-shot capacity of {} bytes (a graph "
        "cannot hold the host-meeting path: run it eagerly, or create the group with a larger one-shot capacity)",
        what, bytes, os_capacity_);
    Abort(st);  // the other ranks would otherwise wait for this one at the meeting
    return st;
  }
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  DL_RETURN_IF_ERROR(group_->Meet(rank_, bytes, what));
  return launch();
}

Status InProcessDeviceRank::DeviceError() const {
  switch (group_->device_error(rank_)) {
    case 0: return Status::Ok();
    case 1:
      return Status(StatusCode::kCancelled,
                    fmt::format("rank {}'s one-shot collective left its wait because the device group was aborted",
                                rank_));
    default:
      return Status(StatusCode::kDeadlineExceeded,
                    fmt::format("rank {} waited more than {} s in a one-shot collective for a peer that never came",
                                rank_, group_->timeout_s()));
  }
}

Status InProcessDeviceRank::AllReduceSum(void* data, int64_t count, DeviceElem elem, CUstream_st* stream) {
  const size_t bytes = static_cast<size_t>(count) * DeviceElemBytes(elem);
  DL_ASSIGN_OR_RETURN(const bool oneshot, RecordsOneShot(stream));
  if (oneshot) {
    return RecordOneShot("all-reduce", bytes, [&] { return LaunchOneShotAllReduce(view_, data, count, elem, stream); });
  }
  DL_ASSIGN_OR_RETURN(const int slot, Post(data, bytes, "all-reduce", stream));
  DL_RETURN_IF_ERROR(WaitForOthers(slot, stream));
  if (count == 0) return Status::Ok();
  std::vector<const void*> inputs(static_cast<size_t>(group_->size()));
  for (int q = 0; q < group_->size(); ++q) inputs[q] = group_->device_rank(q).staging(slot);
  return LaunchSumInRankOrder(inputs, data, count, elem, stream);
}

Status InProcessDeviceRank::AllGather(const void* local, size_t bytes, void* out, CUstream_st* stream) {
  DL_ASSIGN_OR_RETURN(const bool oneshot, RecordsOneShot(stream));
  if (oneshot) {
    return RecordOneShot("all-gather", bytes, [&] { return LaunchOneShotAllGather(view_, local, bytes, out, stream); });
  }
  DL_ASSIGN_OR_RETURN(const int slot, Post(local, bytes, "all-gather", stream));
  DL_RETURN_IF_ERROR(WaitForOthers(slot, stream));
  if (bytes == 0) return Status::Ok();
  for (int q = 0; q < group_->size(); ++q) {
    const InProcessDeviceRank& src = group_->device_rank(q);
    char* dst = static_cast<char*>(out) + static_cast<size_t>(q) * bytes;
    if (src.device() == device_) {
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src.staging(slot), bytes, cudaMemcpyDeviceToDevice, stream));
    } else {
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpyPeerAsync(dst, device_, src.staging(slot), src.device(), bytes, stream));
    }
  }
  return Status::Ok();
}

void InProcessDeviceRank::Abort(const Status& reason) { group_->Abort(rank_, reason); }

// Ranks on different GPUs read each other's staging buffers: every pair needs peer access.
Status EnablePeerAccess(const std::vector<int>& devices) {
  const std::set<int> distinct(devices.begin(), devices.end());
  for (int a : distinct) {
    for (int b : distinct) {
      if (a == b) continue;
      int can = 0;
      DL_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can) {
        return Unavailable("device {} cannot access device {}'s memory (no peer access between them): the in-process "
                           "device communicator needs it for ranks on different GPUs",
                           a, b);
      }
      DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(a));
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // not an error here; clear it so a later cudaGetLastError does not report it
      } else if (e != cudaSuccess) {
        return Internal("cudaDeviceEnablePeerAccess({} -> {}): {}", a, b, cudaGetErrorString(e));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {

Result<std::shared_ptr<DeviceGroup>> CreateGroup(const std::vector<int>& devices, size_t capacity_bytes,
                                                 const DeviceGroup::OneShotOptions* oneshot, double timeout_s) {
  if (devices.empty()) return InvalidArgument("a device group needs at least one rank");
  if (devices.size() > kMaxReduceRanks) {
    return InvalidArgument("a device group of {} ranks exceeds the {} the rank-order sum takes", devices.size(),
                           kMaxReduceRanks);
  }
  int count = 0;
  DL_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  for (int d : devices) {
    if (d < 0 || d >= count) return InvalidArgument("device {} does not exist ({} visible)", d, count);
  }
  int previous = 0;
  DL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&previous));
  DL_RETURN_IF_ERROR(EnablePeerAccess(devices));
  if (oneshot != nullptr) {
    for (int d : std::set<int>(devices.begin(), devices.end())) {
      DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(d));
      DL_RETURN_IF_ERROR(PreloadOneShotKernels().WithContext(fmt::format("device {}", d)));
    }
  }
  auto group = std::make_shared<InProcessDeviceGroup>(static_cast<int>(devices.size()), timeout_s);
  DL_RETURN_IF_ERROR(group->Init(devices, capacity_bytes, oneshot));
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(previous));
  return std::shared_ptr<DeviceGroup>(std::move(group));
}

}  // namespace

Result<std::shared_ptr<DeviceGroup>> DeviceGroup::CreateInProcess(const std::vector<int>& devices,
                                                                 size_t capacity_bytes, double timeout_s) {
  return CreateGroup(devices, capacity_bytes, nullptr, timeout_s);
}

Result<std::shared_ptr<DeviceGroup>> DeviceGroup::CreateOneShot(const std::vector<int>& devices, size_t capacity_bytes,
                                                               const OneShotOptions& oneshot, double timeout_s) {
  if (devices.size() > static_cast<size_t>(kMaxOneShotRanks)) {
    return InvalidArgument("a one-shot device group of {} ranks exceeds the {} its kernels take", devices.size(),
                           kMaxOneShotRanks);
  }
  if (oneshot.blocks < 1 || oneshot.blocks > kMaxOneShotBlocks) {
    return InvalidArgument("one-shot blocks {}: 1 to {}", oneshot.blocks, kMaxOneShotBlocks);
  }
  return CreateGroup(devices, capacity_bytes, &oneshot, timeout_s);
}

#else  // no CUDA in this build

Result<std::shared_ptr<DeviceGroup>> DeviceGroup::CreateInProcess(const std::vector<int>&, size_t, double) {
  return Unavailable("device communicators need a CUDA build of decodelab");
}
Result<std::shared_ptr<DeviceGroup>> DeviceGroup::CreateOneShot(const std::vector<int>&, size_t, const OneShotOptions&,
                                                               double) {
  return Unavailable("device communicators need a CUDA build of decodelab");
}

#endif

#if defined(DECODELAB_HAVE_CUDA) && defined(DECODELAB_HAVE_NCCL_H)

namespace {

class NcclRank final : public DeviceCommunicator {
 public:
  NcclRank(const NcclApi* api, ncclComm_t comm, int rank, int size, int device)
      : api_(api), comm_(comm), rank_(rank), size_(size), device_(device) {}
  ~NcclRank() override {
    if (comm_ == nullptr) return;
    if (aborted_) {
      api_->CommAbort(comm_);
    } else {
      api_->CommDestroy(comm_);
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return device_; }
  std::string transport() const override { return "nccl"; }
  bool capturable() const override { return true; }
  Status AllReduceSum(void* data, int64_t count, DeviceElem elem, CUstream_st* stream) override {
    ++collectives_issued_;
    if (aborted_) return abort_reason_;
    const ncclDataType_t t = elem == DeviceElem::kF32 ? ncclFloat32 : ncclBfloat16;
    return Check(api_->AllReduce(data, data, static_cast<size_t>(count), t, ncclSum, comm_, stream), "ncclAllReduce");
  }
  Status AllGather(const void* local, size_t bytes, void* out, CUstream_st* stream) override {
    ++collectives_issued_;
    if (aborted_) return abort_reason_;
    return Check(api_->AllGather(local, out, bytes, ncclChar, comm_, stream), "ncclAllGather");
  }
  void Abort(const Status& reason) override {
    // ncclCommAbort (in the destructor) ends this rank's pending collectives; peers blocked in theirs
    // see the failure through NCCL's own error handling.
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = reason.ok() ? Status(StatusCode::kCancelled, "aborted") : reason;
  }

 private:
  Status Check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return Status::Ok();
    return Internal("{} on rank {} (device {}): {}", what, rank_, device_, api_->Describe(r, comm_));
  }
  const NcclApi* api_;
  ncclComm_t comm_;
  int rank_, size_, device_;
  bool aborted_ = false;
  Status abort_reason_;
};

}  // namespace

Result<std::vector<std::unique_ptr<DeviceCommunicator>>> CreateNcclGroup(const std::vector<int>& devices) {
  if (devices.empty()) return InvalidArgument("an NCCL group needs at least one rank");
  if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
    return InvalidArgument("NCCL takes one rank per GPU, and the {} ranks repeat a device (use the in-process device "
                           "communicator for ranks sharing a GPU)",
                           devices.size());
  }
  DL_ASSIGN_OR_RETURN(const NcclApi* api, LoadNccl());
  if (api->CommInitAll == nullptr || api->AllGather == nullptr) {
    return Unavailable("{} lacks ncclCommInitAll or ncclAllGather", api->library_path);
  }
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  const ncclResult_t r = api->CommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data());
  if (r != ncclSuccess) return Internal("ncclCommInitAll over {} GPUs: {}", devices.size(), api->Describe(r, nullptr));
  std::vector<std::unique_ptr<DeviceCommunicator>> out;
  for (size_t i = 0; i < devices.size(); ++i) {
    out.push_back(std::make_unique<NcclRank>(api, comms[i], static_cast<int>(i), static_cast<int>(devices.size()),
                                             devices[i]));
  }
  return out;
}

#else

Result<std::vector<std::unique_ptr<DeviceCommunicator>>> CreateNcclGroup(const std::vector<int>&) {
  return Unavailable("this build of decodelab has no NCCL support (configure with CUDA where nccl.h is found)");
}

#endif

}  // namespace dl::comm
