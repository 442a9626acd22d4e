// The model's weights on the device: uploaded from a checkpoint (converted to BF16 on the host) or
// generated there for a shape-only checkpoint (model/synthetic.h's formula), and described to the
// Laguna forward as LagunaWeights (device WeightRefs). Projections that the forward runs as one
// product are stored fused: q/k/v/g of a layer, a dense MLP's gate and up.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/buffer.h"
#include "model/checkpoint.h"
#include "model/weights.h"

namespace dl {

class CudaWeights {
 public:
  // Uploads `checkpoint` to the current device (`synthetic_seed` generates a shape-only one).
  static Result<std::unique_ptr<CudaWeights>> Upload(const Checkpoint& checkpoint, uint64_t synthetic_seed,
                                                     CUstream_st* stream);

  const LagunaWeights& refs() const { return refs_; }
  // Device arrays of E pointers to each expert's gate, up and down matrices (sparse layers).
  struct ExpertTables {
    const void* gate = nullptr;
    const void* up = nullptr;
    const void* down = nullptr;
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
