// What the engine asks of a backend: run one ForwardBatch (prefill chunks, decode rows, verify rows
// of any number of sequences at once) through the model, appending the rows' K/V to the paged cache,
// and return what the batch asked for. Launch and Wait are separate so the host can prepare the next
// step while the device runs this one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_scales.h"
#include "model/dflash_forward.h"
#include "model/forward_batch.h"

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
  // Largest batch one forward takes: token rows, and output rows.
  virtual int32_t max_rows() const = 0;
  virtual int32_t max_outputs() const = 0;

  // Starts the forward of `batch`. The caller has reserved pages for every row (KvCache::Reserve)
  // and commits them after Wait. `batch` and the SequenceKvs it points to must stay unchanged until
  // Wait returns. At most one forward is in flight.
  virtual Status Launch(const ForwardBatch& batch) = 0;
  // Waits for the launched forward and fills `result` (rows parallel to batch.outputs).
  virtual Status Wait(ForwardResult* result) = 0;
  Status Forward(const ForwardBatch& batch, ForwardResult* result) {
    DL_RETURN_IF_ERROR(Launch(batch));
    return Wait(result);
  }

  virtual void set_kv_observer(KvObserver* observer) { (void)observer; }

  // The DFlash drafter on this backend (model/dflash_forward.h), reading the target's embedding and
  // LM head where this runner holds them; `drafter` must outlive it. Unimplemented where the backend
  // has no drafter of its own: the engine then runs the CPU reference drafter over the checkpoint's
  // host weights (engine/dflash_drafter.h).
  virtual Result<std::unique_ptr<DflashRunner>> MakeDflashRunner(const DflashCheckpoint& drafter) const {
    (void)drafter;
    return Unimplemented("the {} backend has no DFlash drafter of its own", backend_name());
  }

  // Identity for logs, JSON and the lab: presets, fallback flag, tuning, topology (backend keys).
  virtual nlohmann::json Describe() const = 0;
};

}  // namespace dl
