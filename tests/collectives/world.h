// World: W ranks of a test or bench binary on loopback. Rank 0 is the calling process; ranks 1..W-1
// are the binary started again (PeerProcess). The AllGather runs over their channels, rank 0 as hub.
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "tests/common/peer_process.h"

namespace ponte::test {

// Rank 0's AllGather: every other rank's bytes over its channel, then everything back to each.
inline AllGather hub_allgather(std::vector<std::unique_ptr<PeerProcess>>& ranks) {
  return [&ranks](std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all) -> Status {
    all->assign(ranks.size() + 1, {});
    (*all)[0].assign(mine.begin(), mine.end());
    for (size_t i = 0; i < ranks.size(); i++) {
      std::vector<uint8_t>& b = (*all)[i + 1];
      if (!ranks[i]->channel().recv(&b, 60000))
        return Status(Code::kPeerDead, "bootstrap: rank %zu did not send its bytes", i + 1);
      // A rank whose Communicator::create failed before its AllGather sends its error text instead
      // ("communicator: ..."): report that, not a malformed record.
      static constexpr char kFailed[] = "communicator: ";
      if (b.size() >= sizeof(kFailed) - 1 && memcmp(b.data(), kFailed, sizeof(kFailed) - 1) == 0)
        return Status(Code::kPeerDead, "bootstrap: rank %zu failed: %.*s", i + 1, static_cast<int>(b.size()),
                      reinterpret_cast<const char*>(b.data()));
    }
    for (auto& r : ranks)
      for (auto& b : *all)
        if (!r->channel().send(b)) return Status(Code::kPeerDead, "bootstrap: a rank left");
    return Status::Ok();
  };
}

// Rank r > 0's AllGather over its channel to rank 0.
inline AllGather channel_allgather(const Channel& ch, int world) {
  return [&ch, world](std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all) -> Status {
    if (!ch.send(mine.data(), mine.size())) return Status(Code::kPeerDead, "bootstrap: rank 0 is gone");
    all->assign(world, {});
    for (int i = 0; i < world; i++)
      if (!ch.recv(&(*all)[i], 60000)) return Status(Code::kPeerDead, "bootstrap: no bytes from rank 0");
    return Status::Ok();
  };
}

}  // namespace ponte::test
