// The striping rule: one NIC below the threshold, else every NIC; shards no larger than both ends' NICs take.
#include "core/stripe_plan.h"

namespace ponte {

StripePlan StripePlan::make(size_t len, int nics, size_t stripe_min, size_t max_shard) {
  StripePlan p;
  if (nics < 1) nics = 1;
  p.nics = (len >= stripe_min && nics > 1) ? nics : 1;
  if (max_shard > kMaxShardBytes) max_shard = kMaxShardBytes;
  max_shard &= ~(kShardAlignBytes - 1);
  if (max_shard < kShardAlignBytes) max_shard = kShardAlignBytes;
  uint64_t shards = static_cast<uint64_t>(p.nics);
  // Each shard at most max_shard: grow the count in steps of the NIC count.
  if ((len + shards - 1) / shards > max_shard) {
    uint64_t need = (len + max_shard - 1) / max_shard;
    shards = (need + p.nics - 1) / p.nics * p.nics;
  }
  size_t per = static_cast<size_t>((len + shards - 1) / shards);
  // Shard boundaries on LL128 lines (trailing shards may be empty: they are still posted, as
  // 0-byte writes, so the count stays what the target expects).
  if (shards > 1) per = (per + kShardAlignBytes - 1) & ~(kShardAlignBytes - 1);
  p.shards = static_cast<uint32_t>(shards);
  p.shard_bytes = per;
  return p;
}

}  // namespace ponte
