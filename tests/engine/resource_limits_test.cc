// Resource limits an application can hit: a full submission queue and the in-flight cap
// (PONTE_QUEUE_DEPTH, PONTE_MAX_INFLIGHT) answer kAgain with a clear message, nothing is lost,
// and the engine takes work again once the pressure is gone (tcp;ofi_rxm, an engine writing to
// itself through its own control port and endpoint).
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "core/engine.h"

using namespace ponte;
using namespace std::chrono_literals;

namespace {

TEST(ResourceLimits, FullQueueAndInflightCapAreAgainThenWork) {
  EngineOptions o;
  o.config = global_config();
  o.config.backend = BackendChoice::kFabric;
  o.config.fabric_provider = "tcp;ofi_rxm";
  o.config.ctrl_addr = "127.0.0.1";
  o.config.timeout_ms = 20000;
  o.config.queue_depth = 4;   // four submissions wait at most
  o.config.max_inflight = 2;  // two run at a time
  o.groups = {{0}};
  auto e = Engine::create(o);
  ASSERT_TRUE(e.ok()) << e.status().message();
  Engine& eng = **e;
  constexpr size_t kLen = 1 << 20;
  constexpr int kWrites = 16;
  std::vector<uint8_t> src(kLen * kWrites), dst(kLen * kWrites, 0);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 13 + (i >> 12));
  auto sm = eng.register_memory(0, src.data(), src.size());
  auto dm = eng.register_memory(0, dst.data(), dst.size());
  ASSERT_TRUE(sm.ok() && dm.ok());
  auto self = eng.connect(0, eng.address(0));
  ASSERT_TRUE(self.ok()) << self.status().message();
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!eng.peer_ready(0, *self) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(eng.peer_ready(0, *self));

  Flag arrived;
  ASSERT_TRUE(eng.expect_imm(0, 77, eng.imms_per_write(0, *self, kLen) * kWrites, kAnyPeer, arrived.notify()).ok());
  std::vector<Flag> written(kWrites);
  int again = 0;
  std::string again_msg;
  for (int k = 0; k < kWrites; k++) {
    for (;;) {
      Status st = eng.write_imm(0, *self, LocalSlice{&*sm, k * kLen, kLen}, dm->remote(), k * kLen, 77,
                                written[k].notify());
      if (st.ok()) break;
      ASSERT_EQ(st.code(), Code::kAgain) << st.message();
      if (again++ == 0) again_msg = st.message();
      std::this_thread::sleep_for(100us);  // the pressure eases as writes complete
    }
  }
  EXPECT_GT(again, 0) << "16 writes of 1 MiB never filled a queue of 4 behind 2 in flight";
  EXPECT_NE(again_msg.find("submission queue full"), std::string::npos) << again_msg;
  for (int k = 0; k < kWrites; k++) EXPECT_TRUE(written[k].wait(30s).ok()) << k << ": " << written[k].status().message();
  ASSERT_TRUE(arrived.wait(30s).ok()) << arrived.status().message();
  EXPECT_EQ(memcmp(src.data(), dst.data(), src.size()), 0);

  // Nothing stuck: one more write goes through at once.
  Flag w, a;
  std::memset(dst.data(), 0, kLen);
  ASSERT_TRUE(eng.expect_imm(0, 78, eng.imms_per_write(0, *self, kLen), kAnyPeer, a.notify()).ok());
  ASSERT_TRUE(eng.write_imm(0, *self, LocalSlice{&*sm, 0, kLen}, dm->remote(), 0, 78, w.notify()).ok());
  EXPECT_TRUE(w.wait(30s).ok());
  EXPECT_TRUE(a.wait(30s).ok());
  EXPECT_EQ(memcmp(src.data(), dst.data(), kLen), 0);
  EXPECT_TRUE(eng.deregister(*sm).ok());
  EXPECT_TRUE(eng.deregister(*dm).ok());
}

}  // namespace
