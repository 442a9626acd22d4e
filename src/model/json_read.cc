#include "model/json_read.h"

#include <cmath>

namespace dl {

std::string ShowJson(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

Status JsonInt(const nlohmann::json& v, const std::string& key, int64_t lo, int64_t hi, int64_t* out) {
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) {
      return InvalidArgument("key '{}' is {}, outside [{}, {}]", key, u, lo, hi);
    }
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
             std::fabs(v.get<double>()) < 9e15) {
    x = static_cast<int64_t>(v.get<double>());
  } else {
    return InvalidArgument("key '{}' must be an integer, got {}", key, ShowJson(v));
  }
  if (x < lo || x > hi) return InvalidArgument("key '{}' is {}, outside [{}, {}]", key, x, lo, hi);
  *out = x;
  return Status::Ok();
}

}  // namespace dl
