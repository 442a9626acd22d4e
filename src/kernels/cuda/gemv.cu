// BF16 GEMV (and small-T GEMM with the same per-element order). KS warps per output row (the input
// split, chosen from the shape only), lanes walk their slice in 16-byte chunks (lane, lane+32, ...),
// U loads in flight per lane, FP32 FMAs in a fixed sequence, xor-butterfly warp sums, slices added
// in ascending order. The per-token arithmetic is identical for every tile width and token count, so
// y for token t does not depend on how many tokens share the launch.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/bulk_copy.cuh"
#include "kernels/cuda/gemv_epilogue.cuh"
#include "kernels/cuda/mma_product.cuh"
#include "kernels/cuda/norm_block.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kGemvWarps = 8;
constexpr int kGemvTile = 8;  // tokens per pass over W

// Grid ceil(out / (8 / KS)); block 256 threads = 8 / KS rows x KS slices. With a fused input norm,
// dynamic shared memory holds the TT normalised input rows ([TT, in] BF16), computed by every block.
template <int TT, int KS, bool kFusedNorm>
__global__ void __launch_bounds__(kGemvWarps * 32) GemvKernel(GemvParams a, int t0, int nt) {
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  constexpr int U = TT == 1 ? 8 : 4;  // 8 x 16 B per lane in flight; a token tile needs registers for x
  constexpr int kRows = kGemvWarps / KS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRows + warp / KS;
  const int slice = warp % KS;
  const int n8 = a.in / 8;
  const int per = n8 / KS;  // the launcher checks n8 % KS == 0
  const int lo = slice * per, hi = lo + per;
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  const bool live = row < a.out;
  const uint4* w_row = reinterpret_cast<const uint4*>(a.w + static_cast<size_t>(live ? row : 0) * a.in);
  uint4 wv[U];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (live && c < hi) wv[u] = __ldg(w_row + c);
    }
  };
  // The first batch of weights depends on nothing: it is in flight before x is ready.
  load(lo + lane);
  const FusedInputNorm& nm = a.norm;
  constexpr bool fused = kFusedNorm;
  NormWeights norm_weight;
  if constexpr (fused) {
    norm_weight = LoadNormWeights(nm.weight, a.in);
    PrefetchNormResidual(nm, static_cast<size_t>(t0) * a.in, a.in, nt, kGemvWarps * 32);
  }
  WaitReleasing(a.release_after_wait);
  // x rows: given, or (fused norm) computed here while those loads are in flight.
  extern __shared__ uint4 s_x[];
  if constexpr (fused) {
    for (int t = 0; t < nt; ++t) {
      FusedNormRow(nm, static_cast<size_t>(t0 + t) * a.in, norm_weight, a.in, blockIdx.x == 0,
                   reinterpret_cast<uint16_t*>(s_x + t * n8));
    }
  }
  const uint4* x_base = fused ? s_x : reinterpret_cast<const uint4*>(a.x + t0 * a.x_stride);
  const int64_t x_step = fused ? n8 : a.x_stride / 8;  // 16-byte chunks between token rows
  if (live) {
    for (int c0 = lo + lane; c0 < hi; c0 += 32 * U) {
      if (c0 != lo + lane) load(c0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        if (c >= hi) break;
        float wf[8];
        Bf16x8ToFloat(wv[u], wf);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          if (t >= nt) break;
          float xf[8];
          Bf16x8ToFloat(x_base[t * x_step + c], xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[t] = fmaf(wf[e], xf[e], acc[t]);
        }
      }
    }
  }
  GemvStoreRow<KS, TT, kGemvWarps>(acc, live, nt, warp, slice, lane, a.y, a.y_stride, t0, row);
}

// ---- Batched GEMV (T > 1, no fused norm). Block = 8 warps; warp w takes slice w % KS of R
// consecutive rows (row group w / KS of the block); grid (token tiles of TT, row blocks), token tile
// fastest, so the blocks reading the same rows of W run together and share them through L2. Per
// (row, token) the lane walks the slice's chunks lane, lane + 32, ... and FMAs each chunk's 8
// elements in order, then WarpSum and the slices in order: the batch-1 kernels' arithmetic, so a
// token's outputs do not depend on T, R or TT. The R rows' chunks are loaded once per tile and used
// for its TT tokens (x through L1: the 8 warps of a block read the same chunks).
template <int R, int TT, int KS>
__global__ void __launch_bounds__(kGemvWarps * 32) GemvBatchKernel(GemvParams a) {
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  constexpr int kGroups = kGemvWarps / KS;
  constexpr int U = R == 1 ? 4 : 2;  // chunks per row in flight per lane
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slice = warp % KS;
  const int row0 = (blockIdx.y * kGroups + warp / KS) * R;
  const int t0 = blockIdx.x * TT;
  const int nt = min(TT, a.num_tokens - t0);
  const int n8 = a.in / 8;
  const int per = n8 / KS;
  const int lo = slice * per, hi = lo + per;
  const uint4* w_rows[R];
  bool live[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    live[r] = row0 + r < a.out;
    w_rows[r] = reinterpret_cast<const uint4*>(a.w + static_cast<size_t>(live[r] ? row0 + r : 0) * a.in);
  }
  float acc[R][TT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
  uint4 wv[U][R];
  auto load = [&](int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (live[r] && c0 + 32 * u < hi) wv[u][r] = __ldg(w_rows[r] + c0 + 32 * u);
  };
  load(lo + lane);  // weights depend on nothing: in flight before the wait
  WaitReleasing(a.release_after_wait);
  const uint4* x_base = reinterpret_cast<const uint4*>(a.x) + static_cast<size_t>(t0) * (a.x_stride / 8);
  const int64_t x_step = a.x_stride / 8;
  for (int c0 = lo + lane; c0 < hi; c0 += 32 * U) {
    if (c0 != lo + lane) load(c0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= hi) break;
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) Bf16x8ToFloat(wv[u][r], wf[r]);
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t >= nt) break;
        float xf[8];
        Bf16x8ToFloat(x_base[t * x_step + c], xf);  // written by the previous kernel: not the .nc path
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][t] = fmaf(wf[r][e], xf[e], acc[r][t]);
      }
    }
  }
  GemvStoreRows<KS, R, TT, kGemvWarps>(acc, live, nt, warp, slice, lane, a.y, a.y_stride, t0, row0);
}

template <int R, int TT>
void LaunchGemvBatch(const GemvParams& p, int ks, cudaStream_t s) {
  auto grid = [&](int k) {
    const int rows_per_block = (kGemvWarps / k) * R;
    return dim3((p.num_tokens + TT - 1) / TT, (p.out + rows_per_block - 1) / rows_per_block);
  };
  const dim3 block(kGemvWarps * 32);
  switch (ks) {
    case 1: LaunchDependent(GemvBatchKernel<R, TT, 1>, grid(1), block, s, p); break;
    case 2: LaunchDependent(GemvBatchKernel<R, TT, 2>, grid(2), block, s, p); break;
    case 4: LaunchDependent(GemvBatchKernel<R, TT, 4>, grid(4), block, s, p); break;
    default: LaunchDependent(GemvBatchKernel<R, TT, 8>, grid(8), block, s, p); break;
  }
}

template <int R>
void LaunchGemvBatchRows(const GemvParams& p, int ks, cudaStream_t s) {
  switch (p.batch_tokens) {
    case 4: LaunchGemvBatch<R, 4>(p, ks, s); break;
    case 16: LaunchGemvBatch<R, 16>(p, ks, s); break;
    default: LaunchGemvBatch<R, 8>(p, ks, s); break;
  }
}

// ---- Streaming GEMV (GemvParams::streaming): batch 1. Grid = ceil(out / rpb) <= SMs, one block per
// SM owning rows [b * rpb, b * rpb + rows) of W: one contiguous stretch of memory. Warp 8 (one lane)
// is the producer: it copies the stretch stage by stage (stage_rows whole rows, one TMA bulk copy
// each) into a ring of `stages` shared-memory slots, signalling a `full` mbarrier per slot with the
// byte count, and reuses a slot once all 8 consumer warps have arrived on its `empty` mbarrier. It
// never waits for the earlier kernels (weights only), so the first ring's worth is in flight before
// the predecessor has finished. Warps 0-7 consume: warp w takes slice w % KS of rows w / KS,
// w / KS + 8 / KS, ... of each stage, with the plain kernel's per-lane chunk order, FMA sequence,
// warp sum and slice order: the same bits. Shared memory: [2 * stages] mbarriers | ring [stages,
// stage_rows, in] BF16 | x [in] BF16 | partial sums [rpb, KS] FP32.
// kFusedNorm: the consumers compute x = the add + RMSNorm of the residual row (FusedInputNorm, the
// norm kernel's code and bits) instead of copying it: with one block per SM that costs ~130 blocks
// an 8 KB L2 read and a block reduction, less than the norm kernel's launch and release it replaces
// (the plain GEMV's ~2,600 blocks lost that trade, session 4).
struct GemvStreamGeometry {
  int ks = 1, stage_rows = 0, stages = 0, rpb = 0, grid = 0;
  size_t ring_off = 0, x_off = 0, part_off = 0, smem = 0;
  size_t prefetch_bytes = 0;  // the stages that fit in it are copied before the PDL wait
};
constexpr int kStreamMaxStages = 32;

// One block per SM owning consecutive rows: rows per block (set) and the grid.
inline int OneBlockPerSmGrid(int out, int sms, int* rows_per_block) {
  const int rpb = (out + sms - 1) / sms;
  *rows_per_block = rpb;
  return (out + rpb - 1) / rpb;
}

// The geometry for [out x in] with a ring of ring_kb and stages of about stage_kb; stages == 0 when
// two stages of one row group do not fit.
inline GemvStreamGeometry StreamGeometry(int out, int in, int ring_kb, int stage_kb, int sms) {
  GemvStreamGeometry g;
  if (out < 1 || in < 8 || in % 8 != 0 || sms < 1) return g;
  g.ks = GemvKSplitFor(out, in);
  const int group = kGemvWarps / g.ks;  // rows one pass of the 8 warps covers
  const size_t row_bytes = static_cast<size_t>(in) * 2;
  g.grid = OneBlockPerSmGrid(out, sms, &g.rpb);
  const size_t want = static_cast<size_t>(std::max(stage_kb, 1)) * 1024;
  g.stage_rows = std::max<int>(group, static_cast<int>(want / row_bytes) / group * group);
  g.stage_rows = std::min(g.stage_rows, (g.rpb + group - 1) / group * group);
  const size_t stage_bytes = g.stage_rows * row_bytes;
  const int needed = (g.rpb + g.stage_rows - 1) / g.stage_rows;
  int stages = static_cast<int>(static_cast<size_t>(std::max(ring_kb, 1)) * 1024 / stage_bytes);
  stages = std::min({stages, needed, kStreamMaxStages});
  if (stages < std::min(2, needed)) return g;
  g.ring_off = RingOffset(kStreamMaxStages);
  g.x_off = g.ring_off + stages * stage_bytes;
  g.part_off = g.x_off + AlignUp(row_bytes, 16);
  g.smem = g.part_off + static_cast<size_t>(g.rpb) * g.ks * sizeof(float);
  if (g.smem > kMaxBlockSmem) return GemvStreamGeometry{};
  g.stages = stages;
  return g;
}

static_assert(kGemvWarps * 32 == kNormThreads, "the streaming GEMV's consumers run the fused norm");

template <bool kFusedNorm>
__global__ void __launch_bounds__((kGemvWarps + 1) * 32, 1) GemvStreamKernel(GemvParams a, GemvStreamGeometry g) {
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  extern __shared__ __align__(128) unsigned char s_stream[];
  uint64_t* full = reinterpret_cast<uint64_t*>(s_stream);
  uint64_t* empty = full + kStreamMaxStages;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n8 = a.in / 8;
  const size_t stage_chunks = static_cast<size_t>(g.stage_rows) * n8;  // 16-byte chunks per stage
  uint4* ring = reinterpret_cast<uint4*>(s_stream + g.ring_off);
  uint4* s_x = reinterpret_cast<uint4*>(s_stream + g.x_off);
  float* s_part = reinterpret_cast<float*>(s_stream + g.part_off);
  const int r0 = blockIdx.x * g.rpb;
  const int rows = max(0, min(g.rpb, a.out - r0));
  const int n_stages = (rows + g.stage_rows - 1) / g.stage_rows;
  InitRing(full, empty, g.stages, 1, kGemvWarps);
  if (warp == kGemvWarps) {  // the producer
    if (lane == 0) {
      const uint4* src = reinterpret_cast<const uint4*>(a.w) + static_cast<size_t>(r0) * n8;
      const size_t stage_bytes = stage_chunks * 16;
      bool waited = false;
      for (int s = 0; s < n_stages; ++s) {
        const int slot = s % g.stages, use = s / g.stages;
        if (use > 0) MbarWait(empty + slot, (use - 1) & 1);
        if (!waited && (s + 1) * stage_bytes > g.prefetch_bytes) {  // past the early part: wait first
          WaitForGrid();
          if (a.release_after_wait) AllowDependents();  // every thread of a late block releases
          waited = true;
        }
        const int stage_rows = min(g.stage_rows, rows - s * g.stage_rows);
        BulkCopyToShared(ring + slot * stage_chunks, src + s * stage_chunks,
                         static_cast<uint32_t>(stage_rows) * n8 * 16, full + slot);
      }
    }
    return;
  }
  NormWeights norm_weight;
  if constexpr (kFusedNorm) {  // before the wait: the weight is constant, the residual only warmed
    norm_weight = LoadNormWeights(a.norm.weight, a.in);
    PrefetchNormResidual(a.norm, 0, a.in, 1, kGemvWarps * 32);
  }
  WaitReleasing(a.release_after_wait);
  if constexpr (kFusedNorm) {
    FusedNormRow<true>(a.norm, 0, norm_weight, a.in, blockIdx.x == 0, reinterpret_cast<uint16_t*>(s_x));
  } else {
    for (int c = threadIdx.x; c < n8; c += kGemvWarps * 32) s_x[c] = reinterpret_cast<const uint4*>(a.x)[c];
    ConsumerSync<kGemvWarps>();
  }
  const int ks = g.ks, group = kGemvWarps / ks;
  const int slice = warp % ks, per = n8 / ks, lo = slice * per, hi = lo + per;
  for (int s = 0; s < n_stages; ++s) {
    const int slot = s % g.stages, use = s / g.stages;
    MbarWait(full + slot, use & 1);
    const int stage_rows = min(g.stage_rows, rows - s * g.stage_rows);
    const uint4* st = ring + slot * stage_chunks;
    for (int r = warp / ks; r < stage_rows; r += group) {
      const float v = WarpSum(LaneDotShared(st + static_cast<size_t>(r) * n8, s_x, lo, hi, lane));
      if (lane == 0) s_part[(s * g.stage_rows + r) * ks + slice] = v;
    }
    __syncwarp();
    if (lane == 0) MbarArrive(empty + slot);
  }
  ConsumerSync<kGemvWarps>();
  GemvStoreStreamed<kGemvWarps * 32>(s_part, rows, ks, a.y, r0);
}

template <int TT>
void LaunchGemv(const GemvParams& p, int ks, int t0, int nt, cudaStream_t s) {
  auto grid = [&](int k) { return dim3((p.out + kGemvWarps / k - 1) / (kGemvWarps / k)); };
  const dim3 block(kGemvWarps * 32);
  if (p.norm.residual) {  // a separate instantiation: the plain GEMV keeps its register count
    const size_t smem = static_cast<size_t>(TT) * p.in * sizeof(uint16_t);
    switch (ks) {
      case 1: LaunchDependentSmem(GemvKernel<TT, 1, true>, grid(1), block, smem, s, p, t0, nt); break;
      case 2: LaunchDependentSmem(GemvKernel<TT, 2, true>, grid(2), block, smem, s, p, t0, nt); break;
      case 4: LaunchDependentSmem(GemvKernel<TT, 4, true>, grid(4), block, smem, s, p, t0, nt); break;
      default: LaunchDependentSmem(GemvKernel<TT, 8, true>, grid(8), block, smem, s, p, t0, nt); break;
    }
    return;
  }
  switch (ks) {
    case 1: LaunchDependent(GemvKernel<TT, 1, false>, grid(1), block, s, p, t0, nt); break;
    case 2: LaunchDependent(GemvKernel<TT, 2, false>, grid(2), block, s, p, t0, nt); break;
    case 4: LaunchDependent(GemvKernel<TT, 4, false>, grid(4), block, s, p, t0, nt); break;
    default: LaunchDependent(GemvKernel<TT, 8, false>, grid(8), block, s, p, t0, nt); break;
  }
}

// The FP8-weight kernels (gemv_fp8.cu), for GemvParams::w_fp8.
Status GemvFp8(const GemvParams& p, cudaStream_t s);
Status LibraryGemm(const GemvParams& p, cudaStream_t s);  // library_gemm.cu

}  // namespace dev

Status Gemv(const GemvParams& params, Stream stream) {
  GemvParams p = params;
  if ((!p.w && !p.w_fp8.on()) || !p.y) return InvalidArgument("gemv: w, x and y must be set");
  if (p.out < 1 || p.in < 8 || p.in % 8 != 0 || p.num_tokens < 1) {
    return InvalidArgument("gemv: shape [{} x {}] x {} tokens unsupported (in must be a multiple "
                           "of 8)", p.out, p.in, p.num_tokens);
  }
  if (p.x_stride == 0) p.x_stride = p.in;
  if (p.y_stride == 0) p.y_stride = p.out;
  if (p.x_stride % 8 != 0) return InvalidArgument("gemv: x_stride {} not a multiple of 8", p.x_stride);
  if (p.library_gemm) return dev::LibraryGemm(p, reinterpret_cast<cudaStream_t>(stream));  // ops.h, section 5c
  if (p.mma) return dev::MmaGemv(p, reinterpret_cast<cudaStream_t>(stream));  // ops.h, section 5b
  if (p.norm.residual) {
    DL_RETURN_IF_ERROR(dev::CheckFusedInputNorm(p.norm, p.in, "gemv"));
  } else if (!p.x) {
    return InvalidArgument("gemv: w, x and y must be set");
  }
  if (p.w_fp8.on()) return dev::GemvFp8(p, reinterpret_cast<cudaStream_t>(stream));
  const int ks = p.k_split == 0 ? GemvKSplitFor(p.out, p.in) : p.k_split;
  if ((ks != 1 && ks != 2 && ks != 4 && ks != 8) || (p.in / 8) % ks != 0) {
    return InvalidArgument("gemv: k_split {} must be 1, 2, 4 or 8 and divide in / 8 = {}", ks, p.in / 8);
  }
  auto s = reinterpret_cast<cudaStream_t>(stream);
  if (p.streaming.on) {
    dev::GemvStreamGeometry g =
        dev::StreamGeometry(p.out, p.in, p.streaming.ring_kb, p.streaming.stage_kb, dev::SmCount());
    g.prefetch_bytes = static_cast<size_t>(std::max(p.streaming.prefetch_kb, 0)) * 1024;
    if (p.num_tokens != 1 || p.k_split != 0 || g.stages == 0 || !dev::DeviceHasBulkCopy() ||
        reinterpret_cast<uintptr_t>(p.w) % 16 != 0 || reinterpret_cast<uintptr_t>(p.x) % 16 != 0) {
      return InvalidArgument("gemv: streaming needs one token, the default k_split, 16-byte "
                             "aligned w and x and a shape whose two stages fit (GemvStreamSupported); got "
                             "[{} x {}] x {} tokens, ring {} KB",
                             p.out, p.in, p.num_tokens, p.streaming.ring_kb);
    }
    const dim3 block((dev::kGemvWarps + 1) * 32);
    if (p.norm.residual) {
      dev::LaunchDependentSmem(dev::GemvStreamKernel<true>, dim3(g.grid), block, g.smem, s, p, g);
    } else {
      dev::LaunchDependentSmem(dev::GemvStreamKernel<false>, dim3(g.grid), block, g.smem, s, p, g);
    }
    DL_KERNEL_LAUNCH_CHECK("gemv_stream");
    return Status::Ok();
  }
  if (p.num_tokens == 1) {
    dev::LaunchGemv<1>(p, ks, 0, 1, s);
  } else if (!p.norm.residual) {
    if (p.x_stride % 8 != 0 || reinterpret_cast<uintptr_t>(p.x) % 16 != 0) {
      return InvalidArgument("gemv: the batched kernel needs 16-byte aligned x rows");
    }
    switch (p.batch_rows) {
      case 1: dev::LaunchGemvBatchRows<1>(p, ks, s); break;
      case 4: dev::LaunchGemvBatchRows<4>(p, ks, s); break;
      default: dev::LaunchGemvBatchRows<2>(p, ks, s); break;
    }
  } else {
    for (int t0 = 0; t0 < p.num_tokens; t0 += dev::kGemvTile) {
      const int nt = std::min(dev::kGemvTile, p.num_tokens - t0);
      dev::LaunchGemv<dev::kGemvTile>(p, ks, t0, nt, s);
    }
  }
  DL_KERNEL_LAUNCH_CHECK("gemv");
  return Status::Ok();
}

bool GemvStreamSupported(int out, int in, int ring_kb, int stage_kb) {
  return dev::DeviceHasBulkCopy() && dev::StreamGeometry(out, in, ring_kb, stage_kb, dev::SmCount()).stages > 0;
}

}  // namespace dl::kernels
