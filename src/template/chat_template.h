// Chat templates: Hugging Face's Jinja chat templates rendered in C++ with the same result as
// transformers' apply_chat_template (jinja2 with trim_blocks, lstrip_blocks, loopcontrols, HF's
// tojson / raise_exception / strftime_now). The interpreter is in jinja_*.{h,cc}.
//
// Typical use (the server):
//   DL_ASSIGN_OR_RETURN(dl::ChatTemplate tmpl, dl::LoadChatTemplateForModel(model_dir));
//   nlohmann::ordered_json ctx = {{"messages", messages}, {"tools", tools},
//                                 {"add_generation_prompt", true}, {"enable_thinking", false}};
//   ctx["bos_token"] = tmpl.bos_token(); ctx["eos_token"] = tmpl.eos_token();
//   DL_ASSIGN_OR_RETURN(std::string prompt, tmpl.Render(ctx));
// Pass request JSON as nlohmann::ordered_json: tojson prints dict keys in the order they came in
// (as Python does), and nlohmann::json would sort them.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace dl {
namespace jinja {
struct Template;
}

class ChatTemplate {
 public:
  // Parses `template_text`. Syntax errors, unclosed tags and unknown filters/tests are
  // InvalidArgument errors that name `source_name` and the line and column.
  static Result<ChatTemplate> Parse(const std::string& template_text,
                                    const std::string& source_name = "chat template");

  // Renders with the top-level variables of `context` (an object: messages, tools,
  // add_generation_prompt, bos_token, eos_token, enable_thinking, ...). Errors (including a
  // raise_exception() call in the template, whose message is kept verbatim) are InvalidArgument
  // with the line and column; the server maps them to HTTP 400.
  Result<std::string> Render(const nlohmann::ordered_json& context) const;

  const std::string& source() const { return source_; }
  const std::string& source_name() const { return source_name_; }
  // From tokenizer_config.json when loaded with LoadChatTemplateForModel; empty otherwise.
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  void set_special_tokens(std::string bos, std::string eos) {
    bos_token_ = std::move(bos);
    eos_token_ = std::move(eos);
  }

 private:
  std::shared_ptr<const jinja::Template> tmpl_;
  std::string source_;
  std::string source_name_;
  std::string bos_token_;
  std::string eos_token_;
};

// The template text of a model directory: chat_template.jinja, else chat_template.json's
// "chat_template", else tokenizer_config.json's "chat_template" (a string, or HF's list of
// {"name", "template"} from which "default" is taken). NotFound ("model has no chat template")
// when none exists. `origin` receives the file it came from.
Result<std::string> ReadChatTemplateSource(const std::string& model_dir, std::string* origin);

// ReadChatTemplateSource + Parse, with bos_token / eos_token taken from tokenizer_config.json
// (a string or an AddedToken object's "content"). A `template_file` replaces the model's template
// (serve --chat-template); `model_dir` may then be empty (no bos/eos tokens).
Result<ChatTemplate> LoadChatTemplateForModel(const std::string& model_dir,
                                              const std::string& template_file = "");

}  // namespace dl
