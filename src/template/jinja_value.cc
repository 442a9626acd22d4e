#include "template/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace dl::jinja {

void Fail(std::string message) {
  throw JinjaError{std::move(message)};
}

Value* Dict::Find(const std::string& key) {
  for (auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

const Value* Dict::Find(const std::string& key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::Set(const std::string& key, Value value) {
  if (Value* existing = Find(key)) {
    *existing = std::move(value);
  } else {
    items.emplace_back(key, std::move(value));
  }
}

Value Value::MakeList(std::vector<Value> items, bool is_tuple) {
  Value v = FromKind(Kind::kList);
  v.list_ = std::make_shared<List>();
  v.list_->items = std::move(items);
  v.list_->is_tuple = is_tuple;
  return v;
}

Value Value::MakeDict() {
  Value v = FromKind(Kind::kDict);
  v.dict_ = std::make_shared<Dict>();
  return v;
}

Value Value::MakeNamespace() {
  Value v = MakeDict();
  v.dict_->is_namespace = true;
  return v;
}

Value Value::MakeCallable(std::string name, NativeFunction fn) {
  Value v = FromKind(Kind::kCallable);
  v.fn_ = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

Value Value::FromJson(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None();
    case nlohmann::ordered_json::value_t::boolean:
      return Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Int(static_cast<int64_t>(u));
      return Float(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return String(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(FromJson(e));
      return MakeList(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = MakeDict();
      d.dict_->items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) d.dict_->Set(it.key(), FromJson(it.value()));
      return d;
    }
    default:
      return None();  // binary / discarded: not produced by the JSON parser
  }
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0.0;
    case Kind::kString:
      return !str_.empty();
    case Kind::kList:
      return !list_->items.empty();
    case Kind::kDict:
      return dict_->is_namespace || !dict_->items.empty();
    case Kind::kCallable:
      return true;
  }
  return false;
}

std::string PyFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string out;
  size_t pos = 0;
  if (sci[0] == '-') {
    out = "-";
    pos = 1;
  }
  size_t e_pos = sci.find('e');
  std::string digits;
  for (size_t i = pos; i < e_pos; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  int exp = std::stoi(sci.substr(e_pos + 1));
  // Python's repr switches to scientific notation outside 1e-4 <= |x| < 1e16.
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      std::string int_part = digits.substr(0, std::min<size_t>(digits.size(), exp + 1));
      while (int_part.size() < static_cast<size_t>(exp + 1)) int_part += '0';
      std::string frac =
          digits.size() > static_cast<size_t>(exp + 1) ? digits.substr(exp + 1) : "0";
      out += int_part + "." + frac;
    } else {
      out += "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return out;
}

namespace {

// Decodes one UTF-8 code point at s[i]; returns its length (1 for invalid bytes).
size_t DecodeUtf8(const std::string& s, size_t i, uint32_t* cp) {
  unsigned char c = s[i];
  size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + len > s.size()) len = 1;
  if (len == 1) {
    *cp = c;
    return 1;
  }
  uint32_t v = c & (0xFF >> (len + 1));
  for (size_t k = 1; k < len; ++k) {
    unsigned char cc = s[i + k];
    if ((cc & 0xC0) != 0x80) {
      *cp = c;
      return 1;
    }
    v = (v << 6) | (cc & 0x3F);
  }
  *cp = v;
  return len;
}

void AppendHex(std::string& out, const char* prefix, uint32_t v, int width) {
  char b[16];
  std::snprintf(b, sizeof(b), "%s%0*x", prefix, width, v);
  out += b;
}

}  // namespace

std::vector<std::string> SplitCodePoints(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t n = DecodeUtf8(s, i, &cp);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

size_t CodePointCount(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::string PyStrRepr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t n = DecodeUtf8(s, i, &cp);
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == static_cast<uint32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0xa0) || cp == 0xad) {
      AppendHex(out, "\\x", cp, 2);
    } else if (cp == 0x2028 || cp == 0x2029) {
      AppendHex(out, "\\u", cp, 4);
    } else {
      out.append(s, i, n);
    }
    i += n;
  }
  out += quote;
  return out;
}

std::string Value::ToStr() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return str_;
    default:
      return Repr();
  }
}

std::string Value::Repr() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return int_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(int_);
    case Kind::kFloat:
      return PyFloatRepr(float_);
    case Kind::kString:
      return PyStrRepr(str_);
    case Kind::kList: {
      std::string out = list_->is_tuple ? "(" : "[";
      for (size_t i = 0; i < list_->items.size(); ++i) {
        if (i) out += ", ";
        out += list_->items[i].Repr();
      }
      if (list_->is_tuple && list_->items.size() == 1) out += ",";
      out += list_->is_tuple ? ")" : "]";
      return out;
    }
    case Kind::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, v] : dict_->items) {
        if (!first) out += ", ";
        first = false;
        out += PyStrRepr(k) + ": " + v.Repr();
      }
      out += "}";
      return dict_->is_namespace ? "<Namespace " + out + ">" : out;
    }
    case Kind::kCallable:
      return "<function " + fn_->name + ">";
  }
  return "";
}

bool Value::Equals(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (kind_ != Kind::kFloat && o.kind_ != Kind::kFloat) return int_ == o.int_;
    return as_double() == o.as_double();
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return str_ == o.str_;
    case Kind::kList: {
      if (list_->is_tuple != o.list_->is_tuple) return false;
      if (list_->items.size() != o.list_->items.size()) return false;
      for (size_t i = 0; i < list_->items.size(); ++i) {
        if (!list_->items[i].Equals(o.list_->items[i])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (dict_ == o.dict_) return true;
      if (dict_->is_namespace || o.dict_->is_namespace) return false;  // identity only
      if (dict_->items.size() != o.dict_->items.size()) return false;
      for (const auto& [k, v] : dict_->items) {
        const Value* ov = o.dict_->Find(k);
        if (!ov || !v.Equals(*ov)) return false;
      }
      return true;
    }
    case Kind::kCallable:
      return fn_ == o.fn_;
    default:
      return false;
  }
}

std::string Value::QuotedShortTypeName() const {
  const std::string n = TypeName();
  const auto p = n.find(" object");
  return "'" + (p == std::string::npos ? n : n.substr(0, p)) + "'";
}

std::string Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool object";
    case Kind::kInt:
      return "int object";
    case Kind::kFloat:
      return "float object";
    case Kind::kString:
      return "str object";
    case Kind::kList:
      return list_->is_tuple ? "tuple object" : "list object";
    case Kind::kDict:
      return dict_->is_namespace ? "Namespace object" : "dict object";
    case Kind::kCallable:
      return "function object";
  }
  return "object";
}

nlohmann::ordered_json Value::ToJson() const {
  switch (kind_) {
    case Kind::kNone:
      return nullptr;
    case Kind::kBool:
      return int_ != 0;
    case Kind::kInt:
      return int_;
    case Kind::kFloat:
      return float_;
    case Kind::kString:
      return str_;
    case Kind::kList: {
      auto arr = nlohmann::ordered_json::array();
      for (const auto& v : list_->items) arr.push_back(v.ToJson());
      return arr;
    }
    case Kind::kDict: {
      auto obj = nlohmann::ordered_json::object();
      for (const auto& [k, v] : dict_->items) obj[k] = v.ToJson();
      return obj;
    }
    default:
      Fail("Object of type " + TypeName() + " is not JSON serializable");
  }
}

namespace {

void JsonString(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    size_t n = DecodeUtf8(s, i, &cp);
    switch (cp) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (cp < 0x20 || (ensure_ascii && cp >= 0x7f)) {
          if (cp >= 0x10000) {
            uint32_t v = cp - 0x10000;
            AppendHex(out, "\\u", 0xD800 + (v >> 10), 4);
            AppendHex(out, "\\u", 0xDC00 + (v & 0x3FF), 4);
          } else {
            AppendHex(out, "\\u", cp, 4);
          }
        } else {
          out.append(s, i, n);
        }
    }
    i += n;
  }
  out += '"';
}

void Dump(std::string& out, const Value& v, const JsonDumpOptions& o, int level) {
  auto newline = [&](int lvl) {
    out += '\n';
    for (int i = 0; i < lvl; ++i) out += o.indent;
  };
  switch (v.kind()) {
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.as_int());
      return;
    case Value::Kind::kFloat: {
      double d = v.as_double();
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d < 0 ? "-Infinity" : "Infinity";
      } else {
        out += PyFloatRepr(d);
      }
      return;
    }
    case Value::Kind::kString:
      JsonString(out, v.str(), o.ensure_ascii);
      return;
    case Value::Kind::kList: {
      const auto& items = v.list().items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline(level + 1);
        Dump(out, items[i], o, level + 1);
      }
      if (o.has_indent) newline(level);
      out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.is_namespace()) Fail("Object of type Namespace is not JSON serializable");
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict().items) items.push_back(&kv);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out += '{';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline(level + 1);
        JsonString(out, items[i]->first, o.ensure_ascii);
        out += o.key_separator;
        Dump(out, items[i]->second, o, level + 1);
      }
      if (o.has_indent) newline(level);
      out += '}';
      return;
    }
    case Value::Kind::kUndefined:
      Fail("Object of type Undefined is not JSON serializable");
    case Value::Kind::kCallable:
      Fail("Object of type function is not JSON serializable");
  }
}

}  // namespace

std::string JsonDumps(const Value& v, const JsonDumpOptions& options) {
  std::string out;
  Dump(out, v, options, 0);
  return out;
}

}  // namespace dl::jinja
