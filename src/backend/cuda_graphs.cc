#include "backend/cuda_graphs.h"

#if defined(DECODELAB_HAVE_CUDA)

#include <fmt/format.h>

#include "cuda/check.h"

namespace dl {

int32_t BatchBucket(int32_t n, int32_t cap) {
  int32_t b = 1;
  while (b < n) {
    // 1, 2, 3, 4, 6, 8, 12, 16, ...: alternately x1.5 and x4/3.
    const bool power_of_two = (b & (b - 1)) == 0;
    b = b < 2 ? b + 1 : (power_of_two ? b + b / 2 : b / 3 * 4);
  }
  return std::min(b, std::max(cap, n));
}

std::string GraphKey::Name() const {
  return fmt::format("{}/{}x{}{}{}", ForwardModeName(mode), rows, outputs, argmax_only ? "+argmax" : "",
                     mma ? "+mma" : "");
}

Result<GraphCache::Entry*> GraphCache::GetOrCapture(const GraphKey& key, cudaStream_t s,
                                                   const std::function<Status()>& enqueue) {
  auto it = entries_.find(key);
  if (it != entries_.end()) return it->second.get();
  DL_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  Status st = enqueue();
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  if (!st.ok()) {
    if (graph) cudaGraphDestroy(graph);
    return st.WithContext(fmt::format("capturing the {} graph", key.Name()));
  }
  if (end != cudaSuccess) return Internal("{} graph capture failed: {}", key.Name(), cudaGetErrorString(end));
  auto entry = std::make_unique<Entry>();
  DL_RETURN_IF_ERROR(entry->exec.Adopt(graph));
  size_t n = 0;
  DL_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  DL_CUDA_RETURN_IF_ERROR(cudaGraphGetNodes(graph, nodes.data(), &n));
  for (auto node : nodes) {
    cudaGraphNodeType type;
    DL_CUDA_RETURN_IF_ERROR(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeKernel) ++entry->kernel_nodes;
  }
  Entry* out = entry.get();
  entries_.emplace(key, std::move(entry));
  return out;
}

std::vector<std::pair<GraphKey, int>> GraphCache::Captured() const {
  std::vector<std::pair<GraphKey, int>> out;
  for (const auto& [k, e] : entries_) out.emplace_back(k, e->kernel_nodes);
  return out;
}

}  // namespace dl

#endif  // DECODELAB_HAVE_CUDA
