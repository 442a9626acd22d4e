// Types shared by every kernel interface. Kernel entry points take plain device pointers and a params
// struct; this header stays free of CUDA headers so host-only code (the registry, `decodelab kernels`,
// CPU-only builds) can include it.
#pragma once

#include <cstdint>
#include <string_view>

// Functions the host code (CPU references, launchers) and the kernels share.
#if defined(__CUDACC__)
#define DL_HOST_DEVICE __host__ __device__
#else
#define DL_HOST_DEVICE
#endif

// cudaStream_t is `struct CUstream_st*`; naming the struct keeps cuda_runtime.h out of host headers.
struct CUstream_st;

namespace dl::kernels {

using Stream = CUstream_st*;  // == cudaStream_t; nullptr is the legacy default stream
using bf16 = uint16_t;        // BF16 bit pattern (device code reinterprets it as __nv_bfloat16)

// KV cache element type. FP8 is E4M3 with one per-layer scale: stored = round_fp8(x / scale),
// read = code * scale.
enum class KvDtype : uint8_t { kBf16, kFp8 };
// Global (causal over every past key) or sliding (the last W keys, the current one included).
enum class WindowKind : uint8_t { kGlobal, kSliding };

inline std::string_view KvDtypeName(KvDtype t) { return t == KvDtype::kFp8 ? "fp8" : "bf16"; }
inline std::string_view WindowKindName(WindowKind w) {
  return w == WindowKind::kSliding ? "sliding" : "global";
}

// Attention's split-KV chunk: keys are split into chunks of this many ABSOLUTE positions
// ([c*128, c*128+127]), whatever the page size or how a prompt was chunked, and partial softmax
// results are combined in ascending chunk order. This is what makes results bit-identical across
// page sizes, prefill chunkings, and decode vs prefill of the same token.
inline constexpr int kAttnChunk = 128;

// Row t's block table in a batch of several sequences: table token_seq[t] of the [*, stride] tables,
// or `block_table` itself when every row belongs to one sequence (token_seq null).
DL_HOST_DEVICE inline const int32_t* RowBlockTable(const int32_t* block_table, const int32_t* token_seq,
                                                  int32_t stride, int t) {
  return token_seq ? block_table + static_cast<int64_t>(token_seq[t]) * stride : block_table;
}

}  // namespace dl::kernels
