// The request parser's field table and the chat output path (detokenizer, reasoning and tool
// parsers) fed token by token, without HTTP.
#include "server/api.h"

#include <gtest/gtest.h>

#include "tokenizer/tokenizer_writer.h"

namespace dl::api {
namespace {

using nlohmann::json;

const Tokenizer& SmallTokenizer() {
  static const Tokenizer tok = [] {
    auto text = BuildSmallTokenizerJson(1024);
    EXPECT_TRUE(text.ok());
    auto t = Tokenizer::FromJson(*text, "small");
    EXPECT_TRUE(t.ok());
    return *t;
  }();
  return tok;
}

ParseContext Context() {
  ParseContext ctx;
  ctx.tokenizer = &SmallTokenizer();
  ctx.max_context = 512;
  ctx.vocab_size = 1024;
  ctx.no_template_reason = "no template here";
  return ctx;
}

std::optional<ApiError> Parse(const json& body, bool chat, ParsedRequest* out,
                              const ParseContext& ctx = Context()) {
  return ParseRequest(body.dump(), chat, ctx, out);
}

TEST(ParseRequestTest, SamplingFieldsReachSamplingParams) {
  ParsedRequest r;
  auto e = Parse({{"prompt", {5, 6}},
                  {"max_completion_tokens", 3},
                  {"max_tokens", 9},
                  {"min_p", 0.1},
                  {"presence_penalty", 0.5},
                  {"frequency_penalty", -0.25},
                  {"repetition_penalty", 1.2},
                  {"logit_bias", {{"7", 3.5}, {"8", -250}}}},
                 false, &r);
  ASSERT_FALSE(e) << e->message;
  EXPECT_EQ(r.sampling.max_tokens, 3) << "max_completion_tokens wins on /v1/completions too";
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.25f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.2f);
  EXPECT_EQ(r.sampling.logit_bias, (std::map<int32_t, float>{{7, 3.5f}, {8, -100.0f}}));
  EXPECT_TRUE(r.ignored_fields.empty());
}

TEST(ParseRequestTest, DefaultsComeFromTheContextThenOpenAI) {
  ParseContext ctx = Context();
  ctx.defaults.temperature = 0.7;
  ctx.defaults.top_p = 0.95;
  ctx.defaults.top_k = 20;
  ParsedRequest r;
  ASSERT_FALSE(Parse({{"prompt", {5}}}, false, &r, ctx));
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.7f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.95f);
  EXPECT_EQ(r.sampling.top_k, 20);
  ASSERT_FALSE(Parse({{"prompt", {5}}, {"temperature", 0}, {"top_k", -1}}, false, &r, ctx));
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_EQ(r.sampling.top_k, -1);
  ASSERT_FALSE(Parse({{"prompt", {5}}}, false, &r));
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
}

TEST(ParseRequestTest, EveryFieldIsImplementedNoOpRefusedOrReported) {
  ParsedRequest r;
  // Documented no-ops and neutral values of refused fields pass.
  auto e = Parse({{"prompt", {5}},
                  {"user", "u"},
                  {"metadata", {{"k", "v"}}},
                  {"store", false},
                  {"service_tier", "auto"},
                  {"min_tokens", 0},
                  {"response_format", {{"type", "text"}}},
                  {"skip_special_tokens", true}},
                 false, &r);
  ASSERT_FALSE(e) << e->message;
  EXPECT_TRUE(r.ignored_fields.empty());
  // Unknown fields are reported for the log (vLLM), not refused.
  ASSERT_FALSE(Parse({{"prompt", {5}}, {"frobnicate", 1}, {"vllm_xargs", {{"a", 1}}}}, false, &r));
  EXPECT_EQ(r.ignored_fields, (std::vector<std::string>{"frobnicate", "vllm_xargs"}));
  ASSERT_FALSE(Parse({{"prompt", {5}}, {"stream", true}, {"stream_options", {{"include_usage", true}, {"x", 1}}}},
                     false, &r));
  EXPECT_EQ(r.ignored_fields, (std::vector<std::string>{"stream_options.x"}));
  // Output-changing fields that are not implemented: 400 naming them.
  const std::vector<std::pair<json, std::string>> refused = {
      {{{"response_format", {{"type", "json_object"}}}}, "response_format"},
      {{{"response_format", {{"type", "json_schema"}, {"json_schema", json::object()}}}},
       "response_format"},
      {{{"min_tokens", 4}}, "min_tokens"},
      {{{"guided_json", {{"type", "object"}}}}, "guided_json"},
      {{{"use_beam_search", true}}, "use_beam_search"},
      {{{"skip_special_tokens", false}}, "skip_special_tokens"},
      {{{"include_stop_str_in_output", true}}, "include_stop_str_in_output"},
      {{{"min_p", 1.5}}, "min_p"},
      {{{"presence_penalty", 3}}, "presence_penalty"},
      {{{"repetition_penalty", 0}}, "repetition_penalty"},
      {{{"logit_bias", {{"abc", 1}}}}, "logit_bias"},
      {{{"logit_bias", {{"1024", 1}}}}, "logit_bias"},
      {{{"logit_bias", {{"3", "high"}}}}, "logit_bias"},
      {{{"logit_bias", json::array({1})}}, "logit_bias"},
      {{{"echo", true}}, "echo"},
      {{{"stream", true}, {"stream_options", {{"continuous_usage_stats", true}}}},
       "stream_options.continuous_usage_stats"},
  };
  for (const auto& [extra, param] : refused) {
    json body = {{"prompt", {5}}};
    for (auto& [k, v] : extra.items()) body[k] = v;
    auto err = Parse(body, false, &r);
    ASSERT_TRUE(err) << body.dump();
    EXPECT_EQ(err->http_status, 400);
    EXPECT_EQ(err->param, param) << body.dump();
    EXPECT_NE(err->message.find(param), std::string::npos) << err->message;
  }
}

TEST(ParseRequestTest, ToolChoiceIsHonouredOrRefusedByName) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  const json msgs = json::array({{{"role", "user"}, {"content", "hi"}}});
  ParseContext ctx = Context();
  auto tmpl = ChatTemplate::Parse("{% for m in messages %}<user>{{ m.content }}</user>{% endfor %}"
                                  "<assistant><think>");
  ASSERT_TRUE(tmpl.ok());
  ctx.chat_template = &*tmpl;
  ParsedRequest r;
  ASSERT_FALSE(Parse({{"messages", msgs}, {"tools", tools}}, true, &r, ctx));
  EXPECT_TRUE(r.parse_tool_calls) << "auto is the default with tools";
  EXPECT_TRUE(r.parse_reasoning);
  EXPECT_EQ(r.reasoning_start, ReasoningParser::Mode::kReasoning);
  ASSERT_FALSE(Parse({{"messages", msgs}, {"tools", tools}, {"tool_choice", "none"}}, true, &r, ctx));
  EXPECT_FALSE(r.parse_tool_calls);
  ASSERT_FALSE(Parse({{"messages", msgs}}, true, &r, ctx));
  EXPECT_FALSE(r.parse_tool_calls);
  for (const json& choice :
       {json("required"), json::parse(R"({"type": "function", "function": {"name": "get_weather"}})"),
        json("sometimes"), json(3)}) {
    auto e = Parse({{"messages", msgs}, {"tools", tools}, {"tool_choice", choice}}, true, &r, ctx);
    ASSERT_TRUE(e) << choice.dump();
    EXPECT_EQ(e->param, "tool_choice");
  }
  auto e = Parse({{"messages", msgs}, {"tools", tools}, {"tool_choice", "required"}}, true, &r, ctx);
  EXPECT_NE(e->message.find("\"required\""), std::string::npos) << e->message;
  e = Parse({{"messages", msgs}, {"tools", json::array({{{"type", "function"}}})}}, true, &r, ctx);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "tools[0]");
}

// A chat choice's text, token by token through ChoiceText and ChatOutput, as the server runs it.
TEST(ChatOutputTest, TokenByTokenToolCallsAndReasoning) {
  const Tokenizer& tok = SmallTokenizer();
  ParsedRequest req;
  req.chat = true;
  req.parse_reasoning = true;
  req.reasoning_start = ReasoningParser::Mode::kReasoning;
  req.parse_tool_calls = true;
  req.tools = json::parse(R"([{"type": "function", "function": {"name": "read_file",
      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}])");
  const std::string output =
      "Need the file.</think>Reading it.<tool_call>read_file<arg_key>path</arg_key><arg_value>"
      "config.yaml</arg_value></tool_call><tool_call>read_file<arg_key>path</arg_key><arg_value>"
      "b.txt</arg_value></tool_call>";
  auto ids = tok.Encode(output, false);
  ASSERT_TRUE(ids.ok());
  for (const bool parallel : {true, false}) {
    req.parallel_tool_calls = parallel;
    ChoiceText text(&tok, {}, ChatMarkerIds(tok));
    ChatOutput out(req);
    ChatDelta all;
    for (int32_t id : *ids) all.Append(out.Add(text.Add(id, false)));
    all.Append(out.Add(text.Finish()));
    all.Append(out.Finish());
    EXPECT_EQ(all.reasoning, "Need the file.");
    EXPECT_EQ(all.content, "Reading it.");
    ASSERT_EQ(all.tool_calls.size(), parallel ? 2u : 1u);
    EXPECT_EQ(all.tool_calls[0].name, "read_file");
    EXPECT_EQ(json::parse(all.tool_calls[0].arguments), json::parse(R"({"path": "config.yaml"})"));
  }
  // include_reasoning=false drops the reasoning, not the content.
  req.include_reasoning = false;
  req.parse_tool_calls = false;
  ChatOutput out(req);
  ChatDelta d = out.Add("why</think>because");
  EXPECT_EQ(d.reasoning, "");
  EXPECT_EQ(d.content, "because");
}

// Whether the real Laguna tokenizer flags its chat markers special is not known: the parsers must
// see them either way, while other special tokens stay out of the text.
TEST(ChatOutputTest, MarkersReachTheParsersEvenWhenFlaggedSpecial) {
  auto text = BuildSmallTokenizerJson(1024);
  ASSERT_TRUE(text.ok());
  json j = json::parse(*text);
  for (auto& t : j["added_tokens"]) {
    if (t["content"] == "<think>" || t["content"] == "</think>") t["special"] = true;
  }
  auto tok = Tokenizer::FromJson(j.dump(), "special markers");
  ASSERT_TRUE(tok.ok());
  auto ids = tok->Encode("a<think>b</think>c\u3008|EOS|\u3009d", false);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(tok->IsSpecial(*tok->TokenToId("</think>")));
  ChoiceText keep(&*tok, {}, ChatMarkerIds(*tok));
  std::string got;
  for (int32_t id : *ids) got += keep.Add(id, false);
  got += keep.Finish();
  EXPECT_EQ(got, "a<think>b</think>cd");
  ChoiceText plain(&*tok, {});
  got.clear();
  for (int32_t id : *ids) got += plain.Add(id, false);
  got += plain.Finish();
  EXPECT_EQ(got, "abcd") << "without parsers every special token is skipped, as before";
}

}  // namespace
}  // namespace dl::api
