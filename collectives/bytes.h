// bytes: unaligned little-endian field access for the collectives' wire records and blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ponte::coll {

template <typename T>
inline void put(uint8_t* p, size_t off, T v) {
  memcpy(p + off, &v, sizeof(T));
}
template <typename T>
inline T get(const uint8_t* p, size_t off) {
  T v;
  memcpy(&v, p + off, sizeof(T));
  return v;
}

}  // namespace ponte::coll
