// Deterministic generators for the fuzz tests (issue 21): random JSON values and text (valid,
// mutated, invalid UTF-8, extreme numbers, deep nesting) and random Jinja chat templates built from
// the constructs real templates use, plus hostile ones. Header-only; every generator takes the
// caller's seeded engine, so a failing case is reproduced from its seed and index.
#pragma once

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dl::fuzz {

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  int64_t Int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(engine_); }
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(engine_) < p; }
  template <typename T>
  const T& Pick(const std::vector<T>& v) {
    return v[static_cast<size_t>(Int(0, static_cast<int64_t>(v.size()) - 1))];
  }
  uint64_t Next() { return engine_(); }

 private:
  std::mt19937_64 engine_;
};

inline std::string RandomText(Rng& r, size_t max_len = 24) {
  static const std::vector<std::string> pieces = {
      "a", "hello", " ", "\n", "\t", "{", "}", "{{", "}}", "{%", "%}", "\"", "\\", "'", "<", ">",
      "&", "é", "日本", "🙂", "\u200b", "\x01", "\x7f", "%s", "%d", "{}", "{0}", "<|im_end|>",
      "</s>", "null", "0", "-1", "1e308", "user", "assistant"};
  std::string s;
  const int64_t n = r.Int(0, static_cast<int64_t>(max_len));
  for (int64_t i = 0; i < n; ++i) s += r.Pick(pieces);
  return s;
}

// A JSON value that nlohmann can hold (valid UTF-8 strings).
inline nlohmann::ordered_json RandomJson(Rng& r, int depth = 0) {
  using J = nlohmann::ordered_json;
  const int64_t kind = r.Int(0, depth > 4 ? 5 : 7);
  switch (kind) {
    case 0:
      return nullptr;
    case 1:
      return r.Chance(0.5);
    case 2: {
      static const std::vector<int64_t> ints = {0, 1, -1, 2, 7, 255, 256, 511, 512, 65536,
                                                 std::numeric_limits<int32_t>::max(),
                                                 std::numeric_limits<int64_t>::max(),
                                                 std::numeric_limits<int64_t>::min()};
      return r.Chance(0.7) ? J(r.Pick(ints)) : J(r.Int(-1000, 1000));
    }
    case 3: {
      static const std::vector<double> floats = {0.0, -0.0, 0.5, 1.5, -2.25, 1e-300, 1e300,
                                                 3.4028235e38, 16.0, 1e19};
      return r.Pick(floats);
    }
    case 4:
    case 5:
      return RandomText(r);
    case 6: {
      J a = J::array();
      const int64_t n = r.Int(0, 4);
      for (int64_t i = 0; i < n; ++i) a.push_back(RandomJson(r, depth + 1));
      return a;
    }
    default: {
      static const std::vector<std::string> keys = {"role", "content", "name", "type", "text",
                                                    "function", "arguments", "tool_calls", "x",
                                                    "description", "parameters", "properties"};
      J o = J::object();
      const int64_t n = r.Int(0, 4);
      for (int64_t i = 0; i < n; ++i) o[r.Chance(0.8) ? r.Pick(keys) : RandomText(r, 3)] = RandomJson(r, depth + 1);
      return o;
    }
  }
}

// Byte-level damage to a JSON text: flipped bytes, cuts, inserted garbage, invalid UTF-8, deep
// brackets.
inline std::string Mutate(Rng& r, std::string s) {
  const int64_t edits = r.Int(1, 4);
  for (int64_t e = 0; e < edits && !s.empty(); ++e) {
    const size_t at = static_cast<size_t>(r.Int(0, static_cast<int64_t>(s.size()) - 1));
    switch (r.Int(0, 6)) {
      case 0:
        s[at] = static_cast<char>(r.Int(0, 255));
        break;
      case 1:
        s.resize(at);
        break;
      case 2:
        s.insert(at, r.Pick(std::vector<std::string>{"\xff", "\xc3", "\xed\xa0\x80", "\\ud800",
                                                       "\x00", ",", "]", "}", "\"", "1e999",
                                                       "-", "nul"}));
        break;
      case 3:
        s.erase(at, static_cast<size_t>(r.Int(1, 8)));
        break;
      case 4: {
        const size_t depth = static_cast<size_t>(r.Chance(0.5) ? r.Int(100, 140) : r.Int(1, 50000));
        s.insert(at, std::string(depth, '[') + std::string(r.Chance(0.5) ? depth : 0, ']'));
        break;
      }
      case 5:
        s.insert(at, std::string(static_cast<size_t>(r.Int(1, 4096)), ' '));
        break;
      default:
        s += s.substr(0, std::min<size_t>(s.size(), 64));
    }
  }
  return s;
}

// ---- templates ----

class TemplateGen {
 public:
  explicit TemplateGen(Rng& r) : r_(r) {}

  std::string Template() {
    std::string t;
    const int64_t n = r_.Int(1, 6);
    for (int64_t i = 0; i < n; ++i) t += Stmt(0);
    return t;
  }

 private:
  std::string Name() {
    static const std::vector<std::string> names = {
        "messages", "tools", "x", "y", "ns", "m", "i", "loop", "bos_token", "eos_token",
        "add_generation_prompt", "undefined_thing", "raise_exception", "range", "namespace"};
    return r_.Pick(names);
  }
  std::string Literal() {
    static const std::vector<std::string> lits = {
        "0", "1", "-1", "2", "9223372036854775807", "(-9223372036854775807 - 1)", "1.5",
        "1e308", "'a'", "''", "'\\n'", "\"x\"", "true", "false", "none", "[]", "[1, 2, 3]",
        "{}", "{'k': 1}", "(1, 2)", "'%s-%d'", "'{} {}'", "'abc'"};
    return r_.Pick(lits);
  }
  std::string Expr(int depth) {
    if (depth > 4 || r_.Chance(0.3)) return r_.Chance(0.5) ? Name() : Literal();
    static const std::vector<std::string> bin = {"+", "-", "*", "/", "//", "%", "**", "~",
                                                 "and", "or", "in", "not in", "==", "!=",
                                                 "<", ">=", "is defined", "is string"};
    static const std::vector<std::string> filters = {
        "length", "first", "last", "join(', ')", "upper", "lower", "trim", "title",
        "capitalize", "tojson", "tojson(indent=2)", "string", "int", "float", "list",
        "items", "dictsort", "selectattr('role', 'equalto', 'user')", "rejectattr('x')",
        "map(attribute='content')", "map('string')", "unique", "reverse", "sort", "abs",
        "round(2)", "indent(4)", "safe", "escape", "max", "min", "sum", "default('d')",
        "replace('a', 'b')", "format(1, 2)", "wordcount", "count"};
    static const std::vector<std::string> methods = {
        ".strip()", ".split()", ".split(',')", ".upper()", ".startswith('a')",
        ".replace('a', 'bb')", ".format(1)", ".items()", ".keys()", ".get('role')",
        ".append(1)", ".count(1)", ".find('a')", ".splitlines()", ".join(['a', 'b'])"};
    switch (r_.Int(0, 7)) {
      case 0: {
        const std::string op = r_.Pick(bin);
        if (op.rfind("is ", 0) == 0) return "(" + Expr(depth + 1) + " " + op + ")";
        return "(" + Expr(depth + 1) + " " + op + " " + Expr(depth + 1) + ")";
      }
      case 1:
        return "(" + Expr(depth + 1) + "|" + r_.Pick(filters) + ")";
      case 2:
        return "(" + Expr(depth + 1) + ")" + r_.Pick(methods);
      case 3:
        return "(" + Expr(depth + 1) + ")[" + Expr(depth + 1) + "]";
      case 4:
        return "(" + Expr(depth + 1) + ")[" + (r_.Chance(0.5) ? Literal() : "") + ":" +
               (r_.Chance(0.5) ? Literal() : "") + (r_.Chance(0.3) ? ":-1" : "") + "]";
      case 5:
        return "(" + Expr(depth + 1) + ")." +
               r_.Pick(std::vector<std::string>{"role", "content", "a", "items", "0"});
      case 6:
        return "range(" + r_.Pick(std::vector<std::string>{"3", "0", "-2", "100", "1000000", "x|length"}) + ")";
      default:
        return "[" + Expr(depth + 1) + ", " + Expr(depth + 1) + "]";
    }
  }
  std::string Stmt(int depth) {
    if (depth > 3) return "{{ " + Expr(0) + " }}";
    switch (r_.Int(0, 9)) {
      case 0:
      case 1:
        return "{{ " + Expr(0) + " }}";
      case 2:
        return "{% if " + Expr(0) + " %}" + Stmt(depth + 1) + "{% elif " + Expr(0) + " %}" +
               Stmt(depth + 1) + "{% else %}" + Stmt(depth + 1) + "{% endif %}";
      case 3:
        return "{% for " + std::string(r_.Chance(0.3) ? "k, v" : "i") + " in " + Expr(0) +
               (r_.Chance(0.3) ? " if " + Expr(0) : "") + " %}" + Stmt(depth + 1) +
               (r_.Chance(0.2) ? "{% break %}" : "") + "{% else %}" + Stmt(depth + 1) +
               "{% endfor %}";
      case 4:
        return "{% set " + r_.Pick(std::vector<std::string>{"x", "y", "m"}) + " = " + Expr(0) + " %}";
      case 5:
        return "{% set ns = namespace(a=" + Expr(0) + ") %}{% set ns.a = " +
               r_.Pick(std::vector<std::string>{"ns", "[ns]", "ns.a ~ ns.a", "ns.a + ns.a", Expr(0)}) +
               " %}{{ ns.a|length }}";
      case 6:
        return "{% macro f(a, b=1) %}" + Stmt(depth + 1) +
               (r_.Chance(0.3) ? "{{ f(a) }}" : "") + "{% endmacro %}{{ f(" + Expr(0) + ") }}";
      case 7:
        return "{% filter " + r_.Pick(std::vector<std::string>{"upper", "trim", "indent(2)"}) + " %}" +
               Stmt(depth + 1) + "{% endfilter %}";
      case 8:
        // Mostly plain text; now and then a stray delimiter.
        return r_.Chance(0.8) ? "text " : RandomText(r_, 6);
      default:
        return "{%- for m in messages -%}<{{ m.role }}>{{ m.content }}{% if m.tool_calls %}" +
               std::string("{{ m.tool_calls|tojson }}{% endif %}{%- endfor -%}");
    }
  }

  Rng& r_;
};

}  // namespace dl::fuzz
