#include "template/jinja_eval.h"

#include <cmath>
#include <limits>
#include <optional>

#include "template/jinja_builtins.h"

namespace dl::jinja {

Value* Frame::Lookup(const std::string& name) {
  for (Frame* f = this; f; f = f->parent.get()) {
    auto it = f->vars.find(name);
    if (it != f->vars.end()) return &it->second;
  }
  return nullptr;
}

namespace {

[[noreturn]] void FailUndefined(const Value& v) {
  Fail(v.str().empty() ? "value is undefined" : v.str());
}

bool IsDictMethodName(const std::string& n) {
  return n == "items" || n == "keys" || n == "values" || n == "get";
}

// Python index normalisation; returns false when out of range.
bool NormIndex(int64_t i, size_t size, size_t* out) {
  int64_t n = static_cast<int64_t>(size);
  if (i < 0) i += n;
  if (i < 0 || i >= n) return false;
  *out = static_cast<size_t>(i);
  return true;
}

int64_t CheckedInt(const Value& v, const char* what) {
  if (v.is_int() || v.is_bool()) return v.as_int();
  Fail(std::string(what) + " must be an integer, not " + v.TypeName());
}

// Python slice semantics (start/stop/step may be omitted = none/undefined): calls f(i) for every
// selected index of a sequence of `size` items.
template <typename F>
void ForSlice(size_t size, const Value& start_v, const Value& stop_v, const Value& step_v, F f) {
  int64_t n = static_cast<int64_t>(size);
  int64_t step = (step_v.is_none() || step_v.is_undefined()) ? 1 : CheckedInt(step_v, "slice step");
  if (step == 0) Fail("slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t def) -> int64_t {
    if (v.is_none() || v.is_undefined()) return def;
    int64_t i = CheckedInt(v, "slice index");
    if (i < 0) i = i < -n ? -n - 1 : i + n;  // no overflow for INT64_MIN
    if (step > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  int64_t start = clamp(start_v, step > 0 ? 0 : n - 1);
  int64_t stop = clamp(stop_v, step > 0 ? n : -1);
  // start and stop are within [-1, n]; stepping in 128 bits cannot overflow.
  if (step > 0) {
    for (__int128 i = start; i < stop; i += step) f(static_cast<size_t>(i));
  } else {
    for (__int128 i = start; i > stop; i += step) f(static_cast<size_t>(i));
  }
}

// b != 0. INT64_MIN // -1 does not fit (and traps on x86): an overflow error, as for + - *.
int64_t FloorDiv(int64_t a, int64_t b) {
  if (a == std::numeric_limits<int64_t>::min() && b == -1) Fail("integer overflow");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// b != 0. x % -1 is 0 for every x; computing INT64_MIN % -1 traps on x86.
int64_t PyMod(int64_t a, int64_t b) {
  if (b == -1) return 0;
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

// x ** y for y >= 0 by squaring, with overflow checks.
int64_t IntPow(int64_t x, int64_t y) {
  int64_t result = 1;
  while (y > 0) {
    if (y & 1) {
      if (__builtin_mul_overflow(result, x, &result)) Fail("integer overflow");
    }
    y >>= 1;
    if (y > 0 && __builtin_mul_overflow(x, x, &x)) Fail("integer overflow");
  }
  return result;
}

std::string OperandTypes(const Value& a, const Value& b) {
  return a.QuotedShortTypeName() + " and " + b.QuotedShortTypeName();
}

Value Arith(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  if (a.is_number() && b.is_number()) {
    bool ints = !a.is_float() && !b.is_float();
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int(), r = 0;
      if (op == "+") {
        if (__builtin_add_overflow(x, y, &r)) Fail("integer overflow");
        return Value::Int(r);
      }
      if (op == "-") {
        if (__builtin_sub_overflow(x, y, &r)) Fail("integer overflow");
        return Value::Int(r);
      }
      if (op == "*") {
        if (__builtin_mul_overflow(x, y, &r)) Fail("integer overflow");
        return Value::Int(r);
      }
      if (op == "/") {
        if (y == 0) Fail("division by zero");
        return Value::Float(static_cast<double>(x) / static_cast<double>(y));
      }
      if (op == "//") {
        if (y == 0) Fail("integer division or modulo by zero");
        return Value::Int(FloorDiv(x, y));
      }
      if (op == "%") {
        if (y == 0) Fail("integer division or modulo by zero");
        return Value::Int(PyMod(x, y));
      }
      if (op == "**") {
        if (y < 0) {
          if (x == 0) Fail("0.0 cannot be raised to a negative power");
          return Value::Float(std::pow(static_cast<double>(x), static_cast<double>(y)));
        }
        return Value::Int(IntPow(x, y));
      }
    }
    double x = a.as_double(), y = b.as_double();
    if (op == "+") return Value::Float(x + y);
    if (op == "-") return Value::Float(x - y);
    if (op == "*") return Value::Float(x * y);
    if (op == "/") {
      if (y == 0) Fail("float division by zero");
      return Value::Float(x / y);
    }
    if (op == "//") {
      if (y == 0) Fail("float floor division by zero");
      return Value::Float(std::floor(x / y));
    }
    if (op == "%") {
      if (y == 0) Fail("float modulo");
      double r = std::fmod(x, y);
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return Value::Float(r);
    }
    if (op == "**") return Value::Float(std::pow(x, y));
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      CheckStringSize(a.str().size() + b.str().size());
      return Value::String(a.str() + b.str());
    }
    if (a.is_list() && b.is_list() && a.list().is_tuple == b.list().is_tuple) {
      CheckListSize(a.list().items.size() + b.list().items.size());
      std::vector<Value> items = a.list().items;
      items.insert(items.end(), b.list().items.begin(), b.list().items.end());
      return Value::MakeList(std::move(items), a.list().is_tuple);
    }
  }
  if (op == "*") {
    const Value* seq = (a.is_string() || a.is_list())   ? &a
                       : (b.is_string() || b.is_list()) ? &b
                                                        : nullptr;
    const Value* count = seq == &a ? &b : &a;
    if (seq && (count->is_int() || count->is_bool())) {
      int64_t k = std::max<int64_t>(0, count->as_int());
      size_t unit = seq->is_string() ? seq->str().size() : seq->list().items.size();
      if (unit && static_cast<uint64_t>(k) > (uint64_t{1} << 40) / unit) {
        Fail("repetition result too large");
      }
      const size_t total = static_cast<size_t>(k) * unit;
      if (seq->is_string()) {
        CheckStringSize(total);
      } else {
        CheckListSize(total);
      }
      if (seq->is_string()) {
        std::string r;
        for (int64_t i = 0; i < k; ++i) r += seq->str();
        return Value::String(r);
      }
      std::vector<Value> items;
      for (int64_t i = 0; i < k; ++i) {
        items.insert(items.end(), seq->list().items.begin(), seq->list().items.end());
      }
      return Value::MakeList(std::move(items), seq->list().is_tuple);
    }
  }
  Fail("unsupported operand type(s) for " + op + ": " + OperandTypes(a, b));
}

bool Contains(const Value& container, const Value& item) {
  ChargeSteps(1);
  switch (container.kind()) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        Fail("'in <string>' requires string as left operand, not " + item.TypeName());
      }
      ChargeSteps(static_cast<int64_t>(container.str().size() / 64));
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::kList:
      for (const auto& v : container.list().items) {
        if (v.Equals(item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return item.is_string() && container.dict().Find(item.str()) != nullptr;
    default:
      Fail("argument of type " + container.TypeName() + " is not iterable");
  }
}

// jinja2's message for a missing attribute: "'dict object' has no attribute 'x'". Built with
// appends: g++ 12 warns (-Wrestrict, a false positive) on the equivalent operator+ chain.
std::string NoAttribute(const Value& obj, const std::string& name) {
  std::string m = "'";
  m += obj.TypeName();
  m += "' has no attribute '";
  m += name;
  m += '\'';
  return m;
}

}  // namespace

Value GetAttribute(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      FailUndefined(obj);
    case Value::Kind::kDict: {
      if (!obj.is_namespace() && IsDictMethodName(name)) return GetMethod(obj, name);
      if (const Value* v = obj.dict().Find(name)) return *v;
      break;
    }
    case Value::Kind::kString:
    case Value::Kind::kList: {
      Value m = GetMethod(obj, name);
      if (!m.is_undefined()) return m;
      break;
    }
    default:
      break;
  }
  return Value::Undefined(NoAttribute(obj, name));
}

Value GetItem(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined:
      FailUndefined(obj);
    case Value::Kind::kDict:
      if (key.is_string()) {
        if (const Value* v = obj.dict().Find(key.str())) return *v;
        if (!obj.is_namespace() && IsDictMethodName(key.str())) return GetMethod(obj, key.str());
      }
      break;
    case Value::Kind::kList:
      if (key.is_int() || key.is_bool()) {
        size_t i;
        if (NormIndex(key.as_int(), obj.list().items.size(), &i)) return obj.list().items[i];
      } else if (key.is_string()) {
        return GetAttribute(obj, key.str());
      }
      break;
    case Value::Kind::kString:
      if (key.is_int() || key.is_bool()) {
        std::string cp;
        if (CodePointAt(obj.str(), key.as_int(), &cp)) return Value::String(std::move(cp));
      } else if (key.is_string()) {
        return GetAttribute(obj, key.str());
      }
      break;
    default:
      break;
  }
  return Value::Undefined(NoAttribute(obj, key.ToStr()));
}

Evaluator::DepthGuard::DepthGuard(Evaluator* e) : ev(e) {
  if (++ev->eval_depth_ > ev->limits_.max_eval_depth) {
    --ev->eval_depth_;
    Fail("template evaluation nested deeper than " + std::to_string(ev->limits_.max_eval_depth) +
         " levels");
  }
  ChargeSteps(1);
}

void Evaluator::CountIterations(int64_t n) {
  iterations_ += n;
  if (iterations_ > limits_.max_loop_iterations) {
    Fail("template exceeded the limit of " + std::to_string(limits_.max_loop_iterations) +
         " loop iterations");
  }
}

void Evaluator::Append(std::string& out, const std::string& s) {
  if (out.size() + s.size() > limits_.max_output_bytes) {
    Fail("template output exceeds " + std::to_string(limits_.max_output_bytes) + " bytes");
  }
  out += s;
}

std::string Evaluator::Render(const Template& tmpl, const Value& context) {
  std::optional<RenderBudget> budget;
  if (!RenderBudget::Current()) budget.emplace(limits_);
  call_depth_ = eval_depth_ = 0;
  iterations_ = 0;
  // The frames go before the budget: it empties whatever a reference cycle still holds.
  struct FramesReset {
    std::shared_ptr<Frame>& g;
    ~FramesReset() { g.reset(); }
  } frames_reset{globals_};
  globals_ = std::make_shared<Frame>(nullptr);
  Value g = Value::MakeDict();
  AddGlobals(g.dict());
  for (auto& [k, v] : g.dict().items) globals_->Set(k, v);
  if (context.is_dict()) {
    for (const auto& [k, v] : context.dict().items) globals_->Set(k, v);
  }
  std::string out;
  ExecBody(tmpl.body, globals_, out);
  // Break reference cycles (macros stored in frames refer back to them weakly, but values such as
  // namespaces may hold callables); dropping the frame frees everything.
  globals_.reset();
  return out;
}

Evaluator::Flow Evaluator::ExecBody(const Body& body, const std::shared_ptr<Frame>& frame,
                                    std::string& out) {
  for (const auto& s : body) {
    Flow f = ExecStmt(*s, frame, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Evaluator::Flow Evaluator::ExecStmt(const Stmt& s, const std::shared_ptr<Frame>& frame,
                                    std::string& out) {
  try {
    DepthGuard depth(this);
    switch (s.kind) {
      case Stmt::Kind::kText:
        Append(out, s.text);
        return Flow::kNormal;
      case Stmt::Kind::kOutput:
        Append(out, Eval(*s.expr, *frame).ToStr());
        return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (size_t i = 0; i < s.conditions.size(); ++i) {
          if (Eval(*s.conditions[i], *frame).Truthy()) return ExecBody(s.bodies[i], frame, out);
        }
        return ExecBody(s.else_body, frame, out);
      case Stmt::Kind::kFor:
        return ExecFor(s, frame, out);
      case Stmt::Kind::kSet:
        ExecSet(s, *frame, Eval(*s.expr, *frame));
        return Flow::kNormal;
      case Stmt::Kind::kSetBlock: {
        std::string captured;
        ExecBody(s.body, frame, captured);
        Value v = Value::String(std::move(captured));
        if (s.expr) v = ApplyFilterChain(*s.expr, v, *frame);
        frame->Set(s.targets[0], v);
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro:
        frame->Set(s.targets[0], MakeMacro(s, frame, s.targets[0]));
        return Flow::kNormal;
      case Stmt::Kind::kCallBlock: {
        Value caller = MakeMacro(s, frame, "caller");
        const Expr& call = *s.expr;
        Value fn = Eval(*call.args[0], *frame);
        CallArgs args;
        EvalArgs(call, 1, *frame, &args);
        args.keyword.emplace_back("caller", caller);
        Append(out, Call(fn, args).ToStr());
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak:
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        return Flow::kContinue;
      case Stmt::Kind::kFilterBlock: {
        std::string captured;
        ExecBody(s.body, frame, captured);
        Append(out, ApplyFilterChain(*s.expr, Value::String(std::move(captured)), *frame).ToStr());
        return Flow::kNormal;
      }
      case Stmt::Kind::kScope:
        return ExecBody(s.body, frame, out);
    }
  } catch (JinjaError& e) {
    if (e.line == 0) {
      e.line = s.line;
      e.column = s.column;
    }
    throw;
  }
  return Flow::kNormal;
}

namespace {

void BindTargets(Frame& frame, const std::vector<std::string>& targets, const Value& item) {
  if (targets.size() == 1) {
    frame.Set(targets[0], item);
    return;
  }
  std::vector<Value> parts = Iterate(item);
  if (parts.size() != targets.size()) {
    Fail("cannot unpack " + std::to_string(parts.size()) + " values into " +
         std::to_string(targets.size()) + " variables");
  }
  for (size_t i = 0; i < targets.size(); ++i) frame.Set(targets[i], parts[i]);
}

}  // namespace

Evaluator::Flow Evaluator::ExecFor(const Stmt& s, const std::shared_ptr<Frame>& frame,
                                   std::string& out) {
  Value iterable = Eval(*s.expr, *frame);
  if (iterable.is_none() || iterable.is_number() || iterable.is_callable()) {
    Fail("'" + iterable.TypeName() + "' is not iterable");
  }
  std::vector<Value> items = Iterate(iterable);
  if (s.cond) {
    std::vector<Value> kept;
    for (auto& item : items) {
      auto f = std::make_shared<Frame>(frame);
      BindTargets(*f, s.targets, item);
      if (Eval(*s.cond, *f).Truthy()) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    ExecBody(s.else_body, frame, out);
    return Flow::kNormal;
  }
  const int64_t n = static_cast<int64_t>(items.size());
  // One loop object for the whole loop, updated in place (jinja2's LoopContext is one object too).
  Value loop = Value::MakeDict();
  Dict& d = loop.dict();
  auto position = std::make_shared<int64_t>(0);
  d.Set("length", Value::Int(n));
  d.Set("depth", Value::Int(1));
  d.Set("depth0", Value::Int(0));
  d.Set("cycle", Value::MakeCallable("loop.cycle", [position](CallArgs& args, Evaluator&) -> Value {
          if (args.positional.empty()) Fail("no items for cycling given");
          return args.positional[*position % static_cast<int64_t>(args.positional.size())];
        }));
  for (int64_t i = 0; i < n; ++i) {
    CountIterations(1);
    *position = i;
    auto f = std::make_shared<Frame>(frame);
    BindTargets(*f, s.targets, items[i]);
    d.Set("index", Value::Int(i + 1));
    d.Set("index0", Value::Int(i));
    d.Set("revindex", Value::Int(n - i));
    d.Set("revindex0", Value::Int(n - i - 1));
    d.Set("first", Value::Bool(i == 0));
    d.Set("last", Value::Bool(i == n - 1));
    d.Set("previtem", i > 0 ? items[i - 1] : Value::Undefined("there is no previous item"));
    d.Set("nextitem", i + 1 < n ? items[i + 1] : Value::Undefined("there is no next item"));
    f->Set("loop", loop);
    Flow flow = ExecBody(s.body, f, out);
    if (flow == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

void Evaluator::ExecSet(const Stmt& s, Frame& frame, Value value) {
  if (!s.attr.empty()) {
    Value* target = frame.Lookup(s.targets[0]);
    if (!target || !target->is_namespace()) {
      Fail("cannot assign attribute on non-namespace object '" + s.targets[0] + "'");
    }
    target->dict().Set(s.attr, std::move(value));
    return;
  }
  BindTargets(frame, s.targets, value);
}

Value Evaluator::MakeMacro(const Stmt& s, const std::shared_ptr<Frame>& frame,
                           const std::string& name) {
  // The macro refers to its defining scope weakly: a macro stored in that scope must not keep it
  // alive forever (a reference cycle); if the scope is gone we fall back to the globals.
  std::weak_ptr<Frame> weak = frame;
  const Stmt* stmt = &s;
  return Value::MakeCallable(name, [stmt, weak, name](CallArgs& args, Evaluator& ev) -> Value {
    std::shared_ptr<Frame> parent = weak.lock();
    if (!parent) parent = ev.globals_;
    if (++ev.call_depth_ > ev.limits_.max_call_depth) {
      --ev.call_depth_;
      Fail("maximum macro recursion depth (" + std::to_string(ev.limits_.max_call_depth) +
           ") exceeded in '" + name + "'");
    }
    struct DepthRestore {
      Evaluator* e;
      ~DepthRestore() { --e->call_depth_; }
    } restore{&ev};
    auto f = std::make_shared<Frame>(parent);
    const auto& params = stmt->params;
    if (args.positional.size() > params.size()) {
      Fail("macro '" + name + "' takes not more than " + std::to_string(params.size()) +
           " argument(s)");
    }
    std::vector<bool> bound(params.size(), false);
    for (size_t i = 0; i < args.positional.size(); ++i) {
      f->Set(params[i].name, args.positional[i]);
      bound[i] = true;
    }
    for (auto& [k, v] : args.keyword) {
      bool found = false;
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].name == k) {
          if (bound[i]) Fail("macro '" + name + "' got multiple values for argument '" + k + "'");
          f->Set(k, v);
          bound[i] = found = true;
        }
      }
      if (!found) {
        if (k == "caller") {
          f->Set("caller", v);
        } else {
          Fail("macro '" + name + "' was invoked with an unknown keyword argument '" + k + "'");
        }
      }
    }
    for (size_t i = 0; i < params.size(); ++i) {
      if (bound[i]) continue;
      f->Set(params[i].name,
             params[i].default_value
                 ? ev.Eval(*params[i].default_value, *f)
                 : Value::Undefined("parameter '" + params[i].name + "' was not provided"));
    }
    std::string out;
    ev.ExecBody(stmt->body, f, out);
    return Value::String(std::move(out));
  });
}

Value Evaluator::Call(const Value& fn, CallArgs& args) {
  DepthGuard depth(this);
  if (fn.is_undefined()) FailUndefined(fn);
  if (!fn.is_callable()) Fail("'" + fn.TypeName() + "' is not callable");
  return fn.callable().fn(args, *this);
}

void Evaluator::EvalArgs(const Expr& e, size_t first, Frame& frame, CallArgs* args) {
  for (size_t i = first; i < e.args.size(); ++i)
    args->positional.push_back(Eval(*e.args[i], frame));
  for (const auto& [k, v] : e.kwargs) args->keyword.emplace_back(k, Eval(*v, frame));
}

Value Evaluator::ApplyFilterChain(const Expr& chain, Value input, Frame& frame) {
  Value in = chain.args[0] ? ApplyFilterChain(*chain.args[0], std::move(input), frame) : input;
  CallArgs args;
  EvalArgs(chain, 1, frame, &args);
  return ApplyFilter(chain.name, std::move(in), args, *this);
}

Value Evaluator::Eval(const Expr& e, Frame& frame) {
  try {
    DepthGuard depth(this);
    return EvalInner(e, frame);
  } catch (JinjaError& err) {
    if (err.line == 0) {
      err.line = e.line;
      err.column = e.column;
    }
    throw;
  }
}

Value Evaluator::EvalInner(const Expr& e, Frame& frame) {
  switch (e.kind) {
    case Expr::Kind::kLiteral:
      return e.literal;
    case Expr::Kind::kName: {
      if (Value* v = frame.Lookup(e.name)) return *v;
      return Value::Undefined("'" + e.name + "' is undefined");
    }
    case Expr::Kind::kList:
    case Expr::Kind::kTuple: {
      std::vector<Value> items;
      items.reserve(e.args.size());
      for (const auto& a : e.args) items.push_back(Eval(*a, frame));
      return Value::MakeList(std::move(items), e.kind == Expr::Kind::kTuple);
    }
    case Expr::Kind::kDict: {
      Value d = Value::MakeDict();
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value k = Eval(*e.args[i], frame);
        if (!k.is_string()) Fail("dict keys must be strings, got " + k.TypeName());
        d.dict().Set(k.str(), Eval(*e.args[i + 1], frame));
      }
      return d;
    }
    case Expr::Kind::kGetAttr:
      return GetAttribute(Eval(*e.args[0], frame), e.name);
    case Expr::Kind::kGetItem:
      return GetItem(Eval(*e.args[0], frame), Eval(*e.args[1], frame));
    case Expr::Kind::kSlice: {
      Value obj = Eval(*e.args[0], frame);
      Value parts[3];
      for (int i = 0; i < 3; ++i) {
        parts[i] = e.args[i + 1] ? Eval(*e.args[i + 1], frame) : Value::None();
      }
      if (obj.is_undefined()) FailUndefined(obj);
      if (obj.is_string()) {
        const std::string& str = obj.str();
        std::string r;
        if (IsAscii(str)) {
          ForSlice(str.size(), parts[0], parts[1], parts[2], [&](size_t i) { r += str[i]; });
        } else {
          const std::vector<size_t> offs = CodePointOffsets(str);
          ForSlice(offs.size() - 1, parts[0], parts[1], parts[2],
                   [&](size_t i) { r.append(str, offs[i], offs[i + 1] - offs[i]); });
        }
        return Value::String(std::move(r));
      }
      if (obj.is_list()) {
        std::vector<Value> r;
        const auto& items = obj.list().items;
        ForSlice(items.size(), parts[0], parts[1], parts[2], [&](size_t i) {
          r.push_back(items[i]);
        });
        return Value::MakeList(std::move(r), obj.list().is_tuple);
      }
      Fail("'" + obj.TypeName() + "' is not subscriptable");
    }
    case Expr::Kind::kCall: {
      Value fn = Eval(*e.args[0], frame);
      CallArgs args;
      EvalArgs(e, 1, frame, &args);
      return Call(fn, args);
    }
    case Expr::Kind::kFilter: {
      Value input = Eval(*e.args[0], frame);
      CallArgs args;
      EvalArgs(e, 1, frame, &args);
      return ApplyFilter(e.name, std::move(input), args, *this);
    }
    case Expr::Kind::kTest: {
      Value v = Eval(*e.args[0], frame);
      CallArgs args;
      EvalArgs(e, 1, frame, &args);
      bool r = ApplyTest(e.name, v, args, *this);
      return Value::Bool(e.negated ? !r : r);
    }
    case Expr::Kind::kUnary: {
      Value v = Eval(*e.args[0], frame);
      if (e.name == "not") return Value::Bool(!v.Truthy());
      if (v.is_undefined()) FailUndefined(v);
      if (!v.is_number()) Fail("bad operand type for unary " + e.name + ": " + v.TypeName());
      if (e.name == "+") return v.is_float() ? v : Value::Int(v.as_int());
      if (v.is_float()) return Value::Float(-v.as_double());
      if (v.as_int() == std::numeric_limits<int64_t>::min()) Fail("integer overflow");
      return Value::Int(-v.as_int());
    }
    case Expr::Kind::kBinary:
      return EvalBinary(e, frame);
    case Expr::Kind::kCompare:
      return EvalCompare(e, frame);
    case Expr::Kind::kCondExpr: {
      if (Eval(*e.args[0], frame).Truthy()) return Eval(*e.args[1], frame);
      if (e.args[2]) return Eval(*e.args[2], frame);
      return Value::Undefined(
          "the inline if-expression evaluated to false and no else section was defined");
    }
  }
  Fail("internal error: unknown expression");
}

Value Evaluator::EvalBinary(const Expr& e, Frame& frame) {
  const std::string& op = e.name;
  if (op == "and") {
    Value l = Eval(*e.args[0], frame);
    return l.Truthy() ? Eval(*e.args[1], frame) : l;
  }
  if (op == "or") {
    Value l = Eval(*e.args[0], frame);
    return l.Truthy() ? l : Eval(*e.args[1], frame);
  }
  Value l = Eval(*e.args[0], frame);
  Value r = Eval(*e.args[1], frame);
  if (op == "~") {
    std::string ls = l.ToStr();
    const std::string rs = r.ToStr();
    CheckStringSize(ls.size() + rs.size());
    return Value::String(std::move(ls) + rs);
  }
  return Arith(op, l, r);
}

Value Evaluator::EvalCompare(const Expr& e, Frame& frame) {
  Value left = Eval(*e.args[0], frame);
  for (size_t i = 0; i < e.ops.size(); ++i) {
    Value right = Eval(*e.args[i + 1], frame);
    const std::string& op = e.ops[i];
    bool r;
    if (op == "==") {
      r = left.Equals(right);
    } else if (op == "!=") {
      r = !left.Equals(right);
    } else if (op == "<") {
      r = LessThan(left, right);
    } else if (op == ">") {
      r = LessThan(right, left);
    } else if (op == "<=") {
      r = !LessThan(right, left);
    } else if (op == ">=") {
      r = !LessThan(left, right);
    } else if (op == "in") {
      r = Contains(right, left);
    } else {
      r = !Contains(right, left);
    }
    if (!r) return Value::Bool(false);
    left = std::move(right);
  }
  return Value::Bool(true);
}

}  // namespace dl::jinja
