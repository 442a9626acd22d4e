// The launch mode shared by every decode kernel launcher (ops.h).
#include <atomic>

#include "kernels/ops.h"

namespace dl::kernels {

namespace {
std::atomic<bool> g_dependent_launch{true};
}  // namespace

void SetDependentLaunch(bool on) { g_dependent_launch.store(on); }
bool DependentLaunchEnabled() { return g_dependent_launch.load(std::memory_order_relaxed); }

}  // namespace dl::kernels
