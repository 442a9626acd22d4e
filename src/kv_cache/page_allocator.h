// A fixed pool of KV pages handed out from a free list. Host bookkeeping only: the pages themselves live
// wherever the backend keeps them (host vectors for the CPU backend, device memory for CUDA), indexed by
// the page ids this allocator returns.
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"

namespace dl {

class PageAllocator {
 public:
  explicit PageAllocator(int32_t num_pages);

  // The lowest free page id first, so allocation is deterministic for a given request history.
  Result<int32_t> Allocate();
  // Returns a page to the pool. Freeing a page twice or one never handed out is a bug in the caller and
  // reported as kInternal.
  Status Free(int32_t page);

  int32_t capacity() const { return static_cast<int32_t>(in_use_.size()); }
  int32_t free_count() const { return static_cast<int32_t>(free_.size()); }
  int32_t used_count() const { return capacity() - free_count(); }

 private:
  std::vector<int32_t> free_;  // kept sorted descending, so back() is the lowest id
  std::vector<bool> in_use_;
};

}  // namespace dl
