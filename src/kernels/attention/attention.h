// Paged attention over the KV cache for one sequence: decode (T = 1) and prefill (a chunk of T query
// tokens) run the SAME per-row arithmetic: every query token is processed on its own, over fixed chunks
// of kAttnChunk absolute key positions, and the chunks are combined in ascending order. So a token's
// output does not depend on the page size, on how the prompt was chunked, or on whether it was
// prefilled or decoded (bit-identical). From multi_row_min_tokens rows on, a launch runs the
// multi-row kernel, whose blocks load a key chunk once for kAttnMultiRows rows and then do each row's
// arithmetic exactly as the one-row kernel does: the same bits, fewer K/V bytes. Kernels are instantiated per preset (presets.def); the
// registry maps a preset key to its launcher and never falls back silently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "kernels/common.h"

namespace dl::kernels {

struct AttentionParams {
  const bf16* q = nullptr;          // [T, H, D] after QK-norm and RoPE
  const void* k_pool = nullptr;     // [num_pages, P, K, D] BF16 or FP8 E4M3
  const void* v_pool = nullptr;     // [num_pages, P, K, D]
  const int32_t* block_table = nullptr;  // [max_pages]: position s lives in page block_table[s / P]
  // Rows of several sequences (a batch): row t's block table is block_table + token_seq[t] *
  // block_table_stride. nullptr: every row uses block_table.
  const int32_t* token_seq = nullptr;
  int32_t block_table_stride = 0;
  const int32_t* positions = nullptr;    // [T] query positions, or nullptr: first_position + t
  int32_t first_position = 0;
  // True when the keys at positions below row t's history (history[t]; without it, below the
  // launch's first query position, positions[0] or first_position) were written by EARLIER
  // launches: the kernel then loads them before waiting on the previous kernel (programmatic
  // dependent launch), overlapping that kernel's tail. Leave false unless that holds (the engine's
  // forwards: a sequence's earlier KV comes from earlier forwards; history = its length before).
  bool history_stable = false;
  const int32_t* history = nullptr;  // [T]
  // Upper bound of every query position; sizes the grid and the workspace, so a CUDA graph captured
  // with a large bound stays valid while positions (read from `positions`) grow.
  int32_t max_position = 0;
  int num_tokens = 1;    // T
  int num_q_heads = 0;   // H = K * G (query head i uses KV head i / G)
  int num_kv_heads = 0;  // K
  int head_dim = 0;      // D
  int page_size = 0;     // P
  KvDtype kv_dtype = KvDtype::kBf16;
  WindowKind window_kind = WindowKind::kGlobal;
  int window = 0;              // W (keys incl. the current one) for sliding layers
  float k_scale = 1.0f, v_scale = 1.0f;  // FP8 dequantisation scales
  float softmax_scale = 0.0f;  // 0 = D^-1/2
  // Softplus output gate: out = bf16(bf16(attn) * bf16(softplus(g))), g per head (gate[t*stride + h])
  // or per element (gate[t*stride + h*D + d]); nullptr = no gate.
  const bf16* gate = nullptr;
  int64_t gate_stride = 0;     // elements per token
  bool gate_per_element = false;
  bf16* out = nullptr;         // [T, H, D]
  void* workspace = nullptr;   // AttentionWorkspaceBytes(...); contents need no initialisation
  size_t workspace_bytes = 0;
  // [T * K] arrival tickets of the split kernel (the last chunk block of a (token, KV head) merges
  // the chunks); zero before first use, the kernel leaves them zero. Not used by the fallback.
  uint32_t* counters = nullptr;
  // Where a query's chunks number at most cluster_max_chunks (AttentionMaxChunks; capped at
  // kAttnMaxClusterChunks, sm_90): the chunk blocks of a (token, KV head) form a thread-block cluster,
  // keep their partials in shared memory and merge them through distributed shared memory after a
  // cluster barrier, every block taking a share of the outputs, instead of partials through L2, a
  // fence, an arrival ticket and one merging block. The same arithmetic in the same chunk order: the
  // same bits. 0 = never. The default 5 covers XS.2's sliding layers (window 512: 5 chunks), where
  // it was measured faster (kernel bench 14.4 -> 11.8 us; 1 chunk 8.7 -> 6.9 us); 8 chunks were
  // slower (13.1 -> 15.2 us, global ctx 1k); 2-4 and 6-7 are not measured.
  int cluster_max_chunks = 5;
  bool release_after_wait = false;  // PDL release point (Tuning::late_release)
  // From this many rows (num_tokens) on, the launch runs the multi-row kernel (blocks of
  // kAttnMultiRows rows; attention_kernel.cuh); below it, and always when 0, the one-row split kernel.
  // The same bits either way: a speed knob only (Tuning::attention_multi_row_min_tokens).
  int multi_row_min_tokens = 512;
};
inline constexpr int kAttnMaxClusterChunks = 8;  // the portable cluster size
// Query rows per block of the multi-row kernel: a block loads one key chunk once for this many
// consecutive rows (attention_kernel.cuh explains the choice).
inline constexpr int kAttnMultiRows = 16;
// Blocks a grid dimension y or z can hold: the split kernel's rows, the multi-row kernel's row groups.
inline constexpr int kAttnMaxGridRows = 65535;

// Chunks a query's keys can span: grid width of the split-KV kernel, and the partial slots per
// (row, query head) in the workspace (both kernels use the same layout).
int AttentionMaxChunks(const AttentionParams& p);
// Whether RunAttention runs the multi-row kernel for p (multi_row_min_tokens).
bool AttentionUsesMultiRow(const AttentionParams& p);
// Grid width of the multi-row kernel: the absolute chunks kAttnMultiRows rows of consecutive positions
// can span together (global: AttentionMaxChunks; sliding: up to (W + R - 2) / C + 2, never fewer than
// AttentionMaxChunks).
int AttentionMultiRowChunks(const AttentionParams& p);
// Covers either kernel: the multi-row kernel writes each row's partials into the row's own slots.
size_t AttentionWorkspaceBytes(const AttentionParams& p);

// ---- Presets ---------------------------------------------------------------------------------------
struct AttnPresetKey {
  int head_dim = 128;
  int group = 8;       // G = H / K
  int page_size = 32;
  KvDtype kv_dtype = KvDtype::kFp8;
  WindowKind window = WindowKind::kSliding;
  // Spelled out (not `= default`): CUDA translation units are compiled as C++17.
  bool operator==(const AttnPresetKey& o) const {
    return head_dim == o.head_dim && group == o.group && page_size == o.page_size &&
           kv_dtype == o.kv_dtype && window == o.window;
  }
};
// "attn_d128_g8_p32_fp8_sliding": the one canonical name, used in logs, ledgers and reports.
std::string CanonicalName(const AttnPresetKey& key);
AttnPresetKey PresetKeyOf(const AttentionParams& p);

struct PresetInfo {
  AttnPresetKey key;
  std::string name;
  bool in_default_set = false;  // built when DECODELAB_ATTN_PRESETS is not given
  bool built = false;           // compiled into this binary
};
// Every preset of presets.def, in table order, with its build status.
std::vector<PresetInfo> AllPresets();
// Names of the presets compiled into this binary.
std::vector<std::string> BuiltPresetNames();

// The two kernels every preset builds. kDecode: the split-KV kernel (and its multi-row form), CUDA
// cores, the same bits for a row whatever launch it is in; decode, verify and every generated row.
// kPrompt: the tensor-core prompt kernel (prompt_attention_kernel.cuh), rows of a prompt chunk:
// another exactness class (BF16 probabilities), chunk-, page- and batch-invariant within itself.
enum class AttnKind { kDecode, kPrompt };
const char* AttnKindName(AttnKind kind);

using AttentionLaunchFn = Status (*)(const AttentionParams&, Stream);
struct AttentionKernel {
  std::string name;       // canonical preset name, or "attn_generic_fallback"
  bool fallback = false;  // true for the slow generic path: a run using it is not a speed result
  AttentionLaunchFn launch = nullptr;         // AttnKind::kDecode
  AttentionLaunchFn launch_prompt = nullptr;  // AttnKind::kPrompt (the fallback: the same generic kernel)
};
// The preset's launcher. A key not built is NotFound, naming the key and listing the built presets,
// unless allow_fallback, which returns the generic slow kernel marked fallback = true.
Result<AttentionKernel> ResolveAttention(const AttnPresetKey& key, bool allow_fallback = false);
// Validates p and runs the kernel of that kind (attention, chunk merge and gate in one launch). The
// prompt kind needs no workspace or counters.
Status RunAttention(const AttentionKernel& kernel, const AttentionParams& p, Stream stream,
                    AttnKind kind = AttnKind::kDecode);

// Checks shapes, pointers and workspace against the preset/kernel; shared by launchers.
Status ValidateAttentionParams(const AttentionParams& p);

}  // namespace dl::kernels
