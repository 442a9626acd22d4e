// Black-box tests of the OpenAI-compatible server over loopback HTTP (cpp-httplib's client).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "tests/common/scheduler_util.h"
#include "tests/server/server_test_util.h"
#include "tokenizer/tokenizer.h"

namespace dl::test {
namespace {

using json = nlohmann::json;

std::vector<int32_t> Prompt(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(40 + (i * 53 + salt * 7) % 450);  // no eos ids (2, 24)
  return p;
}

std::vector<int32_t> Ids(const json& a) { return a.get<std::vector<int32_t>>(); }

void ExpectErrorEnvelope(const HttpResult& r, int status, const std::string& param = "") {
  EXPECT_EQ(r.status, status) << r.body;
  ASSERT_TRUE(r.json.is_object()) << r.body;
  ASSERT_TRUE(r.json.contains("error")) << r.body;
  const json& e = r.json["error"];
  EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << r.body;
  EXPECT_TRUE(e["type"].is_string()) << r.body;
  EXPECT_TRUE(e.contains("param")) << r.body;
  EXPECT_TRUE(e.contains("code")) << r.body;
  if (!param.empty()) EXPECT_EQ(e["param"], param) << r.body;
}

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = TestServer::Start({.max_batch = 4}).release(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static TestServer* server_;
};
TestServer* ServerTest::server_ = nullptr;

TEST_F(ServerTest, ModelsHealthMetricsAndState) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  auto h = Get(cli, "/health");
  EXPECT_EQ(h.status, 200);
  auto m = Get(cli, "/v1/models");
  ASSERT_EQ(m.status, 200);
  EXPECT_EQ(m.json["object"], "list");
  EXPECT_EQ(m.json["data"][0]["id"], "tiny-test");
  EXPECT_EQ(m.json["data"][0]["max_model_len"], 512);
  auto s = Get(cli, "/v1/decodelab/state");
  ASSERT_EQ(s.status, 200);
  EXPECT_EQ(s.json["backend"], "cpu-reference");
  EXPECT_EQ(s.json["kernel_presets"], "cpu-reference");
  EXPECT_EQ(s.json["fallback"], false);
  EXPECT_EQ(s.json["binary_sha256"].get<std::string>().size(), 64u);
  EXPECT_EQ(s.json["kv_scales"][0]["rank"], 0);
  EXPECT_EQ(s.json["kv_scales"][0]["layers"].size(), 5u);  // tiny has 5 layers
  EXPECT_EQ(s.json["topology_applicable"], false);
  EXPECT_EQ(s.json["scheduler"]["prefix_caching"], false);
  // One request so the counters move, then the vLLM names must be there.
  auto r = PostJson(cli, "/v1/completions",
                    {{"prompt", Prompt(6, 1)}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  auto metrics = cli.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_EQ(metrics->status, 200);
  for (const char* name :
       {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_sum", "vllm:request_success_total"}) {
    EXPECT_NE(metrics->body.find(name), std::string::npos) << name;
  }
  EXPECT_NE(metrics->body.find("# TYPE vllm:time_to_first_token_seconds histogram"), std::string::npos);
  // Preemption does not exist yet: the counter is there and honest.
  EXPECT_NE(metrics->body.find("# TYPE vllm:num_preemptions_total counter\n"
                               "vllm:num_preemptions_total{model_name=\"tiny-test\"} 0\n"),
            std::string::npos)
      << metrics->body;
}

// A server over two in-process tensor-parallel ranks: the state lists both ranks (world size, each
// rank's own KV scales, the per-rank collectives) and greedy completions equal the one-rank server's.
TEST_F(ServerTest, TensorParallelServerReportsEveryRankAndMatchesOneRank) {
  ASSERT_NE(server_, nullptr);
  auto tp = TestServer::Start({.max_batch = 2, .tp = 2});
  ASSERT_NE(tp, nullptr);
  auto cli = tp->Client();
  auto s = Get(cli, "/v1/decodelab/state");
  ASSERT_EQ(s.status, 200);
  EXPECT_EQ(s.json["world_size"], 2);
  ASSERT_EQ(s.json["kv_scales"].size(), 2u);
  EXPECT_EQ(s.json["kv_scales"][1]["rank"], 1);
  EXPECT_EQ(s.json["kv_scales"][1]["layers"].size(), 5u);
  EXPECT_EQ(s.json["tensor_parallel"]["size"], 2);
  EXPECT_EQ(s.json["tensor_parallel"]["ranks"].size(), 2u);
  const nlohmann::json body = {{"prompt", Prompt(9, 3)}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};
  auto want = server_->Client();
  auto a = PostJson(want, "/v1/completions", body);
  auto b = PostJson(cli, "/v1/completions", body);
  ASSERT_EQ(a.status, 200) << a.body;
  ASSERT_EQ(b.status, 200) << b.body;
  EXPECT_EQ(b.json["choices"][0]["text"], a.json["choices"][0]["text"]);
  EXPECT_GT(s.json["tensor_parallel"]["all_reduces_per_forward"].get<int>(), 0);
  tp->Stop();
}

TEST(ServerConfigTest, ASecondServerOnABusyPortFailsToStart) {
  auto first = TestServer::Start({.max_batch = 1});
  ASSERT_NE(first, nullptr);
  EngineOptions o;
  o.model_dir = TinyModelDir();
  o.backend = BackendKind::kCpu;
  o.max_seq_len = 64;
  auto engine = LoadEngine(o);
  ASSERT_TRUE(engine.ok());
  Scheduler scheduler(**engine, {.max_batch = 1});
  ServerOptions so;
  so.host = "127.0.0.1";
  so.port = first->port();
  so.served_model_name = "second";
  Server second(**engine, scheduler, so, std::nullopt, std::nullopt, "none");
  Status st = second.Bind();
  ASSERT_FALSE(st.ok()) << "two servers must not share " << so.port;
  EXPECT_NE(st.message().find("127.0.0.1:" + std::to_string(so.port)), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("in use"), std::string::npos) << st.message();
  // The first still answers, alone.
  auto cli = first->Client();
  EXPECT_EQ(Get(cli, "/v1/models").json["data"][0]["id"], "tiny-test");
}

TEST(ServerConfigTest, GenerationConfigGivesTheDefaults) {
  // A copy of the tiny model whose generation_config.json asks for greedy decoding, 3 new tokens.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("dl_server_gen_config_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::copy(TinyModelDir(), dir, std::filesystem::copy_options::recursive);
  std::ofstream(dir / "generation_config.json")
      << R"({"eos_token_id": [2, 24], "temperature": 0.0, "max_new_tokens": 3})";
  {
    auto server = TestServer::Start({.max_batch = 1, .model_dir = dir.string()});
    ASSERT_NE(server, nullptr);
    auto cli = server->Client();
    const json prompt = Prompt(7, 2);
    auto implicit = PostJson(cli, "/v1/completions", {{"prompt", prompt}, {"ignore_eos", true}});
    auto greedy = PostJson(cli, "/v1/completions",
                           {{"prompt", prompt}, {"ignore_eos", true}, {"temperature", 0}, {"max_tokens", 3}});
    ASSERT_EQ(implicit.status, 200) << implicit.body;
    EXPECT_EQ(implicit.json["choices"][0]["token_ids"].size(), 3u);
    EXPECT_EQ(implicit.json["choices"][0]["token_ids"], greedy.json["choices"][0]["token_ids"]);
    // The request still wins over the file.
    auto longer = PostJson(cli, "/v1/completions", {{"prompt", prompt}, {"ignore_eos", true}, {"max_tokens", 5}});
    EXPECT_EQ(longer.json["choices"][0]["token_ids"].size(), 5u);
  }
  std::filesystem::remove_all(dir);
}

TEST(ServerConfigTest, MetricLabelValuesAreEscaped) {
  auto server = TestServer::Start({.max_batch = 1, .served_model_name = "a \"b\" c\\d\ne"});
  ASSERT_NE(server, nullptr);
  auto cli = server->Client();
  auto metrics = cli.Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("vllm:num_requests_running{model_name=\"a \\\"b\\\" c\\\\d\\ne\"} 0\n"),
            std::string::npos)
      << metrics->body;
  // No raw newline inside any sample line: every line is a comment or "name{labels} value".
  std::istringstream lines(metrics->body);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_EQ(line.rfind("vllm:", 0) == 0 || line.rfind("decodelab:", 0) == 0, true) << line;
  }
}

// Speculative decoding through serve (n-gram drafter): the same completions as a plain server, for
// greedy and seeded sampled requests with logprobs and penalties, a stop string and streaming, sent
// at once so several sequences verify in one forward; the vLLM spec-decode counters count drafts.
TEST(ServerConfigTest, SpeculativeServeReturnsThePlainCompletions) {
  auto plain = TestServer::Start({.max_batch = 4});
  auto spec = TestServer::Start({.max_batch = 4, .spec_ngram = true, .spec_k = 4});
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(spec, nullptr);
  std::vector<int32_t> repetitive;
  for (int i = 0; i < 48; ++i) repetitive.push_back(60 + (i % 7) * 31);
  std::vector<json> bodies = {
      {{"prompt", repetitive}, {"max_tokens", 30}, {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 2}},
      {{"prompt", "def f(x):\n    return x\ndef f(x):\n    return x\ndef f("}, {"max_tokens", 24},
       {"temperature", 0}, {"ignore_eos", true}},
      {{"prompt", repetitive}, {"max_tokens", 20}, {"temperature", 0.9}, {"seed", 5}, {"ignore_eos", true},
       {"logprobs", 1}, {"frequency_penalty", 0.4}, {"repetition_penalty", 1.1}},
      {{"prompt", Prompt(20, 9)}, {"max_tokens", 16}, {"temperature", 0}}};
  auto run_all = [](TestServer& server, const std::vector<json>& reqs) {
    std::vector<HttpResult> out(reqs.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < reqs.size(); ++i) {
      threads.emplace_back([&, i] {
        auto cli = server.Client();
        out[i] = PostJson(cli, "/v1/completions", reqs[i]);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  };
  const auto want = run_all(*plain, bodies);
  ASSERT_EQ(want[0].status, 200) << want[0].body;
  // A stop string from the middle of the first greedy text, and the same request streamed.
  const std::string text0 = want[0].json["choices"][0]["text"];
  if (text0.size() >= 8) {
    json stopped = bodies[0];
    stopped["stop"] = json::array({text0.substr(text0.size() / 2, 3)});
    bodies.push_back(stopped);
  }
  const auto want_all = run_all(*plain, bodies);
  const auto got_all = run_all(*spec, bodies);
  for (size_t i = 0; i < bodies.size(); ++i) {
    ASSERT_EQ(want_all[i].status, 200) << want_all[i].body;
    ASSERT_EQ(got_all[i].status, 200) << got_all[i].body;
    EXPECT_EQ(got_all[i].json["choices"], want_all[i].json["choices"]) << "request " << i;
    EXPECT_EQ(got_all[i].json["usage"], want_all[i].json["usage"]) << "request " << i;
  }
  // Streaming: the same text, token by token.
  {
    auto cp = plain->Client();
    auto cs = spec->Client();
    json body = bodies[1];
    body["stream"] = true;
    auto a = PostStream(cp, "/v1/completions", body);
    auto b = PostStream(cs, "/v1/completions", body);
    ASSERT_EQ(a.status, 200);
    ASSERT_EQ(b.status, 200);
    auto texts = [](const SseResult& r) {
      std::string t;
      for (const auto& d : r.data) {
        if (d == "[DONE]") continue;
        auto j = json::parse(d, nullptr, false);
        if (j.is_object() && j.contains("choices") && !j["choices"].empty()) t += j["choices"][0].value("text", "");
      }
      return t;
    };
    EXPECT_EQ(texts(b), texts(a));
    EXPECT_EQ(texts(a), want_all[1].json["choices"][0]["text"]);
  }
  // Counters: vLLM's names, with drafts on the speculative server only.
  auto cs = spec->Client();
  auto metrics = cs.Get("/metrics");
  ASSERT_TRUE(metrics);
  for (const char* name : {"vllm:spec_decode_num_drafts_total{", "vllm:spec_decode_num_draft_tokens_total{",
                           "vllm:spec_decode_num_accepted_tokens_total{",
                           "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"tiny-test\",position=\"3\"}"}) {
    EXPECT_NE(metrics->body.find(name), std::string::npos) << name << "\n" << metrics->body;
  }
  EXPECT_EQ(metrics->body.find("vllm:spec_decode_num_drafts_total{model_name=\"tiny-test\"} 0\n"), std::string::npos)
      << "the n-gram drafter should have drafted on repetitive prompts";
  auto cp = plain->Client();
  auto plain_metrics = cp.Get("/metrics");
  ASSERT_TRUE(plain_metrics);
  EXPECT_EQ(plain_metrics->body.find("spec_decode"), std::string::npos);
  auto state = Get(cs, "/v1/decodelab/state");
  ASSERT_EQ(state.status, 200);
  const json& sp = state.json["speculative"];
  EXPECT_EQ(sp["drafter"], "ngram[1,3]");
  EXPECT_EQ(sp["num_speculative_tokens"], 4);
  EXPECT_GT(sp["num_drafts"].get<uint64_t>(), 0u);
  EXPECT_GE(sp["mean_acceptance_length"].get<double>(), 1.0);
  EXPECT_EQ(Get(cp, "/v1/decodelab/state").json["speculative"]["drafter"], "none");
  // A request the HTTP side ended (stop string) is cancelled; the engine thread returns its pages on
  // its next step.
  int used = -1;
  for (int i = 0; i < 300 && used != 0; ++i) {
    used = KvPagesUsed(cs);
    if (used != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(used, 0);
}

TEST_F(ServerTest, TokenizeAndDetokenizeAsVllm) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  auto tok = Tokenizer::FromFile(TinyModelDir());
  ASSERT_TRUE(tok.ok());
  const std::string text = "Hello, world! 2 + 2 = 4.";
  auto r = PostJson(cli, "/tokenize", {{"model", "tiny-test"}, {"prompt", text}, {"return_token_strs", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  auto ids = tok->Encode(text, true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(Ids(r.json["tokens"]), *ids);
  EXPECT_EQ(r.json["count"], ids->size());
  EXPECT_EQ(r.json["max_model_len"], 512);
  ASSERT_EQ(r.json["token_strs"].size(), ids->size());
  EXPECT_EQ(r.json["token_strs"][0], *tok->IdToToken((*ids)[0]));
  auto d = PostJson(cli, "/detokenize", {{"tokens", r.json["tokens"]}});
  ASSERT_EQ(d.status, 200) << d.body;
  EXPECT_EQ(d.json["prompt"], tok->Decode(*ids, false));
  // Chat form: the rendered template, the same ids a chat request would prefill.
  const json messages = json::array({{{"role", "user"}, {"content", "Hi"}}});
  auto t = PostJson(cli, "/tokenize", {{"messages", messages}});
  ASSERT_EQ(t.status, 200) << t.body;
  auto c = PostJson(cli, "/v1/chat/completions",
                    {{"messages", messages}, {"max_completion_tokens", 1}, {"temperature", 0}});
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(t.json["count"], c.json["usage"]["prompt_tokens"]);
  auto back = PostJson(cli, "/detokenize", {{"tokens", t.json["tokens"]}});
  EXPECT_EQ(back.json["prompt"].get<std::string>().rfind("\u3008|EOS|\u3009<system>", 0), 0u)
      << back.body;
  // Errors use the envelope.
  ExpectErrorEnvelope(PostJson(cli, "/detokenize", {{"tokens", {1, 600}}}), 400, "tokens");
  ExpectErrorEnvelope(PostJson(cli, "/tokenize", {{"prompt", 5}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/tokenize", json::object()), 400);
  ExpectErrorEnvelope(PostJson(cli, "/tokenize", {{"model", "other"}, {"prompt", "x"}}), 404, "model");
}

TEST_F(ServerTest, GreedyCompletionEqualsGenerateGreedyAndTheCli) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  const auto prompt = Prompt(37, 3);  // more than two prefill chunks of 16
  auto r = PostJson(cli, "/v1/completions",
                    {{"model", "tiny-test"}, {"prompt", prompt}, {"max_tokens", 20},
                     {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["object"], "text_completion");
  const json& c = r.json["choices"][0];
  EXPECT_EQ(c["finish_reason"], "length");
  const auto got = Ids(c["token_ids"]);
  EXPECT_EQ(got.size(), 20u);
  EXPECT_EQ(r.json["usage"]["prompt_tokens"], 37);
  EXPECT_EQ(r.json["usage"]["completion_tokens"], 20);
  EXPECT_EQ(r.json["usage"]["total_tokens"], 57);
  EXPECT_EQ(r.json["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // Text is the detokenised ids.
  auto tok = Tokenizer::FromFile(TinyModelDir());
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(c["text"], tok->Decode(got, true));

  // In-process reference on a fresh engine.
  EngineOptions o;
  o.model_dir = TinyModelDir();
  o.backend = BackendKind::kCpu;
  o.prefill_chunk = 16;
  auto engine = LoadEngine(o);
  ASSERT_TRUE(engine.ok());
  GenerateOptions g;
  g.max_tokens = 20;
  g.ignore_eos = true;
  g.prefill_chunk = 16;
  auto ref = GenerateGreedy(**engine, prompt, g);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ(got, ref->tokens);

  // `decodelab generate` (the built binary), when it is there.
  const std::string bin = std::string(DECODELAB_BINARY_DIR) + "/bin/decodelab";
  if (!std::filesystem::exists(bin)) {
    GTEST_SKIP() << "decodelab binary not built: CLI comparison skipped";
  }
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) ids += (i ? "," : "") + std::to_string(prompt[i]);
  const std::string cmd = bin + " generate --backend cpu --model " + TinyModelDir() +
                          " --prefill-chunk 16 --max-tokens 20 --ignore-eos --json --prompt-ids " +
                          ids + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out, last;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) out += buf;
  pclose(p);
  size_t nl = out.rfind('\n', out.size() >= 2 ? out.size() - 2 : 0);
  last = out.substr(nl == std::string::npos ? 0 : nl + 1);
  auto j = json::parse(last, nullptr, false);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(Ids(j["tokens"]), got);
}

TEST_F(ServerTest, StreamingIsOneTokenPerEventWithUsageThenDone) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  const auto prompt = Prompt(9, 4);
  json body = {{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}};
  auto plain = PostJson(cli, "/v1/completions", body);
  ASSERT_EQ(plain.status, 200);
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto s = PostStream(cli, "/v1/completions", body);
  ASSERT_EQ(s.status, 200);
  ASSERT_EQ(s.data.size(), 12u + 2u) << s.raw;  // 12 tokens, usage, [DONE]
  EXPECT_EQ(s.data.back(), "[DONE]");
  std::vector<int32_t> ids;
  std::string text;
  for (size_t i = 0; i < 12; ++i) {
    auto c = json::parse(s.data[i]);
    EXPECT_EQ(c["object"], "text_completion");
    ASSERT_EQ(c["choices"].size(), 1u);
    ASSERT_EQ(c["choices"][0]["token_ids"].size(), 1u);
    ids.push_back(c["choices"][0]["token_ids"][0]);
    text += c["choices"][0]["text"].get<std::string>();
    EXPECT_TRUE(c.contains("usage") && c["usage"].is_null());
    if (i + 1 < 12) {
      EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
    } else {
      EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
    }
  }
  EXPECT_EQ(ids, Ids(plain.json["choices"][0]["token_ids"]));
  EXPECT_EQ(text, plain.json["choices"][0]["text"].get<std::string>());
  auto usage = json::parse(s.data[12]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 12);
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 9);
  EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // Framing: every event is "data: ...\n\n".
  size_t events = 0, pos = 0;
  while ((pos = s.raw.find("data: ", pos)) != std::string::npos) {
    ++events;
    pos += 6;
  }
  EXPECT_EQ(events, s.data.size());
  EXPECT_EQ(s.raw.substr(s.raw.size() - 2), "\n\n");
}

TEST_F(ServerTest, TextPromptsListsAndStopStrings) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  auto tok = Tokenizer::FromFile(TinyModelDir());
  ASSERT_TRUE(tok.ok());
  const std::string prompt = "def fibonacci(n):\n    return";
  auto r = PostJson(cli, "/v1/completions",
                    {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  auto enc = tok->Encode(prompt, true);
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(r.json["usage"]["prompt_tokens"], enc->size());
  const std::string text = r.json["choices"][0]["text"];
  // A list of prompts gives one choice each, in order; the text prompt's choice matches.
  auto list = PostJson(cli, "/v1/completions",
                       {{"prompt", json::array({prompt, Prompt(5, 2)})},
                        {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(list.status, 200) << list.body;
  ASSERT_EQ(list.json["choices"].size(), 2u);
  EXPECT_EQ(list.json["choices"][0]["text"], text);
  EXPECT_EQ(list.json["choices"][1]["index"], 1);
  EXPECT_EQ(list.json["usage"]["completion_tokens"], 48);
  // Stop string: a piece from the middle of the greedy text.
  if (text.size() < 8) GTEST_SKIP() << "greedy text too short for a stop-string check: " << text;
  const std::string stop = text.substr(text.size() / 2, 2);
  const size_t at = text.find(stop);
  for (bool stream : {false, true}) {
    json body = {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0},
                 {"ignore_eos", true}, {"stop", json::array({stop})}};
    std::string got;
    std::string finish;
    if (!stream) {
      auto s = PostJson(cli, "/v1/completions", body);
      ASSERT_EQ(s.status, 200);
      got = s.json["choices"][0]["text"];
      finish = s.json["choices"][0]["finish_reason"];
    } else {
      body["stream"] = true;
      auto s = PostStream(cli, "/v1/completions", body);
      ASSERT_EQ(s.status, 200);
      for (const auto& d : s.data) {
        if (d == "[DONE]") continue;
        auto c = json::parse(d);
        got += c["choices"][0]["text"].get<std::string>();
        if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
      }
    }
    EXPECT_EQ(got, text.substr(0, at)) << "stream=" << stream << " stop='" << stop << "'";
    EXPECT_EQ(finish, "stop");
  }
}

TEST_F(ServerTest, ChatCompletionsRenderTheTemplate) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  json body = {{"model", "tiny-test"},
               {"messages", json::array({{{"role", "system"}, {"content", "Be brief."}},
                                         {{"role", "user"},
                                          {"content", json::array({{{"type", "text"}, {"text", "Hi"}}})}}})},
               {"max_completion_tokens", 6},
               {"temperature", 0},
               {"ignore_eos", true},
               {"logprobs", true},
               {"top_logprobs", 2}};
  auto r = PostJson(cli, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["object"], "chat.completion");
  const json& c = r.json["choices"][0];
  EXPECT_EQ(c["message"]["role"], "assistant");
  EXPECT_EQ(c["finish_reason"], "length");
  EXPECT_EQ(c["token_ids"].size(), 6u);
  ASSERT_EQ(c["logprobs"]["content"].size(), 6u);
  EXPECT_EQ(c["logprobs"]["content"][0]["top_logprobs"].size(), 2u);
  // The prompt is the rendered template, tokenized without extra special tokens.
  auto tok = Tokenizer::FromFile(TinyModelDir());
  auto tmpl = LoadChatTemplateForModel(TinyModelDir());
  ASSERT_TRUE(tok.ok() && tmpl.ok());
  nlohmann::ordered_json ctx = {
      {"messages", nlohmann::ordered_json::array({{{"role", "system"}, {"content", "Be brief."}},
                                                  {{"role", "user"}, {"content", "Hi"}}})},
      {"add_generation_prompt", true},
      {"bos_token", tmpl->bos_token()},
      {"eos_token", tmpl->eos_token()}};
  auto text = tmpl->Render(ctx);
  ASSERT_TRUE(text.ok());
  auto ids = tok->Encode(*text, false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(r.json["usage"]["prompt_tokens"], ids->size());
  // Streaming chat: role in the first delta, one token per chunk, finish on the last.
  body["stream"] = true;
  auto s = PostStream(cli, "/v1/chat/completions", body);
  ASSERT_EQ(s.status, 200);
  ASSERT_EQ(s.data.size(), 7u) << s.raw;
  std::vector<int32_t> streamed;
  for (size_t i = 0; i < 6; ++i) {
    auto chunk = json::parse(s.data[i]);
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    if (i == 0) EXPECT_EQ(chunk["choices"][0]["delta"]["role"], "assistant");
    streamed.push_back(chunk["choices"][0]["token_ids"][0]);
  }
  EXPECT_EQ(streamed, Ids(c["token_ids"]));
  EXPECT_EQ(json::parse(s.data[5])["choices"][0]["finish_reason"], "length");
}

TEST_F(ServerTest, LogprobsAndSeededSampling) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  json body = {{"prompt", Prompt(8, 5)}, {"max_tokens", 8}, {"temperature", 0.9},
               {"top_p", 0.95}, {"top_k", 40}, {"seed", 77}, {"ignore_eos", true}, {"logprobs", 3}};
  auto a = PostJson(cli, "/v1/completions", body);
  auto b = PostJson(cli, "/v1/completions", body);
  ASSERT_EQ(a.status, 200) << a.body;
  EXPECT_EQ(a.json["choices"][0]["token_ids"], b.json["choices"][0]["token_ids"]);
  const json& lp = a.json["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 8u);
  ASSERT_EQ(lp["token_logprobs"].size(), 8u);
  ASSERT_EQ(lp["top_logprobs"].size(), 8u);
  for (const auto& x : lp["token_logprobs"]) EXPECT_LE(x.get<double>(), 0.0);
  EXPECT_LE(lp["top_logprobs"][0].size(), 3u);  // distinct strings; identical pieces merge
  EXPECT_GE(lp["top_logprobs"][0].size(), 1u);
}

TEST_F(ServerTest, BadInputGetsTheErrorEnvelopeAndTheServerKeepsServing) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  ExpectErrorEnvelope(PostRaw(cli, "/v1/completions", "{not json"), 400);
  ExpectErrorEnvelope(PostRaw(cli, "/v1/completions", "[1,2]"), 400);
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", 5}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", ""}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", json::array()}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"max_tokens", 4}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", -3}}), 400,
                      "max_tokens");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", "9"}}), 400,
                      "max_tokens");
  ExpectErrorEnvelope(
      PostJson(cli, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", 1000000000000LL}}), 400,
      "max_tokens");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1, 2}}, {"max_tokens", 600}}), 400,
                      "max_tokens");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", Prompt(600, 1)}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1, 512}}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1, -1}}}), 400, "prompt");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1}}, {"temperature", "hot"}}), 400,
                      "temperature");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1}}, {"n", 2}}), 400, "n");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1}}, {"logprobs", true}}), 400,
                      "logprobs");
  ExpectErrorEnvelope(
      PostJson(cli, "/v1/completions", {{"prompt", {1}}, {"stream_options", {{"include_usage", true}}}}),
      400, "stream_options");
  ExpectErrorEnvelope(PostJson(cli, "/v1/chat/completions", {{"messages", "hi"}}), 400, "messages");
  ExpectErrorEnvelope(
      PostJson(cli, "/v1/chat/completions", {{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}), 400);
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {1}}, {"model", "gpt-9"}}), 404,
                      "model");
  ExpectErrorEnvelope(Get(cli, "/v1/nothing-here"), 404);
  ExpectErrorEnvelope(PostJson(cli, "/v2/completions", {{"prompt", {1}}}), 404);
  // Oversized body: 413 (the limit here is 1 MiB).
  ExpectErrorEnvelope(PostRaw(cli, "/v1/completions", std::string(2 << 20, ' ')), 413);
  // Unknown fields are ignored, as OpenAI does; and the server still serves.
  auto ok = PostJson(cli, "/v1/completions",
                     {{"prompt", {5, 6, 7}}, {"max_tokens", 2}, {"frobnicate", {{"x", 1}}},
                      {"user", "u"}, {"temperature", 0}});
  EXPECT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(ok.json["choices"][0]["token_ids"].size(), 2u);
}

TEST_F(ServerTest, PenaltiesBiasMinPAndMaxCompletionTokensAreHonoured) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  // max_completion_tokens on /v1/completions (16 came back before).
  auto r = PostJson(cli, "/v1/completions",
                    {{"prompt", Prompt(6, 3)}, {"max_completion_tokens", 3}, {"temperature", 0},
                     {"ignore_eos", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["choices"][0]["token_ids"].size(), 3u);
  // logit_bias steers greedy decoding.
  r = PostJson(cli, "/v1/completions",
               {{"prompt", Prompt(6, 3)}, {"max_tokens", 4}, {"temperature", 0}, {"ignore_eos", true},
                {"logit_bias", {{"77", 100}}}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Ids(r.json["choices"][0]["token_ids"]), std::vector<int32_t>(4, 77));
  // Penalties and min_p: the HTTP result equals the scheduler's for the same parameters, and the
  // penalties change it.
  json body = {{"prompt", Prompt(10, 4)}, {"max_tokens", 12}, {"temperature", 0.8}, {"seed", 5},
               {"min_p", 0.05}, {"presence_penalty", 0.6}, {"frequency_penalty", 0.4},
               {"repetition_penalty", 1.3}, {"ignore_eos", true}};
  r = PostJson(cli, "/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  GenerationRequest g;
  g.prompt = Prompt(10, 4);
  g.sampling.max_tokens = 12;
  g.sampling.temperature = 0.8f;
  g.sampling.seed = 5;
  g.sampling.min_p = 0.05f;
  g.sampling.presence_penalty = 0.6f;
  g.sampling.frequency_penalty = 0.4f;
  g.sampling.repetition_penalty = 1.3f;
  g.sampling.ignore_eos = true;
  auto st = server_->scheduler().Submit(g);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(Ids(r.json["choices"][0]["token_ids"]), testing_scheduler::Drain(**st).tokens);
  // The penalties change the output: greedily (the sampled draw above is Gumbel-max, where a penalty
  // changes the token only when it lands on the winner, so a sampled pair can agree by chance), for
  // at least one of a fixed set of prompts (they bite only where the argmax is a token already seen).
  int changed = 0;
  for (int salt = 1; salt <= 12 && changed == 0; ++salt) {
    json greedy = {{"prompt", Prompt(24, salt)}, {"max_tokens", 16}, {"temperature", 0}, {"ignore_eos", true}};
    auto plain = PostJson(cli, "/v1/completions", greedy);
    greedy["presence_penalty"] = 1.5;
    greedy["frequency_penalty"] = 1.0;
    greedy["repetition_penalty"] = 2.0;
    auto penalised = PostJson(cli, "/v1/completions", greedy);
    ASSERT_EQ(plain.status, 200) << plain.body;
    ASSERT_EQ(penalised.status, 200) << penalised.body;
    changed += plain.json["choices"][0]["token_ids"] != penalised.json["choices"][0]["token_ids"];
  }
  EXPECT_GT(changed, 0) << "the penalties changed no greedy output";
  // Fields that would change the output and are not implemented: 400 naming them.
  const json base = {{"prompt", {5, 6}}, {"max_tokens", 2}};
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, json>>{{"response_format", {{"type", "json_object"}}},
                                                 {"min_tokens", 3},
                                                 {"guided_regex", "a+"},
                                                 {"use_beam_search", true}}) {
    json b = base;
    b[field] = value;
    ExpectErrorEnvelope(PostJson(cli, "/v1/completions", b), 400, field);
  }
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {5}}, {"min_p", 2}}), 400, "min_p");
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", {{"prompt", {5}}, {"logit_bias", {{"600", 1}}}}),
                      400, "logit_bias");
  // Documented no-ops.
  json noop = base;
  noop["user"] = "u";
  noop["metadata"] = {{"k", "v"}};
  noop["store"] = false;
  noop["response_format"] = {{"type", "text"}};
  EXPECT_EQ(PostJson(cli, "/v1/completions", noop).status, 200);
}

TEST_F(ServerTest, ChatSplitsReasoningAndHonoursToolChoice) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  auto tok = Tokenizer::FromFile(TinyModelDir());
  ASSERT_TRUE(tok.ok());
  const int32_t think = *tok->TokenToId("<think>"), end_think = *tok->TokenToId("</think>");
  const json user = json::array({{{"role", "user"}, {"content", "Hi"}}});
  // The Laguna template opens <think> (enable_thinking defaults to true): the output is reasoning.
  json body = {{"messages", user}, {"max_completion_tokens", 6}, {"temperature", 0},
               {"ignore_eos", true},
               {"logit_bias", {{std::to_string(think), -100}, {std::to_string(end_think), -100}}}};
  auto r = PostJson(cli, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json& m = r.json["choices"][0]["message"];
  const std::string text = tok->Decode(Ids(r.json["choices"][0]["token_ids"]), true);
  EXPECT_EQ(m["reasoning_content"], text);
  EXPECT_EQ(m["content"], "");
  // Streamed: the same split, one chunk per token.
  body["stream"] = true;
  auto s = PostStream(cli, "/v1/chat/completions", body);
  ASSERT_EQ(s.data.size(), 7u) << s.raw;
  std::string reasoning, content;
  for (size_t i = 0; i < 6; ++i) {
    const json d = json::parse(s.data[i])["choices"][0]["delta"];
    reasoning += d.value("reasoning_content", "");
    content += d.value("content", "");
  }
  EXPECT_EQ(reasoning, text);
  EXPECT_EQ(content, "");
  // enable_thinking false: the template closes </think> itself and everything is content.
  body.erase("stream");
  body["chat_template_kwargs"] = {{"enable_thinking", false}};
  r = PostJson(cli, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.json["choices"][0]["message"]["reasoning_content"].is_null());
  EXPECT_EQ(r.json["choices"][0]["message"]["content"],
            tok->Decode(Ids(r.json["choices"][0]["token_ids"]), true));
  // The model closing its reasoning at once: no reasoning, the rest is content.
  body.erase("chat_template_kwargs");
  body["logit_bias"] = {{std::to_string(end_think), 100}};
  body["max_completion_tokens"] = 1;
  r = PostJson(cli, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.json["choices"][0]["message"]["reasoning_content"].is_null());
  EXPECT_EQ(r.json["choices"][0]["message"]["content"], "");
  // tool_choice: auto and none run; what needs constrained decoding is refused by name.
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  for (const char* choice : {"auto", "none"}) {
    r = PostJson(cli, "/v1/chat/completions",
                 {{"messages", user}, {"tools", tools}, {"tool_choice", choice},
                  {"max_completion_tokens", 2}, {"temperature", 0}});
    EXPECT_EQ(r.status, 200) << choice << " " << r.body;
  }
  ExpectErrorEnvelope(PostJson(cli, "/v1/chat/completions",
                               {{"messages", user}, {"tools", tools}, {"tool_choice", "required"}}),
                      400, "tool_choice");
  ExpectErrorEnvelope(
      PostJson(cli, "/v1/chat/completions",
               {{"messages", user},
                {"tools", tools},
                {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}}),
      400, "tool_choice");
  ExpectErrorEnvelope(PostJson(cli, "/v1/chat/completions", {{"messages", user}, {"tools", "x"}}), 400,
                      "tools");
}

TEST_F(ServerTest, ClientDisconnectFreesKvPages) {
  ASSERT_NE(server_, nullptr);
  auto cli = server_->Client();
  int seen = 0;
  auto s = PostStream(cli, "/v1/completions",
                      {{"prompt", Prompt(20, 6)}, {"max_tokens", 400}, {"temperature", 0},
                       {"ignore_eos", true}, {"stream", true}},
                      [&](const std::string&) { return ++seen < 5; });
  EXPECT_TRUE(s.aborted);
  auto probe = server_->Client();
  int used = -1;
  for (int i = 0; i < 300; ++i) {
    used = KvPagesUsed(probe);
    if (used == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(used, 0);
  auto st = server_->scheduler().Stats();
  EXPECT_GE(st.finished_total["abort"], 1u);
}

TEST(ServerConfigTest, ApiKeyChatWithoutTemplateAndOverload) {
  auto server = TestServer::Start(
      {.max_batch = 1, .max_waiting = 1, .api_key = "sekrit", .with_chat_template = false});
  ASSERT_NE(server, nullptr);
  auto cli = server->Client();
  json body = {{"prompt", Prompt(4, 1)}, {"max_tokens", 2}, {"temperature", 0}};
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", body), 401);
  ExpectErrorEnvelope(PostJson(cli, "/v1/completions", body, "wrong"), 401);
  ExpectErrorEnvelope(Get(cli, "/v1/models"), 401);
  ExpectErrorEnvelope(PostJson(cli, "/tokenize", {{"prompt", "x"}}), 401);
  ExpectErrorEnvelope(PostJson(cli, "/detokenize", {{"tokens", {5}}}), 401);
  EXPECT_EQ(PostJson(cli, "/detokenize", {{"tokens", {5}}}, "sekrit").status, 200);
  EXPECT_EQ(Get(cli, "/health").status, 200);  // open, as in vLLM
  EXPECT_EQ(PostJson(cli, "/v1/completions", body, "sekrit").status, 200);
  auto chat = PostJson(cli, "/v1/chat/completions",
                       {{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, "sekrit");
  ExpectErrorEnvelope(chat, 400, "messages");
  EXPECT_NE(chat.json["error"]["message"].get<std::string>().find("chat template"), std::string::npos);

  // Overload: one running, one waiting, the third is refused with 503.
  std::atomic<int> started{0};
  json longreq = {{"prompt", Prompt(4, 2)}, {"max_tokens", 300}, {"temperature", 0},
                  {"ignore_eos", true}, {"stream", true}};
  auto stream_with_key = [&](int) {
    httplib::Client c("127.0.0.1", server->port());
    c.set_default_headers({{"Authorization", "Bearer sekrit"}});
    c.set_read_timeout(60, 0);
    auto r = PostStream(c, "/v1/completions", longreq, [&](const std::string&) {
      ++started;
      return true;
    });
    return r;
  };
  std::thread t1([&] { stream_with_key(1); });
  while (started.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::thread t2([&] { stream_with_key(2); });
  // Wait until the second is queued.
  for (int i = 0; i < 500 && server->scheduler().Stats().waiting < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto refused = PostJson(cli, "/v1/completions", body, "sekrit");
  ExpectErrorEnvelope(refused, 503);
  t1.join();
  t2.join();
}

TEST(ServerConfigTest, ShutdownEndsInFlightStreamsWithAnErrorEvent) {
  auto server = TestServer::Start({.max_batch = 2});
  ASSERT_NE(server, nullptr);
  SseResult result;
  std::atomic<int> seen{0};
  std::thread client([&] {
    auto cli = server->Client();
    result = PostStream(cli, "/v1/completions",
                        {{"prompt", Prompt(10, 3)}, {"max_tokens", 450}, {"temperature", 0},
                         {"ignore_eos", true}, {"stream", true}},
                        [&](const std::string&) {
                          ++seen;
                          return true;
                        });
  });
  while (seen.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  server->Stop();
  client.join();
  ASSERT_GE(result.data.size(), 2u) << result.raw;
  EXPECT_EQ(result.data.back(), "[DONE]");
  auto err = json::parse(result.data[result.data.size() - 2], nullptr, false);
  ASSERT_TRUE(err.contains("error")) << result.raw;
  EXPECT_EQ(err["error"]["code"], 503);
  EXPECT_EQ(server->engine().kv->used_pages(KvGroup::kFull), 0);
}

TEST(ServerConfigTest, PrefixCachingReportsCachedTokensWithIdenticalOutputs) {
  // Shared prefix of 40 tokens, longer than tiny's sliding window (8): two whole pages reusable.
  std::vector<int32_t> prefix = Prompt(40, 8);
  std::vector<int32_t> a = prefix, b = prefix;
  for (int i = 0; i < 5; ++i) a.push_back(300 + i);
  for (int i = 0; i < 9; ++i) b.push_back(350 + i);
  auto run = [&](bool caching) {
    auto server = TestServer::Start({.max_batch = 1, .prefix_caching = caching});
    auto cli = server->Client();
    std::vector<json> out;
    for (const auto* p : {&a, &b}) {
      auto r = PostJson(cli, "/v1/completions",
                        {{"prompt", *p}, {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}});
      EXPECT_EQ(r.status, 200) << r.body;
      out.push_back(r.json);
    }
    return out;
  };
  auto off = run(false);
  auto on = run(true);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(off[i]["choices"][0]["token_ids"], on[i]["choices"][0]["token_ids"]) << i;
    EXPECT_EQ(off[i]["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  }
  EXPECT_EQ(on[0]["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(on[1]["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
}

}  // namespace
}  // namespace dl::test
