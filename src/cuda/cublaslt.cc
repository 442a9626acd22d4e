#include "cuda/cublaslt.h"

#if defined(DECODELAB_HAVE_CUDA)

#include "base/dynamic_library.h"

namespace dl::cuda {
namespace {

Result<CublasLt> Open() {
  auto opened =
      OpenFirstLibrary({"libcublasLt.so.13", "/usr/local/cuda/lib64/libcublasLt.so.13", "libcublasLt.so"});
  if (!opened.ok()) return Unavailable("cannot load cuBLASLt. {}", opened.status().message());
  CublasLt lt;
  lt.path = opened->path;
  std::string missing;
  auto sym = [&](auto& fn, const char* name) { ResolveSymbol(opened->handle, fn, name, true, &missing); };
  sym(lt.GetVersion, "cublasLtGetVersion");
  sym(lt.Create, "cublasLtCreate");
  sym(lt.Destroy, "cublasLtDestroy");
  sym(lt.DescCreate, "cublasLtMatmulDescCreate");
  sym(lt.DescDestroy, "cublasLtMatmulDescDestroy");
  sym(lt.DescSet, "cublasLtMatmulDescSetAttribute");
  sym(lt.LayoutCreate, "cublasLtMatrixLayoutCreate");
  sym(lt.LayoutDestroy, "cublasLtMatrixLayoutDestroy");
  sym(lt.PrefCreate, "cublasLtMatmulPreferenceCreate");
  sym(lt.PrefSet, "cublasLtMatmulPreferenceSetAttribute");
  sym(lt.PrefDestroy, "cublasLtMatmulPreferenceDestroy");
  sym(lt.Heuristic, "cublasLtMatmulAlgoGetHeuristic");
  sym(lt.AlgoConfigGet, "cublasLtMatmulAlgoConfigGetAttribute");
  sym(lt.Matmul, "cublasLtMatmul");
  if (!missing.empty()) return Unavailable("{} lacks{}", opened->path, missing);
  lt.version = lt.GetVersion();
  return lt;  // the library stays open for the process
}

}  // namespace

Result<const CublasLt*> LoadCublasLt() {
  static const Result<CublasLt> loaded = Open();  // thread-safe initialisation, once
  if (!loaded.ok()) return loaded.status();
  return &*loaded;
}

Status CublasLtCheck(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Internal("cuBLASLt {} failed: status {}", what, static_cast<int>(s));
}

}  // namespace dl::cuda

#endif  // DECODELAB_HAVE_CUDA
