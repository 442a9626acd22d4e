// The CUDA backend's memory for one forward, sized once from the largest batch it takes (token rows,
// output rows) and the longest sequence: activations, kernel workspaces, the batch's inputs and
// outputs. One device allocation (an arena carved at fixed offsets) and one pinned host allocation
// mirror each other for the inputs and outputs, so a step's inputs go up in one copy and its outputs
// come back in one. CUDA builds only.
#pragma once

#if defined(DECODELAB_HAVE_CUDA)

#include <cstddef>
#include <cstdint>

#include "cuda/buffer.h"
#include "cuda/memory.h"
#include "kernels/common.h"
#include "kernels/sampling.h"
#include "kv_cache/kv_cache.h"
#include "model/config.h"

namespace dl {

struct CudaWorkspaceSizes {
  int32_t max_rows = 1;     // token rows per forward
  int32_t max_outputs = 1;  // output rows per forward
  int32_t max_seqs = 2;     // block-table rows (sequences + the padding rows' dummy sequence)
  int32_t max_pages = 1;    // block-table entries per sequence and group
  int32_t max_seq_len = 1;
  int32_t max_adjustments = 1 << 16;  // logit adjustments of one forward
  int32_t max_taps = 0;     // hidden-state taps
  // Rows of one split-KV attention launch (AttnKind::kDecode): its workspace holds partials for
  // every (row, query head, chunk of max_seq_len), so the runner launches longer runs of such rows
  // in pieces of this many (a row's bits do not depend on its launch) and the workspace stays the
  // same size whatever the prefill chunk.
  int32_t max_split_attention_rows = 512;
};

// Device pointers of the workspace. Inputs (written by one host-to-device copy from the pinned
// mirror, in this order) come first.
struct CudaWorkspace {
  using bf16 = kernels::bf16;
  CudaWorkspaceSizes sizes;
  // Inputs, [max_rows] / [max_outputs] / [2][max_seqs][max_pages] / [max_adjustments].
  int32_t* ids = nullptr;
  int32_t* positions = nullptr;
  int32_t* token_seq = nullptr;
  int32_t* history = nullptr;
  int32_t* out_rows = nullptr;
  kernels::DeviceRowSampling* sampling = nullptr;
  int32_t* tables = nullptr;  // group g, sequence s: tables + (g * max_seqs + s) * max_pages
  kernels::LogitAdjustment* adjustments = nullptr;
  size_t inputs_fixed_bytes = 0;  // bytes of the inputs before `adjustments`
  // Outputs (one device-to-host copy): [max_outputs] tokens then [max_outputs] non-finite flags.
  int32_t* tokens = nullptr;
  int32_t* nonfinite = nullptr;
  // Activations (BF16).
  bf16* residual[2] = {nullptr, nullptr};
  bf16* normed = nullptr;
  bf16* delta = nullptr;
  bf16* qkvg = nullptr;
  bf16* q = nullptr;
  bf16* attn = nullptr;
  bf16* gate_up = nullptr;
  bf16* hidden = nullptr;
  bf16* out_normed = nullptr;
  bf16* logits = nullptr;   // [max_outputs, V]
  float* logits_f32 = nullptr;
  float* sample_scratch = nullptr;  // [max_outputs, 2 * V]
  bf16* taps = nullptr;     // [max_taps, max_rows, d]
  float* taps_f32 = nullptr;
  // Kernel workspaces.
  void* attn_ws = nullptr;
  size_t attn_ws_bytes = 0;
  uint32_t* attn_counters = nullptr;
  void* moe_ws = nullptr;
  uint32_t* moe_counter = nullptr;
  int32_t* topk_ids = nullptr;
  float* topk_weights = nullptr;
  bf16* router_logits = nullptr;  // [max_rows, E]: prompt rows' router logits (Tuning::prompt_gemm)
  void* argmax_ws = nullptr;
  uint32_t* argmax_counter = nullptr;

  // Pinned host mirrors: inputs (same layout as the device inputs), outputs, logits and taps.
  cuda::PinnedBuffer host_inputs, host_outputs, host_logits, host_taps;
  // The mirror of an input array (at the same offset from `ids` in host_inputs).
  template <typename T>
  T* host(T* device_ptr) const {
    return reinterpret_cast<T*>(host_inputs.as<char>() +
                                (reinterpret_cast<char*>(device_ptr) - reinterpret_cast<char*>(ids)));
  }

  size_t device_bytes = 0;
  cuda::DeviceBuffer arena;

  // Sizes every buffer for `config` (attention workspace from each layer's heads and the longest
  // sequence) and allocates them, zeroed.
  static Result<CudaWorkspace> Create(const ModelConfig& config, const CudaWorkspaceSizes& sizes);
};

}  // namespace dl

#endif  // DECODELAB_HAVE_CUDA
