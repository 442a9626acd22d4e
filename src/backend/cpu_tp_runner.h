// Tensor parallelism on the CPU reference: tp ranks, each a CpuRunner holding only its shard of the
// weights (model/shard_plan.h) and its KV heads, running the one Laguna forward and combining partial
// sums through a comm::Communicator. Rank 0 is the ModelRunner the engine and scheduler talk to: it
// owns scheduling, and each Launch hands the step's plan (the ForwardBatch, with its sequences' block
// tables) to the other ranks. The ranks are threads of this process (the plan is shared memory),
// their collectives in-process or over TCP on loopback; or ranks 1..N-1 are child processes
// (kProcesses, backend/tp_process_ranks.h: the plan serialised to each child over a control
// connection, the collectives over TCP). Every transport sums in the same rank order, so they give
// the same bits. A rank whose forward fails (or, as a process, dies or stops answering) aborts the
// group, so no rank waits for it; the runner then refuses every later step with the error
// (docs/tensor-parallel.md).
#pragma once

#include <memory>
#include <vector>

#include "backend/cpu_runner.h"
#include "backend/rank_threads.h"
#include "backend/tp_process_ranks.h"
#include "comm/communicator.h"
#include "model/shard_plan.h"

namespace dl {

enum class TpTransport : uint8_t {
  kInProcess,   // ranks are threads; collectives through shared memory
  kTcpLoopback, // ranks are threads; collectives over TCP on 127.0.0.1
  kProcesses,   // ranks 1..N-1 are child processes; collectives over TCP on 127.0.0.1
};
const char* TpTransportName(TpTransport t);  // "in-process", "tcp-loopback", "processes"

class CpuTpRunner final : public ModelRunner {
 public:
  // `checkpoint` must outlive the runner. `collective_timeout_s` bounds every wait for another rank.
  // `processes` (kProcesses only) says how to start the children, which must build the same
  // checkpoint.
  static Result<std::unique_ptr<CpuTpRunner>> Create(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                     KvScales scales, int tp_size, EmbeddingMode embedding,
                                                     TpTransport transport = TpTransport::kInProcess,
                                                     double collective_timeout_s = 600.0,
                                                     const TpProcessOptions& processes = {});
  // kProcesses: stops the children (stop message, a bounded wait, then kill) and reaps them.
  ~CpuTpRunner() override;

  std::string backend_name() const override { return "cpu-reference"; }
  const KvCacheSpec& kv_spec() const override { return kv_spec_; }
  const KvScales& kv_scales() const override { return ranks_[0]->kv_scales(); }
  int32_t max_rows() const override { return ranks_[0]->max_rows(); }
  int32_t max_outputs() const override { return ranks_[0]->max_outputs(); }
  Status Launch(const ForwardBatch& batch) override;
  Status Wait(ForwardResult* result) override;
  // KV observation (calibration) sees whole K/V vectors: it runs on one rank (engine.h's
  // CalibrateKvScales), and a forward here with an observer set is refused.
  void set_kv_observer(KvObserver* observer) override { observer_ = observer; }
  nlohmann::json Describe() const override;

  const TensorParallelPlan& plan() const { return plan_; }
  // Collectives each rank issued in the last forward, by rank.
  std::vector<int64_t> collectives_last_forward() const;
  // Test hook: rank `rank`'s next forward fails with `error` before it starts (the other ranks then
  // block in their first collective until the group is aborted). A child process gets the failure
  // in its next step message.
  void FailNextForwardOnRank(int rank, Status error);
  // kProcesses: rank r's process id (0 for rank 0, this process); empty for the thread transports.
  std::vector<pid_t> rank_pids() const;

 private:
  CpuTpRunner() = default;
  Status RunRank(int rank, const ForwardBatch& batch, ForwardResult* result);
  // Runs the step on every rank; their statuses by rank.
  std::vector<Status> RunStep(const ForwardBatch& batch);
  int64_t rank_collectives(int rank) const;

  TensorParallelPlan plan_;
  TpTransport transport_ = TpTransport::kInProcess;
  KvCacheSpec kv_spec_;
  int64_t num_layers_ = 0, vocab_size_ = 0;
  std::shared_ptr<comm::InProcessGroup> in_process_;       // kInProcess
  std::vector<std::unique_ptr<comm::Communicator>> owned_;  // kTcpLoopback
  std::vector<comm::Communicator*> comms_;                 // [tp]
  std::unique_ptr<TpProcessRanks> children_;               // kProcesses: ranks 1..tp-1 (and rank 0's comm)
  InjectedFailures injected_;                              // FailNextForwardOnRank's
  std::vector<std::unique_ptr<CpuRunner>> ranks_;          // [tp]; kProcesses: [1], rank 0's
  KvScales scales_;                                        // what every rank uses
  KvObserver* observer_ = nullptr;

  std::unique_ptr<RankThreads> threads_;  // thread transports: ranks 1..tp-1; last, so it goes first

  bool in_flight_ = false;
  Status broken_;  // set once a forward failed on some rank: the group is gone
  ForwardResult result_;
  Status status_;
};

}  // namespace dl
