// Wire formats of ponte's NCCL transport: the listen handle, the connection messages, the
// clear-to-send (CTS) FIFO slot, the size record and the immediate-value layout. Each has a version.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/remote_region.h"
#include "core/status.h"

namespace ponte::plugin {

constexpr uint8_t kWireVersion = 7;  // 2: CTS elements may ask for inline data; 3: CONNECT carries a traffic class;
                                     // 4: the inline slot is offered (any buffer size), the sender picks;
                                     // 5: a message that fills its one buffer may come without a record;
                                     // 6: the CTS is a plain write, sealed (no immediate);
                                     // 7: the CTS names the receiver's oldest open request; eager slots

// ---------------------------------------------------------------------------------------------
// Limits of the protocol.
constexpr int kMaxRequests = 32;      // requests in flight per comm (NCCL_NET_MAX_REQUESTS)
constexpr int kMaxRecvs = 8;          // buffers in one grouped receive (maxRecvs)
constexpr int kMaxNicsPerDevice = 4;  // NICs fused into one plugin device (NCCL_NET_MAX_DEVS_PER_NIC)
// Comm ids per device (send and receive comms together). Each id owns 64 immediate values (data
// and record, for 32 slots; a send comm's go unused since the CTS carries none), dense from 64:
// the device's engine counts values below kDenseImmValues in a flat array (4 MiB per device), so
// every id can be in use at once.
constexpr uint32_t kMaxCommId = 16383;

// ---------------------------------------------------------------------------------------------
// Immediate values (32 bits). The engine counts immediates per value and per NIC group, so every
// value names the comm that owns it in the group that receives it:
//
//   bits 31..20 : 0 (reserved)
//   bits 19..6  : comm id (1..16383), allocated by the device (group) the immediate lands on
//   bit   5     : 1 = size record, 0 = data shard (immediates land at receivers only: the CTS
//                 is a plain write, wire version 6)
//   bits  4..0  : request slot (request number mod 32: 32 requests in flight per comm)
//
// A grouped receive is one request: its n size records all carry the record value of that
// request, and all data shards of its n buffers carry its data value. A slot is reused only after
// its previous request completed and its counts were consumed exactly, so values need no
// generation bits.
// A closed comm's id stays unused for the engine timeout (late immediates of a comm closed with
// work outstanding end by then), and whatever counts are left on its values are consumed before
// the id is handed out again.
constexpr uint32_t kImmRecordBit = 1u << 5;
constexpr int kImmCommShift = 6;
constexpr uint32_t kImmSlotMask = 0x1f;
constexpr uint32_t kDenseImmValues = (kMaxCommId + 1) << kImmCommShift;
static_assert(kMaxRequests == 32, "the slot field is 5 bits");

constexpr uint32_t imm_value(bool record, uint32_t comm_id, uint64_t request_number) {
  return (record ? kImmRecordBit : 0u) | (comm_id << kImmCommShift) |
         static_cast<uint32_t>(request_number & kImmSlotMask);
}

// ---------------------------------------------------------------------------------------------
// Listen handle: what listen() returns and NCCL hands to the connecting rank (<= 128 bytes).
//   u8 version, u8 kind, u16 length (16 + address bytes), u32 listen id, u64 listen nonce,
//   then an engine group address:
//   kind 'H': the address of the listening device's own group (it fits: 1-2 NICs, most 4-NIC
//             groups); the connector connects to it and sends CONNECT there.
//   kind 'B': the address of a one-NIC "bootstrap" group of the same process (the device's first
//             NIC), because the device's own address does not fit (four EFA NICs: 170 bytes).
//             The connector sends CONNECT there, with its own full address; the listener connects
//             back to that address from the listening device and answers from there.
//   Bytes 120..127 belong to the connecting side: connect() keeps the id of its pending
//   connection there between calls (0 in a fresh handle), as NCCL passes the same handle again.
constexpr size_t kHandleSize = 128;
constexpr size_t kHandleHeader = 16;
constexpr size_t kHandleStageOffset = 120;
constexpr size_t kHandleMaxAddress = kHandleStageOffset - kHandleHeader;  // 104

struct ListenHandle {
  uint32_t listen_id = 0;
  uint64_t nonce = 0;
  bool bootstrap = false;            // kind 'B': address is a bootstrap group's
  std::span<const uint8_t> address;  // points into the decoded buffer
};

// Writes the handle into out (kHandleSize bytes; the stage bytes are zeroed).
Status encode_handle(const ListenHandle& h, uint8_t* out);
Result<ListenHandle> decode_handle(const uint8_t* in);
uint64_t handle_stage(const uint8_t* handle);
void set_handle_stage(uint8_t* handle, uint64_t token);

// ---------------------------------------------------------------------------------------------
// Connection messages, sent two-sided through the engine (engine.send).
//   header: u8 version, u8 kind, u16 length (whole message)
//   CONNECT 'C' (sender -> listener): u32 listen id, u64 listen nonce, u64 connect token,
//       u32 sender comm id, u16 fifo region length, fifo RemoteRegion bytes, u16 traffic class
//       (0..255, 0xffff: none; the listener connects back in it through a bootstrap handle),
//       u16 reply address length, the sender device's group address (bootstrap handles only;
//       else length 0)
//   ACCEPT  'A' (listener -> sender): u64 connect token, u32 receiver comm id, u32 reserved (0),
//       u16 record region length, record RemoteRegion bytes
//   REJECT  'R' (listener -> sender): u64 connect token, u32 reason (RejectReason)
//   NOTICE  'N' (either end -> the other end of an established pair): u64 connect token (names the
//       pair), u8 target role (1 = the send comm, 0 = the recv comm), u8 what (NoticeWhat),
//       u8 clean (CLOSED: 1 when every operation of the closing comm ended well), u8 reserved (0),
//       u64 count (CLOSED: requests the closing comm started: the sender's matched CTS, the
//       receiver's posted CTS); 24 bytes
enum class MsgKind : uint8_t { kConnect = 'C', kAccept = 'A', kReject = 'R', kNotice = 'N' };
enum class RejectReason : uint32_t { kNoListener = 1, kClosed = 2, kNoResources = 3 };
// What one end of a comm pair tells the other (see transport_internal.h, "comm pairs").
enum class NoticeWhat : uint8_t {
  kBroken = 1,  // this end failed (a request failed, a receive buffer was deregistered): the
                // pair's slots can no longer be trusted; write nothing more here, and say so
  kClosed = 2,  // this end closed after its operations ended; it writes nothing more; nor may you
  kAck = 3,     // the answer to both: this end's writes toward you have ended, none will start
};

struct ConnectMsg {
  uint32_t listen_id = 0;
  uint64_t listen_nonce = 0;
  uint64_t token = 0;
  uint32_t sender_comm_id = 0;
  RemoteRegion fifo;
  int traffic_class = -1;               // the sender comm's class (-1: none); see reply_address
  std::vector<uint8_t> reply_address;  // empty unless the handle was a bootstrap one
  friend bool operator==(const ConnectMsg&, const ConnectMsg&) = default;
};
struct AcceptMsg {
  uint64_t token = 0;
  uint32_t receiver_comm_id = 0;
  RemoteRegion records;
  friend bool operator==(const AcceptMsg&, const AcceptMsg&) = default;
};
struct RejectMsg {
  uint64_t token = 0;
  RejectReason reason = RejectReason::kNoListener;
  friend bool operator==(const RejectMsg&, const RejectMsg&) = default;
};

struct NoticeMsg {
  uint64_t token = 0;
  bool to_send = false;  // the target is the pair's send comm (else its recv comm)
  NoticeWhat what = NoticeWhat::kBroken;
  bool clean = false;
  uint64_t count = 0;
  friend bool operator==(const NoticeMsg&, const NoticeMsg&) = default;
};

constexpr size_t kMaxMsgSize = 512;
constexpr size_t kNoticeBytes = 24;
// Each encoder returns the number of bytes written to out (capacity kMaxMsgSize).
Result<size_t> encode_connect(const ConnectMsg& m, uint8_t* out);
Result<size_t> encode_accept(const AcceptMsg& m, uint8_t* out);
size_t encode_reject(const RejectMsg& m, uint8_t* out);
size_t encode_notice(const NoticeMsg& m, uint8_t* out);
Result<MsgKind> peek_kind(std::span<const uint8_t> bytes);
Result<ConnectMsg> decode_connect(std::span<const uint8_t> bytes);
Result<AcceptMsg> decode_accept(std::span<const uint8_t> bytes);
Result<RejectMsg> decode_reject(std::span<const uint8_t> bytes);
Result<NoticeMsg> decode_notice(std::span<const uint8_t> bytes);

// ---------------------------------------------------------------------------------------------
// CTS FIFO slot: what irecv writes into slot (request % 32) of the sender's FIFO: its header and
// its n elements (cts_bytes(n): 152 bytes for one buffer, small enough for a verbs inline send, not
// the whole kCtsSlotBytes), as a plain write: no immediate, so no completion for the sender's
// provider to report (on tcp;ofi_rxm a completion costs the target a CQ entry and a wake-up
// signal; on verbs a receive). The sender reads the slot's bytes instead, into a copy of its own,
// and takes the copy only when it is whole: the request number it waits for and a seal over the
// copy's bytes (read_cts). The seal is a 64-bit hash seeded with the pair's CONNECT token: a write
// still landing (old and new bytes mixed: no order of placement within a write is assumed), the
// slot's previous CTS (another request number) and a zeroed slot all fail it.
//   header (24): u8 version, u8 kind 'T', u16 length, u32 request number (low 32 bits), u8 n,
//                3 pad, u32 oldest open request (low 32 bits: the receiver's oldest request not
//                yet ended when it wrote this CTS; every earlier one has ended: eager slots),
//                u64 seal (the hash of the cts_bytes(n) bytes with these 8 as zero)
constexpr size_t kCtsHeader = 24;
constexpr size_t kCtsElemHeader = 32;
constexpr size_t kCtsElemBytes = kCtsElemHeader + RemoteRegion::encoded_size(kMaxNicsPerDevice);
constexpr size_t kCtsSlotBytes = kCtsHeader + kMaxRecvs * kCtsElemBytes;
constexpr size_t kFifoBytes = kMaxRequests * kCtsSlotBytes;
// The bytes of a slot that a CTS for n buffers fills (its header's length field).
constexpr size_t cts_bytes(int n) { return kCtsHeader + static_cast<size_t>(n) * kCtsElemBytes; }

constexpr uint32_t kCtsInline = 1;

struct CtsElem {
  uint64_t offset = 0;  // of the receive buffer within its registered region
  uint64_t size = 0;    // capacity of the receive buffer
  int32_t tag = 0;
  std::span<const uint8_t> region;  // encoded RemoteRegion of the buffer's registration
  bool inline_data = false;  // kCtsInline: record and data together into the inline slot
};

// Writes one slot (header + n elements) into out (kCtsSlotBytes), sealed with `seal_seed` (the
// pair's CONNECT token). oldest_open: the receiver's oldest request not yet ended (request_number
// itself when every earlier one has).
Status encode_cts(uint32_t request_number, uint32_t oldest_open, uint64_t seal_seed, std::span<const CtsElem> elems,
                  uint8_t* out);
// Copies the CTS that `slot` (memory a peer writes) holds into `copy` (kCtsSlotBytes) and returns
// its buffer count n (1..kMaxRecvs) when the copy is the whole CTS of `expected_request_number`
// (version, kind, request number, length and seal); kAgain when it is not (yet): not written, the
// slot's previous CTS, or a write still landing.
Result<int> read_cts(const uint8_t* slot, uint32_t expected_request_number, uint64_t seal_seed, uint8_t* copy);
// The oldest open request a slot copy that read_cts took names.
uint32_t cts_oldest_open(const uint8_t* copy);
// Reads element i of a slot copy that read_cts took (offset, size, tag and the decoded region).
Status decode_cts_elem(const uint8_t* slot, int i, CtsElem* elem, RemoteRegion* region);

// ---------------------------------------------------------------------------------------------
// Size record: what a sender writes into the receiver's record slot (slot * 8 + buffer index)
// after (not ordered with) the data, with the request's record immediate.
//   u64 size sent, u32 data shards, u32 request number, u8 version, u8 kind 'S', u16 length (32),
//   12 pad (32 bytes)
// Whole-buffer messages: a one-buffer receive blanks its record slot (kind 'B', its request
// number) before it sends its CTS. A message that fills that buffer and goes in one write (one
// immediate: Engine::imms_per_write) carries the record immediate itself and no record follows:
// the record immediate arrived and the slot still blank means the whole buffer landed. One write
// per message instead of two. Write-with-immediate makes a write's bytes visible before its
// immediate, so a record that was sent is always read, never the blank.
constexpr size_t kRecordBytes = 32;
constexpr size_t kRecordArea = kMaxRequests * kMaxRecvs * kRecordBytes;

// Inline slots: after the records, one per request slot, each a size record followed by up to
// kInlineMax data bytes, for a request whose CTS offered it (kCtsInline); written with the
// request's record immediate. A record with shards 0 and size s has its s data bytes behind it
// (in the same write); one with shards > 0 had its data written into the receive buffer.
constexpr size_t kInlineMax = 4096;
constexpr size_t kInlineSlotBytes = kRecordBytes + kInlineMax;
constexpr size_t kInlineArea = kMaxRequests * kInlineSlotBytes;
// Where buffer i's size record of a request lands in the receiver's record area.
constexpr size_t record_offset(uint64_t request_number, int buffer) {
  return ((static_cast<size_t>(request_number % kMaxRequests) * kMaxRecvs) + static_cast<size_t>(buffer)) *
         kRecordBytes;
}
constexpr size_t inline_slot_offset(uint64_t request_number) {
  return kRecordArea + static_cast<size_t>(request_number % kMaxRequests) * kInlineSlotBytes;
}

// Eager slots: after the inline slots, one per request slot, each an eager record followed by up
// to kInlineMax data bytes: a small message sent before its CTS was read (plugin/README.md,
// "eager"), with the request's record immediate. The sender writes slot n % 32 only when the CTS
// it read last says request n - 32 ended at the receiver (its oldest open request is later), so
// the slot and the request's immediate values are free. The record names its request by the
// full 64-bit number, so an old record in the slot never passes for a new one.
//   u64 size, u64 request number, i32 tag, u8 version, u8 kind 'E', u16 length (32), 8 pad
constexpr size_t kEagerArea = kMaxRequests * kInlineSlotBytes;
constexpr size_t kRecordRegionBytes = kRecordArea + kInlineArea + kEagerArea;  // the receiver's record region
constexpr size_t eager_slot_offset(uint64_t request_number) {
  return kRecordArea + kInlineArea + static_cast<size_t>(request_number % kMaxRequests) * kInlineSlotBytes;
}
struct EagerRecord {
  uint64_t size = 0;
  uint64_t request_number = 0;
  int32_t tag = 0;
  friend bool operator==(const EagerRecord&, const EagerRecord&) = default;
};
void encode_eager(const EagerRecord& r, uint8_t* out);
// Whether in holds the eager record of request_number (then it is read into *r).
bool read_eager(const uint8_t* in, uint64_t request_number, EagerRecord* r);

struct SizeRecord {
  uint64_t size = 0;
  uint32_t shards = 0;
  uint32_t request_number = 0;
  friend bool operator==(const SizeRecord&, const SizeRecord&) = default;
};
void encode_record(const SizeRecord& r, uint8_t* out);
Result<SizeRecord> decode_record(const uint8_t* in);
// The blank a one-buffer receive leaves in its record slot, and whether a slot holds it.
void encode_blank_record(uint32_t request_number, uint8_t* out);
bool is_blank_record(const uint8_t* in, uint32_t request_number);

}  // namespace ponte::plugin
