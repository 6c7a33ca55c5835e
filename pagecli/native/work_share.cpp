// The tests' window on work_share.h: which thread took which unit when one starts late.

#include "work_share.h"

#include <chrono>
#include <thread>

namespace pagecli {

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

}  // namespace pagecli
