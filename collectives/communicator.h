// Communicator: W ranks over one engine group, bootstrapped through a caller-supplied AllGather, with
// barrier, all_to_all_v and point-to-point send/recv of registered buffers. EpBuffer builds on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/engine.h"
#include "core/status.h"

namespace ponte {

// Bootstrap exchange: every rank passes its bytes; on success `all` holds every rank's bytes, index =
// rank (this rank's own included). Collective; called once per Communicator::create. Adapters: MPI
// (collectives/mpi_allgather.h), torch.distributed (python). Exceptions must not escape it.
using AllGather = std::function<Status(std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all)>;

struct CommunicatorOptions {
  EngineOptions engine;  // the communicator's own engine; it uses group `group` of it
  int group = 0;
  // Asked on the calling thread, about every 100 ms, while a call (create included) waits for
  // other ranks; true ends the wait: the call fails with kCancelled, and so does every later call
  // of the communicator (the ranks are no longer in step). Python's binding answers Ctrl-C here.
  // nullptr: a call waits until the other ranks answer, die or time out (PONTE_TIMEOUT_MS).
  bool (*interrupted)(void* arg) = nullptr;
  void* interrupted_arg = nullptr;
};

// Memory registered with the communicator's engine group, for all_to_all_v and send/recv. Move-only;
// deregistered when destroyed (destroy it before its Communicator, after the ops using it ended).
class Registration {
 public:
  Registration() = default;
  Registration(Registration&& o) noexcept;
  Registration& operator=(Registration&& o) noexcept;
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  ~Registration();
  void* data() const { return mr_.addr; }
  size_t size() const { return mr_.len; }
  bool valid() const { return mr_.id != 0; }
  const MemoryRegion& region() const { return mr_; }
  const std::vector<uint8_t>& remote_bytes() const { return remote_; }  // encoded RemoteRegion

 private:
  friend class Communicator;
  Engine* engine_ = nullptr;
  MemoryRegion mr_;
  std::vector<uint8_t> remote_;  // mr_.remote().encode(), what a clear-to-send carries
};

// A byte range inside a Registration.
struct BufferRef {
  const Registration* reg = nullptr;
  size_t offset = 0;
};

// Not thread-safe: one thread drives a Communicator (and its EpBuffers). Every collective call
// (create, barrier, all_to_all_v, EpBuffer::create and its dispatch/combine) must be made by all
// ranks in the same order. Errors name the rank they concern; after a peer died, every later call
// fails with kPeerDead.
class Communicator {
 public:
  // Creates the engine, exchanges addresses through allgather, connects every pair, then runs a
  // barrier. Fails (never hangs) when a rank does not answer within PONTE_TIMEOUT_MS.
  static Result<std::unique_ptr<Communicator>> create(int rank, int world, const AllGather& allgather,
                                                      CommunicatorOptions opts = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int world() const;
  Engine& engine();
  int group() const;
  PeerId peer(int rank) const;  // the engine peer this rank writes to (kAnyPeer for itself)
  uint32_t timeout_ms() const;

  Status barrier();

  // Local (not collective) registration of caller memory with the communicator's engine group.
  Result<Registration> register_buffer(void* addr, size_t len);

  // Every rank sends send_counts[r] bytes to rank r, taken back to back from send (block r at
  // offset sum(send_counts[0..r))), and receives recv_counts[r] bytes from rank r into recv at
  // offset sum(recv_counts[0..r)). send_counts[r] on this rank must equal recv_counts[this rank] on
  // rank r (checked: a mismatch is an error on both ends). Zero-copy between registered buffers;
  // the raw-pointer overload registers both for the call.
  Status all_to_all_v(BufferRef send, std::span<const size_t> send_counts, BufferRef recv,
                      std::span<const size_t> recv_counts);
  Status all_to_all_v(const void* send, std::span<const size_t> send_counts, void* recv,
                      std::span<const size_t> recv_counts);

  // Blocking point-to-point of len bytes between registered buffers (receiver-driven: send waits
  // for the matching recv's clear-to-send, so a pair that both send first deadlocks until the
  // timeout, as MPI's rendezvous does). Messages between two ranks match in call order; a send
  // longer than the matching recv is an error on both ends; a shorter one is fine (recv_len).
  Status send(int dst, BufferRef buf, size_t len);
  Status recv(int src, BufferRef buf, size_t len, size_t* recv_len = nullptr);

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  Communicator();
  std::unique_ptr<Impl> impl_;
};

}  // namespace ponte
