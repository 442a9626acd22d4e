// Fused residual add + RMSNorm: one block of 256 threads per row (BlockAddRmsNorm), each thread keeps up
// to 4 chunks of 8 elements (16-byte loads) in registers, so the row is read once and written twice
// (h and out).
#include "kernels/cuda/norm_block.cuh"
#include "kernels/ops.h"

namespace dl::kernels {
namespace dev {

__global__ void __launch_bounds__(kNormThreads) AddRmsNormKernel(AddRmsNormParams a) {
  DL_TIMELINE_SCOPE(kAddRmsNorm);
  AllowDependentsAtStart(a.release_after_wait);
  const NormWeights weight = LoadNormWeights(a.weight, a.n);
  const size_t row = static_cast<size_t>(blockIdx.x) * static_cast<size_t>(a.row_stride > 0 ? a.row_stride : a.n);
  if (a.prefetch_residual) PrefetchBytesL2(a.residual + row, static_cast<size_t>(a.n) * 2, threadIdx.x, kNormThreads);
  WaitReleasing(a.release_after_wait);
  const bf16* delta = a.delta ? a.delta + row : nullptr;
  BlockAddRmsNorm(a.residual + row, delta, weight, a.n, a.eps, delta ? a.residual + row : nullptr, a.out + row,
                  nullptr);
}

}  // namespace dev

Status AddRmsNorm(const AddRmsNormParams& p, Stream stream) {
  if (!p.residual || !p.weight || !p.out) {
    return InvalidArgument("add_rmsnorm: residual, weight and out must be set");
  }
  if (p.n <= 0 || p.n % 8 != 0 || p.n > dev::kNormThreads * 8 * dev::kNormMaxChunks) {
    return InvalidArgument("add_rmsnorm: width {} must be a positive multiple of 8, at most {}", p.n,
                           dev::kNormThreads * 8 * dev::kNormMaxChunks);
  }
  if (p.rows < 1) return InvalidArgument("add_rmsnorm: {} rows", p.rows);
  if (p.row_stride != 0 && (p.row_stride < p.n || p.row_stride % 8 != 0)) {
    return InvalidArgument("add_rmsnorm: row stride {} must be 0 or a multiple of 8 of at least the width {}",
                           p.row_stride, p.n);
  }
  dev::LaunchDependent(dev::AddRmsNormKernel, dim3(p.rows), dim3(dev::kNormThreads),
                       reinterpret_cast<cudaStream_t>(stream), p);
  DL_KERNEL_LAUNCH_CHECK("add_rmsnorm");
  return Status::Ok();
}

}  // namespace dl::kernels
