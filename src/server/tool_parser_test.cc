// The Laguna tool-call and reasoning parsers over the chat-template fixtures: every assistant turn
// the Laguna template renders (tests/data/chat_templates/expected.json, made with jinja2) is read
// back into the message it was rendered from, whole and in pieces of every size.
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "server/reasoning_parser.h"
#include "server/tool_parser.h"
#include "tokenizer/tokenizer_writer.h"

namespace dl::api {
namespace {

using nlohmann::json;

json Fixtures() {
  std::ifstream in(std::string(DECODELAB_SOURCE_DIR) + "/tests/data/chat_templates/expected.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

struct Parsed {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
};

// Reasoning first, then tool calls over the content, as the server does; `piece` bytes at a time.
Parsed ParseInPieces(const std::string& text, ReasoningParser::Mode start, const json& tools,
                     size_t piece) {
  ReasoningParser rp(start);
  ToolCallParser tp(tools);
  Parsed out;
  auto take = [&](ReasoningSplit s, bool last) {
    out.reasoning += s.reasoning;
    ToolParse t = tp.Add(s.content);
    out.content += t.content;
    for (auto& c : t.calls) out.calls.push_back(c);
    if (last) {
      ToolParse f = tp.Finish();
      out.content += f.content;
      for (auto& c : f.calls) out.calls.push_back(c);
    }
  };
  for (size_t i = 0; i < text.size(); i += piece) take(rp.Add(text.substr(i, piece)), false);
  take(rp.Finish(), true);
  return out;
}

TEST(ToolParserFixtures, EveryRenderedAssistantTurnParsesBackToItsMessage) {
  const json fixtures = Fixtures();
  int turns = 0, calls = 0, reasoned = 0;
  for (const auto& c : fixtures["cases"]) {
    if (c["template"] != "laguna_chat_template.jinja" || !c.contains("expected")) continue;
    const std::string rendered = c["expected"];
    const json& ctx = c["context"];
    const json tools = ctx.value("tools", json::array());
    std::vector<json> assistant;
    for (const auto& m : ctx["messages"]) {
      if (m["role"] == "assistant") assistant.push_back(m);
    }
    size_t pos = 0;
    for (const json& m : assistant) {
      const size_t a = rendered.find("<assistant>", pos);
      ASSERT_NE(a, std::string::npos) << c["case"];
      const size_t b = rendered.find("</assistant>", a);
      ASSERT_NE(b, std::string::npos) << c["case"];
      pos = b;
      std::string turn = rendered.substr(a + 11, b - a - 11);
      // The prompt of this turn ends with the marker the template put after <assistant>.
      ReasoningParser::Mode start;
      if (turn.rfind("<think>", 0) == 0) {
        start = ReasoningParser::Mode::kReasoning;
        turn.erase(0, 7);
      } else {
        ASSERT_EQ(turn.rfind("</think>", 0), 0u) << c["case"] << ": " << turn;
        start = ReasoningParser::Mode::kContentOnly;
        turn.erase(0, 8);
      }
      const bool kept_reasoning = start == ReasoningParser::Mode::kReasoning;
      const json want_calls = m.value("tool_calls", json::array());
      for (size_t piece : {turn.size() + 1, size_t{1}, size_t{2}, size_t{3}, size_t{7}}) {
        SCOPED_TRACE(c["case"].get<std::string>() + " piece " + std::to_string(piece));
        const Parsed p = ParseInPieces(turn, start, tools, piece);
        if (kept_reasoning) {
          std::string want = m.value("reasoning_content", "");
          want.erase(0, want.find_first_not_of(" \t\n"));
          want.erase(want.find_last_not_of(" \t\n") + 1);
          EXPECT_EQ(p.reasoning, want);
        } else {
          EXPECT_EQ(p.reasoning, "");
        }
        const std::string want_content = m["content"].is_string() ? m["content"].get<std::string>() : "";
        EXPECT_EQ(p.content, want_content);
        ASSERT_EQ(p.calls.size(), want_calls.size());
        for (size_t i = 0; i < want_calls.size(); ++i) {
          const json& f = want_calls[i]["function"];
          EXPECT_EQ(p.calls[i].name, f["name"]);
          EXPECT_EQ(json::parse(p.calls[i].arguments), f["arguments"]) << p.calls[i].arguments;
          EXPECT_EQ(p.calls[i].id.rfind("chatcmpl-tool-", 0), 0u);
        }
      }
      ++turns;
      calls += static_cast<int>(want_calls.size());
      reasoned += kept_reasoning ? 1 : 0;
    }
  }
  // The fixtures hold several turns with calls and with kept reasoning; make sure they were seen.
  EXPECT_GE(turns, 8);
  EXPECT_GE(calls, 6);
  EXPECT_GE(reasoned, 3);
}

TEST(ToolParser, ValuesFollowTheSchemaAndUnclosedCallsStayContent) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "f", "parameters":
      {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}}}}}])");
  // A string-typed "123" stays text; an untyped "123" is a number; Python literals are read.
  ToolParse p = ToolCallParser::Parse(
      "Sure.<tool_call>f\n<arg_key>s</arg_key>\n<arg_value> 123 </arg_value><arg_key>n</arg_key>"
      "<arg_value>7</arg_value><arg_key>x</arg_key><arg_value>123</arg_value><arg_key>b"
      "</arg_key><arg_value>True</arg_value><arg_key>t</arg_key><arg_value>plain words"
      "</arg_value></tool_call> after",
      tools);
  EXPECT_EQ(p.content, "Sure. after");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].name, "f");
  EXPECT_EQ(json::parse(p.calls[0].arguments),
            json::parse(R"({"s": "123", "n": 7, "x": 123, "b": true, "t": "plain words"})"));
  // Argument order is kept.
  EXPECT_EQ(p.calls[0].arguments.find("\"s\""), 1u);
  // The output ran out inside a call: nothing is lost, nothing is invented.
  p = ToolCallParser::Parse("a <tool_call>f<arg_key>s</arg_key><arg_val", tools);
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, "a <tool_call>f<arg_key>s</arg_key><arg_val");
  // Empty names are dropped; two calls are two calls with distinct ids.
  p = ToolCallParser::Parse("<tool_call></tool_call><tool_call>g</tool_call><tool_call>h</tool_call>",
                            json::array());
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].arguments, "{}");
  EXPECT_NE(p.calls[0].id, p.calls[1].id);
  // Something that only looks like the start of a marker is released at the end.
  p = ToolCallParser::Parse("x <tool_ca", json::array());
  EXPECT_EQ(p.content, "x <tool_ca");
}

TEST(ReasoningParser, StartModeLooksBackToTheCurrentAssistantTurn) {
  auto text = BuildSmallTokenizerJson(1024);
  ASSERT_TRUE(text.ok());
  auto tok = Tokenizer::FromJson(*text, "small");
  ASSERT_TRUE(tok.ok());
  const ReasoningTokens ids = ReasoningTokens::From(*tok);
  ASSERT_TRUE(ids.usable());
  auto mode = [&](const std::string& prompt) {
    auto p = tok->Encode(prompt, false);
    EXPECT_TRUE(p.ok());
    return ReasoningParser::StartMode(*p, ids);
  };
  using M = ReasoningParser::Mode;
  EXPECT_EQ(mode("<user>hi</user>\n<assistant><think>"), M::kReasoning);
  EXPECT_EQ(mode("<user>hi</user>\n<assistant></think>"), M::kContentOnly);
  // A </think> in the history does not end reasoning for this turn (vLLM's poolside_v1 fix).
  EXPECT_EQ(mode("<assistant></think>old</assistant>\n<user>hi</user>\n<assistant>"), M::kContent);
  EXPECT_EQ(mode("<user>mentions </think> in text</user>\n<assistant><think>"), M::kReasoning);
  EXPECT_EQ(mode("plain completion prompt"), M::kContent);
  ReasoningTokens none;
  EXPECT_EQ(ReasoningParser::StartMode(std::vector<int32_t>{1, 2, 3}, none), M::kContentOnly);
}

TEST(ReasoningParser, SplitsLikeVllmInEveryPieceSize) {
  using M = ReasoningParser::Mode;
  struct Case {
    M start;
    std::string text, reasoning, content;
  };
  const std::vector<Case> cases = {
      // The prompt opened <think>: everything up to </think> is reasoning.
      {M::kReasoning, "Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."},
      // A model that repeats <think> at the start: dropped.
      {M::kReasoning, "<think>hm</think>ok", "hm", "ok"},
      // Ran out while thinking: all reasoning, no content.
      {M::kReasoning, "still thinking <thi", "still thinking <thi", ""},
      // After </think> markers are plain content.
      {M::kReasoning, "a</think>b</think>c<think>d", "a", "b</think>c<think>d"},
      // Thinking off: nothing is parsed.
      {M::kContentOnly, "<think>x</think>y", "", "<think>x</think>y"},
      // No marker in the prompt: a <think> in the output opens reasoning.
      {M::kContent, "pre <think>why</think> post", "why", "pre  post"},
      {M::kContent, "no markers at all", "", "no markers at all"},
  };
  for (const auto& c : cases) {
    for (size_t piece = 1; piece <= c.text.size() + 1; ++piece) {
      ReasoningParser p(c.start);
      ReasoningSplit got;
      for (size_t i = 0; i < c.text.size(); i += piece) {
        ReasoningSplit s = p.Add(std::string_view(c.text).substr(i, piece));
        got.reasoning += s.reasoning;
        got.content += s.content;
      }
      ReasoningSplit f = p.Finish();
      got.reasoning += f.reasoning;
      got.content += f.content;
      EXPECT_EQ(got.reasoning, c.reasoning) << c.text << " piece " << piece;
      EXPECT_EQ(got.content, c.content) << c.text << " piece " << piece;
    }
  }
}

}  // namespace
}  // namespace dl::api
