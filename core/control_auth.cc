// SHA-256 (FIPS 180-4), HMAC-SHA256 (RFC 2104) and the control connection's key and proof.
#include "core/control_auth.h"

#include <errno.h>
#include <string.h>
#include <sys/random.h>

#include <vector>

#include "core/wire.h"

namespace ponte {

namespace {

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

void compress(uint32_t h[8], const uint8_t block[64]) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t{block[4 * i]} << 24) | (uint32_t{block[4 * i + 1]} << 16) |
           (uint32_t{block[4 * i + 2]} << 8) | uint32_t{block[4 * i + 3]};
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    k = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

}  // namespace

Sha256Digest sha256(std::span<const uint8_t> data) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  size_t full = data.size() / 64;
  for (size_t i = 0; i < full; i++) compress(h, data.data() + 64 * i);
  // The tail, 0x80, zeros and the bit length (big endian) in one or two blocks.
  uint8_t tail[128] = {};
  size_t rest = data.size() - 64 * full;
  if (rest) memcpy(tail, data.data() + 64 * full, rest);
  tail[rest] = 0x80;
  size_t tail_len = rest + 9 <= 64 ? 64 : 128;
  uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  for (int i = 0; i < 8; i++) tail[tail_len - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  for (size_t off = 0; off < tail_len; off += 64) compress(h, tail + off);
  Sha256Digest out;
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 4; j++) out[4 * i + j] = static_cast<uint8_t>(h[i] >> (24 - 8 * j));
  return out;
}

Sha256Digest hmac_sha256(std::span<const uint8_t> key, std::span<const uint8_t> data) {
  uint8_t k[64] = {};
  if (key.size() > 64) {
    auto d = sha256(key);
    memcpy(k, d.data(), d.size());
  } else if (!key.empty()) {
    memcpy(k, key.data(), key.size());
  }
  std::vector<uint8_t> inner(64 + data.size());
  for (int i = 0; i < 64; i++) inner[i] = k[i] ^ 0x36;
  if (!data.empty()) memcpy(inner.data() + 64, data.data(), data.size());
  auto ih = sha256(inner);
  uint8_t outer[64 + 32];
  for (int i = 0; i < 64; i++) outer[i] = k[i] ^ 0x5c;
  memcpy(outer + 64, ih.data(), ih.size());
  return sha256(outer);
}

bool constant_time_equal(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  if (a.size() != b.size()) return false;
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); i++) diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

Status random_bytes(std::span<uint8_t> out) {
  size_t got = 0;
  while (got < out.size()) {
    ssize_t n = getrandom(out.data() + got, out.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status(Code::kResource, "getrandom: %s", strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

static Sha256Digest key_from_secret(uint64_t secret) {
  std::vector<uint8_t> b;
  WireWriter w(b);
  w.u64(secret);
  return sha256(b);
}

static Sha256Digest key_from_job_key(const std::string& job_key) {
  return sha256(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(job_key.data()), job_key.size()));
}

Result<AuthKey> AuthKey::create(const std::string& job_key) {
  AuthKey k;
  if (!job_key.empty()) {
    k.kind = AuthKind::kJobKey;
    k.key = key_from_job_key(job_key);
    return k;
  }
  k.kind = AuthKind::kSecret;
  while (k.secret == 0) {  // 0 means "no secret" on the wire
    uint8_t b[8];
    PONTE_RETURN_IF_ERROR(random_bytes(b));
    memcpy(&k.secret, b, 8);
  }
  k.key = key_from_secret(k.secret);
  return k;
}

Result<AuthKey> AuthKey::for_peer(AuthKind kind, uint64_t secret, const std::string& job_key) {
  AuthKey k;
  k.kind = kind;
  if (kind == AuthKind::kJobKey) {
    if (job_key.empty())
      return Status(Code::kInvalidArgument, "the peer's engine runs with PONTE_JOB_KEY and this process has none");
    k.key = key_from_job_key(job_key);
    return k;
  }
  k.secret = secret;
  k.key = key_from_secret(secret);
  return k;
}

Sha256Digest auth_proof(const AuthKey& key, const Challenge& challenge, uint64_t acceptor_nonce, uint8_t acceptor_group) {
  static constexpr char kLabel[] = "ponte-ctrl-v2";
  std::vector<uint8_t> msg(kLabel, kLabel + sizeof(kLabel) - 1);
  msg.insert(msg.end(), challenge.begin(), challenge.end());
  WireWriter w(msg);
  w.u64(acceptor_nonce);
  w.u8(acceptor_group);
  return hmac_sha256(key.key, msg);
}

}  // namespace ponte
