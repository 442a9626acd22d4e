// Renders every case of tests/data/chat_templates/expected.json (produced by Python's jinja2 with
// HF's settings, see tools/reference/render_chat_templates.py) and asserts byte equality, or the
// same failure where jinja2 failed.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "template/chat_template.h"

namespace dl {
namespace {

const std::string kDataDir = std::string(DECODELAB_SOURCE_DIR) + "/tests/data/chat_templates";

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// First differing byte, with some context, for readable failures on long prompts.
std::string FirstDifference(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  size_t from = i > 40 ? i - 40 : 0;
  return "first difference at byte " + std::to_string(i) + "\n  want: ..." +
         want.substr(from, 100) + "\n  got:  ..." + got.substr(from, 100);
}

TEST(ChatTemplateFixture, MatchesJinja2ByteForByte) {
  const std::string text = Slurp(kDataDir + "/expected.json");
  ASSERT_FALSE(text.empty()) << "missing " << kDataDir << "/expected.json";
  auto doc = nlohmann::ordered_json::parse(text);
  const auto& cases = doc["cases"];
  ASSERT_GE(cases.size(), 50u);
  std::map<std::string, ChatTemplate> templates;
  int rendered = 0, errors = 0;
  for (const auto& c : cases) {
    const std::string name = c["template"].get<std::string>();
    const std::string label = name + " / " + c["case"].get<std::string>();
    if (!templates.count(name)) {
      auto t = ChatTemplate::Parse(Slurp(kDataDir + "/" + name), name);
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      templates.emplace(name, *t);
    }
    auto out = templates.at(name).Render(c["context"]);
    if (c.contains("expected")) {
      ASSERT_TRUE(out.ok()) << label << ": " << out.status().ToString();
      const std::string want = c["expected"].get<std::string>();
      EXPECT_EQ(*out, want) << label << "\n" << FirstDifference(want, *out);
      ++rendered;
    } else {
      EXPECT_FALSE(out.ok()) << label << ": jinja2 failed with '" << c["error"].get<std::string>()
                             << "' but we rendered:\n"
                             << *out;
      if (!out.ok() && c["error_type"] == "TemplateError") {
        // raise_exception(): the template's own message must reach the caller verbatim.
        EXPECT_NE(out.status().message().find(c["error"].get<std::string>()), std::string::npos)
            << label << ": " << out.status().message();
        EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
      }
      ++errors;
    }
  }
  EXPECT_GT(rendered, 40);
  EXPECT_GT(errors, 3);
}

TEST(ChatTemplateFixture, LagunaTemplateStructure) {
  // Independent of jinja2: the properties design doc laguna-checkpoints.md §3.3 asks for.
  auto t = ChatTemplate::Parse(Slurp(kDataDir + "/laguna_chat_template.jinja"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  nlohmann::ordered_json ctx = {
      {"messages", {{{"role", "user"}, {"content", "hi"}}}},
      {"add_generation_prompt", true},
  };
  auto on = t->Render(ctx);
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_EQ(
      on->rfind("\xe3\x80\x88|EOS|\xe3\x80\x89<system>You are a helpful, conversationally-fluent "
                "assistant made by Poolside.",
                0),
      0u)
      << *on;
  EXPECT_NE(on->find("</system>\n<user>hi</user>\n"), std::string::npos) << *on;
  EXPECT_TRUE(on->size() >= 18 && on->substr(on->size() - 18) == "<assistant><think>") << *on;
  ctx["enable_thinking"] = false;
  auto off = t->Render(ctx);
  ASSERT_TRUE(off.ok());
  EXPECT_TRUE(off->size() >= 19 && off->substr(off->size() - 19) == "<assistant></think>") << *off;

  // Tool signatures: one per line, with <, >, &, ' escaped.
  ctx["tools"] = {
      {{"type", "function"}, {"function", {{"name", "f"}, {"description", "a<b>&'c'"}}}}};
  auto tools = t->Render(ctx);
  ASSERT_TRUE(tools.ok());
  EXPECT_NE(tools->find("<available_tools>\n{\"name\": \"f\", \"description\": "
                        "\"a\\u003cb\\u003e\\u0026\\u0027c\\u0027\"}\n</available_tools>"),
            std::string::npos)
      << *tools;
}

class ModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("dl_template_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  std::filesystem::path dir_;
};

TEST_F(ModelDirTest, PrefersChatTemplateJinja) {
  Write("chat_template.jinja", "JINJA {{ messages|length }}");
  Write("tokenizer_config.json",
        R"({"chat_template": "CONFIG", "bos_token": {"content": "<s>", "special": true},
            "eos_token": "</s>"})");
  auto t = LoadChatTemplateForModel(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*t->Render({{"messages", {1, 2}}}), "JINJA 2");
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->eos_token(), "</s>");
}

TEST_F(ModelDirTest, TokenizerConfigString) {
  Write("tokenizer_config.json", R"({"chat_template": "{{ bos_token }}CONFIG", "bos_token": "B"})");
  auto t = LoadChatTemplateForModel(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*t->Render({{"bos_token", t->bos_token()}}), "BCONFIG");
}

TEST_F(ModelDirTest, TokenizerConfigNamedList) {
  Write("tokenizer_config.json",
        R"({"chat_template": [{"name": "tool_use", "template": "TOOLS"},
                              {"name": "default", "template": "DEFAULT"}]})");
  auto t = LoadChatTemplateForModel(dir_.string());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*t->Render(nlohmann::ordered_json::object()), "DEFAULT");
}

TEST_F(ModelDirTest, NoTemplateIsNotFound) {
  Write("tokenizer_config.json", R"({"eos_token": "</s>"})");
  auto t = LoadChatTemplateForModel(dir_.string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_NE(t.status().message().find("model has no chat template"), std::string::npos);
}

TEST_F(ModelDirTest, NamedListWithoutDefaultIsNotFound) {
  Write("tokenizer_config.json", R"({"chat_template": [{"name": "rag", "template": "X"}]})");
  auto t = LoadChatTemplateForModel(dir_.string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
}

TEST_F(ModelDirTest, BrokenTemplateNamesFileAndLine) {
  Write("chat_template.jinja", "ok\n{% if x %}never closed");
  auto t = LoadChatTemplateForModel(dir_.string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("chat_template.jinja:2:"), std::string::npos)
      << t.status().message();
}

TEST_F(ModelDirTest, CorruptConfigIsDataLoss) {
  Write("tokenizer_config.json", "{not json");
  auto t = LoadChatTemplateForModel(dir_.string());
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(t.status().message().find("tokenizer_config.json"), std::string::npos);
}

TEST(ChatTemplateLoad, MissingDirectory) {
  auto t = LoadChatTemplateForModel("/nonexistent/decodelab/model");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace dl

namespace dl {
namespace {

// Feature-by-feature snippets rendered by jinja2 (the "snippets" section of expected.json).
TEST(ChatTemplateFixture, SnippetsMatchJinja2) {
  auto doc = nlohmann::ordered_json::parse(Slurp(kDataDir + "/expected.json"));
  const auto& context = doc["snippet_context"];
  ASSERT_GE(doc["snippets"].size(), 40u);
  for (const auto& s : doc["snippets"]) {
    const std::string name = s["name"].get<std::string>();
    auto t = ChatTemplate::Parse(s["source"].get<std::string>(), name);
    ASSERT_TRUE(t.ok()) << name << ": " << t.status().ToString();
    auto out = t->Render(context);
    if (s.contains("expected")) {
      ASSERT_TRUE(out.ok()) << name << ": " << out.status().ToString();
      EXPECT_EQ(*out, s["expected"].get<std::string>()) << name;
    } else {
      EXPECT_FALSE(out.ok()) << name << ": jinja2 failed (" << s["error"].get<std::string>()
                             << ") but we rendered: " << *out;
      if (!out.ok() && s["error_type"] == "TemplateError") {
        EXPECT_NE(out.status().message().find(s["error"].get<std::string>()), std::string::npos)
            << out.status().message();
      }
    }
  }
}

}  // namespace
}  // namespace dl
