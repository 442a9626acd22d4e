// What this binary was built from: recorded in bench JSON, lab manifests and /v1/decodelab/state.
#pragma once

#include <string>

namespace dl {

std::string BuildCommit();  // short commit, with "-dirty" when tracked files differed at build time
std::string BuildCompilers();  // "g++ 12.2.0; nvcc 13.0.88" or "g++ 12.2.0; no CUDA"
// How the build was configured: "Release, CUDA ON (architectures 90), no sanitizers, C++ flags ...".
std::string BuildFlags();

}  // namespace dl
