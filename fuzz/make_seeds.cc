// ponte-fuzz-seeds: writes the fuzz targets' seed inputs from ponte's real encoders
// (`write DIR`), or checks that the committed ones still match them (`check DIR`), so a format
// change that forgets its seeds fails a test. DIR is fuzz/corpus; one folder per target.
#include <sys/stat.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "core/control_messages.h"
#include "core/control_socket.h"
#include "core/group_address.h"
#include "core/remote_region.h"
#include "core/verbs/verbs_wire.h"
#include "plugin/wire.h"
#ifdef PONTE_FUZZ_COLLECTIVES
#include "collectives/ep_layout.h"
#endif

using namespace ponte;
using Bytes = std::vector<uint8_t>;
using Seeds = std::map<std::string, Bytes>;  // "target/seed-name" -> bytes

namespace {

void must_ok(Status st) {
  if (!st.ok()) {
    fprintf(stderr, "ponte-fuzz-seeds: encoder failed: %s\n", st.message());
    exit(2);
  }
}

template <typename T>
T must(Result<T> r) {
  if (!r.ok()) {
    fprintf(stderr, "ponte-fuzz-seeds: encoder failed: %s\n", r.status().message());
    exit(2);
  }
  return std::move(r).value();
}

Bytes verbs_address(verbs::LinkLayer ll) {
  verbs::VerbsAddress a;
  a.link_layer = ll;
  a.port = 1;
  a.lid = ll == verbs::LinkLayer::kInfiniBand ? 0x1234 : 0;
  a.mtu = 5;
  a.gid_index = 3;
  for (int i = 0; i < 16; i++) a.gid[i] = static_cast<uint8_t>(i == 10 || i == 11 ? 0xff : i < 10 ? 0 : 100 + i);
  auto e = a.encode();
  return Bytes(e.begin(), e.end());
}

Bytes connect_blob(uint8_t qps = 1, int traffic_class = -1) {
  verbs::ConnectBlob b;
  b.qp_count = qps;
  for (uint8_t i = 0; i < qps; i++) b.qpn[i] = 0x11a2 + 2u * i;
  b.has_traffic_class = traffic_class >= 0;
  b.traffic_class = traffic_class >= 0 ? static_cast<uint8_t>(traffic_class) : 0;
  b.psn = 0x5eed42;
  b.mtu = 5;
  b.link_layer = verbs::LinkLayer::kEthernet;
  for (int i = 0; i < 16; i++) b.gid[i] = static_cast<uint8_t>(i * 7);
  return b.encode();
}

// A group address as an engine builds it: nics NICs whose endpoint addresses are nic_addr.
Bytes group_address(BackendKind backend, int nics, const Bytes& nic_addr) {
  GroupAddress a;
  a.engine_nonce = 0x9e3779b97f4a7c15ull;
  a.group = 0;
  a.backend = backend;
  a.ip_family = 4;
  const uint8_t ip[4] = {127, 0, 0, 1};
  memcpy(a.ip, ip, 4);
  a.port = 40123;
  a.max_msg = 1ull << 30;
  a.auth_kind = nics == 4 ? AuthKind::kJobKey : AuthKind::kSecret;  // the EFA seed: PONTE_JOB_KEY
  a.auth_secret = a.auth_kind == AuthKind::kSecret ? 0x5ec12e7c0ffee123ull : 0;
  for (int i = 0; i < nics; i++) {
    Bytes addr = nic_addr;
    addr.back() = static_cast<uint8_t>(addr.back() + i);
    a.nic_addrs.push_back(addr);
    a.imm_rkey.push_back(0x1000 + i);
    a.imm_base.push_back(backend == BackendKind::kVerbs ? 0x7f0000001000ull : 0);
  }
  return a.encode();
}

Bytes sockaddr_in_bytes() {  // what tcp;ofi_rxm names an endpoint by
  return Bytes{2, 0, 0x9c, 0x40, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1};
}

Bytes remote_region(int nics, uint64_t len) {
  RemoteRegion r;
  r.addr = 0x7f1234560000ull;
  r.len = len;
  r.nics = static_cast<uint8_t>(nics);
  for (int i = 0; i < nics; i++) {
    r.rkey[i] = 0xabc0 + i;
    r.remote_base[i] = i % 2 ? r.addr : 0;
  }
  return r.encode();
}

Bytes hello(const Bytes& address, std::vector<Bytes> blobs, int traffic_class = -1) {
  HelloMsg m;
  m.id_for_receiver = 3;
  m.epoch = 1;
  m.traffic_class = traffic_class;
  m.address = address;
  m.blobs = std::move(blobs);
  return must(encode_hello(m));
}

Seeds all_seeds() {
  Seeds s;
  const Bytes fabric2 = group_address(BackendKind::kFabric, 2, sockaddr_in_bytes());
  const Bytes efa4 = group_address(BackendKind::kFabric, 4, Bytes(32, 0xfe));
  const Bytes verbs1 = group_address(BackendKind::kVerbs, 1, verbs_address(verbs::LinkLayer::kEthernet));
  s["group_address/seed-fabric-tcp-2nics"] = fabric2;
  s["group_address/seed-fabric-efa-4nics"] = efa4;
  s["group_address/seed-verbs-roce-1nic"] = verbs1;

  s["remote_region/seed-1nic"] = remote_region(1, 4096);
  s["remote_region/seed-4nics"] = remote_region(4, 1 << 20);
  s["remote_region/seed-16nics"] = remote_region(16, 64);

  const Bytes h_fabric = hello(fabric2, {Bytes(), Bytes()});
  const Bytes h_verbs = hello(verbs1, {connect_blob()}, 106);  // a connection of traffic class 106
  s["control_messages/seed-hello-fabric"] = h_fabric;
  s["control_messages/seed-hello-verbs"] = h_verbs;
  s["control_messages/seed-bye"] = encode_bye();
  const Bytes ping(ping_message().begin(), ping_message().end()), pong(pong_message().begin(), pong_message().end());
  s["control_messages/seed-ping"] = ping;
  s["control_messages/seed-pong"] = pong;
  Challenge ch;
  for (size_t i = 0; i < ch.size(); i++) ch[i] = static_cast<uint8_t>(0xc0 + i);
  s["control_messages/seed-challenge"] = encode_challenge(ch);
  const auto key = must(AuthKey::for_peer(AuthKind::kSecret, 0x5ec12e7c0ffee123ull, ""));
  const Bytes auth = encode_auth(auth_proof(key, ch, 0x9e3779b97f4a7c15ull, 0));
  s["control_messages/seed-auth"] = auth;

  Bytes stream;  // what a connector sends: its proof, its hello, a ping and a pong, its goodbye
  append_frame(auth, &stream);
  append_frame(h_verbs, &stream);
  append_frame(ping, &stream);
  append_frame(pong, &stream);
  append_frame(encode_bye(), &stream);
  s["control_frame/seed-auth-hello-bye"] = stream;
  Bytes one;
  append_frame(h_fabric, &one);
  s["control_frame/seed-hello"] = one;
  s["control_frame/seed-oversized"] = Bytes{0x00, 0x00, 0x20, 0x00, 1, 1};  // 2 MiB announced

  s["verbs_wire/seed-address-roce"] = verbs_address(verbs::LinkLayer::kEthernet);
  s["verbs_wire/seed-address-ib"] = verbs_address(verbs::LinkLayer::kInfiniBand);
  s["verbs_wire/seed-connect-blob"] = connect_blob();
  s["verbs_wire/seed-connect-blob-4qps-tc"] = connect_blob(4, 106);

  for (bool bootstrap : {false, true}) {
    const Bytes addr = bootstrap ? group_address(BackendKind::kFabric, 1, Bytes(32, 0xfe))
                                 : group_address(BackendKind::kFabric, 1, sockaddr_in_bytes());
    plugin::ListenHandle h;
    h.listen_id = 5;
    h.nonce = 0x0123456789abcdefull;
    h.bootstrap = bootstrap;
    h.address = addr;
    Bytes out(plugin::kHandleSize);
    must_ok(plugin::encode_handle(h, out.data()));
    s[bootstrap ? "plugin_handle/seed-bootstrap" : "plugin_handle/seed-own-group"] = out;
  }

  uint8_t msg[plugin::kMaxMsgSize];
  plugin::ConnectMsg c;
  c.listen_id = 5;
  c.listen_nonce = 0x0123456789abcdefull;
  c.token = 77;
  c.sender_comm_id = 12;
  c.fifo = must(RemoteRegion::decode(remote_region(2, plugin::kFifoBytes)));
  s["plugin_messages/seed-connect"] = Bytes(msg, msg + must(plugin::encode_connect(c, msg)));
  c.reply_address = efa4;
  c.traffic_class = 106;
  s["plugin_messages/seed-connect-bootstrap"] = Bytes(msg, msg + must(plugin::encode_connect(c, msg)));
  plugin::AcceptMsg a;
  a.token = 77;
  a.receiver_comm_id = 9;
  a.records = must(RemoteRegion::decode(remote_region(2, plugin::kRecordRegionBytes)));
  s["plugin_messages/seed-accept"] = Bytes(msg, msg + must(plugin::encode_accept(a, msg)));
  plugin::RejectMsg r;
  r.token = 77;
  r.reason = plugin::RejectReason::kNoResources;
  s["plugin_messages/seed-reject"] = Bytes(msg, msg + plugin::encode_reject(r, msg));
  const plugin::NoticeMsg closed{77, true, plugin::NoticeWhat::kClosed, true, 33};
  s["plugin_messages/seed-notice-closed"] = Bytes(msg, msg + plugin::encode_notice(closed, msg));

  // plugin_cts: u32 expected request number, then the slot.
  const Bytes buf_region = remote_region(2, 1 << 20);
  for (int n : {1, plugin::kMaxRecvs}) {
    std::vector<plugin::CtsElem> elems(n);
    for (int i = 0; i < n; i++) {
      elems[i].offset = 4096u * i;
      elems[i].size = i == 1 ? 0 : 4096;
      elems[i].tag = 100 + i;
      elems[i].region = buf_region;
      elems[i].inline_data = n == 1;  // a one-buffer receive of 4 KiB asks for inline data
    }
    Bytes slot(4 + plugin::kCtsSlotBytes);
    const uint32_t req = 41;
    memcpy(slot.data(), &req, 4);
    must_ok(plugin::encode_cts(req, req - 3, 0x5eed5eed5eed5eedull, elems, slot.data() + 4));  // fuzz_plugin_cts.cc's kSeed
    s[n == 1 ? "plugin_cts/seed-cts-1" : "plugin_cts/seed-cts-8"] = slot;
  }
  Bytes rec(4 + plugin::kRecordBytes);
  plugin::encode_record({123456, 3, 41}, rec.data() + 4);
  s["plugin_cts/seed-record"] = rec;
  Bytes eager(4 + plugin::kRecordBytes + 16, 0x5a);
  const uint32_t eager_req = 41;
  memcpy(eager.data(), &eager_req, 4);
  plugin::encode_eager({16, eager_req, 7}, eager.data() + 4);
  s["plugin_cts/seed-eager"] = eager;
#ifdef PONTE_FUZZ_COLLECTIVES
  // collectives_ep_header: 14 parameter bytes (fuzz_collectives_ep_header.cc), then the header.
  for (uint8_t phase : {kEpPhaseDispatch, kEpPhaseCombine}) {
    const Bytes params = {1, 3, 127, 0, 0xff, 3, 1, 0, 0, static_cast<uint8_t>(phase == kEpPhaseCombine), 7, 0, 0, 0};
    const EpShape shape = make_ep_shape(2, 8, 128, 1024, 2, DType::kBFloat16, 0);
    const int32_t counts[4] = {10, 0, 5, 3};
    EpBlockHeader h;
    h.phase = phase;
    h.rows = 18;
    h.entries = 18;
    h.seq = 7;
    h.data_imms = 1;
    h.data_bytes = 18 * (phase == kEpPhaseDispatch ? dispatch_row_stride(shape) : combine_row_stride(shape));
    Bytes block(ep_header_bytes(shape.local_experts));
    write_block_header(block.data(), shape, h, counts);
    // Sized once and copied into: growing a copy of params by insert trips GCC 12's false
    // -Warray-bounds at -O3 (Release).
    Bytes seed(params.size() + block.size());
    std::copy(params.begin(), params.end(), seed.begin());
    std::copy(block.begin(), block.end(), seed.begin() + static_cast<std::ptrdiff_t>(params.size()));
    s[phase == kEpPhaseDispatch ? "collectives_ep_header/seed-dispatch" : "collectives_ep_header/seed-combine"] = seed;
  }
#endif
  return s;
}

Bytes read_file(const std::string& path, bool* ok) {
  std::ifstream f(path, std::ios::binary);
  *ok = static_cast<bool>(f);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (strcmp(argv[1], "write") != 0 && strcmp(argv[1], "check") != 0)) {
    fprintf(stderr, "usage: %s write|check CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[2];
  const bool write = strcmp(argv[1], "write") == 0;
  const Seeds seeds = all_seeds();
  int bad = 0;
  std::map<std::string, bool> targets;
  for (const auto& [name, bytes] : seeds) {
    const std::string path = dir + "/" + name;
    targets[name.substr(0, name.find('/'))] = true;
    if (write) {
      mkdir(dir.c_str(), 0755);
      mkdir((dir + "/" + name.substr(0, name.find('/'))).c_str(), 0755);
      std::ofstream f(path, std::ios::binary | std::ios::trunc);
      f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      if (!f) {
        fprintf(stderr, "ponte-fuzz-seeds: cannot write %s\n", path.c_str());
        return 1;
      }
      continue;
    }
    bool ok = false;
    if (read_file(path, &ok) != bytes || !ok) {
      fprintf(stderr, "ponte-fuzz-seeds: %s is missing or differs from what the encoder writes now\n", path.c_str());
      bad++;
    }
  }
  if (!write) {  // a seed no encoder writes any more is stale
    for (const auto& [target, _] : targets) {
      DIR* d = opendir((dir + "/" + target).c_str());
      if (!d) continue;
      while (dirent* e = readdir(d)) {
        if (strncmp(e->d_name, "seed-", 5) == 0 && !seeds.count(target + "/" + e->d_name)) {
          fprintf(stderr, "ponte-fuzz-seeds: %s/%s/%s is not written by any encoder\n", dir.c_str(), target.c_str(), e->d_name);
          bad++;
        }
      }
      closedir(d);
    }
    if (bad) fprintf(stderr, "ponte-fuzz-seeds: run `ponte-fuzz-seeds write fuzz/corpus` and commit the result\n");
    else printf("ponte-fuzz-seeds: %zu seeds match the encoders\n", seeds.size());
  }
  return bad ? 1 : 0;
}
