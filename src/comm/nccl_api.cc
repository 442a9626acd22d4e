#include "comm/nccl_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "base/dynamic_library.h"

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

Result<OpenedLibrary> OpenNccl(const std::vector<std::string>& candidates) {
  auto opened = OpenFirstLibrary(candidates);
  if (!opened.ok()) {
    return Unavailable("cannot load NCCL (libnccl.so.2); install NCCL or set DECODELAB_NCCL_LIBRARY to its path. {}",
                       opened.status().message());
  }
  return opened;
}

}  // namespace

Result<std::string> FindNcclLibrary(const std::vector<std::string>& candidates) {
  DL_ASSIGN_OR_RETURN(OpenedLibrary opened, OpenNccl(candidates));
  // Keep it open: closing NCCL can run its destructors before a later real load.
  return opened.path;
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
  DL_ASSIGN_OR_RETURN(OpenedLibrary opened, OpenNccl(candidates));
  void* h = opened.handle;
  NcclApi api;
  api.library_path = opened.path;
  std::string missing;
  auto sym = [&](auto& fn, const char* name, bool required) { ResolveSymbol(h, fn, name, required, &missing); };
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
