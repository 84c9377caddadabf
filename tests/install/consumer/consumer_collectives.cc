// consumer-collectives: a program outside ponte built against an installed ponte::collectives
// (find_package or pkg-config). Two ranks as two threads of this process, bootstrapped through an
// in-process AllGather, each with its own engine on loopback: all_to_all_v moves a distinct pattern
// from every rank to every rank, every byte is checked. Exit 0 and "... verified" when it worked.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "loopback_env.h"

namespace {

constexpr int kWorld = 2;
constexpr size_t kBlock = size_t{256} << 10;  // bytes from each rank to each rank

// The bootstrap exchange between threads: each rank posts its bytes, the last one wakes the rest.
struct Exchange {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<uint8_t>> bytes = std::vector<std::vector<uint8_t>>(kWorld);
  int posted = 0;

  ponte::AllGather for_rank(int rank) {
    return [this, rank](std::span<const uint8_t> mine, std::vector<std::vector<uint8_t>>* all) {
      std::unique_lock<std::mutex> lock(mu);
      bytes[rank].assign(mine.begin(), mine.end());
      if (++posted == kWorld) cv.notify_all();
      if (!cv.wait_for(lock, std::chrono::seconds(60), [this] { return posted == kWorld; }))
        return ponte::Status(ponte::Code::kTimeout, "the other rank never posted its address");
      *all = bytes;
      return ponte::Status::Ok();
    };
  }
};

uint8_t pattern(int from, int to, size_t i) { return static_cast<uint8_t>(from * 31 + to * 7 + i * 13); }

std::string run_rank(int rank, Exchange& exchange) {
  auto comm = ponte::Communicator::create(rank, kWorld, exchange.for_rank(rank));
  if (!comm.ok()) return std::string("create: ") + comm.status().message();
  std::vector<uint8_t> send(kBlock * kWorld), recv(kBlock * kWorld, 0);
  for (int to = 0; to < kWorld; ++to)
    for (size_t i = 0; i < kBlock; ++i) send[to * kBlock + i] = pattern(rank, to, i);
  std::vector<size_t> counts(kWorld, kBlock);
  ponte::Status st = comm.value()->all_to_all_v(send.data(), counts, recv.data(), counts);
  if (!st.ok()) return std::string("all_to_all_v: ") + st.message();
  for (int from = 0; from < kWorld; ++from)
    for (size_t i = 0; i < kBlock; ++i)
      if (recv[from * kBlock + i] != pattern(from, rank, i))
        return "byte " + std::to_string(i) + " from rank " + std::to_string(from) + " differs";
  return "";
}

}  // namespace

int main() {
  set_loopback_defaults();
  Exchange exchange;
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) ranks.emplace_back([&, r] { errors[r] = run_rank(r, exchange); });
  for (auto& t : ranks) t.join();
  int bad = 0;
  for (int r = 0; r < kWorld; ++r)
    if (!errors[r].empty()) std::fprintf(stderr, "consumer-collectives: rank %d: %s\n", r, errors[r].c_str()), ++bad;
  if (bad) return 1;
  std::printf("consumer-collectives: all_to_all_v of %zu bytes per pair between %d ranks, verified\n", kBlock,
              kWorld);
  return 0;
}
