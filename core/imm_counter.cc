// ImmCounterTable: open addressing with linear probing; entries are never removed (protocols reuse
// a bounded set of values), so lock-free readers can probe while the worker inserts.
#include "core/imm_counter.h"

namespace ponte {

static inline size_t hash32(uint32_t v) { return static_cast<size_t>(v) * 0x9E3779B1u; }

ImmCounterTable::ImmCounterTable(size_t capacity, size_t max_waiters, uint32_t dense)
    : dense_(dense ? std::make_unique<std::atomic<uint32_t>[]>(dense) : nullptr), dense_n_(dense) {
  size_t cap = 16;
  while (cap < capacity) cap <<= 1;
  mask_ = cap - 1;
  entries_ = std::make_unique<Entry[]>(cap);
  waiters_.resize(max_waiters);
  for (size_t i = 0; i < max_waiters; i++)
    waiters_[i].next = (i + 1 < max_waiters) ? static_cast<uint32_t>(i + 1) : kNone;
  free_waiter_ = max_waiters ? 0 : kNone;
}

ImmCounterTable::Entry* ImmCounterTable::find(uint32_t value) const {
  const uint64_t key = (uint64_t{1} << 32) | value;
  for (size_t i = hash32(value) & mask_, n = 0; n <= mask_; i = (i + 1) & mask_, n++) {
    uint64_t k = entries_[i].key.load(std::memory_order_acquire);
    if (k == key) return &entries_[i];
    if (k == 0) return nullptr;
  }
  return nullptr;
}

ImmCounterTable::Entry* ImmCounterTable::find_or_insert(uint32_t value) {
  const uint64_t key = (uint64_t{1} << 32) | value;
  for (size_t i = hash32(value) & mask_, n = 0; n <= mask_; i = (i + 1) & mask_, n++) {
    uint64_t k = entries_[i].key.load(std::memory_order_relaxed);
    if (k == key) return &entries_[i];
    if (k == 0) {
      if (used_ * 8 >= (mask_ + 1) * 7) return nullptr;  // keep probes short: refuse past 7/8 full
      used_++;
      entries_[i].key.store(key, std::memory_order_release);
      return &entries_[i];
    }
  }
  return nullptr;
}

void ImmCounterTable::satisfy(Entry* e) {
  while (e->waiter_head != kNone) {
    Waiter& w = waiters_[e->waiter_head];
    uint32_t have = e->count.load(std::memory_order_acquire);
    if (have < w.count) return;
    e->count.fetch_sub(w.count, std::memory_order_acq_rel);
    uint32_t idx = e->waiter_head;
    Notify done = w.done;
    unlink(e, idx);
    done(Status::Ok());
  }
}

void ImmCounterTable::unlink(Entry* e, uint32_t idx) {
  uint32_t prev = kNone;
  for (uint32_t w = e->waiter_head; w != kNone; prev = w, w = waiters_[w].next) {
    if (w != idx) continue;
    uint32_t next = waiters_[w].next;
    if (prev == kNone) e->waiter_head = next; else waiters_[prev].next = next;
    if (e->waiter_tail == w) e->waiter_tail = prev;
    waiters_[w].live = false;
    waiters_[w].next = free_waiter_;
    free_waiter_ = w;
    waiting_--;
    return;
  }
}

bool ImmCounterTable::arrive(uint32_t value) {
  if (value < dense_n_) {
    dense_[value].fetch_add(1, std::memory_order_acq_rel);
    return true;
  }
  Entry* e = find_or_insert(value);
  if (!e) return false;
  e->count.fetch_add(1, std::memory_order_acq_rel);
  if (e->waiter_head != kNone) satisfy(e);
  return true;
}

Status ImmCounterTable::expect(uint32_t value, uint32_t count, uint32_t from_peer,
                               std::chrono::steady_clock::time_point deadline, Notify done) {
  if (value < dense_n_)
    return Status(Code::kInvalidArgument, "immediate 0x%x is counted densely: poll it (imm_arrived)", value);
  if (free_waiter_ == kNone) return Status(Code::kResource, "too many immediate expectations pending");
  Entry* e = find_or_insert(value);
  if (!e) return Status(Code::kResource, "immediate counter table full (%zu values)", mask_ + 1);
  uint32_t idx = free_waiter_;
  Waiter& w = waiters_[idx];
  free_waiter_ = w.next;
  w.value = value;
  w.count = count;
  w.from = from_peer;
  w.deadline = deadline;
  w.done = done;
  w.live = true;
  w.next = kNone;
  if (e->waiter_tail == kNone) e->waiter_head = idx; else waiters_[e->waiter_tail].next = idx;
  e->waiter_tail = idx;
  waiting_++;
  satisfy(e);
  return Status::Ok();
}

template <typename Pred>
void ImmCounterTable::fail_if(Pred pred, const Status& st) {
  if (waiting_ == 0) return;
  for (uint32_t i = 0; i < waiters_.size(); i++) {
    Waiter& w = waiters_[i];
    if (!w.live || !pred(w)) continue;
    Entry* e = find(w.value);
    Notify done = w.done;
    unlink(e, i);
    done(st);
  }
}

void ImmCounterTable::fail_from(uint32_t from_peer, const Status& st) {
  fail_if([&](const Waiter& w) { return w.from == from_peer; }, st);
}

void ImmCounterTable::expire(std::chrono::steady_clock::time_point now) {
  fail_if([&](const Waiter& w) { return w.deadline <= now; },
          Status(Code::kTimeout, "immediate counter: expected immediates did not arrive in time"));
}

void ImmCounterTable::fail_all(const Status& st) {
  fail_if([](const Waiter&) { return true; }, st);
}

uint32_t ImmCounterTable::arrived(uint32_t value) const {
  if (value < dense_n_) return dense_[value].load(std::memory_order_acquire);
  const Entry* e = find(value);
  return e ? e->count.load(std::memory_order_acquire) : 0;
}

void ImmCounterTable::consume(uint32_t value, uint32_t n) {
  if (value < dense_n_) {
    if (n) dense_[value].fetch_sub(n, std::memory_order_acq_rel);
    return;
  }
  Entry* e = find(value);
  if (e && n) e->count.fetch_sub(n, std::memory_order_acq_rel);
}

}  // namespace ponte
