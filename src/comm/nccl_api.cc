#include "comm/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

namespace dl::comm {

std::vector<std::string> DefaultNcclLibraryCandidates() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("DECODELAB_NCCL_LIBRARY"); env != nullptr && *env != '\0') {
    out.emplace_back(env);
  }
  out.emplace_back("libnccl.so.2");
  out.emplace_back("/usr/local/cuda/lib/libnccl.so.2");
  out.emplace_back("/usr/local/cuda/lib64/libnccl.so.2");
  return out;
}

namespace {

// dlopen the first candidate that loads; on failure the error lists every attempt.
Result<std::pair<void*, std::string>> OpenFirst(const std::vector<std::string>& candidates) {
  std::string tried;
  for (const std::string& path : candidates) {
    dlerror();
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) return std::make_pair(h, path);
    const char* why = dlerror();
    tried += fmt::format("\n  {}: {}", path, why ? why : "unknown dlopen error");
  }
  return Unavailable(
      "cannot load NCCL (libnccl.so.2); install NCCL or set DECODELAB_NCCL_LIBRARY to its path. "
      "Tried:{}",
      tried);
}

}  // namespace

Result<std::string> FindNcclLibrary(const std::vector<std::string>& candidates) {
  DL_ASSIGN_OR_RETURN(auto opened, OpenFirst(candidates));
  // Keep it open: closing NCCL can run its destructors before a later real load.
  return opened.second;
}

#if defined(DECODELAB_HAVE_NCCL_H)

bool BuiltWithNccl() {
  return true;
}

std::string NcclApi::Describe(ncclResult_t r, ncclComm_t comm) const {
  std::string s =
      GetErrorString ? GetErrorString(r) : fmt::format("ncclResult {}", static_cast<int>(r));
  if (GetLastError != nullptr) {
    const char* last = GetLastError(comm);
    if (last != nullptr && *last != '\0') s += fmt::format(" ({})", last);
  }
  return s;
}

Result<NcclApi> LoadNcclFrom(const std::vector<std::string>& candidates) {
  DL_ASSIGN_OR_RETURN(auto opened, OpenFirst(candidates));
  void* h = opened.first;
  NcclApi api;
  api.library_path = opened.second;
  std::string missing;
  auto sym = [&](auto& fn, const char* name, bool required) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
    if (fn == nullptr && required) missing += fmt::format(" {}", name);
  };
  sym(api.GetVersion, "ncclGetVersion", true);
  sym(api.GetUniqueId, "ncclGetUniqueId", true);
  sym(api.CommInitRankConfig, "ncclCommInitRankConfig", true);
  sym(api.CommGetAsyncError, "ncclCommGetAsyncError", true);
  sym(api.AllReduce, "ncclAllReduce", true);
  sym(api.CommFinalize, "ncclCommFinalize", true);
  sym(api.CommDestroy, "ncclCommDestroy", true);
  sym(api.CommAbort, "ncclCommAbort", true);
  sym(api.GetErrorString, "ncclGetErrorString", true);
  sym(api.GetLastError, "ncclGetLastError", false);
  sym(api.CommInitAll, "ncclCommInitAll", false);
  sym(api.AllGather, "ncclAllGather", false);
  if (!missing.empty()) {
    ::dlclose(h);
    return Unavailable("{} lacks{}; NCCL 2.14 or newer is needed", api.library_path, missing);
  }
  if (api.GetVersion(&api.version) != ncclSuccess) api.version = 0;
  return api;
}

Result<const NcclApi*> LoadNccl() {
  static std::once_flag once;
  static Result<NcclApi>* loaded = nullptr;
  std::call_once(
      once, [] { loaded = new Result<NcclApi>(LoadNcclFrom(DefaultNcclLibraryCandidates())); });
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

#else

bool BuiltWithNccl() {
  return false;
}

Status LoadNcclUnavailable() {
  return Unavailable(
      "this build of decodelab has no NCCL support (configure with CUDA where nccl.h is found)");
}

#endif

}  // namespace dl::comm
