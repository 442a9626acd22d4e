// Decode-step timeline: per-block globaltimer stamps of every decode kernel, recorded only by builds
// configured with -DDECODELAB_TIMELINE=ON (the kernels then carry DL_TIMELINE_SCOPE stamps; other
// builds compile them out and TimelineBuilt() is false). It exists because the GPU machine has no
// Nsight Systems and ncu serialises kernels: neither shows how the kernels of one CUDA graph overlap
// under programmatic dependent launch, which is where the step's time goes at batch 1.
//
// Per block, thread 0 stamps: start (kernel entry), waited (when it returned from
// WaitForPrerequisites; 0 if it never waited) and end (when it left the kernel). The host groups the
// records by grid (one launch) and derives, per launch, relative to the previous launch's end:
//   exposed   how far this launch moved the step's finish line (the step is the sum of these);
//   lag       first block's start (negative: it started early, under PDL);
//   release   first block's return from the wait (the prerequisite grid's completion latency);
//   after     last block's end minus the first release (the work left once the input was ready).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/common.h"

namespace dl::kernels {

enum class TimelineTag : uint32_t {
  kEmbed,
  kAddRmsNorm,
  kGemv,
  kRopeAppend,
  kAttention,
  kMoeRouter,
  kMoeGateUp,
  kMoeDown,
  kArgmax,
  kSiluMul,
  kCount,
};
std::string_view TimelineTagName(TimelineTag tag);

struct TimelineRecord {
  uint64_t grid = 0;  // %gridid: one launch
  uint32_t tag = 0;   // TimelineTag
  uint32_t block = 0, blocks = 0;
  uint64_t start = 0, waited = 0, end = 0;  // globaltimer, ns; waited 0 = never waited
};

// One launch, times in ns relative to the first launch's start.
struct KernelSpan {
  uint64_t grid = 0;
  TimelineTag tag = TimelineTag::kCount;
  uint32_t blocks = 0;  // blocks that recorded
  int64_t first_start = 0, last_start = 0, first_waited = -1, last_waited = -1, last_end = 0;
  int64_t exposed = 0;   // last_end - max(last_end of every earlier launch), at least 0
  int64_t prev_end = 0;  // the previous launch's last_end (0 for the first)
};
// Launches in start order. Records are grouped by grid id.
std::vector<KernelSpan> TimelineSpans(const std::vector<TimelineRecord>& records);

// Means per kernel name (tag and grid size, e.g. "gemv[1288]"), in first-appearance order.
struct TimelineRow {
  std::string name;
  int count = 0;
  double exposed_us = 0, span_us = 0, lag_us = 0, release_us = 0, after_us = 0;  // means
  double total_exposed_us = 0;                                                    // count * mean
};
std::vector<TimelineRow> TimelineSummary(const std::vector<KernelSpan>& spans);
// The table TimelineSummary gives, as text (one line per row, a header and the step total).
std::string FormatTimeline(const std::vector<TimelineRow>& rows, const std::vector<KernelSpan>& spans);
// `count` launches from the first add_rmsnorm at or after the step's middle launch, one line each, in
// µs from that launch's start: first/last block start, first/last release from the wait, last end.
std::string FormatLaunches(const std::vector<KernelSpan>& spans, size_t count);

// ---- Device side (kernels/cuda/timeline.cu; a build without CUDA or without the option says so) ----
bool TimelineBuilt();
// Allocates room for `capacity` block records and installs it in every kernel translation unit.
Status TimelineEnable(size_t capacity);
// Starts a new recording (enqueued on the stream: the next launches' records replace the last ones).
Status TimelineReset(Stream stream);
// The records since the last reset (synchronises the device); at most `capacity`, the rest dropped.
Result<std::vector<TimelineRecord>> TimelineRead();

// For kernels/cuda/timeline.cuh: each kernel translation unit registers the function that copies the
// buffer descriptor into its own __device__ symbol (no relocatable device code needed).
using TimelineInstaller = int (*)(const void* descriptor);
bool RegisterTimelineInstaller(TimelineInstaller installer);

}  // namespace dl::kernels
