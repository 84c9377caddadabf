// Unit tests of core/status.h: Status (a code and a bounded message), Result<T> (a value or an
// error, with every T constructed and destroyed exactly once) and the two propagation macros.
#include "core/status.h"

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <type_traits>

namespace ponte {
namespace {

constexpr Code kAllCodes[] = {Code::kOk,       Code::kInvalidArgument, Code::kNotFound, Code::kUnavailable,
                              Code::kAgain,    Code::kPeerDead,        Code::kTimeout,  Code::kTransport,
                              Code::kResource, Code::kCancelled,       Code::kInternal};

TEST(StatusTest, OkHasNoMessage) {
  Status st = Status::Ok();
  EXPECT_TRUE(st.ok());
  EXPECT_EQ(st.code(), Code::kOk);
  EXPECT_STREQ(st.message(), "");
  EXPECT_TRUE(Status().ok());
}

TEST(StatusTest, ErrorKeepsCodeAndFormattedMessage) {
  Status st(Code::kPeerDead, "peer %u on NIC %s: %d", 7u, "lo", -3);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.code(), Code::kPeerDead);
  EXPECT_STREQ(st.message(), "peer 7 on NIC lo: -3");
  Status copy = st;  // a copy carries both
  EXPECT_EQ(copy.code(), Code::kPeerDead);
  EXPECT_STREQ(copy.message(), st.message());
}

TEST(StatusTest, LongMessageIsCutAndStaysTerminated) {
  const std::string long_text(500, 'x');
  Status st(Code::kTransport, "head:%s", long_text.c_str());
  const std::string msg = st.message();
  EXPECT_LT(msg.size(), 200u);  // bounded by the fixed buffer, whatever the arguments
  EXPECT_GT(msg.size(), 100u);  // and most of it used
  EXPECT_EQ(msg.rfind("head:x", 0), 0u);  // the start is kept
  EXPECT_EQ(msg.find_first_not_of('x', 5), std::string::npos);
}

TEST(StatusTest, IsTriviallyCopyable) {
  // Creating and copying a Status never allocates: it holds its message in place.
  EXPECT_TRUE(std::is_trivially_copyable_v<Status>);
}

TEST(StatusTest, EveryCodeHasItsOwnName) {
  std::set<std::string> names;
  for (Code c : kAllCodes) {
    const std::string name = code_name(c);
    EXPECT_NE(name, "unknown") << static_cast<int>(c);
    EXPECT_FALSE(name.empty());
    names.insert(name);
  }
  EXPECT_EQ(names.size(), std::size(kAllCodes));
  EXPECT_STREQ(code_name(static_cast<Code>(200)), "unknown");  // e.g. a code read off the wire
}

// Counts live instances, to check that Result constructs and destroys each T exactly once.
struct Tracked {
  static inline int live = 0;
  int v;
  explicit Tracked(int x) : v(x) { ++live; }
  Tracked(const Tracked& o) : v(o.v) { ++live; }
  Tracked(Tracked&& o) noexcept : v(o.v) {
    o.v = -1;
    ++live;
  }
  Tracked& operator=(const Tracked&) = delete;
  ~Tracked() { --live; }
};

TEST(ResultTest, ValueAndErrorStates) {
  Result<int> good = 42;
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good.value(), 42);
  EXPECT_EQ(*good, 42);
  EXPECT_TRUE(good.status().ok());

  Result<int> bad = Status(Code::kTimeout, "no completion in %d ms", 5);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), Code::kTimeout);
  EXPECT_STREQ(bad.status().message(), "no completion in 5 ms");
}

TEST(ResultTest, BuiltFromOkStatusIsAnInternalError) {
  // A Result must hold a value or an error; an OK status with no value is a bug, reported as one.
  Result<int> r = Status::Ok();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInternal);
  EXPECT_NE(std::string(r.status().message()).find("OK status"), std::string::npos);
}

TEST(ResultTest, ConstructsAndDestroysEachValueOnce) {
  ASSERT_EQ(Tracked::live, 0);
  {
    Result<Tracked> a = Tracked(1);
    EXPECT_EQ(Tracked::live, 1);
    Result<Tracked> b = a;  // copy
    EXPECT_EQ(Tracked::live, 2);
    EXPECT_EQ(b->v, 1);
    Result<Tracked> c = std::move(a);  // move: the source still holds a (moved-from) value
    EXPECT_EQ(Tracked::live, 3);
    EXPECT_EQ(c->v, 1);

    Result<Tracked> e = Status(Code::kNotFound, "none");
    EXPECT_EQ(Tracked::live, 3);  // an error holds no T
    e = c;                         // error -> value
    EXPECT_EQ(Tracked::live, 4);
    ASSERT_TRUE(e.ok());
    EXPECT_EQ(e->v, 1);
    b = Status(Code::kResource, "full");  // value -> error: the value is destroyed
    EXPECT_EQ(Tracked::live, 3);
    EXPECT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), Code::kResource);
    Result<Tracked>& same = c;
    c = same;  // self-assignment keeps the value
    EXPECT_EQ(Tracked::live, 3);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->v, 1);
    Tracked moved = std::move(c).value();
    EXPECT_EQ(moved.v, 1);
    EXPECT_EQ(Tracked::live, 4);
  }
  EXPECT_EQ(Tracked::live, 0);
}

TEST(ResultTest, HoldsMoveOnlyValues) {
  Result<std::unique_ptr<int>> r = std::make_unique<int>(9);
  ASSERT_TRUE(r.ok());
  std::unique_ptr<int> p = std::move(r).value();
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(*p, 9);
}

// Helpers for the macros: each step records that it ran.
Status step(int* ran, int n, bool fail) {
  ++*ran;
  if (fail) return Status(Code::kInvalidArgument, "step %d failed", n);
  return Status::Ok();
}

Status three_steps(int* ran, int failing) {
  PONTE_RETURN_IF_ERROR(step(ran, 1, failing == 1));
  PONTE_RETURN_IF_ERROR(step(ran, 2, failing == 2));
  PONTE_RETURN_IF_ERROR(step(ran, 3, failing == 3));
  return Status::Ok();
}

TEST(StatusMacros, ReturnIfErrorStopsAtTheFirstError) {
  int ran = 0;
  EXPECT_TRUE(three_steps(&ran, 0).ok());
  EXPECT_EQ(ran, 3);
  ran = 0;
  Status st = three_steps(&ran, 2);
  EXPECT_EQ(ran, 2);  // step 3 never ran
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_STREQ(st.message(), "step 2 failed");
}

Result<int> half(int x) {
  if (x % 2) return Status(Code::kInvalidArgument, "%d is odd", x);
  return x / 2;
}

Result<int> quarter(int x) {
  PONTE_ASSIGN_OR_RETURN(int h, half(x));
  PONTE_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

TEST(StatusMacros, AssignOrReturnPassesTheValueOrTheError) {
  Result<int> r = quarter(12);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.value(), 3);
  Result<int> odd = quarter(6);  // 6 / 2 = 3: the second step fails
  ASSERT_FALSE(odd.ok());
  EXPECT_STREQ(odd.status().message(), "3 is odd");
}

}  // namespace
}  // namespace ponte
