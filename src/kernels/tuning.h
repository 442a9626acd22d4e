// Kernel tuning: one value the CUDA backend is built with (from `--tune name=value` on the command
// line), printed by bench, Describe and /v1/decodelab/state next to every result. Nothing below
// apps/ reads the environment for it. Every setting changes only when and how bytes move, never the
// arithmetic: results are bit-identical for every value (the GPU tests run the variants), with one
// exception that says so: mma_products picks the linear layers' product, and with it their bits
// (each product is batch- and chunk-invariant on its own; docs/exactness.md).
// Measurements behind the defaults: docs/performance.md.
#pragma once

#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace dl::kernels {

// The decode kernels whose programmatic-dependent-launch release point `late_release` can move.
enum class LateRelease : unsigned { kNorm, kQkvg, kRope, kAttention, kOProj, kRouter, kDown, kCount };
inline constexpr const char* kLateReleaseNames[] = {"norm", "qkvg", "rope", "attention", "o_proj", "router", "down"};
static_assert(std::size(kLateReleaseNames) == static_cast<size_t>(LateRelease::kCount));
inline constexpr unsigned LateBit(LateRelease k) { return 1u << static_cast<unsigned>(k); }

struct Tuning {
  // Programmatic dependent launch (sm_90+): each decode kernel may start before its predecessor
  // ends and waits inside (griddepcontrol). Off only for A/B measurements.
  bool dependent_launch = true;
  // Kernels that let their successor launch just after their own PDL wait instead of at their start
  // (their successor's pre-wait loads then no longer run beside the latency-bound kernel before).
  unsigned late_release = LateBit(LateRelease::kAttention) | LateBit(LateRelease::kOProj) |
                          LateBit(LateRelease::kDown);
  // Small data read right after a PDL wait is warmed in L2 before it (norm residual rows, RoPE's
  // positions, weights, frequencies and block table).
  bool l2_prefetch = true;
  // Attention merges a query's key chunks through a thread-block cluster up to this many chunks
  // (0 = never; at most 8).
  int attention_cluster_max_chunks = 5;
  // Attention runs the multi-row kernel (a key chunk loaded once for 16 rows) from this many rows of
  // a launch on (0 = never): prefill. Same bits either way. Kernel bench (docs/performance.md,
  // session 11): 0.27x the one-row kernel at 128 rows (too few blocks), 1.1-1.5x from 1,024.
  int attention_multi_row_min_tokens = 512;
  // Batch-1 dense GEMVs stream their weights through shared memory with TMA bulk copies.
  bool stream_gemv = true;
  int stream_ring_kb = 128;
  int stream_stage_kb = 32;
  int stream_prefetch_kb = 96;  // issued before the PDL wait
  int oproj_prefetch_kb = 128;  // o_proj's own (it streams beside attention)
  // Batch-1 MoE gate/up streams its weights through a ring of this many KB (0 = register kernel).
  int moe_gate_up_stream_kb = 128;
  // The MoE router takes 8 token rows per block from this many tokens on (0 = never): prefill chunks
  // read the router matrix once per 8 rows instead of once per row (same bits; MoeParams). Kernel
  // bench: slower at 16 rows (28 vs 10 us), even at 64, 1.8x faster at 512 and 2,048.
  int moe_router_rows_min_tokens = 128;
  // Batched (T > 1) GEMV: output rows per warp (1, 2 or 4; 0 = by T: 2 up to 8 tokens, else 4) and
  // tokens per pass over a row (4, 8 or 16). Any choice gives the batch-1 kernel's bits.
  int batch_gemv_rows = 0;
  int batch_gemv_tokens = 8;
  // Every linear layer (any row count, batch 1 included) on the tensor-core product (ops.h 5b)
  // instead of the CUDA-core GEMVs: other bits than off (another summation order), the same bits for
  // every batch and chunking. Off until measured on the device (docs/performance.md, issue 17).
  bool mma_products = false;
  // Prompt rows (a request's own prompt tokens: BatchSequence::prompt_length) on the tensor-core
  // product, generated rows (decode, verify, and generated tokens recomputed after a preemption) on
  // the product mma_products picks. A row's class is a property of its token, never of the batch or
  // chunk, so every promise holds per class; a prompt row no longer equals a decode row at the same
  // position bit for bit (docs/exactness.md, "Prompt rows and generated rows").
  bool prompt_mma = true;
  // Prompt rows' attention (where prompt_mma makes them a class of their own) on the tensor-core
  // prompt kernel (AttnKind::kPrompt: flash-style, BF16 P), generated rows' on the split-KV kernel.
  // 0: prompt rows on the split-KV kernel too (its other bits for prompt rows).
  bool prompt_attention = true;
  // The MMA product's tiled kernel from this many rows on, the register kernel below (same bits).
  int mma_tiled_min_tokens = 64;
  // Prompt rows' dense linear layers (q/k/v/g, o_proj, the dense MLP, the LM head's prompt outputs),
  // where prompt_mma makes prompt rows a class of their own, on the library GEMM (kernels/ops.h 5c:
  // cuBLASLt, one algorithm per shape fixed for the process) instead of the tensor-core product; the
  // experts keep the tensor-core product. Other bits for prompt rows than 0, the same for every
  // batch and chunking. Needs cuBLASLt at run time (the engine says so at start if it is missing).
  bool prompt_gemm = true;
  // Prompt rows' FP8 weights (dense layers and experts), where prompt_mma makes prompt rows a class
  // of their own, on the tensor-core product (kernels/ops.h 5d: codes exact in BF16, one scale per
  // block column's sum) instead of the CUDA-core FP8 rule. Other bits for prompt rows than 0, the
  // same for every batch and chunking.
  bool prompt_fp8_mma = true;
  // Tensor parallelism over the one-shot device communicators: all-reduces of at least this many KiB
  // take the two-shot kernel (comm/device_reduce.h), smaller ones one-shot; 0 = one-shot always. Both
  // give every element the same rank-order FP32 sum, so the choice changes no bit; it changes the
  // bytes each rank reads from its peers (2 (N-1)/N of the message instead of N-1 times it).
  int tp_two_shot_min_kb = 512;

  bool late(LateRelease k) const { return (late_release & LateBit(k)) != 0; }
};

// Sets one field from "name=value" (the names of TuningSettings); InvalidArgument naming the setting
// and its range otherwise.
Status SetTuning(Tuning* t, std::string_view assignment);
// Every setting as (name, value), in declaration order: what --help lists and results print.
std::vector<std::pair<std::string, std::string>> TuningSettings(const Tuning& t);
// "name=value name=value ..." of TuningSettings (late_release's value holds commas).
std::string TuningString(const Tuning& t);
// The help text of --tune: every name, its default and what it does.
std::string TuningHelp();

// The late_release list as names ("attention,o_proj,down"; "" for none).
std::string LateReleaseList(unsigned bits);

}  // namespace dl::kernels
