// EpBuffer: dispatch/combine on the engine. Per slot (two handles live at most) and phase, one
// block per (source, destination) pair: a header with counts per local expert, then rows.
#include "collectives/ep_buffer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "collectives/comm_impl.h"

namespace ponte {

using coll::imm_value;
using coll::ImmKind;

namespace {
constexpr int kSlots = 2;
enum Phase { kDispatch = 0, kCombine = 1 };
enum SlotState { kFree, kDispatchSent, kDispatchReceived, kCombineSent };
constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

// Arena (registered once): for each phase and slot, W incoming blocks (one per source rank) and W
// outgoing blocks (one per destination; this rank's own is packed straight into its incoming one).
//
// Why a remote slot may be rewritten without an extra barrier: rank r writes its dispatch block
// into rank d's incoming (dispatch, s, r) when it starts a handle in slot s. Slots are taken in the
// same order on every rank (lowest free; calls are collective), and r takes slot s again only after
// the previous handle in s finished combine_recv on r, which needed d's combine block for it, which
// d sends from combine_send only after its dispatch_recv had copied (dispatch, s, r) out. The same
// holds for combine: d writes r's incoming (combine, s, d) again only in a later handle's
// combine_send on s, after its dispatch_recv, which needed r's dispatch block of that handle, which
// r sent only after its combine_recv of the previous handle on s had read (combine, s, d). Counters
// are consumed exactly by the waits, so immediates of two uses of a slot never add up, and nothing
// depends on the order in which writes land.
struct EpBuffer::Impl {
  EpBuffer* self = nullptr;
  Communicator::Impl* ci = nullptr;
  EpConfig cfg;
  EpShape shape;
  uint32_t channel = 0;
  int W = 1, me = 0, L = 0;
  size_t hdr_bytes = 0, block_bytes[2] = {0, 0}, max_rows = 0;
  uint8_t* arena = nullptr;
  size_t arena_len = 0;
  MemoryRegion mr;
  std::vector<RemoteRegion> remote;  // every rank's arena
  Status failed;

  struct Slot {
    SlotState state = kFree;
    uint64_t seq = 0;
    int tokens = 0;
    std::vector<int32_t> counts;       // [W * L] rows this rank sent per (dst, local expert)
    std::vector<int32_t> send_map;     // [W * max_rows] t * K + k per (dst, row)
    std::vector<uint8_t> routed;       // [max_tokens] token has a valid expert
    std::vector<int32_t> src_info;     // [L * W * max_tokens * 2]
    std::vector<int32_t> layout;       // [L * W * 2]
    std::vector<int32_t> recv_counts;  // [W * L]: rows each source sent per local expert
    std::vector<ScatterTarget> hdr_targets;  // small blocks whole, large blocks' headers
    // combine() (both phases in one call): this rank's own rows are read from y itself, which
    // cannot change before the call returns, instead of being packed into its own block.
    const uint8_t* own_y = nullptr;
    // dispatch() (both phases in one call): this rank's own block carries tags only; its rows are
    // unpacked from x itself (own_x_tokens rows), which cannot change before the call returns.
    const uint8_t* own_x = nullptr;
    int own_x_tokens = 0;
    FlagSet sends{4};
  } slots[kSlots];
  uint64_t next_seq = 1;
  std::vector<int32_t> scratch_e, cursor, token_row, in_counts;
  std::vector<uint32_t> rows_out;
  std::vector<const uint8_t*> row_of;  // [max_tokens * K]: the combine row answering (t, k)
  std::vector<EpBlockHeader> headers;
  std::vector<uint8_t*> pack_at;
  FlagSet waits;

  // Device mode (cfg.device): the arena is mapped host memory of the device, and the kernels need
  // the routing on the device: one scratch set per buffer (send_map and layout_range per slot, as
  // a slot's combine reads them after the other slot's dispatch).
  EpDevice* dev = nullptr;
  struct DeviceScratch {
    int64_t* idx = nullptr;            // [max_tokens * K]
    int32_t* counts = nullptr;         // [W * L] the slot being dispatched
    int32_t* cursor = nullptr;         // [W * L]
    int32_t* token_row = nullptr;      // [max_tokens * W]
    int32_t* rows_out = nullptr;       // [W]
    int32_t* send_map[kSlots] = {};    // [W * max_rows]
    int32_t* layout[kSlots] = {};      // [L * W * 2]
    int32_t* src_counts = nullptr;     // [W * L] per source being unpacked
    int32_t* begins = nullptr;         // [W * L]
    int32_t* src_info = nullptr;       // [L * W * max_tokens * 2]
    int32_t* pos = nullptr;            // [max_tokens * K]
    float* weights = nullptr;          // [max_tokens * K]
    float* acc = nullptr;              // [max_tokens * H]
    uint8_t* routed = nullptr;         // [max_tokens]
  } dm;
  std::vector<void*> dev_allocs;
  std::vector<int32_t> rows_i32;  // rows_out from the device

  template <typename T>
  Status dev_alloc(T** p, size_t n) {
    auto r = dev->alloc(n * sizeof(T));
    if (!r.ok()) return r.status();
    dev_allocs.push_back(*r);
    *p = static_cast<T*>(*r);
    return Status::Ok();
  }
  Status dev_create() {
    const size_t Tm = static_cast<size_t>(cfg.max_tokens), K = static_cast<size_t>(cfg.topk), WL = static_cast<size_t>(W) * L;
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.idx, Tm * K));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.counts, WL));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.cursor, WL));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.token_row, Tm * W));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.rows_out, static_cast<size_t>(W)));
    for (int s = 0; s < kSlots; s++) {
      PONTE_RETURN_IF_ERROR(dev_alloc(&dm.send_map[s], static_cast<size_t>(W) * max_rows));
      PONTE_RETURN_IF_ERROR(dev_alloc(&dm.layout[s], WL * 2));
    }
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.src_counts, WL));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.begins, WL));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.src_info, WL * Tm * 2));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.pos, Tm * K));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.weights, Tm * K));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.acc, Tm * static_cast<size_t>(cfg.hidden)));
    PONTE_RETURN_IF_ERROR(dev_alloc(&dm.routed, Tm));
    rows_i32.assign(W, 0);
    return Status::Ok();
  }
  // Packs every destination's rows of slot s from x (device) into the outgoing blocks, this rank's
  // own too, then copies its own into its incoming block (where dispatch_recv reads it). Returns
  // once the device is done: the blocks may be posted.
  Status dev_pack_dispatch(int s, const void* x, const int64_t* topk_idx, int T) {
    Slot& sl = slots[s];
    PONTE_RETURN_IF_ERROR(dev->upload(dm.idx, topk_idx, static_cast<size_t>(T) * cfg.topk * sizeof(int64_t)));
    PONTE_RETURN_IF_ERROR(dev->upload(dm.counts, sl.counts.data(), sl.counts.size() * sizeof(int32_t)));
    PONTE_RETURN_IF_ERROR(dev->pack_dispatch(shape, x, dm.idx, T, dm.counts, block(kDispatch, s, 1, 0),
                                             block_bytes[kDispatch], hdr_bytes, dm.cursor, dm.token_row, dm.send_map[s],
                                             dm.rows_out));
    PONTE_RETURN_IF_ERROR(dev->download(rows_i32.data(), dm.rows_out, rows_i32.size() * sizeof(int32_t)));
    for (int d = 0; d < W; d++) rows_out[d] = static_cast<uint32_t>(rows_i32[d]);
    memcpy(block(kDispatch, s, 0, me) + hdr_bytes, block(kDispatch, s, 1, me) + hdr_bytes,
           rows_out[me] * dispatch_row_stride(shape));
    return Status::Ok();
  }
  // Launches the unpack of source r's block of slot s into recv_x (device); counts and begins [L].
  Status dev_unpack(int s, int r, const int32_t* counts, const int32_t* begins, void* recv_x) {
    const size_t at = static_cast<size_t>(r) * L;
    PONTE_RETURN_IF_ERROR(dev->upload(dm.src_counts + at, counts, L * sizeof(int32_t)));
    PONTE_RETURN_IF_ERROR(dev->upload(dm.begins + at, begins, L * sizeof(int32_t)));
    return dev->unpack_dispatch_block(shape, block(kDispatch, s, 0, r) + hdr_bytes, headers[r].rows, dm.src_counts + at, r,
                                      dm.begins + at, recv_x, dm.src_info, dm.pos);
  }
  // out (device) from every rank's combine block of slot s; returns once out is written.
  Status dev_combine(int s, int T, const float* topk_weights, void* out, bool accumulate) {
    Slot& sl = slots[s];
    const size_t TK = static_cast<size_t>(T) * cfg.topk;
    PONTE_RETURN_IF_ERROR(dev->upload(dm.weights, topk_weights, TK * sizeof(float)));
    PONTE_RETURN_IF_ERROR(dev->upload(dm.routed, sl.routed.data(), static_cast<size_t>(T)));
    PONTE_RETURN_IF_ERROR(dev->fill(dm.acc, 0, static_cast<size_t>(T) * cfg.hidden * sizeof(float)));
    for (int d = 0; d < W; d++)
      PONTE_RETURN_IF_ERROR(dev->reduce_combine_block(shape, block(kCombine, s, 0, d) + hdr_bytes, headers[d].rows,
                                                      dm.send_map[s] + static_cast<size_t>(d) * max_rows, dm.weights,
                                                      dm.acc));
    PONTE_RETURN_IF_ERROR(dev->finish_combine(shape, dm.acc, dm.routed, T, out, accumulate));
    return dev->sync();
  }

  // Blocks are laid out phase-major; dir 0 incoming (by source), 1 outgoing (by destination).
  size_t block_offset(int phase, int s, int dir, int r) const {
    size_t off = 0;
    for (int p = 0; p < phase; p++) off += static_cast<size_t>(kSlots) * 2 * W * block_bytes[p];
    return off + ((static_cast<size_t>(s) * 2 + dir) * W + r) * block_bytes[phase];
  }
  uint8_t* block(int phase, int s, int dir, int r) { return arena + block_offset(phase, s, dir, r); }

  Status check_handle(const EpHandle& h, SlotState want, const char* what) const {
    if (h.buf_ != self || h.slot_ < 0 || h.slot_ >= kSlots || slots[h.slot_].seq != h.seq_ ||
        slots[h.slot_].state == kFree)
      return Status(Code::kInvalidArgument, "%s: the handle is not live (released, failed or of another buffer)", what);
    if (slots[h.slot_].state != want) {
      static const char* names[] = {"free", "dispatch sent", "dispatch received", "combine sent"};
      return Status(Code::kInvalidArgument, "%s: the handle is at '%s'", what, names[slots[h.slot_].state]);
    }
    return Status::Ok();
  }
  Status check_rows(const EpRows& m, size_t min_rows, const char* what, const char* name) const {
    if (min_rows > 0 && !m.data) return Status(Code::kInvalidArgument, "%s: %s has no data", what, name);
    if (m.hidden != static_cast<size_t>(cfg.hidden))
      return Status(Code::kInvalidArgument, "%s: %s has hidden %zu, the buffer %d", what, name, m.hidden, cfg.hidden);
    if (m.dtype != cfg.dtype)
      return Status(Code::kInvalidArgument, "%s: %s is %s, the buffer %s", what, name, dtype_name(m.dtype),
                    dtype_name(cfg.dtype));
    if (m.rows < min_rows) return Status(Code::kInvalidArgument, "%s: %s has %zu rows, needs %zu", what, name, m.rows, min_rows);
    return Status::Ok();
  }
  // Ends the handle after a failure of the transport (a dead peer or a timeout fails the buffer).
  Status fail(EpHandle& h, const Status& st) {
    slots[h.slot_].state = kFree;
    slots[h.slot_].seq = 0;
    slots[h.slot_].own_y = nullptr;
    slots[h.slot_].own_x = nullptr;
    h.buf_ = nullptr;
    if (failed.ok() && (st.code() == Code::kPeerDead || st.code() == Code::kTimeout || st.code() == Code::kTransport ||
                        !ci->failed.ok()))
      failed = st;
    return st;
  }

  // Posts this rank's blocks of (phase, slot) to every other rank: small blocks in one scatter, each
  // one write of header and rows carrying the header immediate; a large one (several immediates per
  // write: striped over the NICs) as a write_imm of its rows carrying the data immediate plus its
  // header in the scatter, the header saying how many data immediates to expect.
  // counts: [W * L], the receiver d's counts at d * L.
  void post_blocks(int phase, int s, uint32_t seq, const int32_t* counts) {
    Slot& sl = slots[s];
    sl.hdr_targets.clear();
    const ImmKind hk = phase == kDispatch ? ImmKind::kDispatchHeader : ImmKind::kCombineHeader;
    const ImmKind dk = phase == kDispatch ? ImmKind::kDispatchData : ImmKind::kCombineData;
    for (int d = 0; d < W; d++) {
      EpBlockHeader& h = headers[d];
      h.seq = seq;
      const size_t total = hdr_bytes + h.data_bytes;
      const size_t off = block_offset(phase, s, d == me ? 0 : 1, d);
      const size_t dst_off = block_offset(phase, s, 0, me);
      h.data_imms = 0;
      // A dead rank gets nothing (a scatter naming it would be refused whole): the others still get
      // their blocks, so survivors' recv calls fail naming the dead rank, not this one.
      if (d != me && ci->engine->peer_dead(ci->group, ci->peers[d])) {
      } else if (d != me && h.data_bytes > 0 && ci->engine->imms_per_write(ci->group, ci->peers[d], total) > 1) {
        // Striped: a scatter target is one write on one NIC, so large rows go by write_imm.
        h.data_imms = ci->engine->imms_per_write(ci->group, ci->peers[d], h.data_bytes);
        sl.sends.post(d, [&](Notify n) {
          return ci->engine->write_imm(ci->group, ci->peers[d], {&mr, off + hdr_bytes, h.data_bytes}, remote[d],
                                       dst_off + hdr_bytes, imm_value(dk, static_cast<uint32_t>(s), channel,
                                                                      static_cast<uint32_t>(me)), n);
        });
        sl.hdr_targets.push_back({ci->peers[d], off, hdr_bytes, &remote[d], dst_off});
      } else if (d != me) {
        sl.hdr_targets.push_back({ci->peers[d], off, total, &remote[d], dst_off});
      }
      write_block_header(arena + off, shape, h, counts + static_cast<size_t>(d) * L);
    }
    const uint32_t hv = imm_value(hk, static_cast<uint32_t>(s), channel, static_cast<uint32_t>(me));
    if (!sl.hdr_targets.empty())
      sl.sends.post(-1, [&](Notify n) { return ci->engine->scatter(ci->group, mr, sl.hdr_targets, &hv, n); });
    // A thread that polled the group moments ago (the last recv's wait) leaves what it submits to
    // its next progress() call: post it now, before the caller goes off to compute.
    ci->engine->start_submitted(ci->group);
  }

  // Waits for every rank's block of (phase, slot) and this rank's own writes; checks each header.
  // in_counts [W * L] gets each source's counts.
  Status receive_blocks(int phase, int s, uint32_t seq, const char* what) {
    Slot& sl = slots[s];
    const ImmKind hk = phase == kDispatch ? ImmKind::kDispatchHeader : ImmKind::kCombineHeader;
    const ImmKind dk = phase == kDispatch ? ImmKind::kDispatchData : ImmKind::kCombineData;
    const uint8_t ph = phase == kDispatch ? kEpPhaseDispatch : kEpPhaseCombine;
    for (int r : ci->others)
      waits.post(r, [&](Notify n) {
        return ci->engine->expect_imm(ci->group, imm_value(hk, static_cast<uint32_t>(s), channel, static_cast<uint32_t>(r)),
                                      1, ci->peers[r], n);
      });
    Status st = waits.wait(*ci, what);
    for (int r = 0; r < W && st.ok(); r++) {
      Status hs = read_block_header(block(phase, s, 0, r), shape, ph, seq, &headers[r], &in_counts[static_cast<size_t>(r) * L]);
      if (!hs.ok()) st = ci->rank_error(r, hs, what);
      else if (r != me && headers[r].data_imms > 0)
        waits.post(r, [&](Notify n) {
          return ci->engine->expect_imm(ci->group, imm_value(dk, static_cast<uint32_t>(s), channel, static_cast<uint32_t>(r)),
                                        headers[r].data_imms, ci->peers[r], n);
        });
    }
    Status ds = waits.wait(*ci, what);
    Status ss = sl.sends.wait(*ci, what);
    if (st.ok()) st = ds;
    if (st.ok()) st = ss;
    return st;
  }
};

EpBuffer::EpBuffer() : impl_(std::make_unique<Impl>()) {}

EpBuffer::~EpBuffer() {
  Impl& im = *impl_;
  for (auto& sl : im.slots) sl.sends.wait(*im.ci, "EpBuffer teardown", /*interruptible=*/false).ok();  // writes still reading the arena
  if (im.mr.id) im.ci->engine->deregister(im.mr).ok();
  if (im.dev) {
    for (void* p : im.dev_allocs) im.dev->free(p);
    im.dev->free_mapped(im.arena);
  } else {
    free(im.arena);
  }
}

bool EpHandle::valid() const {
  return buf_ && slot_ >= 0 && slot_ < kSlots && buf_->impl_->slots[slot_].seq == seq_ &&
         buf_->impl_->slots[slot_].state != kFree;
}
std::span<const int32_t> EpHandle::src_info() const {
  if (!valid()) return {};
  return buf_->impl_->slots[slot_].src_info;
}
std::span<const int32_t> EpHandle::layout_range() const {
  if (!valid()) return {};
  return buf_->impl_->slots[slot_].layout;
}
int EpHandle::num_tokens() const { return valid() ? buf_->impl_->slots[slot_].tokens : 0; }

const EpConfig& EpBuffer::config() const { return impl_->cfg; }
int EpBuffer::local_experts() const { return impl_->L; }
size_t EpBuffer::recv_rows_per_expert() const { return static_cast<size_t>(impl_->W) * impl_->cfg.max_tokens; }
int EpBuffer::live_handles() const {
  int n = 0;
  for (auto& sl : impl_->slots) n += sl.state != kFree;
  return n;
}

Result<std::unique_ptr<EpBuffer>> EpBuffer::create(Communicator& comm, const EpConfig& cfg) {
  Communicator::Impl& ci = comm.impl();
  PONTE_RETURN_IF_ERROR(ci.failed);
  const int W = ci.world;
  if (cfg.num_experts <= 0 || cfg.num_experts % W != 0)
    return Status(Code::kInvalidArgument, "EpBuffer: %d experts over %d ranks (a positive multiple is needed)", cfg.num_experts, W);
  if (cfg.max_tokens <= 0 || cfg.hidden <= 0 || cfg.topk <= 0)
    return Status(Code::kInvalidArgument, "EpBuffer: max_tokens %d, hidden %d, topk %d must be positive", cfg.max_tokens,
                  cfg.hidden, cfg.topk);
  if (cfg.dtype != DType::kFloat32 && cfg.dtype != DType::kBFloat16)
    return Status(Code::kInvalidArgument, "EpBuffer: unknown dtype %u", static_cast<unsigned>(cfg.dtype));
  if (cfg.extra_bytes_per_row != 0)
    return Status(Code::kInvalidArgument, "EpBuffer: extra bytes per row (fp8 scales) are not supported yet");
  if (static_cast<int64_t>(cfg.max_tokens) * W > INT32_MAX / 2 || static_cast<int64_t>(cfg.max_tokens) * cfg.topk > INT32_MAX)
    return Status(Code::kInvalidArgument, "EpBuffer: max_tokens %d too large", cfg.max_tokens);
  if (ci.next_channel >= static_cast<uint32_t>(coll::kMaxChannels - 1))
    return Status(Code::kResource, "EpBuffer: a communicator carries at most %d EpBuffers", coll::kMaxChannels - 2);
  std::unique_ptr<EpBuffer> b(new EpBuffer());
  Impl& im = *b->impl_;
  im.self = b.get();
  im.ci = &ci;
  im.cfg = cfg;
  im.W = W;
  im.me = ci.rank;
  im.shape = make_ep_shape(W, cfg.num_experts, cfg.max_tokens, cfg.hidden, cfg.topk, cfg.dtype, cfg.extra_bytes_per_row);
  im.L = im.shape.local_experts;
  im.channel = ci.next_channel++;
  im.hdr_bytes = ep_header_bytes(im.L);
  im.max_rows = max_rows_per_block(im.shape);
  im.block_bytes[kDispatch] = align_up(dispatch_block_bytes(im.shape), 64);
  im.block_bytes[kCombine] = align_up(combine_block_bytes(im.shape), 64);
  im.arena_len = static_cast<size_t>(kSlots) * 2 * W * (im.block_bytes[0] + im.block_bytes[1]);
  if (cfg.device) {
    auto a = cfg.device->alloc_mapped(align_up(im.arena_len, 4096));
    if (!a.ok()) return Status(a.status().code(), "EpBuffer: the %zu-byte arena on %s: %s", im.arena_len, cfg.device->name(),
                               a.status().message());
    im.dev = cfg.device;  // from here on the destructor frees through the device
    im.arena = *a;
  } else {
    im.arena = static_cast<uint8_t*>(aligned_alloc(4096, align_up(im.arena_len, 4096)));
  }
  if (!im.arena) return Status(Code::kResource, "EpBuffer: no memory for a %zu-byte arena", im.arena_len);
  PONTE_ASSIGN_OR_RETURN(im.mr, ci.engine->register_memory(ci.group, im.arena, im.arena_len));
  const size_t per_expert = static_cast<size_t>(W) * cfg.max_tokens;
  for (auto& sl : im.slots) {
    sl.counts.assign(static_cast<size_t>(W) * im.L, 0);
    sl.send_map.assign(static_cast<size_t>(W) * im.max_rows, -1);
    sl.routed.assign(cfg.max_tokens, 0);
    sl.src_info.assign(static_cast<size_t>(im.L) * per_expert * 2, -1);
    sl.layout.assign(static_cast<size_t>(im.L) * W * 2, 0);
    sl.recv_counts.assign(static_cast<size_t>(W) * im.L, 0);
    sl.sends.reserve(static_cast<size_t>(W) + 2);
    sl.hdr_targets.reserve(W);
  }
  im.scratch_e.assign(cfg.num_experts, 0);
  im.cursor.assign(static_cast<size_t>(W) * im.L, 0);
  im.token_row.assign(W, -1);
  im.rows_out.assign(W, 0);
  im.in_counts.assign(static_cast<size_t>(W) * im.L, 0);
  im.row_of.assign(static_cast<size_t>(cfg.max_tokens) * cfg.topk, nullptr);
  im.headers.assign(W, {});
  im.pack_at.assign(W, nullptr);
  im.waits.reserve(2 * static_cast<size_t>(W) + 2);
  if (im.dev) {
    Status ds = im.dev_create();
    if (!ds.ok()) return Status(ds.code(), "EpBuffer: device scratch on %s: %s", im.dev->name(), ds.message());
  }
  std::vector<std::vector<uint8_t>> all;
  PONTE_RETURN_IF_ERROR(ci.exchange(im.mr.remote().encode(), &all));
  im.remote.resize(W);
  for (int r = 0; r < W; r++) {
    auto rr = RemoteRegion::decode(all[r]);
    if (!rr.ok()) return Status(Code::kInvalidArgument, "EpBuffer: rank %d's arena: %s", r, rr.status().message());
    if (rr->len != im.arena_len)
      return Status(Code::kInvalidArgument, "EpBuffer: rank %d's arena is %llu bytes, this rank's %zu (configs differ)", r,
                    static_cast<unsigned long long>(rr->len), im.arena_len);
    im.remote[r] = *rr;
  }
  return b;
}

Result<EpHandle> EpBuffer::dispatch_send(const EpRows& x, std::span<const int64_t> topk_idx) {
  return dispatch_send_impl(x, topk_idx, false);
}

Result<EpHandle> EpBuffer::dispatch_send_impl(const EpRows& x, std::span<const int64_t> topk_idx, bool x_stays) {
  Impl& im = *impl_;
  const char* what = x_stays ? "dispatch" : "dispatch_send";
  PONTE_RETURN_IF_ERROR(im.failed);
  PONTE_RETURN_IF_ERROR(im.ci->failed);
  if (x.rows > static_cast<size_t>(im.cfg.max_tokens))
    return Status(Code::kInvalidArgument, "%s: %zu tokens, the buffer takes at most %d", what, x.rows, im.cfg.max_tokens);
  const int T = static_cast<int>(x.rows);
  PONTE_RETURN_IF_ERROR(im.check_rows(x, x.rows, what, "x"));
  if (topk_idx.size() != x.rows * im.cfg.topk)
    return Status(Code::kInvalidArgument, "%s: topk_idx has %zu entries, expected %zu (T %d x K %d)", what, topk_idx.size(),
                  x.rows * im.cfg.topk, T, im.cfg.topk);
  PONTE_RETURN_IF_ERROR(check_routing(im.shape, topk_idx.data(), T, im.scratch_e.data()));
  int s = -1;
  for (int i = 0; i < kSlots && s < 0; i++)
    if (im.slots[i].state == kFree) s = i;
  if (s < 0)
    return Status(Code::kResource, "%s: %d handles are live already (each lives until its combine_recv); a third is refused",
                  what, kSlots);
  // On a device, x is never read in place (dispatch()'s shortcut): the kernels pack every block.
  if (im.dev) x_stays = false;
  Impl::Slot& sl = im.slots[s];
  const uint64_t seq = im.next_seq++;
  sl.tokens = T;
  count_routes(im.shape, topk_idx.data(), T, sl.counts.data());
  for (int t = 0; t < T; t++) {
    uint8_t any = 0;
    for (int k = 0; k < im.cfg.topk; k++) any |= topk_idx[static_cast<size_t>(t) * im.cfg.topk + k] >= 0;
    sl.routed[t] = any;
  }
  if (im.dev) {
    Status ds = im.dev_pack_dispatch(s, x.data, topk_idx.data(), T);  // the slot is still free if this fails
    if (!ds.ok()) return Status(ds.code(), "%s: %s", what, ds.message());
  } else {
    for (int d = 0; d < im.W; d++) im.pack_at[d] = im.block(kDispatch, s, d == im.me ? 0 : 1, d) + im.hdr_bytes;
    pack_dispatch(im.shape, x.data, nullptr, topk_idx.data(), T, sl.counts.data(), im.pack_at.data(), im.cursor.data(),
                  im.token_row.data(), sl.send_map.data(), im.rows_out.data(), x_stays ? im.me : -1);
  }
  sl.own_x = x_stays ? static_cast<const uint8_t*>(x.data) : nullptr;
  sl.own_x_tokens = T;
  const size_t stride = dispatch_row_stride(im.shape);
  for (int d = 0; d < im.W; d++) {
    EpBlockHeader& h = im.headers[d];
    h.phase = kEpPhaseDispatch;
    h.rows = im.rows_out[d];
    h.entries = 0;
    for (int l = 0; l < im.L; l++) h.entries += static_cast<uint32_t>(sl.counts[static_cast<size_t>(d) * im.L + l]);
    h.data_bytes = h.rows * stride;
  }
  sl.state = kDispatchSent;
  sl.seq = seq;
  im.post_blocks(kDispatch, s, static_cast<uint32_t>(seq), sl.counts.data());
  EpHandle h;
  h.buf_ = this;
  h.slot_ = s;
  h.seq_ = seq;
  return h;
}

Status EpBuffer::dispatch_recv(EpHandle& h, const EpRows& recv_x, std::span<int32_t> recv_count) {
  Impl& im = *impl_;
  const char* what = "dispatch_recv";
  PONTE_RETURN_IF_ERROR(im.check_handle(h, kDispatchSent, what));
  const size_t per_expert = recv_rows_per_expert();
  PONTE_RETURN_IF_ERROR(im.check_rows(recv_x, static_cast<size_t>(im.L) * per_expert, what, "recv_x"));
  if (recv_count.size() < static_cast<size_t>(im.L))
    return Status(Code::kInvalidArgument, "%s: recv_count has %zu entries, needs %d", what, recv_count.size(), im.L);
  Impl::Slot& sl = im.slots[h.slot_];
  const int me = im.me, L = im.L;
  // This rank's own block is here already: it is unpacked while the others' are still in flight,
  // its rows first in each expert's block (layout_range says where each source's rows are).
  std::fill(sl.src_info.begin(), sl.src_info.end(), -1);
  int32_t* own = &im.in_counts[static_cast<size_t>(me) * L];
  Status st = read_block_header(im.block(kDispatch, h.slot_, 0, me), im.shape, kEpPhaseDispatch,
                                static_cast<uint32_t>(sl.seq), &im.headers[me], own);
  std::fill(im.scratch_e.begin(), im.scratch_e.begin() + L, 0);
  if (st.ok() && im.dev) {
    st = im.dev->fill(im.dm.src_info, 0xff, sl.src_info.size() * sizeof(int32_t));  // -1 everywhere
    if (st.ok()) st = im.dev_unpack(h.slot_, me, own, im.scratch_e.data(), recv_x.data);
  } else if (st.ok())
    st = unpack_dispatch_block(im.shape, im.block(kDispatch, h.slot_, 0, me) + im.hdr_bytes, im.headers[me].rows, own, me,
                               im.scratch_e.data(), recv_x.data, nullptr, sl.src_info.data(), im.cursor.data(),
                               sl.own_x, sl.own_x_tokens);
  sl.own_x = nullptr;
  if (!st.ok()) return im.fail(h, st);
  st = im.receive_blocks(kDispatch, h.slot_, static_cast<uint32_t>(sl.seq), what);
  if (!st.ok()) return im.fail(h, st);
  sl.recv_counts = im.in_counts;
  for (int l = 0; l < L; l++) {
    int32_t b = 0;
    for (int i = 0; i < im.W; i++) {
      const int r = (me + i) % im.W;  // this rank first
      const int32_t c = sl.recv_counts[static_cast<size_t>(r) * L + l];
      sl.layout[2 * (static_cast<size_t>(l) * im.W + r)] = b;
      sl.layout[2 * (static_cast<size_t>(l) * im.W + r) + 1] = c;
      b += c;
    }
    recv_count[l] = b;  // <= W * max_tokens: each source sends at most max_tokens rows per expert
  }
  for (int r = 0; r < im.W; r++) {
    if (r == me) continue;
    for (int l = 0; l < L; l++) im.scratch_e[l] = sl.layout[2 * (static_cast<size_t>(l) * im.W + r)];
    if (im.dev) {
      st = im.dev_unpack(h.slot_, r, &sl.recv_counts[static_cast<size_t>(r) * L], im.scratch_e.data(), recv_x.data);
      if (!st.ok()) return im.fail(h, Status(st.code(), "%s: %s", what, st.message()));
      continue;
    }
    st = unpack_dispatch_block(im.shape, im.block(kDispatch, h.slot_, 0, r) + im.hdr_bytes, im.headers[r].rows,
                               &sl.recv_counts[static_cast<size_t>(r) * L], r, im.scratch_e.data(), recv_x.data,
                               nullptr, sl.src_info.data(), im.cursor.data());
    if (!st.ok()) return im.fail(h, im.ci->rank_error(r, st, what));
  }
  if (im.dev) {  // waits for the unpacks: recv_x is written when this returns
    st = im.dev->download(sl.src_info.data(), im.dm.src_info, sl.src_info.size() * sizeof(int32_t));
    if (!st.ok()) return im.fail(h, Status(st.code(), "%s: %s", what, st.message()));
  }
  sl.state = kDispatchReceived;
  return Status::Ok();
}

Status EpBuffer::combine_send(EpHandle& h, const EpRows& y) { return combine_send_impl(h, y, false); }

Status EpBuffer::combine_send_impl(EpHandle& h, const EpRows& y, bool y_stays) {
  Impl& im = *impl_;
  const char* what = y_stays ? "combine" : "combine_send";
  PONTE_RETURN_IF_ERROR(im.check_handle(h, kDispatchReceived, what));
  PONTE_RETURN_IF_ERROR(im.failed);
  PONTE_RETURN_IF_ERROR(im.ci->failed);
  PONTE_RETURN_IF_ERROR(im.check_rows(y, static_cast<size_t>(im.L) * recv_rows_per_expert(), what, "y"));
  Impl::Slot& sl = im.slots[h.slot_];
  const size_t stride = combine_row_stride(im.shape);
  if (im.dev) {
    // Every block (this rank's own into its incoming one) packed by the device, then posted.
    Status ds = im.dev->upload(im.dm.layout[h.slot_], sl.layout.data(), sl.layout.size() * sizeof(int32_t));
    for (int r = 0; r < im.W && ds.ok(); r++) {
      EpBlockHeader& hd = im.headers[r];
      hd.phase = kEpPhaseCombine;
      hd.rows = 0;
      for (int l = 0; l < im.L; l++) hd.rows += static_cast<uint32_t>(sl.layout[2 * (static_cast<size_t>(l) * im.W + r) + 1]);
      hd.entries = hd.rows;
      hd.data_bytes = hd.rows * stride;
      ds = im.dev->pack_combine_block(im.shape, y.data, r, im.dm.layout[h.slot_], hd.rows,
                                      im.block(kCombine, h.slot_, r == im.me ? 0 : 1, r) + im.hdr_bytes);
    }
    if (ds.ok()) ds = im.dev->sync();
    if (!ds.ok()) return im.fail(h, Status(ds.code(), "%s: %s", what, ds.message()));
    sl.state = kCombineSent;
    im.post_blocks(kCombine, h.slot_, static_cast<uint32_t>(sl.seq), sl.recv_counts.data());
    return Status::Ok();
  }
  // The other ranks' blocks are packed and posted first, this rank's own after: the peers copy
  // theirs in while this one is packed (only this rank's combine_recv reads it).
  for (int r = 0; r < im.W; r++) {
    EpBlockHeader& hd = im.headers[r];
    hd.phase = kEpPhaseCombine;
    if (r == im.me) {
      hd.rows = 0;
      for (int l = 0; l < im.L; l++) hd.rows += static_cast<uint32_t>(sl.layout[2 * (static_cast<size_t>(l) * im.W + r) + 1]);
    } else {
      hd.rows = pack_combine_block(im.shape, y.data, r, sl.layout.data(), im.block(kCombine, h.slot_, 1, r) + im.hdr_bytes);
    }
    hd.entries = hd.rows;
    hd.data_bytes = hd.rows * stride;
  }
  sl.state = kCombineSent;
  im.post_blocks(kCombine, h.slot_, static_cast<uint32_t>(sl.seq), sl.recv_counts.data());
  // y may change once combine_send returns, so this rank's own rows are copied out too; combine()
  // reads them from y in place (its combine_recv runs before it returns).
  if (y_stays)
    sl.own_y = static_cast<const uint8_t*>(y.data);
  else
    pack_combine_block(im.shape, y.data, im.me, sl.layout.data(), im.block(kCombine, h.slot_, 0, im.me) + im.hdr_bytes);
  return Status::Ok();
}

Status EpBuffer::combine_recv(EpHandle& h, std::span<const float> topk_weights, const EpRows& out, bool accumulate) {
  Impl& im = *impl_;
  const char* what = "combine_recv";
  PONTE_RETURN_IF_ERROR(im.check_handle(h, kCombineSent, what));
  Impl::Slot& sl = im.slots[h.slot_];
  const size_t T = static_cast<size_t>(sl.tokens);
  if (topk_weights.size() != T * im.cfg.topk)
    return Status(Code::kInvalidArgument, "%s: topk_weights has %zu entries, expected %zu (T %zu x K %d)", what,
                  topk_weights.size(), T * im.cfg.topk, T, im.cfg.topk);
  PONTE_RETURN_IF_ERROR(im.check_rows(out, T, what, "out"));
  Status st = im.receive_blocks(kCombine, h.slot_, static_cast<uint32_t>(sl.seq), what);
  // Each block must answer exactly the rows this rank sent that rank.
  for (int d = 0; d < im.W && st.ok(); d++)
    for (int l = 0; l < im.L; l++)
      if (im.in_counts[static_cast<size_t>(d) * im.L + l] != sl.counts[static_cast<size_t>(d) * im.L + l]) {
        st = im.ci->rank_error(d, Status(Code::kInvalidArgument, "combine block answers %d rows of local expert %d, %d were sent",
                                         im.in_counts[static_cast<size_t>(d) * im.L + l], l,
                                         sl.counts[static_cast<size_t>(d) * im.L + l]), what);
        break;
      }
  if (!st.ok()) return im.fail(h, st);
  if (im.dev) {
    st = im.dev_combine(h.slot_, static_cast<int>(T), topk_weights.data(), out.data, accumulate);
    if (!st.ok()) return im.fail(h, Status(st.code(), "%s: %s", what, st.message()));
    sl.state = kFree;
    sl.seq = 0;
    h.buf_ = nullptr;
    return Status::Ok();
  }
  // Where each (t, k)'s answer landed: row i of d's block answers send_map[d][i] (the counts were
  // checked against what was sent above, so every row and every routed (t, k) is named once).
  const size_t stride = combine_row_stride(im.shape);
  std::fill(im.row_of.begin(), im.row_of.begin() + static_cast<ptrdiff_t>(T * im.cfg.topk), nullptr);
  for (int d = 0; d < im.W; d++) {
    const uint8_t* rows = im.block(kCombine, h.slot_, 0, d) + im.hdr_bytes;
    const int32_t* map = &sl.send_map[static_cast<size_t>(d) * im.max_rows];
    if (d == im.me && sl.own_y) {  // in y itself, in the order pack_combine_block copies them
      for_each_combine_row(im.shape, sl.own_y, d, sl.layout.data(),
                           [&](uint32_t i, const uint8_t* row) { im.row_of[static_cast<size_t>(map[i])] = row; });
      continue;
    }
    for (uint32_t i = 0; i < im.headers[d].rows; i++) im.row_of[static_cast<size_t>(map[i])] = rows + i * stride;
  }
  combine_tokens(im.shape, im.row_of.data(), topk_weights.data(), sl.routed.data(), static_cast<int>(T), out.data,
                 accumulate);
  sl.state = kFree;
  sl.seq = 0;
  sl.own_y = nullptr;
  h.buf_ = nullptr;
  return Status::Ok();
}

Result<EpHandle> EpBuffer::dispatch(const EpRows& x, std::span<const int64_t> topk_idx, const EpRows& recv_x,
                                    std::span<int32_t> recv_count) {
  // Check the outputs first, so that bad ones fail before anything is sent.
  PONTE_RETURN_IF_ERROR(impl_->check_rows(recv_x, static_cast<size_t>(impl_->L) * recv_rows_per_expert(), "dispatch", "recv_x"));
  if (recv_count.size() < static_cast<size_t>(impl_->L))
    return Status(Code::kInvalidArgument, "dispatch: recv_count has %zu entries, needs %d", recv_count.size(), impl_->L);
  // dispatch_recv's own refusals (recv_x, recv_count) were checked above, and every failure after
  // them ends the handle (Impl::fail): x is never read once this returns.
  PONTE_ASSIGN_OR_RETURN(EpHandle h, dispatch_send_impl(x, topk_idx, true));
  PONTE_RETURN_IF_ERROR(dispatch_recv(h, recv_x, recv_count));
  return h;
}

Status EpBuffer::combine(EpHandle& h, const EpRows& y, std::span<const float> topk_weights, const EpRows& out,
                         bool accumulate) {
  if (h.valid()) {
    const size_t T = static_cast<size_t>(h.num_tokens());
    if (topk_weights.size() != T * impl_->cfg.topk)
      return Status(Code::kInvalidArgument, "combine: topk_weights has %zu entries, expected %zu", topk_weights.size(),
                    T * impl_->cfg.topk);
    PONTE_RETURN_IF_ERROR(impl_->check_rows(out, T, "combine", "out"));
  }
  // combine_recv's own refusals (the weights, out) were checked above, before anything was sent,
  // and every failure after them ends the handle (Impl::fail): the rows read from y in place are
  // never read once this returns.
  PONTE_RETURN_IF_ERROR(combine_send_impl(h, y, true));
  return combine_recv(h, topk_weights, out, accumulate);
}

}  // namespace ponte
