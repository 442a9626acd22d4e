// The CUDA backend: BF16 weights on the device (CudaWeights), a paged BF16 or FP8 KV cache in device
// memory managed by the same kv_cache bookkeeping as the CPU backend, attention kernels resolved per
// layer from the preset table (no silent fallback), a workspace arena sized from the largest batch
// (CudaWorkspace), and the Laguna forward (model/laguna_forward.h) recorded as one CUDA graph per
// batch bucket (GraphCache). Every op keeps a fixed reduction order per row, so a row's results are
// the same at every batch size and in every bucket.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/tuning.h"
#include "model/checkpoint.h"
#include "model/runner.h"
#include "model/shard_plan.h"

namespace dl {

namespace comm {
class DeviceCommunicator;
}

struct CudaRunnerOptions {
  int device = 0;
  bool allow_fallback = false;  // run a generic attention kernel where a preset is not built
  bool use_graph = true;        // record forwards as CUDA graphs (per batch bucket)
  int32_t max_seq_len = 4096;   // positions the graphs and the workspaces are sized for
  int32_t max_rows = 512;       // token rows of one forward
  int32_t max_outputs = 1;      // output rows (sequences) of one forward
  // Hidden-state taps one forward may ask for (ForwardBatch::hidden_taps; the DFlash drafter's
  // target_layer_ids): the workspace holds [max_taps, max_rows, d] of them. 0: taps are refused.
  int32_t max_taps = 0;
  // For a shape-only checkpoint (null data): generate each tensor on the device with this seed,
  // by the formula of model/synthetic.h.
  uint64_t synthetic_seed = 0;
  // Timing experiments only (bench --skip-ops): leave these op families out of every forward, to
  // measure what each costs inside the real step. Outputs are then wrong; Describe() lists them.
  // Names: kSkippableOps.
  std::vector<std::string> skip_ops;
  kernels::Tuning tuning;
};
inline constexpr std::string_view kSkippableOps[] = {"norm", "qkvg", "rope", "attention", "o_proj", "moe", "dense_mlp"};

class CudaRunner : public ModelRunner {
 public:
  static Result<std::unique_ptr<CudaRunner>> Create(const Checkpoint& checkpoint,
                                                    const KvCacheSpec& kv, KvScales scales,
                                                    const CudaRunnerOptions& options);
  // Rank `rank` of a tensor-parallel group on options.device (backend/cuda_tp_runner.h runs the
  // group): it uploads only its shard of the checkpoint's host weights (model/weight_shard.h), sizes
  // its kernels from RankModelConfig, holds only its KV heads, all-reduces the row-parallel partial
  // sums through `comm` (which must outlive the runner) and gathers the vocabulary-parallel logits
  // before choosing tokens. `kv` is the whole model's cache geometry; the rank stores its KV heads of
  // it. Forwards run eagerly unless the communicator is capturable. BF16 weights, replicated embedding.
  static Result<std::unique_ptr<CudaRunner>> CreateRank(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                        KvScales scales, const CudaRunnerOptions& options,
                                                        const TensorParallelPlan& plan, int rank,
                                                        comm::DeviceCommunicator* comm);
  ~CudaRunner() override;

  std::string backend_name() const override { return "cuda"; }
  const KvCacheSpec& kv_spec() const override;
  const KvScales& kv_scales() const override;
  int32_t max_rows() const override;
  int32_t max_outputs() const override;
  int32_t max_taps() const;  // hidden-state taps the workspace holds (CudaRunnerOptions::max_taps)
  Status Launch(const ForwardBatch& batch) override;  // Prepare, then Submit
  Status Wait(ForwardResult* result) override;
  nlohmann::json Describe() const override;
  // The drafter on this GPU (backend/cuda_dflash.h) over this runner's device embedding and LM head.
  // A tensor-parallel rank holds slices of them: Unimplemented there.
  Result<std::unique_ptr<DflashRunner>> MakeDflashRunner(const DflashCheckpoint& drafter) const override;

  // Launch in two steps, for tensor-parallel ranks whose collectives spin on the device (one-shot,
  // NCCL): every rank captures its graph (Prepare) before any rank's graph runs (Submit), so that no
  // rank loads or captures kernels while a peer's kernel waits for it. Prepare stages the inputs and
  // captures the graph a new shape needs (the one-shot collectives meet on the host while being
  // recorded); Submit launches the graph, or records the forward eagerly. `batch` must live until
  // Wait.
  Status Prepare(const ForwardBatch& batch);
  Status Submit();

  // Per-layer max |x| over the K and V pools (BF16 caches only): FP8 scale calibration runs the
  // built-in prompts through a BF16 cache, then reads these.
  Result<std::pair<std::vector<float>, std::vector<float>>> KvPoolAbsMax();
  // Kernel nodes of the captured batch-1 decode graph (0 before the first decode).
  int kernel_nodes() const;
  // Attention preset (canonical name) per layer, and whether any layer runs a fallback kernel.
  const std::vector<std::string>& layer_presets() const;
  bool fallback() const;
  // Collectives this rank issued in its last forward (recorded, or captured with the graph it
  // replayed); 0 without tensor parallelism.
  int64_t collectives_last_forward() const;

  struct Impl;

 private:
  explicit CudaRunner(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dl
