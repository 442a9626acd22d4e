#pragma once

#include <string_view>

namespace dl {

// The Laguna-style chat template (laguna-checkpoints.md §3.3) that generated models ship as
// chat_template.jinja; the same text as tests/data/chat_templates/laguna_chat_template.jinja.
std::string_view LagunaChatTemplate();

}  // namespace dl
