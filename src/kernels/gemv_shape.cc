// The GEMV's input split, chosen from the shape alone (see GemvParams::k_split).
#include "kernels/ops.h"

namespace dl::kernels {

int GemvKSplitFor(int out, int in) {
  // ~8K warps keep ~64 KB of loads in flight on each of an H200's 132 SMs; fewer rows than that
  // leave HBM idle between a warp's dependent load batches. Each slice keeps at least 8 chunks of
  // 16 bytes per lane, so the split never shrinks a warp's batch below a full set of loads.
  constexpr int kWantWarps = 8192;
  const int n8 = in / 8;
  int split = 1;
  while (split < 8 && static_cast<int64_t>(out) * split < kWantWarps && n8 % (split * 2) == 0 &&
         n8 / (split * 2) >= 32 * 8) {
    split *= 2;
  }
  return split;
}

}  // namespace dl::kernels
