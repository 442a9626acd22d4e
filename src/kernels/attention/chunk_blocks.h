// How the one-row split kernel lays a (token, KV head)'s key chunks over blocks. A function of the
// launch shape only (max_position, window, the tuning values and whether the device has clusters),
// never of the rows' positions or the batch: every row of every launch of a captured graph gets the
// same layout, and each chunk's partial and the merge are the same arithmetic in every layout, so
// the layout changes who computes what, never a bit.
#pragma once

#include <algorithm>

#include "kernels/attention/attention.h"

namespace dl::kernels {

// Blocks per thread-block cluster of the multi-chunk layout (the portable cluster size): the last
// cluster of a (token, KV head) to arrive merges, each of its blocks a share of the outputs.
inline constexpr int kAttnMergeCluster = 8;

enum class AttnChunkKind {
  kTicket,      // one chunk per block; the last block to arrive merges alone (chunks_per_block 1)
  kCluster,     // one chunk per block, the chunks' blocks one cluster merging through DSMEM
  kMultiChunk,  // block b walks chunks b, b + blocks, ...; the last cluster to arrive merges
};

struct AttnChunkLayout {
  AttnChunkKind kind = AttnChunkKind::kTicket;
  int chunks = 0;     // AttentionMaxChunks: partial slots per (row, query head), chunks the grid covers
  int blocks = 0;     // grid width: blocks per (row, KV head)
  int per_block = 1;  // chunks a block walks at most: ceil(chunks / blocks)
  int cluster = 0;    // blocks per cluster (0: none); arrivals per (row, KV head) = blocks / max(cluster, 1)
};

// `clusters`: the device runs thread-block clusters (sm_90). The cluster path keeps its rule
// (chunks <= min(cluster_max_chunks, kAttnMaxClusterChunks)); otherwise chunks_per_block > 1 takes
// the multi-chunk layout with ceil(chunks / chunks_per_block) blocks rounded up to whole clusters.
inline AttnChunkLayout AttentionChunkLayout(const AttentionParams& p, bool clusters) {
  AttnChunkLayout l;
  l.chunks = AttentionMaxChunks(p);
  l.blocks = l.chunks;
  if (clusters && l.chunks <= std::min(p.cluster_max_chunks, kAttnMaxClusterChunks)) {
    l.kind = AttnChunkKind::kCluster;
    l.cluster = l.chunks;
    return l;
  }
  if (p.chunks_per_block <= 1) return l;
  l.kind = AttnChunkKind::kMultiChunk;
  const int group = clusters ? kAttnMergeCluster : 1;
  l.cluster = clusters ? kAttnMergeCluster : 0;
  const int want = (l.chunks + p.chunks_per_block - 1) / p.chunks_per_block;
  l.blocks = (want + group - 1) / group * group;
  l.per_block = (l.chunks + l.blocks - 1) / l.blocks;
  return l;
}

}  // namespace dl::kernels
