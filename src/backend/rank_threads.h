// The threads of a tensor-parallel runner's ranks (CpuTpRunner, CudaTpRunner): rank 0 runs on the
// caller's thread (it is the ModelRunner the engine talks to), ranks 1..n-1 on one worker thread each,
// and every step runs on all of them at once: a rank's collectives wait for the others, so the ranks
// cannot take turns on one thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"

namespace dl {

class RankThreads {
 public:
  explicit RankThreads(int ranks);  // starts ranks - 1 worker threads
  ~RankThreads();                   // stops and joins them (no step may be running)
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  // step(r) for every rank r, at once; returns when every rank's call has returned, with their
  // statuses by rank. Not reentrant.
  std::vector<Status> Run(const std::function<Status(int)>& step);

  // Test hook: rank `rank`'s next TakeInjected returns `error` (the runner's step fails that rank
  // before it starts its forward).
  void InjectFailure(int rank, Status error);
  Status TakeInjected(int rank);

  // "rank r: <status>; rank s: <status>" over the failed ranks, "" when none failed.
  static std::string DescribeFailures(const std::vector<Status>& statuses);

 private:
  void WorkerLoop(int rank);

  const int ranks_;
  std::mutex mu_;
  std::condition_variable step_cv_, done_cv_;
  uint64_t step_ = 0;
  const std::function<Status(int)>* step_fn_ = nullptr;
  int done_ = 0;
  bool stop_ = false;
  std::vector<Status> statuses_;  // [ranks], of the current step
  std::vector<Status> injected_;  // [ranks]
  std::vector<std::thread> workers_;
};

}  // namespace dl
