// decodelab inspect: what a checkpoint (or a built-in shape) is -- config summary, per-layer
// attention/MLP types and head counts, parameter counts, bytes read per decoded token, KV bytes.
#include <cstdio>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "apps/decodelab/commands.h"
#include "apps/decodelab/engine_flags.h"
#include "model/hf_cache.h"
#include "model/checkpoint.h"
#include "model/param_count.h"
#include "model/shapes.h"
#include "model/shard_plan.h"

namespace dl::app {
namespace {

struct InspectFlags {
  std::string model;
  std::string shape;
  int num_layers = 0;
  bool json = false;
  bool config_only = false;
  int tp = 1;  // > 1: print the tensor-parallel shard plan (per-rank shapes)
  std::string embedding = "replicated";
};

std::string Human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return fmt::format("{:.2f} {}", bytes, units[u]);
}

std::string RopeSummary(const RopeParams& p, int64_t head_dim) {
  const RopeTable t = ComputeRopeTable(p, head_dim);
  if (p.rope_type == "yarn") {
    return fmt::format("yarn theta={:g} factor={:g} orig={} beta={:g}/{:g} attention_factor={:.6g} rotary={}/{} "
                       "ramp=[{:g},{:g}]",
                       p.theta, p.factor, p.original_max_position_embeddings, p.beta_fast, p.beta_slow,
                       p.attention_factor, t.rotary_dim, head_dim, t.yarn_low, t.yarn_high);
  }
  return fmt::format("default theta={:g} rotary={}/{}", p.theta, t.rotary_dim, head_dim);
}

// Bytes per token of the layouts a checkpoint of `c` can have (docs/fp8.md).
std::vector<std::pair<std::string, WeightBytesPerToken>> LayoutBytes(const ModelConfig& c) {
  Fp8Options exp, all;
  exp.layout = Fp8Layout::kExport;
  all.layout = Fp8Layout::kAllLinear;
  return {{"bf16", ActiveWeightBytes(c, DType::kBF16)},
          {"fp8-export", ActiveWeightBytes(c, DType::kBF16, &exp)},
          {"fp8-all-linear", ActiveWeightBytes(c, DType::kBF16, &all)}};
}

int RunInspect(InspectFlags f) {
  if (f.model.empty() == f.shape.empty()) return ReportError(InvalidArgument("give exactly one of --model or --shape"));
  if (!f.model.empty()) {
    auto dir = ResolveModelDir(f.model, HubCacheDir());
    if (!dir.ok()) return ReportError(dir.status());
    f.model = *dir;
  }
  ModelConfig c;
  std::optional<Checkpoint> ck;
  std::string source;
  if (!f.shape.empty()) {
    auto r = ShapeConfig(f.shape, f.num_layers > 0 ? std::optional<int>(f.num_layers) : std::nullopt);
    if (!r.ok()) return ReportError(r.status());
    c = *r;
    source = "shape " + f.shape;
  } else if (f.config_only) {
    auto r = ModelConfig::FromFile(f.model + "/config.json");
    if (!r.ok()) return ReportError(r.status());
    c = *r;
    source = f.model + "/config.json";
  } else {
    auto r = Checkpoint::Open(f.model);
    if (!r.ok()) return ReportError(r.status());
    ck.emplace(std::move(r).value());
    c = ck->config();
    source = f.model;
  }
  const ParamCounts p = CountParams(c);
  const int64_t ctxs[] = {4096, 32768, 131072};
  std::optional<TensorParallelPlan> plan;
  if (f.tp > 1) {
    auto mode = ParseEmbeddingMode(f.embedding);
    if (!mode.ok()) return ReportError(mode.status());
    auto r = MakeTensorParallelPlan(c, f.tp, *mode);
    if (!r.ok()) return ReportError(r.status());
    plan = std::move(r).value();
  } else if (f.tp < 1) {
    return ReportError(InvalidArgument("--tp must be at least 1 (got {})", f.tp));
  }
  // Rank 0's BF16 weight bytes per decode step at batch 1 and 64 (experts touched: top-k, and the
  // expected number of distinct experts 64 rows pick).
  auto rank_bytes = [&](int64_t batch) {
    return ReadBytesPerForward(c, *plan, 0, ExpectedDistinctExperts(c.num_experts, c.num_experts_per_tok, batch), 2)
        .total();
  };
  if (f.json) {
    nlohmann::ordered_json j;
    j["source"] = source;
    j["config"] = c.ToJson();
    j["params"] = {{"total", p.total},
                   {"active", p.active},
                   {"embedding_row", p.embedding_row},
                   {"embedding", p.embedding},
                   {"lm_head", p.lm_head},
                   {"attention", p.attention},
                   {"dense_mlp", p.dense_mlp},
                   {"routed_experts", p.routed_experts},
                   {"active_routed_experts", p.active_routed},
                   {"shared_experts", p.shared_experts},
                   {"routers", p.routers},
                   {"correction_biases", p.correction_biases},
                   {"block_norms", p.block_norms}};
    j["bytes_per_token"] = {{"bf16", p.bytes_per_token_bf16()},
                            {"fp8_routed_experts", p.bytes_per_token_fp8_experts()},
                            {"fp8_linears", p.bytes_per_token_fp8_linears()}};
    // With scales, by storage: each layout, and (with --model) the checkpoint as stored.
    auto by_dtype = [](const WeightBytesPerToken& b) {
      return nlohmann::ordered_json{{"bf16", b.bf16}, {"f32", b.f32},           {"fp8", b.fp8},
                                    {"fp8_scales", b.fp8_scales}, {"total", b.total()}};
    };
    nlohmann::ordered_json layouts;
    for (const auto& [name, bytes] : LayoutBytes(c)) layouts[name] = by_dtype(bytes);
    if (ck) layouts["checkpoint"] = by_dtype(ActiveWeightBytes(*ck));
    j["weight_bytes_per_token"] = layouts;
    j["kv_bytes_per_token"] = {{"bf16", KvBytesPerToken(c, 2)}, {"fp8", KvBytesPerToken(c, 1)}};
    nlohmann::ordered_json kr = nlohmann::ordered_json::object();
    for (int64_t t : ctxs) kr[std::to_string(t)] = {{"bf16", KvBytesReadPerToken(c, t, 2)}, {"fp8", KvBytesReadPerToken(c, t, 1)}};
    j["kv_bytes_read_per_token"] = kr;
    if (ck) {
      j["files"] = ck->files();
      j["tensors"] = ck->tensors().size();
      j["weight_bytes"] = ck->weight_bytes();
      j["fused_experts"] = ck->fused_experts();
    }
    j["warnings"] = c.warnings;
    if (plan) {
      nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
      for (const RankShard& rs : plan->ranks) {
        nlohmann::ordered_json layers = nlohmann::ordered_json::array();
        for (const LayerShard& ls : rs.layers) {
          layers.push_back({{"q_heads", ls.q_heads.size}, {"kv_heads", ls.kv_heads.size},
                            {"dense_ff", ls.dense_ff.size}, {"expert_ff", ls.expert_ff.size},
                            {"shared_ff", ls.shared_ff.size}});
        }
        ranks.push_back({{"rank", rs.rank},
                         {"lm_head_vocab", {rs.lm_head_vocab.begin, rs.lm_head_vocab.end()}},
                         {"embedding_vocab", {rs.embed_vocab.begin, rs.embed_vocab.end()}},
                         {"layers", layers}});
      }
      j["tensor_parallel"] = {{"size", plan->tp_size},
                              {"embedding", EmbeddingModeName(plan->embedding)},
                              {"all_reduces_per_forward", plan->AllReducesPerForward(c.num_hidden_layers)},
                              {"rank0_bf16_bytes_per_decode_step", {{"batch1", rank_bytes(1)}, {"batch64", rank_bytes(64)}}},
                              {"ranks", ranks}};
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("model: %s\n", source.c_str());
  if (ck) {
    std::printf("files: %zu safetensors, %zu tensors, %s of weights%s\n", ck->files().size(), ck->tensors().size(),
                Human(static_cast<double>(ck->weight_bytes())).c_str(), ck->fused_experts() ? ", fused experts" : "");
  }
  std::printf("vocab %lld, hidden %lld, layers %lld, head_dim %lld, kv heads %lld, window %lld, max positions %lld\n",
              (long long)c.vocab_size, (long long)c.hidden_size, (long long)c.num_hidden_layers, (long long)c.head_dim,
              (long long)c.num_key_value_heads, (long long)c.sliding_window, (long long)c.max_position_embeddings);
  std::printf("experts %lld (top %lld), widths routed/shared/dense %lld/%lld/%lld, alpha %g, softcap %g, gating %s, "
              "eps %g, tied %s, dtype %s\n",
              (long long)c.num_experts, (long long)c.num_experts_per_tok, (long long)c.moe_intermediate_size,
              (long long)c.shared_expert_intermediate_size, (long long)c.intermediate_size, c.moe_routed_scaling_factor,
              c.moe_router_logit_softcapping, c.gating == GatingKind::kPerHead ? "per-head" : "per-element",
              c.rms_norm_eps, c.tie_word_embeddings ? "yes" : "no", c.dtype.c_str());
  std::printf("rope full:    %s\n", RopeSummary(c.rope_full, c.head_dim).c_str());
  std::printf("rope sliding: %s\n", RopeSummary(c.rope_sliding, c.head_dim).c_str());
  if (c.has_quantization_config) {
    const WeightQuantization& q = c.weight_quant;
    std::printf("quantization_config: %s%s\n", c.quant_method.c_str(),
                q.fp8() ? fmt::format(" (FP8 weights, {} scales{}, {} ignored modules)",
                                      Fp8GranularityName(q.granularity),
                                      q.granularity == Fp8Granularity::kBlock
                                          ? fmt::format(" {}x{}", q.block_rows, q.block_cols)
                                          : std::string(),
                                      q.ignore.size())
                                .c_str()
                        : " (KV cache scheme only)");
  }
  for (const auto& w : c.warnings) std::printf("warning: %s\n", w.c_str());
  std::printf("\nlayer  attention  heads  gqa  rotary  mlp     kv_scales\n");
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    std::string scales = "-";
    if (ck && ck->weights().layers[l].k_scale) {
      scales = fmt::format("k={:g} v={:g}", *ck->weights().layers[l].k_scale, ck->weights().layers[l].v_scale.value_or(0.f));
    }
    std::printf("%5lld  %-9s  %5lld  %3lld  %6lld  %-6s  %s\n", (long long)l, c.is_sliding(l) ? "sliding" : "full",
                (long long)c.heads(l), (long long)(c.heads(l) / c.num_key_value_heads), (long long)c.rotary_dim(l),
                c.is_sparse(l) ? "sparse" : "dense", scales.c_str());
  }
  // Counts with a unit that fits (a tiny model has thousands, XS.2 billions).
  auto h = [](int64_t n) {
    const double v = static_cast<double>(n);
    if (v >= 1e9) return fmt::format("{:.3f} B", v / 1e9);
    if (v >= 1e6) return fmt::format("{:.3f} M", v / 1e6);
    if (v >= 1e3) return fmt::format("{:.1f} K", v / 1e3);
    return fmt::format("{}", n);
  };
  std::printf("\nparameters: total %lld (%s)\n", (long long)p.total, h(p.total).c_str());
  std::printf("  attention %s, routed experts %s, shared %s, dense %s, routers+bias %s, embedding %s, "
              "lm_head %s, norms %s\n",
              h(p.attention).c_str(), h(p.routed_experts).c_str(), h(p.shared_experts).c_str(),
              h(p.dense_mlp).c_str(), h(p.routers + p.correction_biases).c_str(), h(p.embedding).c_str(),
              h(p.lm_head).c_str(), h(p.block_norms).c_str());
  std::printf("active per token: %lld (%s) + %lld embedding row\n", (long long)p.active, h(p.active).c_str(),
              (long long)p.embedding_row);
  std::printf("weight bytes read per decoded token (batch 1; FP8 with its FP32 scales; floor at the H200's "
              "4.8 TB/s peak):\n");
  std::printf("  %-36s %15s  %9s  %9s  %9s  %8s\n", "layout", "total B", "BF16 GB", "FP8 GB", "scales MB", "floor ms");
  auto row = [](const std::string& name, const WeightBytesPerToken& b) {
    std::printf("  %-36s %15lld  %9.3f  %9.3f  %9.3f  %8.3f\n", name.c_str(), (long long)b.total(),
                (b.bf16 + b.f32) / 1e9, b.fp8 / 1e9, b.fp8_scales / 1e6, b.total() / 4.8e12 * 1e3);
  };
  if (ck) {
    row(ck->config().weight_quant.fp8()
            ? fmt::format("this checkpoint ({})", Fp8FormatName(ck->config().weight_quant.format))
            : std::string("this checkpoint"),
        ActiveWeightBytes(*ck));
  }
  for (const auto& [name, bytes] : LayoutBytes(c)) row(name, bytes);
  std::printf("KV cache per token: %lld B BF16, %lld B FP8\n", (long long)KvBytesPerToken(c, 2),
              (long long)KvBytesPerToken(c, 1));
  std::printf("KV bytes read per decoded token:");
  for (int64_t t : ctxs) {
    std::printf("  T=%lld: %s BF16 / %s FP8", (long long)t, Human(KvBytesReadPerToken(c, t, 2)).c_str(),
                Human(KvBytesReadPerToken(c, t, 1)).c_str());
  }
  std::printf("\n");
  if (plan) {
    std::printf("\n%s", DescribeTensorParallelPlan(c, *plan).c_str());
    std::printf("BF16 weight bytes rank 0 reads per decode step: batch 1 %s, batch 64 %s\n",
                Human(static_cast<double>(rank_bytes(1))).c_str(), Human(static_cast<double>(rank_bytes(64))).c_str());
  }
  return 0;
}

}  // namespace

void AddInspectCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<InspectFlags>();
  CLI::App* cmd = root.add_subcommand(
      "inspect",
      "Describe a Laguna checkpoint (validating every tensor) or a built-in shape: config, per-layer\n"
      "attention and MLP types, parameter counts, weight and KV bytes per decoded token");
  cmd->add_option("--model", flags->model,
                  "Checkpoint directory (config.json + safetensors), Hugging Face cache directory, "
                  "or org/name in the hub cache");
  cmd->add_option("--shape", flags->shape, "Built-in shape instead of a directory: tiny, xs2, s21")
      ->check(CLI::IsMember({"tiny", "xs2", "s21"}));
  cmd->add_option("--num-layers", flags->num_layers, "With --shape: keep only the first N layers")
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--config-only", flags->config_only, "With --model: read config.json only, skip the weights");
  cmd->add_flag("--json", flags->json, "Print one JSON object instead of text");
  cmd->add_option("--tp", flags->tp, "Also print the tensor-parallel shard plan for N ranks (per-rank shapes)")
      ->default_val(1);
  cmd->add_option("--embedding", flags->embedding, "With --tp: replicated or vocab-parallel embedding")
      ->default_val("replicated")
      ->check(CLI::IsMember({"replicated", "vocab-parallel"}));
  cmd->callback([flags, &ctx] { ctx.exit_code = RunInspect(*flags); });
}

}  // namespace dl::app
