/* The native kernels' thread pool (native_pool.c). */
#ifndef RACER_NATIVE_POOL_H
#define RACER_NATIVE_POOL_H

/* Items [lo, hi) of a parallel loop, on participant ``tid`` (0 is the caller; below the call's threads). */
typedef void (*racer_body)(void *ctx, long lo, long hi, int tid);

/* body over items [0, items) in runs of ``chunk``, on at most ``threads`` threads (the caller one of
 * them); returns when every item is done. */
void racer_pfor(long items, long chunk, int threads, racer_body body, void *ctx);

/* A forward begins (1) or ends (0): while any is in progress the workers never sleep. */
void racer_pool_hold(int on);

#endif

