// ponte-soak's engine half: one long-lived Engine per process, a stream of write-with-immediate
// messages both ways with credits returned as immediates, driven by one polling thread as NCCL's
// proxy drives the plugin (Engine::progress, yield only after a pass without progress), and
// connect/close cycles against a fresh engine in the peer process.
#pragma once

#include <memory>

#include "core/engine.h"
#include "tests/soak/soak_support.h"

namespace ponte::soak {

class EngineSoak {
 public:
  // Creates this process's engine and connects the two (side A connects, B accepts).
  EngineSoak(const Options& o, const Channel& ch, bool side_a);
  ~EngineSoak();
  EngineSoak(const EngineSoak&) = delete;
  EngineSoak& operator=(const EngineSoak&) = delete;

  // bytes_each_way in each direction between the two long-lived engines; what this side received.
  StreamResult stream(uint64_t bytes_each_way, uint64_t out, uint64_t in);
  // n cycles numbered first..: side B creates a fresh engine, the two connect (A dials on even
  // cycles, B on odd ones), each side registers fresh buffers, writes one message with an
  // immediate and verifies the other's; then B destroys its engine and A deregisters. Returns
  // the cycles that verified.
  int cycles(int first, int n, uint64_t out, uint64_t in);
  // Side A: waits until every peer the cycles made is dead (their engines were destroyed).
  // Returns how many are not.
  int settle();
  Engine& engine() { return *eng_; }

 private:
  const Options& o_;
  const Channel& ch_;
  bool a_;
  std::unique_ptr<Engine> eng_;
  PeerId peer_ = 0;  // the other process's long-lived engine
  std::vector<uint8_t> their_address_;
  std::vector<PeerId> cycle_peers_;  // side A: peers made by the cycles
  size_t inbound_seen_ = 0;          // side A: inbound peers known so far
};

}  // namespace ponte::soak
