// DecodeExperiments' host-side helpers that CPU-only builds need too (tests, bench's report).
#include "kernels/ops.h"

namespace dl::kernels {

unsigned ParseLateRelease(std::string_view list) {
  unsigned bits = 0;
  while (!list.empty()) {
    const size_t comma = list.find(',');
    const std::string_view name = list.substr(0, comma);
    for (size_t k = 0; k < std::size(kLateReleaseNames); ++k) {
      if (name == kLateReleaseNames[k]) bits |= 1u << k;
    }
    list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
  }
  return bits;
}

std::string LateReleaseList(unsigned bits) {
  std::string out;
  for (size_t k = 0; k < std::size(kLateReleaseNames); ++k) {
    if (!((bits >> k) & 1u)) continue;
    if (!out.empty()) out += ',';
    out += kLateReleaseNames[k];
  }
  return out;
}

}  // namespace dl::kernels
