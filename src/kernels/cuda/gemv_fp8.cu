// FP8-weight GEMV (GemvParams::w_fp8): the BF16 kernels of gemv.cu (plain / fused-norm tiles, the
// batched T > 1 kernel; not the batch-1 streaming kernel, which lost here) over E4M3 codes with the FP8
// rule of kernels/ops.h: a lane's 16-byte chunk holds 16 codes whose exact values are FMA'd in order
// against x from zero, and the chunk's sum times its block's scale is FMA'd into the lane's sum. A
// separate file (not templates over gemv.cu) so the BF16 kernels, tuned and measured, keep their code
// and registers untouched, and so the tensor-core work beside it in gemv.cu does not collide; the grid
// shapes and PDL points are gemv.cu's, written for 1-byte elements.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/fp8_weights.cuh"
#include "kernels/cuda/gemv_epilogue.cuh"
#include "kernels/cuda/norm_block.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kFp8GemvWarps = 8;
constexpr int kFp8GemvTile = 8;  // tokens per pass over W (fused-norm tiles)

// Grid ceil(out / (8 / KS)); block 256 threads = 8 / KS rows x KS slices over in / 16 chunks. With a
// fused input norm, dynamic shared memory holds the TT normalised input rows ([TT, in] BF16).
template <int TT, int KS, bool kFusedNorm>
__global__ void __launch_bounds__(kFp8GemvWarps * 32) GemvFp8Kernel(GemvParams a, Fp8ScaleMap sm, int t0, int nt) {
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  constexpr int U = TT == 1 ? 8 : 4;
  constexpr int kRows = kFp8GemvWarps / KS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRows + warp / KS;
  const int slice = warp % KS;
  const int n16 = a.in / 16;
  const int per = n16 / KS;
  const int lo = slice * per, hi = lo + per;
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  const bool live = row < a.out;
  const int r = live ? row : 0;
  const uint4* w_row = reinterpret_cast<const uint4*>(a.w_fp8.codes + static_cast<size_t>(r) * a.in);
  const float* s_row = sm.Row(r);
  uint4 wv[U];
  float sv[U];  // each chunk's scale, loaded with it
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (live && c < hi) {
        wv[u] = __ldg(w_row + c);
        sv[u] = __ldg(s_row + (c >> sm.shift));
      }
    }
  };
  load(lo + lane);
  const FusedInputNorm& nm = a.norm;
  NormWeights norm_weight;
  if constexpr (kFusedNorm) {
    norm_weight = LoadNormWeights(nm.weight, a.in);
    PrefetchNormResidual(nm, static_cast<size_t>(t0) * a.in, a.in, nt, kFp8GemvWarps * 32);
  }
  WaitReleasing(a.release_after_wait);
  extern __shared__ uint4 s_x[];
  const int n8 = a.in / 8;
  if constexpr (kFusedNorm) {
    for (int t = 0; t < nt; ++t) {
      FusedNormRow(nm, static_cast<size_t>(t0 + t) * a.in, norm_weight, a.in, blockIdx.x == 0,
                   reinterpret_cast<uint16_t*>(s_x + t * n8));
    }
  }
  const uint4* x_base = kFusedNorm ? s_x : reinterpret_cast<const uint4*>(a.x + t0 * a.x_stride);
  const int64_t x_step = kFusedNorm ? n8 : a.x_stride / 8;
  if (live) {
    for (int c0 = lo + lane; c0 < hi; c0 += 32 * U) {
      if (c0 != lo + lane) load(c0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        if (c >= hi) break;
        float v[16];
        Fp8ChunkValues(wv[u], v);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          if (t >= nt) break;
          Fp8ChunkFma(v, sv[u], x_base[t * x_step + 2 * c], x_base[t * x_step + 2 * c + 1], acc[t]);
        }
      }
    }
  }
  GemvStoreRow<KS, TT, kFp8GemvWarps>(acc, live, nt, warp, slice, lane, a.y, a.y_stride, t0, row);
}

// Batched (T > 1, no fused norm): GemvBatchKernel's layout (warp w: slice w % KS of R consecutive rows,
// grid (token tiles of TT, row blocks)); each row's chunk is decoded once and used for the tile's
// tokens: the same v[e] values and per-token FMA sequence as the kernel above.
template <int R, int TT, int KS>
__global__ void __launch_bounds__(kFp8GemvWarps * 32) GemvFp8BatchKernel(GemvParams a, Fp8ScaleMap sm) {
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  constexpr int kGroups = kFp8GemvWarps / KS;
  constexpr int U = R == 1 ? 4 : 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slice = warp % KS;
  const int row0 = (blockIdx.y * kGroups + warp / KS) * R;
  const int t0 = blockIdx.x * TT;
  const int nt = min(TT, a.num_tokens - t0);
  const int n16 = a.in / 16;
  const int per = n16 / KS;
  const int lo = slice * per, hi = lo + per;
  const uint4* w_rows[R];
  const float* s_rows[R];
  bool live[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    live[r] = row0 + r < a.out;
    const int rr = live[r] ? row0 + r : 0;
    w_rows[r] = reinterpret_cast<const uint4*>(a.w_fp8.codes + static_cast<size_t>(rr) * a.in);
    s_rows[r] = sm.Row(rr);
  }
  float acc[R][TT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
  uint4 wv[U][R];
  float sv[U][R];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (live[r] && c0 + 32 * u < hi) {
          wv[u][r] = __ldg(w_rows[r] + c0 + 32 * u);
          sv[u][r] = __ldg(s_rows[r] + ((c0 + 32 * u) >> sm.shift));
        }
  };
  load(lo + lane);
  WaitReleasing(a.release_after_wait);
  const uint4* x_base = reinterpret_cast<const uint4*>(a.x) + static_cast<size_t>(t0) * (a.x_stride / 8);
  const int64_t x_step = a.x_stride / 8;
  for (int c0 = lo + lane; c0 < hi; c0 += 32 * U) {
    if (c0 != lo + lane) load(c0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= hi) break;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float v[16];
        Fp8ChunkValues(wv[u][r], v);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          if (t >= nt) break;
          Fp8ChunkFma(v, sv[u][r], x_base[t * x_step + 2 * c], x_base[t * x_step + 2 * c + 1], acc[r][t]);
        }
      }
    }
  }
  GemvStoreRows<KS, R, TT, kFp8GemvWarps>(acc, live, nt, warp, slice, lane, a.y, a.y_stride, t0, row0);
}

template <int R, int TT>
void LaunchGemvFp8Batch(const GemvParams& p, const Fp8ScaleMap& sm, int ks, cudaStream_t s) {
  auto grid = [&](int k) {
    const int rows_per_block = (kFp8GemvWarps / k) * R;
    return dim3((p.num_tokens + TT - 1) / TT, (p.out + rows_per_block - 1) / rows_per_block);
  };
  const dim3 block(kFp8GemvWarps * 32);
  switch (ks) {
    case 1: LaunchDependent(GemvFp8BatchKernel<R, TT, 1>, grid(1), block, s, p, sm); break;
    case 2: LaunchDependent(GemvFp8BatchKernel<R, TT, 2>, grid(2), block, s, p, sm); break;
    case 4: LaunchDependent(GemvFp8BatchKernel<R, TT, 4>, grid(4), block, s, p, sm); break;
    default: LaunchDependent(GemvFp8BatchKernel<R, TT, 8>, grid(8), block, s, p, sm); break;
  }
}
template <int R>
void LaunchGemvFp8BatchRows(const GemvParams& p, const Fp8ScaleMap& sm, int ks, cudaStream_t s) {
  switch (p.batch_tokens) {
    case 4: LaunchGemvFp8Batch<R, 4>(p, sm, ks, s); break;
    case 16: LaunchGemvFp8Batch<R, 16>(p, sm, ks, s); break;
    default: LaunchGemvFp8Batch<R, 8>(p, sm, ks, s); break;
  }
}

template <int TT>
void LaunchGemvFp8(const GemvParams& p, const Fp8ScaleMap& sm, int ks, int t0, int nt, cudaStream_t s) {
  auto grid = [&](int k) { return dim3((p.out + kFp8GemvWarps / k - 1) / (kFp8GemvWarps / k)); };
  const dim3 block(kFp8GemvWarps * 32);
  if (p.norm.residual) {
    const size_t smem = static_cast<size_t>(TT) * p.in * sizeof(uint16_t);
    switch (ks) {
      case 1: LaunchDependentSmem(GemvFp8Kernel<TT, 1, true>, grid(1), block, smem, s, p, sm, t0, nt); break;
      case 2: LaunchDependentSmem(GemvFp8Kernel<TT, 2, true>, grid(2), block, smem, s, p, sm, t0, nt); break;
      case 4: LaunchDependentSmem(GemvFp8Kernel<TT, 4, true>, grid(4), block, smem, s, p, sm, t0, nt); break;
      default: LaunchDependentSmem(GemvFp8Kernel<TT, 8, true>, grid(8), block, smem, s, p, sm, t0, nt); break;
    }
    return;
  }
  switch (ks) {
    case 1: LaunchDependent(GemvFp8Kernel<TT, 1, false>, grid(1), block, s, p, sm, t0, nt); break;
    case 2: LaunchDependent(GemvFp8Kernel<TT, 2, false>, grid(2), block, s, p, sm, t0, nt); break;
    case 4: LaunchDependent(GemvFp8Kernel<TT, 4, false>, grid(4), block, s, p, sm, t0, nt); break;
    default: LaunchDependent(GemvFp8Kernel<TT, 8, false>, grid(8), block, s, p, sm, t0, nt); break;
  }
}

// Gemv()'s FP8 branch (gemv.cu calls it when w_fp8 is set; x_stride / y_stride are filled in there,
// the fused norm checked).
Status GemvFp8(const GemvParams& p, cudaStream_t s) {
  if (p.w != nullptr) return InvalidArgument("gemv: set either w (BF16) or w_fp8, not both");
  Fp8ScaleMap sm;
  DL_RETURN_IF_ERROR(CheckFp8Weight(p.w_fp8, p.in, "gemv", &sm));
  const int n16 = p.in / 16;
  const int ks = p.k_split == 0 ? GemvFp8KSplitFor(p.out, p.in) : p.k_split;
  if ((ks != 1 && ks != 2 && ks != 4 && ks != 8) || n16 % ks != 0) {
    return InvalidArgument("gemv: k_split {} must be 1, 2, 4 or 8 and divide the FP8 chunk count in / 16 = {}", ks, n16);
  }
  if (p.streaming.on) {
    // The TMA-ring streaming kernel lost to the plain one for FP8 rows (9.4 against 11.8 us for XS.2's
    // q/k/v/g, 2.57 against 2.85 ms per token end to end; docs/performance.md, session 17) and left the
    // binary: FP8 weights stream on the plain kernel.
    return InvalidArgument("gemv: FP8 weights have no streaming kernel (streaming.on must be off)");
  }
  if (p.num_tokens == 1) {
    LaunchGemvFp8<1>(p, sm, ks, 0, 1, s);
  } else if (!p.norm.residual) {
    if (reinterpret_cast<uintptr_t>(p.x) % 16 != 0) {
      return InvalidArgument("gemv: the batched kernel needs 16-byte aligned x rows");
    }
    switch (p.batch_rows) {
      case 1: LaunchGemvFp8BatchRows<1>(p, sm, ks, s); break;
      case 4: LaunchGemvFp8BatchRows<4>(p, sm, ks, s); break;
      default: LaunchGemvFp8BatchRows<2>(p, sm, ks, s); break;
    }
  } else {
    for (int t0 = 0; t0 < p.num_tokens; t0 += kFp8GemvTile) {
      const int nt = std::min(kFp8GemvTile, p.num_tokens - t0);
      LaunchGemvFp8<kFp8GemvTile>(p, sm, ks, t0, nt, s);
    }
  }
  DL_KERNEL_LAUNCH_CHECK("gemv_fp8");
  return Status::Ok();
}

}  // namespace dev

}  // namespace dl::kernels
