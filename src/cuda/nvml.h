// The few NVML facts the lab records, with libnvidia-ml opened at run time (never linked), so the
// binary runs where the driver library is absent.
#pragma once

#include <string>

#include "base/status.h"

namespace dl::cuda {

// The kernel driver's version ("580.159.04"), or an error when NVML cannot be opened or answers
// nothing.
Result<std::string> NvmlDriverVersion();

}  // namespace dl::cuda
