// cuBLASLt, opened at run time (libcublasLt.so.13 from the CUDA toolkit): the binary loads without it,
// and what needs it (the BF16 peak measurement, the prompt rows' library GEMM) says which paths it
// tried. CUDA builds only.
#pragma once

#if defined(DECODELAB_HAVE_CUDA)

#include <cublasLt.h>

#include <string>

#include "base/status.h"

namespace dl::cuda {

// The entry points decodelab uses, resolved once per process.
struct CublasLt {
  std::string path;  // the library file that loaded
  size_t version = 0;  // cublasLtGetVersion(): major * 10000 + minor * 100 + patch
  decltype(&cublasLtGetVersion) GetVersion = nullptr;
  decltype(&cublasLtCreate) Create = nullptr;
  decltype(&cublasLtDestroy) Destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) DescCreate = nullptr;
  decltype(&cublasLtMatmulDescDestroy) DescDestroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) DescSet = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) LayoutCreate = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) LayoutDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) PrefCreate = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) PrefSet = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) PrefDestroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) Heuristic = nullptr;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) AlgoConfigGet = nullptr;
  decltype(&cublasLtMatmul) Matmul = nullptr;
};

// The process's cuBLASLt (loaded on first use; the same answer afterwards), or Unavailable naming
// the libraries tried or the missing entry points.
Result<const CublasLt*> LoadCublasLt();

// Ok, or Internal "cuBLASLt <what> failed: status N".
Status CublasLtCheck(cublasStatus_t s, const char* what);

}  // namespace dl::cuda

#endif  // DECODELAB_HAVE_CUDA
