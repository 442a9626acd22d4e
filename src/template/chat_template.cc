#include "template/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "base/file_util.h"
#include "template/jinja_eval.h"
#include "template/jinja_parser.h"

namespace dl {
namespace {

Status FromJinjaError(const jinja::JinjaError& e, const std::string& name) {
  std::string where = e.line > 0 ? fmt::format("{}:{}:{}", name, e.line, e.column) : name;
  if (e.raised_by_template) {
    return InvalidArgument("{}: template raised an exception: {}", where, e.message);
  }
  return InvalidArgument("{}: {}", where, e.message);
}

Result<std::string> ReadFile(const std::filesystem::path& path) {
  return ReadRegularFile(path.string(), kMaxJsonSidecarBytes);
}

Result<nlohmann::ordered_json> ReadJson(const std::filesystem::path& path) {
  DL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return DataLoss("{} is not valid JSON: {}", path.string(), e.what());
  }
}

// Picks the template out of a "chat_template" field (string or [{name, template}, ...]).
Result<std::string> TemplateFromField(const nlohmann::ordered_json& field,
                                      const std::string& file) {
  if (field.is_string()) return field.get<std::string>();
  if (field.is_array()) {
    for (const auto& entry : field) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string()) {
        return entry["template"].get<std::string>();
      }
    }
    return NotFound(
        "model has no chat template: {} lists named chat templates but none is "
        "called \"default\"",
        file);
  }
  return DataLoss("{}: \"chat_template\" must be a string or a list of {{name, template}}", file);
}

std::string TokenString(const nlohmann::ordered_json& config, const char* key) {
  if (!config.contains(key)) return "";
  const auto& t = config[key];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) {
    return t["content"].get<std::string>();
  }
  return "";
}

}  // namespace

Result<ChatTemplate> ChatTemplate::Parse(const std::string& template_text,
                                         const std::string& source_name) {
  ChatTemplate t;
  t.source_ = template_text;
  t.source_name_ = source_name;
  try {
    t.tmpl_ = jinja::ParseTemplate(template_text);
  } catch (const jinja::JinjaError& e) {
    return FromJinjaError(e, source_name);
  } catch (const std::exception& e) {
    return Internal("{}: parse failed: {}", source_name, e.what());
  }
  return t;
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context) const {
  if (!tmpl_) return FailedPrecondition("{}: template was not parsed", source_name_);
  if (!context.is_object()) {
    return InvalidArgument("{}: render context must be a JSON object", source_name_);
  }
  try {
    // One budget for the context and the render: cycles a template makes through the request's
    // own lists are emptied when the budget ends, after the context and the evaluator.
    const jinja::RenderLimits limits;
    jinja::RenderBudget budget(limits);
    const jinja::Value ctx = jinja::Value::FromJson(context);
    jinja::Evaluator ev(limits);
    return ev.Render(*tmpl_, ctx);
  } catch (const jinja::JinjaError& e) {
    return FromJinjaError(e, source_name_);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("{}: out of memory while rendering", source_name_);
  } catch (const std::exception& e) {
    return Internal("{}: render failed: {}", source_name_, e.what());
  }
}

Result<std::string> ReadChatTemplateSource(const std::string& model_dir, std::string* origin) {
  namespace fs = std::filesystem;
  const fs::path dir(model_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFound("model directory {} does not exist", model_dir);

  const fs::path jinja_file = dir / "chat_template.jinja";
  if (fs::exists(jinja_file, ec)) {
    if (origin) *origin = jinja_file.string();
    return ReadFile(jinja_file);
  }
  const fs::path json_file = dir / "chat_template.json";
  if (fs::exists(json_file, ec)) {
    DL_ASSIGN_OR_RETURN(auto j, ReadJson(json_file));
    if (j.is_object() && j.contains("chat_template")) {
      if (origin) *origin = json_file.string();
      return TemplateFromField(j["chat_template"], json_file.string());
    }
  }
  const fs::path config_file = dir / "tokenizer_config.json";
  if (fs::exists(config_file, ec)) {
    DL_ASSIGN_OR_RETURN(auto j, ReadJson(config_file));
    if (j.is_object() && j.contains("chat_template") && !j["chat_template"].is_null()) {
      if (origin) *origin = config_file.string();
      return TemplateFromField(j["chat_template"], config_file.string());
    }
  }
  return NotFound(
      "model has no chat template: {} has no chat_template.jinja and no \"chat_template\" in "
      "chat_template.json or tokenizer_config.json",
      model_dir);
}

Result<ChatTemplate> LoadChatTemplateForModel(const std::string& model_dir,
                                              const std::string& template_file) {
  std::string origin;
  std::string text;
  if (!template_file.empty()) {
    origin = template_file;
    DL_ASSIGN_OR_RETURN(text, ReadFile(template_file));
  } else {
    DL_ASSIGN_OR_RETURN(text, ReadChatTemplateSource(model_dir, &origin));
  }
  DL_ASSIGN_OR_RETURN(ChatTemplate tmpl, ChatTemplate::Parse(text, origin));
  if (model_dir.empty()) return tmpl;
  const std::filesystem::path config_file =
      std::filesystem::path(model_dir) / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(config_file, ec)) {
    DL_ASSIGN_OR_RETURN(auto config, ReadJson(config_file));
    if (config.is_object()) {
      tmpl.set_special_tokens(TokenString(config, "bos_token"), TokenString(config, "eos_token"));
    }
  }
  return tmpl;
}

}  // namespace dl
