#include "apps/decodelab/engine_flags.h"

#include <charconv>
#include <cstdlib>
#include <filesystem>

#include "model/dflash.h"
#include "model/hf_cache.h"
#include "model/shapes.h"
#include "tokenizer/tokenizer_writer.h"

#include "kernels/tuning.h"

namespace dl::app {

void EngineFlags::Add(CLI::App* cmd, bool with_kv) {
  cmd->add_option("--model", model_dir,
                  "Model: a checkpoint directory (config.json + safetensors), a Hugging Face cache "
                  "directory (models--org--name), or org/name found in the hub cache ($HF_HUB_CACHE, "
                  "$HF_HOME/hub or ~/.cache/huggingface/hub; nothing is downloaded)");
  cmd->add_option("--shape", shape,
                  "Build random weights in memory instead of loading: tiny, xs2 or s21");
  cmd->add_option("--seed", seed, "Seed of the random weights for --shape")->default_val(0);
  cmd->add_option("--num-layers", num_layers,
                  "Keep the shape's dimensions with fewer layers (--shape only)");
  cmd->add_option("--shape-dtype", shape_dtype,
                  "Weights of --shape: bf16, or fp8 (E4M3 codes + FP32 128x128 block scales by make-model's "
                  "rule for the --fp8-layout tensors; docs/fp8.md)")
      ->default_val("bf16")
      ->check(CLI::IsMember({"bf16", "fp8"}));
  cmd->add_option("--fp8-layout", fp8_layout,
                  "With --shape-dtype fp8: export (routed experts, as Laguna's FP8 exports; default) or "
                  "all-linear (every linear but LM head, routers and g_proj)")
      ->check(CLI::IsMember({"export", "all-linear"}));
  cmd->add_option("--backend", backend, "auto (CUDA where a GPU is usable, else CPU), cpu or cuda")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  if (with_kv) {
    cmd->add_option("--kv-dtype", kv_dtype, "KV cache element type: f32, bf16 or fp8 (E4M3)")
        ->default_val("f32")
        ->check(CLI::IsMember({"f32", "bf16", "fp8"}));
    cmd->add_option("--kv-scales", kv_scales,
                    "FP8 KV scales file (from `decodelab calibrate`); default: the checkpoint's "
                    "k_scale/v_scale, else the built-in calibration");
    cmd->add_option("--page-size", page_size, "KV page size in tokens")
        ->default_val(16)
        ->check(CLI::IsMember({16, 32, 64}));
  }
  cmd->add_option("--max-seq-len", max_seq_len, "Longest sequence (prompt + generated) to plan for")
      ->default_val(4096);
  cmd->add_option("--prefill-chunk", prefill_chunk,
                  "Prompt tokens of one sequence per forward during prefill (larger chunks: a shorter TTFT, "
                  "longer pauses for the other streams' decode steps)")
      ->default_val(2048);
  cmd->add_option("--tune", tune, "CUDA kernel tuning, name=value (repeatable). " + kernels::TuningHelp());
  cmd->add_option("--tp", tp,
                  "Tensor-parallel ranks, threads of this process (or processes: --tp-transport processes). "
                  "CUDA: rank r runs on GPU r % (visible GPUs), so a tp above the GPU count shares GPUs "
                  "round-robin; the ranks' all-reduce is the rank-order one-shot/two-shot kernel over peer memory "
                  "(--tp-transport, --tune tp_two_shot_min_kb). docs/tensor-parallel.md")
      ->default_val(1);
  cmd->add_option("--tp-transport", tp_transport,
                  "How tensor-parallel ranks meet. auto: CPU ranks are threads of this process; CUDA takes "
                  "device-oneshot (nccl only for GPUs without peer access). processes: ranks 1..N-1 "
                  "are child processes of this one, bit-identical to threads, their output on this process's "
                  "stderr (CPU: collectives over TCP on 127.0.0.1; CUDA: the one-shot all-reduce over CUDA IPC "
                  "memory, device-oneshot-ipc, in graphs or eager). CUDA only: device-oneshot (rank-order "
                  "sum, inside the CUDA graphs), device-in-process (the same sum through host meetings; eager "
                  "forwards) or nccl (its order of addition depends on the message size: bit-identical run to run, "
                  "but a row's bits may depend on its chunk or batch at 3+ ranks)")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "processes", "device-oneshot", "device-in-process", "nccl"}));
  cmd->add_option("--embedding", embedding,
                  "How tensor-parallel ranks hold the embedding: replicated (whole table on every rank, "
                  "no collective) or vocab-parallel (a slice per rank, one all-reduce)")
      ->default_val("replicated")
      ->check(CLI::IsMember({"replicated", "vocab-parallel"}));
}

void SpecFlags::Add(CLI::App* cmd) {
  cmd->add_option("--spec", method,
                  "Speculative decoding: none, ngram (prompt lookup: drafts are what followed the latest "
                  "earlier occurrence of the context's last n tokens) or dflash (a DFlash block drafter, "
                  "--spec-model DIR, conditioned on the model's hidden states). Output is unchanged, token for token")
      ->default_val("none");
  cmd->add_option("--spec-k", k, "Draft tokens per verify step (at most; dflash: at most the drafter's block_size - 1)")
      ->default_val(4);
  cmd->add_option("--spec-ngram-min", ngram_min, "--spec ngram: shortest n-gram to match")->default_val(2);
  cmd->add_option("--spec-ngram-max", ngram_max, "--spec ngram: longest n-gram to match")->default_val(5);
  cmd->add_option("--spec-model", model,
                  "--spec dflash: the DFlash drafter checkpoint directory (config.json + model.safetensors, z-lab "
                  "or Poolside layout; make-model --shape tiny-dflash / --dflash-for DIR writes a random one)");
}

Result<SpecOptions> SpecFlags::ToOptions() const {
  SpecOptions o;
  DL_ASSIGN_OR_RETURN(o.method, SpecOptions::ParseMethod(method));
  o.model_dir = model;
  o.k = k;
  o.ngram_min = ngram_min;
  o.ngram_max = ngram_max;
  DL_RETURN_IF_ERROR(o.Validate());
  return o;
}

std::vector<std::string> SpecFlags::ToArgs() const {
  std::vector<std::string> a = {"--spec", method};
  if (method != "none") {
    a.insert(a.end(), {"--spec-k", std::to_string(k), "--spec-ngram-min", std::to_string(ngram_min),
                       "--spec-ngram-max", std::to_string(ngram_max)});
  }
  if (!model.empty()) a.insert(a.end(), {"--spec-model", model});
  return a;
}

Status SpecFlags::Size(const SpecOptions& spec, EngineOptions* engine) {
  engine->max_draft_tokens = spec.enabled() ? spec.k : 0;
  engine->max_hidden_taps = 0;
  if (spec.method == SpecMethod::kDflash) {
    auto c = DflashConfig::FromFile(spec.model_dir + "/config.json");
    if (!c.ok()) return c.status().WithContext("--spec-model");
    engine->max_hidden_taps = static_cast<int32_t>(c->num_taps());
  }
  return Status::Ok();
}

nlohmann::json SpecFlags::ToJson(const SpecOptions& spec) {
  nlohmann::json j = {{"method", SpecMethodName(spec.method)}};
  if (spec.enabled()) {
    j["num_speculative_tokens"] = spec.k;
    if (spec.method == SpecMethod::kNgram) {
      j["prompt_lookup_min"] = spec.ngram_min;
      j["prompt_lookup_max"] = spec.ngram_max;
    }
    if (spec.method == SpecMethod::kDflash) j["model"] = spec.model_dir;
  }
  return j;
}

std::string HubCacheDir() {
  // huggingface_hub's order: HF_HUB_CACHE (HUGGINGFACE_HUB_CACHE, its older name), HF_HOME/hub,
  // $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub.
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v && *v ? v : "";
  };
  if (auto d = env("HF_HUB_CACHE"); !d.empty()) return d;
  if (auto d = env("HUGGINGFACE_HUB_CACHE"); !d.empty()) return d;
  if (auto d = env("HF_HOME"); !d.empty()) return d + "/hub";
  if (auto d = env("XDG_CACHE_HOME"); !d.empty()) return d + "/huggingface/hub";
  if (auto d = env("HOME"); !d.empty()) return d + "/.cache/huggingface/hub";
  return "";
}

Result<EngineOptions> EngineFlags::ToOptions() const {
  EngineOptions o;
  if (!model_dir.empty()) {
    DL_ASSIGN_OR_RETURN(o.model_dir, ResolveModelDir(model_dir, HubCacheDir()));
  }
  o.shape = shape;
  o.seed = seed;
  if (num_layers > 0) {
    if (shape.empty()) return InvalidArgument("--num-layers applies only with --shape");
    o.num_layers = num_layers;
  }
  if (shape_dtype == "fp8") {
    if (shape.empty()) {
      return InvalidArgument(
          "--shape-dtype fp8 applies only with --shape (a checkpoint's tensors say their own dtype)");
    }
    Fp8Options f;
    if (!fp8_layout.empty()) {
      DL_ASSIGN_OR_RETURN(f.layout, ParseFp8Layout(fp8_layout));
    }
    o.shape_fp8 = f;
  } else if (shape_dtype != "bf16") {
    return InvalidArgument("--shape-dtype must be bf16 or fp8, got '{}'", shape_dtype);
  } else if (!fp8_layout.empty()) {
    return InvalidArgument("--fp8-layout applies only with --shape-dtype fp8");
  }
  DL_ASSIGN_OR_RETURN(o.backend, ParseBackend(backend));
  auto dt = DTypeFromName(kv_dtype);
  if (!dt) return InvalidArgument("--kv-dtype must be f32, bf16 or fp8");
  o.kv_dtype = *dt;
  o.kv_scales_file = kv_scales;
  o.page_size = page_size;
  if (max_seq_len < 1) return InvalidArgument("--max-seq-len must be positive");
  o.max_seq_len = max_seq_len;
  if (prefill_chunk < 1) return InvalidArgument("--prefill-chunk must be positive");
  o.prefill_chunk = prefill_chunk;
  o.max_rows_per_step = prefill_chunk;
  for (const std::string& t : tune) DL_RETURN_IF_ERROR(kernels::SetTuning(&o.tuning, t));
  if (tp < 1) return InvalidArgument("--tp must be at least 1 (got {})", tp);
  o.tp = tp;
  DL_ASSIGN_OR_RETURN(o.embedding, ParseEmbeddingMode(embedding));
  o.tp_transport = tp_transport;
  return o;
}

std::vector<std::string> EngineFlags::ToArgs() const {
  std::vector<std::string> a;
  if (!model_dir.empty()) a.insert(a.end(), {"--model", model_dir});
  if (!shape.empty()) a.insert(a.end(), {"--shape", shape, "--seed", std::to_string(seed)});
  if (num_layers > 0) a.insert(a.end(), {"--num-layers", std::to_string(num_layers)});
  if (shape_dtype != "bf16") a.insert(a.end(), {"--shape-dtype", shape_dtype});
  if (!fp8_layout.empty()) a.insert(a.end(), {"--fp8-layout", fp8_layout});
  a.insert(a.end(), {"--backend", backend, "--kv-dtype", kv_dtype, "--page-size", std::to_string(page_size),
                     "--max-seq-len", std::to_string(max_seq_len), "--prefill-chunk", std::to_string(prefill_chunk)});
  if (!kv_scales.empty()) a.insert(a.end(), {"--kv-scales", kv_scales});
  for (const std::string& t : tune) a.insert(a.end(), {"--tune", t});
  if (tp != 1) a.insert(a.end(), {"--tp", std::to_string(tp), "--embedding", embedding, "--tp-transport", tp_transport});
  return a;
}

Result<std::vector<int32_t>> ParseIdList(const std::string& text) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = text.find(',', i);
    if (j == std::string::npos) j = text.size();
    std::string item = text.substr(i, j - i);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    int64_t v = 0;
    auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || p != item.data() + item.size() || v < 0 ||
        v > INT32_MAX) {
      return InvalidArgument("--prompt-ids: \"{}\" is not a non-negative token id", item);
    }
    ids.push_back(static_cast<int32_t>(v));
    i = j + 1;
  }
  if (ids.empty()) return InvalidArgument("--prompt-ids is empty");
  return ids;
}

Result<std::optional<Tokenizer>> LoadModelTokenizer(const EngineOptions& o, std::string* why) {
  if (!o.model_dir.empty()) {
    if (!std::filesystem::exists(std::filesystem::path(o.model_dir) / "tokenizer.json")) {
      *why = o.model_dir + " has no tokenizer.json";
      return std::optional<Tokenizer>();
    }
    DL_ASSIGN_OR_RETURN(Tokenizer t, Tokenizer::FromFile(o.model_dir));
    return std::optional<Tokenizer>(std::move(t));
  }
  DL_ASSIGN_OR_RETURN(ModelConfig shape, ShapeConfig(o.shape, o.num_layers));
  const int64_t vocab_size = shape.vocab_size;
  if (vocab_size < MinSmallTokenizerVocabSize()) {
    *why = fmt::format("--shape {} has a vocabulary of {}, too small for the generated tokenizer",
                       o.shape, vocab_size);
    return std::optional<Tokenizer>();
  }
  DL_ASSIGN_OR_RETURN(std::string text, BuildSmallTokenizerJson(static_cast<int32_t>(vocab_size)));
  DL_ASSIGN_OR_RETURN(Tokenizer t, Tokenizer::FromJson(text, "generated tokenizer for --shape " + o.shape));
  return std::optional<Tokenizer>(std::move(t));
}

}  // namespace dl::app
