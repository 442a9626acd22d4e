// The in-process device communicator's kernel (comm/device_communicator.cc). CUDA builds only.
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

}  // namespace dl::comm

#endif
