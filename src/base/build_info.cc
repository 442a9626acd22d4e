#include "base/build_info.h"

#include "build_flags.inc"
#include "build_info.inc"

namespace dl {

std::string BuildCommit() {
  return std::string(DECODELAB_GIT_COMMIT) + (DECODELAB_GIT_DIRTY ? "-dirty" : "");
}

std::string BuildCompilers() {
  std::string s = DECODELAB_CXX_COMPILER;
  s += "; ";
  s += (std::string(DECODELAB_CUDA_COMPILER).empty() ? std::string("no CUDA")
                                                      : std::string(DECODELAB_CUDA_COMPILER));
  return s;
}

std::string BuildFlags() { return DECODELAB_BUILD_FLAGS; }

}  // namespace dl
