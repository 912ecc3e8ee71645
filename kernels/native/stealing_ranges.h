// Items 0..n-1 shared by a parallel loop's threads: one contiguous range per thread, which it
// takes from the front; a thread whose range is empty takes the other ranges' last items.
//
// Why not a static split: a decode product's threads stream equal halves of its weight, but not
// at equal speed (a core's share of the memory bandwidth and its interruptions vary), and each
// call ends when the slower half ends. Why not a dynamic schedule: items handed out in turn
// interleave the threads' reads, and each thread's weight stream then starts cold at every item
// instead of running on into the next one (its prefetches reach past an item's end); here a
// thread reads one run of items forward, and only the few it takes from another run at the end
// start cold.
//
// Each range's front and back share one atomic word, so the owner taking the front and a thief
// taking the back never hand out the same item. A range whose thread never arrives (a smaller
// team than asked for) is emptied by the others.
#pragma once
#include <stdint.h>

#include <atomic>

namespace native {

class StealingRanges {
 public:
  static constexpr int MAX_THREADS = 64;

  // n items over `threads` ranges (at most MAX_THREADS; more threads share the last ranges)
  StealingRanges(int n, int threads) : count_(threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads) {
    for (int t = 0; t < count_; t++)
      ranges_[t].bounds.store(pack((int64_t)n * t / count_, (int64_t)n * (t + 1) / count_), std::memory_order_relaxed);
  }

  // The next item for thread t, or -1 when every range is empty. Relaxed order is enough: an
  // item is handed out once, and the parallel region's end orders what its taker wrote.
  int next(int t) {
    const int own = t % count_;
    int item = take(own, true);
    for (int k = 1; item < 0 && k < count_; k++) item = take((own + k) % count_, false);
    return item;
  }

 private:
  struct alignas(64) Range {                   // a line each: the owners' takes do not contend
    std::atomic<uint64_t> bounds;              // front in the low half, back (past the end) high
  };
  static uint64_t pack(int64_t front, int64_t back) { return (uint64_t)front | (uint64_t)back << 32; }

  int take(int r, bool front) {
    uint64_t bounds = ranges_[r].bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t f = (uint32_t)bounds, b = (uint32_t)(bounds >> 32);
      if (f >= b) return -1;
      const uint64_t rest = front ? pack(f + 1, b) : pack(f, b - 1);
      if (ranges_[r].bounds.compare_exchange_weak(bounds, rest, std::memory_order_relaxed)) return front ? f : b - 1;
    }
  }

  int count_;
  Range ranges_[MAX_THREADS];
};

}  // namespace native
