// The launch-mode switch shared by every decode kernel launcher.
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
    m.before_mlp = s != "0";
    m.before_attention = s != "0" && s != "router";
    return m;
  }();
  return mode;
}
bool FusedNormEnabled() { return FusedNorm().before_attention || FusedNorm().before_mlp; }

}  // namespace dl::kernels
