// Parameter, active-parameter and bytes-per-token accounting of a Laguna config (spec §6; S 2.1:
// laguna-checkpoints §1.5-1.6). "Active" is what one decoded token reads at batch 1: all attention
// and norms, the dense MLPs, per MoE layer the router, correction bias, shared expert and k routed
// experts, and the LM head; the embedding is one row, reported separately.
#pragma once

#include <cstdint>

#include "model/config.h"

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

// KV-cache bytes stored per token over all layers (2 * K * D elements per layer).
int64_t KvBytesPerToken(const ModelConfig& c, int64_t elem_bytes);
// KV-cache bytes read by one decoded token at context length T (sliding layers read min(T, W)).
int64_t KvBytesReadPerToken(const ModelConfig& c, int64_t context, int64_t elem_bytes);

}  // namespace dl
