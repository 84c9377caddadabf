// The byte pattern multi-process tests write and verify: a seed and a position give each byte, so
// the receiving side checks every byte without the sender's buffer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ponte::test {

inline uint8_t pattern(uint32_t seed, size_t i) { return static_cast<uint8_t>(seed * 131 + i * 7 + (i >> 9)); }

inline void fill(uint8_t* p, size_t len, uint32_t seed) {
  for (size_t i = 0; i < len; i++) p[i] = pattern(seed, i);
}

// The first index that does not match, or SIZE_MAX. It reads memory a provider thread wrote (as a
// NIC would, unsynchronized by nature): TSan is told not to instrument it.
__attribute__((no_sanitize("thread"))) inline size_t check(const uint8_t* p, size_t len, uint32_t seed) {
  for (size_t i = 0; i < len; i++)
    if (p[i] != pattern(seed, i)) return i;
  return SIZE_MAX;
}

}  // namespace ponte::test
