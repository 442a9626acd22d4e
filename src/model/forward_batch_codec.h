// A ForwardBatch as bytes: the step plan rank 0 of a tensor-parallel group sends to ranks that are
// other processes (backend/tp_process_ranks.h). It carries every field a forward reads: the mode,
// token rows, each sequence's rows, prompt length, KV length and both block tables (the positions
// follow from the length), the output rows with their sampling parameters and logit adjustments,
// and the hidden taps.
//
// Format (version 1, host byte order: both ends are the same binary on one machine):
//   u32 magic "DLFB", u32 version, u8 mode,
//   tokens: u64 n, n x i32,
//   sequences: u64 n, then per sequence: i32 first_row, i32 num_rows, i32 prompt_length,
//     i32 kv_length, full table (u64 n, n x i32), sliding table (u64 n, n x i32),
//   outputs: u64 n, then per output: i32 row, u8 sample, u8 want_logits, f32 temperature,
//     i32 top_k, f32 top_p, f32 min_p, u64 key, u64 step,
//     adjustments (u64 n, then per adjustment: i32 token, f32 bias, f32 repetition, f32 penalty),
//   hidden taps: u64 n, n x i32.
// Decoding checks the magic, the version, every count against the bytes left, the enum and flag
// values and that nothing trails: a truncated or corrupt plan is a DataLoss error naming the field.
// It does not check the batch's consistency (rows, pages): ForwardBatch::Validate does, on rank 0
// before sending and on the receiver before running.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "base/status.h"
#include "model/forward_batch.h"

namespace dl {

inline constexpr uint32_t kForwardBatchMagic = 0x4246'4c44;  // "DLFB" in memory order
inline constexpr uint32_t kForwardBatchVersion = 1;

std::vector<std::byte> EncodeForwardBatch(const ForwardBatch& batch);

// A decoded plan: the batch, and the sequences its BatchSequence::kv point to (SequenceKv::Mirror:
// they hold no pages here). Movable (the pointers stay valid: a moved vector keeps its elements),
// not copyable.
struct DecodedForwardBatch {
  ForwardBatch batch;
  std::vector<SequenceKv> kvs;
  DecodedForwardBatch() = default;
  DecodedForwardBatch(DecodedForwardBatch&&) = default;
  DecodedForwardBatch& operator=(DecodedForwardBatch&&) = default;
  DecodedForwardBatch(const DecodedForwardBatch&) = delete;
  DecodedForwardBatch& operator=(const DecodedForwardBatch&) = delete;
};
Result<DecodedForwardBatch> DecodeForwardBatch(std::span<const std::byte> bytes);

}  // namespace dl
