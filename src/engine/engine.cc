#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>

#include <unistd.h>

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "base/rng.h"
#include "cuda/device.h"
#include "backend/cpu_runner.h"
#include "backend/cpu_tp_runner.h"
#include "backend/cuda_runner.h"
#include "backend/cuda_tp_runner.h"
#include "engine/tp_rank_process.h"
#include "model/backend_support.h"
#include "model/param_count.h"
#include "model/shapes.h"
#include "model/synthetic.h"

namespace dl {

const char* const kCalibrationMethod =
    "builtin-v1: amax/448 of post-norm, post-RoPE K and of V per layer over 4 fixed prompts "
    "(lengths 32, 64, 96, 128); CPU reference: unquantised K/V through an F32 cache; CUDA: the cached "
    "values of a BF16 cache";

Result<BackendKind> ParseBackend(const std::string& name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return InvalidArgument("--backend must be auto, cpu or cuda (got \"{}\")", name);
}

std::pair<int32_t, float> ArgmaxWithMargin(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = static_cast<int32_t>(i);
  }
  float second = -INFINITY;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (static_cast<int32_t>(i) != best) second = std::max(second, logits[i]);
  }
  return {best, logits[best] - second};
}

Status CheckFiniteLogits(std::span<const float> logits, std::string_view context) {
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      return DataLoss("{}: logit {} of {} is {} (the model produced non-finite values)", context, i,
                      logits.size(), logits[i]);
    }
  }
  return Status::Ok();
}

std::vector<std::vector<int32_t>> BuiltinCalibrationPrompts(int64_t vocab_size) {
  const uint64_t key = StreamKey(0, "decodelab-calibration-v1");
  std::vector<std::vector<int32_t>> prompts;
  uint64_t counter = 0;
  for (int len : {32, 64, 96, 128}) {
    std::vector<int32_t> p(len);
    for (auto& t : p) t = static_cast<int32_t>(SplitMix64(key ^ SplitMix64(counter++)) % vocab_size);
    prompts.push_back(std::move(p));
  }
  return prompts;
}

std::optional<KvScales> CheckpointKvScales(const Checkpoint& checkpoint) {
  KvScales s;
  for (const LayerWeights& l : checkpoint.weights().layers) {
    if (!l.k_scale || !l.v_scale) return std::nullopt;
    s.k.push_back(*l.k_scale);
    s.v.push_back(*l.v_scale);
  }
  if (s.k.empty()) return std::nullopt;
  s.source = "checkpoint";
  return s;
}

namespace {

class AmaxObserver : public KvObserver {
 public:
  AmaxObserver(int layers, int64_t width) : k_(layers, 0.0f), v_(layers, 0.0f), width_(width) {}
  void Observe(int32_t layer, const float* k, const float* v, int32_t n) override {
    for (int64_t i = 0; i < width_ * n; ++i) {
      k_[layer] = std::max(k_[layer], std::fabs(k[i]));
      v_[layer] = std::max(v_[layer], std::fabs(v[i]));
    }
  }
  std::vector<float> k_, v_;

 private:
  int64_t width_;
};

KvCacheSpec MakeKvSpec(const ModelConfig& c, DType dtype, int32_t page_size, int32_t max_len,
                       int32_t max_sequences, int32_t max_chunk) {
  KvCacheSpec s;
  s.num_layers = static_cast<int32_t>(c.num_hidden_layers);
  s.num_kv_heads = static_cast<int32_t>(c.num_key_value_heads);
  s.head_dim = static_cast<int32_t>(c.head_dim);
  s.page_size = page_size;
  s.dtype = dtype;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    s.layer_groups.push_back(c.is_sliding(l) ? KvGroup::kSliding : KvGroup::kFull);
  }
  s.sliding_window = static_cast<int32_t>(c.sliding_window);
  s.pages_full = PagesNeededFull(max_len, page_size) * max_sequences;
  s.pages_sliding =
      PagesNeededSliding(max_len, std::max<int32_t>(1, s.sliding_window), max_chunk, page_size) *
      max_sequences;
  return s;
}

// Prefills every built-in calibration prompt as one chunk on a fresh sequence (no outputs).
Status RunCalibrationPrompts(const ModelConfig& c, KvCache& kv, ModelRunner& runner) {
  for (const auto& p : BuiltinCalibrationPrompts(c.vocab_size)) {
    SequenceKv seq;
    DL_RETURN_IF_ERROR(kv.Reserve(seq, static_cast<int32_t>(p.size())));
    ForwardBatch batch;
    batch.mode = ForwardMode::kPrefill;
    batch.AddSequence(seq, p, static_cast<int32_t>(p.size()));
    ForwardResult result;
    Status st = runner.Forward(batch, &result);
    DL_RETURN_IF_ERROR(kv.Release(seq));
    DL_RETURN_IF_ERROR(st.WithContext("calibration forward"));
  }
  return Status::Ok();
}

KvScales ScalesFromAmax(const std::vector<float>& k_amax, const std::vector<float>& v_amax,
                        std::string source) {
  KvScales scales;
  for (size_t l = 0; l < k_amax.size(); ++l) {
    scales.k.push_back(Fp8ScaleFromAmax(k_amax[l]));
    scales.v.push_back(Fp8ScaleFromAmax(v_amax[l]));
  }
  scales.source = std::move(source);
  return scales;
}

}  // namespace

Result<KvScales> CalibrateKvScales(const Checkpoint& checkpoint) {
  const ModelConfig& c = checkpoint.config();
  DL_ASSIGN_OR_RETURN(KvCache kv, KvCache::Create(MakeKvSpec(c, DType::kF32, 16, 128, 1, 128)));
  DL_ASSIGN_OR_RETURN(auto runner, CpuRunner::Create(checkpoint, kv.spec(), {}));
  AmaxObserver observer(static_cast<int>(c.num_hidden_layers), c.num_key_value_heads * c.head_dim);
  runner->set_kv_observer(&observer);
  DL_RETURN_IF_ERROR(RunCalibrationPrompts(c, kv, *runner));
  return ScalesFromAmax(observer.k_, observer.v_, "calibration:builtin-v1");
}

Result<KvScales> CalibrateKvScalesOnCuda(const Checkpoint& checkpoint, const CudaRunnerOptions& base,
                                         int32_t page_size) {
  // The same prompts through a temporary BF16 cache; the scales come from the cached (post-norm,
  // post-RoPE, BF16-rounded) K and V. The runner is freed before the real one is built, so the
  // weights are never on the device twice. The cache takes the engine's page size: the attention
  // presets are built per page size, and the one the engine runs with is the one known to exist
  // (S 2.1's G 9 sliding layers have only page-32 presets; a fixed page 16 found none).
  const ModelConfig& c = checkpoint.config();
  DL_ASSIGN_OR_RETURN(KvCache kv, KvCache::Create(MakeKvSpec(c, DType::kBF16, page_size, 128, 1, 128)));
  CudaRunnerOptions co = base;
  co.skip_ops.clear();  // calibration runs the whole model whatever the bench leaves out
  co.max_seq_len = 128;
  co.max_rows = 128;
  co.max_outputs = 1;
  co.use_graph = false;
  DL_ASSIGN_OR_RETURN(auto runner, CudaRunner::Create(checkpoint, kv.spec(), {}, co));
  DL_RETURN_IF_ERROR(RunCalibrationPrompts(c, kv, *runner));
  DL_ASSIGN_OR_RETURN(auto amax, runner->KvPoolAbsMax());
  return ScalesFromAmax(amax.first, amax.second, "calibration:builtin-v1-cuda-bf16");
}

Status CheckShapeWeightsFit(const ModelConfig& cfg, const Fp8Options* fp8, int tp, EmbeddingMode embedding, int gpus,
                            size_t device_bytes, size_t host_bytes) {
  if (tp < 1 || gpus < 1) return InvalidArgument("weights fit check: tp {} and gpus {} must be positive", tp, gpus);
  // Every expert stored: the per-token count with every expert active is the whole model but for the
  // embedding table, which ActiveWeightBytes leaves out (a token reads one row of it).
  ModelConfig all = cfg;
  all.num_experts_per_tok = std::max<int64_t>(cfg.num_experts, 1);
  const double rest = static_cast<double>(ActiveWeightBytes(all, DType::kBF16, fp8).total());
  const double table = 2.0 * static_cast<double>(cfg.vocab_size) * static_cast<double>(cfg.hidden_size);
  const double per_rank = rest / tp + (embedding == EmbeddingMode::kReplicated ? table : table / tp);
  const int ranks_per_gpu = (tp + gpus - 1) / gpus;
  const double per_gpu = per_rank * ranks_per_gpu;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const std::string layout = fp8 == nullptr ? "BF16" : (fp8->layout == Fp8Layout::kExport ? "FP8 export" : "FP8 all-linear");
  if (per_gpu > static_cast<double>(device_bytes)) {
    return ResourceExhausted(
        "the {} weights of {} layers need {:.1f} GiB per GPU ({} rank(s) of {:.1f} GiB at --tp {} on {} GPU(s)), and a "
        "GPU has {:.1f} GiB: use fewer --num-layers, FP8 weights (--shape-dtype fp8) or a larger --tp on more GPUs",
        layout, cfg.num_hidden_layers, per_gpu / kGiB, ranks_per_gpu, per_rank / kGiB, tp, gpus,
        static_cast<double>(device_bytes) / kGiB);
  }
  if (host_bytes > 0 && rest + table > static_cast<double>(host_bytes)) {
    return ResourceExhausted("--tp {} builds the {} weights of {} layers in host memory first ({:.1f} GiB), and this "
                             "machine has {:.1f} GiB: use fewer --num-layers or FP8 weights",
                             tp, layout, cfg.num_hidden_layers, (rest + table) / kGiB,
                             static_cast<double>(host_bytes) / kGiB);
  }
  return Status::Ok();
}

Result<Checkpoint> LoadHostCheckpoint(const EngineOptions& o) {
  if (o.model_dir.empty() == o.shape.empty()) {
    return InvalidArgument("give exactly one of --model DIR or --shape NAME");
  }
  if (!o.model_dir.empty()) {
    if (o.shape_fp8) {
      return InvalidArgument("FP8 --shape weights apply only with --shape (a checkpoint's tensors say their own dtype)");
    }
    return Checkpoint::Open(o.model_dir);
  }
  DL_ASSIGN_OR_RETURN(ModelConfig cfg, ShapeConfig(o.shape, o.num_layers));
  return MakeSyntheticCheckpoint(cfg, o.seed, DType::kBF16, o.shape_fp8 ? &*o.shape_fp8 : nullptr);
}

Result<std::unique_ptr<Engine>> LoadEngine(const EngineOptions& o) {
  auto engine = std::make_unique<Engine>();
  if (o.model_dir.empty() == o.shape.empty()) {
    return InvalidArgument("give exactly one of --model DIR or --shape NAME");
  }
  if (o.kv_dtype == DType::kF16) return InvalidArgument("--kv-dtype must be f32, bf16 or fp8");

  if (o.tp < 1) return InvalidArgument("--tp must be at least 1 (got {})", o.tp);
  // Backend choice: auto takes CUDA where a GPU is usable, else the CPU reference.
  std::string why;
  const int gpus = cuda::DeviceCount(&why);
  BackendKind chosen = o.backend;
  if (o.backend == BackendKind::kAuto) {
    chosen = gpus > 0 ? BackendKind::kCuda : BackendKind::kCpu;
    engine->backend_choice_reason =
        gpus > 0 ? fmt::format("auto: {} usable GPU(s); using cuda on device 0", gpus)
                 : fmt::format("auto: no usable GPU ({}); using cpu-reference", why);
  } else if (o.backend == BackendKind::kCuda) {
    if (gpus == 0) return Unavailable("--backend cuda: no usable GPU ({})", why);
    engine->backend_choice_reason = "cuda: requested";
  } else {
    engine->backend_choice_reason = "cpu: requested";
  }
  if (o.tp_transport == "processes" && o.tp < 2) {
    return InvalidArgument("--tp-transport processes needs --tp 2 or more (got --tp {})", o.tp);
  }
  if (chosen == BackendKind::kCpu && !o.skip_ops.empty()) {
    return InvalidArgument("--skip-ops is a CUDA timing experiment; the CPU backend ({}) has no such switch",
                           engine->backend_choice_reason);
  }
  EngineOptions effective = o;
  if (chosen == BackendKind::kCuda && o.kv_dtype == DType::kF32) {
    if (o.backend == BackendKind::kCuda) {
      return InvalidArgument("--kv-dtype f32 is the CPU backend's; the CUDA backend takes bf16 or fp8");
    }
    effective.kv_dtype = DType::kBF16;  // auto with the f32 default: the CUDA cache is BF16
    engine->backend_choice_reason += "; KV cache bf16 (f32 is CPU-only)";
  }
  engine->options = effective;

  // Weights: a checkpoint directory, or random weights for a shape (generated on the device for
  // CUDA, so large shapes need neither a file nor a host copy).
  if (!o.model_dir.empty()) {
    DL_ASSIGN_OR_RETURN(Checkpoint ck, LoadHostCheckpoint(o));
    engine->checkpoint = std::make_unique<Checkpoint>(std::move(ck));
  } else {
    DL_ASSIGN_OR_RETURN(ModelConfig cfg, ShapeConfig(o.shape, o.num_layers));
    const Fp8Options* fp8 = o.shape_fp8 ? &*o.shape_fp8 : nullptr;
    if (chosen == BackendKind::kCuda) {
      DL_ASSIGN_OR_RETURN(cuda::DeviceInfo dev, cuda::GetDeviceInfo(0));
      const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGE_SIZE);
      const size_t host = o.tp > 1 && pages > 0 && page_bytes > 0 ? static_cast<size_t>(pages) * page_bytes : 0;
      DL_RETURN_IF_ERROR(CheckShapeWeightsFit(cfg, fp8, o.tp, o.embedding, gpus, dev.total_memory, host)
                             .WithContext(fmt::format("--shape {}", o.shape)));
    }
    if (chosen == BackendKind::kCuda && o.tp == 1) {
      // Generated on the device. Tensor parallelism shards host weights, so --tp N takes the host
      // synthetic checkpoint below (the same formula, model/synthetic.h).
      DL_ASSIGN_OR_RETURN(Checkpoint ck, MakeShapeOnlyCheckpoint(cfg, fp8));
      engine->checkpoint = std::make_unique<Checkpoint>(std::move(ck));
    } else {
      DL_ASSIGN_OR_RETURN(Checkpoint ck, LoadHostCheckpoint(o));
      engine->checkpoint = std::make_unique<Checkpoint>(std::move(ck));
    }
  }
  const ModelConfig& cfg = engine->config();
  for (const auto& w : cfg.warnings) spdlog::warn("model config: {}", w);
  if (chosen == BackendKind::kCuda) {
    DL_RETURN_IF_ERROR(CheckCudaShapeSupport(cfg));
    DL_RETURN_IF_ERROR(CheckCudaWeightSupport(*engine->checkpoint));
  }
  // The shard plan before anything large is built, so a tp the heads do not allow fails at once.
  if (o.tp > 1) DL_RETURN_IF_ERROR(MakeTensorParallelPlan(cfg, o.tp, o.embedding).status());
  CudaRunnerOptions co;
  co.allow_fallback = o.allow_fallback;
  co.use_graph = o.use_graph;
  co.max_seq_len = o.max_seq_len;
  if (o.max_draft_tokens < 0) return InvalidArgument("max_draft_tokens must be >= 0");
  // A verify step: 1 + max_draft_tokens rows and outputs for each of max_batch sequences.
  const int32_t verify_rows = std::max(o.max_batch, 1) * (1 + o.max_draft_tokens);
  co.max_rows = std::max({o.max_rows_per_step, o.prefill_chunk, verify_rows, 1});
  co.max_outputs = verify_rows;
  if (o.max_hidden_taps < 0) return InvalidArgument("max_hidden_taps must be >= 0");
  co.max_taps = o.max_hidden_taps;
  co.synthetic_seed = o.seed;
  co.skip_ops = o.skip_ops;
  co.tuning = o.tuning;

  // KV scales for FP8: file, else checkpoint, else built-in calibration. Never from a request.
  KvScales scales;
  if (effective.kv_dtype == DType::kF8E4M3) {
    if (!o.kv_scales_file.empty()) {
      DL_ASSIGN_OR_RETURN(scales,
                          ReadKvScalesFile(o.kv_scales_file, static_cast<int>(cfg.num_hidden_layers)));
    } else if (auto from_checkpoint = CheckpointKvScales(*engine->checkpoint);
               from_checkpoint && !o.force_calibration) {
      scales = *from_checkpoint;
    } else if (chosen == BackendKind::kCuda) {
      spdlog::info("calibrating FP8 KV scales over the built-in prompt set (cuda, bf16 cache)");
      DL_ASSIGN_OR_RETURN(scales, CalibrateKvScalesOnCuda(*engine->checkpoint, co, o.page_size));
    } else {
      spdlog::info("calibrating FP8 KV scales over the built-in prompt set");
      DL_ASSIGN_OR_RETURN(scales, CalibrateKvScales(*engine->checkpoint));
    }
  } else if (!o.kv_scales_file.empty()) {
    return InvalidArgument("--kv-scales applies only to --kv-dtype fp8");
  } else {
    scales = KvScales::Unit(static_cast<int>(cfg.num_hidden_layers));
  }

  DL_ASSIGN_OR_RETURN(KvCache kv,
                      KvCache::Create(MakeKvSpec(cfg, effective.kv_dtype, o.page_size, o.max_seq_len,
                                                 o.max_sequences, co.max_rows)));
  engine->kv = std::make_unique<KvCache>(std::move(kv));
  if (chosen == BackendKind::kCuda && o.tp > 1) {
    DL_ASSIGN_OR_RETURN(const CudaTpTransport transport, ParseCudaTpTransport(o.tp_transport));
    // kProcesses: each child loads the same model source itself (a --shape model is rebuilt from
    // the same shape, seed and layers) and builds its CUDA rank from the options rank 0 sends.
    DL_ASSIGN_OR_RETURN(auto runner, CudaTpRunner::Create(*engine->checkpoint, engine->kv->spec(), std::move(scales),
                                                          co, o.tp, o.embedding, transport, /*gpus=*/0,
                                                          o.tp_timeout_s, TpProcessOptionsFor(o)));
    const bool graphs = o.use_graph && runner->transport() != "device-in-process";
    engine->backend_choice_reason +=
        fmt::format("; tensor parallel {} (ranks on GPUs [{}]{}, {} communicator, {}, embedding {})", o.tp,
                    fmt::join(runner->devices(), ", "),
                    transport == CudaTpTransport::kProcesses ? ", ranks 1.. as child processes" : "",
                    runner->transport(), graphs ? "CUDA graphs" : "eager forwards", EmbeddingModeName(o.embedding));
    engine->runner = std::move(runner);
  } else if (chosen == BackendKind::kCuda) {
    DL_ASSIGN_OR_RETURN(auto runner, CudaRunner::Create(*engine->checkpoint, engine->kv->spec(),
                                                        std::move(scales), co));
    engine->runner = std::move(runner);
  } else if (o.tp > 1) {
    TpTransport transport = TpTransport::kInProcess;
    if (o.tp_transport == "processes") {
      transport = TpTransport::kProcesses;
    } else if (o.tp_transport != "auto") {
      return InvalidArgument("--tp-transport {} is a CUDA communicator; the CPU backend takes auto (ranks are threads "
                             "of this process) or processes (ranks 1..N-1 are child processes)",
                             o.tp_transport);
    }
    DL_ASSIGN_OR_RETURN(auto runner, CpuTpRunner::Create(*engine->checkpoint, engine->kv->spec(), std::move(scales),
                                                         o.tp, o.embedding, transport, o.tp_timeout_s,
                                                         TpProcessOptionsFor(o)));
    engine->runner = std::move(runner);
    engine->backend_choice_reason +=
        fmt::format("; tensor parallel {} ({}, embedding {})", o.tp,
                    transport == TpTransport::kProcesses ? "ranks 1.. as child processes, collectives over TCP"
                                                         : "in-process ranks",
                    EmbeddingModeName(o.embedding));
  } else {
    DL_ASSIGN_OR_RETURN(auto runner, CpuRunner::Create(*engine->checkpoint, engine->kv->spec(),
                                                       std::move(scales)));
    engine->runner = std::move(runner);
  }
  return engine;
}

Result<GenerateResult> GenerateGreedy(Engine& engine, std::span<const int32_t> prompt,
                                      const GenerateOptions& opts) {
  using Clock = std::chrono::steady_clock;
  if (prompt.empty()) return InvalidArgument("empty prompt");
  if (opts.max_tokens < 0) return InvalidArgument("max_tokens must be >= 0");
  if (opts.num_draft_tokens < 0) return InvalidArgument("num_draft_tokens must be >= 0");
  const int64_t total = static_cast<int64_t>(prompt.size()) + opts.max_tokens;
  if (total > engine.options.max_seq_len) {
    return InvalidArgument("prompt ({} tokens) + max_tokens ({}) exceeds the context limit of {}",
                           prompt.size(), opts.max_tokens, engine.options.max_seq_len);
  }
  const auto& eos = engine.config().eos_token_ids;
  GenerateResult r;
  SequenceKv seq;
  KvCache& kv = *engine.kv;
  ModelRunner& runner = *engine.runner;
  // Rows whose outputs are computed but not yet emitted: the last forward's last row, or a verify
  // step's rows up to the first one whose token differs from the next draft. Each holds the
  // backend's greedy token and the row's logits.
  struct RowOutput {
    int32_t token = -1;
    std::vector<float> logits;
  };
  std::deque<RowOutput> pending;
  const bool speculate = opts.drafter != nullptr && opts.num_draft_tokens > 0 && opts.forced_tokens.empty();
  // A drafter that reads the target's hidden states gets them from every forward of the sequence
  // (the committed rows only) and keeps its state under draft_seq until the end.
  const std::vector<int32_t> taps = speculate ? opts.drafter->hidden_taps() : std::vector<int32_t>{};
  const uint64_t draft_seq = speculate ? opts.drafter->NewSequence() : 0;
  // One forward of `rows` for this sequence with outputs on the last `outputs` rows; commits the
  // first `commit(result)` rows' KV (the rows the caller keeps) and queues their outputs.
  auto run = [&](std::span<const int32_t> rows, int32_t outputs, ForwardMode mode,
                 const std::function<int32_t(const ForwardResult&)>& accepted) -> Status {
    const int32_t n = static_cast<int32_t>(rows.size());
    const int32_t start = seq.length();
    DL_RETURN_IF_ERROR(kv.Reserve(seq, n));
    ForwardBatch batch;
    batch.mode = mode;
    batch.AddSequence(seq, rows, static_cast<int32_t>(prompt.size()));
    batch.hidden_taps = taps;
    for (int32_t i = n - outputs; i < n; ++i) batch.AddOutput(i).want_logits = true;
    ForwardResult result;
    DL_RETURN_IF_ERROR(runner.Forward(batch, &result));
    // A verify step keeps the rows up to the first rejected draft; the pages reserved for the rest
    // stay in the block tables and their positions are written again by the next forward.
    const int32_t keep_outputs = accepted ? accepted(result) : outputs;
    DL_RETURN_IF_ERROR(kv.Commit(seq, n - outputs + keep_outputs));
    if (speculate) {
      const auto t0 = Clock::now();
      DL_RETURN_IF_ERROR(opts.drafter->Observe(draft_seq, start, result, 0, n - outputs + keep_outputs));
      r.spec.drafter_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    }
    for (int32_t i = 0; i < keep_outputs; ++i) {
      if (!result.rows[i].finite) {
        return DataLoss("position {}: the model produced non-finite logits (NaN or Inf)",
                        seq.length() - keep_outputs + i);
      }
      pending.push_back({result.rows[i].token, std::move(result.rows[i].logits)});
    }
    return Status::Ok();
  };
  // A verify step's rows and outputs must fit one forward of the backend.
  const int32_t draft_cap =
      std::min({opts.num_draft_tokens, runner.max_rows() - 1, runner.max_outputs() - 1});
  std::vector<int32_t> context(prompt.begin(), prompt.end());
  Status status = [&]() -> Status {
    const auto t0 = Clock::now();
    const size_t chunk = static_cast<size_t>(std::max(1, opts.prefill_chunk));
    for (size_t i = 0; i < prompt.size(); i += chunk) {
      const size_t n = std::min(chunk, prompt.size() - i);
      const bool last = i + n == prompt.size();
      DL_RETURN_IF_ERROR(run(prompt.subspan(i, n), last ? 1 : 0, ForwardMode::kPrefill, nullptr));
    }
    r.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    r.last_prompt_logits = pending.front().logits;
    r.finish_reason = "length";
    for (int32_t step = 0; step < opts.max_tokens; ++step) {
      RowOutput out = std::move(pending.front());
      pending.pop_front();
      DL_RETURN_IF_ERROR(CheckFiniteLogits(out.logits, fmt::format("generation step {}", step)));
      auto [tok, margin] = ArgmaxWithMargin(out.logits);
      if (tok != out.token) {
        return Internal("the backend's greedy token {} is not the argmax {} of its logits", out.token, tok);
      }
      r.tokens.push_back(tok);
      r.margins.push_back(margin);
      if (opts.keep_step_logits) r.step_logits.push_back(std::move(out.logits));
      if (!opts.ignore_eos && std::find(eos.begin(), eos.end(), tok) != eos.end()) {
        r.finish_reason = "stop";
        break;
      }
      if (step + 1 == opts.max_tokens) break;
      if (!pending.empty()) continue;  // an accepted draft: the next token's row is already computed
      const int32_t next = step < static_cast<int32_t>(opts.forced_tokens.size())
                               ? opts.forced_tokens[step]
                               : tok;
      context.push_back(next);
      // Drafts: never more than the tokens still to come after this step's one (max_tokens - step
      // - 2), so a verify never writes past prompt + max_tokens - 1.
      std::vector<int32_t> rows = {next};
      if (speculate) {
        const int32_t room = std::min(draft_cap, opts.max_tokens - step - 2);
        if (room > 0) {
          const auto t0 = Clock::now();
          DL_ASSIGN_OR_RETURN(std::vector<int32_t> drafts, opts.drafter->ProposeFor(draft_seq, context, room));
          r.spec.drafter_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
          if (static_cast<int32_t>(drafts.size()) > room) drafts.resize(static_cast<size_t>(room));
          rows.insert(rows.end(), drafts.begin(), drafts.end());
        }
      }
      const int32_t n = static_cast<int32_t>(rows.size());
      const int32_t before = static_cast<int32_t>(pending.size());
      const auto ts = Clock::now();
      if (n == 1) {
        DL_RETURN_IF_ERROR(run(rows, 1, ForwardMode::kDecode, nullptr));
      } else {
        // Accept while row i's token equals draft i + 1 (rows[i + 1]); row `accepted` gives the bonus
        // (or correcting) token.
        DL_RETURN_IF_ERROR(run(rows, n, ForwardMode::kVerify, [&](const ForwardResult& res) {
          int32_t accepted = 0;
          while (accepted + 1 < n && res.rows[accepted].finite && res.rows[accepted].token == rows[accepted + 1]) {
            ++accepted;
          }
          r.spec.Record(n - 1, accepted);
          return accepted + 1;
        }));
      }
      r.decode_step_seconds.push_back(std::chrono::duration<double>(Clock::now() - ts).count());
      r.decode_step_tokens.push_back(static_cast<int32_t>(pending.size()) - before);
      // The accepted drafts are the context's next tokens (the last kept row's token is not yet).
      for (size_t i = 1; i < pending.size(); ++i) context.push_back(rows[i]);
    }
    return Status::Ok();
  }();
  if (speculate) opts.drafter->Forget(draft_seq);
  Status release = kv.Release(seq);
  DL_RETURN_IF_ERROR(status);
  DL_RETURN_IF_ERROR(release);
  return r;
}

}  // namespace dl
