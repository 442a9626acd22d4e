// Little binary messages between processes of one build (a tensor-parallel step plan, its replies):
// fixed-width integers and floats in host byte order, strings and vectors with a 64-bit count in
// front. The reader checks every length against the bytes left and names the field it was reading,
// so a truncated or corrupt message is a DataLoss error, never a read past the end or a huge
// allocation. Both ends are the same binary on the same machine (rank 0 re-executes itself), so host
// byte order and layout are shared; the messages carry their own magic and version.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "base/status.h"

namespace dl {

class ByteWriter {
 public:
  template <typename T>
    requires std::is_arithmetic_v<T> || std::is_enum_v<T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void PutString(std::string_view s) {
    Put<uint64_t>(s.size());
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    bytes_.insert(bytes_.end(), p, p + s.size());
  }
  template <typename T>
    requires std::is_arithmetic_v<T>
  void PutVector(std::span<const T> v) {
    Put<uint64_t>(v.size());
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    bytes_.insert(bytes_.end(), p, p + v.size_bytes());
  }
  void PutBytes(std::span<const std::byte> b) {
    Put<uint64_t>(b.size());
    bytes_.insert(bytes_.end(), b.begin(), b.end());
  }
  std::vector<std::byte>& bytes() { return bytes_; }
  std::vector<std::byte> Take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

class ByteReader {
 public:
  // `what` names the message in errors ("step plan").
  ByteReader(std::span<const std::byte> bytes, std::string what) : bytes_(bytes), what_(std::move(what)) {}

  template <typename T>
    requires std::is_arithmetic_v<T> || std::is_enum_v<T>
  Status Get(T* out, std::string_view field) {
    DL_RETURN_IF_ERROR(Need(sizeof(T), field));
    std::memcpy(out, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  // A message's header: its magic (what kind of message) and its format version, both as expected.
  Status GetHeader(uint32_t magic, uint32_t version) {
    uint32_t m = 0, v = 0;
    DL_RETURN_IF_ERROR(Get(&m, "magic"));
    if (m != magic) return DataLoss("{}: bad magic {:#x} (not a {})", what_, m, what_);
    DL_RETURN_IF_ERROR(Get(&v, "version"));
    if (v != version) return DataLoss("{}: version {}, this build reads version {}", what_, v, version);
    return Status::Ok();
  }
  // A count of elements of `element_bytes` each that must fit in what is left.
  Status GetCount(uint64_t* count, size_t element_bytes, std::string_view field) {
    DL_RETURN_IF_ERROR(Get(count, field));
    if (element_bytes > 0 && *count > remaining() / element_bytes) {
      return DataLoss("{}: {} says {} elements of {} bytes, but only {} bytes are left", what_, field, *count,
                      element_bytes, remaining());
    }
    return Status::Ok();
  }
  Status GetString(std::string* out, std::string_view field) {
    uint64_t n = 0;
    DL_RETURN_IF_ERROR(GetCount(&n, 1, field));
    out->assign(reinterpret_cast<const char*>(bytes_.data() + pos_), n);
    pos_ += n;
    return Status::Ok();
  }
  template <typename T>
    requires std::is_arithmetic_v<T>
  Status GetVector(std::vector<T>* out, std::string_view field) {
    uint64_t n = 0;
    DL_RETURN_IF_ERROR(GetCount(&n, sizeof(T), field));
    out->resize(n);
    std::memcpy(out->data(), bytes_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return Status::Ok();
  }
  // A view of the bytes PutBytes wrote (valid while the message is).
  Status GetBytes(std::span<const std::byte>* out, std::string_view field) {
    uint64_t n = 0;
    DL_RETURN_IF_ERROR(GetCount(&n, 1, field));
    *out = bytes_.subspan(pos_, n);
    pos_ += n;
    return Status::Ok();
  }
  // Every byte read: trailing bytes mean the two ends disagree on the format.
  Status ExpectEnd() const {
    if (remaining() != 0) return DataLoss("{}: {} unexpected bytes after the end", what_, remaining());
    return Status::Ok();
  }
  size_t remaining() const { return bytes_.size() - pos_; }
  const std::string& what() const { return what_; }

 private:
  Status Need(size_t n, std::string_view field) const {
    if (n > remaining()) {
      return DataLoss("{}: truncated at {} ({} bytes needed, {} left)", what_, field, n, remaining());
    }
    return Status::Ok();
  }

  std::span<const std::byte> bytes_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace dl
