// RAII owners of CUDA resources: device memory, streams and events. Each is move-only, frees what it
// owns on destruction, and is created through a Result so a failure (no device, out of memory)
// arrives as a Status naming the request. In a build without CUDA, Create returns Unavailable.
#pragma once

#include <cstddef>
#include <utility>

#include "base/status.h"

struct CUstream_st;
struct CUevent_st;

namespace dl::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Result<DeviceBuffer> Create(size_t bytes);
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), size_(o.size_) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      size_ = o.size_;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t size() const { return size_; }

  // Synchronous copies (cudaMemcpy) of `bytes` (default: the whole buffer); bounds-checked.
  Status CopyFromHost(const void* src, size_t bytes);
  Status CopyToHost(void* dst, size_t bytes) const;
  // Sets every byte to `value` (cudaMemset): poisoning outputs in tests, zeroing counters.
  Status Fill(int value);
  void Reset();

 private:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

class Stream {
 public:
  Stream() = default;
  static Result<Stream> Create();
  Stream(Stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept {
    if (this != &o) {
      Reset();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  ~Stream() { Reset(); }
  CUstream_st* get() const { return s_; }  // a cudaStream_t
  Status Synchronize() const;
  void Reset();

 private:
  CUstream_st* s_ = nullptr;
};

class Event {
 public:
  Event() = default;
  static Result<Event> Create();
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      Reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  ~Event() { Reset(); }
  Status Record(CUstream_st* stream) const;
  // Milliseconds between two recorded events (waits for `end`).
  static Result<float> ElapsedMs(const Event& start, const Event& end);
  void Reset();

 private:
  CUevent_st* e_ = nullptr;
};

}  // namespace dl::cuda
