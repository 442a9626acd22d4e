#include "cuda/bandwidth.h"

#include <algorithm>
#include <vector>

#if defined(DECODELAB_HAVE_CUDA)
#include "cuda/memory.h"
#endif

namespace dl::cuda {

#if defined(DECODELAB_HAVE_CUDA)
Result<double> MeasureCopyBandwidthGBps(int device, size_t bytes, int repeats) {
  DL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  DL_ASSIGN_OR_RETURN(auto src, DeviceBuffer::Create(bytes));
  DL_ASSIGN_OR_RETURN(auto dst, DeviceBuffer::Create(bytes));
  DL_CUDA_RETURN_IF_ERROR(cudaMemset(src.data(), 1, bytes));
  cudaEvent_t start, stop;
  DL_CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  DL_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  std::vector<double> gbps;
  for (int i = 0; i < repeats + 1; ++i) {
    cudaEventRecord(start);
    cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    DL_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i > 0) gbps.push_back(2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}
#else
Result<double> MeasureCopyBandwidthGBps(int, size_t, int) {
  return Unavailable("this build of decodelab has no CUDA backend");
}
#endif

}  // namespace dl::cuda
