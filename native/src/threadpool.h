// Persistent thread pool for the inference kernels.
//
// * Workers live for the whole process (restarted only by set_threads) and spin for a
//   configurable time after each job before blocking on a condition variable, so a decode
//   loop issuing hundreds of small ops per token never pays a sleep/wake per op.
// * The calling thread always takes part, so `threads == 1` means no worker at all.
// * Work is split into tasks with fixed index ranges; which thread runs a task never
//   changes what the task computes, so results are bit-identical for any thread count.
// * Re-entrancy: a job submitted while another is running (a second Python thread, or a
//   kernel called from inside a task) runs inline on the submitting thread.
// * Oversubscription: spin-waits yield the CPU after a few hundred iterations, and when
//   jobs keep waiting long for a preempted worker (other busy processes on the cores) the
//   pool runs jobs inline for 50 ms before trying again.  Results never depend on it.
#pragma once

#include <cstdint>

namespace edgepack {

class ThreadPool {
public:
    using TaskFn = void (*)(void* ctx, int64_t task);

    static ThreadPool& instance();

    // n >= 1 threads in total (caller included).  Blocks until running jobs end.
    void set_threads(int n);
    int threads() const;
    // Spin this long (microseconds) waiting for the next job before sleeping.
    void set_spin_us(int64_t us);
    int64_t spin_us() const;

    // Run fn(ctx, i) for i in [0, ntasks); returns when all are done.
    void run(int64_t ntasks, TaskFn fn, void* ctx);

    // Number of chunks parallel_for would use for (n, grain, per_thread).
    int64_t chunk_count(int64_t n, int64_t grain, int per_thread = 1) const {
        if (n <= 0) return 0;
        if (grain < 1) grain = 1;
        int64_t chunks = static_cast<int64_t>(threads()) * per_thread;
        if (chunks > n / grain) chunks = n / grain;
        return chunks < 1 ? 1 : chunks;
    }

    // fn(c, i0, i1) for chunk c in [0, chunks) covering [c*n/chunks, (c+1)*n/chunks).
    template <class F>
    void parallel_chunks(int64_t n, int64_t chunks, F&& fn) {
        if (n <= 0) return;
        if (chunks <= 1) {
            fn(int64_t{0}, int64_t{0}, n);
            return;
        }
        struct Ctx {
            F* f;
            int64_t n, chunks;
        } ctx{&fn, n, chunks};
        run(chunks, [](void* p, int64_t c) {
            auto* x = static_cast<Ctx*>(p);
            (*x->f)(c, c * x->n / x->chunks, (c + 1) * x->n / x->chunks);
        }, &ctx);
    }

    // fn(i0, i1) over [0, n) in chunks of at least `grain` items, about `per_thread`
    // chunks per thread (more chunks balance better, fewer keep streams contiguous).
    template <class F>
    void parallel_for(int64_t n, int64_t grain, F&& fn, int per_thread = 1) {
        parallel_chunks(n, chunk_count(n, grain, per_thread),
                        [&fn](int64_t, int64_t i0, int64_t i1) { fn(i0, i1); });
    }

    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

private:
    ThreadPool();
    ~ThreadPool();
    struct Impl;
    Impl* impl_;
};

// Default thread count: hardware concurrency, capped (kernels are memory-bound early).
int default_threads();

}  // namespace edgepack
