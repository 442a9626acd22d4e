#include "kernels/tuning.h"

#include <charconv>

#include <fmt/format.h>

namespace dl::kernels {
namespace {

struct Setting {
  const char* name;
  const char* help;
  int lo, hi;      // integer range (bools: 0..1)
  bool is_bool;
  int Tuning::*i;  // integer field, or
  bool Tuning::*b; // boolean field
};

constexpr Setting kSettings[] = {
    {"dependent_launch", "programmatic dependent launch between decode kernels (0 = off, A/B only)", 0, 1, true, nullptr, &Tuning::dependent_launch},
    {"l2_prefetch", "warm L2 before each PDL wait with the small data read right after it", 0, 1, true, nullptr, &Tuning::l2_prefetch},
    {"attention_cluster_max_chunks", "attention merges up to this many key chunks in a cluster (0 = never)", 0, 8, false, &Tuning::attention_cluster_max_chunks, nullptr},
    {"attention_multi_row_min_tokens", "attention: the multi-row (prefill) kernel from this many rows on (0 = never; same bits)", 0, 1 << 30, false, &Tuning::attention_multi_row_min_tokens, nullptr},
    {"stream_gemv", "batch-1 dense GEMVs stream weights through shared memory (TMA bulk copies)", 0, 1, true, nullptr, &Tuning::stream_gemv},
    {"stream_ring_kb", "streaming GEMV: shared-memory ring size", 8, 200, false, &Tuning::stream_ring_kb, nullptr},
    {"stream_stage_kb", "streaming GEMV: bytes per bulk copy", 1, 128, false, &Tuning::stream_stage_kb, nullptr},
    {"stream_prefetch_kb", "streaming GEMV: bytes copied before the PDL wait", 0, 200, false, &Tuning::stream_prefetch_kb, nullptr},
    {"oproj_prefetch_kb", "o_proj's streaming GEMV: bytes copied before the PDL wait", 0, 200, false, &Tuning::oproj_prefetch_kb, nullptr},
    {"moe_gate_up_stream_kb", "batch-1 MoE gate/up ring size (0 = register kernel)", 0, 200, false, &Tuning::moe_gate_up_stream_kb, nullptr},
    {"moe_router_rows_min_tokens", "MoE router: 8 token rows per block from this many tokens (0 = never; same bits)", 0, 65535, false, &Tuning::moe_router_rows_min_tokens, nullptr},
    {"batch_gemv_rows", "batched GEMV: output rows per warp (1, 2 or 4; 0 = by token count)", 0, 4, false, &Tuning::batch_gemv_rows, nullptr},
    {"batch_gemv_tokens", "batched GEMV: tokens per pass over the weights (4, 8 or 16)", 4, 16, false, &Tuning::batch_gemv_tokens, nullptr},
    {"mma_products", "linear layers on the tensor-core product at every row count (other bits than 0, the same for every batch)", 0, 1, true, nullptr, &Tuning::mma_products},
    {"prompt_mma", "prompt rows on the tensor-core product, generated rows on mma_products' choice (other bits for prompt rows than 0)", 0, 1, true, nullptr, &Tuning::prompt_mma},
    {"prompt_attention", "prompt rows' attention on the tensor-core prompt kernel when prompt_mma is on (other bits for prompt rows than 0)", 0, 1, true, nullptr, &Tuning::prompt_attention},
    {"mma_tiled_min_tokens", "tensor-core product: rows from which the tiled kernel runs (same bits)", 1, 1 << 30, false, &Tuning::mma_tiled_min_tokens, nullptr},
    {"prompt_gemm", "prompt rows' dense linear layers on the library GEMM (cuBLASLt, one algorithm per shape) when prompt_mma is on; 0 = the tensor-core product (other bits for prompt rows)", 0, 1, true, nullptr, &Tuning::prompt_gemm},
    {"prompt_fp8_mma", "prompt rows' FP8 weights on the tensor-core product (codes exact in BF16, a scale per block column's sum) when prompt_mma is on; 0 = the CUDA-core FP8 rule (other bits for prompt rows)", 0, 1, true, nullptr, &Tuning::prompt_fp8_mma},
    {"tp_two_shot_min_kb", "tensor parallel: all-reduces of at least this many KiB take the two-shot kernel, smaller ones one-shot (same bits; 0 = one-shot always)", 0, 1 << 20, false, &Tuning::tp_two_shot_min_kb, nullptr},
};

std::string ValueOf(const Tuning& t, const Setting& s) {
  return s.is_bool ? (t.*s.b ? "1" : "0") : std::to_string(t.*s.i);
}

bool ParseInt(std::string_view s, int* out) {
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

std::string LateReleaseList(unsigned bits) {
  std::string out;
  for (size_t k = 0; k < std::size(kLateReleaseNames); ++k) {
    if (!((bits >> k) & 1u)) continue;
    if (!out.empty()) out += ',';
    out += kLateReleaseNames[k];
  }
  return out;
}

Status SetTuning(Tuning* t, std::string_view assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string_view::npos) {
    return InvalidArgument("--tune takes name=value (got \"{}\"); names: see --help", assignment);
  }
  const std::string_view name = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  if (name == "late_release") {
    unsigned bits = 0;
    std::string_view list = value == "none" ? std::string_view() : value;
    while (!list.empty()) {
      const size_t comma = list.find(',');
      const std::string_view item = list.substr(0, comma);
      size_t k = 0;
      while (k < std::size(kLateReleaseNames) && item != kLateReleaseNames[k]) ++k;
      if (k == std::size(kLateReleaseNames)) {
        return InvalidArgument("--tune late_release: unknown kernel \"{}\" (known: {}, or none)", item,
                               fmt::join(kLateReleaseNames, ","));
      }
      bits |= 1u << k;
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
    }
    t->late_release = bits;
    return Status::Ok();
  }
  for (const Setting& s : kSettings) {
    if (name != s.name) continue;
    int v = 0;
    if (!ParseInt(value, &v) || v < s.lo || v > s.hi) {
      return InvalidArgument("--tune {}: \"{}\" is not an integer in [{}, {}]", name, value, s.lo, s.hi);
    }
    if (s.is_bool) {
      t->*s.b = v != 0;
    } else {
      if (name == "batch_gemv_rows" && v == 3) return InvalidArgument("--tune batch_gemv_rows: 0, 1, 2 or 4");
      if (name == "batch_gemv_tokens" && v != 4 && v != 8 && v != 16) {
        return InvalidArgument("--tune batch_gemv_tokens: 4, 8 or 16");
      }
      t->*s.i = v;
    }
    return Status::Ok();
  }
  return InvalidArgument("--tune: unknown setting \"{}\" (known: late_release, {})", name, [] {
    std::string names;
    for (const Setting& s : kSettings) names += (names.empty() ? "" : ", ") + std::string(s.name);
    return names;
  }());
}

std::vector<std::pair<std::string, std::string>> TuningSettings(const Tuning& t) {
  std::vector<std::pair<std::string, std::string>> out;
  out.emplace_back("late_release", t.late_release ? LateReleaseList(t.late_release) : "none");
  for (const Setting& s : kSettings) out.emplace_back(s.name, ValueOf(t, s));
  return out;
}

std::string TuningString(const Tuning& t) {
  std::string out;
  for (const auto& [name, value] : TuningSettings(t)) {
    out += (out.empty() ? "" : " ") + name + "=" + value;
  }
  return out;
}

std::string TuningHelp() {
  const Tuning d;
  std::string out = "Kernel tuning, name=value (repeatable; every value gives the same bits except mma_products,\n"
                    "which picks the linear layers' product and with it their bits):\n";
  out += fmt::format("  late_release (default {}): kernels releasing their successor after their PDL wait: "
                     "a comma list of {} or none\n",
                     LateReleaseList(d.late_release), fmt::join(kLateReleaseNames, ","));
  for (const Setting& s : kSettings) out += fmt::format("  {} (default {}): {}\n", s.name, ValueOf(d, s), s.help);
  return out;
}

}  // namespace dl::kernels
