// The control connection's authentication: SHA-256 and HMAC-SHA256 against published vectors
// (FIPS 180-4 examples, RFC 4231), keys and proofs, and the strict decoders of its messages and of
// the group address's auth fields.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/control_auth.h"
#include "core/control_messages.h"
#include "core/group_address.h"

using namespace ponte;

namespace {

std::string hex(const Sha256Digest& d) {
  std::string s;
  char b[3];
  for (uint8_t x : d) {
    snprintf(b, sizeof(b), "%02x", x);
    s += b;
  }
  return s;
}
std::span<const uint8_t> bytes(const std::string& s) {
  return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

TEST(ControlAuth, Sha256MatchesPublishedVectors) {
  EXPECT_EQ(hex(sha256(bytes(""))), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha256(bytes("abc"))), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(hex(sha256(bytes("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(hex(sha256(bytes(std::string(1000000, 'a')))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(ControlAuth, HmacMatchesRfc4231) {
  const std::string key1(20, '\x0b');
  EXPECT_EQ(hex(hmac_sha256(bytes(key1), bytes("Hi There"))),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex(hmac_sha256(bytes("Jefe"), bytes("what do ya want for nothing?"))),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::string key6(131, '\xaa');  // longer than a block: hashed first
  EXPECT_EQ(hex(hmac_sha256(bytes(key6), bytes("Test Using Larger Than Block-Size Key - Hash Key First"))),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(ControlAuth, ProofsDependOnKeyChallengeAndAcceptor) {
  auto k = AuthKey::create("");
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->kind, AuthKind::kSecret);
  EXPECT_NE(k->secret, 0u);
  auto again = AuthKey::for_peer(AuthKind::kSecret, k->secret, "");
  ASSERT_TRUE(again.ok());
  Challenge c{}, c2{};
  c2[0] = 1;
  const auto p = auth_proof(*k, c, 7, 0);
  EXPECT_EQ(p, auth_proof(*again, c, 7, 0));
  EXPECT_NE(p, auth_proof(*k, c2, 7, 0));
  EXPECT_NE(p, auth_proof(*k, c, 8, 0));
  EXPECT_NE(p, auth_proof(*k, c, 7, 1));
  auto other = AuthKey::create("");
  ASSERT_TRUE(other.ok());
  EXPECT_NE(p, auth_proof(*other, c, 7, 0));
  EXPECT_TRUE(constant_time_equal(p, p));
  auto q = p;
  q[31] ^= 1;
  EXPECT_FALSE(constant_time_equal(p, q));

  auto j1 = AuthKey::create("secret job");
  auto j2 = AuthKey::for_peer(AuthKind::kJobKey, 0, "secret job");
  ASSERT_TRUE(j1.ok() && j2.ok());
  EXPECT_EQ(j1->kind, AuthKind::kJobKey);
  EXPECT_EQ(j1->secret, 0u);
  EXPECT_EQ(auth_proof(*j1, c, 1, 2), auth_proof(*j2, c, 1, 2));
  EXPECT_FALSE(AuthKey::for_peer(AuthKind::kJobKey, 0, "").ok());
}

TEST(ControlAuth, MessagesAreStrict) {
  Challenge c;
  for (size_t i = 0; i < c.size(); i++) c[i] = static_cast<uint8_t>(i);
  auto ce = encode_challenge(c);
  auto cd = decode_challenge(ce);
  ASSERT_TRUE(cd.ok());
  EXPECT_EQ(*cd, c);
  EXPECT_FALSE(decode_auth(ce).ok());  // a challenge is not a proof
  auto longer = ce;
  longer.push_back(0);
  EXPECT_FALSE(decode_challenge(longer).ok());
  auto v1 = ce;
  v1[0] = 1;  // version 1 had no authentication: refused
  EXPECT_FALSE(decode_challenge(v1).ok());
  Sha256Digest d{};
  d[5] = 9;
  auto ae = encode_auth(d);
  EXPECT_EQ(ae.size(), 36u);
  EXPECT_LE(ae.size(), kMaxAuthMessage);
  ASSERT_TRUE(decode_auth(ae).ok());
  EXPECT_EQ(*decode_auth(ae), d);
  EXPECT_TRUE(decode_bye(encode_bye()).ok());
  EXPECT_FALSE(decode_hello(encode_bye()).ok());
}

// A hello says which traffic class its sender's connection asked for (the acceptor keeps one peer
// per remote group and class): none (-1) and 0..255 round-trip; anything else is refused.
TEST(ControlAuth, HelloCarriesItsTrafficClass) {
  HelloMsg h;
  h.id_for_receiver = 3;
  h.epoch = 1;
  h.address = {1, 2, 3};
  h.blobs = {{4, 5}};
  for (int tc : {-1, 0, 106, 255}) {
    h.traffic_class = tc;
    auto e = encode_hello(h);
    ASSERT_TRUE(e.ok()) << e.status().message();
    auto d = decode_hello(*e);
    ASSERT_TRUE(d.ok()) << d.status().message();
    EXPECT_EQ(d->traffic_class, tc);
    EXPECT_EQ(*d, h);
  }
  h.traffic_class = 256;
  EXPECT_FALSE(encode_hello(h).ok());
  h.traffic_class = -2;
  EXPECT_FALSE(encode_hello(h).ok());
  h.traffic_class = 7;
  auto e = encode_hello(h);
  ASSERT_TRUE(e.ok());
  auto bad = *e;
  bad[12] = 0x00;  // u16 class at offset 12 (after the header, id and epoch): 0x0100 = 256
  bad[13] = 0x01;
  auto d = decode_hello(bad);
  EXPECT_FALSE(d.ok());
  EXPECT_NE(std::string(d.status().message()).find("traffic class"), std::string::npos) << d.status().message();
  auto v3 = *e;
  v3[0] = 3;  // version 3 had no class in its hello: refused
  EXPECT_FALSE(decode_hello(v3).ok());
}

TEST(ControlAuth, GroupAddressCarriesTheSecretStrictly) {
  GroupAddress a;
  a.engine_nonce = 1;
  a.port = 5;
  a.nic_addrs = {{1, 2, 3}};
  a.imm_rkey = {0};
  a.imm_base = {0};
  a.auth_kind = AuthKind::kSecret;
  a.auth_secret = 0x1234;
  auto b = GroupAddress::decode(a.encode());
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(*b, a);
  a.auth_secret = 0;  // a secret address without a secret
  EXPECT_FALSE(GroupAddress::decode(a.encode()).ok());
  a.auth_kind = AuthKind::kJobKey;
  EXPECT_TRUE(GroupAddress::decode(a.encode()).ok());
  a.auth_secret = 7;  // a job-key address must not carry one
  EXPECT_FALSE(GroupAddress::decode(a.encode()).ok());
  auto enc = a.encode();
  enc[0] = 1;  // version 1 (no auth fields): refused
  EXPECT_FALSE(GroupAddress::decode(enc).ok());
}

}  // namespace
