#include "server/unique_id.h"

#include <atomic>
#include <cstdint>
#include <random>

#include <fmt/format.h>

namespace dl::api {

std::string UniqueId(std::string_view prefix) {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                               std::random_device{}();
  return fmt::format("{}-{:016x}{:08x}", prefix, salt, counter.fetch_add(1));
}

}  // namespace dl::api
