// The tensor-core product (ops.h, section 5b): y[T, out] = x[T, in] W[out, in]^T with one fixed
// order per output element (mma_product.cuh), so a token's outputs do not depend on T, on its place
// in the batch, or on which of the two kernels ran:
//   - MmaRegKernel: warp = one 16-row tile of W x one input slice x 8 NT tokens. Lane (g, c) loads
//     rows g and g + 8 of its tile, 16 bytes per chunk, straight from global memory into the MMA's A
//     fragments (U chunks in flight), and token g's x the same way into B. Decode and small batches:
//     the bytes are W's, streamed once per NT * 8 tokens.
//   - MmaTiledKernel: block = 128 rows x 128 tokens, 8 warps of 64 x 32, W and x chunks staged
//     through shared memory by cp.async (kTileStages stages of two chunks); each lane reads its
//     fragments with the same 16-byte pieces. Prefill: W is read once per 128 tokens.
// Slices (k_split > 1): the register kernel gives each slice a warp and adds the slices' sums through
// shared memory; the tiled kernel walks the slices in turn and folds each slice's accumulator into a
// running total at its end: the same sum, p0 + p1 + ..., in both.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/mma_product.cuh"
#include "kernels/cuda/timeline.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kMmaWarps = 8;

// Grid (ceil(T / (8 NT)), ceil(tiles / (8 / KS))), token passes fastest so that the passes over the
// same rows of W run together and share them through L2; block 256 threads: warp w takes tile
// blockIdx.y * (8 / KS) + w / KS and slice w % KS. W: [out, in], x: [T, in] (row stride x_stride),
// y: [T, out] (row stride y_stride).
template <int NT, int KS>
__global__ void __launch_bounds__(kMmaWarps * 32) MmaRegKernel(GemvParams a, int chunks) {
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  constexpr int U = NT == 1 ? 8 : 4;  // chunks in flight per lane: 2 U loads of W, U NT of x
  constexpr int kTiles = kMmaWarps / KS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int slice = warp % KS;
  const int r0 = (blockIdx.y * kTiles + warp / KS) * 16;
  const int t0 = blockIdx.x * 8 * NT;
  const int per = chunks / KS, q_lo = slice * per, q_hi = q_lo + per;
  const int n8 = a.in / 8;  // 16-byte pieces per row; chunk q's piece of lane c: 4q + c
  const bool live_a[1] = {r0 + g < a.out}, live_b[1] = {r0 + g + 8 < a.out};
  const uint4* wa[1] = {reinterpret_cast<const uint4*>(a.w) + static_cast<size_t>(live_a[0] ? r0 + g : 0) * n8 + c};
  const uint4* wb[1] = {reinterpret_cast<const uint4*>(a.w) + static_cast<size_t>(live_b[0] ? r0 + g + 8 : 0) * n8 + c};
  const int64_t x_step = a.x_stride / 8;
  const uint4* xr[NT];
  bool tok_live[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int t = t0 + 8 * j + g;
    tok_live[j] = t < a.num_tokens;
    xr[j] = reinterpret_cast<const uint4*>(a.x) + (tok_live[j] ? t : 0) * x_step + c;
  }
  float acc_mat[1][NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_mat[0][j][e] = 0.0f;
  // The first weights are in flight before the wait: they depend on nothing.
  MmaSliceDots<1, NT, U>(wa, wb, live_a, live_b, xr, tok_live, n8, q_lo, q_hi, c, acc_mat,
                         [&] { WaitReleasing(a.release_after_wait); });
  float (&acc)[NT][4] = acc_mat[0];
  if constexpr (KS > 1) {
    __shared__ float s_part[kMmaWarps][NT * 4][32];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_part[warp][j * 4 + e][lane] = acc[j][e];
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int k = 1; k < KS; ++k)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += s_part[warp + k][j * 4 + e][lane];
  }
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r0 + g + (e >= 2 ? 8 : 0), t = t0 + 8 * j + 2 * c + (e & 1);
      if (row < a.out && t < a.num_tokens) a.y[static_cast<size_t>(t) * a.y_stride + row] = FloatToBf16Bits(acc[j][e]);
    }
}

// ---- Tiled kernel. Shared memory per stage: W chunk [128 rows][4 pieces] then x chunk [128 tokens]
// [4 pieces] (16-byte pieces, 64 bytes per row): a warp's fragment load (8 rows x 64 bytes) is 512
// contiguous bytes, free of bank conflicts.
// A stage holds kTileStageChunks chunks of 32 inputs of the block's W rows and x rows: a barrier
// per two chunks, not per chunk (one block per SM: a barrier stalls every warp of the SM).
constexpr int kTileM = 128, kTileN = 128, kTileStages = 4, kTileStageChunks = 2, kTileThreads = 256;
constexpr size_t kTileChunkBytes = static_cast<size_t>(kTileM + kTileN) * 64;
constexpr size_t kTileStageBytes = kTileStageChunks * kTileChunkBytes;
constexpr size_t kTileSmem = kTileStages * kTileStageBytes;

// Grid (ceil(T / 128), ceil(out / 128)): token blocks fastest, so the blocks reading the same rows
// of W run together and share them through L2. Warp w: rows 64 (w / 4) .. + 64 (4 tiles of 16),
// tokens 32 (w % 4) .. + 32 (4 tiles of 8) of the block.
template <int KS>
__global__ void __launch_bounds__(kTileThreads, 1) MmaTiledKernel(GemvParams a, int chunks) {
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  extern __shared__ __align__(128) unsigned char s_tile[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wm = warp >> 2, wn = warp & 3;
  const int n0 = blockIdx.x * kTileN, m0 = blockIdx.y * kTileM;
  const int n8 = a.in / 8;
  const int64_t x_step = a.x_stride / 8;
  const uint4* w = reinterpret_cast<const uint4*>(a.w);
  const uint4* x = reinterpret_cast<const uint4*>(a.x);
  WaitReleasing(a.release_after_wait);
  // Stage st holds chunks kTileStageChunks st + cc, each [W rows][4 pieces] then [x rows][4 pieces].
  // Thread tid copies pieces tid and tid + 256 of each operand's chunk: row idx / 4, piece idx % 4.
  const int steps = (chunks + kTileStageChunks - 1) / kTileStageChunks;
  auto load = [&](int stage, int st) {
#pragma unroll
    for (int cc = 0; cc < kTileStageChunks; ++cc) {
      const int q = kTileStageChunks * st + cc;
      uint4* sa = reinterpret_cast<uint4*>(s_tile + stage * kTileStageBytes + cc * kTileChunkBytes);
      uint4* sb = sa + kTileM * 4;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int idx = tid + kTileThreads * i, row = idx >> 2, piece = 4 * q + (idx & 3);
        const bool in = piece < n8;
        const bool wv = in && m0 + row < a.out, xv = in && n0 + row < a.num_tokens;
        CpAsync16(sa + idx, w + (wv ? static_cast<size_t>(m0 + row) * n8 + piece : 0), wv);
        CpAsync16(sb + idx, x + (xv ? (n0 + row) * x_step + piece : 0), xv);
      }
    }
  };
#pragma unroll
  for (int s = 0; s < kTileStages - 1; ++s) {
    if (s < steps) load(s, s);
    CpAsyncCommit();
  }
  float acc[4][4][4];
  float total[KS > 1 ? 4 : 1][KS > 1 ? 4 : 1][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
  const int per = chunks / KS;
  int slice_end = per;
  for (int st = 0; st < steps; ++st) {
    CpAsyncWait<kTileStages - 2>();  // stage st has landed (this thread's copies)
    __syncthreads();                 // everyone's copies, and everyone is done with stage (st - 1) % S
    {
      const int sn = st + kTileStages - 1;
      if (sn < steps) load(sn % kTileStages, sn);
      CpAsyncCommit();
    }
#pragma unroll
    for (int cc = 0; cc < kTileStageChunks; ++cc) {
      const int q = kTileStageChunks * st + cc;
      if (q >= chunks) break;  // past the last chunk: no MMA at all (an MMA of zeros could turn -0 into +0)
      const uint4* sa = reinterpret_cast<const uint4*>(s_tile + (st % kTileStages) * kTileStageBytes + cc * kTileChunkBytes);
      const uint4* sb = sa + kTileM * 4;
      uint4 af[4][2], bf[4];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        af[mt][0] = sa[(wm * 64 + mt * 16 + g) * 4 + c];
        af[mt][1] = sa[(wm * 64 + mt * 16 + g + 8) * 4 + c];
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) bf[nt] = sb[(wn * 32 + nt * 8 + g) * 4 + c];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) MmaChunk(acc[mt][nt], af[mt][0], af[mt][1], bf[nt]);
      if constexpr (KS > 1) {
        if (q + 1 == slice_end) {  // the slice's sum joins the total: p0, then + p1, + p2, ...
          const bool first = slice_end == per;
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                total[mt][nt][e] = first ? acc[mt][nt][e] : total[mt][nt][e] + acc[mt][nt][e];
                acc[mt][nt][e] = 0.0f;
              }
          slice_end += per;
        }
      }
    }
  }
  CpAsyncWait<0>();
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + wm * 64 + mt * 16 + g + (e >= 2 ? 8 : 0);
        const int t = n0 + wn * 32 + nt * 8 + 2 * c + (e & 1);
        float v;
        if constexpr (KS > 1) {
          v = total[mt][nt][e];
        } else {
          v = acc[mt][nt][e];
        }
        if (row < a.out && t < a.num_tokens) a.y[static_cast<size_t>(t) * a.y_stride + row] = FloatToBf16Bits(v);
      }
}

template <int NT>
void LaunchMmaReg(const GemvParams& p, int ks, int chunks, cudaStream_t s) {
  const int tiles = (p.out + 15) / 16;
  auto grid = [&](int k) {
    const int per_block = kMmaWarps / k;
    return dim3((p.num_tokens + 8 * NT - 1) / (8 * NT), (tiles + per_block - 1) / per_block);
  };
  const dim3 block(kMmaWarps * 32);
  switch (ks) {
    case 1: LaunchDependent(MmaRegKernel<NT, 1>, grid(1), block, s, p, chunks); break;
    case 2: LaunchDependent(MmaRegKernel<NT, 2>, grid(2), block, s, p, chunks); break;
    case 4: LaunchDependent(MmaRegKernel<NT, 4>, grid(4), block, s, p, chunks); break;
    default: LaunchDependent(MmaRegKernel<NT, 8>, grid(8), block, s, p, chunks); break;
  }
}

Status MmaGemv(const GemvParams& p, cudaStream_t s) {
  if (p.norm.residual) return InvalidArgument("gemv: the MMA product (mma) takes no fused input norm");
  if (p.streaming.on) return InvalidArgument("gemv: the MMA product (mma) has no streaming kernel: streaming.on must be off");
  if (!p.x) return InvalidArgument("gemv: w, x and y must be set");
  if (reinterpret_cast<uintptr_t>(p.w) % 16 != 0 || reinterpret_cast<uintptr_t>(p.x) % 16 != 0) {
    return InvalidArgument("gemv: the MMA product needs 16-byte aligned w and x");
  }
  const int chunks = (p.in + kMmaChunk - 1) / kMmaChunk;
  const int ks = p.k_split == 0 ? MmaKSplitFor(p.out, p.in) : p.k_split;
  if ((ks != 1 && ks != 2 && ks != 4 && ks != 8) || chunks % ks != 0) {
    return InvalidArgument("gemv: MMA k_split {} must be 1, 2, 4 or 8 and divide the {} chunks of 32 of in = {}", ks,
                           chunks, p.in);
  }
  if (p.num_tokens >= std::max(p.mma_tiled_min_tokens, 1)) {
    if (p.num_tokens > 65535 * kTileN || p.out > 65535 * kTileM) {
      return InvalidArgument("gemv: [{} x {}] x {} tokens exceed the tiled MMA kernel's grid", p.out, p.in, p.num_tokens);
    }
    const dim3 grid((p.num_tokens + kTileN - 1) / kTileN, (p.out + kTileM - 1) / kTileM);
    const dim3 block(kTileThreads);
    switch (ks) {
      case 1: LaunchDependentSmem(MmaTiledKernel<1>, grid, block, kTileSmem, s, p, chunks); break;
      case 2: LaunchDependentSmem(MmaTiledKernel<2>, grid, block, kTileSmem, s, p, chunks); break;
      case 4: LaunchDependentSmem(MmaTiledKernel<4>, grid, block, kTileSmem, s, p, chunks); break;
      default: LaunchDependentSmem(MmaTiledKernel<8>, grid, block, kTileSmem, s, p, chunks); break;
    }
    DL_KERNEL_LAUNCH_CHECK("gemv_mma_tiled");
    return Status::Ok();
  }
  if ((p.out + 15) / 16 > 65535) return InvalidArgument("gemv: {} rows exceed the MMA register kernel's grid", p.out);
  if (p.num_tokens <= 8) {
    LaunchMmaReg<1>(p, ks, chunks, s);
  } else if (p.num_tokens <= 16) {
    LaunchMmaReg<2>(p, ks, chunks, s);
  } else {
    LaunchMmaReg<4>(p, ks, chunks, s);
  }
  DL_KERNEL_LAUNCH_CHECK("gemv_mma");
  return Status::Ok();
}

}  // namespace dev
}  // namespace dl::kernels
