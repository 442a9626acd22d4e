#include "template/jinja_value.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>

namespace dl::jinja {

void Fail(std::string message) {
  throw JinjaError{std::move(message)};
}

// ---------------------------------------------------------------- budget

namespace {

thread_local RenderBudget* t_budget = nullptr;
thread_local int t_value_depth = 0;

double MonotonicSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Mib(size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

uint64_t NextBudgetId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

// Refunds a freed value's bytes to the render that charged them, if it is still running here.
void Refund(uint64_t budget_id, size_t bytes) {
  if (budget_id != 0 && t_budget && t_budget->id() == budget_id) t_budget->RefundBytes(bytes);
}

// Containers dropped while another is being dropped wait here, so freeing a deeply nested value is
// a loop rather than a recursion.
struct Graveyard {
  std::vector<Value> pending;
  bool draining = false;
};
thread_local Graveyard t_grave;

}  // namespace

RenderBudget::RenderBudget(const RenderLimits& limits)
    : limits_(limits),
      previous_(t_budget),
      id_(NextBudgetId()),
      deadline_(MonotonicSeconds() + limits.max_seconds) {
  t_budget = this;
}

RenderBudget::~RenderBudget() {
  t_budget = previous_;
  try {
    BreakCycles();
  } catch (...) {
    // Out of memory while emptying: the cycles leak, the process lives on.
  }
}

void RenderBudget::BreakCycles() {
  // Anything created by this render and still alive is kept so by a cycle: empty it.
  std::vector<std::shared_ptr<List>> lists;
  std::vector<std::shared_ptr<Dict>> dicts;
  for (auto& w : lists_) {
    if (auto l = w.lock()) lists.push_back(std::move(l));
  }
  for (auto& w : dicts_) {
    if (auto d = w.lock()) dicts.push_back(std::move(d));
  }
  std::vector<Value> drop;
  for (auto& l : lists) {
    for (auto& v : l->items) drop.push_back(std::move(v));
    l->items.clear();
  }
  for (auto& d : dicts) {
    for (auto& kv : d->items) drop.push_back(std::move(kv.second));
    d->items.clear();
  }
  List sink;  // its destructor frees `drop` iteratively
  sink.items = std::move(drop);
}

RenderBudget* RenderBudget::Current() { return t_budget; }

void RenderBudget::ChargeSteps(int64_t n) {
  steps_ += n;
  if (steps_ > limits_.max_steps) {
    Fail("template exceeded the limit of " + std::to_string(limits_.max_steps) +
         " evaluation steps");
  }
  if (steps_ >= next_clock_check_) {
    next_clock_check_ = steps_ + 4096;
    if (MonotonicSeconds() > deadline_) {
      Fail("template rendering exceeded the time limit of " +
           std::to_string(static_cast<int>(limits_.max_seconds)) + " s");
    }
  }
}

void RenderBudget::ChargeBytes(size_t n) {
  live_ += n;
  if (live_ > limits_.max_alloc_bytes) {
    Fail("template exceeded the memory limit of " + Mib(limits_.max_alloc_bytes) +
         " for one render");
  }
}

void RenderBudget::CheckTransient(size_t n) const {
  if (n > limits_.max_alloc_bytes || live_ + n > limits_.max_alloc_bytes) {
    Fail("template exceeded the memory limit of " + Mib(limits_.max_alloc_bytes) +
         " for one render");
  }
}

void RenderBudget::Track(const std::shared_ptr<List>& l) {
  const size_t bytes = sizeof(List) + 32 + l->items.size() * sizeof(Value);
  ChargeBytes(bytes);
  l->budget_id = id_;
  l->charged = bytes;
  lists_.push_back(l);
}

void RenderBudget::Track(const std::shared_ptr<Dict>& d) {
  const size_t bytes = sizeof(Dict) + 32;
  ChargeBytes(bytes);
  d->budget_id = id_;
  d->charged = bytes;
  dicts_.push_back(d);
}

void ChargeSteps(int64_t n) {
  if (t_budget) t_budget->ChargeSteps(n);
}

void ChargeBytes(size_t n) {
  if (t_budget) t_budget->ChargeBytes(n);
}

void CheckTransient(size_t n) {
  if (t_budget) t_budget->CheckTransient(n);
}

void CheckStringSize(size_t n) {
  const size_t limit = t_budget ? t_budget->limits().max_string_bytes : RenderLimits{}.max_string_bytes;
  if (n > limit) {
    Fail("string of " + std::to_string(n) + " bytes exceeds the limit of " + Mib(limit));
  }
}

void CheckListSize(size_t n) {
  const size_t limit = t_budget ? t_budget->limits().max_list_items : RenderLimits{}.max_list_items;
  if (n > limit) {
    Fail("list of " + std::to_string(n) + " items exceeds the limit of " + std::to_string(limit));
  }
}

ValueDepthGuard::ValueDepthGuard() {
  if (++t_value_depth > kMaxValueDepth) {
    --t_value_depth;
    Fail("value nested deeper than " + std::to_string(kMaxValueDepth) +
         " levels (or containing itself)");
  }
}

ValueDepthGuard::~ValueDepthGuard() { --t_value_depth; }

namespace {

void Bury(std::vector<Value>& items) noexcept {
  if (items.empty()) return;
  Graveyard& g = t_grave;
  try {
    g.pending.reserve(g.pending.size() + items.size());
  } catch (...) {
    items.clear();  // out of memory: free them recursively after all
    return;
  }
  for (auto& v : items) g.pending.push_back(std::move(v));
  items.clear();
  if (g.draining) return;
  g.draining = true;
  while (!g.pending.empty()) {
    // Destroyed at the end of this iteration; a container it held last buries its own items.
    Value v = std::move(g.pending.back());
    g.pending.pop_back();
  }
  g.draining = false;
}

}  // namespace

void List::Append(Value v) {
  CheckListSize(items.size() + 1);
  if (t_budget) {
    t_budget->ChargeBytes(sizeof(Value));
    if (t_budget->id() == budget_id) charged += sizeof(Value);
  }
  items.push_back(std::move(v));
}

List::~List() {
  Refund(budget_id, charged);
  if (items.empty()) return;
  std::vector<Value> keep;
  try {
    for (auto& v : items) {
      if (v.holds_container()) keep.push_back(std::move(v));
    }
  } catch (...) {
  }
  items.clear();
  Bury(keep);
}

Dict::~Dict() {
  Refund(budget_id, charged);
  if (items.empty()) return;
  std::vector<Value> keep;
  try {
    for (auto& kv : items) {
      if (kv.second.holds_container()) keep.push_back(std::move(kv.second));
    }
  } catch (...) {
  }
  items.clear();
  Bury(keep);
}

const std::string& Value::EmptyString() {
  static const std::string empty;
  return empty;
}

Value Value::String(std::string s) {
  CheckStringSize(s.size());
  Value v = FromKind(Kind::kString);
  const size_t bytes = s.capacity() + 64;
  if (t_budget) {
    // Charged while it lives, so a render's memory is bounded whatever it keeps or drops.
    t_budget->ChargeBytes(bytes);
    const uint64_t id = t_budget->id();
    v.str_ = std::shared_ptr<const std::string>(new std::string(std::move(s)),
                                                [id, bytes](const std::string* p) {
                                                  Refund(id, bytes);
                                                  delete p;
                                                });
  } else {
    v.str_ = std::make_shared<const std::string>(std::move(s));
  }
  return v;
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
    const size_t bytes = sizeof(std::pair<std::string, Value>) + key.size();
    if (t_budget) {
      t_budget->ChargeBytes(bytes);
      if (t_budget->id() == budget_id) charged += bytes;
    }
    items.emplace_back(key, std::move(value));
  }
}

Value Value::MakeList(std::vector<Value> items, bool is_tuple) {
  CheckListSize(items.size());
  Value v = FromKind(Kind::kList);
  v.list_ = std::make_shared<List>();
  v.list_->items = std::move(items);
  v.list_->is_tuple = is_tuple;
  if (t_budget) t_budget->Track(v.list_);
  return v;
}

Value Value::MakeDict() {
  Value v = FromKind(Kind::kDict);
  v.dict_ = std::make_shared<Dict>();
  if (t_budget) t_budget->Track(v.dict_);
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
  ValueDepthGuard depth;
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
      return !str().empty();
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
  ChargeSteps(static_cast<int64_t>(s.size() / 16));
  CheckTransient(CodePointCount(s) * (sizeof(std::string) + 8));
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

bool IsAscii(const std::string& s) {
  for (unsigned char c : s) {
    if (c >= 0x80) return false;
  }
  return true;
}

std::vector<size_t> CodePointOffsets(const std::string& s) {
  CheckTransient((CodePointCount(s) + 1) * sizeof(size_t));
  std::vector<size_t> offs;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    offs.push_back(i);
    i += DecodeUtf8(s, i, &cp);
  }
  offs.push_back(s.size());
  return offs;
}

bool CodePointAt(const std::string& s, int64_t index, std::string* out) {
  if (IsAscii(s)) {
    const int64_t n = static_cast<int64_t>(s.size());
    if (index < 0) index = index < -n ? -1 : index + n;
    if (index < 0 || index >= n) return false;
    *out = std::string(1, s[static_cast<size_t>(index)]);
    return true;
  }
  int64_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) {
    uint32_t cp;
    i += DecodeUtf8(s, i, &cp);
  }
  if (index < 0) index = index < -n ? -1 : index + n;
  if (index < 0 || index >= n) return false;
  int64_t k = 0;
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const size_t len = DecodeUtf8(s, i, &cp);
    if (k++ == index) {
      *out = s.substr(i, len);
      return true;
    }
    i += len;
  }
  return false;
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
      return str();
    default:
      return Repr();
  }
}

std::string Value::Repr() const {
  ValueDepthGuard depth;
  ChargeSteps(1);
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
      return PyStrRepr(str());
    case Kind::kList: {
      std::string out = list_->is_tuple ? "(" : "[";
      for (size_t i = 0; i < list_->items.size(); ++i) {
        if (i) out += ", ";
        out += list_->items[i].Repr();
        CheckStringSize(out.size());
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
        CheckStringSize(out.size());
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
  ChargeSteps(1);
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
      return str_ == o.str_ || str() == o.str();
    case Kind::kList: {
      if (list_ == o.list_) return true;
      ValueDepthGuard depth;
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
      ValueDepthGuard depth;
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
  ValueDepthGuard depth;
  ChargeSteps(1);
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
      return str();
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
  ValueDepthGuard depth;
  ChargeSteps(1);
  CheckStringSize(out.size());
  auto newline = [&](int lvl) {
    CheckStringSize(out.size() + 1 + static_cast<size_t>(lvl) * o.indent.size());
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
