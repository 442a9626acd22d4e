// Counter-based random numbers: every value is a pure function of (stream key, index), so a tensor can
// be generated in any order, in chunks, on the CPU or on the GPU, and always comes out the same. This is
// what lets `make-model` stream a 67 GB checkpoint and `bench --shape` build identical weights on the
// device without a file.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define DL_HOST_DEVICE __host__ __device__
#else
#define DL_HOST_DEVICE
#endif

namespace dl {

DL_HOST_DEVICE inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// FNV-1a of a name, mixed with the seed: the stream key of one tensor.
inline uint64_t StreamKey(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return SplitMix64(h ^ SplitMix64(seed));
}

// Uniform in (0, 1), 24 random bits.
DL_HOST_DEVICE inline float UniformAt(uint64_t key, uint64_t index) {
  const uint64_t r = SplitMix64(key ^ SplitMix64(index));
  return (static_cast<float>(r >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Standard normal via Box-Muller over two uniforms of the same counter.
DL_HOST_DEVICE inline float NormalAt(uint64_t key, uint64_t index) {
  const float u1 = UniformAt(key, 2 * index);
  const float u2 = UniformAt(key, 2 * index + 1);
  return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

}  // namespace dl
