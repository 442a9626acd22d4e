// Tensor parallelism on the CUDA backend: tp ranks, each a CudaRunner holding only its shard of the
// weights (model/shard_plan.h) and its KV heads on its GPU, running the one Laguna forward and
// combining partial sums through a comm::DeviceCommunicator. The mirror of CpuTpRunner: rank 0 is the
// ModelRunner the engine and scheduler talk to, each Launch hands the step's plan (the ForwardBatch,
// with its sequences' block tables) to the other ranks, which are threads of this process.
//
// Rank r runs on GPU r % gpus: with more ranks than visible GPUs, ranks share GPUs round-robin (each
// with its own stream, weights and workspace). The communicator: the one-shot device communicator
// (any ranks on any GPUs with peer access; the rank-order FP32 sum, two-shot for large messages),
// NCCL only where GPUs lack peer access or on request (its order depends on the message size); with
// either, each rank's forwards are CUDA graphs with the collectives inside. The
// in-process device communicator (host meetings, eager forwards) on request. With kProcesses, ranks
// 1..N-1 are child processes instead of threads (the CPU's TpProcessRanks: spawn, control channel,
// supervision), and the one-shot buffers are shared through CUDA IPC handles. A rank whose forward
// fails aborts the group, and every later step is refused with the error (docs/tensor-parallel.md).
#pragma once

#include <memory>
#include <string_view>
#include <vector>

#include "backend/cuda_runner.h"
#include "backend/rank_threads.h"
#include "backend/tp_process_ranks.h"
#include "comm/device_communicator.h"
#include "comm/rank_barrier.h"
#include "model/shard_plan.h"

namespace dl {

enum class CudaTpTransport : uint8_t {
  kAuto,             // kDeviceOneShot; NCCL only for ranks on distinct GPUs without peer access (if it loads)
  kDeviceInProcess,  // comm::DeviceGroup::CreateInProcess (not capturable: eager forwards)
  kDeviceOneShot,    // comm::DeviceGroup::CreateOneShot
  kNccl,             // comm::CreateNcclGroup (one rank per GPU)
  kProcesses,        // ranks 1..N-1 are child processes (backend/tp_process_ranks.h) over
                     // comm::CreateOneShotIpcRank ("device-oneshot-ipc")
};
// "auto", "device-in-process", "device-oneshot", "nccl", "processes"
const char* CudaTpTransportName(CudaTpTransport t);
Result<CudaTpTransport> ParseCudaTpTransport(std::string_view name);

// Rank r's GPU when `tp` ranks share `gpus` visible GPUs: r % gpus.
std::vector<int> TpRankDevices(int tp, int gpus);

// Whether the CUDA backend can run `checkpoint` split by `plan` (no GPU needed): every rank's widths
// suit the kernels (multiples of 8, none empty), the embedding is replicated, and the weights are on
// the host and unquantised (the shards are cut from them). Errors name the rank and what is wrong.
Status CheckCudaTensorParallel(const Checkpoint& checkpoint, const TensorParallelPlan& plan);

class CudaTpRunner final : public ModelRunner {
 public:
  // `checkpoint` must outlive the runner and hold host weights (BF16, F32 or FP8 with scales; not shape-only).
  // `base` applies to every rank (its `device` is replaced by the rank's). `gpus`: how many GPUs the
  // ranks may use (0: every visible one). `collective_timeout_s` bounds the in-process communicator's
  // host wait for another rank, the one-shot kernels' spin, and with kProcesses a child's reply.
  // `processes` (kProcesses only) says how to start the children, which must build the same weights.
  static Result<std::unique_ptr<CudaTpRunner>> Create(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                      KvScales scales, const CudaRunnerOptions& base, int tp_size,
                                                      EmbeddingMode embedding,
                                                      CudaTpTransport transport = CudaTpTransport::kAuto,
                                                      int gpus = 0, double collective_timeout_s = 600.0,
                                                      const TpProcessOptions& processes = {});
  ~CudaTpRunner() override;

  std::string backend_name() const override { return "cuda"; }
  const KvCacheSpec& kv_spec() const override { return kv_spec_; }
  const KvScales& kv_scales() const override { return ranks_[0]->kv_scales(); }
  int32_t max_rows() const override { return ranks_[0]->max_rows(); }
  int32_t max_outputs() const override { return ranks_[0]->max_outputs(); }
  Status Launch(const ForwardBatch& batch) override;
  Status Wait(ForwardResult* result) override;
  // KV observation (calibration) runs on one unsharded rank (engine.h); refused here, as on the CPU.
  void set_kv_observer(KvObserver* observer) override { observer_ = observer; }
  nlohmann::json Describe() const override;

  const TensorParallelPlan& plan() const { return plan_; }
  const std::vector<int>& devices() const { return devices_; }
  std::string transport() const { return comms_[0]->transport(); }
  // Collectives each rank issued in its last forward, by rank.
  std::vector<int64_t> collectives_last_forward() const;
  // Test hook: rank `rank`'s next forward fails with `error` before it starts (the other ranks then
  // wait in their first collective until the group is aborted). Child processes too.
  void FailNextForwardOnRank(int rank, Status error);
  // kProcesses: rank r's process id (0 for rank 0, this process); empty for threads.
  std::vector<pid_t> rank_pids() const;

 private:
  CudaTpRunner() = default;
  Status LaunchRank(int rank, const ForwardBatch& batch);
  // kProcesses: spawns the children, builds rank 0's IPC communicator and runner, waits for theirs.
  Status StartProcesses(const Checkpoint& checkpoint, const KvCacheSpec& kv, KvScales scales,
                        const CudaRunnerOptions& base, EmbeddingMode embedding, double timeout_s,
                        const TpProcessOptions& processes);
  // kProcesses: rank 0's share here, the children's through their control messages.
  Status LaunchProcesses(const ForwardBatch& batch);
  Status WaitProcesses(ForwardResult* result);
  // The group ended: every later step is refused with it, and the children are stopped now.
  Status EndGroup(const std::string& failures);

  TensorParallelPlan plan_;
  KvCacheSpec kv_spec_;
  int64_t num_layers_ = 0, vocab_size_ = 0;
  std::vector<int> devices_;
  std::shared_ptr<comm::DeviceGroup> in_process_;                   // kDeviceInProcess
  std::vector<std::unique_ptr<comm::DeviceCommunicator>> owned_;   // kNccl
  std::vector<comm::DeviceCommunicator*> comms_;                   // [tp]
  // kProcesses: ranks 1..tp-1 (stopped before anything below goes: they map rank 0's buffers).
  std::unique_ptr<TpProcessRanks> children_;
  InjectedFailures injected_;  // FailNextForwardOnRank's
  KvScales scales_;                                                // kProcesses: what the children were sent
  std::vector<std::unique_ptr<CudaRunner>> ranks_;                 // [tp]; kProcesses: [1], rank 0's
  KvObserver* observer_ = nullptr;

  // Ranks 1..tp-1 on their own threads: each enqueues its forward concurrently with the others (the
  // in-process communicator's ranks meet at every collective while enqueuing).
  std::unique_ptr<RankThreads> threads_;
  // Between every rank's CudaRunner::Prepare and any rank's Submit (cuda_runner.h says why).
  std::unique_ptr<comm::RankBarrier> prepared_;

  bool in_flight_ = false;
  Status broken_;  // set once a forward failed on some rank: the group is gone
};

}  // namespace dl
