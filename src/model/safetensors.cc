#include "model/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

namespace dl {

using nlohmann::json;

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// The safetensors reference implementation caps headers at 100 MB.
constexpr uint64_t kMaxHeaderSize = 100'000'000;

Status ParseEntry(const std::string& name, const json& v, uint64_t data_size, const std::string& path,
                  SafetensorsEntry* e) {
  if (!v.is_object()) return DataLoss("{}: tensor '{}': header entry is not an object", path, name);
  e->name = name;
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) return DataLoss("{}: tensor '{}': missing dtype", path, name);
  auto t = DTypeFromSafetensorsName(dt->get<std::string>());
  if (!t) {
    return Unimplemented("{}: tensor '{}': unsupported dtype '{}' (supported: BF16, F16, F32, F8_E4M3)", path,
                         name, dt->get<std::string>());
  }
  e->dtype = *t;
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) return DataLoss("{}: tensor '{}': missing shape", path, name);
  // Overflow-safe element count: every dimension is bounded by the data size.
  uint64_t numel = 1;
  for (const auto& d : *sh) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) {
      return DataLoss("{}: tensor '{}': bad shape entry {}", path, name, d.dump());
    }
    const uint64_t x = d.get<uint64_t>();
    if (x != 0 && numel > std::numeric_limits<uint64_t>::max() / 8 / x) {
      return DataLoss("{}: tensor '{}': shape {} overflows", path, name, sh->dump());
    }
    numel *= x;
    e->shape.push_back(static_cast<int64_t>(x));
  }
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned()) {
    return DataLoss("{}: tensor '{}': data_offsets must be two non-negative integers", path, name);
  }
  e->begin = (*off)[0].get<uint64_t>();
  e->end = (*off)[1].get<uint64_t>();
  if (e->end < e->begin) {
    return DataLoss("{}: tensor '{}': data_offsets [{}, {}] are reversed", path, name, e->begin, e->end);
  }
  if (e->end > data_size) {
    return DataLoss("{}: tensor '{}': data_offsets [{}, {}] run past the end of the data ({} bytes; file "
                    "truncated?)",
                    path, name, e->begin, e->end, data_size);
  }
  const uint64_t expect = numel * DTypeSize(e->dtype);
  if (e->end - e->begin != expect) {
    return DataLoss("{}: tensor '{}': {} bytes at data_offsets, but shape {} of {} needs {}", path, name,
                    e->end - e->begin, sh->dump(), dt->get<std::string>(), expect);
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<SafetensorsEntry>> ParseSafetensors(const uint8_t* data, size_t size,
                                                       const std::string& path,
                                                       std::map<std::string, std::string>* metadata) {
  if (size < 8) return DataLoss("{}: file is {} bytes, too short for a safetensors header", path, size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
  if (n > kMaxHeaderSize) return DataLoss("{}: header length {} is implausibly large (corrupt file?)", path, n);
  if (n > size - 8) {
    return DataLoss("{}: header length {} runs past the end of the file ({} bytes; truncated?)", path, n, size);
  }
  json h;
  try {
    h = json::parse(reinterpret_cast<const char*>(data) + 8, reinterpret_cast<const char*>(data) + 8 + n);
  } catch (const std::exception& e) {
    return DataLoss("{}: header is not valid JSON: {}", path, e.what());
  }
  if (!h.is_object()) return DataLoss("{}: header is not a JSON object", path);
  const uint64_t data_size = size - 8 - n;
  std::vector<SafetensorsEntry> out;
  out.reserve(h.size());
  try {
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) return DataLoss("{}: __metadata__ is not an object", path);
        if (metadata) {
          for (auto m = it->begin(); m != it->end(); ++m) {
            (*metadata)[m.key()] = m->is_string() ? m->get<std::string>() : m->dump();
          }
        }
        continue;
      }
      SafetensorsEntry e;
      DL_RETURN_IF_ERROR(ParseEntry(it.key(), *it, data_size, path, &e));
      e.data = data + 8 + n + e.begin;
      out.push_back(std::move(e));
    }
  } catch (const std::exception& e) {
    return DataLoss("{}: malformed header: {}", path, e.what());
  }
  // No two tensors may share bytes (empty tensors occupy nothing).
  std::vector<const SafetensorsEntry*> by_offset;
  for (const auto& e : out) {
    if (e.end > e.begin) by_offset.push_back(&e);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsEntry* a, const SafetensorsEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    if (by_offset[i]->begin < by_offset[i - 1]->end) {
      return DataLoss("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", path, by_offset[i - 1]->name,
                      by_offset[i - 1]->begin, by_offset[i - 1]->end, by_offset[i]->name, by_offset[i]->begin,
                      by_offset[i]->end);
    }
  }
  return out;
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  SafetensorsFile f;
  DL_ASSIGN_OR_RETURN(f.file_, MappedFile::Open(path));
  DL_ASSIGN_OR_RETURN(f.tensors_, ParseSafetensors(f.file_.data(), f.file_.size(), path, &f.metadata_));
  return f;
}

SafetensorsPlan PlanSafetensors(const std::vector<SafetensorsEntry>& entries,
                                const std::map<std::string, std::string>& metadata) {
  SafetensorsPlan plan;
  // ordered_json keeps __metadata__ first and the tensors in data order, like the Python writer.
  nlohmann::ordered_json h;
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    h["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const auto& e : entries) {
    SafetensorsEntry p = e;
    p.begin = offset;
    p.end = offset + static_cast<uint64_t>(e.numel()) * DTypeSize(e.dtype);
    p.data = nullptr;
    offset = p.end;
    h[p.name] = {{"dtype", std::string(DTypeSafetensorsName(p.dtype))},
                 {"shape", p.shape},
                 {"data_offsets", {p.begin, p.end}}};
    plan.entries.push_back(std::move(p));
  }
  plan.data_size = offset;
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t n = header.size();
  plan.prefix.resize(8);
  for (int i = 0; i < 8; ++i) plan.prefix[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  plan.prefix += header;
  return plan;
}

Status WriteSafetensorsFile(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                            const std::vector<const void*>& data,
                            const std::map<std::string, std::string>& metadata) {
  if (data.size() != entries.size()) return Internal("WriteSafetensorsFile: {} entries, {} buffers", entries.size(), data.size());
  SafetensorsPlan plan = PlanSafetensors(entries, metadata);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return NotFound("cannot create {}: {}", path, std::strerror(errno));
  bool ok = std::fwrite(plan.prefix.data(), 1, plan.prefix.size(), f) == plan.prefix.size();
  for (size_t i = 0; ok && i < entries.size(); ++i) {
    const size_t nb = plan.entries[i].nbytes();
    ok = nb == 0 || std::fwrite(data[i], 1, nb, f) == nb;
  }
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return DataLoss("writing {} failed: {}", path, std::strerror(errno));
  return Status::Ok();
}

}  // namespace dl
