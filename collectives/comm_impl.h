// Communicator::Impl: the communicator's state and the helpers EpBuffer shares with it (waiting on
// many flags with the rank of each, the control arena, the small engine all-gather). Internal.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/imm_space.h"
#include "core/notify.h"

namespace ponte {

// Flags of one call, each labelled with the rank it concerns (-1: several). wait() waits for every
// posted flag (each fires: OK, peer dead, or timeout after PONTE_TIMEOUT_MS) and returns the first
// failure, naming the rank; a dead rank is preferred to a timeout in the message.
class FlagSet {
 public:
  explicit FlagSet(size_t capacity = 0) { reserve(capacity); }
  void reserve(size_t n);
  // Submits one engine operation about `rank` (-1: several): submit(Notify) returns the engine's
  // Status; a refused operation is recorded as this set's failure (its flag would never fire).
  template <typename Submit>
  void post(int rank, Submit submit) {
    if (used_ == cap_) return refused(rank, Status(Code::kInternal, "FlagSet: %zu flags reserved", cap_));
    Flag* f = &flags_[used_];
    f->reset();
    ranks_[used_] = rank;
    Status st = submit(f->notify());
    if (st.ok()) used_++;
    else refused(rank, st);
  }
  void refused(int rank, const Status& st);
  // interruptible: c's interrupted hook may end the wait (every expectation of the group is
  // cancelled, the writes are still waited for); teardown waits pass false.
  Status wait(Communicator::Impl& c, const char* what, bool interruptible = true);
  size_t size() const { return used_; }

 private:
  std::unique_ptr<Flag[]> flags_;
  std::vector<int> ranks_;
  size_t cap_ = 0;
  size_t used_ = 0;
  Status refused_;
  int refused_rank_ = -1;
};

struct Communicator::Impl {
  std::unique_ptr<Engine> engine;
  int group = 0;
  int rank = 0;
  int world = 1;
  uint32_t timeout_ms = 30000;
  // The engine peer of each rank (kAnyPeer for this rank). Each pair has one connection: the lower
  // rank connects (outbound), then names itself with a two-sided hello so that the higher rank
  // knows which inbound peer it is (connecting both ways at once races in the handshake).
  std::vector<PeerId> peers;
  std::unique_ptr<std::atomic<uint32_t>[]> hello_peer;  // per rank: inbound peer + 1, set by on_hello
  std::vector<int> others;    // every rank but this one
  std::vector<PeerId> other_peers;

  // Control arena: slots of kCtrlSlot bytes, (area, epoch, rank). Incoming areas are written by the
  // rank named; outgoing ones are this rank's staging for records it writes to that rank.
  enum Area { kXchg, kA2aCts, kA2aHdr, kP2pCts, kP2pHdr, kOutA2aCts, kOutA2aHdr, kOutP2pCts, kOutP2pHdr, kHello, kAreas };
  static constexpr size_t kCtrlSlot = 512;
  uint8_t* ctrl = nullptr;
  size_t ctrl_len = 0;
  MemoryRegion ctrl_mr;
  std::vector<RemoteRegion> ctrl_remote;  // every rank's control arena

  uint64_t barrier_calls = 0;
  uint64_t xchg_calls = 0;
  uint64_t a2a_calls = 0;
  std::vector<uint64_t> p2p_sent, p2p_recvd;  // per rank
  uint32_t next_channel = 1;                  // EpBuffers take channels 1..14
  Status failed;                              // sticky: a peer died, a wait timed out or was interrupted
  bool (*interrupted)(void*) = nullptr;       // CommunicatorOptions::interrupted
  void* interrupted_arg = nullptr;
  bool was_interrupted = false;               // sticky: a wait was interrupted (failed says where)
  std::chrono::steady_clock::time_point next_interrupt_check{};

  // Scratch of the calls (one thread drives a communicator), sized for the world at create, so
  // that barrier, send, recv and all_to_all_v of registered buffers allocate nothing: flag sets
  // and per-rank offsets. (all_to_all_v of raw pointers still registers them per call.)
  FlagSet flags[4];
  std::vector<size_t> send_off, recv_off;  // [world + 1]
  std::vector<RemoteRegion> regions;       // [world]
  void reserve_scratch();

  size_t ctrl_offset(Area a, uint32_t epoch, int r) const {
    return ((static_cast<size_t>(a) * coll::kEpochs + epoch % coll::kEpochs) * world + r) * kCtrlSlot;
  }
  uint8_t* ctrl_slot(Area a, uint32_t epoch, int r) { return ctrl + ctrl_offset(a, epoch, r); }

  // Whether the interrupted hook asks to stop waiting: asks at most every kInterruptCheck, and
  // answers true from then on (sticky). False without a hook.
  static constexpr auto kInterruptCheck = std::chrono::milliseconds(100);
  bool interrupt_requested();
  // The status of a call that an interrupt ended (also remembered in failed).
  Status interrupted_error(const char* what);
  // Formats an error about rank r (or the dead ranks, if r < 0) and remembers fatal ones.
  Status rank_error(int r, const Status& st, const char* what);
  // Every rank's bytes (at most kCtrlSlot - 8), over the engine. Collective.
  Status exchange(std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all);
  Status check_usable() const { return failed; }
};

}  // namespace ponte
