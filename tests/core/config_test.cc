// Config: PONTE_* variables parse, bad values are named in the error.
#include <gtest/gtest.h>
#include <sched.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "core/config.h"

using namespace ponte;

class ConfigTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const char* v : {"PONTE_BACKEND", "PONTE_STRIPE_MIN", "PONTE_TIMEOUT_MS", "PONTE_PROGRESS_CORES",
                          "PONTE_IB_GID_INDEX", "PONTE_RECV_SIZE", "PONTE_LOG", "PONTE_NICS", "PONTE_FABRIC_HMEM",
                          "PONTE_NET_INLINE", "PONTE_POLLER_SLEEP_US", "PONTE_IDLE_SLEEP_US",
                          "PONTE_POLLER_HOLD_US"})
      unsetenv(v);
  }
};

TEST_F(ConfigTest, Defaults) {
  auto c = Config::from_env();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->backend, BackendChoice::kAuto);
  EXPECT_EQ(c->fabric_provider, "efa");
  EXPECT_LE(c->timeout_ms, 30000u);
  EXPECT_EQ(c->ib_gid_index, -1);
  EXPECT_EQ(c->fabric_hmem, -1);  // auto
  EXPECT_EQ(c->net_inline, 4096u);
  EXPECT_EQ(c->poller_sleep_us, 5000u);
  EXPECT_EQ(c->idle_sleep_us, 1000u);
  EXPECT_EQ(c->poller_hold_us, 2000u);
}

TEST_F(ConfigTest, ParsesValues) {
  setenv("PONTE_BACKEND", "fabric", 1);
  setenv("PONTE_STRIPE_MIN", "1m", 1);
  setenv("PONTE_TIMEOUT_MS", "2500", 1);
  setenv("PONTE_PROGRESS_CORES", "2,5,7", 1);
  setenv("PONTE_IB_GID_INDEX", "3", 1);
  setenv("PONTE_NICS", "4", 1);
  setenv("PONTE_FABRIC_HMEM", "0", 1);
  setenv("PONTE_NET_INLINE", "0", 1);
  setenv("PONTE_POLLER_SLEEP_US", "50", 1);
  setenv("PONTE_IDLE_SLEEP_US", "50", 1);
  setenv("PONTE_POLLER_HOLD_US", "10", 1);
  auto c = Config::from_env();
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->backend, BackendChoice::kFabric);
  EXPECT_EQ(c->stripe_min_bytes, size_t{1} << 20);
  EXPECT_EQ(c->timeout_ms, 2500u);
  EXPECT_EQ(c->progress_cores, (std::vector<int>{2, 5, 7}));
  EXPECT_EQ(c->ib_gid_index, 3);
  EXPECT_EQ(c->nics_per_group, 4);
  EXPECT_EQ(c->fabric_hmem, 0);
  EXPECT_EQ(c->net_inline, 0u);
  EXPECT_EQ(c->poller_sleep_us, 50u);
  EXPECT_EQ(c->idle_sleep_us, 50u);
  EXPECT_EQ(c->poller_hold_us, 10u);
  setenv("PONTE_FABRIC_HMEM", "on", 1);
  EXPECT_EQ(Config::from_env()->fabric_hmem, 1);
}

TEST_F(ConfigTest, BadValuesNameTheVariable) {
  struct Case {
    const char* name;
    const char* value;
  } cases[] = {{"PONTE_BACKEND", "gpu"},       {"PONTE_STRIPE_MIN", "12q"},     {"PONTE_TIMEOUT_MS", "-1"},
               {"PONTE_TIMEOUT_MS", "0"},       {"PONTE_PROGRESS_CORES", "1,,2"}, {"PONTE_IB_GID_INDEX", "x"},
               {"PONTE_RECV_SIZE", "0"},        {"PONTE_LOG", "loud"},          {"PONTE_NICS", "99"},
               {"PONTE_FABRIC_HMEM", "cuda"}, {"PONTE_NET_INLINE", "4097"}, {"PONTE_POLLER_SLEEP_US", "49"},
               {"PONTE_POLLER_SLEEP_US", "60000001"}, {"PONTE_IDLE_SLEEP_US", "49"},
               {"PONTE_IDLE_SLEEP_US", "60000001"}, {"PONTE_POLLER_HOLD_US", "9"},
               {"PONTE_POLLER_HOLD_US", "1000001"}};
  for (const auto& cs : cases) {
    setenv(cs.name, cs.value, 1);
    auto c = Config::from_env();
    EXPECT_FALSE(c.ok()) << cs.name << "=" << cs.value;
    if (!c.ok()) {
      EXPECT_NE(std::string(c.status().message()).find(cs.name), std::string::npos) << c.status().message();
    }
    unsetenv(cs.name);
  }
}

TEST(ParseSize, Suffixes) {
  EXPECT_EQ(*parse_size("8"), 8u);
  EXPECT_EQ(*parse_size("64k"), 65536u);
  EXPECT_EQ(*parse_size("1m"), 1u << 20);
  EXPECT_EQ(*parse_size("2g"), size_t{2} << 30);
  EXPECT_FALSE(parse_size("").ok());
  EXPECT_FALSE(parse_size("k").ok());
  EXPECT_FALSE(parse_size("99999999999999999999g").ok());
}

// check_cores_usable: the cores this process may run on pass; any other is named in the error.
TEST(CoresUsable, AllowedCoresPassOthersAreNamed) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  std::vector<int> usable;
  int outside = -1;
  for (int c = 0; c < CPU_SETSIZE; c++) {
    if (CPU_ISSET(c, &allowed)) usable.push_back(c);
    else if (outside < 0 && c > 0 && CPU_ISSET(c - 1, &allowed)) outside = c;
  }
  ASSERT_FALSE(usable.empty());
  EXPECT_TRUE(check_cores_usable({}, "x").ok());
  EXPECT_TRUE(check_cores_usable(usable, "x").ok());
  std::vector<int> bad_cores = {-1, static_cast<int>(CPU_SETSIZE)};
  if (outside > 0) bad_cores.push_back(outside);  // the first core past an allowed one, if any
  for (int bad : bad_cores) {
    Status st = check_cores_usable({usable[0], bad}, "PONTE_PROGRESS_CORES");
    SCOPED_TRACE(bad);
    EXPECT_EQ(st.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(st.message()).find("PONTE_PROGRESS_CORES: this process may not run on core " +
                                             std::to_string(bad)),
              std::string::npos)
        << st.message();
  }
}
