// parallel_for for the library's ops on its own worker threads, which wait for the next job by
// spinning a few tens of microseconds before they sleep (thread_pool.cpp explains why).
//
// Same contract as at::parallel_for: fn(begin, end) over [begin, end) split into one contiguous
// range per thread (the calling thread takes the first), ranges of at least `grain`; a range
// no larger than `grain`, a call from inside another parallel region, or a pool turned off
// runs as at::parallel_for would. The thread count is at::get_num_threads().
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace pagedllm {
namespace pool {

using Thunk = void (*)(void* ctx, int64_t begin, int64_t end);

// Runs thunk over [begin, end) in `num_tasks` ranges of `chunk` on the pool; false (and nothing
// run) when the pool cannot take the job here: the caller then uses at::parallel_for.
bool run(int64_t begin, int64_t end, int64_t chunk, int64_t num_tasks, Thunk thunk, void* ctx);

}  // namespace pool

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  grain = grain < 1 ? 1 : grain;
  if (n <= grain || threads <= 1 || at::in_parallel_region()) {
    fn(begin, end);
    return;
  }
  // at::parallel_for's split: min(threads, ceil(n / grain)) ranges of ceil(n / ranges).
  const int64_t tasks = std::min(threads, (n + grain - 1) / grain);
  const int64_t chunk = (n + tasks - 1) / tasks;
  auto thunk = [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
  if (!pool::run(begin, end, chunk, tasks, thunk, const_cast<void*>(static_cast<const void*>(&fn))))
    at::parallel_for(begin, end, grain, fn);
}

}  // namespace pagedllm
