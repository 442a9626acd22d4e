#include "backend/rank_threads.h"

#include <utility>

namespace dl {

RankThreads::RankThreads(int ranks) : ranks_(ranks), statuses_(ranks) {
  for (int r = 1; r < ranks; ++r) workers_.emplace_back(&RankThreads::WorkerLoop, this, r);
}

RankThreads::~RankThreads() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  step_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void RankThreads::WorkerLoop(int r) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<Status(int)>* fn = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      step_cv_.wait(lk, [&] { return stop_ || step_ != seen; });
      if (stop_) return;
      seen = step_;
      fn = step_fn_;
    }
    Status st = (*fn)(r);
    {
      std::lock_guard<std::mutex> lk(mu_);
      statuses_[r] = std::move(st);
      ++done_;
    }
    done_cv_.notify_all();
  }
}

std::vector<Status> RankThreads::Run(const std::function<Status(int)>& step) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    step_fn_ = &step;  // read by every worker before it counts itself done
    done_ = 0;
    ++step_;
  }
  step_cv_.notify_all();
  Status st0 = step(0);
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return done_ == ranks_ - 1; });
  statuses_[0] = std::move(st0);
  step_fn_ = nullptr;
  return statuses_;
}

void InjectedFailures::Set(int rank, Status error) {
  if (rank < 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (rank >= static_cast<int>(injected_.size())) injected_.resize(rank + 1);
  injected_[rank] = std::move(error);
}

Status InjectedFailures::Take(int rank) {
  std::lock_guard<std::mutex> lk(mu_);
  if (rank < 0 || rank >= static_cast<int>(injected_.size())) return Status::Ok();
  return std::exchange(injected_[rank], Status::Ok());
}

std::string RankThreads::DescribeFailures(const std::vector<Status>& statuses) {
  std::string failures;
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) {
      failures += fmt::format("{}rank {}: {}", failures.empty() ? "" : "; ", r, statuses[r].ToString());
    }
  }
  return failures;
}

}  // namespace dl
