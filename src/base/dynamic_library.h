// Libraries opened at run time (NCCL, cuBLASLt): the binary loads without them, and a feature that
// needs one says which paths it tried.
#pragma once

#include <dlfcn.h>

#include <string>
#include <type_traits>
#include <vector>

#include "base/status.h"

namespace dl {

struct OpenedLibrary {
  void* handle = nullptr;
  std::string path;  // the candidate that loaded
};
// dlopen (RTLD_NOW | RTLD_LOCAL) of the first candidate that loads. Otherwise Unavailable whose message
// is "Tried:" and a line per candidate with dlerror's reason (callers put what they wanted before it).
Result<OpenedLibrary> OpenFirstLibrary(const std::vector<std::string>& candidates);

// fn = the symbol `name` of `handle`; a required symbol that is absent appends " name" to *missing.
template <typename Fn>
void ResolveSymbol(void* handle, Fn& fn, const char* name, bool required, std::string* missing) {
  static_assert(std::is_pointer_v<Fn>, "a function pointer");
  fn = reinterpret_cast<Fn>(::dlsym(handle, name));
  if (fn == nullptr && required) *missing += " " + std::string(name);
}

}  // namespace dl
