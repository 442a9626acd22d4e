// Syntax tree of a parsed Jinja template.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "template/jinja_value.h"

namespace dl::jinja {

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // args
    kTuple,     // args
    kDict,      // kwargs-like: keys in args[2i], values in args[2i+1]
    kGetAttr,   // args[0].name
    kGetItem,   // args[0][args[1]]
    kSlice,     // args[0][args[1]:args[2]:args[3]] (null = omitted)
    kCall,      // args[0](args[1..], kwargs)
    kFilter,    // args[0] | name(args[1..], kwargs); args[0] null inside {% filter %}
    kTest,      // args[0] is [not] name(args[1..]); negated
    kUnary,     // name is "-", "+", "not"
    kBinary,    // args[0] name args[1]; name: + - * / // % ** ~ and or in "not in"
    kCompare,   // args[0] ops[0] args[1] ops[1] args[2] ...
    kCondExpr,  // args[1] if args[0] else args[2] (args[2] may be null)
  };
  Kind kind;
  int line = 0;
  int column = 0;
  int depth = 1;  // of the subtree: evaluating and freeing it recurse this deep
  Value literal;
  std::string name;
  bool negated = false;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // may be null
};

struct Stmt {
  enum class Kind {
    kText,       // text
    kOutput,     // {{ expr }}
    kIf,         // conditions[i] -> bodies[i]; else_body
    kFor,        // targets in expr [if cond]: body [else else_body]
    kSet,        // targets (or ns attr) = expr
    kSetBlock,   // {% set name %}body{% endset %}
    kMacro,      // name(params): body
    kCallBlock,  // {% call(params) expr %}body{% endcall %}
    kBreak,
    kContinue,
    kFilterBlock,  // {% filter expr %}body{% endfilter %}; expr is a filter chain with null input
    kScope,        // body executed inline ({% generation %} of HF's AssistantTracker)
  };
  Kind kind;
  int line = 0;
  int column = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<std::string> targets;
  std::string attr;  // kSet on namespace: targets[0].attr = expr
  std::vector<ExprPtr> conditions;
  std::vector<Body> bodies;
  Body body;
  Body else_body;
  std::vector<MacroParam> params;
};

struct Template {
  Body body;
};

}  // namespace dl::jinja
