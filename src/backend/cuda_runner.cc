#include "backend/cuda_runner.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "backend/cuda_dflash.h"
#include "backend/cuda_graphs.h"
#include "backend/cuda_tp_runner.h"
#include "backend/cuda_weights.h"
#include "backend/cuda_workspace.h"
#include "comm/device_communicator.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "kernels/attention/attention.h"
#include "kernels/elementwise.h"
#include "kernels/ops.h"
#include "kernels/sampling.h"
#include "kernels/timeline.h"
#include "model/backend_support.h"
#include "model/laguna_forward.h"
#include "model/weight_shard.h"
#endif

namespace dl {

#if defined(DECODELAB_HAVE_CUDA)

using kernels::bf16;
using kernels::LateRelease;

namespace {

// A layer's KV pools and attention kernel. Each pool has one page more than the cache hands out: the
// page padding rows write (GraphCache).
struct LayerCache {
  cuda::DeviceBuffer k_pool, v_pool;
  kernels::AttentionKernel attn;
  int32_t trash_page = 0;
  bool sliding = false;
};

}  // namespace

struct CudaRunner::Impl final : LagunaOps {
  // The model as this runner computes it: the whole model, or a tensor-parallel rank's part of it
  // (RankModelConfig: its heads and widths; the vocabulary stays whole).
  const ModelConfig cfg;
  // Tensor parallelism (tp_size 1: none). The rank's LM head writes its vocabulary slice of each
  // output row into local_logits [R, vocab_stride] (the largest slice, so every rank's block has one
  // shape for the all-gather); SelectTokens gathers the blocks [tp, R, vocab_stride] into
  // gathered_logits and copies each rank's columns into place in ws.logits [R, V].
  int tp_size = 1, rank = 0;
  comm::DeviceCommunicator* comm = nullptr;
  std::vector<Slice> vocab_slices;  // [tp]: every rank's LM head rows
  // The embedding rows this rank holds: the whole table (replicated, and tp 1) or its vocab-parallel
  // slice, whose lookup the forward's AllReduce(kEmbedding) completes.
  Slice embed_rows;
  int64_t vocab_stride = 0;
  cuda::DeviceBuffer local_logits, gathered_logits;
  int64_t collectives_last_forward = 0;
  std::map<std::string, int64_t> graph_collectives;  // GraphKey::Name() -> collectives captured in it
  KvCacheSpec kv;
  KvScales scales;
  CudaRunnerOptions opt;
  cuda::Stream stream;
  cuda::Event step_start, step_end;  // around each forward: ForwardResult::device_ms
  std::unique_ptr<CudaWeights> weights;
  std::vector<LayerCache> layers;
  RopeTable rope[2];
  cuda::DeviceBuffer inv_freq[2];
  CudaWorkspace ws;
  GraphCache graphs;
  std::vector<std::string> layer_presets;
  bool fallback = false;
  std::vector<std::string> fallback_ops;
  std::string device_name;
  int decode_kernel_nodes = 0;

  // The forward being recorded: rows and outputs of the launch (bucketed when graphed).
  int32_t T = 0, R = 0;
  // Consecutive rows (of the T rows, or of the R output rows) on one product: `mma` set = the
  // tensor-core product (Tuning::mma_products, or a prompt row with Tuning::prompt_mma). The
  // linear layers and experts run once per run; one run in the common cases (a prompt chunk alone,
  // decode rows alone), more in a step that mixes them. Padding rows join the last run.
  struct RowRun {
    int32_t begin = 0, count = 0;
    bool mma = false;
  };
  std::vector<RowRun> row_runs, out_runs;
  bool argmax_only = false;
  int cur = 0;  // which residual buffer holds the stream
  struct {
    const WeightRef* weight = nullptr;
    bool add = false;
  } pending;  // an AddRmsNorm not yet run (folded into its consumer where that pays)
  // The launched forward (Launch to Wait).
  const ForwardBatch* launched = nullptr;
  // The prepared forward (Prepare to Submit) and its graph (null: eager).
  const ForwardBatch* prepared = nullptr;
  GraphCache::Entry* prepared_entry = nullptr;

  explicit Impl(const ModelConfig& c) : cfg(c) {}
  cudaStream_t s() const { return stream.get(); }
  // Whether a row's product follows its class (prompt rows on the tensor-core product, generated rows
  // on the CUDA cores): then RowRun::mma marks the prompt rows.
  bool mma_products_only_for_prompts() const { return !opt.tuning.mma_products && opt.tuning.prompt_mma; }
  // Whether a run is prompt rows made a class of their own (they then take the prompt products the
  // tuning asks for below).
  bool prompt_class(const RowRun& run) const { return run.mma && mma_products_only_for_prompts(); }
  // Whether a run's products may take the library GEMM: Tuning::prompt_gemm (each product then also
  // needs LibraryGemmFits, a property of its shapes).
  bool prompt_gemm(const RowRun& run) const { return prompt_class(run) && opt.tuning.prompt_gemm; }
  // Whether a run's FP8 weights take the tensor-core product (ops.h 5d): Tuning::prompt_fp8_mma (each
  // then also needs a block shape the product takes: MmaFp8Supported, MoeFp8MmaSupported).
  bool prompt_fp8_mma(const RowRun& run) const { return prompt_class(run) && opt.tuning.prompt_fp8_mma; }
  bool Skips(std::string_view op) const {
    return std::find(opt.skip_ops.begin(), opt.skip_ops.end(), op) != opt.skip_ops.end();
  }
  Status Init(const Checkpoint& ck);
  Status Stage(const ForwardBatch& batch, GraphKey* key, bool* graphed);
  Status Record(const ForwardBatch& batch);

  bf16* Buffer(Act a) const {
    switch (a) {
      case Act::kNormed: return ws.normed;
      case Act::kQkvg: return ws.qkvg;
      case Act::kAttention: return ws.attn;
      case Act::kDelta: return ws.delta;
      case Act::kGateUp: return ws.gate_up;
      case Act::kHidden: return ws.hidden;
      case Act::kOutputNormed: return ws.out_normed;
      case Act::kLogits: return ws.logits;
    }
    return nullptr;
  }
  // The pending norm as its own kernel (in place on the residual stream).
  Status FlushNorm();
  // The pending norm folded into its consumer: the updated stream goes to the other buffer, because
  // the consumer's other blocks still read this one.
  kernels::FusedInputNorm TakeFusedNorm(bf16* u_out);

  // LagunaOps.
  Status Embed(const WeightRef& table) override;
  Status AddRmsNorm(const WeightRef& weight, bool add_delta) override;
  Status Linear(const LinearWeights& w, Act in, Act out) override;
  Status QkNormRopeAppend(int32_t layer, const LagunaLayerWeights& w) override;
  Status Attention(int32_t layer) override;
  Status SiluMul() override;
  Status Moe(int32_t layer, const MoeWeights& w) override;
  Status TapHidden(int32_t tap) override;
  Status OutputNorm(const WeightRef& weight) override;
  Status SelectTokens() override;
  Status AllReduce(PartialSum what) override;
  // Tensor parallelism: every rank's logits of the R output rows into ws.logits [R, V].
  Status GatherLogits();
  const TensorParallelPlan* plan = nullptr;  // Init only (the rank's shard)
};

Status CudaRunner::Impl::Init(const Checkpoint& ck) {
  const ModelConfig& c = cfg;
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(opt.device));
  DL_ASSIGN_OR_RETURN(auto info, cuda::GetDeviceInfo(opt.device));
  device_name = info.name;
  DL_ASSIGN_OR_RETURN(stream, cuda::Stream::Create());
  DL_ASSIGN_OR_RETURN(step_start, cuda::Event::Create());
  DL_ASSIGN_OR_RETURN(step_end, cuda::Event::Create());
  kernels::SetDependentLaunch(opt.tuning.dependent_launch);
  DL_RETURN_IF_ERROR(CheckCudaShapeSupport(c));
  if (mma_products_only_for_prompts() && opt.tuning.prompt_gemm) {  // say it now, not at the first prompt
    DL_RETURN_IF_ERROR(kernels::LibraryGemmAvailable().WithContext(
        "prompt rows' dense layers (--tune prompt_gemm=0 puts them on the tensor-core product)"));
  }
  const int64_t D = c.head_dim;
  embed_rows = Slice{0, c.vocab_size};
  if (tp_size == 1) {
    DL_ASSIGN_OR_RETURN(weights, CudaWeights::Upload(ck, opt.synthetic_seed, s()));
  } else {
    embed_rows = plan->ranks[rank].embed_vocab;  // ShardHostWeights cuts the table to these rows
    // The rank's slices of the host weights (row slices are views, column slices copies the shard
    // owns until the upload is done).
    DL_ASSIGN_OR_RETURN(auto shard, ShardHostWeights(ck.config(), HostLagunaWeights(ck.weights()), *plan, rank));
    DL_ASSIGN_OR_RETURN(weights, CudaWeights::UploadHost(ck, shard->weights, opt.synthetic_seed, s()));
    for (const RankShard& r : plan->ranks) {
      vocab_slices.push_back(r.lm_head_vocab);
      vocab_stride = std::max(vocab_stride, r.lm_head_vocab.size);
    }
    const size_t block = static_cast<size_t>(std::max(1, opt.max_outputs)) * vocab_stride * sizeof(bf16);
    DL_ASSIGN_OR_RETURN(local_logits, cuda::DeviceBuffer::Create(block));
    DL_ASSIGN_OR_RETURN(gathered_logits, cuda::DeviceBuffer::Create(block * tp_size));
  }
  rope[0] = ComputeRopeTable(c.rope_full, D);
  rope[1] = ComputeRopeTable(c.rope_sliding, D);
  for (int i = 0; i < 2; ++i) {
    DL_ASSIGN_OR_RETURN(inv_freq[i], cuda::DeviceBuffer::Create(std::max<size_t>(1, rope[i].inv_freq.size()) * 4));
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(inv_freq[i].data(), rope[i].inv_freq.data(), rope[i].inv_freq.size() * 4,
                                       cudaMemcpyHostToDevice));
  }
  const kernels::KvDtype kvd = kv.dtype == DType::kF8E4M3 ? kernels::KvDtype::kFp8 : kernels::KvDtype::kBf16;
  layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerCache& L = layers[l];
    L.sliding = c.is_sliding(l);
    const KvGroup g = L.sliding ? KvGroup::kSliding : KvGroup::kFull;
    L.trash_page = kv.pages_in(g);
    const size_t pool = kv.page_bytes() * static_cast<size_t>(kv.pages_in(g) + 1);
    DL_ASSIGN_OR_RETURN(L.k_pool, cuda::DeviceBuffer::Create(pool));
    DL_ASSIGN_OR_RETURN(L.v_pool, cuda::DeviceBuffer::Create(pool));
    DL_RETURN_IF_ERROR(L.k_pool.Fill(0));
    DL_RETURN_IF_ERROR(L.v_pool.Fill(0));
    // The attention kernel from the preset table; a missing preset is an error unless fallback is
    // allowed, and then every output says so.
    kernels::AttnPresetKey key;
    key.head_dim = static_cast<int>(D);
    key.group = static_cast<int>(c.heads(l) / c.num_key_value_heads);
    key.page_size = kv.page_size;
    key.kv_dtype = kvd;
    key.window = L.sliding ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
    auto resolved = kernels::ResolveAttention(key, opt.allow_fallback);
    if (!resolved.ok()) return resolved.status().WithContext(fmt::format("layer {}", l));
    L.attn = *resolved;
    layer_presets.push_back(L.attn.name);
    if (L.attn.fallback) {
      fallback = true;
      fallback_ops.push_back(fmt::format("layer {} attention ({} not built)", l, kernels::CanonicalName(key)));
    }
  }
  CudaWorkspaceSizes z;
  z.max_rows = std::max(1, opt.max_rows);
  z.max_outputs = std::max(1, opt.max_outputs);
  z.max_seqs = z.max_outputs + 1;  // + the padding rows' dummy sequence
  z.max_pages = PagesNeededFull(opt.max_seq_len, kv.page_size);
  z.max_seq_len = opt.max_seq_len;
  z.max_taps = std::max(0, opt.max_taps);
  DL_ASSIGN_OR_RETURN(ws, CudaWorkspace::Create(c, z));
  // The dummy sequence's tables (the last row of each group): position 0 in the trash page. Never
  // overwritten, so the one copy per step carries them.
  for (int g = 0; g < 2; ++g) {
    int32_t* row = ws.host(ws.tables) + (static_cast<size_t>(g) * z.max_seqs + z.max_seqs - 1) * z.max_pages;
    std::fill(row, row + z.max_pages, -1);
    row[0] = kv.pages_in(static_cast<KvGroup>(g));
  }
  if (comm != nullptr && comm->capturable()) {
    // A rank whose communicator spins on the device (one-shot, NCCL) launches these conversions
    // after its graph, while a peer's graph may be waiting in a collective: load the kernel now, as
    // under CUDA lazy loading a first launch may wait for the whole context. (The graphs' kernels are
    // loaded when they are captured, which CudaTpRunner finishes on every rank before any replays.)
    DL_RETURN_IF_ERROR(kernels::Bf16ToF32(ws.logits, ws.logits_f32, 1, s()));
  }
  DL_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return Status::Ok();
}

// ---- Inputs and launch -------------------------------------------------------------------------

Status CudaRunner::Impl::Stage(const ForwardBatch& b, GraphKey* key, bool* graphed) {
  const CudaWorkspaceSizes& z = ws.sizes;
  DL_RETURN_IF_ERROR(b.Validate(cfg.vocab_size, kv.page_size));
  const int32_t rows = b.num_rows(), outs = static_cast<int32_t>(b.outputs.size());
  const int32_t seqs = static_cast<int32_t>(b.seqs.size());
  if (rows > z.max_rows || outs > z.max_outputs || seqs > z.max_seqs - 1) {
    return InvalidArgument("CUDA forward of {} rows, {} outputs, {} sequences exceeds the backend's {} / {} / {}",
                           rows, outs, seqs, z.max_rows, z.max_outputs, z.max_seqs - 1);
  }
  if (!b.hidden_taps.empty() && static_cast<int32_t>(b.hidden_taps.size()) > z.max_taps) {
    return Unimplemented("{} hidden-state taps on the CUDA backend, which was sized for {} (CudaRunnerOptions::max_taps, "
                         "EngineOptions::max_hidden_taps)", b.hidden_taps.size(), z.max_taps);
  }
  for (const BatchSequence& sq : b.seqs) {
    if (sq.kv->length() + sq.num_rows > opt.max_seq_len) {
      return InvalidArgument("sequence of {} tokens exceeds the CUDA backend's max_seq_len {}",
                             sq.kv->length() + sq.num_rows, opt.max_seq_len);
    }
  }
  const std::vector<int32_t> positions = b.Positions();
  // Each row's product: its class (prompt or generated, BatchSequence::prompt_length) decides, so a
  // row gets the same product whatever else is in the batch and however its prompt was chunked.
  std::vector<char> row_mma(static_cast<size_t>(rows), opt.tuning.mma_products ? 1 : 0);
  if (mma_products_only_for_prompts()) {
    for (const BatchSequence& sq : b.seqs) {
      for (int32_t i = sq.first_row; i < sq.first_row + sq.num_rows; ++i) row_mma[i] = positions[i] < sq.prompt_length;
    }
  }
  auto make_runs = [](std::vector<RowRun>& runs, int32_t n, int32_t padded, auto&& mma_of) {
    runs.clear();
    for (int32_t i = 0; i < n; ++i) {
      const bool m = mma_of(i);
      if (runs.empty() || runs.back().mma != m) runs.push_back({i, 0, m});
      ++runs.back().count;
    }
    if (!runs.empty()) runs.back().count += padded - n;
  };
  // A step mixing the products runs eagerly: its run boundaries change from step to step.
  const bool one_product = std::adjacent_find(row_mma.begin(), row_mma.end(), std::not_equal_to<>()) == row_mma.end();
  *graphed = opt.use_graph && b.hidden_taps.empty() && one_product;
  T = *graphed ? BatchBucket(rows, z.max_rows) : rows;
  R = outs == 0 ? 0 : (*graphed ? BatchBucket(outs, z.max_outputs) : outs);
  make_runs(row_runs, rows, T, [&](int32_t i) { return row_mma[i] != 0; });
  make_runs(out_runs, outs, R, [&](int32_t r) { return row_mma[b.outputs[r].row] != 0; });
  argmax_only = outs == 1 && R == 1 && b.outputs[0].sampling.greedy() && b.outputs[0].sampling.adjustments.empty();
  *key = GraphKey{b.mode, T, R, argmax_only, row_mma[0] != 0};

  int32_t* ids = ws.host(ws.ids);
  int32_t* pos = ws.host(ws.positions);
  int32_t* seq = ws.host(ws.token_seq);
  int32_t* hist = ws.host(ws.history);
  for (int32_t s = 0; s < seqs; ++s) {
    const BatchSequence& sq = b.seqs[s];
    for (int32_t i = sq.first_row; i < sq.first_row + sq.num_rows; ++i) {
      ids[i] = b.tokens[i];
      pos[i] = positions[i];
      seq[i] = s;
      hist[i] = sq.kv->length();
    }
    for (int g = 0; g < 2; ++g) {
      const auto& table = sq.kv->block_table(static_cast<KvGroup>(g));
      if (static_cast<int32_t>(table.size()) > z.max_pages) return Internal("block table longer than {}", z.max_pages);
      int32_t* row = ws.host(ws.tables) + (static_cast<size_t>(g) * z.max_seqs + s) * z.max_pages;
      std::copy(table.begin(), table.end(), row);
      std::fill(row + table.size(), row + z.max_pages, -1);
    }
  }
  for (int32_t i = rows; i < T; ++i) ids[i] = 0, pos[i] = 0, seq[i] = z.max_seqs - 1, hist[i] = 0;
  int32_t* out_rows = ws.host(ws.out_rows);
  kernels::DeviceRowSampling* sp = ws.host(ws.sampling);
  kernels::LogitAdjustment* adj = ws.host(ws.adjustments);
  int32_t n_adj = 0;
  for (int32_t r = 0; r < R; ++r) {
    sp[r] = kernels::DeviceRowSampling{};
    out_rows[r] = 0;
    if (r >= outs) continue;
    const OutputRequest& o = b.outputs[r];
    out_rows[r] = o.row;
    const RowSampling& rs = o.sampling;
    sp[r].temperature = rs.temperature;
    sp[r].top_k = rs.top_k;
    sp[r].top_p = rs.top_p;
    sp[r].min_p = rs.min_p;
    sp[r].key = rs.key;
    sp[r].step = rs.step;
    sp[r].adj_begin = n_adj;
    sp[r].adj_count = static_cast<int32_t>(rs.adjustments.size());
    if (n_adj + sp[r].adj_count > z.max_adjustments) {
      return InvalidArgument("a forward's logit adjustments exceed {}", z.max_adjustments);
    }
    std::copy(rs.adjustments.begin(), rs.adjustments.end(), adj + n_adj);
    n_adj += sp[r].adj_count;
  }
  const size_t bytes = ws.inputs_fixed_bytes + static_cast<size_t>(n_adj) * sizeof(kernels::LogitAdjustment);
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ws.ids, ws.host_inputs.as<char>(), bytes, cudaMemcpyHostToDevice, s()));
  return Status::Ok();
}

Status CudaRunner::Impl::Record(const ForwardBatch& batch) {
  cur = 0;
  pending.weight = nullptr;
  return LagunaForward(cfg, weights->refs(), batch, *this);
}

// ---- Ops ---------------------------------------------------------------------------------------

Status CudaRunner::Impl::FlushNorm() {
  if (pending.weight == nullptr) return Status::Ok();
  const WeightRef* w = std::exchange(pending.weight, nullptr);
  if (Skips("norm")) return Status::Ok();
  kernels::AddRmsNormParams n;
  n.residual = ws.residual[cur];
  n.delta = pending.add ? ws.delta : nullptr;
  n.weight = DeviceBf16(*w);
  n.out = ws.normed;
  n.rows = T;
  n.n = static_cast<int>(cfg.hidden_size);
  n.eps = static_cast<float>(cfg.rms_norm_eps);
  n.prefetch_residual = opt.tuning.l2_prefetch;
  n.release_after_wait = opt.tuning.late(LateRelease::kNorm);
  return kernels::AddRmsNorm(n, s());
}

kernels::FusedInputNorm CudaRunner::Impl::TakeFusedNorm(bf16* u_out) {
  const WeightRef* w = std::exchange(pending.weight, nullptr);
  kernels::FusedInputNorm n;
  n.residual = ws.residual[cur];
  n.delta = pending.add ? ws.delta : nullptr;
  n.weight = DeviceBf16(*w);
  n.residual_out = pending.add ? ws.residual[cur ^ 1] : nullptr;  // no delta: the stream is unchanged
  n.u_out = u_out;
  n.eps = static_cast<float>(cfg.rms_norm_eps);
  n.prefetch_residual = opt.tuning.l2_prefetch;
  if (pending.add) cur ^= 1;
  return n;
}

Status CudaRunner::Impl::Embed(const WeightRef& table) {
  if (table.rows() != embed_rows.size) {
    return Internal("embedding table of {} rows, the rank holds {}", table.rows(), embed_rows.size);
  }
  kernels::EmbedParams p{DeviceBf16(table), ws.ids, ws.residual[cur], T, static_cast<int>(cfg.hidden_size),
                         static_cast<int>(cfg.vocab_size)};
  if (embed_rows.size != cfg.vocab_size) {  // vocab-parallel: [T, d] rows of other ranks' tokens are -0
    p.slice_begin = static_cast<int>(embed_rows.begin);
    p.slice_rows = static_cast<int>(embed_rows.size);
  }
  return kernels::EmbedLookup(p, s());
}

Status CudaRunner::Impl::AddRmsNorm(const WeightRef& weight, bool add_delta) {
  DL_RETURN_IF_ERROR(FlushNorm());
  pending.weight = &weight;
  pending.add = add_delta;
  return Status::Ok();
}

Status CudaRunner::Impl::Linear(const LinearWeights& w, Act in, Act out) {
  // One GEMV per stored part (CudaWeights stacks consecutive parts of one dtype: one part unless, e.g.,
  // q/k/v are FP8 and g BF16), each writing its rows of the output.
  if (w.parts.empty()) return Internal("CUDA linear: no weights");
  const bool qkvg = out == Act::kQkvg, o_proj = in == Act::kAttention;
  const bool mlp = out == Act::kGateUp || in == Act::kHidden;
  const int rows = in == Act::kOutputNormed ? R : T;
  const std::vector<RowRun>& runs = in == Act::kOutputNormed ? out_runs : row_runs;
  if (runs.empty()) return FlushNorm();  // no output rows
  kernels::FusedInputNorm norm;
  // The dense MLP's gate/up takes the norm before it (the measured policy: only the norm before the
  // MLP is folded, and only at batch 1 where the streaming kernel takes it); everything else runs it.
  // The tensor-core product takes no fused norm.
  if (pending.weight != nullptr && out == Act::kGateUp && rows == 1 && opt.skip_ops.empty() && w.parts.size() == 1 &&
      !runs.front().mma) {
    norm = TakeFusedNorm(nullptr);
  } else {
    DL_RETURN_IF_ERROR(FlushNorm());
  }
  if ((qkvg && Skips("qkvg")) || (o_proj && Skips("o_proj")) || (mlp && Skips("dense_mlp"))) return Status::Ok();
  const kernels::Tuning& tu = opt.tuning;
  const int64_t total_out = w.out();
  int64_t row0 = 0;
  for (const WeightRef& W : w.parts) {
    const bool fp8 = IsFp8(W);
    for (const RowRun& run : runs) {
      kernels::GemvParams p;
      p.norm = norm;
      if (fp8) {
        p.w_fp8 = Fp8Of(W);
      } else {
        p.w = DeviceBf16(W);
      }
      p.out = static_cast<int>(W.rows());
      p.in = static_cast<int>(W.cols());
      p.x = Buffer(in) + static_cast<int64_t>(run.begin) * p.in;
      p.y = Buffer(out) + static_cast<int64_t>(run.begin) * total_out + row0;
      p.y_stride = total_out;
      if (out == Act::kLogits && tp_size > 1) {  // the rank's vocabulary slice, gathered in SelectTokens
        p.y = local_logits.as<bf16>() + static_cast<int64_t>(run.begin) * vocab_stride + row0;
        p.y_stride = vocab_stride;
      }
      p.num_tokens = run.count;
      p.streaming.ring_kb = tu.stream_ring_kb;
      p.streaming.stage_kb = tu.stream_stage_kb;
      p.streaming.prefetch_kb = o_proj ? tu.oproj_prefetch_kb : tu.stream_prefetch_kb;
      // The run's product (RowRun): the tensor-core product (ops.h 5b) gives a row the same bits for
      // every row count, so the CUDA-core kernels' streaming and batched variants do not apply. FP8
      // weights take it for prompt rows only (ops.h 5d, Tuning::prompt_fp8_mma), and only where their
      // block shape allows (a property of the checkpoint, never of the batch); every other row keeps
      // the FP8 rule's kernels.
      p.mma = run.mma && (!fp8 || (prompt_fp8_mma(run) && kernels::MmaFp8Supported(p.w_fp8, p.in)));
      p.mma_tiled_min_tokens = tu.mma_tiled_min_tokens;
      // Prompt rows (a class of their own) on the library GEMM where Tuning::prompt_gemm asks for it
      // and the layer's rows are 16-byte aligned (a property of its shapes, never of the batch).
      p.library_gemm = !fp8 && prompt_gemm(run) && kernels::LibraryGemmFits(p);
      // Streaming is BF16's batch-1 kernel; FP8 weights take the plain kernel (ops.h 5).
      p.streaming.on = !p.mma && !fp8 && rows == 1 && tu.stream_gemv &&
                       kernels::GemvStreamSupported(p.out, p.in, tu.stream_ring_kb, tu.stream_stage_kb);
      p.batch_rows = tu.batch_gemv_rows > 0 ? tu.batch_gemv_rows : (run.count <= 8 ? 2 : 4);
      p.batch_tokens = tu.batch_gemv_tokens;
      p.release_after_wait = (qkvg && tu.late(LateRelease::kQkvg)) || (o_proj && tu.late(LateRelease::kOProj));
      DL_RETURN_IF_ERROR(kernels::Gemv(p, s()).WithContext(W.name));
    }
    row0 += W.rows();
  }
  return Status::Ok();
}

Status CudaRunner::Impl::QkNormRopeAppend(int32_t l, const LagunaLayerWeights& w) {
  DL_RETURN_IF_ERROR(FlushNorm());
  if (Skips("rope")) return Status::Ok();
  const LayerCache& L = layers[l];
  const int H = static_cast<int>(cfg.heads(l)), D = static_cast<int>(cfg.head_dim);
  const int K = static_cast<int>(cfg.num_key_value_heads);
  const int group = L.sliding ? 1 : 0;
  const CudaWorkspaceSizes& z = ws.sizes;
  kernels::QkNormRopeAppendParams rp;
  rp.q = ws.qkvg;
  rp.k = ws.qkvg + H * D;
  rp.v = ws.qkvg + (H + K) * D;
  rp.qkv_stride = cfg.qkvg_width(l);
  rp.q_norm_weight = DeviceBf16(w.q_norm);
  rp.k_norm_weight = DeviceBf16(w.k_norm);
  rp.inv_freq = inv_freq[group].as<float>();
  rp.attention_factor = rope[group].attention_factor;
  rp.rotary_dim = static_cast<int>(rope[group].rotary_dim);
  rp.eps = static_cast<float>(cfg.rms_norm_eps);
  rp.positions = ws.positions;
  rp.num_tokens = T;
  rp.num_q_heads = H;
  rp.num_kv_heads = K;
  rp.head_dim = D;
  rp.q_out = ws.q;
  rp.k_pool = L.k_pool.data();
  rp.v_pool = L.v_pool.data();
  rp.kv_dtype = kv.dtype == DType::kF8E4M3 ? kernels::KvDtype::kFp8 : kernels::KvDtype::kBf16;
  rp.k_scale = scales.k[l];
  rp.v_scale = scales.v[l];
  rp.block_table = ws.tables + static_cast<size_t>(group) * z.max_seqs * z.max_pages;
  // One row is one sequence, the first: no per-row table lookup (a dependent load on the critical path).
  rp.token_seq = T > 1 ? ws.token_seq : nullptr;
  rp.block_table_stride = z.max_pages;
  rp.page_size = kv.page_size;
  rp.prefetch_constants = opt.tuning.l2_prefetch;
  rp.block_table_entries = z.max_pages;
  rp.release_after_wait = opt.tuning.late(LateRelease::kRope);
  return kernels::QkNormRopeAppend(rp, s());
}

Status CudaRunner::Impl::Attention(int32_t l) {
  DL_RETURN_IF_ERROR(FlushNorm());
  if (Skips("attention")) return Status::Ok();
  const LayerCache& L = layers[l];
  const int H = static_cast<int>(cfg.heads(l)), D = static_cast<int>(cfg.head_dim);
  const int K = static_cast<int>(cfg.num_key_value_heads);
  const CudaWorkspaceSizes& z = ws.sizes;
  kernels::AttentionParams ap;
  ap.q = ws.q;
  ap.k_pool = L.k_pool.data();
  ap.v_pool = L.v_pool.data();
  ap.block_table = ws.tables + static_cast<size_t>(L.sliding ? 1 : 0) * z.max_seqs * z.max_pages;
  ap.positions = ws.positions;
  ap.history_stable = true;  // a sequence's keys before this forward come from earlier forwards
  // One row (decode of one sequence): its table is the first and its history its position, so the
  // kernel needs neither per-row array (each would be one more dependent load before the keys').
  ap.token_seq = T > 1 ? ws.token_seq : nullptr;
  ap.block_table_stride = z.max_pages;
  ap.history = T > 1 ? ws.history : nullptr;
  ap.max_position = opt.max_seq_len - 1;
  ap.num_tokens = T;
  ap.num_q_heads = H;
  ap.num_kv_heads = K;
  ap.head_dim = D;
  ap.page_size = kv.page_size;
  ap.kv_dtype = kv.dtype == DType::kF8E4M3 ? kernels::KvDtype::kFp8 : kernels::KvDtype::kBf16;
  ap.window_kind = L.sliding ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
  ap.window = static_cast<int>(cfg.sliding_window);
  ap.k_scale = scales.k[l];
  ap.v_scale = scales.v[l];
  ap.gate = ws.qkvg + (H + 2 * K) * D;
  ap.gate_stride = cfg.qkvg_width(l);
  ap.gate_per_element = cfg.gating == GatingKind::kPerElement;
  ap.out = ws.attn;
  ap.workspace = ws.attn_ws;
  ap.workspace_bytes = ws.attn_ws_bytes;
  ap.counters = ws.attn_counters;
  ap.cluster_max_chunks = opt.tuning.attention_cluster_max_chunks;
  ap.multi_row_min_tokens = opt.tuning.attention_multi_row_min_tokens;
  ap.release_after_wait = opt.tuning.late(LateRelease::kAttention);
  // Prompt rows (where prompt_mma makes them their own class) on the tensor-core prompt kernel, each
  // run of consecutive rows of one class in its own launch; otherwise every row on the split kernel.
  // Split-kernel launches take at most z.max_split_attention_rows rows (the workspace's size).
  const bool prompt_kernel = mma_products_only_for_prompts() && opt.tuning.prompt_attention;
  auto launch = [&](int32_t begin, int32_t count, kernels::AttnKind kind) {
    kernels::AttentionParams rp = ap;
    const size_t b = static_cast<size_t>(begin);
    rp.q = ap.q + b * H * D;
    rp.out = ap.out + b * H * D;
    rp.gate = ap.gate + b * ap.gate_stride;
    rp.positions = ap.positions + b;
    if (ap.token_seq) rp.token_seq = ap.token_seq + b;
    if (ap.history) rp.history = ap.history + b;
    rp.num_tokens = count;
    return kernels::RunAttention(L.attn, rp, s(), kind)
        .WithContext(fmt::format("layer {}, {} rows {}..{}", l, kernels::AttnKindName(kind), begin, begin + count - 1));
  };
  for (const RowRun& run : row_runs) {
    if (prompt_kernel && run.mma) {
      DL_RETURN_IF_ERROR(launch(run.begin, run.count, kernels::AttnKind::kPrompt));
      continue;
    }
    for (int32_t b = run.begin; b < run.begin + run.count; b += z.max_split_attention_rows) {
      const int32_t n = std::min(z.max_split_attention_rows, run.begin + run.count - b);
      DL_RETURN_IF_ERROR(launch(b, n, kernels::AttnKind::kDecode));
    }
  }
  return Status::Ok();
}

Status CudaRunner::Impl::SiluMul() {
  if (Skips("dense_mlp")) return Status::Ok();
  return kernels::SiluMul({ws.gate_up, ws.hidden, T, static_cast<int>(cfg.intermediate_size)}, s());
}

Status CudaRunner::Impl::Moe(int32_t l, const MoeWeights& w) {
  kernels::MoeParams mp;
  // Prompt rows' router logits on the library GEMM (Tuning::prompt_gemm, as their dense layers): a
  // run of them gets its logits from one GEMM (library_gemm set) and the router only selects.
  const int64_t d = cfg.hidden_size, k = cfg.num_experts_per_tok, E = cfg.num_experts;
  auto router_gemm = [&](const RowRun& run) {
    kernels::GemvParams g;
    g.w = DeviceBf16(w.router);
    g.x = ws.normed + run.begin * d;
    g.y = ws.router_logits + run.begin * E;
    g.out = static_cast<int>(E);
    g.in = static_cast<int>(d);
    g.num_tokens = run.count;
    g.library_gemm = !IsFp8(w.router) && prompt_gemm(run) && kernels::LibraryGemmFits(g);
    return g;
  };
  // The router takes the norm before it (every block recomputes its token's row) and writes u2 for
  // the expert kernels; with several runs, or logits from the library GEMM (which reads u2), the norm
  // runs on its own first (the same bits: norm_block.cuh), and each run's experts read its rows of u2.
  if (pending.weight != nullptr && opt.skip_ops.empty() && row_runs.size() == 1 && !router_gemm(row_runs[0]).library_gemm) {
    mp.norm = TakeFusedNorm(ws.normed);
  } else {
    DL_RETURN_IF_ERROR(FlushNorm());
  }
  if (Skips("moe")) return Status::Ok();
  const CudaWeights::ExpertTables& t = weights->experts(l);
  mp.x = ws.normed;
  mp.num_tokens = T;
  mp.router_w = DeviceBf16(w.router);
  mp.router_bias = DeviceBf16(w.correction_bias);
  if (t.fp8) {  // the routed experts' codes and scale pointer arrays (CudaWeights::ExpertTables)
    auto table = [](const void* codes, const void* scales, const WeightRef& first) {
      return kernels::MoeParams::Fp8Experts{static_cast<const uint8_t* const*>(codes),
                                            static_cast<const float* const*>(scales),
                                            static_cast<int>(first.block_rows), static_cast<int>(first.block_cols)};
    };
    mp.gate_fp8 = table(t.gate, t.gate_scales, w.gate[0]);
    mp.up_fp8 = table(t.up, t.up_scales, w.up[0]);
    mp.down_fp8 = table(t.down, t.down_scales, w.down[0]);
  } else {
    mp.gate_w = static_cast<const bf16* const*>(t.gate);
    mp.up_w = static_cast<const bf16* const*>(t.up);
    mp.down_w = static_cast<const bf16* const*>(t.down);
  }
  if (IsFp8(w.shared_gate)) {
    mp.shared_gate_fp8 = Fp8Of(w.shared_gate);
    mp.shared_up_fp8 = Fp8Of(w.shared_up);
    mp.shared_down_fp8 = Fp8Of(w.shared_down);
  } else {
    mp.shared_gate_w = DeviceBf16(w.shared_gate);
    mp.shared_up_w = DeviceBf16(w.shared_up);
    mp.shared_down_w = DeviceBf16(w.shared_down);
  }
  mp.d = static_cast<int>(cfg.hidden_size);
  mp.num_experts = static_cast<int>(cfg.num_experts);
  mp.top_k = static_cast<int>(cfg.num_experts_per_tok);
  mp.ffn = static_cast<int>(cfg.moe_intermediate_size);
  mp.shared_ffn = static_cast<int>(cfg.shared_expert_intermediate_size);
  mp.alpha = static_cast<float>(cfg.moe_routed_scaling_factor);
  mp.softcap = static_cast<float>(cfg.moe_router_logit_softcapping);
  mp.y = ws.delta;
  mp.topk_ids = ws.topk_ids;
  mp.topk_weights = ws.topk_weights;
  mp.workspace = ws.moe_ws;
  mp.counter = ws.moe_counter;
  mp.gate_up_stream_ring_kb = opt.tuning.moe_gate_up_stream_kb;
  mp.router_rows_min_tokens = opt.tuning.moe_router_rows_min_tokens;
  mp.router_release_after_wait = opt.tuning.late(LateRelease::kRouter);
  mp.down_release_after_wait = opt.tuning.late(LateRelease::kDown);
  for (const RowRun& run : row_runs) {
    kernels::MoeParams rp = mp;
    rp.x = ws.normed + run.begin * d;
    rp.y = ws.delta + run.begin * d;
    rp.topk_ids = ws.topk_ids + run.begin * k;
    rp.topk_weights = ws.topk_weights + run.begin * k;
    rp.counter = ws.moe_counter + run.begin;
    rp.num_tokens = run.count;
    // The run's product (RowRun). FP8 experts take the tensor-core product for prompt rows only
    // (ops.h 5d, Tuning::prompt_fp8_mma) where every FP8 group's block shape allows; other rows keep
    // the FP8 rule's kernels.
    const bool fp8_experts = mp.gate_fp8.on() || mp.shared_gate_fp8.on();
    rp.mma = run.mma && (!fp8_experts || (prompt_fp8_mma(run) && kernels::MoeFp8MmaSupported(mp)));
    if (const kernels::GemvParams g = router_gemm(run); g.library_gemm) {
      DL_RETURN_IF_ERROR(kernels::Gemv(g, s()).WithContext(fmt::format("layer {} router", l)));
      rp.router_logits = g.y;
    }
    DL_RETURN_IF_ERROR(kernels::Moe(rp, s()).WithContext(fmt::format("layer {}", l)));
  }
  return Status::Ok();
}

Status CudaRunner::Impl::TapHidden(int32_t tap) {
  DL_RETURN_IF_ERROR(FlushNorm());
  const int64_t n = static_cast<int64_t>(T) * cfg.hidden_size;
  return kernels::AddBf16(ws.residual[cur], ws.delta, ws.taps + tap * n, n, s());
}

Status CudaRunner::Impl::OutputNorm(const WeightRef& weight) {
  DL_RETURN_IF_ERROR(FlushNorm());
  kernels::AddRmsNormParams fin;
  fin.residual = ws.residual[cur];
  fin.delta = ws.delta;
  fin.weight = DeviceBf16(weight);
  fin.n = static_cast<int>(cfg.hidden_size);
  fin.eps = static_cast<float>(cfg.rms_norm_eps);
  fin.prefetch_residual = opt.tuning.l2_prefetch;
  if (T == 1 && R == 1) {  // batch-1 decode: the one row is the output row
    fin.out = ws.out_normed;
    fin.rows = 1;
    return kernels::AddRmsNorm(fin, s());
  }
  fin.out = ws.normed;
  fin.rows = T;
  DL_RETURN_IF_ERROR(kernels::AddRmsNorm(fin, s()));
  return kernels::GatherRows({ws.normed, ws.out_rows, ws.out_normed, R, static_cast<int>(cfg.hidden_size)}, s());
}

Status CudaRunner::Impl::GatherLogits() {
  // [R, vocab_stride] per rank -> [tp, R, vocab_stride] on every rank -> each rank's [R, V_q] columns at
  // [v_q, v_q + V_q) of ws.logits [R, V]. A copy, not arithmetic: every rank then holds the whole
  // rows in BF16 exactly as one rank's LM head would have written them, and chooses the same tokens.
  const size_t block = static_cast<size_t>(R) * vocab_stride * sizeof(bf16);
  DL_RETURN_IF_ERROR(comm->AllGather(local_logits.data(), block, gathered_logits.data(), s()));
  const size_t V = static_cast<size_t>(cfg.vocab_size);
  for (int q = 0; q < tp_size; ++q) {
    const Slice& v = vocab_slices[q];
    if (v.size == 0) continue;
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(ws.logits + v.begin, V * sizeof(bf16),
                                              gathered_logits.as<char>() + q * block, vocab_stride * sizeof(bf16),
                                              v.size * sizeof(bf16), R, cudaMemcpyDeviceToDevice, s()));
  }
  return Status::Ok();
}

Status CudaRunner::Impl::AllReduce(PartialSum what) {
  if (tp_size == 1) return Status::Ok();
  if (what == PartialSum::kEmbedding) {
    // The vocab-parallel lookup's [T, d] BF16 residual: each token's row from the one rank holding it,
    // -0 from the others, so the sum is that row bit for bit (kernels/elementwise.h, EmbedParams).
    return comm->AllReduceSum(ws.residual[cur], static_cast<int64_t>(T) * cfg.hidden_size, comm::DeviceElem::kBF16,
                              s());
  }
  // kDelta [T, d] BF16: each rank's partial sum, added in FP32 and rounded once (in rank order with the
  // in-process device communicator; NCCL's own order otherwise).
  return comm->AllReduceSum(ws.delta, static_cast<int64_t>(T) * cfg.hidden_size, comm::DeviceElem::kBF16, s());
}

Status CudaRunner::Impl::SelectTokens() {
  if (tp_size > 1 && R > 0) DL_RETURN_IF_ERROR(GatherLogits());
  const int V = static_cast<int>(cfg.vocab_size);
  if (argmax_only) {
    kernels::ArgmaxParams am;
    am.logits = ws.logits;
    am.n = V;
    am.out = ws.tokens;
    am.nonfinite = ws.nonfinite;
    am.workspace = ws.argmax_ws;
    am.counter = ws.argmax_counter;
    return kernels::Argmax(am, s());
  }
  kernels::SampleRowsParams sp;
  sp.logits = ws.logits;
  sp.rows = R;
  sp.vocab = V;
  sp.params = ws.sampling;
  sp.adjustments = ws.adjustments;
  sp.tokens = ws.tokens;
  sp.nonfinite = ws.nonfinite;
  sp.scratch = ws.sample_scratch;
  return kernels::SampleRows(sp, s());
}

// ---- CudaRunner --------------------------------------------------------------------------------

CudaRunner::CudaRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaRunner::~CudaRunner() = default;

Result<std::unique_ptr<CudaRunner>> CudaRunner::Create(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                       KvScales scales, const CudaRunnerOptions& options) {
  return CreateRank(checkpoint, kv, std::move(scales), options, TensorParallelPlan{}, 0, nullptr);
}

Result<std::unique_ptr<CudaRunner>> CudaRunner::CreateRank(const Checkpoint& checkpoint, const KvCacheSpec& kv,
                                                           KvScales scales, const CudaRunnerOptions& options,
                                                           const TensorParallelPlan& plan, int rank,
                                                           comm::DeviceCommunicator* comm) {
  std::string why;
  if (cuda::DeviceCount(&why) <= options.device) {
    return Unavailable("--backend cuda: no usable GPU ({})", why);
  }
  if (kv.dtype != DType::kBF16 && kv.dtype != DType::kF8E4M3) {
    return InvalidArgument("--kv-dtype {} is the CPU backend's; the CUDA backend takes bf16 or fp8",
                           DTypeName(kv.dtype));
  }
  const bool tp = plan.tp_size > 1;
  if (tp) {
    if (comm == nullptr || comm->size() != plan.tp_size || comm->rank() != rank) {
      return InvalidArgument("tensor-parallel rank {} of {}: the device communicator is {} of {}", rank, plan.tp_size,
                             comm ? comm->rank() : -1, comm ? comm->size() : 0);
    }
    DL_RETURN_IF_ERROR(CheckCudaTensorParallel(checkpoint, plan));
  }
  const ModelConfig& c = checkpoint.config();
  if (scales.empty()) scales = KvScales::Unit(static_cast<int>(c.num_hidden_layers));
  auto impl = std::make_unique<Impl>(tp ? RankModelConfig(c, plan, rank) : c);
  impl->kv = kv;
  if (tp) {
    impl->tp_size = plan.tp_size;
    impl->rank = rank;
    impl->comm = comm;
    impl->plan = &plan;
    impl->kv.num_kv_heads = static_cast<int32_t>(impl->cfg.num_key_value_heads);  // the rank's heads only
  }
  impl->scales = std::move(scales);
  impl->opt = options;
  for (const std::string& op : options.skip_ops) {
    if (std::find(std::begin(kSkippableOps), std::end(kSkippableOps), op) == std::end(kSkippableOps)) {
      return InvalidArgument("--skip-ops: unknown op '{}' (known: {})", op, fmt::join(kSkippableOps, ", "));
    }
  }
  DL_RETURN_IF_ERROR(impl->Init(checkpoint));
  impl->plan = nullptr;  // the caller's; not needed after the upload
  return std::unique_ptr<CudaRunner>(new CudaRunner(std::move(impl)));
}

const KvCacheSpec& CudaRunner::kv_spec() const { return impl_->kv; }
const KvScales& CudaRunner::kv_scales() const { return impl_->scales; }
int32_t CudaRunner::max_rows() const { return impl_->ws.sizes.max_rows; }
int32_t CudaRunner::max_outputs() const { return impl_->ws.sizes.max_outputs; }
int32_t CudaRunner::max_taps() const { return impl_->ws.sizes.max_taps; }
int CudaRunner::kernel_nodes() const { return impl_->decode_kernel_nodes; }
int64_t CudaRunner::collectives_last_forward() const { return impl_->collectives_last_forward; }
const std::vector<std::string>& CudaRunner::layer_presets() const { return impl_->layer_presets; }
bool CudaRunner::fallback() const { return impl_->fallback; }

Status CudaRunner::Launch(const ForwardBatch& batch) {
  DL_RETURN_IF_ERROR(Prepare(batch));
  return Submit();
}

Status CudaRunner::Prepare(const ForwardBatch& batch) {
  Impl& m = *impl_;
  if (m.launched != nullptr) return FailedPrecondition("a forward is already in flight");
  m.prepared = nullptr;
  // A tensor-parallel rank launches from its group's thread: its device, not whatever that thread had.
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(m.opt.device));
  GraphKey key;
  bool graphed = false;
  DL_RETURN_IF_ERROR(m.Stage(batch, &key, &graphed));
  // The in-process device communicator meets the other ranks on the host at each collective, which a
  // captured graph cannot replay: such a rank runs eagerly (comm/device_communicator.h).
  if (m.comm != nullptr && !m.comm->capturable()) graphed = false;
  m.prepared_entry = nullptr;
  if (graphed) {
    const int64_t before = m.comm != nullptr ? m.comm->collectives_issued() : 0;
    DL_ASSIGN_OR_RETURN(m.prepared_entry, m.graphs.GetOrCapture(key, m.s(), [&] { return m.Record(batch); }));
    if (key.rows == 1 && key.outputs == 1) m.decode_kernel_nodes = m.prepared_entry->kernel_nodes;
    if (m.comm != nullptr) {
      const int64_t captured = m.comm->collectives_issued() - before;
      if (captured > 0) m.graph_collectives[key.Name()] = captured;  // 0: replayed, not captured now
      m.collectives_last_forward = m.graph_collectives[key.Name()];
    }
  }
  m.prepared = &batch;
  return Status::Ok();
}

Status CudaRunner::Submit() {
  Impl& m = *impl_;
  if (m.prepared == nullptr) return FailedPrecondition("no prepared forward to submit");
  const ForwardBatch& batch = *std::exchange(m.prepared, nullptr);
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(m.opt.device));
  cudaStream_t s = m.s();
  const bool decode1 = batch.num_rows() == 1 && batch.outputs.size() == 1;
  if (kernels::TimelineBuilt() && decode1 && m.comm == nullptr) {  // diagnostic builds: keep the stamps of the latest step only
    static const Status enabled = kernels::TimelineEnable(size_t{1} << 21);
    DL_RETURN_IF_ERROR(enabled);
    DL_RETURN_IF_ERROR(kernels::TimelineReset(s));
  }
  if (m.prepared_entry != nullptr) {
    DL_RETURN_IF_ERROR(m.step_start.Record(s));
    DL_RETURN_IF_ERROR(m.prepared_entry->exec.Launch(s));
  } else {
    const int64_t collectives_before = m.comm != nullptr ? m.comm->collectives_issued() : 0;
    DL_RETURN_IF_ERROR(m.step_start.Record(s));
    DL_RETURN_IF_ERROR(m.Record(batch));
    if (m.comm != nullptr) m.collectives_last_forward = m.comm->collectives_issued() - collectives_before;
  }
  DL_RETURN_IF_ERROR(m.step_end.Record(s));
  // What comes back: tokens and flags, logits of the rows that asked, taps.
  const int V = static_cast<int>(m.cfg.vocab_size);
  const int32_t outs = static_cast<int32_t>(batch.outputs.size());
  if (outs > 0) {
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.ws.host_outputs.as<int32_t>(), m.ws.tokens,
                                            2 * sizeof(int32_t) * m.ws.sizes.max_outputs, cudaMemcpyDeviceToHost, s));
  }
  for (int32_t r = 0; r < outs; ++r) {
    if (!batch.outputs[r].want_logits) continue;
    const size_t off = static_cast<size_t>(r) * V;
    DL_RETURN_IF_ERROR(kernels::Bf16ToF32(m.ws.logits + off, m.ws.logits_f32 + off, V, s));
    DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.ws.host_logits.as<float>() + off, m.ws.logits_f32 + off,
                                            sizeof(float) * V, cudaMemcpyDeviceToHost, s));
  }
  if (!batch.hidden_taps.empty()) {
    const int64_t n = static_cast<int64_t>(batch.hidden_taps.size()) * m.T * m.cfg.hidden_size;
    DL_RETURN_IF_ERROR(kernels::Bf16ToF32(m.ws.taps, m.ws.taps_f32, n, s));
    DL_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(m.ws.host_taps.as<float>(), m.ws.taps_f32, sizeof(float) * n, cudaMemcpyDeviceToHost, s));
  }
  m.launched = &batch;
  return Status::Ok();
}

Status CudaRunner::Wait(ForwardResult* result) {
  Impl& m = *impl_;
  if (m.launched == nullptr) return FailedPrecondition("no forward in flight");
  const ForwardBatch& batch = *std::exchange(m.launched, nullptr);
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(m.opt.device));
  DL_RETURN_IF_ERROR(m.stream.Synchronize());
  // A one-shot collective that gave up its wait (group aborted, peer timed out) left wrong values.
  if (m.comm != nullptr) DL_RETURN_IF_ERROR(m.comm->DeviceError());
  const int V = static_cast<int>(m.cfg.vocab_size);
  *result = ForwardResult{};
  DL_ASSIGN_OR_RETURN(float ms, cuda::Event::ElapsedMs(m.step_start, m.step_end));
  result->device_ms = ms;
  result->rows.resize(batch.outputs.size());
  const int32_t* out = m.ws.host_outputs.as<int32_t>();
  for (size_t r = 0; r < batch.outputs.size(); ++r) {
    RowResult& row = result->rows[r];
    row.token = batch.outputs[r].sample ? out[r] : -1;
    row.finite = out[m.ws.sizes.max_outputs + r] == 0;
    if (batch.outputs[r].want_logits) {
      const float* l = m.ws.host_logits.as<float>() + r * V;
      row.logits.assign(l, l + V);
    }
  }
  const size_t tap_n = static_cast<size_t>(batch.num_rows()) * m.cfg.hidden_size;
  for (size_t t = 0; t < batch.hidden_taps.size(); ++t) {
    const float* h = m.ws.host_taps.as<float>() + t * static_cast<size_t>(m.T) * m.cfg.hidden_size;
    result->hidden.emplace_back(h, h + tap_n);
  }
  return Status::Ok();
}

Result<std::pair<std::vector<float>, std::vector<float>>> CudaRunner::KvPoolAbsMax() {
  if (impl_->kv.dtype != DType::kBF16) return FailedPrecondition("KvPoolAbsMax needs a BF16 cache");
  cudaStream_t s = impl_->s();
  DL_ASSIGN_OR_RETURN(auto scratch, cuda::DeviceBuffer::Create(sizeof(float)));
  std::vector<float> k, v;
  for (auto& L : impl_->layers) {
    for (auto* which : {&L.k_pool, &L.v_pool}) {
      // The pages the cache hands out; the last (padding) page is left out.
      const int64_t n = static_cast<int64_t>((which->size() - impl_->kv.page_bytes()) / 2);
      DL_RETURN_IF_ERROR(kernels::AbsMaxBf16(which->as<bf16>(), n, scratch.as<float>(), s));
      float amax = 0;
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&amax, scratch.data(), 4, cudaMemcpyDeviceToHost, s));
      DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
      (which == &L.k_pool ? k : v).push_back(amax);
    }
  }
  return std::make_pair(k, v);
}

nlohmann::json CudaRunner::Describe() const {
  const Impl& m = *impl_;
  std::vector<std::string> unique = m.layer_presets;
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  nlohmann::json graphs = nlohmann::json::array();
  for (const auto& [key, nodes] : m.graphs.Captured()) graphs.push_back({{"graph", key.Name()}, {"kernel_nodes", nodes}});
  nlohmann::json tuning = nlohmann::json::object();
  for (const auto& [name, value] : kernels::TuningSettings(m.opt.tuning)) tuning[name] = value;
  const int nodes = m.decode_kernel_nodes;
  // The communicator, with its all-reduce size rule where it has one ("device-oneshot+two-shot>=524288").
  std::string collectives = m.comm != nullptr ? m.comm->transport() : "none";
  if (m.comm != nullptr && !m.comm->all_reduce_rule().empty()) collectives += "+" + m.comm->all_reduce_rule();
  nlohmann::json d = {{"backend", "cuda"},
          {"device", m.device_name},
          {"kernel_presets", unique},
          {"layer_presets", m.layer_presets},
          {"fallback", m.fallback},
          {"fallback_ops", m.fallback_ops},
          {"topology",
           {{{"rank", m.rank},
             {"kernel_nodes", nodes},
             {"collectives", m.collectives_last_forward},
             {"transport", m.comm != nullptr ? m.comm->transport() : "none"},
             // Under tensor parallelism the communicator and its size rule are part of what the graph is.
             {"signature", m.comm != nullptr ? fmt::format("{}/{}/{}", nodes, m.collectives_last_forward, collectives)
                                             : fmt::format("{}/{}", nodes, m.collectives_last_forward)}}}},
          {"graphs", graphs},
          {"kv_dtype", std::string(DTypeName(m.kv.dtype))},
          {"page_size", m.kv.page_size},
          {"graph", m.opt.use_graph},
          {"max_rows", m.ws.sizes.max_rows},
          {"max_outputs", m.ws.sizes.max_outputs},
          {"dependent_launch", kernels::DependentLaunchEnabled()},
          {"skipped_ops", m.opt.skip_ops},
          {"tuning", tuning},
          // The library GEMM's algorithms fixed so far (prompt rows' bits depend on them and on the
          // cuBLASLt version they name; kernels/ops.h 5c).
          {"library_gemm", kernels::LibraryGemmAlgorithmsInUse()},
          {"workspace_bytes", m.ws.device_bytes},
          {"weight_bytes", m.weights->bytes()}};
  if (m.tp_size > 1) {
    d["tensor_parallel_rank"] = {{"rank", m.rank},
                                 {"size", m.tp_size},
                                 {"device", m.opt.device},
                                 {"transport", m.comm->transport()},
                                 {"all_reduce_rule", m.comm->all_reduce_rule()},
                                 {"graphs", m.comm->capturable() && m.opt.use_graph},
                                 {"q_heads_layer0", m.cfg.heads(0)},
                                 {"kv_heads", m.cfg.num_key_value_heads},
                                 {"lm_head_vocab", {m.vocab_slices[m.rank].begin, m.vocab_slices[m.rank].end()}},
                                 {"collectives_last_forward", m.collectives_last_forward}};
  }
  return d;
}

Result<std::unique_ptr<DflashRunner>> CudaRunner::MakeDflashRunner(const DflashCheckpoint& drafter) const {
  const Impl& m = *impl_;
  if (m.tp_size > 1) {
    return Unimplemented("the DFlash drafter on CUDA needs the whole embedding and LM head; rank {} of {} holds slices",
                         m.rank, m.tp_size);
  }
  CudaDflashOptions o;
  o.device = m.opt.device;
  o.max_seq_len = m.opt.max_seq_len;
  o.allow_fallback = m.opt.allow_fallback;
  o.tuning = m.opt.tuning;
  const LagunaWeights& w = m.weights->refs();
  DL_ASSIGN_OR_RETURN(auto runner, CudaDflashRunner::Create(drafter, w.embed, w.lm_head, o));
  return std::unique_ptr<DflashRunner>(std::move(runner));
}

#else  // no CUDA backend in this build

struct CudaRunner::Impl {};
CudaRunner::CudaRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaRunner::~CudaRunner() = default;
Result<std::unique_ptr<CudaRunner>> CudaRunner::Create(const Checkpoint&, const KvCacheSpec&, KvScales,
                                                       const CudaRunnerOptions&) {
  return Unavailable("--backend cuda: this build of decodelab has no CUDA backend");
}
Result<std::unique_ptr<CudaRunner>> CudaRunner::CreateRank(const Checkpoint&, const KvCacheSpec&, KvScales,
                                                           const CudaRunnerOptions&, const TensorParallelPlan&, int,
                                                           comm::DeviceCommunicator*) {
  return Unavailable("--backend cuda: this build of decodelab has no CUDA backend");
}
int64_t CudaRunner::collectives_last_forward() const { return 0; }
static const KvCacheSpec kNoSpec;
static const KvScales kNoScales;
static const std::vector<std::string> kNoPresets;
const KvCacheSpec& CudaRunner::kv_spec() const { return kNoSpec; }
const KvScales& CudaRunner::kv_scales() const { return kNoScales; }
int32_t CudaRunner::max_rows() const { return 0; }
int32_t CudaRunner::max_outputs() const { return 0; }
int32_t CudaRunner::max_taps() const { return 0; }
Status CudaRunner::Launch(const ForwardBatch&) { return Unavailable("no CUDA backend in this build"); }
Status CudaRunner::Prepare(const ForwardBatch&) { return Unavailable("no CUDA backend in this build"); }
Status CudaRunner::Submit() { return Unavailable("no CUDA backend in this build"); }
Status CudaRunner::Wait(ForwardResult*) { return Unavailable("no CUDA backend in this build"); }
Result<std::pair<std::vector<float>, std::vector<float>>> CudaRunner::KvPoolAbsMax() {
  return Unavailable("no CUDA backend in this build");
}
nlohmann::json CudaRunner::Describe() const { return {{"backend", "cuda"}, {"available", false}}; }
int CudaRunner::kernel_nodes() const { return 0; }
const std::vector<std::string>& CudaRunner::layer_presets() const { return kNoPresets; }
bool CudaRunner::fallback() const { return false; }
Result<std::unique_ptr<DflashRunner>> CudaRunner::MakeDflashRunner(const DflashCheckpoint&) const {
  return Unavailable("no CUDA backend in this build");
}

#endif

}  // namespace dl
