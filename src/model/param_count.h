// Parameter, active-parameter and bytes-per-token accounting of a Laguna config (spec §6; S 2.1:
// laguna-checkpoints §1.5-1.6). "Active" is what one decoded token reads at batch 1: all attention
// and norms, the dense MLPs, per MoE layer the router, correction bias, shared expert and k routed
// experts, and the LM head; the embedding is one row, reported separately.
#pragma once

#include <cstdint>
#include <functional>

#include "model/checkpoint.h"
#include "model/config.h"
#include "model/fp8_layout.h"
#include "model/synthetic.h"

namespace dl {

struct ParamCounts {
  int64_t total = 0;
  // Parts of the total.
  int64_t embedding = 0, lm_head = 0, attention = 0, dense_mlp = 0, routed_experts = 0, shared_experts = 0,
          routers = 0, correction_biases = 0, block_norms = 0;
  // Per decoded token.
  int64_t active = 0;          // excludes the embedding row
  int64_t active_routed = 0;   // k experts per MoE layer
  int64_t active_fp8_linears = 0;  // active linears except LM head, routers and g_proj
  int64_t embedding_row = 0;   // hidden_size

  // Weight bytes read per decoded token (embedding row excluded, no scale tensors):
  int64_t bytes_per_token_bf16() const { return 2 * active; }
  // Routed experts FP8, everything else BF16 (closest to the published FP8 exports).
  int64_t bytes_per_token_fp8_experts() const { return active_routed + 2 * (active - active_routed); }
  // Every linear FP8 except the LM head, routers and g_proj (those and the norms BF16).
  int64_t bytes_per_token_fp8_linears() const { return active_fp8_linears + 2 * (active - active_fp8_linears); }
};

ParamCounts CountParams(const ModelConfig& c);

// Weight bytes one decoded token reads at batch 1 (the activity rule of CountParams: embedding
// row excluded, k routed experts per MoE layer), by how the tensors are stored (docs/fp8.md).
struct WeightBytesPerToken {
  int64_t bf16 = 0;        // 16-bit elements (BF16, F16)
  int64_t f32 = 0;         // F32 elements
  int64_t fp8 = 0;         // FP8 E4M3 codes
  int64_t fp8_scales = 0;  // their FP32 scales
  int64_t routed = 0;      // the part of the total read by the k routed experts (codes + scales)
  int64_t total() const { return bf16 + f32 + fp8 + fp8_scales; }
};
// How one tensor of CheckpointTensorSpecs is stored: its element dtype and (FP8) scale count.
struct TensorStorage {
  DType dtype = DType::kBF16;
  int64_t scales = 0;
};
WeightBytesPerToken ActiveWeightBytes(const ModelConfig& c,
                                      const std::function<TensorStorage(const TensorSpec&)>& storage);
// Every tensor in `dtype`, or with `fp8` its layout's tensors FP8 with that granularity's scales.
WeightBytesPerToken ActiveWeightBytes(const ModelConfig& c, DType dtype, const Fp8Options* fp8 = nullptr);
// As the checkpoint stores them (each tensor's header dtype; FP8 weights with their scales).
WeightBytesPerToken ActiveWeightBytes(const Checkpoint& checkpoint);

// KV-cache bytes stored per token over all layers (2 * K * D elements per layer).
int64_t KvBytesPerToken(const ModelConfig& c, int64_t elem_bytes);
// KV-cache bytes read by one decoded token at context length T (sliding layers read min(T, W)).
int64_t KvBytesReadPerToken(const ModelConfig& c, int64_t context, int64_t elem_bytes);

// Arithmetic of prefilling one prompt of `prompt_len` tokens (0 .. prompt_len-1), in FLOPs (a
// multiply-add counts 2), the figure the prefill's achieved TFLOP/s divide:
//   linear: 2 x (active parameters - LM head) per token (k routed experts per token, as decode),
//           plus 2 x LM head for the `logit_rows` rows that need logits (the last row at greedy);
//   attention: per layer and token, 4 x H_l x D x visible keys (scores and values; causal, sliding
//           layers see min(position + 1, W) keys). Norms, RoPE, softmax and routing are not counted.
struct PrefillFlops {
  double linear = 0, attention = 0;
  double total() const { return linear + attention; }
};
PrefillFlops CountPrefillFlops(const ModelConfig& c, int64_t prompt_len, int64_t logit_rows = 1);

}  // namespace dl
