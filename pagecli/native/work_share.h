// Parallel loops whose threads, once through their own share of the work, take over what another
// thread has not started yet.
//
// Why: pagecli runs as many OpenMP threads as the machine has cores, and a step runs hundreds of
// parallel regions. When the OS holds one thread off its core for a while (a server's own Python
// thread, a benchmark client, anything else on a 2-core machine), a static split makes every other
// thread wait at the region's end for the held one's share. Here each thread first takes its own
// share, in order, as a static split would (so in the common case the same thread reads the same
// weights in the same order, and nothing changes); a thread that finishes takes the units another
// thread has not yet begun. A unit's result never depends on the thread that computes it (each
// kernel's sum order is fixed per output), so outputs stay bit-identical.
//
// Cost: one uncontended atomic increment per unit, on a cache line of the share's own.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace pagecli {

// bounds[0] = 0 <= bounds[1] <= ... <= bounds[parts] = units: share r is units [bounds[r], bounds[r + 1]).
class SharedWork {
 public:
  explicit SharedWork(std::vector<int64_t> bounds)
      : bounds_(std::move(bounds)), parts_(static_cast<int64_t>(bounds_.size()) - 1), next_(new Counter[parts_]) {
    for (int64_t r = 0; r < parts_; ++r) next_[r].unit.store(bounds_[r], std::memory_order_relaxed);
  }

  int64_t parts() const { return parts_; }

  // One thread's walk over the units: its own share first, then the others' in turn, each unit
  // handed out once over all threads.
  class Cursor {
   public:
    Cursor(SharedWork& work, int64_t home) : work_(work), home_(home), part_(home) {}
    // The next unit this thread is to compute, or -1 when every unit has been handed out.
    int64_t next() {
      while (visited_ < work_.parts_) {
        const int64_t u = work_.next_[part_].unit.fetch_add(1, std::memory_order_relaxed);
        if (u < work_.bounds_[part_ + 1]) {
          entered_ = part_ != taken_from_;
          taken_from_ = part_;
          return u;
        }
        ++visited_;
        part_ = (part_ + 1) % work_.parts_;
      }
      return -1;
    }
    // Whether the last unit is the first this thread took from its share: the units stopped following
    // each other there (a kernel streaming its weights starts a new run).
    bool entered_part() const { return entered_; }
    // One past the last unit of the last unit's share.
    int64_t end_of_part() const { return work_.bounds_[part_ + 1]; }
    // The share this thread owns.
    int64_t home() const { return home_; }

   private:
    SharedWork& work_;
    int64_t home_;
    int64_t part_;
    int64_t visited_ = 0;
    int64_t taken_from_ = -1;  // the share of the last unit handed out
    bool entered_ = false;
  };

 private:
  struct alignas(64) Counter {
    std::atomic<int64_t> unit;
  };
  std::vector<int64_t> bounds_;
  int64_t parts_;
  std::unique_ptr<Counter[]> next_;
};

// The split at::parallel_for makes of [0, units) over `parts` threads: equal runs of consecutive units.
inline std::vector<int64_t> even_bounds(int64_t units, int64_t parts) {
  parts = std::max<int64_t>(1, std::min(parts, units));
  const int64_t chunk = (units + parts - 1) / parts;
  std::vector<int64_t> bounds(parts + 1);
  for (int64_t r = 0; r <= parts; ++r) bounds[r] = std::min(units, r * chunk);
  return bounds;
}

// Runs fn(cursor) once on each thread of a parallel region over the shares of `bounds`; fn takes
// units with cursor.next() until it returns -1. Per-thread setup (scratch buffers, tile
// configuration) goes before the loop, once.
template <typename Fn>
void parallel_shared(std::vector<int64_t> bounds, const Fn& fn) {
  if (bounds.back() == 0) return;  // no units
  SharedWork work(std::move(bounds));
  at::parallel_for(0, work.parts(), 1, [&](int64_t begin, int64_t /*end*/) {
    SharedWork::Cursor cursor(work, begin);
    fn(cursor);
  });
}

// parallel_shared over units [0, units), split as at::parallel_for(0, units, grain, ...) splits it.
template <typename Fn>
void parallel_shared(int64_t units, const Fn& fn, int64_t grain = 1) {
  if (units <= 0) return;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), (units + grain - 1) / grain);
  parallel_shared(even_bounds(units, parts), fn);
}

// parallel_shared over items [0, count) handed out in units of `per_unit` consecutive items; fn(item)
// for every item, in order within a unit.
template <typename Fn>
void parallel_shared_items(int64_t count, int64_t per_unit, const Fn& fn) {
  parallel_shared((count + per_unit - 1) / per_unit, [&](SharedWork::Cursor& cursor) {
    for (int64_t u; (u = cursor.next()) >= 0;) {
      for (int64_t item = u * per_unit; item < std::min(count, (u + 1) * per_unit); ++item) fn(item);
    }
  });
}

// For the tests (work_share.cpp): parallel_shared over `units` units, the thread that owns share
// `delayed_part` starting `delay_ms` late, as one held off its core would; returns per unit the
// share of the thread that took it (-2 where two threads took the same unit).
std::vector<int64_t> shared_work_takers(int64_t units, int64_t delayed_part, int64_t delay_ms);

}  // namespace pagecli
