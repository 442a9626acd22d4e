// `decodelab kernels`: the attention presets of presets.def with their canonical names and whether
// each is built into this binary, plus the other kernels. Needs no GPU.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "apps/decodelab/commands.h"
#include "cuda/device.h"
#include "kernels/attention/attention.h"

namespace dl::app {

void AddKernelsCommand(CLI::App& root, CommandContext& ctx) {
  auto* cmd = root.add_subcommand(
      "kernels",
      "List the attention kernel presets (canonical names, built or not) and the other CUDA kernels "
      "of this binary. Presets are chosen at build time with -DDECODELAB_ATTN_PRESETS; a missing "
      "preset is an error at run time unless --allow-fallback is given. Works without a GPU.");
  struct Opts {
    bool all = false;
    bool json = false;
    std::string check;
  };
  auto opts = std::make_shared<Opts>();
  cmd->add_flag("--all", opts->all, "Also list the presets of presets.def that are not built");
  cmd->add_flag("--json", opts->json, "Print JSON instead of a table");
  cmd->add_option("--check", opts->check,
                  "Resolve one preset key written as D,G,P,KV,WINDOW (e.g. 128,8,32,fp8,sliding); "
                  "exit 1 with the list of built presets when it is not built");
  cmd->callback([opts, &ctx] {
    if (!opts->check.empty()) {
      kernels::AttnPresetKey key;
      char kv[8] = {0}, win[12] = {0};
      if (std::sscanf(opts->check.c_str(), "%d,%d,%d,%7[a-z0-9],%11[a-z]", &key.head_dim,
                      &key.group, &key.page_size, kv, win) != 5 ||
          (std::string(kv) != "fp8" && std::string(kv) != "bf16") ||
          (std::string(win) != "global" && std::string(win) != "sliding")) {
        ctx.exit_code = ReportError(InvalidArgument(
            "--check '{}': expected D,G,P,fp8|bf16,global|sliding", opts->check));
        return;
      }
      key.kv_dtype = std::string(kv) == "fp8" ? kernels::KvDtype::kFp8 : kernels::KvDtype::kBf16;
      key.window = std::string(win) == "sliding" ? kernels::WindowKind::kSliding
                                                 : kernels::WindowKind::kGlobal;
      auto r = kernels::ResolveAttention(key);
      if (!r.ok()) {
        ctx.exit_code = ReportError(r.status());
        return;
      }
      std::printf("%s: built\n", r->name.c_str());
      return;
    }
    const auto presets = kernels::AllPresets();
    const char* others[][2] = {
        {"add_rmsnorm", "fused residual add + RMSNorm (BF16)"},
        {"qknorm_rope_append", "QK-norm + partial/YaRN RoPE + FP8/BF16 paged KV append"},
        {"attn_combine", "split-KV chunk combine + softplus gate (per head / per element)"},
        {"attn_generic_fallback", "slow generic attention, only with --allow-fallback"},
        {"gemv", "BF16 GEMV / batch-invariant small-T GEMM"},
        {"gemv_fp8", "FP8-weight GEMV / small-T GEMM, block scales in the kernel (the FP8 rule, ops.h)"},
        {"gemv_mma", "tensor-core product (mma.sync) for every row count, and the MoE experts (--tune mma_products=1)"},
        {"moe", "router top-k + routed/shared SwiGLU experts + combine (3 launches)"},
        {"moe_fp8", "the MoE with FP8 routed and/or shared experts (BF16 router)"},
        {"argmax", "argmax over the vocabulary (ties -> lowest index)"},
    };
    const bool cuda = cuda::BuiltWithCuda();
    if (opts->json) {
      nlohmann::json j;
      j["cuda_backend"] = cuda;
      j["attention_presets"] = nlohmann::json::array();
      for (const auto& p : presets) {
        if (!opts->all && !p.built) continue;
        j["attention_presets"].push_back({{"name", p.name},
                                          {"head_dim", p.key.head_dim},
                                          {"group", p.key.group},
                                          {"page_size", p.key.page_size},
                                          {"kv_dtype", kernels::KvDtypeName(p.key.kv_dtype)},
                                          {"window", kernels::WindowKindName(p.key.window)},
                                          {"built", p.built},
                                          {"default", p.in_default_set}});
      }
      j["other_kernels"] = nlohmann::json::array();
      for (auto& o : others) j["other_kernels"].push_back({{"name", o[0]}, {"built", cuda}});
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    size_t built = 0;
    for (const auto& p : presets) built += p.built;
    std::printf("attention presets: %zu built of %zu in presets.def%s\n", built, presets.size(),
                cuda ? "" : " (this build has no CUDA backend)");
    std::printf("  %-34s %5s %3s %5s %-5s %-8s %s\n", "name", "D", "G", "page", "kv", "window",
                "status");
    for (const auto& p : presets) {
      if (!opts->all && !p.built) continue;
      std::printf("  %-34s %5d %3d %5d %-5s %-8s %s\n", p.name.c_str(), p.key.head_dim,
                  p.key.group, p.key.page_size, std::string(kernels::KvDtypeName(p.key.kv_dtype)).c_str(),
                  std::string(kernels::WindowKindName(p.key.window)).c_str(),
                  p.built ? "built" : (p.in_default_set ? "not built (default set)" : "not built"));
    }
    if (!opts->all && built < presets.size()) {
      std::printf("  (%zu more in presets.def: --all lists them)\n", presets.size() - built);
    }
    std::printf("other kernels%s:\n", cuda ? "" : " (not available: no CUDA backend)");
    for (auto& o : others) std::printf("  %-22s %s\n", o[0], o[1]);
  });
}

}  // namespace dl::app
