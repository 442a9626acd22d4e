#include "server/tool_parser.h"

#include <algorithm>

#include "server/reasoning_parser.h"
#include "server/unique_id.h"

namespace dl::api {
namespace {

std::string_view Trim(std::string_view s) {
  const char* ws = " \t\r\n";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string_view::npos) return {};
  const size_t b = s.find_last_not_of(ws);
  return s.substr(a, b - a + 1);
}

nlohmann::ordered_json Deserialize(std::string_view raw) {
  try {
    return nlohmann::ordered_json::parse(raw);
  } catch (const nlohmann::json::exception&) {
  }
  // Python literals, which vLLM's ast.literal_eval fallback also accepts.
  if (raw == "True") return true;
  if (raw == "False") return false;
  if (raw == "None") return nullptr;
  return std::string(raw);
}

}  // namespace

bool ToolCallParser::IsStringParam(const std::string& tool, const std::string& key) const {
  if (!tools_.is_array()) return false;
  for (const auto& t : tools_) {
    if (!t.is_object()) continue;
    const nlohmann::json& f = t.contains("function") ? t["function"] : t;
    if (!f.is_object() || f.value("name", "") != tool) continue;
    const auto params = f.find("parameters");
    if (params == f.end() || !params->is_object()) return false;
    const auto props = params->find("properties");
    if (props == params->end() || !props->is_object()) return false;
    const auto p = props->find(key);
    if (p == props->end() || !p->is_object()) return false;
    const auto type = p->find("type");
    return type != p->end() && *type == "string";
  }
  return false;
}

bool ToolCallParser::ParseBlock(std::string_view body, ToolCall* call) const {
  size_t name_end = body.size();
  for (std::string_view stop : {std::string_view("\n"), kArgKeyStart}) {
    const size_t at = body.find(stop);
    if (at != std::string_view::npos) name_end = std::min(name_end, at);
  }
  const std::string name(Trim(body.substr(0, name_end)));
  if (name.empty()) return false;
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  size_t pos = name_end;
  while (true) {
    const size_t ks = body.find(kArgKeyStart, pos);
    if (ks == std::string_view::npos) break;
    const size_t ke = body.find(kArgKeyEnd, ks + kArgKeyStart.size());
    if (ke == std::string_view::npos) break;
    // Only whitespace may separate </arg_key> from <arg_value> (vLLM's pattern).
    const size_t after = ke + kArgKeyEnd.size();
    const size_t vs = body.find(kArgValueStart, after);
    if (vs == std::string_view::npos || !Trim(body.substr(after, vs - after)).empty()) {
      pos = after;
      continue;
    }
    const size_t ve = body.find(kArgValueEnd, vs + kArgValueStart.size());
    if (ve == std::string_view::npos) break;
    const std::string key(Trim(body.substr(ks + kArgKeyStart.size(), ke - ks - kArgKeyStart.size())));
    const std::string_view raw =
        Trim(body.substr(vs + kArgValueStart.size(), ve - vs - kArgValueStart.size()));
    args[key] = IsStringParam(name, key) ? nlohmann::ordered_json(std::string(raw)) : Deserialize(raw);
    pos = ve + kArgValueEnd.size();
  }
  call->id = UniqueId("chatcmpl-tool");
  call->name = name;
  call->arguments = args.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return true;
}

ToolParse ToolCallParser::Add(std::string_view text) {
  ToolParse out;
  buf_.append(text);
  while (true) {
    if (!in_call_) {
      const size_t at = buf_.find(kToolCallStart);
      if (at == std::string::npos) {
        const size_t hold = PartialMarkerSuffix(buf_, kToolCallStart);
        out.content += buf_.substr(0, buf_.size() - hold);
        buf_.erase(0, buf_.size() - hold);
        break;
      }
      out.content += buf_.substr(0, at);
      buf_.erase(0, at + kToolCallStart.size());
      in_call_ = true;
      continue;
    }
    const size_t end = buf_.find(kToolCallEnd);
    if (end == std::string::npos) break;
    ToolCall call;
    if (ParseBlock(std::string_view(buf_).substr(0, end), &call)) out.calls.push_back(std::move(call));
    buf_.erase(0, end + kToolCallEnd.size());
    in_call_ = false;
  }
  return out;
}

ToolParse ToolCallParser::Finish() {
  ToolParse out;
  out.content = in_call_ ? std::string(kToolCallStart) + buf_ : buf_;
  buf_.clear();
  in_call_ = false;
  return out;
}

ToolParse ToolCallParser::Parse(std::string_view text, const nlohmann::json& tools) {
  ToolCallParser p(tools);
  ToolParse a = p.Add(text);
  a.content += p.Finish().content;  // Finish never has calls
  return a;
}

}  // namespace dl::api
