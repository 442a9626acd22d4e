// The CPU reference backend: FP32 arithmetic over the checkpoint's weights, every feature of the
// spec, the Laguna forward (model/laguna_forward.h) run row by row. It is the oracle the CUDA backend
// and the lab are checked against, not the fast path. Each row is computed on its own in a fixed
// order, so a row's results never depend on the rest of the batch.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "kv_cache/host_kv_storage.h"
#include "model/checkpoint.h"
#include "model/laguna_forward.h"
#include "model/runner.h"
#include "model/shard_plan.h"
#include "model/weight_shard.h"

namespace dl {

class CpuRunner : public ModelRunner, private LagunaOps {
 public:
  // `checkpoint` must outlive the runner (weights are read in place from its mapped files).
  static Result<std::unique_ptr<CpuRunner>> Create(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                   KvScales scales);
  // Rank `rank` of a tensor-parallel group (backend/cpu_tp_runner.h runs the group): it holds only
  // its shard of the weights (`plan`) and its KV heads, and combines partial results through `comm`
  // (which must outlive the runner). `kv` is the whole model's cache geometry (the page bookkeeping
  // every rank shares); the rank stores only its plan's KV heads.
  static Result<std::unique_ptr<CpuRunner>> CreateRank(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                       KvScales scales, const TensorParallelPlan& plan, int rank,
                                                       comm::Communicator* comm);

  std::string backend_name() const override { return "cpu-reference"; }
  const KvCacheSpec& kv_spec() const override { return kv_spec_; }
  const KvScales& kv_scales() const override { return storage_.scales(); }
  int32_t max_rows() const override { return 1 << 20; }
  int32_t max_outputs() const override { return 1 << 20; }
  Status Launch(const ForwardBatch& batch) override;
  Status Wait(ForwardResult* result) override;
  void set_kv_observer(KvObserver* observer) override { observer_ = observer; }
  nlohmann::json Describe() const override;
  // Collectives this rank issued in its last forward (0 without tensor parallelism).
  int64_t collectives_last_forward() const { return collectives_last_forward_; }

 private:
  CpuRunner(const Checkpoint& checkpoint, const KvCacheSpec& kv, KvScales scales, const TensorParallelPlan& plan,
            int rank, comm::Communicator* comm, std::unique_ptr<HostWeightShard> shard);
  static Status CheckKvSpec(const ModelConfig& c, const KvCacheSpec& kv, const KvScales& scales);

  // LagunaOps over FP32 host activations.
  Status Embed(const WeightRef& table) override;
  Status AddRmsNorm(const WeightRef& weight, bool add_delta) override;
  Status Linear(const LinearWeights& w, Act in, Act out) override;
  Status QkNormRopeAppend(int32_t layer, const LagunaLayerWeights& w) override;
  Status Attention(int32_t layer) override;
  Status SiluMul() override;
  Status Moe(int32_t layer, const MoeWeights& w) override;
  Status TapHidden(int32_t tap) override;
  Status OutputNorm(const WeightRef& weight) override;
  Status SelectTokens() override;
  Status AllReduce(PartialSum what) override;
  // This rank's query and KV heads in `layer` (the whole layer's without tensor parallelism).
  int64_t local_heads(int32_t layer) const { return layer_shards_[layer].q_heads.size; }
  int64_t local_kv_heads(int32_t layer) const { return layer_shards_[layer].kv_heads.size; }

  // An activation slot: its rows and width for the current batch.
  struct Slot {
    std::vector<float> data;
    int64_t width = 0;
    float* row(int64_t r) { return data.data() + r * width; }
  };
  Slot& slot(Act a) { return slots_[static_cast<int>(a)]; }
  void Resize(Act a, int64_t rows, int64_t width);
  // y = SwiGLU(x) for one token with the given gate/up/down.
  void SwiGlu(const WeightRef& gate, const WeightRef& up, const WeightRef& down, const float* x, float* y);

  const ModelConfig& cfg_;
  // Tensor parallelism: this rank's part of the plan, its weights' owned slices, the communicator
  // (null on a single rank).
  int tp_size_ = 1, rank_ = 0;
  std::vector<LayerShard> layer_shards_;
  std::unique_ptr<HostWeightShard> shard_;
  comm::Communicator* comm_ = nullptr;
  std::vector<Slice> lm_head_slices_;  // every rank's LM head rows, in rank order
  int64_t collectives_last_forward_ = 0;
  LagunaWeights weights_;
  KvCacheSpec kv_spec_;
  HostKvStorage storage_;
  KvObserver* observer_ = nullptr;
  RopeTable rope_full_, rope_sliding_;

  // The batch being run (Launch to Wait).
  const ForwardBatch* batch_ = nullptr;
  std::vector<int32_t> positions_;
  std::vector<float> residual_;
  Slot slots_[8];
  std::vector<float> q_;  // [T, H*D] after QK-norm and RoPE
  ForwardResult result_;
  Status status_;
};

}  // namespace dl
