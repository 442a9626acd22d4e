// The generic slow attention kernel, used only with --allow-fallback.
#include <cmath>

#include "kernels/attention/attention_kernel.cuh"

namespace dl::kernels {
namespace dev {

// The generic path: any D <= 256, G, P, dtype and window at run time. One block per (query head,
// token), one key at a time with an online softmax. Slow by design; it exists so that a missing
// preset can still run under --allow-fallback, and it always reports itself as a fallback.
__global__ void __launch_bounds__(128) AttentionFallbackKernel(const AttentionParams a) {
  const int h = blockIdx.x, t = blockIdx.y;
  const int D = a.head_dim, H = a.num_q_heads, K = a.num_kv_heads, P = a.page_size;
  const int kvh = h / (H / K);
  const int pos = a.positions ? a.positions[t] : a.first_position + t;
  const int start = a.window_kind == WindowKind::kSliding ? max(0, pos - a.window + 1) : 0;
  const bool fp8 = a.kv_dtype == KvDtype::kFp8;
  const int32_t* table = RowBlockTable(a.block_table, a.token_seq, a.block_table_stride, t);
  __shared__ float s_warp[4];
  float q[2], acc[2] = {0.0f, 0.0f};
  for (int i = 0; i < 2; ++i) {
    const int d = threadIdx.x + 128 * i;
    q[i] = d < D ? Bf16BitsToFloat(a.q[(static_cast<size_t>(t) * H + h) * D + d]) : 0.0f;
  }
  auto load = [&](const void* pool, int s, int d) {
    const size_t idx =
        ((static_cast<size_t>(table[s / P]) * P + s % P) * K + kvh) * D + d;
    return fp8 ? Fp8ToFloat(static_cast<const uint8_t*>(pool)[idx]) *
                     (pool == a.k_pool ? a.k_scale : a.v_scale)
               : Bf16BitsToFloat(static_cast<const uint16_t*>(pool)[idx]);
  };
  float m = -INFINITY, l = 0.0f;
  for (int s = start; s <= pos; ++s) {
    float part = 0.0f;
    for (int i = 0; i < 2; ++i) {
      const int d = threadIdx.x + 128 * i;
      if (d < D) part = fmaf(q[i], load(a.k_pool, s, d), part);
    }
    part = WarpSum(part);
    if ((threadIdx.x & 31) == 0) s_warp[threadIdx.x >> 5] = part;
    __syncthreads();
    const float score = (s_warp[0] + s_warp[1] + s_warp[2] + s_warp[3]) * a.softmax_scale;
    __syncthreads();
    const float m_new = fmaxf(m, score);
    const float corr = expf(m - m_new);
    const float w = expf(score - m_new);
    l = l * corr + w;
    for (int i = 0; i < 2; ++i) {
      const int d = threadIdx.x + 128 * i;
      if (d < D) acc[i] = acc[i] * corr + w * load(a.v_pool, s, d);
    }
    m = m_new;
  }
  for (int i = 0; i < 2; ++i) {
    const int d = threadIdx.x + 128 * i;
    if (d < D) {
      a.out[(static_cast<size_t>(t) * H + h) * D + d] = GateAndRound(a, t, h, d, acc[i] / l);
    }
  }
}

}  // namespace dev

Status LaunchAttentionFallback(const AttentionParams& params, Stream stream) {
  AttentionParams p = params;
  if (p.softmax_scale <= 0.0f) {
    p.softmax_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  }
  dim3 grid(p.num_q_heads, p.num_tokens);
  dev::AttentionFallbackKernel<<<grid, 128, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  DL_KERNEL_LAUNCH_CHECK("attn_generic_fallback");
  return Status::Ok();
}

}  // namespace dl::kernels
