#include "template/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "template/jinja_builtins.h"
#include "template/jinja_lexer.h"

namespace dl::jinja {
namespace {

constexpr int kMaxDepth = 200;  // nesting limit: deep input must fail cleanly, not blow the stack
// Depth limit of one expression tree. Chains (a|f|g..., a.b.c..., a + b + c ...) are parsed by loops,
// not recursion, but build trees as deep as they are long.
constexpr int kMaxExprDepth = 256;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  std::unique_ptr<Template> Run() {
    auto t = std::make_unique<Template>();
    t->body = ParseBody({});
    if (Cur().type != TokenType::kEof) ErrorAt(Cur(), "unexpected tag");
    return t;
  }

 private:
  struct DepthGuard {
    explicit DepthGuard(Parser* p) : p(p) {
      if (++p->depth_ > kMaxDepth) p->ErrorAt(p->Cur(), "template nested too deeply");
    }
    ~DepthGuard() { --p->depth_; }
    Parser* p;
  };

  const Token& Cur() const { return toks_[i_]; }
  const Token& Peek(size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  void Advance() {
    if (i_ + 1 < toks_.size()) ++i_;
  }

  [[noreturn]] void ErrorAt(const Token& t, const std::string& message) {
    JinjaError e{message};
    e.line = t.line;
    e.column = t.column;
    throw e;
  }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case TokenType::kEof:
        return "end of template";
      case TokenType::kVarEnd:
        return "'}}'";
      case TokenType::kBlockEnd:
        return "'%}'";
      case TokenType::kText:
        return "template data";
      case TokenType::kString:
        return "string";
      default:
        return "'" + t.value + "'";
    }
  }

  bool IsOp(const char* op) const {
    return Cur().type == TokenType::kOperator && Cur().value == op;
  }
  bool IsName(const char* name) const {
    return Cur().type == TokenType::kName && Cur().value == name;
  }
  void ExpectOp(const char* op) {
    if (!IsOp(op)) ErrorAt(Cur(), std::string("expected '") + op + "', got " + Describe(Cur()));
    Advance();
  }
  std::string ExpectName() {
    if (Cur().type != TokenType::kName) ErrorAt(Cur(), "expected a name, got " + Describe(Cur()));
    std::string v = Cur().value;
    Advance();
    return v;
  }
  void ExpectBlockEnd() {
    if (Cur().type != TokenType::kBlockEnd) {
      ErrorAt(Cur(), "expected end of block tag '%}', got " + Describe(Cur()));
    }
    Advance();
  }

  ExprPtr NewExpr(Expr::Kind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->column = at.column;
    return e;
  }
  // Records the depth of a node whose children are attached; fails when it passes the limit.
  ExprPtr Seal(ExprPtr e) {
    int d = 0;
    for (const auto& a : e->args) {
      if (a) d = std::max(d, a->depth);
    }
    for (const auto& kv : e->kwargs) {
      if (kv.second) d = std::max(d, kv.second->depth);
    }
    e->depth = d + 1;
    if (e->depth > kMaxExprDepth) {
      JinjaError err{"expression nested deeper than " + std::to_string(kMaxExprDepth) +
                     " levels (each filter, attribute, call or operator in a chain is one level)"};
      err.line = e->line;
      err.column = e->column;
      throw err;
    }
    return e;
  }
  StmtPtr NewStmt(Stmt::Kind kind, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = at.line;
    s->column = at.column;
    return s;
  }

  // Parses statements until a block tag named in `end_tags` (left unconsumed, positioned on its
  // name) or the end of the template.
  Body ParseBody(const std::vector<std::string>& end_tags) {
    DepthGuard guard(this);
    Body body;
    while (true) {
      const Token& t = Cur();
      if (t.type == TokenType::kEof) {
        if (!end_tags.empty()) {
          ErrorAt(t, "unexpected end of template: expected '{% " + end_tags.back() +
                         " %}' (unclosed block)");
        }
        return body;
      }
      if (t.type == TokenType::kText) {
        auto s = NewStmt(Stmt::Kind::kText, t);
        s->text = t.value;
        body.push_back(std::move(s));
        Advance();
      } else if (t.type == TokenType::kVarBegin) {
        auto s = NewStmt(Stmt::Kind::kOutput, t);
        Advance();
        s->expr = ParseTuple();
        if (Cur().type != TokenType::kVarEnd) {
          ErrorAt(Cur(), "expected end of print statement '}}', got " + Describe(Cur()));
        }
        Advance();
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        const Token& name = Peek();
        if (name.type != TokenType::kName) ErrorAt(name, "expected a statement name after '{%'");
        if (std::find(end_tags.begin(), end_tags.end(), name.value) != end_tags.end()) {
          Advance();  // onto the name
          return body;
        }
        const std::string& kw = name.value;
        if (!end_tags.empty() && (kw.rfind("end", 0) == 0 || kw == "elif" || kw == "else")) {
          ErrorAt(name, "unexpected '{% " + kw + " %}': expected '{% " + end_tags.back() + " %}'");
        }
        Advance();
        body.push_back(ParseStatement());
      } else {
        ErrorAt(t, "unexpected " + Describe(t));
      }
    }
  }

  StmtPtr ParseStatement() {
    const Token& t = Cur();
    const std::string kw = t.value;
    if (kw == "if") return ParseIf();
    if (kw == "for") return ParseFor();
    if (kw == "set") return ParseSet();
    if (kw == "macro") return ParseMacro();
    if (kw == "call") return ParseCallBlock();
    if (kw == "filter") return ParseFilterBlock();
    if (kw == "break" || kw == "continue") {
      if (loop_depth_ == 0) ErrorAt(t, "'" + kw + "' outside of a loop");
      auto s = NewStmt(kw == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, t);
      Advance();
      ExpectBlockEnd();
      return s;
    }
    if (kw == "generation") {
      auto s = NewStmt(Stmt::Kind::kScope, t);
      Advance();
      ExpectBlockEnd();
      s->body = ParseBody({"endgeneration"});
      Advance();
      ExpectBlockEnd();
      return s;
    }
    if (kw.rfind("end", 0) == 0 || kw == "elif" || kw == "else") {
      ErrorAt(t, "unexpected '{% " + kw + " %}' (no open block to close)");
    }
    ErrorAt(t, "unknown tag '" + kw + "'");
  }

  StmtPtr ParseIf() {
    auto s = NewStmt(Stmt::Kind::kIf, Cur());
    Advance();
    while (true) {
      s->conditions.push_back(ParseTuple());
      ExpectBlockEnd();
      s->bodies.push_back(ParseBody({"elif", "else", "endif"}));
      std::string tag = Cur().value;
      Advance();
      if (tag == "elif") continue;
      if (tag == "else") {
        ExpectBlockEnd();
        s->else_body = ParseBody({"endif"});
        Advance();
      }
      ExpectBlockEnd();
      return s;
    }
  }

  StmtPtr ParseFor() {
    auto s = NewStmt(Stmt::Kind::kFor, Cur());
    Advance();
    bool paren = IsOp("(");
    if (paren) Advance();
    s->targets.push_back(ExpectName());
    while (IsOp(",")) {
      Advance();
      s->targets.push_back(ExpectName());
    }
    if (paren) ExpectOp(")");
    if (!IsName("in")) ErrorAt(Cur(), "expected 'in' in for loop, got " + Describe(Cur()));
    Advance();
    s->expr = ParseExpression(/*with_cond=*/false);
    if (IsName("if")) {
      Advance();
      s->cond = ParseExpression(true);
    }
    if (IsName("recursive")) ErrorAt(Cur(), "recursive for loops are not supported");
    ExpectBlockEnd();
    ++loop_depth_;
    s->body = ParseBody({"else", "endfor"});
    --loop_depth_;
    std::string tag = Cur().value;
    Advance();
    if (tag == "else") {
      ExpectBlockEnd();
      s->else_body = ParseBody({"endfor"});
      Advance();
    }
    ExpectBlockEnd();
    return s;
  }

  StmtPtr ParseSet() {
    const Token& at = Cur();
    Advance();
    std::vector<std::string> targets;
    std::string attr;
    targets.push_back(ExpectName());
    if (IsOp(".")) {
      Advance();
      attr = ExpectName();
    } else {
      while (IsOp(",")) {
        Advance();
        targets.push_back(ExpectName());
      }
    }
    if (IsOp("=")) {
      Advance();
      auto s = NewStmt(Stmt::Kind::kSet, at);
      s->targets = std::move(targets);
      s->attr = std::move(attr);
      s->expr = ParseTuple();
      ExpectBlockEnd();
      return s;
    }
    if (targets.size() != 1 || !attr.empty()) {
      ErrorAt(Cur(), "expected '=' in set statement");
    }
    auto s = NewStmt(Stmt::Kind::kSetBlock, at);
    s->targets = std::move(targets);
    if (IsOp("|")) s->expr = ParseFilterChain(nullptr);
    ExpectBlockEnd();
    s->body = ParseBody({"endset"});
    Advance();
    ExpectBlockEnd();
    return s;
  }

  void ParseParams(std::vector<MacroParam>* params) {
    ExpectOp("(");
    while (!IsOp(")")) {
      if (!params->empty()) ExpectOp(",");
      if (IsOp(")")) break;
      MacroParam p;
      p.name = ExpectName();
      if (IsOp("=")) {
        Advance();
        p.default_value = ParseExpression(true);
      }
      params->push_back(std::move(p));
    }
    Advance();
  }

  StmtPtr ParseMacro() {
    auto s = NewStmt(Stmt::Kind::kMacro, Cur());
    Advance();
    s->targets.push_back(ExpectName());
    ParseParams(&s->params);
    ExpectBlockEnd();
    int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = ParseBody({"endmacro"});
    loop_depth_ = saved;
    Advance();
    ExpectBlockEnd();
    return s;
  }

  StmtPtr ParseCallBlock() {
    auto s = NewStmt(Stmt::Kind::kCallBlock, Cur());
    Advance();
    if (IsOp("(")) ParseParams(&s->params);
    s->expr = ParseExpression(true);
    if (s->expr->kind != Expr::Kind::kCall) ErrorAt(Cur(), "expected a call in {% call %}");
    ExpectBlockEnd();
    s->body = ParseBody({"endcall"});
    Advance();
    ExpectBlockEnd();
    return s;
  }

  StmtPtr ParseFilterBlock() {
    auto s = NewStmt(Stmt::Kind::kFilterBlock, Cur());
    Advance();
    s->expr = ParseFilterChain(nullptr, /*leading_pipe=*/false);
    ExpectBlockEnd();
    s->body = ParseBody({"endfilter"});
    Advance();
    ExpectBlockEnd();
    return s;
  }

  // ---- expressions ----

  ExprPtr ParseTuple() {
    const Token& at = Cur();
    ExprPtr first = ParseExpression(true);
    if (!IsOp(",")) return first;
    auto t = NewExpr(Expr::Kind::kTuple, at);
    t->args.push_back(std::move(first));
    while (IsOp(",")) {
      Advance();
      if (Cur().type == TokenType::kVarEnd || Cur().type == TokenType::kBlockEnd) break;
      t->args.push_back(ParseExpression(true));
    }
    return Seal(std::move(t));
  }

  ExprPtr ParseExpression(bool with_cond) {
    DepthGuard guard(this);
    if (!with_cond) return ParseOr();
    ExprPtr expr1 = ParseOr();
    while (IsName("if")) {
      const Token& at = Cur();
      Advance();
      ExprPtr cond = ParseOr();
      ExprPtr else_expr;
      if (IsName("else")) {
        Advance();
        else_expr = ParseExpression(true);
      }
      auto e = NewExpr(Expr::Kind::kCondExpr, at);
      e->args.push_back(std::move(cond));
      e->args.push_back(std::move(expr1));
      e->args.push_back(std::move(else_expr));
      expr1 = Seal(std::move(e));
    }
    return expr1;
  }

  ExprPtr Binary(const Token& at, const std::string& op, ExprPtr l, ExprPtr r) {
    auto e = NewExpr(Expr::Kind::kBinary, at);
    e->name = op;
    e->args.push_back(std::move(l));
    e->args.push_back(std::move(r));
    return Seal(std::move(e));
  }

  ExprPtr ParseOr() {
    ExprPtr left = ParseAnd();
    while (IsName("or")) {
      const Token& at = Cur();
      Advance();
      left = Binary(at, "or", std::move(left), ParseAnd());
    }
    return left;
  }

  ExprPtr ParseAnd() {
    ExprPtr left = ParseNot();
    while (IsName("and")) {
      const Token& at = Cur();
      Advance();
      left = Binary(at, "and", std::move(left), ParseNot());
    }
    return left;
  }

  ExprPtr ParseNot() {
    DepthGuard guard(this);
    if (IsName("not")) {
      auto e = NewExpr(Expr::Kind::kUnary, Cur());
      e->name = "not";
      Advance();
      e->args.push_back(ParseNot());
      return Seal(std::move(e));
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    const Token& at = Cur();
    ExprPtr first = ParseMath1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (Cur().type == TokenType::kOperator &&
          (Cur().value == "==" || Cur().value == "!=" || Cur().value == "<" ||
           Cur().value == "<=" || Cur().value == ">" || Cur().value == ">=")) {
        op = Cur().value;
        Advance();
      } else if (IsName("in")) {
        op = "in";
        Advance();
      } else if (IsName("not") && Peek().type == TokenType::kName && Peek().value == "in") {
        op = "not in";
        Advance();
        Advance();
      } else {
        break;
      }
      if (!cmp) {
        cmp = NewExpr(Expr::Kind::kCompare, at);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(ParseMath1());
    }
    return cmp ? Seal(std::move(cmp)) : std::move(first);
  }

  ExprPtr ParseMath1() {
    ExprPtr left = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const Token& at = Cur();
      std::string op = at.value;
      Advance();
      left = Binary(at, op, std::move(left), ParseConcat());
    }
    return left;
  }

  ExprPtr ParseConcat() {
    ExprPtr left = ParseMath2();
    while (IsOp("~")) {
      const Token& at = Cur();
      Advance();
      left = Binary(at, "~", std::move(left), ParseMath2());
    }
    return left;
  }

  ExprPtr ParseMath2() {
    ExprPtr left = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token& at = Cur();
      std::string op = at.value;
      Advance();
      left = Binary(at, op, std::move(left), ParsePow());
    }
    return left;
  }

  ExprPtr ParsePow() {
    ExprPtr left = ParseUnary(true);
    while (IsOp("**")) {
      const Token& at = Cur();
      Advance();
      left = Binary(at, "**", std::move(left), ParseUnary(true));
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    DepthGuard guard(this);
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      node = NewExpr(Expr::Kind::kUnary, Cur());
      node->name = Cur().value;
      Advance();
      node->args.push_back(ParseUnary(false));
      node = Seal(std::move(node));
    } else {
      node = ParsePostfix(ParsePrimary());
    }
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr ParsePrimary() {
    const Token& t = Cur();
    switch (t.type) {
      case TokenType::kName: {
        const std::string& v = t.value;
        if (v == "true" || v == "True" || v == "false" || v == "False") {
          auto e = NewExpr(Expr::Kind::kLiteral, t);
          e->literal = Value::Bool(v[0] == 't' || v[0] == 'T');
          Advance();
          return e;
        }
        if (v == "none" || v == "None") {
          auto e = NewExpr(Expr::Kind::kLiteral, t);
          e->literal = Value::None();
          Advance();
          return e;
        }
        auto e = NewExpr(Expr::Kind::kName, t);
        e->name = v;
        Advance();
        return e;
      }
      case TokenType::kString: {
        auto e = NewExpr(Expr::Kind::kLiteral, t);
        std::string s;
        while (Cur().type == TokenType::kString) {  // adjacent literals concatenate
          s += Cur().value;
          Advance();
        }
        e->literal = Value::String(std::move(s));
        return e;
      }
      case TokenType::kInt: {
        auto e = NewExpr(Expr::Kind::kLiteral, t);
        e->literal = Value::Int(t.int_value);
        Advance();
        return e;
      }
      case TokenType::kFloat: {
        auto e = NewExpr(Expr::Kind::kLiteral, t);
        e->literal = Value::Float(t.float_value);
        Advance();
        return e;
      }
      case TokenType::kOperator:
        if (t.value == "(") {
          Advance();
          if (IsOp(")")) {
            Advance();
            auto e = NewExpr(Expr::Kind::kTuple, t);
            return e;
          }
          ExprPtr first = ParseExpression(true);
          if (IsOp(")")) {
            Advance();
            return first;
          }
          auto tup = NewExpr(Expr::Kind::kTuple, t);
          tup->args.push_back(std::move(first));
          while (IsOp(",")) {
            Advance();
            if (IsOp(")")) break;
            tup->args.push_back(ParseExpression(true));
          }
          ExpectOp(")");
          return Seal(std::move(tup));
        }
        if (t.value == "[") {
          auto e = NewExpr(Expr::Kind::kList, t);
          Advance();
          while (!IsOp("]")) {
            if (!e->args.empty()) ExpectOp(",");
            if (IsOp("]")) break;
            e->args.push_back(ParseExpression(true));
          }
          Advance();
          return Seal(std::move(e));
        }
        if (t.value == "{") {
          auto e = NewExpr(Expr::Kind::kDict, t);
          Advance();
          while (!IsOp("}")) {
            if (!e->args.empty()) ExpectOp(",");
            if (IsOp("}")) break;
            e->args.push_back(ParseExpression(true));
            ExpectOp(":");
            e->args.push_back(ParseExpression(true));
          }
          Advance();
          return Seal(std::move(e));
        }
        break;
      default:
        break;
    }
    ErrorAt(t, "unexpected " + Describe(t) + " in expression");
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".")) {
        const Token& at = Cur();
        Advance();
        if (Cur().type == TokenType::kName) {
          auto e = NewExpr(Expr::Kind::kGetAttr, at);
          e->name = Cur().value;
          e->args.push_back(std::move(node));
          Advance();
          node = Seal(std::move(e));
        } else if (Cur().type == TokenType::kInt) {
          auto e = NewExpr(Expr::Kind::kGetItem, at);
          e->args.push_back(std::move(node));
          auto idx = NewExpr(Expr::Kind::kLiteral, Cur());
          idx->literal = Value::Int(Cur().int_value);
          e->args.push_back(std::move(idx));
          Advance();
          node = Seal(std::move(e));
        } else {
          ErrorAt(Cur(), "expected an attribute name after '.'");
        }
      } else if (IsOp("[")) {
        node = ParseSubscript(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr node) {
    const Token& at = Cur();
    Advance();  // [
    ExprPtr parts[3];
    bool is_slice = false;
    int idx = 0;
    while (true) {
      if (IsOp(":")) {
        is_slice = true;
        if (++idx > 2) ErrorAt(Cur(), "too many ':' in slice");
        Advance();
        continue;
      }
      if (IsOp("]")) break;
      if (parts[idx]) ErrorAt(Cur(), "expected ']' or ':' in subscript");
      parts[idx] = ParseExpression(true);
    }
    Advance();  // ]
    if (!is_slice) {
      if (!parts[0]) ErrorAt(at, "empty subscript");
      auto e = NewExpr(Expr::Kind::kGetItem, at);
      e->args.push_back(std::move(node));
      e->args.push_back(std::move(parts[0]));
      return Seal(std::move(e));
    }
    auto e = NewExpr(Expr::Kind::kSlice, at);
    e->args.push_back(std::move(node));
    for (auto& p : parts) e->args.push_back(std::move(p));
    return Seal(std::move(e));
  }

  void ParseArgs(Expr* e) {
    ExpectOp("(");
    bool first = true;
    while (!IsOp(")")) {
      if (!first) ExpectOp(",");
      first = false;
      if (IsOp(")")) break;
      if (Cur().type == TokenType::kName && Peek().type == TokenType::kOperator &&
          Peek().value == "=") {
        std::string key = Cur().value;
        Advance();
        Advance();
        e->kwargs.emplace_back(key, ParseExpression(true));
      } else {
        if (!e->kwargs.empty()) ErrorAt(Cur(), "positional argument follows keyword argument");
        e->args.push_back(ParseExpression(true));
      }
    }
    Advance();
  }

  ExprPtr ParseCall(ExprPtr node) {
    auto e = NewExpr(Expr::Kind::kCall, Cur());
    e->args.push_back(std::move(node));
    ParseArgs(e.get());
    return Seal(std::move(e));
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp("|")) {
        node = ParseFilterChain(std::move(node), true, /*single=*/true);
      } else if (IsName("is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  // `| name(args) | name2 ...`; with leading_pipe false the first filter has no '|'.
  ExprPtr ParseFilterChain(ExprPtr input, bool leading_pipe = true, bool single = false) {
    bool first = true;
    while (first || IsOp("|")) {
      if (!first || leading_pipe) ExpectOp("|");
      first = false;
      const Token& at = Cur();
      std::string name = ExpectName();
      while (IsOp(".")) {
        Advance();
        name += '.';
        name += ExpectName();
      }
      if (!IsKnownFilter(name)) ErrorAt(at, "no filter named '" + name + "'");
      auto e = NewExpr(Expr::Kind::kFilter, at);
      e->name = name;
      e->args.push_back(std::move(input));
      if (IsOp("(")) ParseArgs(e.get());
      input = Seal(std::move(e));
      if (single) break;
    }
    return input;
  }

  ExprPtr ParseTest(ExprPtr node) {
    auto e = NewExpr(Expr::Kind::kTest, Cur());
    Advance();  // is
    if (IsName("not")) {
      e->negated = true;
      Advance();
    }
    const Token& at = Cur();
    std::string name = ExpectName();
    if (!IsKnownTest(name)) ErrorAt(at, "no test named '" + name + "'");
    e->name = name;
    e->args.push_back(std::move(node));
    if (IsOp("(")) {
      ParseArgs(e.get());
    } else {
      const Token& c = Cur();
      bool starts_arg =
          c.type == TokenType::kName || c.type == TokenType::kString || c.type == TokenType::kInt ||
          c.type == TokenType::kFloat ||
          (c.type == TokenType::kOperator && (c.value == "(" || c.value == "[" || c.value == "{"));
      if (starts_arg && !(c.type == TokenType::kName &&
                          (c.value == "else" || c.value == "or" || c.value == "and" ||
                           c.value == "is" || c.value == "if"))) {
        e->args.push_back(ParsePostfix(ParsePrimary()));
      }
    }
    return Seal(std::move(e));
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

std::unique_ptr<Template> ParseTemplate(const std::string& source) {
  return Parser(Tokenize(source)).Run();
}

}  // namespace dl::jinja
