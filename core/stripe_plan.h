// StripePlan: how one write is cut into shards over the NICs of a group (local NIC i writes to
// the peer's NIC i). Both ends compute the same shard count, which is what the target's counter expects.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ponte {

// The largest shard ponte puts in one write. Each group advertises the smallest max_msg_size of its
// NICs; both ends use min(theirs, ours, kMaxShardBytes), so they agree on the shard count.
constexpr size_t kMaxShardBytes = size_t{1} << 30;
// Shard boundaries fall on multiples of this: NCCL's LL128 lines (128 bytes, flag in the last 8)
// must each travel whole through one NIC, never split between two.
constexpr size_t kShardAlignBytes = 128;

struct StripePlan {
  uint32_t shards = 1;   // number of writes (each carries the immediate, if any)
  size_t shard_bytes = 0;  // every shard but the last has this many bytes
  int nics = 1;          // NICs used: shard j goes to NIC (first_nic + j) % nics

  // len: write size; nics: min(local, peer) NICs; stripe_min: below this, one NIC; max_shard:
  // the largest write both ends' NICs take (rounded down to kShardAlignBytes, at least that).
  static StripePlan make(size_t len, int nics, size_t stripe_min, size_t max_shard = kMaxShardBytes);
  size_t shard_offset(uint32_t j) const { return static_cast<size_t>(j) * shard_bytes; }
  size_t shard_len(uint32_t j, size_t len) const {
    size_t off = shard_offset(j);
    if (off >= len) return 0;
    size_t left = len - off;
    return left < shard_bytes ? left : shard_bytes;
  }
};

}  // namespace ponte
