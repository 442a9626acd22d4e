// The preset registry: presets.def (all presets) + the generated list of presets built into this
// binary, mapped to their launchers. Resolving never falls back silently.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kernels/attention/attention.h"

namespace dl::kernels {

Status LaunchAttentionFallback(const AttentionParams& p, Stream stream);

#define DL_BUILT_PRESET(name, d, g, p, kv, win) \
  namespace presets {                           \
  Status Launch_##name(const AttentionParams&, Stream); \
  Status Launch_##name##_prompt(const AttentionParams&, Stream); \
  }
#include "kernels/attention/attention_presets_built.inc"
#undef DL_BUILT_PRESET

namespace {

constexpr KvDtype fp8 = KvDtype::kFp8;
constexpr KvDtype bf16 = KvDtype::kBf16;
constexpr WindowKind global = WindowKind::kGlobal;
constexpr WindowKind sliding = WindowKind::kSliding;

struct TableRow {
  AttnPresetKey key;
  bool in_default_set;
};
const TableRow kTable[] = {
#define DL_ATTN_PRESET(d, g, p, kv, win, def) {{d, g, p, kv, win}, def != 0},
#include "kernels/attention/presets.def"
#undef DL_ATTN_PRESET
};

struct BuiltRow {
  const char* name;
  AttnPresetKey key;
  AttentionLaunchFn launch;
  AttentionLaunchFn launch_prompt;
};
const BuiltRow kBuilt[] = {
#define DL_BUILT_PRESET(name, d, g, p, kv, win) \
  {#name, {d, g, p, kv, win}, &presets::Launch_##name, &presets::Launch_##name##_prompt},
#include "kernels/attention/attention_presets_built.inc"
#undef DL_BUILT_PRESET
    {nullptr, {}, nullptr, nullptr},  // keeps the array non-empty in CPU-only builds
};

}  // namespace

const char* AttnKindName(AttnKind kind) { return kind == AttnKind::kPrompt ? "prompt" : "decode"; }

std::string CanonicalName(const AttnPresetKey& k) {
  return fmt::format("attn_d{}_g{}_p{}_{}_{}", k.head_dim, k.group, k.page_size,
                     KvDtypeName(k.kv_dtype), WindowKindName(k.window));
}

AttnPresetKey PresetKeyOf(const AttentionParams& p) {
  AttnPresetKey k;
  k.head_dim = p.head_dim;
  k.group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
  k.page_size = p.page_size;
  k.kv_dtype = p.kv_dtype;
  k.window = p.window_kind;
  return k;
}

std::vector<PresetInfo> AllPresets() {
  std::vector<PresetInfo> out;
  for (const TableRow& row : kTable) {
    PresetInfo info;
    info.key = row.key;
    info.name = CanonicalName(row.key);
    info.in_default_set = row.in_default_set;
    info.built = std::any_of(std::begin(kBuilt), std::end(kBuilt),
                             [&](const BuiltRow& b) { return b.name && b.key == row.key; });
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<std::string> BuiltPresetNames() {
  std::vector<std::string> out;
  for (const BuiltRow& b : kBuilt)
    if (b.name) out.push_back(b.name);
  return out;
}

Result<AttentionKernel> ResolveAttention(const AttnPresetKey& key, bool allow_fallback) {
  for (const BuiltRow& b : kBuilt) {
    if (b.name && b.key == key) return AttentionKernel{b.name, false, b.launch, b.launch_prompt};
  }
  if (allow_fallback) {
    return AttentionKernel{"attn_generic_fallback", true, &LaunchAttentionFallback, &LaunchAttentionFallback};
  }
  const std::vector<std::string> built = BuiltPresetNames();
  const bool in_table = std::any_of(std::begin(kTable), std::end(kTable),
                                    [&](const TableRow& r) { return r.key == key; });
  return NotFound(
      "attention preset {} is not built into this binary ({}); built presets: [{}]. Rebuild with "
      "-DDECODELAB_ATTN_PRESETS including it{}, or pass --allow-fallback to run the slow generic "
      "kernel (a fallback run is never a speed result)",
      CanonicalName(key), in_table ? "it is in presets.def" : "it is not in presets.def either",
      fmt::join(built, ", "), in_table ? "" : " after adding it to presets.def");
}

int AttentionMaxChunks(const AttentionParams& p) {
  const int global_chunks = std::max(p.max_position, 0) / kAttnChunk + 1;
  if (p.window_kind == WindowKind::kSliding && p.window > 0) {
    return std::min(global_chunks, (p.window - 1 + kAttnChunk - 1) / kAttnChunk + 1);
  }
  return global_chunks;
}

bool AttentionUsesMultiRow(const AttentionParams& p) {
  return p.multi_row_min_tokens > 0 && p.num_tokens >= p.multi_row_min_tokens;
}

int AttentionMultiRowChunks(const AttentionParams& p) {
  const int global_chunks = std::max(p.max_position, 0) / kAttnChunk + 1;
  if (p.window_kind == WindowKind::kSliding && p.window > 0) {
    // R rows at positions q..q+R-1 see keys from q-W+1 to q+R-1: W+R-1 positions, which can straddle
    // (W+R-2)/C + 2 chunks. A block whose rows do not fit (several sequences, positions not
    // consecutive) splits them into sets that do; one row always fits (AttentionMaxChunks).
    const int span = (p.window + kAttnMultiRows - 2) / kAttnChunk + 2;
    return std::max(std::min(global_chunks, span), AttentionMaxChunks(p));
  }
  return global_chunks;
}

size_t AttentionWorkspaceBytes(const AttentionParams& p) {
  return static_cast<size_t>(p.num_tokens) * p.num_q_heads * AttentionMaxChunks(p) *
         (static_cast<size_t>(p.head_dim) + 2) * sizeof(float);
}

Status ValidateAttentionParams(const AttentionParams& p) {
  const std::string name = CanonicalName(PresetKeyOf(p));
  auto bad = [&](const char* what) {
    return InvalidArgument("attention ({}): {}", name, what);
  };
  if (!p.q || !p.k_pool || !p.v_pool || !p.block_table || !p.out) {
    return bad("q, k_pool, v_pool, block_table and out must be set");
  }
  if (p.num_tokens < 1 || p.num_q_heads < 1 || p.num_kv_heads < 1) return bad("empty shape");
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return InvalidArgument("attention ({}): {} query heads is not a multiple of {} KV heads", name,
                           p.num_q_heads, p.num_kv_heads);
  }
  if (p.head_dim < 8 || p.head_dim > 256 || p.head_dim % 8 != 0) {
    return InvalidArgument("attention ({}): head_dim {} must be a multiple of 8 in [8, 256]", name,
                           p.head_dim);
  }
  if (p.page_size < 1) return bad("page_size must be positive");
  if (p.window_kind == WindowKind::kSliding && p.window < 1) {
    return bad("a sliding layer needs window >= 1");
  }
  if (!p.positions && p.first_position + p.num_tokens - 1 > p.max_position) {
    return InvalidArgument("attention ({}): last query position {} exceeds max_position {}", name,
                           p.first_position + p.num_tokens - 1, p.max_position);
  }
  if (p.first_position < 0) return bad("negative position");
  if (p.gate && p.gate_stride <= 0) return bad("gate needs gate_stride");
  if (p.token_seq && p.block_table_stride < 1) return bad("token_seq needs block_table_stride");
  return Status::Ok();
}

Status RunAttention(const AttentionKernel& kernel, const AttentionParams& p, Stream stream, AttnKind kind) {
  DL_RETURN_IF_ERROR(ValidateAttentionParams(p));
  const AttentionLaunchFn launch = kind == AttnKind::kPrompt ? kernel.launch_prompt : kernel.launch;
  if (!launch) {
    return InvalidArgument("attention kernel {} has no {} launcher", kernel.name, AttnKindName(kind));
  }
  if (!kernel.fallback) {
    const std::string want = CanonicalName(PresetKeyOf(p));
    if (want != kernel.name) {
      return InvalidArgument("attention kernel {} cannot run parameters of preset {}", kernel.name,
                             want);
    }
    if (kind == AttnKind::kPrompt) return launch(p, stream);  // no workspace, no counters, any row count
    const size_t need = AttentionWorkspaceBytes(p);
    if (!p.workspace || p.workspace_bytes < need) {
      return InvalidArgument("attention ({}): workspace of {} bytes, need {}", kernel.name,
                             p.workspace_bytes, need);
    }
    if (!p.counters) {
      return InvalidArgument("attention ({}): counters ([T x K] words, zeroed) must be set", kernel.name);
    }
    if (p.multi_row_min_tokens < 0) {
      return InvalidArgument("attention ({}): multi_row_min_tokens {} must be >= 0 (0 = never)", kernel.name,
                             p.multi_row_min_tokens);
    }
    if (AttentionUsesMultiRow(p)) {
      const int groups = (p.num_tokens + kAttnMultiRows - 1) / kAttnMultiRows;
      if (groups > kAttnMaxGridRows) {
        return InvalidArgument("attention ({}): {} rows need {} row groups of {}; a launch takes at most {}",
                               kernel.name, p.num_tokens, groups, kAttnMultiRows, kAttnMaxGridRows);
      }
    } else if (p.num_tokens > kAttnMaxGridRows) {
      return InvalidArgument(
          "attention ({}): {} rows exceed the one-row kernel's {} per launch; the multi-row kernel takes "
          "them (multi_row_min_tokens {}, 0 = never)",
          kernel.name, p.num_tokens, kAttnMaxGridRows, p.multi_row_min_tokens);
    }
  }
  return launch(p, stream);
}

}  // namespace dl::kernels
