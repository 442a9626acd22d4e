#include "kv_cache/kv_scales.h"

#include <cmath>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "base/file_util.h"

namespace dl {

std::string FloatBitsHex(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return fmt::format("0x{:08x}", u);
}

static bool ParseBits(const std::string& s, float* out) {
  if (s.size() != 10 || s[0] != '0' || s[1] != 'x') return false;
  uint32_t u = 0;
  for (size_t i = 2; i < s.size(); ++i) {
    char c = s[i];
    uint32_t d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    u = (u << 4) | d;
  }
  std::memcpy(out, &u, 4);
  return true;
}

nlohmann::json KvScales::ToJson() const {
  nlohmann::json rows = nlohmann::json::array();
  for (size_t l = 0; l < k.size(); ++l) {
    rows.push_back({{"layer", l},
                    {"k_scale", k[l]},
                    {"v_scale", v[l]},
                    {"k_scale_bits", FloatBitsHex(k[l])},
                    {"v_scale_bits", FloatBitsHex(v[l])}});
  }
  return {{"source", source}, {"layers", rows}};
}

bool KvScales::BitwiseEqual(const KvScales& o) const {
  if (k.size() != o.k.size() || v.size() != o.v.size()) return false;
  return std::memcmp(k.data(), o.k.data(), k.size() * 4) == 0 &&
         std::memcmp(v.data(), o.v.data(), v.size() * 4) == 0;
}

Result<KvScales> ReadKvScalesFile(const std::string& path, int num_layers) {
  auto parsed = ReadJsonFile(path, kMaxJsonSidecarBytes);
  if (!parsed.ok()) return parsed.status().WithContext("KV scales file");
  const nlohmann::json& j = *parsed;
  if (!j.is_object() || j.value("format", "") != "decodelab-kv-scales") {
    return InvalidArgument("{} is not a decodelab KV scales file (\"format\" must be "
                           "\"decodelab-kv-scales\")", path);
  }
  if (!j.contains("layers") || !j["layers"].is_array()) {
    return InvalidArgument("KV scales file {}: missing \"layers\" array", path);
  }
  const auto& rows = j["layers"];
  if (static_cast<int>(rows.size()) != num_layers) {
    return InvalidArgument("KV scales file {} has {} layers, the model has {}", path, rows.size(),
                           num_layers);
  }
  KvScales s;
  s.k.assign(num_layers, 0.0f);
  s.v.assign(num_layers, 0.0f);
  std::vector<bool> seen(num_layers, false);
  for (const auto& r : rows) {
    if (!r.is_object() || !r.contains("layer") || !r["layer"].is_number_integer()) {
      return InvalidArgument("KV scales file {}: every row needs an integer \"layer\"", path);
    }
    const int l = r["layer"].get<int>();
    if (l < 0 || l >= num_layers || seen[l]) {
      return InvalidArgument("KV scales file {}: layer {} out of range or repeated", path, l);
    }
    seen[l] = true;
    for (const char* which : {"k", "v"}) {
      float value = 0.0f;
      const std::string bits_key = std::string(which) + "_scale_bits";
      const std::string key = std::string(which) + "_scale";
      if (r.contains(bits_key)) {
        if (!r[bits_key].is_string() || !ParseBits(r[bits_key].get<std::string>(), &value)) {
          return InvalidArgument("KV scales file {}: layer {} {} must look like 0x3c4985f0", path, l,
                                 bits_key);
        }
      } else if (r.contains(key) && r[key].is_number()) {
        value = static_cast<float>(r[key].get<double>());
      } else {
        return InvalidArgument("KV scales file {}: layer {} lacks {}", path, l, key);
      }
      if (!std::isfinite(value) || value <= 0.0f) {
        return InvalidArgument("KV scales file {}: layer {} {} = {} is not a positive finite number",
                               path, l, key, value);
      }
      (which[0] == 'k' ? s.k : s.v)[l] = value;
    }
  }
  s.source = "file:" + path;
  return s;
}

Status WriteKvScalesFile(const std::string& path, const KvScales& scales, const std::string& method,
                         const nlohmann::json& model_identity) {
  nlohmann::json j = {{"format", "decodelab-kv-scales"},
                      {"version", 1},
                      {"num_layers", scales.k.size()},
                      {"method", method},
                      {"model", model_identity},
                      {"layers", scales.ToJson()["layers"]}};
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) return NotFound("cannot write {}", tmp);
    out << j.dump(2) << "\n";
    if (!out) return DataLoss("write to {} failed", tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return DataLoss("cannot rename {} to {}", tmp, path);
  }
  return Status::Ok();
}

float Fp8ScaleFromAmax(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  return amax / 448.0f;
}

}  // namespace dl
