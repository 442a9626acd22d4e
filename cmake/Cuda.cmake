# CUDA is optional and switched on automatically where nvcc exists. The binary must still load and run
# its CPU paths on a machine with the toolkit but no driver (CI): link the CUDA runtime statically
# (it opens libcuda at run time) and never link NVML or libcuda directly.
set(DECODELAB_HAVE_CUDA OFF)
if(NOT DECODELAB_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    # CMake 3.25 does not know nvcc 13's C++20 mode: CMAKE_CUDA_STANDARD 20 silently gives C++17.
    string(APPEND CMAKE_CUDA_FLAGS " -std=c++20 --expt-relaxed-constexpr")
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(DECODELAB_HAVE_CUDA ON)
  elseif(DECODELAB_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DECODELAB_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "decodelab: CUDA backend ${DECODELAB_HAVE_CUDA}")

# NCCL headers: CUDA toolkit directory (build machines) or the system include dir (GPU machine). The
# library itself is opened at run time (comm/nccl_api), so the binary loads where NCCL is absent.
find_path(NCCL_INCLUDE_DIR nccl.h HINTS /usr/local/cuda/include ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
if(NCCL_INCLUDE_DIR)
  message(STATUS "decodelab: nccl.h in ${NCCL_INCLUDE_DIR}")
endif()
