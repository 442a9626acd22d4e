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

bool FusedNormEnabled() {
  static const bool enabled = SwitchOn("DECODELAB_FUSED_NORM");
  return enabled;
}

}  // namespace dl::kernels
