// Fuzzes the plugin's connection messages (CONNECT, ACCEPT, REJECT, NOTICE, received through engine.send
// from any peer): an accepted message is of this version and kind, and re-encodes to exactly its
// bytes; messages built from the input round-trip unchanged.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstring>

#include "fuzz/fuzz_check.h"
#include "plugin/wire.h"

using namespace ponte;
using namespace ponte::plugin;

namespace {

bool same_bytes(const uint8_t* a, size_t alen, const uint8_t* b, size_t blen) {
  return alen == blen && std::memcmp(a, b, alen) == 0;
}

RemoteRegion make_region(FuzzedDataProvider& fdp, uint64_t min_len) {
  RemoteRegion r;
  r.addr = fdp.ConsumeIntegral<uint64_t>();
  r.len = fdp.ConsumeIntegralInRange<uint64_t>(min_len, UINT64_MAX);
  r.nics = fdp.ConsumeIntegralInRange<uint8_t>(1, kMaxNicsPerDevice);
  for (int i = 0; i < r.nics; i++) {
    r.rkey[i] = fdp.ConsumeIntegral<uint64_t>();
    r.remote_base[i] = fdp.ConsumeIntegral<uint64_t>();
  }
  return r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  uint8_t out[kMaxMsgSize];
  auto kind = peek_kind(in);
  if (kind.ok()) FUZZ_CHECK(data[0] == kWireVersion);
  if (auto m = decode_connect(in); m.ok()) {
    FUZZ_CHECK(kind.ok() && *kind == MsgKind::kConnect);
    auto n = encode_connect(*m, out);
    FUZZ_CHECK(n.ok() && same_bytes(out, *n, data, size));
  }
  if (auto m = decode_accept(in); m.ok()) {
    FUZZ_CHECK(kind.ok() && *kind == MsgKind::kAccept);
    auto n = encode_accept(*m, out);
    FUZZ_CHECK(n.ok() && same_bytes(out, *n, data, size));
  }
  if (auto m = decode_reject(in); m.ok()) {
    FUZZ_CHECK(kind.ok() && *kind == MsgKind::kReject);
    FUZZ_CHECK(same_bytes(out, encode_reject(*m, out), data, size));
  }
  if (auto m = decode_notice(in); m.ok()) {
    FUZZ_CHECK(kind.ok() && *kind == MsgKind::kNotice && m->token != 0);
    FUZZ_CHECK(same_bytes(out, encode_notice(*m, out), data, size));
  }

  FuzzedDataProvider fdp(data, size);
  ConnectMsg c;
  c.listen_id = fdp.ConsumeIntegral<uint32_t>();
  c.listen_nonce = fdp.ConsumeIntegral<uint64_t>();
  c.token = fdp.ConsumeIntegralInRange<uint64_t>(1, UINT64_MAX);
  c.sender_comm_id = fdp.ConsumeIntegralInRange<uint32_t>(1, kMaxCommId);
  c.fifo = make_region(fdp, kFifoBytes);
  c.traffic_class = fdp.ConsumeIntegralInRange<int>(-1, 255);
  c.reply_address = fdp.ConsumeBytes<uint8_t>(fdp.ConsumeIntegralInRange<size_t>(0, 200));
  auto cn = encode_connect(c, out);
  FUZZ_CHECK(cn.ok());
  auto c2 = decode_connect(std::span<const uint8_t>(out, *cn));
  FUZZ_CHECK(c2.ok() && *c2 == c);

  AcceptMsg a;
  a.token = fdp.ConsumeIntegral<uint64_t>();
  a.receiver_comm_id = fdp.ConsumeIntegralInRange<uint32_t>(1, kMaxCommId);
  a.records = make_region(fdp, kRecordRegionBytes);
  auto an = encode_accept(a, out);
  FUZZ_CHECK(an.ok());
  auto a2 = decode_accept(std::span<const uint8_t>(out, *an));
  FUZZ_CHECK(a2.ok() && *a2 == a);

  RejectMsg r;
  r.token = fdp.ConsumeIntegral<uint64_t>();
  r.reason = static_cast<RejectReason>(fdp.ConsumeIntegralInRange<uint32_t>(1, 3));
  auto r2 = decode_reject(std::span<const uint8_t>(out, encode_reject(r, out)));
  FUZZ_CHECK(r2.ok() && *r2 == r);

  NoticeMsg nm;
  nm.token = fdp.ConsumeIntegralInRange<uint64_t>(1, UINT64_MAX);
  nm.to_send = fdp.ConsumeBool();
  nm.what = static_cast<NoticeWhat>(fdp.ConsumeIntegralInRange<uint8_t>(1, 3));
  nm.clean = fdp.ConsumeBool();
  nm.count = fdp.ConsumeIntegral<uint64_t>();
  auto n2 = decode_notice(std::span<const uint8_t>(out, encode_notice(nm, out)));
  FUZZ_CHECK(n2.ok() && *n2 == nm);
  return 0;
}
