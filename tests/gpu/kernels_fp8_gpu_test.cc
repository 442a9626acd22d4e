// FP8-weight GEMV and MoE kernels (the FP8 rule of kernels/ops.h) against their CPU references
// (kernels/reference: dequantise exactly, then the FP32 product), and bit-identity between every FP8
// path: batch 1 == batched == grouped, any token tile, any grouping; shapes from
// XS.2 and ones whose widths are not multiples of 128 (partial scale blocks); 128x128, per-tensor and
// per-channel scales. Every test skips visibly where no CUDA device is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/rng.h"
#include "cuda/buffer.h"
#include "cuda/device.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/reference/reference.h"
#include "tests/gpu/gpu_test_util.h"

namespace dl::kernels {
namespace {

using namespace gpu_test;  // NOLINT(google-build-using-namespace): the shared test helpers

// The MoE's absolute tolerance: the BF16 tests' 2e-3 at their output scale, growing with the output's
// largest magnitude (a one-ulp BF16 flip of an intermediate h moves outputs in proportion to the
// layer's scale, which is larger at XS.2's widths).
float MoeAtol(const std::vector<bf16>& want) {
  float m = 0.0f;
  for (bf16 v : want) m = std::max(m, std::fabs(Bf16ToFloat(v)));
  return std::max(2e-3f, 2e-3f * m);
}

// An FP8 weight [rows, cols] quantised by the contract's rule from scale * NormalAt(key, i) (FP32):
// per block amax, s = amax / 448 (1 when amax == 0), code = FloatToFp8E4M3(v / s). Blocks br x bc
// (0: the whole dimension).
struct HostFp8 {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  int rows = 0, cols = 0, br = 0, bc = 0;
  Fp8Weight Host() const { return {codes.data(), scales.data(), br, bc}; }
};
HostFp8 QuantizedFp8(int rows, int cols, uint64_t key, float scale, int br = 128, int bc = 128) {
  HostFp8 w;
  w.rows = rows, w.cols = cols, w.br = br > 0 ? br : rows, w.bc = bc > 0 ? bc : cols;
  const int sr = (rows + w.br - 1) / w.br, sc = (cols + w.bc - 1) / w.bc;
  std::vector<float> v(static_cast<size_t>(rows) * cols);
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * NormalAt(key, i);
  w.scales.assign(static_cast<size_t>(sr) * sc, 0.0f);
  for (int o = 0; o < rows; ++o)
    for (int i = 0; i < cols; ++i) {
      float& s = w.scales[(o / w.br) * sc + i / w.bc];
      s = std::max(s, std::fabs(v[static_cast<size_t>(o) * cols + i]));
    }
  for (float& s : w.scales) s = s == 0.0f ? 1.0f : s / 448.0f;
  w.codes.resize(v.size());
  for (int o = 0; o < rows; ++o)
    for (int i = 0; i < cols; ++i) {
      const size_t at = static_cast<size_t>(o) * cols + i;
      w.codes[at] = FloatToFp8E4M3(v[at] / w.scales[(o / w.br) * sc + i / w.bc]);
    }
  return w;
}
struct DeviceFp8 {
  cuda::DeviceBuffer codes, scales;
  int br = 0, bc = 0;
  explicit DeviceFp8(const HostFp8& h) : codes(Upload(h.codes)), scales(Upload(h.scales)), br(h.br), bc(h.bc) {}
  Fp8Weight Weight() const { return {codes.as<uint8_t>(), scales.as<float>(), br, bc}; }
};

GemvParams Fp8Gemv(const Fp8Weight& w, const bf16* x, bf16* y, int out, int in, int T, int ks = 0) {
  GemvParams p;
  p.w_fp8 = w, p.x = x, p.y = y, p.out = out, p.in = in, p.num_tokens = T, p.k_split = ks;
  return p;
}

// ---------------------------------------------------------------------------------------------------
struct GemvCase {
  int out, in, ks, br, bc;
};

// Against the reference, the FP8 rule's exact bits (ref::GemvFp8Rule), and every token alone (batch 1)
// and every batched-kernel shape give the batched launch's bits.
TEST(Fp8GemvGpu, MatchesReferenceAndIsBatchInvariant) {
  SKIP_WITHOUT_GPU();
  for (const GemvCase c : {GemvCase{1000, 2048, 0, 128, 128}, GemvCase{64, 512, 0, 128, 128},
                           GemvCase{2048, 8192, 0, 128, 128}, GemvCase{2048, 8192, 1, 128, 128},
                           GemvCase{300, 8192, 8, 128, 128}, GemvCase{10304, 2048, 0, 128, 128},
                           GemvCase{333, 400, 0, 128, 128}, GemvCase{130, 144, 0, 128, 128},
                           GemvCase{200, 1040, 0, 0, 0}, GemvCase{257, 2064, 0, 1, 0}}) {
    SCOPED_TRACE(testing::Message() << c.out << "x" << c.in << " k_split " << c.ks << " blocks " << c.br << "x" << c.bc);
    const int T = 37;
    const HostFp8 hw = QuantizedFp8(c.out, c.in, 91, 0.05f, c.br, c.bc);
    const DeviceFp8 dw(hw);
    auto x = RandomBf16(static_cast<size_t>(T) * c.in, 92);
    auto d_x = Upload(x);
    auto d_y = Alloc(static_cast<size_t>(T) * c.out * 2), d_y1 = Alloc(c.out * 2);
    const GemvParams p = Fp8Gemv(dw.Weight(), d_x.as<bf16>(), d_y.as<bf16>(), c.out, c.in, T, c.ks);
    ASSERT_OK(Gemv(p, nullptr));
    std::vector<bf16> ref(static_cast<size_t>(T) * c.out);
    ref::Gemv(Fp8Gemv(hw.Host(), x.data(), ref.data(), c.out, c.in, T));
    const auto y = Download<bf16>(d_y, static_cast<size_t>(T) * c.out);
    ExpectClose(y, ref, 1e-4f, 1.0f / 128, "fp8 gemm");
    std::vector<bf16> rule(ref.size());
    ref::GemvFp8Rule(Fp8Gemv(hw.Host(), x.data(), rule.data(), c.out, c.in, T, c.ks));
    EXPECT_EQ(y, rule) << "the FP8 rule's bits (ref::GemvFp8Rule)";
    for (int t : {0, 7, 10, 36}) {
      ASSERT_OK(Gemv(Fp8Gemv(dw.Weight(), d_x.as<bf16>() + t * c.in, d_y1.as<bf16>(), c.out, c.in, 1, c.ks), nullptr));
      EXPECT_EQ(Download<bf16>(d_y1, c.out), Rows(y, c.out, t, 1)) << "token " << t;
    }
    for (auto [rows, tokens] : {std::pair{1, 4}, std::pair{1, 16}, std::pair{2, 8}, std::pair{4, 8}, std::pair{4, 16}}) {
      for (int n : {2, 9, T}) {
        GemvParams q = p;
        q.num_tokens = n;
        q.batch_rows = rows, q.batch_tokens = tokens;
        auto d_yq = Alloc(static_cast<size_t>(n) * c.out * 2);
        q.y = d_yq.as<bf16>();
        ASSERT_OK(Gemv(q, nullptr));
        Sync();
        EXPECT_EQ(Download<bf16>(d_yq, static_cast<size_t>(n) * c.out), Rows(y, c.out, 0, n))
            << "rows/warp " << rows << " tokens/tile " << tokens << " T " << n;
      }
    }
  }
}

// FP8 weights on the tensor-core product (ops.h 5d, prompt rows): against the reference; every token
// alone, and every run of tokens at any offset, gives the long launch's bits (one kernel for every T,
// no k_split); run to run. 128 x 128 blocks with partial edges, 32-wide block columns, per-tensor and
// per-channel scales, XS.2's q/k/v and o_proj widths.
TEST(Fp8MmaProductGpu, MatchesReferenceAndEveryTokenAlone) {
  SKIP_WITHOUT_GPU();
  for (const GemvCase c : {GemvCase{1024, 2048, 0, 128, 128}, GemvCase{2048, 8192, 0, 128, 128},
                           GemvCase{333, 400, 0, 128, 128}, GemvCase{130, 144, 0, 128, 128},
                           GemvCase{96, 256, 0, 32, 32}, GemvCase{200, 1040, 0, 0, 0},
                           GemvCase{257, 2064, 0, 1, 0}}) {
    SCOPED_TRACE(testing::Message() << c.out << "x" << c.in << " blocks " << c.br << "x" << c.bc);
    const int T = 300;
    const HostFp8 hw = QuantizedFp8(c.out, c.in, 191, 0.05f, c.br, c.bc);
    const DeviceFp8 dw(hw);
    auto x = RandomBf16(static_cast<size_t>(T) * c.in, 192);
    auto d_x = Upload(x);
    auto d_y = Alloc(static_cast<size_t>(T) * c.out * 2), d_y2 = Alloc(static_cast<size_t>(T) * c.out * 2);
    GemvParams p = Fp8Gemv(dw.Weight(), d_x.as<bf16>(), d_y.as<bf16>(), c.out, c.in, T);
    p.mma = true;
    ASSERT_OK(Gemv(p, nullptr));
    const auto y = Download<bf16>(d_y, static_cast<size_t>(T) * c.out);
    std::vector<bf16> ref(static_cast<size_t>(T) * c.out);
    ref::Gemv(Fp8Gemv(hw.Host(), x.data(), ref.data(), c.out, c.in, T));
    ExpectClose(y, ref, 1e-4f, 1.0f / 128, "fp8 mma product");
    GemvParams again = p;
    again.y = d_y2.as<bf16>();
    ASSERT_OK(Gemv(again, nullptr));
    EXPECT_EQ(Download<bf16>(d_y2, static_cast<size_t>(T) * c.out), y) << "run to run";
    for (auto [t0, n] : {std::pair{0, 1}, std::pair{7, 1}, std::pair{299, 1}, std::pair{5, 37}, std::pair{130, 130},
                         std::pair{1, 299}}) {
      GemvParams q = p;
      q.x = d_x.as<bf16>() + static_cast<size_t>(t0) * c.in;
      q.y = d_y2.as<bf16>();
      q.num_tokens = n;
      ASSERT_OK(Gemv(q, nullptr));
      EXPECT_EQ(Download<bf16>(d_y2, static_cast<size_t>(n) * c.out), Rows(y, c.out, t0, n))
          << "tokens " << t0 << " .. " << t0 + n - 1 << " alone";
    }
  }
}

TEST(Fp8MmaProductGpu, RefusesBlockShapesItDoesNotCover) {
  SKIP_WITHOUT_GPU();
  const DeviceFp8 dw(QuantizedFp8(64, 512, 1, 0.05f, 128, 16));
  auto d_x = Upload(RandomBf16(512, 2)), d_y = Alloc(64 * 2);
  GemvParams p = Fp8Gemv(dw.Weight(), d_x.as<bf16>(), d_y.as<bf16>(), 64, 512, 1);
  p.mma = true;
  const Status st = Gemv(p, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.ToString().find("power of two >= 32"), std::string::npos) << st.ToString();
}

// A norm folded into the FP8 GEMV gives AddRmsNorm + the FP8 GEMV's bits (plain tiles at 1 and 11 tokens).
TEST(Fp8GemvGpu, FusedInputNormMatchesSeparateKernels) {
  SKIP_WITHOUT_GPU();
  for (auto [out, in, T] : {std::tuple{1000, 2048, 1}, std::tuple{1000, 2048, 11}, std::tuple{10304, 2048, 1},
                            std::tuple{700, 8192, 1}, std::tuple{130, 144, 3}}) {
    SCOPED_TRACE(testing::Message() << out << "x" << in << " T " << T);
    const size_t n = static_cast<size_t>(T) * in;
    const DeviceFp8 dw(QuantizedFp8(out, in, 96, 0.05f));
    auto h = RandomBf16(n, 97, 4.0f), dl = RandomBf16(n, 98), nw = RandomBf16(in, 99);
    auto d_nw = Upload(nw), d_dl = Upload(dl);
    auto d_h_sep = Upload(h), d_u = Alloc(n * 2), d_y_sep = Alloc(static_cast<size_t>(T) * out * 2);
    AddRmsNormParams np{d_h_sep.as<bf16>(), d_dl.as<bf16>(), d_nw.as<bf16>(), d_u.as<bf16>(), T, in, 1e-6f};
    ASSERT_OK(AddRmsNorm(np, nullptr));
    ASSERT_OK(Gemv(Fp8Gemv(dw.Weight(), d_u.as<bf16>(), d_y_sep.as<bf16>(), out, in, T), nullptr));
    auto d_h = Upload(h), d_h_out = Alloc(n * 2), d_u_out = Alloc(n * 2), d_y = Alloc(static_cast<size_t>(T) * out * 2);
    GemvParams fused = Fp8Gemv(dw.Weight(), nullptr, d_y.as<bf16>(), out, in, T);
    fused.norm.residual = d_h.as<bf16>();
    fused.norm.delta = d_dl.as<bf16>();
    fused.norm.weight = d_nw.as<bf16>();
    fused.norm.residual_out = d_h_out.as<bf16>();
    fused.norm.u_out = d_u_out.as<bf16>();
    fused.norm.eps = 1e-6f;
    ASSERT_OK(Gemv(fused, nullptr));
    Sync();
    const auto y_sep = Download<bf16>(d_y_sep, static_cast<size_t>(T) * out);
    EXPECT_EQ(Download<bf16>(d_y, static_cast<size_t>(T) * out), y_sep);
    EXPECT_EQ(Download<bf16>(d_u_out, n), Download<bf16>(d_u, n));
    EXPECT_EQ(Download<bf16>(d_h_out, n), Download<bf16>(d_h_sep, n));
  }
}

// The rule's order, hand-checkable (Reference.Fp8RuleSumsEachChunkFromZeroThenScalesIt): one row of 528
// codes, lane 0's chunk 0 sums to 2^24 and its chunk 32 to fl(1 - 2^24) = 1 - 2^24, so the row is
// exactly the scale s; one FMA chain over all elements would give fl(2^24 + 1) - 2^24 = 0. Plain,
// fused-norm-free batched (two equal tokens) and every batched shape.
TEST(Fp8GemvGpu, SumsEachChunkFromZeroThenScalesIt) {
  SKIP_WITHOUT_GPU();
  const int in = 528;
  std::vector<uint8_t> codes(in, 0x00);
  std::vector<bf16> x(in, FloatToBf16(0.0f));
  codes[0] = 0x78, x[0] = FloatToBf16(65536.0f);
  codes[16 * 32] = 0x38, x[16 * 32] = FloatToBf16(1.0f);
  codes[16 * 32 + 1] = 0xf8, x[16 * 32 + 1] = FloatToBf16(65536.0f);
  std::vector<bf16> x2(x);
  x2.insert(x2.end(), x.begin(), x.end());
  for (float s : {1.0f, 0.375f}) {
    SCOPED_TRACE(testing::Message() << "scale " << s);
    auto d_codes = Upload(codes), d_scale = Upload(std::vector<float>{s}), d_x = Upload(x2);
    auto d_y = Alloc(2 * 2);
    const Fp8Weight w{d_codes.as<uint8_t>(), d_scale.as<float>(), 1, in};
    GemvParams p = Fp8Gemv(w, d_x.as<bf16>(), d_y.as<bf16>(), 1, in, 1);
    ASSERT_OK(Gemv(p, nullptr));
    Sync();
    EXPECT_EQ(Bf16ToFloat(Download<bf16>(d_y, 1)[0]), s) << "plain";
    for (int rows : {1, 2, 4}) {
      GemvParams b = p;
      b.num_tokens = 2, b.batch_rows = rows;
      ASSERT_OK(Gemv(b, nullptr));
      Sync();
      const auto y = Download<bf16>(d_y, 2);
      EXPECT_EQ(Bf16ToFloat(y[0]), s) << "batched, " << rows << " rows per warp";
      EXPECT_EQ(Bf16ToFloat(y[1]), s) << "batched, " << rows << " rows per warp";
    }
  }
}

TEST(Fp8GemvGpu, RefusesWhatTheRuleDoesNotCover) {
  SKIP_WITHOUT_GPU();
  const DeviceFp8 dw(QuantizedFp8(64, 512, 1, 0.05f));
  auto d_x = Upload(RandomBf16(512, 2)), d_y = Alloc(64 * 2);
  GemvParams both = Fp8Gemv(dw.Weight(), d_x.as<bf16>(), d_y.as<bf16>(), 64, 512, 1);
  both.w = d_x.as<bf16>();
  EXPECT_FALSE(Gemv(both, nullptr).ok()) << "BF16 and FP8 weights at once";
  GemvParams narrow = Fp8Gemv(dw.Weight(), d_x.as<bf16>(), d_y.as<bf16>(), 64, 504, 1);
  EXPECT_FALSE(Gemv(narrow, nullptr).ok()) << "in % 16 != 0";
  Fp8Weight odd = dw.Weight();
  odd.block_cols = 96;
  EXPECT_FALSE(Gemv(Fp8Gemv(odd, d_x.as<bf16>(), d_y.as<bf16>(), 64, 512, 1), nullptr).ok()) << "block_cols 96";
  Fp8Weight no_scales = dw.Weight();
  no_scales.scales = nullptr;
  EXPECT_FALSE(Gemv(Fp8Gemv(no_scales, d_x.as<bf16>(), d_y.as<bf16>(), 64, 512, 1), nullptr).ok()) << "no scales";
  GemvParams streaming = Fp8Gemv(dw.Weight(), d_x.as<bf16>(), d_y.as<bf16>(), 64, 512, 1);
  streaming.streaming.on = true;
  const Status st = Gemv(streaming, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << "FP8 weights have no streaming kernel: " << st.ToString();
}

// The device's synthetic FP8 fill quantises like the host (the contract's rule), up to the last bit of
// the device's logf/cosf: scales within a few ulps, codes at most one step apart and nearly all equal;
// 128x128 blocks with partial edges, per-channel and per-tensor.
TEST(Fp8FillGpu, FillAffineFp8MatchesTheHostRule) {
  SKIP_WITHOUT_GPU();
  for (auto [rows, cols, br, bc] : {std::tuple{300, 400, 128, 128}, std::tuple{64, 2048, 1, 2048}, std::tuple{100, 272, 100, 272}}) {
    SCOPED_TRACE(testing::Message() << rows << "x" << cols << " blocks " << br << "x" << bc);
    const HostFp8 h = QuantizedFp8(rows, cols, 4242, 0.03f, br, bc);
    auto d_codes = Alloc(static_cast<size_t>(rows) * cols), d_scales = Alloc(h.scales.size() * 4);
    ASSERT_OK(FillAffineFp8(d_codes.as<uint8_t>(), d_scales.as<float>(), rows, cols, br, bc, 4242, 0.03f, 0.0f, nullptr));
    Sync();
    const auto codes = Download<uint8_t>(d_codes, h.codes.size());
    const auto scales = Download<float>(d_scales, h.scales.size());
    for (size_t b = 0; b < scales.size(); ++b) EXPECT_NEAR(scales[b], h.scales[b], h.scales[b] * 1e-6f) << "block " << b;
    size_t differ = 0;
    for (size_t i = 0; i < codes.size(); ++i) {
      const int step = std::abs(static_cast<int>(codes[i] & 0x7f) - static_cast<int>(h.codes[i] & 0x7f));
      ASSERT_LE(step, 1) << "element " << i;
      differ += codes[i] != h.codes[i];
    }
    EXPECT_LE(differ, codes.size() / 1000) << differ << " codes differ";
  }
}

// ---------------------------------------------------------------------------------------------------
// A random MoE layer with FP8 routed experts (and an FP8 or BF16 shared expert), host and device copies.
struct Fp8MoeLayer {
  int E, k, d, F, Fs;
  bool shared_fp8;
  std::vector<HostFp8> host;   // gate, up, down of each expert, then the shared expert's (FP8)
  std::vector<std::vector<bf16>> shared_bf16;  // the shared expert's BF16 matrices (shared_fp8 false)
  std::vector<DeviceFp8> dev;
  std::vector<cuda::DeviceBuffer> shared_bf16_dev;
  std::vector<bf16> router_h, bias_h;
  cuda::DeviceBuffer router, bias;
  cuda::DeviceBuffer codes[3], scales[3];  // device arrays [E] per matrix kind
  std::vector<const uint8_t*> h_codes[3];
  std::vector<const float*> h_scales[3];
  int br, bc;

  Fp8MoeLayer(int E_, int k_, int d_, int F_, int Fs_, bool shared_fp8_, uint64_t seed, int br_ = 128, int bc_ = 128)
      : E(E_), k(k_), d(d_), F(F_), Fs(Fs_), shared_fp8(shared_fp8_), br(br_), bc(bc_) {
    std::vector<const uint8_t*> dc[3];
    std::vector<const float*> ds[3];
    for (int e = 0; e <= E; ++e) {
      const int f = e == E ? Fs : F;
      for (int m = 0; m < 3; ++m) {
        const int rows = m == 2 ? d : f, cols = m == 2 ? f : d;
        if (e == E && !shared_fp8) {
          shared_bf16.push_back(RandomBf16(static_cast<size_t>(rows) * cols, seed + 3 * e + m, 0.08f));
          continue;
        }
        host.push_back(QuantizedFp8(rows, cols, seed + 3 * e + m, 0.08f, br, bc));
      }
    }
    for (const HostFp8& h : host) dev.emplace_back(h);
    for (const auto& s : shared_bf16) shared_bf16_dev.push_back(Upload(s));
    for (int e = 0; e < E; ++e)
      for (int m = 0; m < 3; ++m) {
        dc[m].push_back(dev[3 * e + m].codes.as<uint8_t>()), ds[m].push_back(dev[3 * e + m].scales.as<float>());
        h_codes[m].push_back(host[3 * e + m].codes.data()), h_scales[m].push_back(host[3 * e + m].scales.data());
      }
    for (int m = 0; m < 3; ++m) codes[m] = Upload(dc[m]), scales[m] = Upload(ds[m]);
    router_h = RandomBf16(static_cast<size_t>(E) * d, seed + 100000, 0.1f);
    bias_h = RandomBf16(E, seed + 100001, 0.05f);
    router = Upload(router_h), bias = Upload(bias_h);
  }
  MoeParams Params(const bf16* x, bf16* y, int32_t* ids, float* wts, void* workspace, uint32_t* counter, int T) const {
    MoeParams p;
    p.x = x, p.router_w = router.as<bf16>(), p.router_bias = bias.as<bf16>();
    MoeParams::Fp8Experts* kinds[3] = {&p.gate_fp8, &p.up_fp8, &p.down_fp8};
    // One block shape per matrix kind (per-channel / per-tensor blocks depend on the kind's width).
    for (int m = 0; m < 3; ++m) {
      *kinds[m] = {codes[m].as<const uint8_t*>(), scales[m].as<const float*>(), host[m].br, host[m].bc};
    }
    if (shared_fp8) {
      p.shared_gate_fp8 = dev[3 * E].Weight(), p.shared_up_fp8 = dev[3 * E + 1].Weight();
      p.shared_down_fp8 = dev[3 * E + 2].Weight();
    } else {
      p.shared_gate_w = shared_bf16_dev[0].as<bf16>(), p.shared_up_w = shared_bf16_dev[1].as<bf16>();
      p.shared_down_w = shared_bf16_dev[2].as<bf16>();
    }
    p.d = d, p.num_experts = E, p.top_k = k, p.ffn = F, p.shared_ffn = Fs, p.alpha = 2.5f;
    p.num_tokens = T, p.y = y, p.topk_ids = ids, p.topk_weights = wts, p.workspace = workspace, p.counter = counter;
    return p;
  }
  // The same layer with host pointers, for ref::Moe (one token).
  MoeParams HostParams(const bf16* x, bf16* y, int32_t* ids, float* wts) const {
    MoeParams p = Params(x, y, ids, wts, nullptr, nullptr, 1);
    p.router_w = router_h.data(), p.router_bias = bias_h.data();
    MoeParams::Fp8Experts* kinds[3] = {&p.gate_fp8, &p.up_fp8, &p.down_fp8};
    for (int m = 0; m < 3; ++m) *kinds[m] = {h_codes[m].data(), h_scales[m].data(), host[m].br, host[m].bc};
    if (shared_fp8) {
      p.shared_gate_fp8 = host[3 * E].Host(), p.shared_up_fp8 = host[3 * E + 1].Host();
      p.shared_down_fp8 = host[3 * E + 2].Host();
    } else {
      p.shared_gate_w = shared_bf16[0].data(), p.shared_up_w = shared_bf16[1].data();
      p.shared_down_w = shared_bf16[2].data();
    }
    return p;
  }
};

struct MoeShape {
  int E, k, d, F, Fs;
  bool shared_fp8;
  int br, bc;
};

// Batch 1 against the reference (selection and weights exact from the kernel's own logits), FP8 shared
// expert or BF16 (the S 2.1 export's layout), 128x128 / per-channel / per-tensor scales, widths that are
// not multiples of 128; run to run bit-identical.
TEST(Fp8MoeGpu, MatchesReference) {
  SKIP_WITHOUT_GPU();
  for (const MoeShape c : {MoeShape{8, 3, 64, 32, 16, true, 128, 128}, MoeShape{64, 8, 512, 128, 64, true, 128, 128},
                           MoeShape{64, 8, 512, 128, 64, false, 128, 128}, MoeShape{32, 4, 400, 144, 80, true, 128, 128},
                           MoeShape{16, 4, 256, 64, 64, true, 1, 0}, MoeShape{16, 4, 256, 64, 64, false, 0, 0},
                           MoeShape{256, 8, 2048, 512, 512, true, 128, 128}}) {
    SCOPED_TRACE(testing::Message() << "E " << c.E << " k " << c.k << " d " << c.d << " F " << c.F << " Fs " << c.Fs
                                    << " shared " << (c.shared_fp8 ? "fp8" : "bf16") << " blocks " << c.br << "x" << c.bc);
    const Fp8MoeLayer layer(c.E, c.k, c.d, c.F, c.Fs, c.shared_fp8, 7000, c.br, c.bc);
    auto x = RandomBf16(c.d, 701);
    auto d_x = Upload(x), d_y = Alloc(c.d * 2), d_ids = Alloc(c.k * 4), d_w = Alloc(c.k * 4);
    auto d_ws = Alloc(MoeWorkspaceBytes(c.d, c.E, c.k, c.F, c.Fs)), d_counter = Alloc(4, 0);
    const MoeParams p = layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), d_ids.as<int32_t>(), d_w.as<float>(), d_ws.data(),
                                     d_counter.as<uint32_t>(), 1);
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    const auto y1 = Download<bf16>(d_y, c.d);
    const auto logits = Download<float>(d_ws, c.E);  // the workspace starts with the router logits
    std::vector<bf16> y_ref(c.d);
    std::vector<int32_t> ids_ref(c.k);
    std::vector<float> w_ref(c.k);
    ref::Moe(layer.HostParams(x.data(), y_ref.data(), ids_ref.data(), w_ref.data()), logits.data());
    EXPECT_EQ(Download<int32_t>(d_ids, c.k), ids_ref);
    EXPECT_EQ(Download<float>(d_w, c.k), w_ref);
    ExpectClose(y1, y_ref, MoeAtol(y_ref), 1.0f / 32, "fp8 moe y");
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_y, c.d), y1) << "run to run";
    EXPECT_EQ(Download<uint32_t>(d_counter, 1)[0], 0u);
  }
}

// The grouped path (T > 1) gives every token the bits it gets alone (batch 1) and inside a shuffled
// subset of the batch; the grouped result also matches the reference per token. mma: the experts on
// the tensor-core product (ops.h 5d; batch 1 through the lists too).
void ExpectGroupedMatchesAloneAndReference(const MoeShape& c, int T, bool mma = false) {
  {
    SCOPED_TRACE(testing::Message() << "E " << c.E << " k " << c.k << " d " << c.d << " T " << T << " shared "
                                    << (c.shared_fp8 ? "fp8" : "bf16") << " blocks " << c.br << "x" << c.bc
                                    << (mma ? " mma" : ""));
    const Fp8MoeLayer layer(c.E, c.k, c.d, c.F, c.Fs, c.shared_fp8, 8000, c.br, c.bc);
    auto x = RandomBf16(static_cast<size_t>(T) * c.d, 801);
    auto d_x = Upload(x), d_y = Alloc(static_cast<size_t>(T) * c.d * 2), d_ids = Alloc(static_cast<size_t>(T) * c.k * 4);
    auto d_ws = Alloc(MoeWorkspaceBytes(c.d, c.E, c.k, c.F, c.Fs, T)), d_counter = Alloc(T * 4, 0);
    MoeParams p = layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), d_ids.as<int32_t>(), nullptr, d_ws.data(),
                               d_counter.as<uint32_t>(), T);
    p.mma = mma;
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    const auto y_all = Download<bf16>(d_y, static_cast<size_t>(T) * c.d);
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    EXPECT_EQ(Download<bf16>(d_y, static_cast<size_t>(T) * c.d), y_all) << "run to run";
    auto d_y1 = Alloc(c.d * 2), d_ids1 = Alloc(c.k * 4);
    for (int t = 0; t < T; t += 4) {
      MoeParams one = p;
      one.num_tokens = 1;
      one.x = d_x.as<bf16>() + static_cast<size_t>(t) * c.d;
      one.y = d_y1.as<bf16>(), one.topk_ids = d_ids1.as<int32_t>();
      ASSERT_OK(Moe(one, nullptr));
      Sync();
      ASSERT_EQ(Download<bf16>(d_y1, c.d), Rows(y_all, c.d, t, 1)) << "token " << t;
      if (t % 16 == 0) {  // the reference is slow at XS.2's widths: a few tokens
        std::vector<bf16> y_ref(c.d);
        std::vector<int32_t> ids_ref(c.k);
        std::vector<float> w_ref(c.k);
        const auto logits = Download<float>(d_ws, c.E);  // token 0's slice; the single launch wrote it
        ref::Moe(layer.HostParams(x.data() + static_cast<size_t>(t) * c.d, y_ref.data(), ids_ref.data(), w_ref.data()),
                 logits.data());
        ExpectClose(Rows(y_all, c.d, t, 1), y_ref, MoeAtol(y_ref), 1.0f / 32, "grouped fp8 moe token " + std::to_string(t));
      }
    }
    // A shuffled subset of the tokens in another batch: the same rows.
    ExpectShuffledSubsetGivesTheSameRows(p, x, y_all, 7);
  }
}

// Small layers: few experts (token tiles), k 4 and 8, a BF16 shared expert beside FP8 routed ones, widths
// that are not multiples of 128.
TEST(Fp8MoeGpu, GroupedPathMatchesEveryTokenAloneAndTheReference) {
  SKIP_WITHOUT_GPU();
  ExpectGroupedMatchesAloneAndReference({16, 4, 512, 128, 64, true, 128, 128}, 40);
  ExpectGroupedMatchesAloneAndReference({64, 8, 512, 128, 128, false, 128, 128}, 33);
  ExpectGroupedMatchesAloneAndReference({32, 4, 400, 144, 80, true, 128, 128}, 9);
}

// The FP8 experts on the tensor-core product (ops.h 5d): the same properties, with 128 x 128 blocks
// (partial edges), per-channel and per-tensor scales, and a BF16 shared expert beside FP8 routed ones
// (its BF16 bits in the FP8 launch). Small layers (racecheck runs this one).
TEST(Fp8MoeGpu, MmaExpertsMatchEveryTokenAloneAndTheReference) {
  SKIP_WITHOUT_GPU();
  ExpectGroupedMatchesAloneAndReference({16, 4, 512, 128, 64, true, 128, 128}, 40, true);
  ExpectGroupedMatchesAloneAndReference({64, 8, 512, 128, 128, false, 128, 128}, 33, true);
  ExpectGroupedMatchesAloneAndReference({32, 4, 400, 144, 80, true, 128, 128}, 9, true);
  ExpectGroupedMatchesAloneAndReference({16, 4, 256, 64, 64, true, 1, 0}, 21, true);
  ExpectGroupedMatchesAloneAndReference({16, 4, 256, 64, 64, false, 0, 0}, 21, true);
}

// XS.2's layer at T 64 on the FP8 tensor-core experts.
TEST(Fp8MoeGpu, MmaExpertsAtXs2Widths) {
  SKIP_WITHOUT_GPU();
  ExpectGroupedMatchesAloneAndReference({256, 8, 2048, 512, 512, true, 128, 128}, 64, true);
}

// XS.2's layer (E 256, k 8, d 2,048, F = Fs = 512) at T 64.
TEST(Fp8MoeGpu, GroupedPathAtXs2Widths) {
  SKIP_WITHOUT_GPU();
  ExpectGroupedMatchesAloneAndReference({256, 8, 2048, 512, 512, true, 128, 128}, 64);
}

// The multi-row router with FP8 expert tables (the code pointers it writes for the expert kernels) gives
// the one-row router's bits (ExpectMultiRowRouterMatchesOneRow), with and without the fused norm: XS.2's
// layer with an FP8 shared expert, a small one with a BF16 shared expert.
TEST(Fp8MoeGpu, MultiRowRouterMatchesOneRowRouter) {
  SKIP_WITHOUT_GPU();
  for (const MoeShape c : {MoeShape{256, 8, 2048, 512, 512, true, 128, 128}, MoeShape{64, 8, 512, 128, 64, false, 128, 128}}) {
    const Fp8MoeLayer layer(c.E, c.k, c.d, c.F, c.Fs, c.shared_fp8, 9500, c.br, c.bc);
    for (int T : {1, 7, 16, 17, 100, 512, 513}) {
      for (bool fused : {false, true}) {
        SCOPED_TRACE(testing::Message() << "E " << c.E << " d " << c.d << " T " << T << (fused ? " fused norm" : ""));
        const MoeParams p = layer.Params(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, T);
        ASSERT_NO_FATAL_FAILURE(ExpectMultiRowRouterMatchesOneRow(p, fused ? 960 : 0));
      }
    }
  }
}

TEST(Fp8MoeGpu, RefusesMixedGroupsAndBadScales) {
  SKIP_WITHOUT_GPU();
  const Fp8MoeLayer layer(16, 4, 256, 64, 64, true, 9000);
  auto d_x = Upload(RandomBf16(256, 901)), d_y = Alloc(256 * 2);
  auto d_ws = Alloc(MoeWorkspaceBytes(256, 16, 4, 64, 64)), d_counter = Alloc(4, 0);
  const MoeParams p = layer.Params(d_x.as<bf16>(), d_y.as<bf16>(), nullptr, nullptr, d_ws.data(), d_counter.as<uint32_t>(), 1);
  MoeParams mixed = p;
  mixed.down_fp8 = {};
  EXPECT_FALSE(Moe(mixed, nullptr).ok()) << "routed gate/up FP8 with a BF16-less down";
  MoeParams no_scales = p;
  no_scales.up_fp8.scales = nullptr;
  EXPECT_FALSE(Moe(no_scales, nullptr).ok());
  MoeParams odd = p;
  odd.shared_down_fp8.block_cols = 48;
  EXPECT_FALSE(Moe(odd, nullptr).ok()) << "block_cols 48";
  const Fp8MoeLayer narrow(16, 4, 256, 64, 64, true, 9001, 128, 16);  // FP8 rule yes, the MMA experts no
  auto d_ids = Alloc(4 * 4), d_wts = Alloc(4 * 4);
  MoeParams mma = narrow.Params(d_x.as<bf16>(), d_y.as<bf16>(), d_ids.as<int32_t>(), d_wts.as<float>(), d_ws.data(),
                                d_counter.as<uint32_t>(), 1);
  EXPECT_TRUE(Moe(mma, nullptr).ok()) << "16-wide block columns on the FP8 rule";
  mma.mma = true;
  const Status st = Moe(mma, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
}

}  // namespace
}  // namespace dl::kernels
