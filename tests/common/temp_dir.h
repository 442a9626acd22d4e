// A fresh directory under the system temp dir for one test, removed with everything in it when the
// value goes away.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

namespace dl::test_util {

class TempDir {
 public:
  // `prefix` names the test in the directory's name (prefix-XXXXXX).
  explicit TempDir(std::string_view prefix) {
    std::string t = (std::filesystem::temp_directory_path() / (std::string(prefix) + "-XXXXXX")).string();
    path_ = ::mkdtemp(t.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string operator/(const std::string& s) const { return (std::filesystem::path(path_) / s).string(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace dl::test_util
