// decodelab generate: greedy decoding of one prompt given as text or token ids.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <span>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "apps/decodelab/commands.h"
#include "engine/dflash_drafter.h"
#include "apps/decodelab/engine_flags.h"
#include "base/sha256.h"
#include "lab/lab_stats.h"
#include "model/shapes.h"

namespace dl::app {
namespace {

struct GenerateFlags {
  EngineFlags engine;
  SpecFlags spec;
  std::string prompt_ids;
  std::string prompt;
  int max_tokens = 16;
  bool ignore_eos = false;
  bool allow_fallback = false;
  bool json = false;
};

int RunGenerate(const GenerateFlags& f) {
  auto opts = f.engine.ToOptions();
  if (!opts.ok()) return ReportError(opts.status());
  opts->allow_fallback = f.allow_fallback;
  auto spec = f.spec.ToOptions();
  if (!spec.ok()) return ReportError(spec.status());
  if (Status st = SpecFlags::Size(*spec, &*opts); !st.ok()) return ReportError(st);
  if (f.prompt.empty() == f.prompt_ids.empty()) {
    return ReportError(InvalidArgument("give exactly one of --prompt TEXT or --prompt-ids IDS"));
  }
  // The tokenizer, for a text prompt and to print the output as text.
  std::string no_tokenizer;
  auto tokenizer = LoadModelTokenizer(*opts, &no_tokenizer);
  if (!tokenizer.ok()) return ReportError(tokenizer.status());
  if (!f.prompt.empty() && !*tokenizer) {
    return ReportError(
        InvalidArgument("--prompt needs the model's tokenizer ({}): give --prompt-ids", no_tokenizer));
  }
  // Text is encoded as /v1/completions does (the tokenizer's special tokens added).
  auto prompt = f.prompt.empty() ? ParseIdList(f.prompt_ids) : (*tokenizer)->Encode(f.prompt, true);
  if (!prompt.ok()) return ReportError(prompt.status());
  if (prompt->empty()) return ReportError(InvalidArgument("--prompt encodes to no tokens"));
  opts->max_seq_len = std::max<int>(opts->max_seq_len,
                                    static_cast<int>(prompt->size()) + f.max_tokens);
  auto engine = LoadEngine(*opts);
  if (!engine.ok()) return ReportError(engine.status());
  // The drafter once the model is loaded (DFlash reads its hidden size, vocabulary and LM head).
  auto drafter = MakeDrafterFor(*spec, *(*engine)->checkpoint, (*engine)->runner.get());
  if (!drafter.ok()) return ReportError(drafter.status());
  spdlog::info("backend: {} ({})", (*engine)->runner->backend_name(),
               (*engine)->backend_choice_reason);
  GenerateOptions g;
  g.max_tokens = f.max_tokens;
  g.ignore_eos = f.ignore_eos;
  g.prefill_chunk = opts->prefill_chunk;
  g.drafter = drafter->get();
  g.num_draft_tokens = spec->enabled() ? spec->k : 0;
  auto r = GenerateGreedy(**engine, *prompt, g);
  if (!r.ok()) return ReportError(r.status());

  // Without speculation every decode forward gives one token: the median forward is the TPOT. With
  // it a forward gives 1 + accepted tokens: decode time over decoded tokens.
  double decode_s = 0;
  int64_t decode_tokens = 0;
  for (size_t i = 0; i < r->decode_step_seconds.size(); ++i) {
    decode_s += r->decode_step_seconds[i];
    decode_tokens += r->decode_step_tokens[i];
  }
  const double tpot = spec->enabled() ? (decode_tokens > 0 ? decode_s / decode_tokens : 0.0)
                                      : lab::Median(r->decode_step_seconds);
  const double tok_s = tpot > 0 ? 1.0 / tpot : 0.0;
  FILE* text_out = f.json ? stderr : stdout;
  std::string ids;
  for (size_t i = 0; i < r->tokens.size(); ++i) ids += (i ? "," : "") + std::to_string(r->tokens[i]);
  std::fprintf(text_out, "tokens: %s\n", ids.c_str());
  // The generated text, without special tokens and without the end-of-sequence token that stopped it.
  std::optional<std::string> text;
  if (*tokenizer) {
    std::span<const int32_t> shown(r->tokens);
    if (r->finish_reason == "stop" && !shown.empty()) shown = shown.first(shown.size() - 1);
    text = (*tokenizer)->Decode(shown, true);
    std::fprintf(text_out, "text: %s\n", text->c_str());
  }
  std::fprintf(text_out,
               "generated %zu tokens (finish: %s); prefill %zu tokens in %.3f ms; decode %s "
               "%.3f ms/token = %.1f tok/s\n",
               r->tokens.size(), r->finish_reason.c_str(), prompt->size(), r->prefill_seconds * 1e3,
               spec->enabled() ? "mean" : "median", tpot * 1e3, tok_s);
  nlohmann::json spec_json = SpecFlags::ToJson(*spec);
  if (spec->enabled()) {
    const SpecStats& st = r->spec;
    std::fprintf(text_out,
                 "speculative (%s, k %d): %llu verify steps with drafts, %llu drafted, %llu accepted (%.1f%%), "
                 "mean acceptance length %.2f\n",
                 (*drafter)->name().c_str(), spec->k, static_cast<unsigned long long>(st.num_drafts),
                 static_cast<unsigned long long>(st.num_draft_tokens),
                 static_cast<unsigned long long>(st.num_accepted_tokens), 100.0 * st.acceptance_rate(),
                 st.mean_acceptance_length());
    spec_json["drafter"] = (*drafter)->name();
    spec_json["num_drafts"] = st.num_drafts;
    spec_json["num_draft_tokens"] = st.num_draft_tokens;
    spec_json["num_accepted_tokens"] = st.num_accepted_tokens;
    spec_json["num_accepted_tokens_per_pos"] = st.accepted_per_pos;
    spec_json["mean_acceptance_length"] = st.mean_acceptance_length();
    spec_json["decode_forwards"] = r->decode_step_seconds.size();
    spec_json["drafter_ms"] = st.drafter_seconds * 1e3;
  }
  if (f.json) {
    nlohmann::json j = {
        {"tokens", r->tokens},
        {"text", text ? nlohmann::json(*text) : nlohmann::json(nullptr)},
        {"finish_reason", r->finish_reason},
        {"prompt_tokens", prompt->size()},
        {"prefill_ms", r->prefill_seconds * 1e3},
        {"decode_median_tpot_ms", tpot * 1e3},
        {"speculative", spec_json},
        {"decode_tok_s", tok_s},
        {"decode_step_ms", [&] {
           std::vector<double> ms;
           for (double s : r->decode_step_seconds) ms.push_back(s * 1e3);
           return ms;
         }()},
        {"backend", (*engine)->runner->Describe()},
        {"kv_dtype", f.engine.kv_dtype},
        {"page_size", f.engine.page_size},
        {"ignore_eos", f.ignore_eos},
        {"kv_scales_source", (*engine)->runner->kv_scales().source},
    };
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

}  // namespace

void AddGenerateCommand(CLI::App& root, CommandContext& ctx) {
  auto flags = std::make_shared<GenerateFlags>();
  CLI::App* cmd = root.add_subcommand(
      "generate",
      "Greedy decoding of one prompt (text or token ids); prints the generated ids, text and speed");
  flags->engine.Add(cmd);
  flags->spec.Add(cmd);
  auto* ids = cmd->add_option("--prompt-ids", flags->prompt_ids,
                              "Prompt token ids, comma-separated: 5,17,42");
  auto* text = cmd->add_option("--prompt", flags->prompt,
                               "Prompt text, encoded with the model's tokenizer (special tokens "
                               "added, as /v1/completions does)");
  ids->excludes(text);
  cmd->add_option("--max-tokens", flags->max_tokens, "Tokens to generate")->default_val(16)
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--ignore-eos", flags->ignore_eos, "Do not stop at an end-of-sequence token");
  cmd->add_flag("--allow-fallback", flags->allow_fallback,
                "CUDA: run a generic attention kernel where a preset is not built (reported in "
                "--json's backend; slow)");
  cmd->add_flag("--json", flags->json,
                "Print one single-line JSON object as the last line of stdout (text goes to stderr)");
  cmd->callback([flags, &ctx] { ctx.exit_code = RunGenerate(*flags); });
}

}  // namespace dl::app
