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
#include <exception>
#include <functional>
#include <memory>
#include <vector>

namespace pagecli {

// bounds[0] = 0 <= bounds[1] <= ... <= bounds[parts] = units: share r is units [bounds[r], bounds[r + 1]).
class SharedWork {
 public:
  SharedWork() = default;
  explicit SharedWork(std::vector<int64_t> bounds) { reset(std::move(bounds)); }

  // Starts over on new shares (a Team's next region), keeping the counters' memory when it suffices.
  void reset(std::vector<int64_t> bounds) {
    bounds_ = std::move(bounds);
    parts_ = static_cast<int64_t>(bounds_.size()) - 1;
    if (parts_ > capacity_) next_.reset(new Counter[capacity_ = parts_]);
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
  int64_t parts_ = 0, capacity_ = 0;
  std::unique_ptr<Counter[]> next_;
};

// ---- A team: one parallel region kept open over many kernels -----------------------------------
// A decode step of one sequence runs about 150 products and attention calls of 20-300 us each; as
// separate parallel regions, each pays a fork and a join, and the worker threads idle through the
// tensor bookkeeping between them. DecodeStep (decode_step.cpp) instead opens one region for the
// whole step (run_team): its threads run the layer loop together, each kernel's parallel_shared
// handing out the units of one shared SharedWork to all of them, with a barrier before (rank 0 has
// set the shares) and after (every unit is done); the steps between kernels run on rank 0 alone.
// Every thread must make the same calls in the same order, and the units are the same as in a
// region of their own, so results are bit-identical to the separate regions.
class Team {
 public:
  explicit Team(int64_t size) : size_(size) {}
  int64_t size() const { return size_; }

  // Returns when every member has called it; throws Aborted once a member has failed (fail()).
  void barrier();
  // A member's error: the others leave at their next barrier, and run_team rethrows it.
  void fail(std::exception_ptr error);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::exception_ptr error() const { return error_; }

  // parallel_shared inside the team: every member calls it with the same bounds.
  template <typename Fn>
  void share(std::vector<int64_t> bounds, int64_t rank, const Fn& fn) {
    if (bounds.back() == 0) return;
    if (rank == 0) work_.reset(std::move(bounds));
    barrier();
    {
      SharedWork::Cursor cursor(work_, rank % work_.parts());  // members past the shares only take over
      fn(cursor);
    }
    barrier();
  }

  // Memory the members share for one kernel (the rows it rounds before its products): every member
  // calls it with the same size, rank 0 grows it, and all get the same pointer after a barrier. It
  // stays valid until the next call (a kernel's share() ends with a barrier, so no member still
  // reads the last kernel's).
  void* shared_scratch(int64_t bytes, int64_t rank) {
    if (rank == 0 && static_cast<int64_t>(scratch_.size()) < bytes) scratch_.resize(bytes);
    barrier();
    return scratch_.data();
  }

  struct Aborted {};  // thrown by barrier() in the members that did not fail

 private:
  std::vector<unsigned char> scratch_;
  const int64_t size_;
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
  std::atomic<bool> failed_{false};
  std::atomic_flag error_taken_ = ATOMIC_FLAG_INIT;
  std::exception_ptr error_;
  SharedWork work_;
};

// The team this thread is a member of (null outside run_team) and its rank there.
struct TeamSeat {
  Team* team = nullptr;
  int64_t rank = 0;
};
TeamSeat& team_seat();

// The threads a kernel shares its work over: the team's inside run_team, else ATen's.
inline int64_t work_threads() {
  const TeamSeat& seat = team_seat();
  return seat.team ? seat.team->size() : at::get_num_threads();
}

// Runs body(team, rank) on every thread of one parallel region (ATen's thread count), as a Team;
// rethrows the first member's error after all have left.
void run_team(const std::function<void(Team&, int64_t)>& body);

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
  if (const TeamSeat& seat = team_seat(); seat.team) return seat.team->share(std::move(bounds), seat.rank, fn);
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
  const int64_t parts = std::min<int64_t>(work_threads(), (units + grain - 1) / grain);
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

// For the tests: `regions` parallel_shared calls of `units` units in one run_team; per region and
// unit, the rank that took it (-1 never, -2 twice). Member `failing_rank` raises in region 1 (-1:
// none): run_team then raises that error in the caller once every member has left.
std::vector<int64_t> team_work_takers(int64_t units, int64_t regions, int64_t failing_rank);

}  // namespace pagecli
