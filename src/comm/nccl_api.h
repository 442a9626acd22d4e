// NCCL, opened at run time. decodelab never links libnccl: the binary must load and run its CPU
// paths where NCCL is absent, and a missing NCCL must be a clear error at the stage that needs it
// (the probe classifies it as a rank failing before `comm-initialised`). nccl.h is used for its
// types only, and only when the build found it (DECODELAB_HAVE_NCCL_H, set by
// src/comm/CMakeLists.txt).
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

#if defined(DECODELAB_HAVE_NCCL_H)
#include <nccl.h>
#endif

namespace dl::comm {

// Where LoadNccl looks, in order: $DECODELAB_NCCL_LIBRARY when set, then "libnccl.so.2" (the
// loader's search path: LD_LIBRARY_PATH, ldconfig cache, system lib dirs), then the CUDA toolkit's
// copies
// (/usr/local/cuda/lib/libnccl.so.2, /usr/local/cuda/lib64/libnccl.so.2).
std::vector<std::string> DefaultNcclLibraryCandidates();

// True when this build can talk to NCCL at all (it found nccl.h and the CUDA runtime headers).
bool BuiltWithNccl();

#if defined(DECODELAB_HAVE_NCCL_H)

// The functions decodelab uses, resolved from one dlopen'ed libnccl.
struct NcclApi {
  std::string library_path;  // the candidate that loaded
  int version = 0;           // ncclGetVersion, e.g. 22809

  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclCommFinalize) CommFinalize = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;  // may stay null on old NCCL
  // The tensor-parallel device communicator's (comm/device_communicator.h): looked up, not required,
  // so the probe keeps loading any NCCL it loaded before; CreateNcclGroup refuses when they are null.
  decltype(&::ncclCommInitAll) CommInitAll = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;

  // "ncclAllReduce: unhandled system error (<last error>)" for messages.
  std::string Describe(ncclResult_t r, ncclComm_t comm) const;
};

// Loads NCCL once per process (later calls return the same table or the same error). The error
// lists every path tried and dlerror()'s reason.
Result<const NcclApi*> LoadNccl();
// Loads from the given candidates without caching (tests; explicit library choice).
Result<NcclApi> LoadNcclFrom(const std::vector<std::string>& candidates);

#else

// Without nccl.h the loader still reports clearly why NCCL cannot be used.
Status LoadNcclUnavailable();

#endif

// dlopen probe with no NCCL types: the path that loaded, or an error listing every path tried.
// Available in every build (the probe's --help / diagnostics and the tests use it).
Result<std::string> FindNcclLibrary(const std::vector<std::string>& candidates);

}  // namespace dl::comm
