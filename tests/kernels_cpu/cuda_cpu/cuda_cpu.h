// CUDA-on-CPU shim: lets g++ compile the unmodified kernels/*.cu and run a kernel over a grid.
//
// Model (what the kernels may rely on, and nothing more):
//   * one OS thread per CUDA thread of a block (blockDim.x*y*z threads, at most 1024), taken from a
//     persistent pool so that a launch costs no thread creation (ThreadSanitizer makes that ~1 ms);
//   * threadIdx / blockIdx are thread_local; gridDim / blockDim are set before the pool is woken;
//   * the blocks of a grid run one after another, all threads of the block stepping through the
//     same block sequence with a barrier between blocks, so `__shared__` can be plain `static`
//     storage shared by the pool threads (one copy per kernel instantiation);
//   * __syncthreads() is a barrier over the block's threads built from two atomics and a futex:
//     arrivals are acq_rel increments of a counter, the last one publishes a new generation with a
//     release store, the others acquire it. ThreadSanitizer sees exactly these edges, so a missing
//     barrier shows up as a data race on the static storage. (pthread_barrier_wait is NOT used: its
//     ThreadSanitizer interceptor releases and acquires one clock for all generations, so a thread
//     that leaves barrier k late acquires what a faster thread did after it and before barrier k+1,
//     and planted races went unreported in about half of the processes);
//   * intrinsics map to their libm counterparts (__expf -> expf, __ldg -> plain load, ...); float4, int2
//     and __align__ are their g++ equivalents (16- and 8-byte alignment);
//   * asynchronous copies to shared memory (CUDA's pipeline primitives, PTX cp.async) land at the latest
//     moment their contract allows, and hold garbage until then (see __pipeline_memcpy_async below).
// Not modelled (the kernels must not use them): warps (shuffles, votes, warp-synchronous code),
// atomics, dynamic (extern) shared memory, streams, cooperative groups, textures.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace cudacpu {
inline thread_local dim3 tl_threadIdx{0, 0, 0};
inline thread_local dim3 tl_blockIdx{0, 0, 0};
inline dim3 g_blockDim{1, 1, 1};  // written only while the pool is parked (a launch holds the lock)
inline dim3 g_gridDim{1, 1, 1};

// Reusable barrier for `count` threads (see the header comment for why not pthread_barrier_t).
class Barrier {
 public:
  void reset(int count) {  // only while no thread is inside wait()
    count_ = count;
    arrived_.store(0, std::memory_order_relaxed);
  }

  void wait() {
    const int gen = generation_.load(std::memory_order_relaxed);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == count_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);  // nobody arrives again before the release below
      generation_.store(gen + 1, std::memory_order_release);
      syscall(SYS_futex, reinterpret_cast<int*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
      return;
    }
    while (generation_.load(std::memory_order_acquire) == gen)
      syscall(SYS_futex, reinterpret_cast<int*>(&generation_), FUTEX_WAIT_PRIVATE, gen, nullptr, nullptr, 0);
  }

 private:
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "futex needs a plain int");
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
  int count_ = 1;
};

inline Barrier g_barrier;

inline void syncthreads() { g_barrier.wait(); }

// A thread's asynchronous copies (see __pipeline_memcpy_async): those not yet committed, and the
// committed groups, oldest first. The value is read from global memory at the issue (global memory a
// kernel reads is read-only while it runs, so reading it later would give the same bytes). Pending
// copies at a block's end abort the run (check_no_copies_pending).
struct AsyncCopy {
  void* dst;
  size_t size;
  unsigned char bytes[16];
};
inline thread_local std::vector<AsyncCopy> tl_copies_open;
inline thread_local std::deque<std::vector<AsyncCopy>> tl_copy_groups;

inline void land(const std::vector<AsyncCopy>& group) {
  for (const AsyncCopy& c : group) std::memcpy(c.dst, c.bytes, c.size);
}

// A copy still pending when its thread leaves the block would land in shared memory that belongs to
// no block any more (on a GPU) or to the next one (here): a kernel must wait for every copy it issued.
// Empty groups (commits without copies) are fine.
inline void check_no_copies_pending() {
  size_t pending = tl_copies_open.size();
  for (const std::vector<AsyncCopy>& g : tl_copy_groups) pending += g.size();
  if (pending) {
    std::fprintf(stderr, "cuda_cpu: %zu asynchronous copies pending at the end of block (%u,%u,%u), thread %u: "
                 "a __pipeline_wait_prior is missing\n", pending, tl_blockIdx.x, tl_blockIdx.y, tl_blockIdx.z,
                 tl_threadIdx.x);
    std::abort();
  }
  tl_copy_groups.clear();
}

// Persistent pool: thread t (t < blockDim volume) runs `job` for every block of the grid in order.
class Pool {
 public:
  static Pool& get() {
    // never destroyed: its threads stay parked in wait() until the process exits, and destroying a
    // condition variable with waiters blocks in glibc (the exit would hang)
    static Pool* pool = new Pool;
    return *pool;
  }

  void launch(dim3 grid, dim3 block, const std::function<void()>& job) {
    const unsigned long long nt = 1ull * block.x * block.y * block.z;
    if (nt == 0 || nt > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
      std::fprintf(stderr, "cuda_cpu: invalid launch grid (%u,%u,%u) block (%u,%u,%u)\n", grid.x, grid.y,
                   grid.z, block.x, block.y, block.z);
      std::abort();
    }
    std::unique_lock<std::mutex> lock(mu_);
    while (threads_.size() < nt) {
      int tid = static_cast<int>(threads_.size());
      threads_.emplace_back([this, tid] { worker(tid); });
      threads_.back().detach();
    }
    g_gridDim = grid;
    g_blockDim = block;
    g_barrier.reset(static_cast<int>(nt));
    job_ = &job;
    active_ = static_cast<int>(nt);
    remaining_ = static_cast<int>(nt);
    ++generation_;
    wake_.notify_all();
    done_.wait(lock, [this] { return remaining_ == 0; });
    job_ = nullptr;
  }

 private:
  Pool() = default;

  void worker(int tid) {
    unsigned long long seen = 0;
    for (;;) {
      const std::function<void()>* job;
      dim3 grid, block;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen && tid < active_; });
        seen = generation_;
        job = job_;
        grid = g_gridDim;
        block = g_blockDim;
      }
      tl_threadIdx = dim3(tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y));
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            tl_blockIdx = dim3(x, y, z);
            (*job)();
            check_no_copies_pending();
            syncthreads();  // block boundary: the next block may reuse the static __shared__ storage
          }
      std::lock_guard<std::mutex> lock(mu_);
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void()>* job_ = nullptr;
  int active_ = 0, remaining_ = 0;
  unsigned long long generation_ = 0;
};

template <class F>
void launch(dim3 grid, dim3 block, F f) {
  std::function<void()> job(f);
  Pool::get().launch(grid, block, job);
}
}  // namespace cudacpu

#define threadIdx (::cudacpu::tl_threadIdx)
#define blockIdx (::cudacpu::tl_blockIdx)
#define blockDim (::cudacpu::g_blockDim)
#define gridDim (::cudacpu::g_gridDim)
#define __syncthreads() ::cudacpu::syncthreads()

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) float4 {  // CUDA's vector type: 16-byte aligned, so a float4 access is one 128-bit access
  float x, y, z, w;
};
struct alignas(8) int2 {  // likewise, 8 bytes
  int x, y;
};

template <class T>
inline T __ldg(const T* p) { return *p; }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }

// CUDA's pipeline primitives (cuda_pipeline_primitives.h; PTX cp.async on sm_80+), the contract and
// nothing more: __pipeline_memcpy_async(dst, src, size, zfill) copies size - zfill bytes from global
// src to shared dst and zeroes the last zfill bytes (size 4, 8 or 16, both addresses aligned to it;
// src is not read when zfill == size); __pipeline_commit() closes the thread's group of copies issued
// since the last commit; __pipeline_wait_prior(n) returns once all but the n most recent committed
// groups have landed. Modelled adversarially: dst holds garbage (0xff bytes, a NaN per float) from the
// issue until the wait that covers the copy, and only then its value. So reading a buffer before its
// wait gives NaNs (a result mismatch); a missing barrier before the issue is a ThreadSanitizer race of
// the garbage write with the buffer's previous readers, and one after the wait a race of the value's
// write with its new readers.
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size, size_t zfill = 0) {
  if ((size != 4 && size != 8 && size != 16) || zfill > size ||
      (reinterpret_cast<uintptr_t>(dst) | (zfill < size ? reinterpret_cast<uintptr_t>(src) : 0)) % size) {
    std::fprintf(stderr, "cuda_cpu: __pipeline_memcpy_async(%p, %p, %zu, %zu): size 4, 8 or 16, zfill <= size, "
                 "addresses aligned to size\n", dst, src, size, zfill);
    std::abort();
  }
  cudacpu::AsyncCopy c{dst, size, {}};
  if (zfill < size) std::memcpy(c.bytes, src, size - zfill);
  std::memset(dst, 0xff, size);  // garbage until the wait
  cudacpu::tl_copies_open.push_back(c);
}
inline void __pipeline_commit() {
  cudacpu::tl_copy_groups.push_back(std::move(cudacpu::tl_copies_open));
  cudacpu::tl_copies_open.clear();
}
inline void __pipeline_wait_prior(size_t n) {
  while (cudacpu::tl_copy_groups.size() > n) {
    cudacpu::land(cudacpu::tl_copy_groups.front());
    cudacpu::tl_copy_groups.pop_front();
  }
}

using std::fmaxf;
using std::fminf;
