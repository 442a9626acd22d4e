// The meeting point of ranks that are threads of one process (the in-process host group and the
// in-process device group): every rank arrives, the last one completes the meeting, and a rank that
// waits longer than the timeout ends the group with an error naming the ranks that never came. Once
// aborted (by a timeout or by a failed rank), every arrival returns the abort's status at once.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "base/status.h"

namespace dl::comm {

class RankBarrier {
 public:
  // `group`: how errors name the group ("tensor-parallel group").
  RankBarrier(int size, double timeout_s, std::string group);

  // Rank r arrives at the meeting `what` (named in a timeout). The last arrival runs on_last (under the
  // barrier's lock, every rank's writes before its arrival visible) and its status becomes every
  // rank's result of this meeting; nullptr: Ok.
  Status Arrive(int r, const char* what, const std::function<Status()>& on_last = nullptr);
  // Ends the group: every waiting and later arrival returns `reason` (Cancelled when it is Ok), with
  // the rank that aborted in its context. The first abort's reason stays.
  void Abort(int r, const Status& reason);

 private:
  void AbortLocked(Status reason);

  const int size_;
  const double timeout_s_;
  const std::string group_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> arrived_;
  int arrived_count_ = 0;
  uint64_t generation_ = 0;
  Status result_;  // of the last completed meeting
  bool aborted_ = false;
  Status abort_reason_;
};

}  // namespace dl::comm
