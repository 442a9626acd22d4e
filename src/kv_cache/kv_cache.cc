#include "kv_cache/kv_cache.h"

#include <algorithm>

namespace dl {

Status KvCacheSpec::Validate() const {
  if (num_layers <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return InvalidArgument("KV cache: layers, heads and head_dim must be positive ({}, {}, {})",
                           num_layers, num_kv_heads, head_dim);
  }
  if (page_size != 16 && page_size != 32 && page_size != 64) {
    return InvalidArgument("--page-size must be 16, 32 or 64 (got {})", page_size);
  }
  if (static_cast<int32_t>(layer_groups.size()) != num_layers) {
    return InvalidArgument("KV cache: {} layer groups for {} layers", layer_groups.size(), num_layers);
  }
  bool any_sliding = std::count(layer_groups.begin(), layer_groups.end(), KvGroup::kSliding) > 0;
  if (any_sliding && sliding_window <= 0) {
    return InvalidArgument("KV cache: sliding layers need a positive window (got {})", sliding_window);
  }
  if (pages_full < 0 || pages_sliding < 0) return InvalidArgument("KV cache: negative pool size");
  return Status::Ok();
}

int32_t PagesNeededFull(int32_t max_len, int32_t page_size) {
  return (max_len + page_size - 1) / page_size;
}

int32_t PagesNeededSliding(int32_t max_len, int32_t window, int32_t max_chunk, int32_t page_size) {
  // Live positions while writing a chunk: the W-1 before it plus the chunk itself, which may straddle
  // one extra page boundary on each side.
  const int32_t live = std::min(max_len, window - 1 + max_chunk);
  return std::min(PagesNeededFull(max_len, page_size), (live + page_size - 1) / page_size + 1);
}

int32_t SequenceKv::pages_held() const {
  int32_t n = 0;
  for (const auto& t : tables_) n += static_cast<int32_t>(std::count_if(t.begin(), t.end(), [](int32_t p) { return p >= 0; }));
  return n;
}

Result<KvCache> KvCache::Create(const KvCacheSpec& spec) {
  DL_RETURN_IF_ERROR(spec.Validate());
  KvCache c;
  c.spec_ = spec;
  c.allocators_[0] = PageAllocator(spec.pages_full);
  c.allocators_[1] = PageAllocator(spec.pages_sliding);
  c.refs_[0].assign(static_cast<size_t>(spec.pages_full), 0);
  c.refs_[1].assign(static_cast<size_t>(spec.pages_sliding), 0);
  return c;
}

Status KvCache::Reserve(SequenceKv& seq, int32_t n) {
  if (n < 0) return InvalidArgument("KV reserve of {} tokens", n);
  const int32_t pages_needed = PagesNeededFull(seq.length_ + n, spec_.page_size);
  const size_t old_sizes[2] = {seq.tables_[0].size(), seq.tables_[1].size()};
  for (int g = 0; g < 2; ++g) {
    const KvGroup group = static_cast<KvGroup>(g);
    if (std::find(spec_.layer_groups.begin(), spec_.layer_groups.end(), group) ==
        spec_.layer_groups.end()) {
      continue;  // no layer of this kind: no table to grow
    }
    auto& table = seq.tables_[g];
    while (static_cast<int32_t>(table.size()) < pages_needed) {
      auto page = allocators_[g].Allocate();
      if (!page.ok()) {
        // Undo this call's allocations in every group, so a failed reserve changes nothing.
        for (int h = 0; h <= g; ++h) {
          auto& t = seq.tables_[h];
          for (size_t i = old_sizes[h]; i < t.size(); ++i) (void)Unref(h, t[i]);
          t.resize(old_sizes[h]);
        }
        return page.status().WithContext(group == KvGroup::kFull ? "full-attention layers"
                                                                 : "sliding-window layers");
      }
      refs_[g][static_cast<size_t>(*page)] = 1;
      table.push_back(*page);
    }
  }
  return Status::Ok();
}

Status KvCache::Commit(SequenceKv& seq, int32_t n) {
  seq.length_ += n;
  // A future query is at position >= length and sees keys >= length - W + 1: pages that end before
  // that are dead in the sliding group.
  auto& table = seq.tables_[static_cast<int>(KvGroup::kSliding)];
  const int32_t first_live = seq.length_ - spec_.sliding_window + 1;
  for (size_t i = 0; i < table.size(); ++i) {
    const int32_t page_end = static_cast<int32_t>(i + 1) * spec_.page_size;  // exclusive
    if (page_end > first_live) break;
    if (table[i] >= 0) {
      DL_RETURN_IF_ERROR(Unref(1, table[i]));
      table[i] = -1;
    }
  }
  return Status::Ok();
}

Status KvCache::Release(SequenceKv& seq) {
  for (int g = 0; g < 2; ++g) {
    for (int32_t p : seq.tables_[g]) {
      if (p >= 0) DL_RETURN_IF_ERROR(Unref(g, p));
    }
    seq.tables_[g].clear();
  }
  seq.length_ = 0;
  return Status::Ok();
}

Status KvCache::Unref(int g, int32_t page) {
  auto& refs = refs_[g];
  if (page < 0 || page >= static_cast<int32_t>(refs.size()) || refs[static_cast<size_t>(page)] <= 0) {
    return Internal("KV page {} of the {} group released but it is not in use", page,
                    g == 0 ? "full-attention" : "sliding-window");
  }
  if (--refs[static_cast<size_t>(page)] == 0) return allocators_[g].Free(page);
  return Status::Ok();
}

bool KvCache::has_group(KvGroup g) const {
  return std::find(spec_.layer_groups.begin(), spec_.layer_groups.end(), g) != spec_.layer_groups.end();
}

Status KvCache::RetainPage(KvGroup g, int32_t page) {
  auto& refs = refs_[static_cast<int>(g)];
  if (page < 0 || page >= static_cast<int32_t>(refs.size()) || refs[static_cast<size_t>(page)] <= 0) {
    return Internal("KV page {} retained but it is not in use", page);
  }
  ++refs[static_cast<size_t>(page)];
  return Status::Ok();
}

Status KvCache::ReleasePage(KvGroup g, int32_t page) { return Unref(static_cast<int>(g), page); }

int32_t KvCache::page_refs(KvGroup g, int32_t page) const {
  const auto& refs = refs_[static_cast<int>(g)];
  if (page < 0 || page >= static_cast<int32_t>(refs.size())) return 0;
  return refs[static_cast<size_t>(page)];
}

Status KvCache::AttachPrefix(SequenceKv& seq, int32_t length, const std::vector<int32_t>& full_pages,
                             const std::vector<int32_t>& sliding_pages) {
  if (seq.length_ != 0 || !seq.tables_[0].empty() || !seq.tables_[1].empty()) {
    return FailedPrecondition("KV AttachPrefix on a sequence that already holds pages");
  }
  if (length <= 0 || length % spec_.page_size != 0) {
    return InvalidArgument("KV AttachPrefix: length {} is not a positive multiple of the page size {}",
                           length, spec_.page_size);
  }
  const size_t n = static_cast<size_t>(length / spec_.page_size);
  const std::vector<int32_t>* tables[2] = {&full_pages, &sliding_pages};
  for (int g = 0; g < 2; ++g) {
    const bool used = has_group(static_cast<KvGroup>(g));
    if (used && tables[g]->size() != n) {
      return InvalidArgument("KV AttachPrefix: {} pages given for the {} group, {} needed",
                             tables[g]->size(), g == 0 ? "full-attention" : "sliding-window", n);
    }
    if (!used && !tables[g]->empty()) {
      return InvalidArgument("KV AttachPrefix: pages given for a group the model does not have");
    }
    for (int32_t p : *tables[g]) {
      if (p < 0 && g == 0) return InvalidArgument("KV AttachPrefix: a full-attention page is missing");
      if (p >= 0 && page_refs(static_cast<KvGroup>(g), p) <= 0) {
        return Internal("KV AttachPrefix: page {} is not in use", p);
      }
    }
  }
  for (int g = 0; g < 2; ++g) {
    for (int32_t p : *tables[g]) {
      if (p >= 0) ++refs_[g][static_cast<size_t>(p)];
    }
    seq.tables_[g] = *tables[g];
  }
  seq.length_ = length;
  return Status::Ok();
}

double KvCache::usage() const {
  const int32_t total = total_pages(KvGroup::kFull) + total_pages(KvGroup::kSliding);
  if (total == 0) return 0.0;
  return static_cast<double>(used_pages(KvGroup::kFull) + used_pages(KvGroup::kSliding)) / total;
}

}  // namespace dl
