// The CPU reference backend: FP32 arithmetic over the checkpoint's weights, every feature of the spec.
// It is the oracle the CUDA backend and the lab are checked against, not the fast path.
#pragma once

#include <memory>

#include "kv_cache/host_kv_storage.h"
#include "model/checkpoint.h"
#include "model/runner.h"

namespace dl {

class CpuRunner : public ModelRunner {
 public:
  // `checkpoint` must outlive the runner (weights are read in place from its mapped files).
  static Result<std::unique_ptr<CpuRunner>> Create(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                   KvScales scales);

  std::string backend_name() const override { return "cpu-reference"; }
  const KvCacheSpec& kv_spec() const override { return kv_spec_; }
  const KvScales& kv_scales() const override { return storage_.scales(); }
  Status Forward(const SequenceKv& seq, std::span<const int32_t> tokens, bool all_logits,
                 std::vector<float>* logits) override;
  void set_kv_observer(KvObserver* observer) override { observer_ = observer; }
  nlohmann::json Describe() const override;

 private:
  CpuRunner(const Checkpoint& checkpoint, const KvCacheSpec& kv, KvScales scales);

  // One layer over `n` tokens at positions [pos0, pos0 + n); h is the residual stream [n, d].
  void Attention(int32_t layer, const SequenceKv& seq, int32_t pos0, int32_t n, float* h);
  void Mlp(int32_t layer, int32_t n, float* h);
  // y = SwiGLU(x) for one token with the given gate/up/down.
  void SwiGlu(const TensorView& gate, const TensorView& up, const TensorView& down, const float* x,
              float* y);

  const ModelConfig& cfg_;
  const ModelWeights& w_;
  KvCacheSpec kv_spec_;
  HostKvStorage storage_;
  KvObserver* observer_ = nullptr;
  RopeTable rope_full_, rope_sliding_;
};

}  // namespace dl
