// The engine's hot paths allocate nothing once warm: every operation type (write, write with
// immediate striped over two NICs, read, paged write, scatter, immediate, send into engine
// buffers, expect_imm, barrier), driven by the worker and by a thread that polls (progress()),
// make no C++ heap allocation on any thread of the process. One engine connected to itself, over
// each setup's provider (tests/common/setups.h); libfabric's own malloc calls are not counted.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/engine.h"
#include "tests/common/all_threads_alloc_counter.h"
#include "tests/common/completion_counter.h"
#include "tests/common/loopback.h"
#include "tests/common/setups.h"

using namespace ponte;
using namespace ponte::test;
using namespace std::chrono_literals;

namespace {

constexpr size_t kRegion = 4 << 20;
constexpr size_t kPage = 4096;
constexpr uint32_t kPages = 8;
constexpr uint32_t kPagedAt = 128;  // the paged write's first destination page (at 512 KiB)

struct Received {
  std::atomic<int> messages{0};
  std::atomic<uint8_t> last{0};
};
void on_recv(void* arg, PeerId, std::span<const uint8_t> data) {
  auto* r = static_cast<Received*>(arg);
  if (!data.empty()) r->last.store(data[0]);
  r->messages++;
}

class EngineAllocTest : public ::testing::TestWithParam<Setup> {
 protected:
  void SetUp() override {
    keep_test_traffic_on_loopback();
    EngineOptions o;
    o.config = global_config();
    o.config.backend = GetParam().backend;
    if (!GetParam().provider.empty()) o.config.fabric_provider = GetParam().provider;
    o.config.ctrl_addr = "127.0.0.1";
    // Keep-alives every 500 ms (a quarter of the timeout): the rounds below cross several. The
    // SoftRoCE guest needs more time for 1 MiB.
    o.config.timeout_ms = GetParam().backend == BackendChoice::kVerbs ? 8000 : 2000;
    o.config.stripe_min_bytes = 64 << 10;  // the 1 MiB write goes over both NICs
    o.groups = {{0, 0}};                   // device 0 opened twice: two NICs
    auto e = Engine::create(o);
    ASSERT_TRUE(e.ok()) << e.status().message();
    eng_ = std::move(e.value());
    for (auto* b : {&src_, &dst_}) {
      *b = static_cast<uint8_t*>(aligned_alloc(4096, kRegion));
      ASSERT_NE(*b, nullptr);
      std::memset(*b, 0, kRegion);
    }
    auto ms = eng_->register_memory(0, src_, kRegion);
    auto md = eng_->register_memory(0, dst_, kRegion);
    ASSERT_TRUE(ms.ok() && md.ok());
    src_mr_ = std::move(ms.value());
    dst_mr_ = std::move(md.value());
    dst_remote_ = dst_mr_.remote();
    eng_->set_recv_handler(0, &on_recv, &recv_);
    {
      // Connecting allocates (the peer's state, its handshake): seen here, so the counter sees the
      // engine's allocations and a zero below means something.
      AllThreadsAllocCounter setup;
      auto self = eng_->connect(0, eng_->address(0));
      ASSERT_TRUE(self.ok()) << self.status().message();
      peer_ = *self;
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      while (!eng_->peer_ready(0, peer_) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
      ASSERT_TRUE(eng_->peer_ready(0, peer_));
      EXPECT_GT(setup.stop(/*trace=*/false), 0) << "the engine's allocations are not seen by this counter";
    }
    for (uint32_t i = 0; i < kPages; ++i) {
      src_pages_[i] = i;
      dst_pages_[i] = kPagedAt + kPages - 1 - i;  // reversed: every page lands elsewhere
    }
    for (int k = 0; k < 2; ++k)
      targets_[k] = ScatterTarget{peer_, static_cast<size_t>(k) * kPage, kPage, &dst_remote_,
                                  (2u << 20) + static_cast<size_t>(k) * kPage};
  }
  void TearDown() override {
    if (eng_) {
      if (src_mr_.id) {
        EXPECT_TRUE(eng_->deregister(src_mr_).ok());
      }
      if (dst_mr_.id) {
        EXPECT_TRUE(eng_->deregister(dst_mr_).ok());
      }
    }
    eng_.reset();
    free(src_);
    free(dst_);
  }

  // One round of every operation type, each checked: posted, completed OK, its bytes or
  // immediates arrived. `poll`: this thread runs the data path (progress()) while it waits.
  void round(uint32_t n, bool poll) {
    const uint8_t mark = static_cast<uint8_t>(n * 7 + 1);
    src_[0] = mark;                       // write, 64 KiB
    src_[(1 << 20) + 5] = mark;           // write_imm, 1 MiB
    src_[3 * kPage] = mark;               // paged write: page 3 lands at page kPagedAt + kPages - 4
    dst_[(3 << 20) + 9] = mark;           // read from dst into src
    const uint32_t imm_value = 1000 + (n % 64);  // a bounded set of values (counters never forget)
    const uint32_t imms = eng_->imms_per_write(0, peer_, 1 << 20);
    CompletionCounter c, expected;
    int posted = 0;
    auto post = [&](const Status& st) {
      ASSERT_TRUE(st.ok()) << st.message();
      ++posted;
    };
    post(eng_->expect_imm(0, imm_value, imms + kPages + 2 + 1, peer_, expected.notify()));
    post(eng_->write(0, peer_, LocalSlice{&src_mr_, 0, 64 << 10}, dst_remote_, 0, c.notify()));
    post(eng_->write_imm(0, peer_, LocalSlice{&src_mr_, 1 << 20, 1 << 20}, dst_remote_, 1 << 20, imm_value, c.notify()));
    post(eng_->read(0, peer_, LocalSlice{&src_mr_, 3 << 20, 4096}, dst_remote_, 3 << 20, c.notify()));
    post(eng_->paged_write(0, peer_, src_mr_, src_pages_, dst_remote_, dst_pages_, kPage, &imm_value, c.notify()));
    post(eng_->scatter(0, src_mr_, targets_, &imm_value, c.notify()));
    post(eng_->imm(0, peer_, imm_value, c.notify()));
    const int before = recv_.messages.load();
    post(eng_->send(0, peer_, LocalSlice{&src_mr_, 0, 512}, c.notify()));
    const PeerId peers[1] = {peer_};
    post(eng_->barrier(0, peers, 2000 + (n % 4), c.notify()));
    if (HasFatalFailure()) return;
    const int ops = posted - 1;  // all but the expectation
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while ((c.ok + c.failed < ops || expected.ok + expected.failed < 1 || recv_.messages.load() == before) &&
           std::chrono::steady_clock::now() < deadline) {
      if (!poll || !eng_->progress(0)) std::this_thread::yield();
    }
    ASSERT_EQ(c.ok.load(), ops) << c.failed.load() << " failed";
    ASSERT_EQ(expected.ok.load(), 1) << "the immediates did not all arrive";
    ASSERT_GT(recv_.messages.load(), before);
    EXPECT_EQ(recv_.last.load(), mark);
    EXPECT_EQ(dst_[0], mark);
    EXPECT_EQ(dst_[(1 << 20) + 5], mark);
    EXPECT_EQ(dst_[(kPagedAt + kPages - 4) * kPage], mark);
    EXPECT_EQ(src_[(3 << 20) + 9], mark);
    EXPECT_EQ(dst_[2 << 20], mark);  // scatter target 0 (its source: offset 0)
  }

  std::unique_ptr<Engine> eng_;
  uint8_t* src_ = nullptr;
  uint8_t* dst_ = nullptr;
  MemoryRegion src_mr_, dst_mr_;
  RemoteRegion dst_remote_;
  PeerId peer_ = 0;
  Received recv_;
  uint32_t src_pages_[kPages], dst_pages_[kPages];
  ScatterTarget targets_[2];
};

TEST_P(EngineAllocTest, EveryOperationAllocatesNothingOnceWarm) {
  for (bool poll : {false, true}) {
    SCOPED_TRACE(poll ? "driven by a polling thread" : "driven by the worker");
    for (uint32_t i = 0; i < 100; ++i) {
      round(i, poll);
      if (HasFatalFailure()) return;
    }
    AllThreadsAllocCounter count;
    uint32_t i = 100;
    const auto until = std::chrono::steady_clock::now() + 1500ms;  // three keep-alive intervals
    for (; i < 400 || std::chrono::steady_clock::now() < until; ++i) {
      round(i, poll);
      if (HasFatalFailure()) return;
    }
    EXPECT_EQ(count.stop(), 0) << "C++ heap allocations in " << (i - 100) << " warm rounds";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineAllocTest, ::testing::ValuesIn(setups()),
                         [](const ::testing::TestParamInfo<Setup>& i) { return i.param.name; });

}  // namespace
