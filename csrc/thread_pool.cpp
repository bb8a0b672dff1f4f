// The ops' own worker threads (thread_pool.h), and why they exist.
//
// A decode step runs ~150 parallel regions (4 GEMMs and an attention call a layer), each a few
// hundred microseconds, separated by single-threaded work (norms, rotary, Python) of a few tens.
// The engine sets OMP_WAIT_POLICY=PASSIVE, because OpenMP workers that spin starve everything
// else on a busy 2-core machine (pagedllm/__init__.py). But a passive worker sleeps the moment a
// region ends, and waking it costs the next region 10-25 us (measured on a 2-vCPU KVM guest: an
// empty-ish torch.add region 10-12 us spinning, 21 us passive, 34 us after a 200 us gap), about
// 2-3 ms of every step, 5-8% of a 16-row step.
//
// These workers wait for the next job by spinning (pause) for `spin_us` (default 50), then sleep
// on a futex; between the regions of one step they never sleep, and between steps they sleep
// after 50 us. But the gaps a passive worker leaves are where anything else on the machine runs
// for free (the API server beside the engine core streams its outputs there: spinning measured
// 3-11% fewer tok/s serving on 2 cores). So they stop spinning while the machine is contended:
// when the pool's threads spent more than kContendedShare of a window of kWindowNs waiting on a
// run queue (/proc/<tid>/schedstat: runnable, not running, i.e. someone else had the core), the
// pool hands its jobs to at::parallel_for (OpenMP's passive threads) for kBackoffNs, then tries
// spinning again. Its own workers sleeping on a futex did worse than OpenMP there: in a model whose
// torch ops run on OpenMP between the ops' jobs (an encoder), the pool stayed contended and a call
// cost ~1 ms more than on OpenMP, the woken worker apparently sharing the caller's core.
//
// One job at a time: a second thread calling an op meanwhile, a call from a worker, or a pool
// after fork() in the child is refused (pool::run returns false) and at::parallel_for runs it.
#include "thread_pool.h"

#include <ATen/ATen.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace pagedllm {
namespace pool {
namespace {

constexpr int64_t kWindowNs = 20'000'000;
constexpr double kContendedShare = 0.02;
constexpr int64_t kBackoffNs = 1'000'000'000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

int64_t spin_us_from_env() {
  const char* s = std::getenv("PAGEDLLM_POOL_SPIN_US");
  if (s == nullptr || *s == '\0') return 50;
  return std::max(0L, std::min(std::atol(s), 10000L));
}

thread_local bool tls_is_worker = false;

// Nanoseconds a thread has waited on a run queue (the second field of its schedstat); -1 if unknown.
int64_t run_queue_wait_ns(long tid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/task/%ld/schedstat", tid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return -1;
  unsigned long long on_cpu = 0, waiting = 0;
  const int got = std::fscanf(f, "%llu %llu", &on_cpu, &waiting);
  std::fclose(f);
  return got == 2 ? static_cast<int64_t>(waiting) : -1;
}

long this_tid() { return static_cast<long>(syscall(SYS_gettid)); }

class Pool {
 public:
  bool run(int64_t begin, int64_t end, int64_t chunk, int64_t num_tasks, Thunk thunk, void* ctx);

  std::atomic<bool> enabled{std::getenv("PAGEDLLM_DISABLE_OP_POOL") == nullptr ||
                            std::string(std::getenv("PAGEDLLM_DISABLE_OP_POOL")) == "0"};
  std::atomic<int64_t> spin_us{spin_us_from_env()};
  std::atomic<bool> yield_when_contended{true};  // contended jobs to at::parallel_for (off: tests of the workers)
  std::atomic<int64_t> jobs{0}, worker_sleeps{0}, contended_windows{0}, handed_off{0};
  std::atomic<bool> contended{false};

 private:
  void resize(int64_t num_workers);
  void worker_loop(int64_t index, uint32_t seen);
  void update_contention();
  // Spin (while the budget lasts and the process is not contended), then sleep, until *word != seen.
  void wait_while_equal(std::atomic<uint32_t>& word, uint32_t seen, std::atomic<uint32_t>& sleepers, bool count);

  std::mutex mutex_;  // held by the thread running a job
  std::vector<std::thread> workers_;
  std::atomic<uint32_t> epoch_{0};    // bumped per job; the workers' futex word
  std::atomic<uint32_t> pending_{0};  // workers yet to finish the job; the caller's futex word
  std::atomic<uint32_t> worker_sleepers_{0}, caller_sleeping_{0};
  std::atomic<bool> stop_{false};
  // The job, written before epoch_ is bumped (release) and read after it is seen (acquire).
  Thunk thunk_ = nullptr;
  void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0, tasks_ = 0;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::vector<std::atomic<long>> worker_tids_ = std::vector<std::atomic<long>>(0);
  int64_t window_start_ = 0, window_wait_ = 0, passive_until_ = 0;
  long window_caller_ = 0;
};

void Pool::wait_while_equal(std::atomic<uint32_t>& word, uint32_t seen, std::atomic<uint32_t>& sleepers,
                            bool count) {
  const int64_t budget = contended.load(std::memory_order_relaxed) ? 0 : spin_us.load(std::memory_order_relaxed);
  if (budget > 0) {
    const int64_t deadline = now_ns() + budget * 1000;
    for (int i = 0;; ++i) {
      if (word.load(std::memory_order_acquire) != seen) return;
      _mm_pause();
      if ((i & 63) == 63 && now_ns() > deadline) break;
    }
  }
  while (word.load(std::memory_order_acquire) == seen) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (count) worker_sleeps.fetch_add(1, std::memory_order_relaxed);
    futex_wait(&word, seen);  // returns at once if word changed after the fetch_add
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

// `seen`: the epoch when the worker was made; a job posted before the thread first runs still counts.
void Pool::worker_loop(int64_t index, uint32_t seen) {
  tls_is_worker = true;
  worker_tids_[index].store(this_tid(), std::memory_order_release);
  for (;;) {
    wait_while_equal(epoch_, seen, worker_sleepers_, true);
    seen = epoch_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    const int64_t task = index + 1;  // task 0 is the caller's
    if (task < tasks_) {
      const int64_t b = begin_ + task * chunk_, e = std::min(end_, b + chunk_);
      if (b < e) {
        try {
          thunk_(ctx_, b, e);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!error_) error_ = std::current_exception();
        }
      }
    }
    if (pending_.fetch_sub(1, std::memory_order_seq_cst) == 1 && caller_sleeping_.load(std::memory_order_seq_cst))
      futex_wake(&pending_);
  }
}

void Pool::resize(int64_t num_workers) {
  if (static_cast<int64_t>(workers_.size()) == num_workers) return;
  if (!workers_.empty()) {
    stop_.store(true, std::memory_order_release);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake(&epoch_);
    for (auto& t : workers_) t.join();
    workers_.clear();
    stop_.store(false, std::memory_order_release);
  }
  worker_tids_ = std::vector<std::atomic<long>>(num_workers);
  window_start_ = 0;  // a new set of threads: start a new contention window
  const uint32_t start = epoch_.load(std::memory_order_acquire);
  for (int64_t i = 0; i < num_workers; ++i) workers_.emplace_back([this, i, start] { worker_loop(i, start); });
}

void Pool::update_contention() {
  const int64_t t = now_ns();
  if (window_start_ != 0 && t - window_start_ < kWindowNs) return;
  const long caller = this_tid();
  int64_t wait = run_queue_wait_ns(caller);
  for (auto& tid : worker_tids_) {
    const long w = tid.load(std::memory_order_acquire);
    const int64_t ns = w == 0 ? -1 : run_queue_wait_ns(w);
    wait = (wait < 0 || ns < 0) ? -1 : wait + ns;
  }
  if (wait < 0) {  // no schedstat here (or a worker not started yet): stay passive meanwhile
    contended.store(true, std::memory_order_relaxed);
    window_start_ = 0;
    return;
  }
  if (window_start_ != 0 && caller == window_caller_) {
    if (static_cast<double>(wait - window_wait_) > kContendedShare * static_cast<double>(t - window_start_)) {
      passive_until_ = t + kBackoffNs;
      contended_windows.fetch_add(1, std::memory_order_relaxed);
    }
    contended.store(t < passive_until_, std::memory_order_relaxed);
  }
  window_start_ = t;
  window_wait_ = wait;
  window_caller_ = caller;
}

bool Pool::run(int64_t begin, int64_t end, int64_t chunk, int64_t num_tasks, Thunk thunk, void* ctx) {
  if (tls_is_worker) {  // a job inside a job: this thread does it alone
    thunk(ctx, begin, end);
    return true;
  }
  if (!enabled.load(std::memory_order_relaxed)) return false;
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  resize(at::get_num_threads() - 1);
  if (static_cast<int64_t>(workers_.size()) + 1 < num_tasks) return false;
  update_contention();
  if (contended.load(std::memory_order_relaxed) && yield_when_contended.load(std::memory_order_relaxed)) {
    handed_off.fetch_add(1, std::memory_order_relaxed);
    return false;  // OpenMP's passive threads take it (above)
  }
  jobs.fetch_add(1, std::memory_order_relaxed);
  thunk_ = thunk;
  ctx_ = ctx;
  begin_ = begin;
  end_ = end;
  chunk_ = chunk;
  tasks_ = num_tasks;
  error_ = nullptr;
  pending_.store(static_cast<uint32_t>(workers_.size()), std::memory_order_relaxed);
  epoch_.fetch_add(1, std::memory_order_seq_cst);  // publishes the job
  if (worker_sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(&epoch_);
  std::exception_ptr mine;
  try {
    thunk(ctx, begin, std::min(end, begin + chunk));
  } catch (...) {
    mine = std::current_exception();
  }
  for (uint32_t p; (p = pending_.load(std::memory_order_acquire)) != 0;) wait_while_equal(pending_, p, caller_sleeping_, false);
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
  return true;
}

Pool* g_pool = nullptr;
std::once_flag g_once;

// In a child of fork() the workers do not exist: it gets a fresh pool (the parent's is left as is).
void after_fork_in_child() { g_pool = new Pool(); }

Pool& instance() {
  std::call_once(g_once, [] {
    g_pool = new Pool();  // never destroyed: workers may outlive static destruction order
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
  });
  return *g_pool;
}

// Query and set the pool from Python: enabled (1/0), spin budget in us, whether contended jobs go to
// OpenMP (1/0); a negative value keeps the current setting. Returns [enabled, spin_us, jobs,
// worker_sleeps, contended, contended_windows, yield_when_contended, handed_off].
std::vector<int64_t> op_pool_config(int64_t enabled, int64_t spin_us, int64_t yield_when_contended) {
  Pool& p = instance();
  if (enabled >= 0) p.enabled.store(enabled != 0);
  if (spin_us >= 0) p.spin_us.store(std::min<int64_t>(spin_us, 10000));
  if (yield_when_contended >= 0) p.yield_when_contended.store(yield_when_contended != 0);
  return {p.enabled.load() ? 1 : 0, p.spin_us.load(), p.jobs.load(), p.worker_sleeps.load(),
          p.contended.load() ? 1 : 0, p.contended_windows.load(), p.yield_when_contended.load() ? 1 : 0,
          p.handed_off.load()};
}

}  // namespace

bool run(int64_t begin, int64_t end, int64_t chunk, int64_t num_tasks, Thunk thunk, void* ctx) {
  return instance().run(begin, end, chunk, num_tasks, thunk, ctx);
}

}  // namespace pool
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("op_pool_config(int enabled, int spin_us, int yield_when_contended=-1) -> int[]",
        &pagedllm::pool::op_pool_config);
}
