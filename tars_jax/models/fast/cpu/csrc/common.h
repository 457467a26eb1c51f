// Shared by the FFI handlers of this folder: ParallelFor over XLA's intra-op thread pool, and the
// expert groups (rows sorted by expert, sizes [E] int32) with their checks.
//
// ParallelFor: tasks are claimed with an atomic counter by the calling thread and by helpers
// scheduled on the pool. The caller never waits for a helper to start (it can run every task
// itself), only for claimed tasks to finish, so a busy pool cannot deadlock it; the shared state
// lives as long as the last helper.
#ifndef TARS_JAX_CSRC_COMMON_H_
#define TARS_JAX_CSRC_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace tars {

struct ParallelJob {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::function<void(int64_t)> run;

  void Work() {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      run(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs run(t) for t in [0, total), on the caller and num_threads - 1 helpers (one worker per core
// whether or not the caller is itself a pool thread).
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> run) {
  if (total <= 0) return;
  auto job = std::make_shared<ParallelJob>();
  job->total = total;
  job->run = std::move(run);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0), total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// Start row of each expert's group, and the total: start[e] = sizes[0] + ... + sizes[e - 1].
inline std::vector<int64_t> GroupStarts(const int32_t* sizes, int64_t experts) {
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) start[e + 1] = start[e] + sizes[e];
  return start;
}

// InvalidArgument for a negative group size or sizes summing past `rows` (the rows of the input).
inline xla::ffi::Error CheckGroups(const int32_t* sizes, int64_t experts, int64_t rows) {
  int64_t total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (sizes[e] < 0) return xla::ffi::Error::InvalidArgument("negative group size");
    total += sizes[e];
  }
  if (total > rows) return xla::ffi::Error::InvalidArgument("group sizes sum past the rows of xs");
  return xla::ffi::Error::Success();
}

}  // namespace tars

#endif  // TARS_JAX_CSRC_COMMON_H_
