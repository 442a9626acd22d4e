#include "engine/tp_rank_process.h"

#include <charconv>
#include <cstdio>

#include "backend/tp_process_ranks.h"
#include "comm/launch_env.h"

namespace dl {

std::vector<std::string> TpRankModelArgs(const EngineOptions& o) {
  if (!o.model_dir.empty()) return {"--model", o.model_dir};
  std::vector<std::string> a = {"--shape", o.shape, "--seed", std::to_string(o.seed)};
  if (o.num_layers) a.insert(a.end(), {"--num-layers", std::to_string(*o.num_layers)});
  if (o.shape_fp8) {  // every field of the FP8 layout: the child must quantise exactly as rank 0 did
    const Fp8Options& f = *o.shape_fp8;
    a.insert(a.end(), {"--fp8-layout", std::string(Fp8LayoutName(f.layout)), "--fp8-format",
                       std::string(Fp8FormatName(f.format)), "--fp8-granularity",
                       std::string(Fp8GranularityName(f.granularity)), "--fp8-block-rows",
                       std::to_string(f.block_rows), "--fp8-block-cols", std::to_string(f.block_cols)});
  }
  return a;
}

TpProcessOptions TpProcessOptionsFor(const EngineOptions& o) {
  TpProcessOptions p;
  p.exe = o.tp_rank_exe;
  p.argv_prefix = o.tp_rank_argv_prefix;
  for (std::string& a : TpRankModelArgs(o)) p.argv_prefix.push_back(std::move(a));
  return p;
}

namespace {

Result<EngineOptions> ParseModelArgs(const std::vector<std::string>& args) {
  EngineOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& key = args[i];
    if (i + 1 >= args.size()) return InvalidArgument("__tp-rank: '{}' without a value", key);
    const std::string& value = args[++i];
    if (key == "--model") {
      o.model_dir = value;
    } else if (key == "--shape") {
      o.shape = value;
    } else if (key == "--seed") {
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), o.seed);
      if (ec != std::errc() || end != value.data() + value.size()) {
        return InvalidArgument("__tp-rank: --seed '{}' is not a whole number", value);
      }
    } else if (key == "--num-layers") {
      DL_ASSIGN_OR_RETURN(long long v, comm::ParseInteger(value, key));
      o.num_layers = static_cast<int>(v);
    } else if (key.starts_with("--fp8-")) {
      Fp8Options& f = o.shape_fp8 ? *o.shape_fp8 : o.shape_fp8.emplace();
      if (key == "--fp8-layout") {
        DL_ASSIGN_OR_RETURN(f.layout, ParseFp8Layout(value));
      } else if (key == "--fp8-format") {
        DL_ASSIGN_OR_RETURN(f.format, ParseFp8Format(value));
      } else if (key == "--fp8-granularity") {
        DL_ASSIGN_OR_RETURN(f.granularity, ParseFp8Granularity(value));
      } else if (key == "--fp8-block-rows" || key == "--fp8-block-cols") {
        DL_ASSIGN_OR_RETURN(long long v, comm::ParseInteger(value, key));
        (key == "--fp8-block-rows" ? f.block_rows : f.block_cols) = v;
      } else {
        return InvalidArgument("__tp-rank: unknown flag '{}'", key);
      }
    } else {
      return InvalidArgument("__tp-rank: unknown flag '{}'", key);
    }
  }
  return o;
}

}  // namespace

int TpRankProcessMain(const std::string& program, const std::vector<std::string>& args) {
  const Status st = RunTpRankProcess(args);
  if (!st.ok()) std::fprintf(stderr, "%s __tp-rank: error: %s\n", program.c_str(), st.message().c_str());
  std::fflush(nullptr);
  return st.ok() ? 0 : 1;
}

Status RunTpRankProcess(const std::vector<std::string>& args) {
  std::vector<std::string> model_args;
  DL_ASSIGN_OR_RETURN(TpRankArgs rank, ParseTpRankArgs(args, &model_args));
  DL_ASSIGN_OR_RETURN(EngineOptions model, ParseModelArgs(model_args));
  return RunTpRankChild(rank, [&]() { return LoadHostCheckpoint(model); });
}

}  // namespace dl
