// The visible skip of every GPU test where no CUDA device is usable (CI has the toolkit, no GPU).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "cuda/device.h"

#define SKIP_WITHOUT_GPU()                                                                \
  do {                                                                                    \
    std::string why;                                                                      \
    if (::dl::cuda::DeviceCount(&why) == 0) GTEST_SKIP() << "no usable GPU: " << why;     \
  } while (0)
