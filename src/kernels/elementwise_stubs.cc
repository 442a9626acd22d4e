// CPU-only builds: the element-wise launchers report that there is no CUDA backend.
#include "kernels/elementwise.h"

#if !defined(DECODELAB_HAVE_CUDA)
namespace dl::kernels {
Status EmbedLookup(const EmbedParams&, Stream) { return Unavailable("no CUDA backend in this build"); }
Status SiluMul(const SiluMulParams&, Stream) { return Unavailable("no CUDA backend in this build"); }
Status FillAffineBf16(bf16*, int64_t, uint64_t, float, float, Stream) {
  return Unavailable("no CUDA backend in this build");
}
Status FillAffineFp8(uint8_t*, float*, int64_t, int64_t, int, int, uint64_t, float, float, Stream) {
  return Unavailable("no CUDA backend in this build");
}
Status AbsMaxBf16(const bf16*, int64_t, float*, Stream) {
  return Unavailable("no CUDA backend in this build");
}
Status DeviceSmokeTest(int, size_t*) { return Unavailable("no CUDA backend in this build"); }
Status GatherRows(const GatherRowsParams&, Stream) { return Unavailable("no CUDA backend in this build"); }
Status AddBf16(const bf16*, const bf16*, bf16*, int64_t, Stream) {
  return Unavailable("no CUDA backend in this build");
}
Status Bf16ToF32(const bf16*, float*, int64_t, Stream) {
  return Unavailable("no CUDA backend in this build");
}
Status F32ToBf16(const float*, bf16*, int64_t, Stream) {
  return Unavailable("no CUDA backend in this build");
}
}  // namespace dl::kernels
#endif
