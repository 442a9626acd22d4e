// Launchers of the batch-1 decode kernels (CUDA backend). Every pointer is a DEVICE pointer unless a
// comment says otherwise; BF16 tensors are row-major, weights are [out, in] (PyTorch layout), and
// vector loads need 16-byte aligned rows (row widths multiple of 8 elements). Activations are BF16
// with FP32 accumulation; the rounding points follow the reference (laguna-architecture.md §3, §9)
// and are spelled out at each function and in the CPU references (kernels/reference/reference.h).
// Every reduction has a fixed order: results are bit-identical run to run (no value atomics).
// In a build without CUDA every launcher returns Unavailable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "kernels/attention/attention.h"
#include "kernels/common.h"

namespace dl::kernels {

// ---- 1. Residual add + RMSNorm -------------------------------------------------------------------
// For each of `rows` rows of width n:
//   h   = bf16(residual + delta)          (skipped when delta == nullptr)
//   x̂   = bf16(h_f32 * 1/sqrt(mean(h_f32²) + eps))
//   out = bf16(x̂ * weight)                (BF16 x BF16, the reference's order, §3.3 / §9.5)
// residual is updated in place with h. n % 8 == 0, n <= 8192. out may equal residual.
struct AddRmsNormParams {
  bf16* residual = nullptr;     // [rows, n] in/out (row stride row_stride)
  const bf16* delta = nullptr;  // [rows, n] or nullptr (plain RMSNorm of residual)
  const bf16* weight = nullptr; // [n]
  bf16* out = nullptr;          // [rows, n]
  int rows = 1;
  int n = 0;
  float eps = 1e-6f;
  bool prefetch_residual = true;  // as FusedInputNorm::prefetch_residual
  bool release_after_wait = false;  // PDL release point (Tuning::late_release)
  // Elements between consecutive rows of residual, delta and out (0 = n): one slice of wider rows
  // (the DFlash drafter's per-tap norms over [rows, taps * n]). A multiple of 8.
  int64_t row_stride = 0;
};
Status AddRmsNorm(const AddRmsNormParams& p, Stream stream);

// An add + RMSNorm folded into the kernel that consumes its output (the GEMV, the MoE router): every
// block recomputes the normalised rows it needs into shared memory (the same bits as AddRmsNorm), so
// the step has one kernel boundary fewer. One block writes the updated residual to residual_out,
// which must be a different buffer from residual (other blocks are still reading that), and, where
// later kernels need the normalised rows, u_out. n = the consumer's input width, at most 8192.
struct FusedInputNorm {
  const bf16* residual = nullptr;  // [T, n]; nullptr = nothing fused (the consumer reads its x)
  const bf16* delta = nullptr;     // [T, n] or nullptr (plain RMSNorm)
  const bf16* weight = nullptr;    // [n]
  bf16* residual_out = nullptr;    // [T, n] bf16(residual + delta), or nullptr (not written)
  bf16* u_out = nullptr;           // [T, n] normalised rows, or nullptr (not written)
  float eps = 1e-6f;
  // Warm L2 with the residual rows before the PDL wait (PrefetchBytesL2): written one or two
  // phases earlier, they have usually left L2 by the time the norm reads them.
  bool prefetch_residual = true;
};

// ---- 2. QK-norm + partial/YaRN RoPE + KV quantise/append ------------------------------------------
// For every token t (position pos_t) and head:
//   q, k heads: y = RMSNorm(x; w_qn / w_kn, eps) (rounding as above), then RoPE on dims [0, R):
//     pairs (j, j+R/2), φ = pos_t * inv_freq[j] (FP32), c = bf16(cos φ * m), s = bf16(sin φ * m),
//     y_j' = bf16(bf16(y_j c) + bf16(-y_{j+R/2} s)),  y_{j+R/2}' = bf16(bf16(y_{j+R/2} c) + bf16(y_j s));
//     dims [R, D) pass through.
//   q goes to q_out; k and the raw v go to the paged cache at pos_t:
//     page = block_table[pos_t / P], slot = pos_t % P, element ((page*P + slot)*K + head)*D + d,
//     FP8: code = round_fp8_e4m3_satfinite(x / scale) (IEEE division), BF16: stored as is.
// q_out may alias q (each head is staged in shared memory before it is written). num_q_heads may be 0:
// k and v only (q, q_norm_weight and q_out unused; the DFlash drafter's context keys).
struct QkNormRopeAppendParams {
  const bf16* q = nullptr;  // [T, H, D] with row stride qkv_stride (elements per token)
  const bf16* k = nullptr;  // [T, K, D] same stride
  const bf16* v = nullptr;  // [T, K, D] same stride
  int64_t qkv_stride = 0;   // elements between consecutive tokens (H*D for separate buffers,
                            // (H+2K)*D for a fused qkv projection output)
  const bf16* q_norm_weight = nullptr;  // [D]
  const bf16* k_norm_weight = nullptr;  // [D]
  const float* inv_freq = nullptr;      // [R/2] FP32 (model/config.h ComputeRopeTable)
  float attention_factor = 1.0f;        // m: multiplies cos and sin
  int rotary_dim = 0;                   // R (even, <= D)
  float eps = 1e-6f;
  const int32_t* positions = nullptr;   // [T] absolute positions, or nullptr: first_position + t
  int32_t first_position = 0;
  int num_tokens = 1;   // T
  int num_q_heads = 0;  // H
  int num_kv_heads = 0; // K
  int head_dim = 0;     // D: multiple of 8, <= 256
  bf16* q_out = nullptr;  // [T, H, D]
  // Paged KV cache of this layer: [num_pages, P, K, D] each.
  void* k_pool = nullptr;
  void* v_pool = nullptr;
  KvDtype kv_dtype = KvDtype::kBf16;
  float k_scale = 1.0f, v_scale = 1.0f;  // FP8 only
  const int32_t* block_table = nullptr;  // [max_pages] page ids of this sequence
  // Rows of several sequences: row t's table is block_table + token_seq[t] * block_table_stride
  // (nullptr: every row uses block_table).
  const int32_t* token_seq = nullptr;
  int32_t block_table_stride = 0;
  int page_size = 16;                    // P
  // > 0: warm L2 before the PDL wait with what the kernel reads after it that no earlier kernel of
  // the step writes: positions, norm weights, inv_freq and the first block_table_entries entries
  // (PrefetchBytesL2; these are DRAM misses otherwise). Loads into registers there were slower
  // (session 4: queued behind the q/k/v/g weight stream); a prefetch does not hold the thread.
  int block_table_entries = 0;
  bool prefetch_constants = true;
  bool release_after_wait = false;  // PDL release point (Tuning::late_release)
};
Status QkNormRopeAppend(const QkNormRopeAppendParams& p, Stream stream);

// ---- FP8 weights (the FP8 weight contract, issue 18) ------------------------------------------------
// An FP8 weight matrix [rows, cols]: E4M3 ("fn") codes, row-major, one byte each (rows 16-byte
// aligned: cols % 16 == 0), and FP32 scales, one per block of block_rows x block_cols codes,
// row-major over the blocks ([ceil(rows / block_rows), ceil(cols / block_cols)]):
//   W[o, i] = float(code[o, i]) * scale[o / block_rows, i / block_cols]   (one FP32 multiply).
// Blocks: 128 x 128 (both Laguna formats), one block (per tensor: rows x cols) or (1, cols) (per
// channel). block_cols must be a power of two that is a multiple of 16, or >= cols (one block
// column), so a 16-byte chunk of codes never straddles two scale columns.
//
// THE FP8 RULE, shared by every FP8 path at every T (batch-1 plain, fused norm, batched
// T > 1, the MoE's batch-1 and grouped kernels), so batch 1 == batched == grouped bit for bit: a
// lane's 16-byte chunk c of a row holds the 16 codes of elements 16c .. 16c + 15; with
// s = scale[row / block_rows, 16c / block_cols] and v_e = float(code_e) (the code's value, exact), per
// token:
//   p = 0;  for e = 0 .. 15 in order: p = fmaf(v_e, x[16c + e], p)
//   acc = fmaf(p, s, acc)
// The scale multiplies the chunk's sum once instead of each code (no FP32 multiply per element), and a
// chunk's 16 FMAs start from zero, so the chunks a lane holds are independent chains that meet acc in
// one FMA each. Each FMA rounds once (a product is never rounded on its own; FP32 denormals are kept:
// no FTZ), so the result differs from the reference's "dequantise, then the FP32 dot" only in where
// FP32 rounds (fl(code * s) and its running sum there, the chunk sums and acc here): the two are
// compared with a tolerance.
// The chunks a lane takes, the k_split slices (GemvFp8KSplitFor: GemvKSplitFor's rule counted in
// 16-element chunks), the xor-butterfly warp sum, the slice order and the BF16 rounding points are
// the BF16 rule's (GemvParams below): only the chunk holds 16 elements instead of 8, and acc is a
// lane's sum over its chunks in ascending order. The CPU reference dequantises W in FP32 (W[o, i] above)
// and runs its usual linear (kernels/reference); ref::GemvFp8Rule computes this rule on the host, to
// pin the kernels' bits.
struct Fp8Weight {
  const uint8_t* codes = nullptr;  // [rows, cols] E4M3 codes
  const float* scales = nullptr;   // [ceil(rows / block_rows), ceil(cols / block_cols)] FP32
  int block_rows = 0, block_cols = 0;
  DL_HOST_DEVICE bool on() const { return codes != nullptr; }
};
// k_split of an FP8 weight [out, in]: GemvKSplitFor over in / 16 chunks of 16 bytes.
int GemvFp8KSplitFor(int out, int in);

// ---- 5. GEMV / small-T GEMM ------------------------------------------------------------------------
// y[t, o] = bf16( sum_i W[o, i] * x[t, i] ), FP32 accumulation in a FIXED order per output element that
// does not depend on T: GEMM over T tokens is bit-identical to T separate GEMVs (batch invariance, so
// prefill chunking cannot change results). The order: the input is split into k_split contiguous
// slices; lane l of a slice's warp takes its 16-byte chunks l, l+32, l+64, ... in ascending order and
// FMAs their 8 elements in order; the 32 lane sums are added by an xor butterfly (WarpSum); slices
// are added in ascending order. Batch 1 streams W (GemvParams::streaming); T > 1 tokens run the
// batched kernel (each warp holds batch_rows rows' chunks in registers for batch_tokens tokens, so W
// is read once per token tile) unless a norm is fused, which takes the tiled plain kernel.
struct GemvParams {
  const bf16* w = nullptr;  // [out, in] BF16, or nullptr when w_fp8 is set
  const bf16* x = nullptr;  // [T, in] (row stride x_stride)
  bf16* y = nullptr;        // [T, out] (row stride y_stride)
  int out = 0, in = 0;      // in % 8 == 0
  int num_tokens = 1;
  int64_t x_stride = 0, y_stride = 0;  // 0 = dense (in / out)
  // Warps per output row (1, 2, 4 or 8; 0 = GemvKSplitFor(out, in)). A function of the shape only,
  // never of num_tokens, so a token's result does not depend on the batch it was computed in.
  int k_split = 0;
  // Set: x is computed from it (x itself is not read); token t's rows come from row t of residual.
  FusedInputNorm norm;
  // on: the streaming kernel (GemvStreamSupported): batch 1, one block per SM owns consecutive rows
  // (one contiguous stretch of W) and a producer warp copies them through a ring of shared-memory
  // stages with TMA bulk copies, the first prefetch_kb before the PDL wait, so HBM stays busy
  // across block boundaries and the predecessor's tail. Same bits as the plain kernel. Takes a
  // fused input norm (its consumers compute x from the residual row, once per block).
  struct Streaming {
    bool on = false;
    int ring_kb = 128;     // shared memory for the ring
    int stage_kb = 32;     // bytes per bulk copy (rounded to whole rows per warp group)
    int prefetch_kb = 96;  // issued before the PDL wait (at most the ring): more slows the
                           // latency-bound predecessor, whose loads queue behind these (96 against
                           // 64 KB: 2.564 / 2.553 against 2.572 / 2.567 ms, session 7; 128: slower)
  } streaming;
  // T > 1 without a fused norm: rows per warp (1, 2, 4) and tokens per tile (4, 8, 16) of the batched
  // kernel (Tuning::batch_gemv_rows / batch_gemv_tokens). Same bits for every choice.
  int batch_rows = 2;
  int batch_tokens = 8;
  bool release_after_wait = false;  // PDL release point (Tuning::late_release)
  // Set (codes != nullptr, w == nullptr): the weight is FP8 (the FP8 rule above; in % 16 == 0). Every
  // path and option above applies unchanged (k_split 0 = GemvFp8KSplitFor) except streaming: FP8
  // weights have no streaming kernel (it lost to the plain kernel at batch 1, docs/performance.md
  // session 17), so streaming.on must be off.
  Fp8Weight w_fp8;
  // on: the tensor-core product (section 5b below) instead of the CUDA-core kernels above; k_split
  // then means the MMA product's split (0 = MmaKSplitFor). Other bits than off (another summation
  // order), the same bits for every num_tokens. No fused norm, no streaming.
  bool mma = false;
  // The MMA product's tiled kernel runs from this many tokens on, the register kernel below it (the
  // same bits either way: the choice only moves bytes). Tuning::mma_tiled_min_tokens.
  int mma_tiled_min_tokens = 64;
  // on: the library GEMM (section 5c below) instead of every kernel above; mma and k_split are then
  // ignored. Other bits than both other products, the same bits for every num_tokens.
  bool library_gemm = false;
};
// Splits the input dimension over several warps when there are too few rows to keep every SM's
// loads in flight (o_proj: 2,048 rows x 8,192); each warp sums its slice, the slices are added in order.
int GemvKSplitFor(int out, int in);
// Whether GemvParams::streaming applies to this shape with this ring (two stages of whole row groups fit).
bool GemvStreamSupported(int out, int in, int ring_kb = 128, int stage_kb = 32);
Status Gemv(const GemvParams& p, Stream stream);

// ---- 5b. The tensor-core product (GemvParams::mma) -------------------------------------------------
// y[t, o] = bf16( sum_i W[o, i] x[t, i] ) on mma.sync.m16n8k16 (BF16 operands, FP32 accumulation):
// W is the MMA's A (16 output rows per tile, tiles at multiples of 16), tokens are its N (8 columns
// per MMA; an MMA computes each output element from its own row, column and accumulator only, so
// tokens never mix). The order per output element is a function of (out, in) only, never of T:
//   - the input is cut into chunks of 32 elements (the last one padded with zeros) and the chunks
//     into k_split = MmaKSplitFor(out, in) equal slices;
//   - per slice, from a zero accumulator, chunk q ascending, two MMAs per chunk (h = 0, then 1):
//     MMA (q, h) takes elements 32q + 8c + 4h + {0, 1, 2, 3} as its logical k {2c, 2c+1, 2c+8,
//     2c+9}, c = 0..3: a fixed permutation of k (the same for W and x) that lets every lane take
//     its operands of both MMAs with one 16-byte load per row;
//   - the slices' FP32 sums are added in ascending order (p0 + p1 + ...), then one BF16 rounding.
// Two kernels compute exactly this: the register kernel (W fragments straight from global memory
// into registers, 8, 16 or 32 tokens per pass: decode and small batches) and the tiled kernel
// (128 x 128 output tiles, W and x staged through shared memory with cp.async: prefill), chosen by
// GemvParams::mma_tiled_min_tokens. Bits differ from the CUDA-core kernels (another order), so a
// backend uses one product for every row count (Tuning::mma_products).
// Splits the input when there are too few 16-row tiles to keep the loads in flight (o_proj, the
// dense down projection): until ~1,024 warps, each slice at least 8 chunks, k_split | chunks.
int MmaKSplitFor(int out, int in);

// ---- 5d. FP8 weights on the tensor-core product (GemvParams::mma with w_fp8: prompt rows) -----------
// y[t, o] = bf16( sum_b s[o / block_rows, b] * p_b[t, o] ), b = 0, 1, ... the weight's block columns
// in ascending order, where p_b is 5b's product over block b's chunks alone (from a zero accumulator,
// chunk q ascending, two MMAs per chunk, the same K permutation) with W's codes as BF16 operands:
// float(code) is exact in BF16, so the MMA sees W's code values and x's BF16 values unrounded. The
// block sums meet the total in one FP32 step each: total = p_0 * s_0, then total = fmaf(p_b, s_b,
// total). No k_split (the block columns are the slices) and one kernel for every token count (the
// tiled kernel, whose 128-token tiles at small T cost tensor-core work, not weight bytes), so a
// token's outputs do not depend on T, its place in the batch or how the prompt was chunked. The
// CPU reference dequantises W in FP32; the two differ in where FP32 rounds (compared with a
// tolerance). Needs in % 16 == 0 and block_cols a power of two >= 32 (the FP8 contract's, less 16: a
// chunk of 32 must not straddle two scales) or >= in (MmaFp8Supported).
bool MmaFp8Supported(const Fp8Weight& w, int in);
bool MmaFp8Supported(int block_rows, int block_cols, int in);  // the block shape alone
struct MoeParams;
// Whether every FP8 expert group of `p` has a block shape the MMA experts take (MmaFp8Supported over
// each matrix's input width); true when no group is FP8.
bool MoeFp8MmaSupported(const MoeParams& p);

// ---- 5c. The library GEMM (GemvParams::library_gemm) -----------------------------------------------
// y[t, o] = bf16( sum_i W[o, i] x[t, i] ) by cuBLASLt (BF16 operands, FP32 accumulation and scale,
// beta 0) with ONE algorithm per (out, in) and device: the library's heuristic choice for
// kLibraryGemmPlanTokens tokens among the algorithms without split-K that need no workspace and
// accept 16-byte aligned operands, fixed on first use for the process. Every token count runs that
// algorithm, whose tiles compute each output element from its own row of W and its own token in one
// thread block's K loop, so a token's outputs do not depend on T, on its place in the batch or on the
// chunking (the GPU tests check it bit for bit at the model's shapes). The bits are the algorithm's:
// they may differ between cuBLASLt versions and GPUs, never between runs of one binary on one
// library and GPU (DescribeLibraryGemm names the algorithm). No fused norm, no streaming, BF16 only.
// This is the prefill path's dense product: W is read once per tile of tokens at the library's
// tensor-core rate (wgmma on sm_90).
inline constexpr int kLibraryGemmPlanTokens = 2048;
// Whether the library GEMM takes p's operands: BF16 weights, out and the row strides multiples of 8,
// w, x and y 16-byte aligned. A layer that does not fit keeps the tensor-core product.
bool LibraryGemmFits(const GemvParams& p);
// Ok when cuBLASLt loads (the library GEMM can run), else Unavailable naming the libraries tried.
Status LibraryGemmAvailable();
// "cuBLASLt 13.0.0 algo 66 tile 128x256 stages ... (out x in)": the algorithm the library GEMM runs
// for this shape on the current device (choosing it if it has not been chosen yet).
Result<std::string> DescribeLibraryGemm(int out, int in);
// Every algorithm the library GEMM has fixed so far in this process on the current device, as
// DescribeLibraryGemm writes them, ordered by shape: what a result's prompt-row bits came from.
std::vector<std::string> LibraryGemmAlgorithmsInUse();

// ---- 6. MoE for T tokens (each token on its own) ----------------------------------------------------
// Router (one kernel): z = bf16(W_r x) -> FP32; if softcap > 0: z = c tanh(z / c); s = sigmoid(z);
// select the top-k of (s + bias) (ties: lowest expert id; descending order); w_e = bf16(s_e / sum_sel s)
// (sum in selection order). Experts: h_j = bf16(bf16(silu(bf16(G_j x))) * bf16(U_j x));
// o_j = bf16(D_j h_j); y = bf16( bf16(alpha * bf16(sum_j bf16(o_j * w_j))) + bf16(D_s h_s) )
// (5.17.0 grouped_mm order: per-slot BF16 products, FP32 sum over slots, one rounding). No host
// round trip: expert ids stay on the device and index the pointer arrays. Batch 1: router, gate/up
// and down+combine (three launches, the weights streamed per token). T > 1: router, a grouping
// kernel that lists each selected expert's (token, slot) pairs, gate/up and down over those lists
// (each selected expert's rows are read once for all its tokens) and the combine: five launches.
// Every dot product keeps the GEMV's per-lane order (GemvParams), so token t's arithmetic is the
// same for every T and every grouping: prefill = decode = batched decode, bit for bit.
// Expert weights: arrays (in DEVICE memory) of E device pointers, one per expert tensor, matching the
// loader's per-expert tensors: gate/up [F, d], down [d, F].
struct MoeParams {
  const bf16* x = nullptr;             // [T, d] normalised input u2
  const bf16* router_w = nullptr;      // [E, d]
  const bf16* router_bias = nullptr;   // [E] e_score_correction_bias (BF16, selection only)
  const bf16* const* gate_w = nullptr; // [E] -> [F, d]
  const bf16* const* up_w = nullptr;   // [E] -> [F, d]
  const bf16* const* down_w = nullptr; // [E] -> [d, F]
  const bf16* shared_gate_w = nullptr; // [Fs, d]
  const bf16* shared_up_w = nullptr;   // [Fs, d]
  const bf16* shared_down_w = nullptr; // [d, Fs]
  int d = 0, num_experts = 0, top_k = 0, ffn = 0, shared_ffn = 0;  // d, F: multiples of 8; E <= 1024
  int num_tokens = 1;    // T (the CPU reference takes one token)
  float alpha = 1.0f;    // moe_routed_scaling_factor
  float softcap = 0.0f;  // moe_router_logit_softcapping (0 = off)
  bf16* y = nullptr;     // [T, d] output (routed*alpha + shared), NOT added to the residual
  // Outputs of the router, kept for inspection: selected ids (descending biased score) and weights
  // (the BF16-rounded values, as float).
  int32_t* topk_ids = nullptr;      // [T, top_k]
  float* topk_weights = nullptr;    // [T, top_k]
  void* workspace = nullptr;        // MoeWorkspaceBytes(..., T); contents need no initialisation
  uint32_t* counter = nullptr;      // [T] words, zero before first use; kernels leave them zero
  // Set: the router computes u2 from it and writes it to norm.u_out, which must be x, for the expert
  // kernels.
  FusedInputNorm norm;
  // Batch 1: gate/up streams its weights through a ring of this many KB of shared memory (TMA bulk
  // copies, like GemvParams::streaming), in units of 4 rows of one slot's gate and up
  // matrices (the shared expert's first, before the PDL wait); 0 or an unfit shape: the register
  // kernel. Same bits either way.
  int gate_up_stream_ring_kb = 128;
  // The router from this many tokens on (0 = never) takes 8 token rows per block: each router row is
  // loaded once per block for its 8 rows and the block normalises its rows together (prefill); below
  // it, one token per block (decode). Same bits either way (Tuning::moe_router_rows_min_tokens).
  int router_rows_min_tokens = 128;
  // PDL release points (Tuning::late_release) of the router and the down kernel.
  bool router_release_after_wait = false, down_release_after_wait = false;
  // FP8 experts (the FP8 rule above), per group: routed (gate/up/down of every expert) and shared
  // (its gate/up/down) are each all BF16 or all FP8, independently (the S 2.1 export: routed FP8,
  // shared BF16). Set: the BF16 pointers of that group are nullptr. The router stays BF16. When any
  // group is FP8 the expert kernels are the FP8-capable ones (register kernels at batch 1, the grouped
  // path at T > 1); their BF16 rows keep the BF16 rule, so a BF16 group gives the BF16 kernels' bits.
  struct Fp8Experts {
    const uint8_t* const* codes = nullptr;  // [E] (DEVICE array) -> [rows, cols] codes
    const float* const* scales = nullptr;   // [E] (DEVICE array) -> that expert's scales
    int block_rows = 0, block_cols = 0;      // the same for every expert
    DL_HOST_DEVICE bool on() const { return codes != nullptr; }
  };
  Fp8Experts gate_fp8, up_fp8, down_fp8;  // gate/up [F, d], down [d, F]
  Fp8Weight shared_gate_fp8, shared_up_fp8, shared_down_fp8;  // [Fs, d], [Fs, d], [d, Fs]
  // on: the expert products on the tensor-core product's arithmetic (ops.h 5b; splits
  // MmaKSplitFor(F, d) for gate/up and MmaKSplitFor(d, F) for down, halved until it divides Fs's
  // chunks). T > 1: router, lists, gate/up (SiLU * up fused), down, combine, the expert products as
  // a grouped GEMM over the lists (per block one expert or shared-expert segment, 64 gate + 64 up
  // rows or 128 down rows, and 64 of its (token, slot) pairs per pass, weights and the pairs'
  // vectors staged through a cp.async ring of shared memory). Batch 1 skips the lists: router,
  // gate/up of the selected slots, down + combine in one kernel (three launches). Other bits than
  // off; the same bits for every T and grouping, batch 1 included (mma_batch1_lists: batch 1 through
  // the lists and the GEMM anyway, for the tests). FP8 groups (prompt rows, Tuning::prompt_fp8_mma)
  // take section 5d's rule in the grouped GEMM: each block column's sum (from zero, 5b's order, codes
  // exact in BF16) times its row's scale, total = p0 s0, then fmaf(p_b, s_b, total), no split; they
  // go through the lists at every T, batch 1 included, and need MmaFp8Supported block shapes. A BF16
  // group beside them keeps its bits.
  bool mma = false;
  bool mma_batch1_lists = false;
  // Set: the router logits z (BF16, before the softcap) of the T tokens come from here instead of
  // the router's own dot products (prompt rows: the library GEMM of router_w with x, Tuning::
  // prompt_gemm), and the router only selects (softcap, sigmoid, bias, top-k and weights as above,
  // the same kernel code). No fused input norm then (x is u2 already). [T, E], row stride E.
  const bf16* router_logits = nullptr;
};
// Workspace for up to num_tokens tokens (the per-token router state and the grouped path's expert
// lists and per-slot outputs).
size_t MoeWorkspaceBytes(int d, int num_experts, int top_k, int ffn, int shared_ffn, int num_tokens = 1);
Status Moe(const MoeParams& p, Stream stream);
// The router stage of Moe alone (its checks, its launch), for tests and benchmarks: per token the
// router logits, selection, weights and expert pointers in the workspace, topk_ids / topk_weights
// where set, and with a fused input norm u2 in x and the updated residual; y is not written.
Status MoeRouter(const MoeParams& p, Stream stream);

// ---- 7. Argmax -------------------------------------------------------------------------------------
// out[0] = argmax_i logits[i] (ties -> lowest index, NaN counts as the maximum, like torch.argmax).
struct ArgmaxParams {
  const bf16* logits = nullptr;  // [n]
  int n = 0;
  int32_t* out = nullptr;        // [1]
  void* workspace = nullptr;     // ArgmaxWorkspaceBytes(n)
  uint32_t* counter = nullptr;   // one word, zero before first use; the kernel leaves it zero
  int32_t* nonfinite = nullptr;  // [1] optional: set to 1 when a logit is NaN or +-Inf, else 0
};
size_t ArgmaxWorkspaceBytes(int n);
Status Argmax(const ArgmaxParams& p, Stream stream);

// ---- Launch mode ----------------------------------------------------------------------------------
// Whether the decode kernels are launched with programmatic dependent launch (sm_90+). A launch
// attribute every launcher shares, so it is process-wide: the CUDA backend sets it from its
// Tuning::dependent_launch when it is built (one engine per process). On by default.
void SetDependentLaunch(bool on);
bool DependentLaunchEnabled();

// ---- Test and benchmark helper -----------------------------------------------------------------------
// dst[i] = bf16(scale * NormalAt(key, i)) (base/rng.h, counter-based): the function the CPU computes,
// up to the last bits of the device's logf/cosf, so benchmarks can make big tensors on the device.
Status FillRandomBf16(bf16* dst, size_t n, uint64_t key, float scale, Stream stream);

}  // namespace dl::kernels
