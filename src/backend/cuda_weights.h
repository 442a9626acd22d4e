// The model's weights on the device: uploaded from the checkpoint's host weights (HostLagunaWeights:
// BF16 as is, F32/F16 converted to BF16 on the host, FP8 codes and their FP32 block scales unchanged)
// or generated there for a shape-only checkpoint (model/synthetic.h's formula; FP8 by the FP8
// contract's quantisation where asked), and described to the Laguna forward as LagunaWeights (device
// WeightRefs). Projections that the forward runs as one product are stored fused: q/k/v/g of a layer,
// a dense MLP's gate and up; consecutive parts of one dtype share a matrix (an FP8 part joins when the
// parts before it fill whole scale blocks), so a LinearWeights may hold several (e.g. q/k/v FP8 and g
// BF16). Embedding, norms, router and correction bias must be BF16 (the FP8 contract).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/buffer.h"
#include "kernels/ops.h"
#include "model/checkpoint.h"
#include "model/weights.h"

namespace dl {

// Shape-only checkpoints (no data) say which tensors are FP8 through their views' dtype
// (MakeShapeOnlyCheckpoint with Fp8Options: model/fp8_layout.h decides the layout); those are generated
// on the device as E4M3 codes and FP32 block scales (the FP8 contract's rule on the synthetic formula's
// FP32 value), in the view's block shape or, where it names none, this one.
inline constexpr int kSyntheticFp8Block = 128;

// A device WeightRef as a kernel operand: BF16 data, or (dtype F8E4M3) FP8 codes with their scales.
inline const kernels::bf16* DeviceBf16(const WeightRef& w) { return static_cast<const kernels::bf16*>(w.data); }
inline bool IsFp8(const WeightRef& w) { return w.dtype == DType::kF8E4M3; }
inline kernels::Fp8Weight Fp8Of(const WeightRef& w) {
  return {static_cast<const uint8_t*>(w.data), w.scales, static_cast<int>(w.block_rows), static_cast<int>(w.block_cols)};
}

class CudaWeights {
 public:
  // Uploads `checkpoint` to the current device (`synthetic_seed` generates a shape-only one).
  static Result<std::unique_ptr<CudaWeights>> Upload(const Checkpoint& checkpoint, uint64_t synthetic_seed,
                                                     CUstream_st* stream);
  // Uploads `host`, a description of weights over host memory that need not be the checkpoint's own
  // (a tensor-parallel rank's shard, model/weight_shard.h); `checkpoint` supplies the synthetic specs
  // of tensors without data.
  static Result<std::unique_ptr<CudaWeights>> UploadHost(const Checkpoint& checkpoint, const LagunaWeights& host,
                                                         uint64_t synthetic_seed, CUstream_st* stream);

  const LagunaWeights& refs() const { return refs_; }
  // Device arrays of E pointers to each expert's gate, up and down matrices (sparse layers): BF16
  // matrices, or FP8 codes (fp8 set) with the arrays of their scale pointers beside them.
  struct ExpertTables {
    const void* gate = nullptr;
    const void* up = nullptr;
    const void* down = nullptr;
    bool fp8 = false;
    const void* gate_scales = nullptr;
    const void* up_scales = nullptr;
    const void* down_scales = nullptr;
  };
  const ExpertTables& experts(int64_t layer) const { return tables_[static_cast<size_t>(layer)]; }
  // Bytes of every weight on the device.
  uint64_t bytes() const { return bytes_; }

 private:
  CudaWeights() = default;
  std::vector<cuda::DeviceBuffer> buffers_;
  std::vector<ExpertTables> tables_;
  LagunaWeights refs_;
  uint64_t bytes_ = 0;
  friend class CudaWeightsBuilder;
};

}  // namespace dl
