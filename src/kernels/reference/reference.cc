#include "kernels/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/dtype.h"

namespace dl::kernels::ref {
namespace {

float B(bf16 v) { return Bf16ToFloat(v); }
bf16 ToB(float f) { return FloatToBf16(f); }

// y = bf16(x̂ * w) with x̂ = bf16(x / rms): the reference RMSNorm on one vector.
void RmsNormVec(const float* x, const bf16* w, int n, float eps, float* y) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(ss / n);
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (int i = 0; i < n; ++i) y[i] = RoundBf16(RoundBf16(x[i] * inv) * B(w[i]));
}

double Dot(const bf16* a, const bf16* b, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(B(a[i])) * B(b[i]);
  return s;
}

// Row o of a weight [*, n] as FP32: BF16 widened, or FP8 dequantised (code * scale, one FP32 multiply).
std::vector<float> WeightRow(const bf16* w, const Fp8Weight& f, int o, int n) {
  std::vector<float> row(n);
  for (int i = 0; i < n; ++i) row[i] = f.on() ? Fp8WeightAt(f, n, o, i) : B(w[static_cast<size_t>(o) * n + i]);
  return row;
}
double Dot(const std::vector<float>& a, const bf16* b, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(a[i]) * B(b[i]);
  return s;
}

}  // namespace

float Fp8WeightAt(const Fp8Weight& w, int cols, int64_t o, int64_t i) {
  const int64_t scale_cols = (cols + w.block_cols - 1) / w.block_cols;
  const float scale = w.scales[(o / w.block_rows) * scale_cols + i / w.block_cols];
  return Fp8E4M3ToFloat(w.codes[o * cols + i]) * scale;
}

float Softplus(float z) { return z > 20.0f ? z : std::log1p(std::exp(z)); }

void AddRmsNorm(const AddRmsNormParams& p) {
  std::vector<float> x(p.n), y(p.n);
  for (int r = 0; r < p.rows; ++r) {
    bf16* h = p.residual + static_cast<size_t>(r) * p.n;
    for (int i = 0; i < p.n; ++i) {
      x[i] = B(h[i]);
      if (p.delta) {
        x[i] = RoundBf16(x[i] + B(p.delta[static_cast<size_t>(r) * p.n + i]));
        h[i] = ToB(x[i]);
      }
    }
    RmsNormVec(x.data(), p.weight, p.n, p.eps, y.data());
    for (int i = 0; i < p.n; ++i) p.out[static_cast<size_t>(r) * p.n + i] = ToB(y[i]);
  }
}

void QkNormRopeAppend(const QkNormRopeAppendParams& p) {
  const int H = p.num_q_heads, K = p.num_kv_heads, D = p.head_dim, R = p.rotary_dim, half = R / 2;
  std::vector<float> x(D), y(D);
  for (int t = 0; t < p.num_tokens; ++t) {
    const int pos = p.positions ? p.positions[t] : p.first_position + t;
    for (int head = 0; head < H + 2 * K; ++head) {
      const int kind = head < H ? 0 : (head < H + K ? 1 : 2);
      const bf16* base = kind == 0 ? p.q : (kind == 1 ? p.k : p.v);
      const int hh = kind == 0 ? head : (kind == 1 ? head - H : head - H - K);
      const bf16* src = base + static_cast<size_t>(t) * p.qkv_stride + static_cast<size_t>(hh) * D;
      for (int e = 0; e < D; ++e) x[e] = B(src[e]);
      if (kind != 2) {
        RmsNormVec(x.data(), kind == 0 ? p.q_norm_weight : p.k_norm_weight, D, p.eps, y.data());
        x = y;
        for (int e = 0; e < D; ++e) {
          if (e >= R) continue;
          const int j = e < half ? e : e - half;
          const float ang = static_cast<float>(pos) * p.inv_freq[j];
          const float c = RoundBf16(std::cos(ang) * p.attention_factor);
          const float s = RoundBf16(std::sin(ang) * p.attention_factor);
          // rotate_half(x) = cat(-x2, x1); out = x*cos + rotate_half(x)*sin, all BF16 ops.
          const float rot = e < half ? -x[e + half] : x[e - half];
          y[e] = RoundBf16(RoundBf16(x[e] * c) + RoundBf16(rot * s));
        }
      } else {
        y = x;
      }
      for (int e = 0; e < D; ++e) {
        if (kind == 0) {
          p.q_out[(static_cast<size_t>(t) * H + hh) * D + e] = ToB(y[e]);
          continue;
        }
        const int32_t* table = RowBlockTable(p.block_table, p.token_seq, p.block_table_stride, t);
        const int page = table[pos / p.page_size];
        const size_t idx =
            ((static_cast<size_t>(page) * p.page_size + pos % p.page_size) * K + hh) * D + e;
        void* pool = kind == 1 ? p.k_pool : p.v_pool;
        if (p.kv_dtype == KvDtype::kFp8) {
          static_cast<uint8_t*>(pool)[idx] =
              FloatToFp8E4M3(y[e] / (kind == 1 ? p.k_scale : p.v_scale));
        } else {
          static_cast<uint16_t*>(pool)[idx] = ToB(y[e]);
        }
      }
    }
  }
}

void Attention(const AttentionParams& p) {
  const int H = p.num_q_heads, K = p.num_kv_heads, D = p.head_dim, P = p.page_size, G = H / K;
  const double scale =
      p.softmax_scale > 0.0f ? p.softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
  auto read = [&](const void* pool, float kv_scale, int t, int s, int kvh, int d) -> double {
    const int32_t* table = RowBlockTable(p.block_table, p.token_seq, p.block_table_stride, t);
    const size_t idx = ((static_cast<size_t>(table[s / P]) * P + s % P) * K + kvh) * D + d;
    if (p.kv_dtype == KvDtype::kFp8) {
      return static_cast<double>(Fp8E4M3ToFloat(static_cast<const uint8_t*>(pool)[idx])) * kv_scale;
    }
    return B(static_cast<const uint16_t*>(pool)[idx]);
  };
  for (int t = 0; t < p.num_tokens; ++t) {
    const int pos = p.positions ? p.positions[t] : p.first_position + t;
    const int start = p.window_kind == WindowKind::kSliding ? std::max(0, pos - p.window + 1) : 0;
    for (int h = 0; h < H; ++h) {
      const int kvh = h / G;
      const bf16* q = p.q + (static_cast<size_t>(t) * H + h) * D;
      std::vector<double> score(pos - start + 1);
      double mx = -std::numeric_limits<double>::infinity();
      for (int s = start; s <= pos; ++s) {
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += B(q[d]) * read(p.k_pool, p.k_scale, t, s, kvh, d);
        score[s - start] = dot * scale;
        mx = std::max(mx, score[s - start]);
      }
      double l = 0.0;
      for (double& sc : score) l += (sc = std::exp(sc - mx));
      for (int d = 0; d < D; ++d) {
        double o = 0.0;
        for (int s = start; s <= pos; ++s) o += score[s - start] * read(p.v_pool, p.v_scale, t, s, kvh, d);
        float out = RoundBf16(static_cast<float>(o / l));
        if (p.gate) {
          const size_t gi = static_cast<size_t>(t) * p.gate_stride +
                            (p.gate_per_element ? static_cast<size_t>(h) * D + d : h);
          out = RoundBf16(out * RoundBf16(Softplus(B(p.gate[gi]))));
        }
        p.out[(static_cast<size_t>(t) * H + h) * D + d] = ToB(out);
      }
    }
  }
}

void Gemv(const GemvParams& p) {
  const int64_t xs = p.x_stride ? p.x_stride : p.in, ys = p.y_stride ? p.y_stride : p.out;
  for (int o = 0; o < p.out; ++o) {
    const std::vector<float> w = WeightRow(p.w, p.w_fp8, o, p.in);
    for (int t = 0; t < p.num_tokens; ++t) p.y[t * ys + o] = ToB(static_cast<float>(Dot(w, p.x + t * xs, p.in)));
  }
}

void GemvFp8Rule(const GemvParams& p) {
  const int64_t xs = p.x_stride ? p.x_stride : p.in, ys = p.y_stride ? p.y_stride : p.out;
  const int n16 = p.in / 16;
  const int ks = p.k_split ? p.k_split : GemvFp8KSplitFor(p.out, p.in);
  const int per = n16 / ks;
  const int64_t scale_cols = (p.in + p.w_fp8.block_cols - 1) / p.w_fp8.block_cols;
  std::vector<float> v(p.in);  // the row's code values (exact)
  for (int o = 0; o < p.out; ++o) {
    const uint8_t* codes = p.w_fp8.codes + static_cast<int64_t>(o) * p.in;
    const float* scales = p.w_fp8.scales + (o / p.w_fp8.block_rows) * scale_cols;
    for (int i = 0; i < p.in; ++i) v[i] = Fp8E4M3ToFloat(codes[i]);
    for (int t = 0; t < p.num_tokens; ++t) {
      const bf16* x = p.x + t * xs;
      float sum = 0.0f;
      for (int slice = 0; slice < ks; ++slice) {
        float lanes[32];
        for (int lane = 0; lane < 32; ++lane) {
          float acc = 0.0f;
          for (int c = slice * per + lane; c < (slice + 1) * per; c += 32) {
            float chunk = 0.0f;
            for (int e = 0; e < 16; ++e) chunk = std::fma(v[16 * c + e], B(x[16 * c + e]), chunk);
            acc = std::fma(chunk, scales[16 * c / p.w_fp8.block_cols], acc);
          }
          lanes[lane] = acc;
        }
        for (int off = 16; off > 0; off >>= 1) {
          float next[32];
          for (int lane = 0; lane < 32; ++lane) next[lane] = lanes[lane] + lanes[lane ^ off];
          std::copy(next, next + 32, lanes);
        }
        sum = slice == 0 ? lanes[0] : sum + lanes[0];
      }
      p.y[t * ys + o] = ToB(sum);
    }
  }
}

void Moe(const MoeParams& p, const float* logits_override, float* term_scale) {
  const int E = p.num_experts, k = p.top_k, d = p.d;
  std::vector<float> score(E), biased(E);
  for (int e = 0; e < E; ++e) {
    float z = logits_override
                  ? logits_override[e]
                  : RoundBf16(static_cast<float>(Dot(p.router_w + static_cast<size_t>(e) * d, p.x, d)));
    if (p.softcap > 0.0f) z = p.softcap * std::tanh(z / p.softcap);
    score[e] = 1.0f / (1.0f + std::exp(-z));
    biased[e] = score[e] + B(p.router_bias[e]);
  }
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return biased[a] > biased[b]; });
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += score[order[j]];
  std::vector<float> w(k);
  for (int j = 0; j < k; ++j) {
    w[j] = RoundBf16(score[order[j]] / sum);
    if (p.topk_ids) p.topk_ids[j] = order[j];
    if (p.topk_weights) p.topk_weights[j] = w[j];
  }
  // Each matrix BF16 or FP8 (dequantised exactly, then the same FP32 expert).
  auto expert = [&](const bf16* gw, const Fp8Weight& gf, const bf16* uw, const Fp8Weight& uf, const bf16* dw,
                    const Fp8Weight& df, int F, std::vector<float>& out) {
    std::vector<bf16> h(F);
    for (int f = 0; f < F; ++f) {
      const float g = RoundBf16(static_cast<float>(Dot(WeightRow(gw, gf, f, d), p.x, d)));
      const float u = RoundBf16(static_cast<float>(Dot(WeightRow(uw, uf, f, d), p.x, d)));
      const float act = RoundBf16(g / (1.0f + std::exp(-g)));
      h[f] = ToB(act * u);
    }
    out.resize(d);
    for (int i = 0; i < d; ++i) out[i] = RoundBf16(static_cast<float>(Dot(WeightRow(dw, df, i, F), h.data(), F)));
  };
  auto routed_fp8 = [](const MoeParams::Fp8Experts& x, int e) {
    return x.on() ? Fp8Weight{x.codes[e], x.scales[e], x.block_rows, x.block_cols} : Fp8Weight{};
  };
  std::vector<double> routed(d, 0.0), routed_abs(d, 0.0);
  std::vector<float> o;
  for (int j = 0; j < k; ++j) {
    const int e = order[j];
    const bool fp8 = p.gate_fp8.on();
    expert(fp8 ? nullptr : p.gate_w[e], routed_fp8(p.gate_fp8, e), fp8 ? nullptr : p.up_w[e], routed_fp8(p.up_fp8, e),
           fp8 ? nullptr : p.down_w[e], routed_fp8(p.down_fp8, e), p.ffn, o);
    for (int i = 0; i < d; ++i) {
      const float term = RoundBf16(o[i] * w[j]);
      routed[i] += term;
      routed_abs[i] += std::fabs(term);
    }
  }
  expert(p.shared_gate_w, p.shared_gate_fp8, p.shared_up_w, p.shared_up_fp8, p.shared_down_w, p.shared_down_fp8,
         p.shared_ffn, o);
  for (int i = 0; i < d; ++i) {
    const float r = RoundBf16(static_cast<float>(routed[i]));
    p.y[i] = ToB(RoundBf16(r * p.alpha) + o[i]);
    if (term_scale) term_scale[i] = static_cast<float>(routed_abs[i] * std::fabs(p.alpha)) + std::fabs(o[i]);
  }
}

int32_t Argmax(const bf16* logits, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) {
    const float v = B(logits[i]), b = B(logits[best]);
    if (std::isnan(b)) break;
    if (std::isnan(v) || v > b) best = i;
  }
  return best;
}

}  // namespace dl::kernels::ref
