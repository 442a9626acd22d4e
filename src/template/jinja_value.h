// Run-time values of the Jinja interpreter. They mirror the Python objects that jinja2 sees when
// Hugging Face renders a chat template (None, bool, int, float, str, list, tuple, dict, callables,
// jinja2's Undefined), because templates are written against Python semantics: truthiness, ==
// between int and float, str() of a list, json.dumps of a dict in insertion order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace dl::jinja {

// Errors inside the interpreter travel as this exception; the public API (ChatTemplate) catches it
// and returns a Status, so it never leaves the library. line == 0 means "position not yet known":
// the evaluator fills in the innermost node it was evaluating.
struct JinjaError {
  std::string message;
  int line = 0;
  int column = 0;
  bool raised_by_template = false;  // raise_exception() from the template itself
};

[[noreturn]] void Fail(std::string message);

class Value;
class Evaluator;

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

using NativeFunction = std::function<Value(CallArgs& args, Evaluator& ev)>;

struct Callable {
  std::string name;
  NativeFunction fn;
};

struct List {
  std::vector<Value> items;
  bool is_tuple = false;
};

// Python dicts keep insertion order; so do we. Keys are strings (JSON objects and the dict literals
// chat templates write); lookup is linear, which is fine for message-sized dicts.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;  // jinja2's namespace(): the only object `set x.attr = ...` may modify

  Value* Find(const std::string& key);
  const Value* Find(const std::string& key) const;
  void Set(const std::string& key, Value value);
};

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };

  Value() = default;  // undefined
  static Value Undefined(std::string hint = "") {
    Value v;
    v.str_ = std::move(hint);
    return v;
  }
  static Value None() { return FromKind(Kind::kNone); }
  static Value Bool(bool b) {
    Value v = FromKind(Kind::kBool);
    v.int_ = b ? 1 : 0;
    return v;
  }
  static Value Int(int64_t i) {
    Value v = FromKind(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value Float(double d) {
    Value v = FromKind(Kind::kFloat);
    v.float_ = d;
    return v;
  }
  static Value String(std::string s) {
    Value v = FromKind(Kind::kString);
    v.str_ = std::move(s);
    return v;
  }
  static Value MakeList(std::vector<Value> items = {}, bool is_tuple = false);
  static Value MakeDict();
  static Value MakeNamespace();
  static Value MakeCallable(std::string name, NativeFunction fn);
  // JSON → Value (objects keep the order of the ordered_json they come from).
  static Value FromJson(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || is_bool(); }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_callable() const { return kind_ == Kind::kCallable; }
  bool is_namespace() const { return is_dict() && dict_->is_namespace; }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }  // valid for kInt and kBool
  double as_double() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& str() const { return str_; }  // kString; for kUndefined the error hint
  List& list() const { return *list_; }
  Dict& dict() const { return *dict_; }
  Callable& callable() const { return *fn_; }

  // Python truthiness.
  bool Truthy() const;
  // Python str() (what {{ value }} prints; undefined prints as "").
  std::string ToStr() const;
  // Python repr().
  std::string Repr() const;
  // Python ==, with 1 == 1.0 == True.
  bool Equals(const Value& other) const;
  // jinja2's type names in messages: "dict object", "list object", ...
  std::string TypeName() const;
  // Python's quoted short type name as error messages show it: 'int', 'str', 'dict'.
  std::string QuotedShortTypeName() const;
  // Back to JSON (undefined and callables are errors, like json.dumps would raise).
  nlohmann::ordered_json ToJson() const;

 private:
  static Value FromKind(Kind k) {
    Value v;
    v.kind_ = k;
    return v;
  }

  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;
  double float_ = 0;
  std::string str_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> fn_;
};

// Python's repr(float): shortest round-trip digits, "1.0", "1e+16", "1e-05", "inf", "nan".
std::string PyFloatRepr(double d);
// Python's repr(str).
std::string PyStrRepr(const std::string& s);

struct JsonDumpOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;  // used when has_indent
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
// json.dumps(value, ...) with Python's exact formatting.
std::string JsonDumps(const Value& v, const JsonDumpOptions& options);

// UTF-8 helpers: Python strings index code points.
std::vector<std::string> SplitCodePoints(const std::string& s);
size_t CodePointCount(const std::string& s);

}  // namespace dl::jinja
