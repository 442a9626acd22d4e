#include "cuda/peak.h"

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>

#if defined(DECODELAB_HAVE_CUDA)
#include "base/rng.h"
#include "cuda/cublaslt.h"
#include "cuda/memory.h"
#endif

namespace dl::cuda {

#if defined(DECODELAB_HAVE_CUDA)
Result<double> MeasureBf16PeakTflops(int device, int n, int repeats) {
  if (n < 256 || n % 256 != 0 || repeats < 1) return InvalidArgument("BF16 peak: n a multiple of 256, repeats >= 1");
  auto loaded = LoadCublasLt();
  if (!loaded.ok()) return Unavailable("the BF16 peak measurement: {}", loaded.status().message());
  const CublasLt& lt = **loaded;
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  const size_t elems = static_cast<size_t>(n) * n, bytes = elems * 2;
  DL_ASSIGN_OR_RETURN(auto a, DeviceBuffer::Create(bytes));
  DL_ASSIGN_OR_RETURN(auto b, DeviceBuffer::Create(bytes));
  DL_ASSIGN_OR_RETURN(auto d, DeviceBuffer::Create(bytes));
  constexpr size_t kWorkspace = size_t{32} << 20;
  DL_ASSIGN_OR_RETURN(auto ws, DeviceBuffer::Create(kWorkspace));
  {  // BF16 values in [-1, 1): one random block, repeated over the matrices
    std::vector<uint16_t> block(size_t{1} << 20);
    for (size_t i = 0; i < block.size(); ++i) {
      const float x = 2.0f * UniformAt(20261202, i) - 1.0f;
      uint32_t u;
      std::memcpy(&u, &x, 4);
      block[i] = static_cast<uint16_t>(u >> 16);
    }
    for (size_t off = 0; off < elems; off += block.size()) {
      const size_t m = std::min(block.size(), elems - off) * 2;
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(static_cast<char*>(a.data()) + off * 2, block.data(), m, cudaMemcpyHostToDevice));
      DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(static_cast<char*>(b.data()) + off * 2, block.data(), m, cudaMemcpyHostToDevice));
    }
  }
  cublasLtHandle_t handle = nullptr;
  DL_RETURN_IF_ERROR(CublasLtCheck(lt.Create(&handle), "create"));
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto cleanup = [&] {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (pref) lt.PrefDestroy(pref);
    if (la) lt.LayoutDestroy(la);
    if (lb) lt.LayoutDestroy(lb);
    if (ld) lt.LayoutDestroy(ld);
    if (desc) lt.DescDestroy(desc);
    lt.Destroy(handle);
  };
  auto run = [&]() -> Result<double> {
    DL_RETURN_IF_ERROR(CublasLtCheck(lt.DescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc"));
    DL_RETURN_IF_ERROR(CublasLtCheck(lt.LayoutCreate(&la, CUDA_R_16BF, n, n, n), "layout"));
    DL_RETURN_IF_ERROR(CublasLtCheck(lt.LayoutCreate(&lb, CUDA_R_16BF, n, n, n), "layout"));
    DL_RETURN_IF_ERROR(CublasLtCheck(lt.LayoutCreate(&ld, CUDA_R_16BF, n, n, n), "layout"));
    DL_RETURN_IF_ERROR(CublasLtCheck(lt.PrefCreate(&pref), "preference"));
    const uint64_t ws_bytes = kWorkspace;
    DL_RETURN_IF_ERROR(CublasLtCheck(
        lt.PrefSet(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)), "preference"));
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    DL_RETURN_IF_ERROR(CublasLtCheck(lt.Heuristic(handle, desc, la, lb, ld, ld, pref, 1, &heur, &found), "heuristic"));
    if (found < 1) return Unavailable("cuBLASLt offers no BF16 algorithm for {}^3", n);
    const float alpha = 1.0f, beta = 0.0f;
    auto product = [&] {
      return lt.Matmul(handle, desc, &alpha, a.data(), la, b.data(), lb, &beta, d.data(), ld, d.data(), ld, &heur.algo,
                       ws.data(), kWorkspace, nullptr);
    };
    for (int i = 0; i < 3; ++i) DL_RETURN_IF_ERROR(CublasLtCheck(product(), "matmul"));
    DL_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
    DL_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
    std::vector<double> tflops;
    for (int i = 0; i < repeats; ++i) {
      cudaEventRecord(start);
      DL_RETURN_IF_ERROR(CublasLtCheck(product(), "matmul"));
      cudaEventRecord(stop);
      DL_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      tflops.push_back(2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e12);
    }
    std::sort(tflops.begin(), tflops.end());
    return tflops[tflops.size() / 2];
  };
  auto result = run();
  cleanup();
  return result;
}
#else
Result<double> MeasureBf16PeakTflops(int, int, int) {
  return Unavailable("this build of decodelab has no CUDA backend");
}
#endif

}  // namespace dl::cuda
