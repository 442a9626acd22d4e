#include "base/dynamic_library.h"

namespace dl {

Result<OpenedLibrary> OpenFirstLibrary(const std::vector<std::string>& candidates) {
  std::string tried;
  for (const std::string& path : candidates) {
    dlerror();
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) return OpenedLibrary{h, path};
    const char* why = dlerror();
    tried += fmt::format("\n  {}: {}", path, why ? why : "unknown dlopen error");
  }
  return Unavailable("Tried:{}", tried);
}

}  // namespace dl
