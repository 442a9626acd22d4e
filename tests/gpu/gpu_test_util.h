// Helpers shared by the GPU kernel tests (kernels_gpu_test.cc, kernels_fp8_gpu_test.cc): the visible
// skip where no CUDA device is usable, status assertions, random BF16 data, device buffers to and from
// the host, and the element-wise tolerance check every kernel comparison uses.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "base/dtype.h"
#include "base/rng.h"
#include "cuda/buffer.h"
#include "cuda/device.h"
#include "kernels/common.h"
#include "kernels/ops.h"
#include "tests/gpu/gpu_skip.h"

#define ASSERT_OK(expr)                                          \
  do {                                                           \
    const ::dl::Status s_ = (expr);                              \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.message();       \
  } while (0)

namespace dl::kernels::gpu_test {

inline std::vector<bf16> RandomBf16(size_t n, uint64_t key, float scale = 1.0f) {
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = FloatToBf16(scale * NormalAt(key, i));
  return v;
}

template <typename T>
cuda::DeviceBuffer Upload(const std::vector<T>& v) {
  auto b = cuda::DeviceBuffer::Create(std::max<size_t>(v.size() * sizeof(T), 16));
  EXPECT_TRUE(b.ok()) << b.status().message();
  if (!v.empty()) EXPECT_TRUE(b->CopyFromHost(v.data(), v.size() * sizeof(T)).ok());
  return std::move(b).value();
}
template <typename T>
std::vector<T> Download(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  EXPECT_TRUE(b.CopyToHost(v.data(), n * sizeof(T)).ok());
  return v;
}
inline cuda::DeviceBuffer Alloc(size_t bytes, int poison = 0xff) {
  auto b = cuda::DeviceBuffer::Create(std::max<size_t>(bytes, 16));
  EXPECT_TRUE(b.ok()) << b.status().message();
  EXPECT_TRUE(b->Fill(poison).ok());
  return std::move(b).value();
}
inline void Sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }
inline std::vector<bf16> Rows(const std::vector<bf16>& v, size_t row_elems, int first, int n) {
  return std::vector<bf16>(v.begin() + first * row_elems, v.begin() + (first + n) * row_elems);
}
// |got - want| <= atol + rtol * |want| (+ slack[i] where slack is given: a per-element allowance the
// caller derives, e.g. from the magnitude of the terms a sum cancelled) for every element; NaN
// (poison left unwritten) never passes.
inline void ExpectClose(const std::vector<bf16>& got, const std::vector<bf16>& want, float atol, float rtol,
                 const std::string& what, const std::vector<float>& slack = {}) {
  ASSERT_EQ(got.size(), want.size());
  ASSERT_TRUE(slack.empty() || slack.size() == got.size());
  size_t bad = 0, first = 0;
  float worst = 0.0f;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = Bf16ToFloat(got[i]), w = Bf16ToFloat(want[i]);
    const float err = std::fabs(g - w);
    if (!(err <= atol + rtol * std::fabs(w) + (slack.empty() ? 0.0f : slack[i]))) {
      if (bad++ == 0) first = i;
    }
    if (err > worst || std::isnan(err)) worst = err;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size()
                     << " elements outside tolerance; first at " << first << " got "
                     << Bf16ToFloat(got[first]) << " want " << Bf16ToFloat(want[first])
                     << (slack.empty() ? "" : " slack " + std::to_string(slack[first])) << "; max abs err " << worst;
}

// A shuffled subset (T / 2 + 1 of the T tokens, order from `seed`) of a MoE launch's tokens, run as a
// batch of its own with the same parameters, gives each token the row it got among all T (y_all:
// [T, d]): the grouping never changes a token's bits.
inline void ExpectShuffledSubsetGivesTheSameRows(const MoeParams& p, const std::vector<bf16>& x,
                                                 const std::vector<bf16>& y_all, uint32_t seed) {
  const int T = p.num_tokens, d = p.d;
  std::vector<int> pick(T);
  std::iota(pick.begin(), pick.end(), 0);
  std::shuffle(pick.begin(), pick.end(), std::mt19937(seed));
  pick.resize(T / 2 + 1);
  std::vector<bf16> xs;
  for (int t : pick) xs.insert(xs.end(), x.begin() + static_cast<size_t>(t) * d, x.begin() + static_cast<size_t>(t + 1) * d);
  auto d_xs = Upload(xs);
  const int n = static_cast<int>(pick.size());
  auto d_ys = Alloc(static_cast<size_t>(n) * d * 2), d_idss = Alloc(static_cast<size_t>(n) * p.top_k * 4);
  MoeParams sub = p;
  sub.num_tokens = n, sub.x = d_xs.as<bf16>(), sub.y = d_ys.as<bf16>(), sub.topk_ids = d_idss.as<int32_t>();
  ASSERT_OK(Moe(sub, nullptr));
  Sync();
  const auto ys = Download<bf16>(d_ys, static_cast<size_t>(n) * d);
  for (int i = 0; i < n; ++i) EXPECT_EQ(Rows(ys, d, i, 1), Rows(y_all, d, pick[i], 1)) << "token " << pick[i];
}

// The element-wise identity of two equally long vectors, reporting the first difference (not the whole
// vectors); compare float and BF16 data as their bits.
template <typename T>
void ExpectSameElements(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const auto diff = std::mismatch(got.begin(), got.end(), want.begin());
  EXPECT_TRUE(diff.first == got.end()) << what << ": first difference at element " << (diff.first - got.begin())
                                       << " of " << got.size();
}

// The multi-row router (MoeParams::router_rows_min_tokens 1: 8 token rows per block at every T) against
// the one-row router (0: one token per block) for the layer `layer` points at (x, y, ids, weights,
// workspace, counter and the norm are this function's; num_tokens, softcap, mma and the FP8 tables are
// the caller's): MoeRouter alone leaves every byte of the workspace (logits, selection, weights, expert
// pointer tables, per token) and the ids and weights the same; the whole Moe gives the same ids,
// weights and y, and with a fused input norm (fused_norm_seed != 0: residual, delta and norm weight
// from that seed) the same u2 in x and updated residual. Both runs start from the same poisoned
// buffers, so an output neither writes would compare equal: the ids are checked to be a selection and
// y, u2 and the residual to be written (no BF16 NaN, the poison).
inline void ExpectMultiRowRouterMatchesOneRow(const MoeParams& layer, uint64_t fused_norm_seed) {
  const int T = layer.num_tokens, d = layer.d, E = layer.num_experts, k = layer.top_k;
  const size_t n = static_cast<size_t>(T) * d, nk = static_cast<size_t>(T) * k;
  const size_t ws_bytes = MoeWorkspaceBytes(d, E, k, layer.ffn, layer.shared_ffn, T);
  const bool fused = fused_norm_seed != 0;
  const std::vector<bf16> x_in = RandomBf16(n, 1101);
  const size_t norm_n = fused ? n : 1;  // the norm's inputs only where it runs
  auto d_h = Upload(RandomBf16(norm_n, fused_norm_seed, 4.0f)), d_dl = Upload(RandomBf16(norm_n, fused_norm_seed + 1));
  auto d_nw = Upload(RandomBf16(fused ? d : 1, fused_norm_seed + 2));
  struct Out {
    std::vector<uint8_t> router_ws;
    std::vector<int32_t> router_ids, ids;
    std::vector<uint32_t> router_wts, wts;
    std::vector<uint16_t> y, x, res;
  };
  auto run = [&](int min_tokens, Out* o) {
    auto x = Alloc(n * 2), y = Alloc(n * 2), res = Alloc(n * 2), ids = Alloc(nk * 4), wts = Alloc(nk * 4);
    auto ws = Alloc(ws_bytes), counter = Alloc(static_cast<size_t>(T) * 4, 0);
    if (!fused) ASSERT_OK(x.CopyFromHost(x_in.data(), n * 2));
    MoeParams p = layer;
    p.x = x.as<bf16>(), p.y = y.as<bf16>(), p.topk_ids = ids.as<int32_t>(), p.topk_weights = wts.as<float>();
    p.workspace = ws.data(), p.counter = counter.as<uint32_t>();
    p.router_rows_min_tokens = min_tokens;
    if (fused) {
      p.norm.residual = d_h.as<bf16>(), p.norm.delta = d_dl.as<bf16>(), p.norm.weight = d_nw.as<bf16>();
      p.norm.residual_out = res.as<bf16>(), p.norm.u_out = x.as<bf16>(), p.norm.eps = 1e-6f;
    }
    ASSERT_OK(MoeRouter(p, nullptr));
    Sync();
    o->router_ws = Download<uint8_t>(ws, ws_bytes);
    o->router_ids = Download<int32_t>(ids, nk);
    o->router_wts = Download<uint32_t>(wts, nk);
    EXPECT_EQ(Download<uint32_t>(counter, T), std::vector<uint32_t>(T, 0u)) << "the router leaves its tickets at zero";
    ASSERT_OK(Moe(p, nullptr));
    Sync();
    o->ids = Download<int32_t>(ids, nk);
    o->wts = Download<uint32_t>(wts, nk);
    o->y = Download<uint16_t>(y, n);
    o->x = Download<uint16_t>(x, n);
    if (fused) o->res = Download<uint16_t>(res, n);
    EXPECT_EQ(Download<uint32_t>(counter, T), std::vector<uint32_t>(T, 0u));
  };
  Out one, multi;
  ASSERT_NO_FATAL_FAILURE(run(0, &one));
  ASSERT_NO_FATAL_FAILURE(run(1, &multi));
  // Not vacuous: every token has k distinct experts, and y, x and the residual were written.
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> sel(one.ids.begin() + static_cast<size_t>(t) * k, one.ids.begin() + static_cast<size_t>(t + 1) * k);
    std::sort(sel.begin(), sel.end());
    ASSERT_TRUE(sel.front() >= 0 && sel.back() < E && std::adjacent_find(sel.begin(), sel.end()) == sel.end())
        << "token " << t << " has no selection of " << k << " distinct experts";
  }
  auto written = [](const std::vector<uint16_t>& v) {
    return std::none_of(v.begin(), v.end(), [](uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0; });
  };
  EXPECT_TRUE(written(one.y)) << "y has unwritten (NaN) elements";
  if (fused) EXPECT_TRUE(written(one.x) && written(one.res)) << "u2 or the residual has unwritten elements";
  ExpectSameElements(multi.router_ws, one.router_ws, "router workspace (logits, weights, pointers, ids)");
  ExpectSameElements(multi.router_ids, one.router_ids, "router topk_ids");
  ExpectSameElements(multi.router_wts, one.router_wts, "router topk_weights");
  ExpectSameElements(multi.ids, one.ids, "moe topk_ids");
  ExpectSameElements(multi.wts, one.wts, "moe topk_weights");
  ExpectSameElements(multi.y, one.y, "moe y");
  ExpectSameElements(multi.x, one.x, fused ? "u2 written to x" : "x");
  ExpectSameElements(multi.res, one.res, "updated residual");
  EXPECT_EQ(one.router_ids, one.ids) << "MoeRouter and Moe select alike";
}

}  // namespace dl::kernels::gpu_test
