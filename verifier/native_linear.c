/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32, for the few rows a verification step has;
 * the weight float32, bfloat16 or float16 (widened as it is loaded: a one-token step, bound by the
 * bytes it reads, reads half of them in reduced precision).
 *
 * BLAS libraries pack the weight before a GEMM, which for a handful of rows reads and writes the
 * whole weight once more than the product itself needs. Here each weight row is streamed once per
 * call: a tile of NR weight rows is multiplied with MR rows of x in registers (NR x MR vector
 * accumulators over K, reduced at the end), passes over further rows of x find the tile in the
 * L1 cache, and the next tile is prefetched all the while. Threads (OpenMP: torch's own runtime
 * when loaded into its process) take contiguous ranges of weight rows.
 *
 * Many rows: a half-width weight tile that several passes meet is widened to float32 once (into the
 * thread's scratch, L1-resident) instead of on every pass, and the rows of x are taken in blocks
 * that stay in the L2 cache while the whole weight streams past each block (K is never split).
 *
 * A row's result never depends on the other rows of the call: every output is the same sequence of
 * vector FMAs over K, on the same float32 values (a widened weight holds exactly what a load widens
 * to), followed by the same lane reduction, whatever tile, pass or block it falls in. So these
 * kernels are batch invariant by construction, with no chunking of rows, in every dtype.
 *
 * Built by verifier/native.py with -O3 -march=native: the vector width follows the CPU (256-bit on
 * AVX2, 512-bit with AVX-512), and the tuner measures which tile shape wins for each row count.
 */
#include <stddef.h>
#include <stdlib.h>

#include "native_pool.h"
#include "native_vec.h"

typedef void (*tile_fn)(const float *restrict x, const void *restrict w, const float *restrict bias,
                        float *restrict y, long N, long K, const void *next);

/* The lanes of an accumulator summed as a fixed tree (halves added until one lane is left): the same
 * additions for every output, in a few dependent steps instead of VL. */
static inline float reduce_tree(vf v)
{
    float a[VL];
    memcpy(a, &v, sizeof a);
    for (int h = VL / 2; h; h /= 2)
        for (int i = 0; i < h; i++) a[i] += a[i + h];
    return a[0];
}

/* A weight vector loaded once into a register for the MR FMAs that use it: left alone, GCC folds
 * the load into each FMA, MR loads where one does, and a float32 tile then waits on the load ports
 * (measured on an AVX2 Zen 3: 1.3-1.6x faster tiles at 16-64 rows). No effect on the arithmetic. */
#if defined(__AVX__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) (void)0
#endif

/* NR weight rows from ``w`` on against MR rows of x from ``x`` on, into y (row stride N) and bias
 * from the tile's first output on; ``next``: the following tile's first weight row (NULL for none),
 * prefetched meanwhile, one line at a time: a call of at most MR rows makes one pass per tile, and
 * the prefetch keeps the next tile's lines on their way while it runs (one thread, 4 rows: ~20%
 * faster than leaving the stream to the hardware prefetcher alone). */
#define DEFTILE(T, W, NR, MR)                                                                              \
    static void tile_##T##_##NR##_##MR(const float *restrict x, const void *restrict wv_, const float *restrict bias, \
                                       float *restrict y, long N, long K, const void *next_)               \
    {                                                                                                      \
        const W *w = wv_, *next = next_;                                                                   \
        vf acc[NR][MR];                                                                                    \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) acc[i][j] = (vf){0};                                              \
        const long kv = K - K % VL;                                                                        \
        for (long k = 0; k < kv; k += VL) {                                                                \
            vf xv[MR];                                                                                     \
            for (int j = 0; j < MR; j++) xv[j] = load_f32(x + j * K + k);                                  \
            if (next && !(k & (64 / sizeof(W) - 1)))                                                       \
                for (int i = 0; i < NR; i++) __builtin_prefetch(next + i * K + k, 0, 3);                   \
            for (int i = 0; i < NR; i++) {                                                                 \
                vf wv = load_##T(w + i * K + k);                                                           \
                KEEP_IN_REGISTER(wv);                                                                      \
                for (int j = 0; j < MR; j++) acc[i][j] += wv * xv[j];                                      \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) {                                                                 \
                float s = reduce_tree(acc[i][j]);                                                          \
                for (long k = kv; k < K; k++) s += one_##T(w + i * K + k) * x[j * K + k];                  \
                y[j * N + i] = bias ? s + bias[i] : s;                                                     \
            }                                                                                              \
    }

#define DEFTILES(T, W)                                                                                     \
    DEFTILE(T, W, 1, 1)                                                                                    \
    DEFTILE(T, W, 4, 1) DEFTILE(T, W, 4, 2) DEFTILE(T, W, 4, 3)                                            \
    DEFTILE(T, W, 6, 1) DEFTILE(T, W, 6, 2) DEFTILE(T, W, 6, 3) DEFTILE(T, W, 6, 4)                        \
    DEFTILE(T, W, 8, 1) DEFTILE(T, W, 8, 2) DEFTILE(T, W, 8, 3)

DEFTILES(f32, float)
DEFTILES(bf16, uint16_t)
DEFTILES(f16, _Float16)

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* bfloat16 weights and rows of x multiplied in pairs by the CPU (AVX512-BF16 ``vdpbf16ps``: two
 * exact products added to each float32 lane, in a fixed order): no widening, twice the products per
 * instruction. The same instruction sequence for every output whatever the other rows, like the
 * tiles above; x is bfloat16 here (it is so in a bfloat16 forward). */
#define DEFTILE_DP(NR, MR)                                                                                 \
    static void tile_dp_##NR##_##MR(const float *restrict x_, const void *restrict wv_, const float *restrict bias, \
                                    float *restrict y, long N, long K, const void *next_) \
    {                                                                                                      \
        const uint16_t *x = (const uint16_t *)x_, *w = wv_, *next = next_;                                 \
        __m512 acc[NR][MR];                                                                                \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) acc[i][j] = _mm512_setzero_ps();                                  \
        const long kv = K - K % 32;                                                                        \
        for (long k = 0; k < kv; k += 32) {                                                                \
            __m512bh xv[MR];                                                                               \
            for (int j = 0; j < MR; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * K + k);              \
            if (next)                                                                                      \
                for (int i = 0; i < NR; i++) __builtin_prefetch(next + i * K + k, 0, 3);                   \
            for (int i = 0; i < NR; i++) {                                                                 \
                __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i * K + k);                                  \
                for (int j = 0; j < MR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);           \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < NR; i++)                                                                       \
            for (int j = 0; j < MR; j++) {                                                                 \
                vf a;                                                                                      \
                memcpy(&a, &acc[i][j], sizeof a);                                                          \
                float s = reduce_tree(a);                                                                  \
                for (long k = kv; k < K; k++) s += one_bf16(w + i * K + k) * one_bf16(x + j * K + k);             \
                y[j * N + i] = bias ? s + bias[i] : s;                                                     \
            }                                                                                              \
    }
DEFTILE_DP(1, 1)
DEFTILE_DP(6, 1) DEFTILE_DP(6, 2) DEFTILE_DP(6, 3) DEFTILE_DP(6, 4)
DEFTILE_DP(8, 1) DEFTILE_DP(8, 2) DEFTILE_DP(8, 3)
#define HAVE_DP 1
#else
#define HAVE_DP 0
#endif

enum { BF16_PAIRS = 3 }; /* beside F32, BF16, F16 (native_vec.h) */

struct variant {
    int nr, mr, type, esize;
    tile_fn one;      /* one weight row against one x row: a weight's last rows when NR does not divide */
    tile_fn tiles[5]; /* tiles[r]: r rows of x (1..mr) */
    tile_fn wide[5];  /* the float32 tiles of the same shape, for a half-width weight tile widened once */
};

/* tiles[] of each tile shape NR x MR (slots 1..MR), for weight type T. */
#define TILES_4_3(T) {0, tile_##T##_4_1, tile_##T##_4_2, tile_##T##_4_3, 0}
#define TILES_6_2(T) {0, tile_##T##_6_1, tile_##T##_6_2, 0, 0}
#define TILES_6_4(T) {0, tile_##T##_6_1, tile_##T##_6_2, tile_##T##_6_3, tile_##T##_6_4}
#define TILES_8_3(T) {0, tile_##T##_8_1, tile_##T##_8_2, tile_##T##_8_3, 0}
#define VARIANT(T, CODE, ES, NR, MR) {NR, MR, CODE, ES, tile_##T##_1_1, TILES_##NR##_##MR(T), TILES_##NR##_##MR(f32)},
#define VARIANTS_OF(T, CODE, ES)                                                                           \
    VARIANT(T, CODE, ES, 4, 3) VARIANT(T, CODE, ES, 6, 2) VARIANT(T, CODE, ES, 6, 4) VARIANT(T, CODE, ES, 8, 3)

static const struct variant VARIANTS[] = {
    VARIANTS_OF(f32, F32, 4) VARIANTS_OF(bf16, BF16, 2) VARIANTS_OF(f16, F16, 2)
#if HAVE_DP
    {6, 4, BF16_PAIRS, 2, tile_dp_1_1, TILES_6_4(dp), {0}},
    {8, 3, BF16_PAIRS, 2, tile_dp_1_1, TILES_8_3(dp), {0}},
#endif
};

/* Whether this build multiplies bfloat16 pairs natively (type BF16_PAIRS). */
int racer_bf16_pairs(void) { return HAVE_DP; }

/* ``n`` half-width values from w on, as float32, into buf: exactly the values a tile's loads widen
 * them to. ``next`` (or NULL): the weight's next tile, prefetched line by line meanwhile. */
static void widen(const void *w, int type, long n, float *restrict buf, const char *next)
{
    const long nv = n - n % VL;
    for (long d = 0; d < nv; d += VL) {
        if (next && !(d & (32 - 1))) __builtin_prefetch(next + 2 * d, 0, 3); /* 32 values: one line */
        vf v = load_as_f32(w, d, type);
        memcpy(buf + d, &v, sizeof v);
    }
    for (long d = nv; d < n; d++)
        buf[d] = type == BF16 ? one_bf16((const uint16_t *)w + d) : one_f16((const _Float16 *)w + d);
}

/* The calling thread's scratch of at least ``n`` floats (kept for its later calls), or NULL. */
static float *scratch(long n)
{
    static __thread float *buf;
    static __thread long cap;
    if (n > cap) {
        free(buf);
        buf = malloc(n * sizeof *buf);
        cap = buf ? n : 0;
    }
    return buf;
}

/* Weight rows [n0, n0 + NR) against M rows of x (``xs`` bytes a value), one tile call per MR rows.
 * Given ``buf``, a half-width tile that more than one pass meets is widened into it once and the
 * passes run the float32 tile on it: the same FMAs on the same values, so the same bits, without
 * widening the weight again on every pass. */
static void block(const struct variant *v, const char *x, long xs, const char *w, const float *bias, float *y,
                  long M, long N, long K, long n0, float *buf)
{
    const long es = v->esize;
    if (n0 + v->nr > N) { /* the last rows of a weight whose row count NR does not divide */
        for (long n = n0; n < N; n++)
            for (long m = 0; m < M; m++)
                v->one((const float *)(x + m * K * xs), w + n * K * es, bias ? bias + n : NULL, y + m * N + n, N, K, NULL);
        return;
    }
    const char *wt = w + n0 * K * es, *next = n0 + 2 * v->nr <= N ? wt + v->nr * K * es : NULL;
    const tile_fn *tiles = v->tiles;
    if (buf && M > v->mr) {
        widen(wt, v->type, v->nr * K, buf, next);
        wt = (const char *)buf, tiles = v->wide, next = NULL;
    }
    for (long m0 = 0; m0 < M; m0 += v->mr) {
        long r = M - m0 < v->mr ? M - m0 : v->mr;
        tiles[r]((const float *)(x + m0 * K * xs), wt, bias ? bias + n0 : NULL, y + m0 * N + n0, N, K, next);
    }
}

int racer_vector_bits(void) { return VL * 32; }

/* ``bytes`` from p on written back and dropped from every cache level (where the CPU has a flush
 * instruction; else nothing): the next read of them comes from memory, as a forward's read of a
 * weight does, the layers between having streamed everything else through the caches. */
void racer_flush(const void *p, long bytes)
{
#if defined(__x86_64__) || defined(__i386__)
    for (long i = 0; i < bytes; i += 64) __builtin_ia32_clflush((const char *)p + i);
    if (bytes > 0) __builtin_ia32_clflush((const char *)p + bytes - 1);
    __builtin_ia32_mfence();
#else
    (void)p, (void)bytes;
#endif
}

enum { X_BLOCK_BYTES = 256 << 10 }; /* rows of x a weight tile meets per pass over the weight: L2-resident */

static const struct variant *find_variant(int nr, int mr, int type)
{
    for (size_t i = 0; i < sizeof VARIANTS / sizeof VARIANTS[0]; i++)
        if (VARIANTS[i].nr == nr && VARIANTS[i].mr == mr && VARIANTS[i].type == type) return &VARIANTS[i];
    return NULL;
}

static long gcd(long a, long b) { return b ? gcd(b, a % b) : a; }

enum { MAX_WEIGHTS = 8 };

/* One racer_linear_many call over one block of x's rows, as its tiles read it. */
struct linear_call {
    const struct variant *const *v;
    const long *first;
    long xs;
    const void *const *w;
    const float *const *bias;
    float *const *y;
    const int64_t *N;
    long K, widest, m0, m;
    const char *x;
};

/* Weight tiles [lo, hi), counted across the call's weights. */
static void linear_body(void *ctx, long lo, long hi, int tid)
{
    const struct linear_call *c = ctx;
    float *buf = c->widest ? scratch(c->widest) : NULL;
    (void)tid;
    for (long b = lo; b < hi; b++) {
        int i = 0;
        while (b >= c->first[i + 1]) i++;
        block(c->v[i], c->x, c->xs, c->w[i], c->bias[i], c->y[i] + c->m0 * c->N[i], c->m, c->N[i], c->K,
              (b - c->first[i]) * c->v[i]->nr, buf);
    }
}

/* ``count`` weights against the same rows of x, in one parallel loop (the weights' tiles shared
 * out among the threads as one list): y[i][M, N[i]] = x[M, K] @ w[i][N[i], K]^T (+ bias[i]), weight i
 * by the tile shape tiles[2i] x tiles[2i + 1]. Each output is computed exactly as racer_linear
 * computes it alone. 0, or -1 for a tile shape or weight type this build does not have. */
int racer_linear_many(int count, const int64_t *tiles, int type, const float *x, const void *const *w,
                      const float *const *bias, float *const *y, const int64_t *N, long M, long K, int threads)
{
    const struct variant *v[MAX_WEIGHTS];
    long first[MAX_WEIGHTS + 1] = {0}, step = 1, widest = 0;
    if (count < 1 || count > MAX_WEIGHTS) return -1;
    for (int i = 0; i < count; i++) {
        if (!(v[i] = find_variant((int)tiles[2 * i], (int)tiles[2 * i + 1], type))) return -1;
        first[i + 1] = first[i] + (N[i] + v[i]->nr - 1) / v[i]->nr;
        step = step / gcd(step, v[i]->mr) * v[i]->mr; /* a row block holds whole passes of every tile */
        widest = v[i]->nr * K > widest && M > v[i]->mr ? v[i]->nr * K : widest;
    }
    const long xs = type == BF16_PAIRS ? 2 : 4;
    long mb = X_BLOCK_BYTES / (K * xs) / step * step;
    mb = mb < step ? step : mb;
    const int wide = (type == BF16 || type == F16) && widest;
    const int nth = threads > 0 ? threads : 1;
    struct linear_call c = {v, first, xs, w, bias, y, N, K, wide ? widest : 0};
    for (c.m0 = 0; c.m0 < M; c.m0 += mb) {
        c.m = M - c.m0 < mb ? M - c.m0 : mb;
        c.x = (const char *)x + c.m0 * K * xs;
        racer_pfor(first[count], (first[count] + nth - 1) / nth, nth, linear_body, &c);
    }
    return 0;
}

/* 0, or -1 for a tile shape or weight type this build does not have.
 * ``type``: the weight's (0 float32, 1 bfloat16, 2 float16; x, bias and y float32), or 3: bfloat16
 * weight and x multiplied in pairs (bias and y float32). Many rows of x are taken in blocks that stay
 * in the L2 cache while the weight streams past them; no split over K, so blocking never changes a
 * row's FMAs. */
int racer_linear(int nr, int mr, int type, const float *x, const void *w, const float *bias, float *y, long M, long N,
                 long K, int threads)
{
    const int64_t tiles[2] = {nr, mr}, n = N;
    return racer_linear_many(1, tiles, type, x, &w, &bias, &y, &n, M, K, threads);
}
