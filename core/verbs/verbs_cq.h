// The completion queue of one verbs NIC (every QP's sends and the SRQ's receives land here) and the
// work-request ids that let a completion find its operation again.
#pragma once

#include <memory>

#include "core/verbs/verbs_loader.h"

namespace ponte::verbs {

class VerbsCq {
 public:
  static Result<std::unique_ptr<VerbsCq>> create(const VerbsApi& api, ibv_context* ctx, int depth,
                                                 const std::string& name);
  ~VerbsCq();
  VerbsCq(const VerbsCq&) = delete;
  VerbsCq& operator=(const VerbsCq&) = delete;

  ibv_cq* cq() const { return cq_; }
  int depth() const { return depth_; }  // what the provider granted (>= requested)

 private:
  explicit VerbsCq(const VerbsApi& api) : api_(api) {}
  const VerbsApi& api_;
  ibv_cq* cq_ = nullptr;
  int depth_ = 0;
};

// wr_id layout. Receives: bit 63 set, low 32 bits = SRQ slot. Sends: bit 63 clear, bits 40..62 =
// peer index, 24..39 = generation of the peer's QP, 0..23 = the WR's sequence number in its QP.
namespace wrid {
constexpr uint64_t kRecv = uint64_t{1} << 63;
constexpr uint32_t kMaxPeers = 1u << 23;
constexpr uint32_t kSeqMask = 0xffffff;

inline uint64_t recv(uint32_t slot) { return kRecv | slot; }
inline uint64_t send(uint32_t peer, uint16_t gen, uint32_t seq) {
  return (uint64_t{peer} << 40) | (uint64_t{gen} << 24) | (seq & kSeqMask);
}
inline bool is_recv(uint64_t id) { return (id & kRecv) != 0; }
inline uint32_t slot(uint64_t id) { return static_cast<uint32_t>(id); }
inline uint32_t peer(uint64_t id) { return static_cast<uint32_t>((id >> 40) & (kMaxPeers - 1)); }
inline uint16_t gen(uint64_t id) { return static_cast<uint16_t>(id >> 24); }
inline uint32_t seq(uint64_t id) { return static_cast<uint32_t>(id) & kSeqMask; }
}  // namespace wrid

}  // namespace ponte::verbs
