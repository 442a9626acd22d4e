#include "template/jinja_builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <initializer_list>
#include <limits>
#include <unordered_map>

#include "template/jinja_eval.h"

#include "base/utf8.h"

namespace dl::jinja {

// ---------------------------------------------------------------- helpers

namespace {

// Simple (one-to-one) case mapping for ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic: the
// scripts chat messages commonly use. Returns cp unchanged when it has no mapping. Python's full
// Unicode tables (and its special cases such as final sigma) are not reproduced.
uint32_t MapCase(uint32_t cp, bool upper) {
  if (cp < 0x80) {
    if (upper && cp >= 'a' && cp <= 'z') return cp - 32;
    if (!upper && cp >= 'A' && cp <= 'Z') return cp + 32;
    return cp;
  }
  if (upper) {
    if (cp >= 0xE0 && cp <= 0xFE && cp != 0xF7) return cp - 32;
    if (cp == 0xFF) return 0x178;
    if (cp == 0xB5) return 0x39C;
    if ((cp >= 0x100 && cp <= 0x137) || (cp >= 0x14A && cp <= 0x177)) return cp & 1 ? cp - 1 : cp;
    if ((cp >= 0x139 && cp <= 0x148) || (cp >= 0x179 && cp <= 0x17E)) return cp & 1 ? cp : cp - 1;
    if (cp == 0x17F) return 'S';
    if (cp >= 0x3B1 && cp <= 0x3C9) return cp == 0x3C2 ? 0x3A3 : cp - 32;
    if (cp == 0x3AC) return 0x386;
    if (cp >= 0x3AD && cp <= 0x3AF) return cp - 37;
    if (cp == 0x3CC) return 0x38C;
    if (cp == 0x3CD || cp == 0x3CE) return cp - 63;
    if (cp >= 0x430 && cp <= 0x44F) return cp - 32;
    if (cp >= 0x450 && cp <= 0x45F) return cp - 80;
    return cp;
  }
  if (cp >= 0xC0 && cp <= 0xDE && cp != 0xD7) return cp + 32;
  if (cp == 0x178) return 0xFF;
  if ((cp >= 0x100 && cp <= 0x137) || (cp >= 0x14A && cp <= 0x177)) return cp & 1 ? cp : cp + 1;
  if ((cp >= 0x139 && cp <= 0x148) || (cp >= 0x179 && cp <= 0x17E)) return cp & 1 ? cp + 1 : cp;
  if (cp >= 0x391 && cp <= 0x3A9 && cp != 0x3A2) return cp + 32;
  if (cp == 0x386) return 0x3AC;
  if (cp >= 0x388 && cp <= 0x38A) return cp + 37;
  if (cp == 0x38C) return 0x3CC;
  if (cp == 0x38E || cp == 0x38F) return cp + 63;
  if (cp >= 0x410 && cp <= 0x42F) return cp + 32;
  if (cp >= 0x400 && cp <= 0x40F) return cp + 80;
  return cp;
}

uint32_t DecodeCp(const std::string& s, size_t i, size_t* len) {
  unsigned char c = s[i];
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) n = 1;
  uint32_t v = n == 1 ? c : c & (0xFF >> (n + 1));
  for (size_t k = 1; k < n; ++k) {
    unsigned char cc = s[i + k];
    if ((cc & 0xC0) != 0x80) {
      *len = 1;
      return c;
    }
    v = (v << 6) | (cc & 0x3F);
  }
  *len = n;
  return v;
}



bool IsCased(uint32_t cp) {
  return MapCase(cp, true) != cp || MapCase(cp, false) != cp;
}

// Applies `mode(index_of_code_point, previous_was_cased, cp) -> upper?` to every cased code point
// (true = upper, false = lower). ß uppercases to "SS" as in Python.
template <typename F>
std::string CaseTransform(const std::string& s, F upper_for) {
  std::string out;
  out.reserve(s.size());
  bool prev_cased = false;
  size_t index = 0;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = DecodeCp(s, i, &len);
    bool cased = IsCased(cp) || cp == 0xDF;
    if (cased) {
      bool up = upper_for(index, prev_cased, cp);
      if (up && cp == 0xDF) {
        out += "SS";
      } else {
        AppendUtf8(out, MapCase(cp, up));
      }
    } else {
      out.append(s, i, len);
    }
    prev_cased = cased;
    i += len;
    ++index;
  }
  return out;
}

std::string ToUpper(const std::string& s) {
  return CaseTransform(s, [](size_t, bool, uint32_t) { return true; });
}

}  // namespace

std::string ToLower(const std::string& s) {
  return CaseTransform(s, [](size_t, bool, uint32_t) { return false; });
}

namespace {

bool IsAsciiSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == '\x1c' ||
         c == '\x1d' || c == '\x1e' || c == '\x1f';
}
bool IsUpper(char c) {
  return c >= 'A' && c <= 'Z';
}
bool IsLowerC(char c) {
  return c >= 'a' && c <= 'z';
}
bool IsAlpha(char c) {
  return IsUpper(c) || IsLowerC(c);
}
bool IsDigitC(char c) {
  return c >= '0' && c <= '9';
}

std::string Strip(const std::string& s, const Value& chars, bool left, bool right) {
  auto is_strip = [&](char c) {
    if (chars.is_none() || chars.is_undefined()) return IsAsciiSpace(c);
    return chars.str().find(c) != std::string::npos;
  };
  if (!chars.is_none() && !chars.is_undefined() && !chars.is_string()) {
    Fail("strip arg must be None or str");
  }
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && is_strip(s[b])) ++b;
  }
  if (right) {
    while (e > b && is_strip(s[e - 1])) --e;
  }
  return s.substr(b, e - b);
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  ChargeSteps(static_cast<int64_t>(s.size() / 16));
  std::string out;
  if (from.empty()) {
    // Python inserts `to` between every character (and at both ends).
    auto cps = SplitCodePoints(s);
    int64_t done = 0;
    const size_t inserts = count < 0 ? cps.size() + 1
                                     : std::min<size_t>(cps.size() + 1, static_cast<size_t>(count));
    if (!to.empty() && inserts > (size_t{1} << 40) / to.size()) Fail("replace() result too large");
    CheckStringSize(s.size() + inserts * to.size());
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      if (i < cps.size()) out += cps[i];
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(from, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += to;
    CheckStringSize(out.size());
    pos = f + from.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<std::string> SplitLines(const std::string& s) {
  std::vector<std::string> lines;
  std::string cur;
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    size_t brk = 0;
    if (c == '\r' && i + 1 < s.size() && s[i + 1] == '\n') {
      brk = 2;
    } else if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1c || c == 0x1d ||
               c == 0x1e) {
      brk = 1;
    } else if (c == 0xC2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) == 0x85) {
      brk = 2;
    } else if (c == 0xE2 && i + 2 < s.size() && static_cast<unsigned char>(s[i + 1]) == 0x80 &&
               (static_cast<unsigned char>(s[i + 2]) == 0xA8 ||
                static_cast<unsigned char>(s[i + 2]) == 0xA9)) {
      brk = 3;
    }
    if (brk) {
      lines.push_back(cur);
      cur.clear();
      i += brk;
    } else {
      cur += s[i++];
    }
  }
  if (!cur.empty()) lines.push_back(cur);
  return lines;
}

// Python str.title(): upper after an uncased character, lower after a cased one.
std::string PyTitle(const std::string& s) {
  return CaseTransform(s, [](size_t, bool prev_cased, uint32_t) { return !prev_cased; });
}

// Python str.capitalize().
std::string PyCapitalize(const std::string& s) {
  return CaseTransform(s, [](size_t index, bool, uint32_t) { return index == 0; });
}

// jinja2's title filter: words start after whitespace, '-', '(', '{', '[', '<'.
std::string JinjaTitle(const std::string& s) {
  std::string out;
  bool start = true;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    DecodeCp(s, i, &len);
    std::string ch = s.substr(i, len);
    char c = s[i];
    if (len == 1 && (IsAsciiSpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<')) {
      out += ch;
      start = true;
    } else {
      out += start ? ToUpper(ch) : ToLower(ch);
      start = false;
    }
    i += len;
  }
  return out;
}

// Binds positional and keyword arguments of a builtin to its parameter names.
class ArgList {
 public:
  ArgList(CallArgs& args, const std::string& fname, std::initializer_list<const char*> names)
      : args_(args), names_(names) {
    if (args.positional.size() > names_.size()) {
      Fail(fname + "() takes at most " + std::to_string(names_.size()) + " argument(s), got " +
           std::to_string(args.positional.size()));
    }
    for (const auto& [k, v] : args.keyword) {
      if (std::find(names_.begin(), names_.end(), k) == names_.end()) {
        Fail(fname + "() got an unexpected keyword argument '" + k + "'");
      }
    }
  }
  bool Has(size_t i) const {
    if (i < args_.positional.size()) return true;
    for (const auto& kv : args_.keyword) {
      if (kv.first == names_[i]) return true;
    }
    return false;
  }
  Value Get(size_t i, Value def = Value::None()) const {
    if (i < args_.positional.size()) return args_.positional[i];
    for (const auto& kv : args_.keyword) {
      if (kv.first == names_[i]) return kv.second;
    }
    return def;
  }
  int64_t GetInt(size_t i, int64_t def) const {
    Value v = Get(i, Value::Int(def));
    if (v.is_int() || v.is_bool()) return v.as_int();
    if (v.is_float() && std::isfinite(v.as_double()) && std::fabs(v.as_double()) < 9.2e18) {
      return static_cast<int64_t>(v.as_double());
    }
    Fail(std::string("argument '") + names_[i] + "' must be an integer");
  }
  std::string GetStr(size_t i, const std::string& def) const {
    Value v = Get(i, Value::String(def));
    return v.ToStr();
  }

 private:
  CallArgs& args_;
  std::vector<const char*> names_;
};

Value Tuple2(Value a, Value b) {
  return Value::MakeList({std::move(a), std::move(b)}, true);
}

// jinja2's make_attrgetter: "a.b.0" walks items/attributes.
Value GetPath(const Value& item, const std::string& path) {
  Value cur = item;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && part.size() <= 18 && std::all_of(part.begin(), part.end(), IsDigitC);
    cur = GetItem(cur, numeric ? Value::Int(std::stoll(part)) : Value::String(part));
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

Value SortKey(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::String(ToLower(v.str()));
  return v;
}

bool ParseInt(const std::string& text, int base, int64_t* out) {
  std::string s = Strip(text, Value::None(), true, true);
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_' && i > 0 && i + 1 < s.size()) continue;
    clean += s[i];
  }
  if (clean.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(clean.c_str(), &end, base);
  if (errno || *end != '\0') return false;
  *out = v;
  return true;
}

bool ParseFloat(const std::string& text, double* out) {
  std::string s = Strip(text, Value::None(), true, true);
  if (s.empty()) return false;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (*end != '\0') return false;
  *out = v;
  return true;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// Python's "%s" % args (s, r, d, i, f and %% only).
std::string PercentFormat(const std::string& fmt, const std::vector<Value>& args) {
  std::string out;
  size_t ai = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    CheckStringSize(out.size());
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) Fail("incomplete format");
    char c = fmt[i];
    if (c == '%') {
      out += '%';
      continue;
    }
    if (ai >= args.size()) Fail("not enough arguments for format string");
    const Value& a = args[ai++];
    if (c == 's') {
      out += a.ToStr();
    } else if (c == 'r') {
      out += a.Repr();
    } else if (c == 'd' || c == 'i') {
      if (!a.is_number()) Fail("%d format: a real number is required, not " + a.TypeName());
      if (a.is_float()) {
        const double d = std::trunc(a.as_double());
        if (!std::isfinite(d)) Fail("%d format: cannot convert " + PyFloatRepr(d) + " to integer");
        char b[64];
        std::snprintf(b, sizeof b, "%.0f", d);
        out += b;
      } else {
        out += std::to_string(a.as_int());
      }
    } else if (c == 'f') {
      char b[64];
      std::snprintf(b, sizeof(b), "%f", a.as_double());
      out += b;
    } else {
      Fail(std::string("unsupported format character '") + c + "'");
    }
  }
  if (ai < args.size()) Fail("not all arguments converted during string formatting");
  return out;
}

// Python's str.format with {} / {0} / {name} fields (no format specs).
std::string BraceFormat(const std::string& fmt, CallArgs& args) {
  std::string out;
  size_t auto_idx = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '{' && i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (c == '}' && i + 1 < fmt.size() && fmt[i + 1] == '}') {
      out += '}';
      ++i;
    } else if (c == '{') {
      size_t close = fmt.find('}', i);
      if (close == std::string::npos) Fail("Single '{' encountered in format string");
      std::string field = fmt.substr(i + 1, close - i - 1);
      if (field.find_first_of(":!") != std::string::npos) Fail("format specs are not supported");
      const Value* v = nullptr;
      if (field.empty()) {
        if (auto_idx >= args.positional.size()) Fail("Replacement index out of range");
        v = &args.positional[auto_idx++];
      } else if (std::all_of(field.begin(), field.end(), IsDigitC)) {
        if (field.size() > 9) Fail("Replacement index out of range");
        size_t k = std::stoul(field);
        if (k >= args.positional.size()) Fail("Replacement index out of range");
        v = &args.positional[k];
      } else {
        for (auto& [name, val] : args.keyword) {
          if (name == field) v = &val;
        }
        if (!v) Fail("KeyError: '" + field + "'");
      }
      out += v->ToStr();
      CheckStringSize(out.size());
      i = close;
    } else if (c == '}') {
      Fail("Single '}' encountered in format string");
    } else {
      out += c;
    }
  }
  return out;
}

std::vector<Value> PySplit(const std::string& s, const Value& sep, int64_t maxsplit) {
  ChargeSteps(static_cast<int64_t>(s.size() / 16));
  std::vector<Value> parts;
  if (sep.is_none() || sep.is_undefined()) {
    size_t i = 0;
    int64_t splits = 0;
    while (true) {
      while (i < s.size() && IsAsciiSpace(s[i])) ++i;
      if (i >= s.size()) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        size_t e = s.size();
        while (e > i && IsAsciiSpace(s[e - 1])) --e;
        parts.push_back(Value::String(s.substr(i, e - i)));
        break;
      }
      size_t j = i;
      while (j < s.size() && !IsAsciiSpace(s[j])) ++j;
      parts.push_back(Value::String(s.substr(i, j - i)));
      ++splits;
      i = j;
    }
    return parts;
  }
  if (!sep.is_string()) Fail("must be str or None, not " + sep.TypeName());
  const std::string& d = sep.str();
  if (d.empty()) Fail("empty separator");
  size_t pos = 0;
  int64_t splits = 0;
  while (maxsplit < 0 || splits < maxsplit) {
    size_t f = s.find(d, pos);
    if (f == std::string::npos) break;
    parts.push_back(Value::String(s.substr(pos, f - pos)));
    pos = f + d.size();
    ++splits;
  }
  parts.push_back(Value::String(s.substr(pos)));
  return parts;
}

// ---------------------------------------------------------------- tests

using TestFn = bool (*)(const Value& v, CallArgs& args, Evaluator& ev);

const Value& Arg0(CallArgs& args, const char* test) {
  if (args.positional.empty()) Fail(std::string("test '") + test + "' needs an argument");
  return args.positional[0];
}

const std::unordered_map<std::string, TestFn>& Tests() {
  static const std::unordered_map<std::string, TestFn> tests = {
      {"defined", [](const Value& v, CallArgs&, Evaluator&) { return !v.is_undefined(); }},
      {"undefined", [](const Value& v, CallArgs&, Evaluator&) { return v.is_undefined(); }},
      {"none", [](const Value& v, CallArgs&, Evaluator&) { return v.is_none(); }},
      {"boolean", [](const Value& v, CallArgs&, Evaluator&) { return v.is_bool(); }},
      {"true", [](const Value& v, CallArgs&, Evaluator&) { return v.is_bool() && v.as_bool(); }},
      {"false", [](const Value& v, CallArgs&, Evaluator&) { return v.is_bool() && !v.as_bool(); }},
      {"integer", [](const Value& v, CallArgs&, Evaluator&) { return v.is_int(); }},
      {"float", [](const Value& v, CallArgs&, Evaluator&) { return v.is_float(); }},
      {"number", [](const Value& v, CallArgs&, Evaluator&) { return v.is_number(); }},
      {"string", [](const Value& v, CallArgs&, Evaluator&) { return v.is_string(); }},
      {"mapping",
       [](const Value& v, CallArgs&, Evaluator&) { return v.is_dict() && !v.is_namespace(); }},
      {"iterable",
       [](const Value& v, CallArgs&, Evaluator&) {
         return v.is_undefined() || v.is_string() || v.is_list() ||
                (v.is_dict() && !v.is_namespace());
       }},
      {"sequence",
       [](const Value& v, CallArgs&, Evaluator&) {
         return v.is_undefined() || v.is_string() || v.is_list() ||
                (v.is_dict() && !v.is_namespace());
       }},
      {"callable", [](const Value& v, CallArgs&, Evaluator&) { return v.is_callable(); }},
      {"even",
       [](const Value& v, CallArgs&, Evaluator&) {
         if (!v.is_int() && !v.is_bool()) Fail("'even' test needs an integer");
         return v.as_int() % 2 == 0;
       }},
      {"odd",
       [](const Value& v, CallArgs&, Evaluator&) {
         if (!v.is_int() && !v.is_bool()) Fail("'odd' test needs an integer");
         return v.as_int() % 2 != 0;
       }},
      {"divisibleby",
       [](const Value& v, CallArgs& a, Evaluator&) {
         const Value& n = Arg0(a, "divisibleby");
         if (!(v.is_int() || v.is_bool()) || !(n.is_int() || n.is_bool())) {
           Fail("'divisibleby' test needs integers");
         }
         if (n.as_int() == 0) Fail("integer division or modulo by zero");
         if (n.as_int() == -1) return true;  // INT64_MIN % -1 traps
         return v.as_int() % n.as_int() == 0;
       }},
      {"equalto", [](const Value& v, CallArgs& a, Evaluator&) { return v.Equals(Arg0(a, "eq")); }},
      {"eq", [](const Value& v, CallArgs& a, Evaluator&) { return v.Equals(Arg0(a, "eq")); }},
      {"sameas",
       [](const Value& v, CallArgs& a, Evaluator&) {
         const Value& o = Arg0(a, "sameas");
         return v.kind() == o.kind() && v.Equals(o);
       }},
      {"ne", [](const Value& v, CallArgs& a, Evaluator&) { return !v.Equals(Arg0(a, "ne")); }},
      {"lt", [](const Value& v, CallArgs& a, Evaluator&) { return LessThan(v, Arg0(a, "lt")); }},
      {"lessthan",
       [](const Value& v, CallArgs& a, Evaluator&) { return LessThan(v, Arg0(a, "lt")); }},
      {"le", [](const Value& v, CallArgs& a, Evaluator&) { return !LessThan(Arg0(a, "le"), v); }},
      {"gt", [](const Value& v, CallArgs& a, Evaluator&) { return LessThan(Arg0(a, "gt"), v); }},
      {"greaterthan",
       [](const Value& v, CallArgs& a, Evaluator&) { return LessThan(Arg0(a, "gt"), v); }},
      {"ge", [](const Value& v, CallArgs& a, Evaluator&) { return !LessThan(v, Arg0(a, "ge")); }},
      {"in",
       [](const Value& v, CallArgs& a, Evaluator&) {
         const Value& seq = Arg0(a, "in");
         if (seq.is_string()) return v.is_string() && seq.str().find(v.str()) != std::string::npos;
         if (seq.is_dict()) return v.is_string() && seq.dict().Find(v.str()) != nullptr;
         for (const auto& x : Iterate(seq)) {
           if (x.Equals(v)) return true;
         }
         return false;
       }},
      {"lower",
       [](const Value& v, CallArgs&, Evaluator&) {
         return v.is_string() && ToLower(v.str()) == v.str() && ToUpper(v.str()) != v.str();
       }},
      {"upper",
       [](const Value& v, CallArgs&, Evaluator&) {
         return v.is_string() && ToUpper(v.str()) == v.str() && ToLower(v.str()) != v.str();
       }},
  };
  return tests;
}

// ---------------------------------------------------------------- filters

using FilterFn = Value (*)(Value in, CallArgs& args, Evaluator& ev);

Value SelectOrReject(Value in, CallArgs& args, Evaluator& ev, bool by_attr, bool select) {
  // select(test, args...), selectattr(attr, test, args...)
  size_t next = 0;
  std::string attr;
  if (by_attr) {
    if (args.positional.empty()) Fail("selectattr/rejectattr need an attribute name");
    attr = args.positional[next++].ToStr();
  }
  std::string test;
  CallArgs test_args;
  if (next < args.positional.size()) {
    test = args.positional[next++].ToStr();
    if (!IsKnownTest(test)) Fail("no test named '" + test + "'");
    test_args.positional.assign(args.positional.begin() + next, args.positional.end());
  }
  std::vector<Value> out;
  for (auto& item : Iterate(in)) {
    Value v = by_attr ? GetPath(item, attr) : item;
    bool ok = test.empty() ? v.Truthy() : ApplyTest(test, v, test_args, ev);
    if (ok == select) out.push_back(item);
  }
  return Value::MakeList(std::move(out));
}

Value MinMax(Value in, CallArgs& args, bool want_max, const char* name) {
  ArgList a(args, name, {"case_sensitive", "attribute"});
  bool cs = a.Get(0, Value::Bool(false)).Truthy();
  Value attr = a.Get(1);
  auto items = Iterate(in);
  if (items.empty())
    return Value::Undefined(std::string("No aggregated item, sequence was empty."));
  auto key = [&](const Value& v) {
    return SortKey(attr.is_none() ? v : GetPath(v, attr.ToStr()), cs);
  };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    bool better = want_max ? LessThan(key(items[best]), key(items[i]))
                           : LessThan(key(items[i]), key(items[best]));
    if (better) best = i;
  }
  return items[best];
}

const std::unordered_map<std::string, FilterFn>& Filters() {
  static const std::unordered_map<std::string, FilterFn> filters = {
      {"trim",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "trim", {"chars"});
         return Value::String(Strip(in.ToStr(), a.Get(0), true, true));
       }},
      {"upper", [](Value in, CallArgs&, Evaluator&) { return Value::String(ToUpper(in.ToStr())); }},
      {"lower", [](Value in, CallArgs&, Evaluator&) { return Value::String(ToLower(in.ToStr())); }},
      {"capitalize",
       [](Value in, CallArgs&, Evaluator&) { return Value::String(PyCapitalize(in.ToStr())); }},
      {"title",
       [](Value in, CallArgs&, Evaluator&) { return Value::String(JinjaTitle(in.ToStr())); }},
      {"length",
       [](Value in, CallArgs&, Evaluator&) -> Value {
         if (in.is_undefined()) return Value::Int(0);
         if (in.is_string()) return Value::Int(static_cast<int64_t>(CodePointCount(in.str())));
         if (in.is_list()) return Value::Int(static_cast<int64_t>(in.list().items.size()));
         if (in.is_dict()) return Value::Int(static_cast<int64_t>(in.dict().items.size()));
         Fail("object of type '" + in.TypeName() + "' has no len()");
       }},
      {"first",
       [](Value in, CallArgs&, Evaluator&) {
         auto items = Iterate(in);
         return items.empty() ? Value::Undefined("No first item, sequence was empty.") : items[0];
       }},
      {"last",
       [](Value in, CallArgs&, Evaluator&) {
         auto items = Iterate(in);
         return items.empty() ? Value::Undefined("No last item, sequence was empty.")
                              : items.back();
       }},
      {"join",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "join", {"d", "attribute"});
         std::string sep = a.GetStr(0, "");
         Value attr = a.Get(1);
         std::string out;
         bool first = true;
         for (auto& item : Iterate(in)) {
           if (!first) out += sep;
           first = false;
           out += (attr.is_none() ? item : GetPath(item, attr.ToStr())).ToStr();
           CheckStringSize(out.size());
         }
         return Value::String(std::move(out));
       }},
      {"default",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "default", {"default_value", "boolean"});
         bool boolean = a.Get(1, Value::Bool(false)).Truthy();
         if (in.is_undefined() || (boolean && !in.Truthy())) {
           return a.Get(0, Value::String(""));
         }
         return in;
       }},
      {"replace",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "replace", {"old", "new", "count"});
         int64_t count = a.Has(2) && !a.Get(2).is_none() ? a.GetInt(2, -1) : -1;
         return Value::String(Replace(in.ToStr(), a.GetStr(0, ""), a.GetStr(1, ""), count));
       }},
      {"tojson",
       [](Value in, CallArgs& args, Evaluator&) {
         // HF: json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
         // sort_keys=sort_keys); Python's default separators depend on indent.
         ArgList a(args, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
         JsonDumpOptions o;
         o.ensure_ascii = a.Get(0, Value::Bool(false)).Truthy();
         Value indent = a.Get(1);
         if (indent.is_int() || indent.is_bool()) {
           o.has_indent = true;
           CheckStringSize(static_cast<size_t>(std::max<int64_t>(0, indent.as_int())));
           o.indent = std::string(std::max<int64_t>(0, indent.as_int()), ' ');
         } else if (indent.is_string()) {
           o.has_indent = true;
           o.indent = indent.str();
         } else if (!indent.is_none()) {
           Fail("tojson: indent must be an integer or a string");
         }
         o.item_separator = o.has_indent ? "," : ", ";
         Value seps = a.Get(2);
         if (!seps.is_none()) {
           if (!seps.is_list() || seps.list().items.size() != 2) {
             Fail("tojson: separators must be a (item_separator, key_separator) pair");
           }
           o.item_separator = seps.list().items[0].ToStr();
           o.key_separator = seps.list().items[1].ToStr();
         }
         o.sort_keys = a.Get(3, Value::Bool(false)).Truthy();
         return Value::String(JsonDumps(in, o));
       }},
      {"string", [](Value in, CallArgs&, Evaluator&) { return Value::String(in.ToStr()); }},
      {"int",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "int", {"default", "base"});
         Value def = a.Get(0, Value::Int(0));
         if (in.is_int()) return in;
         if (in.is_bool()) return Value::Int(in.as_int());
         if (in.is_float()) {
           // Python's int() has no range; ours is int64: out of range falls back to the default.
           if (!std::isfinite(in.as_double()) || std::fabs(in.as_double()) >= 9.2e18) return def;
           return Value::Int(static_cast<int64_t>(in.as_double()));
         }
         if (in.is_string()) {
           int64_t v;
           if (ParseInt(in.str(), static_cast<int>(a.GetInt(1, 10)), &v)) return Value::Int(v);
           double d;
           if (ParseFloat(in.str(), &d) && std::isfinite(d) && std::fabs(d) < 9.2e18) {
             return Value::Int(static_cast<int64_t>(d));
           }
         }
         return def;
       }},
      {"float",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "float", {"default"});
         if (in.is_number()) return Value::Float(in.as_double());
         double d;
         if (in.is_string() && ParseFloat(in.str(), &d)) return Value::Float(d);
         return a.Get(0, Value::Float(0.0));
       }},
      {"list", [](Value in, CallArgs&, Evaluator&) { return Value::MakeList(Iterate(in)); }},
      {"items",
       [](Value in, CallArgs&, Evaluator&) {
         if (in.is_undefined()) return Value::MakeList();
         if (!in.is_dict()) Fail("Can only get item pairs from a mapping.");
         std::vector<Value> out;
         for (auto& [k, v] : in.dict().items) out.push_back(Tuple2(Value::String(k), v));
         return Value::MakeList(std::move(out));
       }},
      {"dictsort",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "dictsort", {"case_sensitive", "by", "reverse"});
         bool cs = a.Get(0, Value::Bool(false)).Truthy();
         std::string by = a.GetStr(1, "key");
         bool rev = a.Get(2, Value::Bool(false)).Truthy();
         if (!in.is_dict()) Fail("dictsort: value is not a mapping");
         int pos = by == "key" ? 0 : by == "value" ? 1 : -1;
         if (pos < 0) Fail("You can only sort by either \"key\" or \"value\"");
         std::vector<Value> out;
         for (auto& [k, v] : in.dict().items) out.push_back(Tuple2(Value::String(k), v));
         std::stable_sort(out.begin(), out.end(), [&](const Value& x, const Value& y) {
           const Value kx = SortKey(x.list().items[pos], cs), ky = SortKey(y.list().items[pos], cs);
           return rev ? LessThan(ky, kx) : LessThan(kx, ky);
         });
         return Value::MakeList(std::move(out));
       }},
      {"selectattr",
       [](Value in, CallArgs& args, Evaluator& ev) {
         return SelectOrReject(std::move(in), args, ev, true, true);
       }},
      {"rejectattr",
       [](Value in, CallArgs& args, Evaluator& ev) {
         return SelectOrReject(std::move(in), args, ev, true, false);
       }},
      {"select",
       [](Value in, CallArgs& args, Evaluator& ev) {
         return SelectOrReject(std::move(in), args, ev, false, true);
       }},
      {"reject",
       [](Value in, CallArgs& args, Evaluator& ev) {
         return SelectOrReject(std::move(in), args, ev, false, false);
       }},
      {"map",
       [](Value in, CallArgs& args, Evaluator& ev) {
         std::vector<Value> out;
         const Value* attr = nullptr;
         const Value* def = nullptr;
         for (auto& [k, v] : args.keyword) {
           if (k == "attribute") attr = &v;
           if (k == "default") def = &v;
         }
         if (attr) {
           for (auto& item : Iterate(in)) {
             Value v = GetPath(item, attr->ToStr());
             out.push_back(v.is_undefined() && def ? *def : v);
           }
           return Value::MakeList(std::move(out));
         }
         if (args.positional.empty()) Fail("map: needs a filter name or attribute=");
         std::string filter = args.positional[0].ToStr();
         if (!IsKnownFilter(filter)) Fail("no filter named '" + filter + "'");
         CallArgs rest;
         rest.positional.assign(args.positional.begin() + 1, args.positional.end());
         rest.keyword = args.keyword;
         for (auto& item : Iterate(in)) {
           CallArgs copy = rest;
           out.push_back(ApplyFilter(filter, item, copy, ev));
         }
         return Value::MakeList(std::move(out));
       }},
      {"unique",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "unique", {"case_sensitive", "attribute"});
         bool cs = a.Get(0, Value::Bool(false)).Truthy();
         Value attr = a.Get(1);
         std::vector<Value> out, seen;
         for (auto& item : Iterate(in)) {
           Value key = SortKey(attr.is_none() ? item : GetPath(item, attr.ToStr()), cs);
           bool dup = false;
           ChargeSteps(static_cast<int64_t>(seen.size()));
           for (auto& s : seen) {
             if (s.Equals(key)) {
               dup = true;
               break;
             }
           }
           if (!dup) {
             seen.push_back(key);
             out.push_back(item);
           }
         }
         return Value::MakeList(std::move(out));
       }},
      {"reverse",
       [](Value in, CallArgs&, Evaluator&) {
         if (in.is_string()) {
           auto cps = SplitCodePoints(in.str());
           std::string r;
           for (auto it = cps.rbegin(); it != cps.rend(); ++it) r += *it;
           return Value::String(r);
         }
         auto items = Iterate(in);
         std::reverse(items.begin(), items.end());
         return Value::MakeList(std::move(items));
       }},
      {"sort",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "sort", {"reverse", "case_sensitive", "attribute"});
         bool rev = a.Get(0, Value::Bool(false)).Truthy();
         bool cs = a.Get(1, Value::Bool(false)).Truthy();
         Value attr = a.Get(2);
         auto items = Iterate(in);
         auto key = [&](const Value& v) {
           return SortKey(attr.is_none() ? v : GetPath(v, attr.ToStr()), cs);
         };
         ChargeSteps(static_cast<int64_t>(items.size()) *
                     (1 + static_cast<int64_t>(std::log2(items.size() + 1.0))));
         std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
           return rev ? LessThan(key(y), key(x)) : LessThan(key(x), key(y));
         });
         return Value::MakeList(std::move(items));
       }},
      {"abs",
       [](Value in, CallArgs&, Evaluator&) -> Value {
         if (in.is_float()) return Value::Float(std::fabs(in.as_double()));
         if (in.is_int() || in.is_bool()) {
           if (in.as_int() == std::numeric_limits<int64_t>::min()) Fail("integer overflow");
           return Value::Int(std::llabs(in.as_int()));
         }
         Fail("bad operand type for abs(): " + in.TypeName());
       }},
      {"round",
       [](Value in, CallArgs& args, Evaluator&) -> Value {
         ArgList a(args, "round", {"precision", "method"});
         int64_t prec = a.GetInt(0, 0);
         std::string method = a.GetStr(1, "common");
         if (!in.is_number()) Fail("round: value must be a number");
         if (method == "common" && !in.is_float()) return Value::Int(in.as_int());
         double scale = std::pow(10.0, static_cast<double>(prec));
         double x = in.as_double() * scale;
         double r;
         if (method == "common") {
           r = std::nearbyint(x);  // Python's round(): ties to even
         } else if (method == "ceil") {
           r = std::ceil(x);
         } else if (method == "floor") {
           r = std::floor(x);
         } else {
           Fail("method must be 'common', 'ceil' or 'floor'");
         }
         return Value::Float(r / scale);
       }},
      {"indent",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "indent", {"width", "first", "blank"});
         Value width = a.Get(0, Value::Int(4));
         const int64_t w = width.is_string() ? 0 : std::max<int64_t>(0, a.GetInt(0, 4));
         CheckStringSize(static_cast<size_t>(w));
         std::string ind = width.is_string() ? width.str() : std::string(static_cast<size_t>(w), ' ');
         bool first = a.Get(1, Value::Bool(false)).Truthy();
         bool blank = a.Get(2, Value::Bool(false)).Truthy();
         std::string s = in.ToStr() + "\n";
         auto lines = SplitLines(s);
         if (!ind.empty() && lines.size() > (size_t{1} << 40) / ind.size()) {
           Fail("indent() result too large");
         }
         CheckStringSize(s.size() + lines.size() * ind.size());
         std::string rv;
         if (blank) {
           for (size_t i = 0; i < lines.size(); ++i) {
             if (i) rv += "\n" + ind;
             rv += lines[i];
           }
         } else {
           rv = lines.empty() ? "" : lines[0];
           for (size_t i = 1; i < lines.size(); ++i) {
             rv += "\n";
             rv += lines[i].empty() ? lines[i] : ind + lines[i];
           }
         }
         if (first) rv = ind + rv;
         return Value::String(rv);
       }},
      {"safe", [](Value in, CallArgs&, Evaluator&) { return in; }},
      {"escape",
       [](Value in, CallArgs&, Evaluator&) { return Value::String(HtmlEscape(in.ToStr())); }},
      {"e", [](Value in, CallArgs&, Evaluator&) { return Value::String(HtmlEscape(in.ToStr())); }},
      {"max", [](Value in, CallArgs& args,
                 Evaluator&) { return MinMax(std::move(in), args, true, "max"); }},
      {"min", [](Value in, CallArgs& args,
                 Evaluator&) { return MinMax(std::move(in), args, false, "min"); }},
      {"sum",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "sum", {"attribute", "start"});
         Value attr = a.Get(0);
         Value total = a.Get(1, Value::Int(0));
         for (auto& item : Iterate(in)) {
           Value v = attr.is_none() ? item : GetPath(item, attr.ToStr());
           if (!total.is_number() || !v.is_number()) Fail("sum: values must be numbers");
           if (total.is_float() || v.is_float()) {
             total = Value::Float(total.as_double() + v.as_double());
           } else {
             int64_t r;
             if (__builtin_add_overflow(total.as_int(), v.as_int(), &r)) Fail("integer overflow");
             total = Value::Int(r);
           }
         }
         return total;
       }},
      {"attr",
       [](Value in, CallArgs& args, Evaluator&) {
         ArgList a(args, "attr", {"name"});
         return GetAttribute(in, a.GetStr(0, ""));
       }},
      {"format",
       [](Value in, CallArgs& args, Evaluator&) {
         return Value::String(PercentFormat(in.ToStr(), args.positional));
       }},
      {"wordcount",
       [](Value in, CallArgs&, Evaluator&) {
         return Value::Int(static_cast<int64_t>(PySplit(in.ToStr(), Value::None(), -1).size()));
       }},
  };
  return filters;
}

// ---------------------------------------------------------------- methods

Value StringMethod(const std::string& s, const std::string& name) {
  auto bind = [&](NativeFunction fn) { return Value::MakeCallable("str." + name, std::move(fn)); };
  if (name == "startswith" || name == "endswith") {
    bool starts = name == "startswith";
    return bind([s, starts](CallArgs& args, Evaluator&) {
      if (args.positional.empty()) Fail("startswith/endswith need an argument");
      std::vector<Value> options = args.positional[0].is_list()
                                       ? args.positional[0].list().items
                                       : std::vector<Value>{args.positional[0]};
      for (const auto& o : options) {
        if (!o.is_string()) Fail("startswith/endswith argument must be str or a tuple of str");
        const std::string& p = o.str();
        if (p.size() > s.size()) continue;
        if (starts ? s.compare(0, p.size(), p) == 0
                   : s.compare(s.size() - p.size(), p.size(), p) == 0) {
          return Value::Bool(true);
        }
      }
      return Value::Bool(false);
    });
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    bool l = name != "rstrip", r = name != "lstrip";
    return bind([s, l, r](CallArgs& args, Evaluator&) {
      ArgList a(args, "strip", {"chars"});
      return Value::String(Strip(s, a.Get(0), l, r));
    });
  }
  if (name == "split" || name == "rsplit") {
    bool rsplit = name == "rsplit";
    return bind([s, rsplit](CallArgs& args, Evaluator&) {
      ArgList a(args, "split", {"sep", "maxsplit"});
      int64_t maxsplit = a.GetInt(1, -1);
      if (!rsplit || maxsplit < 0) return Value::MakeList(PySplit(s, a.Get(0), maxsplit));
      // rsplit with a limit: split the reversed string with the reversed separator.
      std::string rs(s.rbegin(), s.rend());
      Value sep = a.Get(0);
      if (sep.is_string()) sep = Value::String(std::string(sep.str().rbegin(), sep.str().rend()));
      auto parts = PySplit(rs, sep, maxsplit);
      std::reverse(parts.begin(), parts.end());
      for (auto& p : parts) p = Value::String(std::string(p.str().rbegin(), p.str().rend()));
      return Value::MakeList(std::move(parts));
    });
  }
  if (name == "upper")
    return bind([s](CallArgs&, Evaluator&) { return Value::String(ToUpper(s)); });
  if (name == "lower")
    return bind([s](CallArgs&, Evaluator&) { return Value::String(ToLower(s)); });
  if (name == "title")
    return bind([s](CallArgs&, Evaluator&) { return Value::String(PyTitle(s)); });
  if (name == "capitalize") {
    return bind([s](CallArgs&, Evaluator&) { return Value::String(PyCapitalize(s)); });
  }
  if (name == "replace") {
    return bind([s](CallArgs& args, Evaluator&) {
      ArgList a(args, "replace", {"old", "new", "count"});
      Value o = a.Get(0), n = a.Get(1);
      if (!o.is_string() || !n.is_string()) Fail("replace() arguments must be str");
      return Value::String(Replace(s, o.str(), n.str(), a.GetInt(2, -1)));
    });
  }
  if (name == "format") {
    return bind([s](CallArgs& args, Evaluator&) { return Value::String(BraceFormat(s, args)); });
  }
  if (name == "join") {
    return bind([s](CallArgs& args, Evaluator&) {
      if (args.positional.size() != 1) Fail("join() takes exactly one argument");
      std::string out;
      bool first = true;
      for (auto& item : Iterate(args.positional[0])) {
        if (!item.is_string())
          Fail("sequence item: expected str instance, " + item.TypeName() + " found");
        if (!first) out += s;
        first = false;
        out += item.str();
        CheckStringSize(out.size());
      }
      return Value::String(std::move(out));
    });
  }
  if (name == "find" || name == "count") {
    bool find = name == "find";
    return bind([s, find](CallArgs& args, Evaluator&) {
      if (args.positional.empty() || !args.positional[0].is_string())
        Fail("expected a str argument");
      const std::string& sub = args.positional[0].str();
      ChargeSteps(static_cast<int64_t>(s.size() / 16));
      if (find) {
        size_t p = s.find(sub);
        if (p == std::string::npos) return Value::Int(-1);
        return Value::Int(static_cast<int64_t>(CodePointCount(s.substr(0, p))));
      }
      if (sub.empty()) return Value::Int(static_cast<int64_t>(CodePointCount(s) + 1));
      int64_t n = 0;
      for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::Int(n);
    });
  }
  if (name == "splitlines") {
    return bind([s](CallArgs&, Evaluator&) {
      std::vector<Value> out;
      for (auto& l : SplitLines(s)) out.push_back(Value::String(l));
      return Value::MakeList(std::move(out));
    });
  }
  using Pred = bool (*)(char);
  static const std::pair<const char*, Pred> kPreds[] = {
      {"isdigit", IsDigitC},
      {"isalpha", IsAlpha},
      {"isspace", IsAsciiSpace},
      {"isalnum", [](char c) { return IsAlpha(c) || IsDigitC(c); }}};
  for (const auto& [pname, pred] : kPreds) {
    if (name == pname) {
      Pred p = pred;
      return bind([s, p](CallArgs&, Evaluator&) {
        return Value::Bool(!s.empty() && std::all_of(s.begin(), s.end(), p));
      });
    }
  }
  if (name == "isupper" || name == "islower") {
    bool up = name == "isupper";
    return bind([s, up](CallArgs&, Evaluator&) {
      bool cased = std::any_of(s.begin(), s.end(), IsAlpha);
      return Value::Bool(cased && (up ? ToUpper(s) == s : ToLower(s) == s));
    });
  }
  return Value::Undefined();
}

}  // namespace

// ---------------------------------------------------------------- public

bool LessThan(const Value& a, const Value& b) {
  ChargeSteps(1);
  if (a.is_number() && b.is_number()) {
    if (!a.is_float() && !b.is_float()) return a.as_int() < b.as_int();
    return a.as_double() < b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();
  if (a.is_list() && b.is_list()) {
    ValueDepthGuard depth;
    const auto& x = a.list().items;
    const auto& y = b.list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (x[i].Equals(y[i])) continue;
      return LessThan(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  Fail("'<' not supported between instances of " + a.QuotedShortTypeName() + " and " +
       b.QuotedShortTypeName());
}

std::vector<Value> Iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      ChargeSteps(static_cast<int64_t>(v.list().items.size()));
      CheckTransient(v.list().items.size() * sizeof(Value));
      return v.list().items;
    case Value::Kind::kDict: {
      if (v.is_namespace()) Fail("'Namespace' object is not iterable");
      ChargeSteps(static_cast<int64_t>(v.dict().items.size()));
      std::vector<Value> keys;
      for (auto& [k, _] : v.dict().items) keys.push_back(Value::String(k));
      return keys;
    }
    case Value::Kind::kString: {
      std::vector<Value> out;
      for (auto& cp : SplitCodePoints(v.str())) out.push_back(Value::String(cp));
      return out;
    }
    default:
      Fail("'" + v.TypeName() + "' is not iterable");
  }
}

bool IsKnownFilter(const std::string& name) {
  return Filters().count(name) > 0 || name == "d" || name == "count";
}
bool IsKnownTest(const std::string& name) {
  return Tests().count(name) > 0;
}

Value ApplyFilter(const std::string& name, Value input, CallArgs& args, Evaluator& ev) {
  const std::string& n = name == "d" ? "default" : name == "count" ? "length" : name;
  auto it = Filters().find(n);
  if (it == Filters().end()) Fail("no filter named '" + name + "'");
  return it->second(std::move(input), args, ev);
}

bool ApplyTest(const std::string& name, const Value& value, CallArgs& args, Evaluator& ev) {
  auto it = Tests().find(name);
  if (it == Tests().end()) Fail("no test named '" + name + "'");
  return it->second(value, args, ev);
}

Value GetMethod(const Value& obj, const std::string& name) {
  if (obj.is_string()) return StringMethod(obj.str(), name);
  if (obj.is_dict()) {
    Value self = obj;
    if (name == "items" || name == "keys" || name == "values") {
      return Value::MakeCallable("dict." + name, [self, name](CallArgs& args, Evaluator&) {
        if (!args.positional.empty() || !args.keyword.empty()) Fail(name + "() takes no arguments");
        std::vector<Value> out;
        for (auto& [k, v] : self.dict().items) {
          if (name == "items") {
            out.push_back(Tuple2(Value::String(k), v));
          } else {
            out.push_back(name == "keys" ? Value::String(k) : v);
          }
        }
        return Value::MakeList(std::move(out));
      });
    }
    if (name == "get") {
      return Value::MakeCallable("dict.get", [self](CallArgs& args, Evaluator&) {
        if (args.positional.empty() || args.positional.size() > 2) {
          Fail("get() takes 1 or 2 arguments");
        }
        const Value& key = args.positional[0];
        if (key.is_string()) {
          if (const Value* v = self.dict().Find(key.str())) return *v;
        }
        return args.positional.size() > 1 ? args.positional[1] : Value::None();
      });
    }
    return Value::Undefined();
  }
  if (obj.is_list()) {
    Value self = obj;
    if (name == "append" && !obj.list().is_tuple) {
      return Value::MakeCallable("list.append", [self](CallArgs& args, Evaluator&) {
        if (args.positional.size() != 1) Fail("append() takes exactly one argument");
        self.list().Append(args.positional[0]);
        return Value::None();
      });
    }
    if (name == "index" || name == "count") {
      bool index = name == "index";
      return Value::MakeCallable("list." + name, [self, index](CallArgs& args, Evaluator&) {
        if (args.positional.size() != 1) Fail("expected one argument");
        int64_t n = 0;
        const auto& items = self.list().items;
        for (size_t i = 0; i < items.size(); ++i) {
          if (!items[i].Equals(args.positional[0])) continue;
          if (index) return Value::Int(static_cast<int64_t>(i));
          ++n;
        }
        if (index) Fail(args.positional[0].Repr() + " is not in list");
        return Value::Int(n);
      });
    }
  }
  return Value::Undefined();
}

void AddGlobals(Dict& g) {
  g.Set("range", Value::MakeCallable("range", [](CallArgs& args, Evaluator& ev) {
          auto& p = args.positional;
          if (p.empty() || p.size() > 3 || !args.keyword.empty()) {
            Fail("range expected 1 to 3 integer arguments");
          }
          for (auto& v : p) {
            if (!v.is_int() && !v.is_bool())
              Fail("range() integer argument expected, got " + v.TypeName());
          }
          int64_t start = p.size() > 1 ? p[0].as_int() : 0;
          int64_t stop = p.size() > 1 ? p[1].as_int() : p[0].as_int();
          int64_t step = p.size() > 2 ? p[2].as_int() : 1;
          if (step == 0) Fail("range() arg 3 must not be zero");
          // Bounded up front: a huge range would exhaust memory before any loop limit trips.
          __int128 span =
              step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
          __int128 len =
              span <= 0 ? 0 : (span + (step > 0 ? step : -step) - 1) / (step > 0 ? step : -step);
          constexpr int64_t kMaxRange = 1000000;
          if (len > kMaxRange) {
            Fail("range() of " + std::to_string(static_cast<int64_t>(len)) +
                 " items exceeds the limit of " + std::to_string(kMaxRange));
          }
          ev.CountIterations(static_cast<int64_t>(len));
          std::vector<Value> out;
          out.reserve(static_cast<size_t>(len));
          for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            out.push_back(Value::Int(i));
          return Value::MakeList(std::move(out));
        }));
  auto make_dict = [](bool ns) {
    return [ns](CallArgs& args, Evaluator&) {
      Value d = ns ? Value::MakeNamespace() : Value::MakeDict();
      for (auto& p : args.positional) {
        if (!p.is_dict()) Fail("namespace()/dict() positional argument must be a mapping");
        for (auto& [k, v] : p.dict().items) d.dict().Set(k, v);
      }
      for (auto& [k, v] : args.keyword) d.dict().Set(k, v);
      return d;
    };
  };
  g.Set("namespace", Value::MakeCallable("namespace", make_dict(true)));
  g.Set("dict", Value::MakeCallable("dict", make_dict(false)));
  g.Set("raise_exception",
        Value::MakeCallable("raise_exception", [](CallArgs& args, Evaluator&) -> Value {
          JinjaError e;
          e.message =
              args.positional.empty() ? "raise_exception() called" : args.positional[0].ToStr();
          e.raised_by_template = true;
          throw e;
        }));
  g.Set("strftime_now", Value::MakeCallable("strftime_now", [](CallArgs& args, Evaluator&) {
          if (args.positional.size() != 1) Fail("strftime_now() takes one format argument");
          std::time_t t = std::time(nullptr);
          std::tm tm{};
          localtime_r(&t, &tm);
          char buf[512];
          size_t n = std::strftime(buf, sizeof(buf), args.positional[0].ToStr().c_str(), &tm);
          return Value::String(std::string(buf, n));
        }));
}

}  // namespace dl::jinja
