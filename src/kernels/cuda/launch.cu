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

L2PrefetchMode L2Prefetch() {
  static const L2PrefetchMode mode = [] {
    const char* v = std::getenv("DECODELAB_L2_PREFETCH");
    const std::string_view s = v ? v : "0";
    L2PrefetchMode m;
    m.o_proj = s == "o_proj" || s == "all";
    m.next = s == "next" || s == "all";
    return m;
  }();
  return mode;
}
bool L2PrefetchEnabled() { return L2Prefetch().any(); }

}  // namespace dl::kernels
