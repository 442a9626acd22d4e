// Safetensors files: parsing a mapped file with every offset checked (a corrupt or hostile file gives
// a Status naming the file and tensor, never a crash), and planning/writing files in the exact
// layout the Python `safetensors` package produces (8-byte little-endian header length, JSON header
// padded with spaces to a multiple of 8, "__metadata__": {"format": "pt"}, data in header order).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/mapped_file.h"
#include "base/status.h"

namespace dl {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section (after the header)
  uint64_t end = 0;
  const uint8_t* data = nullptr;  // set by the parser: points into the mapped file

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

// Parses the header of the safetensors bytes [data, data+size). `path` is only used in messages.
// Checks: header length within the file, valid JSON object, known dtypes, non-negative shapes whose
// byte size matches the offsets, offsets inside the data section, no overlapping tensors.
Result<std::vector<SafetensorsEntry>> ParseSafetensors(const uint8_t* data, size_t size,
                                                       const std::string& path,
                                                       std::map<std::string, std::string>* metadata = nullptr);

// A mapped safetensors file and its parsed tensors.
class SafetensorsFile {
 public:
  static Result<SafetensorsFile> Open(const std::string& path);
  const std::string& path() const { return file_.path(); }
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  MappedFile file_;
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Layout of a file to be written: the full prefix (8-byte length + padded JSON header) and each
// entry's [begin, end) in the data section, assigned in the given order.
struct SafetensorsPlan {
  std::string prefix;
  std::vector<SafetensorsEntry> entries;
  uint64_t data_size = 0;
  uint64_t file_size() const { return prefix.size() + data_size; }
};
SafetensorsPlan PlanSafetensors(const std::vector<SafetensorsEntry>& entries,
                                const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Writes a small file at once: `data[i]` holds entries[i]'s bytes (for tests and fixtures).
Status WriteSafetensorsFile(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                            const std::vector<const void*>& data,
                            const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace dl
