// Slow, obviously correct CPU references of the CUDA kernels. They take the SAME params structs as
// the launchers, but every pointer is a HOST pointer (pools, block tables, pointer arrays included).
// Accumulations are in double, so a reference differs from the reference model's FP32 order only
// below BF16 resolution; the rounding points (to BF16 / FP8) are exactly the ones the kernels
// document (laguna-architecture.md §3, §9).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/attention/attention.h"
#include "kernels/ops.h"
#include "kernels/sampling.h"

namespace dl::kernels::ref {

void AddRmsNorm(const AddRmsNormParams& p);
void QkNormRopeAppend(const QkNormRopeAppendParams& p);
// Attention with the gate; ignores workspace.
void Attention(const AttentionParams& p);
// BF16 or FP8 weights (GemvParams::w_fp8: dequantised with Fp8WeightAt, then the same dot).
void Gemv(const GemvParams& p);
// Element [o, i] of an FP8 weight with `cols` columns: float(code) * scale[o / br, i / bc], one FP32
// multiply (the FP8 weight contract's meaning, and the dequantised value of the FP8 rule).
float Fp8WeightAt(const Fp8Weight& w, int cols, int64_t o, int64_t i);
// Router + experts (each expert group BF16 or FP8, dequantised exactly). `logits_override` ([E], optional): use these router logits (already BF16-rounded)
// instead of computing them, so a test can check selection bit-exactly against a kernel's logits.
void Moe(const MoeParams& p, const float* logits_override = nullptr);
int32_t Argmax(const bf16* logits, int n);
// Step 1 of kernels/sampling.h's rule, in place.
void ApplyLogitAdjustments(float* logits, const std::vector<LogitAdjustment>& adjustments);
// kernels/sampling.h's rule for one row of FP32 logits; *finite = false when a logit is NaN or Inf
// (the token is then meaningless).
int32_t SampleRow(const float* logits, int vocab, const RowSampling& s, bool* finite);

// Softplus as PyTorch computes it (threshold 20).
float Softplus(float z);

}  // namespace dl::kernels::ref
