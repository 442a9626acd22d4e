// The CUDA backend's captured forwards: one CUDA graph per (mode, token-row bucket, output-row
// bucket, token choice), captured on first use. A graph holds no sequence: token ids, positions,
// block tables and sampling parameters are read from the workspace's input arrays, so one capture
// serves every step of that shape. Batches are padded up to their bucket (padding rows write only a
// page no sequence owns, and every row is computed on its own, so padding never changes a real
// row's result). CUDA builds only.
#pragma once

#if defined(DECODELAB_HAVE_CUDA)

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "base/status.h"
#include "cuda/memory.h"
#include "model/forward_batch.h"

namespace dl {

// The smallest bucket >= n of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, ... (each step at most
// 1.5x: padding costs at most a third), capped at `cap`.
int32_t BatchBucket(int32_t n, int32_t cap);

struct GraphKey {
  ForwardMode mode = ForwardMode::kDecode;
  int32_t rows = 1;
  int32_t outputs = 1;
  bool argmax_only = false;  // one greedy row without adjustments: the multi-block argmax kernel
  bool mma = false;          // every row on the tensor-core product (Tuning::prompt_mma, mma_products)
  bool operator<(const GraphKey& o) const {
    return std::tie(mode, rows, outputs, argmax_only, mma) < std::tie(o.mode, o.rows, o.outputs, o.argmax_only, o.mma);
  }
  std::string Name() const;  // "decode/8x8", "prefill/512x9+argmax", "prefill/512x1+mma"
};

class GraphCache {
 public:
  struct Entry {
    cuda::GraphExec exec;
    int kernel_nodes = 0;
  };
  // The entry for `key`, capturing it first by running `enqueue` on `stream` under stream capture.
  Result<Entry*> GetOrCapture(const GraphKey& key, cudaStream_t stream, const std::function<Status()>& enqueue);
  std::vector<std::pair<GraphKey, int>> Captured() const;  // key and kernel nodes

 private:
  std::map<GraphKey, std::unique_ptr<Entry>> entries_;
};

}  // namespace dl

#endif  // DECODELAB_HAVE_CUDA
