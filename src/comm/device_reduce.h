// The in-process device communicators' kernels (comm/device_communicator.cc). CUDA builds only.
#pragma once

#if defined(DECODELAB_HAVE_CUDA)

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/status.h"
#include "comm/device_communicator.h"

namespace dl::comm {

// The most ranks one sum reads (their pointers travel in the kernel's parameters).
inline constexpr size_t kMaxReduceRanks = 64;

// out[i] = round(((in[0][i] + in[1][i]) + in[2][i]) + ...) for i < count: each rank's element widened
// to FP32, added in rank order in FP32 (no fused or reassociated adds), rounded once to `elem` (BF16:
// round to nearest even). `inputs` may be peer memory; `out` may be one of them only if no other
// rank reads it concurrently. Shapes: inputs[r] and out are [count] of `elem`.
Status LaunchSumInRankOrder(const std::vector<const void*>& inputs, void* out, int64_t count, DeviceElem elem,
                            CUstream_st* stream);

// ---- One-shot collectives (DeviceGroup::CreateOneShot) ----------------------------------------------
//
// Every rank owns, in its GPU's memory: slots [2][capacity] bytes (double-buffered by the call's
// parity), flags [kMaxOneShotBlocks][kMaxOneShotRanks] uint64 (flags[b][q]: the last mark rank q's
// block b stored, once it had written its part into q's slot) and epochs [kMaxOneShotBlocks] uint64
// (calls block b of this rank has made). One call, on rank r, block b of a fixed grid of `blocks`:
//   1. e = ++epochs[b] (device memory: a replayed graph advances it, nothing is baked in); copy b's
//      part of the input into r's slot[e & 1];
//   2. release-store the call's mark 2e into flags[b][r] of every rank (peer memory), then spin
//      (acquire) until every rank q has stored 2e or later into r's flags[b][q] (one thread per rank);
//   3. read b's part of every rank's slot[e & 1] (peer memory) and combine: the all-reduce adds the
//      ranks in rank order in FP32 and rounds once (LaunchSumInRankOrder's bits), the all-gather
//      copies rank q's bytes to out[q * bytes, ...).
// Why one barrier is enough: rank r overwrites slot[e & 1] again at call e + 2, after its call e + 1
// saw every rank's call-(e + 1) marks, which each rank stored after its own call-e reads. Why the grid
// is fixed: the argument needs every block that read at call e to signal at call e + 1. The element
// split between blocks is the same in steps 1 and 3 of one call on every rank (same count, grid).
// Why the ranks' kernels are co-resident when ranks share a GPU: `blocks` is small (the spinning
// blocks of every rank fit beside each other and beside the work the late rank still has to do).
// A spin gives up when the group's host-mapped abort word is set or after timeout_ns, setting the
// rank's host-mapped error word (1 aborted, 2 timed out); the host reads it after the stream.
//
// The two-shot all-reduce (an all-reduce of at least `two_shot_min_bytes`, when that is set): step 1
// as above; after a first meeting (mark 2e - 1) each rank sums the units it owns (a thread's k-th
// unit belongs to rank k % size) over every rank's slot in rank order, rounds once and writes the
// sums into its own slot; after a second meeting (mark 2e) every rank copies each unit from its
// owner's slot. The same bits as one-shot, element for element, so the size choice changes no
// result; it moves fewer bytes: each rank reads 2 (size - 1) / size of the message from its peers
// instead of (size - 1) times it. Marks grow by two per call of either kind, so one-shot and
// two-shot calls share the flags and epochs and the slot-reuse argument above holds across both.
inline constexpr int kMaxOneShotRanks = 16;
inline constexpr int kMaxOneShotBlocks = 64;
inline constexpr int kOneShotThreads = 512;

struct OneShotView {
  int rank = 0, size = 0, blocks = 0;
  size_t capacity = 0;                       // bytes of one slot (a multiple of 16)
  void* slots[kMaxOneShotRanks] = {};        // rank q's slots (peer pointers)
  uint64_t* flags[kMaxOneShotRanks] = {};    // rank q's flags (peer pointers)
  uint64_t* epochs = nullptr;                // this rank's
  const volatile uint32_t* abort = nullptr;  // the group's, host-mapped
  volatile uint32_t* error = nullptr;        // this rank's, host-mapped
  uint64_t timeout_ns = 0;
  size_t two_shot_min_bytes = 0;             // all-reduces of at least this many bytes take two-shot; 0: never
};

// data [count] of `elem` on the view's rank: the rank-order sum over ranks, in place (one-shot, or
// two-shot from the view's two_shot_min_bytes on: the same bits).
Status LaunchOneShotAllReduce(const OneShotView& v, void* data, int64_t count, DeviceElem elem, CUstream_st* stream);
// out [size * bytes] = every rank's local [bytes], in rank order.
Status LaunchOneShotAllGather(const OneShotView& v, const void* local, size_t bytes, void* out, CUstream_st* stream);
// The view's size rule for all_reduce_rule(): "two-shot>=N" (bytes), or "" when two-shot is off.
std::string TwoShotRule(const OneShotView& v);
// Loads the one-shot kernels on the current device now: under CUDA lazy loading a kernel's first
// launch may wait for the whole context, including a peer's spinning kernel.
Status PreloadOneShotKernels();

}  // namespace dl::comm

#endif
