// Unit tests of the NCCL transport's wire formats and immediate layout (plugin/wire.h).
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <vector>

#include "plugin/wire.h"

using namespace ponte;
using namespace ponte::plugin;

namespace {

RemoteRegion region(int nics, uint64_t addr = 0x7f0000001000, uint64_t len = 1 << 20) {
  RemoteRegion r;
  r.addr = addr;
  r.len = len;
  r.nics = static_cast<uint8_t>(nics);
  for (int i = 0; i < nics; ++i) {
    r.rkey[i] = 0x1000 + i;
    r.remote_base[i] = addr;
  }
  return r;
}

TEST(PluginWire, HandleRoundTripAndStage) {
  std::vector<uint8_t> addr(60);
  for (size_t i = 0; i < addr.size(); ++i) addr[i] = static_cast<uint8_t>(i + 1);
  uint8_t h[kHandleSize];
  ASSERT_TRUE(encode_handle(ListenHandle{7, 0x1122334455667788ull, false, addr}, h).ok());
  EXPECT_EQ(handle_stage(h), 0u);
  set_handle_stage(h, 99);
  auto d = decode_handle(h);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->listen_id, 7u);
  EXPECT_EQ(d->nonce, 0x1122334455667788ull);
  ASSERT_EQ(d->address.size(), addr.size());
  EXPECT_EQ(std::memcmp(d->address.data(), addr.data(), addr.size()), 0);
  EXPECT_EQ(handle_stage(h), 99u);
  EXPECT_FALSE(d->bootstrap);
  // A bootstrap handle ('B'): the address is a one-NIC group the listener answers through.
  ASSERT_TRUE(encode_handle(ListenHandle{8, 9, true, addr}, h).ok());
  auto b = decode_handle(h);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->bootstrap);
  EXPECT_EQ(b->listen_id, 8u);
}

TEST(PluginWire, HandleRejectsWhatItDoesNotUnderstand) {
  uint8_t zeros[kHandleSize] = {};
  EXPECT_EQ(decode_handle(zeros).status().code(), Code::kInvalidArgument);
  std::vector<uint8_t> addr(20, 5);
  uint8_t h[kHandleSize];
  ASSERT_TRUE(encode_handle(ListenHandle{1, 2, false, addr}, h).ok());
  uint8_t bad[kHandleSize];
  std::memcpy(bad, h, kHandleSize);
  bad[0] = kWireVersion + 1;  // version
  EXPECT_FALSE(decode_handle(bad).ok());
  std::memcpy(bad, h, kHandleSize);
  bad[1] = 'X';  // kind
  EXPECT_FALSE(decode_handle(bad).ok());
  std::memcpy(bad, h, kHandleSize);
  bad[2] = 200;  // length beyond the handle's address room
  EXPECT_FALSE(decode_handle(bad).ok());
  std::memcpy(bad, h, kHandleSize);
  std::memset(bad + 4, 0, 4);  // listen id 0
  EXPECT_FALSE(decode_handle(bad).ok());
  std::vector<uint8_t> huge(kHandleMaxAddress + 1, 1);
  EXPECT_EQ(encode_handle(ListenHandle{1, 2, false, huge}, h).code(), Code::kInvalidArgument);
}

TEST(PluginWire, ConnectionMessagesRoundTrip) {
  uint8_t buf[kMaxMsgSize];
  ConnectMsg c;
  c.listen_id = 3;
  c.listen_nonce = 44;
  c.token = 55;
  c.sender_comm_id = 6;
  c.fifo = region(4, 0x1000, kFifoBytes);
  auto n = encode_connect(c, buf);
  ASSERT_TRUE(n.ok());
  ASSERT_EQ(peek_kind({buf, n.value()}).value(), MsgKind::kConnect);
  auto dc = decode_connect({buf, n.value()});
  ASSERT_TRUE(dc.ok()) << dc.status().message();
  EXPECT_EQ(dc->listen_id, 3u);
  EXPECT_EQ(dc->listen_nonce, 44u);
  EXPECT_EQ(dc->token, 55u);
  EXPECT_EQ(dc->sender_comm_id, 6u);
  EXPECT_EQ(dc->fifo.nics, 4);
  EXPECT_EQ(dc->fifo.rkey[3], 0x1003u);
  EXPECT_TRUE(dc->reply_address.empty());
  EXPECT_EQ(dc->traffic_class, -1) << "no class asked for is none, not class 0";
  // With a reply address (bootstrap handles) and a traffic class: both come back whole.
  c.reply_address.assign(170, 0x5a);
  for (int tc : {0, 106, 255}) {
    c.traffic_class = tc;
    auto nb = encode_connect(c, buf);
    ASSERT_TRUE(nb.ok());
    auto db = decode_connect({buf, nb.value()});
    ASSERT_TRUE(db.ok()) << db.status().message();
    EXPECT_EQ(db->reply_address, c.reply_address);
    EXPECT_EQ(db->traffic_class, tc);
    EXPECT_FALSE(decode_connect({buf, nb.value() - 1}).ok());
  }
  // A class outside 0..255 is neither encoded nor accepted on the wire (0xffff alone means none).
  c.traffic_class = 256;
  EXPECT_FALSE(encode_connect(c, buf).ok());
  c.traffic_class = 106;
  auto nt = encode_connect(c, buf);
  ASSERT_TRUE(nt.ok());
  const size_t tc_at = 30 + c.fifo.encode().size();
  ASSERT_EQ(buf[tc_at], 106);
  buf[tc_at + 1] = 1;  // class 0x016a
  EXPECT_FALSE(decode_connect({buf, nt.value()}).ok());
  c.traffic_class = -1;
  c.reply_address.clear();
  n = encode_connect(c, buf);
  ASSERT_TRUE(n.ok());
  // Truncated, or with a FIFO too small for the protocol: rejected.
  EXPECT_FALSE(decode_connect({buf, n.value() - 1}).ok());
  c.fifo.len = kFifoBytes - 1;
  auto small = encode_connect(c, buf);
  ASSERT_TRUE(small.ok());
  EXPECT_FALSE(decode_connect({buf, small.value()}).ok());

  AcceptMsg a;
  a.token = 55;
  a.receiver_comm_id = 9;
  a.records = region(2, 0x2000, kRecordRegionBytes);
  auto an = encode_accept(a, buf);
  ASSERT_TRUE(an.ok());
  auto da = decode_accept({buf, an.value()});
  ASSERT_TRUE(da.ok()) << da.status().message();
  EXPECT_EQ(da->token, 55u);
  EXPECT_EQ(da->receiver_comm_id, 9u);
  EXPECT_EQ(da->records.nics, 2);
  EXPECT_FALSE(decode_connect({buf, an.value()}).ok()) << "an ACCEPT is not a CONNECT";
  std::memset(buf + 12, 0, 4);  // comm id 0
  EXPECT_FALSE(decode_accept({buf, an.value()}).ok());

  const size_t rn = encode_reject(RejectMsg{77, RejectReason::kClosed}, buf);
  auto dr = decode_reject({buf, rn});
  ASSERT_TRUE(dr.ok());
  EXPECT_EQ(dr->token, 77u);
  EXPECT_EQ(dr->reason, RejectReason::kClosed);
  EXPECT_FALSE(peek_kind({buf, 3}).ok());
  buf[1] = 'Q';
  EXPECT_FALSE(peek_kind({buf, rn}).ok());
}

TEST(PluginWire, NoticeRoundTripAndStrictDecoding) {
  uint8_t buf[kMaxMsgSize];
  const NoticeMsg m{0x1122334455667788ull, true, NoticeWhat::kClosed, true, 41};
  ASSERT_EQ(encode_notice(m, buf), kNoticeBytes);
  ASSERT_EQ(peek_kind({buf, kNoticeBytes}).value(), MsgKind::kNotice);
  auto d = decode_notice({buf, kNoticeBytes});
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(*d, m);
  for (NoticeWhat w : {NoticeWhat::kBroken, NoticeWhat::kAck}) {
    encode_notice(NoticeMsg{9, false, w, false, 0}, buf);
    auto dw = decode_notice({buf, kNoticeBytes});
    ASSERT_TRUE(dw.ok());
    EXPECT_EQ(dw->what, w);
    EXPECT_FALSE(dw->to_send);
  }
  // Truncated, longer, token 0, unknown notice, role or clean byte, reserved byte set: refused.
  encode_notice(m, buf);
  EXPECT_FALSE(decode_notice({buf, kNoticeBytes - 1}).ok());
  EXPECT_FALSE(decode_notice({buf, kNoticeBytes + 1}).ok());
  for (size_t at : {size_t{12}, size_t{13}, size_t{14}, size_t{15}}) {
    uint8_t bad[kNoticeBytes];
    std::memcpy(bad, buf, kNoticeBytes);
    bad[at] = 7;
    EXPECT_FALSE(decode_notice({bad, kNoticeBytes}).ok()) << "byte " << at;
  }
  encode_notice(NoticeMsg{0, false, NoticeWhat::kBroken, false, 0}, buf);
  EXPECT_FALSE(decode_notice({buf, kNoticeBytes}).ok()) << "token 0";
  EXPECT_FALSE(decode_reject({buf, kNoticeBytes}).ok()) << "a NOTICE is not a REJECT";
}

constexpr uint64_t kSeal = 0x1234abcd5678ef90ull;  // a pair's CONNECT token

TEST(PluginWire, CtsSlotRoundTrip) {
  std::vector<uint8_t> slot(kCtsSlotBytes, 0xee), copy(kCtsSlotBytes);
  const auto r4 = region(4).encode();
  const auto r1 = region(1, 0x9000, 8192).encode();
  CtsElem elems[3];
  elems[0] = CtsElem{0, 1000, 11, r4};
  elems[1] = CtsElem{4096, 4096, -5, r1};
  elems[2] = CtsElem{0, 0, 12, {}};  // zero-byte receive without a registration
  ASSERT_TRUE(encode_cts(1234, 1201, kSeal, elems, slot.data()).ok());
  auto n = read_cts(slot.data(), 1234, kSeal, copy.data());
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(n.value(), 3);
  EXPECT_EQ(cts_oldest_open(copy.data()), 1201u);  // the receiver's oldest open request
  EXPECT_EQ(read_cts(slot.data(), 1235, kSeal, copy.data()).status().code(), Code::kAgain) << "another request's CTS";
  EXPECT_EQ(read_cts(slot.data(), 1234, kSeal + 1, copy.data()).status().code(), Code::kAgain)
      << "another pair's CTS (a comm closed before)";
  ASSERT_TRUE(read_cts(slot.data(), 1234, kSeal, copy.data()).ok());
  CtsElem e;
  RemoteRegion r;
  ASSERT_TRUE(decode_cts_elem(copy.data(), 1, &e, &r).ok());
  EXPECT_EQ(e.offset, 4096u);
  EXPECT_EQ(e.size, 4096u);
  EXPECT_EQ(e.tag, -5);
  EXPECT_EQ(r.nics, 1);
  EXPECT_EQ(r.len, 8192u);
  ASSERT_TRUE(decode_cts_elem(copy.data(), 2, &e, &r).ok());
  EXPECT_EQ(e.size, 0u);
  // A buffer that does not fit its region is refused.
  elems[1].offset = 8000;
  ASSERT_TRUE(encode_cts(1, 1, kSeal, elems, slot.data()).ok());
  ASSERT_TRUE(read_cts(slot.data(), 1, kSeal, copy.data()).ok());
  EXPECT_FALSE(decode_cts_elem(copy.data(), 1, &e, &r).ok());
  // Bad counts.
  std::vector<CtsElem> nine(9, elems[0]);
  EXPECT_FALSE(encode_cts(1, 1, kSeal, nine, slot.data()).ok());
  EXPECT_FALSE(encode_cts(1, 1, kSeal, {}, slot.data()).ok());
  std::vector<uint8_t> zeros(kCtsSlotBytes, 0);
  EXPECT_EQ(read_cts(zeros.data(), 0, kSeal, copy.data()).status().code(), Code::kAgain) << "a fresh slot";
  EXPECT_EQ(read_cts(zeros.data(), 0, 0, copy.data()).status().code(), Code::kAgain) << "a fresh slot, seed 0";
}

// The CTS is a plain write: no order of placement within it is assumed, so the sender may read
// the slot while it lands, the previous CTS's bytes and the new one's mixed. Every such mix that
// is not the whole new CTS is "not yet" (kAgain), never a CTS: whichever bytes landed first, in
// any run of words, and a single byte missing anywhere.
TEST(PluginWire, CtsHalfLandedIsNotYetInEveryOrder) {
  const auto r4 = region(4).encode();
  const auto r1 = region(1, 0x9000, 8192).encode();
  std::vector<CtsElem> two = {CtsElem{0, 1000, 7, r4}, CtsElem{64, 100, 8, r1}};
  std::vector<uint8_t> old_cts(kCtsSlotBytes, 0), new_cts(kCtsSlotBytes, 0), slot(kCtsSlotBytes), copy(kCtsSlotBytes);
  ASSERT_TRUE(encode_cts(5, 5, kSeal, two, old_cts.data()).ok());  // request 5, two buffers
  two[1].size = 200;
  ASSERT_TRUE(encode_cts(37, 37, kSeal, two, new_cts.data()).ok());  // request 37, the same slot
  const size_t len = cts_bytes(2);
  int seen = 0;
  for (size_t from = 0; from < len; ++from)
    for (size_t to = from + 1; to <= len; ++to) {
      if (from == 0 && to == len) continue;  // all of it: the whole CTS
      slot = old_cts;  // bytes [from, to) of the new CTS have landed, the rest not yet
      std::memcpy(slot.data() + from, new_cts.data() + from, to - from);
      if (std::memcmp(slot.data(), new_cts.data(), len) != 0) {  // unless the rest was the same
        auto n = read_cts(slot.data(), 37, kSeal, copy.data());
        ASSERT_EQ(n.status().code(), Code::kAgain) << "bytes [" << from << ", " << to << ") of " << len;
        ++seen;
      }
      slot = new_cts;  // and the complement: all but [from, to)
      std::memcpy(slot.data() + from, old_cts.data() + from, to - from);
      if (std::memcmp(slot.data(), new_cts.data(), len) != 0) {
        auto n = read_cts(slot.data(), 37, kSeal, copy.data());
        ASSERT_EQ(n.status().code(), Code::kAgain) << "all but bytes [" << from << ", " << to << ") of " << len;
        ++seen;
      }
    }
  EXPECT_GT(seen, 1000);
  slot = old_cts;
  std::memcpy(slot.data(), new_cts.data(), len);
  auto n = read_cts(slot.data(), 37, kSeal, copy.data());
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(n.value(), 2);
}

// irecv writes only the CTS's header and its n elements (cts_bytes(n)), over whatever an earlier
// CTS with more buffers left in the slot: encoding touches no byte past them, and the slot decodes
// to the new CTS alone.
TEST(PluginWire, CtsWritesOnlyItsElementsOverAStaleSlot) {
  EXPECT_EQ(cts_bytes(1), 152u) << "one buffer's CTS: 24-byte header, one 128-byte element";
  EXPECT_LT(cts_bytes(1), kCtsSlotBytes / 4);
  const auto r4 = region(4).encode();
  const auto r1 = region(1, 0x9000, 8192).encode();
  std::vector<CtsElem> eight(kMaxRecvs, CtsElem{0, 1000, 7, r4});
  std::vector<uint8_t> sender_slot(kCtsSlotBytes, 0), copy(kCtsSlotBytes);
  ASSERT_TRUE(encode_cts(5, 5, kSeal, eight, sender_slot.data()).ok());  // request 5: eight buffers
  std::vector<uint8_t> fresh(kCtsSlotBytes, 0xee);
  CtsElem one[1] = {CtsElem{4096, 2048, 3, r1}};
  ASSERT_TRUE(encode_cts(37, 37, kSeal, one, fresh.data()).ok());  // request 37, the same slot: one buffer
  for (size_t i = cts_bytes(1); i < kCtsSlotBytes; ++i)
    ASSERT_EQ(fresh[i], 0xee) << "encode_cts wrote byte " << i << " past its element";
  std::memcpy(sender_slot.data(), fresh.data(), cts_bytes(1));  // what the write lands
  auto n = read_cts(sender_slot.data(), 37, kSeal, copy.data());
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(n.value(), 1) << "the stale CTS's seven other elements are not read";
  CtsElem e;
  RemoteRegion r;
  ASSERT_TRUE(decode_cts_elem(copy.data(), 0, &e, &r).ok());
  EXPECT_EQ(e.offset, 4096u);
  EXPECT_EQ(e.size, 2048u);
  EXPECT_EQ(e.tag, 3);
  EXPECT_EQ(r.nics, 1);
}

TEST(PluginWire, CtsInlineOfferRoundTripsForAnyBufferSize) {
  std::vector<uint8_t> slot(kCtsSlotBytes, 0);
  const auto r1 = region(1, 0x9000, 8192).encode();
  CtsElem elems[2] = {CtsElem{0, kInlineMax, 3, r1, true}, CtsElem{0, 8192, 4, r1, false}};
  ASSERT_TRUE(encode_cts(7, 7, kSeal, elems, slot.data()).ok());
  CtsElem e;
  RemoteRegion r;
  ASSERT_TRUE(decode_cts_elem(slot.data(), 0, &e, &r).ok());
  EXPECT_TRUE(e.inline_data);
  EXPECT_EQ(e.size, kInlineMax);
  ASSERT_TRUE(decode_cts_elem(slot.data(), 1, &e, &r).ok());
  EXPECT_FALSE(e.inline_data);
  // The offer does not bound the buffer (NCCL posts step buffers of 64 KiB and more): the sender
  // alone decides whether a message fits behind the record.
  const auto r4 = region(1, 0x9000, 8 << 20).encode();
  elems[0].size = 4 << 20;
  elems[0].region = r4;
  ASSERT_TRUE(encode_cts(7, 7, kSeal, elems, slot.data()).ok());
  ASSERT_TRUE(decode_cts_elem(slot.data(), 0, &e, &r).ok());
  EXPECT_TRUE(e.inline_data);
  EXPECT_EQ(e.size, 4u << 20);
  // Unknown flag bits are refused.
  ASSERT_TRUE(encode_cts(7, 7, kSeal, elems, slot.data()).ok());
  slot[kCtsHeader + kCtsElemBytes + 20] = 0x02;  // element 1's flags
  EXPECT_FALSE(decode_cts_elem(slot.data(), 1, &e, &r).ok());
  // Records: 8 per request slot, request numbers wrap at 32; inline slots follow them, no overlap.
  EXPECT_EQ(record_offset(0, 0), 0u);
  EXPECT_EQ(record_offset(kMaxRequests + 1, 2), (kMaxRecvs + 2) * kRecordBytes);
  EXPECT_EQ(record_offset(kMaxRequests - 1, kMaxRecvs - 1) + kRecordBytes, kRecordArea);
  // Inline slots follow the records and do not overlap.
  EXPECT_EQ(inline_slot_offset(0), kRecordArea);
  EXPECT_EQ(inline_slot_offset(kMaxRequests + 1), kRecordArea + kInlineSlotBytes);
  EXPECT_EQ(inline_slot_offset(kMaxRequests - 1) + kInlineSlotBytes, kRecordArea + kInlineArea);
  // Eager slots follow the inline slots and end the record region.
  EXPECT_EQ(eager_slot_offset(0), kRecordArea + kInlineArea);
  EXPECT_EQ(eager_slot_offset(kMaxRequests + 1), kRecordArea + kInlineArea + kInlineSlotBytes);
  EXPECT_EQ(eager_slot_offset(kMaxRequests - 1) + kInlineSlotBytes, kRecordRegionBytes);
}

// An eager record names its request by the full 64-bit number: the slot's record of request n - 32,
// or of n - 2^32 (the same low 32 bits), is not request n's; nor is a size record or a blank.
TEST(PluginWire, EagerRecordIsOnlyItsOwnRequests) {
  uint8_t b[kRecordBytes];
  const uint64_t n = (1ull << 32) + 40;
  encode_eager(EagerRecord{4096, n, -3}, b);
  EagerRecord r;
  ASSERT_TRUE(read_eager(b, n, &r));
  EXPECT_EQ(r, (EagerRecord{4096, n, -3}));
  EXPECT_FALSE(read_eager(b, n + 32, &r)) << "the next request of the slot";
  EXPECT_FALSE(read_eager(b, n - (1ull << 32), &r)) << "the same low 32 bits";
  encode_record(SizeRecord{100, 0, static_cast<uint32_t>(n)}, b);
  EXPECT_FALSE(read_eager(b, n, &r)) << "a size record";
  encode_blank_record(static_cast<uint32_t>(n), b);
  EXPECT_FALSE(read_eager(b, n, &r)) << "a blank";
  uint8_t zeros[kRecordBytes] = {};
  EXPECT_FALSE(read_eager(zeros, 0, &r)) << "a slot never written";
}

TEST(PluginWire, SizeRecordRoundTrip) {
  uint8_t b[kRecordBytes];
  encode_record(SizeRecord{(1ull << 33) + 5, 4, 77}, b);
  auto r = decode_record(b);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size, (1ull << 33) + 5);
  EXPECT_EQ(r->shards, 4u);
  EXPECT_EQ(r->request_number, 77u);
  uint8_t zeros[kRecordBytes] = {};
  EXPECT_FALSE(decode_record(zeros).ok());
}

// A blank record (a one-buffer receive's slot before anything was written there) is never read
// as a size record, is its own request's only, and a size record written over it is not blank.
TEST(PluginWire, BlankRecordIsNotASizeRecord) {
  uint8_t b[kRecordBytes];
  encode_blank_record(77, b);
  EXPECT_TRUE(is_blank_record(b, 77));
  EXPECT_FALSE(is_blank_record(b, 77 + kMaxRequests));  // the slot's next request: still blank from before
  EXPECT_FALSE(decode_record(b).ok());
  encode_record(SizeRecord{0, 0, 77}, b);
  EXPECT_FALSE(is_blank_record(b, 77));
  EXPECT_TRUE(decode_record(b).ok());
  uint8_t zeros[kRecordBytes] = {};
  EXPECT_FALSE(is_blank_record(zeros, 0));
}

TEST(PluginWire, ImmediateValuesAreDistinctAndBounded) {
  std::set<uint32_t> seen;
  for (uint32_t comm = 1; comm <= kMaxCommId; ++comm)
    for (uint64_t req = 0; req < kMaxRequests; ++req)
      for (bool rec : {false, true}) EXPECT_TRUE(seen.insert(imm_value(rec, comm, req)).second);
  // Request numbers reuse their slot's value: the set never grows past 64 values per comm.
  EXPECT_EQ(imm_value(false, 3, 5), imm_value(false, 3, 5 + kMaxRequests));
  EXPECT_EQ(seen.size(), size_t{kMaxCommId} * kMaxRequests * 2);
  // All of them in the engine's dense counters (no shared table to fill up).
  EXPECT_LT(*seen.rbegin(), kDenseImmValues);
}

}  // namespace
