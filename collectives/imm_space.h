// imm_space: the immediate values collectives put on the wire, a bounded range disjoint from the NCCL
// plugin's (plugin/wire.h uses bit 31 and bits 14..0, leaves bit 30 zero; every value here has it set).
#pragma once

#include <cstdint>

namespace ponte::coll {

//   bit  31     : 0
//   bit  30     : 1 (collectives)
//   bits 29..26 : kind (ImmKind)
//   bits 25..24 : epoch: the slot of an EpBuffer handle, or a call counter mod 4
//   bits 23..20 : channel: 0 the communicator itself, 1..15 its EpBuffers
//   bits 19..0  : the sending rank (below 2^20)
// Counters are consumed exactly by the waiting side, so a value is reused only once its previous
// use was counted and consumed: no generation bits (the reuse argument is in each protocol).
constexpr uint32_t kImmCollectiveBit = 1u << 30;
constexpr int kImmKindShift = 26;
constexpr int kImmEpochShift = 24;
constexpr int kImmChannelShift = 20;
constexpr uint32_t kImmRankMask = (1u << 20) - 1;
constexpr int kMaxRanks = 1 << 20;
constexpr int kMaxChannels = 16;
constexpr uint32_t kEpochs = 4;

enum class ImmKind : uint32_t {
  kDispatchHeader = 0,
  kDispatchData = 1,
  kCombineHeader = 2,
  kCombineData = 3,
  kBarrier = 4,
  kExchange = 5,   // small all-gather over the control arena
  kCts = 6,        // clear-to-send record (all_to_all_v, recv)
  kHeader = 7,     // length record of a transfer (all_to_all_v, send)
  kData = 8,       // data of a transfer
};

constexpr uint32_t imm_value(ImmKind kind, uint32_t epoch, uint32_t channel, uint32_t rank) {
  return kImmCollectiveBit | (static_cast<uint32_t>(kind) << kImmKindShift) | ((epoch % kEpochs) << kImmEpochShift) |
         ((channel & 0xfu) << kImmChannelShift) | (rank & kImmRankMask);
}

static_assert((imm_value(ImmKind::kData, 3, 15, kImmRankMask) & (1u << 31)) == 0, "bit 31 is the plugin's");
static_assert(static_cast<uint32_t>(ImmKind::kData) < 16, "4 kind bits");

}  // namespace ponte::coll
