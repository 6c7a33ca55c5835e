// work_share.h's team (barrier, errors, the region) and the tests' window on it: which thread took
// which unit when one starts late.

#include "work_share.h"

#include <c10/util/ParallelGuard.h>
#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

namespace pagecli {

TeamSeat& team_seat() {
  thread_local TeamSeat seat;
  return seat;
}

void Team::barrier() {
  if (size_ == 1) return;
  const int64_t generation = generation_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
    arrived_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    return;
  }
  // Spin while the others are on their cores (a kernel's end is microseconds away); past that, give
  // the core up between looks, as a member held off its core by another process needs it back.
  for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
    if (failed()) throw Aborted{};
    if (spins < 20000) {
      _mm_pause();
    } else {
      sched_yield();
    }
  }
}

void Team::fail(std::exception_ptr error) {
  if (!error_taken_.test_and_set()) error_ = std::move(error);
  failed_.store(true, std::memory_order_release);
}

void run_team(const std::function<void(Team&, int64_t)>& body) {
  Team* team = nullptr;
  std::unique_ptr<Team> owner;
  // One region of ATen's threads (no num_threads clause: ATen avoids it for GOMP's pool, see
  // ATen/ParallelOpenMP.h); the team is as large as the region OpenMP actually gives.
#pragma omp parallel
  {
#pragma omp single
    {
      owner = std::make_unique<Team>(omp_get_num_threads());
      team = owner.get();
    }  // (an implied barrier: every thread sees the team)
    const int64_t rank = omp_get_thread_num();
    TeamSeat& seat = team_seat();
    const TeamSeat outer = seat;
    seat = TeamSeat{team, rank};
    c10::ParallelGuard in_region(true);  // ATen's own parallel_for inside runs inline
    try {
      body(*team, rank);
    } catch (const Team::Aborted&) {
      // another member failed; its error is the one rethrown
    } catch (...) {
      team->fail(std::current_exception());
    }
    seat = outer;
  }
  if (team->failed()) std::rethrow_exception(team->error());
}

std::vector<int64_t> shared_work_takers(int64_t units, int64_t delayed_part, int64_t delay_ms) {
  std::vector<std::atomic<int64_t>> takers(units);
  for (auto& t : takers) t.store(-1);
  parallel_shared(units, [&](SharedWork::Cursor& cursor) {
    if (cursor.home() == delayed_part) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    for (int64_t u; (u = cursor.next()) >= 0;) {
      int64_t unset = -1;
      if (!takers[u].compare_exchange_strong(unset, cursor.home())) takers[u].store(-2);
    }
  });
  std::vector<int64_t> out(units);
  for (int64_t u = 0; u < units; ++u) out[u] = takers[u].load();
  return out;
}

std::vector<int64_t> team_work_takers(int64_t units, int64_t regions, int64_t failing_rank) {
  std::vector<std::atomic<int64_t>> takers(units * regions);
  for (auto& t : takers) t.store(-1);
  run_team([&](Team&, int64_t rank) {
    for (int64_t region = 0; region < regions; ++region) {
      if (region == 1 && rank == failing_rank) throw std::runtime_error("team member " + std::to_string(rank) + " failed");
      parallel_shared(units, [&](SharedWork::Cursor& cursor) {
        for (int64_t u; (u = cursor.next()) >= 0;) {
          int64_t unset = -1;
          if (!takers[region * units + u].compare_exchange_strong(unset, rank)) takers[region * units + u].store(-2);
        }
      });
    }
  });
  std::vector<int64_t> out(units * regions);
  for (size_t i = 0; i < out.size(); ++i) out[i] = takers[i].load();
  return out;
}

}  // namespace pagecli
