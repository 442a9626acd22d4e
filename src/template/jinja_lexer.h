// Tokenizer for Jinja templates with Hugging Face's environment: trim_blocks and lstrip_blocks on,
// `-` / `+` whitespace control on tags, {# comments #} dropped, {% raw %} kept verbatim.
#pragma once

#include <string>
#include <vector>

#include "template/jinja_value.h"

namespace dl::jinja {

enum class TokenType {
  kText,        // template data between tags (whitespace control already applied)
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,
  kString,  // value already unescaped
  kInt,
  kFloat,
  kOperator,
  kEof,
};

struct Token {
  TokenType type;
  std::string value;
  int line = 1;
  int column = 1;
  int64_t int_value = 0;
  double float_value = 0;
};

struct LexOptions {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
};

// Throws JinjaError (with position) on malformed input: unclosed tags, strings or comments.
std::vector<Token> Tokenize(const std::string& source, const LexOptions& options = {});

}  // namespace dl::jinja
