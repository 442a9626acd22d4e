// Tree-walking evaluator: renders a parsed template against a context, with jinja2's scoping (a for
// loop body and a macro get their own scope; `set` inside a loop does not leak out, which is why
// templates use namespace()) and jinja2's default Undefined (prints as "", iterates as empty, fails
// on attribute access).
#pragma once

#include <memory>
#include <string>
#include <unordered_map>

#include "template/jinja_ast.h"
#include "template/jinja_value.h"

namespace dl::jinja {

struct Frame {
  explicit Frame(std::shared_ptr<Frame> parent_frame) : parent(std::move(parent_frame)) {}
  Value* Lookup(const std::string& name);
  void Set(const std::string& name, Value value) { vars[name] = std::move(value); }

  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Frame> parent;
};

class Evaluator {
 public:
  explicit Evaluator(RenderLimits limits = {}) : limits_(limits) {}

  // Renders `tmpl` with the variables of `context` (a dict) on top of the built-in globals, under a
  // RenderBudget of the limits (the caller's, when one is installed on this thread already).
  // Throws JinjaError.
  std::string Render(const Template& tmpl, const Value& context);

  // Calls a callable value (macro, builtin, method).
  Value Call(const Value& fn, CallArgs& args);
  // Applies a filter chain parsed with a null innermost input ({% filter %}, {% set x | f %}).
  Value ApplyFilterChain(const Expr& chain, Value input, Frame& frame);

  // Used by loops and builtins to bound runaway templates.
  void CountIterations(int64_t n);

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  Flow ExecBody(const Body& body, const std::shared_ptr<Frame>& frame, std::string& out);
  Flow ExecStmt(const Stmt& s, const std::shared_ptr<Frame>& frame, std::string& out);
  Flow ExecFor(const Stmt& s, const std::shared_ptr<Frame>& frame, std::string& out);
  void ExecSet(const Stmt& s, Frame& frame, Value value);
  Value MakeMacro(const Stmt& s, const std::shared_ptr<Frame>& frame, const std::string& name);

  Value Eval(const Expr& e, Frame& frame);
  Value EvalInner(const Expr& e, Frame& frame);
  Value EvalBinary(const Expr& e, Frame& frame);
  Value EvalCompare(const Expr& e, Frame& frame);
  void EvalArgs(const Expr& e, size_t first, Frame& frame, CallArgs* args);

  void Append(std::string& out, const std::string& s);

  // Counts one level of nested evaluation (and one step) for as long as it lives.
  struct DepthGuard {
    explicit DepthGuard(Evaluator* e);
    ~DepthGuard() { --ev->eval_depth_; }
    Evaluator* ev;
  };

  RenderLimits limits_;
  int call_depth_ = 0;
  int eval_depth_ = 0;
  int64_t iterations_ = 0;
  std::shared_ptr<Frame> globals_;
};

// `obj.name` with jinja2's rules (dict keys, methods of str/dict/list, Undefined for missing).
Value GetAttribute(const Value& obj, const std::string& name);
// `obj[key]`.
Value GetItem(const Value& obj, const Value& key);

}  // namespace dl::jinja
