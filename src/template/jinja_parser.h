// Parser for the Jinja subset used by Hugging Face chat templates. Grammar and operator precedence
// follow jinja2's parser (filters and tests bind tighter than arithmetic, `not` looser than
// comparisons, `a if c else b` loosest).
#pragma once

#include <memory>
#include <string>

#include "template/jinja_ast.h"

namespace dl::jinja {

// Throws JinjaError with a line/column on syntax errors and on unknown filters or tests (jinja2
// reports those when compiling the template, too).
std::unique_ptr<Template> ParseTemplate(const std::string& source);

}  // namespace dl::jinja
