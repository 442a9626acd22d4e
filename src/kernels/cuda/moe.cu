// MoE for one token, three launches, no host round trip:
//   1. router GEMV over E rows (warp per expert) + last-block top-k selection (ticket counter used for
//      scheduling only; selection and weights come from one block in a fixed order);
//   2. gate/up of the k selected experts and the shared expert (warp per (slot, row)), SwiGLU;
//   3. down projections (warp per output row, all slots) + the weighted combine.
// Expert ids never leave the device: kernel 2 and 3 read them from the workspace and index the
// per-expert pointer arrays.
#include <climits>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

constexpr int kMoeWarps = 8;
constexpr int kMoeMaxExperts = 1024;
constexpr int kMoeMaxTopK = 32;

struct MoeWs {
  float* logits;   // [E]
  int32_t* ids;    // [k]
  float* weights;  // [k]
  uint16_t* h;     // [k+1, Fmax]
};
__host__ __device__ inline size_t Align16(size_t x) { return (x + 15) & ~size_t{15}; }
__host__ __device__ inline MoeWs MoeWorkspace(void* base, int E, int k) {
  char* p = static_cast<char*>(base);
  MoeWs w;
  w.logits = reinterpret_cast<float*>(p);
  p += Align16(E * sizeof(float));
  w.ids = reinterpret_cast<int32_t*>(p);
  p += Align16(k * sizeof(int32_t));
  w.weights = reinterpret_cast<float*>(p);
  p += Align16(k * sizeof(float));
  w.h = reinterpret_cast<uint16_t*>(p);
  return w;
}

// Per-lane partial dot of a BF16 row with a BF16 vector over 16-byte chunks lane, lane+32, ...
__device__ __forceinline__ float LaneDot(const bf16* row, const bf16* x, int n8, int lane) {
  const uint4* r = reinterpret_cast<const uint4*>(row);
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc = 0.0f;
  for (int c0 = lane; c0 < n8; c0 += 128) {
    uint4 rv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (c0 + 32 * u < n8) rv[u] = r[c0 + 32 * u];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (c0 + 32 * u >= n8) break;
      float rf[8], xf[8];
      Bf16x8ToFloat(rv[u], rf);
      Bf16x8ToFloat(xv[c0 + 32 * u], xf);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(rf[e], xf[e], acc);
    }
  }
  return acc;
}

__device__ __forceinline__ bool BetterScore(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

__global__ void __launch_bounds__(kMoeWarps * 32) MoeRouterKernel(MoeParams a) {
  const MoeWs ws = MoeWorkspace(a.workspace, a.num_experts, a.top_k);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * kMoeWarps + warp;
  if (e < a.num_experts) {
    const float z = WarpSum(LaneDot(a.router_w + static_cast<size_t>(e) * a.d, a.x, a.d / 8, lane));
    if (lane == 0) ws.logits[e] = RoundBf16(z);
  }
  __shared__ bool s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  __shared__ float s_score[kMoeMaxExperts];
  __shared__ float s_biased[kMoeMaxExperts];
  __shared__ int s_sel[kMoeMaxTopK];
  __shared__ float s_wv[kMoeWarps];
  __shared__ int s_wi[kMoeWarps];
  for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x) {
    float z = __ldcg(&ws.logits[i]);
    if (a.softcap > 0.0f) z = a.softcap * tanhf(z / a.softcap);
    const float s = 1.0f / (1.0f + expf(-z));
    s_score[i] = s;
    s_biased[i] = s + Bf16BitsToFloat(a.router_bias[i]);
  }
  __syncthreads();
  for (int j = 0; j < a.top_k; ++j) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < a.num_experts; i += blockDim.x)
      if (BetterScore(s_biased[i], i, bv, bi)) bv = s_biased[i], bi = i;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (BetterScore(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (lane == 0) s_wv[warp] = bv, s_wi[warp] = bi;
    __syncthreads();
    if (threadIdx.x == 0) {
      float v = s_wv[0];
      int idx = s_wi[0];
      for (int w = 1; w < kMoeWarps; ++w)
        if (BetterScore(s_wv[w], s_wi[w], v, idx)) v = s_wv[w], idx = s_wi[w];
      s_sel[j] = idx;
      s_biased[idx] = -INFINITY;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int j = 0; j < a.top_k; ++j) sum += s_score[s_sel[j]];
    for (int j = 0; j < a.top_k; ++j) {
      const float w = RoundBf16(s_score[s_sel[j]] / sum);
      ws.ids[j] = s_sel[j];
      ws.weights[j] = w;
      if (a.topk_ids) a.topk_ids[j] = s_sel[j];
      if (a.topk_weights) a.topk_weights[j] = w;
    }
    *a.counter = 0u;
  }
}

// Grid (ceil(Fmax / 8), k + 1): slot k is the shared expert.
__global__ void __launch_bounds__(kMoeWarps * 32) MoeGateUpKernel(MoeParams a) {
  const MoeWs ws = MoeWorkspace(a.workspace, a.num_experts, a.top_k);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = blockIdx.y;
  const bool shared = j == a.top_k;
  const int F = shared ? a.shared_ffn : a.ffn;
  const int f = blockIdx.x * kMoeWarps + warp;
  if (f >= F) return;
  const bf16 *gw, *uw;
  if (shared) {
    gw = a.shared_gate_w;
    uw = a.shared_up_w;
  } else {
    const int e = ws.ids[j];
    gw = a.gate_w[e];
    uw = a.up_w[e];
  }
  const float g = RoundBf16(WarpSum(LaneDot(gw + static_cast<size_t>(f) * a.d, a.x, a.d / 8, lane)));
  const float u = RoundBf16(WarpSum(LaneDot(uw + static_cast<size_t>(f) * a.d, a.x, a.d / 8, lane)));
  if (lane == 0) {
    const float act = RoundBf16(g / (1.0f + expf(-g)));
    const int fmax = a.ffn > a.shared_ffn ? a.ffn : a.shared_ffn;
    ws.h[static_cast<size_t>(j) * fmax + f] = FloatToBf16Bits(act * u);
  }
}

// Grid ceil(d / 8): warp per output row, all k+1 slots.
__global__ void __launch_bounds__(kMoeWarps * 32) MoeDownKernel(MoeParams a) {
  const MoeWs ws = MoeWorkspace(a.workspace, a.num_experts, a.top_k);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i = blockIdx.x * kMoeWarps + warp;
  if (i >= a.d) return;
  const int fmax = a.ffn > a.shared_ffn ? a.ffn : a.shared_ffn;
  float routed = 0.0f;
  for (int j = 0; j < a.top_k; ++j) {
    const bf16* row = a.down_w[ws.ids[j]] + static_cast<size_t>(i) * a.ffn;
    const float o = RoundBf16(WarpSum(LaneDot(row, ws.h + static_cast<size_t>(j) * fmax, a.ffn / 8, lane)));
    routed += RoundBf16(o * ws.weights[j]);
  }
  const float s = RoundBf16(WarpSum(LaneDot(a.shared_down_w + static_cast<size_t>(i) * a.shared_ffn,
                                            ws.h + static_cast<size_t>(a.top_k) * fmax,
                                            a.shared_ffn / 8, lane)));
  if (lane == 0) {
    const float y = RoundBf16(RoundBf16(RoundBf16(routed) * a.alpha) + s);
    a.y[i] = FloatToBf16Bits(y);
  }
}

}  // namespace dev

size_t MoeWorkspaceBytes(int num_experts, int top_k, int ffn, int shared_ffn) {
  const size_t fmax = std::max(ffn, shared_ffn);
  return dev::Align16(num_experts * sizeof(float)) + dev::Align16(top_k * sizeof(int32_t)) +
         dev::Align16(top_k * sizeof(float)) + dev::Align16((top_k + 1) * fmax * sizeof(uint16_t));
}

Status Moe(const MoeParams& p, Stream stream) {
  if (!p.x || !p.router_w || !p.router_bias || !p.gate_w || !p.up_w || !p.down_w ||
      !p.shared_gate_w || !p.shared_up_w || !p.shared_down_w || !p.y || !p.workspace ||
      !p.counter) {
    return InvalidArgument("moe: every weight, x, y, workspace and counter must be set");
  }
  if (p.d < 8 || p.d % 8 || p.ffn < 8 || p.ffn % 8 || p.shared_ffn < 8 || p.shared_ffn % 8) {
    return InvalidArgument("moe: d {}, ffn {}, shared_ffn {} must be positive multiples of 8", p.d,
                           p.ffn, p.shared_ffn);
  }
  if (p.num_experts < 1 || p.num_experts > dev::kMoeMaxExperts || p.top_k < 1 ||
      p.top_k > std::min(p.num_experts, dev::kMoeMaxTopK)) {
    return InvalidArgument("moe: {} experts / top-{} unsupported (E <= {}, k <= min(E, {}))",
                           p.num_experts, p.top_k, dev::kMoeMaxExperts, dev::kMoeMaxTopK);
  }
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int threads = dev::kMoeWarps * 32;
  dev::MoeRouterKernel<<<(p.num_experts + dev::kMoeWarps - 1) / dev::kMoeWarps, threads, 0, s>>>(p);
  DL_KERNEL_LAUNCH_CHECK("moe_router_topk");
  const int fmax = std::max(p.ffn, p.shared_ffn);
  dev::MoeGateUpKernel<<<dim3((fmax + dev::kMoeWarps - 1) / dev::kMoeWarps, p.top_k + 1), threads,
                         0, s>>>(p);
  DL_KERNEL_LAUNCH_CHECK("moe_gate_up");
  dev::MoeDownKernel<<<(p.d + dev::kMoeWarps - 1) / dev::kMoeWarps, threads, 0, s>>>(p);
  DL_KERNEL_LAUNCH_CHECK("moe_down_combine");
  return Status::Ok();
}

}  // namespace dl::kernels
