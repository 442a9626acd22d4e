// One forward over a batch of token rows: the single value every backend runs and every caller
// (generate, bench, the scheduler behind serve, calibration) builds (SGLang's ForwardBatch,
// llama.cpp's llama_batch).
//
// Rows are flat: the rows of one sequence are consecutive and in position order, and row i of a
// sequence sits at position kv->length() + i (its pages reserved beforehand with KvCache::Reserve).
// A row's results never depend on the other rows of the batch: every backend computes each row
// with a fixed reduction order of its own (batch invariance, docs/exactness.md).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "kernels/sampling.h"
#include "kv_cache/kv_cache.h"

namespace dl {

enum class ForwardMode : uint8_t {
  kPrefill,  // prompt chunks (possibly beside decode rows: a mixed step)
  kDecode,   // one row per sequence
  kVerify,   // speculative verification: a sequence's last token plus its drafts
};
const char* ForwardModeName(ForwardMode m);

// How an output row's token is chosen (kernels/sampling.h spells out the rule; the CUDA backend runs
// it on the device, the CPU reference on the host).
using LogitAdjustment = kernels::LogitAdjustment;
using RowSampling = kernels::RowSampling;

struct OutputRequest {
  int32_t row = 0;           // a row of ForwardBatch::tokens; outputs are in ascending row order
  bool sample = true;        // choose a token
  RowSampling sampling;
  bool want_logits = false;  // the row's raw [vocab] logits come back as floats
};

struct BatchSequence {
  const SequenceKv* kv = nullptr;  // must stay unchanged until the forward's Wait returns
  int32_t first_row = 0;
  int32_t num_rows = 0;
  // The request's prompt length: a row at a position below it is a prompt row (one of the request's
  // own prompt tokens), any other row a generated row (decode, verify, or a generated token
  // recomputed after a preemption). The class is a property of the token, so it does not depend on
  // the batch or the chunking; the CUDA backend may compute the two classes with different products
  // (Tuning::prompt_mma, docs/exactness.md). 0: every row is a generated row.
  int32_t prompt_length = 0;
};

struct ForwardBatch {
  ForwardMode mode = ForwardMode::kDecode;
  std::vector<int32_t> tokens;      // [T]
  std::vector<BatchSequence> seqs;  // cover [0, T) in order
  std::vector<OutputRequest> outputs;
  // Layers after which the hidden state (the residual stream leaving the layer, [T, d]) comes back
  // (the DFlash drafter reads them). Ascending, unique.
  std::vector<int32_t> hidden_taps;

  int32_t num_rows() const { return static_cast<int32_t>(tokens.size()); }
  // Appends a sequence's rows (BatchSequence::prompt_length: the request's prompt length); returns the
  // index of its first row.
  int32_t AddSequence(const SequenceKv& kv, std::span<const int32_t> rows, int32_t prompt_length = 0);
  // Asks for outputs at `row`.
  OutputRequest& AddOutput(int32_t row);
  // The position of every row (kv->length() + its index within its sequence).
  std::vector<int32_t> Positions() const;
  // Rows, sequences and outputs consistent; token ids in [0, vocab); every row's page reserved.
  Status Validate(int64_t vocab_size, int32_t page_size) const;
  // Every hidden tap names a layer of a model of `num_layers` (checked before a tensor-parallel
  // group starts, so a tap no rank could take does not end the group).
  Status ValidateHiddenTaps(int64_t num_layers) const;
};

struct RowResult {
  int32_t token = -1;         // when sampled
  bool finite = true;         // false: the row's logits held NaN or Inf (the token is meaningless)
  std::vector<float> logits;  // when want_logits: [vocab]
};

struct ForwardResult {
  std::vector<RowResult> rows;               // parallel to ForwardBatch::outputs
  std::vector<std::vector<float>> hidden;    // per tap: [T, d] floats
  double device_ms = 0;  // the forward's time on the device (CUDA events; 0 where not measured)
};

}  // namespace dl
