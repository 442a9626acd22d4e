// Choosing a row's next token from its logits: the rule the CUDA sampler (SampleRows) implements and
// the CPU reference (ref::SampleRow, which the CPU backend runs) spells out.
//
// For one row of V logits l:
//   1. adjustments (logit_bias, then the repetition, frequency and presence penalties, vLLM's v1
//      order): x = l_t + bias; x = x > 0 ? x / repetition : x * repetition; l_t = x - penalty, for each
//      listed token t (each token listed at most once; engine/sampling.h builds the list);
//   2. temperature 0: the token is argmax_i l_i, lowest id on ties (greedy);
//   3. otherwise z_i = l_i / temperature, and the kept set is filtered, in this order:
//      min_p: z_i >= z_max + ln(min_p)  (p_i >= min_p * p_max);
//      top_k: the k largest z of what is left, ties by ascending id (exactly k stay);
//      top_p: the tokens above tau stay, tau the largest value such that the tokens left with
//             z >= tau hold at least top_p of the mass left; of the tokens at tau, the lowest ids
//             until the mass reaches top_p (at least one);
//   4. the token is argmax over the kept set of z_i + g_i (Gumbel-max: an exact draw from
//      softmax(z) restricted to the kept set), g_i = -ln(-ln(u_i)), u_i = UniformAt(row_key, i),
//      row_key = SplitMix64(key ^ SplitMix64(step)) (base/rng.h); ties to the lowest id.
// Every step is a function of the row alone, so the token does not depend on the batch. A row whose
// logits hold NaN or Inf is reported (its token is not meaningful).
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"
#include "kernels/common.h"

namespace dl::kernels {

struct LogitAdjustment {
  int32_t token = 0;
  float bias = 0.0f;        // added first (logit_bias)
  float repetition = 1.0f;  // then divides a positive logit, multiplies the others
  float penalty = 0.0f;     // then subtracted (frequency * count + presence)
};
// The adjustment's formula, for the CPU statement and the device kernel alike.
DL_HOST_DEVICE inline float AdjustedLogit(float l, const LogitAdjustment& a) {
  const float x = l + a.bias;
  return (x > 0.0f ? x / a.repetition : x * a.repetition) - a.penalty;
}

struct RowSampling {
  float temperature = 0.0f;
  int32_t top_k = 0;    // 0 = off
  float top_p = 1.0f;   // (0, 1]
  float min_p = 0.0f;   // [0, 1]
  uint64_t key = 0;
  uint64_t step = 0;
  std::vector<LogitAdjustment> adjustments;
  bool greedy() const { return temperature <= 0.0f; }
};

// One row's parameters as the device reads them: RowSampling without the vector (its adjustments are
// adjustments[adj_begin, adj_begin + adj_count) of SampleRowsParams::adjustments).
struct DeviceRowSampling {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t key = 0;
  uint64_t step = 0;
  int32_t adj_begin = 0;
  int32_t adj_count = 0;
};

// SampleRows: tokens[r] for r < rows from logits [rows, vocab] BF16, one block per row; the rule
// above with FP32 arithmetic and block reductions in a fixed order (the top-k and top-p thresholds by
// bisection over the values' ordered bit patterns).
struct SampleRowsParams {
  const bf16* logits = nullptr;                // [rows, vocab]
  int rows = 0;
  int vocab = 0;
  const DeviceRowSampling* params = nullptr;   // [rows]
  const LogitAdjustment* adjustments = nullptr;
  int32_t* tokens = nullptr;                   // [rows]
  int32_t* nonfinite = nullptr;                // [rows]: 1 when the row's logits held NaN or Inf
  float* scratch = nullptr;                    // [rows, 2 * vocab] FP32 work space
};
Status SampleRows(const SampleRowsParams& p, Stream stream);

}  // namespace dl::kernels
