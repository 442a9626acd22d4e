// Communicator over a TcpGroup (comm/tcp_group.h): CPU ranks in separate processes or machines, or
// threads of one process over loopback (tests). Sums are taken on rank 0 in rank order (the same
// order as InProcessGroup), every collective is bounded by a timeout naming the rank it waited for,
// and Abort closes this rank's sockets so its peers fail at once instead of waiting.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/tcp_group.h"

namespace dl::comm {

class TcpCommunicator final : public Communicator {
 public:
  TcpCommunicator(std::unique_ptr<TcpGroup> group, double timeout_s)
      : group_(std::move(group)), rank_(group_->rank()), size_(group_->world_size()), timeout_s_(timeout_s) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "tcp"; }
  Status AllReduceSum(std::span<float> data) override;
  Status AllGather(std::span<const std::byte> local, std::span<const size_t> bytes_per_rank,
                   std::span<std::byte> out) override;
  void Abort(const Status& reason) override;

 private:
  Status Check(Status st);

  std::unique_ptr<TcpGroup> group_;  // null once aborted
  int rank_, size_;
  double timeout_s_;
  Status aborted_;
};

}  // namespace dl::comm
