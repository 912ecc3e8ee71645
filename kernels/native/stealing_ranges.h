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
// taking the back never hand out the same item. The owner takes a run of its range at once, an
// eighth of what is left, so that its atomic exchanges (each a full barrier to the core's loads
// and stores) number a few dozen a call rather than one an item; the runs shrink toward the end,
// where a thief takes single items. A range whose thread never arrives (a smaller team than
// asked for) is emptied by the others.
//
//   native::StealingRanges work(n, threads);
//   #pragma omp parallel num_threads(threads)
//   for (native::StealingRanges::Cursor items(work, omp_get_thread_num()); items.next();) use(items.item());
#pragma once
#include <stdint.h>

#include <atomic>

namespace native {

class StealingRanges {
 public:
  static constexpr int MAX_THREADS = 64;

  // n items over `threads` ranges (at most MAX_THREADS: in a larger team thread t shares range
  // t % MAX_THREADS's front with its other takers)
  StealingRanges(int n, int threads) : count_(threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads) {
    for (int t = 0; t < count_; t++)
      ranges_[t].bounds.store(pack((int64_t)n * t / count_, (int64_t)n * (t + 1) / count_), std::memory_order_relaxed);
  }

  // One thread's items: its own range's runs, then single items from the others' backs.
  class Cursor {
   public:
    Cursor(StealingRanges& work, int t) : work_(work), own_(t % work.count_) {}
    // Moves to the next item; false when every range is empty.
    bool next() {
      if (++item_ < end_) return true;
      if (work_.take_front(own_, item_, end_)) return true;
      for (int k = 1; k < work_.count_; k++)
        if (work_.take_back((own_ + k) % work_.count_, item_)) {
          end_ = item_ + 1;
          return true;
        }
      return false;
    }
    int item() const { return item_; }

   private:
    StealingRanges& work_;
    int own_, item_ = -1, end_ = 0;
  };

 private:
  struct alignas(64) Range {                   // a line each: the owners' takes do not contend
    std::atomic<uint64_t> bounds;              // front in the low half, back (past the end) high
  };
  static uint64_t pack(int64_t front, int64_t back) { return (uint64_t)front | (uint64_t)back << 32; }

  // Relaxed order is enough: an item is handed out once, and the parallel region's end orders
  // what its taker wrote.
  bool take_front(int r, int& first, int& end) {        // a run [first, end) of range r's front
    uint64_t bounds = ranges_[r].bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t f = (uint32_t)bounds, b = (uint32_t)(bounds >> 32);
      if (f >= b) return false;
      const uint32_t run = (b - f) / 8 > 1 ? (b - f) / 8 : 1;
      if (ranges_[r].bounds.compare_exchange_weak(bounds, pack(f + run, b), std::memory_order_relaxed)) {
        first = (int)f;
        end = (int)(f + run);
        return true;
      }
    }
  }
  bool take_back(int r, int& item) {                    // range r's last item
    uint64_t bounds = ranges_[r].bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t f = (uint32_t)bounds, b = (uint32_t)(bounds >> 32);
      if (f >= b) return false;
      if (ranges_[r].bounds.compare_exchange_weak(bounds, pack(f, b - 1), std::memory_order_relaxed)) {
        item = (int)(b - 1);
        return true;
      }
    }
  }

  int count_;
  Range ranges_[MAX_THREADS];
};

}  // namespace native
