#pragma once

#include <string>
#include <string_view>

#include "base/status.h"

namespace dl {

// Lower-case hex SHA-256 of a byte string.
std::string Sha256Hex(std::string_view bytes);
// Lower-case hex SHA-256 of a file's contents, streamed.
Result<std::string> Sha256File(const std::string& path);
// SHA-256 of the running executable (/proc/self/exe).
Result<std::string> Sha256OfSelf();

}  // namespace dl
