#include "model/cuda_runner.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "base/rng.h"

#include "cuda/device.h"
#include "model/synthetic.h"
#include "cuda/memory.h"
#include "kernels/attention/attention.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/timeline.h"
#endif

namespace dl {

#if defined(DECODELAB_HAVE_CUDA)

using kernels::bf16;

namespace {

struct DeviceLayer {
  cuda::DeviceBuffer qkvg;  // [H*D + 2*K*D + gate_width, d]: q, k, v and g projections fused
  cuda::DeviceBuffer o;     // [d, H*D]
  cuda::DeviceBuffer input_norm, post_norm, q_norm, k_norm;
  cuda::DeviceBuffer gate_up, down;  // dense: [2F, d] (gate rows first), [d, F]
  cuda::DeviceBuffer router, bias;   // sparse: [E, d], [E]
  cuda::DeviceBuffer experts_gate, experts_up, experts_down;  // [E, F, d], [E, F, d], [E, d, F]
  cuda::DeviceBuffer shared_gate, shared_up, shared_down;
  cuda::DeviceBuffer gate_ptrs, up_ptrs, down_ptrs;  // [E] device pointers into experts_*
  cuda::DeviceBuffer k_pool, v_pool;                 // [pages, P, K, D]
  kernels::AttentionKernel attn;
  int64_t heads = 0, qkvg_width = 0, gate_width = 0;
  bool sliding = false, sparse = false;
};

}  // namespace

struct CudaRunner::Impl {
  const ModelConfig& cfg;
  KvCacheSpec kv;
  KvScales scales;
  CudaRunnerOptions opt;
  cuda::Stream stream;
  cuda::DeviceBuffer embed, final_norm, lm_head;
  std::vector<DeviceLayer> layers;
  RopeTable rope[2];
  cuda::DeviceBuffer inv_freq[2];
  // Activations, sized for max_chunk tokens.
  cuda::DeviceBuffer ids, positions, residual, residual_alt, u, qkvg, q_out, attn_out, delta, gate_up, hidden;
  cuda::DeviceBuffer logits_bf16, logits_f32, argmax;
  cuda::DeviceBuffer block_tables[2];
  int32_t max_pages = 0;
  int64_t max_qkvg = 0, max_attn = 0, max_ffn = 0;
  cuda::DeviceBuffer attn_ws, attn_counters, moe_ws, moe_counter, argmax_ws, argmax_counter, topk_ids, topk_w;
  size_t attn_ws_bytes = 0;
  cuda::PinnedBuffer host_ids, host_positions, host_tables, host_logits, host_argmax;
  cuda::GraphExec decode_graph;
  int kernel_nodes = 0;
  // Layers of the last batch-1 forward whose input norm was folded into the q/k/v/g GEMV (Describe).
  int decode_norms_in_qkvg = -1;
  std::vector<std::string> layer_presets;
  bool fallback = false;
  std::vector<std::string> fallback_ops;
  std::string device_name;

  explicit Impl(const ModelConfig& c) : cfg(c) {}
  // Timing experiments (CudaRunnerOptions::skip_ops): whether op family `op` is left out.
  bool Skips(std::string_view op) const {
    return std::find(opt.skip_ops.begin(), opt.skip_ops.end(), op) != opt.skip_ops.end();
  }
  // The norm folding in effect: none while ops are skipped (each skip must leave its own kernels out).
  kernels::FusedNormMode FusedNorm() const {
    return opt.skip_ops.empty() ? kernels::FusedNorm() : kernels::FusedNormMode{};
  }
  Status Init(const Checkpoint& ck);
  Status StageInputs(const SequenceKv& seq, std::span<const int32_t> tokens);
  Status Enqueue(int32_t T, bool all_logits);
  Status CaptureDecodeGraph();
  Status CopyLogits(int32_t rows, std::vector<float>* out);
};

namespace {

// Where shape-only views get their values: (seed, kind, fan_in) per tensor name.
struct SyntheticSource {
  uint64_t seed = 0;
  std::unordered_map<std::string, TensorSpec> specs;
};
thread_local const SyntheticSource* g_synthetic = nullptr;

// Copies a tensor to the device as BF16 (converting F32/F16 on the host in chunks), or generates it
// there when the view has no data (shape-only checkpoint).
Status UploadAt(const TensorView& t, void* dst, cudaStream_t s) {
  if (t.data == nullptr) {
    if (!g_synthetic) return Internal("tensor {} has no data and no synthetic source", t.name);
    auto it = g_synthetic->specs.find(t.name);
    if (it == g_synthetic->specs.end()) return Internal("no synthetic spec for {}", t.name);
    float scale = 0, offset = 0;
    TensorValueAffine(it->second.kind, it->second.fan_in, &scale, &offset);
    DL_RETURN_IF_ERROR(kernels::FillAffineBf16(static_cast<bf16*>(dst), t.numel(),
                                               StreamKey(g_synthetic->seed, t.name), scale, offset,
                                               s));
    return Status::Ok();
  }
  if (t.dtype == DType::kBF16) {
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, t.data, t.nbytes(), cudaMemcpyHostToDevice, s));
    return cudaStreamSynchronize(s) == cudaSuccess ? Status::Ok()
                                                   : Internal("upload of {} failed", t.name);
  }
  const int64_t n = t.numel();
  const int64_t chunk = 1 << 22;
  std::vector<uint16_t> staging(static_cast<size_t>(std::min(n, chunk)));
  for (int64_t i = 0; i < n; i += chunk) {
    const int64_t m = std::min(chunk, n - i);
    for (int64_t j = 0; j < m; ++j) staging[j] = FloatToBf16(t.at(i + j));
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(static_cast<uint16_t*>(dst) + i, staging.data(), m * 2,
                                       cudaMemcpyHostToDevice));
  }
  return Status::Ok();
}

Result<cuda::DeviceBuffer> Upload(const TensorView& t, cudaStream_t s) {
  DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(static_cast<size_t>(t.numel()) * 2));
  DL_RETURN_IF_ERROR(UploadAt(t, buf.data(), s).WithContext(t.name));
  return buf;
}

// Row-concatenation of several [rows_i, cols] tensors into one [sum rows_i, cols] BF16 matrix.
Result<cuda::DeviceBuffer> UploadConcat(const std::vector<const TensorView*>& parts, cudaStream_t s) {
  int64_t total = 0;
  for (auto* p : parts) total += p->numel();
  DL_ASSIGN_OR_RETURN(auto buf, cuda::DeviceBuffer::Create(static_cast<size_t>(total) * 2));
  int64_t off = 0;
  for (auto* p : parts) {
    DL_RETURN_IF_ERROR(UploadAt(*p, buf.as<uint16_t>() + off, s).WithContext(p->name));
    off += p->numel();
  }
  return buf;
}

// The experts' gate (or up, or down) matrices stacked, plus a device array of per-expert pointers.
Status UploadExperts(const std::vector<ExpertWeights>& experts, TensorView ExpertWeights::*which,
                     cuda::DeviceBuffer* stacked, cuda::DeviceBuffer* ptrs, cudaStream_t s) {
  const int64_t per = (experts[0].*which).numel();
  DL_ASSIGN_OR_RETURN(*stacked,
                      cuda::DeviceBuffer::Create(static_cast<size_t>(per) * experts.size() * 2));
  std::vector<const void*> host_ptrs;
  for (size_t e = 0; e < experts.size(); ++e) {
    void* dst = stacked->as<uint16_t>() + static_cast<int64_t>(e) * per;
    DL_RETURN_IF_ERROR(UploadAt(experts[e].*which, dst, s).WithContext((experts[e].*which).name));
    host_ptrs.push_back(dst);
  }
  DL_ASSIGN_OR_RETURN(*ptrs, cuda::DeviceBuffer::Create(host_ptrs.size() * sizeof(void*)));
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptrs->data(), host_ptrs.data(), host_ptrs.size() * sizeof(void*),
                                     cudaMemcpyHostToDevice));
  return Status::Ok();
}

template <typename T>
Result<cuda::DeviceBuffer> Zeroed(size_t count) {
  DL_ASSIGN_OR_RETURN(auto b, cuda::DeviceBuffer::Create(count * sizeof(T)));
  if (b.data()) DL_CUDA_RETURN_IF_ERROR(cudaMemset(b.data(), 0, b.size()));
  return b;
}

// Whether RunGemv takes the streaming kernel for this shape (GemvParams::streaming).
bool GemvStreams(int out, int in, int tokens) {
  const kernels::DecodeExperiments& exp = kernels::Experiments();
  return exp.stream_gemv && tokens == 1 && kernels::GemvStreamSupported(out, in, exp.stream_ring_kb, exp.stream_stage_kb);
}

// y[T, out] = x[T, in] W[out, in]^T, dense rows.
Status RunGemv(const bf16* w, const bf16* x, bf16* y, int out, int in, int tokens, cudaStream_t s,
              const kernels::FusedInputNorm& norm = {}, int stage_rows = 0, bool release_after_wait = false,
              int prefetch_kb = -1) {
  kernels::GemvParams p;
  p.release_after_wait = release_after_wait;
  p.norm = norm;
  p.stage_rows = stage_rows;
  p.w = w;
  p.x = x;
  p.y = y;
  p.out = out;
  p.in = in;
  p.num_tokens = tokens;
  // Batch 1 streams the weights through shared memory (GemvParams::streaming): same bits.
  const kernels::DecodeExperiments& exp = kernels::Experiments();
  p.streaming.ring_kb = exp.stream_ring_kb;
  p.streaming.stage_kb = exp.stream_stage_kb;
  p.streaming.prefetch_kb = prefetch_kb >= 0 ? prefetch_kb : exp.stream_prefetch_kb;
  p.streaming.on = stage_rows == 0 && GemvStreams(out, in, tokens);
  return kernels::Gemv(p, s);
}

}  // namespace

Status CudaRunner::Impl::Init(const Checkpoint& ck) {
  const ModelConfig& c = cfg;
  const ModelWeights& w = ck.weights();
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(opt.device));
  SyntheticSource synthetic;
  synthetic.seed = opt.synthetic_seed;
  if (ck.files().empty()) {
    for (TensorSpec& spec : CheckpointTensorSpecs(cfg)) synthetic.specs[spec.name] = spec;
  }
  g_synthetic = &synthetic;
  struct Clear {
    ~Clear() { g_synthetic = nullptr; }
  } clear;
  DL_ASSIGN_OR_RETURN(auto info, cuda::GetDeviceInfo(opt.device));
  device_name = info.name;
  DL_ASSIGN_OR_RETURN(stream, cuda::Stream::Create());
  cudaStream_t s = stream.get();
  const int64_t d = c.hidden_size, D = c.head_dim, K = c.num_key_value_heads;
  if (d % 8 != 0 || D % 8 != 0) {
    return InvalidArgument("CUDA backend needs hidden_size and head_dim divisible by 8 ({}, {})", d, D);
  }
  DL_ASSIGN_OR_RETURN(embed, Upload(w.embed, s));
  DL_ASSIGN_OR_RETURN(final_norm, Upload(w.final_norm, s));
  DL_ASSIGN_OR_RETURN(lm_head, Upload(w.lm_head, s));
  rope[0] = ComputeRopeTable(c.rope_full, D);
  rope[1] = ComputeRopeTable(c.rope_sliding, D);
  for (int i = 0; i < 2; ++i) {
    DL_ASSIGN_OR_RETURN(inv_freq[i], cuda::DeviceBuffer::Create(
                                         std::max<size_t>(1, rope[i].inv_freq.size()) * 4));
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(inv_freq[i].data(), rope[i].inv_freq.data(),
                                       rope[i].inv_freq.size() * 4, cudaMemcpyHostToDevice));
  }
  const kernels::KvDtype kvd =
      kv.dtype == DType::kF8E4M3 ? kernels::KvDtype::kFp8 : kernels::KvDtype::kBf16;
  layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    DeviceLayer& dl = layers[l];
    dl.heads = c.heads(l);
    dl.gate_width = c.gate_width(l);
    dl.qkvg_width = dl.heads * D + 2 * K * D + dl.gate_width;
    dl.sliding = c.is_sliding(l);
    dl.sparse = c.is_sparse(l);
    max_qkvg = std::max(max_qkvg, dl.qkvg_width);
    max_attn = std::max(max_attn, dl.heads * D);
    DL_ASSIGN_OR_RETURN(dl.qkvg, UploadConcat({&lw.q, &lw.k, &lw.v, &lw.g}, s));
    DL_ASSIGN_OR_RETURN(dl.o, Upload(lw.o, s));
    DL_ASSIGN_OR_RETURN(dl.input_norm, Upload(lw.input_norm, s));
    DL_ASSIGN_OR_RETURN(dl.post_norm, Upload(lw.post_attn_norm, s));
    DL_ASSIGN_OR_RETURN(dl.q_norm, Upload(lw.q_norm, s));
    DL_ASSIGN_OR_RETURN(dl.k_norm, Upload(lw.k_norm, s));
    if (dl.sparse) {
      DL_ASSIGN_OR_RETURN(dl.router, Upload(lw.router, s));
      DL_ASSIGN_OR_RETURN(dl.bias, Upload(lw.correction_bias, s));
      DL_RETURN_IF_ERROR(UploadExperts(lw.experts, &ExpertWeights::gate, &dl.experts_gate,
                                       &dl.gate_ptrs, s));
      DL_RETURN_IF_ERROR(UploadExperts(lw.experts, &ExpertWeights::up, &dl.experts_up, &dl.up_ptrs, s));
      DL_RETURN_IF_ERROR(UploadExperts(lw.experts, &ExpertWeights::down, &dl.experts_down,
                                       &dl.down_ptrs, s));
      DL_ASSIGN_OR_RETURN(dl.shared_gate, Upload(lw.shared.gate, s));
      DL_ASSIGN_OR_RETURN(dl.shared_up, Upload(lw.shared.up, s));
      DL_ASSIGN_OR_RETURN(dl.shared_down, Upload(lw.shared.down, s));
      max_ffn = std::max(max_ffn, c.moe_intermediate_size);
    } else {
      DL_ASSIGN_OR_RETURN(dl.gate_up, UploadConcat({&lw.mlp_gate, &lw.mlp_up}, s));
      DL_ASSIGN_OR_RETURN(dl.down, Upload(lw.mlp_down, s));
      max_ffn = std::max(max_ffn, c.intermediate_size);
    }
    const KvGroup g = dl.sliding ? KvGroup::kSliding : KvGroup::kFull;
    const size_t pool = kv.page_bytes() * static_cast<size_t>(kv.pages_in(g));
    DL_ASSIGN_OR_RETURN(dl.k_pool, Zeroed<uint8_t>(pool));
    DL_ASSIGN_OR_RETURN(dl.v_pool, Zeroed<uint8_t>(pool));
    // The attention kernel from the preset table; a missing preset is an error unless fallback is
    // allowed, and then every output says so.
    kernels::AttnPresetKey key;
    key.head_dim = static_cast<int>(D);
    key.group = static_cast<int>(dl.heads / K);
    key.page_size = kv.page_size;
    key.kv_dtype = kvd;
    key.window = dl.sliding ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
    auto resolved = kernels::ResolveAttention(key, opt.allow_fallback);
    if (!resolved.ok()) return resolved.status().WithContext(fmt::format("layer {}", l));
    dl.attn = *resolved;
    layer_presets.push_back(dl.attn.name);
    if (dl.attn.fallback) {
      fallback = true;
      fallback_ops.push_back(fmt::format("layer {} attention ({} not built)", l,
                                         kernels::CanonicalName(key)));
    }
  }
  const int32_t T = opt.max_chunk;
  DL_ASSIGN_OR_RETURN(ids, Zeroed<int32_t>(T));
  DL_ASSIGN_OR_RETURN(positions, Zeroed<int32_t>(T));
  DL_ASSIGN_OR_RETURN(residual, Zeroed<bf16>(static_cast<size_t>(T) * d));
  DL_ASSIGN_OR_RETURN(residual_alt, Zeroed<bf16>(static_cast<size_t>(T) * d));
  DL_ASSIGN_OR_RETURN(u, Zeroed<bf16>(static_cast<size_t>(T) * d));
  DL_ASSIGN_OR_RETURN(delta, Zeroed<bf16>(static_cast<size_t>(T) * d));
  DL_ASSIGN_OR_RETURN(qkvg, Zeroed<bf16>(static_cast<size_t>(T) * max_qkvg));
  DL_ASSIGN_OR_RETURN(q_out, Zeroed<bf16>(static_cast<size_t>(T) * max_attn));
  DL_ASSIGN_OR_RETURN(attn_out, Zeroed<bf16>(static_cast<size_t>(T) * max_attn));
  DL_ASSIGN_OR_RETURN(gate_up, Zeroed<bf16>(static_cast<size_t>(T) * 2 * max_ffn));
  DL_ASSIGN_OR_RETURN(hidden, Zeroed<bf16>(static_cast<size_t>(T) * max_ffn));
  DL_ASSIGN_OR_RETURN(logits_bf16, Zeroed<bf16>(static_cast<size_t>(T) * c.vocab_size));
  DL_ASSIGN_OR_RETURN(logits_f32, Zeroed<float>(static_cast<size_t>(T) * c.vocab_size));
  DL_ASSIGN_OR_RETURN(argmax, Zeroed<int32_t>(1));
  max_pages = PagesNeededFull(opt.max_seq_len, kv.page_size);
  for (auto& t : block_tables) {
    DL_ASSIGN_OR_RETURN(t, Zeroed<int32_t>(max_pages));
  }
  // Workspaces for the largest chunk and position.
  for (const DeviceLayer& dl : layers) {
    kernels::AttentionParams ap;
    ap.num_tokens = T;
    ap.num_q_heads = static_cast<int>(dl.heads);
    ap.num_kv_heads = static_cast<int>(K);
    ap.head_dim = static_cast<int>(D);
    ap.page_size = kv.page_size;
    ap.max_position = opt.max_seq_len - 1;
    ap.window_kind = dl.sliding ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
    ap.window = static_cast<int>(c.sliding_window);
    attn_ws_bytes = std::max(attn_ws_bytes, kernels::AttentionWorkspaceBytes(ap));
  }
  DL_ASSIGN_OR_RETURN(attn_ws, Zeroed<uint8_t>(attn_ws_bytes));
  DL_ASSIGN_OR_RETURN(attn_counters, Zeroed<uint32_t>(static_cast<size_t>(T) * K));
  if (c.num_experts > 0) {
    DL_ASSIGN_OR_RETURN(moe_ws, Zeroed<uint8_t>(kernels::MoeWorkspaceBytes(
                                    static_cast<int>(c.num_experts), static_cast<int>(c.num_experts_per_tok),
                                    static_cast<int>(c.moe_intermediate_size),
                                    static_cast<int>(c.shared_expert_intermediate_size), T)));
    DL_ASSIGN_OR_RETURN(moe_counter, Zeroed<uint32_t>(T));
    DL_ASSIGN_OR_RETURN(topk_ids, Zeroed<int32_t>(static_cast<size_t>(T) * c.num_experts_per_tok));
    DL_ASSIGN_OR_RETURN(topk_w, Zeroed<float>(static_cast<size_t>(T) * c.num_experts_per_tok));
  }
  DL_ASSIGN_OR_RETURN(argmax_ws,
                      Zeroed<uint8_t>(kernels::ArgmaxWorkspaceBytes(static_cast<int>(c.vocab_size))));
  DL_ASSIGN_OR_RETURN(argmax_counter, Zeroed<uint32_t>(1));
  DL_ASSIGN_OR_RETURN(host_ids, cuda::PinnedBuffer::Allocate(static_cast<size_t>(T) * 4));
  DL_ASSIGN_OR_RETURN(host_positions, cuda::PinnedBuffer::Allocate(static_cast<size_t>(T) * 4));
  DL_ASSIGN_OR_RETURN(host_tables, cuda::PinnedBuffer::Allocate(static_cast<size_t>(max_pages) * 8));
  DL_ASSIGN_OR_RETURN(host_logits,
                      cuda::PinnedBuffer::Allocate(static_cast<size_t>(T) * c.vocab_size * 4));
  DL_ASSIGN_OR_RETURN(host_argmax, cuda::PinnedBuffer::Allocate(4));
  DL_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Status::Ok();
}

Status CudaRunner::Impl::StageInputs(const SequenceKv& seq, std::span<const int32_t> tokens) {
  const int32_t T = static_cast<int32_t>(tokens.size());
  if (T > opt.max_chunk) {
    return InvalidArgument("CUDA forward of {} tokens exceeds the chunk size {}", T, opt.max_chunk);
  }
  if (seq.length() + T > opt.max_seq_len) {
    return InvalidArgument("sequence of {} tokens exceeds the CUDA backend's max_seq_len {}",
                           seq.length() + T, opt.max_seq_len);
  }
  for (int32_t i = 0; i < T; ++i) {
    if (tokens[i] < 0 || tokens[i] >= cfg.vocab_size) {
      return InvalidArgument("token id {} is outside the vocabulary [0, {})", tokens[i], cfg.vocab_size);
    }
    host_ids.as<int32_t>()[i] = tokens[i];
    host_positions.as<int32_t>()[i] = seq.length() + i;
  }
  cudaStream_t s = stream.get();
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ids.data(), host_ids.as<int32_t>(), T * 4,
                                          cudaMemcpyHostToDevice, s));
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(positions.data(), host_positions.as<int32_t>(), T * 4,
                                          cudaMemcpyHostToDevice, s));
  for (int g = 0; g < 2; ++g) {
    const auto& table = seq.block_table(static_cast<KvGroup>(g));
    if (static_cast<int32_t>(table.size()) > max_pages) return Internal("block table too long");
    int32_t* h = host_tables.as<int32_t>() + g * max_pages;
    std::fill(h, h + max_pages, -1);
    std::copy(table.begin(), table.end(), h);
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(block_tables[g].data(), h, max_pages * 4,
                                            cudaMemcpyHostToDevice, s));
  }
  return Status::Ok();
}

Status CudaRunner::Impl::Enqueue(int32_t T, bool all_logits) {
  const ModelConfig& c = cfg;
  cudaStream_t s = stream.get();
  const int d = static_cast<int>(c.hidden_size), D = static_cast<int>(c.head_dim);
  const int K = static_cast<int>(c.num_key_value_heads);
  const float eps = static_cast<float>(c.rms_norm_eps);
  // The residual stream lives in res[cur]. A norm folded into its consumer (FusedInputNorm) writes the
  // updated stream to the other buffer, because the consumer's other blocks still read this one; the
  // separate AddRmsNorm kernel (fusion off, timing experiments, the final norm) updates it in place.
  bf16* res_buf[2] = {residual.as<bf16>(), residual_alt.as<bf16>()};
  int cur = 0;
  const kernels::FusedNormMode fuse = FusedNorm();
  const kernels::DecodeExperiments& exp = kernels::Experiments();
  auto fused_norm = [&](const bf16* delta_in, const cuda::DeviceBuffer& weight, bf16* u_out) {
    kernels::FusedInputNorm n;
    n.residual = res_buf[cur];
    n.delta = delta_in;
    n.weight = weight.as<bf16>();
    n.residual_out = delta_in ? res_buf[cur ^ 1] : nullptr;  // no delta: the stream is unchanged
    n.u_out = u_out;
    n.eps = eps;
    n.prefetch_residual = exp.l2_prefetch;
    if (delta_in) cur ^= 1;
    return n;
  };
  auto separate_norm = [&](const bf16* delta_in, const cuda::DeviceBuffer& weight) -> Status {
    if (Skips("norm")) return Status::Ok();
    kernels::AddRmsNormParams n;
    n.residual = res_buf[cur];
    n.delta = delta_in;
    n.weight = weight.as<bf16>();
    n.out = u.as<bf16>();
    n.rows = T;
    n.n = d;
    n.eps = eps;
    n.prefetch_residual = exp.l2_prefetch;
    n.release_after_wait = Late(exp, kernels::LateRelease::kNorm);
    return kernels::AddRmsNorm(n, s);
  };
  int norms_in_qkvg = 0;
  DL_RETURN_IF_ERROR(kernels::EmbedLookup({embed.as<bf16>(), ids.as<int32_t>(), res_buf[cur], T, d,
                                           static_cast<int>(c.vocab_size)}, s));
  for (size_t l = 0; l < layers.size(); ++l) {
    DeviceLayer& L = layers[l];
    const int H = static_cast<int>(L.heads);
    const int group = L.sliding ? 1 : 0;
    const bf16* delta1 = l == 0 ? nullptr : delta.as<bf16>();
    kernels::FusedInputNorm norm1;
    if (fuse.before_attention ||
        (fuse.before_streaming_attention && GemvStreams(static_cast<int>(L.qkvg_width), d, T))) {
      norm1 = fused_norm(delta1, L.input_norm, nullptr);  // u1 feeds only q/k/v/g
      ++norms_in_qkvg;
    } else {
      DL_RETURN_IF_ERROR(separate_norm(delta1, L.input_norm));
    }

    if (!Skips("qkvg")) {
      DL_RETURN_IF_ERROR(RunGemv(L.qkvg.as<bf16>(), u.as<bf16>(), qkvg.as<bf16>(),
                                 static_cast<int>(L.qkvg_width), d, T, s, norm1, 0,
                                 Late(exp, kernels::LateRelease::kQkvg)));
    }

    kernels::QkNormRopeAppendParams rp;
    rp.q = qkvg.as<bf16>();
    rp.k = qkvg.as<bf16>() + H * D;
    rp.v = qkvg.as<bf16>() + (H + K) * D;
    rp.qkv_stride = L.qkvg_width;
    rp.q_norm_weight = L.q_norm.as<bf16>();
    rp.k_norm_weight = L.k_norm.as<bf16>();
    rp.inv_freq = inv_freq[group].as<float>();
    rp.attention_factor = rope[group].attention_factor;
    rp.rotary_dim = static_cast<int>(rope[group].rotary_dim);
    rp.eps = eps;
    rp.positions = positions.as<int32_t>();
    rp.num_tokens = T;
    rp.num_q_heads = H;
    rp.num_kv_heads = K;
    rp.head_dim = D;
    rp.q_out = q_out.as<bf16>();
    rp.k_pool = L.k_pool.data();
    rp.v_pool = L.v_pool.data();
    rp.kv_dtype = kv.dtype == DType::kF8E4M3 ? kernels::KvDtype::kFp8 : kernels::KvDtype::kBf16;
    rp.k_scale = scales.k[l];
    rp.v_scale = scales.v[l];
    rp.block_table = block_tables[group].as<int32_t>();
    rp.page_size = kv.page_size;
    rp.prefetch_constants = exp.l2_prefetch;
    rp.block_table_entries = max_pages;
    rp.release_after_wait = Late(exp, kernels::LateRelease::kRope);
    if (!Skips("rope")) DL_RETURN_IF_ERROR(kernels::QkNormRopeAppend(rp, s));

    kernels::AttentionParams ap;
    ap.q = q_out.as<bf16>();
    ap.k_pool = L.k_pool.data();
    ap.v_pool = L.v_pool.data();
    ap.block_table = block_tables[group].as<int32_t>();
    ap.positions = positions.as<int32_t>();
    ap.history_stable = true;  // keys before this forward's first token come from earlier forwards
    ap.max_position = opt.max_seq_len - 1;
    ap.num_tokens = T;
    ap.num_q_heads = H;
    ap.num_kv_heads = K;
    ap.head_dim = D;
    ap.page_size = kv.page_size;
    ap.kv_dtype = rp.kv_dtype;
    ap.window_kind = L.sliding ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
    ap.window = static_cast<int>(c.sliding_window);
    ap.k_scale = rp.k_scale;
    ap.v_scale = rp.v_scale;
    ap.gate = qkvg.as<bf16>() + (H + 2 * K) * D;
    ap.gate_stride = L.qkvg_width;
    ap.gate_per_element = c.gating == GatingKind::kPerElement;
    ap.out = attn_out.as<bf16>();
    ap.workspace = attn_ws.data();
    ap.workspace_bytes = attn_ws_bytes;
    ap.counters = attn_counters.as<uint32_t>();
    ap.cluster_max_chunks = exp.attention_cluster_max_chunks;
    ap.release_after_wait = Late(exp, kernels::LateRelease::kAttention);
    if (!Skips("attention")) {
      DL_RETURN_IF_ERROR(kernels::RunAttention(L.attn, ap, s).WithContext(fmt::format("layer {}", l)));
    }

    if (!Skips("o_proj")) {
      // Batch 1 may stage o_proj's weights into shared memory while attention runs (GemvParams);
      // off by default: equal within noise (docs/performance.md, session 4).
      const int stage = T == 1 && kernels::GemvStagedSupported(d, H * D)
                            ? std::min(exp.oproj_stage_rows, kernels::GemvMaxStageRows(H * D))
                            : 0;
      DL_RETURN_IF_ERROR(RunGemv(L.o.as<bf16>(), attn_out.as<bf16>(), delta.as<bf16>(), d, H * D, T, s, {}, stage,
                                 Late(exp, kernels::LateRelease::kOProj), exp.oproj_prefetch_kb));
    }

    kernels::FusedInputNorm norm2;
    if (fuse.before_mlp) {
      // The MoE's expert kernels read u2 too: the router writes it (u_out = x); the dense MLP's
      // gate/up is u2's only reader.
      norm2 = fused_norm(delta.as<bf16>(), L.post_norm, L.sparse ? u.as<bf16>() : nullptr);
    } else {
      DL_RETURN_IF_ERROR(separate_norm(delta.as<bf16>(), L.post_norm));
    }

    if (Skips(L.sparse ? "moe" : "dense_mlp")) {
      // timing experiment: the MLP's output is left as it was
    } else if (L.sparse) {
      kernels::MoeParams mp;
      mp.x = u.as<bf16>();
      mp.num_tokens = T;
      mp.router_w = L.router.as<bf16>();
      mp.router_bias = L.bias.as<bf16>();
      mp.gate_w = L.gate_ptrs.as<const bf16*>();
      mp.up_w = L.up_ptrs.as<const bf16*>();
      mp.down_w = L.down_ptrs.as<const bf16*>();
      mp.shared_gate_w = L.shared_gate.as<bf16>();
      mp.shared_up_w = L.shared_up.as<bf16>();
      mp.shared_down_w = L.shared_down.as<bf16>();
      mp.d = d;
      mp.num_experts = static_cast<int>(c.num_experts);
      mp.top_k = static_cast<int>(c.num_experts_per_tok);
      mp.ffn = static_cast<int>(c.moe_intermediate_size);
      mp.shared_ffn = static_cast<int>(c.shared_expert_intermediate_size);
      mp.alpha = static_cast<float>(c.moe_routed_scaling_factor);
      mp.softcap = static_cast<float>(c.moe_router_logit_softcapping);
      mp.y = delta.as<bf16>();
      mp.topk_ids = topk_ids.as<int32_t>();
      mp.topk_weights = topk_w.as<float>();
      mp.workspace = moe_ws.data();
      mp.counter = moe_counter.as<uint32_t>();
      mp.norm = norm2;
      mp.gate_up_variant = exp.moe_gate_up_variant, mp.down_variant = exp.moe_down_variant;
      mp.down_loads_early = exp.moe_down_loads_early;
      mp.gate_up_stream_ring_kb = exp.moe_gate_up_stream_ring_kb;
      mp.router_stages_pointers = exp.moe_router_stages_pointers;
      mp.router_stages_bias = exp.moe_router_stages_bias;
      mp.router_release_after_wait = Late(exp, kernels::LateRelease::kRouter);
      mp.down_release_after_wait = Late(exp, kernels::LateRelease::kDown);
      DL_RETURN_IF_ERROR(kernels::Moe(mp, s));
    } else {
      const int F = static_cast<int>(c.intermediate_size);
      DL_RETURN_IF_ERROR(
          RunGemv(L.gate_up.as<bf16>(), u.as<bf16>(), gate_up.as<bf16>(), 2 * F, d, T, s, norm2));
      DL_RETURN_IF_ERROR(kernels::SiluMul({gate_up.as<bf16>(), hidden.as<bf16>(), T, F}, s));
      DL_RETURN_IF_ERROR(RunGemv(L.down.as<bf16>(), hidden.as<bf16>(), delta.as<bf16>(), d, F, T, s));
    }
  }
  if (T == 1) decode_norms_in_qkvg = norms_in_qkvg;
  kernels::AddRmsNormParams fin;
  fin.residual = res_buf[cur];
  fin.delta = delta.as<bf16>();
  fin.weight = final_norm.as<bf16>();
  fin.out = u.as<bf16>();
  fin.rows = T;
  fin.n = d;
  fin.eps = eps;
  fin.prefetch_residual = exp.l2_prefetch;
  DL_RETURN_IF_ERROR(kernels::AddRmsNorm(fin, s));
  const int V = static_cast<int>(c.vocab_size);
  DL_RETURN_IF_ERROR(RunGemv(lm_head.as<bf16>(),
                             u.as<bf16>() + (all_logits ? 0 : static_cast<int64_t>(T - 1) * d),
                             logits_bf16.as<bf16>(), V, d, all_logits ? T : 1, s));
  kernels::ArgmaxParams am;
  am.logits = logits_bf16.as<bf16>() + (all_logits ? static_cast<int64_t>(T - 1) * V : 0);
  am.n = V;
  am.out = argmax.as<int32_t>();
  am.workspace = argmax_ws.data();
  am.counter = argmax_counter.as<uint32_t>();
  return kernels::Argmax(am, s);
}

Status CudaRunner::Impl::CaptureDecodeGraph() {
  cudaStream_t s = stream.get();
  DL_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  Status st = Enqueue(1, false);
  cudaGraph_t graph = nullptr;
  cudaError_t end = cudaStreamEndCapture(s, &graph);
  if (!st.ok()) {
    if (graph) cudaGraphDestroy(graph);
    return st.WithContext("capturing the decode graph");
  }
  if (end != cudaSuccess) return Internal("decode graph capture failed: {}", cudaGetErrorString(end));
  DL_RETURN_IF_ERROR(decode_graph.Adopt(graph));
  size_t n = 0;
  DL_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  DL_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &n));
  kernel_nodes = 0;
  for (auto node : nodes) {
    cudaGraphNodeType type;
    DL_CUDA_RETURN_IF_ERROR(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeKernel) ++kernel_nodes;
  }
  return Status::Ok();
}

Status CudaRunner::Impl::CopyLogits(int32_t rows, std::vector<float>* out) {
  cudaStream_t s = stream.get();
  const int64_t n = static_cast<int64_t>(rows) * cfg.vocab_size;
  DL_RETURN_IF_ERROR(kernels::Bf16ToF32(logits_bf16.as<bf16>(), logits_f32.as<float>(), n, s));
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_logits.as<float>(), logits_f32.data(), n * 4,
                                          cudaMemcpyDeviceToHost, s));
  DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  out->assign(host_logits.as<float>(), host_logits.as<float>() + n);
  return Status::Ok();
}

CudaRunner::CudaRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaRunner::~CudaRunner() = default;

Result<std::unique_ptr<CudaRunner>> CudaRunner::Create(const Checkpoint& checkpoint,
                                                       const KvCacheSpec& kv, KvScales scales,
                                                       const CudaRunnerOptions& options) {
  std::string why;
  if (cuda::DeviceCount(&why) <= options.device) {
    return Unavailable("--backend cuda: no usable GPU ({})", why);
  }
  if (kv.dtype != DType::kBF16 && kv.dtype != DType::kF8E4M3) {
    return InvalidArgument("--kv-dtype {} is the CPU backend's; the CUDA backend takes bf16 or fp8",
                           DTypeName(kv.dtype));
  }
  const ModelConfig& c = checkpoint.config();
  if (scales.empty()) scales = KvScales::Unit(static_cast<int>(c.num_hidden_layers));
  auto impl = std::make_unique<Impl>(c);
  impl->kv = kv;
  impl->scales = std::move(scales);
  impl->opt = options;
  for (const std::string& op : options.skip_ops) {
    if (std::find(std::begin(kSkippableOps), std::end(kSkippableOps), op) == std::end(kSkippableOps)) {
      return InvalidArgument("--skip-ops: unknown op '{}' (known: {})", op, fmt::join(kSkippableOps, ", "));
    }
  }
  DL_RETURN_IF_ERROR(impl->Init(checkpoint));
  return std::unique_ptr<CudaRunner>(new CudaRunner(std::move(impl)));
}

const KvCacheSpec& CudaRunner::kv_spec() const { return impl_->kv; }
const KvScales& CudaRunner::kv_scales() const { return impl_->scales; }
int CudaRunner::kernel_nodes() const { return impl_->kernel_nodes; }
const std::vector<std::string>& CudaRunner::layer_presets() const { return impl_->layer_presets; }
bool CudaRunner::fallback() const { return impl_->fallback; }

Status CudaRunner::Forward(const SequenceKv& seq, std::span<const int32_t> tokens, bool all_logits,
                           std::vector<float>* logits) {
  const int32_t T = static_cast<int32_t>(tokens.size());
  if (T == 0) return InvalidArgument("forward of zero tokens");
  DL_RETURN_IF_ERROR(impl_->StageInputs(seq, tokens));
  if (T == 1 && impl_->opt.use_graph) {
    if (!impl_->decode_graph.ready()) DL_RETURN_IF_ERROR(impl_->CaptureDecodeGraph());
    DL_RETURN_IF_ERROR(impl_->decode_graph.Launch(impl_->stream.get()));
  } else {
    DL_RETURN_IF_ERROR(impl_->Enqueue(T, all_logits));
  }
  return impl_->CopyLogits(all_logits ? T : 1, logits);
}

Result<int32_t> CudaRunner::DecodeArgmax(const SequenceKv& seq, int32_t token) {
  DL_RETURN_IF_ERROR(impl_->StageInputs(seq, std::span<const int32_t>(&token, 1)));
  cudaStream_t s = impl_->stream.get();
  if (kernels::TimelineBuilt()) {  // diagnostic builds: keep the stamps of the latest step only
    static const Status enabled = kernels::TimelineEnable(size_t{1} << 21);
    DL_RETURN_IF_ERROR(enabled);
    DL_RETURN_IF_ERROR(kernels::TimelineReset(s));
  }
  if (impl_->opt.use_graph) {
    if (!impl_->decode_graph.ready()) DL_RETURN_IF_ERROR(impl_->CaptureDecodeGraph());
    DL_RETURN_IF_ERROR(impl_->decode_graph.Launch(s));
  } else {
    DL_RETURN_IF_ERROR(impl_->Enqueue(1, false));
  }
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(impl_->host_argmax.as<int32_t>(), impl_->argmax.data(), 4,
                                          cudaMemcpyDeviceToHost, s));
  DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return impl_->host_argmax.as<int32_t>()[0];
}

Result<std::pair<std::vector<float>, std::vector<float>>> CudaRunner::KvPoolAbsMax() {
  if (impl_->kv.dtype != DType::kBF16) return FailedPrecondition("KvPoolAbsMax needs a BF16 cache");
  cudaStream_t s = impl_->stream.get();
  DL_ASSIGN_OR_RETURN(auto scratch, cuda::DeviceBuffer::Create(sizeof(float)));
  std::vector<float> k, v;
  for (auto& L : impl_->layers) {
    for (auto* which : {&L.k_pool, &L.v_pool}) {
      DL_RETURN_IF_ERROR(kernels::AbsMaxBf16(which->as<bf16>(), static_cast<int64_t>(which->size() / 2),
                                             scratch.as<float>(), s));
      float amax = 0;
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&amax, scratch.data(), 4, cudaMemcpyDeviceToHost, s));
      DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
      (which == &L.k_pool ? k : v).push_back(amax);
    }
  }
  return std::make_pair(k, v);
}

nlohmann::json CudaRunner::Describe() const {
  std::vector<std::string> unique = impl_->layer_presets;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  const int nodes = impl_->kernel_nodes;
  const kernels::FusedNormMode fused = impl_->FusedNorm();
  const kernels::DecodeExperiments& exp = kernels::Experiments();
  return {{"backend", "cuda"},
          {"device", impl_->device_name},
          {"kernel_presets", unique},
          {"layer_presets", impl_->layer_presets},
          {"fallback", impl_->fallback},
          {"fallback_ops", impl_->fallback_ops},
          {"topology",
           {{{"rank", 0},
             {"kernel_nodes", nodes},
             {"collectives", 0},
             {"signature", fmt::format("{}/0", nodes)}}}},
          {"kv_dtype", std::string(DTypeName(impl_->kv.dtype))},
          {"page_size", impl_->kv.page_size},
          {"graph", impl_->opt.use_graph},
          {"dependent_launch", kernels::DependentLaunchEnabled()},
          {"fused_norm", fused.name},
          // Measured on the last batch-1 forward (decode): "stream" folds it only where q/k/v/g streams.
          {"fused_norm_before_attention", impl_->decode_norms_in_qkvg > 0},
          {"fused_norm_before_mlp", fused.before_mlp},
          {"skipped_ops", impl_->opt.skip_ops},
          {"moe_variant", fmt::format("{},{}", exp.moe_gate_up_variant, exp.moe_down_variant)},
          {"oproj_stage_rows", std::to_string(exp.oproj_stage_rows)},
          {"moe_down_early", exp.moe_down_loads_early ? "1" : "0"},
          {"moe_gate_up_stream_kb", std::to_string(exp.moe_gate_up_stream_ring_kb)},
          {"moe_router_pointers", exp.moe_router_stages_pointers ? "1" : "0"},
          {"l2_prefetch", exp.l2_prefetch ? "1" : "0"},
          {"attention_cluster_max_chunks", std::to_string(exp.attention_cluster_max_chunks)},
          {"moe_router_bias", exp.moe_router_stages_bias ? "1" : "0"},
          {"late_release", kernels::LateReleaseList(exp.late_release)},
          {"stream_gemv", exp.stream_gemv ? fmt::format("ring {} KB, stage {} KB, prefetch {} KB (o_proj {} KB)",
                                                        exp.stream_ring_kb, exp.stream_stage_kb,
                                                        exp.stream_prefetch_kb, exp.oproj_prefetch_kb)
                                          : "0"}};
}

#else  // no CUDA backend in this build

struct CudaRunner::Impl {};
CudaRunner::CudaRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaRunner::~CudaRunner() = default;
Result<std::unique_ptr<CudaRunner>> CudaRunner::Create(const Checkpoint&, const KvCacheSpec&, KvScales,
                                                       const CudaRunnerOptions&) {
  return Unavailable("--backend cuda: this build of decodelab has no CUDA backend");
}
static const KvCacheSpec kNoSpec;
static const KvScales kNoScales;
static const std::vector<std::string> kNoPresets;
const KvCacheSpec& CudaRunner::kv_spec() const { return kNoSpec; }
const KvScales& CudaRunner::kv_scales() const { return kNoScales; }
Status CudaRunner::Forward(const SequenceKv&, std::span<const int32_t>, bool, std::vector<float>*) {
  return Unavailable("no CUDA backend in this build");
}
Result<int32_t> CudaRunner::DecodeArgmax(const SequenceKv&, int32_t) {
  return Unavailable("no CUDA backend in this build");
}
Result<std::pair<std::vector<float>, std::vector<float>>> CudaRunner::KvPoolAbsMax() {
  return Unavailable("no CUDA backend in this build");
}
nlohmann::json CudaRunner::Describe() const { return {{"backend", "cuda"}, {"available", false}}; }
int CudaRunner::kernel_nodes() const { return 0; }
const std::vector<std::string>& CudaRunner::layer_presets() const { return kNoPresets; }
bool CudaRunner::fallback() const { return false; }

#endif

}  // namespace dl
