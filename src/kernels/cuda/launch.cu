// The launch-mode and experiment switches shared by the decode kernel launchers and the engine.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "kernels/ops.h"

namespace dl::kernels {

namespace {
// On unless the variable is "0".
bool SwitchOn(const char* name) {
  const char* v = std::getenv(name);
  return !(v != nullptr && std::string_view(v) == "0");
}
// Sets *out to max(lo, the variable's integer value) when the variable is set.
void ReadInt(const char* name, int lo, int* out) {
  if (const char* v = std::getenv(name)) *out = std::max(lo, std::atoi(v));
}
}  // namespace

bool DependentLaunchEnabled() {
  static const bool enabled = SwitchOn("DECODELAB_PDL");
  return enabled;
}

FusedNormMode FusedNorm() {
  static const FusedNormMode mode = [] {
    const char* v = std::getenv("DECODELAB_FUSED_NORM");
    const std::string_view s = v ? v : "router";
    FusedNormMode m;
    if (s == "0") return m;
    m.before_mlp = true;
    if (s == "router") {
      m.name = "router";
    } else if (s == "stream") {
      m.before_streaming_attention = true;
      m.name = "stream";
    } else {
      m.before_attention = true;
      m.name = "1";
    }
    return m;
  }();
  return mode;
}

const DecodeExperiments& Experiments() {
  static const DecodeExperiments e = [] {
    DecodeExperiments x;
    if (const char* v = std::getenv("DECODELAB_MOE_VARIANT")) {
      std::sscanf(v, "%d,%d", &x.moe_gate_up_variant, &x.moe_down_variant);
    }
    x.moe_down_loads_early = SwitchOn("DECODELAB_MOE_DOWN_EARLY");
    ReadInt("DECODELAB_MOE_GATE_UP_STREAM_KB", 0, &x.moe_gate_up_stream_ring_kb);
    x.moe_router_stages_pointers = SwitchOn("DECODELAB_MOE_ROUTER_POINTERS");
    x.moe_router_stages_bias = SwitchOn("DECODELAB_MOE_ROUTER_BIAS");
    ReadInt("DECODELAB_OPROJ_STAGE_ROWS", 0, &x.oproj_stage_rows);
    x.stream_gemv = SwitchOn("DECODELAB_STREAM_GEMV");
    ReadInt("DECODELAB_STREAM_RING_KB", 1, &x.stream_ring_kb);
    ReadInt("DECODELAB_STREAM_STAGE_KB", 1, &x.stream_stage_kb);
    ReadInt("DECODELAB_STREAM_PREFETCH_KB", 0, &x.stream_prefetch_kb);
    ReadInt("DECODELAB_OPROJ_PREFETCH_KB", -1, &x.oproj_prefetch_kb);
    if (x.oproj_prefetch_kb < 0) x.oproj_prefetch_kb = x.stream_prefetch_kb;
    x.l2_prefetch = SwitchOn("DECODELAB_L2_PREFETCH");
    ReadInt("DECODELAB_ATTN_CLUSTER", 0, &x.attention_cluster_max_chunks);
    if (const char* v = std::getenv("DECODELAB_LATE_RELEASE")) x.late_release = ParseLateRelease(v);
    return x;
  }();
  return e;
}

}  // namespace dl::kernels
