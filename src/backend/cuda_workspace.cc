#include "backend/cuda_workspace.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/check.h"
#include "kernels/attention/attention.h"
#include "kernels/ops.h"

namespace dl {

namespace {

// Hands out 256-byte aligned offsets, then turns them into pointers into one allocation.
class ArenaPlan {
 public:
  template <typename T>
  void Add(T** slot, size_t count) {
    offset_ = (offset_ + 255) & ~size_t{255};
    items_.push_back({reinterpret_cast<void**>(slot), offset_});
    offset_ += std::max<size_t>(count, 1) * sizeof(T);
  }
  void AddBytes(void** slot, size_t bytes) {
    offset_ = (offset_ + 255) & ~size_t{255};
    items_.push_back({slot, offset_});
    offset_ += std::max<size_t>(bytes, 1);
  }
  size_t size() const { return offset_; }
  void Bind(char* base) const {
    for (const Item& i : items_) *i.slot = base + i.offset;
  }

 private:
  struct Item {
    void** slot;
    size_t offset;
  };
  std::vector<Item> items_;
  size_t offset_ = 0;
};

}  // namespace

Result<CudaWorkspace> CudaWorkspace::Create(const ModelConfig& c, const CudaWorkspaceSizes& z) {
  CudaWorkspace w;
  w.sizes = z;
  const size_t T = static_cast<size_t>(z.max_rows), R = static_cast<size_t>(z.max_outputs);
  const size_t d = static_cast<size_t>(c.hidden_size), V = static_cast<size_t>(c.vocab_size);
  const int64_t D = c.head_dim, K = c.num_key_value_heads;
  int64_t max_qkvg = 0, max_attn = 0, max_ffn = c.intermediate_size;
  size_t attn_ws = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t H = c.heads(l);
    max_qkvg = std::max(max_qkvg, c.qkvg_width(l));
    max_attn = std::max(max_attn, H * D);
    kernels::AttentionParams ap;
    ap.num_tokens = std::min(z.max_rows, z.max_split_attention_rows);
    ap.num_q_heads = static_cast<int>(H);
    ap.num_kv_heads = static_cast<int>(K);
    ap.head_dim = static_cast<int>(D);
    ap.max_position = z.max_seq_len - 1;
    ap.window_kind = c.is_sliding(l) ? kernels::WindowKind::kSliding : kernels::WindowKind::kGlobal;
    ap.window = static_cast<int>(c.sliding_window);
    attn_ws = std::max(attn_ws, kernels::AttentionWorkspaceBytes(ap));
  }
  if (c.num_experts > 0) max_ffn = std::max(max_ffn, c.moe_intermediate_size);
  ArenaPlan plan;
  // Inputs first, contiguous, in the pinned mirror's order.
  plan.Add(&w.ids, T);
  plan.Add(&w.positions, T);
  plan.Add(&w.token_seq, T);
  plan.Add(&w.history, T);
  plan.Add(&w.out_rows, R);
  plan.Add(&w.sampling, R);
  plan.Add(&w.tables, 2 * static_cast<size_t>(z.max_seqs) * z.max_pages);
  plan.Add(&w.adjustments, static_cast<size_t>(z.max_adjustments));
  plan.Add(&w.tokens, 2 * R);
  for (auto& r : w.residual) plan.Add(&r, T * d);
  plan.Add(&w.normed, T * d);
  plan.Add(&w.delta, T * d);
  plan.Add(&w.qkvg, T * max_qkvg);
  plan.Add(&w.q, T * max_attn);
  plan.Add(&w.attn, T * max_attn);
  plan.Add(&w.gate_up, T * 2 * max_ffn);
  plan.Add(&w.hidden, T * max_ffn);
  plan.Add(&w.out_normed, R * d);
  plan.Add(&w.logits, R * V);
  plan.Add(&w.logits_f32, R * V);
  plan.Add(&w.sample_scratch, 2 * R * V);
  plan.Add(&w.taps, static_cast<size_t>(z.max_taps) * T * d);
  plan.Add(&w.taps_f32, static_cast<size_t>(z.max_taps) * T * d);
  plan.AddBytes(&w.attn_ws, attn_ws);
  w.attn_ws_bytes = attn_ws;
  plan.Add(&w.attn_counters, T * K);
  if (c.num_experts > 0) {
    const int k = static_cast<int>(c.num_experts_per_tok);
    plan.AddBytes(&w.moe_ws, kernels::MoeWorkspaceBytes(static_cast<int>(d), static_cast<int>(c.num_experts), k,
                                                        static_cast<int>(c.moe_intermediate_size),
                                                        static_cast<int>(c.shared_expert_intermediate_size),
                                                        z.max_rows));
    plan.Add(&w.moe_counter, T);
    plan.Add(&w.topk_ids, T * k);
    plan.Add(&w.topk_weights, T * k);
    plan.Add(&w.router_logits, T * c.num_experts);
  }
  plan.AddBytes(&w.argmax_ws, kernels::ArgmaxWorkspaceBytes(static_cast<int>(V)));
  plan.Add(&w.argmax_counter, 1);
  DL_ASSIGN_OR_RETURN(w.arena, cuda::DeviceBuffer::Create(plan.size()));
  DL_CUDA_RETURN_IF_ERROR(cudaMemset(w.arena.data(), 0, plan.size()));
  plan.Bind(w.arena.as<char>());
  w.device_bytes = plan.size();
  w.nonfinite = w.tokens + R;
  w.inputs_fixed_bytes = reinterpret_cast<char*>(w.adjustments) - reinterpret_cast<char*>(w.ids);
  const size_t inputs_bytes = w.inputs_fixed_bytes + static_cast<size_t>(z.max_adjustments) * sizeof(kernels::LogitAdjustment);
  DL_ASSIGN_OR_RETURN(w.host_inputs, cuda::PinnedBuffer::Allocate(inputs_bytes));
  DL_ASSIGN_OR_RETURN(w.host_outputs, cuda::PinnedBuffer::Allocate(2 * R * sizeof(int32_t)));
  DL_ASSIGN_OR_RETURN(w.host_logits, cuda::PinnedBuffer::Allocate(R * V * sizeof(float)));
  if (z.max_taps > 0) {
    DL_ASSIGN_OR_RETURN(w.host_taps, cuda::PinnedBuffer::Allocate(static_cast<size_t>(z.max_taps) * T * d * sizeof(float)));
  }
  return w;
}

}  // namespace dl

#endif  // DECODELAB_HAVE_CUDA
