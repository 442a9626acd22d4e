// What the engine asks of a backend: run a chunk of tokens of one sequence through the model, appending
// their K/V to the paged cache, and return logits. Prefill (many tokens) and decode (one token) are the
// same call, so they share one code path in every backend.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_scales.h"

namespace dl {

// Sees every K/V vector before it is quantised into the cache; calibration uses it to find amax.
class KvObserver {
 public:
  virtual ~KvObserver() = default;
  // k, v: [num_kv_heads * head_dim] floats of one token in `layer` (post QK-norm and RoPE for k).
  virtual void Observe(int32_t layer, const float* k, const float* v, int32_t n) = 0;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  // "cpu-reference" or "cuda".
  virtual std::string backend_name() const = 0;
  virtual const KvCacheSpec& kv_spec() const = 0;
  virtual const KvScales& kv_scales() const = 0;

  // Runs `tokens` at positions [seq.length(), seq.length() + n). The caller has reserved pages for them
  // (KvCache::Reserve) and commits them afterwards. `logits` receives [n, vocab] floats when
  // `all_logits`, else the last token's [vocab].
  virtual Status Forward(const SequenceKv& seq, std::span<const int32_t> tokens, bool all_logits,
                         std::vector<float>* logits) = 0;

  virtual void set_kv_observer(KvObserver* observer) { (void)observer; }

  // Identity for logs, JSON and the lab: presets, fallback flag, topology (backend-specific keys).
  virtual nlohmann::json Describe() const = 0;
};

}  // namespace dl
