// PageBuffer: page-aligned memory a test registers, freed when it goes out of scope. Declared
// before the engine that registers it, it outlives that engine (and ASan's leak check is quiet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace ponte::test {

struct PageBuffer {
  explicit PageBuffer(size_t len) : p(static_cast<uint8_t*>(std::aligned_alloc(4096, (len + 4095) / 4096 * 4096))) {}
  ~PageBuffer() { std::free(p); }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;
  uint8_t* p;
};

}  // namespace ponte::test
