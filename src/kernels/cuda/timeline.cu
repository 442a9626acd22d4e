// Host half of the decode-step timeline (kernels/timeline.h): the record buffer and its installation
// in every kernel translation unit.
#include <algorithm>
#include <vector>

#include "cuda/check.h"
#include "kernels/cuda/timeline.cuh"
#include "kernels/timeline.h"

namespace dl::kernels {
namespace {
std::vector<TimelineInstaller>& Installers() {
  static std::vector<TimelineInstaller> installers;
  return installers;
}
constexpr int kSegments = dev::kTimelineSegments;
struct TimelineState {
  unsigned long long* records = nullptr;
  unsigned* count = nullptr;
  unsigned per_segment = 0;
};
TimelineState& State() {
  static TimelineState state;
  return state;
}
}  // namespace

bool RegisterTimelineInstaller(TimelineInstaller installer) {
  Installers().push_back(installer);
  return true;
}

bool TimelineBuilt() {
#ifdef DL_TIMELINE
  return true;
#else
  return false;
#endif
}

Status TimelineEnable(size_t capacity) {
  if (!TimelineBuilt()) return Unavailable("timeline: this build has no timeline stamps (configure with -DDECODELAB_TIMELINE=ON)");
  if (capacity == 0 || capacity > (1u << 26)) return InvalidArgument("timeline: capacity {} (1..2^26 records)", capacity);
  TimelineState& st = State();
  if (st.records) {
    cudaFree(st.records);
    cudaFree(st.count);
    st = {};
  }
  st.per_segment = static_cast<unsigned>((capacity + kSegments - 1) / kSegments);
  DL_CUDA_RETURN_IF_ERROR(cudaMalloc(&st.records, size_t{kSegments} * st.per_segment * 6 * sizeof(unsigned long long)));
  DL_CUDA_RETURN_IF_ERROR(cudaMalloc(&st.count, kSegments * sizeof(unsigned)));
  DL_CUDA_RETURN_IF_ERROR(cudaMemset(st.count, 0, kSegments * sizeof(unsigned)));
  const dev::TimelineDeviceBuffer descriptor{st.records, st.count, st.per_segment};
  for (TimelineInstaller install : Installers()) {
    const auto e = static_cast<cudaError_t>(install(&descriptor));
    if (e != cudaSuccess) return Internal("timeline: installing the buffer: {}", cudaGetErrorString(e));
  }
  return Status::Ok();
}

Status TimelineReset(Stream stream) {
  if (!State().count) return FailedPrecondition("timeline: not enabled");
  DL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(State().count, 0, kSegments * sizeof(unsigned), reinterpret_cast<cudaStream_t>(stream)));
  return Status::Ok();
}

Result<std::vector<TimelineRecord>> TimelineRead() {
  const TimelineState& st = State();
  if (!st.count) return FailedPrecondition("timeline: not enabled");
  DL_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  std::vector<unsigned> counts(kSegments);
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(counts.data(), st.count, kSegments * sizeof(unsigned), cudaMemcpyDeviceToHost));
  std::vector<unsigned long long> raw(size_t{kSegments} * st.per_segment * 6);
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(raw.data(), st.records, raw.size() * sizeof raw[0], cudaMemcpyDeviceToHost));
  std::vector<TimelineRecord> records;
  for (int sm = 0; sm < kSegments; ++sm) {
    const unsigned n = std::min(counts[sm], st.per_segment);
    for (unsigned i = 0; i < n; ++i) {
      const unsigned long long* r = &raw[6 * (size_t{static_cast<unsigned>(sm)} * st.per_segment + i)];
      records.push_back({r[0], static_cast<uint32_t>(r[1]), static_cast<uint32_t>(r[2] & 0xffffffffu),
                         static_cast<uint32_t>(r[2] >> 32), r[3], r[4], r[5]});
    }
  }
  return records;
}

}  // namespace dl::kernels
