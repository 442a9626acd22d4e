// Run-time values of the Jinja interpreter. They mirror the Python objects that jinja2 sees when
// Hugging Face renders a chat template (None, bool, int, float, str, list, tuple, dict, callables,
// jinja2's Undefined), because templates are written against Python semantics: truthiness, ==
// between int and float, str() of a list, json.dumps of a dict in insertion order.
#pragma once

#include <algorithm>
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
struct List;
struct Dict;

// What one render may use. A template is input (a model file), so it must not be able to crash or
// hang the process: every recursion, allocation and unit of work of the interpreter is bounded, and
// crossing a bound is a JinjaError naming it.
struct RenderLimits {
  int max_call_depth = 128;               // macro recursion
  int max_eval_depth = 400;               // nested expressions/statements/calls being evaluated
  int64_t max_loop_iterations = 2000000;  // all loops of one render together
  int64_t max_steps = 20000000;           // evaluation steps and builtin work units together
  size_t max_output_bytes = 64u << 20;
  size_t max_string_bytes = 64u << 20;    // one string value
  size_t max_list_items = 1u << 20;       // one list
  size_t max_alloc_bytes = 256u << 20;    // strings, lists and dicts of one render alive at once
  double max_seconds = 10;                // wall time of one render
};

// Values nest at most this deep (lists in lists, dicts in dicts, a context from JSON): printing,
// comparing and converting them recurse.
inline constexpr int kMaxValueDepth = 256;

// The accounting of the render running on this thread. Outside a render nothing is charged.
class RenderBudget {
 public:
  explicit RenderBudget(const RenderLimits& limits);
  ~RenderBudget();
  RenderBudget(const RenderBudget&) = delete;
  RenderBudget& operator=(const RenderBudget&) = delete;

  // The budget installed on this thread, or null.
  static RenderBudget* Current();

  const RenderLimits& limits() const { return limits_; }
  uint64_t id() const { return id_; }
  void ChargeSteps(int64_t n);
  // Memory of values alive now: charged when made, refunded when freed during this render.
  void ChargeBytes(size_t n);
  void RefundBytes(size_t n) { live_ -= std::min(live_, n); }
  // Fails when `n` more bytes, even briefly (a scratch vector), would pass the limit.
  void CheckTransient(size_t n) const;
  void Track(const std::shared_ptr<List>& l);
  void Track(const std::shared_ptr<Dict>& d);

 private:
  void BreakCycles();

  RenderLimits limits_;
  RenderBudget* previous_;
  uint64_t id_;
  int64_t steps_ = 0;
  int64_t next_clock_check_ = 0;
  size_t live_ = 0;
  double deadline_ = 0;
  // Containers created by this render: whatever is still alive when it ends is held only by a
  // reference cycle (`ns.self = ns`) and is emptied so it can be freed.
  std::vector<std::weak_ptr<List>> lists_;
  std::vector<std::weak_ptr<Dict>> dicts_;
};

// Charges against the current budget (no-ops outside a render); they Fail past a limit.
void ChargeSteps(int64_t n);
void ChargeBytes(size_t n);
void CheckTransient(size_t n);
// Call before building a string of `n` bytes / a list of `n` items.
void CheckStringSize(size_t n);
void CheckListSize(size_t n);

// Bounds the recursion of functions that walk nested values.
class ValueDepthGuard {
 public:
  ValueDepthGuard();
  ~ValueDepthGuard();
  ValueDepthGuard(const ValueDepthGuard&) = delete;
  ValueDepthGuard& operator=(const ValueDepthGuard&) = delete;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

using NativeFunction = std::function<Value(CallArgs& args, Evaluator& ev)>;

struct Callable {
  std::string name;
  NativeFunction fn;
};

// Containers free their items iteratively: a list nested 100,000 deep must not overflow the stack
// when it is dropped.
struct List {
  std::vector<Value> items;
  bool is_tuple = false;
  uint64_t budget_id = 0;  // the render that charged `charged` bytes for this list
  size_t charged = 0;
  ~List();
  void Append(Value v);  // charges the new slot
};

// Python dicts keep insertion order; so do we. Keys are strings (JSON objects and the dict literals
// chat templates write); lookup is linear, which is fine for message-sized dicts.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;  // jinja2's namespace(): the only object `set x.attr = ...` may modify
  uint64_t budget_id = 0;
  size_t charged = 0;

  Value* Find(const std::string& key);
  const Value* Find(const std::string& key) const;
  void Set(const std::string& key, Value value);
  ~Dict();
};

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kCallable };

  Value() = default;  // undefined
  static Value Undefined(std::string hint = "") {
    Value v;
    if (!hint.empty()) v.str_ = std::make_shared<const std::string>(std::move(hint));
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
  // Strings are immutable and shared between copies of a value.
  static Value String(std::string s);
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
  const std::string& str() const { return str_ ? *str_ : EmptyString(); }  // kString; kUndefined: the hint
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
  static const std::string& EmptyString();
  friend struct List;
  friend struct Dict;
  bool holds_container() const { return list_ || dict_ || fn_; }

  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;
  double float_ = 0;
  std::shared_ptr<const std::string> str_;
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
std::vector<std::string> SplitCodePoints(const std::string& s);  // charged to the render budget
size_t CodePointCount(const std::string& s);
bool IsAscii(const std::string& s);
// The code point at Python index `index` (negative counts from the end); false when out of range.
bool CodePointAt(const std::string& s, int64_t index, std::string* out);
// The byte offset of every code point, then s.size() (charged to the render budget).
std::vector<size_t> CodePointOffsets(const std::string& s);

}  // namespace dl::jinja
