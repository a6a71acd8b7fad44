// Spin-then-block persistent pool; see threadpool.h for the contract.
//
// The job in flight is one 64-bit atomic word: generation (24 bits) | task count (20
// bits) | next unclaimed task (20 bits).  A thread claims a task with a compare-exchange
// that also checks the generation, so a worker that wakes late can never claim a task of
// a newer job with the callback of an older one: the callback is read after a successful
// claim, and the submitter does not overwrite it until every task of the job is done.
#include "threadpool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define EDGEPACK_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define EDGEPACK_PAUSE() __asm__ __volatile__("yield")
#else
#define EDGEPACK_PAUSE() ((void)0)
#endif

namespace edgepack {
namespace {

constexpr int kMaxThreads = 256;
constexpr int kDefaultCap = 8;
constexpr int64_t kDefaultSpinUs = 1000;
constexpr uint64_t kTaskBits = 20;
constexpr uint64_t kTaskMask = (uint64_t{1} << kTaskBits) - 1;
constexpr int64_t kMaxTasksPerJob = static_cast<int64_t>(kTaskMask);

// True on pool workers and on a caller while it runs a job: a nested run() then executes
// inline (re-locking `submit` from its owner would be undefined behaviour).
thread_local bool t_in_job = false;

// One step of a spin-wait: `pause` for the first iterations (a partner running on another
// core answers within microseconds), then also yield the CPU every few iterations: when
// the OS has put the waiting thread and its partner on the same core (the other core busy
// with another process), pure spinning would keep the partner off the CPU until the time
// slice ends, stalling the job by milliseconds.
inline void relax(int i) {
    EDGEPACK_PAUSE();
    if (i >= 256 && (i & 15) == 0) std::this_thread::yield();
}

inline uint64_t gen_of(uint64_t s) { return s >> (2 * kTaskBits); }
inline uint64_t count_of(uint64_t s) { return (s >> kTaskBits) & kTaskMask; }
inline uint64_t next_of(uint64_t s) { return s & kTaskMask; }
inline uint64_t pack(uint64_t gen, uint64_t count, uint64_t next) {
    return (gen << (2 * kTaskBits)) | (count << kTaskBits) | next;
}

}  // namespace

int default_threads() {
    const unsigned hw = std::thread::hardware_concurrency();
    return std::max(1, std::min<int>(hw ? static_cast<int>(hw) : 1, kDefaultCap));
}

struct ThreadPool::Impl {
    std::atomic<uint64_t> state{0};
    std::atomic<ThreadPool::TaskFn> fn{nullptr};
    std::atomic<void*> ctx{nullptr};
    std::atomic<int64_t> done{0};
    std::atomic<int> sleepers{0};
    std::atomic<bool> stop{false};
    std::atomic<int64_t> spin_us{kDefaultSpinUs};
    std::atomic<int> nthreads{1};

    std::mutex submit;  // one job at a time; a busy pool makes other submitters run inline
    std::mutex sleep_mutex;
    std::condition_variable wake;
    std::vector<std::thread> workers;

    // Claim and run tasks of generation `gen` until none is left; returns how many.
    int64_t work(uint64_t gen) {
        int64_t ran = 0;
        uint64_t s = state.load(std::memory_order_acquire);
        for (;;) {
            if (gen_of(s) != gen || next_of(s) >= count_of(s)) return ran;
            if (!state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                             std::memory_order_acquire)) {
                continue;
            }
            const TaskFn f = fn.load(std::memory_order_relaxed);
            f(ctx.load(std::memory_order_relaxed), static_cast<int64_t>(next_of(s)));
            ++ran;
            done.fetch_add(1, std::memory_order_acq_rel);
            s = state.load(std::memory_order_acquire);
        }
    }

    void worker_loop() {
        t_in_job = true;
        uint64_t seen = gen_of(state.load(std::memory_order_acquire));
        for (;;) {
            // Spin, then block, until a new generation (or stop) appears.
            const auto deadline = std::chrono::steady_clock::now() +
                                  std::chrono::microseconds(spin_us.load(std::memory_order_relaxed));
            bool fresh = false;
            for (int i = 0;; ++i) {
                if (stop.load(std::memory_order_acquire)) return;
                if (gen_of(state.load(std::memory_order_acquire)) != seen) {
                    fresh = true;
                    break;
                }
                relax(i);
                if ((i & 63) == 63 && std::chrono::steady_clock::now() >= deadline) break;
            }
            if (!fresh) {
                std::unique_lock<std::mutex> lock(sleep_mutex);
                sleepers.fetch_add(1, std::memory_order_seq_cst);
                wake.wait(lock, [&] {
                    return stop.load(std::memory_order_seq_cst) ||
                           gen_of(state.load(std::memory_order_seq_cst)) != seen;
                });
                sleepers.fetch_sub(1, std::memory_order_seq_cst);
                if (stop.load(std::memory_order_acquire)) return;
            }
            seen = gen_of(state.load(std::memory_order_acquire));
            work(seen);
        }
    }

    void start(int n) {
        stop.store(false, std::memory_order_release);
        nthreads.store(n, std::memory_order_release);
        for (int i = 1; i < n; ++i) {
            try {
                workers.emplace_back([this] { worker_loop(); });
            } catch (const std::exception&) {
                nthreads.store(static_cast<int>(workers.size()) + 1, std::memory_order_release);
                break;  // fewer threads than asked: still correct
            }
        }
    }

    void shutdown() {
        {
            std::lock_guard<std::mutex> lock(sleep_mutex);
            stop.store(true, std::memory_order_seq_cst);
        }
        wake.notify_all();
        for (std::thread& t : workers) t.join();
        workers.clear();
        nthreads.store(1, std::memory_order_release);
    }

    // Back-off when the machine is oversubscribed: a job whose caller had to wait long for
    // a preempted worker, or had to run every task itself, counts as "late"; after
    // kLateJobs late jobs in a row, jobs run inline for a while (then parallelism is tried
    // again).  Safe because results do not depend on the thread count; a worker that has a
    // core of its own claims its tasks within about a microsecond, so it does not trigger.
    static constexpr int64_t kLateWaitNs = 200000;       // 200 us of waiting at the barrier,
    static constexpr int kLateJobs = 8;                  // or no help, in this many jobs in a row:
    static constexpr int64_t kInlineMinNs = 50000000;    // then 50 ms single-threaded,
    static constexpr int64_t kInlineMaxNs = 1600000000;  // doubling while it keeps happening
    int late = 0;
    int64_t inline_ns = kInlineMinNs;
    std::chrono::steady_clock::time_point inline_until{};

    bool backing_off() {
        return inline_until.time_since_epoch().count() != 0 && std::chrono::steady_clock::now() < inline_until;
    }

    void run_job(int64_t ntasks, TaskFn f, void* c) {
        fn.store(f, std::memory_order_relaxed);
        ctx.store(c, std::memory_order_relaxed);
        done.store(0, std::memory_order_relaxed);
        const uint64_t gen = (gen_of(state.load(std::memory_order_relaxed)) + 1) & 0xffffffu;
        state.store(pack(gen, static_cast<uint64_t>(ntasks), 0), std::memory_order_seq_cst);
        if (sleepers.load(std::memory_order_seq_cst) > 0) {
            { std::lock_guard<std::mutex> lock(sleep_mutex); }
            wake.notify_all();
        }
        const int64_t mine = work(gen);
        bool slow = mine == ntasks;  // the workers took nothing: they did not get a CPU in time
        if (done.load(std::memory_order_acquire) < ntasks) {
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; done.load(std::memory_order_acquire) < ntasks; ++i) relax(i);
            slow = std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(kLateWaitNs);
        }
        if (!slow) {
            late = 0;
            inline_ns = kInlineMinNs;
            return;
        }
        if (++late >= kLateJobs) {
            late = 0;
            inline_until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(inline_ns);
            inline_ns = std::min(2 * inline_ns, kInlineMaxNs);
        }
    }
};

ThreadPool::ThreadPool() : impl_(new Impl) { impl_->start(default_threads()); }

// The pool is a function-local static that is never destroyed: joining threads during
// interpreter shutdown (static destruction order, fork children) is riskier than leaving
// them to the OS.
ThreadPool::~ThreadPool() = default;

ThreadPool& ThreadPool::instance() {
    static ThreadPool* pool = new ThreadPool();
    return *pool;
}

void ThreadPool::set_threads(int n) {
    n = std::max(1, std::min(n, kMaxThreads));
    std::lock_guard<std::mutex> lock(impl_->submit);
    if (n == impl_->nthreads.load() && static_cast<int>(impl_->workers.size()) == n - 1) return;
    impl_->shutdown();
    impl_->start(n);
}

int ThreadPool::threads() const { return impl_->nthreads.load(std::memory_order_acquire); }

void ThreadPool::set_spin_us(int64_t us) {
    impl_->spin_us.store(std::max<int64_t>(0, us), std::memory_order_relaxed);
}

int64_t ThreadPool::spin_us() const { return impl_->spin_us.load(std::memory_order_relaxed); }

void ThreadPool::run(int64_t ntasks, TaskFn fn, void* ctx) {
    if (ntasks <= 0) return;
    if (t_in_job) {  // nested inside a task: run inline
        for (int64_t i = 0; i < ntasks; ++i) fn(ctx, i);
        return;
    }
    std::unique_lock<std::mutex> lock(impl_->submit, std::try_to_lock);
    if (!lock.owns_lock() || impl_->workers.empty() || ntasks == 1 || impl_->backing_off()) {
        for (int64_t i = 0; i < ntasks; ++i) fn(ctx, i);  // busy, single-threaded or trivial
        return;
    }
    struct InJob {
        InJob() { t_in_job = true; }
        ~InJob() { t_in_job = false; }
    } in_job;
    for (int64_t base = 0; base < ntasks; base += kMaxTasksPerJob) {
        const int64_t n = std::min(kMaxTasksPerJob, ntasks - base);
        if (base == 0) {
            impl_->run_job(n, fn, ctx);
        } else {
            struct Shift {
                TaskFn fn;
                void* ctx;
                int64_t base;
            } shift{fn, ctx, base};
            impl_->run_job(n, [](void* p, int64_t i) {
                auto* s = static_cast<Shift*>(p);
                s->fn(s->ctx, s->base + i);
            }, &shift);
        }
    }
}

}  // namespace edgepack
