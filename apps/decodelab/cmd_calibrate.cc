// decodelab calibrate: FP8 KV scales over the fixed built-in prompt set, written to a file.
#include <cstdio>

#include "apps/decodelab/commands.h"
#include "apps/decodelab/engine_flags.h"

namespace dl::app {
namespace {

struct CalibrateFlags {
  EngineFlags engine;
  std::string out;
};

int RunCalibrate(const CalibrateFlags& f) {
  auto opts = f.engine.ToOptions();
  if (!opts.ok()) return ReportError(opts.status());
  if (f.out.empty()) return ReportError(InvalidArgument("--out FILE is required"));
  // Loading an FP8 engine runs the built-in calibration on the chosen backend (CPU: F32 cache and
  // amax of the unquantised K/V; CUDA: a temporary BF16 cache), and the scales it used are the result.
  opts->kv_dtype = DType::kF8E4M3;
  opts->kv_scales_file.clear();
  opts->force_calibration = true;
  opts->max_seq_len = 256;
  std::fprintf(stderr, "calibrating over the built-in prompt set (%s)\n", kCalibrationMethod);
  auto engine = LoadEngine(*opts);
  if (!engine.ok()) return ReportError(engine.status());
  std::fprintf(stderr, "backend: %s (%s)\n", (*engine)->runner->backend_name().c_str(),
               (*engine)->backend_choice_reason.c_str());
  const KvScales* scales = &(*engine)->runner->kv_scales();
  const ModelConfig& c = (*engine)->config();
  nlohmann::json identity = {
      {"source", f.engine.model_dir.empty() ? "shape:" + f.engine.shape : f.engine.model_dir},
      {"seed", f.engine.seed},
      {"num_hidden_layers", c.num_hidden_layers},
      {"hidden_size", c.hidden_size},
      {"vocab_size", c.vocab_size}};
  const std::string method = std::string(kCalibrationMethod) + " [" + scales->source + "]";
  Status st = WriteKvScalesFile(f.out, *scales, method, identity);
  if (!st.ok()) return ReportError(st);
  for (size_t l = 0; l < scales->k.size(); ++l) {
    std::printf("layer %2zu  k_scale %.6g (%s)  v_scale %.6g (%s)\n", l, scales->k[l],
                FloatBitsHex(scales->k[l]).c_str(), scales->v[l], FloatBitsHex(scales->v[l]).c_str());
  }
  std::printf("wrote %s\n", f.out.c_str());
  return 0;
}

}  // namespace

void AddCalibrateCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<CalibrateFlags>();
  CLI::App* cmd = root.add_subcommand(
      "calibrate", "Compute per-layer FP8 KV scales over the fixed built-in prompt set");
  flags->engine.Add(cmd, /*with_kv=*/false);
  cmd->add_option("--out", flags->out, "Scales file to write (JSON, docs/kv-scales.md)")->required();
  cmd->callback([flags, &ctx] { ctx.exit_code = RunCalibrate(*flags); });
}

}  // namespace dl::app
