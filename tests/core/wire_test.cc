// Wire formats: RemoteRegion and GroupAddress round-trip, and their decoders reject bad bytes.
#include <gtest/gtest.h>

#include "core/group_address.h"
#include "core/remote_region.h"

using namespace ponte;

static RemoteRegion sample_region(int nics) {
  RemoteRegion r;
  r.addr = 0x7f0012345000;
  r.len = 1 << 20;
  r.nics = static_cast<uint8_t>(nics);
  for (int i = 0; i < nics; i++) {
    r.rkey[i] = 0x1000 + i;
    r.remote_base[i] = i % 2 ? 0 : r.addr;
  }
  return r;
}

TEST(RemoteRegion, RoundTrip) {
  for (int nics : {1, 2, 4, 16}) {
    RemoteRegion r = sample_region(nics);
    auto bytes = r.encode();
    EXPECT_EQ(bytes.size(), RemoteRegion::encoded_size(nics));
    auto d = RemoteRegion::decode(bytes);
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d->addr, r.addr);
    EXPECT_EQ(d->len, r.len);
    EXPECT_EQ(d->nics, nics);
    for (int i = 0; i < nics; i++) {
      EXPECT_EQ(d->rkey[i], r.rkey[i]);
      EXPECT_EQ(d->remote_base[i], r.remote_base[i]);
    }
  }
}

TEST(RemoteRegion, RejectsTruncatedForeignAndFutureBytes) {
  auto bytes = sample_region(2).encode();
  for (size_t n = 0; n < bytes.size(); n++) {
    auto d = RemoteRegion::decode(std::span<const uint8_t>(bytes.data(), n));
    EXPECT_FALSE(d.ok()) << "accepted a " << n << "-byte prefix";
    if (!d.ok()) {
      EXPECT_EQ(d.status().code(), Code::kInvalidArgument);
    }
  }
  auto future = bytes;
  future[0] = 2;
  EXPECT_FALSE(RemoteRegion::decode(future).ok());
  auto foreign = bytes;
  foreign[1] = 'A';
  EXPECT_FALSE(RemoteRegion::decode(foreign).ok());
  auto nics0 = bytes;
  nics0[20] = 0;
  EXPECT_FALSE(RemoteRegion::decode(nics0).ok());
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_FALSE(RemoteRegion::decode(longer).ok());
  std::vector<uint8_t> zeros(64, 0);
  EXPECT_FALSE(RemoteRegion::decode(zeros).ok());
}

static GroupAddress sample_address() {
  GroupAddress a;
  a.engine_nonce = 0x1122334455667788ull;
  a.group = 3;
  a.backend = BackendKind::kVerbs;
  a.ip[0] = 127;
  a.ip[3] = 1;
  a.port = 4242;
  a.nic_addrs = {{1, 2, 3}, {4, 5, 6, 7, 8}};
  a.auth_secret = 0xfeedf00d;
  return a;
}

TEST(GroupAddress, RoundTrip) {
  GroupAddress a = sample_address();
  auto bytes = a.encode();
  auto d = GroupAddress::decode(bytes);
  ASSERT_TRUE(d.ok()) << d.status().message();
  EXPECT_EQ(d->engine_nonce, a.engine_nonce);
  EXPECT_EQ(d->group, 3);
  EXPECT_EQ(d->backend, BackendKind::kVerbs);
  EXPECT_EQ(d->port, 4242);
  EXPECT_EQ(d->ip[0], 127);
  EXPECT_EQ(d->nic_addrs, a.nic_addrs);
  EXPECT_EQ(d->auth_secret, 0xfeedf00du);
}

TEST(GroupAddress, RejectsBadBytes) {
  auto bytes = sample_address().encode();
  for (size_t n = 0; n < bytes.size(); n++)
    EXPECT_FALSE(GroupAddress::decode(std::span<const uint8_t>(bytes.data(), n)).ok()) << n;
  auto bad_backend = bytes;
  bad_backend[13] = 9;
  EXPECT_FALSE(GroupAddress::decode(bad_backend).ok());
  auto region = sample_region(1).encode();
  auto d = GroupAddress::decode(region);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(std::string(d.status().message()).find("not a ponte address"), std::string::npos);
  std::vector<uint8_t> zeros(128, 0);
  EXPECT_FALSE(GroupAddress::decode(zeros).ok());
}
