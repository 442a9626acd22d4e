// Collectives over device memory, for tensor parallelism on the CUDA backend
// (docs/tensor-parallel.md). The same contract as comm::Communicator (every rank calls every
// collective, in the same order, with the same sizes), on buffers in the rank's GPU memory, enqueued
// on the rank's stream: a call returns once the work is enqueued, and the data is ready when the
// stream reaches that point. Three implementations:
//
//   DeviceGroup::CreateInProcess  "device-in-process": ranks are threads of one process, any number
//                                 of them on any GPUs (several ranks may share one GPU; ranks on
//                                 different GPUs need peer access). AllReduceSum adds the ranks'
//                                 values in rank order, ((x0 + x1) + x2) + ..., in FP32, rounded once
//                                 to the buffer's type: the same bits on every rank, run to run, and
//                                 for FP32 the same bits as the CPU's InProcessGroup. Not capturable
//                                 in a CUDA graph: the ranks meet on the host at each collective.
//   DeviceGroup::CreateOneShot    "device-oneshot": the same ranks and the same bits, capturable.
//                                 Inside a stream capture a collective is one kernel per rank that
//                                 copies its input into its slot of device memory the peers read by
//                                 pointer, meets the other ranks through device-side epoch flags and
//                                 combines every rank's slot in rank order (comm/device_reduce.h):
//                                 no host meeting when the graph replays. The ranks still meet on
//                                 the host once when a collective is recorded (checking that they
//                                 agree on its size). Outside a capture (eager forwards) it takes
//                                 the device-in-process path: an eager rank launches kernels for the
//                                 first time, and under CUDA lazy loading a first launch may wait
//                                 for the whole context, including a peer's spinning kernel.
//   CreateNcclGroup               "nccl": one rank per GPU through NCCL (opened at run time,
//                                 comm/nccl_api.h); capturable. NCCL's reduction order depends on
//                                 its algorithm and the rank count: bit-identical run to run at a
//                                 fixed size and topology, not equal to the in-process order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"

struct CUstream_st;

namespace dl::comm {

enum class DeviceElem : uint8_t { kF32, kBF16 };
size_t DeviceElemBytes(DeviceElem e);
const char* DeviceElemName(DeviceElem e);

class DeviceCommunicator {
 public:
  virtual ~DeviceCommunicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual int device() const = 0;  // the CUDA device of this rank's buffers and stream
  // "device-in-process", "device-oneshot", "nccl".
  virtual std::string transport() const = 0;
  // Whether the collectives may be recorded into a CUDA graph (stream capture).
  virtual bool capturable() const = 0;

  // data[i] = the sum over ranks of every rank's data[i] ([count] elements of `elem` in this rank's
  // device memory), on every rank, enqueued on `stream` after the work already there.
  virtual Status AllReduceSum(void* data, int64_t count, DeviceElem elem, CUstream_st* stream) = 0;
  // out[r * bytes, (r + 1) * bytes) = rank r's local[0, bytes), on every rank (the same `bytes`
  // everywhere; out holds size() * bytes).
  virtual Status AllGather(const void* local, size_t bytes, void* out, CUstream_st* stream) = 0;
  // Ends the group: this rank's and every other rank's pending and later collectives fail, naming
  // `reason` (a rank whose forward failed calls it so the others do not wait for it).
  virtual void Abort(const Status& reason) = 0;

  // What the device side of this rank's collectives reported (the one-shot kernels' waits: the group
  // was aborted, or a peer never came within the timeout); read once the rank's stream has passed
  // them. Ok for communicators whose failures show on the host.
  virtual Status DeviceError() const { return Status::Ok(); }

  // Collectives this rank has issued: the topology audit's count.
  int64_t collectives_issued() const { return collectives_issued_; }

 protected:
  int64_t collectives_issued_ = 0;
};

class DeviceGroup {
 public:
  // `devices[r]` is rank r's CUDA device (repeats allowed: ranks sharing a GPU). Each rank gets two
  // staging buffers of `capacity_bytes` on its device: the largest collective it may issue (an
  // all-gather's `bytes` per rank). A rank waits at most `timeout_s` on the host for the others to
  // reach a collective, then the group is aborted with an error naming the ranks that did not come.
  static Result<std::shared_ptr<DeviceGroup>> CreateInProcess(const std::vector<int>& devices, size_t capacity_bytes,
                                                             double timeout_s = 600.0);
  // The one-shot group (the header's "device-oneshot"): CreateInProcess's ranks, staging and timeout
  // for eager collectives, plus per rank two one-shot slots of `oneshot.capacity_bytes` (the largest
  // collective a captured graph may hold; a larger one inside a capture is an error, outside it
  // takes the eager path), flags and epochs. At most 16 ranks. A spinning kernel gives up after
  // `timeout_s` or when the group is aborted, and DeviceError says which.
  struct OneShotOptions {
    size_t capacity_bytes = size_t{2} << 20;
    int blocks = 16;  // the fixed grid of every one-shot kernel (1 to 64): small, so ranks sharing a GPU co-reside
  };
  static Result<std::shared_ptr<DeviceGroup>> CreateOneShot(const std::vector<int>& devices, size_t capacity_bytes,
                                                           const OneShotOptions& oneshot, double timeout_s = 600.0);
  virtual ~DeviceGroup() = default;
  // The communicator of rank r (owned by the group; valid while the group lives).
  virtual DeviceCommunicator& rank(int r) = 0;
  virtual int size() const = 0;
};

// One NCCL communicator per rank, ranks on `devices` (distinct GPUs: NCCL refuses two ranks on one
// GPU), created together by this thread (ncclCommInitAll). Errors: NCCL not loadable, a repeated
// device, NCCL's own failure.
Result<std::vector<std::unique_ptr<DeviceCommunicator>>> CreateNcclGroup(const std::vector<int>& devices);

// The value the in-process AllReduceSum gives for one element, on the host: the ranks' values in rank
// order, added in FP32, rounded once to `elem` (BF16: round to nearest even). Tests compare the
// device's bits with it.
float RankOrderSum(const std::vector<float>& per_rank, DeviceElem elem);

}  // namespace dl::comm
