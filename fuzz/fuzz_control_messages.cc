// Fuzzes the control messages a peer sends on its control connection (CHALLENGE, AUTH, HELLO,
// PING, PONG, BYE) and what the handshake decodes inside a HELLO (the group address, verbs connect
// blobs): an accepted message is of this version, its length field is its size, and it re-encodes
// to exactly its bytes; a hello built from the input round-trips.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <vector>

#include "core/control_messages.h"
#include "core/group_address.h"
#include "core/verbs/verbs_wire.h"
#include "fuzz/fuzz_check.h"

using namespace ponte;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  const std::vector<uint8_t> bytes(in.begin(), in.end());
  auto type = peek_control_type(in);
  if (type.ok()) FUZZ_CHECK(data[0] == kControlVersion);
  auto hello = decode_hello(in);
  if (hello.ok()) {
    FUZZ_CHECK(type.ok() && *type == ControlType::kHello);
    auto again = encode_hello(*hello);
    FUZZ_CHECK(again.ok() && *again == bytes);
    // What the handshake does next with it.
    auto addr = GroupAddress::decode(hello->address);
    for (const auto& blob : hello->blobs) {
      auto cb = verbs::ConnectBlob::decode(blob);
      if (cb.ok()) FUZZ_CHECK(blob.size() == cb->size());
    }
    (void)addr;
  }
  if (decode_bye(in).ok()) FUZZ_CHECK(bytes == encode_bye());
  if (decode_ping(in).ok()) FUZZ_CHECK(type.ok() && *type == ControlType::kPing && in.size() == ping_message().size() &&
                                       std::equal(in.begin(), in.end(), ping_message().begin()));
  if (decode_pong(in).ok()) FUZZ_CHECK(type.ok() && *type == ControlType::kPong && in.size() == pong_message().size() &&
                                       std::equal(in.begin(), in.end(), pong_message().begin()));
  if (auto c = decode_challenge(in); c.ok()) FUZZ_CHECK(encode_challenge(*c) == bytes);
  if (auto a = decode_auth(in); a.ok()) FUZZ_CHECK(encode_auth(*a) == bytes);
  if (type.ok()) FUZZ_CHECK(size >= 4 && (data[2] | (data[3] << 8)) == static_cast<int>(size));

  FuzzedDataProvider fdp(data, size);
  HelloMsg x;
  x.id_for_receiver = fdp.ConsumeIntegral<uint32_t>();
  x.epoch = fdp.ConsumeIntegral<uint32_t>();
  x.traffic_class = fdp.ConsumeIntegralInRange<int>(-1, 255);
  x.address = fdp.ConsumeBytes<uint8_t>(fdp.ConsumeIntegralInRange<size_t>(1, 300));
  if (x.address.empty()) x.address.push_back(1);
  const int n = fdp.ConsumeIntegralInRange<int>(0, 16);
  for (int i = 0; i < n; i++) x.blobs.push_back(fdp.ConsumeBytes<uint8_t>(fdp.ConsumeIntegralInRange<size_t>(0, 64)));
  auto enc = encode_hello(x);
  FUZZ_CHECK(enc.ok());
  auto y = decode_hello(*enc);
  FUZZ_CHECK(y.ok() && *y == x);
  return 0;
}
