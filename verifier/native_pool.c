/* The native kernels' threads: one pool for the process, kept apart from OpenMP's.
 *
 * A verifier's round is a forward (a few hundred parallel loops, microseconds apart), then
 * milliseconds in which the other services work (the drafter, the gateway) on the same CPUs. An
 * OpenMP runtime cannot tell the two gaps apart: its idle threads either spin past the forward,
 * taking the core the other services need, or fall asleep between two loops of the forward and
 * must be woken (a futex, and on a virtual machine the wake of a halted CPU) hundreds of times a
 * forward. Here a forward holds the pool (``racer_pool_hold``): its workers spin between its loops
 * and sleep as soon as it ends, so a forward wakes them once. Outside a hold they spin a few
 * microseconds after a loop, then sleep.
 *
 * ``racer_pfor`` shares out items among the caller and the workers; each participant claims runs of
 * ``chunk`` items from a shared word, so which thread computes an item depends on timing. Every
 * kernel computes an item the same way whoever takes it, so the results never do. A call ends when
 * its items are done, not when every worker has answered: a worker the system has not run yet (its
 * CPU busy with another process) holds up nothing it has not claimed, and one that comes late
 * finds the call's word changed and claims nothing. One call uses the pool at a time; a call that
 * finds it busy (another thread's forward) runs on its caller alone: slower, the same bits.
 */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "native_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define relax() _mm_pause()
#elif defined(__aarch64__)
#define relax() __asm__ __volatile__("yield")
#else
#define relax() ((void)0)
#endif

#ifndef RACER_POOL_NAME
#define RACER_POOL_NAME "racer-pool" /* the reference build's pool: "racer-pool-ref" (native.py) */
#endif

enum { MAX_WORKERS = 254 };
#define IDLE_SPIN_NS 50000L /* outside a hold: how long a worker spins after a loop before it sleeps */

/* The claim word: the call's number (16 bits, wrapping), its threads (8), its items (20) and the next
 * unclaimed item (20). A worker decides from the word alone whether it takes part and what it claims,
 * and reads the call's other fields only after a claim succeeded: a claimed item not yet done keeps
 * the call, and so its fields, alive. A worker that read an old word and claims by chance when the
 * word is equal again (the number wrapped) claims the current call's items, which is right. */
#define ITEM_BITS 20
#define MAX_ITEMS ((1L << ITEM_BITS) - 1)
#define MAX_THREADS 255
#define WORD(call, nth, items, next)                                                                               \
    (((uint64_t)((call)&0xffff) << 48) | ((uint64_t)(nth) << 40) | ((uint64_t)(items) << 20) | (uint64_t)(next))
#define CALL_OF(w) ((uint32_t)((w) >> 48))
#define NTH_OF(w) ((int)(((w) >> 40) & 0xff))
#define ITEMS_OF(w) ((long)(((w) >> 20) & MAX_ITEMS))
#define NEXT_OF(w) ((long)((w)&MAX_ITEMS))

static struct {
    pthread_mutex_t busy;   /* held by the call that uses the workers */
    int workers;            /* started */
    _Atomic uint32_t gen;   /* bumped per call: the sleeping workers' futex word */
    _Atomic int sleepers;   /* workers in (or about to be in) futex_wait */
    _Atomic int hold;       /* forwards in progress: their workers never sleep */
    _Atomic uint64_t claim; /* WORD(call, threads, items, next) of the current call */
    _Atomic long done;      /* items of the current call computed */
    /* the current call: written before its claim word */
    long chunk, offset;
    racer_body body;
    void *ctx;
} P = {.busy = PTHREAD_MUTEX_INITIALIZER};

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Runs of the current call's items claimed and computed as participant ``tid``, until none is left
 * or this thread is not one of the call's. */
static void work(int tid)
{
    uint64_t w = atomic_load_explicit(&P.claim, memory_order_acquire);
    for (;;) {
        const long items = ITEMS_OF(w), lo = NEXT_OF(w);
        if (tid >= NTH_OF(w) || lo >= items) return;
        const long want = lo + P.chunk; /* maybe a later call's chunk: any run is right */
        const long hi = want < items ? want : items;
        if (!atomic_compare_exchange_weak_explicit(&P.claim, &w, (w & ~(uint64_t)MAX_ITEMS) | (uint64_t)hi,
                                                   memory_order_acq_rel, memory_order_acquire))
            continue;
        P.body(P.ctx, P.offset + lo, P.offset + hi, tid);
        atomic_fetch_add_explicit(&P.done, hi - lo, memory_order_release);
        w = atomic_load_explicit(&P.claim, memory_order_acquire);
    }
}

static void *worker(void *arg)
{
    const int id = (int)(intptr_t)arg; /* 1 .. MAX_WORKERS: the caller is 0 */
    uint32_t seen = atomic_load(&P.gen);
    for (;;) {
        work(id); /* the current call's items, if any are left and this worker is one of its threads */
        long spins = 0, since = 0;
        while (atomic_load_explicit(&P.gen, memory_order_acquire) == seen) {
            relax();
            if (atomic_load_explicit(&P.hold, memory_order_relaxed) > 0) {
                since = 0;
                continue;
            }
            if (++spins % 64) continue;
            const long t = now_ns();
            if (!since) since = t;
            if (t - since < IDLE_SPIN_NS) continue;
            atomic_fetch_add(&P.sleepers, 1); /* seq_cst, as the caller's bump then read: one sees the other */
            if (atomic_load(&P.gen) == seen) syscall(SYS_futex, &P.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&P.sleepers, 1);
            spins = since = 0;
        }
        seen = atomic_load(&P.gen);
    }
    return NULL;
}

/* Workers 1 .. n - 1 started (fewer where the system refuses a thread); the caller holds ``busy``. */
static int started(int n)
{
    while (P.workers < n - 1) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setstacksize(&a, 1 << 20);
        const int rc = pthread_create(&t, &a, worker, (void *)(intptr_t)(P.workers + 1));
        pthread_attr_destroy(&a);
        if (rc) break;
        pthread_detach(t);
        pthread_setname_np(t, RACER_POOL_NAME); /* as top -H and /proc/<pid>/task/<tid>/comm show it */
        P.workers++;
    }
    return P.workers + 1 < n ? P.workers + 1 : n;
}

/* One call of at most MAX_ITEMS items, from ``offset`` on; the caller holds ``busy``. */
static void run(long offset, long items, long chunk, int nth, racer_body body, void *ctx)
{
    P.chunk = chunk, P.offset = offset, P.body = body, P.ctx = ctx;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    const uint32_t call = CALL_OF(atomic_load_explicit(&P.claim, memory_order_relaxed)) + 1;
    atomic_store_explicit(&P.claim, WORD(call, nth, items, 0), memory_order_release);
    atomic_fetch_add(&P.gen, 1); /* seq_cst: publishes the call, then the sleepers are read */
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(0);
    while (atomic_load_explicit(&P.done, memory_order_acquire) < items) relax();
}

void racer_pfor(long items, long chunk, int threads, racer_body body, void *ctx)
{
    if (items <= 0) return;
    if (chunk < 1) chunk = 1;
    const long runs = (items + chunk - 1) / chunk;
    int nth = threads < runs ? threads : (int)runs;
    nth = nth < MAX_THREADS ? nth : MAX_THREADS;
    if (nth <= 1 || pthread_mutex_trylock(&P.busy)) {
        body(ctx, 0, items, 0);
        return;
    }
    nth = started(nth);
    for (long first = 0; first < items; first += MAX_ITEMS) {
        const long n = items - first < MAX_ITEMS ? items - first : MAX_ITEMS;
        if (nth > 1)
            run(first, n, chunk, nth, body, ctx);
        else
            body(ctx, first, first + n, 0);
    }
    pthread_mutex_unlock(&P.busy);
}

void racer_pool_hold(int on) { atomic_fetch_add(&P.hold, on ? 1 : -1); }

/* Workers started so far (the tests'). */
int racer_pool_workers(void) { return P.workers; }
