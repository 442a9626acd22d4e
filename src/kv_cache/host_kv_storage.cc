#include "kv_cache/host_kv_storage.h"

namespace dl {

HostKvStorage::HostKvStorage(const KvCacheSpec& spec, KvScales scales)
    : spec_(spec), scales_(std::move(scales)) {
  k_pools_.resize(spec.num_layers);
  v_pools_.resize(spec.num_layers);
  for (int32_t l = 0; l < spec.num_layers; ++l) {
    const size_t bytes = spec.page_bytes() * static_cast<size_t>(spec.pages_in(spec.layer_groups[l]));
    k_pools_[l].assign(bytes, 0);
    v_pools_[l].assign(bytes, 0);
  }
}

size_t HostKvStorage::Offset(int32_t layer, KvSlot slot) const {
  (void)layer;
  return (static_cast<size_t>(slot.page) * spec_.page_size + slot.slot) * spec_.num_kv_heads *
         spec_.head_dim;
}

void HostKvStorage::Write(int32_t layer, KvSlot slot, const float* k, const float* v) {
  const size_t n = static_cast<size_t>(spec_.num_kv_heads) * spec_.head_dim;
  const size_t base = Offset(layer, slot);
  const bool fp8 = spec_.dtype == DType::kF8E4M3;
  const float ks = fp8 ? scales_.k[layer] : 1.0f;
  const float vs = fp8 ? scales_.v[layer] : 1.0f;
  for (size_t i = 0; i < n; ++i) {
    StoreFromFloat(k_pools_[layer].data(), spec_.dtype, base + i, fp8 ? k[i] / ks : k[i]);
    StoreFromFloat(v_pools_[layer].data(), spec_.dtype, base + i, fp8 ? v[i] / vs : v[i]);
  }
}

void HostKvStorage::Read(int32_t layer, KvSlot slot, float* k, float* v) const {
  const size_t n = static_cast<size_t>(spec_.num_kv_heads) * spec_.head_dim;
  const size_t base = Offset(layer, slot);
  const bool fp8 = spec_.dtype == DType::kF8E4M3;
  const float ks = fp8 ? scales_.k[layer] : 1.0f;
  const float vs = fp8 ? scales_.v[layer] : 1.0f;
  for (size_t i = 0; i < n; ++i) {
    k[i] = LoadAsFloat(k_pools_[layer].data(), spec_.dtype, base + i) * ks;
    v[i] = LoadAsFloat(v_pools_[layer].data(), spec_.dtype, base + i) * vs;
  }
}

}  // namespace dl
