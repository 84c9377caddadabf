// The striping rule: one NIC below the threshold, else every NIC; shards of at most 1 GiB.
#include "core/stripe_plan.h"

namespace ponte {

StripePlan StripePlan::make(size_t len, int nics, size_t stripe_min) {
  StripePlan p;
  if (nics < 1) nics = 1;
  p.nics = (len >= stripe_min && nics > 1) ? nics : 1;
  uint64_t shards = static_cast<uint64_t>(p.nics);
  // Each shard at most kMaxShardBytes: grow the count in steps of the NIC count.
  while ((len + shards - 1) / shards > kMaxShardBytes) shards += static_cast<uint64_t>(p.nics);
  size_t per = static_cast<size_t>((len + shards - 1) / shards);
  // Keep shard boundaries 64-byte aligned where the size allows (trailing shards may be empty:
  // they are still posted, as 0-byte writes, so the count stays what the target expects).
  if (shards > 1) per = (per + 63) & ~size_t{63};
  p.shards = static_cast<uint32_t>(shards);
  p.shard_bytes = per;
  return p;
}

}  // namespace ponte
