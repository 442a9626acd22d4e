// GPU kernels against their CPU references (src/kernels/reference), on random data, with explicit
// tolerances, plus bit-identity: run to run, across page sizes, across prefill chunkings and between
// prefill and decode of the same token. Every test skips visibly where no CUDA device is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include "base/dtype.h"
#include "base/rng.h"
#include "cuda/buffer.h"
#include "cuda/device.h"
#include "kernels/attention/attention.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/reference/reference.h"
#include "tests/gpu/gpu_test_util.h"
#include "kernels/sampling.h"

namespace dl::kernels {
namespace {

using namespace gpu_test;  // NOLINT(google-build-using-namespace): the shared test helpers

// ---------------------------------------------------------------------------------------------------
TEST(AddRmsNormGpu, MatchesReferenceAndIsDeterministic) {
  SKIP_WITHOUT_GPU();
  for (int n : {2048, 64, 8192}) {
    const int rows = 3;
    auto h = RandomBf16(rows * n, 11, 4.0f), delta = RandomBf16(rows * n, 12), w = RandomBf16(n, 13);
    auto d_h = Upload(h), d_delta = Upload(delta), d_w = Upload(w);
    auto d_out = Alloc(rows * n * 2);
    AddRmsNormParams p{d_h.as<bf16>(), d_delta.as<bf16>(), d_w.as<bf16>(), d_out.as<bf16>(), rows,
                       n, 1e-6f};
    ASSERT_OK(AddRmsNorm(p, nullptr));
    Sync();
    std::vector<bf16> out_ref(rows * n), h_ref = h;
    AddRmsNormParams r{h_ref.data(), delta.data(), w.data(), out_ref.data(), rows, n, 1e-6f};
    ref::AddRmsNorm(r);
    // The BF16 add has one correct rounding: exact. The norm differs only in the sum order: 1 ulp.
    EXPECT_EQ(Download<bf16>(d_h, rows * n), h_ref) << "residual n=" << n;
    const auto out1 = Download<bf16>(d_out, rows * n);
    ExpectClose(out1, out_ref, 1e-6f, 1.0f / 128, "rmsnorm n=" + std::to_string(n));
    // Plain RMSNorm (no delta) of the updated residual, twice: bit-identical.
    p.delta = nullptr;
    ASSERT_OK(AddRmsNorm(p, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_out, rows * n), out1);
  }
}

// ---------------------------------------------------------------------------------------------------
struct RopeCase {
  int H, K, D, R, P;
  KvDtype kv;
  float m;
};

TEST(QkNormRopeAppendGpu, MatchesReference) {
  SKIP_WITHOUT_GPU();
  for (const RopeCase& c : {RopeCase{48, 8, 128, 64, 16, KvDtype::kFp8, 1.0f},
                            RopeCase{64, 8, 128, 128, 32, KvDtype::kBf16, 1.0f},
                            RopeCase{8, 2, 32, 16, 16, KvDtype::kFp8, 1.3466f},
                            RopeCase{4, 2, 16, 16, 64, KvDtype::kBf16, 1.0f}}) {
    SCOPED_TRACE(testing::Message() << "H " << c.H << " D " << c.D << " R " << c.R << " P " << c.P);
    const int T = 5, stride = (c.H + 2 * c.K) * c.D;  // fused qkv rows
    auto qkv = RandomBf16(T * stride, 21, 2.0f);
    auto qn = RandomBf16(c.D, 22), kn = RandomBf16(c.D, 23);
    std::vector<float> inv_freq(c.R / 2);
    for (int j = 0; j < c.R / 2; ++j)  // YaRN-like: high-frequency dims kept, the rest / 32
      inv_freq[j] = std::pow(500000.0f, -2.0f * j / c.R) / (j > c.R / 8 ? 32.0f : 1.0f);
    std::vector<int32_t> positions = {1000, 1001, 1002, 4095, 131071};
    // Logical pages map to a few physical pages in reverse order; unused entries are -1 (the
    // kernel must never read them).
    const int num_pages = 8;
    std::vector<int32_t> table(131072 / c.P + 1, -1);
    int next_page = num_pages - 1;
    for (int pos : positions)
      if (table[pos / c.P] < 0) table[pos / c.P] = next_page--;
    const size_t esz = c.kv == KvDtype::kFp8 ? 1 : 2;
    const size_t pool_elems = static_cast<size_t>(num_pages) * c.P * c.K * c.D;
    auto d_qkv = Upload(qkv), d_qn = Upload(qn), d_kn = Upload(kn), d_f = Upload(inv_freq);
    auto d_pos = Upload(positions), d_table = Upload(table);
    auto d_kp = Alloc(pool_elems * esz), d_vp = Alloc(pool_elems * esz);
    auto d_qo = Alloc(T * c.H * c.D * 2);
    QkNormRopeAppendParams p;
    p.q = d_qkv.as<bf16>(), p.k = p.q + c.H * c.D, p.v = p.k + c.K * c.D, p.qkv_stride = stride;
    p.q_norm_weight = d_qn.as<bf16>(), p.k_norm_weight = d_kn.as<bf16>();
    p.inv_freq = d_f.as<float>(), p.attention_factor = c.m, p.rotary_dim = c.R;
    p.positions = d_pos.as<int32_t>(), p.num_tokens = T, p.num_q_heads = c.H;
    p.num_kv_heads = c.K, p.head_dim = c.D, p.q_out = d_qo.as<bf16>();
    p.k_pool = d_kp.data(), p.v_pool = d_vp.data(), p.kv_dtype = c.kv;
    p.k_scale = 0.05f, p.v_scale = 0.03f, p.block_table = d_table.as<int32_t>(), p.page_size = c.P;
    ASSERT_OK(QkNormRopeAppend(p, nullptr));
    Sync();
    // Reference on host copies of the pools (poisoned like the device ones).
    std::vector<uint8_t> kp(pool_elems * esz, 0xff), vp(pool_elems * esz, 0xff);
    std::vector<bf16> qo(T * c.H * c.D);
    QkNormRopeAppendParams r = p;
    r.q = qkv.data(), r.k = r.q + c.H * c.D, r.v = r.k + c.K * c.D;
    r.q_norm_weight = qn.data(), r.k_norm_weight = kn.data(), r.inv_freq = inv_freq.data();
    r.positions = positions.data(), r.q_out = qo.data(), r.k_pool = kp.data(), r.v_pool = vp.data();
    r.block_table = table.data();
    ref::QkNormRopeAppend(r);
    ExpectClose(Download<bf16>(d_qo, qo.size()), qo, 1e-6f, 1.0f / 64, "q_out");
    const auto gk = Download<uint8_t>(d_kp, kp.size()), gv = Download<uint8_t>(d_vp, vp.size());
    // Compare the written slots (dequantised); every other byte must still hold the poison.
    size_t written = 0;
    for (int t = 0; t < T; ++t) {
      const int pos = positions[t];
      for (int kvh = 0; kvh < c.K; ++kvh) {
        for (int e = 0; e < c.D; ++e) {
          const size_t idx =
              ((static_cast<size_t>(table[pos / c.P]) * c.P + pos % c.P) * c.K + kvh) * c.D + e;
          for (int which = 0; which < 2; ++which) {
            const auto& g = which ? gv : gk;
            const auto& w = which ? vp : kp;
            float gf, wf, tol;
            if (c.kv == KvDtype::kFp8) {
              gf = Fp8E4M3ToFloat(g[idx]), wf = Fp8E4M3ToFloat(w[idx]);
              tol = 1.0f / 8 * std::fabs(wf) + 1e-3f;  // one E4M3 step after a 1-ulp BF16 change
            } else {
              uint16_t gb, wb;
              std::memcpy(&gb, &g[2 * idx], 2), std::memcpy(&wb, &w[2 * idx], 2);
              gf = Bf16ToFloat(gb), wf = Bf16ToFloat(wb);
              tol = std::fabs(wf) / 64 + 1e-6f;
            }
            ASSERT_LE(std::fabs(gf - wf), tol) << (which ? "v" : "k") << " t " << t << " e " << e;
            ++written;
          }
        }
      }
    }
    size_t untouched_ok = 0, differs = 0;
    for (size_t i = 0; i < gk.size(); ++i) {
      if (gk[i] == kp[i] && gv[i] == vp[i]) ++untouched_ok;
      else ++differs;
    }
    EXPECT_LE(differs, written) << "bytes outside the appended slots changed";
    (void)untouched_ok;
  }
}

// ---------------------------------------------------------------------------------------------------
// A paged KV cache filled with the same logical content for any page size.
struct Cache {
  int K, D, P, num_pages;
  KvDtype kv;
  std::vector<int32_t> table;
  std::vector<uint8_t> k, v;  // raw bytes
};
Cache MakeCache(int K, int D, int P, KvDtype kv, int tokens, uint64_t key, float scale_k,
                float scale_v) {
  Cache c{K, D, P, (tokens + P - 1) / P + 1, kv, {}, {}, {}};
  c.table.resize(c.num_pages);
  std::iota(c.table.begin(), c.table.end(), 0);
  std::shuffle(c.table.begin(), c.table.end(), std::mt19937(static_cast<uint32_t>(key + P)));
  const size_t esz = kv == KvDtype::kFp8 ? 1 : 2;
  const size_t n = static_cast<size_t>(c.num_pages) * P * K * D;
  c.k.assign(n * esz, 0xff);  // poison: NaN in both dtypes, never read
  c.v.assign(n * esz, 0xff);
  for (int s = 0; s < tokens; ++s) {
    for (int h = 0; h < K; ++h) {
      for (int d = 0; d < D; ++d) {
        const size_t logical = (static_cast<size_t>(s) * K + h) * D + d;
        const size_t idx = ((static_cast<size_t>(c.table[s / P]) * P + s % P) * K + h) * D + d;
        const float kf = NormalAt(key, 2 * logical), vf = NormalAt(key, 2 * logical + 1);
        if (kv == KvDtype::kFp8) {
          c.k[idx] = FloatToFp8E4M3(kf / scale_k * 0.5f);
          c.v[idx] = FloatToFp8E4M3(vf / scale_v * 0.5f);
        } else {
          const bf16 kb = FloatToBf16(kf), vb = FloatToBf16(vf);
          std::memcpy(&c.k[2 * idx], &kb, 2), std::memcpy(&c.v[2 * idx], &vb, 2);
        }
      }
    }
  }
  return c;
}

struct AttnRun {
  std::vector<bf16> out;
  std::vector<bf16> ref;
};

// Runs `kernel` for T queries at positions first..first+T-1 over `c`; returns output and reference.
AttnRun RunAttn(const AttentionKernel& kernel, const Cache& c, int H, WindowKind win, int window,
                int first, int T, int max_position, bool per_element_gate, uint64_t key,
                bool want_ref = true, int cluster_max_chunks = AttentionParams{}.cluster_max_chunks,
                AttnKind kind = AttnKind::kDecode) {
  const int D = c.D;
  auto q = RandomBf16(static_cast<size_t>(max_position + 1) * H * D, key, 1.5f);
  const int gate_w = per_element_gate ? H * D : H;
  auto gate = RandomBf16(static_cast<size_t>(max_position + 1) * gate_w, key + 1, 1.0f);
  // Query token at position s always has the same q and gate rows, whatever the chunking.
  std::vector<bf16> q_rows(q.begin() + static_cast<size_t>(first) * H * D,
                           q.begin() + static_cast<size_t>(first + T) * H * D);
  std::vector<bf16> g_rows(gate.begin() + static_cast<size_t>(first) * gate_w,
                           gate.begin() + static_cast<size_t>(first + T) * gate_w);
  auto d_q = Upload(q_rows), d_g = Upload(g_rows), d_k = Upload(c.k), d_v = Upload(c.v);
  auto d_t = Upload(c.table);
  auto d_o = Alloc(static_cast<size_t>(T) * H * D * 2);
  AttentionParams p;
  p.q = d_q.as<bf16>(), p.k_pool = d_k.data(), p.v_pool = d_v.data();
  p.block_table = d_t.as<int32_t>(), p.first_position = first, p.max_position = max_position;
  // The cache is complete before the launch, so earlier keys may be loaded before the wait; this
  // exercises both the early (s < first) and the late (the launch's own tokens) load paths.
  p.history_stable = true;
  p.num_tokens = T, p.num_q_heads = H, p.num_kv_heads = c.K, p.head_dim = D, p.page_size = c.P;
  p.kv_dtype = c.kv, p.window_kind = win, p.window = window, p.k_scale = 0.5f, p.v_scale = 0.25f;
  p.gate = d_g.as<bf16>(), p.gate_stride = gate_w, p.gate_per_element = per_element_gate;
  p.out = d_o.as<bf16>();
  p.cluster_max_chunks = cluster_max_chunks;
  auto d_ws = Alloc(AttentionWorkspaceBytes(p));
  auto d_counters = Alloc(static_cast<size_t>(T) * c.K * 4, 0);
  p.workspace = d_ws.data(), p.workspace_bytes = d_ws.size();
  p.counters = d_counters.as<uint32_t>();
  AttnRun r;
  const Status st = RunAttention(kernel, p, nullptr, kind);
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  r.out = Download<bf16>(d_o, static_cast<size_t>(T) * H * D);
  if (!kernel.fallback) {  // the last chunk block of every (token, KV head) hands its ticket back
    const auto left = Download<uint32_t>(d_counters, static_cast<size_t>(T) * c.K);
    EXPECT_EQ(std::count(left.begin(), left.end(), 0u), static_cast<long>(left.size()));
  }
  if (want_ref) {
    r.ref.resize(r.out.size());
    AttentionParams h = p;
    h.q = q_rows.data(), h.k_pool = c.k.data(), h.v_pool = c.v.data(), h.block_table = c.table.data();
    h.gate = g_rows.data(), h.out = r.ref.data();
    ref::Attention(h);
  }
  return r;
}


// The test shape of a preset: XS.2's (8 KV heads, window 512) for head dim 128, the tiny config's
// (2 KV heads, window 8) otherwise.
struct PresetTestShape {
  int K, H, window;
};
PresetTestShape TestShapeOf(const AttnPresetKey& k) {
  const int K = k.head_dim == 128 ? 8 : 2;
  return {K, K * k.group, k.head_dim == 128 ? 512 : 8};
}

TEST(AttentionGpu, EveryBuiltPresetMatchesReference) {
  SKIP_WITHOUT_GPU();
  for (const PresetInfo& info : AllPresets()) {
    if (!info.built) continue;
    SCOPED_TRACE(info.name);
    const AttnPresetKey& k = info.key;
    const auto [K, H, window] = TestShapeOf(k);
    // Long enough for the window to bite and for several chunks; T = 3 prefill then checks.
    const int tokens = k.head_dim == 128 ? 1300 : 300;
    Cache c = MakeCache(K, k.head_dim, k.page_size, k.kv_dtype, tokens, 31, 0.5f, 0.25f);
    auto kernel = ResolveAttention(k);
    ASSERT_TRUE(kernel.ok()) << kernel.status().message();
    const int T = 3, first = tokens - T;
    AttnRun a = RunAttn(*kernel, c, H, k.window, window, first, T, tokens - 1,
                        /*per_element_gate=*/k.group == 4, 41);
    // FP32 accumulation vs the double reference: 1-2 BF16 ulps, plus a small absolute term for
    // outputs near zero (averages of many values).
    ExpectClose(a.out, a.ref, 2e-3f, 1.0f / 64, info.name);
    // Run to run: bit-identical.
    AttnRun b = RunAttn(*kernel, c, H, k.window, window, first, T, tokens - 1, k.group == 4, 41,
                        false);
    EXPECT_EQ(a.out, b.out) << "run-to-run";
    // Decode of the last token alone (and with a larger grid bound) equals its prefill row.
    AttnRun dcd = RunAttn(*kernel, c, H, k.window, window, tokens - 1, 1, tokens + 700,
                          k.group == 4, 41, false);
    EXPECT_EQ(dcd.out, Rows(a.out, static_cast<size_t>(H) * k.head_dim, T - 1, 1))
        << "decode vs prefill";
  }
}

TEST(AttentionGpu, BitIdenticalAcrossPageSizesAndPrefillChunking) {
  SKIP_WITHOUT_GPU();
  for (KvDtype kv : {KvDtype::kFp8, KvDtype::kBf16}) {
    for (WindowKind win : {WindowKind::kSliding, WindowKind::kGlobal}) {
      const int G = win == WindowKind::kSliding ? 8 : 6, K = 8, H = G * K, D = 128;
      std::vector<std::vector<bf16>> outs;
      for (int P : {16, 32, 64}) {
        const AttnPresetKey key{D, G, P, kv, win};
        auto kernel = ResolveAttention(key);
        if (!kernel.ok()) continue;  // a focused build may lack some page sizes
        Cache c = MakeCache(K, D, P, kv, 900, 51, 0.5f, 0.25f);
        AttnRun whole = RunAttn(*kernel, c, H, win, 512, 890, 10, 899, false, 61, false);
        // Same 10 tokens prefilled as chunks of 4 + 6: identical rows.
        AttnRun c1 = RunAttn(*kernel, c, H, win, 512, 890, 4, 899, false, 61, false);
        AttnRun c2 = RunAttn(*kernel, c, H, win, 512, 894, 6, 899, false, 61, false);
        std::vector<bf16> joined = c1.out;
        joined.insert(joined.end(), c2.out.begin(), c2.out.end());
        EXPECT_EQ(joined, whole.out) << CanonicalName(key) << " prefill chunking";
        outs.push_back(whole.out);
      }
      for (size_t i = 1; i < outs.size(); ++i) EXPECT_EQ(outs[i], outs[0]) << "page sizes differ";
    }
  }
}

// The tensor-core prompt kernel (AttnKind::kPrompt), every built preset: against the reference; the
// same rows prefilled whole and as chunks of 37, 100 and 512 rows give the same bits (tiles of 16
// rows then start at other rows, and a row's key tiles start at other tiles); run to run; and the same
// bits at every built page size. Prompts longer than the sliding window (1,300 tokens over W 512; 300
// over the tiny presets' W 8), with rows at the prompt's end, where the window bites.
TEST(AttentionGpu, PromptKernelMatchesReferenceAndIsChunkAndPageInvariant) {
  SKIP_WITHOUT_GPU();
  std::map<std::string, std::vector<bf16>> by_shape;  // (D, G, kv, window) -> the prompt's rows
  for (const PresetInfo& info : AllPresets()) {
    if (!info.built) continue;
    SCOPED_TRACE(info.name);
    const AttnPresetKey& k = info.key;
    const auto [K, H, window] = TestShapeOf(k);
    const int D = k.head_dim, tokens = D == 128 ? 1300 : 300, T = D == 128 ? 600 : 200, first = tokens - T;
    const float k_scale = 0.5f, v_scale = 0.25f;
    Cache c = MakeCache(K, D, k.page_size, k.kv_dtype, tokens, 33, k_scale, v_scale);
    auto kernel = ResolveAttention(k);
    ASSERT_TRUE(kernel.ok()) << kernel.status().message();
    const bool per_element = k.group == 4;
    const int gate_w = per_element ? H * D : H;
    const auto q = RandomBf16(static_cast<size_t>(tokens) * H * D, 43, 1.5f);
    const auto gate = RandomBf16(static_cast<size_t>(tokens) * gate_w, 44, 1.0f);
    auto d_q = Upload(q), d_g = Upload(gate), d_k = Upload(c.k), d_v = Upload(c.v), d_t = Upload(c.table);
    auto d_o = Alloc(static_cast<size_t>(tokens) * H * D * 2, 0);
    AttentionParams p;
    p.q = d_q.as<bf16>(), p.k_pool = d_k.data(), p.v_pool = d_v.data(), p.block_table = d_t.as<int32_t>();
    p.max_position = tokens - 1, p.num_q_heads = H, p.num_kv_heads = K, p.head_dim = D, p.page_size = k.page_size;
    p.kv_dtype = k.kv_dtype, p.window_kind = k.window, p.window = window, p.k_scale = k_scale, p.v_scale = v_scale;
    p.gate = d_g.as<bf16>(), p.gate_stride = gate_w, p.gate_per_element = per_element, p.out = d_o.as<bf16>();
    // Rows [f, f + n) as one launch, into their own rows of d_o.
    auto launch = [&](int f, int n) {
      AttentionParams a = p;
      a.q += static_cast<size_t>(f) * H * D, a.gate += static_cast<size_t>(f) * gate_w;
      a.out += static_cast<size_t>(f) * H * D, a.first_position = f, a.num_tokens = n;
      ASSERT_OK(RunAttention(*kernel, a, nullptr, AttnKind::kPrompt));
    };
    auto prompt_rows = [&](int chunk) {
      for (int f = first; f < tokens; f += chunk) launch(f, std::min(chunk, tokens - f));
      Sync();
      return Rows(Download<bf16>(d_o, static_cast<size_t>(tokens) * H * D), static_cast<size_t>(H) * D, first, T);
    };
    const std::vector<bf16> whole = prompt_rows(T);
    EXPECT_EQ(prompt_rows(T), whole) << "run to run";
    for (int chunk : {37, 100, 512}) EXPECT_EQ(prompt_rows(chunk), whole) << "prompt chunks of " << chunk;
    // Against the reference, on the host, over the last 40 rows (three tiles, one partial). The
    // kernel rounds each probability to BF16 for P V (up to 2^-9 relative), which moves an output by
    // up to 2^-9 max|v| before the gate multiplies it: a bound that does not shrink where few keys
    // are visible (the tiny presets' window of 8) or where the output cancels to near zero. So the
    // tolerance is the split kernel's (2e-3 absolute, 1/64 relative) plus 2^-9 max|v| max gate.
    const int tail = 40, f = tokens - tail;
    launch(f, tail);
    Sync();
    const auto got = Rows(Download<bf16>(d_o, static_cast<size_t>(tokens) * H * D), static_cast<size_t>(H) * D, f, tail);
    EXPECT_EQ(got, Rows(whole, static_cast<size_t>(H) * D, T - tail, tail)) << "the last rows alone";
    std::vector<bf16> ref(got.size());
    AttentionParams h = p;
    h.q = q.data() + static_cast<size_t>(f) * H * D, h.k_pool = c.k.data(), h.v_pool = c.v.data();
    h.block_table = c.table.data(), h.gate = gate.data() + static_cast<size_t>(f) * gate_w, h.out = ref.data();
    h.first_position = f, h.num_tokens = tail;
    ref::Attention(h);
    float v_max = 0.0f, gate_max = 0.0f;
    for (int s = 0; s < tokens; ++s) {
      for (int e = 0; e < K * D; ++e) {
        const size_t idx = (static_cast<size_t>(c.table[s / k.page_size]) * k.page_size + s % k.page_size) * K * D + e;
        float v;
        if (k.kv_dtype == KvDtype::kFp8) {
          v = Fp8E4M3ToFloat(c.v[idx]) * v_scale;
        } else {
          uint16_t b16;
          std::memcpy(&b16, &c.v[2 * idx], 2);
          v = Bf16ToFloat(b16);
        }
        v_max = std::max(v_max, std::fabs(v));
      }
    }
    for (size_t i = static_cast<size_t>(f) * gate_w; i < gate.size(); ++i) gate_max = std::max(gate_max, ref::Softplus(Bf16ToFloat(gate[i])));
    ExpectClose(got, ref, 2e-3f + std::ldexp(v_max * gate_max, -9), 1.0f / 64, info.name + " prompt kernel vs reference");
    const std::string shape = fmt::format("d{}_g{}_{}_{}", D, k.group, KvDtypeName(k.kv_dtype), WindowKindName(k.window));
    auto [it, first_page_size] = by_shape.emplace(shape, whole);
    if (!first_page_size) EXPECT_EQ(whole, it->second) << "page sizes differ";
  }
}

// The cluster merge (chunk partials through distributed shared memory) gives the ticket merge's bits:
// every built preset, prefill of 3 tokens and decode, at contexts of 1 to 8 chunks (the cluster
// sizes it takes), with the decode grid sized for a larger bound too.
TEST(AttentionGpu, ClusterMergeMatchesTicketMerge) {
  SKIP_WITHOUT_GPU();
  for (const PresetInfo& info : AllPresets()) {
    if (!info.built) continue;
    SCOPED_TRACE(info.name);
    const AttnPresetKey& k = info.key;
    const auto [K, H, window] = TestShapeOf(k);
    for (int tokens : {40, 300, 900}) {
      SCOPED_TRACE(testing::Message() << tokens << " tokens");
      Cache c = MakeCache(K, k.head_dim, k.page_size, k.kv_dtype, tokens, 37, 0.5f, 0.25f);
      auto kernel = ResolveAttention(k);
      ASSERT_TRUE(kernel.ok()) << kernel.status().message();
      for (auto [first, T, bound] : {std::tuple{tokens - 3, 3, tokens - 1}, std::tuple{tokens - 1, 1, tokens - 1},
                                     std::tuple{tokens - 1, 1, 1000}}) {
        AttentionParams probe;
        probe.max_position = bound, probe.window_kind = k.window, probe.window = window;
        ASSERT_LE(AttentionMaxChunks(probe), kAttnMaxClusterChunks);
        AttnRun ticket = RunAttn(*kernel, c, H, k.window, window, first, T, bound, k.group == 4, 43, false, 0);
        AttnRun cluster = RunAttn(*kernel, c, H, k.window, window, first, T, bound, k.group == 4, 43, false,
                                  kAttnMaxClusterChunks);
        EXPECT_EQ(cluster.out, ticket.out) << "first " << first << " T " << T << " bound " << bound;
      }
    }
  }
}

TEST(AttentionGpu, MissingPresetErrorsAndFallbackMatchesReference) {
  SKIP_WITHOUT_GPU();
  const AttnPresetKey key{64, 4, 8, KvDtype::kBf16, WindowKind::kSliding};  // not in presets.def
  auto missing = ResolveAttention(key);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find(CanonicalName(key)), std::string::npos);
  auto fb = ResolveAttention(key, true);
  ASSERT_TRUE(fb.ok());
  EXPECT_TRUE(fb->fallback);
  Cache c = MakeCache(2, 64, 8, KvDtype::kBf16, 200, 71, 1.0f, 1.0f);
  AttnRun a = RunAttn(*fb, c, 8, WindowKind::kSliding, 37, 197, 3, 199, true, 81);
  ExpectClose(a.out, a.ref, 2e-3f, 1.0f / 64, "fallback");
  // A preset kernel refuses parameters of another preset.
  auto names = BuiltPresetNames();
  if (!names.empty()) {
    for (const auto& info : AllPresets()) {
      if (!info.built) continue;
      AttentionKernel wrong = *ResolveAttention(info.key);
      AttentionParams p;
      p.q = reinterpret_cast<const bf16*>(16), p.k_pool = p.v_pool = p.q, p.out = nullptr;
      p.block_table = reinterpret_cast<const int32_t*>(16);
      p.out = reinterpret_cast<bf16*>(16);
      p.num_q_heads = 8, p.num_kv_heads = 2, p.head_dim = 64, p.page_size = 8;
      p.window_kind = WindowKind::kGlobal;
      EXPECT_FALSE(RunAttention(wrong, p, nullptr).ok());
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// The multi-row (prefill) kernel against the one-row kernel: the same launch (same q, gate, cache,
// positions) once with multi_row_min_tokens = 0 (never) and once with 1 (always), compared bit for bit
// (every output element; the BF16 vectors compare as bits). Rows may come from several sequences
// (token_seq) at any positions.
struct MultiRowCase {
  std::vector<int32_t> positions;   // per row
  std::vector<int32_t> seq;         // per row; empty: one sequence (block_table itself)
  int max_position = 0;
};
struct MultiRowResult {
  std::vector<bf16> one_row, multi_row, ref;
};
// `tables`: [num_seqs, stride] block tables over the pool of `c` (c.table when there is one sequence).
MultiRowResult RunOneRowAndMultiRow(const AttentionKernel& kernel, const Cache& c, const std::vector<int32_t>& tables,
                                    int stride, int H, WindowKind win, int window, const MultiRowCase& mc,
                                    bool per_element_gate, uint64_t key, bool want_ref) {
  const int D = c.D, T = static_cast<int>(mc.positions.size());
  const int gate_w = per_element_gate ? H * D : H;
  const size_t q_n = static_cast<size_t>(T) * H * D, g_n = static_cast<size_t>(T) * gate_w;
  auto d_q = Alloc(q_n * 2), d_g = Alloc(g_n * 2);
  EXPECT_TRUE(FillRandomBf16(d_q.as<bf16>(), q_n, key, 1.5f, nullptr).ok());
  EXPECT_TRUE(FillRandomBf16(d_g.as<bf16>(), g_n, key + 1, 1.0f, nullptr).ok());
  auto d_k = Upload(c.k), d_v = Upload(c.v), d_t = Upload(tables), d_pos = Upload(mc.positions);
  auto d_seq = Upload(mc.seq.empty() ? std::vector<int32_t>{0} : mc.seq);
  AttentionParams p;
  p.q = d_q.as<bf16>(), p.k_pool = d_k.data(), p.v_pool = d_v.data(), p.block_table = d_t.as<int32_t>();
  p.token_seq = mc.seq.empty() ? nullptr : d_seq.as<int32_t>(), p.block_table_stride = mc.seq.empty() ? 0 : stride;
  p.positions = d_pos.as<int32_t>(), p.max_position = mc.max_position;
  p.history_stable = true;  // the whole cache is written before the launch (the one-row kernel's early loads)
  p.history = d_pos.as<int32_t>();
  p.num_tokens = T, p.num_q_heads = H, p.num_kv_heads = c.K, p.head_dim = D, p.page_size = c.P;
  p.kv_dtype = c.kv, p.window_kind = win, p.window = window, p.k_scale = 0.5f, p.v_scale = 0.25f;
  p.gate = d_g.as<bf16>(), p.gate_stride = gate_w, p.gate_per_element = per_element_gate;
  auto d_ws = Alloc(AttentionWorkspaceBytes(p));
  auto d_counters = Alloc(static_cast<size_t>(T) * c.K * 4, 0);
  auto d_o = Alloc(q_n * 2);
  p.workspace = d_ws.data(), p.workspace_bytes = d_ws.size(), p.counters = d_counters.as<uint32_t>();
  p.out = d_o.as<bf16>();
  MultiRowResult r;
  for (int min_tokens : {0, 1}) {
    EXPECT_TRUE(d_o.Fill(0xff).ok());     // poison: an output left unwritten is NaN and differs
    EXPECT_TRUE(d_ws.Fill(0xff).ok());
    p.multi_row_min_tokens = min_tokens;
    const Status st = RunAttention(kernel, p, nullptr);
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    (min_tokens ? r.multi_row : r.one_row) = Download<bf16>(d_o, q_n);
    const auto left = Download<uint32_t>(d_counters, static_cast<size_t>(T) * c.K);
    EXPECT_EQ(std::count(left.begin(), left.end(), 0u), static_cast<long>(left.size()))
        << "tickets handed back (multi_row_min_tokens " << min_tokens << ")";
  }
  if (want_ref) {
    const auto q = Download<bf16>(d_q, q_n), g = Download<bf16>(d_g, g_n);
    r.ref.resize(q_n);
    AttentionParams h = p;
    h.q = q.data(), h.k_pool = c.k.data(), h.v_pool = c.v.data(), h.block_table = tables.data();
    h.token_seq = mc.seq.empty() ? nullptr : mc.seq.data(), h.positions = mc.positions.data();
    h.history = nullptr, h.gate = g.data(), h.out = r.ref.data();
    ref::Attention(h);
  }
  return r;
}

MultiRowCase Prompt(int first, int T, int extra_bound = 0) {
  MultiRowCase mc;
  for (int i = 0; i < T; ++i) mc.positions.push_back(first + i);
  mc.max_position = first + T - 1 + extra_bound;
  return mc;
}

// Every built preset (D 128 G 6/8, D 32 G 2/4, D 16; FP8 and BF16; pages 16/32/64 as built): prompts of
// 1, 37, 100, 512 and 700 rows at positions 0.. and 1000.. (history in the cache), sliding windows of
// 512 and 40 (shorter than most prompts), one grid sized for a larger bound; and against the CPU
// reference on the cheaper shapes.
TEST(AttentionGpu, MultiRowKernelMatchesOneRowKernelBitForBit) {
  SKIP_WITHOUT_GPU();
  for (const PresetInfo& info : AllPresets()) {
    if (!info.built) continue;
    SCOPED_TRACE(info.name);
    const AttnPresetKey& k = info.key;
    const int K = k.head_dim == 128 ? 8 : 2, H = K * k.group;
    const Cache c = MakeCache(K, k.head_dim, k.page_size, k.kv_dtype, 1700, 91, 0.5f, 0.25f);
    auto kernel = ResolveAttention(k);
    ASSERT_TRUE(kernel.ok()) << kernel.status().message();
    const std::vector<int> windows = k.window == WindowKind::kSliding ? std::vector<int>{512, 40} : std::vector<int>{0};
    for (int window : windows) {
      for (int first : {0, 1000}) {
        for (int T : {1, 37, 100, 512, 700}) {
          SCOPED_TRACE(testing::Message() << "window " << window << " first " << first << " T " << T);
          const MultiRowResult r = RunOneRowAndMultiRow(*kernel, c, c.table, 0, H, k.window, window, Prompt(first, T),
                                                        k.group == 4, 300 + T + first, false);
          EXPECT_EQ(r.multi_row, r.one_row);
        }
      }
      // A grid sized for a larger bound (a captured graph's max_position): still the same bits.
      const MultiRowResult big = RunOneRowAndMultiRow(*kernel, c, c.table, 0, H, k.window, window,
                                                      Prompt(1000, 100, 600), k.group == 4, 77, false);
      EXPECT_EQ(big.multi_row, big.one_row) << "max_position bound 1699";
      // Against the CPU reference (the tolerance of EveryBuiltPresetMatchesReference).
      const bool cheap = k.head_dim < 128;
      const MultiRowResult r = RunOneRowAndMultiRow(*kernel, c, c.table, 0, H, k.window, window,
                                                    cheap ? Prompt(990, 37) : Prompt(0, 37), k.group == 4, 78, true);
      EXPECT_EQ(r.multi_row, r.one_row);
      ExpectClose(r.multi_row, r.ref, 2e-3f, 1.0f / 64, info.name + " multi-row vs reference");
    }
  }
}

// One launch mixing several sequences (token_seq): two prefill chunks, decode rows between them, and
// rows of one sequence at positions that are neither consecutive nor ascending. The multi-row kernel
// splits a block's rows into sets by block table and span; every row gets the one-row kernel's bits.
TEST(AttentionGpu, MultiRowKernelTakesRowsOfSeveralSequences) {
  SKIP_WITHOUT_GPU();
  for (const PresetInfo& info : AllPresets()) {
    if (!info.built) continue;
    SCOPED_TRACE(info.name);
    const AttnPresetKey& k = info.key;
    const int K = k.head_dim == 128 ? 8 : 2, H = K * k.group, D = k.head_dim, P = k.page_size;
    // Four sequences of 1400, 300, 900 and 1600 tokens, each with its own pages of one pool.
    const int lens[4] = {1400, 300, 900, 1600};
    std::vector<Cache> caches;
    for (int s = 0; s < 4; ++s) caches.push_back(MakeCache(K, D, P, k.kv_dtype, lens[s], 200 + s, 0.5f, 0.25f));
    Cache pool = caches[0];
    pool.k.clear(), pool.v.clear(), pool.num_pages = 0;
    int stride = 0;
    for (const Cache& c : caches) stride = std::max(stride, c.num_pages);
    std::vector<int32_t> tables(4 * static_cast<size_t>(stride), 0);
    for (int s = 0; s < 4; ++s) {
      for (int i = 0; i < caches[s].num_pages; ++i) tables[s * stride + i] = pool.num_pages + caches[s].table[i];
      pool.k.insert(pool.k.end(), caches[s].k.begin(), caches[s].k.end());
      pool.v.insert(pool.v.end(), caches[s].v.begin(), caches[s].v.end());
      pool.num_pages += caches[s].num_pages;
    }
    MultiRowCase mc;
    auto add = [&](int seq, int first, int n) {
      for (int i = 0; i < n; ++i) mc.seq.push_back(seq), mc.positions.push_back(first + i);
    };
    add(0, 1200, 100);  // a prefill chunk with history
    add(2, 899, 1);     // a decode row
    add(1, 0, 37);      // a prompt from the start
    add(3, 1599, 1);    // another decode row
    add(0, 1300, 3);    // the first sequence again
    for (int p : {1000, 40, 1399, 41, 700, 5}) mc.seq.push_back(0), mc.positions.push_back(p);  // anywhere
    add(1, 37, 40);     // the second sequence's next chunk
    mc.max_position = 1599;
    auto kernel = ResolveAttention(k);
    ASSERT_TRUE(kernel.ok()) << kernel.status().message();
    const std::vector<int> windows = k.window == WindowKind::kSliding ? std::vector<int>{512, 40} : std::vector<int>{0};
    for (int window : windows) {
      SCOPED_TRACE(testing::Message() << "window " << window);
      const MultiRowResult r = RunOneRowAndMultiRow(*kernel, pool, tables, stride, H, k.window, window, mc,
                                                    k.group == 4, 500 + window, D < 128);
      EXPECT_EQ(r.multi_row, r.one_row);
      if (D < 128) ExpectClose(r.multi_row, r.ref, 2e-3f, 1.0f / 64, info.name + " mixed batch vs reference");
    }
  }
}

// RunAttention's checks on the multi-row path: a workspace too small, no counters, a negative
// threshold; each refused before any launch (the output stays poisoned).
TEST(AttentionGpu, MultiRowPathRejectsBadParameters) {
  SKIP_WITHOUT_GPU();
  for (const PresetInfo& info : AllPresets()) {
    if (!info.built) continue;
    const AttnPresetKey& k = info.key;
    const int K = k.head_dim == 128 ? 8 : 2, H = K * k.group, T = 64;
    const Cache c = MakeCache(K, k.head_dim, k.page_size, k.kv_dtype, 200, 11, 0.5f, 0.25f);
    auto kernel = ResolveAttention(k);
    ASSERT_TRUE(kernel.ok());
    auto d_q = Alloc(static_cast<size_t>(T) * H * k.head_dim * 2, 0), d_o = Alloc(static_cast<size_t>(T) * H * k.head_dim * 2);
    auto d_k = Upload(c.k), d_v = Upload(c.v), d_t = Upload(c.table);
    AttentionParams p;
    p.q = d_q.as<bf16>(), p.k_pool = d_k.data(), p.v_pool = d_v.data(), p.block_table = d_t.as<int32_t>();
    p.first_position = 100, p.max_position = 199, p.num_tokens = T, p.num_q_heads = H, p.num_kv_heads = K;
    p.head_dim = k.head_dim, p.page_size = k.page_size, p.kv_dtype = k.kv_dtype, p.window_kind = k.window;
    p.window = 40, p.out = d_o.as<bf16>(), p.multi_row_min_tokens = 1;
    auto d_ws = Alloc(AttentionWorkspaceBytes(p)), d_counters = Alloc(static_cast<size_t>(T) * K * 4, 0);
    p.workspace = d_ws.data(), p.workspace_bytes = d_ws.size() - 4, p.counters = d_counters.as<uint32_t>();
    const Status small = RunAttention(*kernel, p, nullptr);
    EXPECT_EQ(small.code(), StatusCode::kInvalidArgument) << info.name;
    EXPECT_NE(small.message().find("workspace"), std::string::npos) << small.message();
    p.workspace_bytes = d_ws.size();
    p.counters = nullptr;
    EXPECT_EQ(RunAttention(*kernel, p, nullptr).code(), StatusCode::kInvalidArgument) << info.name;
    p.counters = d_counters.as<uint32_t>();
    p.multi_row_min_tokens = -5;
    EXPECT_EQ(RunAttention(*kernel, p, nullptr).code(), StatusCode::kInvalidArgument) << info.name;
    Sync();
    const auto out = Download<bf16>(d_o, static_cast<size_t>(T) * H * k.head_dim);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](bf16 v) { return v == 0xffff; })) << "nothing launched";
    p.multi_row_min_tokens = 1;  // and the good parameters run
    ASSERT_OK(RunAttention(*kernel, p, nullptr));
    Sync();
    const auto ran = Download<bf16>(d_o, static_cast<size_t>(T) * H * k.head_dim);
    EXPECT_EQ(std::count(ran.begin(), ran.end(), bf16{0xffff}), 0) << info.name;
  }
}

// ---------------------------------------------------------------------------------------------------
TEST(GemvGpu, MatchesReferenceAndIsBatchInvariant) {
  SKIP_WITHOUT_GPU();
  // k_split 0 = the shape's default (4 for 2,048 x 8,192); every split must match and be invariant.
  for (auto [out, in, ks] : {std::tuple{1000, 2048, 0}, std::tuple{64, 512, 0}, std::tuple{2048, 8192, 0},
                             std::tuple{2048, 8192, 1}, std::tuple{2048, 8192, 2},
                             std::tuple{300, 8192, 8}, std::tuple{10304, 2048, 0}}) {
    SCOPED_TRACE(testing::Message() << out << "x" << in << " k_split " << ks);
    const int T = 37;  // several token tiles of every width, the last one partial
    auto w = RandomBf16(static_cast<size_t>(out) * in, 91, 0.05f), x = RandomBf16(T * in, 92);
    auto d_w = Upload(w), d_x = Upload(x);
    auto d_y = Alloc(T * out * 2), d_y1 = Alloc(out * 2);
    GemvParams p{d_w.as<bf16>(), d_x.as<bf16>(), d_y.as<bf16>(), out, in, T, 0, 0, ks};
    ASSERT_OK(Gemv(p, nullptr));
    std::vector<bf16> ref(T * out);
    GemvParams r{w.data(), x.data(), ref.data(), out, in, T, 0, 0};
    ref::Gemv(r);
    const auto y = Download<bf16>(d_y, T * out);
    ExpectClose(y, ref, 1e-4f, 1.0f / 128, "gemm out " + std::to_string(out));
    for (int t : {0, 7, 10, 36}) {
      GemvParams one{d_w.as<bf16>(), d_x.as<bf16>() + t * in, d_y1.as<bf16>(), out, in, 1, 0, 0, ks};
      ASSERT_OK(Gemv(one, nullptr));
      EXPECT_EQ(Download<bf16>(d_y1, out), Rows(y, out, t, 1)) << "token " << t;
    }
    // Every batched-kernel shape (rows per warp, tokens per tile) and other token counts: the same bits.
    for (auto [rows, tokens] : {std::pair{1, 4}, std::pair{1, 16}, std::pair{2, 4}, std::pair{2, 16}, std::pair{4, 8},
                                std::pair{4, 16}}) {
      for (int n : {2, 9, T}) {
        GemvParams q = p;
        q.num_tokens = n;
        q.batch_rows = rows, q.batch_tokens = tokens;
        auto d_yq = Alloc(static_cast<size_t>(n) * out * 2);
        q.y = d_yq.as<bf16>();
        ASSERT_OK(Gemv(q, nullptr));
        Sync();
        EXPECT_EQ(Download<bf16>(d_yq, static_cast<size_t>(n) * out), Rows(y, out, 0, n))
            << "rows/warp " << rows << " tokens/tile " << tokens << " T " << n;
      }
    }
  }
}

// The streaming GEMV (TMA bulk copies through a shared-memory ring) gives the plain kernel's bits:
// the decode shapes (q/k/v/g, o_proj, a slice of the LM head), shapes whose last block or stage is
// partial, an input width that is not a multiple of 32 chunks, and small rings that reuse every slot
// many times (the mbarrier phases).
TEST(GemvGpu, StreamMatchesPlainBitForBit) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int out, in, ring_kb, stage_kb;
  };
  for (const Case c : {Case{10304, 2048, 128, 16}, Case{2048, 8192, 128, 16}, Case{20000, 2048, 128, 16},
                       Case{1001, 2048, 128, 16}, Case{1000, 2056, 128, 16}, Case{300, 8192, 128, 16},
                       Case{64, 512, 128, 16}, Case{10304, 2048, 32, 4}, Case{2048, 8192, 32, 1},
                       Case{5000, 1024, 200, 32}}) {
    SCOPED_TRACE(testing::Message() << c.out << "x" << c.in << " ring " << c.ring_kb << " KB stage " << c.stage_kb);
    ASSERT_TRUE(GemvStreamSupported(c.out, c.in, c.ring_kb, c.stage_kb));
    auto d_w = Upload(RandomBf16(static_cast<size_t>(c.out) * c.in, 101, 0.05f)), d_x = Upload(RandomBf16(c.in, 102));
    auto d_y0 = Alloc(c.out * 2), d_y1 = Alloc(c.out * 2);
    GemvParams p{d_w.as<bf16>(), d_x.as<bf16>(), d_y0.as<bf16>(), c.out, c.in, 1};
    ASSERT_OK(Gemv(p, nullptr));
    GemvParams st = p;
    st.y = d_y1.as<bf16>();
    for (int prefetch_kb : {0, 32, c.ring_kb}) {  // the producer's wait at every point of its loop
      st.streaming = {true, c.ring_kb, c.stage_kb, prefetch_kb};
      ASSERT_OK(Gemv(st, nullptr));
      Sync();
      EXPECT_EQ(Download<bf16>(d_y1, c.out), Download<bf16>(d_y0, c.out)) << "prefetch " << prefetch_kb << " KB";
    }
    GemvParams two = st;
    two.num_tokens = 2;
    EXPECT_FALSE(Gemv(two, nullptr).ok()) << "streaming is batch 1 only";
  }
  EXPECT_FALSE(GemvStreamSupported(64, 65536, 128, 16)) << "two stages of one 128 KB row do not fit";
  EXPECT_FALSE(GemvStreamSupported(10304, 2048, 16, 4)) << "one 16 KB stage (4 rows of 4 KB) is no ring";
}

// A norm folded into the GEMV (FusedInputNorm) gives the bits of AddRmsNorm followed by the GEMV: y,
// the updated residual (written to the other buffer) and u; with 1 and 11 tokens (11 = two tiles),
// with and without delta, and with the widest row the norm takes; at one token also through the
// streaming kernel (its consumer warps run the norm on their named barrier), with the decode step's
// q/k/v/g shape, a small ring that reuses every slot, and the producer's wait at both ends.
TEST(GemvGpu, FusedInputNormMatchesSeparateKernels) {
  SKIP_WITHOUT_GPU();
  for (auto [out, in, T, with_delta] :
       {std::tuple{1000, 2048, 1, true}, std::tuple{1000, 2048, 11, true}, std::tuple{300, 2048, 3, false},
        std::tuple{64, 8192, 2, true}, std::tuple{10304, 2048, 1, true}, std::tuple{700, 8192, 1, false}}) {
    SCOPED_TRACE(testing::Message() << out << "x" << in << " T " << T << " delta " << with_delta);
    auto w = RandomBf16(static_cast<size_t>(out) * in, 96, 0.05f);
    auto h = RandomBf16(static_cast<size_t>(T) * in, 97, 4.0f), dl = RandomBf16(static_cast<size_t>(T) * in, 98);
    auto nw = RandomBf16(in, 99);
    auto d_w = Upload(w), d_nw = Upload(nw), d_dl = Upload(dl);
    // Separate: AddRmsNorm in place, then the GEMV of u.
    auto d_h_sep = Upload(h), d_u = Alloc(static_cast<size_t>(T) * in * 2), d_y_sep = Alloc(static_cast<size_t>(T) * out * 2);
    AddRmsNormParams np{d_h_sep.as<bf16>(), with_delta ? d_dl.as<bf16>() : nullptr, d_nw.as<bf16>(), d_u.as<bf16>(),
                        T, in, 1e-6f};
    ASSERT_OK(AddRmsNorm(np, nullptr));
    GemvParams sep{d_w.as<bf16>(), d_u.as<bf16>(), d_y_sep.as<bf16>(), out, in, T};
    ASSERT_OK(Gemv(sep, nullptr));
    // Fused: x is not read (null); the residual goes to a second buffer, u to a third.
    auto d_h = Upload(h), d_h_out = Alloc(static_cast<size_t>(T) * in * 2), d_u_out = Alloc(static_cast<size_t>(T) * in * 2);
    auto d_y = Alloc(static_cast<size_t>(T) * out * 2);
    GemvParams fused{d_w.as<bf16>(), nullptr, d_y.as<bf16>(), out, in, T};
    fused.norm.residual = d_h.as<bf16>();
    fused.norm.delta = with_delta ? d_dl.as<bf16>() : nullptr;
    fused.norm.weight = d_nw.as<bf16>();
    fused.norm.residual_out = with_delta ? d_h_out.as<bf16>() : nullptr;
    fused.norm.u_out = d_u_out.as<bf16>();
    fused.norm.eps = 1e-6f;
    ASSERT_OK(Gemv(fused, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_y, static_cast<size_t>(T) * out), Download<bf16>(d_y_sep, static_cast<size_t>(T) * out));
    EXPECT_EQ(Download<bf16>(d_u_out, static_cast<size_t>(T) * in), Download<bf16>(d_u, static_cast<size_t>(T) * in));
    EXPECT_EQ(Download<bf16>(d_h, static_cast<size_t>(T) * in), h) << "the input residual is never written";
    if (with_delta) {
      EXPECT_EQ(Download<bf16>(d_h_out, static_cast<size_t>(T) * in), Download<bf16>(d_h_sep, static_cast<size_t>(T) * in));
    }
    if (T != 1) continue;
    for (auto [ring_kb, stage_kb, prefetch_kb] : {std::tuple{128, 32, 64}, std::tuple{32, 4, 0}, std::tuple{32, 4, 32}}) {
      SCOPED_TRACE(testing::Message() << "streaming, ring " << ring_kb << " KB, stage " << stage_kb << " KB, prefetch "
                                      << prefetch_kb << " KB");
      ASSERT_TRUE(GemvStreamSupported(out, in, ring_kb, stage_kb));
      auto d_y_st = Alloc(static_cast<size_t>(out) * 2), d_h_st = Alloc(static_cast<size_t>(in) * 2);
      auto d_u_st = Alloc(static_cast<size_t>(in) * 2);
      GemvParams st = fused;
      st.y = d_y_st.as<bf16>();
      st.norm.residual_out = with_delta ? d_h_st.as<bf16>() : nullptr;
      st.norm.u_out = d_u_st.as<bf16>();
      st.streaming = {true, ring_kb, stage_kb, prefetch_kb};
      ASSERT_OK(Gemv(st, nullptr));
      Sync();
      EXPECT_EQ(Download<bf16>(d_y_st, out), Download<bf16>(d_y_sep, out));
      EXPECT_EQ(Download<bf16>(d_u_st, in), Download<bf16>(d_u, in));
      EXPECT_EQ(Download<bf16>(d_h, in), h) << "the input residual is never written";
      if (with_delta) EXPECT_EQ(Download<bf16>(d_h_st, in), Download<bf16>(d_h_sep, in));
    }
  }
  // In place is refused: other blocks still read the residual.
  auto buf = Alloc(2048 * 2), wv = Alloc(64 * 2048 * 2), yv = Alloc(64 * 2);
  GemvParams bad{wv.as<bf16>(), nullptr, yv.as<bf16>(), 64, 2048, 1};
  bad.norm.residual = buf.as<bf16>();
  bad.norm.weight = buf.as<bf16>();
  bad.norm.residual_out = buf.as<bf16>();
  EXPECT_FALSE(Gemv(bad, nullptr).ok());
}

// ---------------------------------------------------------------------------------------------------
// The tensor-core product (GemvParams::mma, ops.h 5b). Its promise: a token's outputs depend on its
// x row and the shape only. Checked against the FP32 reference (tolerance: BF16 operands, FP32 sums
// in another order), then bit for bit: every row of a 1,000-token launch (tiled kernel) equals that
// row launched alone (register kernel, and the tiled kernel at one token), equals the register
// kernel over the same 1,000 tokens, and equals it inside launches of 2, 5, 8, 16, 17 and 64 tokens
// starting at several offsets (every position inside the 8-token MMA columns and the 128-token tiles).
constexpr int kMmaAlwaysRegister = 1 << 30;

struct MmaShape {
  int out, in, ks;
};

// y = the product of rows [first, first + n) of x (device, [*, in]) into y (device, [n, out]).
Status RunMma(const cuda::DeviceBuffer& w, const cuda::DeviceBuffer& x, cuda::DeviceBuffer& y, const MmaShape& s,
              int first, int n, int tiled_min_tokens, size_t y_row = 0) {
  GemvParams p{w.as<bf16>(), x.as<bf16>() + static_cast<size_t>(first) * s.in,
               y.as<bf16>() + y_row * s.out, s.out, s.in, n, 0, 0, s.ks};
  p.mma = true;
  p.mma_tiled_min_tokens = tiled_min_tokens;
  return Gemv(p, nullptr);
}

void CheckMmaShape(const MmaShape& s, int big_t, bool every_row_alone) {
  SCOPED_TRACE(testing::Message() << s.out << "x" << s.in << " k_split " << s.ks << " (default "
                                  << MmaKSplitFor(s.out, s.in) << ")");
  auto w = RandomBf16(static_cast<size_t>(s.out) * s.in, 191, 0.05f);
  auto x = RandomBf16(static_cast<size_t>(big_t) * s.in, 192);
  auto d_w = Upload(w), d_x = Upload(x);
  // Close to the reference: 17 tokens (two column tiles of the register kernel, the second partial).
  {
    const int T = 17;
    auto d_y = Alloc(static_cast<size_t>(T) * s.out * 2);
    ASSERT_OK(RunMma(d_w, d_x, d_y, s, 0, T, kMmaAlwaysRegister));
    std::vector<bf16> ref(static_cast<size_t>(T) * s.out);
    GemvParams r{w.data(), x.data(), ref.data(), s.out, s.in, T, 0, 0};
    ref::Gemv(r);
    const auto y = Download<bf16>(d_y, ref.size());
    ExpectClose(y, ref, 1e-3f, 1.0f / 128, "mma vs reference");
    double num = 0, den = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      const double d = Bf16ToFloat(y[i]) - Bf16ToFloat(ref[i]);
      num += d * d, den += static_cast<double>(Bf16ToFloat(ref[i])) * Bf16ToFloat(ref[i]);
    }
    EXPECT_LT(std::sqrt(num / den), 4e-3) << "relative L2 error";
  }
  // The big launch through the tiled kernel, and through the register kernel: the same bits.
  const size_t big = static_cast<size_t>(big_t) * s.out;
  auto d_big = Alloc(big * 2), d_big_reg = Alloc(big * 2);
  ASSERT_OK(RunMma(d_w, d_x, d_big, s, 0, big_t, 1));
  ASSERT_OK(RunMma(d_w, d_x, d_big_reg, s, 0, big_t, kMmaAlwaysRegister));
  Sync();
  const auto want = Download<bf16>(d_big, big);
  for (size_t i = 0; i < big; ++i) ASSERT_FALSE(std::isnan(Bf16ToFloat(want[i]))) << "unwritten element " << i;
  EXPECT_EQ(Download<bf16>(d_big_reg, big), want) << "register kernel at " << big_t << " tokens";
  // Every row alone (register kernel), each into its own row of one buffer; a few through the tiled
  // kernel at one token.
  {
    auto d_alone = Alloc(big * 2);
    const int step = every_row_alone ? 1 : 13;
    for (int t = 0; t < big_t; t += step) ASSERT_OK(RunMma(d_w, d_x, d_alone, s, t, 1, kMmaAlwaysRegister, t));
    Sync();
    const auto alone = Download<bf16>(d_alone, big);
    int bad = 0;
    for (int t = 0; t < big_t && bad < 5; t += step) {
      if (Rows(alone, s.out, t, 1) != Rows(want, s.out, t, 1)) {
        ADD_FAILURE() << "token " << t << " alone differs from token " << t << " of " << big_t;
        ++bad;
      }
    }
    auto d_one = Alloc(static_cast<size_t>(s.out) * 2);
    for (int t : {0, 1, 7, 130, big_t - 1}) {
      ASSERT_OK(RunMma(d_w, d_x, d_one, s, t, 1, 1));
      Sync();
      EXPECT_EQ(Download<bf16>(d_one, s.out), Rows(want, s.out, t, 1)) << "tiled kernel, token " << t << " alone";
    }
  }
  // Other token counts at several offsets, through both kernels.
  for (int n : {2, 5, 8, 16, 17, 64}) {
    auto d_yn = Alloc(static_cast<size_t>(n) * s.out * 2);
    for (int first : {0, 3, 61, big_t - n}) {
      for (int tiled_min : {kMmaAlwaysRegister, 1}) {
        ASSERT_OK(RunMma(d_w, d_x, d_yn, s, first, n, tiled_min));
        Sync();
        EXPECT_EQ(Download<bf16>(d_yn, static_cast<size_t>(n) * s.out), Rows(want, s.out, first, n))
            << n << " tokens from " << first << (tiled_min == 1 ? " (tiled)" : " (register)");
      }
    }
  }
}

TEST(MmaGpu, MatchesReferenceAndEveryRowIsItsAloneResult) {
  SKIP_WITHOUT_GPU();
  // The decode shapes (q/k/v/g of both layer kinds, o_proj of both, the dense MLP), a slice of the
  // LM head's width, explicit splits, and odd shapes: out not a multiple of 16 or 128, in a multiple
  // of 8 but not of 32 (a zero-padded last chunk).
  for (const MmaShape s : {MmaShape{10304, 2048, 0}, MmaShape{8240, 2048, 0}, MmaShape{2048, 8192, 0},
                           MmaShape{2048, 6144, 0}, MmaShape{2048, 8192, 1}, MmaShape{300, 8192, 8},
                           MmaShape{1001, 2056, 0}, MmaShape{1000, 2048, 4}, MmaShape{64, 512, 0}}) {
    CheckMmaShape(s, 1000, /*every_row_alone=*/s.out * static_cast<size_t>(s.in) <= 2048u * 8192u);
    if (HasFatalFailure()) return;
  }
}

// Small odd shapes (also what compute-sanitizer runs: tools/device/mma_check.sh).
TEST(MmaGpu, OddShapesEveryKernel) {
  SKIP_WITHOUT_GPU();
  for (const MmaShape s : {MmaShape{37, 72, 0}, MmaShape{16, 32, 0}, MmaShape{129, 264, 0}, MmaShape{200, 512, 2},
                           MmaShape{17, 1024, 8}}) {
    CheckMmaShape(s, 300, true);
    if (HasFatalFailure()) return;
  }
}

// x [T][in] as rows of xs elements, the gaps 1e30 (a product that read one would show it).
std::vector<bf16> StridedRows(const std::vector<bf16>& x, int T, int in, int xs) {
  std::vector<bf16> out(static_cast<size_t>(T) * xs, FloatToBf16(1e30f));
  for (int t = 0; t < T; ++t) std::copy_n(x.begin() + static_cast<size_t>(t) * in, in, out.begin() + static_cast<size_t>(t) * xs);
  return out;
}
// y [T][ys] (filled with 0x7f7f before the product): each row's first `out` elements are dense's row,
// the rest untouched.
void ExpectStridedRowsEqual(const std::vector<bf16>& y, int ys, const std::vector<bf16>& dense, int out, int T,
                            const std::string& what) {
  for (int t = 0; t < T; ++t) {
    ASSERT_EQ(std::vector<bf16>(y.begin() + static_cast<size_t>(t) * ys, y.begin() + static_cast<size_t>(t) * ys + out),
              Rows(dense, out, t, 1))
        << "token " << t << what;
    for (int o = out; o < ys; ++o) ASSERT_EQ(y[static_cast<size_t>(t) * ys + o], bf16{0x7f7f}) << "gap written" << what;
  }
}

// Row strides (a fused q/k/v/g output read in place, a wider y buffer): the dense result's bits, through
// both kernels, and nothing outside each row's out elements written.
TEST(MmaGpu, RowStridesGiveTheDenseBits) {
  SKIP_WITHOUT_GPU();
  const int out = 300, in = 520, T = 70, xs = in + 24, ys = out + 5;
  auto w = Upload(RandomBf16(static_cast<size_t>(out) * in, 195, 0.05f));
  auto x = RandomBf16(static_cast<size_t>(T) * in, 196);
  auto d_x = Upload(x), d_xs = Upload(StridedRows(x, T, in, xs));
  auto d_dense = Alloc(static_cast<size_t>(T) * out * 2);
  GemvParams p{w.as<bf16>(), d_x.as<bf16>(), d_dense.as<bf16>(), out, in, T};
  p.mma = true;
  ASSERT_OK(Gemv(p, nullptr));
  const auto dense = Download<bf16>(d_dense, static_cast<size_t>(T) * out);
  for (int tiled_min : {kMmaAlwaysRegister, 1}) {
    auto d_y = Alloc(static_cast<size_t>(T) * ys * 2, 0x7f);
    GemvParams q = p;
    q.x = d_xs.as<bf16>(), q.y = d_y.as<bf16>(), q.x_stride = xs, q.y_stride = ys, q.mma_tiled_min_tokens = tiled_min;
    ASSERT_OK(Gemv(q, nullptr));
    Sync();
    ExpectStridedRowsEqual(Download<bf16>(d_y, static_cast<size_t>(T) * ys), ys, dense, out, T,
                           tiled_min == 1 ? " (tiled)" : " (register)");
    if (HasFatalFailure()) return;
  }
}

// ---------------------------------------------------------------------------------------------------
// The library GEMM (GemvParams::library_gemm, ops.h 5c): cuBLASLt with one algorithm per shape. Its
// promise is the MMA product's: a token's outputs depend on its x row and the shape only. Checked
// against the FP32 reference, then bit for bit: every sampled row of a big launch equals that row
// alone and inside launches of other sizes at several offsets, and a second big launch equals the first.
Status RunLibraryGemm(const cuda::DeviceBuffer& w, const cuda::DeviceBuffer& x, cuda::DeviceBuffer& y, int out, int in,
                      int first, int n, size_t y_row = 0) {
  GemvParams p{w.as<bf16>(), x.as<bf16>() + static_cast<size_t>(first) * in, y.as<bf16>() + y_row * out, out, in, n};
  p.library_gemm = true;
  return Gemv(p, nullptr);
}

void CheckLibraryGemmShape(int out, int in, int big_t) {
  auto described = DescribeLibraryGemm(out, in);
  ASSERT_TRUE(described.ok()) << described.status().message();
  SCOPED_TRACE(*described);
  std::printf("  %s\n", described->c_str());
  auto w = RandomBf16(static_cast<size_t>(out) * in, 291, 0.05f);
  auto x = RandomBf16(static_cast<size_t>(big_t) * in, 292);
  auto d_w = Upload(w), d_x = Upload(x);
  {  // Close to the reference at 17 tokens.
    const int T = 17;
    auto d_y = Alloc(static_cast<size_t>(T) * out * 2);
    ASSERT_OK(RunLibraryGemm(d_w, d_x, d_y, out, in, 0, T));
    std::vector<bf16> ref(static_cast<size_t>(T) * out);
    GemvParams r{w.data(), x.data(), ref.data(), out, in, T, 0, 0};
    ref::Gemv(r);
    const auto y = Download<bf16>(d_y, ref.size());
    ExpectClose(y, ref, 1e-3f, 1.0f / 128, "library GEMM vs reference");
  }
  const size_t big = static_cast<size_t>(big_t) * out;
  auto d_big = Alloc(big * 2), d_again = Alloc(big * 2);
  ASSERT_OK(RunLibraryGemm(d_w, d_x, d_big, out, in, 0, big_t));
  ASSERT_OK(RunLibraryGemm(d_w, d_x, d_again, out, in, 0, big_t));
  Sync();
  const auto want = Download<bf16>(d_big, big);
  for (size_t i = 0; i < big; ++i) ASSERT_FALSE(std::isnan(Bf16ToFloat(want[i]))) << "unwritten element " << i;
  EXPECT_EQ(Download<bf16>(d_again, big), want) << "run to run";
  {  // Rows alone, each into its own row of one buffer.
    auto d_alone = Alloc(big * 2);
    std::vector<int> rows;
    for (int t = 0; t < big_t; t += 37) rows.push_back(t);
    rows.push_back(big_t - 1);
    for (int t : rows) ASSERT_OK(RunLibraryGemm(d_w, d_x, d_alone, out, in, t, 1, t));
    Sync();
    const auto alone = Download<bf16>(d_alone, big);
    int bad = 0;
    for (int t : rows) {
      if (bad < 5 && Rows(alone, out, t, 1) != Rows(want, out, t, 1)) {
        ADD_FAILURE() << "token " << t << " alone differs from token " << t << " of " << big_t;
        ++bad;
      }
    }
  }
  // Other token counts (the library's tile edges at several places) at several offsets.
  for (int n : {2, 5, 8, 16, 17, 64, 100, 129, 255, 511, 1000}) {
    if (n > big_t) continue;
    auto d_yn = Alloc(static_cast<size_t>(n) * out * 2);
    for (int first : {0, 3, 61, big_t - n}) {
      if (first + n > big_t) continue;
      ASSERT_OK(RunLibraryGemm(d_w, d_x, d_yn, out, in, first, n));
      Sync();
      EXPECT_EQ(Download<bf16>(d_yn, static_cast<size_t>(n) * out), Rows(want, out, first, n))
          << n << " tokens from " << first;
    }
  }
}

TEST(LibraryGemmGpu, MatchesReferenceAndEveryRowIsItsAloneResult) {
  SKIP_WITHOUT_GPU();
  if (!LibraryGemmAvailable().ok()) GTEST_SKIP() << LibraryGemmAvailable().message();
  // XS.2's prompt-row products: q/k/v/g of both layer kinds at a prefill chunk of 2,048, o_proj of
  // both, the dense MLP's gate/up and down, and small shapes (the tiny model's).
  for (const auto [out, in, big_t] : {std::tuple{10304, 2048, 2048}, std::tuple{8240, 2048, 1500},
                                      std::tuple{2048, 8192, 2048}, std::tuple{2048, 6144, 700},
                                      std::tuple{16384, 2048, 600}, std::tuple{2048, 8192, 300},
                                      std::tuple{64, 512, 300}, std::tuple{136, 72, 300}}) {
    SCOPED_TRACE(testing::Message() << out << " x " << in);
    CheckLibraryGemmShape(out, in, big_t);
    if (HasFatalFailure()) return;
  }
}

TEST(LibraryGemmGpu, RowStridesAndWhatItRefuses) {
  SKIP_WITHOUT_GPU();
  if (!LibraryGemmAvailable().ok()) GTEST_SKIP() << LibraryGemmAvailable().message();
  const int out = 304, in = 520, T = 70, xs = in + 24, ys = out + 8;
  auto w = Upload(RandomBf16(static_cast<size_t>(out) * in, 295, 0.05f));
  auto x = RandomBf16(static_cast<size_t>(T) * in, 296);
  auto d_x = Upload(x), d_xs = Upload(StridedRows(x, T, in, xs));
  auto d_dense = Alloc(static_cast<size_t>(T) * out * 2);
  GemvParams p{w.as<bf16>(), d_x.as<bf16>(), d_dense.as<bf16>(), out, in, T};
  p.library_gemm = true;
  EXPECT_TRUE(LibraryGemmFits(p));
  ASSERT_OK(Gemv(p, nullptr));
  const auto dense = Download<bf16>(d_dense, static_cast<size_t>(T) * out);
  auto d_y = Alloc(static_cast<size_t>(T) * ys * 2, 0x7f);
  GemvParams q = p;
  q.x = d_xs.as<bf16>(), q.y = d_y.as<bf16>(), q.x_stride = xs, q.y_stride = ys;
  ASSERT_OK(Gemv(q, nullptr));
  Sync();
  ExpectStridedRowsEqual(Download<bf16>(d_y, static_cast<size_t>(T) * ys), ys, dense, out, T, "");
  if (HasFatalFailure()) return;
  GemvParams bad = p;
  bad.out = 300;  // rows of y not 16-byte aligned
  EXPECT_FALSE(LibraryGemmFits(bad));
  EXPECT_FALSE(Gemv(bad, nullptr).ok());
  bad = p;
  bad.y = p.y + 4;
  EXPECT_FALSE(LibraryGemmFits(bad));
  EXPECT_FALSE(Gemv(bad, nullptr).ok());
  bad = p;
  bad.streaming.on = true;
  EXPECT_FALSE(Gemv(bad, nullptr).ok());
}

TEST(MmaGpu, RejectsWhatItDoesNotDo) {
  SKIP_WITHOUT_GPU();
  auto w = Alloc(64 * 512 * 2, 0), x = Alloc(4 * 512 * 2, 0), y = Alloc(4 * 64 * 2);
  GemvParams p{w.as<bf16>(), x.as<bf16>(), y.as<bf16>(), 64, 512, 4};
  p.mma = true;
  EXPECT_TRUE(Gemv(p, nullptr).ok());
  GemvParams bad = p;
  bad.k_split = 3;
  EXPECT_FALSE(Gemv(bad, nullptr).ok()) << "k_split 3";
  bad = p;
  bad.k_split = 8;  // 16 chunks: divisible, allowed
  EXPECT_TRUE(Gemv(bad, nullptr).ok());
  bad = p;
  bad.in = 488, bad.k_split = 2;  // 16 chunks (the last one padded): 2 divides
  EXPECT_TRUE(Gemv(bad, nullptr).ok());
  bad.in = 456;  // 15 chunks
  EXPECT_FALSE(Gemv(bad, nullptr).ok()) << "k_split 2 of 15 chunks";
  bad = p;
  bad.streaming.on = true, bad.num_tokens = 1;
  EXPECT_FALSE(Gemv(bad, nullptr).ok()) << "streaming";
  bad = p;
  bad.norm.residual = x.as<bf16>(), bad.norm.weight = x.as<bf16>(), bad.x = nullptr;
  EXPECT_FALSE(Gemv(bad, nullptr).ok()) << "fused norm";
  Sync();
}

// ---------------------------------------------------------------------------------------------------
struct MoeCase {
  int E, k, d, F, Fs;
  float softcap;
};

TEST(MoeGpu, MatchesReference) {
  SKIP_WITHOUT_GPU();
  for (const MoeCase& c : {MoeCase{8, 3, 64, 32, 16, 0.0f}, MoeCase{64, 8, 512, 128, 64, 0.0f},
                           MoeCase{256, 8, 256, 64, 64, 5.0f}}) {
    SCOPED_TRACE(testing::Message() << "E " << c.E << " k " << c.k << " d " << c.d);
    auto x = RandomBf16(c.d, 101), router = RandomBf16(static_cast<size_t>(c.E) * c.d, 102, 0.1f);
    auto bias = RandomBf16(c.E, 103, 0.05f);
    std::vector<std::vector<bf16>> hw;
    std::vector<cuda::DeviceBuffer> dw;
    std::vector<const bf16*> hg(c.E), hu(c.E), hd(c.E), dg(c.E), du(c.E), dd(c.E);
    for (int e = 0; e <= c.E; ++e) {
      const int F = e == c.E ? c.Fs : c.F;
      for (int m = 0; m < 3; ++m) {
        hw.push_back(RandomBf16(static_cast<size_t>(F) * c.d, 1000 + 3 * e + m, 0.08f));
        dw.push_back(Upload(hw.back()));
      }
    }
    for (int e = 0; e < c.E; ++e) {
      hg[e] = hw[3 * e].data(), hu[e] = hw[3 * e + 1].data(), hd[e] = hw[3 * e + 2].data();
      dg[e] = dw[3 * e].as<bf16>(), du[e] = dw[3 * e + 1].as<bf16>(), dd[e] = dw[3 * e + 2].as<bf16>();
    }
    auto d_x = Upload(x), d_router = Upload(router), d_bias = Upload(bias);
    auto d_g = Upload(dg), d_u = Upload(du), d_d = Upload(dd);
    auto d_y = Alloc(c.d * 2), d_ids = Alloc(c.k * 4), d_w = Alloc(c.k * 4);
    auto d_ws = Alloc(MoeWorkspaceBytes(c.d, c.E, c.k, c.F, c.Fs)), d_counter = Alloc(4, 0);
    MoeParams p;
    p.x = d_x.as<bf16>(), p.router_w = d_router.as<bf16>(), p.router_bias = d_bias.as<bf16>();
    p.gate_w = d_g.as<const bf16*>(), p.up_w = d_u.as<const bf16*>(), p.down_w = d_d.as<const bf16*>();
    p.shared_gate_w = dw[3 * c.E].as<bf16>(), p.shared_up_w = dw[3 * c.E + 1].as<bf16>();
    p.shared_down_w = dw[3 * c.E + 2].as<bf16>();
    p.d = c.d, p.num_experts = c.E, p.top_k = c.k, p.ffn = c.F, p.shared_ffn = c.Fs;
    p.alpha = 2.5f, p.softcap = c.softcap, p.y = d_y.as<bf16>();
    p.topk_ids = d_ids.as<int32_t>(), p.topk_weights = d_w.as<float>();
    p.workspace = d_ws.data(), p.counter = d_counter.as<uint32_t>();
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    const auto y1 = Download<bf16>(d_y, c.d);
    const auto ids = Download<int32_t>(d_ids, c.k);
    const auto wts = Download<float>(d_w, c.k);
    const auto logits = Download<float>(d_ws, c.E);  // workspace starts with the router logits
    // Router logits: BF16-rounded FP32 sums vs double sums: at most one BF16 ulp apart.
    std::vector<bf16> ref_logits(c.E), gpu_logits(c.E);
    for (int e = 0; e < c.E; ++e) {
      double s = 0;
      for (int i = 0; i < c.d; ++i)
        s += static_cast<double>(Bf16ToFloat(router[e * c.d + i])) * Bf16ToFloat(x[i]);
      ref_logits[e] = FloatToBf16(static_cast<float>(s));
      gpu_logits[e] = FloatToBf16(logits[e]);
      EXPECT_EQ(logits[e], Bf16ToFloat(gpu_logits[e])) << "logit not BF16-rounded";
    }
    ExpectClose(gpu_logits, ref_logits, 1e-6f, 1.0f / 128, "router logits");
    // Selection and weights from the kernel's own logits: exact.
    std::vector<bf16> y_ref(c.d);
    std::vector<int32_t> ids_ref(c.k);
    std::vector<float> w_ref(c.k);
    MoeParams r = p;
    r.x = x.data(), r.router_w = router.data(), r.router_bias = bias.data();
    r.gate_w = hg.data(), r.up_w = hu.data(), r.down_w = hd.data();
    r.shared_gate_w = hw[3 * c.E].data(), r.shared_up_w = hw[3 * c.E + 1].data();
    r.shared_down_w = hw[3 * c.E + 2].data(), r.y = y_ref.data();
    r.topk_ids = ids_ref.data(), r.topk_weights = w_ref.data();
    ref::Moe(r, logits.data());
    EXPECT_EQ(ids, ids_ref);
    EXPECT_EQ(wts, w_ref);
    ExpectClose(y1, y_ref, 2e-3f, 1.0f / 32, "moe y");
    // Again (the counter was reset by the kernel): bit-identical.
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_y, c.d), y1);
    EXPECT_EQ(Download<uint32_t>(d_counter, 1)[0], 0u);
  }
}

// A random MoE layer on the device (E experts of F rows and a shared expert of Fs rows, width d,
// weights from seeds weight_seed + 3e + m) and the MoeParams for T tokens that point at it.
struct RandomMoeLayer {
  int E, k, d, F, Fs;
  std::vector<cuda::DeviceBuffer> weights;  // gate, up, down of each expert, then the shared expert's
  cuda::DeviceBuffer gate_ptrs, up_ptrs, down_ptrs, router, bias;
  RandomMoeLayer(int E_, int k_, int d_, int F_, int Fs_, uint64_t weight_seed, uint64_t router_seed,
                 uint64_t bias_seed)
      : E(E_), k(k_), d(d_), F(F_), Fs(Fs_) {
    std::vector<const bf16*> g(E), u(E), dn(E);
    for (int e = 0; e <= E; ++e) {
      const int f = e == E ? Fs : F;
      for (int m = 0; m < 3; ++m) {
        weights.push_back(Upload(RandomBf16(static_cast<size_t>(f) * d, weight_seed + 3 * e + m, 0.08f)));
      }
      if (e < E) g[e] = weights[3 * e].as<bf16>(), u[e] = weights[3 * e + 1].as<bf16>(), dn[e] = weights[3 * e + 2].as<bf16>();
    }
    gate_ptrs = Upload(g), up_ptrs = Upload(u), down_ptrs = Upload(dn);
    router = Upload(RandomBf16(static_cast<size_t>(E) * d, router_seed, 0.1f));
    bias = Upload(RandomBf16(E, bias_seed, 0.05f));
  }
  MoeParams Params(const bf16* x, bf16* y, int32_t* ids, void* workspace, uint32_t* counter, int T) const {
    MoeParams p;
    p.x = x, p.router_w = router.as<bf16>(), p.router_bias = bias.as<bf16>();
    p.gate_w = gate_ptrs.as<const bf16*>(), p.up_w = up_ptrs.as<const bf16*>(), p.down_w = down_ptrs.as<const bf16*>();
    p.shared_gate_w = weights[3 * E].as<bf16>(), p.shared_up_w = weights[3 * E + 1].as<bf16>();
    p.shared_down_w = weights[3 * E + 2].as<bf16>();
    p.d = d, p.num_experts = E, p.top_k = k, p.ffn = F, p.shared_ffn = Fs, p.alpha = 2.5f;
    p.num_tokens = T, p.y = y, p.topk_ids = ids, p.workspace = workspace, p.counter = counter;
    return p;
  }
};

// T tokens in one launch (prefill) give each token exactly what it gets alone (decode).
TEST(MoeGpu, TokensInOneLaunchMatchSingleTokenLaunches) {
  SKIP_WITHOUT_GPU();
  const int E = 64, k = 8, d = 512, F = 128, Fs = 64, T = 5;
  const RandomMoeLayer layer(E, k, d, F, Fs, 2000, 202, 203);
  auto x = RandomBf16(static_cast<size_t>(T) * d, 201);
  auto d_x = Upload(x);
  auto d_y = Alloc(static_cast<size_t>(T) * d * 2), d_ids = Alloc(static_cast<size_t>(T) * k * 4);
  auto d_ws = Alloc(MoeWorkspaceBytes(d, E, k, F, Fs, T)), d_counter = Alloc(T * 4, 0);
  MoeParams p = layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), d_ids.as<int32_t>(), d_ws.data(),
                             d_counter.as<uint32_t>(), T);
  ASSERT_OK(Moe(p, nullptr));
  Sync();
  const auto y_all = Download<bf16>(d_y, static_cast<size_t>(T) * d);
  const auto ids_all = Download<int32_t>(d_ids, static_cast<size_t>(T) * k);
  EXPECT_EQ(Download<uint32_t>(d_counter, T), std::vector<uint32_t>(T, 0u));
  std::set<int32_t> distinct(ids_all.begin(), ids_all.end());
  EXPECT_GT(distinct.size(), static_cast<size_t>(k)) << "tokens should route differently";
  for (int t = 0; t < T; ++t) {
    MoeParams one = p;
    one.num_tokens = 1;
    one.x = d_x.as<bf16>() + static_cast<size_t>(t) * d;
    ASSERT_OK(Moe(one, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_y, d), std::vector<bf16>(y_all.begin() + t * d, y_all.begin() + (t + 1) * d))
        << "token " << t;
    EXPECT_EQ(Download<int32_t>(d_ids, k),
              std::vector<int32_t>(ids_all.begin() + t * k, ids_all.begin() + (t + 1) * k));
  }
}

// The norm folded into the router gives the bits of AddRmsNorm followed by the MoE: y, ids, u2 (written
// to x for the expert kernels) and the updated residual, for 1 and 5 tokens.
TEST(MoeGpu, FusedInputNormMatchesSeparateKernels) {
  SKIP_WITHOUT_GPU();
  const int E = 64, k = 8, d = 512, F = 128, Fs = 64;
  const RandomMoeLayer layer(E, k, d, F, Fs, 3000, 301, 302);
  auto d_nw = Upload(RandomBf16(d, 303));
  for (int T : {1, 5}) {
    SCOPED_TRACE(testing::Message() << "T " << T);
    const size_t n = static_cast<size_t>(T) * d;
    auto h = RandomBf16(n, 304, 4.0f), dl = RandomBf16(n, 305);
    auto d_dl = Upload(dl);
    auto base = [&](cuda::DeviceBuffer& x, cuda::DeviceBuffer& y, cuda::DeviceBuffer& ids, cuda::DeviceBuffer& ws,
                    cuda::DeviceBuffer& counter) {
      return layer.Params(x.as<bf16>(), y.as<bf16>(), ids.as<int32_t>(), ws.data(), counter.as<uint32_t>(), T);
    };
    // Separate kernels.
    auto d_h_sep = Upload(h), x_sep = Alloc(n * 2), y_sep = Alloc(n * 2), ids_sep = Alloc(static_cast<size_t>(T) * k * 4);
    auto ws_sep = Alloc(MoeWorkspaceBytes(d, E, k, F, Fs, T)), c_sep = Alloc(T * 4, 0);
    AddRmsNormParams np{d_h_sep.as<bf16>(), d_dl.as<bf16>(), d_nw.as<bf16>(), x_sep.as<bf16>(), T, d, 1e-6f};
    ASSERT_OK(AddRmsNorm(np, nullptr));
    ASSERT_OK(Moe(base(x_sep, y_sep, ids_sep, ws_sep, c_sep), nullptr));
    // Fused.
    auto d_h = Upload(h), d_h_out = Alloc(n * 2), x = Alloc(n * 2), y = Alloc(n * 2);
    auto ids = Alloc(static_cast<size_t>(T) * k * 4), ws = Alloc(MoeWorkspaceBytes(d, E, k, F, Fs, T)), c = Alloc(T * 4, 0);
    MoeParams p = base(x, y, ids, ws, c);
    p.norm.residual = d_h.as<bf16>();
    p.norm.delta = d_dl.as<bf16>();
    p.norm.weight = d_nw.as<bf16>();
    p.norm.residual_out = d_h_out.as<bf16>();
    p.norm.u_out = x.as<bf16>();
    p.norm.eps = 1e-6f;
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(y, n), Download<bf16>(y_sep, n));
    EXPECT_EQ(Download<int32_t>(ids, static_cast<size_t>(T) * k), Download<int32_t>(ids_sep, static_cast<size_t>(T) * k));
    EXPECT_EQ(Download<bf16>(x, n), Download<bf16>(x_sep, n)) << "u2 as written for the expert kernels";
    EXPECT_EQ(Download<bf16>(d_h_out, n), Download<bf16>(d_h_sep, n));
    EXPECT_EQ(Download<bf16>(d_h, n), h) << "the input residual is never written";
    p.norm.u_out = nullptr;
    EXPECT_FALSE(Moe(p, nullptr).ok()) << "the expert kernels need u2 in x";
  }
}

// Batch 1's streaming gate/up (TMA bulk copies through a ring) gives the register kernel's bits: a
// small layer, XS.2's widths (d 2,048, F = Fs = 512) and one with Fs != F and k 4; the default ring, a
// ring of two slots (every mbarrier phase reused) and one that holds everything.
TEST(MoeGpu, StreamingGateUpMatchesRegisterKernel) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int E, k, d, F, Fs;
  };
  for (const Shape sh : {Shape{64, 8, 512, 128, 64}, Shape{16, 8, 2048, 512, 512}, Shape{32, 4, 1000, 256, 128}}) {
    const RandomMoeLayer layer(sh.E, sh.k, sh.d, sh.F, sh.Fs, 5000, 502, 503);
    auto d_x = Upload(RandomBf16(sh.d, 501));
    auto d_y0 = Alloc(sh.d * 2), d_y1 = Alloc(sh.d * 2);
    auto d_ws = Alloc(MoeWorkspaceBytes(sh.d, sh.E, sh.k, sh.F, sh.Fs, 1)), d_counter = Alloc(4, 0);
    MoeParams p = layer.Params(d_x.as<bf16>(), d_y0.as<bf16>(), nullptr, d_ws.data(), d_counter.as<uint32_t>(), 1);
    p.gate_up_stream_ring_kb = 0;
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    const auto y0 = Download<bf16>(d_y0, sh.d);
    const int two_slots_kb = 2 * 4 * sh.d * 2 * 2 / 1024 + 1;  // a slot: [2, 4, d] BF16
    for (const int ring_kb : {128, two_slots_kb, 1024}) {
      SCOPED_TRACE(testing::Message() << "d " << sh.d << " F " << sh.F << " Fs " << sh.Fs << " k " << sh.k
                                      << " ring " << ring_kb << " KB");
      MoeParams q = p;
      q.y = d_y1.as<bf16>();
      q.gate_up_stream_ring_kb = ring_kb;
      ASSERT_OK(Moe(q, nullptr));
      Sync();
      EXPECT_EQ(Download<bf16>(d_y1, sh.d), y0);
    }
  }
}

// The grouped path (T > 1: each selected expert's rows read once for all its tokens) gives every token
// the bits it gets alone (the batch-1 kernels) and inside any other batch: few experts so each one
// serves more tokens than one pass of its warps takes (token tiles), k 4 and 8, XS.2's widths, and a
// batch whose tokens are a shuffled subset (different groupings of the same token).
TEST(MoeGpu, GroupedPathMatchesEveryTokenAlone) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int E, k, d, F, Fs, T;
  };
  for (const Shape sh : {Shape{16, 4, 512, 128, 64, 40}, Shape{64, 8, 512, 128, 128, 33}, Shape{256, 8, 2048, 512, 512, 64}}) {
    SCOPED_TRACE(testing::Message() << "E " << sh.E << " k " << sh.k << " d " << sh.d << " T " << sh.T);
    const RandomMoeLayer layer(sh.E, sh.k, sh.d, sh.F, sh.Fs, 6000, 602, 603);
    const int T = sh.T;
    auto x = RandomBf16(static_cast<size_t>(T) * sh.d, 601);
    auto d_x = Upload(x);
    auto d_y = Alloc(static_cast<size_t>(T) * sh.d * 2), d_ids = Alloc(static_cast<size_t>(T) * sh.k * 4);
    auto d_ws = Alloc(MoeWorkspaceBytes(sh.d, sh.E, sh.k, sh.F, sh.Fs, T)), d_counter = Alloc(T * 4, 0);
    MoeParams p = layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), d_ids.as<int32_t>(), d_ws.data(),
                               d_counter.as<uint32_t>(), T);
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    const auto y_all = Download<bf16>(d_y, static_cast<size_t>(T) * sh.d);
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_y, static_cast<size_t>(T) * sh.d), y_all) << "run to run";
    auto d_y1 = Alloc(sh.d * 2), d_ids1 = Alloc(sh.k * 4);
    for (int t = 0; t < T; t += 3) {
      MoeParams one = p;
      one.num_tokens = 1;
      one.x = d_x.as<bf16>() + static_cast<size_t>(t) * sh.d;
      one.y = d_y1.as<bf16>(), one.topk_ids = d_ids1.as<int32_t>();
      ASSERT_OK(Moe(one, nullptr));
      Sync();
      ASSERT_EQ(Download<bf16>(d_y1, sh.d), Rows(y_all, sh.d, t, 1)) << "token " << t;
    }
    // A shuffled subset of the tokens in another batch: the same rows.
    ExpectShuffledSubsetGivesTheSameRows(p, x, y_all, 7);
  }
  // The grouped path needs the selected ids.
  const RandomMoeLayer layer(16, 4, 512, 128, 64, 6000, 602, 603);
  auto d_x = Upload(RandomBf16(2 * 512, 604)), d_y = Alloc(2 * 512 * 2);
  auto d_ws = Alloc(MoeWorkspaceBytes(512, 16, 4, 128, 64, 2)), d_counter = Alloc(8, 0);
  EXPECT_FALSE(Moe(layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), nullptr, d_ws.data(), d_counter.as<uint32_t>(), 2),
                   nullptr).ok());
}

// The multi-row router (8 token rows per block, MoeParams::router_rows_min_tokens) gives the one-row
// router's bits for every row (ExpectMultiRowRouterMatchesOneRow: router state, ids, weights, u2, the
// residual, y), with and without the fused norm, on the CUDA-core and the MMA experts, at T = 1, a
// partial last block of rows (7, 17, 100, 513) and whole ones (16, 512): XS.2's layer (E 256, d 2,048)
// with random biases and no soft-cap, and an odd one (E 60: the last block's warps past E; d 264;
// k 6) with a soft-cap and zero biases.
TEST(MoeGpu, MultiRowRouterMatchesOneRowRouter) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int E, k, d, F, Fs;
    float softcap;
    bool zero_bias;
  };
  for (const Shape sh : {Shape{256, 8, 2048, 512, 512, 0.0f, false}, Shape{60, 6, 264, 96, 40, 5.0f, true}}) {
    RandomMoeLayer layer(sh.E, sh.k, sh.d, sh.F, sh.Fs, 9000, 902, 903);
    if (sh.zero_bias) ASSERT_TRUE(layer.bias.Fill(0).ok());
    for (int T : {1, 7, 16, 17, 100, 512, 513}) {
      for (bool fused : {false, true}) {
        for (bool mma : {false, true}) {
          SCOPED_TRACE(testing::Message() << "E " << sh.E << " d " << sh.d << " T " << T << (fused ? " fused norm" : "")
                                          << (mma ? " mma" : ""));
          MoeParams p = layer.Params(nullptr, nullptr, nullptr, nullptr, nullptr, T);
          p.softcap = sh.softcap;
          p.mma = mma;
          ASSERT_NO_FATAL_FAILURE(ExpectMultiRowRouterMatchesOneRow(p, fused ? 910 : 0));
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// The MMA experts (MoeParams::mma): T > 1 as a grouped GEMM over the lists, batch 1 on its own
// kernels without the lists. Host copies of a small RandomMoeLayer's weights for the reference.
struct HostMoeLayer {
  std::vector<std::vector<bf16>> w;  // gate, up, down of each expert, then the shared expert's
  std::vector<const bf16*> g, u, dn;
  std::vector<bf16> router, bias;
  explicit HostMoeLayer(const RandomMoeLayer& l) : g(l.E), u(l.E), dn(l.E) {
    for (int e = 0; e <= l.E; ++e) {
      const int f = e == l.E ? l.Fs : l.F;
      for (int m = 0; m < 3; ++m) w.push_back(Download<bf16>(l.weights[3 * e + m], static_cast<size_t>(f) * l.d));
    }
    for (int e = 0; e < l.E; ++e) g[e] = w[3 * e].data(), u[e] = w[3 * e + 1].data(), dn[e] = w[3 * e + 2].data();
    router = Download<bf16>(l.router, static_cast<size_t>(l.E) * l.d);
    bias = Download<bf16>(l.bias, l.E);
  }
};

// A token alone on the MMA experts (`one`: its launch just ran, 1 token, x_host its row, d_ws1 its
// workspace, d_ids1 its ids, y1 its y) against ref::Moe with the kernel's router logits as the
// override (the workspace starts with token 0's logits), so the selection is the kernel's own: the
// same ids, y within the tensor-core product's tolerance of the reference's summation order.
void ExpectMmaTokenNearReference(const HostMoeLayer& h, const MoeParams& one, const bf16* x_host,
                                 const cuda::DeviceBuffer& d_ws1, const cuda::DeviceBuffer& d_ids1,
                                 const std::vector<bf16>& y1, const std::string& what) {
  const auto logits = Download<float>(d_ws1, one.num_experts);
  std::vector<bf16> y_ref(one.d);
  std::vector<int32_t> ids_ref(one.top_k);
  std::vector<float> w_ref(one.top_k);
  MoeParams r = one;
  r.x = x_host, r.router_w = h.router.data(), r.router_bias = h.bias.data();
  r.gate_w = h.g.data(), r.up_w = h.u.data(), r.down_w = h.dn.data();
  const size_t E = h.g.size();
  r.shared_gate_w = h.w[3 * E].data(), r.shared_up_w = h.w[3 * E + 1].data(), r.shared_down_w = h.w[3 * E + 2].data();
  r.y = y_ref.data(), r.topk_ids = ids_ref.data(), r.topk_weights = w_ref.data();
  std::vector<float> term_scale(one.d);
  ref::Moe(r, logits.data(), term_scale.data());
  EXPECT_EQ(Download<int32_t>(d_ids1, one.top_k), ids_ref) << what;
  // |y - ref| <= 2e-3 + |ref| / 32 + 2^-7 (alpha sum_j |bf16(o_j w_j)| + |o_shared|): the MMA chain
  // sums each product in another FP32 order than the reference, so a BF16 rounding of o_j, of a routed
  // term or of r alpha may land one ulp (2^-8 relative) away; two such ulps of the terms, not of y,
  // which the terms can cancel down to (seen at E 16, d 2,048, T 17: y 0.14 against 0.16, max abs
  // error 0.25, against the old tolerance 2e-3 + |ref| / 32).
  std::vector<float> slack(one.d);
  for (int i = 0; i < one.d; ++i) slack[i] = term_scale[i] / 128;
  ExpectClose(y1, y_ref, 2e-3f, 1.0f / 32, "moe mma y, " + what, slack);
}

// Precomputed router logits (MoeParams::router_logits, the prompt rows' library GEMM): the router only
// selects. Every token's selection is ref::Moe's from the same logits (ids exactly, y within the
// products' tolerance), the selecting kernel puts the logits where the router does, and a token's
// row of a T-token launch equals the token launched alone, on both expert products.
TEST(MoeGpu, PrecomputedRouterLogitsSelectAsTheReference) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int E, k, d, F, Fs;
    float softcap;
  };
  for (const Shape sh : {Shape{64, 8, 512, 128, 64, 0.0f}, Shape{256, 8, 1024, 128, 128, 4.0f}}) {
    const RandomMoeLayer layer(sh.E, sh.k, sh.d, sh.F, sh.Fs, 7000, 702, 703);
    const HostMoeLayer host(layer);
    for (int T : {1, 7, 20}) {
      for (bool mma : {false, true}) {
        SCOPED_TRACE(testing::Message() << "E " << sh.E << " T " << T << (mma ? " mma" : ""));
        const int E = sh.E, k = sh.k, d = sh.d;
        const auto x = RandomBf16(static_cast<size_t>(T) * d, 711);
        const auto logits = RandomBf16(static_cast<size_t>(T) * E, 712, 3.0f);
        auto d_x = Upload(x), d_logits = Upload(logits);
        auto run = [&](int first, int n, cuda::DeviceBuffer& y, cuda::DeviceBuffer& ids, cuda::DeviceBuffer& ws) {
          auto counter = Alloc(static_cast<size_t>(n) * 4, 0);
          MoeParams p = layer.Params(d_x.as<bf16>() + static_cast<size_t>(first) * d, y.as<bf16>(), ids.as<int32_t>(),
                                     ws.data(), counter.as<uint32_t>(), n);
          p.softcap = sh.softcap;
          p.mma = mma;
          p.router_logits = d_logits.as<bf16>() + static_cast<size_t>(first) * E;
          ASSERT_OK(Moe(p, nullptr));
          Sync();
          EXPECT_EQ(Download<uint32_t>(counter, n), std::vector<uint32_t>(n, 0u)) << "tickets left at zero";
        };
        const size_t ws_all = MoeWorkspaceBytes(d, E, k, sh.F, sh.Fs, T), ws_one = MoeWorkspaceBytes(d, E, k, sh.F, sh.Fs, 1);
        auto y = Alloc(static_cast<size_t>(T) * d * 2), ids = Alloc(static_cast<size_t>(T) * k * 4), ws = Alloc(ws_all);
        ASSERT_NO_FATAL_FAILURE(run(0, T, y, ids, ws));
        const auto y_all = Download<bf16>(y, static_cast<size_t>(T) * d);
        const auto ids_all = Download<int32_t>(ids, static_cast<size_t>(T) * k);
        for (int t = 0; t < T; ++t) {
          auto y1 = Alloc(static_cast<size_t>(d) * 2), ids1 = Alloc(static_cast<size_t>(k) * 4), ws1 = Alloc(ws_one);
          ASSERT_NO_FATAL_FAILURE(run(t, 1, y1, ids1, ws1));
          const auto y_one = Download<bf16>(y1, d);
          EXPECT_EQ(y_one, Rows(y_all, d, t, 1)) << "token " << t << " alone";
          EXPECT_EQ(Download<int32_t>(ids1, k),
                    std::vector<int32_t>(ids_all.begin() + static_cast<size_t>(t) * k, ids_all.begin() + static_cast<size_t>(t + 1) * k))
              << "token " << t << " alone selects as in the batch";
          std::vector<float> want(E);
          for (int e = 0; e < E; ++e) want[e] = Bf16ToFloat(logits[static_cast<size_t>(t) * E + e]);
          EXPECT_EQ(Download<float>(ws1, E), want) << "the logits where the router puts its own";
          MoeParams one = layer.Params(nullptr, nullptr, nullptr, nullptr, nullptr, 1);
          one.softcap = sh.softcap;
          ExpectMmaTokenNearReference(host, one, x.data() + static_cast<size_t>(t) * d, ws1, ids1, y_one,
                                      "token " + std::to_string(t));
        }
      }
    }
  }
  // A fused input norm with precomputed logits is refused (the logits were computed from u2 already).
  const RandomMoeLayer layer(64, 8, 512, 128, 64, 7000, 702, 703);
  auto x = Alloc(512 * 2), y = Alloc(512 * 2), ws = Alloc(MoeWorkspaceBytes(512, 64, 8, 128, 64, 1)), c = Alloc(4, 0);
  auto lg = Alloc(64 * 2, 0), h = Alloc(512 * 2, 0), nw = Alloc(512 * 2, 0), res = Alloc(512 * 2);
  MoeParams p = layer.Params(x.as<bf16>(), y.as<bf16>(), nullptr, ws.data(), c.as<uint32_t>(), 1);
  p.router_logits = lg.as<bf16>();
  p.norm.residual = h.as<bf16>(), p.norm.weight = nw.as<bf16>(), p.norm.residual_out = res.as<bf16>(), p.norm.u_out = x.as<bf16>();
  EXPECT_EQ(Moe(p, nullptr).code(), StatusCode::kInvalidArgument);
}

// Close to the reference per token, run to run, and every token's row of a T-token launch equals the
// token alone (through the batch-1 kernels and through the lists on the GEMM) and inside a shuffled
// subset: the grouped path's promise on the tensor-core product. Shapes: small, XS.2's (E 256, k 8,
// d 2048, F 512), and odd ones (d not a multiple of 32, Fs of another chunk count).
TEST(MoeGpu, MmaExpertsMatchReferenceAndEveryTokenAlone) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int E, k, d, F, Fs, T;
  };
  // T 200 over 16 experts: ~50 pairs per expert and 200 shared-expert pairs, so the shared expert is
  // cut into segments (MoeMmaLists).
  for (const Shape sh : {Shape{16, 4, 512, 128, 64, 40}, Shape{8, 3, 264, 96, 40, 21}, Shape{64, 8, 512, 128, 128, 33},
                         Shape{16, 4, 512, 128, 64, 200}, Shape{256, 8, 2048, 512, 512, 64}}) {
    SCOPED_TRACE(testing::Message() << "E " << sh.E << " k " << sh.k << " d " << sh.d << " F " << sh.F << " Fs "
                                    << sh.Fs << " T " << sh.T);
    const RandomMoeLayer layer(sh.E, sh.k, sh.d, sh.F, sh.Fs, 7000, 702, 703);
    const int T = sh.T;
    auto x = RandomBf16(static_cast<size_t>(T) * sh.d, 701);
    auto d_x = Upload(x);
    auto d_y = Alloc(static_cast<size_t>(T) * sh.d * 2), d_ids = Alloc(static_cast<size_t>(T) * sh.k * 4);
    auto d_ws = Alloc(MoeWorkspaceBytes(sh.d, sh.E, sh.k, sh.F, sh.Fs, T)), d_counter = Alloc(T * 4, 0);
    MoeParams p = layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), d_ids.as<int32_t>(), d_ws.data(),
                               d_counter.as<uint32_t>(), T);
    p.mma = true;
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    const auto y_all = Download<bf16>(d_y, static_cast<size_t>(T) * sh.d);
    for (size_t i = 0; i < y_all.size(); ++i) ASSERT_FALSE(std::isnan(Bf16ToFloat(y_all[i]))) << "unwritten " << i;
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_y, static_cast<size_t>(T) * sh.d), y_all) << "run to run";
    // The reference for the small layers only.
    std::unique_ptr<HostMoeLayer> host;
    if (sh.E <= 64) host = std::make_unique<HostMoeLayer>(layer);
    auto d_y1 = Alloc(sh.d * 2), d_ids1 = Alloc(sh.k * 4), d_ws1 = Alloc(MoeWorkspaceBytes(sh.d, sh.E, sh.k, sh.F, sh.Fs, 1));
    for (int t = 0; t < T; t += 3) {
      MoeParams one = p;
      one.num_tokens = 1;
      one.x = d_x.as<bf16>() + static_cast<size_t>(t) * sh.d;
      one.y = d_y1.as<bf16>(), one.topk_ids = d_ids1.as<int32_t>(), one.workspace = d_ws1.data();
      ASSERT_OK(Moe(one, nullptr));
      Sync();
      const auto y1 = Download<bf16>(d_y1, sh.d);
      ASSERT_EQ(y1, Rows(y_all, sh.d, t, 1)) << "token " << t << " alone (batch-1 kernels, no lists)";
      if (host && t <= 12) {
        ExpectMmaTokenNearReference(*host, one, x.data() + static_cast<size_t>(t) * sh.d, d_ws1, d_ids1, y1,
                                    "token " + std::to_string(t));
      }
      MoeParams listed = one;
      listed.mma_batch1_lists = true;
      ASSERT_OK(Moe(listed, nullptr));
      Sync();
      ASSERT_EQ(Download<bf16>(d_y1, sh.d), y1) << "token " << t << " alone through the lists (GEMM)";
    }
    // A shuffled subset of the tokens in another batch: the same rows.
    ExpectShuffledSubsetGivesTheSameRows(p, x, y_all, 9);
  }
}

// The MMA experts on `layer` at T tokens: the ids a selection (and for `hot` the skewed one intended),
// no element unwritten (every run starts from a poisoned workspace and y, BF16 NaN, so a product the
// GEMM skipped would reach y as NaN instead of a previous run's value), the same ids and y run to run,
// token t (t % alone_step == 0) of the launch equals the token alone (the batch-1 kernels; every
// 97th also through the lists on the GEMM), the first four of those tokens and the last near the
// reference (`host`), and a shuffled subset of the tokens in a batch of its own gives the same rows.
void ExpectMmaExpertsMatchEveryTokenAlone(const RandomMoeLayer& layer, const HostMoeLayer& host, int T, bool hot,
                                          int alone_step) {
  const int d = layer.d, k = layer.k;
  const auto x = RandomBf16(static_cast<size_t>(T) * d, 1100 + T);
  auto d_x = Upload(x);
  auto d_y = Alloc(static_cast<size_t>(T) * d * 2), d_ids = Alloc(static_cast<size_t>(T) * k * 4);
  auto d_ws = Alloc(MoeWorkspaceBytes(d, layer.E, k, layer.F, layer.Fs, T)), d_counter = Alloc(T * 4, 0);
  MoeParams p = layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), d_ids.as<int32_t>(), d_ws.data(), d_counter.as<uint32_t>(), T);
  p.mma = true;
  auto run = [&](std::vector<bf16>* y, std::vector<int32_t>* ids) {
    ASSERT_TRUE(d_ws.Fill(0xff).ok());
    ASSERT_TRUE(d_y.Fill(0xff).ok());
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    *y = Download<bf16>(d_y, static_cast<size_t>(T) * d);
    *ids = Download<int32_t>(d_ids, static_cast<size_t>(T) * k);
  };
  std::vector<bf16> y_all, y_again;
  std::vector<int32_t> ids, ids_again;
  ASSERT_NO_FATAL_FAILURE(run(&y_all, &ids));
  for (size_t i = 0; i < y_all.size(); ++i) ASSERT_FALSE(std::isnan(Bf16ToFloat(y_all[i]))) << "unwritten " << i;
  for (int t = 0; t < T; ++t) {  // k distinct experts per token
    std::vector<int32_t> sel(ids.begin() + static_cast<size_t>(t) * k, ids.begin() + static_cast<size_t>(t + 1) * k);
    std::sort(sel.begin(), sel.end());
    ASSERT_TRUE(sel.front() >= 0 && sel.back() < layer.E && std::adjacent_find(sel.begin(), sel.end()) == sel.end())
        << "token " << t;
    if (hot) {  // the routing is as skewed as intended: experts 0 and 1 in every token's selection
      ASSERT_TRUE(sel[0] == 0 && sel[1] == 1) << "token " << t;
    }
  }
  ASSERT_NO_FATAL_FAILURE(run(&y_again, &ids_again));
  ASSERT_EQ(ids_again, ids);
  ExpectSameElements(y_again, y_all, "MMA experts run to run");
  auto d_y1 = Alloc(d * 2), d_ids1 = Alloc(k * 4), d_ws1 = Alloc(MoeWorkspaceBytes(d, layer.E, k, layer.F, layer.Fs, 1));
  for (int t = 0; t < T; t += alone_step) {
    MoeParams one = p;
    one.num_tokens = 1;
    one.x = d_x.as<bf16>() + static_cast<size_t>(t) * d;
    one.y = d_y1.as<bf16>(), one.topk_ids = d_ids1.as<int32_t>(), one.workspace = d_ws1.data();
    ASSERT_OK(Moe(one, nullptr));
    Sync();
    const auto y1 = Download<bf16>(d_y1, d);
    ASSERT_EQ(y1, Rows(y_all, d, t, 1)) << "token " << t << " alone";
    ASSERT_EQ(Download<int32_t>(d_ids1, k), std::vector<int32_t>(ids.begin() + static_cast<size_t>(t) * k,
                                                                  ids.begin() + static_cast<size_t>(t + 1) * k))
        << "token " << t << " alone: ids";
    if (t / alone_step < 4 || t + alone_step >= T) {
      ExpectMmaTokenNearReference(host, one, x.data() + static_cast<size_t>(t) * d, d_ws1, d_ids1, y1,
                                  "token " + std::to_string(t));
    }
    if (t % (97 * alone_step) != 0) continue;
    one.mma_batch1_lists = true;
    ASSERT_TRUE(d_ws1.Fill(0xff).ok());
    ASSERT_OK(Moe(one, nullptr));
    Sync();
    ASSERT_EQ(Download<bf16>(d_y1, d), y1) << "token " << t << " alone through the lists (GEMM)";
  }
  ExpectShuffledSubsetGivesTheSameRows(p, x, y_all, 1100 + T);
}

struct MmaExpertsShape {
  int E, k, d, F, Fs;
  bool hot;  // experts 0 and 1 get a router bias of +2 (sigmoid scores are in (0, 1)): in every selection
};
RandomMoeLayer MmaExpertsLayer(const MmaExpertsShape& sh) {
  RandomMoeLayer layer(sh.E, sh.k, sh.d, sh.F, sh.Fs, 11000, 1102, 1103);
  if (sh.hot) {
    auto bias = RandomBf16(sh.E, 1103, 0.05f);
    bias[0] = bias[1] = FloatToBf16(2.0f);
    layer.bias = Upload(bias);
  }
  return layer;
}

// The grouped GEMM at prefill sizes (T 2, 17, 128, 1,000 over random routings): every token alone and
// near the reference. Shapes: XS.2's splits (d 2,048, F 512: gate/up k_split 8, down 2; Fs 256: the
// shared expert's other chunk count), an odd one (d 264: an odd chunk count and a padded chunk; F 96
// and Fs 40: partial row tiles; k_split 1) and one whose router bias favours two experts (lists of T
// pairs: many passes per block; most experts empty).
TEST(MoeGpu, MmaExpertsAtPrefillSizesMatchReferenceAndEveryTokenAlone) {
  SKIP_WITHOUT_GPU();
  for (const MmaExpertsShape sh : {MmaExpertsShape{16, 4, 2048, 512, 256, false},
                                   MmaExpertsShape{8, 3, 264, 96, 40, false}, MmaExpertsShape{64, 8, 512, 128, 64, true}}) {
    const RandomMoeLayer layer = MmaExpertsLayer(sh);
    const HostMoeLayer host(layer);
    for (int T : {2, 17, 128, 1000}) {
      SCOPED_TRACE(testing::Message() << "E " << sh.E << " k " << sh.k << " d " << sh.d << " F " << sh.F << " Fs "
                                      << sh.Fs << (sh.hot ? " hot experts" : "") << " T " << T);
      ExpectMmaExpertsMatchEveryTokenAlone(layer, host, T, sh.hot, 1);
    }
  }
}

// The same checks at sizes for compute-sanitizer (memcheck, racecheck): the odd and the hot shape, a
// few tokens, several passes per block, a token alone every 5th.
TEST(MoeGpu, MmaExpertsSanitizerSizes) {
  SKIP_WITHOUT_GPU();
  for (const MmaExpertsShape sh : {MmaExpertsShape{8, 3, 264, 96, 40, false}, MmaExpertsShape{16, 4, 512, 128, 64, true}}) {
    const RandomMoeLayer layer = MmaExpertsLayer(sh);
    const HostMoeLayer host(layer);
    for (int T : {2, 17, 150}) {
      SCOPED_TRACE(testing::Message() << "E " << sh.E << " d " << sh.d << (sh.hot ? " hot experts" : "") << " T " << T);
      ExpectMmaExpertsMatchEveryTokenAlone(layer, host, T, sh.hot, 5);
    }
  }
}

TEST(ArgmaxGpu, MatchesReferenceWithTiesAndNan) {
  SKIP_WITHOUT_GPU();
  for (int n : {100352, 1001, 512}) {
    auto x = RandomBf16(n, 111);
    auto d_ws = Alloc(ArgmaxWorkspaceBytes(n)), d_counter = Alloc(4, 0), d_out = Alloc(4);
    auto run = [&](const std::vector<bf16>& v) {
      auto d_x = Upload(v);
      ArgmaxParams p{d_x.as<bf16>(), n, d_out.as<int32_t>(), d_ws.data(), d_counter.as<uint32_t>()};
      EXPECT_TRUE(Argmax(p, nullptr).ok());
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return Download<int32_t>(d_out, 1)[0];
    };
    EXPECT_EQ(run(x), ref::Argmax(x.data(), n)) << "n " << n;
    // Plant a tie for the maximum at two places: the lower index wins.
    x[n - 1] = FloatToBf16(100.0f), x[n / 3] = FloatToBf16(100.0f);
    EXPECT_EQ(run(x), n / 3);
    x[n - 2] = 0x7fc0;  // NaN beats everything (torch.argmax)
    EXPECT_EQ(run(x), n - 2);
    EXPECT_EQ(Download<uint32_t>(d_counter, 1)[0], 0u);
  }
  // The optional non-finite flag: NaN, +Inf and -Inf anywhere set it; finite rows clear it.
  const int n = 100352;
  auto d_ws = Alloc(ArgmaxWorkspaceBytes(n)), d_counter = Alloc(4, 0), d_out = Alloc(4), d_bad = Alloc(4);
  for (auto [where, bits, bad] : {std::tuple{-1, bf16{0}, 0}, std::tuple{5, bf16{0x7fc0}, 1},
                                  std::tuple{n - 1, bf16{0x7f80}, 1}, std::tuple{n / 2, bf16{0xff80}, 1}}) {
    auto x = RandomBf16(n, 112);
    if (where >= 0) x[where] = bits;
    auto d_x = Upload(x);
    ArgmaxParams p{d_x.as<bf16>(), n, d_out.as<int32_t>(), d_ws.data(), d_counter.as<uint32_t>(), d_bad.as<int32_t>()};
    ASSERT_OK(Argmax(p, nullptr));
    Sync();
    EXPECT_EQ(Download<int32_t>(d_bad, 1)[0], bad) << "planted at " << where;
  }
}

// ---------------------------------------------------------------------------------------------------
// The sampler against ref::SampleRow (kernels/sampling.h's rule): greedy with and without logit
// adjustments, temperature with top-k, top-p, min-p and all three, non-finite rows flagged; a row's
// token is the same alone and among other rows (batch invariance), and run to run.
TEST(SampleRowsGpu, MatchesTheReferenceRuleAndIsBatchInvariant) {
  SKIP_WITHOUT_GPU();
  const int V = 5000, R = 9;
  auto logits = RandomBf16(static_cast<size_t>(R) * V, 121, 3.0f);
  logits[8 * V + 17] = 0x7fc0;  // row 8: NaN
  std::vector<RowSampling> rs(R);
  // {token, bias, repetition, penalty}
  rs[1].adjustments = {{5, 0.0f, 1.3f, 0.0f}, {17, 1.5f, 1.0f, 2.0f}, {200, -1.0f, 2.0f, -5.0f}};
  rs[2].temperature = 1.0f;
  rs[3].temperature = 0.7f, rs[3].top_k = 20;
  rs[4].temperature = 1.2f, rs[4].top_p = 0.8f;
  rs[5].temperature = 1.0f, rs[5].min_p = 0.05f;
  rs[6].temperature = 0.9f, rs[6].top_k = 50, rs[6].top_p = 0.9f, rs[6].min_p = 0.01f;
  rs[7].temperature = 1.0f, rs[7].top_k = 1;
  rs[7].adjustments = {{3, 100.0f, 1.0f, 0.0f}};
  for (int r = 0; r < R; ++r) rs[r].key = 1000 + r, rs[r].step = 3;
  std::vector<DeviceRowSampling> dp(R);
  std::vector<LogitAdjustment> adj;
  for (int r = 0; r < R; ++r) {
    dp[r] = {rs[r].temperature, rs[r].top_k, rs[r].top_p, rs[r].min_p, rs[r].key, rs[r].step,
             static_cast<int32_t>(adj.size()), static_cast<int32_t>(rs[r].adjustments.size())};
    adj.insert(adj.end(), rs[r].adjustments.begin(), rs[r].adjustments.end());
  }
  auto run = [&](const std::vector<bf16>& rows, const std::vector<DeviceRowSampling>& params, int n) {
    auto d_l = Upload(rows), d_p = Upload(params), d_a = Upload(adj);
    auto d_t = Alloc(4 * n), d_bad = Alloc(4 * n), d_s = Alloc(static_cast<size_t>(n) * 2 * V * 4);
    SampleRowsParams p;
    p.logits = d_l.as<bf16>(), p.rows = n, p.vocab = V, p.params = d_p.as<DeviceRowSampling>();
    p.adjustments = d_a.as<LogitAdjustment>(), p.tokens = d_t.as<int32_t>(), p.nonfinite = d_bad.as<int32_t>();
    p.scratch = d_s.as<float>();
    EXPECT_TRUE(SampleRows(p, nullptr).ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return std::pair{Download<int32_t>(d_t, n), Download<int32_t>(d_bad, n)};
  };
  const auto [tokens, bad] = run(logits, dp, R);
  for (int r = 0; r < R; ++r) {
    std::vector<float> row(V);
    for (int i = 0; i < V; ++i) row[i] = Bf16ToFloat(logits[static_cast<size_t>(r) * V + i]);
    bool finite = true;
    const int32_t want = ref::SampleRow(row.data(), V, rs[r], &finite);
    EXPECT_EQ(bad[r], finite ? 0 : 1) << "row " << r;
    if (finite) EXPECT_EQ(tokens[r], want) << "row " << r;
  }
  EXPECT_EQ(tokens[7], 3) << "top-k 1 after a +100 bias is that token";
  // Each row alone (one-row launches): the same token; and run to run.
  for (int r = 0; r < R - 1; ++r) {
    std::vector<bf16> one(logits.begin() + static_cast<size_t>(r) * V, logits.begin() + static_cast<size_t>(r + 1) * V);
    std::vector<DeviceRowSampling> p1 = {dp[r]};
    EXPECT_EQ(run(one, p1, 1).first[0], tokens[r]) << "row " << r << " alone";
  }
  EXPECT_EQ(run(logits, dp, R).first, tokens);
  // Sampling draws differ with the step (the counter), so a seed gives a sequence, not one token.
  std::set<int32_t> seen;
  for (uint64_t step = 0; step < 16; ++step) {
    auto p2 = dp;
    p2[2].step = step;
    seen.insert(run(logits, p2, R).first[2]);
  }
  EXPECT_GT(seen.size(), 1u);
}

// Rows of several sequences in one launch (the batch's block tables, one row per sequence) give each
// sequence the bits of its own launch: RoPE-append into one shared pool and attention over it, for a
// sliding and a global preset, with either kernel kind (the prompt kernel then has rows of both
// sequences in one 16-row tile).
TEST(AttentionGpu, RowsOfSeveralSequencesMatchTheirOwnLaunches) {
  SKIP_WITHOUT_GPU();
  const int K = 8, D = 128, P = 32, pages = 64;
  for (WindowKind win : {WindowKind::kSliding, WindowKind::kGlobal}) {
    const int G = win == WindowKind::kSliding ? 8 : 6, H = G * K;
    auto kernel = ResolveAttention({D, G, P, KvDtype::kFp8, win});
    if (!kernel.ok()) continue;  // a focused build
    SCOPED_TRACE(kernel->name);
    // Two sequences over one pool with disjoint pages; sequence 0 at positions 700.., 1 at 40...
    const int max_pages = 32;
    std::vector<int32_t> tables(2 * max_pages, -1);
    for (int i = 0; i < 24; ++i) tables[i] = 63 - i;               // sequence 0: pages 63..40
    for (int i = 0; i < 4; ++i) tables[max_pages + i] = 2 * i + 1;  // sequence 1: pages 1, 3, 5, 7
    // Fill both sequences' history through RoPE-append of random rows, one sequence at a time.
    const size_t pool = static_cast<size_t>(pages) * P * K * D;
    auto d_kp = Alloc(pool, 0), d_vp = Alloc(pool, 0);
    auto d_tables = Upload(tables);
    auto qn = RandomBf16(D, 131), kn = RandomBf16(D, 132);
    std::vector<float> inv_freq(D / 2);
    for (int j = 0; j < D / 2; ++j) inv_freq[j] = std::pow(10000.0f, -2.0f * j / D);
    auto d_qn = Upload(qn), d_kn = Upload(kn), d_f = Upload(inv_freq);
    const int stride = (H + 2 * K) * D;
    auto rope = [&](const cuda::DeviceBuffer& qkv, const cuda::DeviceBuffer& pos, const int32_t* seq,
                    const int32_t* table, int T, cuda::DeviceBuffer& q_out) {
      QkNormRopeAppendParams p;
      p.q = qkv.as<bf16>(), p.k = p.q + H * D, p.v = p.k + K * D, p.qkv_stride = stride;
      p.q_norm_weight = d_qn.as<bf16>(), p.k_norm_weight = d_kn.as<bf16>(), p.inv_freq = d_f.as<float>();
      p.rotary_dim = D, p.positions = pos.as<int32_t>(), p.num_tokens = T, p.num_q_heads = H;
      p.num_kv_heads = K, p.head_dim = D, p.q_out = q_out.as<bf16>(), p.k_pool = d_kp.data(), p.v_pool = d_vp.data();
      p.kv_dtype = KvDtype::kFp8, p.k_scale = 0.05f, p.v_scale = 0.03f, p.page_size = P;
      p.block_table = table, p.token_seq = seq, p.block_table_stride = seq ? max_pages : 0;
      return QkNormRopeAppend(p, nullptr);
    };
    const int len[2] = {703, 43};
    std::vector<std::vector<int32_t>> hist_pos(2);
    for (int s = 0; s < 2; ++s) {
      for (int i = 0; i < len[s] - 3; ++i) hist_pos[s].push_back(i);
      auto qkv = Upload(RandomBf16(static_cast<size_t>(hist_pos[s].size()) * stride, 140 + s));
      auto pos = Upload(hist_pos[s]);
      auto q_out = Alloc(hist_pos[s].size() * H * D * 2);
      ASSERT_OK(rope(qkv, pos, nullptr, d_tables.as<int32_t>() + s * max_pages, static_cast<int>(hist_pos[s].size()), q_out));
    }
    Sync();
    const auto k_before = Download<uint8_t>(d_kp, pool), v_before = Download<uint8_t>(d_vp, pool);
    // This forward: 3 rows of sequence 0 and 2 of sequence 1.
    const std::vector<int32_t> seq = {0, 0, 0, 1, 1}, pos = {700, 701, 702, 40, 41}, history = {700, 700, 700, 40, 40};
    const int T = 5;
    auto qkv_rows = RandomBf16(static_cast<size_t>(T) * stride, 150);
    auto gate_rows = RandomBf16(static_cast<size_t>(T) * H, 151);
    for (AttnKind kind : {AttnKind::kDecode, AttnKind::kPrompt}) {
      SCOPED_TRACE(AttnKindName(kind));
      ASSERT_OK(d_kp.CopyFromHost(k_before.data(), pool));
      ASSERT_OK(d_vp.CopyFromHost(v_before.data(), pool));
      auto attend = [&](int first, int n, bool batched) {
        auto d_qkv = Upload(std::vector<bf16>(qkv_rows.begin() + static_cast<size_t>(first) * stride,
                                              qkv_rows.begin() + static_cast<size_t>(first + n) * stride));
        auto d_pos = Upload(std::vector<int32_t>(pos.begin() + first, pos.begin() + first + n));
        auto d_seq = Upload(std::vector<int32_t>(seq.begin() + first, seq.begin() + first + n));
        auto d_hist = Upload(std::vector<int32_t>(history.begin() + first, history.begin() + first + n));
        auto d_gate = Upload(std::vector<bf16>(gate_rows.begin() + static_cast<size_t>(first) * H,
                                               gate_rows.begin() + static_cast<size_t>(first + n) * H));
        auto q_out = Alloc(static_cast<size_t>(n) * H * D * 2), out = Alloc(static_cast<size_t>(n) * H * D * 2);
        const int32_t* table = d_tables.as<int32_t>() + (batched ? 0 : seq[first] * max_pages);
        EXPECT_TRUE(rope(d_qkv, d_pos, batched ? d_seq.as<int32_t>() : nullptr, table, n, q_out).ok());
        AttentionParams a;
        a.q = q_out.as<bf16>(), a.k_pool = d_kp.data(), a.v_pool = d_vp.data(), a.block_table = table;
        a.token_seq = batched ? d_seq.as<int32_t>() : nullptr, a.block_table_stride = batched ? max_pages : 0;
        a.positions = d_pos.as<int32_t>(), a.history_stable = true, a.history = d_hist.as<int32_t>();
        a.max_position = 1023, a.num_tokens = n, a.num_q_heads = H, a.num_kv_heads = K, a.head_dim = D;
        a.page_size = P, a.kv_dtype = KvDtype::kFp8, a.window_kind = win, a.window = 512;
        a.k_scale = 0.05f, a.v_scale = 0.03f, a.gate = d_gate.as<bf16>(), a.gate_stride = H, a.out = out.as<bf16>();
        auto ws = Alloc(AttentionWorkspaceBytes(a)), counters = Alloc(static_cast<size_t>(n) * K * 4, 0);
        a.workspace = ws.data(), a.workspace_bytes = ws.size(), a.counters = counters.as<uint32_t>();
        EXPECT_TRUE(RunAttention(*kernel, a, nullptr, kind).ok());
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        return Download<bf16>(out, static_cast<size_t>(n) * H * D);
      };
      const auto together = attend(0, T, true);
      const auto k_together = Download<uint8_t>(d_kp, pool), v_together = Download<uint8_t>(d_vp, pool);
      ASSERT_OK(d_kp.CopyFromHost(k_before.data(), pool));
      ASSERT_OK(d_vp.CopyFromHost(v_before.data(), pool));
      auto alone = attend(0, 3, false);
      const auto alone1 = attend(3, 2, false);
      alone.insert(alone.end(), alone1.begin(), alone1.end());
      EXPECT_EQ(together, alone) << "attention rows";
      EXPECT_TRUE(Download<uint8_t>(d_kp, pool) == k_together && Download<uint8_t>(d_vp, pool) == v_together)
          << "the appended K/V land in the same slots";
    }
  }
}

// The batch's small element-wise helpers: row gather for the output rows, the residual add of the
// hidden-state taps (AddRmsNorm's rounding).
TEST(ElementwiseGpu, GatherRowsAndAddBf16) {
  SKIP_WITHOUT_GPU();
  const int width = 136, rows = 7;
  auto src = RandomBf16(static_cast<size_t>(rows) * width, 161);
  const std::vector<int32_t> pick = {6, 0, 3, 3};
  auto d_src = Upload(src), d_pick = Upload(pick), d_dst = Alloc(pick.size() * width * 2);
  ASSERT_OK(GatherRows({d_src.as<bf16>(), d_pick.as<int32_t>(), d_dst.as<bf16>(), 4, width}, nullptr));
  Sync();
  const auto got = Download<bf16>(d_dst, pick.size() * width);
  for (size_t r = 0; r < pick.size(); ++r) EXPECT_EQ(Rows(got, width, static_cast<int>(r), 1), Rows(src, width, pick[r], 1));
  auto a = RandomBf16(1000, 162, 4.0f), b = RandomBf16(1000, 163);
  auto d_a = Upload(a), d_b = Upload(b), d_o = Alloc(2000);
  ASSERT_OK(AddBf16(d_a.as<bf16>(), d_b.as<bf16>(), d_o.as<bf16>(), 1000, nullptr));
  Sync();
  const auto o = Download<bf16>(d_o, 1000);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(o[i], FloatToBf16(Bf16ToFloat(a[i]) + Bf16ToFloat(b[i]))) << i;
}

}  // namespace
}  // namespace dl::kernels
