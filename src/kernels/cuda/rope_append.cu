// QK-norm + partial (YaRN) RoPE + KV quantise/append, for T tokens in one launch. One warp per
// (token, head) over the H query, K key and K value heads; a head is staged in shared memory as float
// so the RoPE pair partner (j +- R/2, another lane) can be read after a __syncwarp. The data is tiny
// (a few KB per token): this kernel is about launch count and exact rounding, not bandwidth.
#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kRopeWarps = 4;
constexpr int kRopeMaxDim = 256;

__global__ void __launch_bounds__(kRopeWarps * 32) QkNormRopeAppendKernel(QkNormRopeAppendParams a) {
  DL_TIMELINE_SCOPE(kRopeAppend);
  AllowDependentsAtStart(a.release_after_wait);
  // Everything after the wait, including the constant loads and cos/sin: loading them before it was
  // measured slower (rope 4.8 -> 9.2 us exposed per layer), because then they queue behind the
  // q/k/v/g GEMV's weight stream (docs/performance.md, session 4). Only warming L2 with them happens
  // before it (QkNormRopeAppendParams::prefetch_constants): a prefetch does not hold the thread.
  if (a.prefetch_constants && blockIdx.y == 0) {
    const int lanes = kRopeWarps * 32;
    if (a.positions) PrefetchBytesL2(a.positions, sizeof(int32_t) * a.num_tokens, threadIdx.x, lanes);
    if (a.num_q_heads > 0) PrefetchBytesL2(a.q_norm_weight, sizeof(bf16) * a.head_dim, threadIdx.x, lanes);
    PrefetchBytesL2(a.k_norm_weight, sizeof(bf16) * a.head_dim, threadIdx.x, lanes);
    if (a.inv_freq) PrefetchBytesL2(a.inv_freq, sizeof(float) * (a.rotary_dim / 2), threadIdx.x, lanes);
    PrefetchBytesL2(a.block_table, sizeof(int32_t) * a.block_table_entries, threadIdx.x, lanes);
  }
  WaitReleasing(a.release_after_wait);
  __shared__ float s_x[kRopeWarps][kRopeMaxDim];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int head = blockIdx.x * kRopeWarps + warp;
  const int t = blockIdx.y;
  const int H = a.num_q_heads, K = a.num_kv_heads, D = a.head_dim;
  if (head >= H + 2 * K) return;  // warp-uniform; no block-wide barrier below
  const int pos = a.positions ? a.positions[t] : a.first_position + t;
  const int kind = head < H ? 0 : (head < H + K ? 1 : 2);  // q, k, v
  const size_t tok = static_cast<size_t>(t) * a.qkv_stride;
  const bf16* src = kind == 0   ? a.q + tok + static_cast<size_t>(head) * D
                    : kind == 1 ? a.k + tok + static_cast<size_t>(head - H) * D
                                : a.v + tok + static_cast<size_t>(head - H - K) * D;
  float* x = s_x[warp];
  float ss = 0.0f;
  for (int e = lane; e < D; e += 32) {
    const float v = Bf16BitsToFloat(src[e]);
    x[e] = v;
    ss = fmaf(v, v, ss);
  }
  if (kind != 2) {
    ss = WarpSum(ss);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(D) + a.eps);
    const bf16* w = kind == 0 ? a.q_norm_weight : a.k_norm_weight;
    for (int e = lane; e < D; e += 32) x[e] = RoundBf16(RoundBf16(x[e] * inv) * Bf16BitsToFloat(w[e]));
    __syncwarp();
  }
  const int R = a.rotary_dim, half = a.rotary_dim / 2;
  for (int e = lane; e < D; e += 32) {
    float y = x[e];
    if (kind != 2 && e < R) {
      const int j = e < half ? e : e - half;
      const float ang = static_cast<float>(pos) * a.inv_freq[j];
      const float c = RoundBf16(cosf(ang) * a.attention_factor);
      const float s = RoundBf16(sinf(ang) * a.attention_factor);
      y = e < half ? RoundBf16(RoundBf16(y * c) - RoundBf16(x[e + half] * s))
                   : RoundBf16(RoundBf16(y * c) + RoundBf16(x[e - half] * s));
    }
    if (kind == 0) {
      a.q_out[(static_cast<size_t>(t) * H + head) * D + e] = FloatToBf16Bits(y);
    } else {
      const int kvh = kind == 1 ? head - H : head - H - K;
      const int32_t* table = RowBlockTable(a.block_table, a.token_seq, a.block_table_stride, t);
      const int page = table[pos / a.page_size];
      const size_t idx =
          ((static_cast<size_t>(page) * a.page_size + pos % a.page_size) * K + kvh) * D + e;
      void* pool = kind == 1 ? a.k_pool : a.v_pool;
      if (a.kv_dtype == KvDtype::kFp8) {
        const float scale = kind == 1 ? a.k_scale : a.v_scale;
        static_cast<uint8_t*>(pool)[idx] = FloatToFp8(y / scale);
      } else {
        static_cast<uint16_t*>(pool)[idx] = FloatToBf16Bits(y);
      }
    }
  }
}

}  // namespace dev

Status QkNormRopeAppend(const QkNormRopeAppendParams& p, Stream stream) {
  const bool with_q = p.num_q_heads > 0;
  if ((with_q && (!p.q || !p.q_out || !p.q_norm_weight)) || !p.k || !p.v || !p.k_pool || !p.v_pool ||
      !p.block_table || !p.k_norm_weight) {
    return InvalidArgument("qknorm_rope_append: k, v, pools, block_table, k_norm_weight and (with query heads) q, "
                           "q_out and q_norm_weight must be set");
  }
  if (p.head_dim < 1 || p.head_dim > dev::kRopeMaxDim) {
    return InvalidArgument("qknorm_rope_append: head_dim {} not in [1, {}]", p.head_dim,
                           dev::kRopeMaxDim);
  }
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim) {
    return InvalidArgument("qknorm_rope_append: rotary_dim {} must be even and <= head_dim {}",
                           p.rotary_dim, p.head_dim);
  }
  if (p.rotary_dim > 0 && !p.inv_freq) {
    return InvalidArgument("qknorm_rope_append: inv_freq must be set");
  }
  if (p.num_tokens < 1 || p.num_q_heads < 0 || p.num_kv_heads < 1 || p.page_size < 1) {
    return InvalidArgument("qknorm_rope_append: empty shape (T {}, H {}, K {}, P {})", p.num_tokens,
                           p.num_q_heads, p.num_kv_heads, p.page_size);
  }
  if (p.qkv_stride < static_cast<int64_t>(p.head_dim)) {
    return InvalidArgument("qknorm_rope_append: qkv_stride {} too small", p.qkv_stride);
  }
  if (p.token_seq && p.block_table_stride < 1) {
    return InvalidArgument("qknorm_rope_append: token_seq needs block_table_stride");
  }
  if (p.kv_dtype == KvDtype::kFp8 && !(p.k_scale > 0.0f && p.v_scale > 0.0f)) {
    return InvalidArgument("qknorm_rope_append: FP8 cache needs positive k_scale and v_scale");
  }
  const int heads = p.num_q_heads + 2 * p.num_kv_heads;
  dim3 grid((heads + dev::kRopeWarps - 1) / dev::kRopeWarps, p.num_tokens);
  dev::LaunchDependent(dev::QkNormRopeAppendKernel, grid, dim3(dev::kRopeWarps * 32),
                       reinterpret_cast<cudaStream_t>(stream), p);
  DL_KERNEL_LAUNCH_CHECK("qknorm_rope_append");
  return Status::Ok();
}

}  // namespace dl::kernels
