// The launch-mode switch shared by every decode kernel launcher.
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

}  // namespace dl::kernels
