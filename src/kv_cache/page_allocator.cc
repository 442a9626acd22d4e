#include "kv_cache/page_allocator.h"

#include <algorithm>

namespace dl {

PageAllocator::PageAllocator(int32_t num_pages) : in_use_(static_cast<size_t>(num_pages), false) {
  free_.reserve(static_cast<size_t>(num_pages));
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

Result<int32_t> PageAllocator::Allocate() {
  if (free_.empty()) {
    return ResourceExhausted("KV cache is full: all {} pages are in use", capacity());
  }
  int32_t p = free_.back();
  free_.pop_back();
  in_use_[static_cast<size_t>(p)] = true;
  return p;
}

Status PageAllocator::Free(int32_t page) {
  if (page < 0 || page >= capacity() || !in_use_[static_cast<size_t>(page)]) {
    return Internal("KV page {} freed but it is not in use", page);
  }
  in_use_[static_cast<size_t>(page)] = false;
  // Keep the free list sorted descending so the lowest id is reused first.
  auto it = std::lower_bound(free_.begin(), free_.end(), page, std::greater<int32_t>());
  free_.insert(it, page);
  return Status::Ok();
}

}  // namespace dl
