#include "backend/cuda_dflash.h"

#if defined(DECODELAB_HAVE_CUDA)

#include <cuda_runtime.h>

#include <algorithm>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/dtype.h"
#include "backend/cuda_weights.h"
#include "cuda/buffer.h"
#include "cuda/check.h"
#include "kernels/attention/attention.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/sampling.h"
#include "model/config.h"

namespace dl {

using kernels::bf16;

namespace {

// The drafter's page sizes, in order of preference: the first whose preset every layer has.
constexpr int32_t kDraftPageSizes[] = {32, 16, 64};

}  // namespace

struct CudaDflashRunner::Impl final : DflashOps {
  const DflashConfig& cfg;
  CudaDflashOptions opt;
  WeightRef target_embed;
  LinearWeights target_lm_head;
  cuda::Stream stream;
  std::vector<cuda::DeviceBuffer> weight_buffers;
  DflashWeights w;  // the drafter's tensors, data on the device (BF16)

  // Geometry.
  int d = 0, taps = 0, H = 0, K = 0, D = 0, B = 0, F = 0, V = 0, qkvg_w = 0, kvw = 0;
  int32_t page = 32;
  int32_t pages_per_slot = 0;  // a sequence's pages (ring when every layer is sliding)
  int32_t table_entries = 0;   // block-table entries per sequence: positions up to max_seq_len + B
  bool ring = false;
  std::vector<kernels::AttentionKernel> attn;  // per draft layer
  cuda::DeviceBuffer inv_freq;
  int rotary_dim = 0;

  // The paged context cache: per layer a K and a V pool of slots * pages_per_slot pages of
  // [P, K, D] BF16; sequence slot s owns pages [s * pages_per_slot, (s + 1) * pages_per_slot).
  int32_t slots = 0;
  std::vector<cuda::DeviceBuffer> k_pools, v_pools;
  cuda::DeviceBuffer tables;  // [slots, table_entries]
  struct Seq {
    int32_t slot = 0;
    int32_t length = 0;
  };
  std::unordered_map<uint64_t, Seq> seqs;
  std::vector<int32_t> free_slots;

  // Activations and inputs of one Run, grown on demand (contents are per Run).
  struct Grown {
    cuda::DeviceBuffer buf;
    template <typename T>
    Result<T*> Get(size_t count) {
      const size_t bytes = std::max<size_t>(count, 1) * sizeof(T);
      if (buf.size() < bytes) {
        buf.Reset();
        DL_ASSIGN_OR_RETURN(buf, cuda::DeviceBuffer::Create(bytes + bytes / 2));
      }
      return buf.as<T>();
    }
  };
  enum Buf : int {
    kTapsF32, kTaps, kContext, kContextNormed, kContextKv, kResidual, kNormed, kQkvg, kQ, kAttn, kDelta, kGateUp,
    kHidden, kOutNormed, kLogits, kLogitsF32, kInputs, kTokens, kSampling, kScratch, kAttnWs, kBufCount
  };
  Grown grown[kBufCount];
  cuda::DeviceBuffer attn_counters;  // zero; the kernels leave them zero
  size_t attn_counter_words = 0;

  // The Run in progress.
  const DraftBatch* batch = nullptr;
  int32_t C = 0, N = 0, R = 0;
  std::vector<int32_t> ctx_first_row;  // per context: its first row of the C rows
  bf16* acts[static_cast<int>(DraftAct::kLogits) + 1] = {};
  bf16*& act(DraftAct a) { return acts[static_cast<int>(a)]; }
  int32_t* ids = nullptr;        // [N]
  int32_t* positions = nullptr;  // [N] RoPE positions s + j
  int32_t* mask_positions = nullptr;  // [N] attention's query positions (s + B - 1 for bidirectional layers)
  int32_t* token_seq = nullptr;  // [N] slot of each block row
  int32_t* out_rows = nullptr;   // [R]
  int32_t* tokens = nullptr;     // [R] then [R] non-finite flags
  bool keep_logits = false;
  std::vector<float> kept_logits;

  Impl(const DflashConfig& c, const CudaDflashOptions& o) : cfg(c), opt(o) {}
  cudaStream_t s() const { return stream.get(); }

  Status Init(const DflashCheckpoint& ck);
  Status UploadWeights(const DflashCheckpoint& ck);
  Status ResolveAttention();
  Status SlotFor(uint64_t seq, Seq** out);
  Status GrowSlots();
  Status Run(const DraftBatch& b, std::vector<std::vector<int32_t>>* out);
  int32_t RowsOf(DraftAct a) const {
    switch (a) {
      case DraftAct::kTaps:
      case DraftAct::kContext:
      case DraftAct::kContextNormed:
      case DraftAct::kContextKv: return C;
      case DraftAct::kOutputNormed:
      case DraftAct::kLogits: return R;
      default: return N;
    }
  }

  // DflashOps.
  Status NormTapSlices(std::span<const WeightRef> weights) override;
  Status RmsNorm(const WeightRef& weight, DraftAct in, DraftAct out) override;
  Status Linear(const LinearWeights& lw, DraftAct in, DraftAct out) override;
  Status AppendContextKv(int32_t layer, const WeightRef& k_norm) override;
  Status Embed(const WeightRef& table) override;
  Status AddRmsNorm(const WeightRef& weight, bool add_delta) override;
  Status BlockAttention(int32_t layer, const WeightRef& q_norm, const WeightRef& k_norm) override;
  Status SiluMul() override;
  Status OutputNorm(const WeightRef& weight) override;
  Status SelectTokens() override;
};

Status CudaDflashRunner::Impl::UploadWeights(const DflashCheckpoint& ck) {
  std::vector<uint16_t> staging;
  auto upload = [&](TensorView& t) -> Status {
    if (t.empty()) return Status::Ok();  // absent (the z-lab family's gate, aux norms)
    if (t.dtype == DType::kF8E4M3) {
      return Unimplemented("DFlash drafter on CUDA: {} is FP8; the drafter's weights must be BF16, F16 or F32", t.name);
    }
    DL_ASSIGN_OR_RETURN(cuda::DeviceBuffer buf, cuda::DeviceBuffer::Create(static_cast<size_t>(t.numel()) * 2));
    if (t.dtype == DType::kBF16) {
      DL_RETURN_IF_ERROR(buf.CopyFromHost(t.data, static_cast<size_t>(t.numel()) * 2).WithContext(t.name));
    } else {
      staging.resize(static_cast<size_t>(t.numel()));
      for (int64_t i = 0; i < t.numel(); ++i) staging[static_cast<size_t>(i)] = FloatToBf16(t.at(i));
      DL_RETURN_IF_ERROR(buf.CopyFromHost(staging.data(), staging.size() * 2).WithContext(t.name));
    }
    t.data = buf.data();
    t.dtype = DType::kBF16;
    weight_buffers.push_back(std::move(buf));
    return Status::Ok();
  };
  w = ck.weights();
  DL_RETURN_IF_ERROR(upload(w.fc));
  DL_RETURN_IF_ERROR(upload(w.hidden_norm));
  DL_RETURN_IF_ERROR(upload(w.norm));
  for (TensorView& t : w.aux_norms) DL_RETURN_IF_ERROR(upload(t));
  for (DflashLayerWeights& L : w.layers) {
    for (TensorView* t : {&L.input_norm, &L.post_attn_norm, &L.q, &L.k, &L.v, &L.g, &L.o, &L.q_norm, &L.k_norm,
                          &L.gate, &L.up, &L.down}) {
      DL_RETURN_IF_ERROR(upload(*t));
    }
  }
  return Status::Ok();
}

Status CudaDflashRunner::Impl::ResolveAttention() {
  auto key_for = [&](int64_t l, int32_t p) {
    kernels::AttnPresetKey key;
    key.head_dim = D;
    key.group = H / K;
    key.page_size = p;
    key.kv_dtype = kernels::KvDtype::kBf16;
    key.window = cfg.layer_types[l] == LayerType::kSliding ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
    return key;
  };
  // The first page size whose preset every layer has; else, with allow_fallback, the generic kernel.
  std::string missing;
  for (int32_t p : kDraftPageSizes) {
    std::vector<kernels::AttentionKernel> found;
    missing.clear();
    for (int64_t l = 0; l < cfg.num_hidden_layers && missing.empty(); ++l) {
      auto k = kernels::ResolveAttention(key_for(l, p), /*allow_fallback=*/false);
      if (k.ok()) {
        found.push_back(*k);
      } else {
        missing = kernels::CanonicalName(key_for(l, p));
      }
    }
    if (missing.empty()) {
      page = p;
      attn = std::move(found);
      return Status::Ok();
    }
  }
  if (!opt.allow_fallback) {
    return NotFound("DFlash drafter on CUDA: no built attention preset serves its layers (e.g. {}; built: {}); "
                    "--allow-fallback runs the generic kernel", missing, fmt::join(kernels::BuiltPresetNames(), ", "));
  }
  page = kDraftPageSizes[0];
  attn.clear();
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    DL_ASSIGN_OR_RETURN(kernels::AttentionKernel k, kernels::ResolveAttention(key_for(l, page), true));
    attn.push_back(k);
  }
  return Status::Ok();
}

Status CudaDflashRunner::Impl::Init(const DflashCheckpoint& ck) {
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(opt.device));
  d = static_cast<int>(cfg.hidden_size);
  taps = static_cast<int>(cfg.num_taps());
  H = static_cast<int>(cfg.num_attention_heads);
  K = static_cast<int>(cfg.num_key_value_heads);
  D = static_cast<int>(cfg.head_dim);
  B = static_cast<int>(cfg.block_size);
  F = static_cast<int>(cfg.intermediate_size);
  V = static_cast<int>(target_embed.rows());
  qkvg_w = static_cast<int>(cfg.qkvg_width());
  kvw = static_cast<int>(cfg.kv_width());
  if (K < 1 || H % K != 0) return InvalidArgument("DFlash drafter on CUDA: {} query heads over {} KV heads", H, K);
  if (d % 8 != 0 || F % 8 != 0 || D % 8 != 0) {
    return Unimplemented("DFlash drafter on CUDA: widths must be multiples of 8 (hidden {}, FFN {}, head {})", d, F, D);
  }
  bool all_sliding = true;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const bool sliding = cfg.layer_types[l] == LayerType::kSliding;
    all_sliding = all_sliding && sliding;
    if (sliding && !cfg.block_causal[l]) {
      return Unimplemented("DFlash drafter on CUDA: layer {} is sliding with a bidirectional block (each block row "
                           "would need its own window); the CPU reference drafter runs it", l);
    }
  }
  DL_ASSIGN_OR_RETURN(stream, cuda::Stream::Create());
  DL_RETURN_IF_ERROR(UploadWeights(ck));
  DL_RETURN_IF_ERROR(ResolveAttention());
  // A ring of whole pages per sequence: the keys a block row may see (window) plus the block's own
  // scratch rows, so writing positions s..s+B-1 never overwrites a key in any block row's window.
  const int32_t positions = opt.max_seq_len + B;
  ring = all_sliding && cfg.sliding_window + B < positions;
  pages_per_slot = ring ? static_cast<int32_t>((cfg.sliding_window + B + page - 1) / page) + 1
                        : (positions + page - 1) / page;
  table_entries = (positions + page - 1) / page;
  RopeParams rp;
  rp.rope_type = "default";
  rp.theta = cfg.rope_theta;
  rp.partial_rotary_factor = cfg.partial_rotary_factor;
  const RopeTable table = ComputeRopeTable(rp, cfg.head_dim);
  rotary_dim = static_cast<int>(2 * table.inv_freq.size());
  DL_ASSIGN_OR_RETURN(inv_freq, cuda::DeviceBuffer::Create(std::max<size_t>(1, table.inv_freq.size()) * 4));
  if (!table.inv_freq.empty()) DL_RETURN_IF_ERROR(inv_freq.CopyFromHost(table.inv_freq.data(), table.inv_freq.size() * 4));
  k_pools.resize(static_cast<size_t>(cfg.num_hidden_layers));
  v_pools.resize(static_cast<size_t>(cfg.num_hidden_layers));
  return Status::Ok();
}

// Doubles the slots: new pools (the old pages copied to the same place), new tables.
Status CudaDflashRunner::Impl::GrowSlots() {
  const int32_t grown_slots = std::max(4, 2 * slots);
  const size_t page_bytes = static_cast<size_t>(page) * K * D * 2;
  const size_t old_bytes = static_cast<size_t>(slots) * pages_per_slot * page_bytes;
  const size_t new_bytes = static_cast<size_t>(grown_slots) * pages_per_slot * page_bytes;
  for (auto* pools : {&k_pools, &v_pools}) {
    for (cuda::DeviceBuffer& pool : *pools) {
      DL_ASSIGN_OR_RETURN(cuda::DeviceBuffer bigger, cuda::DeviceBuffer::Create(new_bytes));
      if (old_bytes > 0) {
        DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(bigger.data(), pool.data(), old_bytes, cudaMemcpyDeviceToDevice, s()));
      }
      DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s()));
      pool = std::move(bigger);
    }
  }
  std::vector<int32_t> host(static_cast<size_t>(grown_slots) * table_entries);
  for (int32_t slot = 0; slot < grown_slots; ++slot) {
    for (int32_t i = 0; i < table_entries; ++i) {
      host[static_cast<size_t>(slot) * table_entries + i] = slot * pages_per_slot + i % pages_per_slot;
    }
  }
  DL_ASSIGN_OR_RETURN(tables, cuda::DeviceBuffer::Create(host.size() * 4));
  DL_RETURN_IF_ERROR(tables.CopyFromHost(host.data(), host.size() * 4));
  for (int32_t slot = grown_slots - 1; slot >= slots; --slot) free_slots.push_back(slot);
  slots = grown_slots;
  return Status::Ok();
}

Status CudaDflashRunner::Impl::SlotFor(uint64_t seq, Seq** out) {
  auto it = seqs.find(seq);
  if (it == seqs.end()) {
    if (free_slots.empty()) DL_RETURN_IF_ERROR(GrowSlots());
    Seq fresh;
    fresh.slot = free_slots.back();
    free_slots.pop_back();
    it = seqs.emplace(seq, fresh).first;
  }
  *out = &it->second;
  return Status::Ok();
}

Status CudaDflashRunner::Impl::Run(const DraftBatch& b, std::vector<std::vector<int32_t>>* out) {
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(opt.device));
  auto length_of = [&](uint64_t seq) {
    auto it = seqs.find(seq);
    return it == seqs.end() ? 0 : it->second.length;
  };
  // The checks of the CPU reference (CpuDflashRunner::Run), plus the positions the cache holds.
  C = 0;
  ctx_first_row.clear();
  for (const auto& c : b.contexts) {
    if (c.first_position != length_of(c.seq)) {
      return FailedPrecondition("DFlash drafter: context rows of sequence {} start at position {} but its drafter "
                                "cache holds {} positions", c.seq, c.first_position, length_of(c.seq));
    }
    if (c.num_rows < 0 || c.first_position + c.num_rows > opt.max_seq_len) {
      return InvalidArgument("DFlash drafter: context rows {}..{} of sequence {} beyond the {} positions it was sized for",
                             c.first_position, c.first_position + c.num_rows - 1, c.seq, opt.max_seq_len);
    }
    ctx_first_row.push_back(C);
    C += c.num_rows;
  }
  if (static_cast<int64_t>(b.taps.size()) != static_cast<int64_t>(C) * taps * d) {
    return Internal("DFlash drafter: {} tap floats for {} context rows of {} x {}", b.taps.size(), C, taps, d);
  }
  batch = &b;
  cudaStream_t st = s();
  if (C > 0) {
    for (const auto& c : b.contexts) {
      Seq* sq = nullptr;
      DL_RETURN_IF_ERROR(SlotFor(c.seq, &sq));
    }
    const size_t n = static_cast<size_t>(C) * taps * d;
    DL_ASSIGN_OR_RETURN(float* taps_f32, grown[kTapsF32].Get<float>(n));
    DL_ASSIGN_OR_RETURN(act(DraftAct::kTaps), grown[kTaps].Get<bf16>(n));
    DL_ASSIGN_OR_RETURN(act(DraftAct::kContext), grown[kContext].Get<bf16>(static_cast<size_t>(C) * d));
    DL_ASSIGN_OR_RETURN(act(DraftAct::kContextNormed),
                        grown[kContextNormed].Get<bf16>(static_cast<size_t>(C) * d));
    DL_ASSIGN_OR_RETURN(act(DraftAct::kContextKv),
                        grown[kContextKv].Get<bf16>(static_cast<size_t>(C) * 2 * kvw));
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(taps_f32, b.taps.data(), n * 4, cudaMemcpyHostToDevice, st));
    DL_RETURN_IF_ERROR(kernels::F32ToBf16(taps_f32, act(DraftAct::kTaps), static_cast<int64_t>(n), st));
    DL_RETURN_IF_ERROR(DflashContextForward(cfg, w, b, *this));
    for (const auto& c : b.contexts) seqs[c.seq].length = c.first_position + c.num_rows;
  }
  // Blocks.
  N = 0, R = 0;
  for (const auto& blk : b.blocks) {
    if (blk.position != length_of(blk.seq)) {
      return FailedPrecondition("DFlash drafter: block of sequence {} at position {} but its drafter cache holds {} "
                                "positions (context rows missing)", blk.seq, blk.position, length_of(blk.seq));
    }
    if (blk.num_outputs < 0 || blk.num_outputs >= cfg.block_size) {
      return InvalidArgument("DFlash drafter: {} drafts asked of a block of {}", blk.num_outputs, cfg.block_size);
    }
    if (blk.position >= opt.max_seq_len) {
      return InvalidArgument("DFlash drafter: a block at position {} beyond the {} positions it was sized for",
                             blk.position, opt.max_seq_len);
    }
    if (blk.anchor < 0 || blk.anchor >= V) {
      return InvalidArgument("DFlash block token {} outside the target's table", blk.anchor);
    }
    N += B;
    R += blk.num_outputs;
  }
  out->assign(b.blocks.size(), {});
  if (N == 0) return Status::Ok();
  // Inputs [N] ids, positions, mask positions, slots; [R] output rows: one copy.
  std::vector<int32_t> in(static_cast<size_t>(4 * N + std::max(R, 1)), 0);
  int32_t row = 0, o = 0;
  for (const auto& blk : b.blocks) {
    Seq* sq = nullptr;
    DL_RETURN_IF_ERROR(SlotFor(blk.seq, &sq));
    for (int32_t j = 0; j < B; ++j, ++row) {
      in[row] = j == 0 ? blk.anchor : static_cast<int32_t>(cfg.mask_token_id);
      in[N + row] = blk.position + j;
      in[2 * N + row] = blk.position + B - 1;
      in[3 * N + row] = sq->slot;
      if (j >= 1 && j <= blk.num_outputs) in[4 * N + o++] = row;
    }
  }
  DL_ASSIGN_OR_RETURN(int32_t* inputs, grown[kInputs].Get<int32_t>(in.size()));
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(inputs, in.data(), in.size() * 4, cudaMemcpyHostToDevice, st));
  ids = inputs, positions = inputs + N, mask_positions = inputs + 2 * N, token_seq = inputs + 3 * N;
  out_rows = inputs + 4 * N;
  const size_t n = static_cast<size_t>(N);
  DL_RETURN_IF_ERROR(grown[kResidual].Get<bf16>(n * d).status());
  DL_ASSIGN_OR_RETURN(act(DraftAct::kNormed), grown[kNormed].Get<bf16>(n * d));
  DL_ASSIGN_OR_RETURN(act(DraftAct::kQkvg), grown[kQkvg].Get<bf16>(n * qkvg_w));
  DL_RETURN_IF_ERROR(grown[kQ].Get<bf16>(n * H * D).status());
  DL_ASSIGN_OR_RETURN(act(DraftAct::kAttention), grown[kAttn].Get<bf16>(n * H * D));
  DL_ASSIGN_OR_RETURN(act(DraftAct::kDelta), grown[kDelta].Get<bf16>(n * d));
  DL_ASSIGN_OR_RETURN(act(DraftAct::kGateUp), grown[kGateUp].Get<bf16>(n * 2 * F));
  DL_ASSIGN_OR_RETURN(act(DraftAct::kHidden), grown[kHidden].Get<bf16>(n * F));
  DL_ASSIGN_OR_RETURN(act(DraftAct::kOutputNormed),
                      grown[kOutNormed].Get<bf16>(static_cast<size_t>(R) * d));
  DL_ASSIGN_OR_RETURN(act(DraftAct::kLogits), grown[kLogits].Get<bf16>(static_cast<size_t>(R) * V));
  DL_ASSIGN_OR_RETURN(tokens, grown[kTokens].Get<int32_t>(2 * static_cast<size_t>(std::max(R, 1))));
  DL_RETURN_IF_ERROR(DflashBlockForward(cfg, w, target_embed, target_lm_head, b, *this));
  std::vector<int32_t> selected(static_cast<size_t>(R));
  if (R > 0) {
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(selected.data(), tokens, static_cast<size_t>(R) * 4, cudaMemcpyDeviceToHost, st));
  }
  if (keep_logits && R > 0) {
    const size_t nl = static_cast<size_t>(R) * V;
    DL_ASSIGN_OR_RETURN(float* f32, grown[kLogitsF32].Get<float>(nl));
    DL_RETURN_IF_ERROR(kernels::Bf16ToF32(act(DraftAct::kLogits), f32, static_cast<int64_t>(nl), st));
    kept_logits.resize(nl);
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(kept_logits.data(), f32, nl * 4, cudaMemcpyDeviceToHost, st));
  }
  DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st));
  size_t k = 0;
  for (size_t i = 0; i < b.blocks.size(); ++i) {
    for (int32_t j = 0; j < b.blocks[i].num_outputs; ++j) (*out)[i].push_back(selected[k++]);
  }
  return Status::Ok();
}

Status CudaDflashRunner::Impl::NormTapSlices(std::span<const WeightRef> weights) {
  bf16* t = act(DraftAct::kTaps);
  for (size_t i = 0; i < weights.size(); ++i) {
    kernels::AddRmsNormParams p;
    p.residual = t + i * d;
    p.weight = DeviceBf16(weights[i]);
    p.out = t + i * d;
    p.rows = C;
    p.n = d;
    p.row_stride = static_cast<int64_t>(taps) * d;
    p.eps = static_cast<float>(cfg.rms_norm_eps);
    DL_RETURN_IF_ERROR(kernels::AddRmsNorm(p, s()).WithContext(weights[i].name));
  }
  return Status::Ok();
}

Status CudaDflashRunner::Impl::RmsNorm(const WeightRef& weight, DraftAct in, DraftAct out) {
  kernels::AddRmsNormParams p;
  p.residual = act(in);
  p.weight = DeviceBf16(weight);
  p.out = act(out);
  p.rows = RowsOf(in);
  p.n = d;
  p.eps = static_cast<float>(cfg.rms_norm_eps);
  return kernels::AddRmsNorm(p, s()).WithContext(weight.name);
}

Status CudaDflashRunner::Impl::Linear(const LinearWeights& lw, DraftAct in, DraftAct out) {
  const int32_t rows = RowsOf(in);
  if (rows == 0) return Status::Ok();
  const int64_t total_out = lw.out();
  int64_t row0 = 0;
  for (const WeightRef& W : lw.parts) {
    kernels::GemvParams p;
    const bool fp8 = IsFp8(W);
    if (fp8) {
      p.w_fp8 = Fp8Of(W);
    } else {
      p.w = DeviceBf16(W);
    }
    p.out = static_cast<int>(W.rows());
    p.in = static_cast<int>(W.cols());
    p.x = act(in);
    p.y = act(out) + row0;
    p.y_stride = total_out;
    p.num_tokens = rows;
    // Every row count on the tensor-core product (BF16 weights): a block's 16 rows are byte-bound there,
    // where the CUDA-core batched GEMV is bound by its FMAs. The drafter's bits never reach the output,
    // so it needs no class of its own. FP8 weights (the target's LM head) take the FP8 kernels.
    p.mma = !fp8;
    p.mma_tiled_min_tokens = opt.tuning.mma_tiled_min_tokens;
    p.batch_rows = rows <= 8 ? 2 : 4;
    DL_RETURN_IF_ERROR(kernels::Gemv(p, s()).WithContext(W.name));
    row0 += W.rows();
  }
  return Status::Ok();
}

Status CudaDflashRunner::Impl::AppendContextKv(int32_t layer, const WeightRef& k_norm) {
  const bf16* kv = act(DraftAct::kContextKv);
  const int32_t ring_positions = pages_per_slot * page;
  for (size_t i = 0; i < batch->contexts.size(); ++i) {
    const auto& c = batch->contexts[i];
    if (c.num_rows == 0) continue;
    // In a ring only the last ring_positions rows can be held, and two rows of one launch must
    // never share a slot: older rows are left out (no block will see them).
    const int32_t skip = ring ? std::max(0, c.num_rows - ring_positions) : 0;
    kernels::QkNormRopeAppendParams p;
    p.k = kv + static_cast<size_t>(ctx_first_row[i] + skip) * 2 * kvw;
    p.v = p.k + kvw;
    p.qkv_stride = 2 * kvw;
    p.k_norm_weight = DeviceBf16(k_norm);
    p.inv_freq = inv_freq.as<float>();
    p.rotary_dim = rotary_dim;
    p.eps = static_cast<float>(cfg.rms_norm_eps);
    p.first_position = c.first_position + skip;
    p.num_tokens = c.num_rows - skip;
    p.num_q_heads = 0;
    p.num_kv_heads = K;
    p.head_dim = D;
    p.k_pool = k_pools[layer].data();
    p.v_pool = v_pools[layer].data();
    p.kv_dtype = kernels::KvDtype::kBf16;
    p.block_table = tables.as<int32_t>() + static_cast<size_t>(seqs[c.seq].slot) * table_entries;
    p.page_size = page;
    p.prefetch_constants = false;
    DL_RETURN_IF_ERROR(kernels::QkNormRopeAppend(p, s()).WithContext(fmt::format("draft layer {} context", layer)));
  }
  return Status::Ok();
}

Status CudaDflashRunner::Impl::Embed(const WeightRef& table) {
  kernels::EmbedParams p{DeviceBf16(table), ids, grown[kResidual].buf.as<bf16>(), N, d, V};
  return kernels::EmbedLookup(p, s());
}

Status CudaDflashRunner::Impl::AddRmsNorm(const WeightRef& weight, bool add_delta) {
  kernels::AddRmsNormParams p;
  p.residual = grown[kResidual].buf.as<bf16>();
  p.delta = add_delta ? act(DraftAct::kDelta) : nullptr;
  p.weight = DeviceBf16(weight);
  p.out = act(DraftAct::kNormed);
  p.rows = N;
  p.n = d;
  p.eps = static_cast<float>(cfg.rms_norm_eps);
  return kernels::AddRmsNorm(p, s()).WithContext(weight.name);
}

Status CudaDflashRunner::Impl::BlockAttention(int32_t layer, const WeightRef& q_norm, const WeightRef& k_norm) {
  const bf16* qkvg = act(DraftAct::kQkvg);
  bf16* q = grown[kQ].buf.as<bf16>();
  // q/k norms and RoPE at s + j; the block's k and v into its sequence's pages at s..s+B-1 (scratch).
  kernels::QkNormRopeAppendParams rp;
  rp.q = qkvg;
  rp.k = qkvg + static_cast<size_t>(H) * D;
  rp.v = rp.k + kvw;
  rp.qkv_stride = qkvg_w;
  rp.q_norm_weight = DeviceBf16(q_norm);
  rp.k_norm_weight = DeviceBf16(k_norm);
  rp.inv_freq = inv_freq.as<float>();
  rp.rotary_dim = rotary_dim;
  rp.eps = static_cast<float>(cfg.rms_norm_eps);
  rp.positions = positions;
  rp.num_tokens = N;
  rp.num_q_heads = H;
  rp.num_kv_heads = K;
  rp.head_dim = D;
  rp.q_out = q;
  rp.k_pool = k_pools[layer].data();
  rp.v_pool = v_pools[layer].data();
  rp.kv_dtype = kernels::KvDtype::kBf16;
  rp.block_table = tables.as<int32_t>();
  rp.token_seq = token_seq;
  rp.block_table_stride = table_entries;
  rp.page_size = page;
  rp.prefetch_constants = false;
  DL_RETURN_IF_ERROR(kernels::QkNormRopeAppend(rp, s()).WithContext(fmt::format("draft layer {} block", layer)));
  kernels::AttentionParams ap;
  ap.q = q;
  ap.k_pool = k_pools[layer].data();
  ap.v_pool = v_pools[layer].data();
  ap.block_table = tables.as<int32_t>();
  ap.token_seq = token_seq;
  ap.block_table_stride = table_entries;
  // Causal: a row sees the context and the block rows up to its own position; bidirectional: every
  // block row (the mask position of each is the block's last).
  ap.positions = cfg.block_causal[layer] ? positions : mask_positions;
  ap.max_position = opt.max_seq_len + B - 1;
  ap.num_tokens = N;
  ap.num_q_heads = H;
  ap.num_kv_heads = K;
  ap.head_dim = D;
  ap.page_size = page;
  ap.kv_dtype = kernels::KvDtype::kBf16;
  const bool sliding = cfg.layer_types[layer] == LayerType::kSliding;
  ap.window_kind = sliding ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
  ap.window = static_cast<int>(cfg.sliding_window);
  if (cfg.per_head_gate) {
    ap.gate = qkvg + static_cast<size_t>(H) * D + 2 * static_cast<size_t>(kvw);
    ap.gate_stride = qkvg_w;
  }
  ap.out = act(DraftAct::kAttention);
  ap.cluster_max_chunks = opt.tuning.attention_cluster_max_chunks;
  ap.multi_row_min_tokens = opt.tuning.attention_multi_row_min_tokens;
  const size_t ws_bytes = kernels::AttentionWorkspaceBytes(ap);
  DL_ASSIGN_OR_RETURN(char* ws, grown[kAttnWs].Get<char>(ws_bytes));
  ap.workspace = ws;
  ap.workspace_bytes = grown[kAttnWs].buf.size();
  const size_t words = static_cast<size_t>(N) * K;
  if (attn_counter_words < words) {
    attn_counters.Reset();
    DL_ASSIGN_OR_RETURN(attn_counters, cuda::DeviceBuffer::Create(words * 4));
    DL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(attn_counters.data(), 0, words * 4, s()));
    attn_counter_words = words;
  }
  ap.counters = attn_counters.as<uint32_t>();
  return kernels::RunAttention(attn[static_cast<size_t>(layer)], ap, s(), kernels::AttnKind::kDecode)
      .WithContext(fmt::format("draft layer {} attention", layer));
}

Status CudaDflashRunner::Impl::SiluMul() {
  return kernels::SiluMul({act(DraftAct::kGateUp), act(DraftAct::kHidden), N, F}, s());
}

Status CudaDflashRunner::Impl::OutputNorm(const WeightRef& weight) {
  DL_RETURN_IF_ERROR(AddRmsNorm(weight, /*add_delta=*/true));
  if (R == 0) return Status::Ok();
  return kernels::GatherRows(
      {act(DraftAct::kNormed), out_rows, act(DraftAct::kOutputNormed), R, d}, s());
}

Status CudaDflashRunner::Impl::SelectTokens() {
  if (R == 0) return Status::Ok();
  // Every row at temperature 0 (all-zero parameters): argmax, lowest id on ties (kernels/sampling.h).
  DL_ASSIGN_OR_RETURN(kernels::DeviceRowSampling* params, grown[kSampling].Get<kernels::DeviceRowSampling>(R));
  DL_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(params, 0, sizeof(kernels::DeviceRowSampling) * R, s()));
  DL_ASSIGN_OR_RETURN(float* scratch, grown[kScratch].Get<float>(static_cast<size_t>(R) * 2 * V));
  kernels::SampleRowsParams sp;
  sp.logits = act(DraftAct::kLogits);
  sp.rows = R;
  sp.vocab = V;
  sp.params = params;
  sp.tokens = tokens;
  sp.nonfinite = tokens + R;
  sp.scratch = scratch;
  return kernels::SampleRows(sp, s());
}

// ---- CudaDflashRunner --------------------------------------------------------------------------

CudaDflashRunner::CudaDflashRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaDflashRunner::~CudaDflashRunner() = default;

Result<std::unique_ptr<CudaDflashRunner>> CudaDflashRunner::Create(const DflashCheckpoint& drafter,
                                                                   WeightRef target_embed,
                                                                   LinearWeights target_lm_head,
                                                                   const CudaDflashOptions& options) {
  auto impl = std::make_unique<Impl>(drafter.config(), options);
  impl->target_embed = std::move(target_embed);
  impl->target_lm_head = std::move(target_lm_head);
  if (impl->target_embed.data == nullptr || impl->target_lm_head.parts.empty()) {
    return InvalidArgument("DFlash drafter on CUDA: the target's device embedding and LM head must be set");
  }
  if (impl->target_embed.dtype != DType::kBF16) {
    return Unimplemented("DFlash drafter on CUDA: the target's embedding is {}, BF16 expected",
                         DTypeName(impl->target_embed.dtype));
  }
  DL_RETURN_IF_ERROR(impl->Init(drafter));
  return std::unique_ptr<CudaDflashRunner>(new CudaDflashRunner(std::move(impl)));
}

Status CudaDflashRunner::Run(const DraftBatch& batch, std::vector<std::vector<int32_t>>* tokens) {
  Status st = impl_->Run(batch, tokens);
  impl_->batch = nullptr;
  return st;
}

int32_t CudaDflashRunner::length(uint64_t seq) const {
  auto it = impl_->seqs.find(seq);
  return it == impl_->seqs.end() ? 0 : it->second.length;
}

void CudaDflashRunner::Forget(uint64_t seq) {
  auto it = impl_->seqs.find(seq);
  if (it == impl_->seqs.end()) return;
  impl_->free_slots.push_back(it->second.slot);
  impl_->seqs.erase(it);
}

size_t CudaDflashRunner::num_sequences() const { return impl_->seqs.size(); }
std::string CudaDflashRunner::where() const { return "cuda"; }
void CudaDflashRunner::set_keep_logits(bool keep) { impl_->keep_logits = keep; }
const std::vector<float>& CudaDflashRunner::last_logits() const { return impl_->kept_logits; }

}  // namespace dl

#else  // !DECODELAB_HAVE_CUDA

namespace dl {

struct CudaDflashRunner::Impl {};
CudaDflashRunner::CudaDflashRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaDflashRunner::~CudaDflashRunner() = default;
Result<std::unique_ptr<CudaDflashRunner>> CudaDflashRunner::Create(const DflashCheckpoint&, WeightRef, LinearWeights,
                                                                   const CudaDflashOptions&) {
  return Unavailable("no CUDA backend in this build");
}
Status CudaDflashRunner::Run(const DraftBatch&, std::vector<std::vector<int32_t>>*) {
  return Unavailable("no CUDA backend in this build");
}
int32_t CudaDflashRunner::length(uint64_t) const { return 0; }
void CudaDflashRunner::Forget(uint64_t) {}
size_t CudaDflashRunner::num_sequences() const { return 0; }
std::string CudaDflashRunner::where() const { return "cuda"; }
void CudaDflashRunner::set_keep_logits(bool) {}
const std::vector<float>& CudaDflashRunner::last_logits() const {
  static const std::vector<float> none;
  return none;
}

}  // namespace dl

#endif
