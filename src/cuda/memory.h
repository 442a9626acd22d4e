// RAII owners of the CUDA resources that need the runtime's headers: pinned host buffers and
// instantiated graphs (device buffers, streams and events are in cuda/buffer.h). Only available in
// builds with the CUDA backend (DECODELAB_HAVE_CUDA).
#pragma once

#if defined(DECODELAB_HAVE_CUDA)

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "base/status.h"
#include "cuda/buffer.h"
#include "cuda/check.h"

namespace dl::cuda {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static Result<PinnedBuffer> Allocate(size_t bytes) {
    PinnedBuffer b;
    if (bytes > 0) {
      cudaError_t e = cudaMallocHost(&b.ptr_, bytes);
      if (e != cudaSuccess) {
        cudaGetLastError();
        return ResourceExhausted("cudaMallocHost of {} bytes failed: {}", bytes, cudaGetErrorString(e));
      }
    }
    b.bytes_ = bytes;
    return b;
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFreeHost(ptr_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class GraphExec {
 public:
  GraphExec() = default;
  GraphExec(GraphExec&& o) noexcept { *this = std::move(o); }
  GraphExec& operator=(GraphExec&& o) noexcept {
    if (this != &o) {
      Reset();
      graph_ = std::exchange(o.graph_, nullptr);
      exec_ = std::exchange(o.exec_, nullptr);
    }
    return *this;
  }
  ~GraphExec() { Reset(); }
  void Reset() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
  }
  // Takes ownership of a captured graph and instantiates it.
  Status Adopt(cudaGraph_t graph) {
    Reset();
    graph_ = graph;
    DL_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec_, graph_, 0));
    return Status::Ok();
  }
  bool ready() const { return exec_ != nullptr; }
  cudaGraph_t graph() const { return graph_; }
  Status Launch(cudaStream_t s) const {
    DL_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec_, s));
    return Status::Ok();
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace dl::cuda

#endif  // DECODELAB_HAVE_CUDA
