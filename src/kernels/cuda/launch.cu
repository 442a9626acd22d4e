// The launch-mode switches shared by the decode kernel launchers and the engine.
#include <cstdlib>
#include <string_view>

#include "kernels/ops.h"

namespace dl::kernels {

bool DependentLaunchEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DECODELAB_PDL");
    return !(v != nullptr && std::string_view(v) == "0");
  }();
  return enabled;
}

bool L2PrefetchEnabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("DECODELAB_L2_PREFETCH");
    return !(v != nullptr && std::string_view(v) == "0");
  }();
  return enabled;
}

}  // namespace dl::kernels
