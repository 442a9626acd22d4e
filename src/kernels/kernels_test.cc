// CPU tests of the preset table, the registry and the CPU references (these run in CI without a GPU;
// the GPU kernels are compared against the same references in tests/gpu/kernels_gpu_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <set>

#include "base/dtype.h"
#include "base/rng.h"
#include "kernels/attention/attention.h"
#include "kernels/ops.h"
#include "kernels/tuning.h"
#include "kernels/reference/reference.h"

namespace dl::kernels {
namespace {

std::vector<bf16> RandomBf16(size_t n, uint64_t key, float scale = 1.0f) {
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = FloatToBf16(scale * NormalAt(key, i));
  return v;
}

TEST(Presets, CanonicalNameFollowsTheTableColumns) {
  EXPECT_EQ(CanonicalName({128, 8, 32, KvDtype::kFp8, WindowKind::kSliding}),
            "attn_d128_g8_p32_fp8_sliding");
  EXPECT_EQ(CanonicalName({32, 2, 16, KvDtype::kBf16, WindowKind::kGlobal}),
            "attn_d32_g2_p16_bf16_global");
}

TEST(Presets, TableHasUniqueNamesAndDefaultCoversXs2) {
  const auto all = AllPresets();
  std::set<std::string> names, defaults;
  for (const auto& p : all) {
    EXPECT_TRUE(names.insert(p.name).second) << "duplicate " << p.name;
    if (p.in_default_set) defaults.insert(p.name);
  }
  // XS.2: full layers G 6 global, sliding layers G 8, D 128, every page size and KV dtype.
  for (int page : {16, 32, 64}) {
    for (KvDtype kv : {KvDtype::kFp8, KvDtype::kBf16}) {
      EXPECT_TRUE(defaults.count(CanonicalName({128, 6, page, kv, WindowKind::kGlobal})));
      EXPECT_TRUE(defaults.count(CanonicalName({128, 8, page, kv, WindowKind::kSliding})));
    }
  }
  // The tiny config (D 32: G 2 full, G 4 sliding).
  EXPECT_TRUE(defaults.count("attn_d32_g2_p16_bf16_global"));
  EXPECT_TRUE(defaults.count("attn_d32_g4_p16_fp8_sliding"));
}

TEST(Presets, BuiltPresetsComeFromTheTable) {
  std::set<std::string> table;
  for (const auto& p : AllPresets()) table.insert(p.name);
  for (const auto& name : BuiltPresetNames()) EXPECT_TRUE(table.count(name)) << name;
#if !defined(DECODELAB_HAVE_CUDA)
  EXPECT_TRUE(BuiltPresetNames().empty());
#endif
}

TEST(Registry, MissingPresetIsAnErrorNamingKeyAndBuiltList) {
  const AttnPresetKey key{72, 3, 8, KvDtype::kBf16, WindowKind::kGlobal};
  auto r = ResolveAttention(key);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("attn_d72_g3_p8_bf16_global"), std::string::npos);
  EXPECT_NE(r.status().message().find("built presets: ["), std::string::npos);
  EXPECT_NE(r.status().message().find("--allow-fallback"), std::string::npos);
}

TEST(Registry, FallbackOnlyWhenAskedAndSaysSo) {
  const AttnPresetKey key{72, 3, 8, KvDtype::kBf16, WindowKind::kGlobal};
  auto r = ResolveAttention(key, /*allow_fallback=*/true);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->fallback);
  EXPECT_EQ(r->name, "attn_generic_fallback");
  for (const auto& name : BuiltPresetNames()) {
    for (const auto& p : AllPresets()) {
      if (p.name != name) continue;
      auto b = ResolveAttention(p.key, true);
      ASSERT_TRUE(b.ok());
      EXPECT_FALSE(b->fallback);
      EXPECT_EQ(b->name, name);
    }
  }
}

TEST(Registry, ChunkCountFollowsAbsolutePositions) {
  AttentionParams p;
  p.num_tokens = 1;
  p.num_q_heads = 8;
  p.head_dim = 128;
  p.max_position = 1000;
  EXPECT_EQ(AttentionMaxChunks(p), 1000 / kAttnChunk + 1);
  p.window_kind = WindowKind::kSliding;
  p.window = 512;  // 511 past keys + current can straddle 5 chunks of 128
  EXPECT_EQ(AttentionMaxChunks(p), 5);
  p.max_position = 10;
  EXPECT_EQ(AttentionMaxChunks(p), 1);
  EXPECT_EQ(AttentionWorkspaceBytes(p), size_t{8} * 1 * 130 * 4);
  // XS.2's sliding layers (5 chunks) take the cluster merge by default, also through the engine's
  // experiment switch, whose default must agree.
  EXPECT_GE(AttentionParams{}.cluster_max_chunks, 5);
  EXPECT_LE(AttentionParams{}.cluster_max_chunks, kAttnMaxClusterChunks);
  EXPECT_EQ(Tuning{}.attention_cluster_max_chunks, AttentionParams{}.cluster_max_chunks);
}

// The multi-row kernel's grid: a block's 16 rows of consecutive positions span W + 15 keys on a
// sliding layer (window 512: up to 6 chunks of 128), the whole context on a global one; one row always
// fits, and the partial slots per row stay AttentionMaxChunks (the workspace is the one-row kernel's).
TEST(Registry, MultiRowGridCoversARowGroupAndTheThresholdDecides) {
  static_assert(kAttnMultiRows == 16, "the figures below assume 16 rows per block");
  AttentionParams p;
  p.num_tokens = 8192;
  p.num_q_heads = 64;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.max_position = 8191;
  p.window_kind = WindowKind::kSliding;
  p.window = 512;
  EXPECT_EQ(AttentionMaxChunks(p), 5);
  EXPECT_EQ(AttentionMultiRowChunks(p), 6);  // rows 639..654 see keys 128..654: chunks 1..5, or 6 at worst
  for (int q0 : {0, 100, 511, 639, 767, 5000, 8176}) {  // every group's span fits the grid
    const int lo = std::max(0, q0 - 511) / kAttnChunk, hi = (q0 + 15) / kAttnChunk;
    EXPECT_LE(hi - lo + 1, AttentionMultiRowChunks(p)) << q0;
  }
  p.window = 40;  // the tiny presets' small window: 16 rows of a window of 40 straddle at most 2 chunks
  EXPECT_EQ(AttentionMultiRowChunks(p), 2);
  EXPECT_EQ(AttentionMultiRowChunks(p), AttentionMaxChunks(p));
  p.max_position = 20;  // a short context caps the grid like the one-row kernel's
  EXPECT_EQ(AttentionMultiRowChunks(p), 1);
  p.window_kind = WindowKind::kGlobal;
  p.max_position = 8191;
  EXPECT_EQ(AttentionMultiRowChunks(p), 64);
  EXPECT_EQ(AttentionMultiRowChunks(p), AttentionMaxChunks(p));
  const size_t ws = AttentionWorkspaceBytes(p);
  p.multi_row_min_tokens = 1;
  EXPECT_EQ(AttentionWorkspaceBytes(p), ws) << "the multi-row kernel writes the same partial slots";
  // The threshold: from multi_row_min_tokens rows on; 0 = never. The engine's switch agrees.
  EXPECT_TRUE(AttentionUsesMultiRow(p));
  p.multi_row_min_tokens = 8193;
  EXPECT_FALSE(AttentionUsesMultiRow(p));
  p.multi_row_min_tokens = 8192;
  EXPECT_TRUE(AttentionUsesMultiRow(p));
  p.multi_row_min_tokens = 0;
  EXPECT_FALSE(AttentionUsesMultiRow(p));
  EXPECT_EQ(Tuning{}.attention_multi_row_min_tokens, AttentionParams{}.multi_row_min_tokens);
  p.num_tokens = 1;
  p.multi_row_min_tokens = AttentionParams{}.multi_row_min_tokens;
  EXPECT_FALSE(AttentionUsesMultiRow(p)) << "decode stays on the one-row kernel";
}

// RunAttention's launch checks, through a stand-in launcher (no GPU needed): a negative threshold, more
// rows than the one-row kernel's grid takes, more row groups than the multi-row kernel's; what passes
// reaches the launcher.
int g_launches = 0;
Status CountingLaunch(const AttentionParams&, Stream) {
  ++g_launches;
  return Status::Ok();
}
TEST(Registry, RunAttentionRejectsRowCountsItsKernelsCannotLaunch) {
  const AttnPresetKey key{32, 2, 16, KvDtype::kBf16, WindowKind::kGlobal};
  const AttentionKernel kernel{CanonicalName(key), false, &CountingLaunch};
  AttentionParams p;
  static const char dummy[16] = {};  // never dereferenced: the launcher is a stand-in
  p.q = reinterpret_cast<const bf16*>(dummy), p.k_pool = p.v_pool = dummy;
  p.block_table = reinterpret_cast<const int32_t*>(dummy), p.out = reinterpret_cast<bf16*>(const_cast<char*>(dummy));
  p.num_q_heads = 4, p.num_kv_heads = 2, p.head_dim = 32, p.page_size = 16;
  p.positions = reinterpret_cast<const int32_t*>(dummy), p.max_position = 4095;
  p.workspace = const_cast<char*>(dummy), p.workspace_bytes = SIZE_MAX;
  p.counters = reinterpret_cast<uint32_t*>(const_cast<char*>(dummy));
  g_launches = 0;
  p.num_tokens = 70000;
  p.multi_row_min_tokens = 0;  // the one-row kernel: one grid row per query row
  const Status one_row = RunAttention(kernel, p, nullptr);
  EXPECT_EQ(one_row.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(one_row.message().find("70000 rows"), std::string::npos) << one_row.message();
  p.multi_row_min_tokens = 128;  // the multi-row kernel takes them
  EXPECT_TRUE(RunAttention(kernel, p, nullptr).ok());
  EXPECT_EQ(g_launches, 1);
  p.num_tokens = kAttnMaxGridRows * kAttnMultiRows + 1;  // one row group too many
  const Status multi = RunAttention(kernel, p, nullptr);
  EXPECT_EQ(multi.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(multi.message().find("row groups"), std::string::npos) << multi.message();
  p.num_tokens = 100;
  p.multi_row_min_tokens = -1;
  const Status negative = RunAttention(kernel, p, nullptr);
  EXPECT_EQ(negative.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.message().find("multi_row_min_tokens"), std::string::npos) << negative.message();
  // A workspace smaller than the row count needs is refused on the multi-row path too.
  p.multi_row_min_tokens = 1;
  p.workspace_bytes = AttentionWorkspaceBytes(p) - 1;
  EXPECT_EQ(RunAttention(kernel, p, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g_launches, 1);
}

TEST(Tuning, SettingsParseRoundTripAndRejectWhatTheyDoNotKnow) {
  Tuning t;
  // The measured default: attention, o_proj and down release after their wait, the others at their start.
  EXPECT_EQ(LateReleaseList(t.late_release), "attention,o_proj,down");
  ASSERT_TRUE(SetTuning(&t, "late_release=rope,attention,down").ok());
  EXPECT_TRUE(t.late(LateRelease::kRope));
  EXPECT_TRUE(t.late(LateRelease::kAttention));
  EXPECT_TRUE(t.late(LateRelease::kDown));
  EXPECT_FALSE(t.late(LateRelease::kNorm));
  EXPECT_EQ(LateReleaseList(t.late_release), "rope,attention,down");  // LateRelease order
  ASSERT_TRUE(SetTuning(&t, "late_release=none").ok());
  EXPECT_EQ(t.late_release, 0u);
  ASSERT_TRUE(SetTuning(&t, "stream_prefetch_kb=64").ok());
  EXPECT_EQ(t.stream_prefetch_kb, 64);
  ASSERT_TRUE(SetTuning(&t, "dependent_launch=0").ok());
  EXPECT_FALSE(t.dependent_launch);
  // Every printed setting parses back to the same value.
  Tuning back;
  for (const auto& [name, value] : TuningSettings(t)) ASSERT_TRUE(SetTuning(&back, name + "=" + value).ok()) << name;
  EXPECT_EQ(TuningString(back), TuningString(t));
  // Unknown names, values out of range, malformed assignments: errors naming the setting.
  EXPECT_EQ(SetTuning(&t, "late_release=rope,bogus").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SetTuning(&t, "no_such_thing=1").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SetTuning(&t, "attention_cluster_max_chunks=9").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SetTuning(&t, "attention_multi_row_min_tokens=-1").code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(SetTuning(&t, "attention_multi_row_min_tokens=0").ok());
  EXPECT_EQ(t.attention_multi_row_min_tokens, 0);
  EXPECT_EQ(SetTuning(&t, "batch_gemv_tokens=5").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(SetTuning(&t, "stream_gemv").code(), StatusCode::kInvalidArgument);
  EXPECT_NE(SetTuning(&t, "stream_ring_kb=abc").message().find("stream_ring_kb"), std::string::npos);
  EXPECT_NE(TuningHelp().find("batch_gemv_rows"), std::string::npos);
  // The product switch: off by default (until measured), 0 or 1, and the tiled kernel's threshold >= 1.
  EXPECT_FALSE(Tuning{}.mma_products);
  ASSERT_TRUE(SetTuning(&t, "mma_products=1").ok());
  EXPECT_TRUE(t.mma_products);
  EXPECT_EQ(SetTuning(&t, "mma_products=2").code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(SetTuning(&t, "mma_tiled_min_tokens=16").ok());
  EXPECT_EQ(t.mma_tiled_min_tokens, 16);
  EXPECT_EQ(SetTuning(&t, "mma_tiled_min_tokens=0").code(), StatusCode::kInvalidArgument);
  EXPECT_NE(TuningString(t).find("mma_products=1 prompt_mma=1 prompt_attention=1 mma_tiled_min_tokens=16"), std::string::npos);
  // Prompt rows on the tensor-core product: on by default, 0 or 1.
  EXPECT_TRUE(Tuning{}.prompt_mma);
  ASSERT_TRUE(SetTuning(&t, "prompt_mma=0").ok());
  EXPECT_FALSE(t.prompt_mma);
  EXPECT_EQ(SetTuning(&t, "prompt_mma=2").code(), StatusCode::kInvalidArgument);
  // Prompt rows' dense layers on the library GEMM: on by default, 0 or 1, printed last.
  EXPECT_TRUE(Tuning{}.prompt_gemm);
  ASSERT_TRUE(SetTuning(&t, "prompt_gemm=0").ok());
  EXPECT_FALSE(t.prompt_gemm);
  EXPECT_EQ(SetTuning(&t, "prompt_gemm=2").code(), StatusCode::kInvalidArgument);
  EXPECT_NE(TuningString(t).find("mma_tiled_min_tokens=16 prompt_gemm=0"), std::string::npos);
  // Prompt rows' FP8 weights on the tensor-core product: on by default, 0 or 1, printed last.
  EXPECT_TRUE(Tuning{}.prompt_fp8_mma);
  ASSERT_TRUE(SetTuning(&t, "prompt_fp8_mma=0").ok());
  EXPECT_FALSE(t.prompt_fp8_mma);
  EXPECT_EQ(SetTuning(&t, "prompt_fp8_mma=2").code(), StatusCode::kInvalidArgument);
  EXPECT_NE(TuningString(t).find("prompt_gemm=0 prompt_fp8_mma=0"), std::string::npos);
  // Which FP8 block shapes the tensor-core product takes (ops.h 5d).
  {
    const float scale = 1.0f;
    const uint8_t code = 0;
    Fp8Weight w{&code, &scale, 128, 128};
    EXPECT_TRUE(MmaFp8Supported(w, 2048));
    EXPECT_TRUE(MmaFp8Supported(w, 80));       // one block column, partial
    w.block_cols = 32;
    EXPECT_TRUE(MmaFp8Supported(w, 2048));
    w.block_cols = 16;                          // a chunk of 32 would straddle two scales
    EXPECT_FALSE(MmaFp8Supported(w, 2048));
    w.block_cols = 96;                          // not a power of two: the FP8 contract refuses it
    EXPECT_FALSE(MmaFp8Supported(w, 2048));
    w.block_rows = 1, w.block_cols = 2048;      // per channel
    EXPECT_TRUE(MmaFp8Supported(w, 2048));
    EXPECT_FALSE(MmaFp8Supported(w, 2056));     // in % 16 != 0
    w.scales = nullptr;
    EXPECT_FALSE(MmaFp8Supported(w, 2048));
    // The MoE's FP8 groups, each matrix over its own input width.
    MoeParams m;
    m.d = 2048, m.ffn = 512, m.shared_ffn = 512;
    EXPECT_TRUE(MoeFp8MmaSupported(m)) << "no FP8 group";
    const uint8_t* const codes[1] = {&code};
    const float* const scales[1] = {&scale};
    m.gate_fp8 = m.up_fp8 = m.down_fp8 = {codes, scales, 128, 128};
    EXPECT_TRUE(MoeFp8MmaSupported(m));
    m.shared_down_fp8 = Fp8Weight{&code, &scale, 1, 512};  // per channel over F
    EXPECT_TRUE(MoeFp8MmaSupported(m));
    m.down_fp8.block_cols = 16;
    EXPECT_FALSE(MoeFp8MmaSupported(m)) << "16-wide block columns of the routed down";
    m.down_fp8.block_cols = 128;
    m.shared_down_fp8.block_cols = 256;  // two 256-wide blocks over F = 512: a power of two, fine
    EXPECT_TRUE(MoeFp8MmaSupported(m));
    m.shared_down_fp8.block_cols = 96;
    EXPECT_FALSE(MoeFp8MmaSupported(m)) << "96-wide block columns of the shared down";
  }
  // The multi-row router's threshold: 16 by default, 0 (never) up to the token limit of a launch.
  EXPECT_EQ(Tuning{}.moe_router_rows_min_tokens, 128);
  ASSERT_TRUE(SetTuning(&t, "moe_router_rows_min_tokens=0").ok());
  EXPECT_EQ(t.moe_router_rows_min_tokens, 0);
  EXPECT_EQ(SetTuning(&t, "moe_router_rows_min_tokens=-1").code(), StatusCode::kInvalidArgument);
  EXPECT_NE(TuningString(t).find("moe_router_rows_min_tokens=0"), std::string::npos);
  // The MMA experts have one T > 1 path (the grouped GEMM): its retired switches are unknown settings,
  // refused rather than ignored, and no longer printed.
  for (const char* retired : {"moe_mma_gemm_tokens=64", "moe_mma_blocks_per_sm=2"}) {
    EXPECT_EQ(SetTuning(&t, retired).code(), StatusCode::kInvalidArgument) << retired;
  }
  EXPECT_EQ(TuningString(t).find("moe_mma_"), std::string::npos);
}

TEST(Reference, RmsNormAddsResidualAndNormalisesToUnitRms) {
  const int n = 256;
  auto h = RandomBf16(n, 1, 3.0f), delta = RandomBf16(n, 2);
  std::vector<bf16> w(n, FloatToBf16(1.0f)), out(n);
  auto h0 = h;
  AddRmsNormParams p{h.data(), delta.data(), w.data(), out.data(), 1, n, 1e-6f};
  ref::AddRmsNorm(p);
  double ss = 0;
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(h[i], FloatToBf16(Bf16ToFloat(h0[i]) + Bf16ToFloat(delta[i])));
    ss += Bf16ToFloat(out[i]) * Bf16ToFloat(out[i]);
  }
  EXPECT_NEAR(std::sqrt(ss / n), 1.0, 1e-2);
}

TEST(Reference, RopeQuarterTurnSwapsHalves) {
  // inv_freq = pi/2 and position 1: (x_j, x_{j+R/2}) -> (-x_{j+R/2}, x_j) exactly in BF16, and the
  // dims past R pass through. Unit norm weights and a head with RMS 1 keep the values.
  const int H = 1, K = 1, D = 16, R = 8;
  std::vector<bf16> q(D), k(D), v(D), qn(D, FloatToBf16(1.0f)), kn(D, FloatToBf16(1.0f)), qo(D);
  for (int e = 0; e < D; ++e) q[e] = k[e] = v[e] = FloatToBf16(e % 2 ? 1.0f : -1.0f);
  q[1] = k[1] = FloatToBf16(1.0f);
  std::vector<float> inv_freq(R / 2, static_cast<float>(M_PI / 2));
  std::vector<bf16> kp(4 * D), vp(4 * D);
  std::vector<int32_t> table = {3, 0};
  QkNormRopeAppendParams p;
  p.q = q.data(), p.k = k.data(), p.v = v.data(), p.qkv_stride = D;
  p.q_norm_weight = qn.data(), p.k_norm_weight = kn.data(), p.inv_freq = inv_freq.data();
  p.rotary_dim = R, p.first_position = 1, p.num_q_heads = H, p.num_kv_heads = K, p.head_dim = D;
  p.q_out = qo.data(), p.k_pool = kp.data(), p.v_pool = vp.data(), p.block_table = table.data();
  p.page_size = 1;
  ref::QkNormRopeAppend(p);
  for (int j = 0; j < R / 2; ++j) {
    EXPECT_EQ(Bf16ToFloat(qo[j]), -Bf16ToFloat(q[j + R / 2])) << j;
    EXPECT_EQ(Bf16ToFloat(qo[j + R / 2]), Bf16ToFloat(q[j])) << j;
  }
  for (int e = R; e < D; ++e) EXPECT_EQ(qo[e], q[e]);
  // Position 1 with P = 1 lives in page table[1] = 0; v is stored raw.
  for (int e = 0; e < D; ++e) EXPECT_EQ(vp[e], v[e]);
  EXPECT_EQ(Bf16ToFloat(kp[0]), -Bf16ToFloat(k[R / 2]));
}

TEST(Reference, AttentionOverOneVisibleKeyReturnsItsValueTimesGate) {
  // Sliding window of 1: only the current key is visible, so softmax is 1 and out = v * softplus(g).
  const int D = 16, P = 4, pos = 6;
  std::vector<bf16> q = RandomBf16(D, 5), kp = RandomBf16(3 * P * D, 6), vp = RandomBf16(3 * P * D, 7);
  std::vector<int32_t> table = {2, 0, 1};
  std::vector<bf16> gate = {FloatToBf16(0.3f)}, out(D);
  AttentionParams p;
  p.q = q.data(), p.k_pool = kp.data(), p.v_pool = vp.data(), p.block_table = table.data();
  p.first_position = pos, p.max_position = pos, p.num_q_heads = 1, p.num_kv_heads = 1;
  p.head_dim = D, p.page_size = P, p.window_kind = WindowKind::kSliding, p.window = 1;
  p.gate = gate.data(), p.gate_stride = 1, p.out = out.data();
  ref::Attention(p);
  const float gamma = RoundBf16(std::log1p(std::exp(0.3f)));
  const size_t base = (static_cast<size_t>(table[pos / P]) * P + pos % P) * D;
  for (int d = 0; d < D; ++d) {
    EXPECT_EQ(Bf16ToFloat(out[d]), RoundBf16(Bf16ToFloat(vp[base + d]) * gamma)) << d;
  }
}

TEST(Reference, ArgmaxTiesGoToLowestIndexAndNanWins) {
  std::vector<bf16> x = {FloatToBf16(1), FloatToBf16(5), FloatToBf16(2), FloatToBf16(5)};
  EXPECT_EQ(ref::Argmax(x.data(), 4), 1);
  x[2] = 0x7fc0;  // NaN
  EXPECT_EQ(ref::Argmax(x.data(), 4), 2);
}

TEST(Reference, MoeBiasSelectsButDoesNotWeigh) {
  // Expert 3 has the lowest score but a huge selection bias: it is selected, and its weight is
  // computed from its unbiased score.
  const int E = 4, k = 2, d = 8, F = 8;
  std::vector<bf16> x(d, FloatToBf16(0.5f)), router(E * d);
  const float logit_row[E] = {0.25f, 0.125f, -0.0625f, -0.25f};
  for (int e = 0; e < E; ++e)
    for (int i = 0; i < d; ++i) router[e * d + i] = FloatToBf16(logit_row[e] / (0.5f * d));
  std::vector<bf16> bias = {0, 0, 0, FloatToBf16(4.0f)};
  std::vector<std::vector<bf16>> ew;
  for (int e = 0; e < 3 * E + 3; ++e) ew.push_back(RandomBf16(d * F, 100 + e, 0.2f));
  std::vector<const bf16*> g(E), u(E), dn(E);
  for (int e = 0; e < E; ++e) g[e] = ew[3 * e].data(), u[e] = ew[3 * e + 1].data(), dn[e] = ew[3 * e + 2].data();
  std::vector<bf16> y(d);
  std::vector<int32_t> ids(k);
  std::vector<float> w(k);
  MoeParams p;
  p.x = x.data(), p.router_w = router.data(), p.router_bias = bias.data();
  p.gate_w = g.data(), p.up_w = u.data(), p.down_w = dn.data();
  p.shared_gate_w = ew[12].data(), p.shared_up_w = ew[13].data(), p.shared_down_w = ew[14].data();
  p.d = d, p.num_experts = E, p.top_k = k, p.ffn = F, p.shared_ffn = F, p.alpha = 2.5f;
  p.y = y.data(), p.topk_ids = ids.data(), p.topk_weights = w.data();
  ref::Moe(p);
  EXPECT_EQ(ids[0], 3);
  EXPECT_EQ(ids[1], 0);
  const float s3 = 1 / (1 + std::exp(0.25f)), s0 = 1 / (1 + std::exp(-0.25f));
  EXPECT_EQ(w[0], RoundBf16(s3 / (s3 + s0)));
  EXPECT_EQ(w[1], RoundBf16(s0 / (s3 + s0)));
}

}  // namespace
}  // namespace dl::kernels

namespace dl::kernels {
namespace {

TEST(GemvKSplit, FollowsTheShapeOnly) {
  EXPECT_EQ(GemvKSplitFor(10304, 2048), 2);   // fused q/k/v/g: 20,608 warps, 4 loads per lane each
  EXPECT_EQ(GemvKSplitFor(2048, 8192), 8);    // o_proj: 16,384 warps
  EXPECT_EQ(GemvKSplitFor(100352, 2048), 1);  // LM head: plenty of rows
  EXPECT_EQ(GemvKSplitFor(64, 64), 1);        // tiny model: a slice needs 128 chunks
  EXPECT_EQ(GemvKSplitFor(16, 65536), 8);     // capped at 8 warps per row
  EXPECT_EQ(GemvKSplitFor(100, 2056), 1);     // 257 chunks: no even split
}

TEST(GemvKSplit, Fp8CountsSixteenElementChunks) {
  EXPECT_EQ(GemvFp8KSplitFor(2048, 8192), GemvKSplitFor(2048, 4096));  // 512 chunks of 16 codes
  EXPECT_EQ(GemvFp8KSplitFor(100, 4112), 1);                           // 257 chunks: no even split
}

// The FP8 reference dequantises element [o, i] with its block's scale (partial blocks at both edges,
// per-channel and per-tensor), and the FP8 GEMV reference is the dot of those FP32 weights.
TEST(Reference, Fp8WeightsUseTheirBlocksScale) {
  const int rows = 130, cols = 144;  // 2 x 2 blocks of 128, the last ones partial
  std::vector<uint8_t> codes(static_cast<size_t>(rows) * cols, 0x38);  // E4M3 1.0
  codes[1] = 0xb8;                                                      // -1.0
  codes[129 * cols + 143] = 0x40;                                       // 2.0
  const std::vector<float> scales = {0.5f, 0.25f, 3.0f, 0.125f};
  const Fp8Weight w{codes.data(), scales.data(), 128, 128};
  EXPECT_EQ(ref::Fp8WeightAt(w, cols, 0, 0), 0.5f);
  EXPECT_EQ(ref::Fp8WeightAt(w, cols, 0, 1), -0.5f);
  EXPECT_EQ(ref::Fp8WeightAt(w, cols, 127, 128), 0.25f);
  EXPECT_EQ(ref::Fp8WeightAt(w, cols, 128, 127), 3.0f);
  EXPECT_EQ(ref::Fp8WeightAt(w, cols, 129, 143), 0.25f);  // 2.0 * 0.125
  const std::vector<float> per_channel(rows, 0.0f);
  std::vector<float> channel(per_channel);
  for (int o = 0; o < rows; ++o) channel[o] = 0.5f + o;
  EXPECT_EQ(ref::Fp8WeightAt({codes.data(), channel.data(), 1, cols}, cols, 7, 100), 7.5f);
  const float one = 0.75f;
  EXPECT_EQ(ref::Fp8WeightAt({codes.data(), &one, rows, cols}, cols, 129, 143), 1.5f);
  // GEMV: x = e_i picks column i of W (one BF16 product, exact).
  std::vector<bf16> x(cols, FloatToBf16(0.0f)), y(rows);
  x[143] = FloatToBf16(1.0f);
  GemvParams p;
  p.w_fp8 = w, p.x = x.data(), p.y = y.data(), p.out = rows, p.in = cols;
  ref::Gemv(p);
  EXPECT_EQ(Bf16ToFloat(y[0]), 0.25f);
  EXPECT_EQ(Bf16ToFloat(y[128]), 0.125f);
  EXPECT_EQ(Bf16ToFloat(y[129]), 0.25f);
}

// THE FP8 RULE on the host (ref::GemvFp8Rule, the bits the CUDA FP8 GEMV must give): a chunk's 16
// products are summed in FP32 in element order from zero, then the chunk sum times its scale joins the
// lane's sum. One row, in = 528 (33 chunks, k_split 1): lane 0 holds chunks 0 and 32. Chunk 0 gives
// 2^24; chunk 32 gives fl(1 - 2^24) = -(2^24 - 1) exactly, so the row is 1. One FMA chain over all
// elements (the earlier rule) would give fl(2^24 + 1) - 2^24 = 0. Inside a chunk the order is the
// element order in FP32: 2^24 + 1 - 2^24 in one chunk is 0 (the double reference: 1).
TEST(Reference, Fp8RuleSumsEachChunkFromZeroThenScalesIt) {
  const int in = 528;
  ASSERT_EQ(GemvFp8KSplitFor(1, in), 1);
  std::vector<uint8_t> codes(in, 0x00);  // +0
  std::vector<bf16> x(in, FloatToBf16(0.0f));
  codes[0] = 0x78, x[0] = FloatToBf16(65536.0f);                // 256 * 2^16 = 2^24
  codes[16 * 32] = 0x38, x[16 * 32] = FloatToBf16(1.0f);        // 1
  codes[16 * 32 + 1] = 0xf8, x[16 * 32 + 1] = FloatToBf16(65536.0f);  // -256 * 2^16
  for (float s : {1.0f, 0.375f}) {
    const Fp8Weight w{codes.data(), &s, 1, in};  // per tensor
    bf16 y = FloatToBf16(-7.0f), y_ref = y;
    GemvParams p;
    p.w_fp8 = w, p.x = x.data(), p.y = &y, p.out = 1, p.in = in;
    ref::GemvFp8Rule(p);
    EXPECT_EQ(Bf16ToFloat(y), s) << "chunk 0 (2^24 s) plus chunk 32 ((1 - 2^24) s)";
    p.y = &y_ref;
    ref::Gemv(p);
    EXPECT_EQ(Bf16ToFloat(y_ref), s);
  }
  // The three products in one chunk: 2^24, then + 1 rounds to even (2^24), then - 2^24.
  std::vector<uint8_t> one(16, 0x00);
  std::vector<bf16> x1(16, FloatToBf16(0.0f));
  one[0] = 0x78, x1[0] = FloatToBf16(65536.0f);
  one[1] = 0x38, x1[1] = FloatToBf16(1.0f);
  one[2] = 0xf8, x1[2] = FloatToBf16(65536.0f);
  const float s1 = 1.0f;
  bf16 y1 = FloatToBf16(-7.0f), y1_ref = y1;
  GemvParams q;
  q.w_fp8 = {one.data(), &s1, 1, 16}, q.x = x1.data(), q.y = &y1, q.out = 1, q.in = 16;
  ref::GemvFp8Rule(q);
  EXPECT_EQ(Bf16ToFloat(y1), 0.0f);
  q.y = &y1_ref;
  ref::Gemv(q);
  EXPECT_EQ(Bf16ToFloat(y1_ref), 1.0f) << "the oracle sums in double";
}

// The FP8 GPU tests compare the kernels (= ref::GemvFp8Rule) with the dequantising oracle at atol 1e-4,
// rtol 1/128 (Fp8GemvGpu.MatchesReferenceAndIsBatchInvariant). That tolerance holds for the rule on the
// GPU test's own data (weights 0.05 * N(0, 1) quantised per 128 x 128 block, per tensor and per
// channel; x ~ N(0, 1) in BF16), so the rule's rounding points need no looser test: the two are at most
// one BF16 step apart here.
TEST(Reference, Fp8RuleStaysWithinTheGpuTestsToleranceOfTheOracle) {
  struct Case {
    int out, in, ks, br, bc;
  };
  for (const Case c : {Case{1000, 2048, 0, 128, 128}, Case{2048, 8192, 0, 128, 128}, Case{2048, 8192, 1, 128, 128},
                       Case{300, 8192, 8, 128, 128}, Case{333, 400, 0, 128, 128}, Case{130, 144, 0, 128, 128},
                       Case{200, 1040, 0, 200, 1040}, Case{257, 2064, 0, 1, 2064}}) {
    SCOPED_TRACE(testing::Message() << c.out << "x" << c.in << " k_split " << c.ks << " blocks " << c.br << "x" << c.bc);
    const int T = 3, sc = (c.in + c.bc - 1) / c.bc;
    std::vector<float> v(static_cast<size_t>(c.out) * c.in);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.05f * NormalAt(91, i);
    std::vector<float> scales(static_cast<size_t>((c.out + c.br - 1) / c.br) * sc, 0.0f);
    for (int o = 0; o < c.out; ++o)
      for (int i = 0; i < c.in; ++i) {
        float& s = scales[(o / c.br) * sc + i / c.bc];
        s = std::max(s, std::fabs(v[static_cast<size_t>(o) * c.in + i]));
      }
    for (float& s : scales) s = s == 0.0f ? 1.0f : s / 448.0f;
    std::vector<uint8_t> codes(v.size());
    for (int o = 0; o < c.out; ++o)
      for (int i = 0; i < c.in; ++i) {
        const size_t at = static_cast<size_t>(o) * c.in + i;
        codes[at] = FloatToFp8E4M3(v[at] / scales[(o / c.br) * sc + i / c.bc]);
      }
    const std::vector<bf16> x = RandomBf16(static_cast<size_t>(T) * c.in, 92);
    std::vector<bf16> y(static_cast<size_t>(T) * c.out), y_ref(y.size());
    GemvParams p;
    p.w_fp8 = {codes.data(), scales.data(), c.br, c.bc}, p.x = x.data(), p.y = y.data();
    p.out = c.out, p.in = c.in, p.num_tokens = T, p.k_split = c.ks;
    ref::GemvFp8Rule(p);
    p.y = y_ref.data();
    ref::Gemv(p);
    int bad = 0, differ = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      const float g = Bf16ToFloat(y[i]), w = Bf16ToFloat(y_ref[i]);
      bad += !(std::fabs(g - w) <= 1e-4f + std::fabs(w) / 128);
      differ += g != w;
      // Of one sign: adjacent BF16 values at most (bit patterns one apart); else both within atol of 0.
      if ((y[i] ^ y_ref[i]) < 0x8000) {
        EXPECT_LE(std::abs(static_cast<int>(y[i]) - static_cast<int>(y_ref[i])), 1) << "element " << i;
      }
    }
    EXPECT_EQ(bad, 0);
    EXPECT_LE(differ, static_cast<int>(y.size() / 100)) << differ << " of " << y.size() << " round to the other BF16 neighbour";
  }
}

TEST(MmaKSplit, FollowsTheShapeOnly) {
  EXPECT_EQ(MmaKSplitFor(10304, 2048), 2);   // q/k/v/g (sliding): 644 tiles of 16 rows
  EXPECT_EQ(MmaKSplitFor(8240, 2048), 2);    // q/k/v/g (global)
  EXPECT_EQ(MmaKSplitFor(2048, 8192), 8);    // o_proj (sliding), dense down: 128 tiles
  EXPECT_EQ(MmaKSplitFor(2048, 6144), 8);    // o_proj (global): 24 chunks per slice
  EXPECT_EQ(MmaKSplitFor(16384, 2048), 1);   // dense gate/up: 1,024 tiles
  EXPECT_EQ(MmaKSplitFor(100352, 2048), 1);  // LM head
  EXPECT_EQ(MmaKSplitFor(512, 2048), 8);     // one expert's gate or up
  EXPECT_EQ(MmaKSplitFor(2048, 512), 2);     // one expert's down: 16 chunks, 8 per slice at least
  EXPECT_EQ(MmaKSplitFor(1001, 2056), 1);    // 65 chunks (the last one padded): no even split
  EXPECT_EQ(MmaKSplitFor(37, 72), 1);        // 3 chunks
}

}  // namespace
}  // namespace dl::kernels
