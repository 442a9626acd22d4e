// decodelab bench: in-process decode timing through the serving scheduler (engine/scheduler.h, the
// loop behind `serve`, without HTTP), end-of-sequence ignored: what bench measures is what serve runs.
// `--concurrency N` runs N requests at once (continuous batching). Prints, and writes as JSON: TPOT
// percentiles over inter-token gaps (the first token excluded), tok/s per stream and in total,
// prefill time (TTFT at concurrency 1), bytes per step, the GPU copy bandwidth measured at start,
// the memory floor and the fraction of it reached, kernels per step, the fallback flag, the kernel
// tuning and the build/GPU/settings identity.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "apps/decodelab/bench_common.h"
#include "apps/decodelab/commands.h"
#include "engine/dflash_drafter.h"
#include "apps/decodelab/engine_flags.h"
#include "backend/cuda_runner.h"
#include "base/build_info.h"
#include "base/file_util.h"
#include "base/rng.h"
#include "base/sha256.h"
#include "cuda/bandwidth.h"
#include "cuda/device.h"
#include "cuda/peak.h"
#include "engine/scheduler.h"
#include "kernels/timeline.h"
#include "lab/lab_spec.h"
#include "lab/lab_stats.h"
#include "lab/serve_bench.h"
#include "lab/serve_child.h"
#include "model/param_count.h"
#include "model/shapes.h"

namespace dl::app {

// --json-out: the results as indented JSON (nothing without a path); the exit code.
int WriteJsonOut(const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return 0;
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) return ReportError(DataLoss("cannot write {}", path));
  std::printf("  wrote %s\n", path.c_str());
  return 0;
}

// The first line of every mode's report: the build and where it ran.
void PrintBenchHeader(const char* mode, const nlohmann::json& gpu) {
  std::printf("decodelab bench%s  commit %s  %s\n", mode, BuildCommit().c_str(),
              gpu.is_null() ? "cpu" : gpu["name"].get<std::string>().c_str());
}

namespace {

struct BenchFlags {
  EngineFlags engine;
  SpecFlags spec;
  std::string prompt_file;  // text, encoded with the model's tokenizer, replaces the random prompt
  bool verify_cost = false;
  std::vector<int> verify_k = {2, 4, 8, 15};
  std::vector<int> verify_batch = {1, 8};
  int verify_iters = 20;
  std::vector<int> prefill_sweep;  // --prefill-sweep: prompt lengths, prefill only
  int sweep_warmup = 1;            // --sweep-warmup: untimed requests per length first
  int prompt_len = 1024;
  int gen_len = 1024;
  int repeat = 3;
  int concurrency = 1;
  int max_num_batched_tokens = 0;  // 0: max(prefill chunk, concurrency)
  bool allow_fallback = false;
  bool no_graph = false;
  std::vector<std::string> skip_ops;
  std::string json_out;
};

std::vector<int32_t> BenchPrompt(int n, int64_t vocab, int salt) {
  const uint64_t key = StreamKey(static_cast<uint64_t>(salt), "decodelab-bench-prompt-v1");
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<int32_t>(SplitMix64(key ^ SplitMix64(i)) % vocab);
  return p;
}

// The settings every bench result carries (which model, weights, cache and launch mode ran); each
// mode adds its own.
nlohmann::json CommonSettings(const BenchFlags& f, const Engine& engine) {
  const KvCacheSpec& kv = engine.kv->spec();
  const auto& fp8 = engine.options.shape_fp8;
  return {{"model", f.engine.model_dir},
          {"shape", f.engine.shape},
          {"num_layers", engine.config().num_hidden_layers},
          {"shape_dtype", f.engine.shape_dtype},
          {"fp8_layout", fp8 ? std::string(Fp8LayoutName(fp8->layout)) : ""},
          {"seed", f.engine.seed},
          {"kv_dtype", std::string(DTypeName(kv.dtype))},
          {"page_size", kv.page_size},
          {"prefill_chunk", engine.options.prefill_chunk},
          {"graph", !f.no_graph}};
}

// One run: `concurrency` requests at once through a fresh scheduler.
struct RunResult {
  std::vector<double> itl_ms;   // inter-token gaps of every request
  std::vector<double> device_ms;  // device time of each decode step with every stream decoding
  std::vector<double> ttft_ms;  // per request
  double duration_s = 0;        // first submit to last token
  int64_t tokens = 0;
  double decode_tok_s = 0;      // per stream: (tokens - 1) / (last token - first token), averaged
  SpecStats spec;
};

Result<RunResult> RunOnce(Engine& engine, const BenchFlags& f, const SchedulerOptions& so,
                          const std::vector<int32_t>& file_prompt) {
  using Clock = std::chrono::steady_clock;
  Scheduler sched(engine, so);
  sched.Start();
  std::vector<std::shared_ptr<RequestState>> states;
  const auto t0 = Clock::now();
  for (int i = 0; i < f.concurrency; ++i) {
    GenerationRequest r;
    r.prompt = file_prompt.empty() ? BenchPrompt(f.prompt_len, engine.config().vocab_size, i) : file_prompt;
    r.sampling.max_tokens = f.gen_len;
    r.sampling.ignore_eos = true;
    DL_ASSIGN_OR_RETURN(auto st, sched.Submit(std::move(r)));
    states.push_back(std::move(st));
  }
  RunResult out;
  Clock::time_point last = t0;
  double decode_s = 0;
  for (auto& st : states) {
    std::vector<Clock::time_point> times;
    RequestState::Update u;
    while (true) {
      st->Poll(&u, std::chrono::milliseconds(200));
      for (const TokenEvent& e : u.tokens) times.push_back(e.emitted);
      if (u.finished) break;
    }
    if (u.reason != FinishReason::kLength || static_cast<int>(times.size()) != f.gen_len) {
      sched.Stop();
      return Internal("bench request ended with {} after {} tokens: {}", FinishReasonName(u.reason), times.size(),
                      u.error.message());
    }
    out.ttft_ms.push_back(std::chrono::duration<double, std::milli>(times[0] - t0).count());
    for (size_t i = 1; i < times.size(); ++i) {
      out.itl_ms.push_back(std::chrono::duration<double, std::milli>(times[i] - times[i - 1]).count());
    }
    last = std::max(last, times.back());
    out.tokens += static_cast<int64_t>(times.size());
    decode_s += std::chrono::duration<double>(times.back() - times.front()).count();
  }
  // Per stream, first token to last (what speculation speeds up; TPOT percentiles are not, since a
  // verify step emits its accepted tokens together).
  out.decode_tok_s = decode_s > 0 ? static_cast<double>(out.tokens - f.concurrency) / decode_s : 0.0;
  out.spec = sched.Stats().spec;
  for (const auto& [rows, ms] : sched.Stats().decode_steps) {
    if (rows == f.concurrency && ms > 0) out.device_ms.push_back(ms);
  }
  sched.Stop();
  out.duration_s = std::chrono::duration<double>(last - t0).count();
  return out;
}

// One verify forward of `batch` sequences with 1 + k rows each (every row an output, greedy) against
// one decode forward of `batch` rows, at a context of --prompt-len: the cost of checking k drafts.
// The pages are reserved but never committed, so every timed forward writes the same positions.
// With a DFlash drafter (`--spec dflash`), its host time too: one block forward (flat in K) and the
// context append per committed row, so the cycle's break-even counts what drafting costs.
int RunVerifyCost(Engine& engine, const BenchFlags& f, const nlohmann::json& gpu, const Drafter* dflash) {
  using Clock = std::chrono::steady_clock;
  KvCache& kv = *engine.kv;
  ModelRunner& runner = *engine.runner;
  const int max_batch = *std::max_element(f.verify_batch.begin(), f.verify_batch.end());
  std::vector<SequenceKv> seqs(static_cast<size_t>(max_batch));
  uint64_t draft_seq = 0;
  double draft_row_ms = 0;  // the drafter's context append, per committed row (host)
  auto release = [&] {
    for (auto& s : seqs) (void)kv.Release(s);
    if (draft_seq != 0) dflash->Forget(draft_seq);
  };
  // Prefill every sequence's context once (chunks of --prefill-chunk).
  for (int b = 0; b < max_batch; ++b) {
    const std::vector<int32_t> prompt = BenchPrompt(f.prompt_len, engine.config().vocab_size, b);
    for (size_t i = 0; i < prompt.size(); i += static_cast<size_t>(engine.options.prefill_chunk)) {
      const size_t n = std::min<size_t>(engine.options.prefill_chunk, prompt.size() - i);
      ForwardBatch batch;
      batch.mode = ForwardMode::kPrefill;
      if (dflash && b == 0) batch.hidden_taps = dflash->hidden_taps();
      Status st = kv.Reserve(seqs[b], static_cast<int32_t>(n));
      ForwardResult r;
      if (st.ok()) {
        batch.AddSequence(seqs[b], std::span<const int32_t>(prompt).subspan(i, n), static_cast<int32_t>(prompt.size()));
        st = runner.Forward(batch, &r);
      }
      if (st.ok()) st = kv.Commit(seqs[b], static_cast<int32_t>(n));
      if (st.ok() && dflash && b == 0) {
        // The drafter's context for sequence 0, timed per row.
        if (draft_seq == 0) draft_seq = dflash->NewSequence();
        const auto t0 = Clock::now();
        st = dflash->Observe(draft_seq, static_cast<int32_t>(i), r, 0, static_cast<int32_t>(n));
        draft_row_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count() / f.prompt_len;
      }
      if (!st.ok()) {
        release();
        return ReportError(st.WithContext("verify-cost prefill"));
      }
    }
  }
  const bool on_device = !gpu.is_null();
  // Median time of `iters` forwards of `rows_per_seq` rows for each of `batch` sequences.
  auto time_forward = [&](int batch_size, int rows_per_seq, double* median_ms) -> Status {
    ForwardBatch batch;
    batch.mode = rows_per_seq == 1 ? ForwardMode::kDecode : ForwardMode::kVerify;
    for (int b = 0; b < batch_size; ++b) {
      DL_RETURN_IF_ERROR(kv.Reserve(seqs[b], rows_per_seq));
      std::vector<int32_t> rows(static_cast<size_t>(rows_per_seq));
      for (int j = 0; j < rows_per_seq; ++j) rows[j] = (7 + 31 * j + 101 * b) % static_cast<int32_t>(engine.config().vocab_size);
      const int32_t first = batch.AddSequence(seqs[b], rows);
      for (int j = 0; j < rows_per_seq; ++j) batch.AddOutput(first + j);
    }
    std::vector<double> ms;
    for (int it = 0; it < 3 + f.verify_iters; ++it) {
      ForwardResult r;
      const auto t0 = Clock::now();
      DL_RETURN_IF_ERROR(runner.Forward(batch, &r));
      const double host_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (it >= 3) ms.push_back(on_device && r.device_ms > 0 ? r.device_ms : host_ms);
    }
    *median_ms = lab::Median(ms);
    return Status::Ok();
  };
  // The drafter's block forward at this context for K drafts (host; median of the same iterations).
  auto time_draft = [&](int k, double* median_ms) -> Status {
    const std::vector<int32_t> prompt = BenchPrompt(f.prompt_len, engine.config().vocab_size, 0);
    std::vector<int32_t> context(prompt.begin(), prompt.end());
    context.push_back(7);  // the anchor
    std::vector<double> ms;
    for (int it = 0; it < 1 + f.verify_iters; ++it) {
      const auto t0 = Clock::now();
      DL_RETURN_IF_ERROR(dflash->ProposeFor(draft_seq, context, k).status());
      if (it >= 1) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    *median_ms = lab::Median(ms);
    return Status::Ok();
  };
  nlohmann::json points = nlohmann::json::array();
  PrintBenchHeader(" --verify-cost", gpu);
  std::printf("  model %s, %lld layers, kv %s, context %d, %s time, median of %d forwards\n",
              f.engine.model_dir.empty() ? ("shape " + f.engine.shape).c_str() : f.engine.model_dir.c_str(),
              static_cast<long long>(engine.config().num_hidden_layers),
              std::string(DTypeName(kv.spec().dtype)).c_str(), f.prompt_len, on_device ? "device (CUDA events)" : "host",
              f.verify_iters);
  if (dflash) {
    std::printf("  drafter %s (host time; sequences draft one after another): context append %.4f ms per row\n",
                dflash->name().c_str(), draft_row_ms);
  }
  std::printf("  %6s %4s %12s %12s %8s %22s%s\n", "batch", "K", "decode ms", "verify ms", "ratio", "break-even accept len",
              dflash ? "     draft ms  cycle break-even" : "");
  for (int batch_size : f.verify_batch) {
    double decode_ms = 0;
    if (Status st = time_forward(batch_size, 1, &decode_ms); !st.ok()) {
      release();
      return ReportError(st.WithContext("decode forward"));
    }
    for (int k : f.verify_k) {
      double verify_ms = 0;
      if (Status st = time_forward(batch_size, 1 + k, &verify_ms); !st.ok()) {
        release();
        return ReportError(st.WithContext(fmt::format("verify forward, K {}", k)));
      }
      const double ratio = decode_ms > 0 ? verify_ms / decode_ms : 0.0;
      // A verify step yields (mean acceptance length) tokens where decode steps yield one each: it
      // pays off above a mean acceptance length of `ratio` (the n-gram drafter's own cost is host
      // time, not counted).
      // Above K + 1 no acceptance can pay for the verify.
      const std::string even = ratio <= k + 1 ? fmt::format("{:.2f}", ratio) : fmt::format("never (> {})", k + 1);
      nlohmann::json point = {{"batch", batch_size},
                              {"k", k},
                              {"decode_ms", decode_ms},
                              {"verify_ms", verify_ms},
                              {"ratio", ratio},
                              {"break_even_mean_acceptance_length", ratio <= k + 1 ? nlohmann::json(ratio) : nlohmann::json(nullptr)},
                              {"break_even_acceptance_rate",
                               ratio <= k + 1 ? nlohmann::json(std::max(0.0, (ratio - 1.0) / k)) : nlohmann::json(nullptr)}};
      std::string cycle;
      if (dflash) {
        // A cycle emitting L tokens costs verify + batch x (block + L rows of context) against L
        // decode steps: L = (verify + batch x block) / (decode - batch x row), when that is <= K + 1.
        double block_ms = 0;
        if (Status st = time_draft(k, &block_ms); !st.ok()) {
          release();
          return ReportError(st.WithContext("drafter block"));
        }
        const double draft_ms = batch_size * block_ms, row_ms = batch_size * draft_row_ms;
        const double margin = decode_ms - row_ms;
        const double l = margin > 0 ? (verify_ms + draft_ms) / margin : 0.0;
        const bool reachable = margin > 0 && l <= k + 1;
        cycle = fmt::format("  {:11.4f}  {:>16}", draft_ms, reachable ? fmt::format("{:.2f}", l) : "never");
        point["draft_block_ms"] = draft_ms;
        point["draft_context_ms_per_row"] = row_ms;
        point["cycle_break_even_mean_acceptance_length"] = reachable ? nlohmann::json(l) : nlohmann::json(nullptr);
      }
      std::printf("  %6d %4d %12.4f %12.4f %8.3f %22s%s\n", batch_size, k, decode_ms, verify_ms, ratio, even.c_str(),
                  cycle.c_str());
      points.push_back(std::move(point));
    }
  }
  release();
  const nlohmann::json describe = runner.Describe();
  nlohmann::json j = {{"verify_cost", points},
                      {"time_source", on_device ? "device" : "host"},
                      {"context", f.prompt_len},
                      {"iters", f.verify_iters},
                      {"backend", describe},
                      {"fallback", describe.value("fallback", false)},
                      {"commit", BuildCommit()},
                      {"gpu", gpu},
                      {"settings", CommonSettings(f, engine)}};
  return WriteJsonOut(f.json_out, j);
}

// Achieved prefill arithmetic: `prompts` prompts of `prompt_len` tokens each (one sequence per
// prompt), prefilled in `ms`, against CountPrefillFlops and the measured BF16 peak (0: not measured).
struct PrefillRate {
  PrefillFlops flops;  // of one prompt
  double tok_s = 0, tflops = 0, pct_of_peak = 0;
};
PrefillRate PrefillRateOf(const ModelConfig& cfg, int prompt_len, int prompts, double ms, double peak_tflops) {
  PrefillRate r;
  r.flops = CountPrefillFlops(cfg, prompt_len);
  if (ms <= 0) return r;
  r.tok_s = static_cast<double>(prompt_len) * prompts / (ms * 1e-3);
  r.tflops = r.flops.total() * prompts / (ms * 1e-3) / 1e12;
  r.pct_of_peak = peak_tflops > 0 ? 100.0 * r.tflops / peak_tflops : 0.0;
  return r;
}

// --prefill-sweep: for each prompt length, --repeat requests alone (concurrency 1, two tokens each,
// through the scheduler as serve runs them): TTFT (the prefill), prompt tokens/s and TFLOP/s.
int RunPrefillSweep(Engine& engine, const BenchFlags& f, const SchedulerOptions& so, const nlohmann::json& gpu,
                    double peak_tflops) {
  const ModelConfig& cfg = engine.config();
  nlohmann::json rows = nlohmann::json::array();
  PrintBenchHeader(" --prefill-sweep", gpu);
  std::printf("  %lld layers, kv %s page %d, prefill chunk %d, %d runs per length after %d untimed, BF16 peak %.0f "
              "TFLOP/s%s\n",
              static_cast<long long>(cfg.num_hidden_layers), std::string(DTypeName(engine.kv->spec().dtype)).c_str(),
              engine.kv->spec().page_size, engine.options.prefill_chunk, f.repeat, f.sweep_warmup, peak_tflops,
              peak_tflops > 0 ? " (cuBLASLt, measured)" : " (not measured)");
  std::printf("  %8s %12s %12s %14s %12s %8s\n", "prompt", "TTFT ms", "min ms", "prefill tok/s", "TFLOP/s", "% peak");
  for (int len : f.prefill_sweep) {
    BenchFlags one = f;
    one.prompt_len = len;
    one.gen_len = 2;
    one.concurrency = 1;
    std::vector<double> ttft;
    for (int rep = -f.sweep_warmup; rep < f.repeat; ++rep) {
      auto run = RunOnce(engine, one, so, {});
      if (!run.ok()) return ReportError(run.status().WithContext(fmt::format("--prefill-sweep {}", len)));
      if (rep >= 0) ttft.push_back(run->ttft_ms[0]);
    }
    const double ms = lab::Median(ttft);
    const PrefillRate r = PrefillRateOf(cfg, len, 1, ms, peak_tflops);
    std::printf("  %8d %12.2f %12.2f %14.0f %12.4g %7.1f%%\n", len, ms, *std::min_element(ttft.begin(), ttft.end()),
                r.tok_s, r.tflops, r.pct_of_peak);
    rows.push_back({{"prompt_len", len}, {"prefill_ms_median", ms}, {"ttft_ms", ttft}, {"prefill_tok_s", r.tok_s},
                    {"prefill_tflops", r.tflops}, {"prefill_pct_of_bf16_peak", r.pct_of_peak},
                    {"prefill_flops", r.flops.total()}, {"prefill_flops_attention", r.flops.attention}});
  }
  const nlohmann::json describe = engine.runner->Describe();
  nlohmann::json j = {{"prefill_sweep", rows},
                      {"bf16_peak_tflops", peak_tflops},
                      {"tuning", describe.value("tuning", nlohmann::json::object())},
                      {"fallback", describe.value("fallback", false)},
                      {"backend", describe},
                      {"commit", BuildCommit()},
                      {"gpu", gpu},
                      {"settings", CommonSettings(f, engine)}};
  j["settings"]["repeat"] = f.repeat;
  j["settings"]["sweep_warmup"] = f.sweep_warmup;
  if (describe.value("fallback", false)) std::printf("  ** FALLBACK: not a speed result **\n");
  if (!gpu.is_null()) std::printf("  tuning       %s\n", kernels::TuningString(engine.options.tuning).c_str());
  return WriteJsonOut(f.json_out, j);
}

int RunBench(const BenchFlags& f) {
  auto opts = f.engine.ToOptions();
  if (!opts.ok()) return ReportError(opts.status());
  if (f.prompt_len < 1 || f.gen_len < 2 || f.repeat < 1 || f.concurrency < 1) {
    return ReportError(
        InvalidArgument("--prompt-len >= 1, --gen-len >= 2, --repeat >= 1 and --concurrency >= 1 please"));
  }
  auto spec = f.spec.ToOptions();
  if (!spec.ok()) return ReportError(spec.status());
  if (f.verify_cost && (spec->method == SpecMethod::kNgram || !f.prompt_file.empty())) {
    return ReportError(InvalidArgument("--verify-cost times forwards of --verify-k drafts itself: it takes no --spec "
                                       "ngram or --prompt-file (--spec dflash adds the drafter's cost)"));
  }
  if (f.verify_cost && spec->method == SpecMethod::kDflash) {
    spec->k = *std::max_element(f.verify_k.begin(), f.verify_k.end());  // checked against the block size
  }
  std::vector<int32_t> file_prompt;
  if (!f.prompt_file.empty()) {
    std::string no_tokenizer;
    auto tokenizer = LoadModelTokenizer(*opts, &no_tokenizer);
    if (!tokenizer.ok()) return ReportError(tokenizer.status());
    if (!*tokenizer) return ReportError(InvalidArgument("--prompt-file needs the model's tokenizer ({})", no_tokenizer));
    auto text = ReadRegularFile(f.prompt_file, 16 << 20);
    if (!text.ok()) return ReportError(text.status());
    auto ids = (*tokenizer)->Encode(*text, true);
    if (!ids.ok()) return ReportError(ids.status().WithContext(f.prompt_file));
    if (ids->empty()) return ReportError(InvalidArgument("--prompt-file {} encodes to no tokens", f.prompt_file));
    file_prompt = std::move(*ids);
  }
  const int prompt_len = file_prompt.empty() ? f.prompt_len : static_cast<int>(file_prompt.size());
  opts->max_seq_len = prompt_len + f.gen_len + 1;
  if (!f.prefill_sweep.empty()) {
    if (f.verify_cost || spec->enabled() || !file_prompt.empty() || f.concurrency != 1) {
      return ReportError(InvalidArgument("--prefill-sweep times prompts of its own lengths alone: it takes no "
                                         "--verify-cost, --spec, --prompt-file or --concurrency"));
    }
    opts->max_seq_len = *std::max_element(f.prefill_sweep.begin(), f.prefill_sweep.end()) + 3;
  }
  if (Status st = SpecFlags::Size(*spec, &*opts); !st.ok()) return ReportError(st);
  if (f.verify_cost) {
    opts->max_draft_tokens = *std::max_element(f.verify_k.begin(), f.verify_k.end());
    opts->max_seq_len = f.prompt_len + opts->max_draft_tokens + 2;
  }
  opts->allow_fallback = f.allow_fallback;
  opts->use_graph = !f.no_graph;
  opts->skip_ops = f.skip_ops;
  opts->max_batch = f.concurrency;
  opts->max_sequences = f.concurrency;
  if (f.verify_cost) {
    opts->max_batch = *std::max_element(f.verify_batch.begin(), f.verify_batch.end());
    opts->max_sequences = opts->max_batch;
  }
  opts->max_rows_per_step = f.max_num_batched_tokens > 0 ? f.max_num_batched_tokens
                                                         : std::max(opts->prefill_chunk, f.concurrency);
  if (opts->backend == BackendKind::kAuto && f.engine.kv_dtype == "f32" &&
      cuda::DeviceCount() > 0) {
    opts->kv_dtype = DType::kF8E4M3;  // the bench default on a GPU is the FP8 cache
  }
  nlohmann::json gpu = nullptr;
  double copy_gbps = 0.0, peak_tflops = 0.0;
  if (cuda::DeviceCount() > 0 && opts->backend != BackendKind::kCpu) {
    auto info = cuda::GetDeviceInfo(0);
    if (info.ok()) gpu = {{"name", info->name}, {"sms", info->sm_count}, {"pci", info->pci_bus_id}};
    std::fprintf(stderr, "measuring device-to-device copy bandwidth ...\n");
    auto bw = cuda::MeasureCopyBandwidthGBps(0);
    if (!bw.ok()) return ReportError(bw.status());
    copy_gbps = *bw;
    std::fprintf(stderr, "copy bandwidth: %.0f GB/s (read + write)\n", copy_gbps);
    if (!f.verify_cost) {  // the prefill's share of the peak is in every result but --verify-cost's
      auto peak = cuda::MeasureBf16PeakTflops(0);
      if (peak.ok()) {
        peak_tflops = *peak;
        std::fprintf(stderr, "BF16 peak: %.0f TFLOP/s (cuBLASLt 8192^3)\n", peak_tflops);
      } else {
        std::fprintf(stderr, "BF16 peak not measured (prefill %% of peak omitted): %s\n",
                     peak.status().message().c_str());
      }
    }
  }
  const auto t_load = std::chrono::steady_clock::now();
  auto engine = LoadEngine(*opts);
  if (!engine.ok()) return ReportError(engine.status());
  // The drafter once the model is loaded (DFlash reads its hidden size, vocabulary and LM head).
  auto drafter = MakeDrafterFor(*spec, *(*engine)->checkpoint, (*engine)->runner.get());
  if (!drafter.ok()) return ReportError(drafter.status());
  std::fprintf(stderr, "backend: %s (%s); load %.1f s\n", (*engine)->runner->backend_name().c_str(),
               (*engine)->backend_choice_reason.c_str(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  const ModelConfig& cfg = (*engine)->config();
  if (f.verify_cost) return RunVerifyCost(**engine, f, gpu, spec->method == SpecMethod::kDflash ? drafter->get() : nullptr);
  SchedulerOptions so;
  so.drafter = *drafter;
  so.num_draft_tokens = spec->enabled() ? spec->k : 0;
  so.max_batch = f.concurrency;
  so.max_waiting = f.concurrency;
  so.prefill_chunk = opts->prefill_chunk;
  so.max_tokens_per_step = opts->max_rows_per_step;
  so.record_step_times = true;
  if (!f.prefill_sweep.empty()) return RunPrefillSweep(**engine, f, so, gpu, peak_tflops);
  std::vector<double> run_medians, all_steps, prefill_ms, prefill_all_ms, ttft_ms, out_tok_s, device_ms, decode_tok_s;
  SpecStats spec_total;
  for (int rep = 0; rep < f.repeat; ++rep) {
    auto run = RunOnce(**engine, f, so, file_prompt);
    if (!run.ok()) return ReportError(run.status());
    decode_tok_s.push_back(run->decode_tok_s);
    spec_total.num_drafts += run->spec.num_drafts;
    spec_total.num_draft_tokens += run->spec.num_draft_tokens;
    spec_total.num_accepted_tokens += run->spec.num_accepted_tokens;
    spec_total.drafter_seconds += run->spec.drafter_seconds;
    spec_total.accepted_per_pos.resize(std::max(spec_total.accepted_per_pos.size(), run->spec.accepted_per_pos.size()));
    for (size_t i = 0; i < run->spec.accepted_per_pos.size(); ++i) {
      spec_total.accepted_per_pos[i] += run->spec.accepted_per_pos[i];
    }
    run_medians.push_back(lab::Median(run->itl_ms));
    all_steps.insert(all_steps.end(), run->itl_ms.begin(), run->itl_ms.end());
    ttft_ms.insert(ttft_ms.end(), run->ttft_ms.begin(), run->ttft_ms.end());
    prefill_ms.push_back(lab::Median(run->ttft_ms));
    prefill_all_ms.push_back(*std::max_element(run->ttft_ms.begin(), run->ttft_ms.end()));
    device_ms.insert(device_ms.end(), run->device_ms.begin(), run->device_ms.end());
    out_tok_s.push_back(run->duration_s > 0 ? run->tokens / run->duration_s : 0.0);
    std::fprintf(stderr, "run %d/%d: TTFT median %.2f ms, median TPOT %.4f ms, %.1f output tok/s\n", rep + 1,
                 f.repeat, prefill_ms.back(), run_medians.back(), out_tok_s.back());
  }

  const int64_t kv_elem = static_cast<int64_t>(DTypeSize((*engine)->kv->spec().dtype));
  // Bytes one decode step reads with `concurrency` sequences: the dense weights once, each routed
  // expert once if any token chose it (expected fraction under uniform routing, which random weights
  // give: 1 - (1 - k/E)^C), and every sequence's KV, averaged over the decoded contexts.
  double kv_bytes = 0;
  for (int s = 1; s < f.gen_len; ++s) {
    kv_bytes += static_cast<double>(KvBytesReadPerToken(cfg, prompt_len + s, kv_elem));
  }
  kv_bytes = kv_bytes / (f.gen_len - 1) * f.concurrency;
  // Weight bytes as the loaded checkpoint stores them (BF16, F32, FP8 codes + scales; docs/fp8.md).
  const WeightBytesPerToken wb = ActiveWeightBytes(*(*engine)->checkpoint);
  const double routed_active = static_cast<double>(wb.routed);
  double touched = 1.0;
  if (cfg.num_experts > 0) {
    const double k_over_e = static_cast<double>(cfg.num_experts_per_tok) / static_cast<double>(cfg.num_experts);
    touched = (1.0 - std::pow(1.0 - k_over_e, f.concurrency)) / k_over_e;  // experts read per chosen slot
  }
  const double weight_bytes = static_cast<double>(wb.total()) - routed_active + routed_active * touched;
  const double bytes = weight_bytes + kv_bytes;
  // With speculation a verify emits its accepted tokens together, so the median inter-token gap
  // says nothing; the time per output token is then a stream's decode time over its tokens.
  const double decode_rate = lab::Median(decode_tok_s);
  const double tpot = spec->enabled() && decode_rate > 0 ? 1e3 / decode_rate : lab::Median(all_steps);
  const double floor_ms = copy_gbps > 0 ? bytes / (copy_gbps * 1e9) * 1e3 : 0.0;
  const nlohmann::json describe = (*engine)->runner->Describe();
  int kernels = 0;
  if (describe.contains("topology") && describe["topology"].is_array()) {
    kernels = describe["topology"][0].value("kernel_nodes", 0);
  }
  const double spread = (*std::max_element(run_medians.begin(), run_medians.end()) -
                         *std::min_element(run_medians.begin(), run_medians.end())) / tpot;
  // Every prompt prefilled: until the last request's first token (at concurrency 1, the TTFT).
  const PrefillRate prefill = PrefillRateOf(cfg, prompt_len, f.concurrency, lab::Median(prefill_all_ms), peak_tflops);
  auto self = Sha256OfSelf();
  nlohmann::json j = {
      {"tpot_ms_median", tpot},
      {"tpot_ms_p10", lab::Percentile(all_steps, 10)},
      {"tpot_ms_p90", lab::Percentile(all_steps, 90)},
      {"tok_s", 1e3 / tpot},
      {"output_tok_s", lab::Median(out_tok_s)},
      {"decode_tok_s_per_stream", lab::Median(decode_tok_s)},
      {"speculative", [&] {
         nlohmann::json sj = SpecFlags::ToJson(*spec);
         if (spec->enabled()) {
           sj["drafter"] = (*drafter)->name();
           sj["vllm:spec_decode_num_drafts_total"] = spec_total.num_drafts;
           sj["vllm:spec_decode_num_draft_tokens_total"] = spec_total.num_draft_tokens;
           sj["vllm:spec_decode_num_accepted_tokens_total"] = spec_total.num_accepted_tokens;
           sj["vllm:spec_decode_num_accepted_tokens_per_pos_total"] = spec_total.accepted_per_pos;
           sj["mean_acceptance_length"] = spec_total.mean_acceptance_length();
           sj["acceptance_rate"] = spec_total.acceptance_rate();
           sj["drafter_ms_total"] = spec_total.drafter_seconds * 1e3;
           sj["drafter_ms_per_draft"] =
               spec_total.num_drafts ? spec_total.drafter_seconds * 1e3 / spec_total.num_drafts : 0.0;
         }
         return sj;
       }()},
      {"device_step_ms_median", lab::Median(device_ms)},
      {"device_steps", device_ms.size()},
      {"concurrency", f.concurrency},
      {"run_median_tpot_ms", run_medians},
      {"run_spread_rel", spread},
      {"prefill_ms_median", lab::Median(prefill_ms)},
      {"prefill_tok_s", prefill.tok_s},
      {"prefill_tflops", prefill.tflops},
      {"prefill_pct_of_bf16_peak", prefill.pct_of_peak},
      {"bf16_peak_tflops", peak_tflops},
      {"ttft_ms_median", lab::Median(ttft_ms)},
      {"ttft_ms_p99", lab::Percentile(ttft_ms, 99)},
      {"bytes_per_step", bytes},
      {"bytes_per_token", bytes / f.concurrency},
      {"weight_bytes_per_step", weight_bytes},
      {"weight_bytes_per_token", weight_bytes / f.concurrency},
      {"weight_bytes_one_token_by_dtype",
       {{"bf16", wb.bf16}, {"f32", wb.f32}, {"fp8", wb.fp8}, {"fp8_scales", wb.fp8_scales}, {"total", wb.total()}}},
      {"weight_format", cfg.weight_quant.fp8() ? std::string(Fp8FormatName(cfg.weight_quant.format)) : "none"},
      {"expert_reads_per_slot", touched},
      {"kv_bytes_per_step_mean", kv_bytes},
      {"copy_bandwidth_gbps", copy_gbps},
      {"memory_floor_ms", floor_ms},
      {"pct_of_floor", floor_ms > 0 ? 100.0 * floor_ms / tpot : 0.0},
      {"kernels_per_step", kernels},
      {"tuning", describe.value("tuning", nlohmann::json::object())},
      {"kernels_per_layer", cfg.num_hidden_layers ? double(kernels) / cfg.num_hidden_layers : 0.0},
      {"fallback", describe.value("fallback", false)},
      {"skipped_ops", f.skip_ops},
      {"backend", describe},
      {"commit", BuildCommit()},
      {"compilers", BuildCompilers()},
      {"binary_sha256", self.ok() ? *self : ""},
      {"gpu", gpu},
      {"driver", cuda::DriverVersionString()},
      {"runtime", cuda::RuntimeVersionString()},
      {"settings", CommonSettings(f, **engine)}};
  j["settings"].update({{"prompt_len", prompt_len},
                        {"prompt_file", f.prompt_file},
                        {"gen_len", f.gen_len},
                        {"repeat", f.repeat},
                        {"dependent_launch", describe.value("dependent_launch", false)},
                        {"concurrency", f.concurrency},
                        {"max_num_batched_tokens", so.max_tokens_per_step},
                        {"ignore_eos", true}});
  PrintBenchHeader("", gpu);
  std::printf("  model        %s, %lld layers, kv %s page %d, prompt %d, gen %d, concurrency %d, %d runs%s\n",
              f.engine.model_dir.empty() ? ("shape " + f.engine.shape).c_str() : f.engine.model_dir.c_str(),
              static_cast<long long>(cfg.num_hidden_layers),
              std::string(DTypeName((*engine)->kv->spec().dtype)).c_str(),
              (*engine)->kv->spec().page_size, prompt_len, f.gen_len, f.concurrency, f.repeat,
              describe.value("fallback", false) ? "  ** FALLBACK: not a speed result **" : "");
  if (!f.skip_ops.empty()) {
    std::printf("  ** SKIPPED OPS: %s (timing experiment; outputs are wrong; not a speed result) **\n",
                fmt::format("{}", fmt::join(f.skip_ops, ",")).c_str());
  }
  std::printf("  TPOT         median %.4f ms  p10 %.4f  p90 %.4f  (%.1f tok/s per stream; run spread %.1f%%)\n",
              tpot, lab::Percentile(all_steps, 10), lab::Percentile(all_steps, 90), 1e3 / tpot, 100 * spread);
  std::printf("  throughput   %.1f output tok/s (median of runs, all %d streams, prefill included)\n",
              lab::Median(out_tok_s), f.concurrency);
  std::printf("  decode       %.1f tok/s per stream (first to last token; median of runs)\n", lab::Median(decode_tok_s));
  if (spec->enabled()) {
    std::printf("  speculative  %s, k %d: %llu drafts, %llu draft tokens, %llu accepted (%.1f%%), mean acceptance "
                "length %.2f tokens per verify\n",
                (*drafter)->name().c_str(), spec->k, static_cast<unsigned long long>(spec_total.num_drafts),
                static_cast<unsigned long long>(spec_total.num_draft_tokens),
                static_cast<unsigned long long>(spec_total.num_accepted_tokens), 100.0 * spec_total.acceptance_rate(),
                spec_total.mean_acceptance_length());
    std::printf("               drafter host time %.1f ms in all (%.3f ms per draft: proposing%s)\n",
                spec_total.drafter_seconds * 1e3,
                spec_total.num_drafts ? spec_total.drafter_seconds * 1e3 / spec_total.num_drafts : 0.0,
                spec->method == SpecMethod::kDflash ? " and feeding it the committed rows" : "");
    std::printf("               (TPOT here is decode time over tokens; its p10/p90 are inter-token gaps, which are "
                "near zero inside a verify)\n");
  }
  if (!device_ms.empty()) {
    std::printf("  device step  median %.4f ms over %zu steps with all %d streams decoding (host and sync: TPOT - this)\n",
                lab::Median(device_ms), device_ms.size(), f.concurrency);
  }
  std::printf("  TTFT         median %.2f ms  p99 %.2f ms (at concurrency 1: the prefill time)\n", lab::Median(ttft_ms),
              lab::Percentile(ttft_ms, 99));
  std::printf("  prefill      %.0f prompt tok/s, %.1f TFLOP/s%s (every prompt to its first token; median of runs)\n",
              prefill.tok_s, prefill.tflops,
              peak_tflops > 0 ? fmt::format(", {:.1f}% of the measured BF16 peak {:.0f}", prefill.pct_of_peak,
                                            peak_tflops).c_str()
                              : "");
  std::printf("  bytes/step   %.3f GB (weights %.3f: routed experts %.2fx one token's, expected under uniform "
              "routing; KV %.4f)\n",
              bytes / 1e9, weight_bytes / 1e9, touched, kv_bytes / 1e9);
  std::printf("  weights/tok  %.3f GB at batch 1: BF16 %.3f, F32 %.4f, FP8 %.3f + scales %.4f (%s)\n", wb.total() / 1e9,
              wb.bf16 / 1e9, wb.f32 / 1e9, wb.fp8 / 1e9, wb.fp8_scales / 1e9,
              cfg.weight_quant.fp8()
                  ? fmt::format("FP8 weights, {} format", Fp8FormatName(cfg.weight_quant.format)).c_str()
                  : "no FP8 weights");
  if (copy_gbps > 0) {
    std::printf("  floor        %.4f ms per step at %.0f GB/s copy bandwidth -> %.1f%% of floor (TPOT)%s\n", floor_ms,
                copy_gbps, 100.0 * floor_ms / tpot,
                device_ms.empty() ? ""
                                  : fmt::format(", {:.1f}% (device step)", 100.0 * floor_ms / lab::Median(device_ms)).c_str());
  }
  if (gpu.is_null()) {
    std::printf("  backend      cpu reference (no kernels, graph or launch modes)\n");
  } else {
    std::printf("  kernels      %d per batch-1 step (%.1f per layer), %s, %s\n", kernels,
                cfg.num_hidden_layers ? double(kernels) / cfg.num_hidden_layers : 0.0,
                f.no_graph ? "launched one by one" : "CUDA graphs per batch bucket",
                describe.value("dependent_launch", false) ? "programmatic dependent launch" : "plain launches");
    std::printf("  tuning       %s\n", kernels::TuningString(opts->tuning).c_str());
  }
  if (kernels::TimelineBuilt() && !gpu.is_null()) {
    // The runner restarts the recording before every decode step: what is left is the last one.
    auto records = kernels::TimelineRead();
    if (!records.ok()) return ReportError(records.status().WithContext("timeline"));
    const auto spans = kernels::TimelineSpans(*records);
    const auto rows = kernels::TimelineSummary(spans);
    std::printf("  timeline of the last decode step (timeline build: the stamps cost time; compare the TPOT of "
                "a normal build):\n%s  one layer's launches in order:\n%s",
                kernels::FormatTimeline(rows, spans).c_str(), kernels::FormatLaunches(spans, 12).c_str());
    nlohmann::json jrows = nlohmann::json::array(), jspans = nlohmann::json::array();
    for (const auto& r : rows) {
      jrows.push_back({{"kernel", r.name}, {"count", r.count}, {"exposed_us", r.exposed_us},
                       {"total_exposed_us", r.total_exposed_us}, {"span_us", r.span_us}, {"lag_us", r.lag_us},
                       {"release_us", r.release_us}, {"after_us", r.after_us}});
    }
    for (const auto& sp : spans) {
      jspans.push_back({{"kernel", std::string(kernels::TimelineTagName(sp.tag))}, {"blocks", sp.blocks},
                        {"first_start_ns", sp.first_start}, {"last_start_ns", sp.last_start},
                        {"first_waited_ns", sp.first_waited}, {"last_waited_ns", sp.last_waited},
                        {"last_end_ns", sp.last_end}, {"exposed_ns", sp.exposed}});
    }
    j["timeline"] = {{"summary", jrows}, {"launches", jspans}};
  }
  return WriteJsonOut(f.json_out, j);
}

struct BenchServeFlags {
  EngineFlags engine;
  SpecFlags spec;
  std::string endpoint;
  int max_batch = 0;  // 0: the concurrency (or 64 for unbounded)
  int max_num_batched_tokens = 0;
  lab::ServeBenchOptions bench;
  std::string json_out;
  std::string serve_log = "/tmp/decodelab-bench-serve.log";
  std::string prompt_file;  // every request's prompt is this text
};

void PrintServeSummary(const nlohmann::json& j) {
  auto line = [&](const char* label, const std::string& key, const char* fmtstr = "%.2f") {
    std::printf("%-40s", label);
    std::printf(fmtstr, j.value(key, 0.0));
    std::printf("\n");
  };
  std::printf("============ Serving Benchmark Result ============\n");
  std::printf("%-40s%d\n", "Successful requests:", j.value("completed", 0));
  std::printf("%-40s%d\n", "Failed requests:", j.value("failed", 0));
  std::printf("%-40s%d\n", "Maximum request concurrency:", j.value("max_concurrency", 0));
  line("Benchmark duration (s):", "duration");
  std::printf("%-40s%lld\n", "Total input tokens:", static_cast<long long>(j.value("total_input_tokens", 0)));
  std::printf("%-40s%lld\n", "Total generated tokens:", static_cast<long long>(j.value("total_output_tokens", 0)));
  line("Request throughput (req/s):", "request_throughput");
  line("Output token throughput (tok/s):", "output_throughput");
  line("Total Token throughput (tok/s):", "total_token_throughput");
  for (auto [title, name, label] :
       {std::tuple{"---------------Time to First Token----------------", "ttft", "TTFT"},
        std::tuple{"-----Time per Output Token (excl. 1st token)------", "tpot", "TPOT"},
        std::tuple{"---------------Inter-token Latency----------------", "itl", "ITL"},
        std::tuple{"----------------End-to-end Latency----------------", "e2el", "E2EL"}}) {
    std::printf("%s\n", title);
    for (auto [stat, title_case] : {std::pair{"mean", "Mean"}, std::pair{"median", "Median"}, std::pair{"p99", "P99"}}) {
      line(fmt::format("{} {} (ms):", title_case, label).c_str(), fmt::format("{}_{}_ms", stat, name));
    }
  }
  // Speculation (where the server exports vLLM's spec-decode counters): acceptance beside tok/s.
  std::printf("%s", lab::FormatSpecBlock(j).c_str());
  std::printf("==================================================\n");
}

int RunBenchServe(const BenchServeFlags& f) {
  lab::ServeBenchOptions o = f.bench;
  if (!f.prompt_file.empty()) {
    auto text = ReadRegularFile(f.prompt_file, 16 << 20);
    if (!text.ok()) return ReportError(text.status());
    if (text->empty()) return ReportError(InvalidArgument("--prompt-file {} is empty", f.prompt_file));
    o.prompt_text = std::move(*text);
  }
  std::unique_ptr<lab::ServeChild> child;
  lab::Endpoint ep;
  if (!f.endpoint.empty()) {
    if (!f.engine.model_dir.empty() || !f.engine.shape.empty() || f.spec.method != "none" || !f.spec.model.empty()) {
      return ReportError(InvalidArgument("bench serve: give --endpoint (a running server) or --model/--shape (one "
                                         "this command starts, with its --spec flags), not both"));
    }
    auto parsed = lab::ParseEndpoint(f.endpoint);
    if (!parsed.ok()) return ReportError(parsed.status());
    ep = *parsed;
  } else {
    if (f.engine.model_dir.empty() == f.engine.shape.empty()) {
      return ReportError(InvalidArgument("bench serve: give --endpoint URL, or exactly one of --model/--shape"));
    }
    std::vector<std::string> args = f.engine.ToArgs();
    const auto spec_args = f.spec.ToArgs();
    args.insert(args.end(), spec_args.begin(), spec_args.end());
    const int max_batch = f.max_batch > 0 ? f.max_batch : (o.concurrency > 0 ? o.concurrency : 64);
    args.insert(args.end(), {"--max-batch", std::to_string(max_batch)});
    if (f.max_num_batched_tokens > 0) {
      args.insert(args.end(), {"--max-num-batched-tokens", std::to_string(f.max_num_batched_tokens)});
    }
    std::fprintf(stderr, "starting decodelab serve (log: %s) ...\n", f.serve_log.c_str());
    auto started = lab::ServeChild::Start("/proc/self/exe", args, f.serve_log, 1800);
    if (!started.ok()) return ReportError(started.status());
    child = std::move(*started);
    ep = child->endpoint();
  }
  auto result = lab::RunServeBench(ep, o, [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); });
  if (child) child->Stop();
  if (!result.ok()) return ReportError(result.status());
  nlohmann::json j = *result;
  j["commit"] = BuildCommit();
  if (!f.prompt_file.empty()) j["prompt_file"] = f.prompt_file;
  PrintServeSummary(j);
  if (!f.json_out.empty()) {
    std::ofstream out(f.json_out);
    out << j.dump(2) << "\n";
    if (!out) return ReportError(DataLoss("cannot write {}", f.json_out));
    std::printf("wrote %s\n", f.json_out.c_str());
  }
  return j.value("failed", 0) == 0 ? 0 : 1;
}

void AddBenchServeCommand(CLI::App* bench, CommandContext& ctx) {
  auto flags = std::make_shared<BenchServeFlags>();
  CLI::App* cmd = bench->add_subcommand(
      "serve", "Serving benchmark over HTTP (vllm bench serve's counterpart): random token prompts, streamed, "
               "greedy, ignore_eos; against --endpoint or a `decodelab serve` it starts");
  flags->engine.Add(cmd);
  flags->spec.Add(cmd);
  cmd->add_option("--endpoint", flags->endpoint, "A running OpenAI-compatible server, http://HOST:PORT (any engine)");
  cmd->add_option("--input-len", flags->bench.input_len, "Prompt tokens per request")->default_val(1024);
  cmd->add_option("--output-len", flags->bench.output_len, "Generated tokens per request")->default_val(1024);
  cmd->add_option("--num-prompts", flags->bench.num_prompts, "Requests")->default_val(100);
  cmd->add_option("--concurrency,--max-concurrency", flags->bench.concurrency,
                  "Most requests in flight (0 = all at once)")
      ->default_val(0);
  cmd->add_option("--request-rate", flags->bench.request_rate, "Requests per second, Poisson arrivals (default inf)");
  cmd->add_option("--prompt-seed", flags->bench.seed, "Seed of the prompts and arrivals (--seed is the started server's weights seed)")->default_val(0);
  cmd->add_option("--vocab-size", flags->bench.vocab_size,
                  "Prompt ids come from [0, N) (default: the server's, from /v1/decodelab/state)");
  cmd->add_option("--model-name", flags->bench.model, "The request's model (default: the first of /v1/models)");
  cmd->add_option("--max-batch", flags->max_batch, "Started server: --max-batch (default: the concurrency, 64 if 0)");
  cmd->add_option("--max-num-batched-tokens", flags->max_num_batched_tokens, "Started server: rows per step");
  cmd->add_option("--serve-log", flags->serve_log, "Started server: its log file");
  cmd->add_option("--json-out", flags->json_out, "Write the results as JSON (vLLM's key names)");
  cmd->add_option("--prompt-file", flags->prompt_file,
                  "Every request's prompt is this file's text, tokenized by the server (replaces --input-len "
                  "random ids; e.g. tools/bench/prompts/repetitive_code.txt for --spec ngram)");
  cmd->callback([flags, &ctx] { ctx.exit_code = RunBenchServe(*flags); });
}

}  // namespace

void AddBenchCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = root.add_subcommand(
      "bench", "Decode benchmark in process through the serving scheduler (no HTTP; end-of-sequence ignored)");
  flags->engine.Add(cmd);
  cmd->add_option("--prompt-len", flags->prompt_len, "Prompt tokens")->default_val(1024);
  cmd->add_option("--gen-len", flags->gen_len, "Generated tokens per run")->default_val(1024);
  cmd->add_option("--repeat", flags->repeat, "Runs; TPOT statistics pool all of them")->default_val(3);
  cmd->add_option("--concurrency", flags->concurrency, "Requests decoded together (continuous batching)")
      ->default_val(1)
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--max-num-batched-tokens", flags->max_num_batched_tokens,
                  "Token rows per forward (decode rows + prefill chunks); default max(prefill chunk, concurrency)");
  cmd->add_flag("--allow-fallback", flags->allow_fallback,
                "Run a generic attention kernel where a preset is not built (the result says "
                "fallback and is not a speed result)");
  cmd->add_flag("--no-graph", flags->no_graph, "Launch kernels one by one instead of a CUDA graph");
  cmd->add_option("--skip-ops", flags->skip_ops,
                  fmt::format("Timing experiment (CUDA): leave these op families out of every forward to "
                              "see what each costs inside the real step: {}. Outputs are wrong; the result "
                              "is marked and is not a speed result",
                              fmt::join(kSkippableOps, ", ")))
      ->delimiter(',');
  cmd->add_option("--json-out", flags->json_out, "Write the results as JSON");
  flags->spec.Add(cmd);
  cmd->add_option("--prompt-file", flags->prompt_file,
                  "Every request's prompt: this file's text, encoded with the model's tokenizer (replaces the "
                  "random --prompt-len prompt; e.g. tools/bench/prompts/repetitive_code.txt for --spec ngram)");
  cmd->add_flag("--verify-cost", flags->verify_cost,
                "Instead of the decode bench: time one verify forward (1 + K rows per sequence, outputs on "
                "every row) against one decode forward at a context of --prompt-len, for each --verify-k and "
                "--verify-batch; prints device ms, the ratio and the break-even acceptance length (with --spec "
                "dflash --spec-model DIR also the drafter's block and per-row cost and the cycle's break-even)");
  cmd->add_option("--verify-k", flags->verify_k, "--verify-cost: draft counts K")
      ->delimiter(',')
      ->default_str("2,4,8,15")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--verify-batch", flags->verify_batch, "--verify-cost: sequences per forward")
      ->delimiter(',')
      ->default_str("1,8")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--prefill-sweep", flags->prefill_sweep,
                  "Instead of the decode bench: prefill prompts of these lengths alone (e.g. 128,1024,8192,32768; "
                  "--repeat runs each) and print TTFT, prompt tokens/s and TFLOP/s against the measured BF16 peak")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--sweep-warmup", flags->sweep_warmup,
                  "--prefill-sweep: untimed requests per length before the timed ones (the first request of a "
                  "length captures its CUDA graphs, which a server does once per shape)")
      ->default_val(1)
      ->check(CLI::Range(0, 100));
  cmd->add_option("--verify-iters", flags->verify_iters, "--verify-cost: timed forwards per point (after 3 warm-up)")
      ->default_val(20)
      ->check(CLI::Range(1, 10000));
  AddBenchServeCommand(cmd, ctx);
  AddBenchCommCommand(cmd, ctx);
  cmd->callback([flags, &ctx, cmd] {
    // `bench serve` or `bench comm` ran instead
    if (cmd->get_subcommand("serve")->parsed() || cmd->get_subcommand("comm")->parsed()) return;
    ctx.exit_code = RunBench(*flags);
  });
}

}  // namespace dl::app
