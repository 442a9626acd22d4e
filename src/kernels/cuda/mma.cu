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
// FP8 weights (ops.h 5d): W's codes have a ring of their own, a stage's 64 codes of each of the 128
// rows ([128 rows][4 pieces of 16 codes]); the block converts a landed stage to BF16 into the W area
// of the BF16 layout above, so the fragments and MMAs are the BF16 kernel's.
constexpr size_t kTileCodeStageBytes = static_cast<size_t>(kTileM) * 64;
constexpr size_t kTileFp8Smem = kTileSmem + kTileStages * kTileCodeStageBytes;

// Where an FP8 weight's scales are (ops.h 5d): row o's scale of block column b at
// scales[(o / block_rows) * cols + b]; a block column spans chunks_per_block chunks of 32.
struct MmaFp8Scales {
  const float* scales = nullptr;
  int block_rows = 1, cols = 1, chunks_per_block = 1;
};

// Grid (ceil(T / 128), ceil(out / 128)): token blocks fastest, so the blocks reading the same rows
// of W run together and share them through L2. Warp w: rows 64 (w / 4) .. + 64 (4 tiles of 16),
// tokens 32 (w % 4) .. + 32 (4 tiles of 8) of the block.
// kFp8 (ops.h 5d; KS 1): W is a.w_fp8's codes, staged through their own ring and converted to BF16
// per stage; each block column's sum folds into the total with its scale.
template <int KS, bool kFp8>
__global__ void __launch_bounds__(kTileThreads, 1) MmaTiledKernel(GemvParams a, int chunks, MmaFp8Scales fs) {
  static_assert(!kFp8 || KS == 1, "FP8 weights have no k_split: their block columns are the slices");
  DL_TIMELINE_SCOPE(kGemv);
  AllowDependentsAtStart(a.release_after_wait);
  extern __shared__ __align__(128) unsigned char s_tile[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int wm = warp >> 2, wn = warp & 3;
  const int n0 = blockIdx.x * kTileN, m0 = blockIdx.y * kTileM;
  const int n8 = a.in / 8, n16 = a.in / 16;
  const int64_t x_step = a.x_stride / 8;
  const uint4* w = reinterpret_cast<const uint4*>(kFp8 ? static_cast<const void*>(a.w_fp8.codes) : a.w);
  const uint4* x = reinterpret_cast<const uint4*>(a.x);
  uint4* s_codes = reinterpret_cast<uint4*>(s_tile + kTileSmem);  // kFp8: [kTileStages][kTileM * 4]
  WaitReleasing(a.release_after_wait);
  // Stage st holds chunks kTileStageChunks st + cc, each [W rows][4 pieces] then [x rows][4 pieces].
  // Thread tid copies pieces tid and tid + 256 of each operand's chunk: row idx / 4, piece idx % 4.
  // FP8: W's pieces tid and tid + 256 of the stage's [128 rows][4 pieces of 16 codes] instead.
  const int steps = (chunks + kTileStageChunks - 1) / kTileStageChunks;
  auto load = [&](int stage, int st) {
    if constexpr (kFp8) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int idx = tid + kTileThreads * i, row = idx >> 2, piece = 4 * st + (idx & 3);
        const bool wv = piece < n16 && m0 + row < a.out;
        CpAsync16(s_codes + stage * kTileM * 4 + idx, w + (wv ? static_cast<size_t>(m0 + row) * n16 + piece : 0), wv);
      }
    }
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
        if constexpr (!kFp8) CpAsync16(sa + idx, w + (wv ? static_cast<size_t>(m0 + row) * n8 + piece : 0), wv);
        CpAsync16(sb + idx, x + (xv ? (n0 + row) * x_step + piece : 0), xv);
      }
    }
  };
  // FP8: this lane's rows' scales of block column b (rows past `out` take the last row's: never stored).
  auto row_scales = [&](int b, float (&sv)[4][2]) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = min(m0 + wm * 64 + mt * 16 + g + 8 * h, a.out - 1);
        sv[mt][h] = __ldg(fs.scales + static_cast<size_t>(row / fs.block_rows) * fs.cols + b);
      }
  };
#pragma unroll
  for (int s = 0; s < kTileStages - 1; ++s) {
    if (s < steps) load(s, s);
    CpAsyncCommit();
  }
  constexpr bool kTotal = KS > 1 || kFp8;
  float acc[4][4][4];
  float total[kTotal ? 4 : 1][kTotal ? 4 : 1][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
  const int per = kFp8 ? fs.chunks_per_block : chunks / KS;
  int slice_end = per;
  int slice = 0;  // the slice (FP8: the block column) whose chunks acc sums
  for (int st = 0; st < steps; ++st) {
    CpAsyncWait<kTileStages - 2>();  // stage st has landed (this thread's copies)
    __syncthreads();                 // everyone's copies, and everyone is done with stage (st - 1) % S
    {
      const int sn = st + kTileStages - 1;
      if (sn < steps) load(sn % kTileStages, sn);
      CpAsyncCommit();
    }
    if constexpr (kFp8) {  // the stage's codes -> its W area as BF16 (piece j of a row: chunk j / 2, half j % 2)
      const uint4* sc = s_codes + (st % kTileStages) * kTileM * 4;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int idx = tid + kTileThreads * i, row = idx >> 2, j = idx & 3;
        uint4* sa = reinterpret_cast<uint4*>(s_tile + (st % kTileStages) * kTileStageBytes + (j >> 1) * kTileChunkBytes);
        Fp8x16ToBf16(sc[idx], sa[row * 4 + 2 * (j & 1)], sa[row * 4 + 2 * (j & 1) + 1]);
      }
      __syncthreads();
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
      if constexpr (kTotal) {
        // The slice's sum joins the total: p0, then + p1, + p2, ... (KS > 1); FP8: block column b's
        // sum times its row's scale, total = p0 s0, then fmaf(p_b, s_b, total) (ops.h 5d).
        if (q + 1 == slice_end || (kFp8 && q + 1 == chunks)) {
          float sv[4][2] = {};
          if constexpr (kFp8) row_scales(slice, sv);
          const bool first = slice == 0;
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float p = acc[mt][nt][e];
                if constexpr (kFp8) {
                  total[mt][nt][e] = first ? p * sv[mt][e >> 1] : fmaf(p, sv[mt][e >> 1], total[mt][nt][e]);
                } else {
                  total[mt][nt][e] = first ? p : total[mt][nt][e] + p;
                }
                acc[mt][nt][e] = 0.0f;
              }
          ++slice;
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
        if constexpr (kTotal) {
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

// FP8 weights (ops.h 5d): the tiled kernel for every token count, its block columns as the slices.
Status MmaGemvFp8(const GemvParams& p, cudaStream_t s) {
  const Fp8Weight& w = p.w_fp8;
  if (!MmaFp8Supported(w, p.in)) {
    return InvalidArgument("gemv: the MMA product takes FP8 weights [{} x {}] with in % 16 == 0 and block columns "
                           "of a power of two >= 32 or >= in (got {} x {} blocks{})",
                           p.out, p.in, w.block_rows, w.block_cols, w.scales ? "" : ", no scales");
  }
  if (reinterpret_cast<uintptr_t>(w.codes) % 16 != 0 || reinterpret_cast<uintptr_t>(p.x) % 16 != 0) {
    return InvalidArgument("gemv: the MMA product needs 16-byte aligned codes and x");
  }
  if (p.num_tokens > 65535 * kTileN || p.out > 65535 * kTileM) {
    return InvalidArgument("gemv: [{} x {}] x {} tokens exceed the tiled MMA kernel's grid", p.out, p.in, p.num_tokens);
  }
  const int chunks = (p.in + kMmaChunk - 1) / kMmaChunk;
  MmaFp8Scales fs;
  fs.scales = w.scales;
  fs.block_rows = w.block_rows;
  fs.cols = (p.in + w.block_cols - 1) / w.block_cols;
  fs.chunks_per_block = w.block_cols >= p.in ? chunks : w.block_cols / kMmaChunk;
  const dim3 grid((p.num_tokens + kTileN - 1) / kTileN, (p.out + kTileM - 1) / kTileM);
  LaunchDependentSmem(MmaTiledKernel<1, true>, grid, dim3(kTileThreads), kTileFp8Smem, s, p, chunks, fs);
  DL_KERNEL_LAUNCH_CHECK("gemv_mma_tiled_fp8");
  return Status::Ok();
}

Status MmaGemv(const GemvParams& p, cudaStream_t s) {
  if (p.norm.residual) return InvalidArgument("gemv: the MMA product (mma) takes no fused input norm");
  if (p.streaming.on) return InvalidArgument("gemv: the MMA product (mma) has no streaming kernel: streaming.on must be off");
  if (!p.x) return InvalidArgument("gemv: w, x and y must be set");
  if (p.w_fp8.on()) return MmaGemvFp8(p, s);
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
      case 1: LaunchDependentSmem(MmaTiledKernel<1, false>, grid, block, kTileSmem, s, p, chunks, MmaFp8Scales{}); break;
      case 2: LaunchDependentSmem(MmaTiledKernel<2, false>, grid, block, kTileSmem, s, p, chunks, MmaFp8Scales{}); break;
      case 4: LaunchDependentSmem(MmaTiledKernel<4, false>, grid, block, kTileSmem, s, p, chunks, MmaFp8Scales{}); break;
      default: LaunchDependentSmem(MmaTiledKernel<8, false>, grid, block, kTileSmem, s, p, chunks, MmaFp8Scales{}); break;
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
