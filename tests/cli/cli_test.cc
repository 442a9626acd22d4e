// The decodelab command line as a user meets it: exit codes (usage errors exit 2), --version, and
// generate with a text prompt.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <csignal>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "base/build_info.h"

namespace dl {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int rc = -1;
  std::string out, err;
};

std::string Slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs the binary with `args` (shell words), capturing stdout and stderr separately.
CliRun Decodelab(const std::string& args, const std::string& env = "") {
  const fs::path dir = fs::temp_directory_path() / ("dl_cli_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string cmd = env + " timeout 120 '" + DECODELAB_EXE + "' " + args + " >'" +
                          (dir / "out").string() + "' 2>'" + (dir / "err").string() + "'";
  CliRun r;
  const int status = std::system(cmd.c_str());
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = Slurp(dir / "out");
  r.err = Slurp(dir / "err");
  fs::remove_all(dir);
  return r;
}

TEST(CliTest, UsageErrorsExitTwo) {
  for (const char* args : {"", "no-such-command", "generate --bogus", "serve --port 99999",
                           "serve --max-batch 0", "generate --shape tiny --max-tokens many",
                           "inspect --shape nope", "lab screen --no-such-flag"}) {
    const CliRun r = Decodelab(args);
    EXPECT_EQ(r.rc, 2) << "decodelab " << args << "\n" << r.err;
    EXPECT_NE(r.err.find("--help"), std::string::npos) << args << ": " << r.err;
  }
  // A usage error found after parsing (library InvalidArgument) exits 2 as well.
  const CliRun both = Decodelab("generate --shape tiny --backend cpu --prompt hi --prompt-ids 1,2");
  EXPECT_EQ(both.rc, 2) << both.err;
  const CliRun none = Decodelab("generate --shape tiny --backend cpu");
  EXPECT_EQ(none.rc, 2) << none.err;
  EXPECT_NE(none.err.find("--prompt"), std::string::npos) << none.err;
  // probe's exit codes 2..8 are classes of a probe that ran: its usage errors exit 1.
  const CliRun probe = Decodelab("probe --ranks abc");
  EXPECT_EQ(probe.rc, 1) << probe.err;
  // --help is not an error.
  EXPECT_EQ(Decodelab("--help").rc, 0);
  EXPECT_EQ(Decodelab("serve --help").rc, 0);
}

TEST(CliTest, ServeOnABusyPortIsAStartupErrorNamingTheAddress) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  // `timeout` turns a server that wrongly starts into exit 124 instead of a hang.
  const CliRun r = Decodelab("serve --shape tiny --backend cpu --max-seq-len 64 --port " +
                             std::to_string(port));
  ::close(fd);
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("in use"), std::string::npos) << r.err;
}

TEST(CliTest, VersionPrintsTheCommitAndBuildFlags) {
  const CliRun r = Decodelab("--version");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.rfind("decodelab ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("commit " + BuildCommit()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("compilers " + BuildCompilers()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("build " + BuildFlags()), std::string::npos) << r.out;
  EXPECT_NE(BuildFlags().find("CUDA"), std::string::npos);
  EXPECT_NE(BuildFlags().find("C++ flags"), std::string::npos);
}

TEST(CliTest, GenerateTakesTextAndPrintsText) {
  const CliRun r = Decodelab(
      "generate --shape tiny --backend cpu --prompt 'Hello, world' --max-tokens 5 --ignore-eos --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string last = r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1);
  const auto j = nlohmann::json::parse(last, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j["tokens"].size(), 5u);
  EXPECT_TRUE(j["text"].is_string());
  EXPECT_NE(r.err.find("text: " + j["text"].get<std::string>()), std::string::npos) << r.err;
  // The same prompt as ids gives the same tokens: --prompt is only a tokenizer in front.
  const CliRun tok = Decodelab("generate --shape tiny --backend cpu --prompt 'Hello, world' --max-tokens 1 --json");
  ASSERT_EQ(tok.rc, 0);
  const auto jt = nlohmann::json::parse(tok.out.substr(tok.out.rfind('\n', tok.out.size() - 2) + 1));
  EXPECT_GT(jt["prompt_tokens"].get<int>(), 1);
  // --allow-fallback is accepted by generate as by bench (it only matters on CUDA).
  const CliRun fb = Decodelab("generate --shape tiny --backend cpu --prompt-ids 5,6 --max-tokens 2 --allow-fallback");
  EXPECT_EQ(fb.rc, 0) << fb.err;
}

// Speculative decoding from the command line: --spec dflash and --spec-model are refused as not
// implemented (never ignored), --spec ngram gives generate's plain tokens with drafts counted, and
// bench reports the counters and times verify against decode with --verify-cost.
TEST(CliTest, SpecFlagsOnGenerateAndBench) {
  // --spec dflash needs --spec-model and --spec-model needs --spec dflash.
  for (const char* args : {"generate --shape tiny --backend cpu --prompt-ids 5,6 --spec dflash",
                           "serve --shape tiny --backend cpu --port 0 --spec dflash"}) {
    const CliRun r = Decodelab(args);
    EXPECT_NE(r.rc, 0) << args;
    EXPECT_NE(r.err.find("needs --spec-model"), std::string::npos) << args << ": " << r.err;
  }
  for (const char* args : {"generate --shape tiny --backend cpu --prompt-ids 5,6 --spec-model /nonexistent",
                           "bench --shape tiny --backend cpu --prompt-len 8 --gen-len 4 --spec ngram --spec-model /x"}) {
    const CliRun r = Decodelab(args);
    EXPECT_NE(r.rc, 0) << args;
    EXPECT_NE(r.err.find("needs --spec dflash"), std::string::npos) << args << ": " << r.err;
  }
  {
    const CliRun r = Decodelab("generate --shape tiny --backend cpu --prompt-ids 5,6 --spec dflash --spec-model /nonexistent");
    EXPECT_NE(r.rc, 0);
    EXPECT_NE(r.err.find("--spec-model"), std::string::npos) << r.err;
  }
  EXPECT_EQ(Decodelab("generate --shape tiny --backend cpu --prompt-ids 5,6 --spec eagle").rc, 2);
  EXPECT_EQ(Decodelab("generate --shape tiny --backend cpu --prompt-ids 5,6 --spec ngram --spec-k 0").rc, 2);
  std::string ids;
  for (int i = 0; i < 40; ++i) ids += (i ? "," : "") + std::to_string(40 + (i % 5) * 17);
  auto last_json = [](const CliRun& r) {
    return nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1), nullptr, false);
  };
  const CliRun plain = Decodelab("generate --shape tiny --backend cpu --max-tokens 24 --ignore-eos --json --prompt-ids " + ids);
  const CliRun spec = Decodelab("generate --shape tiny --backend cpu --max-tokens 24 --ignore-eos --json --spec ngram "
                                "--spec-k 3 --spec-ngram-min 1 --prompt-ids " + ids);
  ASSERT_EQ(plain.rc, 0) << plain.err;
  ASSERT_EQ(spec.rc, 0) << spec.err;
  const auto jp = last_json(plain), js = last_json(spec);
  ASSERT_TRUE(jp.is_object() && js.is_object()) << spec.out;
  EXPECT_EQ(js["tokens"], jp["tokens"]);
  EXPECT_EQ(jp["speculative"]["method"], "none");
  EXPECT_EQ(js["speculative"]["method"], "ngram");
  EXPECT_EQ(js["speculative"]["num_speculative_tokens"], 3);
  EXPECT_GT(js["speculative"]["num_drafts"].get<int>(), 0) << "a repetitive prompt always has an n-gram match";
  EXPECT_NE(spec.err.find("mean acceptance length"), std::string::npos) << spec.err;

  const fs::path out = fs::temp_directory_path() / ("dl_cli_spec_bench_" + std::to_string(::getpid()) + ".json");
  const CliRun bench = Decodelab("bench --shape tiny --backend cpu --prompt-len 24 --gen-len 12 --repeat 1 --spec ngram "
                                 "--spec-ngram-min 1 --json-out " + out.string());
  ASSERT_EQ(bench.rc, 0) << bench.err;
  EXPECT_NE(bench.out.find("speculative  ngram[1,5], k 4"), std::string::npos) << bench.out;
  const auto jb = nlohmann::json::parse(Slurp(out), nullptr, false);
  ASSERT_TRUE(jb.is_object());
  EXPECT_EQ(jb["speculative"]["method"], "ngram");
  EXPECT_TRUE(jb["speculative"].contains("vllm:spec_decode_num_drafts_total"));
  EXPECT_TRUE(jb["speculative"].contains("mean_acceptance_length"));
  EXPECT_GT(jb["decode_tok_s_per_stream"].get<double>(), 0.0);
  fs::remove(out);
  const CliRun cost = Decodelab("bench --shape tiny --backend cpu --verify-cost --prompt-len 20 --verify-k 2,4 "
                                "--verify-batch 1,2 --verify-iters 2");
  ASSERT_EQ(cost.rc, 0) << cost.err;
  EXPECT_NE(cost.out.find("break-even"), std::string::npos) << cost.out;
  int rows = 0;
  for (size_t at = cost.out.find("\n"); at != std::string::npos; at = cost.out.find("\n", at + 1)) {
    std::istringstream line(cost.out.substr(at + 1, cost.out.find("\n", at + 1) - at - 1));
    int batch = 0, k = 0;
    double decode_ms = 0, verify_ms = 0;
    if (line >> batch >> k >> decode_ms >> verify_ms) {
      EXPECT_GT(decode_ms, 0.0);
      EXPECT_GT(verify_ms, 0.0);
      ++rows;
    }
  }
  EXPECT_EQ(rows, 4) << cost.out;  // K 2 and 4 at batch 1 and 2
}

// bench serve with speculation: vLLM's Speculative Decoding block beside the throughputs and its
// result keys in the JSON, the counters' difference over the run; the same server without --spec
// has neither. Random prompts of 256 ids from the tiny vocabulary of 512: the generated token has
// occurred before in nearly every step, so the n-gram drafter (n >= 1) drafts. --prompt-file sends
// a text the server tokenizes; its input tokens come from usage.
TEST(CliTest, BenchServeReportsAcceptanceBesideTokS) {
  const fs::path dir = fs::temp_directory_path() / ("dl_cli_bench_serve_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string common = "bench serve --shape tiny --backend cpu --output-len 12 --num-prompts 2 --concurrency 2 "
                             "--serve-log '" + (dir / "serve.log").string() + "' --json-out ";
  const CliRun spec = Decodelab(common + "'" + (dir / "spec.json").string() +
                                "' --input-len 256 --spec ngram --spec-k 3 --spec-ngram-min 1");
  ASSERT_EQ(spec.rc, 0) << spec.out << spec.err;
  EXPECT_NE(spec.out.find("Output token throughput (tok/s):"), std::string::npos) << spec.out;
  EXPECT_NE(spec.out.find("---------------Speculative Decoding---------------"), std::string::npos) << spec.out;
  EXPECT_NE(spec.out.find("Acceptance length:"), std::string::npos) << spec.out;
  const auto j = nlohmann::json::parse(Slurp(dir / "spec.json"), nullptr, false);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["total_output_tokens"], 24);
  const int drafts = j["spec_decode_num_drafts"];
  EXPECT_GT(drafts, 0) << "the drafter found earlier occurrences";
  EXPECT_LE(j["spec_decode_draft_tokens"].get<int>(), 3 * drafts);
  EXPECT_LE(j["spec_decode_accepted_tokens"].get<int>(), j["spec_decode_draft_tokens"].get<int>());
  EXPECT_DOUBLE_EQ(j["spec_decode_acceptance_length"].get<double>(),
                   1.0 + j["spec_decode_accepted_tokens"].get<double>() / drafts);
  EXPECT_DOUBLE_EQ(j["spec_decode_acceptance_rate"].get<double>(),
                   100.0 * j["spec_decode_accepted_tokens"].get<double>() / j["spec_decode_draft_tokens"].get<double>());
  ASSERT_EQ(j["spec_decode_per_position_acceptance_rates"].size(), 3u);
  EXPECT_NE(spec.out.find("  Position 2:"), std::string::npos) << spec.out;

  std::string text;
  for (int i = 0; i < 6; ++i) text += "def get_user(self, key):\n    return self.rows[key]\n";
  std::ofstream(dir / "prompt.txt") << text;
  const CliRun plain = Decodelab(common + "'" + (dir / "plain.json").string() + "' --prompt-file '" +
                                 (dir / "prompt.txt").string() + "'");
  ASSERT_EQ(plain.rc, 0) << plain.out << plain.err;
  EXPECT_EQ(plain.out.find("Speculative Decoding"), std::string::npos) << plain.out;
  const auto p = nlohmann::json::parse(Slurp(dir / "plain.json"), nullptr, false);
  ASSERT_TRUE(p.is_object());
  EXPECT_FALSE(p.contains("spec_decode_num_drafts"));
  EXPECT_EQ(p["completed"], 2);
  EXPECT_GT(p["total_input_tokens"].get<int>(), 2 * 30) << "usage.prompt_tokens of the text prompt";
  EXPECT_TRUE(p["input_len"].is_null());
  fs::remove_all(dir);
}

// bench --prefill-sweep: one row per length with the prefill's rate and its arithmetic; the plain
// bench reports the prefill rate beside the TTFT; the sweep refuses what it does not combine with.
TEST(CliTest, BenchPrefillSweep) {
  const fs::path out = fs::temp_directory_path() / ("dl_cli_prefill_sweep_" + std::to_string(::getpid()) + ".json");
  const CliRun sweep = Decodelab("bench --shape tiny --backend cpu --prefill-sweep 8,40 --prefill-chunk 16 --repeat 2 "
                                 "--json-out " + out.string());
  ASSERT_EQ(sweep.rc, 0) << sweep.err;
  EXPECT_NE(sweep.out.find("prefill tok/s"), std::string::npos) << sweep.out;
  const auto j = nlohmann::json::parse(Slurp(out), nullptr, false);
  fs::remove(out);
  ASSERT_TRUE(j.is_object());
  ASSERT_EQ(j["prefill_sweep"].size(), 2u);
  double last_flops = 0;
  for (int i = 0; i < 2; ++i) {
    const auto& row = j["prefill_sweep"][i];
    EXPECT_EQ(row["prompt_len"], i == 0 ? 8 : 40);
    EXPECT_EQ(row["ttft_ms"].size(), 2u);
    const double ms = row["prefill_ms_median"].get<double>();
    ASSERT_GT(ms, 0.0);
    EXPECT_NEAR(row["prefill_tok_s"].get<double>(), row["prompt_len"].get<double>() / (ms * 1e-3), 1e-6 * row["prefill_tok_s"].get<double>());
    EXPECT_NEAR(row["prefill_tflops"].get<double>(), row["prefill_flops"].get<double>() / (ms * 1e-3) / 1e12, 1e-9);
    EXPECT_GT(row["prefill_flops"].get<double>(), last_flops);
    last_flops = row["prefill_flops"].get<double>();
  }
  EXPECT_EQ(j["settings"]["prefill_chunk"], 16);
  EXPECT_EQ(j["settings"]["sweep_warmup"], 1) << "one untimed request per length by default";
  EXPECT_NE(sweep.out.find("2 runs per length after 1 untimed"), std::string::npos) << sweep.out;
  EXPECT_EQ(j["bf16_peak_tflops"], 0.0) << "no GPU: no peak, and no share of it";

  const fs::path plain_out = fs::temp_directory_path() / ("dl_cli_prefill_plain_" + std::to_string(::getpid()) + ".json");
  const CliRun plain = Decodelab("bench --shape tiny --backend cpu --prompt-len 12 --gen-len 3 --repeat 1 --json-out " +
                                 plain_out.string());
  ASSERT_EQ(plain.rc, 0) << plain.err;
  const auto jp = nlohmann::json::parse(Slurp(plain_out), nullptr, false);
  fs::remove(plain_out);
  ASSERT_TRUE(jp.is_object());
  EXPECT_NEAR(jp["prefill_tok_s"].get<double>(), 12.0 / (jp["prefill_ms_median"].get<double>() * 1e-3),
              1e-6 * jp["prefill_tok_s"].get<double>());
  EXPECT_GT(jp["prefill_tflops"].get<double>(), 0.0);

  for (const char* bad : {"--concurrency 2", "--verify-cost", "--spec ngram"}) {
    const CliRun r = Decodelab(std::string("bench --shape tiny --backend cpu --prefill-sweep 8 ") + bad);
    EXPECT_NE(r.rc, 0) << bad;
    EXPECT_NE(r.err.find("--prefill-sweep"), std::string::npos) << bad << ": " << r.err;
  }
}

// A random DFlash drafter from make-model drives `generate --spec dflash` and `bench --spec dflash` on
// the tiny shape: the plain tokens, the drafter's counters; a drafter for another model is refused.
TEST(CliTest, DflashDrafterEndToEnd) {
  const fs::path dir = fs::temp_directory_path() / ("dl_cli_dflash_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const CliRun made = Decodelab("make-model --shape tiny-dflash --out " + (dir / "drafter").string());
  ASSERT_EQ(made.rc, 0) << made.err;
  const auto cfg = nlohmann::json::parse(Slurp(dir / "drafter" / "config.json"), nullptr, false);
  ASSERT_TRUE(cfg.is_object());
  EXPECT_EQ(cfg["architectures"][0], "DFlashLagunaForCausalLM");
  EXPECT_TRUE(cfg["dflash_config"].contains("target_layer_ids"));
  EXPECT_TRUE(fs::exists(dir / "drafter" / "model.safetensors"));
  // --dflash-for a written model gives the same kind of drafter; zlab layout too.
  ASSERT_EQ(Decodelab("make-model --shape tiny --num-layers 3 --out " + (dir / "model").string()).rc, 0);
  const CliRun made2 = Decodelab("make-model --dflash-for " + (dir / "model").string() + " --dflash-layout zlab "
                                 "--block-size 4 --num-layers 1 --out " + (dir / "zlab").string());
  ASSERT_EQ(made2.rc, 0) << made2.err;
  const auto cfg2 = nlohmann::json::parse(Slurp(dir / "zlab" / "config.json"), nullptr, false);
  EXPECT_EQ(cfg2["architectures"][0], "DFlashDraftModel");
  EXPECT_EQ(cfg2["dflash_config"]["num_target_layers"], 3);
  EXPECT_NE(Decodelab("make-model --shape tiny --block-size 4 --out " + (dir / "x").string()).rc, 0);
  // --dflash-for a built-in shape (a --shape target has no directory); an unknown name says what it takes.
  const CliRun made3 = Decodelab("make-model --dflash-for tiny --out " + (dir / "for_shape").string());
  ASSERT_EQ(made3.rc, 0) << made3.err;
  const auto cfg3 = nlohmann::json::parse(Slurp(dir / "for_shape" / "config.json"), nullptr, false);
  EXPECT_EQ(cfg3["dflash_config"]["num_target_layers"], 5);
  const CliRun bad_for = Decodelab("make-model --dflash-for no_such_model --out " + (dir / "y").string());
  EXPECT_NE(bad_for.rc, 0);
  EXPECT_NE(bad_for.err.find("a checkpoint directory or tiny, xs2, s21"), std::string::npos) << bad_for.err;

  auto last_json = [](const CliRun& r) {
    return nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1), nullptr, false);
  };
  const std::string gen = "generate --shape tiny --backend cpu --max-tokens 20 --ignore-eos --json --prompt-ids "
                          "40,57,74,91,108,40,57,74,91,108,40,57";
  const CliRun plain = Decodelab(gen);
  const CliRun spec = Decodelab(gen + " --spec dflash --spec-k 5 --spec-model " + (dir / "drafter").string());
  ASSERT_EQ(plain.rc, 0) << plain.err;
  ASSERT_EQ(spec.rc, 0) << spec.err;
  const auto jp = last_json(plain), js = last_json(spec);
  ASSERT_TRUE(jp.is_object() && js.is_object()) << spec.out;
  EXPECT_EQ(js["tokens"], jp["tokens"]);
  EXPECT_EQ(js["speculative"]["method"], "dflash");
  EXPECT_GT(js["speculative"]["num_drafts"].get<int>(), 0);
  // K beyond the block, and a drafter for a 3-layer model on the 5-layer tiny shape.
  const CliRun big = Decodelab(gen + " --spec dflash --spec-k 8 --spec-model " + (dir / "drafter").string());
  EXPECT_NE(big.rc, 0);
  EXPECT_NE(big.err.find("block_size"), std::string::npos) << big.err;
  const CliRun other = Decodelab(gen + " --spec dflash --spec-k 2 --spec-model " + (dir / "zlab").string());
  EXPECT_NE(other.rc, 0);
  EXPECT_NE(other.err.find("layers"), std::string::npos) << other.err;
  const fs::path out = dir / "bench.json";
  const CliRun bench = Decodelab("bench --shape tiny --backend cpu --prompt-len 24 --gen-len 12 --repeat 1 --spec dflash "
                                 "--spec-k 3 --spec-model " + (dir / "drafter").string() + " --json-out " + out.string());
  ASSERT_EQ(bench.rc, 0) << bench.err;
  const auto jb = nlohmann::json::parse(Slurp(out), nullptr, false);
  ASSERT_TRUE(jb.is_object());
  EXPECT_EQ(jb["speculative"]["method"], "dflash");
  EXPECT_GT(jb["speculative"]["vllm:spec_decode_num_drafts_total"].get<int>(), 0);
  EXPECT_GT(jb["speculative"]["drafter_ms_total"].get<double>(), 0.0);
  // --verify-cost with the drafter: its block and per-row context cost beside the verify's.
  const fs::path vc = dir / "verify.json";
  const CliRun cost = Decodelab("bench --shape tiny --backend cpu --verify-cost --prompt-len 20 --verify-k 2,7 "
                                "--verify-batch 1 --verify-iters 2 --spec dflash --spec-model " +
                                (dir / "drafter").string() + " --json-out " + vc.string());
  ASSERT_EQ(cost.rc, 0) << cost.err;
  EXPECT_NE(cost.out.find("cycle break-even"), std::string::npos) << cost.out;
  const auto jv = nlohmann::json::parse(Slurp(vc), nullptr, false);
  ASSERT_TRUE(jv.is_object());
  ASSERT_EQ(jv["verify_cost"].size(), 2u);
  for (const auto& p : jv["verify_cost"]) {
    EXPECT_GT(p["draft_block_ms"].get<double>(), 0.0);
    EXPECT_GT(p["draft_context_ms_per_row"].get<double>(), 0.0);
    EXPECT_TRUE(p.contains("cycle_break_even_mean_acceptance_length"));
  }
  EXPECT_NE(Decodelab("bench --shape tiny --backend cpu --verify-cost --verify-k 8 --spec dflash --spec-model " +
                      (dir / "drafter").string()).rc, 0)
      << "K 8 is beyond the block of 8";
  fs::remove_all(dir);
}

// --tp on the CPU reference: the same greedy tokens as one rank in both embedding modes (this
// prompt's margins on the tiny shape are far above FP32 rounding); refusals name what is wrong.
TEST(CliTest, TensorParallelGenerateAndInspect) {
  auto tokens = [](const CliRun& r) {
    const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', r.out.size() - 2) + 1), nullptr, false);
    return j.is_object() ? j["tokens"] : nlohmann::json();
  };
  const std::string base = "generate --shape tiny --backend cpu --prompt-ids 5,6,7,8,9 --max-tokens 12 --ignore-eos --json";
  const CliRun one = Decodelab(base);
  ASSERT_EQ(one.rc, 0) << one.err;
  // --tp-transport processes: ranks 1..N-1 are this binary re-executed as `__tp-rank` children.
  for (const char* extra : {" --tp 2", " --tp 4 --embedding vocab-parallel", " --tp 2 --embedding replicated",
                            " --tp 2 --tp-transport processes", " --tp 4 --embedding vocab-parallel --tp-transport processes"}) {
    const CliRun tp = Decodelab(base + extra);
    ASSERT_EQ(tp.rc, 0) << extra << ": " << tp.err;
    EXPECT_EQ(tokens(tp), tokens(one)) << extra;
    EXPECT_EQ(tokens(tp).size(), 12u);
    EXPECT_NE(tp.err.find("tensor parallel"), std::string::npos) << tp.err;
  }
  const CliRun three = Decodelab(base + " --tp 3");
  EXPECT_NE(three.rc, 0);
  EXPECT_NE(three.err.find("3 ranks"), std::string::npos) << three.err;
  // --tp on the CUDA backend is accepted: without a usable GPU it fails for that reason, not the tp;
  // with one it runs two ranks sharing the GPU (tokens vs the CPU: tests/gpu/cuda_tp_gpu_test.cc).
  const CliRun cuda = Decodelab("generate --shape tiny --backend cuda --tp 2 --prompt-ids 5,6 --max-tokens 2");
  if (cuda.rc != 0) {
    EXPECT_NE(cuda.err.find("no usable GPU"), std::string::npos) << cuda.err;
  } else {
    EXPECT_NE(cuda.err.find("tensor parallel 2"), std::string::npos) << cuda.err;
  }
  EXPECT_EQ(Decodelab(base + " --embedding sideways").rc, 2);
  const CliRun processes = Decodelab(base + " --tp 2 --tp-transport processes");
  EXPECT_NE(processes.out.find("\"transport\":\"processes\""), std::string::npos) << processes.out;
  EXPECT_EQ(Decodelab(base + " --tp 2 --tp-transport carrier-pigeon").rc, 2);
  const CliRun one_rank = Decodelab(base + " --tp-transport processes");
  EXPECT_EQ(one_rank.rc, 2);
  EXPECT_NE(one_rank.err.find("needs --tp 2 or more"), std::string::npos) << one_rank.err;
  const CliRun cuda_processes =
      Decodelab("generate --shape tiny --backend cuda --tp 2 --tp-transport processes --prompt-ids 5,6 --max-tokens 2");
  // CUDA ranks as processes: without a usable GPU refused for that reason; with one, rank 1 is a child
  // process on the same GPU (tests/gpu/cuda_tp_gpu_test.cc checks its bits).
  if (cuda_processes.rc != 0) {
    EXPECT_NE(cuda_processes.err.find("no usable GPU"), std::string::npos) << cuda_processes.err;
  } else {
    EXPECT_NE(cuda_processes.err.find("ranks 1.. as child processes"), std::string::npos) << cuda_processes.err;
  }
  EXPECT_NE(Decodelab("generate --help").out.find("processes"), std::string::npos);
  // The hidden rank subcommand is not for people: absent from --help, and refuses to run by hand.
  EXPECT_EQ(Decodelab("--help").out.find("__tp-rank"), std::string::npos);
  const CliRun by_hand = Decodelab("__tp-rank --model x");
  EXPECT_EQ(by_hand.rc, 1);
  EXPECT_NE(by_hand.err.find("started by rank 0"), std::string::npos) << by_hand.err;
  // The issue's per-rank shapes of S 2.1 at TP=4, without a GPU or weights.
  const CliRun inspect = Decodelab("inspect --shape s21 --tp 4");
  ASSERT_EQ(inspect.rc, 0) << inspect.err;
  EXPECT_NE(inspect.out.find("rank 3: sliding sparse (from layer 1): q=18 heads [54, 72) kv=2 heads [6, 8)"),
            std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("(from layer 0): q=12 heads [0, 12) kv=2 heads [0, 2)"), std::string::npos)
      << inspect.out;
  const CliRun bad = Decodelab("inspect --shape s21 --tp 5");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.err.find("KV heads"), std::string::npos) << bad.err;
}

// `decodelab serve` in the background, its stdout and stderr in files, stopped with SIGTERM.
class ServeProcess {
 public:
  explicit ServeProcess(const std::string& args) {
    static int instance = 0;
    dir_ = fs::temp_directory_path() /
           ("dl_cli_serve_" + std::to_string(::getpid()) + "_" + std::to_string(instance++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string cmd = std::string("exec '") + DECODELAB_EXE + "' serve " + args + " >'" +
                              (dir_ / "out").string() + "' 2>'" + (dir_ / "err").string() + "'";
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (int i = 0; i < 600 && port_ == 0; ++i) {
      const std::string out = Slurp(dir_ / "out");
      const size_t at = out.find("ready at http://127.0.0.1:");
      if (at != std::string::npos) port_ = std::atoi(out.c_str() + at + 26);
      if (port_ == 0) ::usleep(50000);
    }
  }
  ~ServeProcess() {
    Stop();
    fs::remove_all(dir_);
  }
  int port() const { return port_; }
  std::string Stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
    }
    return Slurp(dir_ / "err");
  }

 private:
  fs::path dir_;
  pid_t pid_ = -1;
  int port_ = 0;
};

TEST(CliTest, ServeLogsAccessLinesAndThroughputThroughOnePath) {
  ServeProcess serve("--shape tiny --backend cpu --max-seq-len 128 --port 0 --access-log "
                     "--log-stats-interval 0.2");
  ASSERT_GT(serve.port(), 0);
  httplib::Client cli("127.0.0.1", serve.port());
  auto r = cli.Post("/v1/completions",
                    R"({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": true})",
                    "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  auto s = cli.Post("/v1/completions",
                    R"({"prompt": [5, 6], "max_tokens": 3, "temperature": 0, "ignore_eos": true,
                        "stream": true})",
                    "application/json");
  ASSERT_TRUE(s);
  auto h = cli.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  ::usleep(700000);  // at least one throughput interval after the requests
  const std::string err = serve.Stop();
  EXPECT_NE(err.find("\"POST /v1/completions\" 200 prompt_tokens=3 completion_tokens=4"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("\"POST /v1/completions\" 200 prompt_tokens=2 completion_tokens=3"),
            std::string::npos)
      << "streams are logged when they end\n"
      << err;
  EXPECT_NE(err.find("\"GET /health\" 200"), std::string::npos) << err;
  EXPECT_NE(err.find("Avg prompt throughput: "), std::string::npos) << err;
  EXPECT_NE(err.find("Avg generation throughput: "), std::string::npos) << err;
  EXPECT_NE(err.find("KV cache usage: "), std::string::npos) << err;
  // --log-level warning: the info lines are gone.
  ServeProcess quiet("--shape tiny --backend cpu --max-seq-len 128 --port 0 --access-log "
                     "--log-level warning");
  ASSERT_GT(quiet.port(), 0);
  httplib::Client qc("127.0.0.1", quiet.port());
  auto qh = qc.Get("/health");
  ASSERT_TRUE(qh);
  EXPECT_EQ(qh->status, 200);
  const std::string qerr = quiet.Stop();
  EXPECT_EQ(qerr.find("GET /health"), std::string::npos) << qerr;
  EXPECT_EQ(qerr.find("loading"), std::string::npos) << qerr;
}

// A written tiny model whose config.json gets `extra` keys.
fs::path TinyModelWith(const nlohmann::json& extra, const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("dl_cli_model_" + std::to_string(::getpid()) + name);
  fs::remove_all(dir);
  const CliRun made = Decodelab("make-model --shape tiny --out '" + dir.string() + "'");
  EXPECT_EQ(made.rc, 0) << made.err;
  auto config = nlohmann::json::parse(Slurp(dir / "config.json"));
  for (auto& [k, v] : extra.items()) config[k] = v;
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir;
}

TEST(CliTest, ConfigWarningsAtLoadAndLegacyRopeScalingRefused) {
  const fs::path odd = TinyModelWith({{"frobnicate", 1}}, "odd");
  const CliRun r = Decodelab("generate --backend cpu --model '" + odd.string() +
                             "' --prompt-ids 5,6 --max-tokens 2");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("unknown key 'frobnicate'"), std::string::npos) << r.err;
  fs::remove_all(odd);
  const fs::path legacy = TinyModelWith(
      {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 8.0}, {"original_max_position_embeddings", 4096}}}},
      "legacy");
  const CliRun l = Decodelab("generate --backend cpu --model '" + legacy.string() +
                             "' --prompt-ids 5,6 --max-tokens 2");
  EXPECT_NE(l.rc, 0);
  EXPECT_NE(l.err.find("rope_scaling"), std::string::npos) << l.err;
  fs::remove_all(legacy);
}

// make-model --dtype fp8 writes an FP8 checkpoint that inspect describes and the CPU backend runs;
// --shape-dtype fp8 gives --shape the same weights (same greedy tokens); FP8 flags without FP8 are
// errors, never ignored.
TEST(CliTest, Fp8CheckpointsFromMakeModelAndShape) {
  const fs::path dir = fs::temp_directory_path() / ("dl_cli_fp8_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const CliRun made = Decodelab("make-model --shape tiny --seed 4 --dtype fp8 --fp8-format compressed-tensors "
                                "--fp8-layout all-linear --out '" + dir.string() + "'");
  ASSERT_EQ(made.rc, 0) << made.err;
  const CliRun inspect = Decodelab("inspect --model '" + dir.string() + "'");
  EXPECT_EQ(inspect.rc, 0) << inspect.err;
  EXPECT_NE(inspect.out.find("quantization_config: compressed-tensors (FP8 weights, block scales 128x128"),
            std::string::npos)
      << inspect.out;
  EXPECT_NE(inspect.out.find("this checkpoint (compressed-tensors)"), std::string::npos) << inspect.out;
  const CliRun file = Decodelab("generate --backend cpu --model '" + dir.string() +
                                "' --prompt-ids 5,17,42 --max-tokens 4 --ignore-eos");
  ASSERT_EQ(file.rc, 0) << file.err;
  const CliRun shape = Decodelab("generate --backend cpu --shape tiny --seed 4 --shape-dtype fp8 --fp8-layout "
                                 "all-linear --prompt-ids 5,17,42 --max-tokens 4 --ignore-eos");
  ASSERT_EQ(shape.rc, 0) << shape.err;
  const auto tokens = [](const std::string& out) { return out.substr(0, out.find('\n')); };
  EXPECT_EQ(tokens(file.out), tokens(shape.out));
  EXPECT_NE(tokens(file.out).find("tokens: "), std::string::npos) << file.out;
  fs::remove_all(dir);
  const CliRun stray = Decodelab("make-model --shape tiny --fp8-layout export --out '" + dir.string() + "'");
  EXPECT_NE(stray.rc, 0);
  EXPECT_NE(stray.err.find("apply only with --dtype fp8"), std::string::npos) << stray.err;
  const CliRun stray2 = Decodelab("generate --backend cpu --shape tiny --fp8-layout export --prompt-ids 5 --max-tokens 2");
  EXPECT_NE(stray2.rc, 0);
  EXPECT_NE(stray2.err.find("--fp8-layout applies only with --shape-dtype fp8"), std::string::npos) << stray2.err;
  EXPECT_FALSE(fs::exists(dir));
}

TEST(CliTest, LabRunsDirDefaultsToTheCacheAsTheReadmeSays) {
  // README: the report lands under <cache>/runs (~/.cache/decodelab/runs by default), where `lab
  // screen` put the runs; a bare `lab report` or `lab runs` must look there, not in ./runs.
  const fs::path cache = fs::temp_directory_path() / ("dl_cli_cache_" + std::to_string(::getpid()));
  const CliRun r = Decodelab("lab runs", "DECODELAB_CACHE='" + cache.string() + "'");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find((cache / "runs" / "ledger.sqlite").string()), std::string::npos) << r.err;
  const CliRun help = Decodelab("lab report --help", "DECODELAB_CACHE='" + cache.string() + "'");
  EXPECT_NE(help.out.find((cache / "runs").string()), std::string::npos) << help.out;
  EXPECT_FALSE(fs::exists(cache));
}

TEST(CliTest, ModelFromTheHuggingFaceCacheWithoutDownloading) {
  const fs::path root = fs::temp_directory_path() / ("dl_cli_hub_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path model = root / "written";
  ASSERT_EQ(Decodelab("make-model --shape tiny --out '" + model.string() + "'").rc, 0);
  // huggingface_hub's layout: snapshots/<rev>/ of symlinks, refs/main naming the revision.
  const fs::path repo = root / "hub" / "models--acme--laguna-tiny";
  fs::create_directories(repo / "snapshots" / "0123abcd");
  fs::create_directories(repo / "refs");
  std::ofstream(repo / "refs" / "main") << "0123abcd";
  for (const auto& e : fs::directory_iterator(model)) {
    fs::create_symlink(e.path(), repo / "snapshots" / "0123abcd" / e.path().filename());
  }
  const std::string gen = " --backend cpu --prompt-ids 5,6,7 --max-tokens 3 --ignore-eos --json";
  const CliRun direct = Decodelab("generate --model '" + model.string() + "'" + gen);
  ASSERT_EQ(direct.rc, 0) << direct.err;
  const std::string hub = "HF_HUB_CACHE='" + (root / "hub").string() + "'";
  const CliRun by_id = Decodelab("generate --model acme/laguna-tiny" + gen, hub);
  ASSERT_EQ(by_id.rc, 0) << by_id.err;
  EXPECT_EQ(nlohmann::json::parse(by_id.out)["tokens"], nlohmann::json::parse(direct.out)["tokens"]);
  const CliRun by_home = Decodelab("generate --model acme/laguna-tiny" + gen,
                                   "HF_HUB_CACHE= HF_HOME='" + root.string() + "'");
  EXPECT_EQ(by_home.rc, 0) << by_home.err;
  const CliRun by_dir = Decodelab("generate --model '" + repo.string() + "'" + gen);
  EXPECT_EQ(by_dir.rc, 0) << by_dir.err;
  const CliRun inspect = Decodelab("inspect --config-only --model acme/laguna-tiny", hub);
  EXPECT_EQ(inspect.rc, 0) << inspect.err;
  const CliRun missing = Decodelab("generate --model acme/nothing" + gen, hub);
  EXPECT_NE(missing.rc, 0);
  EXPECT_NE(missing.err.find("models--acme--nothing"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("does not download"), std::string::npos) << missing.err;
  fs::remove_all(root);
}

TEST(CliTest, ServeChatTemplateFileReplacesTheModelsTemplate) {
  const fs::path file = fs::temp_directory_path() / ("dl_cli_tmpl_" + std::to_string(::getpid()));
  std::ofstream(file) << "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}";
  ServeProcess serve("--shape tiny --backend cpu --max-seq-len 128 --port 0 --chat-template '" +
                     file.string() + "'");
  ASSERT_GT(serve.port(), 0);
  httplib::Client cli("127.0.0.1", serve.port());
  const std::string messages = R"({"messages": [{"role": "user", "content": "hello"}]})";
  auto t = cli.Post("/tokenize", messages, "application/json");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->status, 200) << t->body;
  auto d = cli.Post("/detokenize",
                    nlohmann::json{{"tokens", nlohmann::json::parse(t->body)["tokens"]}}.dump(),
                    "application/json");
  ASSERT_TRUE(d);
  EXPECT_EQ(nlohmann::json::parse(d->body)["prompt"], "[user] hello\n[assistant] ");
  auto c = cli.Post("/v1/chat/completions",
                    R"({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})",
                    "application/json");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->status, 200) << c->body;
  serve.Stop();
  // A template that does not parse stops the start, with the file's name.
  std::ofstream(file, std::ios::trunc) << "{% for m in messages %}";
  const CliRun bad = Decodelab("serve --shape tiny --backend cpu --port 0 --chat-template '" +
                               file.string() + "'");
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.err.find(file.string()), std::string::npos) << bad.err;
  fs::remove(file);
}

}  // namespace
}  // namespace dl
