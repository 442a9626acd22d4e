// The paged KV cache's bookkeeping, shared by every backend and by the server's scheduler.
//
// Layers fall into two groups with their own page pools and block tables: full-attention layers keep
// every position; sliding-window layers keep only the positions a future query can still see (the last
// W-1 plus whatever chunk is being written), so their pages are returned as the window moves on. A page
// holds `page_size` consecutive positions; position s of a sequence lives in page
// block_table[s / page_size], slot s % page_size, in every layer of the group (one page id addresses the
// same slot range in each layer's pool). Pages are pure address translation: no kernel may let the page
// size change a reduction order.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "base/dtype.h"
#include "base/status.h"
#include "kv_cache/page_allocator.h"

namespace dl {

enum class KvGroup : uint8_t { kFull = 0, kSliding = 1 };

struct KvCacheSpec {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 16;  // 16, 32 or 64
  DType dtype = DType::kF32;
  std::vector<KvGroup> layer_groups;  // [num_layers]
  int32_t sliding_window = 0;         // W: keys visible to a query, the query's own included
  int32_t pages_full = 0;             // pool sizes per group
  int32_t pages_sliding = 0;

  // Bytes of one token's K (or V) in one layer.
  size_t token_bytes() const { return static_cast<size_t>(num_kv_heads) * head_dim * DTypeSize(dtype); }
  size_t page_bytes() const { return token_bytes() * static_cast<size_t>(page_size); }
  int32_t pages_in(KvGroup g) const { return g == KvGroup::kFull ? pages_full : pages_sliding; }
  Status Validate() const;
};

// Pages needed to hold a sequence of `max_len` tokens written in chunks of at most `max_chunk`.
int32_t PagesNeededFull(int32_t max_len, int32_t page_size);
int32_t PagesNeededSliding(int32_t max_len, int32_t window, int32_t max_chunk, int32_t page_size);

class KvCache;

// One sequence's view of the cache: its length and a block table per layer group. Move-only; its
// pages go back to the cache through KvCache::Release.
class SequenceKv {
 public:
  int32_t length() const { return length_; }
  // block_table(g)[i] is the page holding positions [i*P, (i+1)*P), or -1 where the window dropped it.
  const std::vector<int32_t>& block_table(KvGroup g) const { return tables_[static_cast<int>(g)]; }
  int32_t pages_held() const;
  // A sequence of `length` positions with these block tables that holds no page of any KvCache here:
  // another process's sequence, as a tensor-parallel rank receives it in its step plan
  // (model/forward_batch_codec.h). Its pages are the owner's; never Commit or Release it.
  static SequenceKv Mirror(int32_t length, std::vector<int32_t> full_table, std::vector<int32_t> sliding_table) {
    SequenceKv s;
    s.length_ = length;
    s.tables_[0] = std::move(full_table);
    s.tables_[1] = std::move(sliding_table);
    return s;
  }

 private:
  friend class KvCache;
  int32_t length_ = 0;
  std::vector<int32_t> tables_[2];
};

class KvCache {
 public:
  static Result<KvCache> Create(const KvCacheSpec& spec);

  const KvCacheSpec& spec() const { return spec_; }

  // Makes room for positions [seq.length, seq.length + n) in every group. On failure nothing changes.
  Status Reserve(SequenceKv& seq, int32_t n);
  // Marks those positions written: length += n, then returns sliding pages no future query can see.
  Status Commit(SequenceKv& seq, int32_t n);
  // Returns every page of the sequence (finish, error or cancellation) and resets it to empty.
  Status Release(SequenceKv& seq);

  // Page sharing for prefix caching. Every handed-out page carries a reference count: Reserve gives
  // a new page one reference; Commit (sliding pages leaving the window) and Release drop the
  // sequence's references, and a page returns to its pool when its last reference goes. A prefix
  // cache holds its own references through RetainPage/ReleasePage, so a page written by one request
  // can back another request's prompt prefix. Shared pages are never written again: sharing is only
  // allowed on whole pages (AttachPrefix takes a page-aligned length).
  Status RetainPage(KvGroup g, int32_t page);
  Status ReleasePage(KvGroup g, int32_t page);
  int32_t page_refs(KvGroup g, int32_t page) const;
  // Makes an empty `seq` start with `length` (a multiple of page_size) already-written positions
  // whose pages are `full_pages` and `sliding_pages` (length / page_size entries each for the groups
  // the model has; -1 allowed in the sliding table for pages no future query can see), taking one
  // reference on each. On failure nothing changes.
  Status AttachPrefix(SequenceKv& seq, int32_t length, const std::vector<int32_t>& full_pages,
                      const std::vector<int32_t>& sliding_pages);
  bool has_group(KvGroup g) const;

  int32_t used_pages(KvGroup g) const { return allocators_[static_cast<int>(g)].used_count(); }
  int32_t total_pages(KvGroup g) const { return allocators_[static_cast<int>(g)].capacity(); }
  // Fraction of all pages in use, for the server's kv usage gauge.
  double usage() const;

 private:
  Status Unref(int g, int32_t page);

  KvCacheSpec spec_;
  PageAllocator allocators_[2] = {PageAllocator(0), PageAllocator(0)};
  std::vector<int32_t> refs_[2];  // per page: references held (0 = free)
};

// Where position `pos` lives: (page id, slot), or page -1 when it is not held.
struct KvSlot {
  int32_t page = -1;
  int32_t slot = 0;
};
inline KvSlot LocatePosition(const std::vector<int32_t>& table, int32_t page_size, int32_t pos) {
  const int32_t i = pos / page_size;
  if (pos < 0 || i >= static_cast<int32_t>(table.size())) return {};
  return {table[static_cast<size_t>(i)], pos % page_size};
}

}  // namespace dl
