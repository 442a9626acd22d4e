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
// multiply (the FP8 weight contract's meaning; the CUDA kernels' FP8 rule never forms it, and is
// compared with this dequantising reference with a tolerance).
float Fp8WeightAt(const Fp8Weight& w, int cols, int64_t o, int64_t i);
// THE FP8 RULE of kernels/ops.h on the host, in the kernels' exact order (not an oracle: the oracle is
// Gemv above). FP8 weights only (p.w_fp8; in % 16 == 0): per token and row, k_split slices (p.k_split,
// 0 = GemvFp8KSplitFor), lane l of a slice takes chunks lo + l, + 32, ... and per chunk
// p = fmaf(float(code_e), x_e, p) from zero for e = 0 .. 15, acc = fmaf(p, scale, acc); the 32 lane sums
// meet in the xor butterfly (offsets 16, 8, 4, 2, 1), slices are added in ascending order, one BF16
// rounding. The CUDA FP8 GEMV gives these bits on every path (plain, streaming, batched, fused norm).
void GemvFp8Rule(const GemvParams& p);
// Router + experts (each expert group BF16 or FP8, dequantised exactly). `logits_override` ([E], optional): use these router logits (already BF16-rounded)
// instead of computing them, so a test can check selection bit-exactly against a kernel's logits.
// term_scale (optional, d floats): per output element the magnitude of what its last roundings add,
// alpha * sum_j |bf16(o_j w_j)| + |o_shared|; a kernel whose FP32 sums run in another order may flip
// those roundings by an ulp, so a test's tolerance for y scales with this, not with |y| (the terms
// can cancel to a y far smaller than themselves).
void Moe(const MoeParams& p, const float* logits_override = nullptr, float* term_scale = nullptr);
int32_t Argmax(const bf16* logits, int n);
// Step 1 of kernels/sampling.h's rule, in place.
void ApplyLogitAdjustments(float* logits, const std::vector<LogitAdjustment>& adjustments);
// kernels/sampling.h's rule for one row of FP32 logits; *finite = false when a logit is NaN or Inf
// (the token is then meaningless).
int32_t SampleRow(const float* logits, int vocab, const RowSampling& s, bool* finite);

// Softplus as PyTorch computes it (threshold 20).
float Softplus(float z);

}  // namespace dl::kernels::ref
