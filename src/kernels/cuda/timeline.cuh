// Device half of the decode-step timeline (kernels/timeline.h). Compiled in only with DL_TIMELINE
// (cmake -DDECODELAB_TIMELINE=ON); otherwise both macros are empty statements.
//   DL_TIMELINE_SCOPE(kTag)  first statement of a decode kernel: stamps the block's start, and its
//                            end when thread 0 leaves the kernel (whichever return it takes);
//   DL_TIMELINE_WAITED()     inside WaitForPrerequisites: stamps thread 0's return from the wait.
// Thread 0 of every block appends one record to its SM's segment of the buffer (one atomic per block
// on a per-SM counter, so launches of thousands of blocks do not queue on one address; still a
// separate build, since every block pays a few stores).
#pragma once

#include <cuda_runtime.h>

#include "kernels/timeline.h"

namespace dl::kernels::dev {
constexpr int kTimelineSegments = 256;  // one per SM id (%smid < 256 on every part we target)
struct TimelineDeviceBuffer {
  // [kTimelineSegments][per_segment][6]: grid, tag, block | blocks << 32, start, waited, end
  unsigned long long* records;
  unsigned* count;  // [kTimelineSegments]
  unsigned per_segment;
};

}  // namespace dl::kernels::dev

#ifdef DL_TIMELINE
namespace dl::kernels::dev {

namespace {
// One copy per translation unit (no relocatable device code); TimelineEnable installs the buffer in
// every unit through the function each one registers here.
__device__ TimelineDeviceBuffer g_timeline;
__shared__ unsigned long long s_timeline_waited;
int InstallTimeline(const void* descriptor) {
  return static_cast<int>(cudaMemcpyToSymbol(g_timeline, descriptor, sizeof(TimelineDeviceBuffer)));
}
[[maybe_unused]] const bool g_timeline_registered = RegisterTimelineInstaller(&InstallTimeline);
}  // namespace

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

class TimelineScope {
 public:
  __device__ explicit TimelineScope(TimelineTag tag) : tag_(static_cast<unsigned>(tag)) {
    if (threadIdx.x == 0) {
      start_ = GlobalTimer();
      s_timeline_waited = 0;
    }
  }
  __device__ ~TimelineScope() {
    if (threadIdx.x != 0 || g_timeline.records == nullptr) return;
    const unsigned long long end = GlobalTimer();
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    sm %= kTimelineSegments;
    const unsigned i = atomicAdd(g_timeline.count + sm, 1u);
    if (i >= g_timeline.per_segment) return;
    unsigned long long grid;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    const unsigned long long block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned long long blocks = static_cast<unsigned long long>(gridDim.x) * gridDim.y * gridDim.z;
    unsigned long long* r = g_timeline.records + 6ull * (static_cast<unsigned long long>(sm) * g_timeline.per_segment + i);
    r[0] = grid, r[1] = tag_, r[2] = block | (blocks << 32), r[3] = start_, r[4] = s_timeline_waited, r[5] = end;
  }

 private:
  unsigned tag_;
  unsigned long long start_ = 0;
};

}  // namespace dl::kernels::dev

#define DL_TIMELINE_SCOPE(tag) ::dl::kernels::dev::TimelineScope dl_timeline_scope_(::dl::kernels::TimelineTag::tag)
#define DL_TIMELINE_WAITED()                                                              \
  do {                                                                                    \
    if (threadIdx.x == 0) ::dl::kernels::dev::s_timeline_waited = ::dl::kernels::dev::GlobalTimer(); \
  } while (0)
#else
#define DL_TIMELINE_SCOPE(tag) \
  do {                         \
  } while (0)
#define DL_TIMELINE_WAITED() \
  do {                       \
  } while (0)
#endif
