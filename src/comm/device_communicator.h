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
//   CreateOneShotIpcRank          "device-oneshot-ipc": device-oneshot with ranks as processes (CUDA
//                                 IPC handles; eager collectives run the kernels too).
//   CreateNcclGroup               "nccl": one rank per GPU through NCCL (opened at run time,
//                                 comm/nccl_api.h); capturable. NCCL's reduction order depends on
//                                 its algorithm and the rank count: bit-identical run to run at a
//                                 fixed size and topology, not equal to the in-process order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"

struct CUstream_st;

namespace dl::comm {

class Communicator;

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
  // How the all-reduce is chosen by size, where there is a choice ("two-shot>=524288": messages of at
  // least that many bytes take the two-shot kernel); empty where every size takes one algorithm.
  // Part of the topology signature: it names what a captured graph's collectives run.
  virtual std::string all_reduce_rule() const { return ""; }
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
    // All-reduces of at least this many bytes take the two-shot kernel (comm/device_reduce.h: the
    // same bits as one-shot, fewer bytes read from peers at 3+ ranks); 0: never.
    size_t two_shot_min_bytes = 0;
  };
  static Result<std::shared_ptr<DeviceGroup>> CreateOneShot(const std::vector<int>& devices, size_t capacity_bytes,
                                                           const OneShotOptions& oneshot, double timeout_s = 600.0);
  virtual ~DeviceGroup() = default;
  // The communicator of rank r (owned by the group; valid while the group lives).
  virtual DeviceCommunicator& rank(int r) = 0;
  virtual int size() const = 0;
};

// One rank of a one-shot group whose ranks are processes ("device-oneshot-ipc"; backend/
// tp_process_ranks.h runs CUDA ranks so): the same kernels, slots, flags and epochs as CreateOneShot,
// so the same bits (the rank-order FP32 sum, rounded once), the buffers shared through CUDA IPC
// handles instead of pointers of one process. Called by every rank of the group with its own rank,
// the same size, options and timeout, and its CUDA device.
//
// `exchange` all-gathers equal-sized byte records between the ranks (the caller's control channel:
// the processes' TCP group): returns every rank's record concatenated in rank order. Called three
// times by every rank, in the same order.
//
// Who owns what, and why: rank 0 allocates every rank's slots and flags (rank r's on rank r's
// device) and exports them; ranks 1..N-1 open them (cudaIpcOpenMemHandle) and close them when their
// communicator goes. So a child that dies or is killed never frees memory a survivor's kernel still
// writes to (rank 0 outlives its children; a child dies with rank 0). Epochs are each rank's own.
//
// Abort: the kernels read one abort word in shared host memory (a /dev/shm page rank 0 creates and
// every rank maps and registers with CUDA), so Abort on any rank ends the spinning kernels of every
// rank at once, as the in-process group's abort does. A rank that dies without aborting is noticed
// on the host (rank 0's supervision aborts for it) or by the spin timeout.
//
// Eager (uncaptured) collectives run the same one-shot kernels: each process has its own CUDA
// context, so a first launch under lazy loading waits only for this rank's own work, never for a
// peer's spinning kernel (the one-shot kernels are loaded at creation anyway). There is no host
// meeting, so every collective, eager or captured, must fit the capacity.
// (A vector, not a span: this header is also compiled as C++17 by the .cu files.)
using ExchangeBytes = std::function<Result<std::vector<std::byte>>(const std::vector<std::byte>& mine)>;
// The exchange over a host communicator (Communicator::AllGather of equal parts); `comm` must outlive
// the returned function.
ExchangeBytes ExchangeOver(Communicator& comm);
Result<std::unique_ptr<DeviceCommunicator>> CreateOneShotIpcRank(int rank, int size, int device,
                                                                 const DeviceGroup::OneShotOptions& oneshot,
                                                                 double timeout_s, const ExchangeBytes& exchange);

// One NCCL communicator per rank, ranks on `devices` (distinct GPUs: NCCL refuses two ranks on one
// GPU), created together by this thread (ncclCommInitAll). Errors: NCCL not loadable, a repeated
// device, NCCL's own failure.
Result<std::vector<std::unique_ptr<DeviceCommunicator>>> CreateNcclGroup(const std::vector<int>& devices);

// The value the in-process AllReduceSum gives for one element, on the host: the ranks' values in rank
// order, added in FP32, rounded once to `elem` (BF16: round to nearest even). Tests compare the
// device's bits with it.
float RankOrderSum(const std::vector<float>& per_rank, DeviceElem elem);

}  // namespace dl::comm
