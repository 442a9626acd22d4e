// The collectives a tensor-parallel engine uses (docs/tensor-parallel.md). Every method is a
// collective: each rank of the group calls it, in the same order, with the same sizes. Results are
// bit-identical on every rank and run to run: sums are taken in one fixed rank order.
//
// Built: InProcessGroup (ranks are threads of one process sharing memory: tests and the CPU
// reference's --tp) and TcpCommunicator (ranks anywhere, over comm::TcpGroup's star). The CUDA
// backend's collectives on device buffers are comm/device_communicator.h (the same contract with a
// stream: an in-process device group with this same rank-order sum, and NCCL).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace dl::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "in-process", "tcp".
  virtual std::string transport() const = 0;

  // data[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ... over ranks 0, 1, ..., size-1 (x_r: rank r's data),
  // on every rank.
  virtual Status AllReduceSum(std::span<float> data) = 0;
  // out = the concatenation, in rank order, of every rank's `local`; rank r contributes
  // bytes_per_rank[r] bytes (the same list on every rank; out holds their sum).
  virtual Status AllGather(std::span<const std::byte> local, std::span<const size_t> bytes_per_rank,
                           std::span<std::byte> out) = 0;
  // Ends the group: this rank's and every other rank's pending and later collectives fail, naming
  // `reason` (a rank whose forward failed calls it so the others do not wait for it forever).
  virtual void Abort(const Status& reason) = 0;

  // Collectives this rank has issued (AllReduceSum and AllGather calls): the topology audit's count.
  int64_t collectives_issued() const { return collectives_issued_; }

 protected:
  int64_t collectives_issued_ = 0;
};

// AllGather of floats: every rank's `local` (counts[r] floats from rank r) concatenated in rank
// order.
Result<std::vector<float>> AllGatherFloats(Communicator& comm, std::span<const float> local,
                                           std::span<const int64_t> counts);

// One rank's best candidate for a row's greedy token over its vocabulary slice.
struct ArgmaxCandidate {
  float value = 0.0f;
  int32_t index = -1;  // global vocabulary id; -1 when the rank's slice is empty
  int32_t finite = 1;  // 0 when the rank's slice of the row held NaN or Inf
};
// The greedy token of each row over the whole vocabulary, from each rank's candidates (one per
// row, the same number of rows on every rank): the largest value, ties to the lowest id (ranks hold
// ascending contiguous slices), finite only when every slice was. Exact: the same token as an
// argmax over the gathered row, with one small all-gather instead of the row.
Result<std::vector<ArgmaxCandidate>> DistributedArgmax(Communicator& comm,
                                                       std::span<const ArgmaxCandidate> local);

// A group of `size` in-process ranks (threads sharing memory). Each rank's collectives run on the
// calling thread; a rank waits at most `timeout_s` for the others, then the group is aborted with an
// error naming the ranks that did not arrive.
class InProcessGroup {
 public:
  static std::shared_ptr<InProcessGroup> Create(int size, double timeout_s = 600.0);
  // The communicator of rank r (owned by the group; valid while the group lives).
  virtual Communicator& rank(int r) = 0;
  virtual int size() const = 0;
  virtual ~InProcessGroup() = default;
};

}  // namespace dl::comm
