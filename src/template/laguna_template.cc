#include "template/laguna_template.h"

namespace dl {

std::string_view LagunaChatTemplate() {
  static constexpr std::string_view kText =
#include "laguna_chat_template.inc"
      ;
  return kText;
}

}  // namespace dl
