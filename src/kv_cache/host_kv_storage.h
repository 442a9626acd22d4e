// KV pages in host memory for the CPU reference backend: per layer a K pool and a V pool of
// [pages_in(group), page_size, num_kv_heads, head_dim] elements of the cache dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_cache/kv_cache.h"
#include "kv_cache/kv_scales.h"

namespace dl {

class HostKvStorage {
 public:
  HostKvStorage(const KvCacheSpec& spec, KvScales scales);

  // Stores one token's K and V ([num_kv_heads * head_dim] floats each) of `layer` at `slot`.
  void Write(int32_t layer, KvSlot slot, const float* k, const float* v);
  // Reads them back as floats (dequantised with the layer's scale for FP8).
  void Read(int32_t layer, KvSlot slot, float* k, float* v) const;

  const KvScales& scales() const { return scales_; }

 private:
  size_t Offset(int32_t layer, KvSlot slot) const;
  KvCacheSpec spec_;
  KvScales scales_;
  std::vector<std::vector<uint8_t>> k_pools_, v_pools_;  // [num_layers]
};

}  // namespace dl
