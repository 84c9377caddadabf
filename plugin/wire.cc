// Encoders and decoders of the transport's wire formats (see wire.h). Little endian throughout.
#include "plugin/wire.h"

#include <bit>
#include <cstring>

namespace ponte::plugin {

static_assert(std::endian::native == std::endian::little,
              "the wire formats are little endian; add byte swaps for this host");

namespace {

constexpr uint16_t kNoTrafficClass = 0xffff;  // CONNECT: the sender asked for no class

template <typename T>
void put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

void put_header(uint8_t* p, uint8_t kind, size_t length) {
  p[0] = kWireVersion;
  p[1] = kind;
  put<uint16_t>(p + 2, static_cast<uint16_t>(length));
}

// Checks version, kind and that the stated length fits in what arrived.
Status check_header(std::span<const uint8_t> b, uint8_t kind, size_t min_len, const char* what) {
  if (b.size() < 4) return Status(Code::kInvalidArgument, "%s: %zu bytes, too short", what, b.size());
  if (b[0] != kWireVersion)
    return Status(Code::kInvalidArgument, "%s: version %u, expected %u", what, b[0], kWireVersion);
  if (b[1] != kind)
    return Status(Code::kInvalidArgument, "%s: kind 0x%02x, expected '%c'", what, b[1], kind);
  const size_t len = get<uint16_t>(b.data() + 2);
  if (len < min_len || len > b.size())
    return Status(Code::kInvalidArgument, "%s: length %zu outside [%zu, %zu]", what, len, min_len,
                  b.size());
  return Status::Ok();
}

// A connection message fills what arrived exactly: trailing bytes are a format this side does
// not know.
Status check_message(std::span<const uint8_t> b, uint8_t kind, size_t min_len, const char* what) {
  PONTE_RETURN_IF_ERROR(check_header(b, kind, min_len, what));
  const size_t len = get<uint16_t>(b.data() + 2);
  if (len != b.size())
    return Status(Code::kInvalidArgument, "%s: length %zu but %zu bytes arrived", what, len, b.size());
  return Status::Ok();
}

// A RemoteRegion embedded with a u16 (messages) or u8 (CTS) length prefix; with a name, it must
// hold at least min_len bytes.
Result<RemoteRegion> decode_region(std::span<const uint8_t> b, const char* what,
                                   const char* region = nullptr, size_t min_len = 0) {
  auto r = RemoteRegion::decode(b);
  if (!r.ok())
    return Status(Code::kInvalidArgument, "%s: bad region: %s", what, r.status().message());
  if (r->len < min_len)
    return Status(Code::kInvalidArgument, "%s: %s region of %llu bytes < %zu", what, region,
                  static_cast<unsigned long long>(r->len), min_len);
  return r;
}

}  // namespace

// ---- listen handle ----------------------------------------------------------------------------

Status encode_handle(const ListenHandle& h, uint8_t* out) {
  if (h.address.size() > kHandleMaxAddress)
    return Status(Code::kInvalidArgument,
                  "listen handle: engine address is %zu bytes, at most %zu fit in NCCL's %zu-byte "
                  "handle",
                  h.address.size(), kHandleMaxAddress, kHandleSize);
  if (h.listen_id == 0 || h.nonce == 0)
    return Status(Code::kInternal, "listen handle: id and nonce must be nonzero");
  std::memset(out, 0, kHandleSize);
  put_header(out, h.bootstrap ? 'B' : 'H', kHandleHeader + h.address.size());
  put<uint32_t>(out + 4, h.listen_id);
  put<uint64_t>(out + 8, h.nonce);
  std::memcpy(out + kHandleHeader, h.address.data(), h.address.size());
  return Status::Ok();
}

Result<ListenHandle> decode_handle(const uint8_t* in) {
  std::span<const uint8_t> b(in, kHandleStageOffset);
  const bool bootstrap = in[1] == 'B';
  PONTE_RETURN_IF_ERROR(
      check_header(b, bootstrap ? 'B' : 'H', kHandleHeader + 1, "listen handle"));
  ListenHandle h;
  h.bootstrap = bootstrap;
  h.listen_id = get<uint32_t>(in + 4);
  h.nonce = get<uint64_t>(in + 8);
  if (h.listen_id == 0 || h.nonce == 0)
    return Status(Code::kInvalidArgument, "listen handle: zero listen id or nonce");
  const size_t len = get<uint16_t>(in + 2);
  for (size_t i = len; i < kHandleStageOffset; ++i)
    if (in[i] != 0) return Status(Code::kInvalidArgument, "listen handle: nonzero byte %zu after the address", i);
  h.address = std::span<const uint8_t>(in + kHandleHeader, len - kHandleHeader);
  return h;
}

uint64_t handle_stage(const uint8_t* handle) { return get<uint64_t>(handle + kHandleStageOffset); }
void set_handle_stage(uint8_t* handle, uint64_t token) {
  put<uint64_t>(handle + kHandleStageOffset, token);
}

// ---- connection messages ----------------------------------------------------------------------

Result<size_t> encode_connect(const ConnectMsg& m, uint8_t* out) {
  const auto region = m.fifo.encode();
  const size_t len = 4 + 4 + 8 + 8 + 4 + 2 + region.size() + 2 + 2 + m.reply_address.size();
  if (len > kMaxMsgSize) return Status(Code::kInternal, "CONNECT: %zu bytes is too long", len);
  if (m.traffic_class < -1 || m.traffic_class > 255)
    return Status(Code::kInternal, "CONNECT: traffic class %d is not 0..255 or none", m.traffic_class);
  put_header(out, 'C', len);
  put<uint32_t>(out + 4, m.listen_id);
  put<uint64_t>(out + 8, m.listen_nonce);
  put<uint64_t>(out + 16, m.token);
  put<uint32_t>(out + 24, m.sender_comm_id);
  put<uint16_t>(out + 28, static_cast<uint16_t>(region.size()));
  std::memcpy(out + 30, region.data(), region.size());
  uint8_t* a = out + 30 + region.size();
  put<uint16_t>(a, m.traffic_class < 0 ? kNoTrafficClass : static_cast<uint16_t>(m.traffic_class));
  a += 2;
  put<uint16_t>(a, static_cast<uint16_t>(m.reply_address.size()));
  if (!m.reply_address.empty()) std::memcpy(a + 2, m.reply_address.data(), m.reply_address.size());
  return len;
}

Result<size_t> encode_accept(const AcceptMsg& m, uint8_t* out) {
  const auto region = m.records.encode();
  const size_t len = 4 + 8 + 4 + 4 + 2 + region.size();
  if (len > kMaxMsgSize) return Status(Code::kInternal, "ACCEPT: %zu bytes is too long", len);
  put_header(out, 'A', len);
  put<uint64_t>(out + 4, m.token);
  put<uint32_t>(out + 12, m.receiver_comm_id);
  put<uint32_t>(out + 16, 0);
  put<uint16_t>(out + 20, static_cast<uint16_t>(region.size()));
  std::memcpy(out + 22, region.data(), region.size());
  return len;
}

size_t encode_reject(const RejectMsg& m, uint8_t* out) {
  const size_t len = 4 + 8 + 4;
  put_header(out, 'R', len);
  put<uint64_t>(out + 4, m.token);
  put<uint32_t>(out + 12, static_cast<uint32_t>(m.reason));
  return len;
}

size_t encode_notice(const NoticeMsg& m, uint8_t* out) {
  put_header(out, 'N', kNoticeBytes);
  put<uint64_t>(out + 4, m.token);
  out[12] = m.to_send ? 1 : 0;
  out[13] = static_cast<uint8_t>(m.what);
  out[14] = m.clean ? 1 : 0;
  out[15] = 0;
  put<uint64_t>(out + 16, m.count);
  return kNoticeBytes;
}

Result<MsgKind> peek_kind(std::span<const uint8_t> b) {
  if (b.size() < 4) return Status(Code::kInvalidArgument, "message: %zu bytes, too short", b.size());
  if (b[0] != kWireVersion)
    return Status(Code::kInvalidArgument, "message: version %u, expected %u", b[0], kWireVersion);
  switch (b[1]) {
    case 'C':
      return MsgKind::kConnect;
    case 'A':
      return MsgKind::kAccept;
    case 'R':
      return MsgKind::kReject;
    case 'N':
      return MsgKind::kNotice;
    default:
      return Status(Code::kInvalidArgument, "message: unknown kind 0x%02x", b[1]);
  }
}

Result<ConnectMsg> decode_connect(std::span<const uint8_t> b) {
  PONTE_RETURN_IF_ERROR(check_message(b, 'C', 34, "CONNECT"));
  const size_t len = get<uint16_t>(b.data() + 2);
  ConnectMsg m;
  m.listen_id = get<uint32_t>(b.data() + 4);
  m.listen_nonce = get<uint64_t>(b.data() + 8);
  m.token = get<uint64_t>(b.data() + 16);
  m.sender_comm_id = get<uint32_t>(b.data() + 24);
  const size_t rlen = get<uint16_t>(b.data() + 28);
  if (30 + rlen + 4 > len)
    return Status(Code::kInvalidArgument, "CONNECT: region length %zu overruns %zu bytes", rlen,
                  len);
  const uint16_t tc = get<uint16_t>(b.data() + 30 + rlen);
  if (tc > 255 && tc != kNoTrafficClass)
    return Status(Code::kInvalidArgument, "CONNECT: traffic class %u is not 0..255 or none", tc);
  m.traffic_class = tc == kNoTrafficClass ? -1 : tc;
  const size_t alen = get<uint16_t>(b.data() + 32 + rlen);
  if (30 + rlen + 4 + alen != len)
    return Status(Code::kInvalidArgument, "CONNECT: lengths %zu + %zu do not fill %zu bytes",
                  rlen, alen, len);
  m.reply_address.assign(b.begin() + static_cast<std::ptrdiff_t>(34 + rlen),
                         b.begin() + static_cast<std::ptrdiff_t>(len));
  if (m.sender_comm_id == 0 || m.sender_comm_id > kMaxCommId || m.token == 0)
    return Status(Code::kInvalidArgument, "CONNECT: bad comm id %u or token", m.sender_comm_id);
  PONTE_ASSIGN_OR_RETURN(m.fifo, decode_region(b.subspan(30, rlen), "CONNECT", "FIFO", kFifoBytes));
  return m;
}

Result<AcceptMsg> decode_accept(std::span<const uint8_t> b) {
  PONTE_RETURN_IF_ERROR(check_message(b, 'A', 22, "ACCEPT"));
  const size_t len = get<uint16_t>(b.data() + 2);
  AcceptMsg m;
  m.token = get<uint64_t>(b.data() + 4);
  m.receiver_comm_id = get<uint32_t>(b.data() + 12);
  const size_t rlen = get<uint16_t>(b.data() + 20);
  if (22 + rlen != len)
    return Status(Code::kInvalidArgument, "ACCEPT: region length %zu does not fill %zu bytes",
                  rlen, len);
  if (m.receiver_comm_id == 0 || m.receiver_comm_id > kMaxCommId)
    return Status(Code::kInvalidArgument, "ACCEPT: bad comm id %u", m.receiver_comm_id);
  if (get<uint32_t>(b.data() + 16) != 0)
    return Status(Code::kInvalidArgument, "ACCEPT: reserved field is %u", get<uint32_t>(b.data() + 16));
  PONTE_ASSIGN_OR_RETURN(m.records, decode_region(b.subspan(22, rlen), "ACCEPT", "record", kRecordRegionBytes));
  return m;
}

Result<RejectMsg> decode_reject(std::span<const uint8_t> b) {
  PONTE_RETURN_IF_ERROR(check_message(b, 'R', 16, "REJECT"));
  if (b.size() != 16) return Status(Code::kInvalidArgument, "REJECT: %zu bytes, expected 16", b.size());
  RejectMsg m;
  m.token = get<uint64_t>(b.data() + 4);
  const uint32_t reason = get<uint32_t>(b.data() + 12);
  if (reason < static_cast<uint32_t>(RejectReason::kNoListener) ||
      reason > static_cast<uint32_t>(RejectReason::kNoResources))
    return Status(Code::kInvalidArgument, "REJECT: unknown reason %u", reason);
  m.reason = static_cast<RejectReason>(reason);
  return m;
}

Result<NoticeMsg> decode_notice(std::span<const uint8_t> b) {
  PONTE_RETURN_IF_ERROR(check_message(b, 'N', kNoticeBytes, "NOTICE"));
  if (b.size() != kNoticeBytes)
    return Status(Code::kInvalidArgument, "NOTICE: %zu bytes, expected %zu", b.size(), kNoticeBytes);
  NoticeMsg m;
  m.token = get<uint64_t>(b.data() + 4);
  const uint8_t role = b[12], what = b[13], clean = b[14];
  if (m.token == 0 || role > 1 || clean > 1 || b[15] != 0)
    return Status(Code::kInvalidArgument, "NOTICE: bad token, role %u, clean %u or reserved %u",
                  role, clean, b[15]);
  if (what < static_cast<uint8_t>(NoticeWhat::kBroken) || what > static_cast<uint8_t>(NoticeWhat::kAck))
    return Status(Code::kInvalidArgument, "NOTICE: unknown notice %u", what);
  m.to_send = role == 1;
  m.what = static_cast<NoticeWhat>(what);
  m.clean = clean == 1;
  m.count = get<uint64_t>(b.data() + 16);
  return m;
}

// ---- CTS slot ---------------------------------------------------------------------------------

namespace {
// The CTS seal: a 64-bit hash of `len` bytes (a multiple of 8) seeded with the pair's token, bytes
// 16..23 (the seal itself) taken as zero. Word by word, each mixed in with a multiply and a
// shift (splitmix64's finalizer): a change anywhere, a byte or the whole, changes the result but
// with a chance of 2^-64.
uint64_t cts_seal(const uint8_t* p, size_t len, uint64_t seed) {
  uint64_t h = seed ^ 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < len; i += 8) {
    uint64_t w = i == 16 ? 0 : get<uint64_t>(p + i);
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 31;
  }
  return h;
}
static_assert(kCtsHeader % 8 == 0 && kCtsElemBytes % 8 == 0, "the seal hashes whole words");
}  // namespace

Status encode_cts(uint32_t request_number, uint32_t oldest_open, uint64_t seal_seed, std::span<const CtsElem> elems,
                  uint8_t* out) {
  if (elems.empty() || elems.size() > static_cast<size_t>(kMaxRecvs))
    return Status(Code::kInvalidArgument, "CTS: %zu buffers, must be 1..%d", elems.size(),
                  kMaxRecvs);
  const size_t len = cts_bytes(static_cast<int>(elems.size()));
  put_header(out, 'T', len);
  put<uint32_t>(out + 4, request_number);
  out[8] = static_cast<uint8_t>(elems.size());
  std::memset(out + 9, 0, 3);
  put<uint32_t>(out + 12, oldest_open);
  std::memset(out + 16, 0, 8);
  for (size_t i = 0; i < elems.size(); ++i) {
    uint8_t* e = out + kCtsHeader + i * kCtsElemBytes;
    const CtsElem& c = elems[i];
    if (c.region.size() > kCtsElemBytes - kCtsElemHeader)
      return Status(Code::kInvalidArgument, "CTS: region of %zu bytes (more than %d NICs?)",
                    c.region.size(), kMaxNicsPerDevice);
    put<uint64_t>(e, c.offset);
    put<uint64_t>(e + 8, c.size);
    put<int32_t>(e + 16, c.tag);
    put<uint32_t>(e + 20, c.inline_data ? kCtsInline : 0u);
    e[24] = static_cast<uint8_t>(c.region.size());
    std::memset(e + 25, 0, 7);
    if (!c.region.empty()) std::memcpy(e + kCtsElemHeader, c.region.data(), c.region.size());
    std::memset(e + kCtsElemHeader + c.region.size(), 0, kCtsElemBytes - kCtsElemHeader - c.region.size());
  }
  put<uint64_t>(out + 16, cts_seal(out, len, seal_seed));
  return Status::Ok();
}

Result<int> read_cts(const uint8_t* slot, uint32_t expected_request_number, uint64_t seal_seed, uint8_t* copy) {
  auto not_yet = [] { return Status(Code::kAgain, "CTS: not (wholly) written yet"); };
  // The request number with an acquire load first: the copy's loads come after it, on weakly
  // ordered CPUs too (and after the caller's earlier ones: its progress call). Then the header
  // (the length to copy), then the whole CTS again: the seal is checked on the copy, and the
  // caller decodes only the copy. A peer's write may land meanwhile.
  const uint32_t number = __atomic_load_n(reinterpret_cast<const uint32_t*>(slot + 4), __ATOMIC_ACQUIRE);
  if (number != expected_request_number) return not_yet();
  std::memcpy(copy, slot, kCtsHeader);
  if (copy[0] != kWireVersion || copy[1] != 'T' || get<uint32_t>(copy + 4) != expected_request_number) return not_yet();
  const int n = copy[8];
  if (n < 1 || n > kMaxRecvs || get<uint16_t>(copy + 2) != cts_bytes(n)) return not_yet();
  const size_t len = cts_bytes(n);
  std::memcpy(copy, slot, len);
  if (get<uint16_t>(copy + 2) != len || copy[8] != n || get<uint64_t>(copy + 16) != cts_seal(copy, len, seal_seed))
    return not_yet();
  if (copy[0] != kWireVersion || copy[1] != 'T' || get<uint32_t>(copy + 4) != expected_request_number) return not_yet();
  return n;
}

uint32_t cts_oldest_open(const uint8_t* copy) { return get<uint32_t>(copy + 12); }

Status decode_cts_elem(const uint8_t* slot, int i, CtsElem* elem, RemoteRegion* region) {
  const uint8_t* e = slot + kCtsHeader + static_cast<size_t>(i) * kCtsElemBytes;
  elem->offset = get<uint64_t>(e);
  elem->size = get<uint64_t>(e + 8);
  elem->tag = get<int32_t>(e + 16);
  const uint32_t flags = get<uint32_t>(e + 20);
  if (flags & ~kCtsInline) return Status(Code::kInvalidArgument, "CTS: unknown flags 0x%x", flags);
  elem->inline_data = (flags & kCtsInline) != 0;
  const size_t rlen = e[24];
  if (rlen > kCtsElemBytes - kCtsElemHeader)
    return Status(Code::kInvalidArgument, "CTS: region length %zu too long", rlen);
  elem->region = std::span<const uint8_t>(e + kCtsElemHeader, rlen);
  if (rlen == 0) {  // a zero-byte buffer without a registration: nothing may land in it
    if (elem->size != 0 || elem->offset != 0)
      return Status(Code::kInvalidArgument, "CTS: buffer without a region at offset %llu, %llu bytes",
                    static_cast<unsigned long long>(elem->offset),
                    static_cast<unsigned long long>(elem->size));
    *region = RemoteRegion{};
    return Status::Ok();
  }
  auto r = decode_region(elem->region, "CTS");
  if (!r.ok()) return r.status();
  *region = r.value();
  if (elem->offset > region->len || elem->size > region->len - elem->offset)
    return Status(Code::kInvalidArgument, "CTS: buffer [%llu, +%llu) outside its %llu-byte region",
                  static_cast<unsigned long long>(elem->offset),
                  static_cast<unsigned long long>(elem->size),
                  static_cast<unsigned long long>(region->len));
  return Status::Ok();
}

// ---- size record ------------------------------------------------------------------------------

void encode_record(const SizeRecord& r, uint8_t* out) {
  std::memset(out, 0, kRecordBytes);
  put<uint64_t>(out, r.size);
  put<uint32_t>(out + 8, r.shards);
  put<uint32_t>(out + 12, r.request_number);
  put_header(out + 16, 'S', kRecordBytes);
}

void encode_blank_record(uint32_t request_number, uint8_t* out) {
  std::memset(out, 0, kRecordBytes);
  put<uint32_t>(out + 12, request_number);
  put_header(out + 16, 'B', kRecordBytes);
}

bool is_blank_record(const uint8_t* in, uint32_t request_number) {
  return in[16] == kWireVersion && in[17] == 'B' && get<uint16_t>(in + 18) == kRecordBytes &&
         get<uint32_t>(in + 12) == request_number;
}

void encode_eager(const EagerRecord& r, uint8_t* out) {
  std::memset(out, 0, kRecordBytes);
  put<uint64_t>(out, r.size);
  put<uint64_t>(out + 8, r.request_number);
  put<int32_t>(out + 16, r.tag);
  put_header(out + 20, 'E', kRecordBytes);
}

bool read_eager(const uint8_t* in, uint64_t request_number, EagerRecord* r) {
  if (in[20] != kWireVersion || in[21] != 'E' || get<uint16_t>(in + 22) != kRecordBytes ||
      get<uint64_t>(in + 8) != request_number)
    return false;
  r->size = get<uint64_t>(in);
  r->request_number = request_number;
  r->tag = get<int32_t>(in + 16);
  return true;
}

Result<SizeRecord> decode_record(const uint8_t* in) {
  if (in[16] != kWireVersion || in[17] != 'S' || get<uint16_t>(in + 18) != kRecordBytes)
    return Status(Code::kInvalidArgument, "size record: version %u kind 0x%02x length %u", in[16],
                  in[17], get<uint16_t>(in + 18));
  SizeRecord r;
  r.size = get<uint64_t>(in);
  r.shards = get<uint32_t>(in + 8);
  r.request_number = get<uint32_t>(in + 12);
  return r;
}

}  // namespace ponte::plugin
