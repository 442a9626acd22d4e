// decodelab make-model: writes a synthetic Laguna checkpoint (random but deterministic weights) in
// the exact layout transformers' save_pretrained writes, streaming it to disk.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include <fmt/ranges.h>

#include "apps/decodelab/commands.h"
#include "model/dflash.h"
#include "model/fp8_layout.h"
#include "model/model_writer.h"
#include "model/param_count.h"
#include "model/shapes.h"

namespace dl::app {
namespace {

std::atomic<bool> g_cancel{false};
extern "C" void OnInterrupt(int) { g_cancel.store(true); }

struct MakeModelFlags {
  std::string shape = "tiny";
  std::string out;
  uint64_t seed = 0;
  std::string dtype = "bf16";
  int num_layers = 0;
  std::string max_shard_size = "5GB";
  int threads = 2;
  // --dtype fp8 only (docs/fp8.md).
  std::string fp8_format, fp8_layout, fp8_scales;
  // A DFlash drafter (--shape tiny-dflash, --dflash-for DIR).
  std::string dflash_for;
  std::string dflash_layout = "poolside";
  int block_size = 8;
  bool shape_given = false, block_size_given = false, layout_given = false;
};

bool IsDrafter(const MakeModelFlags& f) { return f.shape == "tiny-dflash" || !f.dflash_for.empty(); }

// A random DFlash drafter for the target `tiny` (--shape tiny-dflash) or the checkpoint in
// --dflash-for DIR (or a built-in shape): hidden size, vocabulary and tap ids matching it, a transformers-layout config.
int RunMakeDrafter(const MakeModelFlags& f) {
  if (!f.dflash_for.empty() && f.shape_given) {
    return ReportError(InvalidArgument("give --dflash-for DIR or --shape tiny-dflash, not both"));
  }
  if (f.dtype != "bf16") return ReportError(InvalidArgument("a DFlash drafter is written in bf16 (got --dtype {})", f.dtype));
  if (!f.fp8_format.empty() || !f.fp8_layout.empty() || !f.fp8_scales.empty()) {
    return ReportError(InvalidArgument("--fp8-* flags do not apply to a DFlash drafter"));
  }
  // The target: tiny without --dflash-for; with it a checkpoint directory, or a built-in shape (a
  // `--shape` target of bench, generate, serve) where no directory of that name exists.
  const std::string target_name = f.dflash_for.empty() ? "tiny" : f.dflash_for;
  ModelConfig target;
  auto shape = ShapeConfig(target_name);
  if (shape.ok() && (f.dflash_for.empty() || !std::filesystem::exists(target_name))) {
    target = *shape;
  } else if (f.dflash_for.empty()) {
    return ReportError(shape.status());
  } else {
    auto c = ModelConfig::FromFile(target_name + "/config.json");
    if (!c.ok()) return ReportError(c.status().WithContext("--dflash-for (a checkpoint directory or tiny, xs2, s21)"));
    target = *c;
  }
  WriteDflashOptions o;
  o.layout = f.dflash_layout == "zlab" ? DflashLayout::kZlab : DflashLayout::kPoolside;
  o.config = DflashConfigFor(target, f.num_layers > 0 ? f.num_layers : 2, f.block_size,
                             o.layout == DflashLayout::kZlab ? DflashFamily::kZlab : DflashFamily::kLaguna);
  o.seed = f.seed;
  o.out_dir = f.out;
  if (Status st = o.config.CheckTarget(target); !st.ok()) return ReportError(st);
  std::fprintf(stderr, "make-model: DFlash drafter (%s layout) for a %lld-layer target: %lld layers, block %lld, taps "
               "[%s] -> %s\n", f.dflash_layout.c_str(), static_cast<long long>(target.num_hidden_layers),
               static_cast<long long>(o.config.num_hidden_layers), static_cast<long long>(o.config.block_size),
               fmt::format("{}", fmt::join(o.config.target_layer_ids, ",")).c_str(), f.out.c_str());
  if (Status st = WriteSyntheticDflash(o); !st.ok()) return ReportError(st);
  return 0;
}

int RunMakeModel(const MakeModelFlags& f) {
  if (IsDrafter(f)) return RunMakeDrafter(f);
  if (f.block_size_given || f.layout_given) {
    return ReportError(InvalidArgument("--block-size and --dflash-layout apply only to a DFlash drafter "
                                       "(--shape tiny-dflash or --dflash-for DIR)"));
  }
  std::optional<int> layers;
  if (f.num_layers > 0) layers = f.num_layers;
  auto config = ShapeConfig(f.shape, layers);
  if (!config.ok()) return ReportError(config.status());
  auto dtype = DTypeFromName(f.dtype);
  if (!dtype || (*dtype != DType::kBF16 && *dtype != DType::kF32 && *dtype != DType::kF8E4M3)) {
    return ReportError(InvalidArgument("--dtype must be bf16, f32 or fp8, got '{}'", f.dtype));
  }
  std::optional<Fp8Options> fp8;
  if (*dtype == DType::kF8E4M3) {
    fp8.emplace();
    if (!f.fp8_format.empty()) {
      auto v = ParseFp8Format(f.fp8_format);
      if (!v.ok()) return ReportError(v.status().WithContext("--fp8-format"));
      fp8->format = *v;
    }
    if (!f.fp8_layout.empty()) {
      auto v = ParseFp8Layout(f.fp8_layout);
      if (!v.ok()) return ReportError(v.status().WithContext("--fp8-layout"));
      fp8->layout = *v;
    }
    if (!f.fp8_scales.empty()) {
      auto v = ParseFp8Granularity(f.fp8_scales);
      if (!v.ok()) return ReportError(v.status().WithContext("--fp8-scales"));
      fp8->granularity = *v;
    }
    dtype = DType::kBF16;  // the tensors the layout leaves unquantised
  } else if (!f.fp8_format.empty() || !f.fp8_layout.empty() || !f.fp8_scales.empty()) {
    return ReportError(InvalidArgument("--fp8-format, --fp8-layout and --fp8-scales apply only with --dtype fp8"));
  }
  auto shard = ParseByteSize(f.max_shard_size);
  if (!shard.ok()) return ReportError(shard.status().WithContext("--max-shard-size"));

  MakeModelOptions o;
  o.config = *config;
  o.config.dtype = *dtype == DType::kF32 ? "float32" : "bfloat16";
  o.seed = f.seed;
  o.dtype = *dtype;
  o.fp8 = fp8;
  o.out_dir = f.out;
  o.max_shard_size = *shard;
  o.threads = f.threads;
  o.cancel = &g_cancel;
  const ParamCounts pc = CountParams(o.config);
  const std::string what =
      fp8 ? fmt::format("fp8 ({} format, {} layout, {} scales)", Fp8FormatName(fp8->format), Fp8LayoutName(fp8->layout),
                        Fp8GranularityName(fp8->granularity))
          : f.dtype;
  std::fprintf(stderr, "make-model: shape %s, %lld layers, %.3f M parameters, %s -> %s\n", f.shape.c_str(),
               static_cast<long long>(o.config.num_hidden_layers), pc.total / 1e6, what.c_str(), f.out.c_str());
  const bool tty = ::isatty(STDERR_FILENO);
  auto t0 = std::chrono::steady_clock::now();
  auto last = t0 - std::chrono::seconds(10);
  o.progress = [&](const MakeModelProgress& p) {
    const auto now = std::chrono::steady_clock::now();
    const bool done = p.bytes_done == p.bytes_total;
    if (!done && now - last < std::chrono::milliseconds(tty ? 500 : 10000)) return;
    last = now;
    const double s = std::chrono::duration<double>(now - t0).count();
    const double rate = s > 0 ? p.bytes_done / s : 0;
    const double eta = rate > 0 ? (p.bytes_total - p.bytes_done) / rate : 0;
    std::fprintf(stderr, "%s  %s  %.2f / %.2f GB (%.0f%%)  %.0f MB/s  ETA %.0f s%s", tty ? "\r" : "",
                 p.file.c_str(), p.bytes_done / 1e9, p.bytes_total / 1e9,
                 p.bytes_total ? 100.0 * p.bytes_done / p.bytes_total : 100.0, rate / 1e6, eta,
                 tty ? "   " : "\n");
    std::fflush(stderr);
  };
  auto prev_int = std::signal(SIGINT, OnInterrupt);
  auto prev_term = std::signal(SIGTERM, OnInterrupt);
  auto r = WriteSyntheticModel(o);
  std::signal(SIGINT, prev_int);
  std::signal(SIGTERM, prev_term);
  if (tty) std::fprintf(stderr, "\n");
  if (!r.ok()) return ReportError(r.status());
  std::fprintf(stderr, "wrote %zu safetensors file(s), %.2f GB in %.1f s (%.0f MB/s) to %s\n", r->files.size(),
               r->file_bytes / 1e9, r->seconds, r->seconds > 0 ? r->file_bytes / r->seconds / 1e6 : 0.0,
               f.out.c_str());
  return 0;
}

}  // namespace

void AddMakeModelCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<MakeModelFlags>();
  CLI::App* cmd = root.add_subcommand(
      "make-model",
      "Write a synthetic Laguna checkpoint (config.json, generation_config.json, safetensors) with\n"
      "deterministic random weights, in the layout transformers' save_pretrained writes. Large shapes\n"
      "stream to disk (free space is checked first; the directory appears only when complete).");
  cmd->add_option("--shape", flags->shape, "Model shape: tiny (spec §7), xs2 (Laguna-XS.2, ~67 GB BF16), "
                                           "s21 (Laguna S 2.1, ~235 GB BF16), or tiny-dflash (a random DFlash "
                                           "drafter for tiny, docs/speculative.md)")
      ->default_val("tiny")
      ->check(CLI::IsMember({"tiny", "xs2", "s21", "tiny-dflash"}));
  cmd->add_option("--dflash-for", flags->dflash_for,
                  "Write a random DFlash drafter matching the checkpoint in DIR, or the built-in shape tiny, xs2 "
                  "or s21 (hidden size, vocabulary, tap layers spread over its layers, ending at the last) instead "
                  "of a model");
  cmd->add_option("--dflash-layout", flags->dflash_layout,
                  "Drafter: poolside (Laguna family: fused qkv_proj, per-head gate, causal sliding blocks; default) or "
                  "zlab (DFlashDraftModel: split projections, bidirectional full-attention blocks)")
      ->check(CLI::IsMember({"poolside", "zlab"}));
  cmd->add_option("--block-size", flags->block_size, "Drafter: block size B (drafts up to B - 1 per step; default 8)")
      ->check(CLI::Range(2, 64));
  cmd->add_option("--out", flags->out, "Output directory (must not exist, or be empty)")->required();
  cmd->add_option("--seed", flags->seed, "Seed: weights depend only on (seed, tensor name, index)")->default_val(0);
  cmd->add_option("--dtype", flags->dtype,
                  "Weight dtype: bf16, f32, or fp8 (E4M3 codes + F32 scales for the --fp8-layout tensors, BF16 "
                  "for the rest; docs/fp8.md)")
      ->default_val("bf16");
  cmd->add_option("--fp8-format", flags->fp8_format,
                  "With --dtype fp8: native (quant_method fp8, <weight>_scale_inv, as Laguna-S-2.1-FP8) or "
                  "compressed-tensors (<weight>_scale, as Laguna-XS.2-FP8); default native")
      ->check(CLI::IsMember({"native", "compressed-tensors"}));
  cmd->add_option("--fp8-layout", flags->fp8_layout,
                  "With --dtype fp8: export (the routed experts, as Laguna's FP8 exports; layers >= 44 stay BF16) "
                  "or all-linear (every linear but LM head, routers and g_proj); default export")
      ->check(CLI::IsMember({"export", "all-linear"}));
  cmd->add_option("--fp8-scales", flags->fp8_scales,
                  "With --dtype fp8: block (128x128, default), channel or tensor (compressed-tensors only for channel)")
      ->check(CLI::IsMember({"block", "channel", "tensor"}));
  cmd->add_option("--num-layers", flags->num_layers,
                  "Keep the shape's dimensions but only the first N layers (tests, small disks); for a DFlash "
                  "drafter its number of layers (default 2)")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--max-shard-size", flags->max_shard_size,
                  "Largest safetensors shard, as transformers: 5GB, 500MB, 2GiB; one shard is written as "
                  "model.safetensors, more as model-0000i-of-0000N.safetensors + index")
      ->default_val("5GB");
  cmd->add_option("--threads", flags->threads, "Value generation threads")->default_val(2)->check(CLI::Range(1, 64));
  cmd->callback([flags, cmd, &ctx] {
    flags->shape_given = cmd->count("--shape") > 0;
    flags->block_size_given = cmd->count("--block-size") > 0;
    flags->layout_given = cmd->count("--dflash-layout") > 0;
    ctx.exit_code = RunMakeModel(*flags);
  });
}

}  // namespace dl::app
