#include "comm/tcp_communicator.h"

namespace dl::comm {

Status TcpCommunicator::Check(Status st) {
  // A failed collective leaves the stream mid-message: the group cannot be used again.
  if (!st.ok()) Abort(st);
  return st;
}

Status TcpCommunicator::AllReduceSum(std::span<float> data) {
  ++collectives_issued_;
  if (!group_) return aborted_;
  return Check(group_->AllReduceSum(data, DeadlineIn(timeout_s_))
                   .WithContext(fmt::format("tensor-parallel all-reduce on rank {}", rank_)));
}

Status TcpCommunicator::AllGather(std::span<const std::byte> local, std::span<const size_t> bytes_per_rank,
                                  std::span<std::byte> out) {
  ++collectives_issued_;
  if (!group_) return aborted_;
  if (static_cast<int>(bytes_per_rank.size()) != size_ || local.size() != bytes_per_rank[rank_]) {
    return InvalidArgument("all-gather on rank {}: {} bytes given, the sizes say {}", rank_, local.size(),
                           static_cast<int>(bytes_per_rank.size()) == size_ ? bytes_per_rank[rank_] : 0);
  }
  size_t total = 0;
  for (size_t b : bytes_per_rank) total += b;
  if (out.size() < total) return InvalidArgument("all-gather: output of {} bytes, {} needed", out.size(), total);
  return Check(group_->AllGather(local.data(), bytes_per_rank, out.data(), DeadlineIn(timeout_s_))
                   .WithContext(fmt::format("tensor-parallel all-gather on rank {}", rank_)));
}

void TcpCommunicator::Abort(const Status& reason) {
  if (!group_) return;
  aborted_ = (reason.ok() ? Status(StatusCode::kCancelled, "aborted") : reason)
                 .WithContext(fmt::format("tensor-parallel group aborted on rank {}", rank_));
  group_.reset();  // closes the sockets: peers see the connection end
}

}  // namespace dl::comm
