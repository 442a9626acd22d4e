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

// The test hook of the tensor-parallel runners (FailNextForwardOnRank): rank r's next Take returns
// the error Set for it, once; the runner's step then fails that rank before it starts its forward
// (a thread rank) or sends it to the rank with its step plan (a process rank). Thread-safe.
class InjectedFailures {
 public:
  void Set(int rank, Status error);  // a negative rank is ignored
  Status Take(int rank);             // Ok when nothing was set for it

 private:
  std::mutex mu_;
  std::vector<Status> injected_;  // by rank
};

class RankThreads {
 public:
  explicit RankThreads(int ranks);  // starts ranks - 1 worker threads
  ~RankThreads();                   // stops and joins them (no step may be running)
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  // step(r) for every rank r, at once; returns when every rank's call has returned, with their
  // statuses by rank. Not reentrant.
  std::vector<Status> Run(const std::function<Status(int)>& step);

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
  std::vector<std::thread> workers_;
};

}  // namespace dl
