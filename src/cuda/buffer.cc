#include "cuda/buffer.h"

#if defined(DECODELAB_HAVE_CUDA)
#include <cuda_runtime.h>

#include "cuda/check.h"
#endif

namespace dl::cuda {

#if defined(DECODELAB_HAVE_CUDA)

Result<DeviceBuffer> DeviceBuffer::Create(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  cudaError_t err = cudaMalloc(&b.ptr_, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return ResourceExhausted("cudaMalloc of {} bytes failed: {}", bytes, cudaGetErrorString(err));
  }
  b.size_ = bytes;
  return b;
}
Status DeviceBuffer::CopyFromHost(const void* src, size_t bytes) {
  if (bytes > size_) return InvalidArgument("copy of {} bytes into a {}-byte buffer", bytes, size_);
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(ptr_, src, bytes, cudaMemcpyHostToDevice));
  return Status::Ok();
}
Status DeviceBuffer::CopyToHost(void* dst, size_t bytes) const {
  if (bytes > size_) return InvalidArgument("copy of {} bytes out of a {}-byte buffer", bytes, size_);
  DL_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, ptr_, bytes, cudaMemcpyDeviceToHost));
  return Status::Ok();
}
Status DeviceBuffer::Fill(int value) {
  if (size_) DL_CUDA_RETURN_IF_ERROR(cudaMemset(ptr_, value, size_));
  return Status::Ok();
}
void DeviceBuffer::Reset() {
  if (ptr_) cudaFree(ptr_);
  ptr_ = nullptr;
  size_ = 0;
}

Result<Stream> Stream::Create() {
  Stream s;
  cudaStream_t raw = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking);
  if (err != cudaSuccess) return Unavailable("cudaStreamCreate failed: {}", cudaGetErrorString(err));
  s.s_ = raw;
  return s;
}
Status Stream::Synchronize() const {
  DL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s_));
  return Status::Ok();
}
void Stream::Reset() {
  if (s_) cudaStreamDestroy(s_);
  s_ = nullptr;
}

Result<Event> Event::Create() {
  Event e;
  cudaEvent_t raw = nullptr;
  cudaError_t err = cudaEventCreate(&raw);
  if (err != cudaSuccess) return Unavailable("cudaEventCreate failed: {}", cudaGetErrorString(err));
  e.e_ = raw;
  return e;
}
Status Event::Record(CUstream_st* stream) const {
  DL_CUDA_RETURN_IF_ERROR(cudaEventRecord(e_, stream));
  return Status::Ok();
}
Result<float> Event::ElapsedMs(const Event& start, const Event& end) {
  DL_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(end.e_));
  float ms = 0.0f;
  DL_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.e_, end.e_));
  return ms;
}
void Event::Reset() {
  if (e_) cudaEventDestroy(e_);
  e_ = nullptr;
}

#else

Result<DeviceBuffer> DeviceBuffer::Create(size_t bytes) {
  return Unavailable("no CUDA backend in this build (allocating {} bytes)", bytes);
}
Status DeviceBuffer::CopyFromHost(const void*, size_t) { return Unavailable("no CUDA backend"); }
Status DeviceBuffer::CopyToHost(void*, size_t) const { return Unavailable("no CUDA backend"); }
Status DeviceBuffer::Fill(int) { return Unavailable("no CUDA backend"); }
void DeviceBuffer::Reset() {}
Result<Stream> Stream::Create() { return Unavailable("no CUDA backend"); }
Status Stream::Synchronize() const { return Unavailable("no CUDA backend"); }
void Stream::Reset() {}
Result<Event> Event::Create() { return Unavailable("no CUDA backend"); }
Status Event::Record(CUstream_st*) const { return Unavailable("no CUDA backend"); }
Result<float> Event::ElapsedMs(const Event&, const Event&) {
  return Unavailable("no CUDA backend");
}
void Event::Reset() {}

#endif

}  // namespace dl::cuda
