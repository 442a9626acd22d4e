#include "template/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "base/utf8.h"

namespace dl::jinja {
namespace {

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}
bool IsIdentStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool IsIdentChar(char c) {
  return IsIdentStart(c) || (c >= '0' && c <= '9');
}
bool IsDigit(char c) {
  return c >= '0' && c <= '9';
}

using ::dl::AppendUtf8;

class Lexer {
 public:
  Lexer(const std::string& src, const LexOptions& options) : src_(src), options_(options) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> Run() {
    const size_t n = src_.size();
    while (pos_ < n) {
      size_t start = FindTagStart(pos_);
      if (start == std::string::npos) {
        EmitText(src_.substr(pos_), pos_);
        break;
      }
      std::string text = src_.substr(pos_, start - pos_);
      const char kind = src_[start + 1];
      const char ctrl = start + 2 < n ? src_[start + 2] : '\0';
      const bool has_ctrl = ctrl == '-' || ctrl == '+';
      if (ctrl == '-') {
        size_t e = text.size();
        while (e > 0 && IsSpace(text[e - 1])) --e;
        text.resize(e);
      } else if (ctrl != '+' && kind != '{' && options_.lstrip_blocks) {
        LStrip(text, pos_ == 0 || src_[pos_ - 1] == '\n');
      }
      EmitText(text, pos_);
      size_t body = start + 2 + (has_ctrl ? 1 : 0);
      if (kind == '#') {
        size_t end = src_.find("#}", body);
        if (end == std::string::npos) Error(start, "unclosed comment: missing '#}'");
        char end_ctrl =
            (end > body && (src_[end - 1] == '-' || src_[end - 1] == '+')) ? src_[end - 1] : '\0';
        pos_ = AfterTagEnd(end + 2, end_ctrl, /*is_block=*/true);
      } else if (kind == '{') {
        Push(TokenType::kVarBegin, "{{", start);
        pos_ = LexInside(body, start, /*is_block=*/false);
      } else {
        if (TryRaw(body, start)) continue;
        Push(TokenType::kBlockBegin, "{%", start);
        pos_ = LexInside(body, start, /*is_block=*/true);
      }
    }
    Push(TokenType::kEof, "", src_.size());
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void Error(size_t offset, const std::string& message) {
    JinjaError e{message};
    LineCol(offset, &e.line, &e.column);
    throw e;
  }

  void LineCol(size_t offset, int* line, int* col) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    size_t idx = static_cast<size_t>(it - line_starts_.begin()) - 1;
    *line = static_cast<int>(idx + 1);
    *col = static_cast<int>(offset - line_starts_[idx] + 1);
  }

  void Push(TokenType type, std::string value, size_t offset) {
    Token t{type, std::move(value)};
    LineCol(offset, &t.line, &t.column);
    tokens_.push_back(std::move(t));
  }

  void EmitText(const std::string& text, size_t offset) {
    if (!text.empty()) Push(TokenType::kText, text, offset);
  }

  size_t FindTagStart(size_t from) const {
    size_t p = from;
    while (true) {
      p = src_.find('{', p);
      if (p == std::string::npos || p + 1 >= src_.size()) return std::string::npos;
      char c = src_[p + 1];
      if (c == '{' || c == '%' || c == '#') return p;
      ++p;
    }
  }

  // lstrip_blocks: drop spaces/tabs between the start of the line and a block or comment tag.
  // `line_starting` says whether `text` itself begins at the start of a line.
  static void LStrip(std::string& text, bool line_starting) {
    size_t nl = text.rfind('\n');
    size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
    if (l_pos == 0 && !line_starting) return;
    if (l_pos == text.size()) return;
    for (size_t i = l_pos; i < text.size(); ++i) {
      if (!IsSpace(text[i])) return;
    }
    text.resize(l_pos);
  }

  // Position after a closing delimiter that ends at `p`, applying `-` (strip all whitespace),
  // `+` (keep) or trim_blocks (drop one newline after a block or comment tag).
  size_t AfterTagEnd(size_t p, char ctrl, bool is_block) const {
    if (ctrl == '-') {
      while (p < src_.size() && IsSpace(src_[p])) ++p;
    } else if (ctrl != '+' && is_block && options_.trim_blocks) {
      if (p < src_.size() && src_[p] == '\n') ++p;
    }
    return p;
  }

  // {% raw %} ... {% endraw %}: the body is text, never parsed.
  bool TryRaw(size_t body, size_t tag_start) {
    size_t p = body;
    while (p < src_.size() && IsSpace(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && IsIdentChar(src_[p + 3]))) {
      return false;
    }
    p += 3;
    while (p < src_.size() && IsSpace(src_[p])) ++p;
    char ctrl = '\0';
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ctrl = src_[p++];
    if (src_.compare(p, 2, "%}") != 0) return false;
    size_t content_start = AfterTagEnd(p + 2, ctrl, true);
    // Find {%[-+]? endraw [-+]?%}
    size_t q = content_start;
    while (true) {
      q = src_.find("{%", q);
      if (q == std::string::npos) Error(tag_start, "unclosed raw block: missing '{% endraw %}'");
      size_t r = q + 2;
      char open_ctrl = '\0';
      if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) open_ctrl = src_[r++];
      while (r < src_.size() && IsSpace(src_[r])) ++r;
      if (src_.compare(r, 6, "endraw") == 0) {
        r += 6;
        while (r < src_.size() && IsSpace(src_[r])) ++r;
        char close_ctrl = '\0';
        if (r < src_.size() && (src_[r] == '-' || src_[r] == '+')) close_ctrl = src_[r++];
        if (src_.compare(r, 2, "%}") == 0) {
          std::string text = src_.substr(content_start, q - content_start);
          if (open_ctrl == '-') {
            size_t e = text.size();
            while (e > 0 && IsSpace(text[e - 1])) --e;
            text.resize(e);
          } else if (open_ctrl != '+' && options_.lstrip_blocks) {
            LStrip(text, content_start == 0 || src_[content_start - 1] == '\n');
          }
          EmitText(text, content_start);
          pos_ = AfterTagEnd(r + 2, close_ctrl, true);
          return true;
        }
      }
      q += 2;
    }
  }

  // Lexes expression tokens from `p` up to and including the closing delimiter; returns the
  // position after it (whitespace control applied).
  size_t LexInside(size_t p, size_t tag_start, bool is_block) {
    std::vector<char> balance;
    const size_t n = src_.size();
    while (true) {
      while (p < n && IsSpace(src_[p])) ++p;
      if (p >= n) {
        Error(tag_start, is_block ? "unclosed block tag: missing '%}'"
                                  : "unclosed variable tag: missing '}}'");
      }
      // Closing delimiter (only outside brackets for }}).
      if (is_block) {
        char ctrl = '\0';
        size_t q = p;
        if (src_[q] == '-' || src_[q] == '+') ctrl = src_[q++];
        if (src_.compare(q, 2, "%}") == 0) {
          Push(TokenType::kBlockEnd, "%}", p);
          return AfterTagEnd(q + 2, ctrl, true);
        }
      } else if (balance.empty()) {
        char ctrl = '\0';
        size_t q = p;
        if (src_[q] == '-') ctrl = src_[q++];
        if (src_.compare(q, 2, "}}") == 0) {
          Push(TokenType::kVarEnd, "}}", p);
          return AfterTagEnd(q + 2, ctrl, false);
        }
      }
      char c = src_[p];
      if (c == '"' || c == '\'') {
        p = LexString(p);
      } else if (IsDigit(c)) {
        p = LexNumber(p);
      } else if (IsIdentStart(c)) {
        size_t s = p;
        while (p < n && IsIdentChar(src_[p])) ++p;
        Push(TokenType::kName, src_.substr(s, p - s), s);
      } else {
        static const char* kTwo[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* t : kTwo) {
          if (src_.compare(p, 2, t) == 0) {
            op = t;
            break;
          }
        }
        if (op.empty()) {
          if (std::string("+-*/%~<>=()[]{},.:|").find(c) == std::string::npos) {
            Error(p, std::string("unexpected character '") + c + "' in tag");
          }
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") {
          balance.push_back(c);
        } else if (op == ")" || op == "]" || op == "}") {
          char want = op == ")" ? '(' : op == "]" ? '[' : '{';
          if (balance.empty() || balance.back() != want) Error(p, "unexpected '" + op + "'");
          balance.pop_back();
        }
        Push(TokenType::kOperator, op, p);
        p += op.size();
      }
    }
  }

  size_t LexString(size_t p) {
    const char quote = src_[p];
    size_t start = p++;
    std::string value;
    while (true) {
      if (p >= src_.size()) Error(start, "unterminated string literal");
      char c = src_[p];
      if (c == quote) {
        ++p;
        break;
      }
      if (c != '\\') {
        value += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) Error(start, "unterminated string literal");
      char e = src_[p + 1];
      p += 2;
      // Python unicode-escape semantics (what jinja2 applies to string literals).
      switch (e) {
        case '\\':
          value += '\\';
          break;
        case '\'':
          value += '\'';
          break;
        case '"':
          value += '"';
          break;
        case 'a':
          value += '\a';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'n':
          value += '\n';
          break;
        case 'r':
          value += '\r';
          break;
        case 't':
          value += '\t';
          break;
        case 'v':
          value += '\v';
          break;
        case '\n':
          break;  // line continuation
        case 'x':
        case 'u':
        case 'U': {
          size_t len = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (p + len > src_.size()) Error(start, "truncated \\" + std::string(1, e) + " escape");
          std::string hex = src_.substr(p, len);
          for (char h : hex) {
            if (!std::isxdigit(static_cast<unsigned char>(h))) {
              Error(start, "truncated \\" + std::string(1, e) + " escape");
            }
          }
          uint32_t cp = static_cast<uint32_t>(std::strtoul(hex.c_str(), nullptr, 16));
          if (cp > 0x10FFFF) Error(start, "illegal Unicode character in string escape");
          AppendUtf8(value, cp);
          p += len;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = e - '0';
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k) {
              cp = cp * 8 + (src_[p++] - '0');
            }
            AppendUtf8(value, cp);
          } else {
            value += '\\';
            value += e;
          }
      }
    }
    Push(TokenType::kString, value, start);
    return p;
  }

  size_t LexNumber(size_t p) {
    size_t start = p;
    auto digits = [&] {
      while (p < src_.size() && (IsDigit(src_[p]) ||
                                 (src_[p] == '_' && p + 1 < src_.size() && IsDigit(src_[p + 1])))) {
        ++p;
      }
    };
    digits();
    bool is_float = false;
    bool after_dot = !tokens_.empty() && tokens_.back().type == TokenType::kOperator &&
                     tokens_.back().value == ".";
    if (!after_dot && p + 1 < src_.size() && src_[p] == '.' && IsDigit(src_[p + 1])) {
      is_float = true;
      ++p;
      digits();
    }
    if (!after_dot && p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && IsDigit(src_[q])) {
        is_float = true;
        p = q;
        digits();
      }
    }
    std::string text;
    for (size_t i = start; i < p; ++i) {
      if (src_[i] != '_') text += src_[i];
    }
    Push(is_float ? TokenType::kFloat : TokenType::kInt, text, start);
    if (is_float) {
      tokens_.back().float_value = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      long long v = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) Error(start, "integer literal out of range: " + text);
      tokens_.back().int_value = v;
    }
    return p;
  }

  const std::string& src_;
  LexOptions options_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
  size_t pos_ = 0;
};

}  // namespace

std::vector<Token> Tokenize(const std::string& source, const LexOptions& options) {
  // Like jinja2: line endings are normalised to "\n" and, without keep_trailing_newline, one
  // trailing newline of the template source is dropped.
  std::string text;
  text.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      text += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      text += source[i];
    }
  }
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return Lexer(text, options).Run();
}

}  // namespace dl::jinja
