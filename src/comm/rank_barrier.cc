#include "comm/rank_barrier.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace dl::comm {

RankBarrier::RankBarrier(int size, double timeout_s, std::string group)
    : size_(size), timeout_s_(timeout_s), group_(std::move(group)), arrived_(size, false) {}

Status RankBarrier::Arrive(int r, const char* what, const std::function<Status()>& on_last) {
  std::unique_lock<std::mutex> lk(mu_);
  if (aborted_) return abort_reason_;
  const uint64_t gen = generation_;
  arrived_[r] = true;
  if (++arrived_count_ == size_) {
    arrived_count_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), false);
    result_ = on_last ? on_last() : Status::Ok();
    ++generation_;
    cv_.notify_all();
    return result_;
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s_));
  const bool done = cv_.wait_until(lk, deadline, [&] { return generation_ != gen || aborted_; });
  // A later meeting cannot complete before this rank arrives at it: result_ is still this one's.
  if (generation_ != gen) return result_;
  if (!done && !aborted_) {
    std::string missing;
    for (int q = 0; q < size_; ++q) {
      if (!arrived_[q]) missing += (missing.empty() ? "" : ",") + std::to_string(q);
    }
    AbortLocked(Status(StatusCode::kDeadlineExceeded, fmt::format("{}: rank {} waited {} s in {} for rank(s) {}",
                                                                  group_, r, timeout_s_, what, missing)));
  }
  return abort_reason_;
}

void RankBarrier::Abort(int r, const Status& reason) {
  std::lock_guard<std::mutex> lk(mu_);
  const Status why = reason.ok() ? Status(StatusCode::kCancelled, "aborted") : reason;
  AbortLocked(why.WithContext(fmt::format("{} aborted by rank {}", group_, r)));
}

void RankBarrier::AbortLocked(Status reason) {
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = std::move(reason);
  cv_.notify_all();
}

}  // namespace dl::comm
