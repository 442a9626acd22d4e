// decodelab bench: in-process batch-1 decode timing (no HTTP), always ignoring end-of-sequence.
// Prints, and writes as JSON: TPOT percentiles over decode steps (the first excluded), tok/s, prefill
// time, bytes read per token, the GPU copy bandwidth measured at start, the memory floor and the
// fraction of it reached, kernels per step, the fallback flag, and the build/GPU/settings identity.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "apps/decodelab/commands.h"
#include "apps/decodelab/engine_flags.h"
#include "base/build_info.h"
#include "base/rng.h"
#include "base/sha256.h"
#include "cuda/bandwidth.h"
#include "lab/lab_stats.h"
#include "cuda/device.h"
#include "kernels/timeline.h"
#include "model/cuda_runner.h"
#include "model/param_count.h"

namespace dl::app {
namespace {

struct BenchFlags {
  EngineFlags engine;
  int prompt_len = 1024;
  int gen_len = 1024;
  int repeat = 3;
  bool allow_fallback = false;
  bool no_graph = false;
  std::vector<std::string> skip_ops;
  std::string json_out;
};

std::vector<int32_t> BenchPrompt(int n, int64_t vocab) {
  const uint64_t key = StreamKey(0, "decodelab-bench-prompt-v1");
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = static_cast<int32_t>(SplitMix64(key ^ SplitMix64(i)) % vocab);
  return p;
}

int RunBench(const BenchFlags& f) {
  using Clock = std::chrono::steady_clock;
  auto opts = f.engine.ToOptions();
  if (!opts.ok()) return ReportError(opts.status());
  if (f.prompt_len < 1 || f.gen_len < 2 || f.repeat < 1) {
    return ReportError(InvalidArgument("--prompt-len >= 1, --gen-len >= 2 and --repeat >= 1 please"));
  }
  if (opts->shape == "s21" && opts->backend != BackendKind::kCpu) {
    return ReportError(InvalidArgument(
        "--shape s21 at BF16 (235 GB) does not fit one H200: it needs TP >= 2 or FP8 weights, which "
        "this version does not have yet"));
  }
  opts->max_seq_len = f.prompt_len + f.gen_len + 1;
  opts->allow_fallback = f.allow_fallback;
  opts->use_graph = !f.no_graph;
  opts->skip_ops = f.skip_ops;
  if (opts->backend == BackendKind::kAuto && f.engine.kv_dtype == "f32" &&
      cuda::DeviceCount() > 0) {
    opts->kv_dtype = DType::kF8E4M3;  // the bench default on a GPU is the FP8 cache
  }
  nlohmann::json gpu = nullptr;
  double copy_gbps = 0.0;
  if (cuda::DeviceCount() > 0 && opts->backend != BackendKind::kCpu) {
    auto info = cuda::GetDeviceInfo(0);
    if (info.ok()) gpu = {{"name", info->name}, {"sms", info->sm_count}, {"pci", info->pci_bus_id}};
    std::fprintf(stderr, "measuring device-to-device copy bandwidth ...\n");
    auto bw = cuda::MeasureCopyBandwidthGBps(0);
    if (!bw.ok()) return ReportError(bw.status());
    copy_gbps = *bw;
    std::fprintf(stderr, "copy bandwidth: %.0f GB/s (read + write)\n", copy_gbps);
  }
  const auto t_load = Clock::now();
  auto engine = LoadEngine(*opts);
  if (!engine.ok()) return ReportError(engine.status());
  std::fprintf(stderr, "backend: %s (%s); load %.1f s\n", (*engine)->runner->backend_name().c_str(),
               (*engine)->backend_choice_reason.c_str(),
               std::chrono::duration<double>(Clock::now() - t_load).count());
  const ModelConfig& cfg = (*engine)->config();
  const auto prompt = BenchPrompt(f.prompt_len, cfg.vocab_size);
  auto* cuda_runner = dynamic_cast<CudaRunner*>((*engine)->runner.get());

  std::vector<double> run_medians, all_steps, prefill_ms;
  for (int rep = 0; rep < f.repeat; ++rep) {
    KvCache& kv = *(*engine)->kv;
    SequenceKv seq;
    std::vector<float> logits;
    std::vector<double> steps;
    Status st = [&]() -> Status {
      const auto t0 = Clock::now();
      for (int i = 0; i < f.prompt_len; i += opts->prefill_chunk) {
        const int n = std::min(opts->prefill_chunk, f.prompt_len - i);
        DL_RETURN_IF_ERROR(kv.Reserve(seq, n));
        DL_RETURN_IF_ERROR((*engine)->runner->Forward(
            seq, std::span<const int32_t>(prompt).subspan(i, n), false, &logits));
        DL_RETURN_IF_ERROR(kv.Commit(seq, n));
      }
      prefill_ms.push_back(std::chrono::duration<double>(Clock::now() - t0).count() * 1e3);
      int32_t token = ArgmaxWithMargin(logits).first;
      for (int s = 0; s < f.gen_len; ++s) {
        const auto ts = Clock::now();
        DL_RETURN_IF_ERROR(kv.Reserve(seq, 1));
        if (cuda_runner) {
          DL_ASSIGN_OR_RETURN(token, cuda_runner->DecodeArgmax(seq, token));
        } else {
          DL_RETURN_IF_ERROR((*engine)->runner->Forward(seq, std::span<const int32_t>(&token, 1),
                                                        false, &logits));
          token = ArgmaxWithMargin(logits).first;
        }
        DL_RETURN_IF_ERROR(kv.Commit(seq, 1));
        steps.push_back(std::chrono::duration<double>(Clock::now() - ts).count() * 1e3);
      }
      return Status::Ok();
    }();
    Status rel = kv.Release(seq);
    if (!st.ok()) return ReportError(st);
    if (!rel.ok()) return ReportError(rel);
    steps.erase(steps.begin());  // the first decode step also captures the graph
    run_medians.push_back(lab::Median(steps));
    all_steps.insert(all_steps.end(), steps.begin(), steps.end());
    std::fprintf(stderr, "run %d/%d: prefill %.2f ms, median TPOT %.4f ms\n", rep + 1, f.repeat,
                 prefill_ms.back(), run_medians.back());
  }

  const ParamCounts pc = CountParams(cfg);
  const int64_t kv_elem = static_cast<int64_t>(DTypeSize((*engine)->kv->spec().dtype));
  // KV read per step averaged over the decoded contexts.
  double kv_bytes = 0;
  for (int s = 1; s < f.gen_len; ++s) {
    kv_bytes += static_cast<double>(KvBytesReadPerToken(cfg, f.prompt_len + s, kv_elem));
  }
  kv_bytes /= (f.gen_len - 1);
  const double weight_bytes = static_cast<double>(pc.bytes_per_token_bf16());
  const double bytes = weight_bytes + kv_bytes;
  const double tpot = lab::Median(all_steps);
  const double floor_ms = copy_gbps > 0 ? bytes / (copy_gbps * 1e9) * 1e3 : 0.0;
  const nlohmann::json describe = (*engine)->runner->Describe();
  int kernels = 0;
  if (describe.contains("topology") && describe["topology"].is_array()) {
    kernels = describe["topology"][0].value("kernel_nodes", 0);
  }
  const double spread = (*std::max_element(run_medians.begin(), run_medians.end()) -
                         *std::min_element(run_medians.begin(), run_medians.end())) / tpot;
  auto self = Sha256OfSelf();
  nlohmann::json j = {
      {"tpot_ms_median", tpot},
      {"tpot_ms_p10", lab::Percentile(all_steps, 10)},
      {"tpot_ms_p90", lab::Percentile(all_steps, 90)},
      {"tok_s", 1e3 / tpot},
      {"run_median_tpot_ms", run_medians},
      {"run_spread_rel", spread},
      {"prefill_ms_median", lab::Median(prefill_ms)},
      {"bytes_per_token", bytes},
      {"weight_bytes_per_token", weight_bytes},
      {"kv_bytes_per_token_mean", kv_bytes},
      {"copy_bandwidth_gbps", copy_gbps},
      {"memory_floor_ms", floor_ms},
      {"pct_of_floor", floor_ms > 0 ? 100.0 * floor_ms / tpot : 0.0},
      {"kernels_per_step", kernels},
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
      {"settings",
       {{"model", f.engine.model_dir},
        {"shape", f.engine.shape},
        {"num_layers", cfg.num_hidden_layers},
        {"seed", f.engine.seed},
        {"prompt_len", f.prompt_len},
        {"gen_len", f.gen_len},
        {"repeat", f.repeat},
        {"kv_dtype", std::string(DTypeName((*engine)->kv->spec().dtype))},
        {"page_size", (*engine)->kv->spec().page_size},
        {"prefill_chunk", opts->prefill_chunk},
        {"graph", !f.no_graph},
        {"dependent_launch", describe.value("dependent_launch", false)},
        {"fused_norm", describe.value("fused_norm", std::string("0"))},
        {"ignore_eos", true}}}};
  std::printf("decodelab bench  commit %s  %s\n", BuildCommit().c_str(),
              gpu.is_null() ? "cpu" : gpu["name"].get<std::string>().c_str());
  std::printf("  model        %s, %lld layers, kv %s page %d, prompt %d, gen %d, %d runs%s\n",
              f.engine.model_dir.empty() ? ("shape " + f.engine.shape).c_str() : f.engine.model_dir.c_str(),
              static_cast<long long>(cfg.num_hidden_layers),
              std::string(DTypeName((*engine)->kv->spec().dtype)).c_str(),
              (*engine)->kv->spec().page_size, f.prompt_len, f.gen_len, f.repeat,
              describe.value("fallback", false) ? "  ** FALLBACK: not a speed result **" : "");
  if (!f.skip_ops.empty()) {
    std::printf("  ** SKIPPED OPS: %s (timing experiment; outputs are wrong; not a speed result) **\n",
                fmt::format("{}", fmt::join(f.skip_ops, ",")).c_str());
  }
  std::printf("  TPOT         median %.4f ms  p10 %.4f  p90 %.4f  (%.1f tok/s; run spread %.1f%%)\n",
              tpot, lab::Percentile(all_steps, 10), lab::Percentile(all_steps, 90), 1e3 / tpot, 100 * spread);
  std::printf("  prefill      %.2f ms (median of runs)\n", lab::Median(prefill_ms));
  std::printf("  bytes/token  %.3f GB (weights %.3f + KV %.4f)\n", bytes / 1e9, weight_bytes / 1e9,
              kv_bytes / 1e9);
  if (copy_gbps > 0) {
    std::printf("  floor        %.4f ms at %.0f GB/s copy bandwidth -> %.1f%% of floor\n", floor_ms,
                copy_gbps, 100.0 * floor_ms / tpot);
  }
  if (gpu.is_null()) {
    std::printf("  backend      cpu reference (no kernels, graph or launch modes)\n");
  } else {
    std::printf("  kernels      %d per step (%.1f per layer), %s, %s, %s\n", kernels,
                cfg.num_hidden_layers ? double(kernels) / cfg.num_hidden_layers : 0.0,
                f.no_graph ? "launched one by one" : "one CUDA graph",
                describe.value("dependent_launch", false) ? "programmatic dependent launch"
                                                          : "plain launches (DECODELAB_PDL=0)",
                describe.value("fused_norm", std::string("0")) == "0" ? "separate norm kernels"
                : describe.value("fused_norm_before_attention", false) ? "norms folded into q/k/v/g and the router"
                                                                        : "norm folded into the router only");
    if (describe.contains("stream_gemv")) {
      const std::string gemv = describe.value("stream_gemv", std::string("0"));
      std::printf("  GEMV         %s\n", gemv == "0" ? "plain kernel at batch 1 (DECODELAB_STREAM_GEMV=0)"
                                                     : ("streaming at batch 1: " + gemv).c_str());
    }
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
  if (!f.json_out.empty()) {
    std::ofstream out(f.json_out);
    out << j.dump(2) << "\n";
    if (!out) return ReportError(DataLoss("cannot write {}", f.json_out));
    std::printf("  wrote %s\n", f.json_out.c_str());
  }
  return 0;
}

}  // namespace

void AddBenchCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<BenchFlags>();
  CLI::App* cmd = root.add_subcommand(
      "bench", "Batch-1 decode benchmark in process (no HTTP; end-of-sequence ignored)");
  flags->engine.Add(cmd);
  cmd->add_option("--prompt-len", flags->prompt_len, "Prompt tokens")->default_val(1024);
  cmd->add_option("--gen-len", flags->gen_len, "Generated tokens per run")->default_val(1024);
  cmd->add_option("--repeat", flags->repeat, "Runs; TPOT statistics pool all of them")->default_val(3);
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
  cmd->callback([flags, &ctx] { ctx.exit_code = RunBench(*flags); });
}

}  // namespace dl::app
