#pragma once

#include <cstddef>

#include "base/status.h"

namespace dl::cuda {

// Device-to-device copy bandwidth of `device`, counting bytes read plus bytes written, as the median
// of `repeats` timed copies of `bytes` (after a warm-up). The memory floor of a decode step is its bytes
// divided by this.
Result<double> MeasureCopyBandwidthGBps(int device, size_t bytes = size_t{2} << 30, int repeats = 10);

}  // namespace dl::cuda
