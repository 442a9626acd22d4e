// Bandwidth of the decode kernels at Laguna XS.2 shapes against the device-to-device copy bandwidth
// measured in the same run. Inputs rotate among several copies so that repeated calls do not run out
// of L2; every figure is the median-free mean of back-to-back launches timed with events (launch gaps
// included, no CUDA graph), so small kernels show their latency, not their bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cuda/buffer.h"
#include "cuda/device.h"
#include "kernels/attention/attention.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/sampling.h"

using namespace dl;
using namespace dl::kernels;

namespace {

#define CHECK_OK(expr)                                                              \
  do {                                                                              \
    const ::dl::Status s_ = (expr);                                                 \
    if (!s_.ok()) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, s_.message().c_str()); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

cuda::DeviceBuffer Alloc(size_t bytes) {
  auto b = cuda::DeviceBuffer::Create(bytes);
  if (!b.ok()) {
    std::fprintf(stderr, "%s\n", b.status().message().c_str());
    std::exit(1);
  }
  return std::move(b).value();
}
cuda::DeviceBuffer Random(size_t elems, uint64_t key, float scale) {
  auto b = Alloc(elems * 2);
  CHECK_OK(FillRandomBf16(b.as<bf16>(), elems, key, scale, nullptr));
  return b;
}
template <typename T>
cuda::DeviceBuffer Upload(const std::vector<T>& v) {
  auto b = Alloc(v.size() * sizeof(T));
  CHECK_OK(b.CopyFromHost(v.data(), v.size() * sizeof(T)));
  return b;
}

// Mean milliseconds per call of fn(i) over `iters` calls after a warm-up.
// The stream every timed call goes to; TimeMs captures `iters` calls into one CUDA graph, as the
// engine's decode step does, so a row is the kernel's cost inside a graph (launch gaps included,
// host launch overhead not). The copy row is timed with plain launches.
cudaStream_t g_stream = nullptr;

double TimeMs(const std::function<void(int)>& fn, int iters, bool graph = true) {
  cudaDeviceSynchronize();  // set-up work went to the legacy stream
  for (int i = 0; i < 3; ++i) fn(i);
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaStreamSynchronize(g_stream);
    cudaGraph_t g;
    cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < iters; ++i) fn(i);
    cudaStreamEndCapture(g_stream, &g);
    cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    cudaGraphLaunch(exec, g_stream);  // warm
  }
  cudaEventRecord(a, g_stream);
  if (graph) {
    cudaGraphLaunch(exec, g_stream);
  } else {
    for (int i = 0; i < iters; ++i) fn(i);
  }
  cudaEventRecord(b, g_stream);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a), cudaEventDestroy(b);
  if (exec) cudaGraphExecDestroy(exec);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(err));
    std::exit(1);
  }
  return ms / iters;
}

struct Row {
  std::string name, shape;
  double us, bytes;
};

}  // namespace

// XS.2's MoE layers for the `moe` and `moe_gemm` sections: E 256 experts of F 512 over d 2048 (top-8),
// `layers` layers' experts (their pointer tables as the engine keeps them), routers, biases, shared
// experts of F, `max_t` input rows and the outputs, workspace and counters of a launch of max_t rows.
struct BenchMoeLayers {
  static constexpr int E = 256, k = 8, d = 2048, F = 512;
  int layers, max_t;
  std::vector<cuda::DeviceBuffer> experts, ptr_arrays, routers, biases, shared;
  cuda::DeviceBuffer xs, yv, ws, counter, ids;
  BenchMoeLayers(int layers_, int max_t_, uint64_t x_seed) : layers(layers_), max_t(max_t_) {
    for (int l = 0; l < layers; ++l) {
      std::vector<const bf16*> gp(E), up(E), dp(E);
      for (int e = 0; e < E; ++e) {
        experts.push_back(Random(size_t(3) * F * d, 1000 + l * E + e, 0.02f));
        const bf16* base = experts.back().as<bf16>();
        gp[e] = base, up[e] = base + size_t(F) * d, dp[e] = base + size_t(2) * F * d;
      }
      ptr_arrays.push_back(Upload(gp)), ptr_arrays.push_back(Upload(up)), ptr_arrays.push_back(Upload(dp));
      routers.push_back(Random(size_t(E) * d, 50 + l, 0.05f));
      biases.push_back(Random(E, 60 + l, 0.05f));
      shared.push_back(Random(size_t(3) * F * d, 70 + l, 0.02f));
    }
    xs = Random(size_t(max_t) * d, x_seed, 1.0f);
    yv = Alloc(size_t(max_t) * d * 2), ws = Alloc(MoeWorkspaceBytes(d, E, k, F, F, max_t));
    counter = Alloc(size_t(max_t) * 4), ids = Alloc(size_t(max_t) * k * 4);
    CHECK_OK(counter.Fill(0));
  }
  // Launch i of a timed graph: layer i % layers, T rows from input row x_row.
  MoeParams Params(int i, int top_k, int T, int x_row = 0) const {
    const int l = i % layers;
    MoeParams p;
    p.x = xs.as<bf16>() + size_t(x_row) * d, p.router_w = routers[l].as<bf16>(), p.router_bias = biases[l].as<bf16>();
    p.gate_w = ptr_arrays[3 * l].as<const bf16*>(), p.up_w = ptr_arrays[3 * l + 1].as<const bf16*>();
    p.down_w = ptr_arrays[3 * l + 2].as<const bf16*>();
    p.shared_gate_w = shared[l].as<bf16>(), p.shared_up_w = p.shared_gate_w + size_t(F) * d;
    p.shared_down_w = p.shared_gate_w + size_t(2) * F * d;
    p.d = d, p.num_experts = E, p.top_k = top_k, p.ffn = F, p.shared_ffn = F, p.alpha = 2.5f;
    p.num_tokens = T, p.topk_ids = ids.as<int32_t>();
    p.y = yv.as<bf16>(), p.workspace = ws.data(), p.counter = counter.as<uint32_t>();
    return p;
  }
};

int main(int argc, char** argv) {
  // Optional: one section only (gemv, gemv_batch, gemv_fp8, mma, norm, rope, attn, attn_long (its 32K
  // cases alone, e.g. under ncu), attn_prefill, moe, moe_gemm, router, moe_fp8, argmax); the copy row
  // always runs.
  const std::string only = argc > 1 ? argv[1] : "";
  auto want = [&](const char* section) { return only.empty() || only == section; };
  std::string why;
  if (cuda::DeviceCount(&why) == 0) {
    std::fprintf(stderr, "kernels_bench: no CUDA device: %s\n", why.c_str());
    return 1;
  }
  auto info = cuda::GetDeviceInfo(0);
  std::printf("device: %s, %d SMs, L2 %zu MB\n", info->name.c_str(), info->sm_count,
              info->l2_bytes >> 20);
  std::vector<Row> rows;
  cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking);

  // Copy bandwidth (read + write).
  {
    const size_t n = size_t{1} << 31;
    auto src = Alloc(n), dst = Alloc(n);
    CHECK_OK(src.Fill(0x3c));
    const double ms = TimeMs([&](int) { cudaMemcpyAsync(dst.data(), src.data(), n, cudaMemcpyDeviceToDevice, g_stream); }, 10, false);
    rows.push_back({"d2d copy", "2 GiB", ms * 1e3, 2.0 * n});
  }
  const double copy_gbs = rows[0].bytes / (rows[0].us * 1e-6) / 1e9;

  // GEMV: fused q/k/v/g (sliding), o_proj at each input split, lm_head; 8 rotating weight copies
  // (> L2). k_split 0 = the shape's default (GemvKSplitFor); -1: that split through the streaming
  // kernel (GemvParams::streaming, default ring).
  auto x = Random(8192, 1, 1.0f);
  auto y = Alloc(100352 * 2);
  if (want("gemv")) for (auto [name, out, in, copies, ks] : {std::tuple{"gemv qkvg", 10304, 2048, 8, 0},
                                           std::tuple{"gemv qkvg ks1", 10304, 2048, 8, 1},
                                           std::tuple{"gemv o_proj", 2048, 8192, 8, 0},
                                           std::tuple{"gemv o_proj ks1", 2048, 8192, 8, 1},
                                           // One copy: the weights stay in L2 (what a prefetch hint buys).
                                           std::tuple{"gemv qkvg L2-hot", 10304, 2048, 1, 0},
                                           std::tuple{"gemv o_proj L2-hot", 2048, 8192, 1, 0},
                                           std::tuple{"gemv o_proj ks2", 2048, 8192, 8, 2},
                                           std::tuple{"gemv o_proj ks4", 2048, 8192, 8, 4},
                                           std::tuple{"gemv lm_head", 100352, 2048, 1, 0},
                                           std::tuple{"gemv qkvg stream", 10304, 2048, 8, -1},
                                           std::tuple{"gemv o_proj stream", 2048, 8192, 8, -1},
                                           std::tuple{"gemv lm_head stream", 100352, 2048, 1, -1}}) {
    std::vector<cuda::DeviceBuffer> w;
    for (int c = 0; c < copies; ++c) w.push_back(Random(size_t(out) * in, 10 + c, 0.02f));
    const double ms = TimeMs([&](int i) {
      GemvParams p{w[i % copies].as<bf16>(), x.as<bf16>(), y.as<bf16>(), out, in, 1, 0, 0, std::max(ks, 0)};
      p.streaming.on = ks < 0;
      CHECK_OK(Gemv(p, g_stream));
    }, 200);
    rows.push_back({name, fmt::format("{}x{} ks{}", out, in, ks <= 0 ? GemvKSplitFor(out, in) : ks),
                    ms * 1e3, 2.0 * out * in});
  }
  // Batched GEMV (T tokens, W read once per token tile): the decode batch sizes, every kernel shape.
  // The bytes column counts W once: % copy is the fraction of the weight stream's floor reached.
  if (want("gemv_batch")) {
    auto xb = Random(size_t(64) * 8192, 11, 1.0f);
    auto yb = Alloc(size_t(64) * 10304 * 2);
    for (auto [name, out, in] : {std::tuple{"qkvg", 10304, 2048}, std::tuple{"o_proj", 2048, 8192}}) {
      std::vector<cuda::DeviceBuffer> w;
      for (int c = 0; c < 8; ++c) w.push_back(Random(size_t(out) * in, 30 + c, 0.02f));
      for (int T : {2, 8, 32, 64}) {
        for (int br : {1, 2, 4}) {
          for (int bt : {8, 16}) {
            const double ms = TimeMs([&](int i) {
              GemvParams p{w[i % 8].as<bf16>(), xb.as<bf16>(), yb.as<bf16>(), out, in, T};
              p.batch_rows = br, p.batch_tokens = bt;
              CHECK_OK(Gemv(p, g_stream));
            }, 50);
            rows.push_back({fmt::format("gemv {} T{}", name, T), fmt::format("{}x{} r{} t{}", out, in, br, bt),
                            ms * 1e3, 2.0 * out * in});
          }
        }
      }
    }
  }

  // FP8 weights (128x128 block scales, the FP8 rule) beside BF16 at XS.2's shapes: batch 1 (plain and
  // streaming), T 8 and 64 (batched kernel, the runner's rows/warp choice). Bytes: the weight stream
  // (codes + scales, or BF16), read once per call.
  auto fp8_weight = [&](int out, int in, uint64_t key, cuda::DeviceBuffer* codes, cuda::DeviceBuffer* scales) {
    *codes = Alloc(size_t(out) * in);
    *scales = Alloc(size_t((out + 127) / 128) * ((in + 127) / 128) * 4);
    CHECK_OK(FillAffineFp8(codes->as<uint8_t>(), scales->as<float>(), out, in, 128, 128, key, 0.02f, 0.0f, nullptr));
  };
  if (want("gemv_fp8")) {
    auto xb = Random(size_t(2048) * 8192, 11, 1.0f);
    auto yb = Alloc(size_t(2048) * 10304 * 2);
    for (auto [name, out, in] : {std::tuple{"qkvg", 10304, 2048}, std::tuple{"o_proj", 2048, 8192}}) {
      std::vector<cuda::DeviceBuffer> wb, codes(8), scales(8);
      for (int c = 0; c < 8; ++c) {
        wb.push_back(Random(size_t(out) * in, 30 + c, 0.02f));
        fp8_weight(out, in, 300 + c, &codes[c], &scales[c]);
      }
      const double fp8_bytes = double(out) * in + 4.0 * ((out + 127) / 128) * ((in + 127) / 128);
      // Launch i's product of copy i % 8 of the weights (FP8 or BF16) over T tokens.
      auto params = [&](int i, bool fp8, int T) {
        GemvParams p;
        if (fp8) {
          p.w_fp8 = {codes[i % 8].as<uint8_t>(), scales[i % 8].as<float>(), 128, 128};
        } else {
          p.w = wb[i % 8].as<bf16>();
        }
        p.x = xb.as<bf16>(), p.y = yb.as<bf16>(), p.out = out, p.in = in, p.num_tokens = T;
        p.batch_rows = T <= 8 ? 2 : 4;
        return p;
      };
      for (int T : {1, 8, 64}) {
        for (bool fp8 : {false, true}) {
          for (bool stream : {false, true}) {
            if (stream && (T != 1 || fp8)) continue;  // FP8 weights have no streaming kernel
            const double ms = TimeMs([&](int i) {
              GemvParams p = params(i, fp8, T);
              p.streaming.on = stream;
              CHECK_OK(Gemv(p, g_stream));
            }, T == 64 ? 50 : 200);
            rows.push_back({fmt::format("gemv {} {} T{}{}", fp8 ? "fp8" : "bf16", name, T, stream ? " stream" : ""),
                            fmt::format("{}x{} ks{}", out, in, fp8 ? GemvFp8KSplitFor(out, in) : GemvKSplitFor(out, in)),
                            ms * 1e3, fp8 ? fp8_bytes : 2.0 * out * in});
          }
        }
      }
      // Prompt rows: the tensor-core product with FP8 weights (ops.h 5d) beside what BF16 prompt rows
      // run (the library GEMM, where cuBLASLt loads; else the BF16 tensor-core product) and the
      // CUDA-core FP8 rule.
      const bool library = LibraryGemmAvailable().ok();
      for (int T : {64, 512, 2048}) {
        for (const std::string kernel : {library ? "bf16 library" : "bf16 mma", "fp8 mma", "fp8 cuda cores"}) {
          const bool fp8 = kernel[0] == 'f', mma = kernel.find("mma") != std::string::npos;
          if (fp8 && !mma && T > 512) continue;  // slow; T 512 says enough
          const double ms = TimeMs([&](int i) {
            GemvParams p = params(i, fp8, T);
            p.mma = mma;
            p.library_gemm = kernel == "bf16 library";
            CHECK_OK(Gemv(p, g_stream));
          }, 20);
          rows.push_back({fmt::format("{} {} T{} ({:.0f} TFLOP/s)", kernel, name, T, 2.0 * out * in * T / (ms * 1e-3) / 1e12),
                          fmt::format("{}x{}", out, in), ms * 1e3, fp8 ? fp8_bytes : 2.0 * out * in});
        }
      }
    }
  }

  // The tensor-core product (GemvParams::mma) against the CUDA-core GEMV at every token count, on
  // XS.2's linear layers. Per row: time, the bytes it must move (W once, x and y once) over that time,
  // the FLOP rate, and the floor: max(bytes / the copy bandwidth measured above, FLOPs / 790 TFLOP/s,
  // the dense BF16 rate measured on an H200, issue 17). "gemv" is what the backend runs today (the
  // streaming kernel at one token, the batched kernel above); "mma" the product's dispatch (register
  // kernel below mma_tiled_min_tokens = 64, tiled from there); "mma reg" / "mma tiled" force one kernel.
  struct ProductRow {
    std::string kernel, layer;
    int out, in, T;
    double us;
  };
  std::vector<ProductRow> products;
  if (want("mma")) {
    // "library": the library GEMM (GemvParams::library_gemm, the prompt rows' dense product by
    // default), where cuBLASLt loads; its algorithm per shape is printed once.
    const bool library_gemm = LibraryGemmAvailable().ok();
    if (!library_gemm) std::printf("library GEMM not measured: %s\n", LibraryGemmAvailable().message().c_str());
    const int kMaxT = 4096;
    auto xb = Random(size_t(kMaxT) * 8192, 12, 1.0f);
    auto yb = Alloc(size_t(kMaxT) * 100352 * 2);
    for (auto [layer, out, in, copies] : {std::tuple{"qkvg", 10304, 2048, 4}, std::tuple{"o_proj", 2048, 8192, 4},
                                          std::tuple{"mlp gate_up", 16384, 2048, 4}, std::tuple{"mlp down", 2048, 8192, 4},
                                          std::tuple{"lm_head", 100352, 2048, 1}}) {
      std::vector<cuda::DeviceBuffer> w;
      for (int c = 0; c < copies; ++c) w.push_back(Random(size_t(out) * in, 40 + c, 0.02f));
      if (library_gemm) {
        auto described = DescribeLibraryGemm(out, in);
        std::printf("%s: %s\n", layer, described.ok() ? described->c_str() : described.status().message().c_str());
      }
      for (int T : {1, 2, 4, 8, 16, 64, 256, 1024, 2048, 4096}) {
        const int iters = T <= 16 ? 100 : T <= 256 ? 20 : 5;
        auto run = [&](const char* kernel, bool mma, int tiled_min, bool library = false) {
          const double ms = TimeMs([&](int i) {
            GemvParams p{w[i % copies].as<bf16>(), xb.as<bf16>(), yb.as<bf16>(), out, in, T};
            p.mma = mma;
            p.library_gemm = library;
            p.mma_tiled_min_tokens = tiled_min;
            p.streaming.on = !mma && T == 1 && GemvStreamSupported(out, in);
            p.batch_rows = T <= 8 ? 2 : 4;  // the backend's choice (batch_gemv_rows=0)
            CHECK_OK(Gemv(p, g_stream));
          }, iters);
          products.push_back({kernel, layer, out, in, T, ms * 1e3});
        };
        run("gemv", false, 64);
        run("mma", true, 64);
        if (T <= 256) run("mma reg", true, 1 << 30);
        if (T >= 8) run("mma tiled", true, 1);
        if (library_gemm) run("library", true, 64, true);
      }
    }
  }

  // Residual add + RMSNorm, d = 2048.
  if (want("norm")) {
    auto h = Random(2048, 2, 1.0f), dl = Random(2048, 3, 1.0f), w = Random(2048, 4, 1.0f);
    auto o = Alloc(4096);
    const double ms = TimeMs([&](int) {
      AddRmsNormParams p{h.as<bf16>(), dl.as<bf16>(), w.as<bf16>(), o.as<bf16>(), 1, 2048, 1e-6f};
      CHECK_OK(AddRmsNorm(p, g_stream));
    }, 500);
    rows.push_back({"add_rmsnorm", "d 2048", ms * 1e3, 2.0 * 2048 * 5});
  }

  // QK-norm + RoPE + FP8 append, sliding layer (H 64, K 8, D 128, R 128), one token.
  if (want("rope")) {
    const int H = 64, K = 8, D = 128, P = 32;
    auto qkv = Random((H + 2 * K) * D, 5, 1.0f), qn = Random(D, 6, 1.0f), kn = Random(D, 7, 1.0f);
    std::vector<float> f(64);
    for (int j = 0; j < 64; ++j) f[j] = std::pow(10000.0f, -j / 64.0f);
    auto d_f = Upload(f);
    std::vector<int32_t> table(256);
    std::iota(table.begin(), table.end(), 0);
    auto d_t = Upload(table);
    auto kp = Alloc(size_t(256) * P * K * D), vp = Alloc(size_t(256) * P * K * D);
    auto qo = Alloc(H * D * 2);
    const double ms = TimeMs([&](int i) {
      QkNormRopeAppendParams p;
      p.q = qkv.as<bf16>(), p.k = p.q + H * D, p.v = p.k + K * D, p.qkv_stride = (H + 2 * K) * D;
      p.q_norm_weight = qn.as<bf16>(), p.k_norm_weight = kn.as<bf16>(), p.inv_freq = d_f.as<float>();
      p.rotary_dim = 128, p.first_position = 4000 + i % 64, p.num_q_heads = H, p.num_kv_heads = K;
      p.head_dim = D, p.q_out = qo.as<bf16>(), p.k_pool = kp.data(), p.v_pool = vp.data();
      p.kv_dtype = KvDtype::kFp8, p.k_scale = p.v_scale = 0.05f, p.block_table = d_t.as<int32_t>();
      p.page_size = P;
      CHECK_OK(QkNormRopeAppend(p, g_stream));
    }, 500);
    rows.push_back({"qknorm_rope_append", "H64 K8 D128 fp8", ms * 1e3, 2.0 * (H + 4 * K) * D});
  }

  // Attention: sliding (G 8, W 512) at position 4095 over 30 layers' pools; global (G 6) at 32767.
  struct AttnCase {
    const char* label;
    AttnPresetKey key;
    int pos, copies;
  };
  if (want("attn") || only == "attn_long") for (const AttnCase& c :
       {AttnCase{"attn sliding ctx4k", {128, 8, 32, KvDtype::kFp8, WindowKind::kSliding}, 4095, 30},
        AttnCase{"attn sliding ctx4k", {128, 8, 32, KvDtype::kBf16, WindowKind::kSliding}, 4095, 30},
        AttnCase{"attn global ctx100", {128, 6, 32, KvDtype::kFp8, WindowKind::kGlobal}, 99, 30},
        AttnCase{"attn global ctx1k", {128, 6, 32, KvDtype::kFp8, WindowKind::kGlobal}, 1023, 30},
        AttnCase{"attn global ctx2k", {128, 6, 32, KvDtype::kFp8, WindowKind::kGlobal}, 2047, 30},
        AttnCase{"attn global ctx32k", {128, 6, 32, KvDtype::kFp8, WindowKind::kGlobal}, 32767, 4},
        AttnCase{"attn global ctx32k", {128, 6, 64, KvDtype::kBf16, WindowKind::kGlobal}, 32767, 4}}) {
    if (only == "attn_long" && c.pos < 32767) continue;
    auto kernel = ResolveAttention(c.key);
    if (!kernel.ok()) {
      std::printf("skip %s: %s\n", c.label, kernel.status().message().c_str());
      continue;
    }
    const int K = 8, D = 128, P = c.key.page_size, H = K * c.key.group;
    const int pages = (c.pos + 1 + P - 1) / P;
    const size_t esz = c.key.kv_dtype == KvDtype::kFp8 ? 1 : 2;
    const size_t pool = size_t(pages) * P * K * D * esz;
    std::vector<int32_t> table(pages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(1));
    auto d_t = Upload(table);
    std::vector<cuda::DeviceBuffer> kp, vp;
    for (int l = 0; l < c.copies; ++l) {
      kp.push_back(esz == 1 ? Alloc(pool) : Random(pool / 2, 100 + l, 1.0f));
      vp.push_back(esz == 1 ? Alloc(pool) : Random(pool / 2, 200 + l, 1.0f));
      if (esz == 1) {  // FP8 codes 1.25 / 0.8125: finite, non-zero
        CHECK_OK(kp.back().Fill(0x3a));
        CHECK_OK(vp.back().Fill(0x35));
      }
    }
    auto q = Random(H * D, 8, 1.0f), g = Random(H, 9, 1.0f), o = Alloc(H * D * 2);
    AttentionParams p;
    p.q = q.as<bf16>(), p.block_table = d_t.as<int32_t>(), p.first_position = c.pos;
    p.max_position = c.pos, p.num_q_heads = H, p.num_kv_heads = K, p.head_dim = D;
    p.page_size = P, p.kv_dtype = c.key.kv_dtype, p.window_kind = c.key.window, p.window = 512;
    p.k_scale = p.v_scale = 0.1f, p.gate = g.as<bf16>(), p.gate_stride = H, p.out = o.as<bf16>();
    auto ws = Alloc(AttentionWorkspaceBytes(p)), counters = Alloc(K * 4);
    CHECK_OK(counters.Fill(0));
    p.workspace = ws.data(), p.workspace_bytes = ws.size(), p.counters = counters.as<uint32_t>();
    const double ms = TimeMs([&](int i) {
      AttentionParams a = p;
      a.k_pool = kp[i % c.copies].data(), a.v_pool = vp[i % c.copies].data();
      CHECK_OK(RunAttention(*kernel, a, g_stream));
    }, 200);
    const int keys = c.key.window == WindowKind::kSliding ? std::min(512, c.pos + 1) : c.pos + 1;
    rows.push_back({c.label, kernel->name, ms * 1e3, 2.0 * keys * K * D * esz});
  }

  // Prefill attention at XS.2 shapes (full layer G 6, sliding layer G 8 W 512; 8 KV heads, D 128, FP8
  // KV, page 32): a prompt of T tokens at positions 0..T-1 over a cache of T tokens, the one-row kernel
  // (multi_row_min_tokens = 0) against the multi-row kernel (1); the same bits (kernels_gpu_test). K/V
  // bytes: what the blocks load from L2/HBM (each block its keys: one row's visible keys for the
  // one-row kernel, the union of its rows' for the multi-row one). The tensor-core prompt kernel
  // (AttnKind::kPrompt) beside them, with its TFLOP/s: 4 D flops per (row, query head, visible key),
  // scores and values. Printed as its own table.
  struct PrefillRow {
    std::string layer;
    int T;
    double us_one, us_multi, bytes_one, bytes_multi, us_prompt, flops;
  };
  std::vector<PrefillRow> prefill;
  if (want("attn_prefill")) {
    for (int T : {128, 256, 512, 1024, 8192}) {
      for (bool sliding : {false, true}) {
        const int K = 8, D = 128, P = 32, G = sliding ? 8 : 6, H = K * G, W = 512;
        const AttnPresetKey key{D, G, P, KvDtype::kFp8, sliding ? WindowKind::kSliding : WindowKind::kGlobal};
        auto kernel = ResolveAttention(key);
        if (!kernel.ok()) {
          std::printf("skip attn_prefill: %s\n", kernel.status().message().c_str());
          continue;
        }
        const int pages = (T + P - 1) / P;
        std::vector<int32_t> table(pages);
        std::iota(table.begin(), table.end(), 0);
        std::shuffle(table.begin(), table.end(), std::mt19937(3));
        auto d_t = Upload(table);
        const size_t pool = size_t(pages) * P * K * D;
        auto kp = Alloc(pool), vp = Alloc(pool);
        CHECK_OK(kp.Fill(0x3a));  // FP8 codes 1.25 / 0.8125: finite, non-zero
        CHECK_OK(vp.Fill(0x35));
        auto q = Random(size_t(T) * H * D, 8, 1.0f), g = Random(size_t(T) * H, 9, 1.0f), o = Alloc(size_t(T) * H * D * 2);
        AttentionParams p;
        p.q = q.as<bf16>(), p.k_pool = kp.data(), p.v_pool = vp.data(), p.block_table = d_t.as<int32_t>();
        p.first_position = 0, p.max_position = T - 1, p.num_tokens = T, p.num_q_heads = H, p.num_kv_heads = K;
        p.head_dim = D, p.page_size = P, p.kv_dtype = KvDtype::kFp8, p.window_kind = key.window, p.window = W;
        p.k_scale = p.v_scale = 0.1f, p.gate = g.as<bf16>(), p.gate_stride = H, p.out = o.as<bf16>();
        auto ws = Alloc(AttentionWorkspaceBytes(p)), counters = Alloc(size_t(T) * K * 4);
        CHECK_OK(counters.Fill(0));
        p.workspace = ws.data(), p.workspace_bytes = ws.size(), p.counters = counters.as<uint32_t>();
        const int iters = T >= 8192 ? 3 : 20;
        double us[2];
        for (int multi : {0, 1}) {
          p.multi_row_min_tokens = multi;
          us[multi] = 1e3 * TimeMs([&](int) { CHECK_OK(RunAttention(*kernel, p, g_stream)); }, iters);
        }
        const double us_prompt =
            1e3 * TimeMs([&](int) { CHECK_OK(RunAttention(*kernel, p, g_stream, AttnKind::kPrompt)); }, iters);
        // Keys each kernel's blocks load (K and V rows of D bytes, per KV head).
        auto start_of = [&](int pos) { return sliding ? std::max(0, pos - W + 1) : 0; };
        double keys_one = 0, keys_multi = 0;
        for (int t = 0; t < T; ++t) keys_one += t - start_of(t) + 1;
        const double flops = 4.0 * D * H * keys_one;
        for (int t0 = 0; t0 < T; t0 += kAttnMultiRows) {
          const int t1 = std::min(T, t0 + kAttnMultiRows) - 1;
          for (int c = start_of(t0) / kAttnChunk; c <= t1 / kAttnChunk; ++c) {  // the union per chunk
            int lo = INT32_MAX, hi = -1;
            for (int t = t0; t <= t1; ++t) {
              if (start_of(t) / kAttnChunk > c || t / kAttnChunk < c) continue;
              lo = std::min(lo, start_of(t)), hi = std::max(hi, t);
            }
            if (hi >= 0) keys_multi += std::min(hi, c * kAttnChunk + kAttnChunk - 1) - std::max(lo, c * kAttnChunk) + 1;
          }
        }
        const double per_key = 2.0 * K * D;  // K and V, FP8
        prefill.push_back({sliding ? "sliding G8 W512" : "full G6", T, us[0], us[1], keys_one * per_key,
                           keys_multi * per_key, us_prompt, flops});
      }
    }
  }

  // MoE, XS.2 layer: E 256, top-8, F 512, shared 512, d 2048; 2 layers' experts, 16 inputs.
  if (want("moe")) {
    const BenchMoeLayers m(2, 4096, 80);  // 4,096: the MMA experts' prefill rows
    const int E = m.E, k = m.k, d = m.d, F = m.F;
    // Launch i of a timed graph: layer i % 2, input row i % 16 (batch 1) or rows [0, T).
    auto moe_params = [&](int i, int top_k, int T) { return m.Params(i, top_k, T, T == 1 ? i % 16 : 0); };
    // top-k 8 is the model; 1 and 4 separate the fixed cost (router, launches, chains) from the
    // per-slot streaming cost.
    for (int top_k : {k, 4, 1}) {
      const double ms = TimeMs([&](int i) { CHECK_OK(Moe(moe_params(i, top_k, 1), g_stream)); }, 200);
      rows.push_back({fmt::format("moe (router+{}+shared)", top_k), fmt::format("E256 k{} F512 d2048", top_k),
                      ms * 1e3, 2.0 * (size_t(E) * d + size_t(top_k + 1) * 3 * F * d)});
    }
    // The grouped path (T > 1): bytes = the router, the experts uniform routing touches (expected
    // E (1 - (1 - k/E)^T)) and the shared expert.
    for (int T : {2, 8, 32, 64, 512}) {
      const double touched = E * (1.0 - std::pow(1.0 - double(k) / E, T));
      const double ms = TimeMs([&](int i) { CHECK_OK(Moe(moe_params(i, k, T), g_stream)); }, T > 64 ? 10 : 50);
      rows.push_back({fmt::format("moe grouped T{}", T), "E256 k8 F512 d2048", ms * 1e3,
                      2.0 * (size_t(E) * d + (touched + 1) * 3 * F * d)});
    }
    // The MMA experts (MoeParams::mma): batch 1 on its own kernels, T > 1 the grouped GEMM over the lists.
    for (int T : {1, 2, 8, 64, 512, 1024, 4096}) {
      const double touched = E * (1.0 - std::pow(1.0 - double(k) / E, T));
      const double ms = TimeMs([&](int i) {
        MoeParams p = moe_params(i, k, T);
        p.mma = true;
        CHECK_OK(Moe(p, g_stream));
      }, T > 64 ? 10 : 50);
      rows.push_back({fmt::format("moe mma T{}", T), "E256 k8 F512 d2048", ms * 1e3,
                      2.0 * (size_t(E) * d + (touched + 1) * 3 * F * d)});
    }
  }

  // The MMA experts at prefill sizes, XS.2's layer (the grouped GEMM, 64 pairs per block pass): the
  // whole Moe (router, lists, gate/up, down, combine) and the router alone, whose difference is the
  // lists, the experts and the combine. Weight bytes: the experts uniform routing touches and the shared
  // expert; FLOP: 2 x 3 F d per (token, slot) pair and per token for the shared expert.
  struct MoeGemmRow {
    std::string kernel;
    int T;
    double us, weight_bytes, flops;
  };
  std::vector<MoeGemmRow> moe_gemm;
  if (want("moe_gemm")) {
    const BenchMoeLayers m(2, 8192, 81);
    const int E = m.E, k = m.k, d = m.d, F = m.F;
    auto params = [&](int i, int T) {
      MoeParams p = m.Params(i, k, T);
      p.mma = true;
      return p;
    };
    for (int T : {512, 1024, 2048, 8192}) {
      const int iters = T >= 8192 ? 4 : 10;
      const double touched = E * (1.0 - std::pow(1.0 - double(k) / E, T));
      const double weight_bytes = 2.0 * (touched + 1) * 3 * F * d;
      const double flops = 2.0 * 3 * F * d * (double(T) * k + T);
      const double router_ms = TimeMs([&](int i) { CHECK_OK(MoeRouter(params(i, T), g_stream)); }, iters);
      moe_gemm.push_back({"router only", T, router_ms * 1e3, 0.0, 0.0});
      const double ms = TimeMs([&](int i) { CHECK_OK(Moe(params(i, T), g_stream)); }, iters);
      moe_gemm.push_back({"grouped gemm", T, ms * 1e3, weight_bytes, flops});
    }
  }

  // The MoE router alone (MoeRouter: the fused input norm, as the engine runs it, the router GEMV and
  // the top-k) at XS.2's E 256, k 8, d 2048: the one-row kernel (a token per block) against the
  // multi-row kernel (8 token rows per block, MoeParams::router_rows_min_tokens) at the same T. Bytes:
  // the router matrix once and per token the residual, delta, updated residual and u2 rows.
  if (want("router")) {
    const int E = 256, k = 8, d = 2048, F = 512, kMaxT = 2048;
    auto router = Random(size_t(E) * d, 50, 0.05f), bias = Random(E, 60, 0.05f);
    auto table = Alloc(size_t(E) * sizeof(void*));  // expert pointer tables: copied, never dereferenced
    CHECK_OK(table.Fill(0));
    auto h = Random(size_t(kMaxT) * d, 81, 4.0f), delta = Random(size_t(kMaxT) * d, 82, 1.0f), nw = Random(d, 83, 1.0f);
    auto x = Alloc(size_t(kMaxT) * d * 2), h_out = Alloc(size_t(kMaxT) * d * 2), y = Alloc(16);
    auto ws = Alloc(MoeWorkspaceBytes(d, E, k, F, F, kMaxT)), counter = Alloc(kMaxT * 4), ids = Alloc(size_t(kMaxT) * k * 4);
    CHECK_OK(counter.Fill(0));
    for (int T : {1, 16, 64, 512, 2048}) {
      for (int rows_min : {0, 1}) {
        MoeParams p;
        p.x = x.as<bf16>(), p.router_w = router.as<bf16>(), p.router_bias = bias.as<bf16>();
        p.gate_w = p.up_w = p.down_w = table.as<const bf16*>();
        p.shared_gate_w = p.shared_up_w = p.shared_down_w = router.as<bf16>();  // never read by the router
        p.d = d, p.num_experts = E, p.top_k = k, p.ffn = F, p.shared_ffn = F, p.num_tokens = T;
        p.y = y.as<bf16>(), p.topk_ids = ids.as<int32_t>(), p.workspace = ws.data(), p.counter = counter.as<uint32_t>();
        p.norm.residual = h.as<bf16>(), p.norm.delta = delta.as<bf16>(), p.norm.weight = nw.as<bf16>();
        p.norm.residual_out = h_out.as<bf16>(), p.norm.u_out = x.as<bf16>();
        p.router_rows_min_tokens = rows_min;
        const double ms = TimeMs([&](int) { CHECK_OK(MoeRouter(p, g_stream)); }, T >= 512 ? 20 : 200);
        rows.push_back({fmt::format("router {} T{}", rows_min ? "8 rows" : "1 row", T), "E256 k8 d2048 fused norm", ms * 1e3,
                        2.0 * (size_t(E) * d + size_t(4) * T * d)});
      }
    }
  }

  // MoE with FP8 experts (routed and shared, 128x128 scales) at the XS.2 layer beside the BF16 rows of
  // the moe section: batch 1 (register gate/up) and the grouped path at T 8 and 64.
  if (want("moe_fp8")) {
    const int E = 256, k = 8, d = 2048, F = 512;
    const int layers = 2;
    std::vector<cuda::DeviceBuffer> codes, scales, tables, routers, biases;
    const size_t mat = size_t(F) * d, mat_scales = size_t(F / 128) * (d / 128);
    for (int l = 0; l < layers; ++l) {
      // One allocation per matrix kind: E + 1 experts (the last is the shared one).
      std::vector<const uint8_t*> cp[3];
      std::vector<const float*> sp[3];
      for (int m = 0; m < 3; ++m) {
        codes.push_back(Alloc(mat * (E + 1)));
        scales.push_back(Alloc(mat_scales * (E + 1) * 4));
        for (int e = 0; e <= E; ++e) {
          uint8_t* c = codes.back().as<uint8_t>() + mat * e;
          float* sc = scales.back().as<float>() + mat_scales * e;
          const int rows = m == 2 ? d : F, cols = m == 2 ? F : d;
          CHECK_OK(FillAffineFp8(c, sc, rows, cols, 128, 128, 5000 + (l * 3 + m) * 1000 + e, 0.02f, 0.0f, nullptr));
          if (e < E) cp[m].push_back(c), sp[m].push_back(sc);
        }
      }
      for (int m = 0; m < 3; ++m) tables.push_back(Upload(cp[m])), tables.push_back(Upload(sp[m]));
      routers.push_back(Random(size_t(E) * d, 50 + l, 0.05f));
      biases.push_back(Random(E, 60 + l, 0.05f));
    }
    const int kMaxT = 2048;
    auto xs = Random(size_t(kMaxT) * d, 80, 1.0f);
    auto yv = Alloc(size_t(kMaxT) * d * 2), ws = Alloc(MoeWorkspaceBytes(d, E, k, F, F, kMaxT)), counter = Alloc(kMaxT * 4);
    auto ids = Alloc(size_t(kMaxT) * k * 4);
    CHECK_OK(counter.Fill(0));
    auto moe_params = [&](int i, int T) {
      const int l = i % layers;
      MoeParams p;
      p.x = xs.as<bf16>() + (T == 1 ? size_t(i % 16) * d : 0), p.router_w = routers[l].as<bf16>();
      p.router_bias = biases[l].as<bf16>();
      MoeParams::Fp8Experts* kinds[3] = {&p.gate_fp8, &p.up_fp8, &p.down_fp8};
      Fp8Weight* shared[3] = {&p.shared_gate_fp8, &p.shared_up_fp8, &p.shared_down_fp8};
      for (int m = 0; m < 3; ++m) {
        *kinds[m] = {tables[6 * l + 2 * m].as<const uint8_t*>(), tables[6 * l + 2 * m + 1].as<const float*>(), 128, 128};
        *shared[m] = {codes[3 * l + m].as<uint8_t>() + mat * E, scales[3 * l + m].as<float>() + mat_scales * E, 128, 128};
      }
      p.d = d, p.num_experts = E, p.top_k = k, p.ffn = F, p.shared_ffn = F, p.alpha = 2.5f;
      p.num_tokens = T, p.topk_ids = ids.as<int32_t>();
      p.y = yv.as<bf16>(), p.workspace = ws.data(), p.counter = counter.as<uint32_t>();
      return p;
    };
    const double scale_bytes = 4.0 * mat_scales * 3;
    // Then prompt rows: the experts on the tensor-core product (ops.h 5d) against the FP8 rule's grouped
    // kernels at T 512 and the MMA alone at 2,048.
    for (auto [T, mma] : {std::pair{1, false}, std::pair{8, false}, std::pair{64, false}, std::pair{512, false},
                          std::pair{512, true}, std::pair{2048, true}}) {
      const double touched = T == 1 ? k : E * (1.0 - std::pow(1.0 - double(k) / E, T));
      const double ms = TimeMs([&](int i) {
        MoeParams p = moe_params(i, T);
        p.mma = mma;
        CHECK_OK(Moe(p, g_stream));
      }, T > 64 ? 10 : T > 8 ? 50 : 200);
      rows.push_back({fmt::format("moe fp8 {}{}T{}", mma ? "mma " : "", T == 1 ? "" : "grouped ", T),
                      "E256 k8 F512 d2048 fp8", ms * 1e3, 2.0 * E * d + (touched + 1) * (3.0 * F * d + scale_bytes)});
    }
  }

  // Argmax over the vocabulary.
  if (want("argmax")) {
    auto logits = Random(100352, 90, 3.0f);
    auto ws = Alloc(ArgmaxWorkspaceBytes(100352)), counter = Alloc(4), out = Alloc(4);
    CHECK_OK(counter.Fill(0));
    const double ms = TimeMs([&](int) {
      ArgmaxParams p{logits.as<bf16>(), 100352, out.as<int32_t>(), ws.data(), counter.as<uint32_t>()};
      CHECK_OK(Argmax(p, g_stream));
    }, 500);
    rows.push_back({"argmax", "V 100352", ms * 1e3, 2.0 * 100352});
    // The sampler, one block per row: greedy rows and top-k/top-p rows.
    for (int R : {1, 64}) {
      for (bool greedy : {true, false}) {
        auto many = Random(size_t(R) * 100352, 91, 3.0f);
        auto params = Alloc(sizeof(DeviceRowSampling) * R), toks = Alloc(4 * R), bad = Alloc(4 * R);
        auto scratch = Alloc(size_t(R) * 2 * 100352 * 4);
        std::vector<DeviceRowSampling> hp(R);
        for (auto& sp : hp) {
          if (!greedy) sp.temperature = 0.8f, sp.top_k = 50, sp.top_p = 0.9f, sp.key = 7;
        }
        CHECK_OK(params.CopyFromHost(hp.data(), sizeof(DeviceRowSampling) * R));
        const double ms2 = TimeMs([&](int) {
          SampleRowsParams p;
          p.logits = many.as<bf16>(), p.rows = R, p.vocab = 100352, p.params = params.as<DeviceRowSampling>();
          p.tokens = toks.as<int32_t>(), p.nonfinite = bad.as<int32_t>(), p.scratch = scratch.as<float>();
          CHECK_OK(SampleRows(p, g_stream));
        }, 50);
        rows.push_back({fmt::format("sample_rows R{} {}", R, greedy ? "greedy" : "top-k/p"), "V 100352", ms2 * 1e3,
                        2.0 * 100352 * R});
      }
    }
  }

  if (!prefill.empty()) {
    std::printf("\nattn_prefill (FP8 KV, page 32, 8 KV heads, D 128; multi-row: %d rows per block)\n", kAttnMultiRows);
    std::printf("%-16s %5s %12s %12s %8s %14s %14s %10s %9s\n", "layer", "T", "one-row us", "multi-row us", "speedup",
                "one-row KV MB", "multi-row KV MB", "prompt us", "TFLOP/s");
    for (const PrefillRow& r : prefill) {
      std::printf("%-16s %5d %12.1f %12.1f %7.2fx %14.1f %14.1f %10.1f %9.1f\n", r.layer.c_str(), r.T, r.us_one,
                  r.us_multi, r.us_one / r.us_multi, r.bytes_one / 1e6, r.bytes_multi / 1e6, r.us_prompt,
                  r.flops / (r.us_prompt * 1e6));
    }
  }
  if (!moe_gemm.empty()) {
    std::printf("\nmoe_gemm (E256 k8 F512 d2048, MMA experts; 'experts' = whole Moe minus the router: lists, gate/up, "
                "down, combine)\n");
    std::printf("%-16s %5s %10s %12s %14s %14s\n", "kernel", "T", "moe us", "experts us", "weights TB/s", "TFLOP/s");
    double router_us = 0.0;
    for (const MoeGemmRow& r : moe_gemm) {
      if (r.weight_bytes == 0.0) {
        router_us = r.us;
        std::printf("%-16s %5d %10.1f\n", r.kernel.c_str(), r.T, r.us);
        continue;
      }
      const double experts_us = r.us - router_us;
      std::printf("%-16s %5d %10.1f %12.1f %14.2f %14.1f\n", r.kernel.c_str(), r.T, r.us, experts_us,
                  r.weight_bytes / (experts_us * 1e-6) / 1e12, r.flops / (experts_us * 1e-6) / 1e12);
    }
  }
  if (!products.empty()) {
    constexpr double kPeakTflops = 790.0;
    std::printf("\n%-10s %-12s %-13s %5s %10s %9s %8s %10s %8s\n", "product", "layer", "shape", "T", "us/call", "GB/s",
                "TFLOP/s", "floor us", "%floor");
    for (const ProductRow& r : products) {
      const double bytes = 2.0 * (double(r.out) * r.in + double(r.T) * (r.in + r.out));
      const double flops = 2.0 * double(r.out) * r.in * r.T;
      const double floor_us = std::max(bytes / (copy_gbs * 1e9), flops / (kPeakTflops * 1e12)) * 1e6;
      std::printf("%-10s %-12s %-13s %5d %10.2f %9.1f %8.1f %10.2f %7.1f%%\n", r.kernel.c_str(), r.layer.c_str(),
                  fmt::format("{}x{}", r.out, r.in).c_str(), r.T, r.us, bytes / (r.us * 1e-6) / 1e9,
                  flops / (r.us * 1e-6) / 1e12, floor_us, 100.0 * floor_us / r.us);
    }
  }
  std::printf("\n%-24s %-32s %10s %10s %8s\n", "kernel", "shape", "us/call", "GB/s", "%copy");
  for (const Row& r : rows) {
    const double gbs = r.bytes / (r.us * 1e-6) / 1e9;
    std::printf("%-24s %-32s %10.2f %10.1f %7.1f%%\n", r.name.c_str(), r.shape.c_str(), r.us, gbs,
                100.0 * gbs / copy_gbs);
  }
  return 0;
}
