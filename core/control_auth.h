// ControlAuth: who may speak on a group's control port. The group address carries a random 64-bit
// invitation secret (or says "job key" when PONTE_JOB_KEY is set); a connector proves it holds the
// key by answering the acceptor's fresh challenge with an HMAC-SHA256 over it.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "core/status.h"

namespace ponte {

// Design (why a challenge and not the bare secret):
// - The acceptor sends every new connection a 16-byte random challenge; the connector's first
//   message must be proof = HMAC-SHA256(key, "ponte-ctrl-v2" | challenge | acceptor's engine nonce
//   | acceptor's group). The acceptor compares in constant time and, on a mismatch, a malformed or
//   oversized first frame, or silence past a short deadline, closes the socket: no peer, no
//   handshake state, no buffer beyond the 64-byte proof frame, one log line per group.
// - Replay: a recorded proof answers one challenge that the acceptor never issues again (128
//   random bits per connection), and it names the acceptor, so neither a replay to the same engine
//   nor one to another engine of the same job passes. The key itself never travels on the control
//   connection; with a per-engine secret it travels only inside the address, out of band.
// - Not a defence against someone who can read the out-of-band channel (the address) or sit in
//   the middle of the TCP connection: it keeps stray connections, scanners and other jobs out.
// - The key: a per-engine random secret (64 bits, to keep addresses inside NCCL's 128-byte
//   handle; guessing it takes one TCP connection per try), or SHA-256(PONTE_JOB_KEY) when set, in
//   which case the address carries no secret and every engine of the job must have the same key.
enum class AuthKind : uint8_t { kSecret = 1, kJobKey = 2 };

using Sha256Digest = std::array<uint8_t, 32>;
Sha256Digest sha256(std::span<const uint8_t> data);
Sha256Digest hmac_sha256(std::span<const uint8_t> key, std::span<const uint8_t> data);
// Equal-length comparison whose time does not depend on where the bytes differ.
bool constant_time_equal(std::span<const uint8_t> a, std::span<const uint8_t> b);
// Fills out from the kernel's random source (getrandom).
Status random_bytes(std::span<uint8_t> out);

constexpr size_t kChallengeBytes = 16;
using Challenge = std::array<uint8_t, kChallengeBytes>;

// The key a group listens with, or connects to a peer with.
struct AuthKey {
  AuthKind kind = AuthKind::kSecret;
  uint64_t secret = 0;        // kSecret: what the address carries
  Sha256Digest key{};         // the HMAC key derived from the secret or the job key
  // A fresh key for this engine: PONTE_JOB_KEY's when job_key is not empty, else a random secret.
  static Result<AuthKey> create(const std::string& job_key);
  // The key to reach a peer whose address says kind/secret; job_key is this process's.
  static Result<AuthKey> for_peer(AuthKind kind, uint64_t secret, const std::string& job_key);
};

Sha256Digest auth_proof(const AuthKey& key, const Challenge& challenge, uint64_t acceptor_nonce, uint8_t acceptor_group);

}  // namespace ponte
