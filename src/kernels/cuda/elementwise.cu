#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "base/dtype.h"
#include "base/rng.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/elementwise.h"

namespace dl::kernels {
namespace {

__global__ void EmbedKernel(const __nv_bfloat16* __restrict__ table, const int32_t* __restrict__ ids,
                            __nv_bfloat16* __restrict__ out, int d, int vocab, int slice_begin,
                            int slice_end) {
  DL_TIMELINE_SCOPE(kEmbed);
  dev::AllowDependents();
  dev::WaitForPrerequisites();
  const int t = blockIdx.x;
  const int id = ids[t];
  const bool valid = id >= 0 && id < vocab;
  const bool held = valid && id >= slice_begin && id < slice_end;
  // Invalid ids: +0 (as ever). Valid ids another rank holds: BF16 -0 in all 8 lanes, the identity of
  // the all-reduce's FP32 sum (elementwise.h).
  const uint4 fill = valid ? make_uint4(0x80008000u, 0x80008000u, 0x80008000u, 0x80008000u) : make_uint4(0, 0, 0, 0);
  const uint4* src = reinterpret_cast<const uint4*>(table + static_cast<int64_t>(held ? id - slice_begin : 0) * d);
  uint4* dst = reinterpret_cast<uint4*>(out + static_cast<int64_t>(t) * d);
  for (int i = threadIdx.x; i < d / 8; i += blockDim.x) dst[i] = held ? src[i] : fill;
}

__global__ void SiluMulKernel(const __nv_bfloat16* __restrict__ gate_up, __nv_bfloat16* __restrict__ out,
                              int ffn) {
  DL_TIMELINE_SCOPE(kSiluMul);
  dev::AllowDependents();
  dev::WaitForPrerequisites();
  const int t = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= ffn) return;
  const float g = __bfloat162float(gate_up[static_cast<int64_t>(t) * 2 * ffn + j]);
  const float u = __bfloat162float(gate_up[static_cast<int64_t>(t) * 2 * ffn + ffn + j]);
  const float s = __bfloat162float(__float2bfloat16(g / (1.0f + expf(-g))));
  out[static_cast<int64_t>(t) * ffn + j] = __float2bfloat16(s * u);
}

__global__ void GatherRowsKernel(const uint4* __restrict__ src, const int32_t* __restrict__ rows,
                                 uint4* __restrict__ dst, int n16) {
  dev::AllowDependents();
  dev::WaitForPrerequisites();
  const int r = blockIdx.x;
  const uint4* s = src + static_cast<int64_t>(rows[r]) * n16;
  for (int i = threadIdx.x; i < n16; i += blockDim.x) dst[static_cast<int64_t>(r) * n16 + i] = s[i];
}

__global__ void AddBf16Kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                              __nv_bfloat16* __restrict__ out, int64_t n) {
  dev::AllowDependents();
  dev::WaitForPrerequisites();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
  }
}

__global__ void Bf16ToF32Kernel(const __nv_bfloat16* __restrict__ src, float* __restrict__ dst, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __bfloat162float(src[i]);
}

__global__ void F32ToBf16Kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __float2bfloat16(src[i]);
}

__global__ void FillAffineKernel(__nv_bfloat16* dst, int64_t n, uint64_t key, float scale, float offset) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // No FMA: the host computes offset + scale * n as two rounded operations.
    dst[i] = __float2bfloat16(__fadd_rn(offset, __fmul_rn(scale, NormalAt(key, static_cast<uint64_t>(i)))));
  }
}

__global__ void AbsMaxKernel(const __nv_bfloat16* __restrict__ src, int64_t n, unsigned* out) {
  float m = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    m = fmaxf(m, fabsf(__bfloat162float(src[i])));
  }
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  // Non-negative floats order like their bit patterns as unsigned integers.
  if ((threadIdx.x & 31) == 0) atomicMax(out, __float_as_uint(m));
}

Status LaunchStatus(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return Internal("{} launch failed: {}", what, cudaGetErrorString(e));
  return Status::Ok();
}

}  // namespace

Status EmbedLookup(const EmbedParams& p, Stream stream) {
  if (p.d % 8 != 0 || p.num_tokens <= 0) return InvalidArgument("EmbedLookup: bad shape");
  const int rows = p.slice_rows < 0 ? p.vocab : p.slice_rows;
  if (p.slice_begin < 0 || p.slice_rows < -1 || p.slice_begin > p.vocab - rows) {
    return InvalidArgument("EmbedLookup: rows [{}, +{}) are not a slice of the vocabulary of {}", p.slice_begin,
                           rows, p.vocab);
  }
  dev::LaunchDependent(EmbedKernel, dim3(p.num_tokens), dim3(128), stream,
                       reinterpret_cast<const __nv_bfloat16*>(p.table), p.ids,
                       reinterpret_cast<__nv_bfloat16*>(p.out), p.d, p.vocab, p.slice_begin, p.slice_begin + rows);
  return LaunchStatus("EmbedLookup");
}

Status SiluMul(const SiluMulParams& p, Stream stream) {
  if (p.ffn <= 0 || p.num_tokens <= 0) return InvalidArgument("SiluMul: bad shape");
  dim3 grid((p.ffn + 255) / 256, p.num_tokens);
  dev::LaunchDependent(SiluMulKernel, grid, dim3(256), stream,
                       reinterpret_cast<const __nv_bfloat16*>(p.gate_up),
                       reinterpret_cast<__nv_bfloat16*>(p.out), p.ffn);
  return LaunchStatus("SiluMul");
}

Status FillAffineBf16(bf16* dst, int64_t n, uint64_t key, float scale, float offset, Stream stream) {
  if (n <= 0) return Status::Ok();
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 8192);
  FillAffineKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      reinterpret_cast<__nv_bfloat16*>(dst), n, key, scale, offset);
  return LaunchStatus("FillAffineBf16");
}

Status AbsMaxBf16(const bf16* src, int64_t n, float* out, Stream stream) {
  if (cudaMemsetAsync(out, 0, sizeof(float), stream) != cudaSuccess) return LaunchStatus("AbsMaxBf16");
  if (n <= 0) return Status::Ok();
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 2048);
  AbsMaxKernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(src), n, reinterpret_cast<unsigned*>(out));
  return LaunchStatus("AbsMaxBf16");
}

Status DeviceSmokeTest(int device, size_t* bytes_in_use) {
  if (cudaSetDevice(device) != cudaSuccess) return LaunchStatus("cudaSetDevice");
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return LaunchStatus("cudaMemGetInfo");
  if (bytes_in_use) *bytes_in_use = total_b - free_b;
  constexpr int64_t n = 1 << 20;
  bf16* d = nullptr;
  if (cudaMalloc(&d, n * sizeof(bf16)) != cudaSuccess) return LaunchStatus("cudaMalloc");
  const uint64_t key = StreamKey(device, "decodelab-device-smoke-test");
  Status st = FillAffineBf16(d, n, key, 1.0f, 0.0f, nullptr);
  std::vector<uint16_t> h(n);
  if (st.ok() && cudaMemcpy(h.data(), d, n * sizeof(bf16), cudaMemcpyDeviceToHost) != cudaSuccess) {
    st = LaunchStatus("cudaMemcpy");
  }
  cudaFree(d);
  DL_RETURN_IF_ERROR(st);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i += 997) {
    const int diff = static_cast<int>(h[i]) - static_cast<int>(FloatToBf16(NormalAt(key, i)));
    bad += diff > 1 || diff < -1;
  }
  if (bad) return Internal("device {}: {} of {} sampled values differ from the host formula", device, bad, n / 997 + 1);
  return Status::Ok();
}

Status GatherRows(const GatherRowsParams& p, Stream stream) {
  if (p.width % 8 != 0 || p.num_rows < 0 || !p.src || !p.rows || !p.dst) {
    return InvalidArgument("GatherRows: bad shape or pointers (width {} must be a multiple of 8)", p.width);
  }
  if (p.num_rows == 0) return Status::Ok();
  dev::LaunchDependent(GatherRowsKernel, dim3(p.num_rows), dim3(128), stream, reinterpret_cast<const uint4*>(p.src),
                       p.rows, reinterpret_cast<uint4*>(p.dst), p.width / 8);
  return LaunchStatus("GatherRows");
}

Status AddBf16(const bf16* a, const bf16* b, bf16* out, int64_t n, Stream stream) {
  if (n <= 0) return Status::Ok();
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096));
  dev::LaunchDependent(AddBf16Kernel, dim3(blocks), dim3(256), stream, reinterpret_cast<const __nv_bfloat16*>(a),
                       reinterpret_cast<const __nv_bfloat16*>(b), reinterpret_cast<__nv_bfloat16*>(out), n);
  return LaunchStatus("AddBf16");
}

Status Bf16ToF32(const bf16* src, float* dst, int64_t n, Stream stream) {
  if (n <= 0) return Status::Ok();
  Bf16ToF32Kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      reinterpret_cast<const __nv_bfloat16*>(src), dst, n);
  return LaunchStatus("Bf16ToF32");
}

Status F32ToBf16(const float* src, bf16* dst, int64_t n, Stream stream) {
  if (n <= 0) return Status::Ok();
  F32ToBf16Kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(
      src, reinterpret_cast<__nv_bfloat16*>(dst), n);
  return LaunchStatus("F32ToBf16");
}

}  // namespace dl::kernels
